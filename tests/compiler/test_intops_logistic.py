"""Integer sigmoid and tanh (rdakit.compiler.intops.logistic_ref): accuracy against float over
every int8 and int16 input, the kernel over every value of its working input, exact symmetry,
no int32 overflow for any input (hypothesis), the op kinds in the IR, and the lowering bit-exact
on the functional interpreter for 1, 4 and 16 lanes."""

import re

import numpy as np
import pytest
from conftest import hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.compiler import intops
from rdakit.compiler.graph import DataflowGraph, GraphError

FLOAT = {"sigmoid": lambda v: 0.5 + 0.5 * np.tanh(v / 2), "tanh": np.tanh}
PARAMS = {"sigmoid": intops.sigmoid_params, "tanh": intops.tanh_params}

#: Largest absolute error against the float function over every int8 and int16 input, as
#: measured (docs/import.md): i-exp's relative error (0.3 %) shrunk by e / (1 + e)^2 <= 1/4,
#: the quadratic's 1/99 squared by the Newton step (1e-4) and the Q15 steps; tanh's is twice
#: sigmoid's (2 y - 1).
BOUND = {"sigmoid": 0.00088, "tanh": 0.00175}

KINDS = pytest.mark.parametrize("kind", ["sigmoid", "tanh"])


def error(kind, x, scale):
    p = PARAMS[kind](scale)
    y = intops.logistic_ref(kind, x, p)
    assert y.dtype == np.int32
    return np.abs(y * intops.output_scale(kind, p) - FLOAT[kind](x * scale)).max()


@KINDS
def test_every_int8_and_int16_input_is_within_the_bound(kind):
    """Every int8 value at the scales of calibrated activations, every int16 value at three
    scales: the int16 ones reach far into saturation (x up to 3,277 at 0.1)."""
    worst = 0
    for scale in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5):
        worst = max(worst, error(kind, np.arange(-128, 128, dtype=np.int8), scale))
    for scale in (1e-4, 0.002, 0.1):
        worst = max(worst, error(kind, np.arange(-32768, 32768).astype(np.int16), scale))
    assert worst <= BOUND[kind]
    assert worst > BOUND[kind] / 2           # the bound is the measured error, not a loose one


def test_the_kernel_over_every_working_input():
    """Every ``u`` from 0 to EXP_U_MAX (|x| in i-exp's working scale, where the kernel's
    arithmetic starts): no intermediate leaves int32 (the reference asserts it), ``y - 1/2``
    is monotone, 0 at u = 0 and within the bound of ``1 / (1 + exp(-u S_w)) - 1/2``."""
    u = np.arange(intops.EXP_U_MAX + 1)
    w = intops.logistic_of_u(u)
    assert w[0] == 0 and np.all(np.diff(w) >= 0)
    want = 1 / (1 + np.exp(-u * intops.EXP_SW)) - 0.5
    assert np.abs(w * 2.0 ** -intops.SIG_BITS - want).max() <= 0.00072


@KINDS
def test_odd_symmetry_is_exact(kind):
    """sigmoid(-x) = 1 - sigmoid(x) and tanh(-x) = -tanh(x) bit for bit; 1/2 and 0 at 0."""
    x = np.arange(-127, 128, dtype=np.int8)
    p = PARAMS[kind](0.05)
    y = intops.logistic_ref(kind, x, p).astype(np.int64)
    mid = (1 << 14) if kind == "sigmoid" else 0
    np.testing.assert_array_equal(y + y[::-1], 2 * mid)
    assert y[127] == mid


@hostile(60)
@given(st.sampled_from(["int8", "int16", "int32"]).flatmap(
    lambda d: st.lists(st.integers(np.iinfo(d).min, np.iinfo(d).max), min_size=1,
                       max_size=40).map(lambda v: np.array(v, dtype=d))),
       st.floats(1e-4, 4.0), st.sampled_from(["sigmoid", "tanh"]))
