"""Command-line options shared by several commands, each with one spelling and one parser, and
the one path that checks them before any work.

Every command's options are checked after parsing and before the command does anything:
:func:`add_check` registers a check with the command's parser and ``rdakit.cli.main`` runs
the checks (:func:`run_checks`), then the output paths (:mod:`rdakit.cli.outputs`), then the
command. A refused option is a :class:`~rdakit.errors.UserError` whose message names the
option as the user typed it (``--lanes``, not ``data_bits``); the command line exits 2.

- ``--fabric RxC``: the grid of every command that takes one (:func:`add_grid_argument`,
  parsed by :func:`parse_grid`); the old spellings ``--rows R --cols C`` and ``--mesh RxC`` are
  refused with a message naming ``--fabric``. ``--fabric auto`` (the default of the commands
  that compile a workload) tries the grids of :data:`AUTO_GRIDS`, smallest first;
- the fabric's parameters (:func:`add_fabric_arguments`, :func:`fabric_from_args`), checked
  by :func:`checked_params`: a refused value is explained by the values
  :func:`~rdakit.hdl.spec.params.fabric_params` accepts, found by asking it;
- the memory unit's parameters, one option per field of :class:`MUParams`
  (:func:`add_mu_arguments`, :func:`mu_params_from_args`);
- a system of clusters (:func:`add_system_arguments`, :func:`system_from_args`), its cluster
  count checked against :data:`~rdakit.hdl.spec.params.CLUSTERS`;
- a workload's sizes (``--size KEY=VALUE``, :func:`parse_sizes`, :func:`check_sizes`);
- numbers with a range (:func:`add_number`), refused with the option's name and the reason
  of the bound;
- how Verilator builds a fabric (``--build-jobs``, ``--opt``, ``--threads``, ``--public``:
  :func:`add_verilator_arguments`), refused without ``--sim verilator``.
"""

import argparse
import dataclasses
import enum
import functools
import inspect
import math
import re

from amaranth.utils import ceil_log2

from rdakit.compiler.placement import MAX_STEPS
from rdakit.errors import UserError
from rdakit.hdl.cluster.system import SystemParams
from rdakit.hdl.spec.params import CLUSTERS, PLASTICINE_MU, MUParams, fabric_params
from rdakit.sim.flows.e2e import VERILATOR_BUILD
from rdakit.sim.verify.runner import (
    DRIVERS,
    MAX_BUILD_JOBS,
    MAX_THREADS,
    OPT_LEVELS,
    PUBLIC_MODES,
)

__all__ = ["add_check", "run_checks", "dashed", "add_number", "parse_grid",
           "add_grid_argument", "max_grid", "AUTO", "AUTO_GRIDS", "RUN_PROG_LEN",
           "add_fabric_arguments",
           "fabric_dict", "fabric_candidates", "fabric_from_args", "checked_params",
           "fabric_params", "MU_PRESETS", "add_mu_arguments", "mu_params_from_args",
           "check_clusters", "add_system_arguments", "system_from_args", "parse_sizes",
           "check_sizes", "MAX_PLACE_STEPS", "given", "add_verilator_arguments"]


# --- the checks run before any work -----------------------------------------------------------

def add_check(parser, check):
    """Have ``check(args)`` run after parsing and before the command's work; it raises a
    UserError naming the option it refuses. Checks run in the order they were added."""
    parser.set_defaults(checks=(*(parser.get_default("checks") or ()), check))


def run_checks(args):
    """Run every check the command registered (:func:`add_check`)."""
    for check in getattr(args, "checks", ()):
        check(args)


def add_number(parser, *flags, kind=int, low=None, high=None, low_open=False, reason=None,
               **kwargs):
    """``parser.add_argument(*flags, type=kind, **kwargs)`` for a number with a range, checked
    before any work: at least ``low`` (above it with ``low_open``), at most ``high`` (``reason``
    says why the bound is there), and finite. argparse refuses what is not a number."""
    action = parser.add_argument(*flags, type=kind, **kwargs)
    option = max(flags, key=len)

    def check(args):
        value = getattr(args, action.dest)
        if value is None:
            return
        if not isinstance(value, int | float):        # argparse takes "--x=--" as []
            raise UserError(f"{option} must be a number, not {value!r}")
        if not math.isfinite(value):
            raise UserError(f"{option} must be a finite number, not {value}")
        if low is not None and (value < low or (low_open and value == low)):
            raise UserError(f"{option} must be {'above' if low_open else 'at least'} {low}, "
                            f"not {value}")
        if high is not None and value > high:
            why = f" ({reason})" if reason else ""
            raise UserError(f"{option} must be at most {high}{why}, not {value}")
    add_check(parser, check)
    return action


