"""``rdakit bench clusters``: remote against local MU access and a matrix-vector product
across clusters, measured on the RTL; the workloads partitioned across 2 and 4 clusters, with
the cost model's estimates.

:func:`measure_access` runs, in Amaranth's simulator, one CU of cluster 0 reading a buffer of
an MU of its own cluster and then the same buffer placed in cluster 1: ``reads`` blocking
``READ`` instructions one after the other (the round-trip latency of one access) and one stream
of ``words`` vector words (``SRUN`` with ``outstanding`` reads in flight: the bandwidth). The
figures are cycles between the host's START and the CU's done, from the fabric's own counter.
"""

import numpy as np
from amaranth.utils import ceil_log2

from rdakit.compiler.partition.clusters import CLUSTER_STRATEGIES, ClusterSpec, partition_system
from rdakit.compiler.workloads import build
from rdakit.hdl.cluster.system import System, SystemParams
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.isa import assemble
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.flows.e2e import SMALLEST, failure
from rdakit.sim.flows.system import SystemRunSpec, run_system_session
from rdakit.sim.runtime.clusters import run_system, run_system_job
from rdakit.sim.runtime.host import AmaranthTransport, HostDriver
from rdakit.sim.verify.amaranth_sim import simulate
from rdakit.sim.verify.kernels import cluster_matvec

__all__ = ["measure_access", "measure_matvec", "partition_rows", "measured_rows", "SCENARIOS",
           "rtl_system"]


def _programs(reads, words):
    latency = assemble(f"""
        LI r4, 0
        LI r7, {reads}
    loop:
        READ 0, r3, r1, r4
        LOOP r7, loop
        HALT
    """)
    stream = assemble(f"""
        SCFG A_REF, r1
        SCFGI A_STRIDE, 1
        SCFGI N, {words}
        SCFGI D_MODE, 0          # DISCARD
        SRUN PASS, r0
        HALT
    """)
    empty = assemble("HALT")
    return latency, stream, empty


def measure_access(system_params, *, reads=16, words=64, system=None):
    """Cycles of local and remote accesses from the first CU of cluster 0.

    Returns
    -------
    dict
        ``{"local": {...}, "remote": {...}}`` with ``latency_cycles`` (per READ, loop
        included), ``stream_cycles`` (for ``words`` words), ``words_per_cycle`` and, for the
        remote run, ``link_packets`` (requests and responses that crossed the links).
    """
    fp = system_params.fabric
    system = System(system_params) if system is None else system
    cu = fp.tiles("C")[0]
    mu = min(fp.tiles("M"), key=lambda t: (abs(t[0] - cu[0]) + abs(t[1] - cu[1]), t[1], t[0]))
    latency, stream, empty = _programs(reads, words)
    data = np.arange(words * fp.cu.lanes, dtype=np.int32).reshape(words, fp.cu.lanes)
    out = {}

    async def bench(ctx):
        hosts = [HostDriver(fp, AmaranthTransport(ctx, system.host_port(k)))
                 for k in range(system_params.clusters)]
        for where, cluster in (("local", 0), ("remote", 1)):
            ref = await hosts[cluster].alloc((*mu, cluster))
            await hosts[cluster].append_vectors(ref, data)
            before = [int(ctx.get(system.req_packets[k])) + int(ctx.get(system.rsp_packets[k]))
                      for k in range(system_params.clusters)]
            figures = {}
            for name, program in (("latency", latency), ("stream", stream)):
                configs = [FabricConfig(fp, {cu: TileConfig(program=program, regs={1: ref})})]
                configs += [None] * (system_params.clusters - 1)
                cycles = (await run_system(hosts, configs))[0]
                figures[f"{name}_cycles"] = cycles
            after = [int(ctx.get(system.req_packets[k])) + int(ctx.get(system.rsp_packets[k]))
                     for k in range(system_params.clusters)]
            out[where] = {
                "latency_cycles": round(figures["latency_cycles"] / reads, 2),
                "stream_cycles": figures["stream_cycles"],
                "words_per_cycle": round(words / figures["stream_cycles"], 3),
                "link_packets": sum(after) - sum(before),
            }
            await hosts[cluster].release(ref)
        # An empty program: the START-to-done overhead included in every figure above.
        configs = [FabricConfig(fp, {cu: TileConfig(program=empty)})]
        configs += [None] * (system_params.clusters - 1)
        out["overhead_cycles"] = (await run_system(hosts, configs))[0]

    simulate(system, bench)
    return out


