"""``rdakit sweep``: design points x workloads on the fast performance model, on Dask.

A :class:`SweepSpec` names the axes (design parameters and the values each takes), the fixed
parameters, the workloads, the objectives and the budget. Each *point* (one design, one
workload) is compiled and run on the performance model (``--sim model``) by
:func:`evaluate_point`, through :func:`rdakit.sim.flows.e2e.run`, the path of ``rdakit run``:
its outputs are checked bit for bit against numpy and the interpreter, and its row records the
cycles, the bounds, the MU peak and the flits; a point that does not fit (the compiler's
capacity or program-length errors) is a row with its reason. The area of a design (Yosys cells
and memory bits of the CU, the MU tile and both networks' routers, summed over the fabric's
tiles, :func:`fabric_area`) is computed once per hardware parameter set and cached under the
cache folder (:func:`rdakit.sim.verify.cache.cache_root`), keyed by the parameters and the
gateware's sources, not by the workload.

:func:`run_sweep` evaluates the points on a Dask cluster (a ``LocalCluster`` of worker processes
by default, or an existing scheduler), as a grid (the cross product of the axes) or as an Optuna
search (NSGA-II with a fixed seed, minimizing the objectives). The output folder holds the
sweep's own files (:data:`OWN_FILES`): ``sweep.json`` (its mark and spec), ``points.jsonl``
(one line per evaluated point, appended as each finishes: the store a re-run resumes from),
``results.csv`` (and ``results.parquet`` when pyarrow is importable), ``summary.json`` with the
Pareto front, and ``pareto.png``. ``docs/sweep.md`` describes them.
"""

import csv
import dataclasses
import functools
import hashlib
import inspect
import io
import itertools
import json
import pathlib
import time

import numpy as np

from rdakit.errors import UserError
from rdakit.files import atomic_path, atomic_write
from rdakit.hdl.compute.unit import ComputeUnit
from rdakit.hdl.fabric.top import MUTile
from rdakit.hdl.noc.router import Router
from rdakit.hdl.spec.packets import msg_layout, mu_request_layout
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.bench.mu import yosys_stat
from rdakit.sim.flows import e2e
from rdakit.sim.verify import cache
from rdakit.sim.verify.runner import _hdl_digest

__all__ = ["DESIGN_KEYS", "AXIS_NAMES", "METRICS", "DEFAULT_OBJECTIVES", "OWN_FILES",
           "MARK", "Workload", "SweepSpec", "point_key", "evaluate_point", "fabric_area",
           "pareto_front", "SweepStore", "check_output_dir", "run_sweep", "SweepResult",
           "plot_pareto", "COLUMNS"]

#: The keywords of :func:`fabric_params` a sweep may vary or fix (``rows`` and ``cols`` are
#: the ``fabric`` axis, ``RxC``; the cluster and coordinate widths are derived).
DESIGN_KEYS = tuple(k for k in inspect.signature(fabric_params).parameters
                    if k not in ("rows", "cols", "cluster_bits", "coord_bits"))

#: Every axis name: the grid, the fabric's parameters and the partitioner.
AXIS_NAMES = ("fabric", *DESIGN_KEYS, "partitioner")

#: The numeric columns an objective or a budget may name (all minimized).
METRICS = ("cycles", "cycles_over_bound", "mu_peak_words", "mu_utilization", "noc_flits",
           "cells", "memory_bits")

#: The objectives when the spec names none: cycles, area (Yosys cells), peak MU memory.
DEFAULT_OBJECTIVES = ("cycles", "cells", "mu_peak_words")

#: The files of a sweep's output folder; a folder holding one of them without the sweep's mark
#: (``sweep.json`` with :data:`MARK`) is refused.
OWN_FILES = ("sweep.json", "points.jsonl", "results.csv", "results.parquet", "summary.json",
             "pareto.png")

#: The key of ``sweep.json`` that marks a folder as a sweep's (its value, the format's version).
MARK = "rdakit_sweep"

#: The columns of ``results.csv``, in order: the design (one column per axis), the workload,
#: then what the evaluation measured.
COLUMNS = ("key", "workload", "sizes", "fabric", *DESIGN_KEYS, "partitioner", "status",
           "reason", "cycles", "estimated_cycles", "lower_bound", "lanes_bound",
           "cycles_over_bound", "mu_peak_words", "mu_utilization", "noc_flits", "numpy",
           "interpreter", "cells", "memory_bits", "within_budget", "pareto", "rtl_cycles",
           "model_error", "wall_s")


