"""The multilevel partitioner's phases: coarsening, FM refinement, scaling."""

import time

import numpy as np
import pytest

from rdakit.compiler.partition import Targets
from rdakit.compiler.partition.multilevel import MultilevelKL, coarsen, refine_kway
from rdakit.compiler.partition.wgraph import WeightedGraph


def test_coarsening_keeps_work_and_edges():
    g = WeightedGraph.grid(30, 30)
    indptr, adj, ew = g.csr
    levels, maps = coarsen(indptr, adj, ew, g.node_weight, 60, np.random.default_rng(0))
    assert len(levels) > 3 and len(levels[-1][3]) <= 0.05 * g.n + 60
    for (ip, ad, w, vw), (_, _, cw, cvw), m in zip(levels, levels[1:], maps, strict=False):
        assert cvw.sum() == vw.sum() == g.n
        assert len(m) == len(vw) and m.max() == len(cvw) - 1
        # Coarse edge weight = fine edges between different coarse nodes (both directions).
        src = np.repeat(np.arange(len(vw)), np.diff(ip))
        assert cw.sum() == w[m[src] != m[ad]].sum()
        assert cvw.max() <= max(int(1.5 * g.n / 60), 1)


def test_fm_improves_a_random_bisection_and_keeps_balance():
    g = WeightedGraph.grid(20, 20)
    indptr, adj, ew = g.csr
    rng = np.random.default_rng(1)
    parts = rng.permutation(np.arange(g.n) % 2).astype(np.int64)
    before = g.cut(parts)
    maxw = np.array([206.0, 206.0])
    gain = refine_kway(indptr, adj, ew, g.node_weight, parts, maxw, 2, rng, 10, 200)
    assert g.cut(parts) == before - gain < before / 2
    assert np.bincount(parts, minlength=2).max() <= 206


def test_heavy_nodes_do_not_break_balance():
    w = np.array([100, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    g = WeightedGraph("heavy", w, np.arange(11), np.arange(1, 12), np.ones(11, dtype=np.int64))
    parts = MultilevelKL().partition(g, Targets(3))
    weights = g.part_weights(parts, 3)
    assert weights.max() == 100 and g.cut(parts) <= 3


def test_parameter_validation():
    with pytest.raises(TypeError, match="^eps must be a number in \\[0, 10\\), not -1$"):
        MultilevelKL(eps=-1)
    with pytest.raises(TypeError, match="^stall must be a positive integer, not 0$"):
        MultilevelKL(stall=0)


@pytest.mark.slow
def test_100k_grid_into_64_parts_in_under_10_seconds():
    g = WeightedGraph.grid(316, 316)
    t0 = time.perf_counter()
    parts = MultilevelKL().partition(g, Targets(64))
    seconds = time.perf_counter() - t0
    assert seconds < 10
    weights = g.part_weights(parts, 64)
    assert weights.max() <= 1.03 * g.n / 64 + 1
    assert g.cut(parts) <= 1.10 * 5036  # METIS's cut on this grid (seed 0) is 5036
