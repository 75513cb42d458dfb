"""The cost-based greedy partitioner of seed 2, and the subgraph scheduling it shares with the DQN.

Seed 2's dynamic partitioning engine::

    subgraphList = decompose(dataflowGraph)
    for subgraph in subgraphList:
        bestCluster = findBestCluster(subgraph, clusterList)
        updateClusterResources(bestCluster, subgraph)

with ``findBestCluster`` taking the cluster (here: unit) of least
``calculatePartitioningCost(subgraph, cluster)``, a cost that weighs the subgraph's computation,
the data it must receive, its dependencies and the unit's load. Here:

- :func:`decompose` cuts a depth-first topological order of the graph into at most
  ``max_subgraphs`` contiguous pieces of about equal work (every node its own subgraph when the
  graph is small). Depth-first order keeps chains together; contiguous pieces of a topological
  order depend only on earlier pieces, so they can be assigned in order.
- :class:`SubgraphScheduler` keeps, as the subgraphs are assigned, when each unit becomes free
  and when each assigned subgraph finishes. For a subgraph and every unit it computes, at once,
  when the inputs would be ready there (finish of each predecessor plus its transfer if it is on
  another unit), the finish time, the transfer cycles and the unit's load after the assignment.
- :class:`CostGreedy`'s ``calculatePartitioningCost`` is
  ``finish + transfer_weight * transfer + overload_weight * overload``: the finish time covers
  computation and dependencies (waiting for inputs and for the unit), ``transfer`` counts the
  cycles of every input that crosses units (data movement, even off the critical path), and
  ``overload`` is the work above ``(1 + eps)`` times a unit's fair share of the work (load).
  Units without capacity for the subgraph are never chosen.

Buffers with no inputs (graph inputs, constants: no work) are placed afterwards with the
consumer they send the most bytes to.
"""

import dataclasses
from typing import ClassVar

import numpy as np

from rdakit.compiler.cost import CostModel, hop_matrix

__all__ = ["decompose", "SubgraphScheduler", "CostGreedy"]


def dfs_topological_order(wg):
    """A topological order that follows chains depth first (ties to the lower index)."""
    ip, pn, _ = wg.preds
    indeg = np.diff(ip).tolist()
    sp, sn, _ = (a.tolist() for a in wg.succs)
    stack = [v for v in range(wg.n - 1, -1, -1) if indeg[v] == 0]
    order = []
    while stack:
        v = stack.pop()
        order.append(v)
        for u in reversed(sn[sp[v]:sp[v + 1]]):
            indeg[u] -= 1
            if indeg[u] == 0:
                stack.append(u)
    return np.array(order, dtype=np.int64)


def decompose(wg, max_subgraphs):
    """Cut a depth-first topological order into pieces of about ``total / max_subgraphs`` work.

    A piece only grows by a node that reads from the piece: where the order jumps to a node
    independent of the current piece (the start of another branch), a new piece starts, so
    that independent branches stay independent subgraphs (a piece holding the end of one branch
    and the start of the next would chain them). There may thus be more pieces than
    ``max_subgraphs``. Nodes without work count as a small amount, so buffers spread too.

    Returns
    -------
    sub : numpy.ndarray
        Subgraph of each node; subgraph ``i`` depends only on subgraphs ``j <= i``.
    """
    order = dfs_topological_order(wg)
    sub = np.empty(wg.n, dtype=np.int64)
    if wg.n <= max_subgraphs:
        sub[order] = np.arange(wg.n)
        return sub
    w = wg.node_weight.astype(float)
    w = (w + max(w.mean(), 1.0) * 0.05).tolist()
    size = sum(w) / max_subgraphs
    ip, pn, _ = (a.tolist() for a in wg.preds)
    piece, filled = -1, size
    sl = [0] * wg.n
    for v in order.tolist():
        linked = any(sl[u] == piece for u in pn[ip[v]:ip[v + 1]])
        if filled + w[v] > size * 1.0001 or not linked:
            piece += 1
            filled = 0.0
        sl[v] = piece
        filled += w[v]
    return np.array(sl, dtype=np.int64)


