"""Convolutions, batch norms and pooling in the torch.export importer.

The importer (:mod:`rdakit.compiler.frontend.importer`) hands every node to :func:`dispatch`,
which takes the ops of :data:`CONV_OPS` and passes the others on to the importer's own walk.

**Layout.** A 4-D activation ``(N, C, H, W)`` computed here is held NHWC: rows are spatial
positions (row-major over ``n, h, w``), columns are channels. The images are cut into groups
of at most :data:`GROUP_ROWS` positions (at least one image), one 2-D IR tensor of ``(g * H *
W, C)`` per group, and every op here works group by group (so no tensor of a batch of large
images needs more than a few thousand vector words; a batch of small images is one tensor).
In that layout every tap of a kernel is a constant shift of the rows: the tap ``(i, j)`` with
padding ``p`` and dilation ``d`` reads, for the output position of row ``r``, the input row
``r + (i * d - p) * W + (j * d - p)``. So a tap is a ``slice`` of rows and a ``concat`` with a
constant fill (zeros, or ``-127`` for max-pooling) where the shift runs off the tensor, and
the positions whose source falls outside the image (the padding, and the rows that would wrap
into the neighbouring image row or image) are masked by a ``(rows, 1)`` constant: a ``mul``
by 0/1 (and a ``clip`` back to int8 where needed), a ``min`` with 127/-127 for max-pooling.
Each op is a few long streams once lowered.

**Separable taps.** A tap's shift and mask are a horizontal part (``j``) and a vertical part
(``i``). A convolution shifts and masks the input by each horizontal tap, concatenates them
along columns (``(rows, K_w * C_in)``), and then for each kernel row ``i`` multiplies a
vertical shift of that by the ``(K_w * C_in, C_out)`` weights of the row (int8 per output
channel over the whole kernel, int32 accumulators), masking the product at the images' top and
bottom edges (a group of one image needs no mask: the fill is outside the image); the rows'
products are added and requantized per output channel like a linear layer. A kernel row wider
than :data:`CONV_K` reduction elements is cut into chunks of whole taps. Pooling is the max
(or sum) over the horizontal taps, then over the vertical taps of that. A 3x3 kernel is 2 + 2
shifts instead of 8, and 3 matmuls instead of 9 taps kept live for one (an im2col of the
suite ResNet's stem was 57,344 vector words).

**Strides.** A stride or an output smaller than the input picks the output positions after
the taps by 0/1 selection matmuls over bands of output rows (a ``slice`` of the input rows a
band reads), so no selection constant holds more than :data:`SELECT_ELEMENTS` nor reduces over
more than :data:`CONV_K`; a group's images are one tall image when every output row's source
rows stay in step (``H_out * stride == H``), else selected image by image. Batch norm that
follows a convolution (eval mode: running statistics) is folded into its weights and bias
before they are quantized; any other batch norm is a per-channel affine, one
requantization.

**Pooling**: max-pooling is the elementwise ``max`` of its masked taps, average pooling their
sum requantized by ``1 / count`` (a scale change), adaptive average pooling to ``1 x 1`` (and
``mean``/``sum``/``amax`` over ``H, W``) one matmul per group by a 0/1 constant that sums each
image's rows.

**Elementwise ops** (``relu``, ``add`` of the residual, ...) on such an activation run in its
NHWC layout (:func:`native`) instead of the torch fold ``(N * C * H, W)``, which would cut it
into one copy per row. An image input that feeds a convolution is declared as
``(N * C, H * W)`` (:func:`image_fold`: the same row-major bytes as the NCHW tensor), from
which a group's NHWC operand is one slice and transpose per image (and a concat).
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


#: The images of a batch are cut into groups of at most this many NHWC rows (positions), at
#: least one image a group, and every op of this module works group by group: no tensor of
#: the suite's ResNet (batch 8, 32x32) then needs more than a few thousand vector words, and
#: a batch of small images stays one tensor (fewer, larger streams and buffers).
GROUP_ROWS = 2048


def _group_sizes(n, h, w):
    """The number of images of each group of a batch of ``n`` images of ``h x w``."""
    g = max(1, min(n, GROUP_ROWS // (h * w)))
    return [min(g, n - i) for i in range(0, n, g)]


def _is_native(walker, x):
    """Whether ``x`` (4-D) is held in NHWC order (each image a run of rows of one IR tensor,
    so a group of images is free or one concat) and not already in the torch fold."""
    if not isinstance(x, _imp._Act) or x.addr.ndim != 4 or x.scale is None:
        return False
    n, _, h, w = x.shape
    a = _nhwc_addr(x).reshape(n, -1)
    k = walker.b._decode(a)[0]
    if not ((k == k[:, :1]).all() and (a == a[:, :1] + np.arange(a.shape[1])).all()):
        return False
    fold = np.ascontiguousarray(x.addr).reshape(_imp._fold2d(x.shape))
    return (fold.shape, fold.tobytes()) not in walker.b.memo


def _groups(walker, x):
    """``[(g, node)]`` per group of ``g`` images (:func:`_group_sizes`) of the 4-D activation
    ``x``: the IR tensor of their ``(g * H * W, C)`` NHWC rows (free if it is held so; from
    an NCHW image input, a slice and a transpose per image)."""
    n, _, h, w = x.shape
    a = _nhwc_addr(x)
    out, i = [], 0
    for g in _group_sizes(n, h, w):
        out.append((g, walker.b.block(a[i * h * w:(i + g) * h * w])))
        i += g
    return out


def _stem(node, k, groups):
    return node.name if len(groups) == 1 else f"{node.name}_g{k}"


def _nchw_act(walker, parts, shape, scale):
    """The activation of the IR tensors ``parts`` (``(images, node)`` per group, ``H * W``
    NHWC rows an image) as the torch ``shape``."""
    n, c, h, w = shape
    addr = np.concatenate([walker.b.base(node, g * h * w, c) for g, node in parts])
    return _imp._Act(np.transpose(addr.reshape(n, h, w, c), _NCHW), scale)


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

    def horizontal(self):
        """The window's taps along a row only (kernel ``1 x K_w``, stride 1): its horizontal
        shifts and their masks."""
        return dataclasses.replace(self, kernel=(1, self.kernel[1]), stride=(1, 1),
                                   padding=(0, self.padding[1]), dilation=(1, self.dilation[1]))

    def vertical(self):
        """The window's taps along a column only (kernel ``K_h x 1``, stride 1)."""
        return dataclasses.replace(self, kernel=(self.kernel[0], 1), stride=(1, 1),
                                   padding=(self.padding[0], 0), dilation=(self.dilation[0], 1))

    def strided(self):
        """Whether the output positions are not every input position (a selection)."""
        return self.out != (self.h, self.w) or self.stride != (1, 1)


