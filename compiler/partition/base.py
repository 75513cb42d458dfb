"""Partitioning: one interface, several strategies, the same measures for every result.

The interface is ``strategy.partition(graph, targets) -> parts``: a
:class:`~rdakit.compiler.partition.wgraph.WeightedGraph` (nodes in topological order, node
weights in cycles, edge weights in bytes) and :class:`Targets` (the units, with capacities and
the loads they already carry) in, one unit index per node out. A strategy is a frozen
dataclass whose fields are its options; :data:`STRATEGIES` names them all:

``multilevel``
    Multilevel Kernighan-Lin / Fiduccia-Mattheyses (:mod:`.multilevel`).
``greedy``
    Cost-based greedy of seed 2, ``findBestCluster`` / ``calculatePartitioningCost``
    (:mod:`.greedy`).
``dqn``
    A DQN agent assigning subgraphs to units, as in seed 3 (:mod:`.dqn`).
``heft``
    HEFT list scheduling (:mod:`.heft`).
``round_robin``, ``static``
    The baselines of seed 3: node ``i`` (in topological order) on unit ``i mod k``; contiguous
    chunks of the topological order of equal work.
``metis``, ``mtkahypar``
    External references through pymetis and Mt-KaHyPar (:mod:`.external`).
``auto`` (the default, :data:`DEFAULT_STRATEGY`)
    Mt-KaHyPar, METIS and the multilevel KL/FM under one balance rule, the least cut kept
    (:mod:`.portfolio`).

The cut-based strategies share one balance rule (:mod:`.balance`), which gives a node heavier
than an even share a unit of its own with room for its neighbours.

:func:`partition` runs a strategy, checks its answer (every node on exactly one existing unit,
capacities respected) and measures it (:class:`PartitionResult`): the cut, the imbalance, the
lower bound on the makespan, the estimated makespan of a list schedule, the pipeline
bottleneck (heaviest unit, busiest link), whether the quotient graph of the parts is acyclic,
the units left empty and what the strategy's backend warned about.
"""

import dataclasses
import importlib
import time
import warnings
from typing import ClassVar, Protocol

import numpy as np

from rdakit.compiler.cost import CostModel, list_schedule, lower_bound
from rdakit.compiler.graph import DataflowGraph
from rdakit.compiler.partition.balance import part_limits, water_level
from rdakit.compiler.partition.wgraph import WeightedGraph

__all__ = [
    "PartitionError", "PartitionWarning", "Targets", "Partitioner", "PartitionResult",
    "RoundRobin", "Static", "STRATEGIES", "DEFAULT_STRATEGY", "check_strategy", "get_strategy",
    "partition", "measure", "as_weighted", "run_strategy",
]


class PartitionError(ValueError):
    """A graph does not fit its targets, or a strategy gave a malformed answer."""


class PartitionWarning(UserWarning):
    """What a partitioner's backend said (METIS's complaints), or units left without work:
    :func:`partition` collects them into :attr:`PartitionResult.warnings`."""


@dataclasses.dataclass(frozen=True)
class Targets:
    """The units a graph is partitioned onto.

    Parameters
    ----------
    count : int
        Number of units.
    capacity : tuple of float, optional
        Most work (cycles) each unit may hold, its load included (default: unlimited).
    load : tuple of float, optional
        Work each unit already carries (default: none).
    names : tuple of str, optional
        Unit names for messages (default ``unit0``, ``unit1``, ...).

    Raises
    ------
    TypeError
        If ``count`` is not a positive integer or a capacity or load is negative.
    ValueError
        If a tuple does not have ``count`` entries.
    """

    count: int
    capacity: tuple | None = None
    load: tuple | None = None
    names: tuple | None = None

    def __post_init__(self):
        if not isinstance(self.count, int | np.integer) or isinstance(self.count, bool) \
                or self.count < 1:
            raise TypeError(f"Target count must be a positive integer, not {self.count!r}")
        object.__setattr__(self, "count", int(self.count))
        for field in ("capacity", "load", "names"):
            value = getattr(self, field)
            if value is None:
                continue
            value = tuple(value)
            if len(value) != self.count:
                raise ValueError(f"Target {field} must have {self.count} entries, "
                                 f"not {len(value)}")
            if field != "names" and any(not isinstance(x, int | float | np.number) or x < 0
                                        for x in value):
                raise TypeError(f"Target {field} must be non-negative numbers, not {value!r}")
            object.__setattr__(self, field, value)

    @classmethod
    def uniform(cls, count, capacity=None):
        """``count`` equal units with an optional common capacity."""
        return cls(count, None if capacity is None else (capacity,) * count)

    @property
    def k(self):
        """Number of units."""
        return self.count

    def name(self, p):
        """Name of unit ``p``."""
        return self.names[p] if self.names is not None else f"unit{p}"

    @property
    def loads(self):
        """Pre-existing loads as an array."""
        return np.zeros(self.count) if self.load is None else np.asarray(self.load, dtype=float)

    @property
    def capacities(self):
        """Capacities as an array (``inf`` when unlimited)."""
        if self.capacity is None:
            return np.full(self.count, np.inf)
        return np.asarray(self.capacity, dtype=float)

    def target_weights(self, total):
        """Work each unit should receive so that work plus load is even, capped by capacity.

        Sums to ``total`` when the capacities allow it.
        """
        loads, caps = self.loads, self.capacities
        free = caps - loads
        level = water_level(total, loads, free)
        return np.clip(level - loads, 0, free)


