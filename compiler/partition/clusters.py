"""Partitioning across clusters, then within each cluster; shared buffers placed near readers.

A system (``docs/clusters.md``) is several fabrics joined by links that are slower than the
NoC. The compiler therefore partitions in two levels:

1. **Across clusters**, with seed 2's engine (``findBestCluster`` /
   ``calculatePartitioningCost``): the graph is cut into subgraphs
   (:func:`~rdakit.compiler.partition.greedy.decompose`, contiguous pieces of a depth-first
   topological order), and each, in order, goes to the cluster of least cost::

       cost(s, c) = finish(s, c) + transfer_weight * crossing(s, c)
                    + overload_weight * overload(s, c)

   ``finish`` is when ``s`` would finish on ``c``: once its inputs have arrived (a tensor from
   another cluster crosses a link: ``ceil(bytes / link.bytes_per_cycle) + link.latency``) and
   once ``c`` has worked through its load and the work already given to it, at the speed of
   its available CUs (a fluid model: a cluster of ``n`` CUs does ``n`` cycles of work a cycle).
   ``crossing`` is the cycles of every input that crosses a link, critical or not, and
   ``overload`` the work above ``(1 + eps)`` times ``c``'s fair share, which is proportional
   to its available CUs, in cycles of ``c``. So a cluster with fewer available CUs, or an
   injected load, gets less work, and a subgraph stays with its inputs unless moving pays.
2. **Within each cluster**, the nodes it got are partitioned onto its available CUs by any
   strategy of :mod:`~rdakit.compiler.partition`.

Buffers with no inputs (graph inputs, constants; no work) are placed afterwards in the cluster
that reads the most bytes of them, so the bytes that cross links for them are the least
possible for the chosen assignment (:func:`place_buffers`).

:func:`partition_system` does both levels and measures the result with :func:`system_schedule`,
a list schedule in which a transfer inside a CU is free, inside a cluster costs the NoC's
transfer, and between clusters costs the link's.
"""

import dataclasses
import time
from typing import ClassVar

import numpy as np

from rdakit.compiler.cost import CostModel, priority_order
from rdakit.compiler.partition import PartitionError, Targets, as_weighted, get_strategy, partition
from rdakit.compiler.partition.greedy import decompose
from rdakit.compiler.partition.wgraph import WeightedGraph

__all__ = ["ClusterSpec", "LinkModel", "CrossClusterGreedy", "CLUSTER_STRATEGIES",
           "place_buffers", "partition_clusters", "partition_system", "system_schedule",
           "SystemPartition", "induced_subgraph", "observed_clusters"]


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """What one cluster offers the partitioner.

    Parameters
    ----------
    cus : int
        CUs available for this graph (0: the cluster takes no work).
    load : float
        Cycles of work the cluster already carries (injected load), spread over its CUs.
    name : str or None
        Name for messages and tables (default ``cluster<k>``).

    Raises
    ------
    TypeError
        If ``cus`` is not a non-negative integer or ``load`` a non-negative number.
    """

    cus: int
    load: float = 0.0
    name: str | None = None

    def __post_init__(self):
        if not isinstance(self.cus, int) or isinstance(self.cus, bool) or self.cus < 0:
            raise TypeError(f"cus must be a non-negative integer, not {self.cus!r}")
        if not isinstance(self.load, int | float) or isinstance(self.load, bool) \
                or self.load < 0:
            raise TypeError(f"load must be a non-negative number, not {self.load!r}")


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """The inter-cluster link as the cost model sees it.

    Parameters
    ----------
    bytes_per_cycle : float
        Bytes a link moves per cycle (a link of ``W`` wires: ``W / 8``).
    latency : int
        Cycles of latency of a crossing.

    Raises
    ------
    TypeError
        If a parameter is not positive (``latency``: a non-negative integer).
    """

    bytes_per_cycle: float = 1.0
    latency: int = 20

    def __post_init__(self):
        if not isinstance(self.bytes_per_cycle, int | float) \
                or isinstance(self.bytes_per_cycle, bool) or self.bytes_per_cycle <= 0:
            raise TypeError(f"bytes_per_cycle must be a positive number, "
                            f"not {self.bytes_per_cycle!r}")
        if not isinstance(self.latency, int) or isinstance(self.latency, bool) \
                or self.latency < 0:
            raise TypeError(f"latency must be a non-negative integer, not {self.latency!r}")

    @classmethod
    def of_system(cls, system_params):
        """The link of a :class:`~rdakit.hdl.cluster.system.SystemParams`."""
        return cls(bytes_per_cycle=system_params.link_width / 8,
                   latency=system_params.link_latency)

    def crossing_cycles(self, nbytes):
        """Cycles to move ``nbytes`` (array) from one cluster to another."""
        nbytes = np.asarray(nbytes, dtype=float)
        return np.ceil(nbytes / self.bytes_per_cycle) + self.latency