@dataclasses.dataclass(frozen=True)
class Workload:
    """A workload of a sweep: a built-in name (or a graph file) and its sizes."""

    name: str
    sizes: dict = dataclasses.field(default_factory=dict)

    def label(self):
        """``moe:tokens=16,d_model=32``: how the user writes it on the command line."""
        if not self.sizes:
            return self.name
        parts = [f"{k}={','.join(map(str, v)) if isinstance(v, (tuple, list)) else v}"
                 for k, v in self.sizes.items()]
        return f"{self.name}:{','.join(parts)}"


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """What to sweep (checked by the command line, ``rdakit.cli.sweep``).

    Members
    -------
    axes : dict
        Axis name (:data:`AXIS_NAMES`) -> tuple of values; ``fabric`` values are ``"RxC"``.
    fixed : dict
        Parameters every design has (same names as the axes).
    workloads : tuple of Workload
    objectives : tuple of str
        Names of :data:`METRICS`, all minimized.
    budget : dict
        Metric -> largest value a design may have (``cells``: an area budget).
    search : str
        ``"grid"`` (the cross product of the axes) or ``"optuna"``.
    trials : int
        Optuna trials (designs; each is run on every workload).
    seed : int
        Seed of the placement and of the Optuna sampler.
    place_steps : int
        Annealing steps of the placement.
    area : bool
        Whether to compute each design's area with Yosys.
    base : dict
        The keywords of :func:`fabric_params` of a design before the fixed parameters and the
        axes apply (``rdakit sweep`` gives ``rdakit run``'s fabric); missing keywords take
        :func:`fabric_params`'s defaults.
    """

    axes: dict
    fixed: dict = dataclasses.field(default_factory=dict)
    workloads: tuple = ()
    objectives: tuple = DEFAULT_OBJECTIVES
    budget: dict = dataclasses.field(default_factory=dict)
    search: str = "grid"
    trials: int = 20
    seed: int = 0
    place_steps: int = 20000
    area: bool = True
    base: dict = dataclasses.field(default_factory=dict)

    def design(self, values):
        """``(fabric keywords, partitioner)`` of the design with axis values ``values`` (every
        keyword of :func:`fabric_params` filled in, so equal designs have equal keys)."""
        d = {**self.fixed, **values}
        kw = {k: p.default for k, p in inspect.signature(fabric_params).parameters.items()}
        kw.update(self.base)
        kw.update({k: v for k, v in d.items() if k in DESIGN_KEYS})
        if "fabric" in d:
            kw["rows"], kw["cols"] = (int(v) for v in d["fabric"].split("x"))
        return kw, d.get("partitioner", "fastest")

    def grid(self):
        """The axis values of every design of the cross product, in order."""
        names = list(self.axes)
        return [dict(zip(names, combo, strict=True))
                for combo in itertools.product(*(self.axes[n] for n in names))]

    def points(self, values):
        """The points (one per workload) of the design with axis values ``values``."""
        kw, partitioner = self.design(values)
        return [{"fabric": kw, "partitioner": partitioner, "workload": w.name,
                 "sizes": dict(w.sizes), "seed": self.seed, "place_steps": self.place_steps}
                for w in self.workloads]

    def to_json(self):
        d = dataclasses.asdict(self)
        d["workloads"] = [w.label() for w in self.workloads]
        return json.loads(json.dumps(d, default=list))


def _canonical(obj):
    return json.dumps(obj, sort_keys=True, default=list, separators=(",", ":"))


def point_key(point):
    """The key of a point: a digest of its design, workload, sizes, seed and placement steps.
    A re-run finds a point by it (sizes given as a list or a tuple give the same key)."""
    return hashlib.sha256(_canonical(point).encode()).hexdigest()[:16]


def _hw_key(kw):
    """A digest of the hardware parameters of fabric keywords ``kw`` (the area's key); None
    if they are not a valid fabric (axis values that do not go together)."""
    try:
        params = fabric_params(**kw)
    except (TypeError, ValueError):
        return None
    return hashlib.sha256(repr(params).encode()).hexdigest()[:16]


# --- one point --------------------------------------------------------------------------------