class Partitioner(Protocol):
    """A partitioning strategy: a frozen dataclass of options with a name."""

    name: ClassVar[str]

    def partition(self, graph: WeightedGraph, targets: Targets) -> np.ndarray:
        """Return the unit of every node (an integer array of length ``graph.n``)."""


@dataclasses.dataclass(frozen=True, eq=False)
class PartitionResult:
    """An assignment with its measures.

    Members
    -------
    strategy : str
        Name of the strategy.
    graph : WeightedGraph
        The partitioned graph.
    targets : Targets
        The units.
    parts : numpy.ndarray
        Unit of each node.
    seconds : float
        Time the strategy took.
    cut : int
        Sum of the weights (bytes) of edges crossing units.
    imbalance : float
        Heaviest unit (work plus load) over the average, minus 1.
    lower_bound : float
        Larger of the critical path and total work over units.
    makespan : int
        Estimated makespan: list schedule of the assignment under the cost model.
    quotient_acyclic : bool
        Whether the graph of units is acyclic.
    start : numpy.ndarray or None
        Start cycle of every node in that list schedule: the order the lowering gives each
        CU's ops, so that the CUs run the schedule the estimate describes.
    bottleneck : float
        Throughput measure: the heaviest unit's work (load included), the cycles between
        successive inputs when the units run as a pipeline.
    busiest_link : int
        Throughput measure: the most bytes that one unit sends another (edges from unit ``p``
        to unit ``q``, summed, for the busiest ordered pair) per input.
    empty_units : tuple of int
        Units that get no work (a zero-work node, such as a buffer, does not count): the
        balance rule allows it when a node is heavier than an even share
        (:mod:`~rdakit.compiler.partition.balance`); METIS also leaves units empty when it
        fails, and says so in ``warnings``.
    warnings : tuple of str
        What the strategy's backend said (METIS's complaints), :class:`PartitionWarning`.
    """

    strategy: str
    graph: WeightedGraph
    targets: Targets
    parts: np.ndarray
    seconds: float
    cut: int
    imbalance: float
    lower_bound: float
    makespan: int
    quotient_acyclic: bool
    start: np.ndarray | None = None
    bottleneck: float = 0.0
    busiest_link: int = 0
    empty_units: tuple = ()
    warnings: tuple = ()

    def assignment(self):
        """Unit of each node, by node name."""
        return {self.graph.label(i): int(p) for i, p in enumerate(self.parts)}

    def row(self):
        """The measures as a dict (for tables and JSON)."""
        return {"partitioner": self.strategy, "cut": self.cut,
                "imbalance": round(self.imbalance, 6), "seconds": round(self.seconds, 4),
                "makespan": self.makespan, "lower_bound": round(self.lower_bound, 1),
                "acyclic": self.quotient_acyclic, "bottleneck": round(self.bottleneck, 1),
                "busiest_link": self.busiest_link, "empty_units": len(self.empty_units),
                "warnings": list(self.warnings)}


