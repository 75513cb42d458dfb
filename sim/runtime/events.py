"""What a compiled job's CU programs do, counted by event on the functional interpreter, and the
event cost model built from it (``docs/compiler.md``, the cost model).

A CU's time is spent on a few kinds of event, each with its own cost on the RTL: stream steps
(one a cycle once a stream runs), stream starts (configuration and the first round trip, which
the engine overlaps only in part), blocking MU instructions (a round trip each) and the other
instructions (a cycle each). :func:`op_events` counts them per lowered op by running the job on
the interpreter with the job's inputs, so run-time sizes (a token routing) count as they are;
:func:`event_cost_model` lowers a workload onto a one-CU fabric to count every node's events
before partitioning, and returns the :class:`~rdakit.compiler.cost.EventCostModel` the
partitioners use.
"""

import collections

from rdakit.compiler.compile import compile_workload, load_workload
from rdakit.compiler.cost import EVENTS, CostModel, EventCostModel
from rdakit.compiler.graph import MEMORY_KINDS
from rdakit.compiler.lower import LoweringError
from rdakit.compiler.partition import PartitionError
from rdakit.compiler.placement import PlacementError
from rdakit.hdl.compute.sequencer import MU_INSTRUCTIONS, POSTED
from rdakit.hdl.spec.isa import Op
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.models.interp import Interpreter, InterpreterError, StepLimitError
from rdakit.sim.runtime.job import prepare_interp

__all__ = ["EventCounter", "op_events", "cu_events", "node_events", "event_cost_model",
           "cost_model", "BLOCKING", "MAX_EVENT_NODES", "MAX_EVENT_STEPS"]

#: Instructions that wait for an MU response, or whose result is waited for soon after (ALLOC,
#: READ, LEN): every MU instruction but the posted ones (RET, RETI, DECREF, VWRITE), which
#: count as instructions.
BLOCKING = frozenset(MU_INSTRUCTIONS) - frozenset(POSTED)


