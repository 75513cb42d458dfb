"""Partitioning: one interface (:mod:`.base`), several strategies (``auto``, the best cut of
Mt-KaHyPar, METIS and the multilevel KL/FM; the greedy of seed 2, the DQN of seed 3, HEFT,
round-robin and static), the balance rule (:mod:`.balance`), the weighted graph they all see,
and the partition across clusters."""

from rdakit.compiler.partition.base import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    Partitioner,
    PartitionError,
    PartitionResult,
    PartitionWarning,
    RoundRobin,
    Static,
    Targets,
    as_weighted,
    check_strategy,
    get_strategy,
    measure,
    partition,
    run_strategy,
)

__all__ = [
    "PartitionError", "PartitionWarning", "Targets", "Partitioner", "PartitionResult",
    "RoundRobin", "Static", "STRATEGIES", "DEFAULT_STRATEGY", "check_strategy", "get_strategy",
    "partition", "measure", "as_weighted", "run_strategy",
]
