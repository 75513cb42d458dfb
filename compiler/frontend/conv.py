"""Convolutions, batch norms and pooling in the torch.export importer.

The importer (:mod:`rdakit.compiler.frontend.importer`) hands every node to :func:`dispatch`,
which takes the ops of :data:`CONV_OPS` and passes the others on to the importer's own walk.

**Layout.** A 4-D activation ``(N, C, H, W)`` computed here is one 2-D IR tensor of
``(N * H * W, C)``: rows are spatial positions (row-major over ``n, h, w``), columns are
channels (NHWC). In that layout every tap of a kernel is a constant shift of the rows: the tap
``(i, j)`` of a convolution with padding ``p`` and dilation ``d`` reads, for the output
position of row ``r``, the input row ``r + (i * d - p) * W + (j * d - p)``. So a tap is a
``slice`` of rows and a ``concat`` with a constant fill (zeros, or ``-127`` for max-pooling)
where the shift runs off the tensor, and the positions whose source falls outside the image
(the padding, and the rows that would wrap into the neighbouring image row) are masked by a
``(N * H * W, 1)`` constant: a ``mul`` by 0/1 and a ``clip`` for a convolution, a ``min`` with
127/-127 for max-pooling. Each op is a few long streams once lowered (row slices and row
concatenations are one contiguous stream each; a column-broadcast operand is one stream per row).

**Convolution** (im2col): the taps concatenated along columns give the ``(N * H * W, K * K *
C_in)`` matrix, multiplied by the ``(K * K * C_in, C_out)`` weights (int8 per output channel,
int32 accumulators) and requantized per output channel like a linear layer. A stride or an
output smaller than the input picks the output positions by a selection matmul per image (a
0/1 ``(H_out * W_out, H * W)`` constant) before the weights. Batch norm that follows a
convolution (eval mode: running statistics) is folded into its weights and bias before they
are quantized; any other batch norm is a per-channel affine, one requantization.

**Pooling**: max-pooling is the elementwise ``max`` of its masked taps, average pooling their
sum requantized by ``1 / count`` (a scale change), adaptive average pooling to ``1 x 1`` (and
``mean``/``sum``/``amax`` over ``H, W``) one matmul by a 0/1 constant that sums each image's
rows (a reduce to ``1 x 1`` per image).

**Elementwise ops** (``relu``, ``add`` of the residual, ...) on such an activation run in its
NHWC layout (:func:`native`) instead of the torch fold ``(N * C * H, W)``, which would cut it
into one copy per row. An image input that feeds a convolution is declared as
``(N * C, H * W)`` (:func:`image_fold`: the same row-major bytes as the NCHW tensor), from
which the NHWC operand is one transpose and slice per image.
"""

import dataclasses
import math
import operator

import numpy as np

from rdakit.compiler.frontend import importer as _imp
from rdakit.compiler.frontend.aten import op_name

__all__ = ["CONV_OPS", "NATIVE_OPS", "dispatch", "image_fold", "native", "fold_batch_norm"]

CONVOLUTION = "aten.convolution.default"
BATCH_NORM = "aten._native_batch_norm_legit_no_training.default"
MAX_POOL = "aten.max_pool2d_with_indices.default"
AVG_POOL = "aten.avg_pool2d.default"
ADAPTIVE_AVG = ("aten._adaptive_avg_pool2d.default", "aten.adaptive_avg_pool2d.default")

#: The aten ops this module handles.
CONV_OPS = (CONVOLUTION, BATCH_NORM, MAX_POOL, AVG_POOL) + ADAPTIVE_AVG

#: Elementwise ops run in the NHWC layout of a 4-D operand computed here (:func:`native`).
NATIVE_OPS = frozenset({
    "aten.relu.default", "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor",
    "aten.div.Tensor", "aten.neg.default", "aten.clamp.default", "aten.hardtanh.default",
    "aten.rsub.Scalar", "aten.gelu.default", "aten.silu.default",
})

#: Reductions over ``H, W`` done per image in the NHWC layout.
_SPATIAL_REDUCE = {"aten.mean.dim": "mean", "aten.sum.dim_IntList": "sum",
                   "aten.amax.default": "max"}

