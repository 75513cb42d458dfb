"""``rdakit board build|run``: a fabric built for an FPGA board, and kernels run on a board."""

import asyncio

import serial

from rdakit.boards.build import BOARDS, board_preset, board_spec, build
from rdakit.boards.serial_link import board_host
from rdakit.cli.options import (
    add_check,
    add_fabric_arguments,
    add_number,
    checked_params,
    dashed,
    parse_grid,
)
from rdakit.cli.outputs import add_output
from rdakit.errors import UserError
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.bench.report import Report
from rdakit.sim.runtime.host_link import LinkError
from rdakit.sim.runtime.job import run_job
from rdakit.sim.verify import kernels

__all__ = ["register", "params_for", "check_board", "WORKLOADS", "DEFAULT_GRID"]

#: Bounds of the board commands' numbers, each with its reason.
MAX_CLOCK_MHZ = 1000
MAX_TIMEOUT = 3600

#: Kernels ``rdakit board run`` knows: name -> (builder in rdakit.sim.runtime.job, size keyword).
WORKLOADS = {"vector-add": ("vector_add", "n"), "matvec": ("matvec", "m"),
             "moe": ("moe_fanout", "n")}

#: The grid of the board commands unless --fabric says otherwise.
DEFAULT_GRID = "1x2"

_FABRIC_OPTIONS = ("lanes", "prog_len", "local_words", "mu_words", "block_words", "max_buffers",
                   "weight_bits", "noc_depth", "noc_queues", "alloc_mode", "refcount")


def params_for(board, args, *, grid=None, grid_option="--fabric", **changes):
    """The FabricParams of a board build: the board's preset, then the options given; a
    UserError naming the option that is refused (``grid_option`` for the grid)."""
    options = board_preset(board)
    for name in _FABRIC_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    options.update(changes)
    rows, cols = grid or parse_grid(args.fabric)
    kw = dict(rows=rows, cols=cols, layout=getattr(args, "layout", None), **options)
    base_rows, base_cols = parse_grid(DEFAULT_GRID)
    base = dict(board_preset(board), rows=base_rows, cols=base_cols, layout=None)
    return checked_params(fabric_params, kw, base,
                          lambda k: grid_option if k in ("grid", "rows", "cols") else dashed(k))


def check_board(board):
    """The :class:`~rdakit.boards.build.BoardSpec` of ``board``, or a UserError naming the
    boards there are."""
    try:
        return board_spec(board)
    except ValueError as e:
        raise UserError(str(e)) from None


def _utilization_table(report, title, result, spec):
    rows = result.rows(spec.family)
    report.table(title, rows, key="utilization",
                 columns=["resource", "bel", "used", "available", "percent"])