def evaluate_point(point, fit_errors=()):
    """Compile and run ``point`` on the performance model; its row (see :data:`COLUMNS`).

    ``fit_errors`` are the compiler's exceptions for a workload that does not fit the fabric
    (``rdakit.cli.compile.FIT_ERRORS``): the row says ``does not fit`` with the compiler's
    message. A run that fails (a mismatch, a CU error, a leak) is a ``failed`` row with its
    reason; an unexpected exception an ``error`` row naming it; a design whose axis values
    do not go together (``block_words`` 2048 with ``mu_words`` 1024) an ``invalid design``
    row with :func:`fabric_params`'s message. Runs on a Dask worker."""
    start = time.perf_counter()
    row = {"key": point_key(point)}
    try:
        fabric_params(**point["fabric"])
    except (TypeError, ValueError) as e:
        return {**row, "status": "invalid design", "reason": str(e), "wall_s": 0.0}
    spec = e2e.RunSpec(workload=point["workload"], sizes=dict(point["sizes"]),
                       fabric=dict(point["fabric"]), partitioner=point["partitioner"],
                       seed=point["seed"], place_steps=point["place_steps"])
    spec = e2e.RunSpec.from_dict(spec.to_dict())        # sizes as tuples, as the CLI gives
    try:
        r = e2e.run(spec, sim="model")[-1]
    except fit_errors as e:
        row.update(status="does not fit", reason=str(e))
    except Exception as e:  # noqa: BLE001 -- one point's failure is its row, not the sweep's
        row.update(status="error", reason=f"{type(e).__name__}: {e}")
    else:
        why = e2e.failure(r)
        words = point["fabric"]["mu_words"]
        row.update(
            status="failed" if why else "ok", reason=why, cycles=r.get("cycles"),
            estimated_cycles=r.get("estimated_cycles"), lower_bound=r.get("lower_bound"),
            lanes_bound=r.get("lanes_bound"), cycles_over_bound=r.get("cycles_over_bound"),
            mu_peak_words=r.get("mu_peak_words"),
            mu_utilization=(r["mu_peak_words"] / words
                            if r.get("mu_peak_words") is not None else None),
            noc_flits=r.get("noc_flits"), numpy=r.get("numpy"),
            interpreter=r.get("interpreter"))
    row["wall_s"] = round(time.perf_counter() - start, 3)
    return row


# --- area -------------------------------------------------------------------------------------

def _router_class(x, y, rows, cols):
    """Which of a router's four mesh neighbours exist: routers of one class are the same
    circuit but for their coordinates."""
    return (x > 0, x < cols - 1, y > 0, y < rows - 1)


def _compute_area(kw):
    """Yosys cells and memory bits of the fabric of keywords ``kw``: a CU and an MU tile
    (:func:`~rdakit.sim.bench.mu.yosys_stat`) times their counts, and a request and a response
    router of each position class (corner, edge, inside) times the tiles of that class."""
    p = fabric_params(**kw)
    cus, mus = p.tiles("C"), p.tiles("M")
    parts = {"cu": (yosys_stat(ComputeUnit(p, x=cus[0][0], y=cus[0][1])), len(cus)),
             "mu_tile": (yosys_stat(MUTile(p, x=mus[0][0], y=mus[0][1])), len(mus))}
    classes = {}
    for x, y in p.tiles():
        classes.setdefault(_router_class(x, y, p.rows, p.cols), []).append((x, y))
    routers = {"cells": 0, "memory_bits": 0}
    for (x, y), *rest in classes.values():
        for shape in (mu_request_layout(p.mu), msg_layout(p.mu)):
            s = yosys_stat(Router(payload_shape=shape, x=x, y=y, rows=p.rows, cols=p.cols,
                                  coord_bits=p.coord_bits, depth=p.noc_depth,
                                  queues=p.noc_queues))
            for k in routers:
                routers[k] += s[k] * (1 + len(rest))
    out = {"cells": routers["cells"] + sum(s["cells"] * n for s, n in parts.values()),
           "memory_bits": routers["memory_bits"]
           + sum(s["memory_bits"] * n for s, n in parts.values()),
           "router_cells": routers["cells"]}
    for name, (s, n) in parts.items():
        out[f"{name}_cells"], out[f"{name}_count"] = s["cells"], n
    return out