class SubgraphScheduler:
    """Assign subgraphs to units in order, keeping the partial schedule.

    Parameters
    ----------
    wg : WeightedGraph
        The graph.
    targets : Targets
        The units (loads make them busy from the start; capacities bound their work).
    cost : CostModel
        Transfer costs.
    sub : numpy.ndarray
        Subgraph of each node, from :func:`decompose`.

    Members
    -------
    count : int
        Number of subgraphs (assigned in order ``0 .. count - 1``).
    work : numpy.ndarray
        Work of each subgraph.
    deferred : numpy.ndarray of bool
        Subgraphs of buffers with no inputs, placed at the end with their main consumer.
    """

    def __init__(self, wg, targets, cost, sub):
        self.wg, self.targets, self.cost = wg, targets, cost
        self.k = k = targets.count
        self.count = c = int(sub.max()) + 1 if wg.n else 0
        self.sub = sub
        self.work = np.bincount(sub, weights=wg.node_weight, minlength=c)
        su, sv = sub[wg.src], sub[wg.dst]
        cross = su != sv
        key, inverse = np.unique(su[cross] * c + sv[cross], return_inverse=True)
        nbytes = np.bincount(inverse, weights=wg.edge_weight[cross]).astype(np.int64)
        self.pred_of = [[] for _ in range(c)]
        self.succ_bytes = [[] for _ in range(c)]
        for (a, b), nb in zip(np.stack([key // max(c, 1), key % max(c, 1)], 1).tolist(),
                              nbytes.tolist(), strict=True):
            self.pred_of[b].append((a, nb))
            self.succ_bytes[a].append((b, nb))
        self.deferred = np.array([self.work[i] == 0 and not self.pred_of[i] for i in range(c)],
                                 dtype=bool)
        self.hops = hop_matrix(k, cost)
        self.loads = targets.loads.copy()
        self.caps = targets.capacities
        self.avail = self.loads.copy()
        self.busy = np.zeros(k)
        self.finish = np.zeros(c)
        self.unit = np.full(c, -1, dtype=np.int64)
        self.total = float(self.work.sum())
        self.fair = (self.total + self.loads.sum()) / k
        self.makespan = float(self.loads.max(initial=0))
        # Work-only longest path from each subgraph to an exit, its own work included, and the
        # largest such path among its successors: for the critical-path part of estimate().
        self.rank = self.work.astype(float).copy()
        self.succ_rank = np.zeros(c)
        for i in range(c - 1, -1, -1):
            if self.succ_bytes[i]:
                self.succ_rank[i] = max(self.rank[b] for b, _ in self.succ_bytes[i])
                self.rank[i] += self.succ_rank[i]
        self.critical = float(self.rank.max(initial=0))

    def estimate(self, i=None, options=None):
        """Estimated makespan of the partial schedule: a lower bound on the final makespan of
        any completion, the larger of the latest finish so far and, for every assigned
        subgraph, its finish plus the longest chain of work after it.

        With subgraph ``i`` (and its :meth:`options`), the estimate after putting it on each
        unit (an array).
        """
        if i is None:
            return max(self.makespan, self.critical)
        finish = (self.options(i) if options is None else options)[2]
        return np.maximum(np.maximum(finish, self.makespan),
                          np.maximum(finish + self.succ_rank[i], self.critical))

    def options(self, i):
        """Per unit, for subgraph ``i``: ``(ready, start, finish, transfer, local_bytes, fits)``.

        ``transfer`` sums the transfer cycles of inputs from other units, ``local_bytes`` the
        bytes of inputs already on the unit, ``fits`` whether the unit has capacity.
        """
        k = self.k
        ready = np.zeros(k)
        transfer = np.zeros(k)
        local = np.zeros(k)
        for d, nb in self.pred_of[i]:
            if self.deferred[d]:
                continue
            p = self.unit[d]
            tc = self.cost.transfer_array(np.full(k, nb), self.hops[p]).astype(float)
            np.maximum(ready, self.finish[d] + tc, out=ready)
            transfer += tc
            local[p] += nb
        w = self.work[i]
        start = np.maximum(ready, self.avail) if w > 0 else ready
        finish = start + w
        fits = self.loads + self.busy + w <= self.caps + 1e-9
        return ready, start, finish, transfer, local, fits

    def assign(self, i, p, options=None):
        """Put subgraph ``i`` on unit ``p`` (``options``: the result of :meth:`options`)."""
        _, _, finish, *_ = self.options(i) if options is None else options
        self.unit[i] = p
        self.finish[i] = finish[p]
        if self.work[i] > 0:
            self.avail[p] = finish[p]
            self.busy[p] += self.work[i]
        self.makespan = max(self.makespan, float(finish[p]))
        self.critical = max(self.critical, float(finish[p] + self.succ_rank[i]))

    def parts(self):
        """Unit of every node; deferred buffers go to the unit they send the most bytes to."""
        unit = self.unit.copy()
        for i in np.flatnonzero(self.deferred).tolist():
            best = {}
            for b, nb in self.succ_bytes[i]:
                if unit[b] >= 0:
                    best[int(unit[b])] = best.get(int(unit[b]), 0) + nb
            unit[i] = max(sorted(best), key=lambda p: best[p]) if best else 0
        return unit[self.sub]


@dataclasses.dataclass(frozen=True)
class CostGreedy:
    """Seed 2's ``findBestCluster`` / ``calculatePartitioningCost`` greedy.

    Parameters
    ----------
    cost : CostModel
        Cost model.
    subgraphs_per_unit : int
        :func:`decompose` makes at most this many subgraphs per unit.
    transfer_weight : float
        Weight of the transfer cycles in the cost.
    overload_weight : float
        Weight of the work above ``(1 + eps)`` times the fair share.
    eps : float
        Load tolerance before the overload term counts.
    """

    name: ClassVar[str] = "greedy"
    cost: CostModel = CostModel()
    subgraphs_per_unit: int = 32
    transfer_weight: float = 0.5
    overload_weight: float = 2.0
    eps: float = 0.1

    def partition(self, graph, targets):
        sub = decompose(graph, self.subgraphs_per_unit * targets.count)
        sched = SubgraphScheduler(graph, targets, self.cost, sub)
        for i in range(sched.count):
            if sched.deferred[i]:
                continue
            options = sched.options(i)
            sched.assign(i, self.find_best_cluster(sched, i, options), options)
        return sched.parts()

    def calculate_partitioning_cost(self, sched, i, options=None):
        """Cost of putting subgraph ``i`` on each unit (``inf`` where it does not fit)."""
        _, _, finish, transfer, _, fits = sched.options(i) if options is None else options
        load = sched.loads + sched.busy + sched.work[i]
        overload = np.maximum(load - (1 + self.eps) * sched.fair, 0)
        cost = finish + self.transfer_weight * transfer + self.overload_weight * overload
        return np.where(fits, cost, np.inf)

    def find_best_cluster(self, sched, i, options=None):
        """The unit of least cost for subgraph ``i`` (the lowest index among equals)."""
        return int(np.argmin(self.calculate_partitioning_cost(sched, i, options)))
