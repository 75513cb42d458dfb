"""The lowering's passes: each rewrites a :class:`~rdakit.compiler.lower.plan.Plan` in place.

A pass is a small frozen dataclass with a :attr:`~LoweringPass.name` and typed options (as
xDSL's module passes are), whose :meth:`~LoweringPass.apply` leaves the plan valid: every
tensor an op reads exists and every op comes after the ops producing what it reads.
:data:`PIPELINE` is what :func:`~rdakit.compiler.lower.lower` runs, in order:

``legalize``
    Graph nodes to lowered ops the code generator has templates for (a matmul reads its
    right-hand side transposed, a slice at an odd column becomes a selection matmul, ...).
``fuse-elementwise``
    Chains of elementwise ops on one CU into one op of several stream passes.
``fuse-epilogue``
    A chain that is one output stage (a requantization) into the matmul producing what it
    reads: applied to each sum by the matmul's PACK_SUM streams.
``place-outputs``
    Graph outputs into host buffers written by their producers (copies where needed).
``eliminate-dead``
    Ops nobody reads, then unread constants and inputs.
``fuse-dispatch``
    A mixture of experts' dispatch into the matmul that reads its rows, on the same CU.
``schedule-order``
    The ops in the order of the partitioner's list schedule (by start cycle), when it has one:
    each CU runs its ops in the order the estimate assumed.
``check-order``
    That the ops are in a topological order.
"""

import dataclasses
import heapq
from typing import ClassVar

import numpy as np

from rdakit.compiler.lower.chains import Clip, Stage, append_stage
from rdakit.compiler.lower.layout import INT_MAX, LoweringError, TensorLayout, as2d, layout_of
from rdakit.compiler.lower.plan import LOp
from rdakit.compiler.lower.templates import axpy_form
from rdakit.hdl.spec.isa import AluFn

__all__ = ["LOWERABLE_KINDS", "LoweringPass", "Legalize", "FuseElementwise", "FuseEpilogue",
           "PlaceOutputs", "EliminateDead", "FuseDispatch", "ScheduleOrder", "CheckOrder",
           "PIPELINE"]

#: Op kinds the lowering turns into CU programs (every kind of the op table).
LOWERABLE_KINDS = frozenset({
    "input", "const", "output", "matmul", "add", "sub", "mul", "max", "min", "relu", "shr",
    "shl", "clip", "transpose", "reduce_sum", "reduce_max", "slice", "concat", "append", "topk",
    "take", "dispatch", "combine", "exp", "softmax", "gelu", "silu", "layer_norm", "rms_norm",
    "embedding", "sigmoid", "tanh",
})

_BINARY = {"add": AluFn.ADD, "sub": AluFn.SUB, "mul": AluFn.MUL, "max": AluFn.MAX,
           "min": AluFn.MIN}
_COMMUTATIVE = {"add", "mul", "max", "min"}


@dataclasses.dataclass(frozen=True)
class LoweringPass:
    """A rewrite of a plan; subclasses set :attr:`name` and implement :meth:`apply`."""

    #: The pass's name (as a pipeline spells it).
    name: ClassVar[str] = ""

    def apply(self, plan):
        """Rewrite ``plan`` in place."""
        raise NotImplementedError


def _bmode(plan, operand, out):
    """How operand ``operand`` broadcasts to layout ``out``: ``same``, ``scalar``, ``row``,
    ``col`` or None (not supported)."""
    s = plan.tensors[operand].layout
    if (s.rows, s.cols) == (out.rows, out.cols) and s.dynamic == out.dynamic:
        return "same"
    if s.rows == 1 and s.cols == 1 and not s.dynamic:
        return "scalar"
    if s.rows == 1 and s.cols == out.cols and not s.dynamic:
        return "row"
    if s.cols == 1 and (s.rows, s.dynamic) == (out.rows, out.dynamic):
        return "col"
    return None


