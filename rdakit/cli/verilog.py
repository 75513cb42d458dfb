"""``rdakit verilog COMPONENT``: the Verilog of a component with its parameters as options.

Components: ``mu`` (the memory unit), ``router`` (one NoC router), ``noc`` (an R x C mesh, or
the request and response meshes side by side), ``fabric`` (a whole fabric with its host port)
and ``system`` (clusters joined by bridges).
"""

import re

from rdakit.cli.options import (
    add_check,
    add_fabric_arguments,
    add_grid_argument,
    add_mu_arguments,
    add_system_arguments,
    dashed,
    fabric_from_args,
    fabric_params,
    max_grid,
    mu_params_from_args,
    parse_grid,
    system_from_args,
)
from rdakit.cli.outputs import add_output
from rdakit.errors import UserError
from rdakit.files import atomic_write
from rdakit.hdl.cluster.system import System
from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.memory.unit import MemoryUnit
from rdakit.hdl.noc.mesh import DualMesh, Mesh
from rdakit.hdl.noc.router import Router, check_mesh_params
from rdakit.hdl.spec.packets import mu_request_layout, mu_response_layout
from rdakit.hdl.spec.params import MUParams
from rdakit.sim.verify.runner import generate_verilog, lint_waiver_header

__all__ = ["register", "write_verilog", "add_output_arguments"]

PAYLOADS = ("mu-request", "mu-response")


def write_verilog(args, component, what):
    """Write ``component``'s Verilog to ``args.output`` (``-``: standard output) as module
    ``args.name``, headed by the Verilator lint waivers with their reasons."""
    text = lint_waiver_header() + generate_verilog(component, name=args.name)
    if args.output == "-":
        print(text, end="")
    else:
        atomic_write(args.output, text)
        print(f"wrote {args.output}: module {args.name}, {len(text.splitlines())} lines "
              f"({what})")
    return 0


def _check_name(args):
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_$]*", args.name):
        raise UserError(f"--name must be a Verilog identifier (a letter or _, then letters, "
                        f"digits, _ or $), not {args.name!r}")


def add_output_arguments(parser, default_name="top", *, name_help="name of the top module"):
    """``-o FILE`` (``-``: standard output; checked before any work) and ``--name``."""
    add_output(parser, "-o", "--output", required=True, metavar="FILE", dash=True,
               help="Verilog file to write ('-' for standard output)")
    parser.add_argument("--name", default=default_name,
                        help=f"{name_help} (default: %(default)s)")
    add_check(parser, _check_name)


# --- mu ---------------------------------------------------------------------------------------

def _check_mu_id(args):
    bits = mu_params_from_args(args).mu_id_bits
    if not 0 <= args.mu_id < 1 << bits:
        raise UserError(f"--mu-id must be from 0 to {(1 << bits) - 1} (the MU IDs of "
                        f"--mu-id-bits {bits}), not {args.mu_id}")


def _verilog_mu(args):
    params = mu_params_from_args(args)
    mu = _mesh_errors(lambda: MemoryUnit(params, mu_id=args.mu_id))
    return write_verilog(args, mu, f"{params.alloc_mode.value}, {params.refcount.value}, "
                                   f"{params.words} words")


# --- router and noc ---------------------------------------------------------------------------

def _widest_packet():
    """The widest packet of any fabric's memory network (the most lanes fabric_params takes):
    the bound of ``--payload``'s width."""
    lanes = max(n for n in (1 << k for k in range(8)) if not _refused(lambda n=n: fabric_params(
        lanes=n)))
    mu = fabric_params(lanes=lanes).mu
    return max(mu_request_layout(mu).size, mu_response_layout(mu).size)


def _refused(make):
    try:
        make()
    except (TypeError, ValueError):
        return True
    return False


