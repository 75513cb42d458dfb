"""``rdakit run``: compile a workload, run it on a simulated fabric, check it and report."""

from amaranth.utils import ceil_log2

from rdakit.cli.compile import (
    FIT_ERRORS,
    add_workload_arguments,
    choose_fabric,
    load_or_explain,
    parse_split,
)
from rdakit.cli.options import (
    AUTO,
    RUN_PROG_LEN,
    add_check,
    add_verilator_arguments,
    check_clusters,
    check_sizes,
    checked_params,
    dashed,
    fabric_candidates,
    fabric_dict,
    fabric_from_args,
    parse_grid,
    parse_sizes,
)
from rdakit.cli.outputs import add_output, image_suffixes
from rdakit.cli.progress import progress_bar
from rdakit.compiler.partition.clusters import CLUSTER_STRATEGIES
from rdakit.errors import UserError
from rdakit.hdl.cluster.system import SystemParams
from rdakit.sim.bench.report import Report
from rdakit.sim.flows import e2e
from rdakit.sim.flows.system import SystemRunSpec, run_system_session
from rdakit.sim.verify.runner import require_simulator_or_raise

__all__ = ["register", "RUN_PROG_LEN"]

#: The iterations of ``--adapt``: each compiles and simulates the whole workload again.
MAX_ADAPT = 100

#: Cycles ``--inject-load`` may add before a cluster starts: every one is simulated, and
#: Amaranth's simulator takes minutes for a million cycles of a system.
MAX_INJECT_LOAD = 1_000_000


def spec_from_args(args, *, iterations=1, fabric=None):
    return e2e.RunSpec(workload=args.workload, sizes=parse_sizes(args.size),
                       fabric=fabric or fabric_dict(args), partitioner=args.partitioner,
                       seed=args.seed, iterations=iterations, place_steps=args.place_steps,
                       split=getattr(args, "split", None),
                       streams=getattr(args, "streams", True),
                       order=getattr(args, "order", "graph"))


def compile_or_explain(spec, cost=None):
    """Compile ``spec`` or raise a UserError saying why it does not fit."""
    params = spec.params
    try:
        return spec.compile(cost)
    except FIT_ERRORS as e:
        raise UserError(f"{spec.workload} does not fit the {params.rows}x{params.cols} fabric: "
                        f"{e}") from None
    except (TypeError, ValueError, OSError) as e:
        raise UserError(str(e)) from None


def _check(args):
    """Every option of ``rdakit run``, before anything is compiled or simulated."""
    if args.adapt is not None and not 1 <= args.adapt <= MAX_ADAPT:
        raise UserError(f"--adapt takes a number of iterations >= 1 and at most {MAX_ADAPT} "
                        f"(each is a whole run), not {args.adapt}")
    args.sizes = parse_sizes(args.size)
    args.split = parse_split(args.split)
    if args.clusters is not None:
        if args.split is not None:
            raise UserError("--split applies to one fabric; across clusters each cluster's "
                            "ops are not split")
        if args.order is not None:
            raise UserError("--order applies to one fabric; across clusters each CU's ops "
                            "run in the graph's order")
        if args.partitioner == "fastest":
            raise UserError("--partitioner fastest compiles one fabric with several strategies; "
                            "across clusters name one of the strategies (default multilevel)")
        args.partitioner = args.partitioner or "multilevel"
        args.system_spec = system_spec_from_args(args)
        return
    args.partitioner = args.partitioner or "fastest"
    args.order = args.order or "auto"
    for opt in ("slow_cluster", "inject_load", "cluster_cus", "link_width"):
        if getattr(args, opt) is not None:
            raise UserError(f"--{opt.replace('_', '-')} needs --clusters N")
    check_sizes(args.workload, args.sizes, fabric_candidates(args))
    if args.sim == "model" and args.waves:
        raise UserError(f"--waves {args.waves} needs a simulation of the RTL: the performance "
                        f"model (--sim model) has no signals to dump; use --sim amaranth, "
                        f"icarus or verilator")
    if args.waves and getattr(args, "driver", None) == "direct":
        raise UserError(f"--waves {args.waves} needs the cocotb build (--driver cocotb, what "
                        f"--waves uses when --driver is not given): --driver direct records no "
                        f"signals")
    if args.sim in e2e.NEEDS_TOOLS:
        require_simulator_or_raise(args.sim)


def _waves_suffixes(args):
    return ("an FST", (".fst",)) if args.sim == "verilator" else ("a VCD", (".vcd",))