_NHWC = (0, 2, 3, 1)
_NCHW = (0, 3, 1, 2)


@dataclasses.dataclass(eq=False)
class _State:
    """Per import: constants shared between ops (masks, fills, selections) and the batch
    norms folded into their convolution."""

    consts: dict = dataclasses.field(default_factory=dict)
    folded: set = dataclasses.field(default_factory=set)


def _state(walker):
    state = getattr(walker, "conv_state", None)
    if state is None:
        state = walker.conv_state = _State()
    return state


def _const(walker, key, make, stem):
    """A constant built once per import (by ``key``)."""
    consts = _state(walker).consts
    if key not in consts:
        consts[key] = walker.b.const(make(), stem)
    return consts[key]


def image_fold(node, shape):
    """The 2-D IR shape of the graph input ``node`` (an FX placeholder of torch ``shape``):
    ``(N * C, H * W)`` for a 4-D input that a convolution reads (the NCHW bytes as they are),
    else None (the importer's default fold)."""
    if len(shape) != 4:
        return None
    for user in node.users:
        if op_name(user.target) == CONVOLUTION and user.args and user.args[0] is node:
            n, c, h, w = shape
            return (n * c, h * w)
    return None


def dispatch(walker, node, args, kw):
    """The value of ``node``: the ops of :data:`CONV_OPS` here, elementwise ops and spatial
    reductions of an NHWC activation in its layout, everything else by the importer."""
    name = op_name(node.target)
    if name == CONVOLUTION:
        return convolution(walker, node, kw)
    if name == BATCH_NORM:
        return batch_norm(walker, node, kw)
    if name == MAX_POOL:
        return max_pool(walker, node, kw)
    if name == AVG_POOL:
        return avg_pool(walker, node, kw)
    if name in ADAPTIVE_AVG:
        return adaptive_avg_pool(walker, node, kw)
    if name in NATIVE_OPS:
        value = native(walker, node, args, kw)
        if value is not None:
            return value
    if name in _SPATIAL_REDUCE:
        value = spatial_reduce(walker, node, kw, _SPATIAL_REDUCE[name])
        if value is not None:
            return value
    return walker.node(node, args, kw)


# --- layout helpers ---------------------------------------------------------------------------

def _nhwc_addr(x):
    """The addresses of a 4-D activation as its ``(N * H * W, C)`` NHWC matrix."""
    a = np.transpose(x.addr, _NHWC)
    return np.ascontiguousarray(a).reshape(-1, a.shape[-1])


def _is_native(walker, x):
    """Whether ``x`` (4-D) is an IR tensor in NHWC order (a free view) and not already one in
    the torch fold."""
    if not isinstance(x, _imp._Act) or x.addr.ndim != 4 or x.scale is None:
        return False
    a = _nhwc_addr(x)
    fold = np.ascontiguousarray(x.addr).reshape(_imp._fold2d(x.shape))
    memo = walker.b.memo
    return (a.shape, a.tobytes()) in memo and (fold.shape, fold.tobytes()) not in memo


def _nchw_act(walker, node, p, shape, scale):
    """The activation of the IR tensor ``node`` of ``p`` NHWC rows, as the torch ``shape``."""
    n, c, h, w = shape
    addr = walker.b.base(node, p, c).reshape(n, h, w, c)
    return _imp._Act(np.transpose(addr, _NCHW), scale)


def _check_act(x, what="input"):
    if not isinstance(x, _imp._Act):
        _imp._refuse(f"the {what} must be computed from the inputs")
    if x.scale is None:
        _imp._refuse("an integer tensor (indices) cannot be an operand here")
    if x.addr.ndim != 4:
        _imp._refuse(f"only 2-D images are supported: the {what} must be 4-D (N, C, H, W), "
                     f"not of shape {list(x.shape)}")


def _pair(value, what):
    v = [int(value)] if isinstance(value, int) else [int(e) for e in value]
    if len(v) == 1:
        v = v * 2
    if len(v) != 2:
        _imp._refuse(f"{what} must have 1 or 2 entries, not {list(value)}")
    return tuple(v)


