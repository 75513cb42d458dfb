"""top-k, take, reductions over rows and matmul on rows longer than the CU's local buffer
(issue 20): lowered in chunks or straight from the MU, bit-exact against the IR's numpy
reference on the functional interpreter, and what still does not fit refused by name."""

import numpy as np
import pytest
from conftest import hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.compiler.compile import compile_workload
from rdakit.compiler.graph import DataflowGraph
from rdakit.compiler.lower.layout import LoweringError
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.job import run_job_interp

#: A small local buffer keeps the rows (and the runs) short.
LOCAL = 16
I32 = np.iinfo(np.int32)


def params_of(lanes, local_words=LOCAL):
    return fabric_params(2, 2, prog_len=4096, lanes=lanes, local_words=local_words,
                         mu_words=8192)


def long_graph(rows, cols, k, n, dynamic=False):
    """topk of ``x`` (``rows x cols``), take of its indices, reduce_sum and reduce_max over
    each axis, and ``x @ w`` (``w`` a constant ``cols x n``): every kind of this file on one
    input."""
    rng = np.random.default_rng(cols * 7 + n)
    g = DataflowGraph(f"long_{rows}x{cols}")
    x = g.input("x", (rows, cols), "int32", dynamic=dynamic,
                **({"expected_rows": rows / 2} if dynamic else {}))
    w = g.const("w", rng.integers(-128, 128, (cols, n)).astype(np.int8))
    idx = g.add("topk", x, name="tk", k=k)
    g.output("o_tk", idx)
    g.output("o_take", g.add("take", x, idx, name="tv"))
    for kind in ("reduce_sum", "reduce_max"):
        for axis in ((1,) if dynamic else (0, 1)):
            g.output(f"o_{kind}{axis}", g.add(kind, x, name=f"{kind}{axis}", axis=axis))
    g.output("o_mm", g.add("matmul", x, w, name="mm"))
    return g.validate()


def run(g, lanes, inputs, local_words=LOCAL, seed=0):
    job, _ = compile_workload(g, params=params_of(lanes, local_words),
                              partitioner="round_robin", place_steps=20)
    job = job.with_inputs(inputs)
    outputs, result, _ = run_job_interp(job, schedule="random", seed=seed)
    assert result.ok, result.errors
    return job, job.decode(outputs, check_padding=True)


def assert_exact(g, lanes, inputs, **kw):
    _, got = run(g, lanes, inputs, **kw)
    want = g.evaluate(inputs)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@st.composite
def cases(draw):
    lanes = draw(st.sampled_from([1, 4, 16]))
    # One word longer than the local buffer, or several times longer, with or without
    # padding lanes in the last word.
    words = draw(st.sampled_from([LOCAL + 1, LOCAL + 2, 3 * LOCAL + 1, 5 * LOCAL]))
    cols = words * lanes - draw(st.integers(0, lanes - 1))
    rows = draw(st.integers(1, 3))
    k = draw(st.integers(1, min(cols, 6)))
    n = draw(st.integers(1, 3 * lanes))
    # Values from a few (ties everywhere, across words and chunks) or from the extremes.
    pool = draw(st.sampled_from([[-1, 0, 1], [I32.min, I32.max, 0, -1, I32.min + 1],
                                 None]))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    x = (rng.choice(pool, (rows, cols)) if pool is not None
         else rng.integers(I32.min, I32.max, (rows, cols), endpoint=True))
    return lanes, k, n, x.astype(np.int32), seed


@hostile(25)
@given(cases())
def test_long_rows_are_bit_exact_against_the_reference(case):
    """Random lanes, row lengths, k, values (extremes and many ties): every kind equals its
    numpy reference."""
    lanes, k, n, x, seed = case
    g = long_graph(x.shape[0], x.shape[1], k, n)
    assert_exact(g, lanes, {"x": x}, seed=seed)