def _run(args):
    if args.clusters is not None:
        return _run_clusters(args)
    workload = load_or_explain(args)
    kw, chosen = choose_fabric(workload, fabric_candidates(args), name=args.workload,
                               partitioner=args.partitioner, seed=args.seed,
                               place_steps=args.place_steps, split=args.split,
                               streams=args.streams, order=args.order)
    spec = spec_from_args(args, iterations=args.adapt or 1, fabric=kw)
    params = spec.params
    _, summary = compile_or_explain(spec)
    report = Report("run")
    for line in workload.options.get("import_summary", ()):
        report.console.print(line, markup=False)
    if chosen:
        report.console.print(chosen)
    for line in summary.warnings():
        report.console.print(line, style="yellow", markup=False)
    report.console.print(f"[bold]{summary.graph}[/bold] on a {params.rows}x{params.cols} fabric "
                         f"({params.cu.lanes} lanes) with {args.sim}; {summary.how()}")
    for line in summary.ranked_lines():
        report.console.print(line, markup=False)
    timings = {}
    with progress_bar(not args.quiet and report.console.is_terminal) as progress:
        rows = e2e.run(spec, sim=args.sim, waves=args.waves, progress=progress,
                       build=args.verilator_build, timings=timings)
    last = rows[-1]
    report.table("Iterations" + (" (adaptation: re-partitioned with measured costs)"
                                 if spec.iterations > 1 else ""),
                 [{k: r.get(k) for k in ("iteration", "cycles", "estimated_cycles",
                                         "lower_bound", "utilization", "parts", "cut",
                                         "noc_flits", "numpy", "interpreter")}
                  for r in rows], key="iterations")
    if last["tiles"]:
        report.table(f"Tiles (iteration {last['iteration']}): utilization = busy / cycles, "
                     f"active = (busy - stall) / cycles", last["tiles"], key="tiles")
    if args.profile and last.get("profile"):
        report.table(f"Profile (iteration {last['iteration']}): each CU's cycles by what it "
                     f"was doing (docs/e2e.md)", last["profile"], key="profile")
    best = min((r for r in rows if r["cycles"]), key=lambda r: r["cycles"], default=None)
    for key in ("cycles", "load_cycles", "lower_bound", "lanes_bound", "mu_bound",
                "injection_bound", "cycles_over_bound", "utilization", "active", "noc_flits",
                "mu_peak_words", "allocs", "frees", "leaked_buffers", "numpy", "interpreter",
                "hw_error"):
        report.figure(key, last.get(key))
    if best is not None and spec.iterations > 1:
        report.figure("best_iteration", best["iteration"])
        report.figure("best_cycles", best["cycles"])
    report.figure("workload", summary.graph)
    report.figure("fabric", f"{params.rows}x{params.cols}")
    report.figure("simulator", args.sim)
    report.data("iterations_full", rows)
    if timings:
        report.console.print(_timings_line(args.sim, timings, last.get("cycles")),
                             markup=False)
        report.data("timings", [timings])
    report.finish(args.report)
    if args.plot and last["tiles"]:
        e2e.plot_utilization(params, last["tiles"], args.plot,
                             title=f"{summary.graph}, {last['cycles']} cycles ({args.sim})")
        report.console.print(f"wrote {args.plot}")
    if isinstance(args.profile, str) and last.get("profile"):
        e2e.plot_profile(last["profile"], args.profile,
                         title=f"{summary.graph}, {last['cycles']} cycles ({args.sim})")
        report.console.print(f"wrote {args.profile}")
    if args.waves:
        report.console.print(f"wrote {args.waves}")
    return _verdict(report, rows, "outputs equal numpy's and the interpreter's bit for bit; "
                                  "every buffer freed")


def _timings_line(sim, timings, cycles):
    """One line saying where the wall time of a cocotb run went (:func:`e2e.run`'s
    ``timings``) and the simulated cycles per wall second of its ``running`` stage."""
    parts = [f"Verilog {timings['verilog_s']:.1f} s"]
    if "verilate_s" in timings:
        state = "built now" if timings.get("built") else "cached"
        cpu = {k: f" ({timings[k + '_cpu_s']:.1f} CPU s)" if k + "_cpu_s" in timings else ""
               for k in ("verilate", "compile")}
        parts.append(f"build {state} (verilate {timings['verilate_s']:.1f} s{cpu['verilate']}, "
                     f"C++ {timings['compile_s']:.1f} s{cpu['compile']} at -O{timings['opt']} with "
                     f"{timings['jobs']} jobs, {timings['threads']} thread(s), public "
                     f"{timings['public']})")
    else:
        parts.append(f"build {timings['build_s']:.1f} s")
    running = timings.get("stages", {}).get("running")
    cpu = timings.get("stages_cpu", {}).get("running")
    rate = f", {cycles / running:,.0f} cycles/s" if cycles and running else ""
    rate += f", {cycles / cpu:,.0f} cycles per CPU second" if cycles and cpu else ""
    parts.append(f"run {timings['run_s']:.1f} s, of which running {running or 0:.1f} s "
                 f"({cpu or 0:.1f} CPU s{rate})")
    return f"{sim}: " + "; ".join(parts)