@dataclasses.dataclass(frozen=True)
class _Window:
    """A sliding window over ``(N, H, W)`` images: kernel, stride, padding, dilation, and the
    output size."""

    n: int
    h: int
    w: int
    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple

    @property
    def out(self):
        return tuple((size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, s, p, d in zip(
            (self.h, self.w), self.kernel, self.stride, self.padding, self.dilation,
            strict=True))

    @property
    def rows(self):
        return self.n * self.h * self.w

    def check(self, what):
        for name, v, low in (("kernel_size", self.kernel, 1), ("stride", self.stride, 1),
                             ("padding", self.padding, 0), ("dilation", self.dilation, 1)):
            if min(v) < low:
                _imp._refuse(f"{what} {name} must be {low} or more, not {list(v)}")
        for p, d, k in zip(self.padding, self.dilation, self.kernel, strict=True):
            if 2 * p > d * (k - 1):
                _imp._refuse(f"{what} padding {list(self.padding)} is more than half the "
                             f"kernel's span (kernel {list(self.kernel)}, dilation "
                             f"{list(self.dilation)}): not supported")
        if min(self.out) < 1:
            _imp._refuse(f"{what} of an image of {self.h}x{self.w} with kernel "
                         f"{list(self.kernel)} has no output")

    def taps(self):
        """``(i, j, shift, valid)`` per tap: the row shift and the (rows,) bool mask of the
        positions whose source is inside the image."""
        hh, ww = np.meshgrid(np.arange(self.h), np.arange(self.w), indexing="ij")
        for i in range(self.kernel[0]):
            dh = i * self.dilation[0] - self.padding[0]
            for j in range(self.kernel[1]):
                dw = j * self.dilation[1] - self.padding[1]
                ok = ((hh + dh >= 0) & (hh + dh < self.h) & (ww + dw >= 0) & (ww + dw < self.w))
                yield i, j, dh * self.w + dw, np.tile(ok.reshape(-1), self.n)

    def strided(self):
        """Whether the output positions are not every input position (a selection)."""
        return self.out != (self.h, self.w) or self.stride != (1, 1)


def _shift(walker, x, rows, cols, shift, fill, stem):
    """Rows ``r + shift`` of the IR tensor ``x`` (rows x cols), ``fill`` past its ends."""
    if shift == 0:
        return x
    k = min(abs(shift), rows)
    pad = _const(walker, ("fill", k, cols, fill),
                 lambda: np.full((k, cols), fill, np.int8), f"fill_{fill}_{k}x{cols}")
    if k == rows:
        return pad
    b = walker.b
    if shift > 0:
        body = b.add("slice", x, stem=f"{stem}_s", axis=0, start=k, stop=rows)
        return b.add("concat", body, pad, stem=f"{stem}_cat", axis=0)
    body = b.add("slice", x, stem=f"{stem}_s", axis=0, start=0, stop=rows - k)
    return b.add("concat", pad, body, stem=f"{stem}_cat", axis=0)


def _masked_taps(walker, x, win, cols, stem, *, fill, kind):
    """The taps of ``win`` over the NHWC tensor ``x``: ``[(i, j, node)]``, the taps that see no
    position of the image left out. ``kind`` "zero" masks by a 0/1 ``mul`` and a ``clip``
    (int8), "sum" by the ``mul`` alone (int32), "max" by a ``min`` with 127/-127."""
    b = walker.b
    taps = []
    for i, j, shift, ok in win.taps():
        if not ok.any():
            continue
        t = _shift(walker, x, win.rows, cols, shift, fill, f"{stem}_t{i}{j}")
        if not ok.all():
            key = (kind == "max", win.n, win.h, win.w, shift, ok.tobytes())
            if kind == "max":
                m = _const(walker, ("mask",) + key, lambda ok=ok: np.where(
                    ok, _imp.QMAX, -_imp.QMAX).astype(np.int8).reshape(-1, 1),
                    f"maxmask_{abs(shift)}")
                t = b.add("min", t, m, stem=f"{stem}_t{i}{j}_m")
            else:
                m = _const(walker, ("mask",) + key, lambda ok=ok: ok.astype(np.int8).reshape(
                    -1, 1), f"mask_{abs(shift)}")
                t = b.add("mul", t, m, stem=f"{stem}_t{i}{j}_m")
                if kind == "zero":
                    t = b.add("clip", t, stem=f"{stem}_t{i}{j}_q", lo=-_imp.QMAX, hi=_imp.QMAX,
                              dtype="int8")
        taps.append((i, j, t))
    return taps


def _select(walker, x, win, cols, stem):
    """The rows of the output positions of ``win`` from the NHWC tensor ``x`` (every input
    position, rows x cols): one selection matmul per image (int32), stacked."""
    b = walker.b
    ho, wo = win.out
    hw = win.h * win.w

    def make():
        s = np.zeros((ho * wo, hw), np.int8)
        src = ((np.arange(ho) * win.stride[0])[:, None] * win.w
               + (np.arange(wo) * win.stride[1])[None, :])
        s[np.arange(ho * wo), src.reshape(-1)] = 1
        return s
    sel = _const(walker, ("select", win.h, win.w, ho, wo, win.stride), make,
                 f"select_{win.h}x{win.w}_{ho}x{wo}")
    parts = []
    for i in range(win.n):
        img = x if win.n == 1 else b.add("slice", x, stem=f"{stem}_img{i}", axis=0,
                                         start=i * hw, stop=(i + 1) * hw)
        parts.append(b.add("matmul", sel, img, stem=f"{stem}_sel{i}"))
    return parts[0] if len(parts) == 1 else b.add("concat", *parts, stem=f"{stem}_sel",
                                                   axis=0)


# --- convolution and batch norm ----------------------------------------------------------------

def _reads_input(walker, fx_node):
    """Whether an FX node's value depends on a graph input (an IR input of the builder)."""
    inputs = {n for n, k in walker.b.g.nx.nodes(data="kind") if k == "input"}
    stack, seen = [fx_node], set()
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if n.op == "placeholder" and n.name in inputs:
            return True
        stack.extend(n.all_input_nodes)
    return False


def _bn_args(node):
    """``(weight, bias, mean, var, eps)`` FX arguments of a batch norm node."""
    args = list(node.args) + [None] * 7
    kw = node.kwargs
    names = ("input", "weight", "bias", "running_mean", "running_var", "momentum", "eps")
    vals = {k: kw.get(k, args[i]) for i, k in enumerate(names)}
    return vals["weight"], vals["bias"], vals["running_mean"], vals["running_var"], vals["eps"]


def _bn_affine(walker, node, channels):
    """The per-channel ``(a, c)`` of a batch norm node: ``y = a * x + c`` (float64), or None if
    a statistic or parameter is computed from the inputs."""
    weight, bias, mean, var, eps = _bn_args(node)
    values = []
    for v, default in ((weight, 1.0), (bias, 0.0), (mean, None), (var, None)):
        if v is None:
            values.append(np.full(channels, default))
            continue
        if _reads_input(walker, v):
            return None
        values.append(np.asarray(walker.cal[v.name], np.float64).reshape(channels))
    gamma, beta, mu, sigma2 = values
    a = gamma / np.sqrt(sigma2 + float(eps))
    return a, beta - mu * a


def fold_batch_norm(weight, bias, scale, shift):
    """A convolution's float ``(weight, bias)`` with the batch norm ``y = scale * x + shift``
    (per output channel, :func:`_bn_affine`) after it folded in: ``conv(x, weight', bias') ==
    bn(conv(x, weight, bias))``."""
    weight = np.asarray(weight, np.float64)
    scale = np.asarray(scale, np.float64)
    return (weight * scale.reshape((-1,) + (1,) * (weight.ndim - 1)),
            np.asarray(bias, np.float64) * scale + shift)


def _foldable_bn(walker, node, channels):
    """The batch norm that only reads ``node`` (a convolution) and can be folded into it, with
    its affine, or (None, None)."""
    users = list(node.users)
    if len(users) != 1 or op_name(users[0].target) != BATCH_NORM or users[0].args[0] is not node:
        return None, None
    affine = _bn_affine(walker, users[0], channels)
    return (users[0], affine) if affine is not None else (None, None)


def convolution(walker, node, kw):
    """``aten.convolution``: 2-D, groups 1, not transposed; im2col in NHWC and a matmul by
    the int8 weights (per output channel), a following batch norm folded in first."""
    x, weight, bias = kw["input"], kw["weight"], kw.get("bias")
    _check_act(x)
    if kw.get("transposed"):
        _imp._refuse("transposed convolutions are not supported")
    if int(kw.get("groups", 1)) != 1:
        _imp._refuse(f"groups={kw['groups']} is not supported (only groups=1)")
    for what, v in (("weight", weight), ("bias", bias)):
        if isinstance(v, _imp._Act):
            _imp._refuse(f"the {what} must be a constant, not a tensor computed from the "
                         f"inputs")
    w = np.asarray(weight.value, np.float64)
    n, c, h, wd = x.shape
    cout, cin, kh, kw_ = w.shape
    if cin != c:
        _imp._refuse(f"the weight has {cin} input channels, the input {c}")
    win = _Window(n, h, wd, (kh, kw_), _pair(kw["stride"], "stride"),
                  _pair(kw["padding"], "padding"), _pair(kw["dilation"], "dilation"))
    win.check("the convolution's")
    b = np.zeros(cout) if bias is None else np.asarray(bias.value, np.float64).reshape(cout)
    bn, affine = _foldable_bn(walker, node, cout)
    if bn is not None:
        w, b = fold_batch_norm(w, b, *affine)
        _state(walker).folded.add(bn.name)
        scale = _imp._scale_of(walker.cal[bn.name][0])
    else:
        scale = walker.value_scale(node)
    xin = walker.b.block(_nhwc_addr(x))
    taps = _masked_taps(walker, xin, win, c, node.name, fill=0, kind="zero")
    # Weights as (taps * C_in, C_out), the rows in the order of the concatenated taps.
    wmat = np.concatenate([w[:, :, i, j].T for i, j, _ in taps], axis=0)
    bld = walker.b
    cols = taps[0][2] if len(taps) == 1 else bld.add("concat", *(t for _, _, t in taps),
                                                    stem=f"{node.name}_cols", axis=1)
    if win.strided():
        cols = _select(walker, cols, win, len(taps) * c, node.name)
    wq, sw = _imp._per_channel(wmat.T)                       # (C_out, K), scale per column
    wnode = bld.const(np.ascontiguousarray(wq.T), f"{node.name}_w")
    bound = _imp.QMAX * np.abs(wq.astype(np.int64)).sum(axis=1)
    acc = bld.add("matmul", cols, wnode, stem=f"{node.name}_acc")
    ho, wo = win.out
    rows = n * ho * wo
    out = bld.requant([(acc, x.scale * sw, bound)], scale, bias=b, stem=node.name,
                      shape2d=(rows, cout))
    return _nchw_act(walker, out, rows, (n, cout, ho, wo), scale)


def _only_first_result(node, what):
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] != 0:
            _imp._refuse(f"only the output of {what} is supported, not its other results "
                         f"(read by {user.name})")