def _column_view(plan, x):
    """``(tensor, attrs)`` a matmul reads for its operand ``x``: when ``x`` is whole words of
    the columns of a static run-time tensor (an attention head's columns of a KV cache, a
    ``slice_cols`` with no masked lane), that tensor, read in place from word ``b_off`` of each
    row, rows ``b_stride`` words apart (the slice's copy is then read by nobody and dropped);
    else ``x`` itself and no attrs."""
    prod = plan.lop_of(x)
    if prod is None or prod.kind != "slice_cols" or prod.attrs["mask"]:
        return x, {}
    (src,) = prod.ins
    ls = plan.tensors[src].layout
    if ls.dynamic or plan.tensors[src].kind not in ("runtime", "input", "output"):
        return x, {}
    return src, {"b_off": prod.attrs["start"] // plan.lanes, "b_stride": ls.cw}


@dataclasses.dataclass(frozen=True)
class Legalize(LoweringPass):
    """Fill an empty plan from its graph: one or a few lowered ops per node.

    Parameters
    ----------
    kinds : frozenset
        The op kinds accepted; any other raises :class:`LoweringError` naming the node.
    """

    name: ClassVar[str] = "legalize"
    kinds: frozenset = LOWERABLE_KINDS

    def apply(self, plan):
        g = plan.g
        for n in g.order():
            kind = g.kind(n)
            if kind not in self.kinds:
                raise LoweringError(f"Node {n!r} has op kind {kind!r}, which the lowering does "
                                    f"not support (it lowers {', '.join(sorted(self.kinds))})")
            t = g.type_of(n)
            lay = layout_of(t, plan.lanes, n)
            if lay.cols == 0 and kind not in ("input", "const", "output"):
                plan.fail(n, kind, f"a tensor with no columns {t.shape} cannot be lowered")
            ins = list(g.inputs_of(n))
            if kind == "input":
                plan.new_tensor(n, lay, "input", buffer=n,
                                mu_hint=plan.placement.mu_of.get(n))
            elif kind == "const":
                plan.new_tensor(n, lay, "const", value=as2d(g.nx.nodes[n]["attrs"]["value"])
                                .astype(np.int64), mu_hint=plan.placement.mu_of.get(n))
            elif kind == "output":
                plan.outputs.append((n, ins[0]))
            else:
                handler = getattr(self, "_" + kind, self._ew)
                handler(plan, n, kind, ins, lay, g.nx.nodes[n]["attrs"])

    def _matmul(self, plan, n, kind, ins, lay, attrs):
        a, b = ins
        cu = plan.cu_of(n)
        tb = plan.tensors[b]
        la, lb = plan.layout(a), tb.layout
        prod = plan.lop_of(b) if tb.kind != "const" else None
        if tb.kind == "const":
            bt = plan.const(f"{b}^T", tb.value.T, tb.mu_hint, tb.layout.dtype)
        elif prod is not None and prod.kind == "transpose":
            bt, view = _column_view(plan, prod.ins[0])
            plan.add_op(n, "matmul_nt", [a, bt], lay, n, cu, **view)
            return
        elif (la.rows == 1 and not la.dynamic and not lb.dynamic
              and axpy_form(lb.rows, la.words, lay.cw, plan.params.cu.local_words)):
            # One row times a run-time B (attention's p @ V): B's rows scaled and added up.
            b, view = _column_view(plan, b)
            plan.add_op(n, "matmul_axpy", [a, b], lay, n, cu, **view)
            return
        else:
            bt = plan.add_op(f"{n}/rhs^T", "transpose", [b],
                             TensorLayout(lb.cols, lb.rows, plan.lanes, lb.dtype), n, cu)
        plan.add_op(n, "matmul_nt", [a, bt], lay, n, cu)

    def _ew(self, plan, n, kind, ins, lay, attrs):
        cu = plan.cu_of(n)
        if kind in _BINARY:
            a, b = ins
            ma, mb = _bmode(plan, a, lay), _bmode(plan, b, lay)
            if ma != "same":
                if mb == "same" and kind in _COMMUTATIVE:
                    a, b, ma, mb = b, a, mb, ma
                elif ma == "row" and mb in ("same", "row", "scalar", "col") and not lay.dynamic:
                    la = plan.tensors[a].layout
                    a = plan.add_op(f"{n}/expand", "expand", [a],
                                    TensorLayout(lay.rows, lay.cols, plan.lanes, la.dtype), n,
                                    cu)
                    ma = "same"
                else:
                    sa, sb = plan.g.type_of(ins[0]).shape, plan.g.type_of(ins[1]).shape
                    plan.fail(n, kind, f"broadcasting {sa} with {sb} to {plan.g.type_of(n).shape} "
                                       f"is not supported (one operand must have the result's "
                                       f"shape; the other a row, a column or a scalar)")
            if mb is None:
                plan.fail(n, kind, f"broadcasting {plan.g.type_of(b).shape} to "
                                   f"{plan.g.type_of(n).shape} is not supported")
            tb = plan.tensors[b]
            if mb == "scalar" and tb.kind == "const":
                stage = Stage(_BINARY[kind], int(tb.value.reshape(-1)[0]))
                plan.add_op(n, "ew", [a], lay, n, cu, raw=[stage], mode=None)
            else:
                stage = Stage(_BINARY[kind], None, tensor=True)
                plan.add_op(n, "ew", [a, b], lay, n, cu, raw=[stage], mode=mb)
            return
        (x,) = ins
        if kind == "relu":
            raw = [Stage(AluFn.PASS, relu=True)]
        elif kind == "shr":
            raw = [Stage(AluFn.PASS, shift=int(attrs["shift"]))]
        elif kind == "shl":
            raw = [Stage(AluFn.SHL, int(attrs["shift"]))]
        elif kind == "clip":
            info = np.iinfo(attrs.get("dtype", "int8"))
            raw = [Clip(int(attrs.get("lo", info.min)), int(attrs.get("hi", info.max)))]
        else:  # pragma: no cover - every kind has a handler
            raise AssertionError(kind)
        plan.add_op(n, "ew", [x], lay, n, cu, raw=raw, mode=None)

    def _transpose(self, plan, n, kind, ins, lay, attrs):
        plan.add_op(n, "transpose", ins, lay, n, plan.cu_of(n))

    def _reduce_sum(self, plan, n, kind, ins, lay, attrs):
        t = plan.g.type_of(ins[0])
        axis = attrs.get("axis", -1) % len(t.shape)
        row = axis == len(t.shape) - 1
        plan.add_op(n, "reduce", ins, lay, n, plan.cu_of(n), op=kind[7:],
                    axis="row" if row else "col")

    _reduce_max = _reduce_sum

    def _slice(self, plan, n, kind, ins, lay, attrs):
        (x,) = ins
        cu = plan.cu_of(n)
        t = plan.g.type_of(x)
        lx = plan.layout(x)
        axis = attrs["axis"] % len(t.shape)
        start = attrs.get("start", 0)
        stop = attrs.get("stop", t.shape[axis])
        if len(t.shape) == 2 and axis == 0:
            plan.add_op(n, "slice_rows", ins, lay, n, cu, start=start, stop=stop)
            return
        if lay.cols == 0:
            plan.fail(n, kind, "an empty slice cannot be lowered")
        if start % plan.lanes == 0:
            plan.add_op(n, "slice_cols", ins, lay, n, cu, start=start, stop=stop,
                        mask=stop < lx.cols and (stop - start) % plan.lanes != 0)
            return
        sel = np.zeros((stop - start, lx.cols), dtype=np.int64)
        sel[np.arange(stop - start), np.arange(start, stop)] = 1
        s = plan.const(f"{n}/select", sel, plan.nearest_mus(cu)[0])
        plan.add_op(n, "matmul_nt", [x, s], lay, n, cu)

    def _concat(self, plan, n, kind, ins, lay, attrs):
        cu = plan.cu_of(n)
        t = plan.g.type_of(ins[0])
        axis = attrs.get("axis", -1) % len(t.shape) if kind == "concat" else 0
        if len(t.shape) == 2 and axis == 0:
            plan.add_op(n, "concat_rows", ins, lay, n, cu)
            return
        lays = [plan.layout(i) for i in ins]
        if all(la.cols % plan.lanes == 0 for la in lays[:-1]):
            plan.add_op(n, "concat_cols", ins, lay, n, cu)
            return
        # Concatenate whole words (gaps of zero lanes), then compact with a selection matrix.
        width = sum(la.cw for la in lays) * plan.lanes
        words = plan.add_op(f"{n}/words", "concat_cols", ins,
                            TensorLayout(lay.rows, width, plan.lanes, lay.dtype, False, 2), n, cu)
        sel = np.zeros((lay.cols, width), dtype=np.int64)
        col = pos = 0
        for la in lays:
            sel[np.arange(col, col + la.cols), np.arange(pos, pos + la.cols)] = 1
            col += la.cols
            pos += la.cw * plan.lanes
        s = plan.const(f"{n}/select", sel, plan.nearest_mus(cu)[0])
        plan.add_op(n, "matmul_nt", [words, s], lay, n, cu)

    def _append(self, plan, n, kind, ins, lay, attrs):
        first = plan.tensors[ins[0]]
        readers = [s for s in plan.g.nx.successors(ins[0])]
        if first.kind == "input" and readers == [n] and ins[0] != ins[1]:
            # The KV cache grows in place: the output is the input's own buffer.
            cu = plan.cu_of(n)
            plan.new_tensor(n, lay, "output", buffer=first.buffer, producer=n)
            plan.lops.append(LOp(n, "append_inplace", list(ins), n, {}, cu, n))
            first.kind = "aliased"
            return
        self._concat(plan, n, "append", ins, lay, attrs)

    def _topk(self, plan, n, kind, ins, lay, attrs):
        (x,) = ins
        cu = plan.cu_of(n)
        lx = plan.layout(x)
        lanes = plan.lanes
        mu = plan.nearest_mus(cu)[0]
        lrow = np.full(lx.cw * lanes, INT_MAX, dtype=np.int64)
        lrow[lx.cols:] = -(1 << 31)
        ins = [x, plan.const(f"topk/L{lx.cols}", lrow.reshape(1, -1), mu),
               plan.const("topk/MAX", np.full((1, lanes), INT_MAX, np.int64), mu)]
        plan.add_op(n, "topk", ins, lay, n, cu, k=int(attrs["k"]))

    def _take(self, plan, n, kind, ins, lay, attrs):
        plan.add_op(n, "take", ins, lay, n, plan.cu_of(n))

    def _dispatch(self, plan, n, kind, ins, lay, attrs):
        plan.add_op(n, "dispatch", ins, lay, n, plan.cu_of(n), expert=int(attrs["expert"]))

    def _combine(self, plan, n, kind, ins, lay, attrs):
        plan.add_op(n, "combine", ins, lay, n, plan.cu_of(n), shift=int(attrs["shift"]))

    def _intop(self, plan, n, kind, ins, lay, attrs):
        """The integer non-linear ops (rdakit.compiler.intops): one op each, with the graph's
        attributes and the input's dtype (which clips can be left out)."""
        cu = plan.cu_of(n)
        ins = list(ins)
        if kind == "softmax" and attrs.get("causal") is not None:
            # Column positions, INT_MAX on padding lanes: a row's causal mask is built from it.
            lx = plan.layout(ins[0])
            pos = np.full(lx.cw * plan.lanes, INT_MAX, dtype=np.int64)
            pos[:lx.cols] = np.arange(lx.cols)
            ins.append(plan.const(f"softmax/pos{lx.cols}", pos.reshape(1, -1),
                                  plan.nearest_mus(cu)[0]))
        plan.add_op(n, kind, ins, lay, n, cu, dtype=plan.g.type_of(ins[0]).dtype,
                    **{k: v for k, v in attrs.items() if v is not None})

    _exp = _softmax = _gelu = _silu = _layer_norm = _rms_norm = _embedding = _intop
    _sigmoid = _tanh = _intop


def _sole_producer(plan, op, kinds, by_name, outputs, readers):
    """The op of one of ``kinds`` producing ``op``'s first input on ``op``'s CU, when ``op``
    alone reads that tensor and it is no graph output (so ``op`` may fold into it), else
    None."""
    prev = by_name.get(plan.tensors[op.ins[0]].producer)
    if (prev is None or prev.kind not in kinds or prev.cu != op.cu or prev.out in outputs
            or len(readers[prev.out]) != 1):
        return None
    return prev


def _absorb(plan, prev, op):
    """``prev`` takes ``op`` in: its nodes, and its output in place of ``prev``'s own, which
    only ``op`` read (the caller drops ``op`` from the plan)."""
    prev.nodes.extend(op.nodes)
    del plan.tensors[prev.out]
    prev.out = op.out
    plan.tensors[op.out].producer = prev.name


@dataclasses.dataclass(frozen=True)
class FuseElementwise(LoweringPass):
    """Fold chains of elementwise ops on one CU into one op of several stream passes
    (``attrs["stages"]``, see :func:`~rdakit.compiler.lower.chains.append_stage`)."""

    name: ClassVar[str] = "fuse-elementwise"

    def apply(self, plan):
        # One walk in the plan's (topological) order, in linear time. Whether an op folds
        # into the op producing what it reads does not depend on the folds before it (it
        # reads one tensor, whose readers and producer's CU no fold changes), so one walk
        # reaches the fixpoint of folding one pair at a time. The producer of a folded op's
        # result becomes the op its chain started with, where the next op of the chain folds.
        outputs = {src for _, src in plan.outputs}
        readers = plan.readers()
        by_name = {op.name: op for op in plan.lops}
        folded = set()
        for op in plan.lops:
            if op.kind != "ew" or op.attrs["mode"] is not None:
                continue
            prev = _sole_producer(plan, op, ("ew",), by_name, outputs, readers)
            if prev is None:
                continue
            prev.attrs["raw"].extend(op.attrs["raw"])
            _absorb(plan, prev, op)
            folded.add(op.name)
        plan.lops[:] = [op for op in plan.lops if op.name not in folded]
        for op in plan.lops:
            if op.kind == "ew":
                stages = []
                for s in op.attrs["raw"]:
                    stages = append_stage(stages, s)
                op.attrs["stages"] = stages


@dataclasses.dataclass(frozen=True)
class FuseEpilogue(LoweringPass):
    """Fold an elementwise chain of one output stage (``post(v >> shift)``: a requantization
    ``clip(relu(v >> s), -128, 127)``, a shift, a ReLU) into the ``matmul_nt`` or
    ``matmul_axpy`` producing what it reads, on its CU, when nothing else reads the product
    and its streams sum in the local buffer: a row of A fits the CU's free local buffer (one
    PACK_SUM stream a row of the product), or for ``matmul_axpy`` A's row and a row of the
    product (one OUTER_SUM stream). The stream applies ``SHIFT`` and ``POST`` to each sum
    (``attrs["epilogue"]``), and the chain's passes over the product go."""

    name: ClassVar[str] = "fuse-epilogue"

    def apply(self, plan):
        from rdakit.compiler.lower.lowerer import Lowerer

        outputs = {src for _, src in plan.outputs}
        readers = plan.readers()
        by_name = {op.name: op for op in plan.lops}
        free, folded = None, set()
        for op in plan.lops:
            if op.kind != "ew" or op.attrs["mode"] is not None or len(op.attrs["stages"]) != 1:
                continue
            (s,) = op.attrs["stages"]
            if s.fn is not AluFn.PASS or s.tensor:
                continue
            prev = _sole_producer(plan, op, ("matmul_nt", "matmul_axpy"), by_name, outputs,
                                  readers)
            if prev is None or "epilogue" in prev.attrs:
                continue
            if free is None:
                free = Lowerer(plan, plan.params).local_free()
            la = plan.tensors[prev.ins[0]].layout
            need = (la.cw if prev.kind == "matmul_nt"
                    else la.words + plan.tensors[prev.out].layout.cw)
            if need > free.get(op.cu, 0):
                continue                # the long forms: K in chunks, or A's row by READ
            prev.attrs["epilogue"] = s
            _absorb(plan, prev, op)
            folded.add(op.name)
        plan.lops[:] = [op for op in plan.lops if op.name not in folded]


@dataclasses.dataclass(frozen=True)
class PlaceOutputs(LoweringPass):
    """Graph outputs become host buffers written by their producer (copies where a tensor
    is already in a host buffer or feeds several outputs)."""

    name: ClassVar[str] = "place-outputs"

    def apply(self, plan):
        taken = set()
        by_name = {op.name: op for op in plan.lops}
        for name, src in plan.outputs:
            t = plan.tensors[src]
            if t.kind == "runtime" and src not in taken:
                t.kind, t.buffer = "output", name
                taken.add(src)
                plan.output_map[name] = name
                continue
            if t.kind == "output" and t.buffer not in plan.output_map.values() \
                    and src not in taken:
                taken.add(src)                       # a buffer grown in place
                plan.output_map[name] = t.buffer
                continue
            prod = by_name.get(t.producer)
            if prod is not None:
                cu = prod.cu
            else:
                part = plan.part_of.get(name)
                cu = tuple(plan.placement.cu_of.get(part, plan.first_cu))
            lay = t.layout
            cname = f"{name}/copy"
            plan.new_tensor(cname, lay, "output", buffer=name, producer=cname)
            plan.lops.append(LOp(cname, "copy", [src], cname, {}, cu, name))
            plan.output_map[name] = name


@dataclasses.dataclass(frozen=True)
class EliminateDead(LoweringPass):
    """Drop ops whose result nobody reads, then unread constants and inputs."""

    name: ClassVar[str] = "eliminate-dead"

    def apply(self, plan):
        # A work list: an op is dead when nobody reads its result (and that result is not a
        # kept output); dropping it takes it off the readers of what it read, which may leave
        # their producers dead in turn. Linear in the plan's size.
        kept = set(plan.output_map.values())
        readers = {t: len(ops) for t, ops in plan.readers().items()}
        producer = {op.out: op for op in plan.lops}

        def dead(op):
            t = plan.tensors[op.out]
            return not readers.get(op.out) and (
                t.kind == "runtime" or (t.kind == "output" and t.buffer not in kept))

        work = [op for op in plan.lops if dead(op)]
        dropped = set()
        while work:
            op = work.pop()
            if op.name in dropped:
                continue
            dropped.add(op.name)
            del plan.tensors[op.out]
            for i in dict.fromkeys(op.ins):
                readers[i] -= 1
                p = producer.get(i)
                if p is not None and p.name not in dropped and dead(p):
                    work.append(p)
        plan.lops[:] = [op for op in plan.lops if op.name not in dropped]
        readers = plan.readers()
        for name in [n for n, t in plan.tensors.items()
                     if t.kind in ("const", "input", "aliased") and not readers[n]]:
            del plan.tensors[name]


@dataclasses.dataclass(frozen=True)
class FuseDispatch(LoweringPass):
    """A dispatch whose rows are read only by a matmul on its CU (their left operand) folds
    into that matmul, ``matmul_routed``, when a row of the tokens fits the CU's local buffer
    beside its constants: the routed rows go straight from the tokens' buffer to the local
    buffer, not through an MU buffer of their own."""

    name: ClassVar[str] = "fuse-dispatch"

    def apply(self, plan):
        from rdakit.compiler.lower.lowerer import Lowerer

        readers = plan.readers()
        by_name = {op.name: op for op in plan.lops}
        free, fused = None, set()
        for op in plan.lops:
            if op.kind != "matmul_nt" or "b_off" in op.attrs or "b_stride" in op.attrs:
                continue
            a = op.ins[0]
            d = by_name.get(plan.tensors[a].producer)
            if (d is None or d.kind != "dispatch" or d.cu != op.cu or len(readers[a]) != 1
                    or plan.tensors[a].kind != "runtime" or op.ins.count(a) != 1):
                continue
            x, idx = d.ins
            if free is None:
                free = Lowerer(plan, plan.params).local_free()
            if plan.tensors[x].layout.cw > free.get(op.cu, plan.params.cu.local_words):
                continue
            op.kind, op.ins = "matmul_routed", [x, op.ins[1], idx]
            op.attrs["expert"] = d.attrs["expert"]
            op.nodes = [*d.nodes, *op.nodes]
            del plan.tensors[a]
            fused.add(d.name)
        plan.lops[:] = [op for op in plan.lops if op.name not in fused]


@dataclasses.dataclass(frozen=True)
class ScheduleOrder(LoweringPass):
    """Order the ops by the start cycles of the partitioner's list schedule (``plan.start``;
    ties, and ops of no scheduled node, keep their graph order).

    Every CU runs its ops in the plan's one order. In graph order a CU may finish all of its
    own work before it computes what another CU waits for (an MoE CU ran its experts before it
    dispatched the other CU's inputs); the list schedule the partitioner estimated puts what
    others wait for first, and following it makes the estimate the program's. The order is a
    topological sort that keeps every dependency: an op after the ops producing what it reads,
    and ops touching the same buffer (appends in place and the reads around them) in their
    graph order. One topological order for every CU cannot deadlock."""

    name: ClassVar[str] = "schedule-order"

    def apply(self, plan):
        start = plan.start
        if not start:
            return
        ops = plan.lops
        index = {op.name: i for i, op in enumerate(ops)}
        succ = [set() for _ in ops]
        preds = [0] * len(ops)
        last_touch = {}
        for i, op in enumerate(ops):
            for t in dict.fromkeys([*op.ins, op.out]):
                tensor = plan.tensors.get(t)
                if tensor is None:
                    continue
                deps = []
                if tensor.producer is not None and tensor.producer in index:
                    deps.append(index[tensor.producer])
                if tensor.buffer is not None:
                    deps.append(last_touch.get(tensor.buffer))
                    last_touch[tensor.buffer] = i
                for j in deps:
                    if j is not None and j != i and i not in succ[j]:
                        succ[j].add(i)
                        preds[i] += 1
        key, last = [], 0.0
        for op in ops:
            times = [start[n] for n in op.nodes if n in start]
            last = min(times) if times else last
            key.append(last)
        ready = [(key[i], i) for i in range(len(ops)) if not preds[i]]
        heapq.heapify(ready)
        order = []
        while ready:
            _, i = heapq.heappop(ready)
            order.append(i)
            for k in succ[i]:
                preds[k] -= 1
                if not preds[k]:
                    heapq.heappush(ready, (key[k], k))
        plan.lops[:] = [ops[i] for i in order]


@dataclasses.dataclass(frozen=True)
class CheckOrder(LoweringPass):
    """Check that the ops are in a topological order (``schedule-order`` keeps one)."""

    name: ClassVar[str] = "check-order"

    def apply(self, plan):
        pos = {op.name: i for i, op in enumerate(plan.lops)}
        for op in plan.lops:
            for i in op.ins:
                p = plan.tensors[i].producer
                if p is not None and pos[p] >= pos[op.name]:
                    raise AssertionError(f"op {op.name} reads {i} before it is produced")


#: The passes :func:`~rdakit.compiler.lower.lower` runs, in order.
PIPELINE = (Legalize(), FuseElementwise(), FuseEpilogue(), PlaceOutputs(), EliminateDead(),
            FuseDispatch(), ScheduleOrder(), CheckOrder())
