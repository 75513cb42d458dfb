"""``rdakit verilog system`` (the Verilog of a system of clusters) and ``rdakit bench
clusters`` (``docs/clusters.md``).

:func:`add_system_arguments` and :func:`system_from_args` describe a system on any command
line (the fabric options of every cluster plus the cluster count and the link).
"""

import re

from amaranth.utils import ceil_log2

from rdakit.cli.options import add_fabric_arguments, fabric_from_args

__all__ = ["register", "add_system_arguments", "system_from_args"]


def add_system_arguments(parser, *, default_fabric="2x2"):
    """The options of :func:`system_from_args`: every cluster's fabric (``--fabric RxC`` or
    ``--rows R --cols C``), ``--clusters``, ``--link-width``, ``--link-latency``,
    ``--link-depth`` and ``--bridge X,Y``."""
    add_fabric_arguments(parser, default=default_fabric)
    g = parser.add_argument_group("system of clusters (docs/clusters.md)")
    g.add_argument("--rows", type=int, help="rows of every cluster (instead of --fabric)")
    g.add_argument("--cols", type=int, help="columns of every cluster (instead of --fabric)")
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
    from rdakit.errors import UserError
    from rdakit.hdl.cluster.system import SystemParams

    if args.rows is not None or args.cols is not None:
        m = re.fullmatch(r"(\d+)x(\d+)", args.fabric)
        rows, cols = (int(m.group(1)), int(m.group(2))) if m else (2, 2)
        args.fabric = f"{args.rows if args.rows is not None else rows}x" \
                      f"{args.cols if args.cols is not None else cols}"
    n = args.clusters
    if not isinstance(n, int) or n < 1 or n > 256:
        raise UserError(f"--clusters must be from 1 to 256, not {n!r}")
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


def _verilog_system(args):
    from rdakit.cli.verilog import write_verilog
    from rdakit.hdl.cluster.system import System

    sp = system_from_args(args)
    fp = sp.fabric
    return write_verilog(args, System(sp), f"{sp.clusters} clusters of {fp.rows}x{fp.cols}, "
                                           f"links {sp.link_width} wires, "
                                           f"{sp.link_latency} cycles")


def _bench_clusters(args):
    from rdakit.compiler.partition.clusters import LinkModel
    from rdakit.compiler.workloads import WORKLOADS
    from rdakit.errors import UserError
    from rdakit.hdl.cluster.system import System
    from rdakit.sim.bench import clusters as cluster_bench
    from rdakit.sim.bench.report import Report

    sp = system_from_args(args)
    workloads = args.workloads.split(",")
    for w in workloads:
        if w not in WORKLOADS:
            raise UserError(f"--workloads takes names of {', '.join(sorted(WORKLOADS))}, "
                            f"not {w!r}")
    fp = sp.fabric
    report = Report("clusters")
    link = f"{sp.link_width} wires, {sp.link_latency} cycles"
    report.console.print(f"{sp.clusters} clusters of {fp.rows}x{fp.cols}, links of {link} "
                         f"(Amaranth's simulator)")
    system = System(sp)
    access = cluster_bench.measure_access(sp, system=system)
    report.table("Remote against local access on the RTL: one CU of cluster 0 reading an MU "
                 "of its own cluster, then of cluster 1 (16 blocking READs; a 64-word stream)",
                 [{"link": link, "access": where, **access[where]}
                  for where in ("local", "remote")])
    matvec = cluster_bench.measure_matvec(sp, system=system)
    report.table("A matrix-vector product over every CU of every cluster on the RTL (x shared "
                 "from cluster 0, read remotely and freed by its last holder)",
                 [{"clusters": sp.clusters, **matvec}])
    rows = cluster_bench.partition_rows(workloads, (2, 4), LinkModel.of_system(sp))
    report.table("The workloads partitioned across clusters (cost-model estimates; clusters = "
                 "each cluster's available CUs, +L an injected load of L cycles)", rows)
    measured = []
    if args.rtl_workloads:
        from rdakit.cli.run import progress_bar

        with progress_bar(report.console.is_terminal) as progress:
            measured = cluster_bench.measured_rows(workloads, (2, 4), progress=progress)
        report.table("The workloads (smallest sizes) compiled across 2 and 4 clusters of 2x2 "
                     "and run on the RTL (links of the default width, 20 cycles): measured "
                     "cycles, the estimate, bytes the partition sends over links, packets "
                     "that crossed them", measured)
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


def register(commands, verilog, bench):
    b = bench.add_parser(
        "clusters", help="clusters: remote vs local access, cross-cluster partitioning",
        description="On a system of clusters (Amaranth's simulator): the latency and bandwidth "
                    "of remote against local MU access, and a matrix-vector product over "
                    "every CU of every cluster checked against numpy; then the workloads "
                    "partitioned across 2 and 4 clusters (also with one slower cluster) by "
                    "the cross-cluster greedy beside round-robin and static, with the cost "
                    "model's estimated cycles and the bytes that cross the links.")
    add_system_arguments(b, default_fabric="1x2")
    b.add_argument("--workloads", default="mlp,decoder,moe",
                   help="comma-separated workloads of the partitioning table "
                        "(default: %(default)s)")
    b.add_argument("--rtl-workloads", action="store_true",
                   help="also compile the workloads (smallest sizes) across 2 and 4 clusters "
                        "of 2x2 with every cross-cluster partitioner and run them on the RTL "
                        "(tens of minutes)")
    b.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    b.set_defaults(func=_bench_clusters)

    p = verilog.add_parser(
        "system", help="a system of clusters joined by bridges",
        description="Write the Verilog of N fabrics (clusters) sharing one MU address space "
                    "through bridge tiles and inter-cluster links, with one host port per "
                    "cluster (ports cmd__K__*, reply__K__*; docs/clusters.md).")
    add_system_arguments(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="Verilog file to write ('-' for standard output)")
    p.add_argument("--name", default="top", help="top module name (default: %(default)s)")
    p.set_defaults(func=_verilog_system)
