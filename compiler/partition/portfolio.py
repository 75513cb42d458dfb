"""``auto``: the cut-based partitioners side by side, the best answer kept.

Measured on the benchmark's graphs (``rdakit bench partition``, docs/compiler.md), no one
partitioner wins everywhere: Mt-KaHyPar finds the smallest cut on graphs without heavy nodes
(a deep transformer into few units: a third of METIS's and the multilevel KL/FM's cut), the
multilevel KL/FM on graphs where a few heavy nodes have units of their own (a two-layer model
into 16 or 64 units: half to a third of the others' cuts), METIS is close behind both and the
fastest. :class:`Auto` runs each of them (Mt-KaHyPar only when it can be imported) under the
same balance rule (:mod:`~rdakit.compiler.partition.balance`), polishes each answer with the
multilevel partitioner's k-way FM under the exact limits (which first moves nodes out of units
above their limit: a backend's answer may be a hair over), and keeps the assignment that meets
the limits with the least cut; when none meets them, the one least above them (in steps of 1%
of the limit, the cut deciding within a step). Only the kept member's warnings are raised.
Equal cuts go to the earlier member. Deterministic from ``seed`` (Mt-KaHyPar runs its
deterministic preset).

The time is the sum of the members' (under a second on graphs of a few thousand nodes; tens of
seconds on the benchmark's 100k-node graphs, where METIS alone takes a tenth of a second).
"""

import dataclasses
import warnings
from typing import ClassVar

import numpy as np

from rdakit.compiler.partition.balance import overload, part_limits
from rdakit.compiler.partition.base import PartitionWarning, get_strategy
from rdakit.compiler.partition.external import mtkahypar_missing
from rdakit.compiler.partition.multilevel import refine_kway

__all__ = ["Auto", "MEMBERS"]

#: The partitioners :class:`Auto` tries, in order of preference on equal cuts.
MEMBERS = ("mtkahypar", "metis", "multilevel")


@dataclasses.dataclass(frozen=True)
class Auto:
    """Every cut-based partitioner under one balance rule; the least cut within the limits.

    Parameters
    ----------
    eps : float
        Balance tolerance of every member.
    seed : int
        Seed of every member.
    members : tuple of str
        Strategies to try (a subset of :data:`MEMBERS`); Mt-KaHyPar is skipped when it cannot
        be imported.
    """

    name: ClassVar[str] = "auto"
    eps: float = 0.03
    seed: int = 0
    members: tuple = MEMBERS

    def __post_init__(self):
        if not isinstance(self.eps, int | float) or not 0 <= self.eps < 10:
            raise TypeError(f"eps must be a number in [0, 10), not {self.eps!r}")
        bad = [m for m in self.members if m not in MEMBERS]
        if bad or not self.members:
            raise ValueError(f"members must be a non-empty subset of {', '.join(MEMBERS)}, "
                             f"not {self.members!r}")

    def strategies(self):
        """The member strategies that can run here."""
        return [get_strategy(m, eps=self.eps, seed=self.seed) for m in self.members
                if not (m == "mtkahypar" and mtkahypar_missing())]

    def partition(self, graph, targets):
        return self.choose(graph, targets)[1]

    def choose(self, graph, targets):
        """``(name, parts)`` of the member kept (see the module documentation)."""
        limits = part_limits(graph, targets, self.eps)
        indptr, adj, ew = graph.csr
        best = None
        for strategy in self.strategies():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", PartitionWarning)
                parts = np.asarray(strategy.partition(graph, targets), dtype=np.int64).copy()
            # Polish: move nodes out of units above their limit, then k-way FM under the
            # exact limits (a backend's answer may be a hair over, or improvable).
            refine_kway(indptr, adj, ew, graph.node_weight, parts, limits, targets.count,
                        np.random.default_rng(self.seed), 4, 200)
            # Overloads count in steps of 1% of the limit, so that a cut several times
            # larger never wins by a hair's less overload.
            over = overload(graph, targets, parts, limits) / np.maximum(limits, 1e-9)
            key = (int(np.ceil(100 * over.max(initial=0.0) - 1e-9)), graph.cut(parts))
            if best is None or key < best[0]:
                best = (key, strategy.name, parts, caught)
        # Only what the member kept said is the answer's warning.
        for w in best[3]:
            if issubclass(w.category, PartitionWarning):
                warnings.warn(f"{best[1]}: {w.message}", PartitionWarning, stacklevel=2)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return best[1], best[2]
