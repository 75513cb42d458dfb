"""Command-line options that describe a fabric, shared by every command that needs one."""

import re

from rdakit.hdl.spec.params import fabric_params

__all__ = ["add_fabric_arguments", "fabric_dict", "fabric_from_args", "fabric_params"]


def add_fabric_arguments(parser, *, default="2x2"):
    g = parser.add_argument_group("fabric (docs/fabric.md)")
    g.add_argument("--fabric", default=default, metavar="RxC",
                   help="grid rows x columns (default: %(default)s)")
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
    from rdakit.errors import UserError

    m = re.fullmatch(r"(\d+)x(\d+)", args.fabric)
    if not m:
        raise UserError(f"--fabric must be ROWSxCOLS like 4x4, not {args.fabric!r}")
    return dict(rows=int(m.group(1)), cols=int(m.group(2)), layout=args.layout,
                lanes=args.lanes, prog_len=args.prog_len, local_words=args.local_words,
                mu_words=args.mu_words, block_words=args.block_words,
                max_buffers=args.max_buffers, weight_bits=args.weight_bits,
                alloc_mode=args.alloc_mode, refcount=args.refcount, noc_depth=args.noc_depth,
                noc_queues=args.noc_queues, cluster_bits=cluster_bits, coord_bits=coord_bits)


def fabric_from_args(args, *, cluster_bits=0, coord_bits=None):
    """The :class:`FabricParams` of the parsed options (with ``cluster_bits`` for a cluster of
    a system, and ``coord_bits`` wider than the grid needs if asked), or a UserError naming
    the problem."""
    from rdakit.errors import UserError

    try:
        return fabric_params(**fabric_dict(args, cluster_bits=cluster_bits,
                                           coord_bits=coord_bits))
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