def _payload_shape(text):
    """``mu-request``/``mu-response`` (the memory network's packets, default MU parameters) or
    a width in bits, at most the widest packet of any fabric."""
    if text == "mu-request":
        return mu_request_layout(MUParams())
    if text == "mu-response":
        return mu_response_layout(MUParams())
    try:
        width = int(text)
    except ValueError:
        raise UserError(f"--payload must be one of {', '.join(PAYLOADS)} or a width in bits, "
                        f"not {text!r}") from None
    widest = _widest_packet()
    if not 1 <= width <= widest:
        raise UserError(f"--payload must be a width from 1 to {widest} bits (the widest packet "
                        f"of any fabric), not {width}")
    return width


def _mesh_errors(make):
    """``make()``, its TypeError or ValueError a UserError naming the option (``--fabric``
    for the grid)."""
    try:
        return make()
    except (TypeError, ValueError) as e:
        text = str(e)
        key = text.split(" ", 1)[0]
        option = "--fabric" if key in ("rows", "cols") else dashed(key)
        raise UserError(f"{option}{text[len(key):]}") from None


def _check_mesh(args):
    """The grid, queue and payload options of ``verilog router`` and ``verilog noc``, before
    anything is built: the grid at most the largest fabric's (a larger mesh takes minutes to
    generate, and no fabric uses it)."""
    rows, cols = parse_grid(args.fabric)
    high = max_grid()
    if not (1 <= rows <= high and 1 <= cols <= high):
        raise UserError(f"--fabric must be ROWSxCOLS with 1 to {high} rows and columns (the "
                        f"largest fabric), not {args.fabric!r}")
    _mesh_errors(lambda: check_mesh_params(rows=rows, cols=cols, coord_bits=args.coord_bits,
                                           depth=args.depth, queues=args.queues,
                                           counter_bits=args.counter_bits))
    _payload_shape(args.payload)
    if getattr(args, "x", None) is not None:
        for name, value, bound in (("--x", args.x, cols), ("--y", args.y, rows)):
            if not 0 <= value < bound:
                raise UserError(f"{name} must be from 0 to {bound - 1} on a {rows}x{cols} "
                                f"mesh, not {value}")


def _add_noc_arguments(p):
    p.add_argument("--payload", default="mu-request", metavar="KIND",
                   help=f"flit payload: {', '.join(PAYLOADS)} (default MU parameters) or a "
                        f"width in bits (default: %(default)s)")
    p.add_argument("--coord-bits", type=int, default=None, metavar="N",
                   help="width of each coordinate (default: fewest that hold the mesh)")
    p.add_argument("--depth", type=int, default=2, metavar="N",
                   help="entries per input queue (default: %(default)s)")
    p.add_argument("--queues", choices=("voq", "scan", "fifo"), default="voq",
                   help="voq: a FIFO per (input, output) pair; scan: the same, and the oldest "
                        "flit whose next queue has room leaves first; fifo: one FIFO per "
                        "input (default: %(default)s)")
    p.add_argument("--counter-bits", type=int, default=32, metavar="N",
                   help="width of the per-router counters (default: %(default)s)")
    add_output_arguments(p)
    add_check(p, _check_mesh)


def _verilog_router(args):
    rows, cols = parse_grid(args.fabric)
    router = _mesh_errors(lambda: Router(
        payload_shape=_payload_shape(args.payload), x=args.x, y=args.y, rows=rows, cols=cols,
        coord_bits=args.coord_bits, depth=args.depth, queues=args.queues,
        counter_bits=args.counter_bits))
    return write_verilog(args, router, f"router ({args.x}, {args.y}) of {rows}x{cols}, "
                                       f"{args.queues} queues of {args.depth}, "
                                       f"{router.flit.size}-bit flits")


