"""The torch.export importer: a PyTorch program in, an integer-only IR graph out.

:func:`import_program` takes a saved ``torch.export`` program (a ``.pt2`` file from
``torch.export.save``) or an ``ExportedProgram`` with example inputs and returns an
:class:`ImportedModel`: a validated :class:`~rdakit.compiler.graph.DataflowGraph` of integer
ops, the quantized example inputs, the graph's own ``evaluate`` as the bit-exact reference, and
an :class:`AccuracyReport` against the float program.

The steps:

1. **Coverage.** The program is decomposed to core aten except for the ops the importer
   handles (:func:`~rdakit.compiler.frontend.aten.prepare`); every op kind it does not handle
   is listed in one :class:`ModelImportError` with its count. Nodes that read no graph input
   (computations on weights and constants alone) are folded to constants, whatever their op.
2. **Calibration.** The float program runs on the example inputs and every node's output is
   recorded; an activation's scale is ``max |value| / 127``.
3. **Quantization.** Activations are int8, symmetric (``value ~ scale * q``, ``q`` in
   [-127, 127]); weights of ``linear``/``addmm``/``mm`` are int8 per output channel; products
   accumulate in int32. Every int32 result is brought back to int8 by a requantization
   ``clip((sum_k t_k * m_k + c) >> n)`` (IR ``mul``, ``add``, ``shr``, ``clip``) whose integer
   multipliers ``m_k`` (one per column where scales differ per channel), rounding-and-bias term
   ``c`` and shift ``n`` are the largest that keep every intermediate value inside int32 for
   every input (bounded by the int8 ranges, not by the calibration), so the graph never wraps.
   Rescalings by a constant (``x / 8``, ``x * 0.5``) change the scale only: no op.
4. **Layout.** A torch tensor of any rank is a map from its elements to elements of 2-D IR
   tensors (leading dimensions folded into rows). View ops (reshape, permute, slice, expand,
   ...) only rearrange the map; an op that computes materializes each 2-D operand it needs:
   an IR tensor as it stands when the map is its row-major order (a free view), else slices,
   transposes and concatenations of the pieces. Batched matmuls (heads) become one 2-D matmul
   per batch index.

torch is imported inside the functions that need it (``pip install rdakit[torch]``); without it,
:func:`import_program` raises :class:`ModelImportError` saying what to install.
"""

import dataclasses
import functools
import logging
import math
import os
import pathlib
import re
import zipfile

import numpy as np

from rdakit.compiler import intops
from rdakit.compiler.frontend import conv, moe, norms
from rdakit.compiler.frontend.aten import (
    ATEN_OPS,
    live_nodes,
    op_coverage,
    op_name,
    prepare,
    unsupported_summary,
)
from rdakit.compiler.graph import OP_KINDS, DataflowGraph, GraphError
from rdakit.errors import UserError

__all__ = ["ModelImportError", "ImportedModel", "AccuracyReport", "OutputAccuracy",
           "import_program", "load_program", "load_workload", "check_program_file",
           "require_torch", "QMAX", "EXAMPLE_SEED"]

#: The int8 range of activations and weights: symmetric, [-QMAX, QMAX] (so negation is exact).
QMAX = 127

#: Seed of the random example inputs of a program saved without any.
EXAMPLE_SEED = 0

_INT32 = (1 << 31) - 1

#: Fraction bits of the imported softmax's probabilities: int8 in [0, 127], no requantization
#: (``intops.softmax_params(scale, SOFTMAX_BITS)``; at most 0.0078 from float, docs/compiler.md).
SOFTMAX_BITS = 7
SOFTMAX_SCALE = 2.0 ** -SOFTMAX_BITS

#: Bits a requantization multiplier keeps for the terms of the integer non-linear ops, whose
#: int32 results span up to 31 bits (:func:`_pre_shift`).
MULT_BITS = 12


class ModelImportError(UserError):
    """A program the importer cannot take: not a torch.export program, ops it does not handle
    (all listed at once), or torch missing. The command line prints it and exits 2."""


# --- loading ----------------------------------------------------------------------------------

def require_torch(what):
    """The torch module, or a ModelImportError saying how to install it."""
    try:
        import torch  # optional dependency (rdakit[torch]): only a user importing a model needs it
    except ImportError:
        raise ModelImportError(f"{what} is a torch.export program: importing it needs PyTorch; "
                               f"install it with pip install 'rdakit[torch]'") from None
    return torch


def check_program_file(path):
    """Refuse, cheaply, a path that cannot be a saved program: missing, a folder, or not a zip
    archive (``torch.export.save`` writes one). A ModelImportError naming the path."""
    text = str(path)
    p = pathlib.Path(path)
    if not p.exists():
        raise ModelImportError(f"{text!r} does not exist")
    if not p.is_file():
        raise ModelImportError(f"{text!r} is not a file")
    if not zipfile.is_zipfile(p):
        raise ModelImportError(f"{text!r} is not a torch.export program (a .pt2 file from "
                               f"torch.export.save): it is not a zip archive")


def load_program(path):
    """The ``ExportedProgram`` saved in ``path`` (``torch.export.load``).

    Raises
    ------
    ModelImportError
        If the file is missing, is not a saved program, or torch is not installed.
    """
    check_program_file(path)
    torch = require_torch(repr(str(path)))
    # torch logs the traceback of a failed load (its reason) and raises a vaguer error: the
    # log is kept from the user and its reason goes into our message.
    log = logging.getLogger("torch.export")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    propagate, handlers = log.propagate, log.handlers[:]
    log.propagate, log.handlers = False, [handler]
    try:
        return torch.export.load(str(path))
    except Exception as e:  # torch raises many kinds for a damaged or foreign archive
        logged = [r.exc_info[1] for r in records if r.exc_info and r.exc_info[1] is not None]
        raise ModelImportError(f"{str(path)!r} is not a torch.export program (a .pt2 file from "
                               f"torch.export.save): {_reason(logged[0] if logged else e)}"
                               ) from None
    finally:
        log.propagate, log.handlers = propagate, handlers


