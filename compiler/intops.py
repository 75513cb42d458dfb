"""Integer-only non-linear ops in the style of I-BERT: their constants and exact semantics.

Kim et al., 2021, *I-BERT: Integer-only BERT Quantization*, compute the non-linear functions of a
transformer with integer arithmetic only: ``exp`` by a second-order polynomial after splitting
off multiples of ln 2, softmax through that ``exp`` and one integer reciprocal per row, GELU
through a clipped second-order polynomial of erf, LayerNorm through an integer square root.
This module is the one definition of those algorithms in rdakit:

* ``*_params`` functions derive an op's integer attributes from float scales (what an importer
  calls: ``softmax_params(input_scale, out_bits)``), and :func:`output_scale` gives the float
  scale of the op's integer result;
* ``check_*`` functions validate attributes (``ValueError`` with a message;
  :data:`rdakit.compiler.graph.OP_KINDS` turns it into a ``GraphError`` naming the node);
* ``*_ref`` functions are the exact semantics on integer numpy arrays, which
  :meth:`rdakit.compiler.graph.DataflowGraph.evaluate` runs and the lowering
  (:mod:`rdakit.compiler.lower.templates`) reproduces bit for bit on the CUs.

Every intermediate value fits a signed 32-bit lane (the CUs' ALU), for every input of the
op's dtype, as long as the attributes pass their check: the reference computes in int64 and
:func:`_i32` asserts it at each step (the hypothesis tests in ``tests/compiler/test_intops.py``
drive random inputs through it). Inputs beyond an op's range are saturated (``clip``), never
wrapped. The algorithms use only what the CU's ALU has: add, subtract, multiply (low 32 bits),
shifts, and, or, min, max; a division or a square root is per row, by a scalar loop.

The algorithms, and their measured errors against the float functions, are in
``docs/compiler.md`` ("Integer non-linear ops").
"""

import math

import numpy as np

__all__ = [
    "EXP_BITS", "ACT_BITS", "ACT_G_SHIFT", "NORM_BITS", "MAX_LENGTH", "RECIP_BITS", "SUM_BITS",
    "NORM_ONE",
    "LOGISTIC",
    "exp_params", "softmax_params", "gelu_params", "silu_params", "layer_norm_params",
    "rms_norm_params", "sigmoid_params", "tanh_params", "output_scale", "requant",
    "exp_consts", "act_consts", "softmax_sum_shift", "softmax_dtype", "norm_consts",
    "logistic_consts", "check_exp", "check_softmax", "check_act", "check_norm",
    "check_logistic", "exp_ref", "softmax_ref", "gelu_ref", "silu_ref", "act_ref",
    "sigmoid_ref", "tanh_ref", "logistic_ref", "logistic_of_u", "layer_norm_ref",
    "rms_norm_ref", "embedding_ref", "reciprocal", "isqrt", "normalize", "shift_in",
]

INT32_MAX = (1 << 31) - 1

# --- i-exp ----------------------------------------------------------------------------------

#: I-BERT's polynomial: exp(p) ~ A * (p + B)^2 + C on (-ln 2, 0].
EXP_A, EXP_B, EXP_C = 0.3585, 1.353, 0.344
#: Fraction bits of the working scale of exp: ``S_w = ln 2 / 2**EXP_BITS``, so that ``-x`` in
#: that scale splits into ``z = u >> EXP_BITS`` multiples of ln 2 and ``r = u & (2**EXP_BITS -
#: 1)``.
EXP_BITS = 10
#: Largest ``u`` (the input in the working scale): ``z`` stays at most 31, so ``L >> z`` is 0
#: (``exp(-31 ln 2) < 5e-10``).
EXP_U_MAX = (32 << EXP_BITS) - 1
EXP_SW = math.log(2) / (1 << EXP_BITS)
#: ``q_b = round(B / S_w)``, ``q_c = round(C / (A * S_w^2))``: constants of the algorithm.
EXP_QB = round(EXP_B / EXP_SW)
EXP_QC = round(EXP_C / (EXP_A * EXP_SW ** 2))
#: exp(0) in the output scale (the largest result): ``q_b^2 + q_c``.
EXP_LMAX = EXP_QB ** 2 + EXP_QC
#: Scale of the result of ``exp``: ``A * S_w^2``.
EXP_SCALE = EXP_A * EXP_SW ** 2

# --- softmax --------------------------------------------------------------------------------

#: The reciprocal of a row's sum is ``2**RECIP_BITS // sum``.
RECIP_BITS = 30
#: A row's terms are shifted right (:func:`softmax_sum_shift`) so that their sum is at most
#: ``2**SUM_BITS`` (the reciprocal is at least 1, and ``e * f`` at most ``2**30``).
SUM_BITS = RECIP_BITS
#: Longest row of softmax, layer_norm and rms_norm.
MAX_LENGTH = 1 << 16