@functools.cache
def _sources_digest():
    """The gateware's digest (sources, Amaranth and Yosys versions), once a process: it reads
    every source and asks Yosys its version, a second or two."""
    return _hdl_digest()[:16]


def fabric_area(kw):
    """The area of the fabric of :func:`fabric_params` keywords ``kw`` (``{"cells",
    "memory_bits", "router_cells", "cu_cells", "cu_count", "mu_tile_cells",
    "mu_tile_count"}``), from the cache folder's ``sweep-area`` entries if it was computed
    before: keyed by the parameters and the gateware's sources, so a workload never causes a
    recomputation and a change of the RTL does."""
    hw = _hw_key(kw)

    def build(folder):
        (folder / "area.json").write_text(json.dumps(_compute_area(kw)))

    base = cache.cache_root() / "sweep-area"
    with cache.use(base, f"area_{hw}", _sources_digest(), build) as entry:
        return json.loads((entry / "area.json").read_text())


# --- the Pareto front -------------------------------------------------------------------------

def pareto_front(values):
    """Indices of the non-dominated rows of ``values`` (a sequence of equal-length tuples,
    every objective minimized), in increasing order. A row is dominated when another is no
    worse in every objective and better in one; equal rows do not dominate each other."""
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return []
    order = np.lexsort(values.T[::-1])         # by the first objective, then the next ...
    front = []
    for i in order:
        v = values[i]
        if not any(np.all(values[j] <= v) and np.any(values[j] < v) for j in front):
            front.append(i)
    return sorted(int(i) for i in front)


# --- the output folder ------------------------------------------------------------------------

def check_output_dir(path, option="-o"):
    """Refuse ``path`` as a sweep's output folder (a UserError naming ``option``) when it is a
    file, or holds a file of :data:`OWN_FILES` without being a sweep's (no ``sweep.json`` with
    :data:`MARK`): the sweep would overwrite a file it did not write."""
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{option} {str(path)!r} is a file, not a folder")
    if not path.is_dir():
        return
    mark = path / "sweep.json"
    if mark.exists():
        try:
            ok = mark.is_file() and MARK in json.loads(mark.read_text())
        except (ValueError, OSError, TypeError):
            ok = False
        if not ok:
            raise UserError(f"{option} {str(path)!r}: {mark} is not a sweep's (no "
                            f"{MARK!r} in it); rdakit sweep does not overwrite it")
        return
    for name in OWN_FILES:
        if (path / name).exists():
            raise UserError(f"{option} {str(path)!r} holds {name}, which is not a sweep's "
                            f"(there is no sweep.json); rdakit sweep does not overwrite it: "
                            f"choose another folder")


class SweepStore:
    """The evaluated points of an output folder: ``points.jsonl``, a JSON row a line, appended
    as each point finishes (a line cut short by a crash is ignored, so its point runs again)."""

    def __init__(self, folder):
        self.folder = pathlib.Path(folder)
        self.path = self.folder / "points.jsonl"
        self.rows = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and "key" in row:
                    self.rows[row["key"]] = row

    def __contains__(self, key):
        return key in self.rows

    def add(self, row):
        """Record ``row`` (appended and flushed at once)."""
        self.rows[row["key"]] = row
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=list) + "\n")

    def rewrite(self):
        """Write the whole store again (after rows were updated in place)."""
        atomic_write(self.path, "".join(json.dumps(r, default=list) + "\n"
                                        for r in self.rows.values()))


# --- the sweep --------------------------------------------------------------------------------

@dataclasses.dataclass
class SweepResult:
    """What :func:`run_sweep` did.

    Members
    -------
    rows : list of dict
        One per point of the sweep (:data:`COLUMNS`), with its design, area and Pareto mark.
    evaluated : int
        Points run in this call (the others came from the store).
    front : list of dict
        The rows on the Pareto front (per workload).
    """

    rows: list
    evaluated: int
    front: list


def _client(workers, scheduler):
    """A Dask client: to ``scheduler`` if given, else to a new ``LocalCluster`` of ``workers``
    processes of one thread each (the model is pure Python: threads would share one core)."""
    from dask.distributed import Client, LocalCluster  # deferred: Dask is slow to import

    if scheduler:
        try:
            return Client(scheduler, timeout="10s"), None
        except (OSError, ValueError, TypeError) as e:      # unreachable, or not an address
            raise UserError(f"--scheduler {scheduler!r}: cannot connect ({e})") from None
    # The scheduler serves HTTP even without a dashboard, on 8787 unless told otherwise: a free
    # port, so that two sweeps (or a sweep and the user's own cluster) do not collide there
    # (Dask then moves to another port with a warning, and leaks a socket).
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                           dashboard_address=":0", silence_logs=40)
    return Client(cluster), cluster


