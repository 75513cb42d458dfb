"""End to end: compile a workload, run it on a simulated fabric, check it, adapt and report.

This is the engine of ``rdakit run`` and ``rdakit bench e2e``. A :class:`RunSpec` (JSON-able,
so it crosses into a cocotb process) names the workload, its sizes, the fabric, the
partitioner and the number of iterations. :func:`run_session` does the work on any host
backend (a :class:`~rdakit.sim.runtime.host.HostDriver` over Amaranth's simulator or cocotb):

1. compile the workload (:func:`~rdakit.compiler.compile.compile_workload`) with the current
   cost model;
2. run it on the functional interpreter (the golden model of the whole fabric);
3. allocate and fill the inputs through the host port, load the bitstream, start, wait for done,
   read the outputs and every tile's counters, release the host's references;
4. compare the outputs bit-exactly with numpy and with the interpreter, check that every MU is
   empty again (nothing leaked), and record cycles, utilization, NoC flits and MU occupancy;
5. with more than one iteration, fold the measured per-CU costs into the cost model
   (:func:`~rdakit.compiler.adapt.measured_cost`) and go back to 1 on the same fabric.

Failures (a mismatch, a CU error halt, a leak) are recorded in the iteration's row, not raised,
so that a report is always written; :func:`failed` tells whether any happened.
:func:`run` picks the backend: ``amaranth`` (built in), ``icarus``, ``verilator`` or ``model``
(the fast performance model, ``docs/performance-model.md``).
"""

import asyncio
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import threading
import time

import numpy as np

from rdakit.compiler.adapt import measured_cost
from rdakit.compiler.compile import compile_workload, load_workload
from rdakit.compiler.cost import CostModel, lower_bound
from rdakit.compiler.partition import as_weighted
from rdakit.files import atomic_path
from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.spec.config import CU_PROFILE
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.models.interp import InterpreterError
from rdakit.sim.models.perf import ModelTransport
from rdakit.sim.runtime.counters import read_mu_counters, run_delta
from rdakit.sim.runtime.events import ModelRank, cost_model
from rdakit.sim.runtime.host import AmaranthTransport, HostDriver, HostError, harness_host
from rdakit.sim.runtime.job import JobError, run_job, run_job_interp
from rdakit.sim.verify.amaranth_sim import simulate
from rdakit.sim.verify.runner import (
    HarnessProcess,
    VerilatorBuild,
    build_harness,
    cached_verilog,
    run_cocotb,
)

__all__ = ["RunSpec", "TileRow", "tile_rows", "run", "run_many", "run_session", "run_specs",
           "failed", "failure", "BACKENDS", "NEEDS_TOOLS",
           "compute_bound", "plot_utilization", "SMALLEST", "VERILATOR_BUILD", "in_process",
           "fabric_verilog", "fabric_harness", "on_harness"]

#: The simulators ``rdakit run`` can use: the RTL in Amaranth's simulator, Icarus or
#: Verilator, or the fast performance model (``docs/performance-model.md``).
BACKENDS = ("amaranth", "icarus", "verilator", "model")

#: The backends that need a simulator installed (checked before a run).
NEEDS_TOOLS = ("icarus", "verilator")


#: How Verilator builds a fabric for these runs unless told otherwise: the host's session
#: reaches only the top module's ports, so nothing else is public, which Verilator builds
#: several times and simulates 15 times faster than ``--public-flat-rw`` (2x2; measured in
#: ``docs/performance-model.md``, "Verilator at scale").
#: Runs drive the build directly (a harness executable in the run's own process, bursts and
#: waits inside it; ``docs/performance-model.md``, "Verilator at scale"), not through cocotb,
#: unless they record waveforms.
VERILATOR_BUILD = VerilatorBuild(public="ports", driver="direct")


#: The smallest sizes of the built-in workloads: what the tests run on every simulator and the
#: README's main job on the built-in one.
SMALLEST = {
    "mlp": {"batch": 2, "sizes": (8, 8, 4)},
    "decoder": {"d_model": 8, "heads": 2, "d_ff": 8, "cache_len": 2},
    "moe": {"tokens": 4, "d_model": 8, "d_ff": 8, "experts": 4, "k": 2},
    "switch": {"tokens": 4, "d_model": 4, "d_ff": 4, "experts": 2},
    "mixtral": {"tokens": 4, "d_model": 8, "d_ff": 8},
}