#: The annealing steps a placement may take (``--place-steps``): the compiler's own bound.
MAX_PLACE_STEPS = MAX_STEPS


# --- the Verilator build ----------------------------------------------------------------------

_VERILATOR_OPTIONS = ("build_jobs", "opt", "threads", "public", "driver")


def add_verilator_arguments(parser):
    """The options of the Verilator build of a fabric (``docs/performance-model.md``,
    "Verilator at scale"); after the checks, ``args.verilator_build`` is the
    :class:`~rdakit.sim.verify.runner.VerilatorBuild` they give (the flows' own,
    :data:`~rdakit.sim.flows.e2e.VERILATOR_BUILD`, for those not given). Given with another
    ``--sim`` than verilator, they are refused."""
    g = parser.add_argument_group("Verilator build (docs/performance-model.md, Verilator at "
                                  "scale); each build is cached by its options")
    add_number(g, "--build-jobs", low=1, high=MAX_BUILD_JOBS, metavar="N",
               reason="parallel C++ compile jobs",
               help="parallel C++ compile jobs of the build (default: one a core)")
    g.add_argument("--opt", choices=OPT_LEVELS,
                   help="C++ optimisation level of the build: 0 builds fastest, 1 to 3 "
                        "simulate faster, s is Verilator's own (-Os) (default: 0)")
    add_number(g, "--threads", low=1, high=MAX_THREADS, metavar="N",
               reason="threads of the simulation",
               help="Verilator --threads: simulate on N threads (default: 1)")
    g.add_argument("--public", choices=PUBLIC_MODES,
                   help="signals cocotb can reach: all (--public-flat-rw) or ports (the top "
                        "module's only, all a run needs, which lets Verilator optimise the "
                        f"rest) (default: {VERILATOR_BUILD.public})")
    g.add_argument("--driver", choices=DRIVERS,
                   help="how the run drives the build: direct (a harness executable, host "
                        "transfers and waits inside it, no cocotb) or cocotb (its testbench; "
                        f"what --waves uses) (default: {VERILATOR_BUILD.driver})")

    def check(args):
        given_ = [o for o in _VERILATOR_OPTIONS if getattr(args, o) is not None]
        if given_ and args.sim != "verilator":
            names = ", ".join(dashed(o) for o in given_)
            raise UserError(f"{names} set{'s' if len(given_) == 1 else ''} how Verilator "
                            f"builds the fabric; {'it needs' if len(given_) == 1 else 'they need'}"
                            f" --sim verilator, not --sim {args.sim}")
        given_kw = {"jobs": args.build_jobs, "opt": args.opt, "threads": args.threads,
                    "public": args.public, "driver": args.driver}
        try:
            args.verilator_build = dataclasses.replace(
                VERILATOR_BUILD, **{k: v for k, v in given_kw.items() if v is not None})
        except ValueError as e:
            raise UserError(str(e)) from None
    add_check(parser, check)


# --- the grid ---------------------------------------------------------------------------------

_GRID = re.compile(r"(\d+)x(\d+)")

#: ``--fabric auto``: the commands that compile a workload try these grids, smallest first
#: (and, unless ``--mu-words`` is given, MUs from the default size up, doubling) and take the
#: first on which the compiler fits the workload.
AUTO = "auto"
AUTO_GRIDS = ((2, 2), (2, 3), (3, 3), (3, 4), (4, 4))


