"""The compiler's cost model: cycles per op on a CU, bytes per edge, transfers on the mesh.

Assumptions (documented with their reasons in ``docs/compiler.md``):

- An op runs on one compute unit (CU) with ``lanes`` SIMD lanes. It performs ``work`` lane
  operations (a multiply-accumulate counts one; see ``OpSpec.work``), at one vector of
  ``lanes`` per cycle, plus ``op_overhead`` cycles to start (loop configuration and pipeline
  fill). Buffers (graph inputs, constants, outputs) cost no cycles.
- A tensor moves between CUs as ``ceil(bytes / link_bytes)`` flits over a link of
  ``link_bytes`` bytes per cycle, after ``hops * hop_cycles`` cycles of latency: it is sent
  whole (store and forward at tensor granularity) once its producer has finished. A tensor
  read inside its producer's CU moves for free. Dynamic tensors count their expected rows.
- Before placement the distance between two CUs is ``mean_hops``; after placement, the
  Manhattan distance between their tiles (XY routing).
- The estimated makespan of an assignment is the length of a list schedule: ops taken in
  decreasing upward rank (ties by topological index), each started on its CU when the CU is
  free and all its inputs have arrived (a :class:`TimedCostModel` lets the share ``lead`` of
  it run before its inputs from other CUs arrive); no preemption, no insertion into idle gaps.
  Buffers occupy no CU time.
"""

import dataclasses
import math

import numpy as np

from rdakit.compiler.graph import OP_KINDS