def _check_clusters(clusters):
    clusters = tuple(clusters)
    if not clusters or not all(isinstance(c, ClusterSpec) for c in clusters):
        raise TypeError(f"clusters must be a non-empty sequence of ClusterSpec, "
                        f"not {clusters!r}")
    if sum(c.cus for c in clusters) == 0:
        raise PartitionError("No cluster has an available CU")
    return clusters


def _cluster_name(clusters, c):
    return clusters[c].name or f"cluster{c}"


@dataclasses.dataclass(frozen=True)
class CrossClusterGreedy:
    """Seed 2's greedy across clusters (see the module docstring).

    Parameters
    ----------
    link : LinkModel
        The inter-cluster link.
    subgraphs_per_cluster : int
        :func:`~rdakit.compiler.partition.greedy.decompose` makes at most this many subgraphs a
        cluster.
    transfer_weight, overload_weight, eps : float
        Weights of the crossing cycles and of the overload, and the load tolerance.
    """

    link: LinkModel = LinkModel()
    subgraphs_per_cluster: int = 16
    transfer_weight: float = 0.5
    overload_weight: float = 2.0
    eps: float = 0.1
    name: ClassVar[str] = "greedy"

    def partition(self, wg, clusters):
        clusters = _check_clusters(clusters)
        k = len(clusters)
        sub = decompose(wg, self.subgraphs_per_cluster * k)
        c = int(sub.max()) + 1 if wg.n else 0
        work = np.bincount(sub, weights=wg.node_weight, minlength=c)
        su, sv = sub[wg.src], sub[wg.dst]
        cross = su != sv
        preds = [[] for _ in range(c)]
        for a, b, nb in zip(su[cross].tolist(), sv[cross].tolist(),
                            wg.edge_weight[cross].tolist(), strict=True):
            preds[b].append((a, nb))
        deferred = [work[i] == 0 and not preds[i] for i in range(c)]
        speed = np.array([float(cl.cus) for cl in clusters])
        usable = speed > 0
        load = np.array([cl.load for cl in clusters])
        busy = np.zeros(k)
        total = float(work.sum())
        fair = (total + load.sum()) * speed / speed.sum()
        finish = np.zeros(c)
        unit = np.full(c, -1, dtype=np.int64)
        safe = np.where(usable, speed, 1.0)
        for i in range(c):
            if deferred[i]:
                continue
            ready = np.zeros(k)
            crossing = np.zeros(k)
            for d, nb in preds[i]:
                if deferred[d]:
                    continue
                tc = np.where(np.arange(k) == unit[d], 0.0, self.link.crossing_cycles(nb))
                np.maximum(ready, finish[d] + tc, out=ready)
                crossing += tc
            free_at = (load + busy) / safe
            done = np.maximum(ready, free_at) + work[i] / safe
            overload = np.maximum(load + busy + work[i] - (1 + self.eps) * fair, 0) / safe
            cost = done + self.transfer_weight * crossing + self.overload_weight * overload
            p = int(np.argmin(np.where(usable, cost, np.inf)))
            unit[i] = p
            finish[i] = done[p]
            busy[p] += work[i]
        return place_buffers(wg, unit[sub] if wg.n else np.zeros(0, np.int64), clusters)


def place_buffers(wg, parts, clusters=None):
    """Put every node still at ``-1`` (buffers with no inputs and no work) in the cluster that
    reads the most bytes of it (the lowest index among equals; cluster 0 if none reads it):
    the placement with the fewest bytes crossing links for it. Returns a new array."""
    parts = np.asarray(parts, dtype=np.int64).copy()
    todo = np.flatnonzero(parts < 0)
    if not len(todo):
        return parts
    usable = None if clusters is None else np.array([cl.cus > 0 for cl in clusters])
    for v in todo.tolist():
        mask = wg.src == v
        readers = parts[wg.dst[mask]]
        nbytes = wg.edge_weight[mask]
        ok = readers >= 0
        if ok.any():
            by = np.bincount(readers[ok], weights=nbytes[ok])
            parts[v] = int(np.argmax(by))
        else:
            parts[v] = 0 if usable is None else int(np.argmax(usable))
    return parts