def parse_grid(text, option="--fabric"):
    """``"RxC"`` -> ``(rows, cols)``, the one parser of a grid on the command line.

    Raises
    ------
    UserError
        If ``text`` is not two decimal numbers joined by ``x``; the message names ``option``.
    """
    m = _GRID.fullmatch(text)
    if not m:
        raise UserError(f"{option} must be ROWSxCOLS like 4x4, not {text!r}")
    return int(m.group(1)), int(m.group(2))


class _Replaced(argparse.Action):
    """An old spelling of the grid option: refused (exit 2) with a message naming ``--fabric``.

    Takes an optional value so that ``--rows 3`` and ``--mesh 4x4`` reach it whole."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?",
                         default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == "--mesh":
            example = values if isinstance(values, str) and _GRID.fullmatch(values) else "4x4"
            parser.error(f"--mesh was replaced by --fabric RxC (rows x columns): "
                         f"use --fabric {example}")
        parser.error(f"{option_string} was replaced by --fabric RxC (rows x columns), e.g. "
                     f"--fabric 3x3 for --rows 3 --cols 3")


def add_grid_argument(parser, *, default=None, help="grid rows x columns"):
    """Add ``--fabric RxC`` (required when there is no ``default``) and the refused old
    spellings ``--rows``, ``--cols`` and ``--mesh`` to ``parser`` (a parser or a group)."""
    if default is None:
        parser.add_argument("--fabric", required=True, metavar="RxC", help=help)
    else:
        parser.add_argument("--fabric", default=default, metavar="RxC",
                            help=f"{help} (default: %(default)s)")
    for old in ("--rows", "--cols", "--mesh"):
        parser.add_argument(old, action=_Replaced)


# --- the fabric -------------------------------------------------------------------------------

#: ``rdakit run`` and ``rdakit compile``'s program length unless --prog-len says otherwise:
#: compiled programs are hundreds of instructions long (the fabric commands' default, 64,
#: suits hand-written kernels).
RUN_PROG_LEN = 2048

#: The keywords of :func:`fabric_params` that are options of their own (``--lanes`` for
#: ``lanes``, ...); ``rows`` and ``cols`` are ``--fabric``.
_FABRIC_KEYS = ("layout", "lanes", "prog_len", "local_words", "mu_words", "block_words",
                "max_buffers", "weight_bits", "alloc_mode", "refcount", "noc_depth",
                "noc_queues")


def dashed(key):
    """The option of parameter ``key`` as the user types it: ``--link-width`` for
    ``link_width``."""
    return "--" + key.replace("_", "-")


def _option(key):
    """The option of :func:`fabric_params`'s keyword ``key`` as the user types it."""
    return "--fabric" if key in ("rows", "cols", "grid") else dashed(key)


def add_fabric_arguments(parser, *, default="2x2", auto=False, check=True):
    """Add the fabric's options and, with ``check``, their check before any work (a command
    whose defaults come from elsewhere, like a board's preset, adds its own).

    With ``auto``, ``--fabric`` takes ``auto`` (the default) and ``--mu-words`` left out
    lets the command grow the MU (:func:`fabric_candidates`)."""
    g = parser.add_argument_group("fabric (docs/fabric.md)")
    if auto:
        add_grid_argument(g, default=AUTO, help="grid rows x columns, or auto: the smallest of "
                          + ", ".join(f"{r}x{c}" for r, c in AUTO_GRIDS)
                          + " (and MU size) on which the workload fits")
    else:
        add_grid_argument(g, default=default)
    g.add_argument("--layout", help="tile kinds, rows separated by '/', e.g. CMC/MCM "
                                    "(default: checkerboard, CU at (0, 0))")
    g.add_argument("--lanes", type=int, default=4, help="SIMD lanes of a CU (default: 4)")
    g.add_argument("--prog-len", type=int, default=64, action=_Given,
                   help="CU program length (default: 64"
                        + (", or with --fabric auto or --mu-words left out the smallest power "
                           "of two from the command's default that fits)" if auto else ")"))
    g.add_argument("--local-words", type=int, default=64,
                   help="CU local buffer, vector words (default: 64)")
    g.add_argument("--mu-words", type=int, default=None if auto else 1024,
                   help="MU scratchpad, vector words (default: 1024"
                        + (", or with --fabric auto the smallest that fits)" if auto else ")"))
    g.add_argument("--block-words", type=int, default=16, help="MU block size (default: 16)")
    g.add_argument("--max-buffers", type=int, default=16, help="MU buffer slots (default: 16)")
    g.add_argument("--weight-bits", type=int, default=8, help="MU weight bits (default: 8)")
    g.add_argument("--alloc-mode", choices=["virtual", "reserve", "single"], default="virtual")
    g.add_argument("--refcount", choices=["weighted", "counter"], default="weighted")
    g.add_argument("--noc-queues", choices=["voq", "fifo"], default="voq")
    g.add_argument("--noc-depth", type=int, default=2)
    if check:
        add_check(parser, functools.partial(_check_fabric, parser, auto))