#: A run may take ``BUDGET_FACTOR`` times its estimated cycles, and at least ``BUDGET_MIN``
#: cycles, before it counts as hung: the event model's estimates are within 15 % of the RTL on 9
#: of 10 runs (``docs/e2e.md``), so only a run that will never finish gets there, in seconds
#: of simulation rather than hours.
BUDGET_FACTOR = 20
BUDGET_MIN = 50_000


def cycle_budget(estimate):
    """Cycles a run estimated at ``estimate`` cycles may take (:data:`BUDGET_FACTOR`,
    :data:`BUDGET_MIN`)."""
    return max(BUDGET_MIN, BUDGET_FACTOR * int(estimate))


@dataclasses.dataclass
class RunSpec:
    """What to run.

    Members
    -------
    workload : str
        A built-in workload name or the path of a Python graph file.
    sizes : dict
        Size options of the workload builder.
    fabric : dict
        Keyword arguments of :func:`rdakit.cli.options.fabric_params`.
    partitioner : str
        A name of :data:`rdakit.compiler.partition.STRATEGIES`.
    seed : int
        Seed of the placement.
    iterations : int
        Runs; after each but the last, the cost model takes the measured costs and the
        workload is re-partitioned.
    place_steps : int
        Annealing steps of the placement.
    max_cycles : int or None
        Cycles after which a run that is not done counts as hung; ``None`` (the default) is
        :func:`cycle_budget` of the iteration's estimate.
    split : int, "auto" or None
        Row blocks of the graph's row-wise chains (``compile_workload``'s ``split``; ``None``:
        its default).
    streams : bool
        Edges between CUs that qualify lowered as streams between CUs (``compile_workload``'s
        ``streams``).
    order : str
        The order of each CU's ops (``compile_workload``'s ``order``: ``"graph"``,
        ``"schedule"`` or ``"auto"``, both ranked).
    """

    workload: str
    sizes: dict = dataclasses.field(default_factory=dict)
    fabric: dict = dataclasses.field(default_factory=dict)
    partitioner: str = "multilevel"
    seed: int = 0
    iterations: int = 1
    place_steps: int = 20000
    max_cycles: int | None = None
    split: int | str | None = None
    streams: bool = True
    order: str = "graph"

    def __post_init__(self):
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise ValueError(f"iterations must be a positive integer, not {self.iterations!r}")
        if self.max_cycles is not None and (not isinstance(self.max_cycles, int)
                                            or isinstance(self.max_cycles, bool)
                                            or self.max_cycles < 1):
            raise ValueError(f"max_cycles must be a positive integer or None, not "
                             f"{self.max_cycles!r}")

    def budget(self, estimate):
        """The cycles a run estimated at ``estimate`` cycles may take before it counts as
        hung, and why: ``(cycles, reason)``."""
        if self.max_cycles is not None:
            return self.max_cycles, "max_cycles"
        return cycle_budget(estimate), (f"{BUDGET_FACTOR} x the estimate of {estimate} cycles, "
                                        f"at least {BUDGET_MIN}")

    @property
    def params(self):
        return fabric_params(**self.fabric)

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        d["sizes"] = {k: tuple(v) if isinstance(v, list) else v
                      for k, v in d.get("sizes", {}).items()}
        return cls(**d)

    def compile(self, cost=None, schedule_cost=None, progress=None):
        """``(CompiledJob, CompileSummary)`` of this spec (raises the compiler's errors):
        partitioned with ``cost`` (default the work model), its cycles estimated with
        ``schedule_cost`` (default the workload's event model,
        :func:`~rdakit.sim.runtime.events.cost_model`), several candidates (``fastest``,
        ``split="auto"``) ranked by their runs on the performance model
        (:class:`~rdakit.sim.runtime.events.ModelRank`); ``progress(stage, done, total)`` hears
        of the compiler's stages and the event model's count."""
        params = self.params
        workload = load_workload(self.workload, self.sizes)
        if schedule_cost is None:
            schedule_cost = cost_model(workload, params=params, progress=progress)
        return compile_workload(workload, params=params, partitioner=self.partitioner,
                                seed=self.seed, place_steps=self.place_steps, cost=cost,
                                schedule_cost=schedule_cost, progress=progress,
                                split=self.split, streams=self.streams, order=self.order,
                                rank=ModelRank())


