"""Calibration of the cost model against simulation: ``rdakit bench calibrate``.

The cost model (:class:`~rdakit.compiler.cost.CostModel`) charges an op
``ceil(work / lanes) + op_overhead`` cycles. Once workloads are lowered to CU programs, two
simulations say what an op really costs:

* the functional interpreter (:mod:`rdakit.sim.models.interp`), profiled here per program
  counter: an op's *steps* are the instructions it executes plus the stream steps of its
  ``SRUN`` s, summed over the pcs the lowering gave it
  (:class:`~rdakit.compiler.lower.ProgramInfo`); fused ops (an elementwise chain is one
  lowered op) are compared as one group;
* the RTL in Amaranth's simulator, for small jobs (:data:`RTL_JOBS`): every CU's
  ``busy_cycles`` counter and the run's cycles, against the cost model's cycles for the ops
  on that CU and its estimated makespan, and against the interpreter's instruction and
  stream-step counts (fitted cycles per instruction and per stream step).

:func:`compare` measures the relative error ``(estimate - measured) / measured`` per op group,
and fits the model's two constants (a factor on ``ceil(work / lanes)`` and ``op_overhead``), also
per category of op kind (:class:`CalibratedCostModel`), by least squares on the relative error,
to report the error a calibrated model would have.
"""

import collections
import dataclasses
import itertools
import math
import time

import numpy as np

from rdakit.compiler.compile import compile_workload
from rdakit.compiler.cost import CostModel
from rdakit.compiler.graph import MEMORY_KINDS, OP_KINDS, TensorType
from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.spec.isa import Op
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.bench.report import Report
from rdakit.sim.models.interp import Interpreter
from rdakit.sim.runtime.host import AmaranthTransport, HostDriver
from rdakit.sim.runtime.job import prepare_interp, run_job
from rdakit.sim.verify.amaranth_sim import simulate

__all__ = ["ProfilingInterpreter", "profile", "op_groups", "run_types", "compare", "fit",
           "fit_categories", "CalibratedCostModel", "CATEGORIES", "rtl_cycles", "run",
           "WORKLOADS", "RTL_JOBS"]

#: Workloads of the calibration: (name, sizes, fabric rows x cols).
WORKLOADS = [
    ("mlp", dict(batch=4, sizes=(16, 32, 16)), (2, 2)),
    ("decoder", dict(d_model=16, heads=2, d_ff=32, cache_len=4), (2, 2)),
    ("switch", dict(tokens=8, d_model=16, d_ff=16, experts=4), (2, 2)),
    ("mixtral", dict(tokens=8, d_model=16, d_ff=16), (2, 2)),
    ("mlp", dict(batch=4, sizes=(16, 32, 16)), (4, 4)),
    ("mixtral", dict(tokens=8, d_model=16, d_ff=16), (4, 4)),
]


#: Instructions that wait for an MU response (a round trip on the NoC).
BLOCKING = frozenset({Op.ALLOC, Op.READ, Op.VREAD, Op.VWRITE, Op.VAPPEND, Op.LEN, Op.RET,
                      Op.RETI, Op.ADDW, Op.INCREF, Op.DECREF})


