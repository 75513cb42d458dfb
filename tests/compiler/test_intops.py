"""Integer non-linear ops (I-BERT style, rdakit.compiler.intops): accuracy of each reference
against the float function on dequantized inputs, no int32 overflow for any input of the dtype
(hypothesis), the op kinds in the IR (types, attribute checks with their exact messages), and
the lowering of each kind bit-exact on the functional interpreter."""

import math
import re

import numpy as np
import pytest
from conftest import hostile
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from rdakit.compiler import intops
from rdakit.compiler.graph import DataflowGraph, GraphError

RNG = np.random.default_rng(20)
ERF = np.vectorize(math.erf, otypes=[float])


def float_gelu(v):
    """``v Phi(v)``: erf by math.erf where it is not yet +-1 (|v| < 9) in float64."""
    v = np.asarray(v, dtype=np.float64)
    e = np.sign(v)
    near = np.abs(v) < 9
    e[near] = ERF(v[near] / math.sqrt(2))
    return v * 0.5 * (1 + e)


FLOAT = {
    "exp": lambda v: np.exp(np.minimum(v, 0)),
    "gelu": float_gelu,
    "silu": lambda v: v * 0.5 * (1 + np.tanh(v / 2)),
}
PARAMS = {"exp": intops.exp_params, "gelu": intops.gelu_params, "silu": intops.silu_params}
REFS = {"exp": intops.exp_ref, "gelu": intops.gelu_ref, "silu": intops.silu_ref}

#: Largest absolute error against the float function over every int8 value at scales 0.02-0.2,
#: as measured (docs/compiler.md): the kernel's own error (KERNEL) and half a step of the
#: working scale. Wider inputs add the requantization's relative error: :func:`bound`.
BOUND = {"exp": 0.0028, "gelu": 0.0183, "silu": 0.0401}

#: The kernels' own error: the largest ``|K(t) - f(t S)|`` over every value ``t`` of the
#: working input (``|t| <= t_max`` of gelu and silu, ``u`` from 0 to ``EXP_U_MAX`` of exp), in
#: the working scale ``S`` (:data:`STEP`); test_the_kernels_over_every_working_input measures it.
KERNEL = {"exp": 0.002239, "gelu": 0.018150, "silu": 0.039677}
STEP = {"exp": intops.EXP_SW, **{k: c / (1 << intops.ACT_BITS)
                                 for k, (_, c) in intops.ACT_POLY.items()}}
_V = np.linspace(0, 10, 1_000_001)
_SIG = 1 / (1 + np.exp(-_V))
#: The largest slope ``|f'|``: GELU's ``Phi(x) + x phi(x)`` at ``x = sqrt 2``; SiLU's
#: ``sigma(x) (1 + x (1 - sigma(x)))`` near 2.4 (on a grid of 1e-5).
SLOPE = {"gelu": 0.5 * (1 + math.erf(1)) + math.exp(-1) / math.sqrt(math.pi),
         "silu": float((_SIG * (1 + _V * (1 - _SIG))).max())}


def rel_error(kind, scale, p):
    """``r``: the relative error of the requantization multiplier, ``|mult / (ratio
    2**shift) - 1|`` with ``ratio = scale / S`` (at most ``1 / (2 mult - 1)``)."""
    return abs(p["mult"] / (scale / STEP[kind] * 2.0 ** p["shift"]) - 1)


def bound(kind, scale, p, v):
    """The error bound at each (saturated) input value ``v``. The requantized input ``w``
    (``t S`` or ``u S``) is off ``v`` by ``r |v|`` (the multiplier, :func:`rel_error`) and the
    shift's rounding: half a step ``S / 2`` for gelu and silu (rounded), a step for exp
    (floored). The result is ``K(w)``, within KERNEL of ``f(w)``, and ``|f(w) - f(v)|`` is at
    most ``|w - v|`` times the slope: SLOPE for gelu and silu, ``exp(-min(|w|, |v|))`` for
    exp. So ``KERNEL + SLOPE (S / 2 + r |v|)``, and ``KERNEL + exp(S + r |v| - |v|) (S + r
    |v|)`` for exp (whose ``r |v|`` term is at most about ``r / e``)."""
    a = np.abs(v)
    r, s = rel_error(kind, scale, p), STEP[kind]
    if kind == "exp":
        return KERNEL[kind] + np.exp(s + r * a - a) * (s + r * a)
    return KERNEL[kind] + SLOPE[kind] * (s / 2 + r * a)


def float_softmax(v, keep=None):
    v = np.where(keep, v, -np.inf) if keep is not None else v
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def float_norm(kind, v, w, b, eps):
    if kind == "layer_norm":
        n = (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + eps)
    else:
        n = v / np.sqrt((v * v).mean(-1, keepdims=True) + eps)
    return n * w + (0 if b is None else b)


