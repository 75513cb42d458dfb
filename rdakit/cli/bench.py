"""``rdakit bench BENCH``: run a benchmark, print its tables and optionally write them as JSON.

Every bench's options are parsed here and its measurements run by its own module under
``sim/bench/`` (``rdakit.sim.bench.<name>``), which knows nothing of the command line.
"""

import importlib
import math
import pathlib
import sys

from rdakit.cli.board import check_board, params_for
from rdakit.cli.compile import choose_fabric
from rdakit.cli.options import (
    MAX_PLACE_STEPS,
    RUN_PROG_LEN,
    add_check,
    add_fabric_arguments,
    add_grid_argument,
    add_mu_arguments,
    add_number,
    add_system_arguments,
    add_verilator_arguments,
    dashed,
    fabric_candidates,
    fabric_dict,
    max_grid,
    mu_params_from_args,
    parse_grid,
    system_from_args,
)
from rdakit.cli.outputs import add_input, add_output, image_suffixes
from rdakit.cli.progress import progress_bar
from rdakit.compiler.partition import DEFAULT_STRATEGY, STRATEGIES
from rdakit.compiler.partition.clusters import LinkModel
from rdakit.compiler.partition.wgraph import load as load_graph
from rdakit.compiler.workloads import WORKLOADS
from rdakit.errors import UserError
from rdakit.hdl.cluster.system import System
from rdakit.hdl.noc.router import QUEUE_KINDS, check_mesh_params
from rdakit.sim.bench import calibrate, clusters, e2e, memory, models, partition, race
from rdakit.sim.bench.boards import bench_boards
from rdakit.sim.bench.fabric import bench_fabric
from rdakit.sim.bench.mu import bench_mu
from rdakit.sim.bench.report import Report
from rdakit.sim.flows.e2e import BACKENDS, NEEDS_TOOLS
from rdakit.sim.models.noc import PATTERNS
from rdakit.sim.verify.runner import require_simulator_or_raise

__all__ = ["register", "MAX_CYCLES", "MAX_REFINE", "MAX_SCENARIOS"]

#: Cycles of ``bench noc``'s warm-up and of each measured rate: Verilator simulates a 4x4 mesh
#: at some hundred thousand cycles a second, and every rate of every pattern takes them.
MAX_CYCLES = 1_000_000
_CYCLES = "every rate of every pattern simulates them"
#: Bisection steps of ``bench noc`` around saturation.
MAX_REFINE = 20
#: Random scenarios a scheme of ``bench race``.
MAX_SCENARIOS = 100_000


# --- mu and fabric ----------------------------------------------------------------------------

def _bench_mu(args):
    return bench_mu(mu_params_from_args(args), quick=args.quick, json_path=args.json)


def _bench_fabric(args):
    return bench_fabric(fabric_dict(args), simulator=args.sim, quick=args.quick,
                        json_path=args.json)


# --- noc --------------------------------------------------------------------------------------

def _check_noc(args):
    """Every option of ``bench noc``, before anything is built or simulated."""
    rows, cols = parse_grid(args.fabric)
    high = max_grid()
    if not (1 <= rows <= high and 1 <= cols <= high):
        raise UserError(f"--fabric must be ROWSxCOLS with 1 to {high} rows and columns (the "
                        f"largest fabric), not {args.fabric!r}")
    try:
        check_mesh_params(rows=rows, cols=cols, coord_bits=None, depth=args.depth,
                          queues="voq", counter_bits=32)
    except (TypeError, ValueError) as e:
        raise UserError(f"{dashed(str(e).split(' ', 1)[0])} {str(e).split(' ', 1)[1]}") \
            from None
    args.patterns = list(PATTERNS) if args.pattern == "all" else [args.pattern]
    # Once each: every structure's tables are keyed by its name.
    args.structures = tuple(dict.fromkeys(q.strip() for q in args.queues.split(",")))
    for q in args.structures:
        if q not in QUEUE_KINDS:
            raise UserError(f"--queues must be a comma-separated list of "
                            f"{', '.join(QUEUE_KINDS)}, not {args.queues!r}")
    args.rate_list = None
    if args.rates:
        try:
            args.rate_list = [float(r) for r in args.rates.split(",")]
        except ValueError:
            args.rate_list = [math.nan]
        if not all(0 < r <= 1 for r in args.rate_list):
            raise UserError(f"--rates must be injection rates above 0 and at most 1 "
                            f"flits/node/cycle separated by commas, not {args.rates!r}")
    args.hotspot_xy = None
    if args.hotspot:
        try:
            args.hotspot_xy = tuple(int(v) for v in args.hotspot.split(","))
        except ValueError:
            args.hotspot_xy = ()
        x_y = args.hotspot_xy
        if len(x_y) != 2 or not (0 <= x_y[0] < cols and 0 <= x_y[1] < rows):
            raise UserError(f"--hotspot must be X,Y inside the {rows}x{cols} mesh, "
                            f"not {args.hotspot!r}")
    args.mesh = (rows, cols)