#: The MU counters an iteration's row reports (``allocs``, ``frees``, ``leaked_buffers``,
#: ``mu_peak_words``), read before the host fills the inputs and after it released them.
_MU_ROW_COUNTERS = ("live_buffers", "allocs", "frees", "peak_held_words")


def compute_bound(job):
    """A lower bound on the run's cycles: the critical path and the total work over the CUs,
    with every op costing ``ceil(work / lanes)`` cycles (one vector operation a cycle, no
    start-up, free communication)."""
    params = job.params
    wg = as_weighted(job.graph, CostModel(lanes=params.cu.lanes, op_overhead=0))
    return lower_bound(wg, len(params.tiles("C")))


#: The categories of a CU's profile, in the order the hardware gives them priority: the names
#: of :data:`~rdakit.hdl.spec.config.CU_PROFILE` without ``_cycles``, and ``other``.
PROFILE_CATEGORIES = (*(n.removesuffix("_cycles") for n in CU_PROFILE), "other")


def profile_rows(params, counters):
    """Where each CU's cycles went (docs/e2e.md, Profile): a row per CU that ran, ``{"tile":
    "(x, y)", "busy": cycles, <category>: cycles ...}`` with :data:`PROFILE_CATEGORIES` summing
    to ``busy``, then a ``"total"`` row over them."""
    rows = []
    for xy in params.tiles("C"):
        c = counters.get(xy, {})
        if not c.get("busy_cycles"):
            continue
        row = {"tile": "({}, {})".format(*xy), "busy": c["busy_cycles"]}
        row.update({n.removesuffix("_cycles"): c[n] for n in CU_PROFILE})
        row["other"] = row["busy"] - sum(c[n] for n in CU_PROFILE)
        rows.append(row)
    if rows:
        rows.append({"tile": "total", **{k: sum(r[k] for r in rows)
                                         for k in ("busy", *PROFILE_CATEGORIES)}})
    return rows


def roofline(params, job, tiles, cycles, lower):
    """The run's honest bounds from what it did (docs/e2e.md): ``lanes_bound``, its
    multiply-accumulates over every lane of every CU of the fabric; ``mu_bound``, the requests
    the busiest MU received, at one a cycle; ``injection_bound``, the flits the busiest CU
    sent, at one a cycle; and ``cycles_over_bound``, the cycles over the largest of them and
    ``lower`` (the run's ``lower_bound``)."""
    lanes = params.cu.lanes * len(params.tiles("C"))
    out = {"lanes_bound": job.macs / lanes,
           "mu_bound": max((t.flits_in for t in tiles if t.kind == "MU"), default=0),
           "injection_bound": max((t.flits_out for t in tiles if t.kind == "CU"), default=0)}
    bound = max(lower, *out.values())
    out["cycles_over_bound"] = cycles / bound if bound else None
    return out


def _compare(outputs, want, what):
    for name, w in want.items():
        got = outputs.get(name)
        if got is None:
            return f"output {name!r} missing"
        if got.shape != w.shape:
            return f"output {name!r} has shape {got.shape}, {what}'s {w.shape}"
        if not np.array_equal(got, w):
            bad = np.argwhere(got != w)
            i = tuple(int(v) for v in bad[0])
            return (f"output {name!r} differs from {what} in {len(bad)} elements, first at {i}: "
                    f"{got[i]} instead of {w[i]}")
    return "ok"


@dataclasses.dataclass(frozen=True)
class TileRow:
    """One tile's figures in an iteration's report (``tiles`` in ``docs/e2e.md``).

    Members
    -------
    tile : tuple of int
        ``(x, y)``; written ``"(x, y)"`` in the JSON (:meth:`as_json`, :meth:`from_json`).
    kind : str
        ``"CU"`` or ``"MU"``.
    busy, stall : int
        The tile's busy and stalled cycles in the run.
    wait : int or None
        A CU's cycles waiting in WAIT or RECV (``None`` for an MU).
    utilization, active : float
        ``busy / cycles`` and ``(busy - stall) / cycles``.
    flits_out, flits_in : int
        Flits the tile sent and received.
    peak_words, allocs, frees, live_after : int or None
        An MU's peak words held, buffers allocated and freed in the iteration (host's
        included) and live buffers after it (``None`` for a CU).
    """

    tile: tuple
    kind: str
    busy: int
    stall: int
    wait: int | None
    utilization: float
    active: float
    flits_out: int
    flits_in: int
    peak_words: int | None = None
    allocs: int | None = None
    frees: int | None = None
    live_after: int | None = None

    def as_json(self):
        """The row as the report's JSON writes it (keys in the order of the table)."""
        d = dataclasses.asdict(self)
        d["tile"] = "({}, {})".format(*self.tile)
        return d

    @classmethod
    def from_json(cls, d):
        """The inverse of :meth:`as_json` (rows that crossed a cocotb process as JSON)."""
        x, y = (int(v) for v in d["tile"].strip("()").split(","))
        return cls(**{**d, "tile": (x, y)})