def _shift(walker, x, rows, cols, shift, fill, stem, dtype="int8"):
    """Rows ``r + shift`` of the IR tensor ``x`` (rows x cols, of ``dtype``), ``fill`` past
    its ends."""
    if shift == 0:
        return x
    k = min(abs(shift), rows)
    pad = _const(walker, ("fill", k, cols, fill, dtype),
                 lambda: np.full((k, cols), fill, dtype), f"fill_{fill}_{k}x{cols}")
    if k == rows:
        return pad
    b = walker.b
    if shift > 0:
        body = b.add("slice", x, stem=f"{stem}_s", axis=0, start=k, stop=rows)
        return b.add("concat", body, pad, stem=f"{stem}_cat", axis=0)
    body = b.add("slice", x, stem=f"{stem}_s", axis=0, start=0, stop=rows - k)
    return b.add("concat", pad, body, stem=f"{stem}_cat", axis=0)


def _masked_taps(walker, x, win, cols, stem, *, fill, kind, dtype="int8", masks=True):
    """The taps of ``win`` over the NHWC tensor ``x`` of ``win.n`` images (of ``dtype``):
    ``[(i, j, node)]``, the taps that see some position of the image. With ``masks``, the
    positions whose source is outside the image are masked: for ``kind`` "sum" by a 0/1
    ``mul`` (int32), for "max" by a ``min`` with 127/-127; without, the ``fill`` past the
    tensor's ends must do (one image, vertical shifts)."""
    b = walker.b
    taps = []
    for i, j, shift, ok in win.taps():
        if not ok.any():
            continue
        t = _shift(walker, x, win.rows, cols, shift, fill, f"{stem}_t{i}{j}", dtype)
        if masks and not ok.all():
            t = b.add("min" if kind == "max" else "mul", t, _mask(walker, win, shift, ok, kind),
                      stem=f"{stem}_t{i}{j}_m")
        taps.append((i, j, t))
    return taps