# --- GELU and SiLU: x * H(x), H(x) = 1/2 + sgn(x) (1/2 - alpha (c - min(|x|, c))^2) ---------

#: Fraction bits of the working scale of GELU and SiLU: ``S_t = c / 2**ACT_BITS``.
ACT_BITS = 12
#: Right shift of ``H``'s polynomial (``q_half - v^2``, 25 bits) to the 11 bits it keeps.
ACT_G_SHIFT = 14
#: ``(alpha, c)`` of each: GELU from I-BERT's erf polynomial (``a = -0.2888``, ``b = -1.769``
#: on ``x / sqrt 2``: ``alpha = 0.2888 / 4``, ``c = 1.769 sqrt 2``); SiLU's fitted to
#: sigmoid, minimising the largest ``|x (sigmoid(x) - H(x))|`` over a grid of [0, 16] (the
#: same second-order form, so both share one kernel).
ACT_POLY = {"gelu": (0.2888 / 4, 1.769 * math.sqrt(2)), "silu": (0.0156, 4.92)}
# --- sigmoid and tanh: 1 / (1 + exp(-|x|)), a polynomial reciprocal and one Newton step ------

#: Fraction bits of ``e = exp(-|x|)``, of ``d = 1 + e`` and of ``y = 1 / d`` (Q15).
SIG_BITS = 15
#: Right shift of i-exp's result before it is brought to Q15 (``L >> (z + 8)`` has 15 bits, so
#: its product with :data:`SIG_ME` fits int32).
SIG_E_SHIFT = 8
#: ``e = (E * SIG_ME) >> SIG_BITS`` brings ``E = L >> (z + 8)`` (scale ``EXP_SCALE * 2**8``) to
#: Q15; the kernel computes ``-e`` (``E * -SIG_ME``).
SIG_ME = round(EXP_SCALE * (1 << SIG_E_SHIFT) * (1 << SIG_BITS) * (1 << SIG_BITS))
#: ``1/d ~ p(d) = 70/33 - 16/11 d + 32/99 d^2`` on ``[1, 2]``, the minimax quadratic of the
#: relative error (``|1 - d p(d)| <= 1/99``), as ``((alpha - beta e) (-(1 + e)) >> 15) +
#: gamma`` in ``e = d - 1``: ``beta = 32/99``, ``alpha = 112/99``, ``gamma = 210/99``.
SIG_BETA = round(32 / 99 * (1 << SIG_BITS))
SIG_ALPHA = round(112 / 99 * (1 << SIG_BITS))
SIG_GAMMA = round(210 / 99 * (1 << SIG_BITS))
#: The input's weight per kind: ``sigmoid(x) = 1/2 + sgn(x) (y - 1/2)`` with ``y = 1 / (1 +
#: exp(-|x|))``; ``tanh(x) = 2 sigmoid(2x) - 1 = sgn(x) (2y - 1)`` with ``exp(-2|x|)``: the
#: input counts twice, and the result ``sgn(x) (y - 1/2)`` has scale ``2**-14``.
LOGISTIC = {"sigmoid": 1, "tanh": 2}

# --- LayerNorm and RMSNorm ------------------------------------------------------------------

#: The shifted input is saturated to ``NORM_BITS`` bits and a sign (``x'`` of layer_norm in
#: ``[-2**14, 2**14)``, so deviations and their squares fit); rms_norm keeps one bit more.
NORM_BITS = 14
#: ``T``, the sum of squares, is brought to ``[2**28, 2**30)`` by shifts of 2 bits before its
#: square root, so the root has 15 bits.
NORM_LO, NORM_HI = 1 << 28, 1 << 30
#: The normalizing factor is ``N_C // isqrt(T)`` with ``N_C = round(sqrt(C / 2**v) *
#: 2**NORM_ONE)``.
NORM_ONE = 29
#: Largest ``frac`` (fraction bits of the normalized value).
MAX_FRAC = 15


class _Check:
    """Raise ``ValueError`` for a bad attribute (the graph names the node)."""

    @staticmethod
    def int(attrs, name, lo, hi=None, default=None):
        v = attrs.get(name, default)
        if not isinstance(v, int | np.integer) or isinstance(v, bool) or v < lo or (
                hi is not None and v > hi):
            bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
            raise ValueError(f"attribute {name!r} must be an integer {bound}, not {v!r}")
        return int(v)