class ProfilingInterpreter(Interpreter):
    """The interpreter, counting the steps run at every ``(CU, pc)`` (an instruction, or one
    step of the stream of the ``SRUN`` at that pc) and, per CU, the round trips: instructions
    that wait for an MU response, and stream starts."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.pc_steps = collections.Counter()
        self.round_trips = collections.Counter()

    def _step(self, cu):
        self.pc_steps[(cu.xy, cu.pc)] += 1
        if cu.stream is None and cu.pc < len(cu.program):
            ins = cu.program[cu.pc]
            if ins is not None and (ins.op in BLOCKING or ins.op is Op.SRUN):
                self.round_trips[cu.xy] += 1
        super()._step(cu)


def profile(job, *, schedule="round_robin", seed=0):
    """Run ``job`` as :func:`~rdakit.sim.runtime.job.run_job_interp` does, profiled; returns
    ``(outputs, RunResult, steps per (cu, pc))``."""
    interp, refs = prepare_interp(job, interpreter=ProfilingInterpreter, schedule=schedule,
                                  seed=seed)
    result = interp.run(max_steps=50_000_000)
    mus = {b.name: b.mu for b in job.buffers}
    outputs = {name: interp.read_buffer(mus[name], refs[name]) for name in job.outputs}
    result.round_trips = dict(interp.round_trips)
    return outputs, result, interp.pc_steps


def op_groups(job):
    """Groups of graph nodes and the lowered ops implementing them: a lowered op implements
    one or more nodes (a fused chain), and a node may take several lowered ops (a helper
    transpose, a selection matmul); connected ones form a group. Returns a list of
    ``(nodes, lowered op names)``."""
    parent = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for _, _, _, nodes in job.lowered:
        for n in nodes[1:]:
            parent[find(n)] = find(nodes[0])
    groups = collections.defaultdict(lambda: ([], []))
    for name, _, _, nodes in job.lowered:
        g = groups[find(nodes[0])]
        g[1].append(name)
        for n in nodes:
            if n not in g[0]:
                g[0].append(n)
    return list(groups.values())


#: Categories of graph op kinds, each with its own constants in a calibrated model.
CATEGORIES = {
    "matmul": "matmul", "add": "elementwise", "sub": "elementwise", "mul": "elementwise",
    "max": "elementwise", "min": "elementwise", "relu": "elementwise", "shr": "elementwise",
    "shl": "elementwise", "clip": "elementwise", "transpose": "movement", "slice": "movement",
    "concat": "movement", "append": "movement", "reduce_sum": "reduce", "reduce_max": "reduce",
    "topk": "routing", "take": "routing", "dispatch": "routing", "combine": "combine",
}


def run_types(graph, inputs):
    """The :class:`~rdakit.compiler.graph.TensorType` of every node at the sizes of one run
    (dynamic tensors get the rows they really have)."""
    values, types = {}, {}
    for n in graph.order():
        kind = graph.kind(n)
        if kind == "input":
            values[n] = np.asarray(inputs[n])
        else:
            values[n] = OP_KINDS[kind].evaluate([values[i] for i in graph.inputs_of(n)],
                                                graph.nx.nodes[n]["attrs"])
        v = np.asarray(values[n])
        types[n] = TensorType(tuple(v.shape), graph.type_of(n).dtype)
    return types


def run_work(graph, types, node):
    """Lane operations of ``node`` at the sizes of one run."""
    data = graph.nx.nodes[node]
    return OP_KINDS[data["kind"]].work([types[i] for i in data["inputs"]], types[node],
                                       data["attrs"])


def compare(job, pc_steps, cost, inputs=None):
    """One row per op group: the cost model's cycles (at the expected sizes the partitioner
    sees, and at the sizes of this run) against the interpreter's steps."""
    graph = job.graph
    types = run_types(graph, job.workload.inputs if inputs is None else inputs)
    steps_of = collections.Counter()
    for cu, info in job.programs.items():
        for name, _, _, a, b in info.ops:
            steps_of[name] += sum(pc_steps[(cu, pc)] for pc in range(a, b))
    rows = []
    for nodes, lops in op_groups(job):
        compute = [n for n in nodes if graph.kind(n) not in MEMORY_KINDS]
        if not compute:
            continue
        work = sum(run_work(graph, types, n) for n in compute)
        lanes_work = sum(int(math.ceil(run_work(graph, types, n) / cost.lanes))
                         for n in compute)
        expected = sum(cost.op_cycles(graph, n) for n in compute)
        estimate = lanes_work + cost.op_overhead * len(compute)
        measured = sum(steps_of[o] for o in lops)
        rows.append({"graph": graph.name, "op": compute[0], "kinds": "+".join(
            dict.fromkeys(graph.kind(n) for n in compute)),
            "category": CATEGORIES[graph.kind(compute[0])], "nodes": len(compute),
            "work": int(math.ceil(work)), "lanes_work": lanes_work,
            "estimate_expected": int(expected), "estimate": int(estimate),
            "measured": int(measured),
            "rel_error": round((estimate - measured) / measured, 4) if measured else None,
            "rel_error_expected": round((expected - measured) / measured, 4)
            if measured else None})
    return rows


def fit(rows):
    """``measured ~ a * ceil(work / lanes) + b * nodes`` minimizing the squared *relative*
    error over ``rows``; returns ``(a, b, mean absolute relative error of the fit)``."""
    rows = [r for r in rows if r["measured"]]
    x = np.array([[r["lanes_work"], r["nodes"]] for r in rows], dtype=float)
    y = np.array([r["measured"] for r in rows], dtype=float)
    (a, b), *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
    if b < 0:       # a negative overhead fits few points; keep the work term alone
        b = 0.0
        a = float(np.sum(x[:, 0] / y) / np.sum((x[:, 0] / y) ** 2))
    pred = x @ np.array([a, b])
    return float(a), float(b), float(np.mean(np.abs(pred - y) / y))


def fit_categories(rows):
    """:func:`fit` per category; returns ``({category: (a, b)}, mean absolute relative error
    of the per-category model)``."""
    coefficients, errors = {}, []
    by = collections.defaultdict(list)
    for r in rows:
        if r["measured"]:
            by[r["category"]].append(r)
    for cat, rs in sorted(by.items()):
        a, b, _ = fit(rs)
        coefficients[cat] = (round(a, 4), round(b, 3))
        errors += [abs(a * r["lanes_work"] + b * r["nodes"] - r["measured"]) / r["measured"]
                   for r in rs]
    return coefficients, float(np.mean(errors))