def _verdict(report, rows, passed):
    """Print the first failing iteration and why (exit status 1), or ``passed`` (0)."""
    for r in rows:
        why = e2e.failure(r)
        if why:
            report.console.print(f"[bold red]FAILED[/bold red] in iteration {r['iteration']}: "
                                 f"{why}")
            return 1
    report.console.print(f"[bold green]PASS[/bold green]: {passed}")
    return 0


def system_spec_from_args(args):
    """The :class:`~rdakit.sim.flows.system.SystemRunSpec` of ``rdakit run --clusters N``, or a
    UserError naming the problem. The clusters' coordinates are wide enough for the grid of
    all clusters side by side (the compiler's view of the system, docs/clusters.md)."""
    n = check_clusters(args.clusters)
    if args.fabric == AUTO:
        args.fabric = "2x2"                     # each cluster's fabric: auto picks no system
    if args.mu_words is None:
        args.mu_words = fabric_dict(args)["mu_words"]
    if args.sim != "amaranth":
        raise UserError(f"--clusters runs in the built-in simulator only (--sim amaranth), not "
                        f"{args.sim}; the cocotb tests run systems on Icarus and Verilator "
                        f"(docs/clusters.md)")
    if args.waves or args.plot or args.profile:
        raise UserError("--waves, --plot and --profile are for a single fabric, not with "
                        "--clusters")
    rows, cols = parse_grid(args.fabric)
    params = fabric_from_args(args, cluster_bits=max(1, ceil_log2(n)),
                              coord_bits=max(1, ceil_log2(max(rows, n * cols))))
    delays = {}
    if args.slow_cluster is not None or args.inject_load is not None:
        if args.slow_cluster is None or args.inject_load is None:
            raise UserError("--slow-cluster K and --inject-load CYCLES go together")
        if not 0 <= args.slow_cluster < n:
            raise UserError(f"--slow-cluster must name a cluster from 0 to {n - 1}, not "
                            f"{args.slow_cluster}")
        if not 0 <= args.inject_load <= MAX_INJECT_LOAD:
            raise UserError(f"--inject-load must be cycles from 0 to {MAX_INJECT_LOAD} (each "
                            f"is simulated), not {args.inject_load}")
        delays[args.slow_cluster] = args.inject_load
    cus = None
    if args.cluster_cus is not None:
        try:
            cus = [int(k) for k in args.cluster_cus.split(",")]
        except ValueError:
            raise UserError(f"--cluster-cus takes one number per cluster like 2,1, not "
                            f"{args.cluster_cus!r}") from None
        ncu = len(params.tiles("C"))
        if len(cus) != n or any(not 0 <= k <= ncu for k in cus):
            raise UserError(f"--cluster-cus takes {n} numbers from 0 to {ncu} (the CUs of a "
                            f"cluster), not {args.cluster_cus!r}")
    check_sizes(args.workload, args.sizes, [fabric_dict(args)])
    links = dict(fabric=params, clusters=n, link_width=args.link_width,
                 link_latency=args.link_latency)
    system = checked_params(SystemParams, links,
                            dict(links, link_width=None, link_latency=20), dashed)
    try:
        return SystemRunSpec(args.workload, system, sizes=parse_sizes(args.size), cus=cus,
                             strategy=args.cluster_partitioner, inner=args.partitioner,
                             iterations=args.adapt or 1, delays=delays, seed=args.seed,
                             place_steps=args.place_steps)
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None