class _Given(argparse.Action):
    """Stores the option's value and records that the user gave it (``args.given``, a set of
    destinations): a value left at its default may be chosen by the command."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


def given(args, key):
    """Whether the user gave the option of ``key`` (``prog_len``) on the command line."""
    return key in getattr(args, "given", ())


def _defaults(parser):
    """The keyword arguments of :func:`fabric_params` of ``parser``'s defaults (the command's
    own, e.g. ``rdakit run``'s program length)."""
    kw = {k: parser.get_default(k) for k in _FABRIC_KEYS}
    kw["mu_words"] = _MU_WORDS if kw["mu_words"] is None else kw["mu_words"]
    grid = parser.get_default("fabric")
    kw["rows"], kw["cols"] = AUTO_GRIDS[0] if grid in (None, AUTO) else parse_grid(grid)
    return kw


#: The MU size of a fabric when nothing says otherwise (:func:`fabric_params`'s default).
_MU_WORDS = inspect.signature(fabric_params).parameters["mu_words"].default


def _check_fabric(parser, auto, args):
    if args.fabric == AUTO and not auto:
        raise UserError("--fabric must be ROWSxCOLS like 4x4, not 'auto' (auto chooses the "
                        "fabric of a workload: rdakit compile, run and inspect)")
    args.fabric_defaults = _defaults(parser)
    if getattr(args, "clusters", None) is not None:
        return                                  # a system: system_from_args checks it
    fabric_candidates(args)


def fabric_dict(args, *, cluster_bits=0, coord_bits=None):
    """The keyword arguments of :func:`fabric_params` given by the parsed options (JSON-able,
    so they can cross into a cocotb process); a UserError if ``--fabric`` is malformed.
    ``--fabric auto`` gives the first grid it tries and an ``--mu-words`` left out the default
    MU."""
    rows, cols = AUTO_GRIDS[0] if args.fabric == AUTO else parse_grid(args.fabric)
    return dict(rows=rows, cols=cols, layout=args.layout,
                lanes=args.lanes, prog_len=args.prog_len, local_words=args.local_words,
                mu_words=_MU_WORDS if args.mu_words is None else args.mu_words,
                block_words=args.block_words,
                max_buffers=args.max_buffers, weight_bits=args.weight_bits,
                alloc_mode=args.alloc_mode, refcount=args.refcount, noc_depth=args.noc_depth,
                noc_queues=args.noc_queues, cluster_bits=cluster_bits, coord_bits=coord_bits)


def fabric_candidates(args):
    """The fabrics (keyword dicts of :func:`fabric_params`) a command may compile for, in the
    order to try them: the one the options give, or with ``--fabric auto`` the grids of
    :data:`AUTO_GRIDS` and with ``--mu-words`` left out MUs from the default size up to the
    largest :func:`fabric_params` accepts, each doubling, grid by grid. When the command
    searches (``--fabric auto`` or ``--mu-words`` left out) and ``--prog-len`` is not given,
    all of them at the command's program length, then again at each doubling of it up to the
    longest :func:`fabric_params` accepts (:func:`~rdakit.cli.compile.choose_fabric` tries a
    longer program only where the shorter one was too short). Candidates that are not valid
    fabrics are left out; a UserError naming the option if none is valid."""
    first = fabric_dict(args)
    if args.fabric != AUTO:
        grids = [(first["rows"], first["cols"])]
    elif args.layout is not None:               # a layout names its grid
        grids = [(args.layout.count("/") + 1, len(args.layout.split("/")[0]))]
        first.update(rows=grids[0][0], cols=grids[0][1])
    else:
        grids = AUTO_GRIDS
    words = [first["mu_words"]]
    if args.mu_words is None:
        while _error(fabric_params, {**first, "mu_words": 2 * words[-1]}) is None:
            words.append(2 * words[-1])
    lengths = [first["prog_len"]]
    if (args.fabric == AUTO or args.mu_words is None) and not given(args, "prog_len"):
        while _error(fabric_params, {**first, "prog_len": 2 * lengths[-1]}) is None:
            lengths.append(2 * lengths[-1])
    out = [kw for n in lengths for rows, cols in grids for w in words
           if _error(fabric_params, kw := {**first, "rows": rows, "cols": cols,
                                           "mu_words": w, "prog_len": n}) is None]
    if not out:
        checked_params(fabric_params, first, _base(args, first), _option)
    return out


