"""Command-line options shared by several commands, each with one spelling and one parser.

- ``--fabric RxC``: the grid of every command that takes one (:func:`add_grid_argument`,
  parsed by :func:`parse_grid`); the old spellings ``--rows R --cols C`` and ``--mesh RxC`` are
  refused with a message naming ``--fabric``;
- the fabric's parameters (:func:`add_fabric_arguments`, :func:`fabric_from_args`);
- the memory unit's parameters, one option per field of :class:`MUParams`
  (:func:`add_mu_arguments`, :func:`mu_params_from_args`);
- a system of clusters (:func:`add_system_arguments`, :func:`system_from_args`), its cluster
  count checked against :data:`~rdakit.hdl.spec.params.CLUSTERS`;
- a workload's sizes (``--size KEY=VALUE``, :func:`parse_sizes`).
"""

import argparse
import dataclasses
import enum
import re

from amaranth.utils import ceil_log2

from rdakit.errors import UserError
from rdakit.hdl.cluster.system import SystemParams
from rdakit.hdl.spec.params import CLUSTERS, PLASTICINE_MU, MUParams, fabric_params

__all__ = ["parse_grid", "add_grid_argument", "add_fabric_arguments", "fabric_dict",
           "fabric_from_args", "fabric_params", "MU_PRESETS", "add_mu_arguments",
           "mu_params_from_args", "check_clusters", "add_system_arguments", "system_from_args",
           "parse_sizes"]

_GRID = re.compile(r"(\d+)x(\d+)")


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


def add_fabric_arguments(parser, *, default="2x2"):
    g = parser.add_argument_group("fabric (docs/fabric.md)")
    add_grid_argument(g, default=default)
    g.add_argument("--layout", help="tile kinds, rows separated by '/', e.g. CMC/MCM "
                                    "(default: checkerboard, CU at (0, 0))")
    g.add_argument("--lanes", type=int, default=4, help="SIMD lanes of a CU (default: 4)")
    g.add_argument("--prog-len", type=int, default=64, help="CU program length (default: 64)")
    g.add_argument("--local-words", type=int, default=64,
                   help="CU local buffer, vector words (default: 64)")
    g.add_argument("--mu-words", type=int, default=1024,
                   help="MU scratchpad, vector words (default: 1024)")
    g.add_argument("--block-words", type=int, default=16, help="MU block size (default: 16)")
    g.add_argument("--max-buffers", type=int, default=16, help="MU buffer slots (default: 16)")
    g.add_argument("--weight-bits", type=int, default=8, help="MU weight bits (default: 8)")
    g.add_argument("--alloc-mode", choices=["virtual", "reserve", "single"], default="virtual")
    g.add_argument("--refcount", choices=["weighted", "counter"], default="weighted")
    g.add_argument("--noc-queues", choices=["voq", "fifo"], default="voq")
    g.add_argument("--noc-depth", type=int, default=2)


def fabric_dict(args, *, cluster_bits=0, coord_bits=None):
    """The keyword arguments of :func:`fabric_params` given by the parsed options (JSON-able,
    so they can cross into a cocotb process); a UserError if ``--fabric`` is malformed."""
    rows, cols = parse_grid(args.fabric)
    return dict(rows=rows, cols=cols, layout=args.layout,
                lanes=args.lanes, prog_len=args.prog_len, local_words=args.local_words,
                mu_words=args.mu_words, block_words=args.block_words,
                max_buffers=args.max_buffers, weight_bits=args.weight_bits,
                alloc_mode=args.alloc_mode, refcount=args.refcount, noc_depth=args.noc_depth,
                noc_queues=args.noc_queues, cluster_bits=cluster_bits, coord_bits=coord_bits)


def fabric_from_args(args, *, cluster_bits=0, coord_bits=None):
    """The :class:`FabricParams` of the parsed options (with ``cluster_bits`` for a cluster of
    a system, and ``coord_bits`` wider than the grid needs if asked), or a UserError naming
    the problem."""
    try:
        return fabric_params(**fabric_dict(args, cluster_bits=cluster_bits,
                                           coord_bits=coord_bits))
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None


#: Named starting points of ``--preset``.
MU_PRESETS = {"default": MUParams(), "plasticine": PLASTICINE_MU}


def add_mu_arguments(parser, cls=MUParams, *, presets=MU_PRESETS):
    """Add one ``--option`` per field of the parameter dataclass ``cls`` (and ``--preset``)."""
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


def mu_params_from_args(args, cls=MUParams, *, presets=MU_PRESETS):
    """Build the parameter set from parsed arguments, or raise UserError naming the problem."""
    base = presets[args.preset] if presets else cls()
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
               if getattr(args, f.name, None) is not None}
    try:
        return base.replace(**changes)
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None


def check_clusters(n):
    """``n`` if it is a cluster count a system may have (:data:`CLUSTERS`), else a UserError."""
    if not isinstance(n, int) or n not in CLUSTERS:
        raise UserError(f"--clusters must be from {CLUSTERS.start} to {CLUSTERS.stop - 1}, "
                        f"not {n!r}")
    return n


def add_system_arguments(parser, *, default_fabric="2x2"):
    """The options of :func:`system_from_args`: every cluster's fabric (``--fabric RxC`` and
    the other fabric options), ``--clusters``, ``--link-width``, ``--link-latency``,
    ``--link-depth`` and ``--bridge X,Y``."""
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
    try:
        return SystemParams(params, clusters=n, link_width=args.link_width,
                            link_latency=args.link_latency, link_depth=args.link_depth,
                            bridge=bridge)
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None


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