def _bench_noc(args):
    rows, cols = args.mesh
    require_simulator_or_raise(args.simulator)
    # Deferred: the NoC bench module is also a cocotb test module and imports cocotb, an
    # optional dependency (rdakit[test]) that the other commands do without.
    from rdakit.sim.bench.noc import run_bench

    report = run_bench(rows=rows, cols=cols, patterns=args.patterns,
                       structures=args.structures, depth=args.depth, simulator=args.simulator,
                       warmup=args.warmup, measure=args.measure, refine=args.refine,
                       rates=args.rate_list, hotspot=args.hotspot_xy,
                       hot_fraction=args.hot_fraction, json_path=args.json,
                       plot_path=args.plot, area=not args.no_area)
    if report.figures["delivery_errors"]:
        print(f"rdakit: error: {report.figures['delivery_errors']} packets misdelivered, out "
              f"of order or lost during the benchmark", file=sys.stderr)
        return 1
    return 0


# --- race -------------------------------------------------------------------------------------

def _check_race(args):
    args.scheme_list = tuple(args.schemes.split(",")) if args.schemes else race.SCHEMES
    bad = [s for s in args.scheme_list if s not in race.SCHEMES]
    if bad:
        raise UserError(f"--schemes must be a comma-separated list of "
                        f"{', '.join(race.SCHEMES)}, not {bad[0]!r}")
    require_simulator_or_raise(args.sim)


def _bench_race(args):
    schemes = args.scheme_list
    rows = race.run_race(args.scenarios, simulator=args.sim, schemes=schemes, seed=args.seed,
                         optimize=args.sim == "verilator")
    report = Report("race")
    table = race.summarize(rows)
    report.table(
        f"Race injection on a 2x2 fabric ({args.sim}, {args.scenarios} random scenarios a "
        f"scheme, seed {args.seed}): premature frees, leaks, messages, last use -> free",
        table, key="schemes",
        notes="msgs_per_scenario: reference-counting requests to the MU (each answered) plus "
              "gating tokens; extra_msgs_per_copy: the same beyond one release a holder; "
              "latency: MU cycles from the last good READ to the free; cycles: START to done.")
    by_topology = []
    for scheme in schemes:
        for topo in ("pair", "chain", "fanout"):
            rs = [r for r in rows if r["scheme"] == scheme and r["topology"] == topo]
            if rs:
                by_topology.append({"scheme": scheme, "topology": topo, "scenarios": len(rs),
                                    "premature_frees": sum(r["premature"] for r in rs)})
    report.table("Premature frees by holder tree", by_topology, key="topologies")
    for r in table:
        for key in ("premature_frees", "leaks", "double_frees", "extra_msgs_per_copy",
                    "latency_mean", "cycles_mean"):
            report.figure(f"{r['scheme']}_{key}", r[key])
    report.finish(args.json)
    return 0


# --- clusters ---------------------------------------------------------------------------------

def _check_clusters(args):
    for w in args.workloads.split(","):
        if w not in WORKLOADS:
            raise UserError(f"--workloads takes names of {', '.join(sorted(WORKLOADS))}, "
                            f"not {w!r}")


