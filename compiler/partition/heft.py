"""HEFT list scheduling (Topcuoglu, Hariri and Wu, 2002) as a partitioner.

Nodes are taken in decreasing *upward rank* (the longest path to an exit, counting work and
mean transfer cycles; :func:`~rdakit.compiler.cost.upward_rank`). Each goes to the unit on which
it would finish earliest: its inputs are ready there when every predecessor has finished and,
if on another unit, transferred; it starts at the earliest idle interval of the unit long enough
to hold it (*insertion*) or, without insertion, when the unit has finished its last node.
The assignment is HEFT's; its makespan is measured like every other strategy's, by
:func:`~rdakit.compiler.cost.list_schedule`.

Buffers with no inputs (graph inputs, constants) go afterwards to the unit of the consumer they
send the most bytes to; units without capacity for a node are never chosen.
"""

import bisect
import dataclasses
from typing import ClassVar

import numpy as np

from rdakit.compiler.cost import CostModel, hop_matrix, priority_order

__all__ = ["HEFT"]


@dataclasses.dataclass(frozen=True)
class HEFT:
    """HEFT: upward rank, earliest finish time.

    Parameters
    ----------
    cost : CostModel
        Cost model.
    insertion : bool or None
        Insertion-based scheduling (the original HEFT); ``None`` uses it when
        ``nodes * units <= 2e6`` and appends otherwise (it costs a scan of idle intervals per
        unit and node).
    """

    name: ClassVar[str] = "heft"
    cost: CostModel = CostModel()
    insertion: bool | None = None

    def partition(self, graph, targets):
        k, n = targets.count, graph.n
        insertion = self.insertion if self.insertion is not None else n * k <= 2_000_000
        cost = self.cost
        hops = hop_matrix(k, cost)
        order = priority_order(graph, cost, k).tolist()
        ip, pn, pe = (a.tolist() for a in graph.preds)
        w = graph.node_weight.tolist()
        nbytes = graph.edge_weight
        deferred = [w[v] == 0 and ip[v] == ip[v + 1] for v in range(n)]
        parts = np.full(n, -1, dtype=np.int64)
        finish = np.zeros(n)
        loads = targets.loads
        caps = targets.capacities
        busy = loads.copy()
        avail = loads.copy()
        starts = [[0.0] if loads[p] > 0 else [] for p in range(k)]
        ends = [[float(loads[p])] if loads[p] > 0 else [] for p in range(k)]
        for v in order:
            if deferred[v]:
                continue
            ready = np.zeros(k)
            for j in range(ip[v], ip[v + 1]):
                u = pn[j]
                if deferred[u]:
                    continue
                tc = cost.transfer_array(np.full(k, nbytes[pe[j]]), hops[parts[u]])
                np.maximum(ready, finish[u] + tc, out=ready)
            wv = w[v]
            if wv == 0:
                start = ready
            elif insertion:
                start = np.array([_earliest(starts[p], ends[p], ready[p], wv) for p in range(k)])
            else:
                start = np.maximum(ready, avail)
            eft = np.where(busy + wv <= caps + 1e-9, start + wv, np.inf)
            p = int(np.argmin(eft))
            parts[v] = p
            finish[v] = start[p] + wv
            if wv:
                busy[p] += wv
                avail[p] = max(avail[p], finish[v])
                if insertion:
                    i = bisect.bisect_left(starts[p], float(start[p]))
                    starts[p].insert(i, float(start[p]))
                    ends[p].insert(i, float(finish[v]))
        sp, sn, se = (a.tolist() for a in graph.succs)
        for v in range(n):
            if deferred[v]:
                best = {}
                for j in range(sp[v], sp[v + 1]):
                    q = int(parts[sn[j]])
                    if q >= 0:
                        best[q] = best.get(q, 0) + int(nbytes[se[j]])
                parts[v] = max(sorted(best), key=lambda q: best[q]) if best else 0
        return parts


def _earliest(starts, ends, ready, length):
    """Earliest start at or after ``ready`` of an idle interval of ``length`` between the busy
    intervals ``[starts[i], ends[i])`` (sorted, disjoint)."""
    s = float(ready)
    i = bisect.bisect_right(ends, s)
    while i < len(starts):
        if s + length <= starts[i]:
            return s
        s = max(s, ends[i])
        i += 1
    return s