def _base(args, kw):
    """What :func:`checked_params` compares ``kw`` with: the command's defaults (with
    ``kw``'s cluster and coordinate bits, which the command derives)."""
    base = getattr(args, "fabric_defaults", None) or kw
    return {**base, "cluster_bits": kw["cluster_bits"], "coord_bits": kw["coord_bits"]}


def fabric_from_args(args, *, cluster_bits=0, coord_bits=None):
    """The :class:`FabricParams` of the parsed options (with ``cluster_bits`` for a cluster of
    a system, and ``coord_bits`` wider than the grid needs if asked), or a UserError naming
    the option that is refused."""
    if args.fabric == AUTO:
        raise UserError("--fabric auto chooses a fabric for a workload; this command needs "
                        "--fabric RxC")
    kw = fabric_dict(args, cluster_bits=cluster_bits, coord_bits=coord_bits)
    return checked_params(fabric_params, kw, _base(args, kw), _option)


# --- explaining a refused parameter by what the constructor accepts ---------------------------

def _error(make, kw):
    try:
        make(**kw)
    except (TypeError, ValueError) as e:
        return e
    return None


def _accepted(make, kw, key):
    """Say which integers ``make`` accepts for ``key`` with the rest of ``kw``: "a power of
    two from 1 to 16", "an integer from 1 to 64", or ``None`` if it accepts none. Asked of
    ``make`` itself (the parameter's one definition), on 0 to 64 and the powers of two, the
    upper end of a range found by bisection."""
    def ok(v):
        return _error(make, {**kw, key: v}) is None
    small = [v for v in range(65) if ok(v)]
    powers = [1 << k for k in range(41) if ok(1 << k)]
    valid = sorted(set(small) | set(powers))
    if not valid:
        return None
    low, high = valid[0], valid[-1]
    only_powers = all(v & (v - 1) == 0 for v in small)
    if not only_powers and high == max(small):
        a, b = high, 2 * high + 1            # high accepted; find the last before a refusal
        while ok(b) and b < 1 << 40:
            a, b = b, 2 * b
        while b - a > 1:
            m = (a + b) // 2
            a, b = (m, b) if ok(m) else (a, m)
        high = a
    kind = "a power of two" if only_powers else "an integer"
    return f"{kind} at least {low}" if high >= 1 << 40 else f"{kind} from {low} to {high}"


def _explain(make, key, kw, base, option, context=""):
    """The message of ``key``'s value in ``kw`` refused by ``make`` (the rest as in
    ``base``), naming its option."""
    opt = option(key)
    if key == "grid":
        return _explain_grid(make, kw, base, opt)
    value = kw[key]
    accepted = _accepted(make, base, key) if isinstance(value, int) else None
    if accepted is not None:
        return f"{opt} must be {accepted}{context}, not {value!r}"
    e = _error(make, {**base, key: value})
    text = str(e) if e else ""
    if text.startswith(f"{key} "):
        return f"{opt}{text[len(key):]}{context}"
    return f"{opt} {value!r} is refused{context}: {text}"


@functools.cache
def max_grid():
    """The most rows (and columns) a fabric may have, as :func:`fabric_params` says."""
    return _largest_grid(fabric_params, ())