@dataclasses.dataclass(frozen=True)
class CalibratedCostModel(CostModel):
    """A :class:`~rdakit.compiler.cost.CostModel` whose op cycles are
    ``a * ceil(work / lanes) + b`` with ``(a, b)`` fitted per category of op kind
    (:data:`CATEGORIES`) by ``rdakit bench calibrate``; categories without coefficients keep
    ``ceil(work / lanes) + op_overhead``. Pass it as ``cost=`` to the partitioners."""

    coefficients: tuple = ()      # ((category, a, b), ...)

    def op_cycles(self, graph, node):
        kind = graph.kind(node)
        if kind in MEMORY_KINDS:
            return 0
        coef = {c: (a, b) for c, a, b in self.coefficients}.get(CATEGORIES.get(kind))
        if coef is None:
            return super().op_cycles(graph, node)
        a, b = coef
        return max(1, int(round(a * math.ceil(graph.work(node) / self.lanes) + b)))


def rtl_cycles(job):
    """Run ``job`` on the RTL fabric in Amaranth's simulator; return the
    :class:`~rdakit.sim.runtime.job.JobResult` (checked against numpy)."""
    fabric = Fabric(job.params)
    out = {}

    async def tb(ctx):
        out["result"] = await run_job(HostDriver(job.params, AmaranthTransport(ctx, fabric)),
                                      job)

    simulate(fabric, tb)
    out["result"].check(job)
    return out["result"]


def _mape(rows, key="rel_error"):
    vals = [abs(r[key]) for r in rows if r[key] is not None]
    return float(np.mean(vals)) if vals else float("nan")


def run(*, quick=False, rtl=True, json_path=None, console=None):
    """Run the calibration; print the tables and write ``json_path`` if given.

    Returns
    -------
    Report
    """
    report = Report("calibrate", console=console)
    rows, totals = [], []
    workloads = WORKLOADS[:3] if quick else WORKLOADS
    for name, sizes, (r, c) in workloads:
        params = fabric_params(r, c, prog_len=4096, mu_words=4096, max_buffers=64)
        cost = CostModel(lanes=params.cu.lanes)
        job, summary = compile_workload(name, sizes=sizes, params=params,
                                        partitioner="multilevel", place_steps=2000,
                                        cost=cost)
        outputs, result, pc_steps = profile(job)
        result.check()
        got = job.decode(outputs)
        want = job.workload.reference(job.workload.inputs)
        if any(not np.array_equal(got[k], want[k]) for k in want):  # pragma: no cover
            raise AssertionError(f"{job.graph.name}: the interpreter differs from numpy")
        part = compare(job, pc_steps, cost)
        for row in part:
            row["fabric"] = f"{r}x{c}"
        rows += part
        busiest = max(s.instructions + s.stream_steps for s in result.cus.values())
        totals.append({"graph": job.graph.name, "fabric": f"{r}x{c}",
                       "estimated_makespan": summary.estimated_cycles,
                       "busiest_cu_steps": busiest, "interp_steps": result.steps,
                       "ratio": round(summary.estimated_cycles / busiest, 3)})
    report.table("cost model per op group: estimate (cycles) vs interpreter steps", rows,
                 key="op_groups",
                 columns=["graph", "fabric", "op", "kinds", "work", "estimate_expected",
                          "estimate", "measured", "rel_error"],
                 notes="estimate: ceil(work / lanes) + op_overhead at the sizes of the run "
                       "(estimate_expected: at the expected sizes of dynamic tensors, as the "
                       "partitioner sees them); measured: instructions + stream steps the "
                       "interpreter ran in the op's code; rel_error = (estimate - measured) / "
                       "measured")
    report.table("makespan: estimate vs the busiest CU's steps", totals, key="makespan")
    a, b, fitted = fit(rows)
    coefficients, fitted_cat = fit_categories(rows)
    by_cat = collections.defaultdict(list)
    for row in rows:
        by_cat[row["category"]].append(row)
    categories = [
        {"category": k, "ops": len(v), "mean_abs_rel_error": round(_mape(v), 3),
         "mean_rel_error": round(float(np.mean([x["rel_error"] for x in v])), 3),
         "fitted_a": coefficients[k][0], "fitted_b": coefficients[k][1],
         "fitted_mean_abs_rel_error": round(float(np.mean(
             [abs(coefficients[k][0] * x["lanes_work"] + coefficients[k][1] * x["nodes"]
                  - x["measured"]) / x["measured"] for x in v])), 3)}
        for k, v in sorted(by_cat.items())]
    report.table("relative error by category (default model, then fitted per category)",
                 categories, key="categories")
    report.figure("op_groups", len(rows))
    report.figure("mean_abs_rel_error", round(_mape(rows), 4))
    report.figure("mean_rel_error", round(float(np.mean([r["rel_error"] for r in rows])), 4))
    report.figure("mean_abs_rel_error_expected_sizes",
                  round(_mape(rows, "rel_error_expected"), 4))
    report.figure("fitted_work_factor", round(a, 3))
    report.figure("fitted_op_overhead", round(b, 2))
    report.figure("fitted_mean_abs_rel_error", round(fitted, 4))
    report.figure("fitted_per_category_mean_abs_rel_error", round(fitted_cat, 4))
    report.figure("calibrated_coefficients", {k: list(v) for k, v in coefficients.items()})
    if rtl:
        report.figure("rtl", _rtl_figures(report, quick))
    report.finish(json_path)
    return report


