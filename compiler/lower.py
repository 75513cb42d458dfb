"""Lowering: a partitioned and placed dataflow graph to CU programs, host buffers and a job.

:func:`lower` turns a validated :class:`~rdakit.compiler.graph.DataflowGraph`, the partition of
its nodes and their :class:`~rdakit.compiler.placement.Placement` into a
:class:`CompiledJob` (a :class:`rdakit.compiler.job.Job`, so that
:func:`~rdakit.sim.runtime.job.run_job` and :func:`~rdakit.sim.runtime.job.run_job_interp` run it
unchanged). The design is in ``docs/compiler.md`` ("Lowering"); in short:

* **Layout.** A tensor of shape ``(R, C)`` (or ``(C,)``, one row) is ``R`` rows of
  ``cw = ceil(C / lanes)`` vector words, one int32 lane per element whatever its dtype, padding
  lanes zero. Every op keeps padding lanes zero (an op that could break that masks them).
* **Buffers.** Graph inputs and the host-written constants are host buffers (the constants a
  CU reads share one *pool* buffer); graph outputs are host buffers the producing CU appends
  to. Every other tensor is allocated at run time (``ALLOC``) by the CU that produces it,
  in an MU near it, with total weight = one share per CU that reads it; a reader returns its
  share (``RETI``) after its last use, so the buffer is freed after the last reader
  (partial-free). Host inputs and constant pools are shared the same way (the host allocates
  them with one share per reading CU), so they too are freed after their last reader.
* **Dependencies.** A run-time buffer's reference goes from producer to consumer by ``SENDREF``
  into a mailbox slot, received at the consumer's first use (``RECV``); slots are reused in
  order, and a producer whose reference would land in a reused slot first waits for a credit
  token the consumer sends when it empties the slot. A tensor in a host buffer written by a CU
  (a graph output read by other CUs, or a KV cache grown in place) is signalled by a token
  (``SEND``/``WAIT``). Every CU runs its ops in one global topological order and every wait
  is for an event earlier in that order, so programs cannot deadlock.
* **Ops** become streams (``SRUN``): see ``docs/compiler.md`` for each kind.

What does not fit raises :class:`LoweringError` naming it (the node, the CU or the MU, and the
numbers): programs longer than ``prog_len``, buffers beyond the MUs' capacity, local-buffer
needs beyond ``local_words``, unsupported op kinds or shapes.
"""

import collections
import dataclasses

import numpy as np

from rdakit.compiler.graph import GraphError
from rdakit.compiler.job import HostBuffer, Job, Ref
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.isa import AluFn, BMode, DMode, Instr, Op, StreamField, alu
from rdakit.hdl.spec.params import AllocMode, RefcountMode

__all__ = [
    "LoweringError", "TensorLayout", "CompiledJob", "ProgramInfo", "lower", "LOWERABLE_KINDS",
    "sample_inputs", "replay_refs",
]

MASK32 = 0xffff_ffff
INT_MIN = 0x8000_0000          # as an unsigned 32-bit word
INT_MAX = 0x7fff_ffff

#: Op kinds the lowering turns into CU programs (every kind of the op table).
LOWERABLE_KINDS = frozenset({
    "input", "const", "output", "matmul", "add", "sub", "mul", "max", "min", "relu", "shr",
    "shl", "clip", "transpose", "reduce_sum", "reduce_max", "slice", "concat", "append", "topk",
    "take", "dispatch", "combine",
})

_BINARY = {"add": AluFn.ADD, "sub": AluFn.SUB, "mul": AluFn.MUL, "max": AluFn.MAX,
           "min": AluFn.MIN}
_COMMUTATIVE = {"add", "mul", "max", "min"}

# Registers: r0..r7 are an op's temporaries, r8..r14 hold references (a cache backed by the
# CU's reference table when they do not fit), r15 holds the reference table itself.
_TEMPS = 8
_REF_REGS = tuple(range(8, 15))
_TABLE = 15


class LoweringError(ValueError):
    """A graph that cannot be lowered onto the fabric; the message names the node, CU or MU and
    what does not fit."""