def measure_matvec(system_params, *, m=16, k=32, system=None):
    """:func:`~rdakit.sim.verify.kernels.cluster_matvec` over every cluster of a system, in
    Amaranth's simulator: y = W x with the rows of W split over every CU and x shared from
    cluster 0. Returns per-cluster run cycles, the packets over the links, whether y equals
    numpy's, and whether the shared x was freed (exactly once, by its last holder)."""
    fp = system_params.fabric
    system = System(system_params) if system is None else system
    job = cluster_matvec(fp, clusters=system_params.clusters, m=m, k=k)
    out = {}

    async def bench(ctx):
        hosts = [HostDriver(fp, AmaranthTransport(ctx, system.host_port(k)))
                 for k in range(system_params.clusters)]
        x_mu = job.buffers[0].mu
        outputs, cycles, _ = await run_system_job(hosts, job)
        out["cycles"] = [cycles.get(c) for c in range(system_params.clusters)]
        out["link_packets"] = sum(int(ctx.get(system.req_packets[c]))
                                  + int(ctx.get(system.rsp_packets[c]))
                                  for c in range(system_params.clusters))
        out["exact"] = all(np.array_equal(outputs[n], job.expected[n]) for n in job.outputs)
        counters = (await hosts[x_mu[2]].counters())[x_mu[:2]]
        out["x_freed"] = counters["frees"] >= 1 and counters["live_buffers"] == 0

    simulate(system, bench)
    return out


#: Cluster configurations of the partitioning table: ``(label, [(cus, load), ...])``; the
#: label lists each cluster's available CUs (``+L``: an injected load of L cycles).
SCENARIOS = {
    2: [("4 4", [(4, 0), (4, 0)]), ("4 1", [(4, 0), (1, 0)]), ("4 4+2000", [(4, 0), (4, 2000)])],
    4: [("4 4 4 4", [(4, 0)] * 4), ("4 4 4 1", [(4, 0)] * 3 + [(1, 0)])],
}


def partition_rows(workloads, cluster_counts, link, *, strategies=None):
    """Rows of the cross-cluster partitioning table: per workload (default sizes), cluster
    configuration of :data:`SCENARIOS` and strategy, the estimated makespan
    (:func:`~rdakit.compiler.partition.clusters.system_schedule`), the bytes that cross the
    links, the work per cluster, and the makespan over round-robin's."""
    strategies = tuple(strategies or CLUSTER_STRATEGIES)
    rows = []
    for name in workloads:
        graph = build(name).graph
        for n in cluster_counts:
            for label, specs in SCENARIOS[n]:
                clusters = [ClusterSpec(cus, load=load) for cus, load in specs]
                res = {s: partition_system(graph, clusters, s, link=link)
                       for s in dict.fromkeys(("round_robin", *strategies))}
                for s in strategies:
                    r = res[s]
                    rows.append({"workload": name, "clusters": label, "partitioner": s,
                                 "est_cycles": r.makespan, "crossing_bytes": r.crossing_bytes,
                                 "work": [int(w) for w in r.work],
                                 "vs_round_robin": round(r.makespan
                                                         / res["round_robin"].makespan, 3)})
    return rows


def rtl_system(clusters, rows=2, cols=2):
    """The system the compiled workloads run on in :func:`measured_rows`: ``clusters``
    fabrics of ``rows x cols`` with compiled programs' length (2048), coordinates wide enough
    for the clusters side by side, links of the default width and 20 cycles."""

    fp = fabric_params(rows, cols, prog_len=2048, cluster_bits=max(1, ceil_log2(clusters)),
                       coord_bits=max(1, ceil_log2(max(rows, clusters * cols))))
    return SystemParams(fp, clusters=clusters)


def measured_rows(workloads, cluster_counts, *, strategies=None, rows=2, cols=2,
                  place_steps=20000, progress=None):
    """Rows of the measured table: each workload at its smallest size compiled across
    ``n`` clusters of ``rows x cols`` (for each ``n`` of ``cluster_counts``) by each
    cross-cluster strategy and run on the RTL system in Amaranth's simulator: cycles (the
    last cluster's), the estimate, the bytes the partition sends over links, the packets that
    crossed them, the work per cluster, cycles over round-robin's, and the numpy check."""
    strategies = tuple(strategies or CLUSTER_STRATEGIES)
    out = []
    for n in cluster_counts:
        sp = rtl_system(n, rows, cols)
        for name in workloads:
            runs = {}
            for s in dict.fromkeys(("round_robin", *strategies)):
                if progress:
                    progress(f"{name} on {n} clusters, {s}")
                spec = SystemRunSpec(name, sp, sizes=SMALLEST[name], strategy=s,
                                     place_steps=place_steps)
                runs[s] = run_system_session(spec)[0]
            for s in strategies:
                r = runs[s]
                rr = runs["round_robin"]["cycles"]
                out.append({"workload": name, "clusters": n, "partitioner": s,
                            "cycles": r["cycles"], "est_cycles": r["estimated_cycles"],
                            "crossing_bytes": r["crossing_bytes"],
                            "link_packets": r.get("link_packets"), "work": r["work"],
                            "vs_round_robin": (round(r["cycles"] / rr, 3)
                                               if r["cycles"] and rr else None),
                            "check": failure(r) or "ok"})
    return out