# --- accuracy against float ------------------------------------------------------------------

@pytest.mark.parametrize("out_bits,bound", [(7, 0.0079), (8, 0.004), (15, 0.001)])
def test_softmax_of_int8_logits_is_within_its_bound(out_bits, bound):
    """Every int8 logit scale a transformer's attention gives (0.05-0.2), short and long rows:
    the probabilities within half a step of 2**-out_bits and i-exp's error (0.0078 at 7 bits:
    a probability of 1 saturates at 127/128)."""
    worst = 0
    for scale in (0.05, 0.1, 0.2):
        for length in (8, 64, 300):
            x = RNG.integers(-128, 128, (32, length)).astype(np.int8)
            p = intops.softmax_params(scale, out_bits)
            y = intops.softmax_ref(x, p)
            assert y.dtype == intops.softmax_dtype(out_bits)
            worst = max(worst, np.abs(y * 2.0 ** -out_bits - float_softmax(x * scale)).max())
    assert worst <= bound


def test_causal_softmax_masks_the_upper_triangle():
    x = RNG.integers(-128, 128, (2, 5, 7)).astype(np.int8)
    p = dict(intops.softmax_params(0.1, 8), causal=2)
    y = intops.softmax_ref(x, p)
    keep = np.arange(7)[None, :] <= np.arange(5)[:, None] + 2
    assert not np.any(y[:, ~keep])
    assert np.abs(y * 2.0 ** -8 - float_softmax(x * 0.1, keep)).max() <= 0.004


def errors(kind, x, scale):
    """``(error, bound)`` of op ``kind`` at each input of ``x`` (saturated to the op's range
    first) at ``scale``."""
    p = PARAMS[kind](scale)
    xs = np.clip(x.astype(np.int64), -p["clip"], p["clip"] if kind != "exp" else 0)
    y = REFS[kind](x, p)
    assert y.dtype == np.int32
    v = xs * scale
    return np.abs(y * intops.output_scale(kind, p) - FLOAT[kind](v)), bound(kind, scale, p, v)


@pytest.mark.parametrize("kind", ["exp", "gelu", "silu"])
def test_the_kernels_over_every_working_input(kind):
    """Every value of the working input (the kernel's arithmetic starts there; for gelu and
    silu ``t`` up to ``t_max``, beyond which ``clip`` saturates): no intermediate leaves int32
    (the reference asserts it), the error against the float function is KERNEL, exactly as
    measured; gelu and silu are ``t S`` and 0 beyond ``c`` (``H`` exactly 1 and 0)."""
    if kind == "exp":
        u = np.arange(intops.EXP_U_MAX + 1)
        err = np.abs(intops.exp_ref(-u, dict(mult=1, shift=0, clip=intops.EXP_U_MAX))
                     * intops.EXP_SCALE - np.exp(-u * STEP[kind]))
    else:
        q_c, _, q, t_max = intops.act_consts(kind)
        t = np.arange(-t_max, t_max + 1)
        y = REFS[kind](t, dict(mult=1, shift=0, clip=t_max)).astype(np.int64)
        np.testing.assert_array_equal(y[t >= q_c], 2 * q * t[t >= q_c])
        assert not y[t <= -q_c].any()
        err = np.abs(y * intops.output_scale(kind, {}) - FLOAT[kind](t * STEP[kind]))
    assert KERNEL[kind] - 1e-6 <= err.max() <= KERNEL[kind]


@pytest.mark.parametrize("kind", ["exp", "gelu", "silu"])
def test_elementwise_ops_are_within_their_bounds(kind):
    """Every int8 value at three scales (within BOUND: the requantization adds at most 128
    steps of the input times ``r``), every third int16 value at 0.002: within :func:`bound`."""
    for scale, x in [(0.02, np.arange(-128, 128, dtype=np.int8)),
                     (0.05, np.arange(-128, 128, dtype=np.int8)),
                     (0.2, np.arange(-128, 128, dtype=np.int8)),
                     (0.002, np.arange(-32768, 32768, 3).astype(np.int16))]:
        err, most = errors(kind, x, scale)
        assert np.all(err <= most), scale
        assert err.max() <= BOUND[kind] or x.dtype != np.int8, (scale, err.max())


#: The scales where an exhaustive scan of every input up to the clip (geometric grids of 400
#: scales from 1e-4 to 4, 200 from 1e-4 to 1e-3 and 300 from 1e-3 to 4) found the error
#: closest to :func:`bound` (within 0.3 %, 0.1 % and 0.05 % of it), among those with a clip
#: under 10**6; and 2**-9, where hypothesis found the old constant bound of gelu false.
WORST = {"exp": [1e-4, 0.00024945], "gelu": [2 ** -9, 0.0022354],
         "silu": [2 ** -9, 0.00242943]}


