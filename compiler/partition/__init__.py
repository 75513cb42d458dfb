"""Partitioning: one interface (:mod:`.base`), several strategies (multilevel KL/FM, the greedy
of seed 2, the DQN of seed 3, HEFT, METIS and Mt-KaHyPar, round-robin and static), the weighted
graph they all see, and the partition across clusters."""

from rdakit.compiler.partition.base import (
    STRATEGIES,
    Partitioner,
    PartitionError,
    PartitionResult,
    RoundRobin,
    Static,
    Targets,
    as_weighted,
    check_strategy,
    get_strategy,
    measure,
    partition,
)

__all__ = [
    "PartitionError", "Targets", "Partitioner", "PartitionResult", "RoundRobin", "Static",
    "STRATEGIES", "check_strategy", "get_strategy", "partition", "measure", "as_weighted",
]