def _i32(a):
    """``a`` (int64), asserting every element is a signed 32-bit value (what the CU's lanes
    hold): the attributes' checks guarantee it for every input."""
    a = np.asarray(a, dtype=np.int64)
    if a.size and (a.min() < -(1 << 31) or a.max() > INT32_MAX):
        raise AssertionError("an intermediate value left int32")  # pragma: no cover
    return a


def _rows(x):
    """``x`` as int64 rows over its last axis."""
    x = np.asarray(x)
    return x.astype(np.int64).reshape(-1, x.shape[-1]) if x.ndim else x.astype(np.int64)


# --- requantization into a working scale ----------------------------------------------------

def _half(shift):
    """The rounding term of a right shift by ``shift``."""
    return (1 << shift) >> 1


def requant(ratio, t_max, rounding=False):
    """``(mult, shift, clip)`` with ``(min(|x|, clip) * mult) >> shift ~ |x| * ratio`` (with
    ``rounding``, ``2**(shift - 1)`` added before the shift) at most ``t_max``, nothing leaving
    int32: the largest ``shift`` with ``(t_max + 1) << shift`` at most 2**31 and ``mult =
    round(ratio * 2**shift) < 2**31``; ``clip`` the largest ``|x|`` whose result is at most
    ``t_max`` and with ``clip * mult`` (plus the rounding term) below 2**31.

    The result is off ``|x| * ratio`` by ``r |x| ratio`` (``r = |mult / (ratio 2**shift) -
    1|``, at most ``1 / (2 mult - 1)``: the multiplier's own rounding) and the shift's
    rounding (half a step with ``rounding``, else under one step). ``clip * mult`` stays
    within 2**31, so ``shift`` is about ``31 - log2(t_max)``: 11 for ``gelu`` and ``silu``
    (``t_max`` of 20 bits), 16 for ``exp`` and ``sigmoid`` (15 bits); the multiplier's part
    of the error is at most ``|x| / 2**(shift + 1)`` steps of the working scale.

    Raises
    ------
    ValueError
        If ``ratio`` is not a positive finite number, or so large that 1 maps past ``t_max``.
    """
    if not (isinstance(ratio, int | float) and math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"scale ratio must be a positive finite number, not {ratio!r}")
    if ratio > t_max:
        raise ValueError(f"scale ratio {ratio:g} is too coarse: one step of the input would be "
                         f"more than {t_max} steps of the working scale")
    shift = 0
    while shift < 30 and (t_max + 1) << (shift + 1) <= 1 << 31 \
            and round(ratio * (1 << (shift + 1))) < 1 << 31:
        shift += 1
    mult = max(1, round(ratio * (1 << shift)))
    h = _half(shift) if rounding else 0
    clip = min(INT32_MAX, (((t_max + 1) << shift) - 1 - h) // mult)
    return {"mult": mult, "shift": shift, "clip": clip}


def _check_requant(attrs, t_max, rounding=False):
    mult = _Check.int(attrs, "mult", 1, INT32_MAX)
    shift = _Check.int(attrs, "shift", 0, 31)
    clip = _Check.int(attrs, "clip", 0, INT32_MAX)
    h = _half(shift) if rounding else 0
    if clip * mult + h > INT32_MAX:
        raise ValueError(f"attributes clip * mult must be below 2**31, not {clip} * {mult}")
    if (clip * mult + h) >> shift > t_max:
        raise ValueError(f"attributes (clip * mult) >> shift must be at most {t_max}, not "
                         f"({clip} * {mult}) >> {shift}")
    return mult, shift, clip


# --- exp -------------------------------------------------------------------------------------

def exp_consts():
    """``(q_b, q_c, L_max, u_max)`` of i-exp: constants of the algorithm, not of a scale."""
    return EXP_QB, EXP_QC, EXP_LMAX, EXP_U_MAX


def exp_params(input_scale):
    """Attributes of ``exp`` for an input of scale ``input_scale``: ``mult``, ``shift``,
    ``clip`` (``u = (min(-x, clip) * mult) >> shift`` is ``-x`` in the working scale
    ``ln 2 / 2**EXP_BITS``)."""
    return requant(_scale(input_scale) / EXP_SW, EXP_U_MAX)


def check_exp(attrs):
    """Validate the attributes of ``exp`` (and the exp part of ``softmax``)."""
    return _check_requant(attrs, EXP_U_MAX)


def _iexp_u(u):
    """i-exp of ``-u`` in the working scale (``0 <= u <= EXP_U_MAX``): ``L >> z``, scale
    :data:`EXP_SCALE`."""
    z = u >> EXP_BITS
    r = u & ((1 << EXP_BITS) - 1)
    w = _i32(r - EXP_QB)
    big_l = _i32(w * w + EXP_QC)
    return big_l >> z


def exp_ref(x, attrs):
    """``exp(x)`` for ``x <= 0`` (a positive input counts as 0), int32 of scale
    :data:`EXP_SCALE`: ``u = (clip(x, -clip, 0) * -mult) >> shift``, ``z = u >> 10``, ``r = u &
    1023``, ``((r - q_b)^2 + q_c) >> z``."""
    x = np.asarray(x)
    mult, shift, clip = attrs["mult"], attrs["shift"], attrs["clip"]
    d = np.clip(x.astype(np.int64), -clip, 0)
    u = _i32(d * -mult) >> shift
    return _iexp_u(u).astype(np.int32)


# --- softmax ---------------------------------------------------------------------------------

def softmax_params(input_scale, out_bits=8):
    """Attributes of ``softmax`` for logits of scale ``input_scale`` and probabilities of
    ``out_bits`` fraction bits (scale ``2**-out_bits``; the result is int8 for ``out_bits <=
    7``, int16 up to 15, int32 for 16): ``mult``, ``shift``, ``clip`` (of the logits minus
    the row's maximum, as :func:`exp_params`) and ``out_bits``. An importer adds ``causal``
    for a causal mask."""
    p = exp_params(input_scale)
    _Check.int({"out_bits": out_bits}, "out_bits", 1, 16)
    return dict(p, out_bits=int(out_bits))


def softmax_dtype(out_bits):
    """The dtype of softmax's result for ``out_bits`` fraction bits (``2**out_bits - 1`` at
    most)."""
    return "int8" if out_bits <= 7 else "int16" if out_bits <= 15 else "int32"


def softmax_sum_shift(length):
    """Right shift of a softmax row's exp terms, ``s``: each term loses under one unit of
    ``M = L_max >> s`` (the largest term), so the other ``length - 1`` move a probability by
    up to ``(length - 1) / M``, and the reciprocal's floor by up to ``M / 2**30``: the ``s``
    with the least sum of the two, among those with ``length * M <= 2**SUM_BITS`` (about
    ``M = sqrt(length 2**30)``: 3 for rows of 300, whose bound is then 0.0011)."""
    def cost(s):
        m = EXP_LMAX >> s
        return m / (1 << RECIP_BITS) + (length - 1) / m

    fits = [s for s in range(EXP_LMAX.bit_length())
            if length * (EXP_LMAX >> s) <= 1 << SUM_BITS]
    return min(fits, key=cost)


def check_softmax(attrs, shape):
    """Validate the attributes of ``softmax`` over the last axis of ``shape``."""
    check_exp(attrs)
    _Check.int(attrs, "out_bits", 1, 16)
    if shape[-1] > MAX_LENGTH:
        raise ValueError(f"rows must be at most {MAX_LENGTH} long, not {shape[-1]}")
    if attrs.get("causal") is not None:
        if len(shape) < 2:
            raise ValueError("a causal softmax needs at least 2 dimensions (rows, columns)")
        _Check.int(attrs, "causal", 0)


def softmax_ref(x, attrs):
    """Softmax over the last axis: probabilities of scale ``2**-out_bits``.

    Per row (of ``C`` columns; with ``causal = k``, row ``i`` keeps columns ``j <= i + k``, ``i``
    counted along the second-to-last axis, and the others are 0): ``x`` saturated to
    ``[-2**30, 2**30)``, ``m`` the maximum kept, ``d = max(x - m, -clip)`` (``-clip`` where
    masked), ``e = i-exp(d) >> s`` (:func:`softmax_sum_shift`), ``f = 2**30 // sum(e)``,
    ``min((e * f + 2**(29 - out_bits)) >> (30 - out_bits), 2**out_bits - 1)``.
    """
    x = np.asarray(x)
    shape = x.shape
    c = shape[-1]
    mult, shift, clip, bits = attrs["mult"], attrs["shift"], attrs["clip"], attrs["out_bits"]
    v = np.clip(_rows(x), -(1 << 30), (1 << 30) - 1)
    keep = np.ones(v.shape, dtype=bool)
    if attrs.get("causal") is not None:
        i = np.arange(v.shape[0]) % shape[-2]
        keep = np.arange(c)[None, :] <= (i + attrs["causal"])[:, None]
    m = np.where(keep, v, -(1 << 31)).max(axis=1, keepdims=True)
    d = np.where(keep, np.maximum(_i32(v - m), -clip), -clip)
    u = _i32(d * -mult) >> shift
    e = _iexp_u(u) >> softmax_sum_shift(c)
    total = _i32(e.sum(axis=1, keepdims=True))
    f = reciprocal(total)
    out = np.minimum(_i32(_i32(e * f) + (1 << (29 - bits))) >> (30 - bits), (1 << bits) - 1)
    return out.reshape(shape).astype(softmax_dtype(bits))


def reciprocal(s):
    """``2**RECIP_BITS // s`` (``s >= 1``), as the CU's scalar loop computes it."""
    return (1 << RECIP_BITS) // np.asarray(s, dtype=np.int64)


# --- GELU and SiLU ---------------------------------------------------------------------------

def act_consts(kind):
    """``(q_c, q_half, q, t_max)`` of ``gelu`` or ``silu``: ``c`` in the working scale ``S_t
    = c / 2**ACT_BITS`` (``q_c = 2**ACT_BITS``), ``1/2`` in the scale of ``alpha S_t^2
    2**ACT_G_SHIFT`` (``q``, rounded) and of ``alpha S_t^2`` (``q_half = q << ACT_G_SHIFT``),
    and the largest ``|t|`` (``|t| (q + G) < 2**31``)."""
    alpha, c = ACT_POLY[kind]
    st = c / (1 << ACT_BITS)
    q = round(0.5 / (alpha * st * st * (1 << ACT_G_SHIFT)))
    q_half = q << ACT_G_SHIFT         # G = q where v = 0: H is exactly 0 and 1 there
    g_max = max(q_half, (1 << 2 * ACT_BITS) - q_half) >> ACT_G_SHIFT
    return 1 << ACT_BITS, q_half, q, INT32_MAX // (q + g_max + 1) - 1


def _act_params(kind, input_scale):
    _, c = ACT_POLY[kind]
    return requant(_scale(input_scale) / (c / (1 << ACT_BITS)), act_consts(kind)[3],
                   rounding=True)


def gelu_params(input_scale):
    """Attributes of ``gelu`` for an input of scale ``input_scale``: ``mult``, ``shift``,
    ``clip`` (``t = (clip(x, -clip, clip) * mult + 2**(shift - 1)) >> shift`` in the working
    scale ``c / 2**ACT_BITS``)."""
    return _act_params("gelu", input_scale)


def silu_params(input_scale):
    """Attributes of ``silu``, as :func:`gelu_params`."""
    return _act_params("silu", input_scale)


def check_act(kind, attrs):
    """Validate the attributes of ``gelu`` or ``silu``."""
    return _check_requant(attrs, act_consts(kind)[3], rounding=True)


def act_ref(kind, x, attrs):
    """``x * H(x)`` with ``H(x) = 1/2 + sgn(x) (1/2 - alpha (c - min(|x|, c))^2)``, int32:
    ``t = (clip(x, -clip, clip) * mult + 2**(shift - 1)) >> shift``, ``v = max(q_c - |t|,
    0)``, ``G = (q_half - v^2) >> 14``, ``t * q + |t| * G`` (:func:`act_consts`; scale ``S_t /
    (2 q)``, :func:`output_scale`)."""
    x = np.asarray(x)
    q_c, q_half, q, _ = act_consts(kind)
    mult, shift, clip = attrs["mult"], attrs["shift"], attrs["clip"]
    t = _i32(np.clip(x.astype(np.int64), -clip, clip) * mult + _half(shift)) >> shift
    a = np.abs(t)
    v = np.maximum(q_c - a, 0)
    g = _i32(q_half - v * v) >> ACT_G_SHIFT
    return _i32(_i32(t * q) + _i32(a * g)).astype(np.int32)


def gelu_ref(x, attrs):
    """GELU (:func:`act_ref`)."""
    return act_ref("gelu", x, attrs)


def silu_ref(x, attrs):
    """SiLU, ``x * sigmoid(x)`` (:func:`act_ref`)."""
    return act_ref("silu", x, attrs)


# --- sigmoid and tanh ------------------------------------------------------------------------

def logistic_consts():
    """``(m_e, beta, alpha, gamma)`` of ``sigmoid`` and ``tanh``: constants of the algorithm
    (:data:`SIG_ME`, :data:`SIG_BETA`, :data:`SIG_ALPHA`, :data:`SIG_GAMMA`)."""
    return SIG_ME, SIG_BETA, SIG_ALPHA, SIG_GAMMA


def _logistic_params(kind, input_scale):
    return requant(LOGISTIC[kind] * _scale(input_scale) / EXP_SW, EXP_U_MAX)


def sigmoid_params(input_scale):
    """Attributes of ``sigmoid`` for an input of scale ``input_scale``: ``mult``, ``shift``,
    ``clip`` (``u = (min(|x|, clip) * mult) >> shift`` is ``|x|`` in i-exp's working scale
    ``ln 2 / 2**EXP_BITS``, as :func:`exp_params`)."""
    return _logistic_params("sigmoid", input_scale)


def tanh_params(input_scale):
    """Attributes of ``tanh``: as :func:`sigmoid_params` for ``2 |x|``."""
    return _logistic_params("tanh", input_scale)


def check_logistic(attrs):
    """Validate the attributes of ``sigmoid`` or ``tanh``."""
    return _check_requant(attrs, EXP_U_MAX)


def logistic_of_u(u):
    """``w = y - 2**14`` (Q15, ``y ~ 1 / (1 + exp(-u S_w))``) for ``0 <= u <= EXP_U_MAX``:
    ``E = i-exp(u) >> 8``, ``n = (E * -m_e) >> 15`` (``-e``), ``D = n - 2**15`` (``-d``),
    ``y0 = (((n * beta) >> 15) + alpha) * D >> 15) + gamma``, one Newton step ``y = (y0 *
    (((y0 * D) >> 15) + 2**16)) >> 15``, ``w = max(y - 2**14, 0)`` (``y`` is at least 1/2:
    the few steps below it near ``u = 0``, where i-exp gives ``e`` just above 1, are 0, so
    ``sigmoid(0)`` is 1/2 and ``tanh(0)`` 0 exactly)."""
    u = np.asarray(u, dtype=np.int64)
    e = _iexp_u(u) >> SIG_E_SHIFT
    n = _i32(e * -SIG_ME) >> SIG_BITS
    d = n - (1 << SIG_BITS)
    y0 = (_i32(_i32((_i32(n * SIG_BETA) >> SIG_BITS) + SIG_ALPHA) * d) >> SIG_BITS) + SIG_GAMMA
    t = (_i32(y0 * d) >> SIG_BITS) + (2 << SIG_BITS)
    return np.maximum((_i32(y0 * t) >> SIG_BITS) - (1 << (SIG_BITS - 1)), 0)


def logistic_ref(kind, x, attrs):
    """``sigmoid`` (Q15: scale ``2**-15``) or ``tanh`` (scale ``2**-14``) of ``x``, int32:
    ``t = clip(x, -clip, clip) * mult``, ``m = t >> 31``, ``u = ((t ^ m) - m) >> shift``
    (``|t| >> shift``), ``w =`` :func:`logistic_of_u` ``(u)``, ``(w ^ m) - m`` (``sgn(x) w``),
    plus ``2**14`` for sigmoid."""
    x = np.asarray(x)
    mult, shift, clip = attrs["mult"], attrs["shift"], attrs["clip"]
    t = _i32(np.clip(x.astype(np.int64), -clip, clip) * mult)
    m = t >> 31
    u = ((t ^ m) - m) >> shift
    w = logistic_of_u(u)
    out = (w ^ m) - m + ((1 << (SIG_BITS - 1)) if kind == "sigmoid" else 0)
    return _i32(out).astype(np.int32)


def sigmoid_ref(x, attrs):
    """Sigmoid, Q15 (:func:`logistic_ref`)."""
    return logistic_ref("sigmoid", x, attrs)


def tanh_ref(x, attrs):
    """tanh, scale ``2**-14`` (:func:`logistic_ref`)."""
    return logistic_ref("tanh", x, attrs)


# --- LayerNorm and RMSNorm -------------------------------------------------------------------

def norm_consts(kind, length):
    """``(lo, hi, v, n_c)`` of ``layer_norm`` or ``rms_norm`` over rows of ``length``: the
    saturation bounds of the shifted input, the right shift of each square (``v =
    bit_length(length) - 1``, so a row's sum of squares stays below 2**31) and ``N_C =
    round(sqrt(length / 2**v) * 2**NORM_ONE)``."""
    bits = NORM_BITS if kind == "layer_norm" else NORM_BITS + 1
    lo, hi = (-(1 << bits), (1 << bits) - 1) if kind == "layer_norm" else (
        -((1 << bits) - 1), (1 << bits) - 1)
    v = length.bit_length() - 1
    return lo, hi, v, round(math.sqrt(length / (1 << v)) * (1 << NORM_ONE))


def _norm_params(kind, input_scale, input_absmax, length, weight_dtype, eps):
    input_scale = _scale(input_scale)
    if not (isinstance(input_absmax, int | float) and math.isfinite(input_absmax)
            and input_absmax >= 0):
        raise ValueError(f"input_absmax must be a non-negative finite number, not "
                         f"{input_absmax!r}")
    if not isinstance(length, int) or not 1 <= length <= MAX_LENGTH:
        raise ValueError(f"length must be an integer from 1 to {MAX_LENGTH}, not {length!r}")
    if weight_dtype not in ("int8", "int16", "int32"):
        raise ValueError(f"weight_dtype must be int8, int16 or int32, not {weight_dtype!r}")
    if not (isinstance(eps, int | float) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a non-negative finite number, not {eps!r}")
    lo, hi, v, _ = norm_consts(kind, length)
    shift = max(-NORM_BITS, math.ceil(input_absmax / input_scale).bit_length()
                - hi.bit_length())
    frac = _max_frac(length, weight_dtype)
    xs = input_scale * 2.0 ** shift           # scale of the shifted input
    q_eps = min(1 << 30, round(eps * length / (xs * xs * (1 << v))))
    return {"shift": shift, "frac": frac, "eps": q_eps}


def _max_frac(length, weight_dtype):
    """The most fraction bits of the normalized value with ``|z * w| <= 2**30`` for every
    weight of ``weight_dtype``; raises ``ValueError`` if none has."""
    wmax = -int(np.iinfo(weight_dtype).min)
    frac = MAX_FRAC
    while frac >= 0 and _z_max(length, frac) * wmax > 1 << 30:
        frac -= 1
    if frac < 0:
        raise ValueError(f"{weight_dtype} weights are too wide for rows of {length} (the "
                         f"normalized value times a weight must stay within 2**30): use int8 "
                         f"or int16 weights")
    return frac


def _z_max(length, frac):
    """Largest ``|z|`` (the normalized value, ``frac`` fraction bits): ``ceil(sqrt(length))``
    units."""
    return (math.isqrt(length - 1) + 1) << frac


def layer_norm_params(input_scale, input_absmax, length, weight_dtype="int8", eps=1e-5):
    """Attributes of ``layer_norm`` over rows of ``length`` for an input of scale
    ``input_scale`` whose values stay within ``input_absmax`` (calibrated), weights of
    ``weight_dtype`` and ``eps`` (as torch's): ``shift`` (the input is shifted right, or left
    for a negative shift, so that ``input_absmax`` fills :data:`NORM_BITS` bits:
    :func:`shift_in`), ``frac`` (fraction bits of the normalized
    value: the most with nothing leaving int32 when multiplied by a weight) and ``eps``
    (``eps`` in the scale of the sums of squares). The result's scale is ``weight_scale /
    2**frac`` (:func:`output_scale`); the bias must be quantized to it."""
    return _norm_params("layer_norm", input_scale, input_absmax, length, weight_dtype, eps)


def rms_norm_params(input_scale, input_absmax, length, weight_dtype="int8", eps=1e-6):
    """Attributes of ``rms_norm``, as :func:`layer_norm_params`."""
    return _norm_params("rms_norm", input_scale, input_absmax, length, weight_dtype, eps)


def check_norm(kind, attrs, length, weight_dtype):
    """Validate the attributes of ``layer_norm`` or ``rms_norm`` over rows of ``length`` with
    weights of ``weight_dtype``."""
    if length > MAX_LENGTH:
        raise ValueError(f"rows must be at most {MAX_LENGTH} long, not {length}")
    _Check.int(attrs, "shift", -NORM_BITS, 31)
    frac = _Check.int(attrs, "frac", 0, MAX_FRAC)
    _Check.int(attrs, "eps", 0, 1 << 30, default=0)
    most = _max_frac(length, weight_dtype)
    if frac > most:
        raise ValueError(f"attribute 'frac' must be at most {most} for rows of {length} and "
                         f"{weight_dtype} weights (the normalized value times a weight must "
                         f"stay within 2**30), not {frac}")


def shift_in(x, shift, lo, hi):
    """The shifted, saturated input of a norm: ``clip(x >> shift, lo, hi)``, or for a
    negative ``shift = -k`` ``clip(x, lo >> k, hi >> k) << k`` (an input of few bits is
    spread over :data:`NORM_BITS`)."""
    x = np.asarray(x, dtype=np.int64)
    if shift >= 0:
        return np.clip(x >> shift, lo, hi)
    return np.clip(x, lo >> -shift, hi >> -shift) << -shift


def normalize(t):
    """``(T', e)``: ``T' = T * 4**e`` in ``[2**28, 2**30)`` (``e`` from -1 to 14; ``T >= 1``), as
    the CU's scalar loop brings a row's sum of squares to 30 bits."""
    t = np.asarray(t, dtype=np.int64).copy()
    e = np.zeros_like(t)
    high = t >= NORM_HI
    t[high] >>= 2
    e[high] = -1
    while np.any(t < NORM_LO):
        low = t < NORM_LO
        t[low] <<= 2
        e[low] += 1
    return t, e


def isqrt(t):
    """``floor(sqrt(t))`` of each element (the CU's loop sets one bit at a time)."""
    t = np.asarray(t, dtype=np.int64)
    return np.array([math.isqrt(int(v)) for v in t.reshape(-1)], dtype=np.int64).reshape(t.shape)


def _norm(kind, x, w, b, attrs):
    x = np.asarray(x)
    shape = x.shape
    c = shape[-1]
    lo, hi, v, n_c = norm_consts(kind, c)
    frac, eps = attrs["frac"], attrs.get("eps", 0)
    xs = shift_in(_rows(x), attrs["shift"], lo, hi)
    if kind == "layer_norm":
        mu = (xs.sum(axis=1, keepdims=True) + (c << NORM_BITS)) // c - (1 << NORM_BITS)
        d = _i32(xs - mu)
    else:
        d = xs
    q = _i32(((d * d) >> v).sum(axis=1, keepdims=True))
    t = np.maximum(np.minimum(q, INT32_MAX - eps) + eps, 1)
    t, e = normalize(t)
    r = n_c // isqrt(t)
    z = _i32(d * r) >> (NORM_ONE - frac - e)
    zm = _z_max(c, frac)
    z = np.clip(z, -zm, zm)
    out = _i32(z * np.asarray(w, dtype=np.int64).reshape(1, -1))
    if b is not None:       # int32 wraparound, as the IR's add (|z * w| <= 2**30)
        out = out + np.asarray(b, dtype=np.int64).reshape(1, -1)
    return out.reshape(shape).astype(np.int64).astype(np.int32)


def layer_norm_ref(x, w, b, attrs):
    """LayerNorm over the last axis, int32 of scale ``weight_scale / 2**frac``.

    Per row of ``C``: ``x' =`` :func:`shift_in` ``(x, shift, -2**14, 2**14 - 1)``, ``mu =
    floor(sum(x') / C)``, ``d = x' - mu``, ``T = max(sum((d * d) >> v) + eps, 1)``
    (:func:`norm_consts`), ``(T', e) =`` :func:`normalize` ``(T)``, ``R = N_C //
    isqrt(T')``, ``z = clip((d * R) >> (29 - frac - e), -z_max, z_max)`` (``d / sigma``
    with ``frac`` fraction bits), ``z * w + b`` (``|z * w| <= 2**30``; adding ``b`` wraps
    around like the IR's ``add``).
    """
    return _norm("layer_norm", x, w, b, attrs)


def rms_norm_ref(x, w, attrs):
    """RMSNorm over the last axis: :func:`layer_norm_ref` without the mean and the bias
    (``x'`` saturated to ``[-(2**15 - 1), 2**15 - 1]``, ``d = x'``)."""
    return _norm("rms_norm", x, w, None, attrs)


# --- embedding -------------------------------------------------------------------------------

def embedding_ref(table, idx):
    """Rows of ``table`` (``(V, D)``) chosen by ``idx`` (int32, any shape; clamped to ``[0,
    V - 1]``): shape ``idx.shape + (D,)``, the table's dtype."""
    table = np.asarray(table)
    i = np.clip(np.asarray(idx, dtype=np.int64), 0, table.shape[0] - 1)
    return table[i]


# --- scales ----------------------------------------------------------------------------------

def _scale(s):
    if not (isinstance(s, int | float) and math.isfinite(s) and s > 0):
        raise ValueError(f"input_scale must be a positive finite number, not {s!r}")
    return float(s)


def output_scale(kind, attrs, weight_scale=None):
    """The float scale of the integer result of op ``kind`` with ``attrs``: ``exp``
    :data:`EXP_SCALE`; ``softmax`` ``2**-out_bits``; ``gelu``, ``silu`` ``S_t / (2 q)``
    (about ``alpha S_t^3 2**14``); ``layer_norm``, ``rms_norm`` ``weight_scale / 2**frac``;
    ``sigmoid`` ``2**-15``, ``tanh`` ``2**-14``."""
    if kind == "exp":
        return EXP_SCALE
    if kind == "softmax":
        return 2.0 ** -attrs["out_bits"]
    if kind in ACT_POLY:
        _, c = ACT_POLY[kind]
        return c / (1 << ACT_BITS) * 0.5 / act_consts(kind)[2]
    if kind in ("layer_norm", "rms_norm"):
        return _scale(weight_scale) / (1 << attrs["frac"])
    if kind in LOGISTIC:
        return 2.0 ** -(SIG_BITS + 1 - LOGISTIC[kind])
    raise ValueError(f"op kind {kind!r} has no integer scale rule here")