@pytest.mark.parametrize("kind", ["exp", "gelu", "silu"])
def test_every_input_up_to_the_clip_at_the_worst_scales(kind):
    """Every input from ``-clip`` to ``clip`` (to 0 for exp) at the worst scales, and every
    int16 value at 1e-4: within :func:`bound`, which they reach (to 0.3 %); for gelu and
    silu only with its relative part (the error exceeds the kernel's and half a step)."""
    worst = beyond = 0
    for scale in WORST[kind]:
        p = PARAMS[kind](scale)
        x = np.arange(-p["clip"], p["clip"] + 1 if kind != "exp" else 1)
        err, most = errors(kind, x, scale)
        assert np.all(err <= most), scale
        worst = max(worst, (err / most).max())
        if kind != "exp":
            beyond = max(beyond, err.max() - KERNEL[kind] - SLOPE[kind] * STEP[kind] / 2)
    err, most = errors(kind, np.arange(-32768, 32768), 1e-4)
    assert np.all(err <= most)
    assert worst >= 0.997
    assert beyond > 0 or kind == "exp"


@pytest.mark.parametrize("kind", ["gelu", "silu"])
def test_the_requantization_of_gelu_and_silu_uses_all_of_int32(kind):
    """The rounding requantization ``clip * mult + 2**(shift - 1)`` stays below 2**31 with
    the largest ``shift`` that allows (11: ``(t_max + 1) << 12`` is over 2**31), so ``mult``
    has one bit more than with 2**30 and ``r`` is at most ``1 / (2 mult - 1)``."""
    t_max = intops.act_consts(kind)[3]
    for scale in np.geomspace(1e-4, 4, 50):
        p = PARAMS[kind](float(scale))
        assert p["clip"] * p["mult"] + (1 << p["shift"] >> 1) <= np.iinfo(np.int32).max
        assert (t_max + 1) << (p["shift"] + 1) > 1 << 31, scale
        assert rel_error(kind, float(scale), p) <= 1 / (2 * p["mult"] - 1)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype,scale,spread", [("int8", 0.05, 30), ("int32", 0.001, 20000)])
@pytest.mark.parametrize("length", [16, 64, 768])
def test_norms_are_within_their_bound(kind, dtype, scale, spread, length):
    """Calibrated inputs (the absolute maximum of the batch), int8 weights of scale 1/64 and
    an int32 bias: within 0.001 of the float function with the dequantized weights."""
    info = np.iinfo(dtype)
    x = (RNG.normal(0, spread, (16, length)) + RNG.normal(0, spread / 3, (16, 1))).round()
    x = x.clip(info.min, info.max).astype(dtype)
    w = RNG.integers(32, 127, length).astype(np.int8)
    p = (intops.layer_norm_params if kind == "layer_norm" else intops.rms_norm_params)(
        scale, float(np.abs(x).max()) * scale, length)
    out_scale = intops.output_scale(kind, p, 1 / 64)
    bf = RNG.normal(0, 1, length)
    b = np.round(bf / out_scale).astype(np.int32) if kind == "layer_norm" else None
    y = (intops.layer_norm_ref(x, w, b, p) if kind == "layer_norm"
         else intops.rms_norm_ref(x, w, p))
    want = float_norm(kind, x * scale, w / 64, None if b is None else b * out_scale,
                      1e-5 if kind == "layer_norm" else 1e-6)
    assert np.abs(y * out_scale - want).max() <= 0.001 * 2   # |w| < 2: 0.001 of the unit


# --- no overflow, for any input of the dtype -------------------------------------------------

DTYPES = st.sampled_from(["int8", "int16", "int32"])
SCALES = st.floats(1e-4, 4.0)


def ints(dtype, shape):
    info = np.iinfo(dtype)
    return st.lists(st.one_of(st.integers(info.min, info.max),
                              st.sampled_from([info.min, info.max, 0, -1, 1])),
                    min_size=math.prod(shape), max_size=math.prod(shape)).map(
        lambda v: np.array(v, dtype=dtype).reshape(shape))


@st.composite
def arrays(draw, min_cols=1):
    dtype = draw(DTYPES)
    return draw(ints(dtype, (draw(st.integers(1, 4)), draw(st.integers(min_cols, 40)))))


@hostile(60)
@given(arrays(), SCALES, st.sampled_from(["exp", "gelu", "silu"]))
def test_elementwise_ops_saturate_and_never_wrap(x, scale, kind):
    """Any input of any dtype at any scale: no intermediate leaves int32 (the reference
    asserts it), and the result is the float function of the input saturated to the op's
    range (``clip``) within :func:`bound` (the kernel's error and the requantization's,
    relative to ``|v|``): nothing wraps around."""
    err, most = errors(kind, x, scale)
    assert np.all(err <= most)