# --- Layout ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How a tensor lies in an MU buffer.

    A 2-D tensor ``(rows, cols)`` is ``rows`` rows of :attr:`cw` vector words; element
    ``(r, c)`` is lane ``c % lanes`` of word ``r * cw + c // lanes``. A 1-D tensor is one row.
    Every element is one int32 lane whatever the dtype; padding lanes are zero.

    Members
    -------
    rows, cols : int
        Shape (``rows`` is the bound of a dynamic tensor).
    lanes : int
        Lanes of a vector word.
    dtype : str
        The tensor's element type (values are stored as int32).
    dynamic : bool
        Whether the number of rows is known only at run time.
    ndim : int
        1 or 2: the shape :meth:`decode` returns.
    """

    rows: int
    cols: int
    lanes: int
    dtype: str = "int32"
    dynamic: bool = False
    ndim: int = 2

    @property
    def cw(self):
        """Vector words per row."""
        return -(-self.cols // self.lanes)

    @property
    def words(self):
        """Vector words at the bound."""
        return self.rows * self.cw

    def encode(self, value):
        """The vector words (``n x lanes`` int32) holding ``value``."""
        a = np.asarray(value)
        a = a.reshape(1, -1) if self.ndim == 1 else a
        if a.ndim != 2 or a.shape[1] != self.cols or (
                a.shape[0] != self.rows if not self.dynamic else a.shape[0] > self.rows):
            raise ValueError(f"value of shape {np.shape(value)} does not fit the layout "
                             f"{self.describe()}")
        out = np.zeros((a.shape[0], self.cw * self.lanes), dtype=np.int64)
        out[:, :self.cols] = a
        return out.astype(np.int32).reshape(-1, self.lanes)

    def decode(self, words, *, check_padding=False):
        """The tensor held in vector words ``words`` (``n x lanes``), with its dtype; with
        ``check_padding``, raise ``ValueError`` unless every padding lane is zero."""
        w = np.asarray(words, dtype=np.int32).reshape(-1)
        row = self.cw * self.lanes
        if row == 0 or len(w) % row:
            raise ValueError(f"{len(w) // max(self.lanes, 1)} vector words are not whole rows "
                             f"of the layout {self.describe()}")
        if check_padding and np.any(w.reshape(-1, row)[:, self.cols:]):
            raise ValueError(f"padding lanes of a tensor of layout {self.describe()} are not "
                             f"zero")
        a = w.reshape(-1, row)[:, :self.cols].astype(self.dtype)
        return a.reshape(-1) if self.ndim == 1 else a

    def describe(self):
        rows = f"<={self.rows}" if self.dynamic else str(self.rows)
        shape = f"({self.cols},)" if self.ndim == 1 else f"({rows}, {self.cols})"
        return f"{self.dtype}{shape} in {self.cw} words a row"


def _layout(ttype, lanes, node):
    shape = ttype.shape
    if len(shape) > 2:
        raise LoweringError(f"Node {node!r}: a tensor of {len(shape)} dimensions {shape} cannot "
                            f"be lowered; the CUs hold vectors and matrices (1-D or 2-D)")
    if len(shape) == 1:
        if ttype.dynamic:
            raise LoweringError(f"Node {node!r}: a 1-D tensor with a run-time length cannot be "
                                f"lowered (only rows of a 2-D tensor may be dynamic)")
        return TensorLayout(1, shape[0], lanes, ttype.dtype, False, 1)
    return TensorLayout(shape[0], shape[1], lanes, ttype.dtype, ttype.dynamic, 2)


def _as2d(value):
    a = np.asarray(value)
    return a.reshape(1, -1) if a.ndim == 1 else a


# --- Plan: the lowered ops ----------------------------------------------------------------------

@dataclasses.dataclass
class _Tensor:
    """A tensor of the lowered program and where it lives.

    ``kind`` is ``input`` (host buffer written by the host), ``const`` (in a constant pool),
    ``runtime`` (allocated by its producer) or ``output`` (a host buffer written by a CU, a
    graph output or a KV cache grown in place). ``buffer`` names the buffer (its key)."""

    name: str
    layout: TensorLayout
    kind: str
    buffer: str | None = None
    base: int = 0
    value: np.ndarray | None = None
    producer: str | None = None
    mu_hint: tuple | None = None


@dataclasses.dataclass
class _LOp:
    name: str
    kind: str
    ins: list
    out: str
    attrs: dict
    cu: tuple
    node: str
    nodes: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.nodes = self.nodes or [self.node]


@dataclasses.dataclass(frozen=True)
class _Stage:
    """One stream pass of an elementwise chain: ``post(fn(a, b) >> shift)``; ``imm`` is the
    scalar second operand (None: zero, or the chain's tensor operand for the first stage)."""

    fn: AluFn
    imm: int | None = None
    shift: int = 0
    relu: bool = False
    tensor: bool = False


@dataclasses.dataclass(frozen=True)
class _Clip:
    lo: int
    hi: int


def _fits32(v):
    return -(1 << 31) <= v < (1 << 31)


def _append_stage(stages, s):
    """Append stage (or clip) ``s`` to a chain, fusing what can be fused (see the Lowering
    section of docs/compiler.md)."""
    last = stages[-1] if stages else None
    if isinstance(s, _Clip):
        lo, hi = s.lo, s.hi
        if last is not None and last.fn is AluFn.PASS and not last.tensor and not (
                last.relu and hi < 0):
            # clip(v >> k) = min(max(v, lo << k), hi << k) >> k (floor is monotonic); after a
            # ReLU (and hi >= 0) the lower bound is 0 if lo <= 0, and the ReLU is moot if lo > 0.
            k = last.shift
            big_l, big_h = lo << k, hi << k
            if _fits32(big_l) and _fits32(big_h):
                if lo == 0 or (last.relu and lo < 0):
                    stages[-1] = _Stage(AluFn.MIN, big_h, k, True)
                else:
                    stages[-1] = _Stage(AluFn.MAX, big_l, 0, False)
                    stages.append(_Stage(AluFn.MIN, big_h, k, False))
                return stages
        if last is not None and last.relu and lo <= 0:
            stages.append(_Stage(AluFn.MIN, hi))          # the values are already >= 0
        elif lo == 0:
            stages.append(_Stage(AluFn.MIN, hi, 0, True))
        else:
            stages.append(_Stage(AluFn.MAX, lo))
            stages.append(_Stage(AluFn.MIN, hi))
        return stages
    if last is not None and s.fn is AluFn.PASS and not s.tensor:
        # A shift or a ReLU after any stage folds into it: relu(v >> a) >> b = relu(v >> a+b).
        stages[-1] = dataclasses.replace(last, shift=min(31, last.shift + s.shift),
                                         relu=last.relu or s.relu)
        return stages
    stages.append(s)
    return stages


def _chain_zero(stages, known_b):
    """What the chain makes of a zero padding lane (None if it depends on run-time data)."""
    v = 0
    for s in stages:
        if s.tensor and not known_b:
            return None
        b = s.imm if s.imm is not None else 0
        r = alu(s.fn, v, b)
        r = (r - (1 << 32) if r & (1 << 31) else r) >> (s.shift & 31)
        if s.relu and r < 0:
            r = 0
        v = r & MASK32
    return v


class _Planner:
    """Legalizes a graph into lowered ops (:class:`_LOp`) and tensors, then rewrites them."""

    def __init__(self, graph, part_of, placement, params):
        self.g = graph
        self.part_of = part_of
        self.placement = placement
        self.params = params
        self.lanes = params.cu.lanes
        self.tensors = {}
        self.lops = []
        self.outputs = []          # (output name, source tensor)
        self.output_map = {}       # output name -> buffer name
        self.synth = {}            # synthetic constants by name
        cus = params.tiles("C")
        self.mus = params.tiles("M")
        self.first_cu = cus[0]

    # Helpers.

    def cu_of(self, node):
        part = self.part_of.get(node)
        cu = self.placement.cu_of.get(part)
        if cu is None:
            raise LoweringError(f"Node {node!r} is in partition {part!r}, which the placement "
                                f"did not put on a CU")
        return tuple(cu)

    def nearest_mus(self, xy):
        dist = self.placement.fabric.distance
        return sorted(self.mus, key=lambda m: (dist(m, xy), m[1], m[0]))

    def layout(self, name):
        return self.tensors[name].layout

    def new_tensor(self, name, layout, kind="runtime", **kw):
        if name in self.tensors:
            raise AssertionError(f"tensor {name!r} defined twice")
        t = _Tensor(name, layout, kind, **kw)
        self.tensors[name] = t
        return name

    def const(self, name, value, mu_hint, dtype=None):
        """A synthetic constant (deduplicated by name)."""
        if name in self.synth:
            return name
        v = _as2d(value)
        lay = TensorLayout(v.shape[0], v.shape[1], self.lanes, dtype or "int32", False, 2)
        self.new_tensor(name, lay, "const", value=v.astype(np.int64), mu_hint=mu_hint)
        self.synth[name] = True
        return name

    def add_op(self, name, kind, ins, out_layout, node, cu, **attrs):
        self.new_tensor(name, out_layout, "runtime", buffer=name, producer=name)
        self.lops.append(_LOp(name, kind, list(ins), name, attrs, cu, node))
        return name

    def fail(self, node, kind, message):
        raise LoweringError(f"Node {node!r} ({kind}): {message}")

    # Legalization.

    def legalize(self):
        g = self.g
        for n in g.order():
            kind = g.kind(n)
            if kind not in LOWERABLE_KINDS:
                raise LoweringError(f"Node {n!r} has op kind {kind!r}, which the lowering does "
                                    f"not support (it lowers {', '.join(sorted(LOWERABLE_KINDS))})")
            t = g.type_of(n)
            lay = _layout(t, self.lanes, n)
            if lay.cols == 0 and kind not in ("input", "const", "output"):
                self.fail(n, kind, f"a tensor with no columns {t.shape} cannot be lowered")
            ins = list(g.inputs_of(n))
            if kind == "input":
                self.new_tensor(n, lay, "input", buffer=n,
                                mu_hint=self.placement.mu_of.get(n))
            elif kind == "const":
                self.new_tensor(n, lay, "const", value=_as2d(g.nx.nodes[n]["attrs"]["value"])
                                .astype(np.int64), mu_hint=self.placement.mu_of.get(n))
            elif kind == "output":
                self.outputs.append((n, ins[0]))
            else:
                getattr(self, "_legal_" + kind, self._legal_ew)(n, kind, ins, lay,
                                                                g.nx.nodes[n]["attrs"])
        return self

    def _legal_matmul(self, n, kind, ins, lay, attrs):
        a, b = ins
        cu = self.cu_of(n)
        tb = self.tensors[b]
        if tb.kind == "const":
            bt = self.const(f"{b}^T", tb.value.T, tb.mu_hint, tb.layout.dtype)
        else:
            prod = self.lop_of(b)
            if prod is not None and prod.kind == "transpose":
                bt = prod.ins[0]
            else:
                lb = tb.layout
                bt = self.add_op(f"{n}/rhs^T", "transpose", [b],
                                 TensorLayout(lb.cols, lb.rows, self.lanes, lb.dtype), n, cu)
        self.add_op(n, "matmul_nt", [a, bt], lay, n, cu)

    def lop_of(self, tensor):
        p = self.tensors[tensor].producer
        if p is None:
            return None
        return next(op for op in self.lops if op.name == p)

    def _bmode(self, operand, out):
        s = self.tensors[operand].layout
        if (s.rows, s.cols) == (out.rows, out.cols) and s.dynamic == out.dynamic:
            return "same"
        if s.rows == 1 and s.cols == 1 and not s.dynamic:
            return "scalar"
        if s.rows == 1 and s.cols == out.cols and not s.dynamic:
            return "row"
        if s.cols == 1 and (s.rows, s.dynamic) == (out.rows, out.dynamic):
            return "col"
        return None

    def _legal_ew(self, n, kind, ins, lay, attrs):
        cu = self.cu_of(n)
        if kind in _BINARY:
            a, b = ins
            ma, mb = self._bmode(a, lay), self._bmode(b, lay)
            if ma != "same":
                if mb == "same" and kind in _COMMUTATIVE:
                    a, b, ma, mb = b, a, mb, ma
                elif ma == "row" and mb in ("same", "row", "scalar", "col") and not lay.dynamic:
                    la = self.tensors[a].layout
                    a = self.add_op(f"{n}/expand", "expand", [a],
                                    TensorLayout(lay.rows, lay.cols, self.lanes, la.dtype), n,
                                    cu)
                    ma = "same"
                else:
                    sa, sb = self.g.type_of(ins[0]).shape, self.g.type_of(ins[1]).shape
                    self.fail(n, kind, f"broadcasting {sa} with {sb} to {self.g.type_of(n).shape} "
                                       f"is not supported (one operand must have the result's "
                                       f"shape; the other a row, a column or a scalar)")
            if mb is None:
                self.fail(n, kind, f"broadcasting {self.g.type_of(b).shape} to "
                                   f"{self.g.type_of(n).shape} is not supported")
            tb = self.tensors[b]
            if mb == "scalar" and tb.kind == "const":
                stage = _Stage(_BINARY[kind], int(tb.value.reshape(-1)[0]))
                self.add_op(n, "ew", [a], lay, n, cu, raw=[stage], mode=None)
            else:
                stage = _Stage(_BINARY[kind], None, tensor=True)
                self.add_op(n, "ew", [a, b], lay, n, cu, raw=[stage], mode=mb)
            return
        (x,) = ins
        if kind == "relu":
            raw = [_Stage(AluFn.PASS, relu=True)]
        elif kind == "shr":
            raw = [_Stage(AluFn.PASS, shift=int(attrs["shift"]))]
        elif kind == "shl":
            raw = [_Stage(AluFn.SHL, int(attrs["shift"]))]
        elif kind == "clip":
            info = np.iinfo(attrs.get("dtype", "int8"))
            raw = [_Clip(int(attrs.get("lo", info.min)), int(attrs.get("hi", info.max)))]
        else:  # pragma: no cover - every kind has a handler
            raise AssertionError(kind)
        self.add_op(n, "ew", [x], lay, n, cu, raw=raw, mode=None)

    def _legal_transpose(self, n, kind, ins, lay, attrs):
        self.add_op(n, "transpose", ins, lay, n, self.cu_of(n))

    def _legal_reduce_sum(self, n, kind, ins, lay, attrs):
        t = self.g.type_of(ins[0])
        axis = attrs.get("axis", -1) % len(t.shape)
        row = axis == len(t.shape) - 1
        self.add_op(n, "reduce", ins, lay, n, self.cu_of(n), op=kind[7:],
                    axis="row" if row else "col")

    _legal_reduce_max = _legal_reduce_sum

    def _legal_slice(self, n, kind, ins, lay, attrs):
        (x,) = ins
        cu = self.cu_of(n)
        t = self.g.type_of(x)
        lx = self.layout(x)
        axis = attrs["axis"] % len(t.shape)
        start = attrs.get("start", 0)
        stop = attrs.get("stop", t.shape[axis])
        if len(t.shape) == 2 and axis == 0:
            self.add_op(n, "slice_rows", ins, lay, n, cu, start=start, stop=stop)
            return
        if lay.cols == 0:
            self.fail(n, kind, "an empty slice cannot be lowered")
        if start % self.lanes == 0:
            self.add_op(n, "slice_cols", ins, lay, n, cu, start=start, stop=stop,
                        mask=stop < lx.cols and (stop - start) % self.lanes != 0)
            return
        sel = np.zeros((stop - start, lx.cols), dtype=np.int64)
        sel[np.arange(stop - start), np.arange(start, stop)] = 1
        s = self.const(f"{n}/select", sel, self.nearest_mus(cu)[0])
        self.add_op(n, "matmul_nt", [x, s], lay, n, cu)

    def _legal_concat(self, n, kind, ins, lay, attrs):
        cu = self.cu_of(n)
        t = self.g.type_of(ins[0])
        axis = attrs.get("axis", -1) % len(t.shape) if kind == "concat" else 0
        if len(t.shape) == 2 and axis == 0:
            self.add_op(n, "concat_rows", ins, lay, n, cu)
            return
        lays = [self.layout(i) for i in ins]
        if all(la.cols % self.lanes == 0 for la in lays[:-1]):
            self.add_op(n, "concat_cols", ins, lay, n, cu)
            return
        # Concatenate whole words (gaps of zero lanes), then compact with a selection matrix.
        width = sum(la.cw for la in lays) * self.lanes
        words = self.add_op(f"{n}/words", "concat_cols", ins,
                            TensorLayout(lay.rows, width, self.lanes, lay.dtype, False, 2), n, cu)
        sel = np.zeros((lay.cols, width), dtype=np.int64)
        col = pos = 0
        for la in lays:
            sel[np.arange(col, col + la.cols), np.arange(pos, pos + la.cols)] = 1
            col += la.cols
            pos += la.cw * self.lanes
        s = self.const(f"{n}/select", sel, self.nearest_mus(cu)[0])
        self.add_op(n, "matmul_nt", [words, s], lay, n, cu)

    def _legal_append(self, n, kind, ins, lay, attrs):
        first = self.tensors[ins[0]]
        readers = [s for s in self.g.nx.successors(ins[0])]
        if first.kind == "input" and readers == [n] and ins[0] != ins[1]:
            # The KV cache grows in place: the output is the input's own buffer.
            cu = self.cu_of(n)
            self.new_tensor(n, lay, "output", buffer=first.buffer, producer=n)
            self.lops.append(_LOp(n, "append_inplace", list(ins), n, {}, cu, n))
            first.kind = "aliased"
            return
        self._legal_concat(n, "append", ins, lay, attrs)

    def _legal_topk(self, n, kind, ins, lay, attrs):
        (x,) = ins
        cu = self.cu_of(n)
        lx = self.layout(x)
        lanes = self.lanes
        mu = self.nearest_mus(cu)[0]
        lrow = np.full(lx.cw * lanes, INT_MAX, dtype=np.int64)
        lrow[lx.cols:] = -(1 << 31)
        table = np.full((lanes, lanes), INT_MAX, dtype=np.int64)
        np.fill_diagonal(table, -(1 << 31))
        ins = [x, self.const(f"topk/L{lx.cols}", lrow.reshape(1, -1), mu),
               self.const(f"topk/T{lanes}", table, mu),
               self.const("topk/MAX", np.full((1, lanes), INT_MAX, np.int64), mu)]
        self.add_op(n, "topk", ins, lay, n, cu, k=int(attrs["k"]))

    def _legal_take(self, n, kind, ins, lay, attrs):
        self.add_op(n, "take", ins, lay, n, self.cu_of(n))

    def _legal_dispatch(self, n, kind, ins, lay, attrs):
        self.add_op(n, "dispatch", ins, lay, n, self.cu_of(n), expert=int(attrs["expert"]))

    def _legal_combine(self, n, kind, ins, lay, attrs):
        self.add_op(n, "combine", ins, lay, n, self.cu_of(n), shift=int(attrs["shift"]))

    # Rewrites.

    def readers(self):
        out = collections.defaultdict(list)
        for op in self.lops:
            for i in dict.fromkeys(op.ins):
                out[i].append(op)
        return out

    def fuse(self):
        """Fold chains of elementwise ops on one CU into one op of several stream passes."""
        outputs = {src for _, src in self.outputs}
        changed = True
        while changed:
            changed = False
            readers = self.readers()
            by_name = {op.name: op for op in self.lops}
            for op in self.lops:
                if op.kind != "ew" or op.attrs["mode"] is not None:
                    continue
                prev = by_name.get(self.tensors[op.ins[0]].producer)
                if (prev is None or prev.kind != "ew" or prev.cu != op.cu
                        or prev.out in outputs or len(readers[prev.out]) != 1):
                    continue
                prev.attrs["raw"] = prev.attrs["raw"] + op.attrs["raw"]
                prev.nodes = prev.nodes + op.nodes
                del self.tensors[prev.out]
                prev.out = op.out
                self.tensors[op.out].producer = prev.name
                self.lops.remove(op)
                changed = True
                break
        for op in self.lops:
            if op.kind == "ew":
                stages = []
                for s in op.attrs["raw"]:
                    stages = _append_stage(stages, s)
                op.attrs["stages"] = stages
        return self

    def place_outputs(self):
        """Graph outputs become host buffers written by their producer (copies where a tensor
        is already in a host buffer or feeds several outputs)."""
        taken = set()
        by_name = {op.name: op for op in self.lops}
        for name, src in self.outputs:
            t = self.tensors[src]
            if t.kind == "runtime" and src not in taken:
                t.kind, t.buffer = "output", name
                taken.add(src)
                self.output_map[name] = name
                continue
            if t.kind == "output" and t.buffer not in self.output_map.values() \
                    and src not in taken:
                taken.add(src)                       # a buffer grown in place
                self.output_map[name] = t.buffer
                continue
            prod = by_name.get(t.producer)
            if prod is not None:
                cu = prod.cu
            else:
                part = self.part_of.get(name)
                cu = tuple(self.placement.cu_of.get(part, self.first_cu))
            lay = t.layout
            cname = f"{name}/copy"
            self.new_tensor(cname, lay, "output", buffer=name, producer=cname)
            self.lops.append(_LOp(cname, "copy", [src], cname, {}, cu, name))
            self.output_map[name] = name
        return self

    def eliminate_dead(self):
        """Drop ops whose result nobody reads, then unread constants and inputs."""
        kept = set(self.output_map.values())
        while True:
            readers = self.readers()
            dead = [op for op in self.lops if not readers[op.out] and (
                self.tensors[op.out].kind == "runtime" or (
                    self.tensors[op.out].kind == "output"
                    and self.tensors[op.out].buffer not in kept))]
            if not dead:
                break
            for op in dead:
                self.lops.remove(op)
                del self.tensors[op.out]
        readers = self.readers()
        for name in [n for n, t in self.tensors.items()
                     if t.kind in ("const", "input", "aliased") and not readers[n]]:
            del self.tensors[name]
        return self

    def order(self):
        """A topological order of the ops (stable: ops were appended in graph order)."""
        pos = {op.name: i for i, op in enumerate(self.lops)}
        for op in self.lops:
            for i in op.ins:
                p = self.tensors[i].producer
                if p is not None and pos[p] >= pos[op.name]:
                    raise AssertionError(f"op {op.name} reads {i} before it is produced")
        return self


def sample_inputs(graph, seed=0):
    """Deterministic sample inputs for a graph without a workload (small values; a dynamic
    input gets its bound of rows)."""
    rng = np.random.default_rng(seed)
    out = {}
    for n in graph.inputs:
        t = graph.type_of(n)
        out[n] = rng.integers(-8, 8, size=t.shape, dtype=np.int64).astype(t.dtype)
    return out


# --- Code generation: one assembler per CU ------------------------------------------------------

class _Reg(int):
    """A register operand (a plain int is an immediate)."""


def _intersect(states):
    first = states[0]
    return {f: v for f, v in first.items()
            if v is not None and all(s.get(f) == v for s in states[1:])}


class _Asm:
    """A CU program under construction: instructions with labels, and what is known of the
    stream fields at each point, so that a field is only written when its value changes.

    At a label the knowledge is the intersection over every way in; a loop's head forgets the
    fields its body writes (the body is emitted twice: once to find them, once for real)."""

    def __init__(self):
        self.code = []
        self.labels = {}
        self.incoming = collections.defaultdict(list)
        self.known = {f: 0 for f in StreamField}
        self.known[StreamField.OUTER] = 1
        self.reachable = True
        self.written = set()
        self._next = 0

    def __len__(self):
        return len(self.code)

    def emit(self, op, **fields):
        self.code.append((op, fields, None))
        if op is Op.HALT:
            self.reachable = False

    def branch(self, op, label, **fields):
        self.code.append((op, fields, label))
        if label not in self.labels:
            self.incoming[label].append(dict(self.known))
        if op is Op.JMP:
            self.reachable = False

    def label(self):
        self._next += 1
        return f"L{self._next}"

    def place(self, label):
        states = self.incoming.pop(label, [])
        if self.reachable:
            states.append(self.known)
        self.known = _intersect(states) if states else {}
        self.labels[label] = len(self.code)
        self.reachable = True

    def loop(self, body):
        """Emit ``body(head)``, which ends with a backward branch to ``head``."""
        saved = (len(self.code), dict(self.labels),
                 {k: list(v) for k, v in self.incoming.items()}, set(self.written))
        entry = dict(self.known)
        writes = set()
        for attempt in range(3):
            self.written = set()
            head = self.label()
            self.labels[head] = len(self.code)
            self.known = {f: v for f, v in entry.items() if f not in writes}
            self.reachable = True
            body(head)
            if writes >= self.written:
                break
            if attempt == 2:  # pragma: no cover - two passes always suffice
                raise AssertionError("loop body writes different fields on each pass")
            writes |= self.written
            del self.code[saved[0]:]
            self.labels = dict(saved[1])
            self.incoming = collections.defaultdict(list, {k: list(v)
                                                           for k, v in saved[2].items()})
        self.written |= saved[3]

    def li(self, rd, imm):
        self.emit(Op.LI, rd=int(rd), imm=int(imm))

    def alui(self, fn, rd, ra, imm):
        self.emit(Op.ALUI, fn=fn.value, rd=int(rd), ra=int(ra), imm=int(imm))

    def alu(self, fn, rd, ra, rb):
        self.emit(Op.ALU, fn=fn.value, rd=int(rd), ra=int(ra), rb=int(rb))

    def field(self, f, v):
        if isinstance(v, _Reg):
            self.emit(Op.SCFG, fn=f.value, ra=int(v))
            self.known[f] = None
        else:
            v = int(v) & MASK32
            if self.known.get(f) == v:
                return
            self.emit(Op.SCFGI, fn=f.value, imm=v)
            self.known[f] = v
        self.written.add(f)

    def stream(self, fn, *, a, n, a_base=0, a_stride=1, outer=1, a_ostride=0,
               b_mode=BMode.ZERO, b_val=0, b_stride=0, b_ostride=0, d_mode=DMode.DISCARD,
               d_ref=None, d_base=0, d_stride=1, shift=0, relu=False, rd=0):
        """Configure and run one stream (only the fields it uses are written)."""
        F = StreamField
        self.field(F.A_REF, a)
        self.field(F.A_BASE, a_base)
        self.field(F.A_STRIDE, a_stride)
        self.field(F.N, n)
        self.field(F.OUTER, outer)
        if isinstance(outer, _Reg) or outer != 1:
            self.field(F.A_OSTRIDE, a_ostride)
        self.field(F.B_MODE, b_mode.value)
        if b_mode is BMode.LOCAL:
            self.field(F.B_VAL, b_val)
            self.field(F.B_STRIDE, b_stride)
            if isinstance(outer, _Reg) or outer != 1:
                self.field(F.B_OSTRIDE, b_ostride)
        elif b_mode is BMode.SCALAR:
            self.field(F.B_VAL, b_val)
        self.field(F.D_MODE, d_mode.value)
        if d_mode in (DMode.WRITE, DMode.APPEND, DMode.PACK_SUM):
            self.field(F.D_REF, d_ref)
        if d_mode in (DMode.WRITE, DMode.LOCAL, DMode.LOCAL_ACC):
            self.field(F.D_BASE, d_base)
            self.field(F.D_STRIDE, d_stride)
        self.field(F.SHIFT, shift)
        self.field(F.POST, int(relu))
        self.emit(Op.SRUN, fn=fn.value, rd=int(rd))

    def assemble(self, offset):
        out = []
        for op, f, label in self.code:
            if label is not None:
                f = dict(f, imm=self.labels[label] + offset)
            out.append(Instr(op, **f))
        return out


class _RefFile:
    """Which buffer reference is in which register, and which are in the CU's reference table
    (an MU buffer the CU allocates in its prologue when references do not fit r8..r14)."""

    def __init__(self, asm, where):
        self.asm = asm
        self.where = where
        self.reg = {}
        self.occ = {}
        self.slot = {}
        self.pinned = set()
        self.used = {}
        self.tick = 0
        self.n_slots = 0
        self.table = False

    def _touch(self, key):
        self.tick += 1
        self.used[key] = self.tick

    def _free(self):
        for r in _REF_REGS:
            if r not in self.occ:
                return r
        cands = [r for r in _REF_REGS if self.occ[r] not in self.pinned]
        if not cands:
            raise LoweringError(f"{self.where}: an op needs more than {len(_REF_REGS)} buffer "
                                f"references at once")
        r = min(cands, key=lambda r: (self.used[self.occ[r]], r))
        key = self.occ.pop(r)
        del self.reg[key]
        if key not in self.slot:
            # Spill to the table (V and the evicted register are clobbered).
            self.asm.emit(Op.VSET, fn=0, ra=r)
            self.asm.emit(Op.VAPPEND, rd=r, ra=_TABLE)
            self.slot[key] = self.n_slots
            self.n_slots += 1
            self.table = True
        return r

    def get(self, key):
        if key in self.reg:
            r = self.reg[key]
        else:
            if key not in self.slot:
                raise AssertionError(f"{self.where}: reference {key!r} is not held")
            r = self._free()
            self.asm.li(r, self.slot[key])
            self.asm.emit(Op.READ, fn=0, rd=r, ra=_TABLE, rb=r)
            self.reg[key] = r
            self.occ[r] = key
        self.pinned.add(key)
        self._touch(key)
        return _Reg(r)

    def new(self, key):
        r = self._free()
        self.reg[key] = r
        self.occ[r] = key
        self.pinned.add(key)
        self._touch(key)
        return _Reg(r)

    def drop(self, key):
        r = self.reg.pop(key, None)
        if r is not None:
            del self.occ[r]
        self.slot.pop(key, None)
        self.pinned.discard(key)

    def unpin(self, key=None):
        if key is None:
            self.pinned.clear()
        else:
            self.pinned.discard(key)


class _CUGen:
    """The program of one CU under construction."""

    def __init__(self, xy, params, host_keys):
        self.xy = tuple(xy)
        self.id = params.mu_id(*xy)
        self.asm = _Asm()
        self.refs = _RefFile(self.asm, f"CU {self.xy}")
        self.init_regs = {}
        self.extras = []
        if len(host_keys) > len(_REF_REGS) + _TEMPS - 1:
            raise LoweringError(f"CU {self.xy} reads or writes {len(host_keys)} host buffers, "
                                f"but at most {len(_REF_REGS) + _TEMPS - 1} references can be "
                                f"passed in its registers")
        for i, key in enumerate(host_keys):
            if i < len(_REF_REGS):
                r = _REF_REGS[i]
                self.refs.reg[key] = r
                self.refs.occ[r] = key
                self.refs._touch(key)
            else:
                r = i - len(_REF_REGS)
                self.refs.slot[key] = r
                self.refs.n_slots += 1
                self.refs.table = True
                self.extras.append(r)
            self.init_regs[r] = key
        self.held = set(host_keys)
        self.received = set()
        self.waited = set()
        self.op_ranges = []
        self.local = {}          # local constant key -> word offset
        self.local_words = {}    # word offset -> lanes values
        self.local_top = params.cu.local_words
        self.out = None
        self.table_mu = None


class _Account:
    """MU capacity, checked at every allocation with a bound that is safe under every timing.

    Every sync event (token or reference sent or received), allocation and return of a share
    gets a vector clock as the programs are generated (the global order of generation is a
    linearization of the programs' happens-before order). A buffer is certainly freed before an
    ALLOC if every share of it has been returned by an event that happens before the ALLOC
    (RETI waits for its response); every other buffer allocated before (in generation order)
    in the same MU is counted as live. That bounds the live set at every moment: in any
    reachable state, the live buffer allocated last was allocated while all the others were
    counted. Host buffers are allocated before the start (the host's shares of inputs and
    constant pools are returned by the CUs that read them); reference tables are live
    throughout. In ``reserve`` mode the regions of freed buffers are still counted (they return
    to per-class lists, not to the bump allocator); ``single`` mode has one buffer slot."""

    def __init__(self, params, cus):
        mp = params.mu
        self.mp = mp
        self.mode = mp.alloc_mode
        self.mus = params.tiles("M")
        self.cap = mp.n_blocks if self.mode is AllocMode.VIRTUAL else mp.words
        self.cap_slots = 1 if self.mode is AllocMode.SINGLE else mp.max_buffers
        self.index = {cu: i for i, cu in enumerate(cus)}
        self.vc = {cu: [0] * len(cus) for cu in cus}
        self.host = {m: [0, 0] for m in self.mus}    # static totals of the host buffers
        self.bufs = {m: [] for m in self.mus}        # [key, units, weight, rets]
        self.by_key = {}
        self.peak = {m: [0, 0] for m in self.mus}

    def units(self, words):
        """Blocks (virtual) or words (reserve: every region of its growth; single) held."""
        if self.mode is AllocMode.VIRTUAL:
            return -(-words // self.mp.block_words)
        if self.mode is AllocMode.RESERVE:
            size = total = self.mp.reserve_words
            while size < words:
                size *= 2
                total += size
            return total
        return words

    def unit_words(self, units):
        return units * self.mp.block_words if self.mode is AllocMode.VIRTUAL else units

    # Vector clocks.

    def tick(self, cu):
        v = self.vc[cu]
        v[self.index[cu]] += 1
        return (self.index[cu], tuple(v))

    def merge(self, cu, stamp):
        v = self.vc[cu]
        for i, x in enumerate(stamp[1]):
            if x > v[i]:
                v[i] = x

    @staticmethod
    def before(e, f):
        """Whether event ``e`` happens before event ``f`` (both ``(cu index, clock)``)."""
        return e[1][e[0]] <= f[1][e[0]] and e != f

    # Buffers.

    def add(self, m, key, units, weight):
        rec = [key, units, weight, []]
        self.bufs[m].append(rec)
        self.by_key[key] = rec

    def live(self, m, stamp):
        """Units and slots of the buffers of MU ``m`` that may be live at event ``stamp``."""
        u = s = 0
        for _key, units, weight, rets in self.bufs[m]:
            dead = weight is not None and len(rets) == weight and all(
                self.before(r, stamp) for r in rets)
            if not dead or self.mode is AllocMode.RESERVE:
                u += units
            if not dead:
                s += 1
        return u, s

    def fits(self, m, units, stamp):
        u, s = self.live(m, stamp)
        return u + units <= self.cap and s + 1 <= self.cap_slots

    def alloc(self, m, key, units, weight, stamp):
        u, s = self.live(m, stamp)
        self.peak[m] = [max(self.peak[m][0], u + units), max(self.peak[m][1], s + 1)]
        self.add(m, key, units, weight)

    def ret(self, key, stamp):
        rec = self.by_key.get(key)
        if rec is not None:
            rec[3].append(stamp)

    def room(self, stamp):
        best_u = best_s = 0
        for m in self.mus:
            u, s = self.live(m, stamp)
            best_u = max(best_u, self.cap - u)
            best_s = max(best_s, self.cap_slots - s)
        return self.unit_words(best_u), best_s


R0, R1, R2, R3, R4, R5, R6, R7 = (_Reg(i) for i in range(8))


class _Lowerer:
    """Generates every CU's program at once, walking the ops in one global order."""

    def __init__(self, plan, params, tables=None):
        self.plan = plan
        self.tables = tables or {}
        self.params = params
        self.cp = params.cu
        self.mp = params.mu
        self.lanes = params.cu.lanes
        self.lb = self.lanes.bit_length() - 1
        self.tensors = plan.tensors
        self.lops = plan.lops
        self.ops = {op.name: op for op in self.lops}
        self.acct = _Account(params, params.tiles("C"))

    # --- buffers and who holds what ----------------------------------------------------------

    def prod_cu(self, t):
        return self.ops[t.producer].cu if t.producer is not None else None

    def key_of(self, name, cu):
        """``(buffer key, word offset)`` of tensor ``name`` as CU ``cu`` reads it (a constant
        is in the pool of each CU that reads it)."""
        t = self.tensors[name]
        if t.kind == "const":
            return self.const_at[(name, cu)]
        return t.buffer, t.base

    def place_host(self):
        """Host buffers: inputs, one constant pool per CU (the constants it reads, in creation
        order), outputs; exact sizes, each in the MU the placement chose (for a pool: the MU
        holding most of its constants' words) when it has room, else the nearest MU with
        room."""
        acct, plan = self.acct, self.plan
        out_words = collections.Counter()
        for t in self.tensors.values():
            if t.kind == "output":
                out_words[t.buffer] = max(out_words[t.buffer], t.layout.words)
        self.pool_of = collections.defaultdict(list)          # cu -> constants
        for op in self.lops:
            for i in dict.fromkeys(op.ins):
                if self.tensors[i].kind == "const" and i not in self.pool_of[op.cu]:
                    self.pool_of[op.cu].append(i)
        items = []
        for name, t in self.tensors.items():
            if t.kind in ("input", "aliased"):
                items.append((name, t.buffer, max(t.layout.words, out_words[t.buffer]),
                              t.mu_hint))
        # A CU's constants, in creation order, in pools of at most max_buffer_words.
        self.pools = {}                                        # key -> (cu, constants)
        for cu in sorted(self.pool_of, key=lambda c: (c[1], c[0])):
            chunks = [[]]
            for c in sorted(self.pool_of[cu], key=list(self.tensors).index):
                words = self.tensors[c].layout.words
                if words > self.mp.max_buffer_words:
                    shown = f"{c[:-2]!r} (transposed)" if c.endswith("^T") else repr(c)
                    raise LoweringError(f"Constant {shown} needs {words} words but an MU buffer "
                                        f"holds at most {self.mp.max_buffer_words} "
                                        f"(max_buffer_words)")
                if sum(self.tensors[x].layout.words for x in chunks[-1]) + words \
                        > self.mp.max_buffer_words:
                    chunks.append([])
                chunks[-1].append(c)
            for i, names in enumerate(chunks):
                key = f"const@{cu[0]},{cu[1]}" + (f"#{i}" if i else "")
                self.pools[key] = (cu, names)
                votes = collections.Counter()
                for c in names:
                    if self.tensors[c].mu_hint is not None:
                        votes[tuple(self.tensors[c].mu_hint)] += self.tensors[c].layout.words
                hint = min(votes, key=lambda m: (-votes[m], m[1], m[0])) if votes else cu
                items.append((f"the constant pool {key!r} of CU {cu}", key,
                              sum(self.tensors[c].layout.words for c in names), hint))
        for out, buf in plan.output_map.items():
            if buf == out:
                items.append((out, buf, out_words[buf], plan.placement.mu_of.get(out)))
        for name, _, words, _ in items:
            if words > self.mp.max_buffer_words:
                raise LoweringError(f"Buffer {name!r} needs {words} words but an MU buffer "
                                    f"holds at most {self.mp.max_buffer_words} "
                                    f"(max_buffer_words)")
        total = sum(it[2] for it in items)
        capacity = len(acct.mus) * self.mp.words
        if total > capacity:
            raise LoweringError(f"Host buffers (inputs, constants, outputs) need {total} words "
                                f"but the {len(acct.mus)} MUs of the {self.params.rows}x"
                                f"{self.params.cols} fabric hold {capacity} ({self.mp.words} "
                                f"each)")
        self.mu_of = {}
        for i in sorted(range(len(items)), key=lambda i: (-items[i][2], i)):
            name, key, words, hint = items[i]
            for m in plan.nearest_mus(tuple(hint) if hint else acct.mus[0]):
                du = acct.units(words)
                u, s = acct.host[m]
                if u + du <= acct.cap and s + 1 <= acct.cap_slots:
                    acct.host[m][0] += du
                    acct.host[m][1] += 1
                    self.mu_of[key] = m
                    break
            else:
                left = max(acct.unit_words(acct.cap - acct.host[m][0]) for m in acct.mus)
                what = name if name.startswith("the constant") else f"buffer {name!r}"
                raise LoweringError(f"{what[0].upper() + what[1:]} ({words} words) fits in no "
                                    f"MU: the most room left in one is {left} words")
        self.const_at = {}
        for key, (cu, names) in self.pools.items():
            base = 0
            for c in names:
                self.const_at[(c, cu)] = (key, base)
                base += self.tensors[c].layout.words
        self.host_fixed = []
        kept = set(plan.output_map.values())
        for t in self.tensors.values():
            if t.kind == "aliased" and t.buffer in kept:
                self.host_fixed.append((t.buffer, out_words[t.buffer], self.mu_of[t.buffer]))
        for out, buf in plan.output_map.items():
            if buf == out:
                self.host_fixed.append((buf, out_words[buf], self.mu_of[buf]))

    def plan_uses(self):
        """Uses, shares and weights of every buffer on every CU; host keys per CU; mailboxes
        and token channels."""
        self.uses = collections.Counter()
        self.share = {}
        self.touch = collections.defaultdict(dict)      # cu -> ordered host keys
        host_kinds = ("input", "aliased", "const", "output")
        kept = set(self.plan.output_map.values())
        for op in self.lops:
            out = self.tensors[op.out]
            keys = list(dict.fromkeys(self.key_of(i, op.cu)[0] for i in op.ins))
            for key in keys:
                self.uses[(op.cu, key)] += 1
            for i in op.ins:
                t = self.tensors[i]
                key = self.key_of(i, op.cu)[0]
                if t.kind in host_kinds:
                    self.touch[op.cu].setdefault(key, None)
                    # Host buffers the host does not read back are shared by the CUs reading
                    # them (a cache grown in place that is not an output: its readers wait for
                    # the append's token, so they return their shares after it).
                    if t.kind in ("input", "const") or (t.kind in ("aliased", "output")
                                                        and key not in kept):
                        self.share[(op.cu, key)] = 1
            if out.kind == "output":
                self.touch[op.cu].setdefault(out.buffer, None)
        self.readers = collections.defaultdict(list)    # tensor -> CUs reading it, sorted
        for op in self.lops:
            for i in dict.fromkeys(op.ins):
                if op.cu not in self.readers[i]:
                    self.readers[i].append(op.cu)
        self.weight = collections.Counter()
        self.remote = {}
        self.pending = collections.Counter()
        for name, t in self.tensors.items():
            if t.kind == "runtime":
                p = self.prod_cu(t)
                remote = sorted(c for c in self.readers[name] if c != p)
                self.remote[name] = remote
                if self.uses[(p, name)]:
                    self.share[(p, name)] = 1
                for c in remote:
                    self.share[(c, name)] = 1
                self.pending[(p, name)] = len(remote)
        for (_, key), w in self.share.items():
            self.weight[key] += w
        for name, w in self.weight.items():
            if w > self.mp.max_weight:
                raise LoweringError(f"Buffer {name!r} is read by {w} CUs but a weight holds at "
                                    f"most {self.mp.max_weight} (weight_bits = "
                                    f"{self.mp.weight_bits})")
        # Mailboxes: runtime references each CU receives, in the order it first uses them.
        self.inbox = collections.defaultdict(list)
        for op in self.lops:
            for i in dict.fromkeys(op.ins):
                t = self.tensors[i]
                if t.kind == "runtime" and self.prod_cu(t) != op.cu \
                        and i not in self.inbox[op.cu]:
                    self.inbox[op.cu].append(i)
        mb = self.cp.mailbox
        self.slot = {}
        self.pred = {}
        for c, keys in self.inbox.items():
            for i, key in enumerate(keys):
                self.slot[(c, key)] = i % mb
                self.pred[(c, key)] = keys[i - mb] if i >= mb else None
        # Token channels: per receiving CU, one per CU that sends it tokens.
        senders = collections.defaultdict(set)
        for name, t in self.tensors.items():
            if t.kind == "output" and t.producer is not None:
                p = self.prod_cu(t)
                for c in self.readers[name]:
                    if c != p:
                        senders[c].add(p)
        for c, keys in self.inbox.items():
            for i, key in enumerate(keys):
                if i >= mb:
                    senders[self.prod_cu(self.tensors[key])].add(c)
        self.chan = {}
        for r, ss in senders.items():
            if len(ss) > self.cp.channels:
                raise LoweringError(f"CU {r} receives tokens from {len(ss)} CUs but has "
                                    f"{self.cp.channels} token channels")
            for j, s in enumerate(sorted(ss)):
                self.chan[(r, s)] = j

    def register_host(self):
        """The host buffers and reference tables in the capacity accounting: allocated before
        the start; inputs and pools freed when every reading CU has returned its share."""
        acct = self.acct
        for key, (_, names) in self.pools.items():
            words = sum(self.tensors[c].layout.words for c in names)
            acct.add(self.mu_of[key], key, acct.units(words), self.weight[key] or None)
        kept = set(self.plan.output_map.values())
        for t in self.tensors.values():
            if t.kind == "input" or (t.kind == "aliased" and t.buffer not in kept):
                words = max([x.layout.words for x in self.tensors.values()
                             if x.buffer == t.buffer and x.kind in ("aliased", "output")]
                            + [t.layout.words])
                acct.add(self.mu_of[t.buffer], t.buffer, acct.units(words),
                         self.weight[t.buffer] or None)
        for buf, words, m in self.host_fixed:
            acct.add(m, buf, acct.units(words), None)
        self.table_mu = {}
        for cu in sorted(self.tables, key=lambda c: (c[1], c[0])):
            words = self.tables[cu]
            units = max(1, acct.units(words))
            for m in self.plan.nearest_mus(cu):
                hu, hs = acct.host[m]
                if hu + units <= acct.cap and hs + 1 <= acct.cap_slots:
                    acct.host[m][0] += units
                    acct.host[m][1] += 1
                    acct.add(m, ("table", cu), units, None)
                    self.table_mu[cu] = m
                    break
            else:
                left = max(acct.unit_words(acct.cap - acct.host[m][0]) for m in acct.mus)
                raise LoweringError(f"The reference table of CU {cu} ({words} words) fits in "
                                    f"no MU: the most room left in one is {left} words")

    def make_gens(self):
        self.gens = {}
        for op in self.lops:
            if op.cu not in self.gens:
                self.gens[op.cu] = None
        for cu in sorted(self.gens, key=lambda c: (c[1], c[0])):
            self.gens[cu] = _CUGen(cu, self.params, list(self.touch[cu]))

    # --- local buffer ------------------------------------------------------------------------

    def local_needs(self, op):
        """Constants op wants in its CU's local buffer: ``(key, words)``."""
        lanes = self.lanes
        if op.kind in ("transpose", "take"):
            return [("identity", np.eye(lanes, dtype=np.int64))]
        if op.kind == "slice_cols" and op.attrs["mask"]:
            return [self._mask_row(self.tensors[op.out].layout.cols)]
        if op.kind == "ew" and self.ew_needs_mask(op):
            return [self._mask_row(self.tensors[op.out].layout.cols)]
        if op.kind == "reduce" and op.attrs["op"] == "max" and op.attrs["axis"] == "row":
            lay = self.tensors[op.ins[0]].layout
            row = np.full(lay.cw * lanes, INT_MAX, dtype=np.int64)
            row[lay.cols:] = -(1 << 31)
            return [(f"lrow{lay.cols}", row.reshape(-1, lanes))]
        return []

    def _mask_row(self, cols):
        cw = -(-cols // self.lanes)
        row = np.zeros(cw * self.lanes, dtype=np.int64)
        row[:cols] = -1
        return (f"mask{cols}", row.reshape(-1, self.lanes))

    def ew_needs_mask(self, op):
        lay = self.tensors[op.out].layout
        if lay.cols % self.lanes == 0:
            return False
        mode = op.attrs["mode"]
        zero = _chain_zero(op.attrs["stages"], mode in (None, "same", "row"))
        return zero != 0

    def prepare_local(self):
        for op in self.lops:
            g = self.gens[op.cu]
            for key, words in self.local_needs(op):
                if key in g.local:
                    continue
                g.local_top -= len(words)
                if g.local_top < 0:
                    raise LoweringError(f"CU {g.xy}: the local buffer ({self.cp.local_words} "
                                        f"words) cannot hold its constants")
                g.local[key] = g.local_top
                for w, row in enumerate(words):
                    g.local_words[g.local_top + w] = [int(v) for v in row]

    def need_local(self, g, op, words):
        if words > g.local_top:
            consts = self.cp.local_words - g.local_top
            kind = self.plan.g.kind(op.node)
            raise LoweringError(f"Node {op.node!r} ({kind}) needs {words} words of the local "
                                f"buffer but CU {g.xy} has {g.local_top} (local_words = "
                                f"{self.cp.local_words}, {consts} taken by constants)")

    # --- references, tokens, messages --------------------------------------------------------

    def ref(self, g, name):
        """The register holding the buffer of tensor ``name`` on CU ``g`` and the tensor's word
        offset in it, receiving the reference or waiting for the data first if needed."""
        t = self.tensors[name]
        key, base = self.key_of(name, g.xy)
        if t.kind == "runtime":
            if self.prod_cu(t) != g.xy and key not in g.received:
                self.receive(g, key)
        elif t.kind == "output" and t.producer is not None:
            p = self.prod_cu(t)
            if p != g.xy and name not in g.waited:
                self.wait_token(g, p, self.data_tok[(name, g.xy)])
                g.waited.add(name)
        return g.refs.get(key), base

    def send_token(self, g, dst):
        self.tok_sent[(g.xy, dst)] += 1
        seq = self.tok_sent[(g.xy, dst)]
        g.asm.li(R6, self.params.mu_id(*dst))
        g.asm.emit(Op.SEND, aux=self.chan[(dst, g.xy)], ra=6, imm=1)
        self.stamps[("token", g.xy, dst, seq)] = self.acct.tick(g.xy)
        return seq

    def wait_token(self, g, src, seq):
        used = self.tok_used[(g.xy, src)]
        if seq > used:
            g.asm.emit(Op.WAIT, aux=self.chan[(g.xy, src)], imm=seq - used)
            self.tok_used[(g.xy, src)] = seq
            self.acct.merge(g.xy, self.stamps[("token", src, g.xy, seq)])
            self.acct.tick(g.xy)

    def send_ref(self, g, key, dst):
        if self.pred[(dst, key)] is not None:
            self.wait_token(g, dst, self.credit_tok[(dst, key)])
        r = g.refs.get(key)
        g.asm.li(R6, self.params.mu_id(*dst))
        g.asm.li(R7, 1)
        g.asm.emit(Op.SENDREF, aux=self.slot[(dst, key)], rd=6, ra=int(r), rb=7)
        self.stamps[("ref", key, dst)] = self.acct.tick(g.xy)
        g.refs.unpin(key)
        self.sent.add((key, dst))
        self.pending[(g.xy, key)] -= 1
        self.check_release(g, key)

    def receive(self, g, key):
        i = self.inbox_pos[g.xy]
        keys = self.inbox[g.xy]
        if keys[i] != key:  # pragma: no cover - templates take inputs in order
            raise AssertionError(f"CU {g.xy} receives {key!r} out of order (expected "
                                 f"{keys[i]!r})")
        self.inbox_pos[g.xy] = i + 1
        g.asm.emit(Op.RECV, aux=self.slot[(g.xy, key)], rd=6)
        self.acct.merge(g.xy, self.stamps[("ref", key, g.xy)])
        self.acct.tick(g.xy)
        r = g.refs.new(key)
        g.asm.alui(AluFn.ADD, r, R6, 0)
        g.held.add(key)
        g.received.add(key)
        j = i + self.cp.mailbox
        if j < len(keys):
            succ = keys[j]
            sender = self.prod_cu(self.tensors[succ])
            self.credit_tok[(g.xy, succ)] = self.send_token(g, sender)
            self.credits.add((g.xy, succ))
            if succ in self.produced and (succ, g.xy) not in self.sent:
                self.send_ref(self.gens[sender], succ, g.xy)

    def check_release(self, g, key):
        """Return the CU's share of ``key`` and forget the reference after its last use."""
        if key not in g.held or self.uses[(g.xy, key)] > 0 or self.pending[(g.xy, key)] > 0:
            return
        share = self.share.get((g.xy, key), 0)
        if share:
            self.give_back(g.asm, g.refs.get(key), share)
            self.acct.ret(key, self.acct.tick(g.xy))
        g.refs.drop(key)
        g.held.discard(key)

    def give_back(self, asm, r, share):
        """Return a share: RETI (partial-free) or DECREF (counter baseline: every share is
        one count)."""
        if self.mp.refcount is RefcountMode.COUNTER:
            asm.emit(Op.DECREF, ra=int(r))
        else:
            asm.emit(Op.RETI, ra=int(r), imm=share)

    def alloc(self, g, t):
        """ALLOC the buffer of run-time tensor ``t`` in an MU with room near the CU."""
        words = t.layout.words
        if words > self.mp.max_buffer_words:
            raise LoweringError(f"Tensor {t.name!r} needs {words} words but an MU buffer holds "
                                f"at most {self.mp.max_buffer_words} (max_buffer_words)")
        units = max(1, self.acct.units(words)) if words else 0
        hint = self.plan.placement.mu_of.get(t.name)
        prefs = self.plan.nearest_mus(g.xy)
        if hint is not None and tuple(hint) in prefs:
            prefs.remove(tuple(hint))
            prefs.insert(0, tuple(hint))
        stamp = self.acct.tick(g.xy)
        for m in prefs:
            if self.acct.fits(m, units, stamp):
                break
        else:
            words_left, slots_left = self.acct.room(stamp)
            raise LoweringError(f"Tensor {t.name!r} ({words} words, allocated by CU {g.xy}) "
                                f"fits in no MU: the buffers that may still be live there leave "
                                f"at most {words_left} words and {slots_left} buffer slots free "
                                f"in any MU")
        w = self.weight[t.name]
        self.acct.alloc(m, t.name, units, w, stamp)
        r = g.refs.new(t.name)
        g.asm.li(R6, self.params.mu_id(*m))
        g.asm.emit(Op.ALLOC, rd=int(r), ra=6, imm=w)
        g.held.add(t.name)
        return r

    # --- the walk ----------------------------------------------------------------------------

    def generate(self):
        self.tok_sent = collections.Counter()
        self.tok_used = collections.Counter()
        self.stamps = {}
        self.data_tok = {}
        self.credit_tok = {}
        self.credits = set()
        self.sent = set()
        self.produced = set()
        self.inbox_pos = collections.Counter()
        for op in self.lops:
            g = self.gens[op.cu]
            start = len(g.asm)
            t = self.tensors[op.out]
            if t.kind == "runtime":
                g.out = self.alloc(g, t)
            else:
                g.out = g.refs.get(t.buffer)
            getattr(self, "_t_" + op.kind)(g, op)
            for i in op.ins:
                ti = self.tensors[i]
                if ti.kind == "runtime" and self.prod_cu(ti) != g.xy \
                        and ti.buffer not in g.received:  # pragma: no cover
                    raise AssertionError(f"template {op.kind} did not take input {i!r}")
            g.op_ranges.append((op.name, start, len(g.asm)))
            g.refs.unpin()
            for key in dict.fromkeys(self.key_of(i, g.xy)[0] for i in op.ins):
                self.uses[(g.xy, key)] -= 1
                self.check_release(g, key)
            self.after_production(g, op)
        for g in self.gens.values():
            for key in sorted(g.held):
                self.check_release(g, key)
            if any(self.share.get((g.xy, k), 0) for k in g.held):  # pragma: no cover
                raise AssertionError(f"CU {g.xy} still holds shares of {sorted(g.held)}")

    def after_production(self, g, op):
        t = self.tensors[op.out]
        key = t.buffer
        if t.kind == "runtime":
            self.produced.add(key)
            for c in self.remote[key]:
                if self.pred[(c, key)] is None or (c, key) in self.credits:
                    self.send_ref(g, key, c)
        else:
            for c in self.readers[t.name]:
                if c != g.xy:
                    self.data_tok[(t.name, c)] = self.send_token(g, c)
        g.refs.unpin()
        self.check_release(g, key)

    # --- helpers of the templates ------------------------------------------------------------

    def words_of(self, g, name, r_ref, rd):
        """Static words of a tensor (an int), or LEN into ``rd`` (a register) if dynamic."""
        lay = self.tensors[name].layout
        if not lay.dynamic:
            return lay.words
        g.asm.emit(Op.LEN, rd=int(rd), ra=int(r_ref))
        return rd

    def rows_of(self, g, r_words, cw, rd, tmp):
        """``rd = r_words / cw`` (words of whole rows)."""
        asm = g.asm
        if cw == 1:
            asm.alui(AluFn.ADD, rd, r_words, 0)
        elif cw & (cw - 1) == 0:
            asm.alui(AluFn.SHRU, rd, r_words, cw.bit_length() - 1)
        else:
            asm.li(rd, 0)
            asm.li(tmp, 0)

            def body(head):
                asm.alui(AluFn.ADD, tmp, tmp, cw)
                asm.alui(AluFn.ADD, rd, rd, 1)
                asm.branch(Op.BLT, head, ra=int(tmp), rb=int(r_words))
            asm.loop(body)
        return rd

    def row_loop(self, g, name, r_ref, offsets, body):
        """Run ``body()`` once per row of tensor ``name``; ``offsets`` are ``(reg, start,
        step)`` advanced after each row (the first walks ``name``). Uses r2."""
        asm = g.asm
        lay = self.tensors[name].layout
        for reg, start, _ in offsets:
            asm.li(reg, start)

        def advance():
            for reg, _, step in offsets:
                asm.alui(AluFn.ADD, reg, reg, step)

        if not lay.dynamic:
            if lay.rows == 0:
                return
            if lay.rows == 1:
                body()
                return
            asm.li(R2, lay.rows)

            def loop(head):
                body()
                advance()
                asm.branch(Op.LOOP, head, ra=2)
            asm.loop(loop)
            return
        asm.emit(Op.LEN, rd=2, ra=int(r_ref))
        end = asm.label()
        asm.branch(Op.BZ, end, ra=2)

        def loop(head):
            body()
            advance()
            asm.branch(Op.BLT, head, ra=int(offsets[0][0]), rb=2)
        asm.loop(loop)
        asm.place(end)

    # --- templates ---------------------------------------------------------------------------

    def _t_matmul_nt(self, g, op):
        """Per row of A: copy it to the local buffer, then one PACK_SUM stream over the rows of
        Bᵀ appends the row of the product."""
        a, b = op.ins[:2]
        la, lb = self.tensors[a].layout, self.tensors[b].layout
        ra, base_a = self.ref(g, a)
        rb, base_b = self.ref(g, b)
        kw = la.cw
        self.need_local(g, op, kw)
        asm, out = g.asm, g.out

        def body():
            asm.stream(AluFn.PASS, a=ra, a_base=R1, n=kw, d_mode=DMode.LOCAL, d_base=0)
            asm.stream(AluFn.MUL, a=rb, a_base=base_b, n=kw, outer=lb.rows, a_ostride=kw,
                       b_mode=BMode.LOCAL, b_val=0, b_stride=1, b_ostride=0,
                       d_mode=DMode.PACK_SUM, d_ref=out)
        self.row_loop(g, a, ra, [(R1, base_a, kw)], body)

    def _t_transpose(self, g, op):
        """Per column c: a PACK_SUM stream of one step per row picks lane c % lanes of each
        row's word (times a one-hot local word) into the lanes of the output row."""
        (x,) = op.ins
        lx = self.tensors[x].layout
        rx, base = self.ref(g, x)
        ident = g.local["identity"]
        asm, out = g.asm, g.out
        if lx.rows == 0:
            return
        asm.li(R1, 0)
        asm.li(R2, lx.cols)

        def body(head):
            asm.alui(AluFn.SHRU, R3, R1, self.lb)
            asm.alui(AluFn.ADD, R3, R3, base)
            asm.alui(AluFn.AND, R4, R1, self.lanes - 1)
            asm.alui(AluFn.ADD, R4, R4, ident)
            asm.stream(AluFn.MUL, a=rx, a_base=R3, n=1, outer=lx.rows, a_ostride=lx.cw,
                       b_mode=BMode.LOCAL, b_val=R4, b_stride=0, b_ostride=0,
                       d_mode=DMode.PACK_SUM, d_ref=out)
            asm.alui(AluFn.ADD, R1, R1, 1)
            asm.branch(Op.LOOP, head, ra=2)
        asm.loop(body)

    def _t_expand(self, g, op):
        (x,) = op.ins
        lx, lo = self.tensors[x].layout, self.tensors[op.out].layout
        rx, base = self.ref(g, x)
        if lo.rows:
            g.asm.stream(AluFn.PASS, a=rx, a_base=base, n=lx.cw, outer=lo.rows, a_ostride=0,
                         d_mode=DMode.APPEND, d_ref=g.out)

    def _t_copy(self, g, op):
        (x,) = op.ins
        rx, base = self.ref(g, x)
        asm = g.asm
        n = self.words_of(g, x, rx, R2)
        if n == 0:
            return
        end = asm.label()
        if isinstance(n, _Reg):
            asm.branch(Op.BZ, end, ra=2)
        asm.stream(AluFn.PASS, a=rx, a_base=base, n=n, d_mode=DMode.APPEND, d_ref=g.out)
        asm.place(end)

    def _t_ew(self, g, op):
        """An elementwise chain: the first stage streams the input (and its second operand:
        local buffer, scalar or per-row scalar) into the output, later stages rewrite the
        output in place, and a last pass masks padding lanes if the chain makes them
        nonzero."""
        asm, out = g.asm, g.out
        stages, mode = op.attrs["stages"], op.attrs["mode"]
        x = op.ins[0]
        lo = self.tensors[op.out].layout
        rx, bx = self.ref(g, x)
        if mode is not None:
            rb, bb = self.ref(g, op.ins[1])
            lbt = self.tensors[op.ins[1]].layout
        n = self.words_of(g, x, rx, R2)
        if n == 0:
            return
        end = asm.label()
        if isinstance(n, _Reg):
            asm.branch(Op.BZ, end, ra=2)
        s0 = stages[0]
        cw = lo.cw

        def rows():
            return lo.rows if not lo.dynamic else self.rows_of(g, R2, cw, R3, R4)

        kw = dict(shift=s0.shift, relu=s0.relu, d_mode=DMode.APPEND, d_ref=out)
        if mode is None:
            bm = BMode.ZERO if s0.imm is None else BMode.SCALAR
            asm.stream(s0.fn, a=rx, a_base=bx, n=n, b_mode=bm, b_val=s0.imm or 0, **kw)
        elif mode == "scalar":
            asm.li(R5, bb)
            asm.emit(Op.READ, fn=0, rd=5, ra=int(rb), rb=5)
            asm.stream(s0.fn, a=rx, a_base=bx, n=n, b_mode=BMode.SCALAR, b_val=R5, **kw)
        elif mode == "row":
            self.need_local(g, op, cw)
            asm.stream(AluFn.PASS, a=rb, a_base=bb, n=cw, d_mode=DMode.LOCAL, d_base=0)
            asm.stream(s0.fn, a=rx, a_base=bx, n=cw, outer=rows(), a_ostride=cw,
                       b_mode=BMode.LOCAL, b_val=0, b_stride=1, b_ostride=0, **kw)
        elif mode == "col":
            def body():
                asm.emit(Op.READ, fn=0, rd=5, ra=int(rb), rb=3)
                asm.stream(s0.fn, a=rx, a_base=R1, n=cw, b_mode=BMode.SCALAR, b_val=R5, **kw)
            # row_loop uses r2 itself: keep the word count for the later stages in r7.
            if isinstance(n, _Reg):
                asm.alui(AluFn.ADD, R7, R2, 0)
            self.row_loop(g, x, rx, [(R1, bx, cw), (R3, bb, lbt.cw)], body)
            if isinstance(n, _Reg):
                asm.alui(AluFn.ADD, R2, R7, 0)
        else:  # same shape: the second operand goes through the local buffer in chunks
            budget = g.local_top
            self.need_local(g, op, 1)
            if not isinstance(n, _Reg) and n <= budget:
                asm.stream(AluFn.PASS, a=rb, a_base=bb, n=n, d_mode=DMode.LOCAL, d_base=0)
                asm.stream(s0.fn, a=rx, a_base=bx, n=n, b_mode=BMode.LOCAL, b_val=0,
                           b_stride=1, **kw)
            else:
                if not isinstance(n, _Reg):
                    asm.li(R2, n)
                asm.li(R1, 0)

                def body(head):
                    asm.alu(AluFn.SUB, R3, R2, R1)
                    asm.alui(AluFn.MIN, R3, R3, budget)
                    asm.alui(AluFn.ADD, R4, R1, bb)
                    asm.stream(AluFn.PASS, a=rb, a_base=R4, n=R3, d_mode=DMode.LOCAL,
                               d_base=0)
                    asm.alui(AluFn.ADD, R4, R1, bx)
                    asm.stream(s0.fn, a=rx, a_base=R4, n=R3, b_mode=BMode.LOCAL, b_val=0,
                               b_stride=1, **kw)
                    asm.alu(AluFn.ADD, R1, R1, R3)
                    asm.branch(Op.BLT, head, ra=1, rb=2)
                asm.loop(body)
                if not isinstance(n, _Reg):
                    n = lo.words
        for s in stages[1:]:
            bm = BMode.ZERO if s.imm is None else BMode.SCALAR
            asm.stream(s.fn, a=out, a_base=0, n=n, b_mode=bm, b_val=s.imm or 0, shift=s.shift,
                       relu=s.relu, d_mode=DMode.WRITE, d_ref=out, d_base=0, d_stride=1)
        if self.ew_needs_mask(op):
            mask = g.local[f"mask{lo.cols}"]
            asm.stream(AluFn.AND, a=out, a_base=0, n=cw, outer=rows(), a_ostride=cw,
                       b_mode=BMode.LOCAL, b_val=mask, b_stride=1, b_ostride=0,
                       d_mode=DMode.WRITE, d_ref=out, d_base=0, d_stride=1)
        asm.place(end)

    def _t_slice_rows(self, g, op):
        (x,) = op.ins
        lx = self.tensors[x].layout
        rx, base = self.ref(g, x)
        start, stop = op.attrs["start"], op.attrs["stop"]
        if stop > start:
            g.asm.stream(AluFn.PASS, a=rx, a_base=base + start * lx.cw,
                         n=(stop - start) * lx.cw, d_mode=DMode.APPEND, d_ref=g.out)

    def _t_slice_cols(self, g, op):
        """Whole words of each row (the slice starts at a word boundary), ANDed with a mask
        when the last word would keep lanes past the slice."""
        (x,) = op.ins
        lx, lo = self.tensors[x].layout, self.tensors[op.out].layout
        rx, base = self.ref(g, x)
        asm = g.asm
        rows = lo.rows
        end = asm.label()
        if lx.dynamic:
            asm.emit(Op.LEN, rd=2, ra=int(rx))
            asm.branch(Op.BZ, end, ra=2)
            rows = self.rows_of(g, R2, lx.cw, R3, R4)
        elif rows == 0:
            return
        kw = dict(a=rx, a_base=base + op.attrs["start"] // self.lanes, n=lo.cw, outer=rows,
                  a_ostride=lx.cw, d_mode=DMode.APPEND, d_ref=g.out)
        if op.attrs["mask"]:
            asm.stream(AluFn.AND, b_mode=BMode.LOCAL, b_val=g.local[f"mask{lo.cols}"],
                       b_stride=1, b_ostride=0, **kw)
        else:
            asm.stream(AluFn.PASS, **kw)
        asm.place(end)

    def _t_concat_rows(self, g, op):
        for x in op.ins:
            lx = self.tensors[x].layout
            rx, base = self.ref(g, x)
            if lx.words:
                g.asm.stream(AluFn.PASS, a=rx, a_base=base, n=lx.words, d_mode=DMode.APPEND,
                             d_ref=g.out)
            g.refs.unpin(self.key_of(x, g.xy)[0])

    def _t_concat_cols(self, g, op):
        """Each input's rows written at their word offset in the output rows."""
        lo = self.tensors[op.out].layout
        asm, out = g.asm, g.out
        off = 0
        for x in op.ins:
            lx = self.tensors[x].layout
            rx, base = self.ref(g, x)

            def body(rx=rx, lx=lx):
                asm.stream(AluFn.PASS, a=rx, a_base=R1, n=lx.cw, d_mode=DMode.WRITE,
                           d_ref=out, d_base=R3, d_stride=1)
            self.row_loop(g, x, rx, [(R1, base, lx.cw), (R3, off, lo.cw)], body)
            off += lx.cw
            g.refs.unpin(self.key_of(x, g.xy)[0])

    def _t_append_inplace(self, g, op):
        """APPEND the new rows to the cache's own buffer (the KV cache grows in place)."""
        _, x = op.ins
        lx = self.tensors[x].layout
        rx, base = self.ref(g, x)
        if lx.words:
            g.asm.stream(AluFn.PASS, a=rx, a_base=base, n=lx.words, d_mode=DMode.APPEND,
                         d_ref=g.out)

    def _t_reduce(self, g, op):
        (x,) = op.ins
        lx = self.tensors[x].layout
        rx, base = self.ref(g, x)
        asm, out = g.asm, g.out
        cw = lx.cw
        is_max = op.attrs["op"] == "max"
        if op.attrs["axis"] == "row" or lx.ndim == 1:
            # One SUM (or MAX, padding lanes forced to INT_MIN) stream per row.
            def body():
                if is_max:
                    asm.stream(AluFn.MIN, a=rx, a_base=R1, n=cw, b_mode=BMode.LOCAL,
                               b_val=g.local[f"lrow{lx.cols}"], b_stride=1,
                               d_mode=DMode.MAX, rd=R5)
                else:
                    asm.stream(AluFn.PASS, a=rx, a_base=R1, n=cw, d_mode=DMode.SUM, rd=R5)
                asm.emit(Op.VCLR)
                asm.emit(Op.VSET, fn=0, ra=5)
                asm.emit(Op.VAPPEND, rd=0, ra=int(out))
            self.row_loop(g, x, rx, [(R1, base, cw)], body)
            return
        # Over rows: accumulate rows 1.. in the local buffer, add row 0 on the way out.
        fn = AluFn.MAX if is_max else AluFn.ADD
        rows = lx.rows
        if rows == 0:
            return
        if rows == 1:
            asm.stream(AluFn.PASS, a=rx, a_base=base, n=cw, d_mode=DMode.APPEND, d_ref=out)
            return
        self.need_local(g, op, cw)
        asm.stream(AluFn.PASS, a=rx, a_base=base + cw, n=cw, d_mode=DMode.LOCAL, d_base=0)
        if rows > 2:
            asm.li(R1, base + 2 * cw)
            asm.li(R2, rows - 2)

            def body(head):
                asm.stream(fn, a=rx, a_base=R1, n=cw, b_mode=BMode.LOCAL, b_val=0, b_stride=1,
                           d_mode=DMode.LOCAL, d_base=0)
                asm.alui(AluFn.ADD, R1, R1, cw)
                asm.branch(Op.LOOP, head, ra=2)
            asm.loop(body)
        asm.stream(fn, a=rx, a_base=base, n=cw, b_mode=BMode.LOCAL, b_val=0, b_stride=1,
                   d_mode=DMode.APPEND, d_ref=out)

    def _t_topk(self, g, op):
        """Per row: L (local) = INT_MAX on real lanes, INT_MIN on padding; k times: ARGMAX of
        min(row, L), then L at the chosen element = INT_MIN. If the maximum found is INT_MIN,
        every element left equals INT_MIN and the answer is the first one not chosen: the
        first INT_MAX of L (an ARGMAX of L)."""
        x, lrow, table, maxw = op.ins
        lx = self.tensors[x].layout
        rx, bx = self.ref(g, x)
        rp, b_l = self.ref(g, lrow)
        rt, b_t = self.ref(g, table)
        rm, b_m = self.ref(g, maxw)
        k = op.attrs["k"]
        ew = lx.cw
        lanes = self.lanes
        self.need_local(g, op, ew)
        asm, out = g.asm, g.out

        def body():
            asm.stream(AluFn.PASS, a=rp, a_base=b_l, n=ew, d_mode=DMode.LOCAL, d_base=0)
            asm.emit(Op.VCLR)
            for j in range(k):
                asm.stream(AluFn.MIN, a=rx, a_base=R1, n=ew, b_mode=BMode.LOCAL, b_val=0,
                           b_stride=1, d_mode=DMode.ARGMAX, rd=R4)
                if j:
                    ok = asm.label()
                    asm.alui(AluFn.XOR, R6, R4, INT_MIN)
                    asm.branch(Op.BNZ, ok, ra=6)
                    asm.stream(AluFn.MIN, a=rm, a_base=b_m, a_stride=0, n=ew,
                               b_mode=BMode.LOCAL, b_val=0, b_stride=1, d_mode=DMode.ARGMAX,
                               rd=R6)
                    asm.alui(AluFn.ADD, R5, R7, 0)
                    asm.place(ok)
                asm.emit(Op.VSET, fn=j % lanes, ra=5)
                if j % lanes == lanes - 1 or j == k - 1:
                    asm.emit(Op.VAPPEND, rd=0, ra=int(out))
                    if j < k - 1:
                        asm.emit(Op.VCLR)
                if j < k - 1:
                    asm.alui(AluFn.AND, R6, R5, lanes - 1)
                    asm.alui(AluFn.ADD, R6, R6, b_t)
                    asm.alui(AluFn.SHRU, R7, R5, self.lb)
                    asm.stream(AluFn.MIN, a=rt, a_base=R6, n=1, b_mode=BMode.LOCAL, b_val=R7,
                               b_stride=0, d_mode=DMode.LOCAL, d_base=R7)
        self.row_loop(g, x, rx, [(R1, bx, ew)], body)

    def _t_take(self, g, op):
        """x[t, idx[t, j]]: the element at a run-time position is a one-step SUM stream of its
        word times a one-hot local word."""
        x, idx = op.ins
        lx, li = self.tensors[x].layout, self.tensors[idx].layout
        rx, bx = self.ref(g, x)
        ri, bi = self.ref(g, idx)
        k = li.cols
        lanes = self.lanes
        ident = g.local["identity"]
        asm, out = g.asm, g.out

        def body():
            asm.emit(Op.VCLR)
            for j in range(k):
                word = R3
                if j // lanes:
                    asm.alui(AluFn.ADD, R4, R3, j // lanes)
                    word = R4
                asm.emit(Op.READ, fn=j % lanes, rd=5, ra=int(ri), rb=int(word))
                asm.alui(AluFn.SHRU, R6, R5, self.lb)
                asm.alu(AluFn.ADD, R6, R6, R1)
                asm.alui(AluFn.AND, R7, R5, lanes - 1)
                asm.alui(AluFn.ADD, R7, R7, ident)
                asm.stream(AluFn.MUL, a=rx, a_base=R6, n=1, b_mode=BMode.LOCAL, b_val=R7,
                           b_stride=0, d_mode=DMode.SUM, rd=R5)
                asm.emit(Op.VSET, fn=j % lanes, ra=5)
                if j % lanes == lanes - 1 or j == k - 1:
                    asm.emit(Op.VAPPEND, rd=0, ra=int(out))
                    asm.emit(Op.VCLR)
        self.row_loop(g, x, rx, [(R1, bx, lx.cw), (R3, bi, li.cw)], body)

    def _route_test(self, asm, ri, r_word, k, expert, targets):
        """Branch to ``targets[j]`` at the first slot j of the row whose index is ``expert``;
        fall through if none is."""
        lanes = self.lanes
        for j in range(k):
            word = r_word
            if j // lanes:
                asm.alui(AluFn.ADD, R6, r_word, j // lanes)
                word = R6
            asm.emit(Op.READ, fn=j % lanes, rd=5, ra=int(ri), rb=int(word))
            asm.alui(AluFn.XOR, R5, R5, expert)
            asm.branch(Op.BZ, targets[j], ra=5)

    def _t_dispatch(self, g, op):
        """Rows routed to the expert are appended, in token order (a run-time count)."""
        x, idx = op.ins
        lx, li = self.tensors[x].layout, self.tensors[idx].layout
        rx, bx = self.ref(g, x)
        ri, bi = self.ref(g, idx)
        asm, out = g.asm, g.out

        def body():
            hit, nxt = asm.label(), asm.label()
            self._route_test(asm, ri, R3, li.cols, op.attrs["expert"], [hit] * li.cols)
            asm.branch(Op.JMP, nxt)
            asm.place(hit)
            asm.stream(AluFn.PASS, a=rx, a_base=R1, n=lx.cw, d_mode=DMode.APPEND, d_ref=out)
            asm.place(nxt)
        self.row_loop(g, x, rx, [(R1, bx, lx.cw), (R3, bi, li.cw)], body)

    def _t_combine(self, g, op):
        """out = 0; then expert by expert, each token routed to it (in order, so its rows are
        taken in order): local = (gate * y_e row) >> shift; out row += local."""
        idx, gate, *ys = op.ins
        li, lo = self.tensors[idx].layout, self.tensors[op.out].layout
        ri, bi = self.ref(g, idx)
        rg, bg = self.ref(g, gate)
        asm, out = g.asm, g.out
        dw, k, lanes = lo.cw, li.cols, self.lanes
        self.need_local(g, op, dw)
        if lo.rows == 0:
            for y in ys:
                self.ref(g, y)
            return
        asm.stream(AluFn.AND, a=ri, a_base=bi, a_stride=0, n=lo.words, d_mode=DMode.APPEND,
                   d_ref=out)
        for e, y in enumerate(ys):
            ry, by = self.ref(g, y)
            asm.li(R7, by)

            def body(ry=ry, e=e):
                hits = [asm.label() for _ in range(k)]
                do, nxt = asm.label(), asm.label()
                self._route_test(asm, ri, R1, k, e, hits)
                asm.branch(Op.JMP, nxt)
                for j in range(k):
                    asm.place(hits[j])
                    word = R3
                    if j // lanes:
                        asm.alui(AluFn.ADD, R6, R3, j // lanes)
                        word = R6
                    asm.emit(Op.READ, fn=j % lanes, rd=6, ra=int(rg), rb=int(word))
                    if j < k - 1:
                        asm.branch(Op.JMP, do)
                asm.place(do)
                asm.stream(AluFn.MUL, a=ry, a_base=R7, n=dw, b_mode=BMode.SCALAR, b_val=R6,
                           shift=op.attrs["shift"], d_mode=DMode.LOCAL, d_base=0)
                asm.stream(AluFn.ADD, a=out, a_base=R4, n=dw, b_mode=BMode.LOCAL, b_val=0,
                           b_stride=1, d_mode=DMode.WRITE, d_ref=out, d_base=R4, d_stride=1)
                asm.alui(AluFn.ADD, R7, R7, dw)
                asm.place(nxt)
            self.row_loop(g, idx, ri, [(R1, bi, li.cw), (R3, bg, li.cw), (R4, 0, dw)], body)
            g.refs.unpin(self.key_of(y, g.xy)[0])

    # --- assembling the job ------------------------------------------------------------------

    def run(self, inputs, graph):
        self.place_host()
        self.plan_uses()
        self.register_host()
        self.make_gens()
        self.prepare_local()
        self.generate()
        need = {cu: g.refs.n_slots for cu, g in self.gens.items() if g.refs.table}
        if any(need[cu] > self.tables.get(cu, -1) for cu in need):
            return need
        return self.finish(inputs, graph)

    def finish(self, inputs, graph):
        params, cp = self.params, self.cp
        tiles, programs = {}, {}
        for cu, g in self.gens.items():
            prologue = []
            if g.refs.table:
                m = g.table_mu = self.table_mu[cu]
                prologue += [Instr(Op.LI, rd=7, imm=params.mu_id(*m)),
                             Instr(Op.ALLOC, rd=_TABLE, ra=7, imm=1)]
                for r in g.extras:
                    prologue += [Instr(Op.VSET, fn=0, ra=r), Instr(Op.VAPPEND, rd=r, ra=_TABLE)]
            body = g.asm.assemble(len(prologue))
            epilogue = []
            if g.refs.table:
                if self.mp.refcount is RefcountMode.COUNTER:
                    epilogue.append(Instr(Op.DECREF, ra=_TABLE))
                else:
                    epilogue.append(Instr(Op.RETI, ra=_TABLE, imm=1))
            epilogue.append(Instr(Op.HALT))
            program = prologue + body + epilogue
            ops = [(name, self.ops[name].kind, self.ops[name].node, a + len(prologue),
                    b + len(prologue)) for name, a, b in g.op_ranges]
            if len(program) > cp.prog_len:
                names = ", ".join(repr(o[2]) for o in ops[:4]) + (", ..." if len(ops) > 4
                                                                  else "")
                raise LoweringError(f"The program of CU {cu} ({len(ops)} ops: {names}) is "
                                    f"{len(program)} instructions long but prog_len is "
                                    f"{cp.prog_len}")
            tiles[cu] = TileConfig(program=program,
                                   regs={r: Ref(key) for r, key in sorted(g.init_regs.items())},
                                   local=dict(sorted(g.local_words.items())))
            programs[cu] = ProgramInfo(cu, len(program), ops, list(g.init_regs.values()),
                                       g.table_mu, cp.local_words - g.local_top)
        # Host buffers: constant pools, inputs, outputs (allocated by the host in this order).
        lanes = self.lanes
        buffers = []
        for key, (_, names) in self.pools.items():
            data = np.concatenate([self.tensors[c].layout.encode(self.tensors[c].value)
                                   for c in names])
            buffers.append(HostBuffer(key, self.mu_of[key], data, max(1, self.weight[key]),
                                      cu_returns=self.weight[key]))
        input_layouts = {}
        for name in graph.inputs:
            t = self.tensors.get(name)
            if t is None:
                continue
            input_layouts[name] = (t.buffer, t.layout)
            buffers.append(HostBuffer(t.buffer, self.mu_of[t.buffer],
                                      t.layout.encode(inputs[name]),
                                      max(1, self.weight[t.buffer]),
                                      cu_returns=self.weight[t.buffer]))
        output_layouts = {}
        for name, buf in self.plan.output_map.items():
            lay = _layout(graph.type_of(name), lanes, name)
            output_layouts[name] = (buf, lay)
            if buf == name:
                buffers.append(HostBuffer(buf, self.mu_of[buf], None, 1))
        outputs = list(dict.fromkeys(buf for buf, _ in output_layouts.values()))
        mu_usage = {}
        for m in self.acct.mus:
            host = [b.name for b in buffers if tuple(b.mu) == m]
            u = max(self.acct.host[m][0], self.acct.peak[m][0])
            s = max(self.acct.host[m][1], self.acct.peak[m][1])
            mu_usage[m] = {"host_buffers": host,
                           "host_words": sum(0 if b.data is None else len(b.data)
                                             for b in buffers if tuple(b.mu) == m),
                           "bound_words": self.acct.unit_words(u), "bound_slots": s}
        macs = 0
        for n in graph.order():
            if graph.kind(n) == "matmul":
                a, b = (graph.type_of(i).shape for i in graph.inputs_of(n))
                macs += a[0] * a[1] * b[1]
        lowered = [(op.name, op.kind, op.cu, tuple(op.nodes)) for op in self.lops]
        job = CompiledJob(FabricConfig(params, tiles), buffers, outputs, {}, macs=macs,
                          cus_used=len(tiles), description=f"{graph.name} lowered onto "
                          f"{len(tiles)} CUs", graph=graph, input_layouts=input_layouts,
                          output_layouts=output_layouts, programs=programs, mu_usage=mu_usage,
                          lowered=lowered)
        job.expected = job.expected_outputs(inputs)
        return job


@dataclasses.dataclass
class ProgramInfo:
    """What the lowering put on one CU.

    Members
    -------
    cu : tuple
        ``(x, y)``.
    instructions : int
        Program length (prologue, ops, messages, epilogue).
    ops : list
        ``(lowered op, kind, graph node, first pc, end pc)`` of each op, in program order (the
        messages sent for other CUs' ops lie between them).
    host_buffers : list
        Host buffers whose references the CU gets in its initial registers.
    table_mu : tuple or None
        The MU of the CU's reference table (None: every reference fitted in registers).
    local_constants : int
        Words of the local buffer taken by constants.
    """

    cu: tuple
    instructions: int
    ops: list
    host_buffers: list
    table_mu: tuple | None
    local_constants: int

    def op_at(self, pc):
        """The lowered op whose code holds ``pc`` (None: prologue, messages, epilogue)."""
        for name, _, _, a, b in self.ops:
            if a <= pc < b:
                return name
        return None


@dataclasses.dataclass
class CompiledJob(Job):
    """A :class:`~rdakit.compiler.job.Job` made by :func:`lower`, with what is needed to feed it
    other inputs and to read its outputs as tensors.

    Members
    -------
    graph : DataflowGraph
        The lowered graph.
    input_layouts, output_layouts : dict
        Graph input (output) name -> ``(host buffer name, TensorLayout)``.
    programs : dict
        ``(x, y)`` -> :class:`ProgramInfo` of every CU with a program.
    mu_usage : dict
        ``(x, y)`` of every MU -> ``host_buffers`` (names), ``host_words`` (words the host
        writes), ``bound_words`` and ``bound_slots`` (the capacity check's bound, run-time
        buffers included).
    lowered : list
        ``(lowered op, kind, CU, graph nodes it implements)`` in the global order.
    workload : Workload or None
        The workload compiled (set by :func:`~rdakit.compiler.compile.compile_workload`).
    """

    graph: object = None
    input_layouts: dict = dataclasses.field(default_factory=dict)
    output_layouts: dict = dataclasses.field(default_factory=dict)
    programs: dict = dataclasses.field(default_factory=dict)
    mu_usage: dict = dataclasses.field(default_factory=dict)
    lowered: list = dataclasses.field(default_factory=list)
    workload: object = None

    def expected_outputs(self, inputs):
        """The expected contents of the output buffers (the graph evaluated in numpy)."""
        values = self.graph.evaluate(inputs)
        out = {}
        for name, (buf, lay) in self.output_layouts.items():
            out[buf] = lay.encode(values[name])
        return out

    def with_inputs(self, inputs):
        """The same job on other input values (same shapes; dynamic inputs may have fewer
        rows, up to their bound)."""
        missing = sorted(set(self.input_layouts) - set(inputs))
        if missing:
            raise ValueError(f"inputs must give a value for {', '.join(missing)}")
        self.graph.evaluate(inputs)       # checks dtypes and shapes
        buffers = []
        for b in self.buffers:
            for name, (buf, lay) in self.input_layouts.items():
                if buf == b.name:
                    b = dataclasses.replace(b, data=lay.encode(inputs[name]))
            buffers.append(b)
        job = dataclasses.replace(self, buffers=buffers)
        job.expected = job.expected_outputs(inputs)
        return job

    def decode(self, outputs, *, check_padding=False):
        """Graph outputs (numpy arrays of their dtype and shape) from the output buffers read
        back (buffer name -> ``n x lanes`` words); see :meth:`TensorLayout.decode`."""
        return {name: lay.decode(outputs[buf], check_padding=check_padding)
                for name, (buf, lay) in self.output_layouts.items()}


def _parts_by_name(graph, parts):
    if hasattr(parts, "assignment"):
        return parts.assignment()
    if isinstance(parts, dict):
        return {n: int(p) for n, p in parts.items()}
    order = graph.order()
    parts = np.asarray(parts)
    if len(parts) != len(order):
        raise LoweringError(f"An assignment of graph {graph.name!r} must have {len(order)} "
                            f"entries, not {len(parts)}")
    return {n: int(p) for n, p in zip(order, parts.tolist(), strict=True)}


def lower(graph, parts, placement, params, *, inputs=None):
    """Lower a placed dataflow graph to a job for the fabric ``params`` describes.

    Parameters
    ----------
    graph : DataflowGraph
        The graph (validated here).
    parts : PartitionResult, dict or array
        Partition of every node (as :func:`~rdakit.compiler.placement.place` takes it).
    placement : Placement
        Where the partitions and buffers went; its fabric must have the grid of ``params``.
    params : FabricParams
        The fabric.
    inputs : dict, optional
        Values of the graph inputs (default :func:`sample_inputs`): written into the host
        buffers, and evaluated in numpy for the job's expected outputs.

    Returns
    -------
    CompiledJob

    Raises
    ------
    LoweringError
        If something does not fit or cannot be lowered; the message names it.
    """
    graph.validate()
    fab = placement.fabric
    if (fab.rows, fab.cols) != (params.rows, params.cols) or tuple(
            "".join(r) for r in params.grid) != tuple(fab.layout):
        raise LoweringError(f"The placement is for a {fab.rows}x{fab.cols} fabric of layout "
                            f"{'/'.join(fab.layout)}, not the {params.rows}x{params.cols} "
                            f"fabric of layout {'/'.join(''.join(r) for r in params.grid)}")
    if params.cu.regs != 16:
        raise LoweringError(f"The lowering needs CUs with 16 registers, not {params.cu.regs}")
    if inputs is None:
        inputs = sample_inputs(graph)
    try:
        graph.evaluate(inputs)
    except GraphError as e:
        raise LoweringError(str(e)) from None
    part_of = _parts_by_name(graph, parts)
    plan = _Planner(graph, part_of, placement, params)
    plan.legalize().fuse().place_outputs().eliminate_dead().order()
    job = _Lowerer(plan, params).run(inputs, graph)
    if isinstance(job, dict):
        # Some CUs need a reference table: lower again with room reserved for the tables.
        job = _Lowerer(plan, params, tables=job).run(inputs, graph)
        if isinstance(job, dict):  # pragma: no cover - the tables do not depend on MUs
            raise AssertionError(f"reference tables changed between passes: {job}")
    return job


def replay_refs(job):
    """The references the host gets for ``job``'s buffers on a freshly reset fabric: its
    allocations (and appends) replayed on golden MU models. Raises :class:`LoweringError` if
    an MU refuses one."""
    from rdakit.hdl.spec.packets import MUOp, MUStatus
    from rdakit.hdl.spec.vector import pack_vector
    from rdakit.sim.models.mu import MUModel

    p = job.params
    models, refs = {}, {}
    for b in job.buffers:
        mu = tuple(b.mu)
        model = models.setdefault(mu, MUModel(p.mu, p.mu_id(*mu)))
        resp = model.request({"op": MUOp.ALLOC, "data": b.weight})
        if resp["status"] is not MUStatus.OK:
            raise LoweringError(f"MU {mu} refuses host buffer {b.name!r}: "
                                f"{resp['status'].name}")
        ref = resp["ref"]
        for row in ([] if b.data is None else np.asarray(b.data).tolist()):
            r = model.request({"op": MUOp.APPEND, "ref": ref, "data": pack_vector(row)})
            if r["status"] is not MUStatus.OK:
                raise LoweringError(f"MU {mu} cannot hold host buffer {b.name!r}: "
                                    f"{r['status'].name}")
        refs[b.name] = ref["mu"] | ref["buf"] << p.mu.mu_id_bits
    return refs
