"""The dataflow-graph IR: building, validation errors (exact messages), integer semantics."""

import re

import numpy as np
import pytest

from rdakit.compiler.graph import OP_KINDS, DataflowGraph, GraphError, TensorType


def small():
    g = DataflowGraph("small")
    x = g.input("x", (2, 3), "int8")
    w = g.const("w", np.ones((3, 4), dtype=np.int8))
    y = g.add("matmul", x, w, name="mm")
    g.output("y", g.add("relu", y, name="r"))
    return g


def test_types_and_edge_bytes():
    g = small().validate()
    assert g.type_of("mm") == TensorType((2, 4), "int32")
    assert g.type_of("x").nbytes == 6
    assert g.nx.edges["mm", "r"]["bytes"] == 2 * 4 * 4
    assert g.nx.edges["w", "mm"]["bytes"] == 12
    assert g.order() == ["x", "w", "mm", "r", "y"]
    assert g.inputs == ["x"] and g.outputs == ["y"]
    assert str(g.type_of("mm")) == "int32[2, 4]"


def test_same_tensor_read_twice_is_one_edge():
    g = DataflowGraph("sq")
    x = g.input("x", (4,), "int32")
    g.output("y", g.add("mul", x, x, name="sq"))
    g.validate()
    assert g.nx.number_of_edges() == 2
    assert g.inputs_of("sq") == ("x", "x")
    out = g.evaluate({"x": np.array([1, -2, 3, 65536], dtype=np.int32)})["y"]
    assert out.tolist() == [1, 4, 9, 0]  # 2**32 wraps to 0


# --- validation errors, with their exact messages --------------------------------------------

def expect(g, message):
    with pytest.raises(GraphError, match=f"^{re.escape(message)}$"):
        g.validate()


def test_unknown_kind():
    g = DataflowGraph("g")
    x = g.input("x", (2,))
    g.add("frobnicate", x, name="s")
    expect(g, "Op kind of node 's' must be one of " + ", ".join(sorted(OP_KINDS))
           + ", not 'frobnicate'")


def test_dangling_input():
    g = DataflowGraph("g")
    x = g.input("x", (2,))
    g.add("add", x, "ghost", name="a")
    expect(g, "Node 'a' reads from 'ghost', which is not a node of graph 'g'")


def test_cycle():
    g = DataflowGraph("g")
    x = g.input("x", (2,), "int32")
    g.add("add", x, "c", name="b")
    g.add("relu", "b", name="c")
    expect(g, "Graph 'g' must be acyclic, but has the cycle b -> c -> b")


def test_shape_mismatch_matmul():
    g = DataflowGraph("g")
    a = g.input("a", (2, 3))
    b = g.input("b", (4, 5))
    g.add("matmul", a, b, name="mm")
    expect(g, "Node 'mm' (matmul): inner dimensions must match, not (2, 3) @ (4, 5)")


def test_shape_mismatch_broadcast():
    g = DataflowGraph("g")
    a = g.input("a", (2, 3))
    b = g.input("b", (4,))
    g.add("add", a, b, name="s")
    expect(g, "Node 's' (add): input shapes (2, 3) and (4,) do not broadcast")


def test_wrong_arity():
    g = DataflowGraph("g")
    a = g.input("a", (2,))
    g.add("relu", a, a, name="r")
    expect(g, "Node 'r' (relu) must have 1 input, not 2")


def test_bad_dtype():
    g = DataflowGraph("g")
    g.input("a", (2,), "float32")
    expect(g, "Node 'a' (input): dtype must be one of int8, int16, int32, not 'float32'")


def test_bad_const():
    g = DataflowGraph("g")
    g.const("c", np.zeros(3, dtype=np.float64))
    expect(g, "Node 'c' (const): dtype must be one of int8, int16, int32, not 'float64'")


def test_bad_attribute():
    g = DataflowGraph("g")
    a = g.input("a", (2, 5))
    g.add("topk", a, name="t", k=6)
    expect(g, "Node 't' (topk): attribute 'k' must be an integer between 1 and 5, not 6")


def test_clip_bounds():
    g = DataflowGraph("g")
    a = g.input("a", (2,), "int32")
    g.add("clip", a, name="c", lo=0, hi=300)
    expect(g, "Node 'c' (clip): bounds must satisfy -128 <= lo <= hi <= 127, not lo=0, hi=300")


def test_concat_mismatch():
    g = DataflowGraph("g")
    a = g.input("a", (2, 3))
    b = g.input("b", (3, 3))
    g.add("concat", a, b, name="c", axis=1)
    expect(g, "Node 'c' (concat): inputs must agree in dtype and in every dimension but 1, "
              "not int8[2, 3] and int8[3, 3]")