@pytest.mark.parametrize("lanes", [1, 4, 16])
def test_ties_across_words_and_chunks_keep_the_lower_index(lanes):
    """Equal largest values on both sides of a word boundary (the last lane of one word, the
    first of the next: the parts top-k searches before and after the index it found last) and
    in the last word beside its padding lanes; a row of INT_MAX ties; a row all INT_MIN but
    one: top-k takes them in index order (an argmax, k = 1, the first), the other kinds stay
    exact."""
    cols = (LOCAL + 3) * lanes - (lanes > 1)
    x = np.full((3, cols), -5, np.int32)
    x[0, [LOCAL * lanes - 1, LOCAL * lanes, cols - 1]] = 7
    x[1, [0, cols - 1]] = I32.max
    x[1, 1:4] = I32.max - 1
    x[2, :] = I32.min
    x[2, cols // 2] = I32.min + 1
    for k in (1, 3, 6):
        assert_exact(long_graph(3, cols, k, 2 * lanes + 1), lanes, {"x": x})


def test_dynamic_rows():
    """A run-time number of rows (two of three, and none)."""
    g = long_graph(3, 4 * (LOCAL + 1) - 1, 3, 5, dynamic=True)
    rng = np.random.default_rng(1)
    for rows in (2, 0):
        x = rng.integers(-50, 50, (rows, 4 * (LOCAL + 1) - 1)).astype(np.int32)
        assert_exact(g, 4, {"x": x})


def test_the_long_forms_start_past_the_local_buffer():
    """A row of the free local buffer's length takes the row form, one word more the long
    forms (longer programs). (That the row form's programs are unchanged was checked against
    the lowering before the long forms, on these graphs and the built-in workloads.)"""
    g = long_graph(2, 4 * LOCAL, 2, 5)
    short, _ = compile_workload(g, params=params_of(4), partitioner="round_robin",
                                place_steps=20)
    lengths = {name: end - start for name, _, _, start, end in
               next(iter(short.programs.values())).ops}
    long, _ = compile_workload(long_graph(2, 4 * LOCAL + 1, 2, 5), params=params_of(4),
                               partitioner="round_robin", place_steps=20)
    longer = {name: end - start for name, _, _, start, end in
              next(iter(long.programs.values())).ops}
    assert longer["tk"] > lengths["tk"] and longer["mm"] > lengths["mm"]


def compile_error(g, lanes=4, local_words=LOCAL):
    with pytest.raises(LoweringError) as err:
        compile_workload(g, params=params_of(lanes, local_words), partitioner="round_robin",
                         place_steps=20)
    return str(err.value)


def test_what_still_does_not_fit_is_refused_by_name():
    """top-k keeps its k indices and values in the local buffer: more than it holds is refused,
    naming the node and k. (A long-K matmul needs two words: tests/compiler/test_lower.py.)"""
    g = DataflowGraph("big_k")
    g.output("o", g.add("topk", g.input("x", (1, 4 * 40), "int32"), name="tk", k=30))
    assert compile_error(g.validate()) == (
        "Node 'tk' (topk) needs 17 words of the local buffer (a row of 160 elements is "
        "longer than it: one word and the k = 30 indices and values found) but CU (0, 0) has "
        "16 (local_words = 16, 0 taken by constants)")


@pytest.mark.parametrize("lanes,local_words", [(16, 2), (4, 4), (4, 2), (1, 2)])
def test_product_columns_in_blocks_smaller_than_a_word(lanes, local_words):
    """A tiny local buffer: the product's columns accumulate a few at a time (1 or 2 words,
    fewer than a word of the product has lanes), still bit-exact."""
    rng = np.random.default_rng(lanes)
    cols = lanes * 3 - 1
    g = DataflowGraph("mm")
    w = g.const("w", rng.integers(-128, 128, (cols, 2 * lanes + 3)).astype(np.int8))
    g.output("o", g.add("matmul", g.input("x", (2, cols), "int32"), w, name="mm"))
    g.validate()
    assert_exact(g, lanes, {"x": rng.integers(-9, 9, (2, cols)).astype(np.int32)},
                 local_words=local_words)