def as_weighted(graph, cost=None):
    """A :class:`WeightedGraph` for a dataflow graph (through ``cost``) or itself."""
    if isinstance(graph, WeightedGraph):
        return graph
    if isinstance(graph, DataflowGraph):
        return WeightedGraph.from_dataflow(graph, cost)
    raise TypeError(f"Graph must be a DataflowGraph or a WeightedGraph, not "
                    f"{type(graph).__name__}")


def _as_targets(targets):
    return Targets(targets) if isinstance(targets, int | np.integer) else targets


def check_assignment(wg, targets, parts):
    """Check that ``parts`` puts every node on exactly one existing unit; return it as int64."""
    parts = np.asarray(parts)
    if parts.shape != (wg.n,) or (wg.n and not np.issubdtype(parts.dtype, np.integer)):
        raise PartitionError(f"An assignment of graph {wg.name!r} must be {wg.n} unit "
                             f"indices, not an array of {parts.dtype} and shape {parts.shape}")
    parts = parts.astype(np.int64)
    bad = np.flatnonzero((parts < 0) | (parts >= targets.count))
    if len(bad):
        i = int(bad[0])
        raise PartitionError(f"Node {wg.label(i)!r} is assigned to unit {parts[i]}, which is "
                             f"not one of the {targets.count} targets")
    return parts


def check_capacity(wg, targets, parts=None):
    """Raise :class:`PartitionError` if the work cannot fit, or ``parts`` overfills a unit."""
    caps, loads = targets.capacities, targets.loads
    if parts is None:
        total = wg.total_weight + loads.sum()
        if total > caps.sum():
            raise PartitionError(f"Graph {wg.name!r} needs {wg.total_weight} cycles of work "
                                 f"but the {targets.count} targets have room for "
                                 f"{caps.sum() - loads.sum():g}")
        heaviest = int(np.argmax(wg.node_weight)) if wg.n else None
        if heaviest is not None and wg.node_weight[heaviest] > (caps - loads).max():
            raise PartitionError(f"Node {wg.label(heaviest)!r} needs "
                                 f"{wg.node_weight[heaviest]} cycles but no target has room for "
                                 f"more than {(caps - loads).max():g}")
        return
    weights = wg.part_weights(parts, targets.count) + loads
    over = np.flatnonzero(weights > caps)
    if len(over):
        p = int(over[0])
        raise PartitionError(f"Partition {p} needs {weights[p]:g} cycles (load included) but "
                             f"target {targets.name(p)!r} has capacity {caps[p]:g}")


def imbalance(wg, targets, parts):
    """Heaviest unit (work plus load) over the average, minus 1 (0 for an empty graph)."""
    weights = wg.part_weights(parts, targets.count) + targets.loads
    mean = weights.sum() / targets.count
    return float(weights.max() / mean - 1) if mean > 0 else 0.0


def busiest_link(wg, parts, k):
    """Most bytes the edges from one unit to another carry, over ordered pairs of units."""
    parts = np.asarray(parts)
    pu, pv = parts[wg.src], parts[wg.dst]
    cross = pu != pv
    if not cross.any():
        return 0
    return int(np.bincount(pu[cross] * k + pv[cross], weights=wg.edge_weight[cross]).max())


def measure(wg, targets, parts, cost=None, *, strategy="?", seconds=0.0, hops=None, order=None,
            warnings=(), streamed=None):
    """Measure an assignment (see :class:`PartitionResult`); ``order`` is the list schedule's
    priority order (default :func:`~rdakit.compiler.cost.priority_order`), ``warnings`` what
    the strategy said (:func:`run_strategy`)."""
    cost = CostModel() if cost is None else cost
    targets = _as_targets(targets)
    parts = check_assignment(wg, targets, parts)
    sched = list_schedule(wg, parts, targets.count, cost, hops=hops, loads=targets.loads,
                          order=order, streamed=streamed)
    busy = wg.part_weights(parts, targets.count) + targets.loads
    empty = tuple(int(p) for p in np.flatnonzero(busy - targets.loads == 0))
    return PartitionResult(strategy, wg, targets, parts, float(seconds), wg.cut(parts),
                           imbalance(wg, targets, parts),
                           lower_bound(wg, targets.count, targets.loads), sched.makespan,
                           wg.quotient_acyclic(parts), sched.start,
                           float(busy.max(initial=0.0)), busiest_link(wg, parts, targets.count),
                           empty, tuple(warnings))