class _Evaluator:
    """Submits points and designs' areas to the Dask client and records rows as they finish."""

    def __init__(self, client, spec, store, fit_errors, progress, workers):
        self.client, self.spec, self.store, self.workers = client, spec, store, workers
        self.fit_errors, self.progress = fit_errors, progress
        self.areas = {}
        self.evaluated = 0

    def run(self, points, designs):
        from dask.distributed import as_completed  # deferred: Dask is slow to import

        todo = list({point_key(p): p for p in points if point_key(p) not in self.store}
                    .values())
        hw = {k: kw for kw in designs
              if (k := _hw_key(kw)) is not None and k not in self.areas}
        futures = {}
        for p in todo:
            futures[self.client.submit(evaluate_point, p, self.fit_errors, pure=False)] = \
                ("point", p)
        if self.spec.area:
            for k, kw in hw.items():
                futures[self.client.submit(_area_or_reason, kw, pure=False)] = ("area", k)
        total, done = len(futures), 0
        self.progress(f"evaluating {len(todo)} points, {len(hw) if self.spec.area else 0} "
                      f"areas", 0, total)
        for future in as_completed(list(futures)):
            kind, what = futures[future]
            result = future.result()
            if kind == "point":
                self.store.add({**_design_columns(what), **result})
                self.evaluated += 1
            else:
                self.areas[what] = result
            done += 1
            self.progress("evaluating", done, total)


def _area_or_reason(kw):
    """:func:`fabric_area`, or ``{"reason": ...}`` when Yosys fails on the design."""
    try:
        return fabric_area(kw)
    except Exception as e:  # noqa: BLE001 -- one design's area failure is its rows' reason
        return {"reason": f"area: {type(e).__name__}: {e}"}


def _design_columns(point):
    kw = point["fabric"]
    return {"workload": point["workload"],
            "sizes": _canonical(point["sizes"]) if point["sizes"] else "",
            "fabric": f"{kw['rows']}x{kw['cols']}",
            **{k: kw[k] for k in DESIGN_KEYS}, "partitioner": point["partitioner"]}


def _finish_rows(spec, points, store, areas):
    """The rows of ``points`` from the store, with area, budget and Pareto columns."""
    rows = []
    for p in points:
        row = {c: None for c in COLUMNS}
        row.update(store.rows[point_key(p)])
        a = areas.get(_hw_key(p["fabric"]), {})
        row["cells"], row["memory_bits"] = a.get("cells"), a.get("memory_bits")
        if "reason" in a and row["status"] == "ok":
            row["reason"] = a["reason"]
        rows.append(row)
    for row in rows:
        ok = row["status"] == "ok" and all(row[m] is not None for m in spec.objectives)
        row["within_budget"] = ok and all(row[m] is not None and row[m] <= limit
                                          for m, limit in spec.budget.items())
        row["pareto"] = False
    for w in spec.workloads:
        cand = [r for r in rows if r["within_budget"] and r["workload"] == w.name
                and r["sizes"] == (_canonical(w.sizes) if w.sizes else "")]
        for i in pareto_front([tuple(r[m] for m in spec.objectives) for r in cand]):
            cand[i]["pareto"] = True
    return rows


def _objective_values(spec, rows):
    """Optuna's values of one design from its rows (one per workload): cycles, flits and
    utilization summed over the workloads, peaks and area as the largest; ``None`` if a
    workload did not run or the design is over the budget's area."""
    if any(r["status"] != "ok" for r in rows):
        return None
    out = []
    for m in spec.objectives:
        vals = [r[m] for r in rows]
        if any(v is None for v in vals):
            return None
        out.append(max(vals) if m in ("mu_peak_words", "cells", "memory_bits")
                   else sum(vals))
    return out