def _reason(error):
    """The first line of the innermost cause of ``error``, without C++ assertion prefixes."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", text)


# --- results ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OutputAccuracy:
    """How close one dequantized output is to the float program's.

    Members
    -------
    name : str
        The graph output.
    max_abs_error : float
        Largest absolute difference.
    cosine : float
        Cosine similarity of the flattened outputs (1.0 when both are zero).
    top1 : float or None
        Fraction of rows whose argmax over the last dimension agrees (classifiers, language
        model heads); None when the last dimension has fewer than two entries.
    """

    name: str
    max_abs_error: float
    cosine: float
    top1: float | None


@dataclasses.dataclass(frozen=True)
class AccuracyReport:
    """What quantization cost, on the example inputs: each output's :class:`OutputAccuracy`
    and the worst of them (largest error, smallest cosine and top-1)."""

    outputs: tuple

    @property
    def max_abs_error(self):
        """Largest absolute error over every output."""
        return max(o.max_abs_error for o in self.outputs)

    @property
    def cosine(self):
        """Smallest cosine similarity over the outputs."""
        return min(o.cosine for o in self.outputs)

    @property
    def top1(self):
        """Smallest top-1 agreement over the outputs that have one, or None."""
        values = [o.top1 for o in self.outputs if o.top1 is not None]
        return min(values) if values else None

    def as_dict(self):
        """The report as JSON-able data."""
        return {"max_abs_error": self.max_abs_error, "cosine": self.cosine, "top1": self.top1,
                "outputs": [dataclasses.asdict(o) for o in self.outputs]}

    def lines(self):
        """The report as lines for a terminal."""
        out = []
        for o in self.outputs:
            top1 = "" if o.top1 is None else f", top-1 agreement {o.top1:.1%}"
            out.append(f"accuracy of {o.name} against float: max abs error {o.max_abs_error:.4g}, "
                       f"cosine {o.cosine:.5f}{top1}")
        return out


def _accuracy(name, want, got):
    want = np.asarray(want, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    err = float(np.max(np.abs(want - got))) if want.size else 0.0
    a, b = want.reshape(-1), got.reshape(-1)
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0 and nb == 0:
        cosine = 1.0
    elif na == 0 or nb == 0:
        cosine = 0.0
    else:
        cosine = float(a @ b / (na * nb))
    top1 = None
    if want.ndim >= 1 and want.shape[-1] >= 2:
        top1 = float(np.mean(np.argmax(want, axis=-1) == np.argmax(got, axis=-1)))
    return OutputAccuracy(name, err, cosine, top1)


@dataclasses.dataclass(eq=False)
class ImportedModel:
    """A torch.export program as an integer IR graph.

    Members
    -------
    name : str
        Name of the graph.
    graph : DataflowGraph
        The validated integer graph.
    inputs : dict of str to numpy.ndarray
        The quantized example inputs, by graph input.
    input_scales, output_scales : dict of str to float
        ``real ~ scale * integer`` of each graph input and output (None for an integer input,
        such as token indices, which is not scaled).
    output_shapes : dict of str to tuple
        The torch shape of each output (the graph's are 2-D).
    float_outputs : dict of str to numpy.ndarray
        The float program's outputs on the example inputs.
    accuracy : AccuracyReport
        The dequantized outputs of :meth:`evaluate` against :attr:`float_outputs`.
    coverage : dict
        :func:`~rdakit.compiler.frontend.aten.op_coverage` of the program.
    example_source : str
        Where the example inputs came from: ``"given"``, ``"saved"`` (the program's
        ``example_inputs``) or ``"random (seed 0)"``.
    folded : int
        Nodes folded to constants (they read no graph input).
    """

    name: str
    graph: DataflowGraph
    inputs: dict
    input_scales: dict
    output_scales: dict
    output_shapes: dict
    float_outputs: dict
    accuracy: AccuracyReport
    coverage: dict
    example_source: str
    folded: int = 0

    def evaluate(self, inputs=None):
        """The graph's integer outputs (:meth:`DataflowGraph.evaluate`, the bit-exact
        reference) on ``inputs`` (default: the quantized example inputs)."""
        return self.graph.evaluate(self.inputs if inputs is None else inputs)

    def dequantize(self, outputs):
        """Integer outputs (by output name) as float arrays of the torch shapes."""
        return {k: (np.asarray(v, dtype=np.float64) * self.output_scales[k])
                .reshape(self.output_shapes[k]) for k, v in outputs.items()}

    def workload(self):
        """The model as a :class:`~rdakit.compiler.workloads.Workload`: the graph, the
        quantized example inputs as its sample, the graph's evaluate as its reference; its
        options say where the example inputs came from (``example_inputs``) and hold
        :meth:`summary_lines` (``import_summary``, which ``rdakit compile`` and ``run``
        print)."""
        from rdakit.compiler.workloads import Workload  # deferred: workloads imports this module

        return Workload(self.graph.name, self.graph, dict(self.inputs), self.graph.evaluate,
                        {"example_inputs": self.example_source,
                         "import_summary": tuple(self.summary_lines())})

    def summary_lines(self):
        """What a user should know about the import, as lines."""
        nodes = sum(c["count"] for c in self.coverage.values())
        lines = [f"imported {self.name}: {nodes} aten nodes of {len(self.coverage)} kinds -> "
                 f"{len(self.graph)} IR ops ({self.folded} constant nodes folded)",
                 f"example inputs: {self.example_source}; int8 activations, int8 weights per "
                 f"output channel, int32 accumulators"]
        return lines + self.accuracy.lines()


# --- values during the walk ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class _Const:
    """A value known at import (weights, constants and whatever is computed from them)."""

    value: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class _Act:
    """A run-time tensor: ``addr`` (of the torch shape) maps each element to an element of a
    2-D IR tensor (an address of :class:`_Builder`'s address space); ``scale`` is the real
    value of one integer step (None for integer indices)."""

    addr: np.ndarray
    scale: float | None
    dtype: str = "int8"

    @property
    def shape(self):
        return tuple(self.addr.shape)


def _fold2d(shape):
    """The 2-D shape a tensor of ``shape`` has in the IR: leading dimensions folded into rows
    (a vector is one row, a scalar one element)."""
    shape = tuple(shape)
    if not shape:
        return (1, 1)
    return (math.prod(shape[:-1]), shape[-1])


class _Builder:
    """Builds the IR graph: base tensors, an address space over them, and materialization of
    any element map as 2-D IR tensors (free views, else slices, transposes, concatenations)."""

    def __init__(self, name):
        self.g = DataflowGraph(name)
        self.offsets = []              # start address of each base tensor, ascending
        self.bases = []                # (node, rows, cols)
        self.next = 0
        self.memo = {}                 # (shape, address bytes) -> node
        self.names = set()
        self.int_inputs = set()        # graph inputs of integers (indices), 1-D

    def name(self, stem):
        """A node name from ``stem`` not used yet."""
        stem = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in stem) or "n"
        name, k = stem, 1
        while name in self.names:
            name, k = f"{stem}_{k}", k + 1
        self.names.add(name)
        return name

    def add(self, kind, *inputs, stem, **attrs):
        return self.g.add(kind, *inputs, name=self.name(stem), **attrs)

    def const(self, value, stem):
        return self.g.const(self.name(stem), np.ascontiguousarray(value))

    def base(self, node, rows, cols):
        """Register the 2-D IR tensor ``node`` (rows x cols); its addresses, row-major."""
        start = self.next
        self.offsets.append(start)
        self.bases.append((node, rows, cols))
        self.next += rows * cols
        addr = np.arange(start, self.next, dtype=np.int64).reshape(rows, cols)
        self.memo[(addr.shape, addr.tobytes())] = node
        return addr

    def act(self, node, shape, scale, dtype="int8"):
        """A run-time tensor of torch ``shape`` held by the 2-D IR tensor ``node``."""
        return _Act(self.base(node, *_fold2d(shape)).reshape(shape), scale, dtype)

    # --- materialization ------------------------------------------------------------------

    def block(self, addr):
        """An IR node holding the elements ``addr`` (2-D) in that order."""
        key = (addr.shape, addr.tobytes())
        node = self.memo.get(key)
        if node is None:
            node = self._build(addr)
            self.memo[key] = node
        return node

    def _decode(self, addr):
        k = np.searchsorted(np.asarray(self.offsets), addr, side="right") - 1
        cols = np.asarray([c for _, _, c in self.bases])[k]
        local = addr - np.asarray(self.offsets)[k]
        return k, local // cols, local % cols

    def _build(self, addr):
        k, r, c = self._decode(addr)
        rows, cols = addr.shape
        if (k == k.flat[0]).all():
            node, nr, nc = self.bases[int(k.flat[0])]
            r0, c0 = int(r.flat[0]), int(c.flat[0])
            i, j = np.indices(addr.shape)
            if (r == r0 + i).all() and (c == c0 + j).all():
                return self._window(node, nr, nc, r0, rows, c0, cols)
            if (r == r0 + j).all() and (c == c0 + i).all():
                src = self._window(node, nr, nc, r0, cols, c0, rows)
                return self.add("transpose", src, stem=f"{node}_t")
        same = k[:, 1:] == k[:, :-1]
        dr, dc = r[:, 1:] - r[:, :-1], c[:, 1:] - c[:, :-1]
        h_go = same & (((dr == 0) & (dc == 1)) | ((dr == 1) & (dc == 0)))
        same = k[1:] == k[:-1]
        dr, dc = r[1:] - r[:-1], c[1:] - c[:-1]
        v_go = same & (((dr == 1) & (dc == 0)) | ((dr == 0) & (dc == 1)))
        for cuts, axis in ((np.flatnonzero(~h_go.any(axis=0)) + 1, 1),
                           (np.flatnonzero(~v_go.any(axis=1)) + 1, 0),
                           (np.flatnonzero(~h_go.all(axis=0)) + 1, 1),
                           (np.flatnonzero(~v_go.all(axis=1)) + 1, 0)):
            if len(cuts):
                return self._concat(np.split(addr, cuts, axis=axis), axis)
        # Every neighbour continues its piece but the block mixes directions: one row (or
        # column) at a time.
        axis = 0 if rows > 1 else 1
        return self._concat(np.split(addr, addr.shape[axis], axis=axis), axis)

    def _concat(self, parts, axis):
        nodes = [self.block(p) for p in parts]
        return self.add("concat", *nodes, stem="cat", axis=axis)

    def _window(self, node, nr, nc, r0, rows, c0, cols):
        if (r0, rows) != (0, nr):
            node = self.add("slice", node, stem=f"{node}_r", axis=0, start=r0, stop=r0 + rows)
        if (c0, cols) != (0, nc):
            node = self.add("slice", node, stem=f"{node}_c", axis=1, start=c0, stop=c0 + cols)
        return node

    def materialize(self, act, shape2d=None):
        """An IR node holding ``act`` folded to ``shape2d`` (default :func:`_fold2d`)."""
        return self.block(np.ascontiguousarray(act.addr).reshape(shape2d or _fold2d(act.shape)))

    # --- requantization ------------------------------------------------------------------

    def requant(self, terms, scale, *, bias=None, stem, shape2d, pre=0):
        """``clip(round(sum_k real(t_k) / scale + bias / scale))`` to int8 in integer ops.

        ``terms`` are ``(node, real scale, bound)``: an int tensor whose real value is
        ``scale * value`` (a scale per column is an array), and the largest ``|value|`` it
        can hold (per column too). ``bias`` (real units) broadcasts to ``shape2d``. The shift
        is the largest (at most 31) for which ``sum_k bound_k * |m_k| + |c|`` stays within
        int32. A term that would leave int32 even at shift 0 is first clipped to the values
        whose result does not saturate anyway (as is an added term beyond them), so the result
        is still exact. A term of many bits, such as an integer GELU's, may be shifted right by
        ``pre`` bits first so that its multiplier keeps :data:`MULT_BITS` bits
        (:func:`_pre_shift`).
        """
        rows, cols = shape2d
        if bias is not None:
            # Kept at its own shape (a per-channel bias is one row): the IR's add broadcasts
            # it, so the constant is stored once, not once per row.
            bias = np.asarray(bias, dtype=np.float64).reshape(_bias_shape(bias, shape2d))
            np.broadcast_shapes(bias.shape, shape2d)
        spans = [float(np.max(np.asarray(b, np.float64) * np.abs(np.asarray(s, np.float64))))
                 / scale for _, s, b in terms]          # each term's range in output steps
        if bias is not None:
            top = QMAX + 1 + sum(spans)
            bias = np.clip(bias, -top * scale, top * scale)
        cmax = 0.0 if bias is None else float(np.max(np.abs(bias))) / scale
        clipped = []
        for k, (node, s, b) in enumerate(terms):
            need = QMAX + 1 + cmax + sum(spans) - spans[k]
            if spans[k] > need and spans[k] > 1 << 30:
                t = int(math.ceil(need * scale / float(np.min(np.abs(s)))))
                node = self.add("clip", node, stem=f"{stem}_sat", lo=-t, hi=t, dtype="int32")
                b = t
            clipped.append((node, s, b))
        terms = clipped
        chosen = None
        for n in range(31, -1, -1):
            ms = [np.rint(np.asarray(s, dtype=np.float64) * 2.0 ** (n + pre) / scale)
                  for _, s, _ in terms]
            c = np.zeros((1, 1)) if bias is None else np.rint(bias * 2.0 ** n / scale)
            c = c + (1 << (n - 1) if n else 0)
            total = sum(np.max(np.asarray(b, dtype=np.float64) / 2 ** pre * np.abs(m))
                        for (_, _, b), m in zip(terms, ms, strict=True))
            if total + np.max(np.abs(c)) <= _INT32:
                chosen = n, ms, c
                break
        if chosen is None:  # pragma: no cover - the clipping above makes shift 0 fit
            raise AssertionError(f"requantization {stem}: no shift keeps int32")
        n, ms, c = chosen
        acc = None
        for (node, _, _), m in zip(terms, ms, strict=True):
            if pre:
                node = self.add("shr", node, stem=f"{stem}_pre", shift=pre)
            m = _const_shape(m, cols)
            if not (m == 1).all():
                node = self.add("mul", node, self.const(m.astype(np.int32), f"{stem}_m"),
                                stem=f"{stem}_mul")
            acc = node if acc is None else self.add("add", acc, node, stem=f"{stem}_sum")
        c = _const_shape(c, cols)
        if (c != 0).any():
            acc = self.add("add", acc, self.const(c.astype(np.int32), f"{stem}_c"),
                           stem=f"{stem}_add")
        if n:
            acc = self.add("shr", acc, stem=f"{stem}_shr", shift=n)
        return self.add("clip", acc, stem=stem, lo=-QMAX, hi=QMAX, dtype="int8")


def _pre_shift(bound):
    """The right shift of an int32 term bounded by ``bound`` before its requantization, so that
    its multiplier keeps :data:`MULT_BITS` bits (the shifted-out bits are far below one step of
    the int8 result)."""
    return max(0, int(bound).bit_length() - (31 - MULT_BITS))


def _bias_shape(bias, shape2d):
    b = np.asarray(bias)
    if b.size == 1:
        return (1, 1)
    if b.size == shape2d[1] and b.ndim <= 1:
        return (1, shape2d[1])
    return b.shape


def _const_shape(values, cols):
    """A multiplier or bias term as the 2-D constant the IR broadcasts: (1, 1) if all equal,
    one row if every row is the same (a (cols,) vector is one row), else as given."""
    v = np.asarray(values, dtype=np.float64)
    if v.size and (v == v.flat[0]).all():
        return np.full((1, 1), v.flat[0])
    v = v.reshape(1, cols) if v.ndim <= 1 else v
    return v[:1] if (v == v[:1]).all() else v


# --- the walk -----------------------------------------------------------------------------------

def _scale_of(value):
    """The int8 scale of a calibrated float tensor: ``max |value| / 127`` (1 / 127 if all
    zero)."""
    peak = float(np.max(np.abs(value))) if value.size else 0.0
    return (peak if peak > 0 else 1.0) / QMAX


def _quantize(value, scale):
    return np.clip(np.rint(np.asarray(value, dtype=np.float64) / scale), -QMAX, QMAX
                   ).astype(np.int8)


def _per_channel(w):
    """Per-row int8 quantization of a (N, K) weight: (int8 values, scales (N,))."""
    peak = np.max(np.abs(w), axis=1) if w.size else np.zeros(w.shape[0])
    scales = np.where(peak > 0, peak, 1.0) / QMAX
    return _quantize(w / scales[:, None], 1.0), scales


def _value(v):
    """An operand as a value of the walk: a Python number is a constant."""
    return v if isinstance(v, _Act | _Const) else _Const(np.asarray(v, dtype=np.float64))


@dataclasses.dataclass(frozen=True)
class _Unused:
    """A result of a multi-result op the importer does not compute (``why``: the refusal if
    a node reads it)."""

    why: str


@dataclasses.dataclass(frozen=True)
class _Routed:
    """A node of a recognised mixture-of-experts routing that has no value of its own (the
    pattern's other nodes read it; :mod:`~rdakit.compiler.frontend.moe` checked that no other
    node does)."""

    name: str


class _NodeError(Exception):
    """An op the importer handles in general but not with these operands."""


def _refuse(message):
    raise _NodeError(message)


def _dim(d, ndim):
    d = int(d)
    return d + ndim if d < 0 else d


class _Walker:
    """Turns each FX node into a value (:class:`_Const`, :class:`_Act`, or a list of them)."""

    def __init__(self, builder, calibration, torch):
        self.b = builder
        self.cal = calibration           # node name -> float numpy output
        self.torch = torch
        self.routes = {}                 # id(moe.Routing) -> its IR routing, gates, outputs

    # Shared helpers ------------------------------------------------------------------------

    def value_scale(self, node):
        return _scale_of(self.cal[node.name])

    def act_of(self, value, scale, stem):
        """An activation for ``value``: itself, or a constant quantized at ``scale``."""
        if isinstance(value, _Act):
            return value
        v = np.asarray(value.value, dtype=np.float64)
        q = _quantize(v, scale)
        node = self.b.const(q.reshape(_fold2d(q.shape)), f"{stem}_k")
        return self.b.act(node, q.shape, scale)

    def rescale(self, act, scale, stem):
        """``act`` at ``scale`` (an int8 activation): itself if the scale is the same."""
        if act.scale == scale:
            return act
        shape2d = _fold2d(act.shape)
        node = self.b.requant([(self.b.materialize(act), act.scale, QMAX)], scale, stem=stem,
                              shape2d=shape2d)
        return self.b.act(node, act.shape, scale)

    def _check_float(self, *acts):
        for a in acts:
            if isinstance(a, _Act) and a.scale is None:
                _refuse("an integer tensor (indices) cannot be an operand here")

    # Layout ------------------------------------------------------------------------------

    def layout(self, node, kw, x):
        name = op_name(node.target).split(".")[1]
        a = x.addr
        if name in ("view", "_unsafe_view", "reshape"):
            out = a.reshape(tuple(kw["size"] if "size" in kw else kw["shape"]))
        elif name == "flatten":
            s, e = _dim(kw["start_dim"], a.ndim), _dim(kw["end_dim"], a.ndim)
            out = a.reshape(a.shape[:s] + (-1,) + a.shape[e + 1:]) if a.ndim else a.reshape(1)
        elif name == "unflatten":
            d = _dim(kw["dim"], a.ndim)
            out = a.reshape(a.shape[:d] + tuple(kw["sizes"]) + a.shape[d + 1:])
        elif name == "unsqueeze":
            out = np.expand_dims(a, _dim(kw["dim"], a.ndim + 1))
        elif name == "squeeze":
            dims = kw.get("dim", None)
            dims = range(a.ndim) if dims is None else (
                [dims] if isinstance(dims, int) else dims)
            dims = tuple(d for d in (_dim(d, a.ndim) for d in dims) if a.shape[d] == 1)
            out = np.squeeze(a, axis=dims) if dims else a
        elif name == "permute":
            out = np.transpose(a, [_dim(d, a.ndim) for d in kw["dims"]])
        elif name == "transpose":
            out = np.swapaxes(a, _dim(kw["dim0"], a.ndim), _dim(kw["dim1"], a.ndim))
        elif name == "t":
            out = a.T
        elif name == "expand":
            size = list(kw["size"])
            lead = len(size) - a.ndim
            size = [a.shape[i - lead] if s == -1 else s for i, s in enumerate(size)]
            out = np.broadcast_to(a, size)
        elif name in ("slice", "narrow"):
            d = _dim(kw["dim"], a.ndim)
            if name == "narrow":
                start, end, step = int(kw["start"]), int(kw["start"]) + int(kw["length"]), 1
            else:
                start = 0 if kw["start"] is None else kw["start"]
                end = a.shape[d] if kw["end"] is None else kw["end"]
                step = kw["step"]
            index = [slice(None)] * a.ndim
            index[d] = slice(start, end, step)
            out = a[tuple(index)]
        elif name == "select":
            out = np.take(a, int(kw["index"]), axis=_dim(kw["dim"], a.ndim))
        elif name == "dropout":
            if kw.get("train"):
                _refuse("dropout in training mode is random; export the model in eval mode")
            out = a
        else:                       # contiguous, clone, alias, detach
            out = a
        return _Act(out, x.scale, x.dtype)

    def pieces(self, node, kw, x):
        name = op_name(node.target).split(".")[1]
        a = x.addr
        d = _dim(kw["dim"], a.ndim)
        size = a.shape[d]
        if name == "split":
            step = int(kw["split_size"])
            sizes = [min(step, size - s) for s in range(0, size, step)] or [0]
        elif name == "split_with_sizes":
            sizes = [int(s) for s in kw["split_sizes"]]
        elif name == "chunk":
            step = -(-size // int(kw["chunks"]))
            sizes = [min(step, size - s) for s in range(0, size, step)]
        else:                       # unbind
            return [_Act(np.take(a, i, axis=d), x.scale, x.dtype) for i in range(size)]
        return [_Act(p, x.scale, x.dtype) for p in np.split(a, np.cumsum(sizes)[:-1], axis=d)]

    def cat(self, node, kw):
        values = kw["tensors"]
        self._check_float(*values)
        scale = self.value_scale(node)
        acts = [self.rescale(self.act_of(v, scale, node.name), scale, f"{node.name}_in{i}")
                for i, v in enumerate(values)]
        ndim = max(a.addr.ndim for a in acts)
        parts = [a.addr for a in acts if a.addr.size or a.addr.ndim == ndim]
        return _Act(np.concatenate(parts, axis=_dim(kw["dim"], ndim)), scale)

    # Elementwise ---------------------------------------------------------------------------

    def _operand2d(self, value, out_shape, rows):
        """``value`` broadcast to ``out_shape``, as an operand of the (R, C) fold restricted to
        ``rows`` (a slice of R), in the smallest form the IR broadcasts: the whole band, a row
        (1, C), a column (rows, 1) or a scalar (1, 1); copies where none fits. An IR node for
        an activation, a float array for a constant."""
        r_all, cols = _fold2d(out_shape)
        data = value.addr if isinstance(value, _Act) else np.asarray(value.value, np.float64)
        shape = (1,) * (len(out_shape) - data.ndim) + tuple(data.shape)
        a = data.reshape(shape)
        if shape == tuple(out_shape):
            part = a.reshape(r_all, cols)[rows]
        elif math.prod(shape[:-1]) == 1 if shape else True:
            part = a.reshape(1, shape[-1] if shape else 1)
        elif shape[-1] == 1 and shape[:-1] == tuple(out_shape[:-1]):
            part = a.reshape(r_all, 1)[rows]
        else:
            part = np.broadcast_to(a, out_shape).reshape(r_all, cols)[rows]
        if isinstance(value, _Act):
            return self.b.block(np.ascontiguousarray(part))
        return np.ascontiguousarray(part)

    def _bands(self, act, shape):
        """Row ranges of the (R, C) fold of ``shape`` over which ``act`` (of that shape) is a
        sequence of whole IR tensors, so that an op can work on each without concatenating
        them (attention heads); else the one range."""
        r_all, cols = _fold2d(shape)
        whole = [slice(0, r_all)]
        if not isinstance(act, _Act) or act.shape != tuple(shape) or r_all <= 1:
            return whole
        a = np.ascontiguousarray(act.addr).reshape(r_all, cols)
        k = self.b._decode(a[:, 0])[0]
        starts = [0] + [i for i in range(1, r_all) if k[i] != k[i - 1]] + [r_all]
        if len(starts) == 2:
            return whole
        bands = []
        for lo, hi in zip(starts, starts[1:], strict=False):
            node, nr, nc = self.b.bases[int(k[lo])]
            if (nr, nc) != (hi - lo, cols) or not (
                    a[lo:hi] == self.b.offsets[int(k[lo])] + np.arange(nr * nc).reshape(nr, nc)
            ).all():
                return whole
            bands.append(slice(lo, hi))
        return bands

    def banded(self, node, operands, make, scale, *, shape=None, out_cols=None, lead=0,
               out_shape=None):
        """The activation of ``node``: ``make(ins, rows, stem) -> IR node`` applied band by
        band (:meth:`_bands` of ``operands[lead]``), each operand as :meth:`_operand2d` gives
        it; the output has ``out_shape`` (default the node's calibrated shape) and ``out_cols``
        columns a band (default the fold's)."""
        out_shape = tuple(self.cal[node.name].shape) if out_shape is None else out_shape
        shape = out_shape if shape is None else shape
        r_all, cols = _fold2d(shape)
        bands = self._bands(operands[lead], shape)
        parts = []
        for i, rows in enumerate(bands):
            ins = [self._operand2d(v, shape, rows) for v in operands]
            n = rows.stop - rows.start
            stem = node.name if len(bands) == 1 else f"{node.name}_b{i}"
            parts.append(self.b.base(make(ins, n, stem), n, out_cols or cols))
        return _Act(np.concatenate(parts).reshape(out_shape), scale)

    def linear_sum(self, node, operands):
        """``sum_k coef_k * x_k`` for (value, coef) ``operands``, requantized once: the
        constants folded into the additive term."""
        scale = self.value_scale(node)
        values = [v for v, _ in operands]
        self._check_float(*values)
        lead = next(i for i, v in enumerate(values) if isinstance(v, _Act))
        cols = _fold2d(self.cal[node.name].shape)[1]

        def make(ins, rows, stem):
            terms, bias = [], None
            for (v, coef), x in zip(operands, ins, strict=True):
                if isinstance(v, _Act):
                    terms.append((x, coef * v.scale, QMAX))
                else:
                    bias = coef * x if bias is None else bias + coef * x
            return self.b.requant(terms, scale, bias=bias, stem=stem, shape2d=(rows, cols))
        return self.banded(node, values, make, scale, lead=lead)

    def unary(self, node, x, kind, scale=None, **attrs):
        """An IR op of one operand that keeps the int8 type, band by band."""
        return self.banded(node, [x], lambda ins, rows, stem: self.b.add(
            kind, ins[0], stem=stem, **attrs), x.scale if scale is None else scale)

    def scaled(self, node, x, c):
        """``x * c`` for a constant scalar ``c``: a new scale (negated if ``c < 0``)."""
        if c > 0:
            return _Act(x.addr, x.scale * c, x.dtype)
        if c == 0:
            shape = tuple(self.cal[node.name].shape)
            zero = self.b.const(np.zeros(_fold2d(shape), np.int8), f"{node.name}_zero")
            return self.b.act(zero, shape, x.scale)

        def make(ins, rows, stem):
            neg = self.b.add("mul", ins[0], self.b.const(np.full((1, 1), -1, np.int32),
                                                         f"{stem}_m"), stem=f"{stem}_neg")
            return self.b.add("clip", neg, stem=stem, lo=-QMAX, hi=QMAX, dtype="int8")
        return self.banded(node, [x], make, x.scale * -c)

    def product(self, node, x, y):
        """``x * y`` elementwise (an int32 product, requantized)."""
        self._check_float(x, y)
        if isinstance(x, _Const):
            x, y = y, x
        if isinstance(y, _Const) and np.asarray(y.value).size == 1:
            return self.scaled(node, x, float(np.asarray(y.value).reshape(-1)[0]))
        scale = self.value_scale(node)
        cols = _fold2d(self.cal[node.name].shape)[1]
        if isinstance(y, _Const):
            sy = _scale_of(np.asarray(y.value, np.float64))
        else:
            sy = y.scale

        def make(ins, rows, stem):
            a, b = ins
            if isinstance(b, np.ndarray):
                b = self.b.const(_quantize(b, sy), f"{stem}_k")
            p = self.b.add("mul", a, b, stem=f"{stem}_prod")
            return self.b.requant([(p, x.scale * sy, QMAX * QMAX)], scale, stem=stem,
                                  shape2d=(rows, cols))
        return self.banded(node, [x, y], make, scale)

    def clamp(self, node, x, lo, hi):
        q_lo = -QMAX if lo is None else int(np.clip(np.ceil(lo / x.scale - 1e-9), -QMAX, QMAX))
        q_hi = QMAX if hi is None else int(np.clip(np.floor(hi / x.scale + 1e-9), -QMAX, QMAX))
        return self.unary(node, x, "clip", lo=q_lo, hi=max(q_lo, q_hi), dtype="int8")

    # Reductions ----------------------------------------------------------------------------

    def reduce(self, node, kw, x, kind):
        self._check_float(x)
        a = x.addr
        dims = kw.get("dim")
        dims = list(range(a.ndim)) if dims is None or (not isinstance(dims, int) and not dims) \
            else ([dims] if isinstance(dims, int) else list(dims))
        dims = sorted({_dim(d, a.ndim) for d in dims})
        kept = [d for d in range(a.ndim) if d not in dims]
        count = math.prod(a.shape[d] for d in dims)
        moved = _Act(np.transpose(a, kept + dims).reshape(
            tuple(a.shape[d] for d in kept) + (count,)), x.scale)
        scale = x.scale if kind == "reduce_max" else self.value_scale(node)
        per = x.scale / (count if kind == "mean" else 1)

        def make(ins, rows, stem):
            if kind == "reduce_max":
                return self.b.add("reduce_max", ins[0], stem=stem, axis=1)
            s = self.b.add("reduce_sum", ins[0], stem=f"{stem}_sum", axis=1)
            return self.b.requant([(s, per, QMAX * count)], scale, stem=stem,
                                  shape2d=(rows, 1))
        return self.banded(node, [moved], make, scale, shape=moved.shape, out_cols=1)

    # Matmul --------------------------------------------------------------------------------

    def matmul(self, node, x, w, *, bias=None, alpha=1.0):
        """``alpha * (x @ w) + bias``: int8 operands, an int32 product, requantized. A
        constant 2-D ``w`` is quantized per output column; batch dimensions of either operand
        give one 2-D matmul per batch index."""
        self._check_float(x, w)
        scale = self.value_scale(node)
        out_shape = tuple(self.cal[node.name].shape)
        if isinstance(x, _Const):
            x = self.act_of(x, _scale_of(np.asarray(x.value, np.float64)), f"{node.name}_lhs")
        bias = None if bias is None else np.asarray(bias, np.float64)
        if isinstance(w, _Const) and np.asarray(w.value).ndim == 2:
            wv = np.asarray(w.value, np.float64)
            wq, sw = _per_channel(wv.T)                      # (N, K), scale per column
            k, n = wv.shape
            wnode = self.b.const(np.ascontiguousarray(wq.T), f"{node.name}_w")
            bound = QMAX * np.abs(wq.astype(np.int64)).sum(axis=1)
            lhs = _Act(x.addr.reshape(-1, k) if x.addr.ndim != 1 else x.addr.reshape(1, k),
                       x.scale)

            def make(ins, rows, stem):
                acc = self.b.add("matmul", ins[0], wnode, stem=f"{stem}_acc")
                return self.b.requant([(acc, alpha * x.scale * sw, bound)], scale, bias=bias,
                                      stem=stem, shape2d=(rows, n))
            out = self.banded(node, [lhs], make, scale, shape=lhs.shape, out_cols=n)
            return out
        if isinstance(w, _Const):
            w = self.act_of(w, _scale_of(np.asarray(w.value, np.float64)), f"{node.name}_rhs")
        a, b = x.addr, w.addr
        a2 = a.reshape(1, -1) if a.ndim == 1 else a
        b2 = b.reshape(-1, 1) if b.ndim == 1 else b
        k = a2.shape[-1]
        if b2.shape[-2] != k:
            _refuse(f"inner dimensions {a.shape} @ {b.shape} do not match")
        batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
        if not batch or b2.ndim == 2:                     # fold the rows of x
            a2 = a2.reshape(-1, k)
            batch = ()
            blocks = [(a2, b2)]
        else:
            ab = np.broadcast_to(a2, batch + a2.shape[-2:])
            bb = np.broadcast_to(b2, batch + b2.shape[-2:])
            blocks = [(ab[i], bb[i]) for i in np.ndindex(*batch)]
        parts = []
        for i, (ablk, bblk) in enumerate(blocks):
            stem = node.name if len(blocks) == 1 else f"{node.name}_{i}"
            acc = self.b.add("matmul", self.b.block(np.ascontiguousarray(ablk)),
                             self.b.block(np.ascontiguousarray(bblk)), stem=f"{stem}_acc")
            m, n = ablk.shape[0], bblk.shape[1]
            out = self.b.requant([(acc, alpha * x.scale * w.scale, QMAX * QMAX * k)], scale,
                                 bias=bias, stem=stem, shape2d=(m, n))
            parts.append(self.b.base(out, m, n))
        return _Act(np.concatenate(parts).reshape(out_shape), scale)

    # Integer non-linear ops (rdakit.compiler.intops) -------------------------------------------

    def _last(self, x, dims):
        """``x`` with the dimensions ``dims`` moved last and folded into one; the permutation
        that moves them back (None when they are already last)."""
        a = x.addr
        dims = [_dim(d, a.ndim) for d in dims]
        kept = [d for d in range(a.ndim) if d not in dims]
        order = kept + dims
        moved = np.transpose(a, order)
        shape = moved.shape
        flat = moved.reshape(moved.shape[:len(kept)] + (-1,))
        back = None if order == list(range(a.ndim)) else np.argsort(order)
        return _Act(flat, x.scale, x.dtype), shape, back

    def intop(self, node, x, kind, attrs, out_scale, *, scale=None):
        """``kind`` (an int32 result of real scale ``out_scale``) on the int8 activation ``x``,
        band by band, requantized to ``scale`` (default: the node's calibrated scale). The
        bound of the int32 result is exact: the op run on every int8 value."""
        scale = self.value_scale(node) if scale is None else scale
        every = np.arange(-QMAX, QMAX + 1, dtype=np.int32)[None, :]
        bound = int(np.max(np.abs(OP_KINDS[kind].evaluate([every], attrs).astype(np.int64))))
        cols = _fold2d(x.shape)[1]

        def make(ins, rows, stem):
            y = self.b.add(kind, ins[0], stem=f"{stem}_{kind}", **attrs)
            return self.b.requant([(y, out_scale, bound)], scale, stem=stem,
                                  shape2d=(rows, cols), pre=_pre_shift(bound))
        return self.banded(node, [x], make, scale)

    def activation(self, node, x, kind):
        """GELU, SiLU, sigmoid or tanh: :func:`intops.gelu_params` (...) of the input's
        scale."""
        self._check_float(x)
        params = {"gelu": intops.gelu_params, "silu": intops.silu_params,
                  "sigmoid": intops.sigmoid_params, "tanh": intops.tanh_params}[kind]
        try:
            attrs = params(x.scale)
        except ValueError as e:
            _refuse(f"the input's scale {x.scale:g} is out of the integer {kind}'s range: {e}")
        return self.intop(node, x, kind, attrs, intops.output_scale(kind, attrs))

    def exp(self, node, x):
        """``exp(x) = exp(x - M) exp(M)``, ``M`` the largest calibrated input (in steps): the
        integer exp takes ``x - M <= 0``; an input beyond ``M`` counts as ``M``."""
        self._check_float(x)
        top = int(np.clip(np.ceil(np.max(self.cal_in(node, "self")) / x.scale - 1e-9),
                          -QMAX, QMAX))
        if top * x.scale > 700:
            _refuse(f"exp of inputs up to {top * x.scale:g} overflows")
        attrs = intops.exp_params(x.scale)
        shifted = x
        if top:
            k = self.b.const(np.full((1, 1), -top, np.int32), f"{node.name}_m")

            def sub(ins, rows, stem):
                return self.b.add("add", ins[0], k, stem=f"{stem}_sub")
            shifted = self.banded(node, [x], sub, x.scale)
        return self.intop(node, shifted, "exp", attrs,
                          intops.output_scale("exp", attrs) * math.exp(top * x.scale))

    def cal_in(self, node, arg):
        """The calibrated float value of the operand ``arg`` of ``node`` (by its schema name)."""
        from torch.fx.operator_schemas import normalize_function
        pair = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                                  normalize_to_only_use_kwargs=True)
        kw = pair.kwargs if pair is not None else node.kwargs
        a = kw[arg] if arg in kw else kw["input" if arg == "self" else arg]
        return self.cal[a.name] if hasattr(a, "name") else np.asarray(a, np.float64)

    def softmax(self, node, x, dim):
        """Softmax over ``dim``: int8 probabilities of scale ``2**-SOFTMAX_BITS``, no
        requantization."""
        self._check_float(x)
        moved, shape, back = self._last(x, [dim])
        attrs = self._softmax_attrs(x.scale)

        def make(ins, rows, stem):
            return self.b.add("softmax", ins[0], stem=stem, **attrs)
        out = self.banded(node, [moved], make, SOFTMAX_SCALE, shape=moved.shape,
                          out_shape=moved.shape)
        addr = out.addr.reshape(shape)
        return _Act(addr if back is None else np.transpose(addr, back), SOFTMAX_SCALE)

    @staticmethod
    def _softmax_attrs(scale, causal=None):
        try:
            attrs = intops.softmax_params(scale, SOFTMAX_BITS)
        except ValueError as e:
            _refuse(f"the logits' scale {scale:g} is out of the integer softmax's range: {e}")
        return attrs if causal is None else dict(attrs, causal=int(causal))

    def norm(self, node, kind, x, shape, weight, bias, eps):
        """LayerNorm or RMSNorm over the trailing dimensions ``shape``: int8 weights (one
        scale), the bias in the op at the result's scale, requantized."""
        self._check_float(x)
        for what, v in (("weight", weight), ("bias", bias)):
            if isinstance(v, _Act):
                _refuse(f"the {what} must be a constant, not a tensor computed from the inputs")
        n = len(shape)
        if tuple(x.shape[x.addr.ndim - n:]) != tuple(shape):
            _refuse(f"normalized_shape {list(shape)} is not the trailing shape of the input "
                    f"{list(x.shape)}")
        moved, _, _ = self._last(x, range(x.addr.ndim - n, x.addr.ndim))
        c = moved.shape[-1]
        w = np.ones(c) if weight is None else np.asarray(weight.value, np.float64).reshape(c)
        ws = _scale_of(w)
        wq = _quantize(w, ws)
        params = intops.layer_norm_params if kind == "layer_norm" else intops.rms_norm_params
        try:
            attrs = params(x.scale, QMAX * x.scale, c, "int8", float(eps))
        except ValueError as e:
            _refuse(str(e))
        out_scale = intops.output_scale(kind, attrs, ws)
        bq = None
        if kind == "layer_norm":
            b = np.zeros(c) if bias is None else np.asarray(bias.value, np.float64).reshape(c)
            bq = np.rint(b / out_scale)
            if np.abs(bq).max(initial=0) > (1 << 30):
                _refuse("the bias is too large for the weights (more than 2**30 steps of "
                        "weight scale / 2**frac)")
        bound = intops._z_max(c, attrs["frac"]) * int(np.abs(wq.astype(np.int64)).max()) + (
            0 if bq is None else int(np.abs(bq).max(initial=0)))
        scale = self.value_scale(node)
        wnode = self.b.const(wq, f"{node.name}_w")
        bnode = None if bq is None else self.b.const(bq.astype(np.int32), f"{node.name}_b")

        def make(ins, rows, stem):
            y = self.b.add(kind, ins[0], wnode, *([] if bnode is None else [bnode]),
                           stem=f"{stem}_{kind}", **attrs)
            return self.b.requant([(y, out_scale, bound)], scale, stem=stem,
                                  shape2d=(rows, c), pre=_pre_shift(bound))
        out_shape = tuple(self.cal_out(node).shape)
        out = self.banded(node, [moved], make, scale, shape=moved.shape, out_shape=moved.shape)
        return _Act(out.addr.reshape(out_shape), scale)

    def hand_norm(self, node, match, env):
        """The result of a recognised hand-written norm (:mod:`norms`) at its last node
        ``node``: :meth:`norm` over the last dimension with the folded weight and bias."""
        x = env[match.x.name]
        weight, bias = (None if n is None else env[n.name] for n in (match.weight, match.bias))
        return self.norm(node, match.kind, x, [x.shape[-1]], weight, bias, match.eps)

    def cal_out(self, node):
        """The calibrated value of ``node`` (the first result of a multi-result op)."""
        v = self.cal[node.name]
        return v[0] if isinstance(v, list) else v

    def embedding(self, node, table, idx):
        """Rows of a constant table (int8, one scale) chosen by int32 indices (a graph input,
        whole or a contiguous run of it)."""
        if not isinstance(table, _Const):
            _refuse("the table must be a constant (the embedding's weights)")
        if not isinstance(idx, _Act) or idx.scale is not None:
            _refuse("the indices must be integers computed from the inputs")
        t = np.asarray(table.value, np.float64)
        if t.ndim != 2:
            _refuse(f"the table must be 2-D (rows, columns), not of shape {list(t.shape)}")
        scale = _scale_of(t)
        tnode = self.b.const(_quantize(t, scale), f"{node.name}_table")
        flat = idx.addr.reshape(-1)
        k, r, c = self.b._decode(flat)
        base = self.b.bases[int(k[0])] if flat.size else None
        start = int(flat[0] - self.b.offsets[int(k[0])]) if flat.size else 0
        if (not flat.size or not (k == k[0]).all() or base[0] not in self.b.int_inputs
                or not (flat == flat[0] + np.arange(flat.size)).all()):
            _refuse("the indices must be a graph input, or a contiguous run of one (no "
                    "reordering)")
        ids = base[0]
        if (start, flat.size) != (0, base[1] * base[2]):
            ids = self.b.add("slice", ids, stem=f"{node.name}_ids", axis=0, start=start,
                             stop=start + flat.size)
        out = self.b.add("embedding", tnode, ids, stem=node.name)
        return self.b.act(out, idx.shape + (t.shape[1],), scale)

    def attention(self, node, kw):
        """``scaled_dot_product_attention``: per batch index (head), ``q @ k^T`` requantized
        with the scale and any additive mask, an integer softmax (causal for ``is_causal`` or
        a constant causal mask), ``p @ v`` requantized."""
        q, k, v = kw["query"], kw["key"], kw["value"]
        self._check_float(q, k, v)
        if kw.get("dropout_p", 0.0):
            _refuse("dropout_p must be 0 (export the model in eval mode)")
        q, k, v = (t if isinstance(t, _Act) else self.act_of(
            t, _scale_of(np.asarray(t.value, np.float64)), f"{node.name}_{n}")
            for t, n in ((q, "q"), (k, "k"), (v, "v")))
        qa, ka, va = q.addr, k.addr, v.addr
        if min(qa.ndim, ka.ndim, va.ndim) < 2:
            _refuse("query, key and value must have at least 2 dimensions")
        if kw.get("enable_gqa") and qa.ndim >= 3 and ka.shape[-3] != qa.shape[-3]:
            rep = qa.shape[-3] // ka.shape[-3]
            ka, va = np.repeat(ka, rep, axis=-3), np.repeat(va, rep, axis=-3)
        e = qa.shape[-1]
        sc = kw.get("scale")
        sc = 1.0 / math.sqrt(e) if sc is None else float(sc)
        length, width = qa.shape[-2], ka.shape[-2]
        qf = self.cal_in(node, "query")
        kf = self.cal_in(node, "key")
        if kf.shape != ka.shape:
            kf = np.repeat(kf, ka.shape[-3] // kf.shape[-3], axis=-3)
        scores = np.matmul(qf, np.swapaxes(kf, -1, -2)) * sc
        bias, causal = self._attention_mask(kw, scores.shape)
        if bias is not None:
            scores = scores + bias
        keep = np.ones(scores.shape[-2:], bool) if causal is None else (
            np.arange(width)[None, :] <= np.arange(length)[:, None] + causal)
        s_scale = _scale_of(np.where(keep, scores, 0.0))
        attrs = self._softmax_attrs(s_scale, causal)
        out_scale = self.value_scale(node)
        batch = np.broadcast_shapes(qa.shape[:-2], ka.shape[:-2], va.shape[:-2],
                                    scores.shape[:-2])
        qb = np.broadcast_to(qa, batch + qa.shape[-2:])
        kb = np.broadcast_to(np.swapaxes(ka, -1, -2), batch + (e, width))
        vb = np.broadcast_to(va, batch + va.shape[-2:])
        bb = None if bias is None else np.broadcast_to(bias, batch + (length, width))
        parts = []
        for i, index in enumerate(np.ndindex(*batch)):
            stem = node.name if not batch else f"{node.name}_{i}"
            acc = self.b.add("matmul", self.b.block(np.ascontiguousarray(qb[index])),
                             self.b.block(np.ascontiguousarray(kb[index])), stem=f"{stem}_qk")
            s = self.b.requant([(acc, q.scale * k.scale * sc, QMAX * QMAX * e)], s_scale,
                               bias=None if bb is None else np.where(keep, bb[index], 0.0),
                               stem=f"{stem}_s", shape2d=(length, width))
            p = self.b.add("softmax", s, stem=f"{stem}_p", **attrs)
            acc = self.b.add("matmul", p, self.b.block(np.ascontiguousarray(vb[index])),
                             stem=f"{stem}_pv")
            out = self.b.requant([(acc, SOFTMAX_SCALE * v.scale, QMAX * QMAX * width)],
                                 out_scale, stem=stem, shape2d=(length, vb.shape[-1]))
            parts.append(self.b.base(out, length, vb.shape[-1]))
        return _Act(np.concatenate(parts).reshape(batch + (length, vb.shape[-1])), out_scale)

    def _attention_mask(self, kw, shape):
        """``(bias, causal)`` of an attention's mask: the finite additive part (real units, or
        None) and ``k`` of a causal pattern (row ``i`` keeps the columns ``j <= i + k``; None
        for no masked entry)."""
        mask, length, width = kw.get("attn_mask"), shape[-2], shape[-1]
        if kw.get("is_causal"):
            if mask is not None:
                _refuse("is_causal and attn_mask together")
            return None, 0
        if mask is None:
            return None, None
        if isinstance(mask, _Act):
            _refuse("the attention mask must be a constant, not a tensor computed from the "
                    "inputs")
        m = np.asarray(mask.value)
        if m.dtype == bool:
            m = np.where(m, 0.0, -np.inf)
        m = np.asarray(m, np.float64)
        masked = np.isneginf(m)
        if np.isnan(m).any() or np.isposinf(m).any():
            _refuse("the attention mask holds NaN or +inf")
        bias = np.where(masked, 0.0, m)
        bias = None if not bias.any() else bias
        if not masked.any():
            return bias, None
        rows = np.broadcast_to(masked, shape[:-2] + (length, width)).reshape(-1, length, width)
        kept0 = int((~rows[0, 0]).sum())
        causal = kept0 - 1
        want = np.arange(width)[None, :] > np.arange(length)[:, None] + causal
        if causal < 0 or not (rows == want).all():
            _refuse("an attention mask that masks entries (-inf or False) must be causal: row "
                    "i keeps the columns j <= i + k for one k >= 0")
        return bias, causal

    # Mixture of experts --------------------------------------------------------------------

    def routed(self, node, role, env):
        """The value of ``node``, of ``role`` in a recognised routing (:mod:`moe`): the topk
        gives the IR's ``topk`` and gates, an expert's ``x[token]`` its ``dispatch``, the last
        scatter the ``combine`` of every expert's output; the other nodes have no value."""
        kind, routing = role[0], role[1]
        if kind == "drop":
            return _Routed(node.name)
        state = self.routes.setdefault(id(routing), {"ys": {}})
        if kind == "topk":
            logits = env[routing.logits.name]
            if not isinstance(logits, _Act) or logits.scale is None:
                _refuse("the router's logits must be computed from the inputs")
            ln = self.b.materialize(logits)
            idx = self.b.add("topk", ln, stem=f"{node.name}_idx", k=routing.k)
            attrs = self._softmax_attrs(logits.scale)
            gate_scale = SOFTMAX_SCALE
            if routing.renormalised and routing.k == 1:
                # One chosen expert: its renormalised gate is exactly 1.
                gate = self.b.const(np.ones((logits.shape[0], 1), np.int8), f"{node.name}_gates")
                gate_scale = 1.0
            elif routing.renormalised:
                # p_i / sum_j p_j over the chosen j is the softmax of the chosen logits.
                chosen = self.b.add("take", ln, idx, stem=f"{node.name}_logits")
                gate = self.b.add("softmax", chosen, stem=f"{node.name}_gates", **attrs)
            else:
                probs = self.b.add("softmax", ln, stem=f"{node.name}_probs", **attrs)
                gate = self.b.add("take", probs, idx, stem=f"{node.name}_gates")
            state.update(idx=idx, gate=gate, gate_scale=gate_scale)
            return _Routed(node.name)
        member = role[2] if len(role) > 2 else next(
            m for m in routing.members if m.scatter is node)
        if kind == "gather":
            x = env[routing.tokens.name]
            self._check_float(x)
            rows = self.b.add("dispatch", self.b.materialize(x), state["idx"], stem=node.name,
                              expert=member.index, experts=routing.experts)
            return self.b.act(rows, x.shape, x.scale)
        y = env[member.output.name]
        self._check_float(y)
        state["ys"][member.index] = y
        if kind == "gated":
            return _Routed(node.name)
        ys = [state["ys"][e] for e in range(routing.experts)]
        common = max(y.scale for y in ys)        # every expert's output at one scale
        nodes = [self.b.materialize(self.rescale(y, common, f"{node.name}_e{e}"))
                 for e, y in enumerate(ys)]
        total = self.b.add("combine", state["idx"], state["gate"], *nodes,
                           stem=f"{node.name}_sum", shift=0)
        shape = tuple(self.cal[node.name].shape)
        scale = self.value_scale(node)
        bound = routing.k * QMAX * (1 if state["gate_scale"] == 1.0 else QMAX)
        out = self.b.requant([(total, common * state["gate_scale"], bound)], scale,
                             stem=node.name, shape2d=_fold2d(shape))
        return self.b.act(out, shape, scale)

    # Dispatch ------------------------------------------------------------------------------

    def node(self, node, args, kw):
        """The value of ``node`` (a call of a supported op reading at least one activation)."""
        name = op_name(node.target)
        base = name.split(".")[1]
        op = ATEN_OPS[name]
        if name == "operator.getitem":
            value = args[0][args[1]]
            if isinstance(value, _Unused):
                _refuse(value.why)
            return value
        if base in ("split", "split_with_sizes", "chunk", "unbind"):
            return self.pieces(node, kw, kw["input"] if "input" in kw else kw["self"])
        if base == "cat":
            return self.cat(node, kw)
        x = kw.get("input", kw.get("self"))
        if op.layout:
            self._check_float(x)
            return self.layout(node, kw, x)
        if base in ("add", "sub"):
            sign = 1 if base == "add" else -1
            return self.linear_sum(node, [(x, 1.0),
                                          (_value(kw["other"]), sign * kw.get("alpha", 1))])
        if base == "rsub":
            return self.linear_sum(node, [(x, -kw.get("alpha", 1)),
                                          (_Const(np.asarray(kw["other"], np.float64)), 1.0)])
        if base == "mul":
            return self.product(node, x, _value(kw["other"]))
        if base == "div":
            other = kw["other"]
            if isinstance(other, _Act):
                _refuse("the divisor must be a constant, not a tensor computed from the "
                        "inputs")
            if kw.get("rounding_mode") is not None:
                _refuse(f"rounding_mode={kw['rounding_mode']!r} is not supported")
            value = np.asarray(other.value if isinstance(other, _Const) else other, np.float64)
            if (value == 0).any():
                _refuse("division by zero")
            if value.size == 1:
                return self.scaled(node, x, 1.0 / float(value.reshape(-1)[0]))
            return self.product(node, x, _Const(1.0 / value))
        if base == "neg":
            return self.scaled(node, x, -1.0)
        if base == "relu":
            self._check_float(x)
            return self.unary(node, x, "relu")
        if base == "clamp":
            return self.clamp(node, x, kw.get("min"), kw.get("max"))
        if base == "hardtanh":
            return self.clamp(node, x, kw["min_val"], kw["max_val"])
        if base in ("sum", "mean", "amax"):
            if kw.get("dtype") is not None:
                _refuse(f"dtype={kw['dtype']} is not supported")
            return self.reduce(node, kw, x, {"sum": "sum", "mean": "mean",
                                             "amax": "reduce_max"}[base])
        if base == "linear":
            w = kw["weight"]
            bias = None if kw["bias"] is None else kw["bias"]
            if isinstance(bias, _Act):
                _refuse("the bias must be a constant")
            wt = _Const(np.asarray(w.value).T) if isinstance(w, _Const) else _Act(
                w.addr.T, w.scale)
            return self.matmul(node, x, wt, bias=None if bias is None else bias.value)
        if base == "addmm":
            bias = x
            if isinstance(bias, _Act):
                _refuse("the added tensor must be a constant")
            return self.matmul(node, kw["mat1"], kw["mat2"], alpha=kw.get("alpha", 1),
                               bias=np.asarray(bias.value, np.float64) * kw.get("beta", 1))
        if base in ("softmax", "_softmax", "_safe_softmax"):
            if kw.get("half_to_float") or kw.get("dtype") not in (None, self.torch.float32):
                _refuse("a softmax to another dtype is not supported")
            return self.softmax(node, x, kw["dim"])
        if base in ("gelu", "silu", "sigmoid", "tanh"):
            return self.activation(node, x, base)
        if base == "exp":
            return self.exp(node, x)
        if base in ("layer_norm", "native_layer_norm"):
            out = self.norm(node, "layer_norm", x, kw["normalized_shape"], kw.get("weight"),
                            kw.get("bias"), kw.get("eps", 1e-5))
            if base == "layer_norm":
                return out
            why = "the mean and 1/std results of native_layer_norm are not supported"
            return [out, _Unused(why), _Unused(why)]
        if base == "rms_norm":
            eps = kw.get("eps")
            eps = float(np.finfo(np.float32).eps) if eps is None else eps
            return self.norm(node, "rms_norm", x, kw["normalized_shape"], kw.get("weight"),
                             None, eps)
        if base == "embedding":
            return self.embedding(node, kw["weight"], kw["indices"])
        if base == "scaled_dot_product_attention":
            return self.attention(node, kw)
        if base in ("mm", "bmm"):
            return self.matmul(node, x, kw["mat2"])
        if base == "matmul":
            return self.matmul(node, x, kw["other"])
        raise AssertionError(f"no handler for registered op {name}")  # pragma: no cover


# --- the program --------------------------------------------------------------------------------

def _numpy(value):
    """A float64 (or int) numpy array of a torch value; lists element by element."""
    if isinstance(value, list | tuple):
        return [_numpy(v) for v in value]
    if hasattr(value, "detach"):
        t = value.detach().cpu()
        return t.numpy().astype(np.float64) if t.is_floating_point() else t.numpy()
    return np.asarray(value)


def _calibrate(torch, program, flat_args):
    """Run the program's graph on ``flat_args`` (every placeholder, in order), recording every
    node's output as numpy."""
    record = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            record[n.name] = _numpy(out)
            return out

    with torch.no_grad():
        outputs = Recorder(program.graph_module).run(*flat_args)
    return record, outputs


def _example_inputs(torch, program, example_inputs, seed):
    """The flat list of user inputs and where they came from."""
    if example_inputs is not None:
        source = "given"
        args = example_inputs
    elif program.example_inputs is not None:
        source = "the program's example_inputs"
        args = program.example_inputs
    else:
        source = f"random (seed {seed})"
        gen = torch.Generator().manual_seed(seed)
        args = []
        by_name = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        for name in program.graph_signature.user_inputs:
            val = by_name[name].meta.get("val")
            if val.is_floating_point():
                args.append(torch.randn(tuple(val.shape), generator=gen, dtype=val.dtype))
            else:
                args.append(torch.randint(0, 2, tuple(val.shape), generator=gen,
                                          dtype=val.dtype))
        return args, source
    if not isinstance(args, tuple) or len(args) != 2 or not isinstance(args[1], dict):
        args = (tuple(args), {})
    flat = torch.utils._pytree.tree_leaves((tuple(args[0]), dict(args[1])))
    return flat, source


def _const_fold(value):
    if isinstance(value, list):
        return [_const_fold(v) for v in value]
    return _Const(np.asarray(value))


def import_program(program, example_inputs=None, *, name=None, seed=EXAMPLE_SEED):
    """Import a ``torch.export`` program as an integer IR graph.

    Parameters
    ----------
    program : torch.export.ExportedProgram, str or path
        The program, or the path of a ``.pt2`` file from ``torch.export.save``.
    example_inputs : tuple, optional
        The inputs to calibrate on (positional arguments, or ``(args, kwargs)``). Default: the
        program's ``example_inputs`` (saved with it), else random normal floats (and random
        0/1 integers) of the exported shapes from ``seed``.
    name : str, optional
        Name of the graph (default: the file's stem, or ``"model"``).
    seed : int
        Seed of the random example inputs.

    Returns
    -------
    ImportedModel

    Raises
    ------
    ModelImportError
        If the file is not a saved program, torch is missing, the program has ops the importer
        does not handle (every one listed with its count), an op is used in a way it does not
        handle (the node named), or the program mutates buffers or has non-tensor outputs.
    """
    if isinstance(program, str | os.PathLike):
        what = repr(str(program))
        name = name or pathlib.Path(program).stem
        program = load_program(program)
    else:
        what = "the program"
        name = name or "model"
    torch = require_torch(what)
    if not isinstance(program, torch.export.ExportedProgram):
        raise ModelImportError(f"import_program needs a torch.export.ExportedProgram or the "
                               f"path of a .pt2 file, not {type(program).__name__}")
    from torch.export.graph_signature import InputKind, OutputKind

    program = prepare(program)
    live = live_nodes(program)
    try:
        plan = moe.recognise(program, live)
    except moe.RoutingError as e:
        raise ModelImportError(f"{_capital(what)}: node {e.node.name} ({op_name(e.node.target)})"
                               f": {e}") from None
    hand_norms = norms.recognise(program, live)
    inside_norms = norms.matched_nodes(hand_norms)
    coverage = op_coverage(program, decompose=False,
                           routed=set(plan.roles) | inside_norms)
    message = unsupported_summary(coverage, _capital(what))
    if message:
        raise ModelImportError(message)
    sig = program.graph_signature
    bad = [o for o in sig.output_specs if o.kind != OutputKind.USER_OUTPUT]
    if bad:
        raise ModelImportError(f"{_capital(what)} updates buffers or gradients "
                               f"({bad[0].kind.name}); export the model in eval mode without "
                               f"side effects")
    flat_user, source = _example_inputs(torch, program, example_inputs, seed)
    if len(flat_user) != len(sig.user_inputs):
        raise ModelImportError(f"{_capital(what)} takes {len(sig.user_inputs)} inputs, but "
                               f"{len(flat_user)} example inputs were given")
    flat_args, users = [], iter(flat_user)
    state = {**program.state_dict, **program.constants}
    for spec in sig.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            flat_args.append(next(users))
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            flat_args.append(state[spec.target])
        else:
            raise ModelImportError(f"{_capital(what)} has an input of kind {spec.kind.name} "
                                   f"({spec.arg.name}), which the importer does not take")
    calibration, float_out = _calibrate(torch, program, flat_args)
    for node_name, rows in plan.dynamic.items():
        # An expert's rows are as many as torch routed to it; in the IR they are run-time rows
        # bounded by the tokens: zero rows keep the scales and give the IR's shapes.
        v = calibration[node_name]
        calibration[node_name] = np.concatenate([v, np.zeros((rows - len(v),) + v.shape[1:])])

    builder = _Builder(name)
    walker = _Walker(builder, calibration, torch)
    env, inputs, input_scales, folded = {}, {}, {}, 0
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    for n, spec, value in zip(placeholders, sig.input_specs, flat_args, strict=True):
        v = _numpy(value)
        if spec.kind != InputKind.USER_INPUT:
            env[n.name] = _Const(v)
            continue
        node_name = builder.name(n.name)
        if np.issubdtype(v.dtype, np.floating):
            scale = _scale_of(v)
            q = _quantize(v, scale)
            # An image a convolution reads: (N * C, H * W), the NCHW bytes (conv.image_fold).
            shape2d = conv.image_fold(n, q.shape) or _fold2d(q.shape)
            builder.g.input(node_name, shape2d, "int8")
            env[n.name] = _Act(builder.base(node_name, *shape2d).reshape(q.shape), scale)
        else:
            if (np.abs(v) > _INT32).any():
                raise ModelImportError(f"input {n.name} of {what} holds integers beyond int32")
            # Indices are 1-D in the IR (an embedding of (N,) indices gives (N, D) rows).
            q = v.astype(np.int32)
            scale = None
            builder.g.input(node_name, (max(1, q.size),), "int32")
            builder.int_inputs.add(node_name)
            env[n.name] = _Act(builder.base(node_name, 1, q.size).reshape(q.shape), None,
                               "int32")
        inputs[node_name] = q.reshape(-1) if scale is None else q.reshape(shape2d)
        input_scales[node_name] = scale
    for n in program.graph.nodes:
        if n.op != "call_function":
            continue
        if n.name not in live:
            env[n.name] = _const_fold(calibration[n.name])
            folded += 1
            continue
        args = torch.fx.node.map_arg(n.args, lambda a: env[a.name])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: env[a.name])
        kw = kwargs
        if not op_name(n.target).startswith("operator."):
            from torch.fx.operator_schemas import normalize_function
            pair = normalize_function(n.target, tuple(args), dict(kwargs),
                                      normalize_to_only_use_kwargs=True)
            kw = pair.kwargs if pair is not None else kwargs
        try:
            role = plan.roles.get(n.name)
            if role is not None:
                value = walker.routed(n, role, env)
            elif n.name in hand_norms:
                value = walker.hand_norm(n, hand_norms[n.name], env)
            elif n.name in inside_norms:
                # Inside a recognised norm: read by the norm's other nodes only.
                value = _Unused("part of a recognised norm")
            else:
                value = conv.dispatch(walker, n, args, kw)  # convolutions, pooling; else node
        except _NodeError as e:
            raise ModelImportError(f"{_capital(what)}: node {n.name} ({op_name(n.target)}): "
                                   f"{e}") from None
        _check_shape(n, value, calibration[n.name], what)
        env[n.name] = value
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    results = torch.utils._pytree.tree_leaves(output_node.args)
    output_scales, output_shapes, float_outputs = {}, {}, {}
    out_names = ["y"] if len(results) == 1 else [f"y{i}" for i in range(len(results))]
    for oname, r, fv in zip(out_names, results, torch.utils._pytree.tree_leaves(float_out),
                            strict=True):
        value = env[r.name] if hasattr(r, "name") else _Const(np.asarray(r))
        fv = _numpy(fv)
        if isinstance(value, _Const):
            scale = _scale_of(np.asarray(value.value, np.float64))
            value = walker.act_of(value, scale, f"{oname}_const")
        if value.scale is None:
            raise ModelImportError(f"output {oname} of {what} is an integer tensor (indices); "
                                   f"the importer returns quantized activations only")
        builder.g.output(builder.name(oname), builder.materialize(value))
        output_scales[oname] = value.scale
        output_shapes[oname] = tuple(fv.shape)
        float_outputs[oname] = fv
    try:
        graph = builder.g.validate()
    except GraphError as e:  # pragma: no cover - an importer bug, not the user's
        raise AssertionError(f"the imported graph is invalid: {e}") from e
    model = ImportedModel(name=graph.name, graph=graph, inputs=inputs,
                          input_scales=input_scales, output_scales=output_scales,
                          output_shapes=output_shapes, float_outputs=float_outputs,
                          accuracy=None, coverage=coverage, example_source=source,
                          folded=folded)
    got = model.dequantize(model.evaluate())
    model.accuracy = AccuracyReport(tuple(_accuracy(k, float_outputs[k], got[k])
                                          for k in out_names))
    return model


def _capital(text):
    return text[:1].upper() + text[1:]


def _check_shape(node, value, calibrated, what):
    """The importer's own check: the value's shape is the one torch computed."""
    if isinstance(value, list):
        for v, c in zip(value, calibrated, strict=True):
            _check_shape(node, v, c, what)
        return
    if isinstance(value, _Act) and value.shape != tuple(np.shape(calibrated)):
        raise AssertionError(f"{what}: node {node.name} has shape {value.shape} in the importer "
                             f"but {np.shape(calibrated)} in torch")


@functools.lru_cache(maxsize=8)
def _load_cached(path, mtime_ns, size):
    return import_program(path)


def load_workload(path):
    """The :class:`~rdakit.compiler.workloads.Workload` of the ``.pt2`` file ``path`` (the
    imported graph, its quantized example inputs, its evaluate as the reference); imported once
    per file version in a process (``rdakit run`` loads its workload more than once)."""
    check_program_file(path)
    st = os.stat(path)
    return _load_cached(str(pathlib.Path(path).resolve()), st.st_mtime_ns, st.st_size).workload()