def _largest_grid(make, base):
    base = dict(base)
    return max((n for n in range(1, 65) if _error(make, {**base, "rows": n, "cols": n,
                                                          "layout": None}) is None), default=0)


def _explain_grid(make, kw, base, opt):
    text = f"{kw['rows']}x{kw['cols']}"
    high = _largest_grid(make, base)
    if not (1 <= kw["rows"] <= high and 1 <= kw["cols"] <= high):
        return f"{opt} must be ROWSxCOLS with 1 to {high} rows and columns, not {text!r}"
    if kw["rows"] * kw["cols"] < 2:
        return f"{opt} must have room for a CU and an MU (two tiles or more), not {text!r}"
    e = _error(make, {**base, "rows": kw["rows"], "cols": kw["cols"]})
    return f"{opt} {text} is refused: {e}"


def checked_params(make, kw, base, option):
    """``make(**kw)``, or a UserError that names the option at fault.

    ``base`` is what the command would use without options; the keys of ``kw`` that differ
    from it are what the user gave. The message names the first of them that ``make``
    refuses alone (on ``base``), or else the first of a pair that it refuses together, with
    the values it accepts (:func:`_accepted`); ``option(key)`` is the option of a keyword.
    """
    e = _error(make, kw)
    if e is None:
        return make(**kw)
    given = [k for k in kw if k not in ("rows", "cols") and kw[k] != base.get(k)]
    if "rows" in kw and (kw["rows"], kw["cols"]) != (base.get("rows"), base.get("cols")):
        given.insert(0, "grid")

    def with_(keys):
        out = dict(base)
        for k in keys:
            out.update({"rows": kw["rows"], "cols": kw["cols"]} if k == "grid" else {k: kw[k]})
        return out
    for key in given:
        if _error(make, with_([key])) is not None:
            raise UserError(_explain(make, key, with_([key]), with_([]), option))
    for key in given:
        for other in given:
            if other != key and _error(make, with_([key, other])) is not None:
                value = (f"{kw['rows']}x{kw['cols']}" if other == "grid" else kw[other])
                raise UserError(_explain(make, key, with_([key, other]), with_([other]),
                                         option, context=f" with {option(other)} {value}"))
    raise UserError(f"the options do not go together: {e}")


# --- the memory unit --------------------------------------------------------------------------

#: Named starting points of ``--preset``.
MU_PRESETS = {"default": MUParams(), "plasticine": PLASTICINE_MU}


def add_mu_arguments(parser, cls=MUParams, *, presets=MU_PRESETS):
    """Add one ``--option`` per field of the parameter dataclass ``cls`` (and ``--preset``),
    checked before any work (:func:`mu_params_from_args`)."""
    group = parser.add_argument_group(f"{cls.__name__} parameters (see docs/memory-unit.md)")
    if presets:
        group.add_argument("--preset", choices=sorted(presets), default="default",
                           help="start from a named parameter set (default: %(default)s)")
    for field in dataclasses.fields(cls):
        default = field.default
        kind = type(default) if default is not None else int
        if isinstance(default, enum.Enum):
            choices = [m.value for m in type(default)]
            group.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name,
                               choices=choices, default=None,
                               help=f"default: {default.value}")
        else:
            group.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, type=kind,
                               default=None, metavar="N",
                               help=f"default: {'derived' if default is None else default}")
    add_check(parser, lambda args: mu_params_from_args(args, cls, presets=presets))


def mu_params_from_args(args, cls=MUParams, *, presets=MU_PRESETS):
    """Build the parameter set from parsed arguments, or raise a UserError naming the option
    that is refused."""
    base = presets[args.preset] if presets else cls()
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
               if getattr(args, f.name, None) is not None}
    return checked_params(base.replace, changes, {}, dashed)


# --- systems of clusters ----------------------------------------------------------------------

def check_clusters(n):
    """``n`` if it is a cluster count a system may have (:data:`CLUSTERS`), else a UserError."""
    if not isinstance(n, int) or n not in CLUSTERS:
        raise UserError(f"--clusters must be from {CLUSTERS.start} to {CLUSTERS.stop - 1}, "
                        f"not {n!r}")
    return n


