"""``rdakit verilog router``, ``rdakit verilog noc`` and ``rdakit bench noc``."""

import sys

__all__ = ["register"]

PAYLOADS = ("mu-request", "mu-response")


def _payload_shape(text):
    """``mu-request``/``mu-response`` (the memory network's packets, default MU parameters) or
    a width in bits."""
    from rdakit.hdl.spec.packets import mu_request_layout, mu_response_layout
    from rdakit.hdl.spec.params import MUParams

    if text == "mu-request":
        return mu_request_layout(MUParams())
    if text == "mu-response":
        return mu_response_layout(MUParams())
    try:
        return int(text)
    except ValueError:
        from rdakit.errors import UserError
        raise UserError(f"payload must be one of {', '.join(PAYLOADS)} or a width in bits, "
                        f"not {text!r}") from None


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
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="Verilog file to write ('-' for standard output)")
    p.add_argument("--name", default="top", help="name of the top module (default: %(default)s)")


def _write(args, component, what):
    from rdakit.cli.verilog import write_verilog

    return write_verilog(args, component, what)


def _verilog_router(args):
    from rdakit.errors import UserError
    from rdakit.hdl.noc.router import Router

    try:
        router = Router(payload_shape=_payload_shape(args.payload), x=args.x, y=args.y,
                        rows=args.rows, cols=args.cols, coord_bits=args.coord_bits,
                        depth=args.depth, queues=args.queues, counter_bits=args.counter_bits)
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    return _write(args, router, f"router ({args.x}, {args.y}) of {args.rows}x{args.cols}, "
                                f"{args.queues} queues of {args.depth}, "
                                f"{router.flit.size}-bit flits")


def _verilog_noc(args):
    from rdakit.errors import UserError
    from rdakit.hdl.noc.mesh import DualMesh, Mesh
    from rdakit.hdl.spec.packets import mu_request_layout, mu_response_layout
    from rdakit.hdl.spec.params import MUParams

    kw = dict(rows=args.rows, cols=args.cols, coord_bits=args.coord_bits, depth=args.depth,
              queues=args.queues, counter_bits=args.counter_bits)
    try:
        if args.dual:
            if args.payload in PAYLOADS:
                p = MUParams()
                req, rsp = mu_request_layout(p), mu_response_layout(p)
                if kw["coord_bits"] is None:
                    kw["coord_bits"] = p.coord_bits
            else:
                req = rsp = _payload_shape(args.payload)
            noc = DualMesh(request_shape=req, response_shape=rsp, **kw)
            what = "request and response meshes"
        else:
            noc = Mesh(payload_shape=_payload_shape(args.payload), **kw)
            what = f"mesh, {noc.flit.size}-bit flits"
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    return _write(args, noc, f"{args.rows}x{args.cols} {what}, {args.queues} queues of "
                             f"{args.depth}")


def _bench_noc(args):
    from rdakit.errors import UserError
    from rdakit.hdl.noc.router import QUEUE_KINDS, check_mesh_params
    from rdakit.sim.bench.noc import parse_mesh, run_bench
    from rdakit.sim.models.noc import PATTERNS

    try:
        rows, cols = parse_mesh(args.mesh)
        check_mesh_params(rows=rows, cols=cols, coord_bits=None, depth=args.depth,
                          queues="voq", counter_bits=32)
        patterns = list(PATTERNS) if args.pattern == "all" else [args.pattern]
        structures = tuple(q.strip() for q in args.queues.split(","))
        for q in structures:
            if q not in QUEUE_KINDS:
                raise TypeError(f"queues must be a comma-separated list of "
                                f"{', '.join(QUEUE_KINDS)}, not {args.queues!r}")
        rates = None
        if args.rates:
            rates = [float(r) for r in args.rates.split(",")]
            for r in rates:
                if not 0 < r <= 1:
                    raise ValueError(f"rates must be between 0 and 1 flits/node/cycle, "
                                     f"not {r!r}")
        hotspot = None
        if args.hotspot:
            hotspot = tuple(int(v) for v in args.hotspot.split(","))
            if len(hotspot) != 2 or not (0 <= hotspot[0] < cols and 0 <= hotspot[1] < rows):
                raise ValueError(f"hotspot must be X,Y inside the {rows}x{cols} mesh, "
                                 f"not {args.hotspot!r}")
        if not 0 <= args.hot_fraction <= 1:
            raise ValueError(f"hot_fraction must be between 0 and 1, not {args.hot_fraction!r}")
        for name in ("warmup", "measure"):
            if getattr(args, name) < 1:
                raise ValueError(f"{name} must be at least 1 cycle, not {getattr(args, name)!r}")
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    from rdakit.sim.verify.runner import require_simulator_or_raise

    require_simulator_or_raise(args.simulator)
    report = run_bench(mesh=f"{rows}x{cols}", patterns=patterns, structures=structures,
                       depth=args.depth, simulator=args.simulator, warmup=args.warmup,
                       measure=args.measure, refine=args.refine, rates=rates, hotspot=hotspot,
                       hot_fraction=args.hot_fraction, json_path=args.json,
                       plot_path=args.plot, area=not args.no_area)
    if report.figures["delivery_errors"]:
        print(f"rdakit: error: {report.figures['delivery_errors']} packets misdelivered, out "
              f"of order or lost during the benchmark", file=sys.stderr)
        return 1
    return 0