def batch_norm(walker, node, kw):
    """Eval-mode batch norm: already folded into the convolution it follows, else a
    per-channel affine requantized once (the channels as columns)."""
    _only_first_result(node, "batch norm")
    x = kw["input"]
    if node.name in _state(walker).folded:
        return [x, None, None]
    if not isinstance(x, _imp._Act) or x.scale is None or x.addr.ndim < 2:
        _imp._refuse("the input must be a float tensor of shape (N, C, ...) computed from the "
                     "inputs")
    c = x.shape[1]
    affine = _bn_affine(walker, node, c)
    if affine is None:
        _imp._refuse("the weight, bias and running statistics must be constants")
    a, shift = affine
    moved = np.moveaxis(x.addr, 1, -1)
    flat = np.ascontiguousarray(moved).reshape(-1, c)
    scale = _imp._scale_of(walker.cal[node.name][0])
    rows = flat.shape[0]
    out = walker.b.requant([(walker.b.block(flat), x.scale * a, _imp.QMAX)], scale, bias=shift,
                           stem=node.name, shape2d=(rows, c))
    addr = walker.b.base(out, rows, c).reshape(moved.shape)
    return [_imp._Act(np.moveaxis(addr, -1, 1), scale), None, None]


# --- pooling ----------------------------------------------------------------------------------