def tile_rows(params, counters, cycles, mu_after):
    """A :class:`TileRow` per tile of ``params`` from a run's counters (``{(x, y): {name:
    value}}``), its cycles and its MUs' allocation counters ``mu_after``."""
    rows = []
    for (x, y) in params.tiles():
        c = counters.get((x, y), {})
        busy, stall = c.get("busy_cycles", 0), c.get("stall_cycles", 0)
        m = mu_after.get((x, y), {})
        rows.append(TileRow(
            tile=(x, y), kind="CU" if params.kind(x, y) == "C" else "MU",
            busy=busy, stall=stall, wait=c.get("wait_cycles"),
            utilization=busy / cycles if cycles else 0.0,
            active=(busy - stall) / cycles if cycles else 0.0,
            flits_out=c.get("flits_out", 0), flits_in=c.get("flits_in", 0),
            peak_words=m.get("peak_held_words"), allocs=m.get("allocs"), frees=m.get("frees"),
            live_after=m.get("live_buffers")))
    return rows


async def run_iteration(host, job, summary, *, max_cycles, on_stage=None, on_poll=None,
                        budget_reason=None):
    """Run ``job`` once on ``host``; return the iteration's row (see the module docstring) and
    the tiles' counters (``None`` after a hardware error: the job was abandoned, its buffers
    freed). ``budget_reason`` says where ``max_cycles`` came from, for the timeout's
    message."""
    stage = on_stage or (lambda name: None)
    params = job.params
    row = {"partitioner": summary.partitioner, "parts": summary.parts, "cut": summary.cut,
           "estimated_cycles": summary.estimated_cycles, "lower_bound": compute_bound(job),
           "instructions": sum(summary.instructions.values())}
    stage("interpret")
    try:
        interp_outputs, interp_result, _ = run_job_interp(job)
        row["interpreter_instructions"] = int(sum(interp_result.instructions.values()))
        row["interpreter_stream_steps"] = int(sum(c.stream_steps
                                                  for c in interp_result.cus.values()))
        interp_error = None
    except InterpreterError as e:
        # The golden model refuses the job (e.g. a corrupted program): still run the RTL, whose
        # own error status is what the run reports; the comparison names the model's error.
        interp_outputs, interp_error = None, f"the interpreter failed: {e}"
        row["interpreter_instructions"] = row["interpreter_stream_steps"] = None
    before = await read_mu_counters(host, _MU_ROW_COUNTERS)
    try:
        result = await run_job(host, job, max_cycles=max_cycles, on_stage=stage,
                               on_poll=on_poll)
    except (JobError, HostError, TimeoutError) as e:
        message = " ".join([str(e), *getattr(e, "__notes__", ())])
        if isinstance(e, TimeoutError) and budget_reason:
            message = (f"not done within its budget of {max_cycles} cycles "
                       f"({budget_reason}): {message}")
        row.update(cycles=None, hw_error=message, numpy="not run", interpreter="not run",
                   leaked_buffers=None, tiles=[], profile=[])
        return row, None
    delta = run_delta(params, before, await read_mu_counters(host, _MU_ROW_COUNTERS))
    cycles = result.cycles
    tiles = tile_rows(params, result.counters, cycles, delta)
    cu_rows = [t for t in tiles if t.kind == "CU"]
    row.update(
        cycles=cycles, load_cycles=result.load_cycles, hw_error=None,
        numpy=_compare(result.outputs, job.expected, "numpy"),
        interpreter=interp_error or _compare(
            result.outputs, {n: interp_outputs[n] for n in job.outputs}, "the interpreter"),
        utilization=float(np.mean([t.utilization for t in cu_rows])) if cu_rows else 0.0,
        active=float(np.mean([t.active for t in cu_rows])) if cu_rows else 0.0,
        noc_flits=int(sum(t.flits_out for t in tiles)),
        mu_peak_words=int(max((t.peak_words for t in tiles if t.kind == "MU"), default=0)),
        allocs=int(sum(d["allocs"] for d in delta.values())),
        frees=int(sum(d["frees"] for d in delta.values())),
        leaked_buffers=int(sum(d["live_buffers"] for d in delta.values())),
        misrouted=bool(result.status.get("misrouted")),
        **roofline(params, job, tiles, cycles, row["lower_bound"]),
        profile=profile_rows(params, result.counters),
        tiles=[t.as_json() for t in tiles])
    return row, result.counters