class _Baseline:
    """A single-level strategy of :mod:`.partition` applied to clusters as units (it sees
    neither the clusters' resources nor the link)."""

    def __init__(self, name):
        self.name = name

    def partition(self, wg, clusters):
        clusters = _check_clusters(clusters)
        return get_strategy(self.name).partition(wg, Targets(len(clusters)))


#: Cross-cluster strategies: seed 2's greedy, and the baselines of seed 3.
CLUSTER_STRATEGIES = ("greedy", "round_robin", "static")


def partition_clusters(graph, clusters, strategy="greedy", *, link=None, cost=None, **options):
    """The cluster of every node of ``graph`` (an array in the graph's topological order).

    Parameters
    ----------
    graph : DataflowGraph or WeightedGraph
    clusters : sequence of ClusterSpec
    strategy : str
        One of :data:`CLUSTER_STRATEGIES`.
    link : LinkModel
        The link (``greedy`` only; default :class:`LinkModel`).
    cost : CostModel
        Weighs a dataflow graph.

    Raises
    ------
    ValueError
        For an unknown strategy.
    PartitionError
        If no cluster has a CU.
    """
    wg = as_weighted(graph, CostModel() if cost is None else cost)
    if strategy == "greedy":
        s = CrossClusterGreedy(link=link or LinkModel(), **options)
    elif strategy in CLUSTER_STRATEGIES:
        s = _Baseline(strategy)
    else:
        raise ValueError(f"Strategy must be one of {', '.join(CLUSTER_STRATEGIES)}, "
                         f"not {strategy!r}")
    parts = np.asarray(s.partition(wg, clusters), dtype=np.int64)
    clusters = _check_clusters(clusters)
    idle = [c for c in set(parts.tolist()) if clusters[c].cus == 0 and
            wg.node_weight[parts == c].sum() > 0]
    if idle:
        raise PartitionError(f"Strategy {strategy!r} gave work to "
                             f"{_cluster_name(clusters, idle[0])!r}, which has no CU")
    return parts


def induced_subgraph(wg, nodes):
    """The :class:`WeightedGraph` of ``nodes`` (sorted indices of ``wg``) and the edges among
    them, renumbered ``0 .. len(nodes) - 1`` in the same order."""
    nodes = np.asarray(nodes, dtype=np.int64)
    index = np.full(wg.n, -1, dtype=np.int64)
    index[nodes] = np.arange(len(nodes))
    keep = (index[wg.src] >= 0) & (index[wg.dst] >= 0)
    names = None if wg.names is None else tuple(wg.names[i] for i in nodes.tolist())
    return WeightedGraph(wg.name, wg.node_weight[nodes], index[wg.src[keep]],
                         index[wg.dst[keep]], wg.edge_weight[keep], names=names)


@dataclasses.dataclass(frozen=True, eq=False)
class SystemPartition:
    """A two-level assignment with its measures.

    Members
    -------
    strategy : str
        The cross-cluster strategy.
    graph : WeightedGraph
    clusters : tuple of ClusterSpec
    cluster : numpy.ndarray
        Cluster of every node.
    cu : numpy.ndarray
        CU of every node inside its cluster (0 .. cus - 1).
    crossing_bytes : int
        Bytes of the edges between clusters (what crosses the links).
    work : numpy.ndarray
        Work (cycles) given to each cluster.
    makespan : int
        :func:`system_schedule`'s estimate.
    seconds : float
        Time both levels took.
    """

    strategy: str
    graph: WeightedGraph
    clusters: tuple
    cluster: np.ndarray
    cu: np.ndarray
    crossing_bytes: int
    work: np.ndarray
    makespan: int
    seconds: float

    def row(self):
        """The measures as a dict (for tables and JSON)."""
        return {"partitioner": self.strategy, "makespan": self.makespan,
                "crossing_bytes": self.crossing_bytes,
                "work": [int(w) for w in self.work], "seconds": round(self.seconds, 4)}