def _bench_clusters(args):
    sp = system_from_args(args)
    workloads = args.workloads.split(",")
    fp = sp.fabric
    report = Report("clusters")
    link = f"{sp.link_width} wires, {sp.link_latency} cycles"
    report.console.print(f"{sp.clusters} clusters of {fp.rows}x{fp.cols}, links of {link} "
                         f"(Amaranth's simulator)")
    system = System(sp)
    access = clusters.measure_access(sp, system=system)
    report.table("Remote against local access on the RTL: one CU of cluster 0 reading an MU "
                 "of its own cluster, then of cluster 1 (16 blocking READs; a 64-word stream)",
                 [{"link": link, "access": where, **access[where]}
                  for where in ("local", "remote")], key="access")
    matvec = clusters.measure_matvec(sp, system=system)
    report.table("A matrix-vector product over every CU of every cluster on the RTL (x shared "
                 "from cluster 0, read remotely and freed by its last holder)",
                 [{"clusters": sp.clusters, **matvec}], key="matvec")
    rows = clusters.partition_rows(workloads, (2, 4), LinkModel.of_system(sp))
    report.table("The workloads partitioned across clusters (cost-model estimates; clusters = "
                 "each cluster's available CUs, +L an injected load of L cycles)", rows,
                 key="partitions")
    measured = []
    if args.rtl_workloads:
        with progress_bar(report.console.is_terminal) as progress:
            measured = clusters.measured_rows(workloads, (2, 4), progress=progress)
        report.table("The workloads (smallest sizes) compiled across 2 and 4 clusters of 2x2 "
                     "and run on the RTL (links of the default width, 20 cycles): measured "
                     "cycles, the estimate, bytes the partition sends over links, packets "
                     "that crossed them", measured, key="rtl_workloads")
        report.figure("failed_runs", sum(r["check"] != "ok" for r in measured))
    local, remote = access["local"], access["remote"]
    report.figure("remote_latency_ratio",
                  round(remote["latency_cycles"] / local["latency_cycles"], 3))
    report.figure("remote_bandwidth_ratio",
                  round(remote["words_per_cycle"] / local["words_per_cycle"], 3))
    report.figure("matvec_exact", matvec["exact"])
    report.finish(args.json)
    ok = matvec["exact"] and matvec["x_freed"] and all(r["check"] == "ok" for r in measured)
    return 0 if ok else 1


# --- partition and calibrate ------------------------------------------------------------------

def _check_partition(args):
    """``--units`` as unit counts, ``--family`` as families (the model suite's only where
    PyTorch imports), and ``--graph`` read and checked before any work (a bad file is a
    GraphFileError naming it: exit 2)."""
    if args.family is not None:
        if args.graph is not None:
            raise UserError("--family chooses among the benchmark's graphs; it does not apply "
                            "with --graph")
        families = tuple(dict.fromkeys(args.family.split(",")))
        bad = [f for f in families if f not in partition.FAMILIES]
        if bad or not families:
            raise UserError(f"--family takes a comma-separated subset of "
                            f"{','.join(partition.FAMILIES)}, not {args.family!r}")
        if "model" in families:
            _model_suite("--family model")
        args.families = families
    else:
        args.families = partition.FAMILIES
    try:
        units = tuple(int(u) for u in args.units.split(","))
    except ValueError:
        units = ()
    if not units or any(not 1 <= u <= partition.MAX_UNITS for u in units):
        raise UserError(f"--units must be unit counts from 1 to {partition.MAX_UNITS} "
                        f"separated by commas, not {args.units!r}")
    args.unit_counts = units
    args.user_graph = load_graph(args.graph) if args.graph is not None else None


def _bench_partition(args):
    partition.run(quick=args.quick, json_path=args.json, seed=args.seed, graph=args.user_graph,
                  units=args.unit_counts, families=args.families)
    return 0


def _bench_calibrate(args):
    calibrate.run(quick=args.quick, rtl=not args.no_rtl, json_path=args.json)
    return 0