__all__ = [
    "CostModel", "TimedCostModel", "Schedule", "list_schedule", "upward_rank",
    "priority_order", "lower_bound", "hop_matrix",
]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Cycle costs of ops and transfers on the fabric.

    Parameters
    ----------
    lanes : int
        SIMD lanes of a CU.
    op_overhead : int
        Cycles to start an op on a CU.
    link_bytes : int
        Bytes a NoC link moves per cycle (one flit).
    hop_cycles : int
        Latency of one router hop.
    mean_hops : float
        Distance assumed between two CUs before placement.

    Raises
    ------
    TypeError
        If a parameter is not a positive integer (``mean_hops``: a non-negative number).
    """

    #: The share of an op's cycles a CU may spend on it before its inputs from other CUs have
    #: arrived (:func:`list_schedule`), at most ``lead_cycles``; the work model has none.
    lead = 0.0
    lead_cycles = 0
    #: An edge sent as a stream between CUs (:func:`list_schedule`'s ``streamed``): its
    #: consumer may start ``stream_start`` cycles after its producer starts, and ends at least
    #: ``stream_tail`` cycles after its producer ends; the work model charges neither.
    stream_start = 0
    stream_tail = 0

    lanes: int = 16
    op_overhead: int = 8
    link_bytes: int = 4
    hop_cycles: int = 1
    mean_hops: float = 2.0

    def __post_init__(self):
        for name in ("lanes", "link_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TypeError(f"{name} must be a positive integer, not {value!r}")
        for name in ("op_overhead", "hop_cycles"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise TypeError(f"{name} must be a non-negative integer, not {value!r}")
        if not isinstance(self.mean_hops, int | float) or self.mean_hops < 0:
            raise TypeError(f"mean_hops must be a non-negative number, not {self.mean_hops!r}")

    def op_cycles(self, graph, node):
        """Cycles ``node`` of a validated dataflow graph takes on one CU."""
        if OP_KINDS[graph.kind(node)].memory:
            return 0
        return int(math.ceil(graph.work(node) / self.lanes)) + self.op_overhead

    def estimate(self, makespan):
        """The run's estimated cycles from a list schedule's ``makespan``."""
        return int(makespan)

    def edge_bytes(self, graph, u, v):
        """Bytes the edge ``u -> v`` carries (expected, for dynamic tensors)."""
        if not graph.nx.has_edge(u, v):
            raise ValueError(f"Graph {graph.name!r} has no edge {u!r} -> {v!r}")
        return graph.type_of(u).expected_nbytes

    def transfer_cycles(self, nbytes, hops):
        """Cycles to move ``nbytes`` over ``hops`` hops (0 when ``hops`` is 0)."""
        if hops == 0:
            return 0
        return int(math.ceil(nbytes / self.link_bytes)) + int(math.ceil(hops * self.hop_cycles))

    def transfer_array(self, nbytes, hops):
        """:meth:`transfer_cycles` over arrays (``hops`` may be fractional: rounded up)."""
        nbytes = np.asarray(nbytes, dtype=np.int64)
        hops = np.asarray(hops, dtype=float)
        cycles = -(-nbytes // self.link_bytes) + np.ceil(hops * self.hop_cycles).astype(np.int64)
        return np.where(hops > 0, cycles, 0)


@dataclasses.dataclass(frozen=True)
class TimedCostModel(CostModel):
    """A cost model from the lowering's code, timed: a node costs ``overlap`` times the cycles
    its lowered code took when the workload, lowered onto one CU, ran on the performance model
    (``rdakit.sim.runtime.events.timed_cost_model``: the RTL's timing, run-time sizes as they
    are). Nodes without cycles (none were timed) keep :class:`CostModel`'s
    ``ceil(work / lanes) + op_overhead``. The constants are fitted to the measured cycles of
    every ``rdakit bench e2e`` row (``docs/compiler.md``, the timed cost model).

    Parameters
    ----------
    cycles : tuple
        ``(node, cycles)`` per node (a fused chain's cycles are shared by its nodes in
        proportion to their work).
    fixed_cycles : float
        Cycles of the one CU outside any op (its prologue and epilogue): added once to a
        schedule's makespan (:meth:`estimate`).
    overlap : float
        The share of an op's one-CU cycles it costs on the fabric: on one CU an op's time
        includes waiting for the op before it (its last stream's tail), which on the fabric
        is often a wait for another CU that the transfer already charges.
    lead, lead_cycles : float, int
        The share of an op's cycles its CU may spend on it before its inputs from other CUs
        have arrived, at most ``lead_cycles``: its output's ALLOC and the configuration of its
        first stream come before the RECV of a remote input (a few instructions, whatever
        the op's length).
    stream_start, stream_tail : int
        An edge sent as a stream between CUs overlaps its two ends: the consumer may start
        ``stream_start`` cycles after the producer starts (the producer's last pass sends
        the words, the consumer takes them as they come), and ends no sooner than
        ``stream_tail`` cycles after the producer ends (its last word).
    edge_cycles : int
        A tensor between CUs is not copied but handed over (the producer's SENDREF after its
        writes are acknowledged, the consumer's RECV and LEN): a fixed cost, plus
        ``hop_cycles`` per hop.
    """

    cycles: tuple = ()
    fixed_cycles: float = 0.0
    overlap: float = 0.975
    lead: float = 0.3
    lead_cycles: int = 20
    edge_cycles: int = 20
    stream_start: int = 20
    stream_tail: int = 10

    def __post_init__(self):
        super().__post_init__()
        table = {}
        for row in self.cycles:
            if len(row) != 2 or not isinstance(row[1], int | float) or row[1] < 0:
                raise TypeError(f"cycles must hold (node, cycles) rows, not {row!r}")
            table[row[0]] = row[1]
        if not isinstance(self.fixed_cycles, int | float) or self.fixed_cycles < 0:
            raise TypeError(f"fixed_cycles must be a non-negative number, not "
                            f"{self.fixed_cycles!r}")
        if not isinstance(self.overlap, int | float) or not 0 < self.overlap <= 1:
            raise TypeError(f"overlap must be a number in (0, 1], not {self.overlap!r}")
        if not isinstance(self.lead, int | float) or not 0 <= self.lead < 1:
            raise TypeError(f"lead must be a number in [0, 1), not {self.lead!r}")
        if (not isinstance(self.lead_cycles, int) or isinstance(self.lead_cycles, bool)
                or self.lead_cycles < 0):
            raise TypeError(f"lead_cycles must be a non-negative integer, not "
                            f"{self.lead_cycles!r}")
        object.__setattr__(self, "_table", table)

    def transfer_cycles(self, nbytes, hops):
        if hops == 0:
            return 0
        return self.edge_cycles + int(math.ceil(hops * self.hop_cycles))

    def transfer_array(self, nbytes, hops):
        hops = np.asarray(hops, dtype=float)
        cycles = self.edge_cycles + np.ceil(hops * self.hop_cycles).astype(np.int64)
        return np.where(hops > 0, cycles, 0) + np.zeros(np.shape(nbytes), dtype=np.int64)

    def op_cycles(self, graph, node):
        c = self._table.get(node)
        if c is None or OP_KINDS[graph.kind(node)].memory:
            return super().op_cycles(graph, node)
        return max(1, int(round(self.overlap * c)))

    def estimate(self, makespan):
        return int(round(makespan + self.fixed_cycles))


def hop_matrix(k, cost, coords=None):
    """Hop distances between ``k`` units: ``mean_hops`` off the diagonal, or Manhattan
    distances between tile coordinates ``coords[p] = (x, y)`` when given."""
    if coords is None:
        h = np.full((k, k), float(cost.mean_hops))
        np.fill_diagonal(h, 0.0)
        return h
    c = np.asarray(coords, dtype=float).reshape(k, 2)
    return np.abs(c[:, None, :] - c[None, :, :]).sum(axis=2)


def upward_rank(wg, cost, k):
    """HEFT's upward rank: the longest path to an exit, counting node weights and mean transfer
    cycles (``mean_hops``, weighted by the chance ``(k - 1) / k`` that two ends differ)."""
    mean_comm = cost.transfer_array(wg.edge_weight, cost.mean_hops) * ((k - 1) / k)
    rank = wg.node_weight.astype(float).tolist()
    w = wg.node_weight.tolist()
    ip, sn, se = wg.succs
    ip, sn, se = ip.tolist(), sn.tolist(), se.tolist()
    mc = mean_comm.tolist()
    for v in range(wg.n - 1, -1, -1):
        a, b = ip[v], ip[v + 1]
        if a != b:
            rank[v] = w[v] + max(mc[se[j]] + rank[sn[j]] for j in range(a, b))
    return np.array(rank)


def priority_order(wg, cost, k):
    """Nodes by decreasing upward rank, ties by index: a topological order."""
    rank = upward_rank(wg, cost, k)
    return np.lexsort((np.arange(wg.n), -rank))


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A list schedule of an assignment.

    Members
    -------
    start, finish : numpy.ndarray
        Start and finish cycle of every node.
    makespan : int
        Finish of the last node (or of the latest pre-existing load).
    busy : numpy.ndarray
        Cycles each unit computes (its pre-existing load included).
    """

    start: np.ndarray
    finish: np.ndarray
    makespan: int
    busy: np.ndarray


def list_schedule(wg, parts, k, cost, *, hops=None, loads=None, order=None, streamed=None):
    """List-schedule the assignment ``parts`` of ``wg``'s nodes to ``k`` units.

    Parameters
    ----------
    wg : WeightedGraph
        The graph.
    parts : array of int
        Unit of each node.
    k : int
        Number of units.
    cost : CostModel
        Transfer costs.
    hops : array (k, k), optional
        Hop distances between units (default :func:`hop_matrix` without coordinates).
    loads : array (k,), optional
        Cycles each unit is busy before the graph starts.
    order : array, optional
        Priority order (a topological order; default :func:`priority_order`).
    streamed : array of bool, optional
        Per edge, whether it is a stream between CUs (``cost.stream_start`` and
        ``cost.stream_tail`` instead of a transfer after the producer's end).
    """
    parts = np.asarray(parts, dtype=np.int64)
    hops = hop_matrix(k, cost) if hops is None else np.asarray(hops, dtype=float)
    loads = np.zeros(k) if loads is None else np.asarray(loads, dtype=float)
    order = priority_order(wg, cost, k) if order is None else order
    tc = cost.transfer_array(wg.edge_weight, hops[parts[wg.src], parts[wg.dst]]).tolist()
    ip, pn, pe = (a.tolist() for a in wg.preds)
    st = (np.zeros(len(tc), dtype=bool) if streamed is None
          else np.asarray(streamed, dtype=bool)).tolist()
    s_start, s_tail = cost.stream_start, cost.stream_tail
    w = wg.node_weight.tolist()
    lead, lead_cycles = cost.lead, cost.lead_cycles
    pl = parts.tolist()
    avail = loads.astype(np.int64).tolist()
    start = [0] * wg.n
    finish = [0] * wg.n
    for v in order.tolist():
        ready = 0
        streams_from = end = 0
        for j in range(ip[v], ip[v + 1]):
            if st[pe[j]]:
                u = pn[j]
                streams_from = max(streams_from, start[u] + s_start)
                end = max(end, finish[u] + s_tail)
                continue
            t = finish[pn[j]] + tc[pe[j]]
            if t > ready:
                ready = t
        if w[v]:
            p = pl[v]
            if lead:
                ready -= min(int(lead * w[v]), lead_cycles)
            if streams_from > ready:
                ready = streams_from
            s = ready if ready > avail[p] else avail[p]
            f = s + w[v] if s + w[v] > end else end
            avail[p] = f
        else:
            s = ready if ready > streams_from else streams_from
            f = s if s > end else end
        start[v] = s
        finish[v] = f
    busy = np.bincount(parts, weights=wg.node_weight, minlength=k) + loads
    makespan = max(max(finish, default=0), int(loads.max(initial=0)))
    return Schedule(np.array(start), np.array(finish), int(makespan), busy)


def lower_bound(wg, k, loads=None):
    """Lower bound on the makespan on ``k`` units: the larger of the critical path and the total
    work (with pre-existing loads) divided by ``k``."""
    total = wg.total_weight + (0 if loads is None else float(np.sum(loads)))
    return max(float(wg.critical_path()), total / k)
