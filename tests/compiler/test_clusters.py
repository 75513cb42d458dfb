"""Partitioning across clusters: seed 2's greedy against the baselines, resources and loads,
shared-buffer placement, the second level inside clusters, the schedule, and errors."""

import itertools

import numpy as np
import pytest

from rdakit.compiler.cost import CostModel
from rdakit.compiler.partition import PartitionError, as_weighted
from rdakit.compiler.partition.clusters import (
    CLUSTER_STRATEGIES,
    ClusterSpec,
    LinkModel,
    induced_subgraph,
    observed_clusters,
    partition_clusters,
    partition_system,
    place_buffers,
    system_schedule,
)
from rdakit.compiler.partition.wgraph import WeightedGraph
from rdakit.compiler.workloads import build

LINK = LinkModel(bytes_per_cycle=4, latency=20)


@pytest.fixture(scope="module")
def graphs():
    return {name: as_weighted(build(name).graph) for name in ("mlp", "decoder", "mixtral")}


@pytest.mark.parametrize("name", ["mlp", "decoder", "mixtral"])
def test_greedy_beats_round_robin_and_crosses_fewer_bytes(graphs, name):
    wg = graphs[name]
    clusters = [ClusterSpec(4), ClusterSpec(4)]
    res = {s: partition_system(wg, clusters, s, link=LINK) for s in CLUSTER_STRATEGIES}
    assert res["greedy"].makespan < res["round_robin"].makespan
    assert res["greedy"].crossing_bytes < res["round_robin"].crossing_bytes / 10
    for r in res.values():
        assert r.work.sum() == wg.total_weight
        assert r.crossing_bytes == wg.edge_weight[r.cluster[wg.src] != r.cluster[wg.dst]].sum()


@pytest.mark.parametrize("name", ["decoder", "mixtral"])
@pytest.mark.parametrize("slow", [ClusterSpec(1), ClusterSpec(4, load=3000.0)],
                         ids=["fewer_cus", "injected_load"])
def test_work_moves_away_from_a_slower_cluster(graphs, name, slow):
    wg = graphs[name]
    even = partition_clusters(wg, [ClusterSpec(4), ClusterSpec(4)], link=LINK)
    skew = partition_clusters(wg, [ClusterSpec(4), slow], link=LINK)
    work = lambda parts: np.bincount(parts, weights=wg.node_weight, minlength=2)  # noqa: E731
    assert work(skew)[1] < work(even)[1]
    assert work(skew)[1] < 0.4 * wg.total_weight
    # The baselines do not look at resources.
    for s in ("round_robin", "static"):
        np.testing.assert_array_equal(partition_clusters(wg, [ClusterSpec(4), slow], s),
                                      partition_clusters(wg, [ClusterSpec(4), ClusterSpec(4)],
                                                         s))


def test_a_cluster_without_cus_gets_no_work(graphs):
    wg = graphs["mixtral"]
    parts = partition_clusters(wg, [ClusterSpec(2), ClusterSpec(0), ClusterSpec(2)], link=LINK)
    assert wg.node_weight[parts == 1].sum() == 0
    with pytest.raises(PartitionError, match=r"gave work to 'cluster1', which has no CU"):
        partition_clusters(wg, [ClusterSpec(2), ClusterSpec(0)], "round_robin")


def test_a_slow_link_keeps_work_together(graphs):
    wg = graphs["decoder"]
    fast = partition_system(wg, [ClusterSpec(2)] * 2, link=LinkModel(64, 1))
    slow = partition_system(wg, [ClusterSpec(2)] * 2, link=LinkModel(0.25, 500))
    assert slow.crossing_bytes <= fast.crossing_bytes
    assert min(fast.work) > 0


def test_buffers_go_where_most_of_their_bytes_are_read():
    # Buffer 0 feeds nodes 1, 2 (cluster 0, 10 bytes) and 3 (cluster 1, 30 bytes).
    wg = WeightedGraph("b", [0, 5, 5, 5, 0], [0, 0, 0, 1, 3], [1, 2, 3, 4, 4],
                       [5, 5, 30, 1, 1])
    parts = place_buffers(wg, [-1, 0, 0, 1, 1])
    assert parts.tolist() == [1, 0, 0, 1, 1]

    def crossing(p):
        p = np.asarray(p)
        return wg.edge_weight[p[wg.src] != p[wg.dst]].sum()

    best = min(crossing([c, 0, 0, 1, 1]) for c in range(2))
    assert crossing(parts) == best


def test_buffer_placement_is_optimal_on_a_workload(graphs):
    wg = graphs["mixtral"]
    parts = partition_clusters(wg, [ClusterSpec(2)] * 3, link=LINK)
    sources = [v for v in range(wg.n) if wg.node_weight[v] == 0 and not (wg.dst == v).any()]
    assert sources
    for v in sources:
        out = wg.src == v
        costs = [wg.edge_weight[out][parts[wg.dst[out]] != c].sum() for c in range(3)]
        assert costs[parts[v]] == min(costs)