def test_any_input_saturates_and_never_wraps(x, scale, kind):
    """Any input of any dtype at any scale: no intermediate leaves int32, the result is that
    of the input saturated to [-clip, clip] and within the bound of the float function there,
    and it stays in [0, 1] (sigmoid) or [-1, 1] (tanh)."""
    p = PARAMS[kind](scale)
    xs = np.clip(x.astype(np.int64), -p["clip"], p["clip"])
    y = intops.logistic_ref(kind, x, p)
    np.testing.assert_array_equal(y, intops.logistic_ref(kind, xs, p))
    real = y * intops.output_scale(kind, p)
    assert real.min() >= (0 if kind == "sigmoid" else -1) and real.max() <= 1
    assert np.abs(real - FLOAT[kind](xs * scale)).max() <= BOUND[kind] + 1e-9


# --- the op kinds in the IR ------------------------------------------------------------------

def graph_of(kind, attrs, dtype="int8"):
    g = DataflowGraph("g")
    g.output("y", g.add(kind, g.input("x", (2, 3, 4), dtype), name="n", **attrs))
    return g


@KINDS
def test_types_and_scales(kind):
    g = graph_of(kind, PARAMS[kind](0.1), "int16").validate()
    assert str(g.type_of("n")) == "int32[2, 3, 4]"
    assert intops.output_scale(kind, {}) == {"sigmoid": 2.0 ** -15, "tanh": 2.0 ** -14}[kind]


@pytest.mark.parametrize("kind,attrs,message", [
    ("sigmoid", {}, "Node 'n' (sigmoid): attribute 'mult' must be an integer between 1 and "
                    "2147483647, not None"),
    ("tanh", dict(mult=1000, shift=0, clip=1000),
     "Node 'n' (tanh): attributes (clip * mult) >> shift must be at most 32767, not "
     "(1000 * 1000) >> 0"),
    ("sigmoid", dict(mult=1 << 20, shift=4, clip=1 << 12),
     "Node 'n' (sigmoid): attributes clip * mult must be below 2**31, not 4096 * 1048576"),
])
def test_bad_attributes_are_refused_naming_the_node(kind, attrs, message):
    with pytest.raises(GraphError, match=f"^{re.escape(message)}$"):
        graph_of(kind, attrs).validate()


def test_bad_scales_are_refused():
    with pytest.raises(ValueError, match="^input_scale must be a positive finite number, "
                                         "not -1$"):
        intops.tanh_params(-1)


# --- lowered onto the CUs: bit-exact on the functional interpreter ----------------------------

def logistic_graph(rows, cols, dtype):
    """sigmoid and tanh of ``x`` (``rows x cols``) and of a dynamic ``xd``: the graph of the
    interpreter tests and of the RTL test (tests/sim/test_logistic_rtl.py)."""
    s = 0.1 if dtype == "int8" else 0.004 if dtype == "int16" else 1e-4
    g = DataflowGraph(f"logistic_{rows}x{cols}_{dtype}")
    x = g.input("x", (rows, cols), dtype)
    xd = g.input("xd", (rows + 1, cols), dtype, dynamic=True, expected_rows=rows / 2)
    for kind in ("sigmoid", "tanh"):
        g.output(f"o_{kind}", g.add(kind, x, name=kind, **PARAMS[kind](s)))
        g.output(f"o_{kind}_d", g.add(kind, xd, name=f"{kind}_d", **PARAMS[kind](s)))
    return g.validate()


@pytest.mark.parametrize("lanes", [1, 4, 16])
@pytest.mark.parametrize("dtype", ["int8", "int16", "int32"])
def test_lowered_sigmoid_and_tanh_are_bit_exact_on_the_interpreter(lanes, dtype):
    """Odd shapes (padding lanes: sigmoid's 0 is 1/2, masked), the extremes of the dtype, a
    dynamic input with fewer rows than its bound; in chunks when the local buffer is small
    (64 words, 1 lane)."""
    from test_intops import intops_inputs, run_interp

    from rdakit.hdl.spec.params import fabric_params
    g = logistic_graph(3, 7 if lanes < 16 else 21, dtype)
    params = fabric_params(2, 2, prog_len=4096, lanes=lanes, local_words=64 if lanes == 1
                           else 256)
    inputs = intops_inputs(g, lanes, dynamic_rows=2)
    _, got = run_interp(g, params, inputs, seed=lanes)
    want = g.evaluate(inputs)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