def _pool_window(x, kw, what):
    kernel = _pair(kw["kernel_size"], "kernel_size")
    stride = kernel if not kw.get("stride") else _pair(kw["stride"], "stride")
    n, _, h, w = x.shape
    win = _Window(n, h, w, kernel, stride, _pair(kw.get("padding", 0), "padding"),
                  _pair(kw.get("dilation", 1), "dilation"))
    if kw.get("ceil_mode"):
        _imp._refuse("ceil_mode=True is not supported")
    win.check(what)
    return win


def max_pool(walker, node, kw):
    """``max_pool2d``: the elementwise ``max`` of the taps (positions outside the image count
    as -127), the output positions selected; same scale."""
    _only_first_result(node, "max_pool2d_with_indices (the indices)")
    x = kw["input"]
    _check_act(x)
    win = _pool_window(x, kw, "max_pool2d")
    c = x.shape[1]
    b = walker.b
    xin = b.block(_nhwc_addr(x))
    taps = _masked_taps(walker, xin, win, c, node.name, fill=-_imp.QMAX, kind="max")
    acc = taps[0][2]
    for i, j, t in taps[1:]:
        acc = b.add("max", acc, t, stem=f"{node.name}_max{i}{j}")
    if win.strided():
        acc = b.add("clip", _select(walker, acc, win, c, node.name), stem=f"{node.name}_q",
                    lo=-_imp.QMAX, hi=_imp.QMAX, dtype="int8")
    n = x.shape[0]
    ho, wo = win.out
    return [_nchw_act(walker, acc, n * ho * wo, (n, c, ho, wo), x.scale), None]


