"""``rdakit bench models``: the model suite through the front end, op coverage to RTL cycles.

Each model of the suite (:mod:`rdakit.compiler.frontend.models`: GPT-2, BERT, Mixtral and a
small ResNet, random weights from a fixed seed) is exported with ``torch.export``, and its ops
are counted on the graph the importer walks (:func:`rdakit.compiler.frontend.aten.op_coverage`).
A model whose every op is supported is then imported (quantized to integers, with the accuracy
report against the float model), compiled for the first fabric it fits, run on the functional
interpreter and, when its estimated cycles are within the limit, on the RTL; a model with
unsupported ops is a row that lists them. Two tables (their keys in the report JSON):

``models``
    One row per model, every key in every row (``None`` where not measured): ``model``,
    ``params`` (parameters, tied ones once), ``exported_nodes`` (ops of the exported graph),
    ``nodes`` and ``op_kinds`` (ops and distinct ops of the graph the importer walks: core aten
    with the registered ops kept whole), ``folded`` (those that read no model input: the
    importer folds them to constants, whatever their op), ``unsupported_kinds``,
    ``unsupported_nodes`` (not folded) and ``unsupported`` (``"op xN, ..."``, most nodes first),
    ``export_seconds``, ``status`` (see :data:`STATUSES`), ``import_seconds``,
    ``compile_seconds``, ``fabric`` and ``prog_len`` (the CU program length chosen with it),
    ``ir_nodes``, ``estimated_cycles`` (the timed cost model's), ``interp_steps``,
    ``interp_seconds`` and ``interp_check`` (the interpreter against the graph's own
    evaluation), ``rtl_cycles`` and ``rtl_check`` (the RTL against numpy and the interpreter),
    ``rtl_seconds`` (wall seconds of the RTL run, its build included) and, on Icarus and
    Verilator, ``rtl_build_seconds`` (the Verilog and the simulator's build, seconds when
    cached), ``lanes_bound``
    (multiply-accumulates over every lane of every CU), ``max_abs_error``, ``cosine`` and
    ``top1`` (the importer's accuracy against the float model, the worst over the outputs;
    ``top1``, the share of rows whose argmax agrees, where the last dimension has two entries or
    more).
``coverage``
    One row per model and op: ``model``, ``op``, ``count``, ``folded``, ``supported`` (the
    importer handles it, or every node of it is folded), ``ir`` (the IR op kinds it becomes,
    empty if none).

Figures: ``models``, ``partitioner`` (the command's), ``imported`` (models with no unsupported
op that imported), ``unsupported_kinds`` (distinct unsupported ops over the models run),
``failed_runs`` (checks that were not ``ok``: the command then exits 1).
"""

import pathlib
import tempfile
import time

import numpy as np

from rdakit.compiler.partition import DEFAULT_STRATEGY
from rdakit.errors import UserError
from rdakit.sim.bench.report import Report

__all__ = ["QUICK", "STATUSES", "ROW_KEYS", "export", "coverage_rows", "model_row",
           "measure_import", "measure", "write_report"]

#: The sizes of ``--quick``: every model small enough to export, import and compile in seconds.
QUICK = {
    "gpt2": dict(vocab=32, d_model=16, heads=2, layers=1, tokens=4),
    "bert": dict(vocab=32, d_model=16, heads=2, layers=1, tokens=4, batch=2),
    "mixtral": dict(vocab=32, d_model=16, heads=2, kv_heads=1, d_ff=16, experts=4, k=2,
                    layers=1, tokens=4),
    "resnet": dict(widths=(4, 8), blocks=1, classes=10, image=8, batch=4),
}

#: What a row's ``status`` says, by how far the model got.
STATUSES = {
    "unsupported": "it has ops the importer does not handle (listed in unsupported)",
    "import failed": "the importer refused it (the reason follows)",
    "does not fit": "no fabric tried holds it (the reason follows)",
    "interpreted": "compiled and run on the interpreter; the RTL run was not asked for or its "
                   "estimate is over the limit",
    "ran": "compiled and run on the interpreter and the RTL",
}

#: The keys of a ``models`` row, in table order.
ROW_KEYS = ("model", "params", "exported_nodes", "nodes", "op_kinds", "folded",
            "unsupported_kinds",
            "unsupported_nodes", "unsupported", "export_seconds", "status", "import_seconds",
            "compile_seconds", "fabric", "prog_len", "ir_nodes", "estimated_cycles",
            "interp_steps", "interp_seconds",
            "interp_check", "rtl_cycles", "rtl_check", "rtl_seconds", "rtl_build_seconds",
            "lanes_bound", "max_abs_error",
            "cosine", "top1")

#: The columns printed (the row's other keys are in the JSON).
_PRINTED = ("model", "nodes", "op_kinds", "unsupported_kinds", "unsupported_nodes", "status",
            "compile_seconds", "fabric", "prog_len", "estimated_cycles", "rtl_cycles",
            "lanes_bound", "cosine", "top1")


