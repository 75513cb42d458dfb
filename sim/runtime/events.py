"""What a compiled job's CU programs do, counted by event on the functional interpreter and timed
on the performance model, and the cost model built from it (``docs/compiler.md``, the timed
cost model).

A CU's time is spent on a few kinds of event, each with its own cost on the RTL: stream steps
(one a cycle once a stream runs), stream starts (configuration and the first round trip, which
the engine overlaps only in part), blocking MU instructions (a round trip each) and the other
instructions (a cycle each). :func:`op_events` counts them per lowered op by running the job on
the interpreter with the job's inputs, so run-time sizes (a token routing) count as they are;
:func:`timed_cost_model` lowers a workload onto a one-CU fabric, runs it on the performance model
(:mod:`rdakit.sim.models.perf`, the RTL's timing) and charges every node the cycles its code
took: the :class:`~rdakit.compiler.cost.TimedCostModel` the estimates use.
"""

import collections
import math

from rdakit.compiler.compile import bitstream_for, compile_workload, load_workload
from rdakit.compiler.cost import CostModel, TimedCostModel
from rdakit.compiler.graph import MEMORY_KINDS
from rdakit.compiler.lower import LoweringError
from rdakit.compiler.lower.passes import PIPELINE, FuseDispatch
from rdakit.compiler.partition import PartitionError
from rdakit.compiler.placement import PlacementError
from rdakit.hdl.compute.sequencer import MU_INSTRUCTIONS, POSTED
from rdakit.hdl.spec.isa import Op
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.models.interp import (
    DeadlockError,
    Interpreter,
    InterpreterError,
    StepLimitError,
)
from rdakit.sim.models.perf import PerfInterpreter
from rdakit.sim.runtime.job import prepare_interp

__all__ = ["EVENTS", "EventCounter", "op_events", "cu_events", "node_events", "OpTimer",
           "node_cycles", "timed_cost_model", "cost_model", "BLOCKING", "MAX_EVENT_NODES",
           "MAX_EVENT_STEPS", "ModelRank", "MAX_RANK_STEPS"]

#: The events of a CU program :class:`EventCounter` counts: stream steps, stream starts (SRUN),
#: blocking MU instructions and the other instructions.
EVENTS = ("steps", "streams", "mu", "instructions")

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
    per_op = op_events(job, **run)
    out = collections.defaultdict(collections.Counter)
    for name, n, share in _node_shares(job):
        for kind, count in per_op.get(name, {}).items():
            out[n][kind] += count * share
    return dict(out)


def _node_shares(job):
    """``(lowered op, node, share)`` for every compute node of ``job``: a lowered op's share
    of each node it implements, in proportion to their work (a fused chain is one op)."""
    graph = job.graph
    for name, _, _, nodes in job.lowered:
        compute = [n for n in nodes if graph.kind(n) not in MEMORY_KINDS]
        work = [max(1.0, float(graph.work(n))) for n in compute]
        total = sum(work)
        for n, w in zip(compute, work, strict=True):
            yield name, n, w / total