def _sum_taps(walker, x, win, stem):
    b = walker.b
    c = x.shape[1]
    xin = b.block(_nhwc_addr(x))
    taps = _masked_taps(walker, xin, win, c, stem, fill=0, kind="sum")
    acc = taps[0][2]
    for i, j, t in taps[1:]:
        acc = b.add("add", acc, t, stem=f"{stem}_sum{i}{j}")
    if win.strided():
        acc = _select(walker, acc, win, c, stem)
    return acc, len(taps)


def avg_pool(walker, node, kw):
    """``avg_pool2d``: the sum of the taps (int32), requantized by ``1 / count``."""
    x = kw["input"]
    _check_act(x)
    win = _pool_window(x, kw, "avg_pool2d")
    n, c = x.shape[:2]
    ho, wo = win.out
    rows = n * ho * wo
    acc, taps = _sum_taps(walker, x, win, node.name)
    if kw.get("divisor_override"):
        per = x.scale / float(kw["divisor_override"])
    elif kw.get("count_include_pad", True) or win.padding == (0, 0):
        per = x.scale / (win.kernel[0] * win.kernel[1])
    else:
        counts = sum(ok.astype(np.int64) for _, _, _, ok in win.taps())
        hw = counts.reshape(n, win.h, win.w)[:, ::win.stride[0], ::win.stride[1]][:, :ho, :wo]
        per = (x.scale / hw.reshape(-1, 1)).astype(np.float64)
    scale = walker.value_scale(node)
    out = walker.b.requant([(acc, per, _imp.QMAX * taps)], scale, stem=node.name,
                           shape2d=(rows, c))
    return _nchw_act(walker, out, rows, (n, c, ho, wo), scale)


def _global(walker, node, x, kind, scale, out_shape):
    """Sum (or max) over ``H, W`` of each image: one matmul by a 0/1 ``(N, N * H * W)``
    constant (a ``reduce_max`` per image for max), requantized for a sum or mean."""
    n, c, h, w = x.shape
    b = walker.b
    xin = b.block(_nhwc_addr(x))
    if kind == "max":
        parts = [b.add("reduce_max", xin if n == 1 else b.add(
            "slice", xin, stem=f"{node.name}_img{i}", axis=0, start=i * h * w,
            stop=(i + 1) * h * w), stem=f"{node.name}_max{i}", axis=0) for i in range(n)]
        out = parts[0] if n == 1 else b.add("concat", *parts, stem=node.name, axis=0)
        scale = x.scale
    else:
        ones = _const(walker, ("pool", n, h * w), lambda: np.kron(
            np.eye(n, dtype=np.int8), np.ones((1, h * w), np.int8)), f"pool_{n}x{h * w}")
        acc = b.add("matmul", ones, xin, stem=f"{node.name}_acc")
        per = x.scale / (h * w if kind == "mean" else 1)
        out = b.requant([(acc, per, _imp.QMAX * h * w)], scale, stem=node.name, shape2d=(n, c))
    addr = b.base(out, n, c)
    return _imp._Act(addr.reshape(out_shape), scale)