def _optuna_designs(spec, evaluator, progress):
    """Run the Optuna search; the axis values of every design it tried, in order."""
    import optuna  # deferred: slow to import, only for --search optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Optuna 5 reads a trial's constraints from Trial.set_constraint (feasible at <= 0).
    sampler = optuna.samplers.NSGAIISampler(seed=spec.seed)
    study = optuna.create_study(directions=["minimize"] * len(spec.objectives),
                                sampler=sampler)
    batch = max(1, evaluator.workers)
    tried = []
    while len(tried) < spec.trials:
        trials = [study.ask() for _ in range(min(batch, spec.trials - len(tried)))]
        chosen = [{n: t.suggest_categorical(n, list(spec.axes[n])) for n in spec.axes}
                  for t in trials]
        points = [p for v in chosen for p in spec.points(v)]
        evaluator.run(points, [spec.design(v)[0] for v in chosen])
        for t, v in zip(trials, chosen, strict=True):
            rows = _finish_rows(spec, spec.points(v), evaluator.store, evaluator.areas)
            values = _objective_values(spec, rows)
            if values is None:
                study.tell(t, state=optuna.trial.TrialState.FAIL)
                continue
            for m, limit in spec.budget.items():
                t.set_constraint(f"budget_{m}", max(r[m] for r in rows) - limit)
            study.tell(t, values)
        tried += chosen
        progress(f"optuna: {len(tried)}/{spec.trials} trials", len(tried), spec.trials)
    return tried


def run_sweep(spec, folder, *, workers=2, scheduler=None, fit_errors=(), progress=None,
              confirm=None):
    """Run the sweep ``spec`` into the output folder ``folder``; a :class:`SweepResult`.

    Points already in the folder's store (same key) are not evaluated again. ``confirm``
    (``"verilator"``) re-runs the Pareto front's points on that simulator and adds their RTL
    cycles and the model's error. ``progress(stage, done, total)`` hears of the work."""
    progress = progress or (lambda stage, done=None, total=None: None)
    folder = pathlib.Path(folder)
    check_output_dir(folder)
    progress("starting Dask")
    client, cluster = _client(workers, scheduler)    # before anything is written
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / "sweep.json", json.dumps({MARK: 1, "spec": spec.to_json()},
                                                       indent=2) + "\n")
        store = SweepStore(folder)
        evaluator = _Evaluator(client, spec, store, fit_errors, progress,
                               len(client.scheduler_info().get("workers", {})) or workers)
        if spec.search == "optuna":
            designs = _optuna_designs(spec, evaluator, progress)
        else:
            designs = spec.grid()
        points = list({point_key(p): p for v in designs for p in spec.points(v)}.values())
        evaluator.run(points, [spec.design(v)[0] for v in designs])
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    rows = _finish_rows(spec, points, store, evaluator.areas)
    if confirm:
        _confirm(spec, rows, store, confirm, progress)
    front = [r for r in rows if r["pareto"]]
    write_outputs(spec, folder, rows, front, evaluated=evaluator.evaluated)
    return SweepResult(rows, evaluator.evaluated, front)


def _confirm(spec, rows, store, sim, progress):
    """Run the front's points on ``sim`` (the RTL) and add ``rtl_cycles`` and ``model_error``
    (model cycles over RTL cycles, minus one) to their rows and the store."""
    front = [r for r in rows if r["pareto"] and r.get("rtl_cycles") is None]
    for k, row in enumerate(front):
        progress(f"confirming {k + 1}/{len(front)} on {sim}")
        kw, partitioner = spec.design({})
        kw.update({k2: row[k2] for k2 in DESIGN_KEYS})
        kw["rows"], kw["cols"] = (int(v) for v in row["fabric"].split("x"))
        w = next(w for w in spec.workloads if w.name == row["workload"]
                 and (_canonical(w.sizes) if w.sizes else "") == row["sizes"])
        run = e2e.RunSpec.from_dict(e2e.RunSpec(
            workload=w.name, sizes=dict(w.sizes), fabric=kw, partitioner=row["partitioner"],
            seed=spec.seed, place_steps=spec.place_steps).to_dict())
        r = e2e.run(run, sim=sim)[-1]
        row["rtl_cycles"] = r.get("cycles")
        row["model_error"] = (row["cycles"] / r["cycles"] - 1 if r.get("cycles") else None)
        if e2e.failure(r):
            row["reason"] = f"{sim}: {e2e.failure(r)}"
        store.rows[row["key"]].update(rtl_cycles=row["rtl_cycles"],
                                      model_error=row["model_error"])
    if front:
        store.rewrite()