def export(name, *, quick=False):
    """The ``torch.export`` program of suite model ``name`` and its example inputs, at the
    :data:`QUICK` sizes or the suite's defaults (also ``rdakit bench partition``'s model graphs).
    Imports torch, an optional dependency (``rdakit[torch]``): raises ImportError without it."""
    from rdakit.compiler.frontend import models as suite  # deferred: it imports torch

    return suite.export(name, **(QUICK[name] if quick else {}))


def coverage_rows(name, coverage):
    """The ``coverage`` rows of model ``name`` from its :func:`op_coverage`, most nodes
    first."""
    ops = sorted(coverage.items(), key=lambda item: (-item[1]["count"], item[0]))
    return [{"model": name, "op": op, "count": c["count"], "folded": c.get("folded", 0),
             "supported": c["supported"], "ir": ",".join(c["ir"])} for op, c in ops]


def model_row(name, program, coverage, *, params, export_seconds):
    """The ``models`` row of a model from its exported ``program`` and its ``coverage`` (the
    import, compile and run columns ``None``: :func:`run` fills them in)."""
    missing = [(op, c["count"] - c.get("folded", 0)) for op, c in coverage.items()
               if not c["supported"]]
    missing.sort(key=lambda item: (-item[1], item[0]))
    row = dict.fromkeys(ROW_KEYS)
    row.update(
        model=name, params=params,
        exported_nodes=sum(n.op == "call_function" for n in program.graph.nodes),
        nodes=sum(c["count"] for c in coverage.values()), op_kinds=len(coverage),
        folded=sum(c.get("folded", 0) for c in coverage.values()),
        unsupported_kinds=len(missing), unsupported_nodes=sum(c for _, c in missing),
        unsupported=", ".join(f"{op} x{c}" for op, c in missing) or None,
        export_seconds=round(export_seconds, 2),
        status="unsupported" if missing else None)
    return row


def _seconds(t0):
    return round(time.perf_counter() - t0, 2)


def measure_import(row, name, program, inputs, *, choose, partitioner=DEFAULT_STRATEGY,
                   sim=None, rtl_limit=0, progress=None):
    """Import, compile and run a program whose ops are all supported; fills in ``row`` (of
    :func:`model_row`). ``choose``, ``partitioner``, ``sim`` and ``rtl_limit`` are
    :func:`measure`'s; the
    ``inputs`` of an RTL run on Icarus or Verilator are the program's own example inputs
    (``program.example_inputs``, which ``torch.export.export`` records), as for a ``.pt2``
    given to ``rdakit run``."""
    # Deferred like the rest of the front end: the importer imports torch.
    from rdakit.compiler.compile import compile_workload
    from rdakit.compiler.frontend.importer import import_program
    from rdakit.compiler.lower import LoweringError
    from rdakit.compiler.partition import PartitionError
    from rdakit.compiler.placement import PlacementError
    from rdakit.hdl.spec.params import fabric_params
    from rdakit.sim.flows import e2e
    from rdakit.sim.runtime.events import cost_model
    from rdakit.sim.runtime.job import run_job_interp

    outer = progress or (lambda stage, done=None, total=None: None)

    def progress(stage, done=None, total=None):
        outer(f"{name}: {stage}", done, total)

    progress("importing")
    t0 = time.perf_counter()
    try:
        model = import_program(program, inputs, name=name)
    except UserError as e:
        row["status"] = f"import failed: {e}"
        return
    row["import_seconds"] = _seconds(t0)
    accuracy = model.accuracy.as_dict()
    row.update({k: accuracy[k] for k in ("max_abs_error", "cosine", "top1")})
    workload = model.workload()
    row["ir_nodes"] = len(workload.graph)
    progress("choosing a fabric")
    try:
        kw = choose(workload)
    except UserError as e:
        row["status"] = f"does not fit: {e}"
        return
    params = fabric_params(**kw)
    row["fabric"] = f"{params.rows}x{params.cols}/{params.mu.words}w"
    row["prog_len"] = params.cu.prog_len
    t0 = time.perf_counter()
    try:
        job, summary = compile_workload(workload, params=params, partitioner=partitioner,
                                        progress=progress,
                                        schedule_cost=cost_model(workload, params=params,
                                                                 progress=progress))
    except (LoweringError, PlacementError, PartitionError) as e:
        row["status"] = f"does not fit: {e}"
        return
    row["compile_seconds"] = _seconds(t0)
    row["estimated_cycles"] = summary.estimated_cycles
    row["lanes_bound"] = round(e2e.roofline(params, job, (), 0, 0)["lanes_bound"], 1)
    progress("interpreter")
    t0 = time.perf_counter()
    outputs, result, _ = run_job_interp(job)
    row["interp_seconds"] = _seconds(t0)
    row["interp_steps"] = result.steps
    want = workload.graph.evaluate(workload.inputs)
    got = job.decode(outputs)           # the output buffers' words as the graph's arrays
    bad = [n for n in want if n in got and not np.array_equal(got[n], want[n])]
    bad += [n for n in want if n not in got]
    row["interp_check"] = (f"outputs {', '.join(bad)} differ from the graph's evaluation"
                           if bad else "ok")
    row["status"] = "interpreted"
    if sim is None or summary.estimated_cycles > rtl_limit:
        return
    timings = {}
    t0 = time.perf_counter()
    if e2e.in_process(sim):
        rows = e2e.run(e2e.RunSpec(workload, fabric=kw, partitioner=partitioner), sim=sim,
                       progress=progress, timings=timings)
    else:
        # A cocotb simulator runs in its own process, which takes the workload by name: the
        # program saved as a .pt2 (with its example inputs), imported there again.
        import torch  # deferred: optional (rdakit[torch]); the program is torch's already

        with tempfile.TemporaryDirectory(prefix="rdakit-models-") as tmp:
            path = pathlib.Path(tmp) / f"{name}.pt2"
            torch.export.save(program, path)
            rows = e2e.run(e2e.RunSpec(str(path), fabric=kw, partitioner=partitioner),
                           sim=sim, progress=progress, timings=timings)
    row["rtl_seconds"] = _seconds(t0)
    if timings:
        row["rtl_build_seconds"] = round(timings["verilog_s"] + timings["build_s"], 2)
    row["rtl_cycles"] = rows[-1]["cycles"]
    row["rtl_check"] = e2e.failure(rows[-1]) or "ok"
    row["status"] = "ran"