def register(commands, verilog, bench):
    p = verilog.add_parser(
        "router", help="one NoC router",
        description="Write the Verilog of one five-port XY router (see docs/noc.md). The "
                    "defaults give the middle router of a 3x3 mesh, with all ports.")
    p.add_argument("--x", type=int, default=1, help="column of the router (default: 1)")
    p.add_argument("--y", type=int, default=1, help="row of the router (default: 1)")
    p.add_argument("--rows", type=int, default=3, help="mesh rows (default: 3)")
    p.add_argument("--cols", type=int, default=3, help="mesh columns (default: 3)")
    _add_noc_arguments(p)
    p.set_defaults(func=_verilog_router)

    p = verilog.add_parser(
        "noc", help="an R x C mesh network-on-chip",
        description="Write the Verilog of an R x C mesh of XY routers with one local port per "
                    "tile (ports inject__T__*, eject__T__*, counters; tile T = y*cols + x), or "
                    "with --dual the request and response networks side by side (req__*, "
                    "rsp__*). See docs/noc.md.")
    p.add_argument("--rows", type=int, required=True, help="mesh rows")
    p.add_argument("--cols", type=int, required=True, help="mesh columns")
    p.add_argument("--dual", action="store_true",
                   help="two networks: MU requests and MU responses (or the --payload width)")
    _add_noc_arguments(p)
    p.set_defaults(func=_verilog_noc)

    from rdakit.sim.models.noc import PATTERNS

    p = bench.add_parser(
        "noc", help="NoC latency-throughput curves, saturation, zero-load latency, area",
        description="Sweep the injection rate of synthetic traffic on an R x C mesh (the RTL "
                    "in Verilator, driven by a synthesizable traffic harness), print and plot "
                    "the latency-throughput curve, the zero-load latency and the saturation "
                    "throughput beside the XY-routing limit of the pattern, and the router "
                    "area (yosys stat). See docs/noc.md for the methodology.")
    p.add_argument("--mesh", default="4x4", help="ROWSxCOLS (default: %(default)s)")
    p.add_argument("--pattern", choices=list(PATTERNS) + ["all"], default="uniform",
                   help="traffic pattern (default: %(default)s)")
    p.add_argument("--queues", default="voq", metavar="KIND[,KIND...]",
                   help="router queue structures to measure, comma-separated: voq, fifo, scan "
                        "(default: %(default)s)")
    p.add_argument("--depth", type=int, default=4, help="entries per queue (default: 4)")
    p.add_argument("--simulator", choices=("verilator", "icarus"), default="verilator",
                   help="simulator (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=1000, help="warm-up cycles (default: 1000)")
    p.add_argument("--measure", type=int, default=3000,
                   help="measurement cycles per rate (default: 3000)")
    p.add_argument("--refine", type=int, default=3,
                   help="bisection steps around saturation (default: 3)")
    p.add_argument("--rates", default=None, metavar="R,R,...",
                   help="explicit injection rates in flits/node/cycle (default: fractions of "
                        "the pattern's limit)")
    p.add_argument("--hotspot", default=None, metavar="X,Y",
                   help="hot tile of the hotspot pattern (default: the middle)")
    p.add_argument("--hot-fraction", type=float, default=0.25,
                   help="share of hotspot traffic to the hot tile (default: 0.25)")
    p.add_argument("--no-area", action="store_true", help="skip the router area (yosys)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="latency-throughput plot (default: build/bench/noc-MESH-PATTERN.png)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON")
    p.set_defaults(func=_bench_noc)