def adaptive_avg_pool(walker, node, kw):
    """``adaptive_avg_pool2d``: to ``1 x 1`` one matmul summing each image's rows; to a size
    that divides the input, an average pooling with kernel = stride = input / output."""
    x = kw.get("input", kw.get("self"))
    _check_act(x)
    oh, ow = _pair(kw["output_size"], "output_size")
    n, c, h, w = x.shape
    scale = walker.value_scale(node)
    if (oh, ow) == (1, 1):
        return _global(walker, node, x, "mean", scale, (n, c, 1, 1))
    if oh < 1 or ow < 1 or h % oh or w % ow:
        _imp._refuse(f"output_size {[oh, ow]} must divide the input's {h}x{w} (or be 1x1)")
    k = (h // oh, w // ow)
    return avg_pool(walker, node, {"input": x, "kernel_size": k, "stride": k})


def spatial_reduce(walker, node, kw, kind):
    """``mean``/``sum``/``amax`` over ``H, W`` of an NHWC activation, per image; None for any
    other reduction (the importer's)."""
    x = kw.get("input", kw.get("self"))
    if not _is_native(walker, x):
        return None
    dims = kw.get("dim")
    if dims is None or isinstance(dims, int):
        return None
    if sorted(_imp._dim(d, 4) for d in dims) != [2, 3] or kw.get("dtype") is not None:
        return None
    out_shape = tuple(np.shape(walker.cal[node.name]))
    scale = x.scale if kind == "max" else walker.value_scale(node)
    return _global(walker, node, x, kind, scale, out_shape)


# --- elementwise ops in the NHWC layout --------------------------------------------------------

def _to_nhwc(value, shape):
    """An operand of an elementwise op of output ``shape`` (4-D) in the NHWC 2-D layout:
    activations of that shape as their NHWC matrix, constants as a row (per channel), a
    scalar, or the full matrix; None if it cannot be."""
    rows = math.prod(shape) // shape[1]
    if isinstance(value, _imp._Act):
        if value.shape != tuple(shape):
            return None
        return _imp._Act(_nhwc_addr(value), value.scale, value.dtype)
    if isinstance(value, _imp._Const):
        v = np.asarray(value.value)
        if v.ndim > 4:
            return None
        if v.size <= 1:
            return value
        v4 = np.transpose(v.reshape((1,) * (4 - v.ndim) + v.shape), _NHWC)
        if v4.shape[:3] == (1, 1, 1):
            return _imp._Const(v4.reshape(1, v4.shape[3]))
        return _imp._Const(np.ascontiguousarray(np.broadcast_to(
            v4, (shape[0], shape[2], shape[3], shape[1]))).reshape(rows, shape[1]))
    return value


def native(walker, node, args, kw):
    """An elementwise op (:data:`NATIVE_OPS`) whose activation operands are 4-D and in NHWC
    order, run by the importer on their ``(N * H * W, C)`` matrices (the calibrated output
    viewed alike), its result viewed back as NCHW; None if an operand is not such."""
    acts = [v for v in kw.values() if isinstance(v, _imp._Act)]
    if not acts or not _is_native(walker, acts[0]):
        return None
    shape = acts[0].shape
    moved = {}
    for k, v in kw.items():
        t = _to_nhwc(v, shape)
        if t is None:
            return None
        moved[k] = t
    saved = walker.cal[node.name]
    if np.shape(saved) != tuple(shape):
        return None
    walker.cal[node.name] = np.ascontiguousarray(np.transpose(saved, _NHWC)).reshape(
        -1, shape[1])
    try:
        out = walker.node(node, args, moved)
    finally:
        walker.cal[node.name] = saved
    n, c, h, w = shape
    addr = out.addr.reshape(n, h, w, c)
    return _imp._Act(np.transpose(addr, _NCHW), out.scale, out.dtype)