def test_second_level_uses_every_cluster_cu(graphs):
    wg = graphs["mixtral"]
    r = partition_system(wg, [ClusterSpec(3), ClusterSpec(2)], link=LINK)
    for c, n in enumerate((3, 2)):
        cus = set(r.cu[(r.cluster == c) & (wg.node_weight > 0)].tolist())
        assert cus <= set(range(n))
        assert len(cus) == n


def test_induced_subgraph_keeps_inner_edges():
    wg = WeightedGraph("g", [1, 2, 3, 4], [0, 1, 0, 2], [1, 2, 3, 3], [10, 20, 30, 40],
                       names=("a", "b", "c", "d"))
    sub = induced_subgraph(wg, [0, 2, 3])
    assert sub.names == ("a", "c", "d")
    assert sub.node_weight.tolist() == [1, 3, 4]
    assert sorted(zip(sub.src.tolist(), sub.dst.tolist(), sub.edge_weight.tolist(),
                      strict=True)) == [(0, 2, 30), (1, 2, 40)]


def test_schedule_costs():
    # A chain a -> b of 100 bytes: same CU, same cluster, other cluster.
    wg = WeightedGraph("c", [10, 10], [0], [1], [100])
    cost = CostModel(link_bytes=4, hop_cycles=1, mean_hops=2.0)
    link = LinkModel(bytes_per_cycle=2, latency=30)
    two = [ClusterSpec(2), ClusterSpec(1)]
    assert system_schedule(wg, [0, 0], [0, 0], two, link, cost) == 20
    assert system_schedule(wg, [0, 0], [0, 1], two, link, cost) == 20 + 25 + 2
    assert system_schedule(wg, [0, 1], [0, 0], two, link, cost) == 20 + 50 + 30
    # A load delays the CUs of its cluster: 8 cycles over 2 CUs.
    loaded = [ClusterSpec(2, load=8.0), ClusterSpec(1)]
    assert system_schedule(wg, [0, 0], [0, 0], loaded, link, cost) == 24


def test_deterministic(graphs):
    wg = graphs["decoder"]
    a = partition_system(wg, [ClusterSpec(2)] * 2, link=LINK)
    b = partition_system(wg, [ClusterSpec(2)] * 2, link=LINK)
    assert a.cluster.tolist() == b.cluster.tolist() and a.cu.tolist() == b.cu.tolist()


def test_link_model_of_a_system():
    from rdakit.hdl.cluster.system import SystemParams
    from rdakit.hdl.spec.params import fabric_params

    sp = SystemParams(fabric_params(1, 2, cluster_bits=1), link_width=16, link_latency=7)
    link = LinkModel.of_system(sp)
    assert (link.bytes_per_cycle, link.latency) == (2.0, 7)
    assert link.crossing_cycles(10).item() == 5 + 7


@pytest.mark.parametrize("make, exc, message", [
    (lambda: ClusterSpec(-1), TypeError, r"^cus must be a non-negative integer, not -1$"),
    (lambda: ClusterSpec(True), TypeError, r"^cus must be a non-negative integer, not True$"),
    (lambda: ClusterSpec(1, load=-2), TypeError, r"^load must be a non-negative number"),
    (lambda: LinkModel(0), TypeError, r"^bytes_per_cycle must be a positive number, not 0$"),
    (lambda: LinkModel(1, -1), TypeError, r"^latency must be a non-negative integer, not -1$"),
    (lambda: partition_clusters(WeightedGraph.path(4), [ClusterSpec(1)], "kl"), ValueError,
     r"^Strategy must be one of greedy, round_robin, static, not 'kl'$"),
    (lambda: partition_clusters(WeightedGraph.path(4), [ClusterSpec(0)]), PartitionError,
     r"^No cluster has an available CU$"),
    (lambda: partition_clusters(WeightedGraph.path(4), [2]), TypeError,
     r"^clusters must be a non-empty sequence of ClusterSpec"),
])
def test_errors(make, exc, message):
    with pytest.raises(exc, match=message):
        make()


def test_every_strategy_on_every_cluster_count(graphs):
    wg = graphs["mlp"]
    for k, s in itertools.product((1, 2, 4), CLUSTER_STRATEGIES):
        r = partition_system(wg, [ClusterSpec(2)] * k, s, link=LINK)
        assert set(r.cluster.tolist()) <= set(range(k))
        assert r.makespan >= wg.critical_path()


def test_repartitioning_from_observed_cycles_moves_work_away(graphs):
    wg = graphs["mixtral"]
    clusters = [ClusterSpec(4), ClusterSpec(4)]
    first = partition_system(wg, clusters, link=LINK)
    # Cluster 1 turned out three times slower than its CUs promise (an injected load).
    cycles = [first.work[0] / 4, 3 * first.work[1] / 4]
    seen = observed_clusters(clusters, first.work, cycles)
    assert seen[0].load == 0 and seen[1].load == pytest.approx(2 * first.work[1])
    second = partition_system(wg, seen, link=LINK)
    assert second.work[1] < first.work[1]
    with pytest.raises(ValueError, match=r"^work and cycles must have 2 entries"):
        observed_clusters(clusters, [1], [1, 2])