def run_strategy(strategy, wg, targets):
    """Run ``strategy`` on ``wg`` and ``targets``: ``(parts, seconds, warnings)``, the
    :class:`PartitionWarning` messages it raised collected (other warnings pass through)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PartitionWarning)
        t0 = time.perf_counter()
        parts = strategy.partition(wg, targets)
        seconds = time.perf_counter() - t0
    said = []
    for w in caught:
        if issubclass(w.category, PartitionWarning):
            said.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return parts, seconds, tuple(dict.fromkeys(said))


# --- the baselines ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RoundRobin:
    """Node ``i`` of the topological order on unit ``i mod k`` (loads and capacities ignored)."""

    name: ClassVar[str] = "round_robin"

    def partition(self, graph, targets):
        return np.arange(graph.n, dtype=np.int64) % targets.count


@dataclasses.dataclass(frozen=True)
class Static:
    """Contiguous chunks of the topological order, each with its unit's share of the work.

    The quotient graph is acyclic by construction (unit ``p`` only feeds units ``q >= p``).
    """

    name: ClassVar[str] = "static"

    def partition(self, graph, targets):
        w = graph.node_weight.astype(float)
        if w.sum() == 0:
            w = np.ones(graph.n)
        share = targets.target_weights(w.sum())
        bounds = np.cumsum(share)[:-1]
        middle = np.cumsum(w) - w / 2
        return np.searchsorted(bounds, middle, side="right").astype(np.int64)


#: Strategy classes by name, as ``module:Class`` (imported on first use).
STRATEGIES = {
    "auto": "portfolio:Auto",
    "multilevel": "multilevel:MultilevelKL",
    "greedy": "greedy:CostGreedy",
    "dqn": "dqn:DQNPartitioner",
    "heft": "heft:HEFT",
    "round_robin": "base:RoundRobin",
    "static": "base:Static",
    "metis": "external:Metis",
    "mtkahypar": "external:MtKaHyPar",
}


#: The strategy of ``rdakit compile`` and ``rdakit run`` when none is named: the best cut
#: measured (``rdakit bench partition``) comes from whichever of Mt-KaHyPar, METIS and the
#: home-made multilevel wins on the graph, so ``auto`` runs them all under one balance rule.
DEFAULT_STRATEGY = "auto"


def check_strategy(name):
    """Raise ``ValueError`` unless ``name`` is a strategy of :data:`STRATEGIES`."""
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"Strategy must be one of {', '.join(STRATEGIES)}, not {name!r}")


def get_strategy(name, **options):
    """The strategy called ``name``, built with ``options``.

    Raises
    ------
    ValueError
        If there is no strategy of that name.
    """
    check_strategy(name)
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)(**options)


def partition(graph, targets, strategy=DEFAULT_STRATEGY, *, cost=None, **options):
    """Partition ``graph`` onto ``targets`` and measure the result.

    Parameters
    ----------
    graph : DataflowGraph or WeightedGraph
        The graph (a dataflow graph is weighed through ``cost``).
    targets : Targets or int
        The units (an int: that many equal units without loads or capacities).
    strategy : str or Partitioner
        A name from :data:`STRATEGIES` (built with ``options``) or a strategy object.
    cost : CostModel, optional
        Cost model for weighing and measuring (default :class:`CostModel`).

    Returns
    -------
    PartitionResult

    Raises
    ------
    PartitionError
        If the work cannot fit the targets' capacities, or the assignment overfills one.
    """
    cost = CostModel() if cost is None else cost
    wg = as_weighted(graph, cost)
    targets = _as_targets(targets)
    if isinstance(strategy, str):
        if strategy in ("greedy", "heft", "dqn") and "cost" not in options:
            options["cost"] = cost
        strategy = get_strategy(strategy, **options)
    check_capacity(wg, targets)
    parts, seconds, said = run_strategy(strategy, wg, targets)
    parts = check_assignment(wg, targets, parts)
    check_capacity(wg, targets, parts)
    return measure(wg, targets, parts, cost, strategy=strategy.name, seconds=seconds,
                   warnings=said)


def balance_limit(wg, targets, eps):
    """Largest part weight (load included) the balance rule allows with tolerance ``eps``
    (:func:`~rdakit.compiler.partition.balance.part_limits`): used by the tests and the bench
    to check a result."""
    return float((part_limits(wg, targets, eps) + targets.loads).max())