async def run_session(host, spec, *, progress=None):
    """Compile and run ``spec`` on ``host`` for ``spec.iterations`` iterations; return the
    list of iteration rows.

    ``progress(stage, done, total)`` is called as the work goes on (``total`` is the cost
    model's estimate of the cycles while the fabric runs, else ``None``)."""
    progress = progress or (lambda stage, done=None, total=None: None)
    params = spec.params
    cost = CostModel(lanes=params.cu.lanes)
    # The event model depends on the workload and the fabric only: counted once for every
    # iteration.
    estimate_cost = cost_model(load_workload(spec.workload, spec.sizes), params=params,
                               progress=progress)
    rows = []
    for i in range(spec.iterations):
        tag = f"iteration {i + 1}/{spec.iterations}: " if spec.iterations > 1 else ""
        progress(f"{tag}compiling")
        job, summary = spec.compile(
            cost, estimate_cost,
            lambda stage, done=None, total=None, tag=tag: progress(tag + stage, done, total))
        estimate = max(1, summary.estimated_cycles)
        budget, reason = spec.budget(estimate)
        row, counters = await run_iteration(
            host, job, summary, max_cycles=budget, budget_reason=reason,
            on_stage=lambda name, tag=tag: progress(f"{tag}{_STAGES[name]}"),
            on_poll=lambda cycles, tag=tag, estimate=estimate:
                progress(f"{tag}running", cycles, estimate))
        row = {"iteration": i + 1, **row}
        rows.append(row)
        if failed([row]):
            break
        if i + 1 < spec.iterations:
            cost, row["adaptation"] = measured_cost(cost, job, counters)
    return rows


_STAGES = {"interpret": "interpreter (golden model)", "fill": "filling inputs",
           "load": "loading the bitstream", "run": "running", "read": "reading outputs"}


def failure(row):
    """Why the run of ``row`` failed: its hardware error, the first output check (``numpy``,
    then ``interpreter`` if the row has one) that is not ``"ok"``, or its leaked buffers;
    ``None`` if it passed. Rows of single fabrics and of systems alike."""
    if row.get("hw_error"):
        return row["hw_error"]
    for check in ("numpy", "interpreter"):
        if row.get(check, "ok") != "ok":
            return row[check]
    if row.get("leaked_buffers"):
        return f"{row['leaked_buffers']} buffers left allocated"
    return None


def failed(rows):
    """Whether any iteration had a hardware error, a mismatch or a leak."""
    return any(failure(r) for r in rows)


# --- backends ---------------------------------------------------------------------------------

def run(spec, *, sim="amaranth", waves=None, progress=None, build=None, timings=None):
    """Run ``spec`` on ``sim`` (one of :data:`BACKENDS`); return the iteration rows.

    ``waves``: a file for the waveforms (VCD from Amaranth's simulator and Icarus, FST from
    Verilator). ``build`` and ``timings``: as for :func:`run_many`."""
    return run_many([spec], sim=sim, waves=waves, progress=progress, build=build,
                    timings=timings)[0]