# --- models -----------------------------------------------------------------------------------

#: ``bench models``' default ``--rtl-limit`` per ``--sim``: Amaranth's simulator (and Icarus)
#: run a 2x2 fabric at some thousands of cycles a second; Verilator, driven directly, runs a
#: 4x4 at tens of thousands (the suite's ResNet, 14 million estimated cycles, in minutes:
#: docs/import.md); the model, faster still, runs every model.
RTL_LIMITS = {"amaranth": 100_000, "icarus": 100_000, "verilator": 20_000_000,
              "model": 20_000_000}


def _model_suite(what):
    """The model suite's module (:mod:`rdakit.compiler.frontend.models`), imported to refuse
    ``what`` (the command or option as typed) before any work when PyTorch cannot be imported;
    the benches import it themselves."""
    try:
        return importlib.import_module("rdakit.compiler.frontend.models")
    except ImportError as e:
        raise UserError(f"{what} needs PyTorch, which cannot be imported ({e}): pip install "
                        f"'rdakit[torch]'") from None


def _check_models(args):
    suite = _model_suite("rdakit bench models")
    args.model_list = (list(dict.fromkeys(args.models.split(","))) if args.models
                       else list(suite.MODELS))     # tables are keyed by model
    for m in args.model_list:
        if m not in suite.MODELS:
            raise UserError(f"--models takes a comma-separated subset of "
                            f"{','.join(suite.MODELS)}, not {args.models!r}")
    if not args.no_rtl and args.sim in NEEDS_TOOLS:
        require_simulator_or_raise(args.sim)
    if args.rtl_limit is None:
        args.rtl_limit = RTL_LIMITS[args.sim]
    args.candidates = fabric_candidates(args)


def _bench_models(args):
    def choose(workload):
        return choose_fabric(workload, args.candidates, name=workload.name,
                             partitioner=args.partitioner, seed=0, place_steps=20000)[0]

    report = Report("models")
    with progress_bar(report.console.is_terminal) as progress:
        rows, coverage = models.measure(names=args.model_list, quick=args.quick, choose=choose,
                                        partitioner=args.partitioner,
                                        sim=None if args.no_rtl else args.sim,
                                        rtl_limit=args.rtl_limit, progress=progress)
    models.write_report(rows, coverage, quick=args.quick, partitioner=args.partitioner,
                        json_path=args.json, report=report)
    return 1 if report.figures["failed_runs"] else 0


# --- e2e --------------------------------------------------------------------------------------

def _check_e2e(args):
    names = args.partitioners.split(",") if args.partitioners else None
    workloads = tuple(args.workloads.split(",")) if args.workloads else e2e.WORKLOADS
    for w in workloads:
        if w not in e2e.WORKLOADS:
            raise UserError(f"--workloads takes a subset of {','.join(e2e.WORKLOADS)}, "
                            f"not {w!r}")
    known = e2e.partitioners()
    for n in names or ():
        if n not in known:
            raise UserError(f"--partitioners takes a subset of {','.join(known)}, not {n!r}")
    if args.sim in NEEDS_TOOLS:
        require_simulator_or_raise(args.sim)
    args.workload_list, args.partitioner_list = workloads, names


def _bench_e2e(args):
    fabric = fabric_dict(args)
    names, workloads = args.partitioner_list, args.workload_list
    report = Report("e2e")
    report.console.print(f"{','.join(workloads)} on a {fabric['rows']}x{fabric['cols']} fabric "
                         f"with {args.sim}")
    with progress_bar(report.console.is_terminal) as progress:
        part_rows, mem_rows = e2e.run(fabric, sim=args.sim, workloads=workloads,
                                      names=names, place_steps=args.place_steps,
                                      progress=progress, build=args.verilator_build)
    report.table("Partitioners: measured cycles on the RTL beside the cost model's lower "
                 "bound (utilization = mean CU busy / cycles; vs_round_robin = cycles / the "
                 "round-robin baseline's)", part_rows, key="partitioners")
    report.table("Memory schemes (multilevel partitioner): weighted reference counting with "
                 "partial free and virtual buffers, counter-based reference counting, "
                 "reserve-and-copy allocation", mem_rows, key="memory_schemes")
    report.figure("fabric", f"{fabric['rows']}x{fabric['cols']}")
    report.figure("simulator", args.sim)
    bad = [r for r in part_rows + mem_rows if r["check"] != "ok"]
    report.figure("failed_runs", len(bad))
    report.finish(args.json)
    return 1 if bad else 0