@hostile(60)
@given(arrays(), SCALES, st.sampled_from([7, 8, 15, 16]), st.one_of(st.none(),
                                                                    st.integers(0, 3)))
def test_softmax_never_wraps(x, scale, out_bits, causal):
    """Softmax of any logits (int32 extremes included, saturated to +-2**30): probabilities
    within :func:`softmax_bound` of the float softmax of the saturated logits; masked ones
    are 0."""
    p = dict(intops.softmax_params(scale, out_bits), causal=causal)
    y = intops.softmax_ref(x, p)
    v = np.clip(x.astype(np.float64), -(1 << 30), (1 << 30) - 1) * scale
    keep = None
    if causal is not None:
        keep = np.arange(x.shape[1])[None, :] <= np.arange(x.shape[0])[:, None] + causal
        assert not np.any(y[~keep])
    err = np.abs(y * 2.0 ** -out_bits - float_softmax(v, keep)).max()
    assert err <= softmax_bound(out_bits, x.shape[1])


#: Softmax's error besides the shift of the terms (:func:`softmax_bound`), per ``out_bits``: a
#: probability of 1 saturates at ``1 - 2**-out_bits`` (7 and 8 bits); at 15 and 16 bits a
#: quarter of i-exp's relative error between the largest term (+0.04 %) and the others (down to
#: -0.30 %), and half a step. Measured over every pair of logits at 300 scales from 1e-4 to 4,
#: rows of one large and k equal small terms, and random rows: 0.0077, 0.0038, 0.00080, 0.00079.
SOFTMAX_BOUND = {7: 0.0079, 8: 0.004, 15: 0.00087, 16: 0.00087}


def softmax_bound(out_bits, cols):
    """The error bound of softmax over rows of ``cols``: :data:`SOFTMAX_BOUND` and the shift
    of the terms (``e >> s``, :func:`intops.softmax_sum_shift`): each of the other ``cols -
    1`` terms loses under one unit of a sum of at least ``M = L_max >> s``, and the
    reciprocal's floor moves a probability by up to ``M / 2**30``."""
    m = intops.exp_consts()[2] >> intops.softmax_sum_shift(cols)
    return SOFTMAX_BOUND[out_bits] + (cols - 1) / m + m / 2 ** 30


@pytest.mark.parametrize("out_bits", [7, 8, 15])
def test_softmax_of_one_large_and_many_small_terms(out_bits):
    """Rows ``(0, d, ..., d)`` for every ``d`` from ``-clip`` to 0, of 2, 40 and 300 terms:
    within :func:`softmax_bound`, and within 0.0025 at 300 (the small terms, each truncated
    to whole units of ``L_max >> s``, lost most of their mass when ``s`` kept the sum within
    2**20: 0.091 at 300 terms)."""
    worst = {}
    for scale, cols in [(0.00014253287650617473, 2), (0.05, 40), (0.05, 300)]:
        p = intops.softmax_params(scale, out_bits)
        d = np.arange(-p["clip"], 1)
        x = np.zeros((d.size, cols), np.int64)
        x[:, 1:] = d[:, None]
        y = intops.softmax_ref(x, p)
        worst[cols] = np.abs(y * 2.0 ** -out_bits - float_softmax(x * scale)).max()
        assert worst[cols] <= softmax_bound(out_bits, cols), cols
    assert worst[300] <= 0.0025 + 2.0 ** -out_bits


@hostile(60)
@given(arrays(min_cols=2), SCALES, st.sampled_from(["layer_norm", "rms_norm"]),
       st.sampled_from(["int8", "int16"]), st.integers(0, 3))
def test_norms_never_wrap(x, scale, kind, wdtype, seed):
    """Any rows (constant rows, extremes) with int8 or int16 weights at the extremes of their
    range (int32 weights are refused): no intermediate leaves int32 (the reference asserts
    it); the normalized values are within ``sqrt(C)`` units."""
    c = x.shape[1]
    rng = np.random.default_rng(seed)
    info = np.iinfo(wdtype)
    w = rng.choice([info.min, info.max, 1, -1], c).astype(wdtype)
    b = rng.integers(-(1 << 30), 1 << 30, c).astype(np.int32)
    p = (intops.layer_norm_params if kind == "layer_norm" else intops.rms_norm_params)(
        scale, float(np.abs(x.astype(np.float64)).max()) * scale, c, wdtype)
    y = (intops.layer_norm_ref(x, w, b, p) if kind == "layer_norm"
         else intops.rms_norm_ref(x, w, p))
    z = (y.astype(np.int64) - (b if kind == "layer_norm" else 0)) // w.astype(np.int64)
    assert np.abs(z).max() <= (math.isqrt(c - 1) + 1) << p["frac"]