# --- outputs ----------------------------------------------------------------------------------

def write_outputs(spec, folder, rows, front, *, evaluated):
    """``results.csv`` (and ``results.parquet`` with pyarrow), ``summary.json`` and
    ``pareto.png`` of ``rows`` in ``folder``."""
    folder = pathlib.Path(folder)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore",
                            lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: "" if r.get(k) is None else r[k] for k in COLUMNS})
    atomic_write(folder / "results.csv", buf.getvalue())
    try:
        import pyarrow as pa  # deferred and optional: Parquet only when pyarrow is installed
        import pyarrow.parquet as pq
    except ImportError:
        (folder / "results.parquet").unlink(missing_ok=True)
    else:
        table = pa.Table.from_pylist([{k: r.get(k) for k in COLUMNS} for r in rows])
        with atomic_path(folder / "results.parquet") as tmp:
            pq.write_table(table, tmp)
    statuses = {}
    for r in rows:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    summary = {"spec": spec.to_json(), "points": len(rows), "evaluated": evaluated,
               "reused": len(rows) - evaluated, "status": statuses,
               "objectives": list(spec.objectives), "budget": spec.budget,
               "pareto": [{k: r.get(k) for k in COLUMNS if r.get(k) is not None}
                          for r in front]}
    atomic_write(folder / "summary.json", json.dumps(summary, indent=2, default=list) + "\n")
    plot_pareto(spec, rows, folder / "pareto.png")


def _x_metric(spec):
    return next((m for m in spec.objectives if m != "cycles"), "cells")


def plot_pareto(spec, rows, path):
    """A PNG of cycles against the first other objective (area, ``cells`` by default): every
    point that ran, those over the budget in grey, the Pareto front marked and joined."""
    import matplotlib  # deferred: slow to import, only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xm = _x_metric(spec)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colors = matplotlib.colormaps["tab10"].colors
    for k, w in enumerate(spec.workloads):
        mine = [r for r in rows if r["workload"] == w.name and r["status"] == "ok"
                and r.get(xm) is not None and r.get("cycles") is not None]
        inside = [r for r in mine if r["within_budget"]]
        over = [r for r in mine if not r["within_budget"]]
        color = colors[k % len(colors)]
        ax.scatter([r[xm] for r in over], [r["cycles"] for r in over], color="#bbbbbb",
                   s=18, label=f"{w.label()}: over budget" if over else None)
        ax.scatter([r[xm] for r in inside], [r["cycles"] for r in inside], color=color, s=18,
                   alpha=0.6, label=w.label())
        marked = [r for r in inside if r["pareto"]]
        ax.scatter([r[xm] for r in marked], [r["cycles"] for r in marked], s=70,
                   facecolors="none", edgecolors=color, linewidths=1.2,
                   label=f"{w.label()}: Pareto front" if marked else None)
        # The staircase of the front in this plane (with more than two objectives, some of
        # the front's points are above it: they win on another objective).
        plane = [inside[i] for i in pareto_front([(r[xm], r["cycles"]) for r in inside])]
        plane.sort(key=lambda r: (r[xm], r["cycles"]))
        if plane:
            ax.plot([r[xm] for r in plane], [r["cycles"] for r in plane], color=color,
                    linewidth=1, drawstyle="steps-post")
        if len(mine) <= 40:
            for r in mine:
                text = " ".join(f"{n}={r[n]}" for n in spec.axes)
                ax.annotate(text, (r[xm], r["cycles"]), fontsize=5, xytext=(3, 3),
                            textcoords="offset points", color="#444444")
    for m, limit in spec.budget.items():
        if m == xm:
            ax.axvline(limit, color="red", linestyle="--", linewidth=1, label=f"{m} budget")
    xs = [r[xm] for r in rows if r["status"] == "ok" and r.get(xm)]
    if xs and min(xs) > 0 and max(xs) / min(xs) > 8:
        ax.set_xscale("log")                 # e.g. memory bits over several MU sizes
    ax.set_xlabel(xm)
    ax.set_ylabel("cycles (performance model)")
    skipped = sum(1 for r in rows if r["status"] != "ok")
    ax.set_title("design points" + (f" ({skipped} did not fit or failed, not shown)"
                                    if skipped else ""), fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