class EventCounter(Interpreter):
    """The interpreter, counting the events of every ``(CU, pc)``: ``steps`` (stream steps of
    the SRUN there), ``streams``, ``mu`` (blocking MU instructions) and ``instructions`` (the
    rest)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.events = collections.defaultdict(collections.Counter)

    def _step(self, cu):
        pc, before = cu.pc, cu.stream_steps
        starting = cu.stream is None
        if starting and pc < len(cu.program) and cu.program[pc] is not None:
            op = cu.program[pc].op
            kind = ("streams" if op is Op.SRUN else "mu" if op in BLOCKING
                    else "instructions")
            self.events[(cu.xy, pc)][kind] += 1
        super()._step(cu)
        if cu.stream_steps != before:
            self.events[(cu.xy, pc)]["steps"] += cu.stream_steps - before


def _run(job, max_steps=50_000_000, progress=None):
    """The events of ``job`` run on the interpreter, in at most ``max_steps`` steps
    (:class:`~rdakit.sim.models.interp.StepLimitError` beyond), calling ``progress("counting
    events", done, max_steps)`` every 1/20 of them."""
    interp, _ = prepare_interp(job, interpreter=EventCounter)
    chunk = max(1, max_steps // 20)
    while True:
        try:
            interp.run(max_steps=min(chunk, max_steps - interp.steps))
            return interp.events
        except StepLimitError:
            if interp.steps >= max_steps:
                raise
            if progress is not None:
                progress("counting events", interp.steps, max_steps)


def op_events(job, *, max_steps=50_000_000, progress=None):
    """Events of every lowered op of ``job`` (name -> Counter of :data:`EVENTS`), summed over
    the CUs it runs on (the run stops after ``max_steps`` interpreter steps, see
    :func:`_run`)."""
    events = _run(job, max_steps, progress)
    out = collections.defaultdict(collections.Counter)
    for cu, info in job.programs.items():
        for name, _, _, a, b in info.ops:
            for pc in range(a, b):
                out[name].update(events.get((cu, pc), {}))
    return dict(out)


def cu_events(job):
    """Events of every CU of ``job`` (``(x, y)`` -> Counter of :data:`EVENTS`), its prologue,
    messages and epilogue included."""
    out = collections.defaultdict(collections.Counter)
    for (cu, _), c in _run(job).items():
        out[cu].update(c)
    return dict(out)


def node_events(job, **run):
    """Events per graph node: a lowered op's events go to the compute nodes it implements, in
    proportion to their work (a fused chain is one lowered op). ``run``: ``max_steps`` and
    ``progress`` of :func:`op_events`."""
    graph = job.graph
    per_op = op_events(job, **run)
    out = collections.defaultdict(collections.Counter)
    for name, _, _, nodes in job.lowered:
        compute = [n for n in nodes if graph.kind(n) not in MEMORY_KINDS]
        if not compute:
            continue
        work = [max(1.0, float(graph.work(n))) for n in compute]
        total = sum(work)
        for n, w in zip(compute, work, strict=True):
            for kind, count in per_op.get(name, {}).items():
                out[n][kind] += count * w / total
    return dict(out)


def event_cost_model(workload, *, sizes=None, params, inputs=None, max_steps=50_000_000,
                     progress=None, **constants):
    """The :class:`~rdakit.compiler.cost.EventCostModel` of ``workload`` for a fabric of
    ``params``: the workload lowered onto one CU (its lanes and local buffer, program and MU
    room enough for everything) and run on the interpreter to count each node's events (in at
    most ``max_steps`` steps, ``progress`` as :func:`_run` calls it). ``constants`` override
    the model's per-event cycles."""
    cp, mp = params.cu, params.mu
    one = fabric_params(1, 2, layout="CM", lanes=cp.lanes, local_words=cp.local_words,
                        outstanding=cp.outstanding, prog_len=4096, mu_words=1 << 16,
                        block_words=mp.block_words, max_buffers=64)
    job, _ = compile_workload(workload, sizes=sizes, params=one, partitioner="round_robin",
                              place_steps=1, inputs=inputs)
    events = node_events(job, max_steps=max_steps, progress=progress)
    return EventCostModel(lanes=cp.lanes, events=tuple(
        (n, *(round(c[k], 3) for k in EVENTS)) for n, c in sorted(events.items())),
        **constants)


#: Nodes beyond which a graph keeps the work model: its one-CU program could not fit the
#: 4096 instructions a CU's program memory holds at most, and lowering it only to find out
#: would double the compile time.
MAX_EVENT_NODES = 2048

#: Interpreter steps the count may take for :func:`cost_model` (it runs about 65,000 a second:
#: 15 s at most). A graph whose work alone takes more (its lane operations over the lanes: the
#: stream steps of one CU) keeps the work model without being lowered; a run that takes more
#: stops there and keeps it too. The built-in workloads at their default sizes take 11,000 to
#: 43,000.
MAX_EVENT_STEPS = 1_000_000


def cost_model(workload, *, sizes=None, params, inputs=None, progress=None):
    """The cost model a workload's cycles are estimated with: its :func:`event_cost_model`, or,
    when it cannot be lowered onto one CU (or has more than :data:`MAX_EVENT_NODES` nodes, or
    needs more than :data:`MAX_EVENT_STEPS` steps to count),
    :class:`~rdakit.compiler.cost.CostModel`'s work estimate (check
    ``isinstance(model, EventCostModel)`` to tell). ``progress("counting events", done,
    total)`` is called as the count goes."""
    workload = load_workload(workload, sizes)
    work = CostModel(lanes=params.cu.lanes)
    graph = workload.graph
    if len(graph) > MAX_EVENT_NODES or sum(
            graph.work(n) for n in graph.order()) / params.cu.lanes > MAX_EVENT_STEPS:
        return work
    try:
        return event_cost_model(workload, params=params, inputs=inputs,
                                max_steps=MAX_EVENT_STEPS, progress=progress)
    except (LoweringError, PlacementError, PartitionError, InterpreterError):
        return work