def run_many(specs, *, sim="amaranth", waves=None, progress=None, build=None, timings=None):
    """Run several specs with the same fabric parameters one after the other on one
    simulation of the fabric (one Verilog build); return one list of iteration rows per
    spec.

    ``build``: how Verilator builds the fabric (a
    :class:`~rdakit.sim.verify.runner.VerilatorBuild`; :data:`VERILATOR_BUILD` if ``None``).
    ``timings``:
    a dict that, for Icarus and Verilator, gets the wall seconds of each phase
    (``verilog_s``: the fabric's Verilog, generated or from the cache; ``build_s``: until the
    testbench first reports, so the simulator build, a second or two when cached; ``run_s``:
    the rest, the simulation with the host's transfers and checks; ``stages``: the seconds of
    each stage the testbench reported, as polled every quarter second, e.g. ``running``;
    ``stages_cpu``: the simulator process's CPU seconds in each stage but the last, which a
    busy machine does not inflate) and, for Verilator, the build's own record
    (``verilate_s``, ``compile_s``, its options, and ``built``: whether this run built it)."""
    if sim not in BACKENDS:
        raise ValueError(f"Simulator must be one of {', '.join(BACKENDS)}, not {sim!r}")
    if not specs:
        raise ValueError("No run given")
    params = specs[0].params
    for s in specs[1:]:
        if s.params != params:
            raise ValueError(f"Runs on one simulation need the same fabric: {s.fabric} differs "
                             f"from {specs[0].fabric}")
    if sim == "model":
        if waves is not None:
            raise ValueError("The performance model (sim 'model') has no waveforms")
        return _run_model(specs, progress=progress)
    if sim == "amaranth":
        return _run_amaranth(specs, waves=waves, progress=progress)
    build = build or VERILATOR_BUILD
    if sim == "verilator" and in_process(sim, build, waves):
        return _run_direct(specs, progress=progress, build=build,
                           timings=timings if timings is not None else {})
    return _run_cocotb(specs, sim, waves=waves, progress=progress, build=build,
                       timings=timings if timings is not None else {})


def in_process(sim, build=None, waves=None):
    """Whether :func:`run_many` runs on ``sim`` (with the Verilator ``build``, default
    :data:`VERILATOR_BUILD`, and ``waves``) in this process, so that a :class:`RunSpec` may
    hold a workload object rather than a name or file another process can load."""
    return sim in ("amaranth", "model") or (
        sim == "verilator" and (build or VERILATOR_BUILD).driver == "direct" and waves is None)


async def run_specs(host, specs, *, progress=None):
    """:func:`run_session` of each spec in turn on one fabric; the list of their rows."""
    progress = progress or (lambda stage, done=None, total=None: None)
    out = []
    for k, spec in enumerate(specs):
        tag = f"[{k + 1}/{len(specs)} {spec.workload} {spec.partitioner}] " if len(specs) > 1 \
            else ""
        out.append(await run_session(
            host, spec, progress=lambda stage, done=None, total=None, tag=tag:
                progress(tag + stage, done, total)))
    return out


def _run_amaranth(specs, *, waves, progress):
    params = specs[0].params
    fabric = Fabric(params)
    out = {}

    async def testbench(ctx):
        host = HostDriver(params, AmaranthTransport(ctx, fabric))
        out["rows"] = await run_specs(host, specs, progress=progress)

    if waves is None:
        simulate(fabric, testbench)
    else:
        with atomic_path(waves) as tmp:
            simulate(fabric, testbench, vcd=tmp)
    return out["rows"]


def _run_model(specs, *, progress):
    """The specs on the performance model (:mod:`rdakit.sim.models.perf`): its host port
    answers the driver as the RTL's does, so the report path is the same."""
    params = specs[0].params
    host = HostDriver(params, ModelTransport(params))
    return asyncio.run(run_specs(host, specs, progress=progress))


def fabric_verilog(params):
    """The Verilog of ``Fabric(params)``, cached by its parameters."""
    return cached_verilog(_fabric_key(params), lambda: Fabric(params))


def fabric_harness(params, build=None):
    """The Verilator harness executable of ``Fabric(params)`` (:func:`build_harness`, the
    Verilog :func:`fabric_verilog`'s), one cache entry per parameters and build options
    (``build``, a :class:`VerilatorBuild`): what ``rdakit run``, ``bench e2e`` and ``bench
    fabric`` drive directly."""
    return build_harness(_fabric_key(params), lambda: Fabric(params),
                         build_name=_build_name(params), build=build)