def add_system_arguments(parser, *, default_fabric="2x2"):
    """The options of :func:`system_from_args`: every cluster's fabric (``--fabric RxC`` and
    the other fabric options), ``--clusters``, ``--link-width``, ``--link-latency``,
    ``--link-depth`` and ``--bridge X,Y``; checked before any work."""
    add_fabric_arguments(parser, default=default_fabric)
    g = parser.add_argument_group("system of clusters (docs/clusters.md)")
    g.add_argument("--clusters", type=int, default=2, help="number of clusters (default: 2)")
    g.add_argument("--link-width", type=int,
                   help="wires of each inter-cluster link (default: a quarter of a request)")
    g.add_argument("--link-latency", type=int, default=20,
                   help="cycles of each link's wire delay (default: 20)")
    g.add_argument("--link-depth", type=int,
                   help="receive queue of each link, packets (default: enough for full rate)")
    g.add_argument("--bridge", metavar="X,Y",
                   help="the bridge tile of every cluster (default: the last tile)")
    add_check(parser, system_from_args)


def system_from_args(args):
    """The :class:`~rdakit.hdl.cluster.system.SystemParams` of the parsed options, or a UserError
    naming the problem."""
    n = check_clusters(args.clusters)
    params = fabric_from_args(args, cluster_bits=max(1, ceil_log2(n)))
    bridge = None
    if args.bridge is not None:
        m = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", args.bridge)
        if not m:
            raise UserError(f"--bridge must be X,Y like 1,0, not {args.bridge!r}")
        bridge = (int(m.group(1)), int(m.group(2)))
    kw = dict(fabric=params, clusters=n, link_width=args.link_width,
              link_latency=args.link_latency, link_depth=args.link_depth, bridge=bridge)
    base = dict(kw, link_width=None, link_latency=20, link_depth=None, bridge=None)
    return checked_params(SystemParams, kw, base, dashed)


# --- a workload's sizes -----------------------------------------------------------------------

def parse_sizes(items):
    """``["batch=4", "sizes=8,16,8"]`` -> ``{"batch": 4, "sizes": (8, 16, 8)}``."""
    sizes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--size must be KEY=VALUE, not {item!r}")
        try:
            parts = [int(v) for v in value.split(",")]
        except ValueError:
            raise UserError(f"--size {key} must be an integer or integers separated by commas, "
                            f"not {value!r}") from None
        sizes[key] = tuple(parts) if "," in value else parts[0]
    return sizes


def check_sizes(workload, sizes, candidates):
    """Refuse, before anything is built, sizes no fabric of ``candidates`` could hold.

    A built-in workload's sizes (``--size KEY=VALUE``) must be options of its builder (its
    signature says which), not negative, and at most the elements of the largest MU buffer of
    the candidates: every size of a built-in workload is a dimension of one of its tensors
    (``seed`` aside, which must fit 32 bits). A graph file takes no sizes."""
    from rdakit.compiler.workloads import WORKLOADS  # deferred: the compiler is heavy

    if workload not in WORKLOADS:
        if sizes:
            raise UserError("--size applies to built-in workloads, not to graph files")
        return
    keys = list(inspect.signature(WORKLOADS[workload]).parameters)
    params = [fabric_params(**kw) for kw in candidates]
    limit = max(p.mu.max_buffer_words * p.cu.lanes for p in params)
    words = max(p.mu.max_buffer_words for p in params)
    for key, value in sizes.items():
        if key not in keys:
            raise UserError(f"--size {key} is not a size of {workload}, whose sizes are "
                            f"{', '.join(keys)}")
        for v in value if isinstance(value, tuple) else (value,):
            if key == "seed":
                if not 0 <= v < 1 << 32:
                    raise UserError(f"--size seed must be from 0 to {(1 << 32) - 1}, not {v}")
            elif v < 0:
                raise UserError(f"--size {key} must not be negative, not {v}")
            elif v > limit:
                raise UserError(f"--size {key} must be at most {limit}: it is a dimension of a "
                                f"tensor of {workload}, and the largest MU buffer holds {words} "
                                f"words of {limit // words} elements, not {v}")