#: Small jobs run on the RTL: (workload, sizes, prog_len).
RTL_JOBS = [
    ("mlp", dict(batch=1, sizes=(8, 8, 4)), 128),
    ("switch", dict(tokens=4, d_model=4, d_ff=4, experts=2), 512),
]


def _rtl_figures(report, quick=False):
    """Small jobs on a 2x2 fabric (CUs at (0, 0), (1, 0), (0, 1)) in Amaranth's simulator:
    every CU's busy cycles against the cost model and the interpreter's counts."""
    rows, jobs = [], []
    for name, sizes, prog_len in RTL_JOBS[:1] if quick else RTL_JOBS:
        params = fabric_params(2, 2, layout="CC/CM", mu_words=1024, prog_len=prog_len)
        cost = CostModel(lanes=params.cu.lanes)
        job, summary = compile_workload(name, sizes=sizes, params=params,
                                        partitioner="multilevel", place_steps=200, cost=cost)
        _, interp, _ = profile(job)
        types = run_types(job.graph, job.workload.inputs)
        t0 = time.perf_counter()
        result = rtl_cycles(job)
        seconds = time.perf_counter() - t0
        for cu in sorted(job.programs):
            nodes = [n for _, _, c, ns in job.lowered if c == cu for n in ns
                     if job.graph.kind(n) not in MEMORY_KINDS]
            estimate = sum(int(math.ceil(run_work(job.graph, types, n) / cost.lanes))
                           + cost.op_overhead for n in nodes)
            state = interp.cus[cu]
            busy = result.counters[cu]["busy_cycles"]
            rows.append({"graph": job.graph.name, "cu": str(cu), "estimate": estimate,
                         "instructions": state.instructions, "stream_steps": state.stream_steps,
                         "round_trips": interp.round_trips.get(cu, 0), "rtl_busy": busy,
                         "rtl_stall": result.counters[cu]["stall_cycles"],
                         "rel_error": round((estimate - busy) / busy, 3)})
        jobs.append({"graph": job.graph.name, "rtl_cycles": result.cycles,
                     "estimated_makespan": summary.estimated_cycles,
                     "makespan_rel_error": round((summary.estimated_cycles - result.cycles)
                                                 / result.cycles, 3),
                     "simulation_seconds": round(seconds, 1)})
    x = np.array([[r["instructions"], r["stream_steps"], r["round_trips"]] for r in rows],
                 dtype=float)
    y = np.array([r["rtl_busy"] for r in rows], dtype=float)
    coef = _nonnegative_fit(x, y)
    for r, pred in zip(rows, x @ coef, strict=True):
        r["fitted"] = int(round(pred))
    report.table("RTL busy cycles per CU: cost model and interpreter counts", rows, key="rtl_cus",
                 notes="fitted: a * instructions + b * stream_steps + c * round_trips "
                       "(non-negative least squares on relative error); busy cycles include "
                       "the time a CU waits for other CUs")
    report.table("RTL runs", jobs, key="rtl_runs")
    return {"jobs": jobs,
            "mean_abs_rel_error_vs_rtl_busy": round(float(np.mean(
                [abs(r["rel_error"]) for r in rows])), 3),
            "cycles_per_instruction": round(float(coef[0]), 2),
            "cycles_per_stream_step": round(float(coef[1]), 2),
            "cycles_per_round_trip": round(float(coef[2]), 2),
            "fitted_mean_abs_rel_error": round(float(np.mean(np.abs(x @ coef - y) / y)), 3)}


def _nonnegative_fit(x, y):
    """Least squares of the relative error with non-negative coefficients (every subset of
    the features tried; the best all-non-negative solution kept)."""
    best, best_err = np.zeros(x.shape[1]), np.inf
    a = x / y[:, None]
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            sol, *_ = np.linalg.lstsq(a[:, cols], np.ones(len(y)), rcond=None)
            if np.any(sol < 0):
                continue
            coef = np.zeros(x.shape[1])
            coef[list(cols)] = sol
            err = float(np.sum((a @ coef - 1) ** 2))
            if err < best_err:
                best, best_err = coef, err
    return best