class OpTimer(PerfInterpreter):
    """The performance model, noting the cycle each instruction of each CU starts in (a stream's
    steps are its SRUN's), and stopping with :class:`~rdakit.sim.models.interp.StepLimitError`
    after ``max_steps`` steps (instructions and stream steps, as the interpreter counts them),
    calling ``progress("timing ops", done, max_steps)`` every 1/20 of them."""

    def __init__(self, *args, max_steps=50_000_000, progress=None, **kw):
        super().__init__(*args, **kw)
        self.starts = collections.defaultdict(list)
        self.stream_ends = collections.defaultdict(list)    # (index into starts, done cycle)
        self.max_steps = max_steps
        self._chunk = max(1, max_steps // 20)
        self._progress = progress

    def _step(self, cu):
        if cu.stream is None:
            self.starts[cu.xy].append((cu.pc, self.now))
        self.steps += 1
        if self.steps % self._chunk == 0:
            if self.steps >= self.max_steps:
                raise StepLimitError(self.max_steps, self.result())
            if self._progress is not None:
                self._progress("timing ops", self.steps, self.max_steps)
        super()._step(cu)

    def _schedule_stream(self, tc, t, ins, steps):
        super()._schedule_stream(tc, t, ins, steps)
        xy = tc.m.xy
        self.stream_ends[xy].append((len(self.starts[xy]) - 1, tc.streams[-1].done))

    def run_ops(self):
        """Run the job to its end; return each CU's halt cycle. Raises ``DeadlockError`` if a
        CU never halts."""
        if self.run_timed() is None:
            blocked = {xy: f"at pc {tc.m.pc}" for xy, tc in self._timed.items()
                       if tc.m.enabled and tc.halt_at is None}
            raise DeadlockError(blocked, self.result())
        return {xy: tc.halt_at for xy, tc in self._timed.items() if tc.m.enabled}


def node_cycles(job, *, max_steps=50_000_000, progress=None):
    """The cycles of ``job`` on the performance model, per graph node: ``(cycles, fixed)``.
    An op's cycles on its CU run from its first instruction's start to its last one's end (the
    next instruction's start, or the halt) or its last stream's end, whichever is later, less
    what the op before it already counted: so an op's cycles are its own code's and what it
    waits for (a round trip, another CU), and the tail of its own streams, which the next op's
    first instruction may wait for (streams between CUs aside); a lowered op's cycles go to
    the compute nodes it implements in proportion to their work. ``fixed`` are the cycles no
    op has (prologues and epilogues), on the busiest CU. Raises ``StepLimitError`` past
    ``max_steps`` steps (see :class:`OpTimer`) and ``DeadlockError`` if a CU never halts."""
    timer, _ = prepare_interp(job, interpreter=OpTimer, max_steps=max_steps, progress=progress)
    halts = timer.run_ops()
    per_op, fixed = collections.Counter(), collections.Counter()
    for xy, info in job.programs.items():
        starts = timer.starts.get(xy, [])
        halt = halts[xy]
        op_at = {pc: name for name, _, _, a, b in info.ops for pc in range(a, b)}
        # Runs of instructions of one op (or of none: prologue, epilogue), each ending when
        # its last instruction does or its last stream is done, whichever is later; a run
        # is charged from its start, or the end of the run before it if that is later (the
        # wait of an op's first instruction for the stream of the op before it is that op's).
        done = collections.defaultdict(int)
        for i, end in timer.stream_ends.get(xy, []):
            done[i] = max(done[i], end + 1)
        runs = []
        for i, (pc, t) in enumerate(starts):
            name = op_at.get(pc)
            t_next = starts[i + 1][1] if i + 1 < len(starts) else halt
            if runs and runs[-1][0] == name:
                runs[-1][2] = max(runs[-1][2], t_next, done[i])
            else:
                runs.append([name, t, max(t_next, done[i])])
        before = 0
        for name, t, end in runs:
            cycles = max(0, end - max(t, before))
            before = max(before, end)
            if name is None:
                fixed[xy] += cycles
            else:
                per_op[name] += cycles
    cycles = collections.Counter()
    for name, n, share in _node_shares(job):
        cycles[n] += per_op.get(name, 0) * share
    return dict(cycles), max(fixed.values(), default=0)


#: The lowering passes :func:`timed_cost_model` times the nodes with: all but
#: ``fuse-dispatch``. On one CU every dispatch folds into its expert's matmul, and the fused
#: op's cycles go almost all to the matmul (by work); a partition that puts the two on
#: different CUs pays for the dispatch in full, so each is timed on its own (what the fold
#: saves where it applies is left out of the estimate).
TIMED_PASSES = tuple(p for p in PIPELINE if not isinstance(p, FuseDispatch))


def timed_cost_model(workload, *, sizes=None, params, inputs=None, max_steps=50_000_000,
                     progress=None, **constants):
    """The :class:`~rdakit.compiler.cost.TimedCostModel` of ``workload`` for a fabric of
    ``params``: the workload lowered onto one CU (its lanes and local buffer, program and MU
    room enough for everything) and run on the performance model to time each node's code (in
    at most ``max_steps`` steps, ``progress`` as :class:`OpTimer` calls it). ``constants``
    override the model's fitted constants (``overlap``, ``edge_cycles``, ``hop_cycles``)."""
    cp, mp = params.cu, params.mu
    one = fabric_params(1, 2, layout="CM", lanes=cp.lanes, local_words=cp.local_words,
                        outstanding=cp.outstanding, prog_len=4096, mu_words=1 << 16,
                        block_words=mp.block_words, max_buffers=64)
    job, _ = compile_workload(workload, sizes=sizes, params=one, partitioner="round_robin",
                              place_steps=1, inputs=inputs, passes=TIMED_PASSES)
    cycles, fixed = node_cycles(job, max_steps=max_steps, progress=progress)
    return TimedCostModel(lanes=cp.lanes, cycles=tuple(
        (n, round(c, 3)) for n, c in sorted(cycles.items())), fixed_cycles=fixed, **constants)


#: Nodes beyond which a graph keeps the work model: its one-CU program could not fit the
#: 4096 instructions a CU's program memory holds at most, and lowering it only to find out
#: would double the compile time.
MAX_EVENT_NODES = 2048

#: Steps the one-CU run may take for :func:`cost_model` (instructions and stream steps; the
#: performance model runs about 50,000 a second: 20 s at most). A graph whose work alone takes
#: more (its lane operations over the lanes: the stream steps of one CU) keeps the work model
#: without being lowered; a run that takes more stops there and keeps it too. The built-in
#: workloads at their default sizes take 11,000 to 43,000.
MAX_EVENT_STEPS = 1_000_000


def cost_model(workload, *, sizes=None, params, inputs=None, progress=None):
    """The cost model a workload's cycles are estimated with: its :func:`timed_cost_model`, or,
    when it cannot be lowered onto one CU (or has more than :data:`MAX_EVENT_NODES` nodes, or
    needs more than :data:`MAX_EVENT_STEPS` steps to time),
    :class:`~rdakit.compiler.cost.CostModel`'s work estimate (check
    ``isinstance(model, TimedCostModel)`` to tell). ``progress("timing ops", done, total)`` is
    called as the run goes."""
    workload = load_workload(workload, sizes)
    work = CostModel(lanes=params.cu.lanes)
    graph = workload.graph
    if len(graph) > MAX_EVENT_NODES or sum(
            graph.work(n) for n in graph.order()) / params.cu.lanes > MAX_EVENT_STEPS:
        return work
    try:
        return timed_cost_model(workload, params=params, inputs=inputs,
                                max_steps=MAX_EVENT_STEPS, progress=progress)
    except (LoweringError, PlacementError, PartitionError, InterpreterError):
        return work


#: Steps one candidate's run may take for :class:`ModelRank` (instructions and stream steps,
#: about 50,000 a second on the performance model: 10 s a candidate at most).
MAX_RANK_STEPS = 500_000


class ModelRank:
    """The ``rank`` of :func:`~rdakit.compiler.compile.compile_workload`: a candidate job's
    cycles on the performance model (its CUs from the start to the last halt, inputs in
    place), or ``None`` when the run takes more than ``max_steps`` steps (then the estimates
    rank the candidates). A candidate whose CUs do not all halt ranks last; one with the
    bitstream and host buffers of an earlier one (strategies often agree) is not run again.
    The estimate is a list schedule of per-node costs and can be tens of % off where the model
    is within a few % of the RTL (``docs/compiler.md``, row splitting)."""

    name = "the performance model"

    #: ``compile_workload`` passes the fewest cycles so far as ``bound``: a candidate still
    #: running past it is stopped there (``math.inf``), a run cut short instead of finished.
    bounded = True

    def __init__(self, max_steps=MAX_RANK_STEPS):
        self.max_steps = max_steps
        self.runs = {}             # the same bitstream and buffers -> the same run, run once
        self.cut = {}              # ... -> the bound a run of it was stopped at

    def __call__(self, job, bound=None):
        key = (bitstream_for(job), tuple(
            (b.name, b.mu, b.weight, None if b.data is None else b.data.tobytes())
            for b in job.buffers))
        if key not in self.runs:
            if bound is not None and self.cut.get(key, -1) >= bound:
                return math.inf                   # already known to take longer
            cycles = self._run(job, bound)
            if cycles == math.inf and bound is not None:
                self.cut[key] = bound
                return cycles
            self.runs[key] = cycles
        return self.runs[key]

    def _run(self, job, bound=None):
        timer, _ = prepare_interp(job, interpreter=OpTimer, max_steps=self.max_steps)
        try:
            cycles = timer.run_timed(until=bound)
        except StepLimitError:
            return None
        return math.inf if cycles is None else cycles