def _verilog_noc(args):
    rows, cols = parse_grid(args.fabric)
    kw = dict(rows=rows, cols=cols, coord_bits=args.coord_bits, depth=args.depth,
              queues=args.queues, counter_bits=args.counter_bits)

    def make():
        if args.dual:
            if args.payload in PAYLOADS:
                p = MUParams()
                req, rsp = mu_request_layout(p), mu_response_layout(p)
                if kw["coord_bits"] is None:
                    kw["coord_bits"] = p.coord_bits
            else:
                req = rsp = _payload_shape(args.payload)
            return DualMesh(request_shape=req, response_shape=rsp, **kw), \
                "request and response meshes"
        noc = Mesh(payload_shape=_payload_shape(args.payload), **kw)
        return noc, f"mesh, {noc.flit.size}-bit flits"
    noc, what = _mesh_errors(make)
    return write_verilog(args, noc, f"{rows}x{cols} {what}, {args.queues} queues of "
                                    f"{args.depth}")


# --- fabric and system ------------------------------------------------------------------------

def _verilog_fabric(args):
    params = fabric_from_args(args)
    try:
        fabric = Fabric(params)
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    return write_verilog(args, fabric, f"{params.rows}x{params.cols} fabric")


def _verilog_system(args):
    sp = system_from_args(args)
    fp = sp.fabric
    return write_verilog(args, System(sp), f"{sp.clusters} clusters of {fp.rows}x{fp.cols}, "
                                           f"links {sp.link_width} wires, "
                                           f"{sp.link_latency} cycles")


def register(commands):
    verilog = commands.add_parser(
        "verilog", help="generate Verilog for a component",
        description="Generate Verilog for a component with its parameters.")
    sub = verilog.add_subparsers(dest="component", metavar="COMPONENT", required=True)

    p = sub.add_parser(
        "mu", help="the memory unit",
        description="Write the Verilog of a memory unit (ports: clk, rst, req__*, resp__*, "
                    "counters; see docs/memory-unit.md).")
    add_mu_arguments(p)
    p.add_argument("--mu-id", type=int, default=0, help="this MU's ID (default: 0)")
    add_output_arguments(p)
    add_check(p, _check_mu_id)
    p.set_defaults(func=_verilog_mu)

    p = sub.add_parser(
        "router", help="one NoC router",
        description="Write the Verilog of one five-port XY router (see docs/noc.md). The "
                    "defaults give the middle router of a 3x3 mesh, with all ports.")
    p.add_argument("--x", type=int, default=1, help="column of the router (default: 1)")
    p.add_argument("--y", type=int, default=1, help="row of the router (default: 1)")
    add_grid_argument(p, default="3x3", help="mesh rows x columns")
    _add_noc_arguments(p)
    p.set_defaults(func=_verilog_router)

    p = sub.add_parser(
        "noc", help="an R x C mesh network-on-chip",
        description="Write the Verilog of an R x C mesh of XY routers with one local port per "
                    "tile (ports inject__T__*, eject__T__*, counters; tile T = y*cols + x), or "
                    "with --dual the request and response networks side by side (req__*, "
                    "rsp__*). See docs/noc.md.")
    add_grid_argument(p, help="mesh rows x columns")
    p.add_argument("--dual", action="store_true",
                   help="two networks: MU requests and MU responses (or the --payload width)")
    _add_noc_arguments(p)
    p.set_defaults(func=_verilog_noc)

    p = sub.add_parser("fabric", help="a whole fabric",
                       description="Write the Verilog of an R x C fabric with its host "
                                   "port (docs/fabric.md).")
    add_fabric_arguments(p)
    add_output_arguments(p, name_help="top module name")
    p.set_defaults(func=_verilog_fabric)

    p = sub.add_parser(
        "system", help="a system of clusters joined by bridges",
        description="Write the Verilog of N fabrics (clusters) sharing one MU address space "
                    "through bridge tiles and inter-cluster links, with one host port per "
                    "cluster (ports cmd__K__*, reply__K__*; docs/clusters.md).")
    add_system_arguments(p)
    add_output_arguments(p, name_help="top module name")
    p.set_defaults(func=_verilog_system)