def test_transpose_of_dynamic_rows():
    g = DataflowGraph("g")
    a = g.input("a", (8, 3), dynamic=True, expected_rows=2)
    g.add("transpose", a, name="t")
    expect(g, "Node 't' (transpose): input must not have run-time rows")


def test_duplicate_name():
    g = DataflowGraph("g")
    g.input("a", (2,))
    with pytest.raises(ValueError, match="^Node name 'a' is already used in graph 'g'$"):
        g.input("a", (3,))


def test_builder_type_errors():
    with pytest.raises(TypeError, match="^Graph name must be a non-empty string, not ''$"):
        DataflowGraph("")
    g = DataflowGraph("g")
    with pytest.raises(TypeError, match="^Op kind must be a string, not 3$"):
        g.add(3)
    with pytest.raises(TypeError, match="^Inputs of node 'r' must be node names, not 1$"):
        g.add("relu", 1, name="r")


def test_evaluate_input_errors():
    g = small()
    with pytest.raises(GraphError, match="^Input 'x' of graph 'small' has no value$"):
        g.evaluate({})
    with pytest.raises(GraphError, match="^Graph 'small' has no input 'z'$"):
        g.evaluate({"x": np.zeros((2, 3), np.int8), "z": 1})
    with pytest.raises(GraphError, match=re.escape("Input 'x' must have shape int8[2, 3], "
                                                   "not (3, 3)")):
        g.evaluate({"x": np.zeros((3, 3), np.int8)})
    with pytest.raises(GraphError, match="^Input 'x' must have dtype int8, not int32$"):
        g.evaluate({"x": np.zeros((2, 3), np.int32)})


# --- integer semantics -----------------------------------------------------------------------

def evaluate(kind, *values, **attrs):
    g = DataflowGraph("e")
    names = [g.input(f"i{j}", v.shape, v.dtype.name) for j, v in enumerate(values)]
    g.output("out", g.add(kind, *names, name="op", **attrs))
    return g.evaluate({f"i{j}": v for j, v in enumerate(values)})["out"]


def test_int32_wraparound_and_shifts():
    big = np.array([2**31 - 1, -(2**31)], dtype=np.int32)
    one = np.array([1, -1], dtype=np.int32)
    assert evaluate("add", big, one).tolist() == [-(2**31), 2**31 - 1]
    assert evaluate("shl", big, shift=1).tolist() == [-2, 0]
    assert evaluate("shr", np.array([-7, 7], dtype=np.int32), shift=1).tolist() == [-4, 3]
    a = np.array([[100, 100]], dtype=np.int8)
    assert evaluate("matmul", a, np.array([[100], [100]], dtype=np.int8)).tolist() == [[20000]]
    assert evaluate("clip", np.array([300, -300, 5], dtype=np.int32)).tolist() == [127, -128, 5]
    assert evaluate("clip", np.array([300], dtype=np.int32), dtype="int16").dtype == np.int16


def test_matmul_accumulates_with_wraparound():
    a = np.full((1, 4), 2**30, dtype=np.int32)
    b = np.full((4, 1), 2, dtype=np.int32)
    assert evaluate("matmul", a, b).tolist() == [[0]]  # 8 * 2**30 = 2**33 wraps to 0


def test_topk_ties_to_lower_index():
    x = np.array([[5, 7, 7, 1], [-(2**31), 0, 0, 0]], dtype=np.int32)
    assert evaluate("topk", x, k=2).tolist() == [[1, 2], [1, 2]]


def test_dispatch_and_combine():
    g = DataflowGraph("moe")
    x = g.input("x", (3, 2), "int8")
    idx = g.input("idx", (3, 1), "int32")
    gate = g.input("gate", (3, 1), "int8")
    e0 = g.add("dispatch", x, idx, name="e0", expert=0, experts=2)
    e1 = g.add("dispatch", x, idx, name="e1", expert=1, experts=2)
    g.output("rows1", e1)
    g.output("y", g.add("combine", idx, gate, e0, e1, name="c", shift=1))
    g.validate()
    t = g.type_of("e0")
    assert t.dynamic and t.shape == (3, 2) and t.expected_rows == 1.5
    out = g.evaluate({"x": np.array([[1, 2], [3, 4], [5, 6]], np.int8),
                      "idx": np.array([[1], [0], [1]], np.int32),
                      "gate": np.array([[2], [4], [-2]], np.int8)})
    assert out["rows1"].tolist() == [[1, 2], [5, 6]]
    assert out["y"].tolist() == [[1, 2], [6, 8], [-5, -6]]


def test_op_table_is_complete():
    for kind, spec in OP_KINDS.items():
        assert spec.kind == kind and spec.doc
        assert spec.memory == (kind in ("input", "const", "output"))