# --- memory -----------------------------------------------------------------------------------

def _check_memory(args):
    if args.plot is not None and args.sim != "model":
        raise UserError(f"--plot needs --sim model (its occupancy trace), not --sim {args.sim}")
    if args.sim in NEEDS_TOOLS:
        require_simulator_or_raise(args.sim)


def _bench_memory(args):
    return memory.bench_memory(quick=args.quick, sim=args.sim, seed=args.seed,
                               area=not args.no_area, plot=args.plot, json_path=args.json)


# --- boards -----------------------------------------------------------------------------------

def _check_boards(args):
    args.board_list = list(dict.fromkeys(args.boards.split(",")))  # tables keyed by board
    for b in args.board_list:
        check_board(b)
    args.grid_list = [parse_grid(g, "--grids") for g in args.grids.split(",")]
    try:
        args.mu_word_list = ([int(w) for w in args.bench_mu_words.split(",")]
                             if args.bench_mu_words else None)
    except ValueError:
        raise UserError(f"--mu-words must be numbers separated by commas, not "
                        f"{args.bench_mu_words!r}") from None
    for b in args.board_list:             # every build's parameters, before the first build
        for grid in args.grid_list:
            params_for(b, args, grid=grid, grid_option="--grids")
        for words in args.mu_word_list or ():
            params_for(b, args, grid=args.grid_list[-1], grid_option="--grids",
                       mu_words=words)


def _bench_boards(args):
    boards, grids, mu_words = args.board_list, args.grid_list, args.mu_word_list
    return bench_boards(boards, grids=grids, mu_words=mu_words, root=pathlib.Path(args.root),
                        json_path=args.json,
                        params_for=lambda board, grid, **changes: params_for(
                            board, args, grid=grid, **changes))


# --- the parsers ------------------------------------------------------------------------------