def test_norm_of_a_constant_row_is_the_bias():
    """sigma = 0: every deviation is 0 (no division by zero), the result is the bias."""
    x = np.full((2, 6), 37, np.int16)
    w = np.arange(1, 7, dtype=np.int8)
    b = np.arange(6, dtype=np.int32) * 1000
    p = intops.layer_norm_params(0.01, 0.37, 6)
    assert intops.layer_norm_ref(x, w, b, p).tolist() == [b.tolist()] * 2
    assert not intops.rms_norm_ref(np.zeros((1, 6), np.int8), w,
                                   intops.rms_norm_params(0.01, 1, 6)).any()


def test_scalar_routines():
    """What the CUs' scalar loops compute: the reciprocal, the square root, the normalization
    of a sum of squares to [2**28, 2**30)."""
    s = np.array([1, 2, 3, 1000, (1 << 20) - 1])
    assert intops.reciprocal(s).tolist() == [(1 << 30) // v for v in s.tolist()]
    t = np.array([1, 2, 5, 1 << 28, (1 << 30) - 1, 1 << 30, (1 << 31) - 1])
    tn, e = intops.normalize(t)
    assert np.all((tn >= 1 << 28) & (tn < 1 << 30))
    assert e.tolist() == [14, 14, 13, 0, 0, -1, -1]
    assert intops.isqrt(tn).tolist() == [math.isqrt(int(v)) for v in tn]


def test_embedding_clamps_indices():
    table = np.arange(12, dtype=np.int8).reshape(4, 3)
    idx = np.array([[0, 3], [-5, 9]], np.int32)
    out = intops.embedding_ref(table, idx)
    assert out.dtype == np.int8 and out.shape == (2, 2, 3)
    assert out[:, :, 0].tolist() == [[0, 9], [0, 9]]


# --- the op kinds in the IR ------------------------------------------------------------------

def graph_of(kind, *shapes, dtype="int8", **attrs):
    g = DataflowGraph("g")
    ins = [g.input(f"x{i}", s, d) for i, (s, d) in enumerate(shapes)]
    g.output("y", g.add(kind, *ins, name="n", **attrs))
    return g


def test_types():
    p = intops.softmax_params(0.1, 7)
    g = graph_of("softmax", ((3, 5), "int8"), **p).validate()
    assert str(g.type_of("n")) == "int8[3, 5]"
    g = graph_of("softmax", ((3, 5), "int32"), **dict(p, out_bits=8)).validate()
    assert str(g.type_of("n")) == "int16[3, 5]"
    for kind in ("exp", "gelu", "silu"):
        g = graph_of(kind, ((2, 3, 4), "int16"), **PARAMS[kind](0.1)).validate()
        assert str(g.type_of("n")) == "int32[2, 3, 4]"
    g = graph_of("layer_norm", ((3, 8), "int8"), ((8,), "int8"), ((8,), "int32"),
                 **intops.layer_norm_params(0.1, 10, 8)).validate()
    assert str(g.type_of("n")) == "int32[3, 8]"
    g = graph_of("embedding", ((10, 6), "int8"), ((2, 5), "int32")).validate()
    assert str(g.type_of("n")) == "int8[2, 5, 6]"


@pytest.mark.parametrize("kind,shapes,attrs,message", [
    ("softmax", [((2, 3), "int8")], {},
     "Node 'n' (softmax): attribute 'mult' must be an integer between 1 and 2147483647, "
     "not None"),
    ("softmax", [((3,), "int8")], dict(intops.softmax_params(0.1), causal=0),
     "Node 'n' (softmax): a causal softmax needs at least 2 dimensions (rows, columns)"),
    ("softmax", [((2, 3), "int8")], dict(intops.softmax_params(0.1), causal=-1),
     "Node 'n' (softmax): attribute 'causal' must be an integer at least 0, not -1"),
    ("softmax", [((2, 3), "int8")], dict(intops.softmax_params(0.1), out_bits=17),
     "Node 'n' (softmax): attribute 'out_bits' must be an integer between 1 and 16, not 17"),
    ("exp", [((2, 3), "int8")], dict(mult=1 << 20, shift=4, clip=1 << 12),
     "Node 'n' (exp): attributes clip * mult must be below 2**31, not 4096 * 1048576"),
    ("exp", [((2, 3), "int8")], dict(mult=1000, shift=0, clip=1000),
     "Node 'n' (exp): attributes (clip * mult) >> shift must be at most 32767, not "
     "(1000 * 1000) >> 0"),
    ("gelu", [((2, 3), "int8")], dict(mult=1, shift=0, clip=-1),
     "Node 'n' (gelu): attribute 'clip' must be an integer between 0 and 2147483647, not -1"),
    ("layer_norm", [((2, 8), "int8"), ((4,), "int8"), ((8,), "int32")],
     intops.layer_norm_params(0.1, 10, 8),
     "Node 'n' (layer_norm): weight must have the shape (8,) of a row, not (4,)"),
    ("layer_norm", [((2, 8), "int8"), ((8,), "int16"), ((8,), "int32")],
     intops.layer_norm_params(0.1, 10, 8),
     "Node 'n' (layer_norm): attribute 'frac' must be at most 13 for rows of 8 and int16 "
     "weights (the normalized value times a weight must stay within 2**30), not 15"),
    ("rms_norm", [((2, 8), "int8"), ((8,), "int32")], intops.rms_norm_params(0.1, 10, 8),
     "Node 'n' (rms_norm): int32 weights are too wide for rows of 8 (the normalized value "
     "times a weight must stay within 2**30): use int8 or int16 weights"),
    ("rms_norm", [((2, 8), "int8"), ((8,), "int8")], dict(shift=40, frac=3),
     "Node 'n' (rms_norm): attribute 'shift' must be an integer between -14 and 31, not 40"),
    ("embedding", [((4, 3), "int8"), ((5,), "int16")], {},
     "Node 'n' (embedding): indices must be int32, not int16"),
    ("embedding", [((12,), "int8"), ((5,), "int32")], {},
     "Node 'n' (embedding): the table must be a static (rows, columns) tensor, not int8[12]"),
])
def test_bad_attributes_are_refused_naming_the_node(kind, shapes, attrs, message):
    with pytest.raises(GraphError, match=f"^{re.escape(message)}$"):
        graph_of(kind, *shapes, **attrs).validate()


@pytest.mark.parametrize("call,message", [
    (lambda: intops.softmax_params(0), "input_scale must be a positive finite number, not 0"),
    (lambda: intops.gelu_params(float("nan")),
     "input_scale must be a positive finite number, not nan"),
    (lambda: intops.exp_params(1e6), "scale ratio 1.47732e+09 is too coarse: one step of the "
                                     "input would be more than 32767 steps of the working "
                                     "scale"),
    (lambda: intops.layer_norm_params(0.1, -1, 8),
     "input_absmax must be a non-negative finite number, not -1"),
    (lambda: intops.rms_norm_params(0.1, 1, 0), "length must be an integer from 1 to 65536, "
                                                "not 0"),
    (lambda: intops.layer_norm_params(0.1, 1, 8, "int4"),
     "weight_dtype must be int8, int16 or int32, not 'int4'"),
])
def test_bad_scales_are_refused(call, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        call()


# --- lowered onto the CUs: bit-exact on the functional interpreter ----------------------------

def intops_graph(rows, cols, dtype, seed=0, scale=None, vocab=5, ids=4):
    """Every new op kind on one input ``x`` (``rows x cols``, ``dtype``), a dynamic input
    ``xd`` for softmax and exp, and an embedding lookup: the graph the lowering tests (and the
    RTL test, tests/sim/test_intops_rtl.py) compile."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    s = scale or (0.1 if dtype == "int8" else 0.004 if dtype == "int16" else 1e-4)
    g = DataflowGraph(f"intops_{rows}x{cols}_{dtype}")
    x = g.input("x", (rows, cols), dtype)
    xd = g.input("xd", (rows + 1, cols), dtype, dynamic=True, expected_rows=rows / 2)
    w = g.const("w", rng.integers(-127, 128, cols).astype(np.int8))
    b = g.const("b", rng.integers(-5000, 5000, cols).astype(np.int32))
    table = g.const("table", rng.integers(-128, 128, (vocab, cols)).astype(np.int8))
    nodes = {
        "exp": ("exp", [x], intops.exp_params(s)),
        "sm": ("softmax", [x], intops.softmax_params(s, 7)),
        "smc": ("softmax", [x], dict(intops.softmax_params(s, 8), causal=rows // 2)),
        "gelu": ("gelu", [x], intops.gelu_params(s)),
        "silu": ("silu", [x], intops.silu_params(s)),
        "ln": ("layer_norm", [x, w, b], intops.layer_norm_params(s, s * info.max, cols)),
        "rms": ("rms_norm", [x, w], intops.rms_norm_params(s, s * info.max / 4, cols)),
        "smd": ("softmax", [xd], intops.softmax_params(s, 15)),
        "expd": ("exp", [xd], intops.exp_params(s)),
        "emb": ("embedding", [table, g.input("ids", (ids,), "int32")], {}),
    }
    for name, (kind, ins, attrs) in nodes.items():
        g.output(f"o_{name}", g.add(kind, *ins, name=name, **attrs))
    return g.validate()


def intops_inputs(g, seed, dynamic_rows):
    rng = np.random.default_rng(seed)
    out = {}
    for name in g.inputs:
        t = g.type_of(name)
        info = np.iinfo(t.dtype)
        shape = (dynamic_rows,) + t.shape[1:] if t.dynamic else t.shape
        if name == "ids":
            out[name] = rng.integers(-2, 8, shape).astype(np.int32)
        else:
            v = rng.integers(info.min, info.max, shape, endpoint=True)
            v[..., :2] = [info.min, info.max][:shape[-1]] if shape[-1] else v[..., :2]
            out[name] = v.astype(t.dtype)
    return out


def run_interp(g, params, inputs, partitioner="round_robin", seed=0):
    from rdakit.compiler.compile import compile_workload
    from rdakit.sim.runtime.job import run_job_interp
    job, _ = compile_workload(g, params=params, partitioner=partitioner, place_steps=50)
    job = job.with_inputs(inputs)
    outputs, result, _ = run_job_interp(job, schedule="random", seed=seed)
    assert result.ok, result.errors
    return job, job.decode(outputs, check_padding=True)


@pytest.mark.parametrize("lanes", [1, 4, 16])
@pytest.mark.parametrize("dtype", ["int8", "int16", "int32"])
def test_lowered_ops_are_bit_exact_on_the_interpreter(lanes, dtype):
    """Every new kind, odd shapes (padding lanes), the extremes of the dtype, a dynamic input
    with fewer rows than its bound, indices out of the table's range; elementwise ops in chunks
    when the local buffer is small (64 words, 1 lane)."""
    from rdakit.hdl.spec.params import fabric_params
    g = intops_graph(3, 7 if lanes < 16 else 21, dtype, seed=lanes)
    params = fabric_params(2, 2, prog_len=4096, lanes=lanes, local_words=64 if lanes == 1
                           else 256)
    inputs = intops_inputs(g, lanes, dynamic_rows=2)
    _, got = run_interp(g, params, inputs, "round_robin" if lanes != 4 else "multilevel",
                        seed=lanes)
    want = g.evaluate(inputs)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("lanes", [4])
@given(st.integers(1, 4), st.integers(1, 19), DTYPES, st.integers(0, 2**16),
       st.integers(0, 3))
@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.generate])
def test_lowered_ops_on_random_shapes_and_values(lanes, rows, cols, dtype, seed, dyn):
    """Random shapes, scales and values: the lowered ops equal their references."""
    from rdakit.hdl.spec.params import fabric_params
    rng = np.random.default_rng(seed)
    g = intops_graph(rows, cols, dtype, seed=seed, scale=float(10 ** rng.uniform(-4, 0.3)))
    params = fabric_params(2, 2, prog_len=4096, lanes=lanes, local_words=256)
    inputs = intops_inputs(g, seed, dynamic_rows=min(dyn, rows + 1))
    _, got = run_interp(g, params, inputs, seed=seed)
    want = g.evaluate(inputs)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# --- rows longer than the local buffer ---------------------------------------------------------

def long_row_graph(rows, cols, dtype, kinds, seed=0):
    """The row-wise kinds ``kinds`` on one input ``x`` (``rows x cols``): the graph of the
    long-row tests."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    s = 0.1 if dtype == "int8" else 0.004 if dtype == "int16" else 1e-4
    g = DataflowGraph(f"long_{rows}x{cols}_{dtype}")
    x = g.input("x", (rows, cols), dtype)
    w = g.const("w", rng.integers(-127, 128, cols).astype(np.int8))
    b = g.const("b", rng.integers(-5000, 5000, cols).astype(np.int32))
    nodes = {
        "ln": ("layer_norm", [x, w, b], intops.layer_norm_params(s, s * info.max, cols)),
        "rms": ("rms_norm", [x, w], intops.rms_norm_params(s, s * info.max / 4, cols)),
        "sm": ("softmax", [x], intops.softmax_params(s, 7)),
        "smc": ("softmax", [x], dict(intops.softmax_params(s, 8), causal=cols // 2)),
    }
    if "smd" in kinds:
        xd = g.input("xd", (rows + 1, cols), dtype, dynamic=True, expected_rows=rows / 2)
        nodes["smd"] = ("softmax", [xd], intops.softmax_params(s, 15))
    for name in kinds:
        kind, ins, attrs = nodes[name]
        g.output(f"o_{name}", g.add(kind, *ins, name=name, **attrs))
    return g.validate()


@pytest.mark.parametrize("lanes,cols,dtype", [(1, 150, "int32"), (4, 300, "int8"),
                                              (4, 770, "int16")])
def test_row_wise_ops_on_rows_longer_than_the_local_buffer_are_bit_exact(lanes, cols, dtype):
    """Rows of 150 to 770 elements (38 to 193 words) with 64 words of local buffer, for
    layer_norm, rms_norm and softmax (plain, causal, on a dynamic input): the passes with a
    per-lane operand go over the row in chunks (for the norms 3 whole chunks of 50 words; one
    of 38 and a last of 37; 3 of 49 in a loop and a last of 46, with padding lanes),
    bit-exact against the references."""
    from rdakit.hdl.spec.params import fabric_params
    g = long_row_graph(3, cols, dtype, ["ln", "rms", "sm", "smc", "smd"], seed=cols)
    params = fabric_params(2, 2, prog_len=4096, lanes=lanes, local_words=64, mu_words=8192)
    inputs = intops_inputs(g, cols, dynamic_rows=2)
    _, got = run_interp(g, params, inputs, seed=lanes)
    want = g.evaluate(inputs)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("lanes,cols", [(1, 150), (4, 300), (4, 770)])
def test_a_row_operand_longer_than_the_local_buffer_is_bit_exact(lanes, cols):
    """The per-channel requantization of a wide linear layer (``(x * m_row + b_row) >> s``,
    clipped; static and dynamic rows, one of them empty): the row operand longer than the
    64 local words goes through the local buffer in chunks of columns."""
    from rdakit.hdl.spec.params import fabric_params
    rng = np.random.default_rng(cols)
    g = DataflowGraph(f"row_{cols}")
    m = g.const("m", rng.integers(-2**14, 2**14, cols).astype(np.int32))
    b = g.const("b", rng.integers(-2**20, 2**20, cols).astype(np.int32))
    for name, dyn in (("x", False), ("xd", True), ("xe", True)):
        x = g.input(name, (3, cols), "int32", dynamic=dyn, **({"expected_rows": 2} if dyn
                                                                else {}))
        y = g.add("shr", g.add("add", g.add("mul", x, m), b), shift=7)
        g.output(f"o_{name}", g.add("clip", y, lo=-128, hi=127))
    g.validate()
    params = fabric_params(2, 2, prog_len=4096, lanes=lanes, local_words=64, mu_words=4096)
    inputs = {"x": rng.integers(-2**15, 2**15, (3, cols)).astype(np.int32),
              "xd": rng.integers(-2**15, 2**15, (2, cols)).astype(np.int32),
              "xe": np.zeros((0, cols), np.int32)}
    _, got = run_interp(g, params, inputs, seed=lanes)
    want = g.evaluate(inputs)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("lanes,ids", [(1, 130), (4, 301)])
def test_more_embedding_indices_than_the_local_buffer_holds(lanes, ids):
    """130 or 301 indices (130 or 76 words, 64 local words), some out of the table's range:
    staged a chunk at a time, bit-exact."""
    from rdakit.hdl.spec.params import fabric_params
    rng = np.random.default_rng(ids)
    g = DataflowGraph(f"emb_{ids}")
    table = g.const("table", rng.integers(-128, 128, (7, 5)).astype(np.int8))
    g.output("o", g.add("embedding", table, g.input("ids", (ids,), "int32"), name="emb"))
    g.validate()
    params = fabric_params(2, 2, prog_len=4096, lanes=lanes, local_words=64, mu_words=4096)
    inputs = {"ids": rng.integers(-2, 9, ids).astype(np.int32)}
    _, got = run_interp(g, params, inputs, seed=lanes)
    np.testing.assert_array_equal(got["o"], g.evaluate(inputs)["o"])


@pytest.mark.parametrize("lanes,cols", [(1, 260), (4, 258), (4, 300)])
def test_reduce_max_of_rows_longer_than_the_local_buffer(lanes, cols):
    """reduce_max over rows whose lrow constant would not leave room (64 local words): all
    but the last word in one MAX stream, the last word's padding lanes masked by a one-word
    constant (none without padding), bit-exact with every value negative."""
    from rdakit.hdl.spec.params import fabric_params
    rng = np.random.default_rng(cols)
    g = DataflowGraph(f"rmax_{cols}")
    x = g.input("x", (3, cols), "int32")
    g.output("o", g.add("reduce_max", x, name="rm", axis=1))
    g.validate()
    params = fabric_params(2, 2, prog_len=4096, lanes=lanes, local_words=64, mu_words=4096)
    inputs = {"x": rng.integers(-2**31, -1, (3, cols)).astype(np.int32)}
    inputs["x"][1, -1] = -1
    _, got = run_interp(g, params, inputs, seed=lanes)
    np.testing.assert_array_equal(got["o"], g.evaluate(inputs)["o"])