def on_harness(params, body, build=None):
    """``await body(host)`` on a running Verilator harness executable of ``Fabric(params)``
    (:func:`fabric_harness`, ``build``'s cache entry), ``host`` its host port just reset
    (:func:`~rdakit.sim.runtime.host.harness_host`); the executable ends with it. What
    ``bench fabric`` and ``bench memory`` drive on Verilator."""
    harness = fabric_harness(params, build)

    async def session(proc):
        return await body(await harness_host(proc, params))

    with HarnessProcess(harness) as proc:
        return asyncio.run(session(proc))


def _fabric_key(params):
    return f"Fabric {params!r}"


def _build_name(params):
    digest = hashlib.sha256(repr(params).encode()).hexdigest()[:10]
    return f"run-{params.rows}x{params.cols}-{digest}"


def _stage_seconds(seen, end, cpu_end):
    """``(wall, cpu)``: the seconds of each stage of ``seen`` (``(stage, when first seen, the
    simulator's CPU seconds then or None)`` in order), the last ending at ``end`` (``cpu_end``);
    a stage's CPU seconds where both its ends are known."""
    stages, cpu = {}, {}
    for (stage, t, c), (_, t_next, c_next) in zip(seen, [*seen[1:], (None, end, cpu_end)],
                                                  strict=True):
        stages[stage] = round(stages.get(stage, 0) + t_next - t, 2)
        if c is not None and c_next is not None:
            cpu[stage] = round(cpu.get(stage, 0) + c_next - c, 2)
    return stages, cpu


def _run_direct(specs, *, progress, build, timings):
    """The specs on a Verilator harness executable of the fabric, driven from this process
    (:class:`~rdakit.sim.runtime.host.HarnessTransport`); ``timings`` as for
    :func:`run_many` (``verilog_s``, ``build_s``: the harness build, or finding it cached,
    ``run_s`` and ``stages`` with ``running``, whose CPU seconds are the executable's)."""
    params = specs[0].params
    progress = progress or (lambda stage, done=None, total=None: None)
    progress(f"generating Verilog ({params.rows}x{params.cols} fabric)")
    start = time.monotonic()
    fabric_verilog(params)
    timings["verilog_s"] = round(time.monotonic() - start, 2)
    progress("building the verilator harness")
    start = time.monotonic()
    harness = fabric_harness(params, build)
    timings["build_s"] = round(time.monotonic() - start, 2)
    seen = []                   # (stage, when first seen, the executable's CPU seconds then)

    def heard(stage, done=None, total=None):
        if not seen or seen[-1][0] != stage:
            seen.append((stage, time.monotonic(), proc.cpu_seconds()))
        progress(stage, done, total)

    async def session():
        host = await harness_host(proc, params)
        return await run_specs(host, specs, progress=heard)

    start = time.monotonic()
    with HarnessProcess(harness) as proc:
        rows = asyncio.run(session())
        end, cpu_end = time.monotonic(), proc.cpu_seconds()
    stages, cpu = _stage_seconds(seen, end, cpu_end)
    timings.update(run_s=round(end - start, 2), stages=stages, stages_cpu=cpu,
                   driver="direct")
    return rows


def _run_cocotb(specs, sim, *, waves, progress, build, timings):
    params = specs[0].params
    progress = progress or (lambda stage, done=None, total=None: None)
    progress(f"generating Verilog ({params.rows}x{params.cols} fabric)")
    start = time.monotonic()
    text = fabric_verilog(params)
    timings["verilog_s"] = round(time.monotonic() - start, 2)
    with tempfile.TemporaryDirectory(prefix="rdakit-run-") as tmp:
        out = pathlib.Path(tmp) / "rows.json"
        prog = pathlib.Path(tmp) / "progress.json"
        done = {}

        def work():
            try:
                done["info"] = run_cocotb(
                    None, verilog_text=text, simulator=sim, test_module="e2e_tb",
                    test_dir=pathlib.Path(__file__).parent,
                    build_name=_build_name(params),
                    config={"specs": [s.to_dict() for s in specs], "out": str(out),
                            "progress": str(prog)},
                    waves=bool(waves), verilator=build or VERILATOR_BUILD)
            except BaseException as e:     # re-raised in the caller's thread
                done["error"] = e

        progress(f"building the {sim} model and running")
        thread = threading.Thread(target=work, daemon=True)
        start = time.monotonic()
        thread.start()
        seen = []                   # (stage, when first seen, the simulator's CPU seconds then)
        while thread.is_alive():
            thread.join(0.25)
            try:
                p = json.loads(prog.read_text())
            except (OSError, ValueError):
                continue
            if not seen or seen[-1][0] != p["stage"]:
                seen.append((p["stage"], time.monotonic(), p.get("cpu")))
            progress(p["stage"], p.get("done"), p.get("total"))
        if "error" in done:
            raise done["error"]
        end = time.monotonic()
        ran = seen[0][1] if seen else end
        stages, cpu = _stage_seconds(seen, end, None)
        timings.update(build_s=round(ran - start, 2), run_s=round(end - ran, 2),
                       stages=stages, stages_cpu=cpu,
                       **(done["info"].get("build_times") or {}))
        rows = json.loads(out.read_text())
        if waves:
            # The run's own folder (kept because waves were asked), removed once copied.
            work = pathlib.Path(done["info"]["work_dir"])
            dumps = sorted((p for p in work.iterdir() if p.suffix in (".fst", ".vcd")),
                           key=lambda p: p.stat().st_mtime)
            if dumps:
                with atomic_path(waves) as tmp:
                    shutil.copyfile(dumps[-1], tmp)
            shutil.rmtree(work, ignore_errors=True)
    return rows