def measure(*, names, quick=False, choose=None, partitioner=DEFAULT_STRATEGY, sim=None,
            rtl_limit=0, progress=None):
    """Measure the models ``names`` (of :data:`~rdakit.compiler.frontend.models.MODELS`):
    ``(rows, coverage)``, the ``models`` and ``coverage`` tables.

    Parameters
    ----------
    names : sequence of str
        Models of the suite.
    quick : bool
        The :data:`QUICK` sizes instead of the suite's defaults.
    choose : callable
        ``choose(workload) -> fabric keyword dict``: the fabric an imported model is compiled
        for (the command's ``--fabric``, or with ``auto`` the smallest it fits); raises
        :class:`~rdakit.errors.UserError` if none holds it.
    partitioner : str
        The compiler's partitioner (:data:`~rdakit.compiler.partition.STRATEGIES`).
    sim : str or None
        The simulator of the RTL runs (:data:`rdakit.sim.flows.e2e.BACKENDS`), None for none.
    rtl_limit : int
        Estimated cycles above which a model is not run on the RTL.
    progress : callable, optional
        ``progress(stage, done=None, total=None)`` as the work goes on.
    """
    # Deferred: the model suite imports torch, an optional dependency (rdakit[torch]).
    from rdakit.compiler.frontend import aten
    from rdakit.compiler.frontend import models as suite

    progress = progress or (lambda stage, done=None, total=None: None)
    rows, coverage = [], []
    for name in names:
        progress(f"{name}: exporting")
        t0 = time.perf_counter()
        program, inputs = export(name, quick=quick)
        export_seconds = time.perf_counter() - t0
        progress(f"{name}: counting ops")
        cov = aten.op_coverage(program)
        row = model_row(name, program, cov, export_seconds=export_seconds,
                        params=suite.parameter_count(program))
        if row["status"] is None:
            measure_import(row, name, program, inputs, choose=choose, partitioner=partitioner,
                           sim=sim, rtl_limit=rtl_limit, progress=progress)
        rows.append(row)
        coverage += coverage_rows(name, cov)
    return rows, coverage


def write_report(rows, coverage, *, quick=False, partitioner=None, json_path=None,
                 report=None):
    """Print the tables of :func:`measure` and its figures (with the ``partitioner`` it was
    given, if named), and write ``json_path`` if given; returns the
    :class:`~rdakit.sim.bench.report.Report` (a new one unless ``report``)."""
    report = report or Report("models")
    what = "quick sizes" if quick else "the suite's sizes"
    report.table(f"The model suite ({what}): ops of the graph the importer walks, unsupported "
                 f"ops, and for the models with none compile time, cycles and accuracy", rows,
                 key="models", columns=list(_PRINTED),
                 notes="nodes: ops after decomposition to core aten (registered ops kept "
                       "whole); every column is in the JSON")
    for r in rows:
        if r["unsupported"]:
            report.console.print(f"{r['model']}: {r['unsupported_kinds']} unsupported op kinds "
                                 f"({r['unsupported_nodes']} nodes): {r['unsupported']}",
                                 markup=False)
        elif r["status"] not in STATUSES:
            report.console.print(f"{r['model']}: {r['status']}", markup=False)
    report.table("Op coverage: every op of every model, most nodes first", coverage,
                 key="coverage")
    report.figure("models", len(rows))
    if partitioner is not None:
        report.figure("partitioner", partitioner)
    report.figure("imported", sum(r["import_seconds"] is not None for r in rows))
    report.figure("unsupported_kinds",
                  len({c["op"] for c in coverage if not c["supported"]}))
    report.figure("failed_runs", sum(r[k] not in (None, "ok") for r in rows
                                     for k in ("interp_check", "rtl_check")))
    report.finish(json_path)
    return report