def _build(args):
    spec = check_board(args.board)
    params = params_for(args.board, args)
    build_dir = args.build_dir or f"build/{args.board}-{params.rows}x{params.cols}"
    try:
        result = build(args.board, params, build_dir=build_dir,
                       clock_hz=args.clock_mhz * 1e6 if args.clock_mhz else None,
                       baud=args.baud, log=lambda s: print(f"rdakit: {s}"))
    except (ValueError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    report = Report("board build")
    _utilization_table(report, f"{spec.title}: {params.rows}x{params.cols} fabric, "
                               f"{params.cu.lanes} lanes, MU {params.mu.words} words", result,
                       spec)
    report.figure("fits", result.fits)
    report.figure("fmax_mhz", result.fmax_mhz)
    report.figure("clock_mhz", result.clock_mhz)
    report.figure("meets_clock", result.meets_clock)
    report.figure("build_seconds", round(result.seconds, 1))
    report.figure("bitstream", result.bitstream)
    report.finish(args.json)
    if not result.fits:
        raise UserError(f"{params.rows}x{params.cols} fabric on the {spec.title}: "
                        f"{result.problem}")
    if not result.meets_clock:
        print(f"rdakit: warning: Fmax {result.fmax_mhz} MHz is below the "
              f"{result.clock_mhz:g} MHz clock")
    return 0


def _run(args):
    spec = check_board(args.board)
    params = params_for(args.board, args)
    builder, size_kw = WORKLOADS[args.workload]
    try:
        job = getattr(kernels, builder)(params, **({size_kw: args.size} if args.size else {}))
    except ValueError as e:
        raise UserError(str(e)) from None
    try:
        host, port = board_host(params, args.port, baud=args.baud or spec.default_baud,
                                timeout=args.timeout)
    except serial.SerialException as e:
        raise UserError(f"cannot open {args.port}: {e}") from None
    try:
        result = asyncio.run(run_job(host, job, counters=False))
    except LinkError as e:
        raise UserError(f"{args.port}: {e} (is the board programmed with `rdakit board build "
                        f"{args.board}` and the same fabric options?)") from None
    except RuntimeError as e:
        raise UserError(str(e)) from None
    finally:
        port.close()
    try:
        result.check(job)
    except AssertionError as e:
        raise UserError(f"{job.description} on the {spec.title}: {e}") from None
    print(f"{job.description} on the {spec.title}: outputs match numpy; "
          f"{result.cycles} cycles, bitstream load {result.load_cycles} cycles")
    return 0


def _presets():
    return "; ".join(f"{b}: " + ", ".join(f"{k.replace('_', '-')} {v}"
                                          for k, v in board_preset(b).items()) for b in BOARDS)


def _check(args):
    check_board(args.board)
    params_for(args.board, args)


def _fabric_options(p):
    add_fabric_arguments(p, default=DEFAULT_GRID, check=False)
    # The board's preset (rdakit.boards.build.board_preset) fills what is not given.
    p.set_defaults(**{name: None for name in _FABRIC_OPTIONS})
    add_check(p, _check)


def register(commands):
    board = commands.add_parser(
        "board", help="FPGA builds of the fabric and runs on a board",
        description="Build a fabric with its UART host bridge for an FPGA board, or run a "
                    "kernel on a programmed board (docs/boards.md).")
    sub = board.add_subparsers(dest="board_command", metavar="COMMAND", required=True)
    p = sub.add_parser(
        "build", help="synthesize, place and route; print utilization and Fmax",
        description="Build the fabric and its host bridge with YoWASP Yosys and nextpnr; "
                    "print utilization and nextpnr's Fmax, and say so when the design does not "
                    "fit. Fabric options not given take the board's preset, not the defaults "
                    "listed below: " + _presets() + ".")
    p.add_argument("board", help="icebreaker or ulx3s")
    _fabric_options(p)
    add_number(p, "--clock-mhz", kind=float, low=0, low_open=True, high=MAX_CLOCK_MHZ,
               reason="beyond any FPGA's fabric",
                   help="fabric clock (default: 12 on iCEBreaker, 50 on ULX3S through a PLL)")
    add_number(p, "--baud", low=1, help="UART baud rate (default: the board's)")
    add_output(p, "--build-dir", folder=True, help="build folder (default: build/BOARD-RxC)")
    add_output(p, "--json", metavar="FILE", help="write the figures to FILE")
    p.set_defaults(func=_build)

    p = sub.add_parser(
        "run", help="run a kernel on a programmed board and check it against numpy",
        description="Over the board's UART: allocate and fill the inputs, load the fabric "
                    "bitstream, start, wait, read the outputs and compare them with numpy. "
                    "Give the fabric options the board was built with; those not given take "
                    "the board's preset: " + _presets() + ".")
    p.add_argument("board", help="icebreaker or ulx3s")
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("--port", required=True, help="serial port, e.g. /dev/ttyUSB0")
    add_number(p, "--baud", low=1, help="UART baud rate (default: the board's)")
    add_number(p, "--size", low=1, help="kernel size (vector words, matrix rows)")
    add_number(p, "--timeout", kind=float, low=0, low_open=True, high=MAX_TIMEOUT,
               reason="an answer takes milliseconds", default=0.5,
               help="seconds to wait for an answer")
    _fabric_options(p)
    p.set_defaults(func=_run)