def _run_clusters(args):
    spec = args.system_spec
    sp = spec.system
    fp = sp.fabric
    report = Report("run")
    slow = "".join(f"; cluster {k} spins {d} cycles before its programs (injected load, "
                   f"unknown to the compiler)" for k, d in spec.delays.items())
    report.console.print(
        f"[bold]{spec.workload}[/bold] on {sp.clusters} clusters of {fp.rows}x{fp.cols} "
        f"(link {sp.link_width} wires, {sp.link_latency} cycles) in Amaranth's simulator; "
        f"partitioners {spec.strategy} across clusters, {spec.inner} within{slow}")
    with progress_bar(not args.quiet and report.console.is_terminal) as progress:
        try:
            rows = run_system_session(spec, progress=progress)
        except FIT_ERRORS as e:
            raise UserError(f"{spec.workload} does not fit {sp.clusters} clusters of "
                            f"{fp.rows}x{fp.cols}: {e}") from None
    keys = ("iteration", "partitioner", "cycles", "finish", "busy", "work", "loads",
            "cus_used", "estimated_cycles", "crossing_bytes", "cut_edges", "link_packets",
            "numpy", "leaked_buffers")
    report.table("Iterations" + (" (adaptation: each cluster's measured busy time fed back "
                                 "as its load, re-partitioned and reloaded)"
                                 if spec.iterations > 1 else ""),
                 [{k: r.get(k) for k in keys} for r in rows], key="iterations")
    last = rows[-1]
    for key in ("cycles", "crossing_bytes", "link_packets", "numpy", "leaked_buffers",
                "hw_error"):
        report.figure(key, last.get(key))
    report.figure("workload", spec.workload)
    report.figure("system", f"{sp.clusters}x {fp.rows}x{fp.cols}")
    report.data("iterations_full", rows)
    report.finish(args.report)
    return _verdict(report, rows, "outputs equal numpy's bit for bit on every iteration; "
                                  "every buffer of every cluster freed")


def register(commands):
    p = commands.add_parser(
        "run", help="compile a workload, run it on a simulated fabric and check it",
        description="Compile a workload (mlp, decoder, moe, switch, mixtral or a Python graph "
                    "file), generate the fabric, load the bitstream and inputs through the host "
                    "port, run to done, read the outputs, compare them bit for bit with numpy "
                    "and with the functional interpreter, and report cycles, per-tile "
                    "utilization, NoC flits, MU peak memory and buffers allocated and freed. "
                    "Exits 1 on a mismatch, a CU error or a leaked buffer; 2 when the workload "
                    f"does not fit. CU program length defaults to {RUN_PROG_LEN} here.")
    add_workload_arguments(p)
    p.add_argument("--sim", choices=e2e.BACKENDS, default="amaranth",
                   help="simulator: amaranth (built in, no tools), icarus or verilator, or "
                        "model, the fast performance model calibrated to the RTL "
                        "(docs/performance-model.md) (default: %(default)s)")
    add_output(p, "--waves", metavar="FILE", suffixes=_waves_suffixes,
               help="write waveforms to FILE (.vcd; .fst with verilator)")
    add_output(p, "--report", metavar="FILE.json", help="write the full report as JSON")
    add_output(p, "--plot", metavar="FILE.png", suffixes=image_suffixes,
               help="write a heatmap of tile utilization (.png or another image format "
                    "matplotlib writes)")
    add_output(p, "--profile", nargs="?", const=True, default=None, metavar="FILE.png",
               suffixes=image_suffixes,
               help="print where each CU's cycles went (the hardware's cycle accounting: "
                    "stream steps, waits, fences, MU round trips, stream start-up, "
                    "instructions); with FILE.png also a stacked bar chart of it")
    p.add_argument("--adapt", type=int, metavar="N",
                   help="run N iterations; after each, feed the measured per-CU costs into "
                        "the cost model, re-partition and reload")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_verilator_arguments(p)

    g = p.add_argument_group("a system of clusters (docs/clusters.md); --fabric is each "
                             "cluster's")
    g.add_argument("--clusters", type=int, metavar="N",
                   help="partition across N clusters joined by links and run the system "
                        "(built-in simulator only); with --adapt, feed each cluster's measured "
                        "busy time back as its load")
    g.add_argument("--cluster-partitioner", default="greedy", choices=CLUSTER_STRATEGIES,
                   help="the partitioner across clusters (default: %(default)s)")
    g.add_argument("--cluster-cus", metavar="LIST",
                   help="CUs each cluster offers, e.g. 2,1 (default: all)")
    g.add_argument("--link-width", type=int,
                   help="wires of each inter-cluster link (default: a quarter of a request)")
    g.add_argument("--link-latency", type=int, default=20,
                   help="cycles of each link's wire delay (default: 20)")
    g.add_argument("--slow-cluster", type=int, metavar="K",
                   help="make cluster K slower by an injected load (with --inject-load)")
    g.add_argument("--inject-load", type=int, metavar="CYCLES",
                   help="cycles cluster K is busy with other work before it starts; the "
                        "compiler is not told")
    add_check(p, _check)
    p.set_defaults(func=_run)