def _mask(walker, win, shift, ok, kind="zero"):
    """The ``(rows, 1)`` constant masking a tap: 0/1, or for max-pooling 127/-127 (a
    ``min``); one per window and tap, shared by the images and the ops."""
    key = ("mask", kind == "max", win.n, win.h, win.w, shift, ok.tobytes())
    if kind == "max":
        return _const(walker, key, lambda: np.where(ok, _imp.QMAX, -_imp.QMAX).astype(
            np.int8).reshape(-1, 1), f"maxmask_{abs(shift)}")
    return _const(walker, key, lambda: ok.astype(np.int8).reshape(-1, 1), f"mask_{abs(shift)}")


#: A convolution's matmuls reduce over at most this many elements (a kernel row's taps x input
#: channels, more in chunks of whole taps): a matmul's reduction row is held in a CU's local
#: buffer (64 vector words by default, some taken by constants).
CONV_K = 192


#: At most this many elements in a selection constant (:func:`_select`): the whole 0/1 matrix
#: of a 32x32 image pooled to 16x16 would be 262,144 (65,536 vector words of 4 lanes, an MU).
SELECT_ELEMENTS = 16384


def _select(walker, x, win, cols, stem):
    """The rows of the output positions of ``win`` from the NHWC tensor ``x`` (every input
    position of its images, rows x cols), int32: bands of output rows, each a 0/1 selection
    matmul of the input rows it reads (a slice), so no constant holds more than
    :data:`SELECT_ELEMENTS` nor reduces over more than :data:`CONV_K` rows (the bands of one
    size share theirs), stacked. The images are one
    tall image when each output row's source rows stay in step across them (``H_out *
    stride == H``), else selected one by one."""
    b = walker.b
    ho, wo = win.out
    sh, sw = win.stride
    if win.n > 1 and ho * sh != win.h:
        hw = win.h * win.w
        one = dataclasses.replace(win, n=1)
        return b.add("concat", *(_select(walker, b.add(
            "slice", x, stem=f"{stem}_img{m}", axis=0, start=m * hw, stop=(m + 1) * hw),
            one, cols, f"{stem}_img{m}") for m in range(win.n)), stem=f"{stem}_sel", axis=0)
    ho *= win.n

    def span(k):                  # input rows read by k output rows
        return ((k - 1) * sh + 1) * win.w

    k = max([1] + [k for k in range(1, ho + 1)
                   if k * wo * span(k) <= SELECT_ELEMENTS and span(k) <= CONV_K])

    def make(k):
        s = np.zeros((k * wo, span(k)), np.int8)
        src = ((np.arange(k) * sh)[:, None] * win.w + (np.arange(wo) * sw)[None, :])
        s[np.arange(k * wo), src.reshape(-1)] = 1
        return s
    parts = []
    for r0 in range(0, ho, k):
        kk = min(k, ho - r0)
        sel = _const(walker, ("select", win.w, wo, sh, sw, kk), lambda kk=kk: make(kk),
                     f"select_{win.w}_{wo}_{kk}")
        start = r0 * sh * win.w
        band = x if (start, span(kk)) == (0, win.rows) else b.add(
            "slice", x, stem=f"{stem}_band{r0}", axis=0, start=start, stop=start + span(kk))
        parts.append(b.add("matmul", sel, band, stem=f"{stem}_sel{r0}"))
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
    """``aten.convolution``: 2-D, groups 1, not transposed; separable taps in NHWC (a matmul
    per kernel row by its int8 weights, per output channel), group by group, a following
    batch norm folded in first."""
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
    one = dataclasses.replace(win, n=1)
    rows_i = [i for i, _, _, ok in one.vertical().taps() if ok.any()]
    cols_j = [j for _, j, _, ok in one.horizontal().taps() if ok.any()]
    # Weights as (taps * C_in, C_out), rows by (i, j), quantized per output channel over
    # every tap; then cut into one matrix per kernel row i and chunk of its columns j.
    wmat = np.concatenate([w[:, :, i, j].T for i in rows_i for j in cols_j], axis=0)
    wq, sw = _imp._per_channel(wmat.T)                       # (C_out, K), scale per column
    bound = _imp.QMAX * np.abs(wq.astype(np.int64)).sum(axis=1)
    per = max(1, CONV_K // c)
    chunks = [cols_j[k:k + per] for k in range(0, len(cols_j), per)]
    bld = walker.b
    wrows = wq.T.reshape(len(rows_i), len(cols_j), c, cout)
    wnodes = {(i, k): bld.const(np.ascontiguousarray(
        wrows[a, k * per:k * per + len(chunk)].reshape(-1, cout)), f"{node.name}_w{i}_{k}")
        for a, i in enumerate(rows_i) for k, chunk in enumerate(chunks)}
    ho, wo = win.out
    groups = _groups(walker, x)
    pick = win.strided() and len(rows_i) * len(cols_j) == 1 and all(
        ok.all() for _, _, _, ok in one.taps())
    outs = []
    for k, (g, xin) in enumerate(groups):
        gw = dataclasses.replace(win, n=g)
        stem = _stem(node, k, groups)
        acc = _conv_group(walker, xin, gw, c, cout, rows_i, chunks, wnodes, pick, stem)
        outs.append((g, bld.requant([(acc, x.scale * sw, bound)], scale, bias=b, stem=stem,
                                    shape2d=(g * ho * wo, cout))))
    return _nchw_act(walker, outs, (n, cout, ho, wo), scale)


def _conv_group(walker, xin, win, c, cout, rows_i, chunks, wnodes, pick, stem):
    """The int32 accumulator ``(g * H_out * W_out, C_out)`` of a convolution over the
    ``win.n`` images of ``xin``, separably: the horizontal taps of a kernel row (each a row
    shift masked at the image's left and right edges) concatenated along columns, so each
    kernel row is one matmul of a vertical shift of them (masked at the top and bottom edges
    when the tensor holds several images; one image's fill does it); the kernel rows'
    products added, the output positions selected."""
    bld = walker.b
    hwin, vwin = win.horizontal(), win.vertical()
    hshift = {j: (shift, ok) for _, j, shift, ok in hwin.taps()}
    vshift = {i: (shift, ok) for i, _, shift, ok in vwin.taps()}
    blocks = []
    for k, chunk in enumerate(chunks):
        taps = []
        for j in chunk:
            shift, ok = hshift[j]
            t = _shift(walker, xin, win.rows, c, shift, 0, f"{stem}_h{j}")
            if not ok.all():
                t = bld.add("mul", t, _mask(walker, hwin, shift, ok), stem=f"{stem}_h{j}_m")
                t = bld.add("clip", t, stem=f"{stem}_h{j}_q", lo=-_imp.QMAX, hi=_imp.QMAX,
                            dtype="int8")
            taps.append(t)
        blocks.append(taps[0] if len(taps) == 1 else bld.add(
            "concat", *taps, stem=f"{stem}_cols{k}", axis=1))
    acc = None
    for i in rows_i:
        shift, ok = vshift[i]
        for k, chunk in enumerate(chunks):
            cols = len(chunk) * c
            t = _shift(walker, blocks[k], win.rows, cols, shift, 0, f"{stem}_v{i}_{k}")
            if pick:
                t = _select(walker, t, win, cols, stem)
            t = bld.add("matmul", t, wnodes[(i, k)], stem=f"{stem}_p{i}_{k}")
            if win.n > 1 and not ok.all():
                t = bld.add("mul", t, _mask(walker, vwin, shift, ok), stem=f"{stem}_p{i}_{k}_m")
            acc = t if acc is None else bld.add("add", acc, t, stem=f"{stem}_acc{i}_{k}")
    if win.strided() and not pick:
        acc = _select(walker, acc, win, cout, stem)
    return acc


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
    scale = _imp._scale_of(walker.cal[node.name][0])
    if _is_native(walker, x):                  # an NHWC activation: image by image
        groups = _groups(walker, x)
        hw = x.shape[2] * x.shape[3]
        outs = [(g, walker.b.requant([(xin, x.scale * a, _imp.QMAX)], scale, bias=shift,
                                     stem=_stem(node, k, groups), shape2d=(g * hw, c)))
                for k, (g, xin) in enumerate(groups)]
        return [_nchw_act(walker, outs, x.shape, scale), None, None]
    moved = np.moveaxis(x.addr, 1, -1)
    flat = np.ascontiguousarray(moved).reshape(-1, c)
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
    n, c = x.shape[:2]
    b = walker.b
    groups = _groups(walker, x)
    outs = []
    for k, (g, xin) in enumerate(groups):
        gw = dataclasses.replace(win, n=g)
        stem = _stem(node, k, groups)
        acc, _ = _pool(walker, xin, gw, c, stem, "max")
        if gw.strided():
            acc = b.add("clip", _select(walker, acc, gw, c, stem), stem=f"{stem}_q",
                        lo=-_imp.QMAX, hi=_imp.QMAX, dtype="int8")
        outs.append((g, acc))
    ho, wo = win.out
    return [_nchw_act(walker, outs, (n, c, ho, wo), x.scale), None]


def _pool(walker, x, win, cols, stem, kind):
    """The ``max`` (int8) or sum (int32, ``kind`` "sum") over the window ``win`` of
    ``win.n`` images of the NHWC tensor ``x``, at every input position, separably: over each
    row's taps, then over the columns' taps of that. Each pass's taps are masked where their
    source leaves the image (a ``min`` with -127 for max, a 0/1 ``mul`` for a sum) except the
    vertical pass of one image, whose fill does it. Returns the tensor and the number of
    taps."""
    b = walker.b
    op, fill = ("max", -_imp.QMAX) if kind == "max" else ("add", 0)
    acc, count = x, 1
    for part, dtype, side in ((win.horizontal(), "int8", "h"),
                              (win.vertical(), "int8" if kind == "max" else "int32", "v")):
        taps = _masked_taps(walker, acc, part, cols, f"{stem}_{side}", fill=fill,
                            kind="max" if kind == "max" else "sum", dtype=dtype,
                            masks=part.kernel[1] > 1 or win.n > 1)
        acc = taps[0][2]
        for i, j, t in taps[1:]:
            acc = b.add(op, acc, t, stem=f"{stem}_{op}{i}{j}")
        count *= len(taps)
    return acc, count


def _sum_taps(walker, xin, win, c, stem):
    """The sum (int32) of the masked taps of ``win`` over ``xin``, the output positions
    selected, and the number of taps."""
    acc, count = _pool(walker, xin, win, c, stem, "sum")
    if win.strided():
        acc = _select(walker, acc, win, c, stem)
    return acc, count


def avg_pool(walker, node, kw):
    """``avg_pool2d``: the sum of the taps (int32), requantized by ``1 / count``."""
    x = kw["input"]
    _check_act(x)
    win = _pool_window(x, kw, "avg_pool2d")
    n, c = x.shape[:2]
    ho, wo = win.out
    one = dataclasses.replace(win, n=1)
    if kw.get("divisor_override"):
        per = x.scale / float(kw["divisor_override"])
    elif kw.get("count_include_pad", True) or win.padding == (0, 0):
        per = x.scale / (win.kernel[0] * win.kernel[1])
    else:
        counts = sum(ok.astype(np.int64) for _, _, _, ok in one.taps())
        hw = counts.reshape(win.h, win.w)[::win.stride[0], ::win.stride[1]][:ho, :wo]
        per = (x.scale / hw.reshape(-1, 1)).astype(np.float64)
    scale = walker.value_scale(node)
    groups = _groups(walker, x)
    outs = []
    for k, (g, xin) in enumerate(groups):
        stem = _stem(node, k, groups)
        acc, taps = _sum_taps(walker, xin, dataclasses.replace(win, n=g), c, stem)
        term = per if np.ndim(per) == 0 else np.tile(per, (g, 1))
        outs.append((g, walker.b.requant([(acc, term, _imp.QMAX * taps)], scale, stem=stem,
                                         shape2d=(g * ho * wo, c))))
    return _nchw_act(walker, outs, (n, c, ho, wo), scale)


def _global(walker, node, x, kind, scale, out_shape):
    """Sum (or max) over ``H, W`` of each image: a matmul by a 0/1 ``(1, H * W)`` constant
    (a ``reduce_max`` for max), the images' rows concatenated, requantized for a sum or
    mean."""
    n, c, h, w = x.shape
    b = walker.b
    parts = []
    for k, (g, xin) in enumerate(_groups(walker, x)):
        stem = f"{node.name}_g{k}"
        if kind == "max":
            parts += [b.add("reduce_max", xin if g == 1 else b.add(
                "slice", xin, stem=f"{stem}_img{m}", axis=0, start=m * h * w,
                stop=(m + 1) * h * w), stem=f"{stem}_max{m}", axis=0) for m in range(g)]
        else:
            ones = _const(walker, ("pool", g, h * w), lambda g=g: np.kron(
                np.eye(g, dtype=np.int8), np.ones((1, h * w), np.int8)), f"pool_{g}x{h * w}")
            parts.append(b.add("matmul", ones, xin, stem=stem))
    out = parts[0] if n == 1 else b.add("concat", *parts, stem=f"{node.name}_acc", axis=0)
    if kind == "max":
        scale = x.scale
    else:
        per = x.scale / (h * w if kind == "mean" else 1)
        out = b.requant([(out, per, _imp.QMAX * h * w)], scale, stem=node.name, shape2d=(n, c))
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