def partition_system(graph, clusters, strategy="greedy", *, inner="multilevel", link=None,
                     cost=None, **options):
    """Partition across clusters (``strategy``), then each cluster's nodes onto its CUs
    (``inner``, a strategy of :mod:`~rdakit.compiler.partition`), and measure.

    Returns
    -------
    SystemPartition
    """
    cost = CostModel() if cost is None else cost
    link = link or LinkModel()
    clusters = _check_clusters(clusters)
    wg = as_weighted(graph, cost)
    t0 = time.perf_counter()
    cl = partition_clusters(wg, clusters, strategy, link=link, cost=cost, **options)
    cu = np.zeros(wg.n, dtype=np.int64)
    for c, spec in enumerate(clusters):
        nodes = np.flatnonzero(cl == c)
        if not len(nodes) or spec.cus == 0:
            continue
        sub = induced_subgraph(wg, nodes)
        loads = (spec.load / spec.cus,) * spec.cus
        inner_options = {"cost": cost} if inner in ("greedy", "heft", "dqn") else {}
        res = partition(sub, Targets(spec.cus, load=loads), inner, cost=cost, **inner_options)
        cu[nodes] = res.parts
    seconds = time.perf_counter() - t0
    crossing = int(wg.edge_weight[cl[wg.src] != cl[wg.dst]].sum())
    work = np.bincount(cl, weights=wg.node_weight, minlength=len(clusters))
    makespan = system_schedule(wg, cl, cu, clusters, link, cost)
    return SystemPartition(strategy, wg, clusters, cl, cu, crossing, work, makespan, seconds)


def system_schedule(wg, cluster, cu, clusters, link, cost=None):
    """Estimated makespan of a two-level assignment: a list schedule over every CU of every
    cluster (each starting busy with its share of its cluster's load), ops in decreasing upward
    rank; a tensor moves for free inside a CU, with the NoC's transfer cost
    (:meth:`CostModel.transfer_cycles` at ``mean_hops``) inside a cluster, and with the link's
    (:meth:`LinkModel.crossing_cycles`) between clusters."""
    cost = CostModel() if cost is None else cost
    clusters = _check_clusters(clusters)
    cluster = np.asarray(cluster, dtype=np.int64)
    cu = np.asarray(cu, dtype=np.int64)
    base = np.concatenate([[0], np.cumsum([c.cus for c in clusters])])
    unit = base[cluster] + cu
    n_units = int(base[-1])
    same_cu = unit[wg.src] == unit[wg.dst]
    same_cluster = cluster[wg.src] == cluster[wg.dst]
    noc = cost.transfer_array(wg.edge_weight, np.full(wg.m, cost.mean_hops))
    tc = np.where(same_cu, 0, np.where(same_cluster, noc,
                                       link.crossing_cycles(wg.edge_weight))).astype(np.int64)
    avail = np.zeros(n_units)
    for c, spec in enumerate(clusters):
        if spec.cus:
            avail[base[c]:base[c + 1]] = spec.load / spec.cus
    ip, pn, pe = (a.tolist() for a in wg.preds)
    w = wg.node_weight.tolist()
    ul = unit.tolist()
    tcl = tc.tolist()
    avail = avail.tolist()
    finish = [0.0] * wg.n
    for v in priority_order(wg, cost, max(n_units, 1)).tolist():
        ready = 0.0
        for j in range(ip[v], ip[v + 1]):
            ready = max(ready, finish[pn[j]] + tcl[pe[j]])
        if w[v]:
            s = max(ready, avail[ul[v]])
            avail[ul[v]] = s + w[v]
        else:
            s = ready
        finish[v] = s + w[v]
    return int(np.ceil(max(finish, default=0.0)))


def observed_clusters(clusters, work, cycles):
    """Cluster specs for re-partitioning at run time (seed 2's monitoring): cluster ``c`` was
    given ``work[c]`` cycles of work and took ``cycles[c]`` cycles on its ``cus`` CUs, so it
    behaves as if it carried a load of ``cycles[c] * cus - work[c]`` (never negative, never
    less than the load already known). A cluster that got no work keeps its spec."""
    clusters = _check_clusters(clusters)
    work = np.asarray(work, dtype=float)
    cycles = np.asarray(cycles, dtype=float)
    if work.shape != (len(clusters),) or cycles.shape != (len(clusters),):
        raise ValueError(f"work and cycles must have {len(clusters)} entries (one a cluster), "
                         f"not {work.shape[0] if work.ndim else work!r} and "
                         f"{cycles.shape[0] if cycles.ndim else cycles!r}")
    if (work < 0).any() or (cycles < 0).any():
        raise ValueError("work and cycles must be non-negative")
    out = []
    for spec, w, t in zip(clusters, work.tolist(), cycles.tolist(), strict=True):
        if w <= 0 or spec.cus == 0:
            out.append(spec)
            continue
        load = max(spec.load, t * spec.cus - w)
        out.append(dataclasses.replace(spec, load=float(load)))
    return out