def register(commands):
    bench = commands.add_parser(
        "bench", help="run a benchmark and print measured figures",
        description="Run a benchmark: prints tables of measured figures (simulated cycles "
                    "first) and, with --json FILE, writes the same figures to a JSON file.")
    sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)

    p = sub.add_parser(
        "mu", help="memory unit: throughput, latency, free cost, traces, area",
        description="Measure the memory unit on its RTL (Amaranth's simulator, every response "
                    "checked against the golden model): sustained READ/WRITE throughput, the "
                    "latency of every operation, cycles to free N blocks, KV-cache and MoE "
                    "traces in every allocation mode, and yosys cell counts.")
    add_mu_arguments(p)
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    add_output(p, "--json", metavar="FILE", help="also write the figures to FILE")
    p.set_defaults(func=_bench_mu)

    p = sub.add_parser(
        "fabric", help="matrix kernels on a fabric's RTL beside the compute lower bound",
        description="Run a 64x64 matrix-vector and a 64x64x64 matrix product spread over every "
                    "CU of the fabric (Verilator by default), check them against numpy, and "
                    "print cycles beside the lower bound MACs / (lanes x CUs), the "
                    "configuration-load cycles and Yosys cell counts per tile type.")
    add_fabric_arguments(p, default="4x4")
    p.set_defaults(mu_words=2048)
    p.add_argument("--sim", choices=["verilator", "icarus"], default="verilator")
    p.add_argument("--quick", action="store_true", help="the matrix-vector product only")
    add_output(p, "--json", metavar="FILE", help="also write the figures to FILE")
    p.set_defaults(func=_bench_fabric)

    p = sub.add_parser(
        "noc", help="NoC latency-throughput curves, saturation, zero-load latency, area",
        description="Sweep the injection rate of synthetic traffic on an R x C mesh (the RTL "
                    "in Verilator, driven by a synthesizable traffic harness), print and plot "
                    "the latency-throughput curve, the zero-load latency and the saturation "
                    "throughput beside the XY-routing limit of the pattern, and the router "
                    "area (yosys stat). See docs/noc.md for the methodology.")
    add_grid_argument(p, default="4x4", help="mesh rows x columns")
    p.add_argument("--pattern", choices=list(PATTERNS) + ["all"], default="uniform",
                   help="traffic pattern (default: %(default)s)")
    p.add_argument("--queues", default="voq", metavar="KIND[,KIND...]",
                   help="router queue structures to measure, comma-separated: voq, fifo, scan "
                        "(default: %(default)s)")
    p.add_argument("--depth", type=int, default=4, help="entries per queue (default: 4)")
    p.add_argument("--simulator", choices=("verilator", "icarus"), default="verilator",
                   help="simulator (default: %(default)s)")
    add_number(p, "--warmup", low=1, high=MAX_CYCLES, reason=_CYCLES, default=1000,
               help="warm-up cycles (default: 1000)")
    add_number(p, "--measure", low=1, high=MAX_CYCLES, reason=_CYCLES, default=3000,
                   help="measurement cycles per rate (default: 3000)")
    add_number(p, "--refine", low=0, high=MAX_REFINE,
               reason="each step halves the interval: 20 reach 1e-6", default=3,
                   help="bisection steps around saturation (default: 3)")
    p.add_argument("--rates", default=None, metavar="R,R,...",
                   help="explicit injection rates in flits/node/cycle (default: fractions of "
                        "the pattern's limit)")
    p.add_argument("--hotspot", default=None, metavar="X,Y",
                   help="hot tile of the hotspot pattern (default: the middle)")
    add_number(p, "--hot-fraction", kind=float, low=0, high=1, default=0.25,
                   help="share of hotspot traffic to the hot tile (default: 0.25)")
    p.add_argument("--no-area", action="store_true", help="skip the router area (yosys)")
    add_output(p, "--plot", default=None, metavar="PNG", suffixes=image_suffixes,
                   help="latency-throughput plot (default: build/bench/noc-RxC-PATTERN.png)")
    add_output(p, "--json", default=None, metavar="FILE", help="write the figures as JSON")
    add_check(p, _check_noc)
    p.set_defaults(func=_bench_noc)

    p = sub.add_parser(
        "race", help="reference counting under random NoC delays: premature frees, messages",
        description="Run random race scenarios (the seed paper's Figure 1(b)) on a 2x2 "
                    "fabric's RTL whose links stall at random: counters without gating, "
                    "counters with acknowledgement gating (copier or token), and partial-free "
                    "with 2 to 4 weight bits. Prints per scheme the premature frees, leaks, "
                    "double frees, reference-counting messages and the latency from the last "
                    "use to the free.")
    add_number(p, "--scenarios", low=1, high=MAX_SCENARIOS, reason="each is a simulation",
               default=1000, metavar="N",
                   help="random scenarios per scheme (default: %(default)s)")
    p.add_argument("--sim", choices=["verilator", "icarus"], default="verilator")
    p.add_argument("--schemes", metavar="LIST",
                   help="comma-separated subset of counter,gated,token,partial (default: all)")
    add_number(p, "--seed", low=0, default=0, help="scenario seed (default: 0)")
    add_output(p, "--json", metavar="FILE", help="also write the figures to FILE")
    add_check(p, _check_race)
    p.set_defaults(func=_bench_race)

    p = sub.add_parser(
        "clusters", help="clusters: remote vs local access, cross-cluster partitioning",
        description="On a system of clusters (Amaranth's simulator): the latency and bandwidth "
                    "of remote against local MU access, and a matrix-vector product over "
                    "every CU of every cluster checked against numpy; then the workloads "
                    "partitioned across 2 and 4 clusters (also with one slower cluster) by "
                    "the cross-cluster greedy beside round-robin and static, with the cost "
                    "model's estimated cycles and the bytes that cross the links.")
    add_system_arguments(p, default_fabric="1x2")
    p.add_argument("--workloads", default="mlp,decoder,moe",
                   help="comma-separated workloads of the partitioning table "
                        "(default: %(default)s)")
    p.add_argument("--rtl-workloads", action="store_true",
                   help="also compile the workloads (smallest sizes) across 2 and 4 clusters "
                        "of 2x2 with every cross-cluster partitioner and run them on the RTL "
                        "(tens of minutes)")
    add_output(p, "--json", metavar="FILE", help="write the figures to FILE")
    add_check(p, _check_clusters)
    p.set_defaults(func=_bench_clusters)

    p = sub.add_parser(
        "partition", help="partitioners: cut, balance, time and makespan",
        description="Every partitioner (auto, multilevel KL/FM, cost-based greedy, DQN, HEFT, "
                    "round-robin, static, METIS, Mt-KaHyPar) on workloads, the model suite's "
                    "exported graphs (with PyTorch), transformer-shaped graphs, random layered "
                    "DAGs and 2-D grids, or on your graph (--graph): "
                    "cut, balance, pipeline bottleneck, busiest link, seconds and estimated "
                    "makespan.")
    p.add_argument("--quick", action="store_true", help="small graphs only (smoke test)")
    p.add_argument("--family", metavar="LIST",
                   help=f"comma-separated families of graphs to measure, a subset of "
                        f"{','.join(partition.FAMILIES)} (default: all)")
    p.add_argument("--graph", metavar="FILE",
                   help="a JSON node-link graph of your own (work per node in cycles, bytes "
                        "per edge; docs/compiler.md): every partitioner on it alone")
    add_input(p, "graph", "--graph")
    p.add_argument("--units", default=",".join(map(str, partition.USER_UNITS)), metavar="LIST",
                   help="unit counts for --graph (default: %(default)s)")
    add_output(p, "--json", metavar="FILE", help="also write the figures to FILE")
    add_number(p, "--seed", low=0, default=0, help="seed of the DQN training")
    add_check(p, _check_partition)
    p.set_defaults(func=_bench_partition)

    p = sub.add_parser(
        "calibrate", help="the cost model against the interpreter and the RTL",
        description="Compile workloads, run them on the functional interpreter (steps per "
                    "lowered op) and one small job on the RTL in Amaranth's simulator "
                    "(cycles), and report the cost model's relative error before and after "
                    "fitting its two constants.")
    p.add_argument("--quick", action="store_true", help="fewer workloads (smoke test)")
    p.add_argument("--no-rtl", action="store_true", help="skip the RTL run")
    add_output(p, "--json", metavar="FILE", help="also write the figures to FILE")
    p.set_defaults(func=_bench_calibrate)

    p = sub.add_parser(
        "models", help="the model suite: op coverage, compile time, cycles, accuracy",
        description="Export each model of the suite (GPT-2, BERT, Mixtral and a small ResNet, "
                    "random weights, built in code) with torch.export and count its ops and "
                    "the ones the importer does not handle; import the models that have none "
                    "(integer quantization, accuracy against float), compile them for the "
                    "smallest fabric they fit, run them on the functional interpreter and, "
                    "when the estimate is within --rtl-limit cycles, on the RTL. Needs "
                    "PyTorch (pip install 'rdakit[torch]'). Exits 1 if a run does not match.")
    p.add_argument("--models", metavar="LIST",
                   help="comma-separated subset of gpt2,bert,mixtral,resnet (default: all)")
    p.add_argument("--quick", action="store_true", help="small sizes of every model")
    p.add_argument("--sim", choices=BACKENDS, default="amaranth",
                   help="simulator of the RTL runs (default: %(default)s)")
    p.add_argument("--no-rtl", action="store_true", help="no RTL run")
    p.add_argument("--partitioner", default=DEFAULT_STRATEGY, choices=sorted(STRATEGIES),
                   help="partitioning strategy (default: %(default)s)")
    add_number(p, "--rtl-limit", low=0, metavar="CYCLES",
               help="run a model on the RTL only if its estimated cycles are at most this "
                    "(default: " + ", ".join(f"{v:,} on {k}" for k, v in RTL_LIMITS.items())
                    + ")")
    add_output(p, "--json", metavar="FILE", help="also write the figures to FILE")
    add_fabric_arguments(p, auto=True)
    add_check(p, _check_models)
    p.set_defaults(func=_bench_models, prog_len=RUN_PROG_LEN)

    p = sub.add_parser(
        "e2e", help="workloads on the RTL fabric with every partitioner and memory scheme",
        description="Compile MLP, decoder-with-KV-cache and MoE (their smallest sizes) with "
                    "every partitioner and run them on one build of the fabric; then with "
                    "counter-based reference counting and with reserve-and-copy allocation "
                    "(one build each). Prints cycles, the cost model's lower bound, CU "
                    "utilization, NoC flits, MU peak words, buffers allocated and freed, and "
                    "the bit-exact check of every run (exit 1 if any failed).")
    p.add_argument("--sim", choices=BACKENDS, default="verilator",
                   help="simulator (default: %(default)s)")
    p.add_argument("--workloads", metavar="LIST", help="subset of mlp,decoder,moe")
    p.add_argument("--partitioners", metavar="LIST",
                   help="comma-separated subset of the partitioners (default: all)")
    add_number(p, "--place-steps", low=0, high=MAX_PLACE_STEPS, default=20000,
                   help="annealing steps of the placement (default: %(default)s)")
    add_output(p, "--json", metavar="FILE", help="also write the figures to FILE")
    add_fabric_arguments(p, default="4x4")
    add_verilator_arguments(p)
    add_check(p, _check_e2e)
    p.set_defaults(func=_bench_e2e, prog_len=RUN_PROG_LEN)

    p = sub.add_parser(
        "memory", help="dynamic workloads under each memory scheme: utilization, copies, OOM",
        description="Autoregressive generation with continuous batching (KV caches that grow "
                    "at run time, lengths drawn at run time) on a 2x3 fabric whose MUs use "
                    "each memory scheme: virtualization with partial-free or counters, "
                    "reserve-and-copy, one buffer per MU. Prints cycles, tokens per "
                    "kilocycle, peak memory utilization, words copied, reference-counting "
                    "messages, cycles from last use to free and out-of-memory events (a "
                    "scheme that runs out of memory is a row), and the MUs' area. Exit 1 if a "
                    "run differs from numpy.")
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--sim", choices=memory.SIMS, default="model",
                   help="simulator (default: %(default)s; the RTL ones with --quick: "
                        "about a minute a run, verilator and icarus one build per scheme)")
    add_number(p, "--seed", low=0, default=0, help="seed of the sequence lengths (default: 0)")
    p.add_argument("--no-area", action="store_true", help="skip the MUs' area (yosys)")
    add_output(p, "--plot", default=None, metavar="PNG", suffixes=image_suffixes,
               help="occupancy of the cache MU over time (model only)")
    add_output(p, "--json", metavar="FILE", help="also write the figures to FILE")
    add_check(p, _check_memory)
    p.set_defaults(func=_bench_memory)

    p = sub.add_parser(
        "boards", help="largest fabric that fits each board, utilization and Fmax per size",
        description="Build growing grids with each board's preset until one does not fit, "
                    "then grow the MU of the largest grid that fits; records utilization and "
                    "Fmax per build. Builds take minutes each.")
    p.add_argument("--boards", default="icebreaker,ulx3s")
    p.add_argument("--grids", default="1x2,2x2,2x3,3x3,3x4,4x4",
                   help="grids to try in order (default: %(default)s)")
    p.add_argument("--mu-words", dest="bench_mu_words",
                   help="MU sizes to try on the largest grid, e.g. 512,1024,2048 (default: "
                        "twice and four times the preset's)")
    add_output(p, "--root", default="build/bench-boards", folder=True,
               help="build folders under this")
    add_output(p, "--json", metavar="FILE")
    add_check(p, _check_boards)
    p.set_defaults(func=_bench_boards)