class FileProgress:
    """``progress`` for a cocotb process: writes the latest stage and the process's CPU seconds
    to a JSON file (at most every ``interval`` seconds while running) for the parent's progress
    bar and timings."""

    def __init__(self, path, interval=0.2):
        self.path = pathlib.Path(path)
        self.interval = interval
        self._last = 0.0

    def __call__(self, stage, done=None, total=None):
        now = time.monotonic()
        if done is not None and now - self._last < self.interval:
            return
        self._last = now
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"stage": stage, "done": done, "total": total,
                                   "cpu": time.process_time()}))
        tmp.replace(self.path)


# --- the heatmap ------------------------------------------------------------------------------

def _save(fig, path):
    """Write figure ``fig`` as a PNG at ``path`` (its folder made as needed) and close it."""
    import matplotlib.pyplot as plt  # deferred like the plots that call this (already loaded)

    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def plot_profile(profile, path, *, title=None):
    """A PNG of :func:`profile_rows`: one stacked bar per CU (the ``total`` row is left out),
    a segment per category."""
    import matplotlib  # deferred: matplotlib is optional and slow to import, only for plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in profile if r["tile"] != "total"]
    labels = [r["tile"] for r in rows]
    fig, ax = plt.subplots(figsize=(1.0 * len(rows) + 3.5, 4))
    bottom = np.zeros(len(rows))
    colors = matplotlib.colormaps["tab10"].colors
    for k, (cat, color) in enumerate(zip(PROFILE_CATEGORIES, colors, strict=False)):
        values = np.array([r[cat] for r in rows], dtype=float)
        ax.bar(labels, values, bottom=bottom, label=cat, color=color, zorder=2 + k)
        bottom += values
    ax.set_xlabel("CU")
    ax.set_ylabel("cycles")
    ax.set_title(title or "where each CU's cycles went", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(fig, path)


def plot_utilization(params, tiles, path, *, title=None):
    """A PNG heatmap of the tiles' utilization (busy / cycles) on the grid; MU tiles show their
    peak occupancy in words."""
    import matplotlib  # deferred: matplotlib is optional and slow to import, only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.full((params.rows, params.cols), np.nan)
    labels = {}
    for t in map(TileRow.from_json, tiles):
        x, y = t.tile
        if t.kind == "CU":
            grid[y, x] = t.utilization
            labels[(x, y)] = f"CU\n{t.utilization:.0%}"
        else:
            labels[(x, y)] = f"MU\npeak {t.peak_words}w"
    fig, ax = plt.subplots(figsize=(1.4 * params.cols + 1.5, 1.4 * params.rows + 0.8))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#dddddd")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=1)
    for (x, y), text in labels.items():
        value = grid[y, x]
        color = "black" if np.isnan(value) or value > 0.6 else "white"
        ax.text(x, y, text, ha="center", va="center", fontsize=8, color=color)
    ax.set_xticks(range(params.cols))
    ax.set_yticks(range(params.rows))
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_title(title or "tile utilization (busy / cycles)", fontsize=9)
    fig.colorbar(im, ax=ax, label="CU utilization")
    _save(fig, path)
