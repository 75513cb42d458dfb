"""Compiling a workload for a system of clusters (compiler/system_compile.py): the two-level
partition is kept, each cluster gets its own configuration, IDs carry the cluster, bad cluster
specs are named."""

import re

import pytest

from rdakit.compiler.partition.clusters import ClusterSpec
from rdakit.compiler.placement import Fabric, PlacementError, place
from rdakit.compiler.system_compile import compile_system, system_view
from rdakit.compiler.workloads import build
from rdakit.hdl.cluster.system import SystemParams
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.flows.e2e import SMALLEST


def system(coord_bits=2, clusters=2):
    fp = fabric_params(2, 2, cluster_bits=1, coord_bits=coord_bits, prog_len=2048)
    return SystemParams(fp, clusters=clusters)


@pytest.fixture(scope="module")
def compiled():
    return compile_system("mlp", system(), sizes=SMALLEST["mlp"], strategy="round_robin",
                          place_steps=2000)


def test_view_gives_real_ids():
    sp = system()
    view = system_view(sp)
    fp = sp.fabric
    assert (view.rows, view.cols) == (2, 4)
    assert view.grid == [list(row) * 2 for row in fp.grid]
    for x in range(4):
        for y in range(2):
            assert view.mu_id(x, y) == fp.mu_id(x % 2, y, x // 2)
            assert view.split(x, y) == (x % 2, y, x // 2)


def test_each_cluster_gets_its_own_configuration(compiled):
    sj = compiled.system_job
    p = compiled.partition
    assert len(sj.configs) == 2
    for c in range(2):
        has_work = (p.work[c] > 0)
        assert (sj.configs[c] is not None) == has_work
    # Round-robin alternates the graph's nodes between clusters: edges cross.
    assert compiled.cut_edges > 0 and p.crossing_bytes > 0
    tiles = {(x, y) for cfg in sj.configs if cfg is not None for x, y in cfg.tiles}
    assert all(0 <= x < 2 and 0 <= y < 2 for x, y in tiles)
    assert {b.mu[2] for b in sj.buffers} <= {0, 1}
    assert all(0 <= b.mu[0] < 2 for b in sj.buffers)
    # Every tile of the wide grid the lowering used went to the cluster it lies in.
    view = compiled.job.params
    used = sum(len(cfg.tiles) for cfg in sj.configs if cfg is not None)
    assert used == len(compiled.job.config.tiles)
    for xy in compiled.job.config.tiles:
        x, y, c = view.split(*xy)
        assert (x, y) in sj.configs[c].tiles


def test_row_reports_the_partition(compiled):
    row = compiled.row()
    assert row["partitioner"] == "round_robin"
    assert row["cut_edges"] == compiled.cut_edges
    assert len(row["work"]) == len(row["cus_used"]) == len(row["loads"]) == 2
    assert all(k <= 2 for k in row["cus_used"])


def test_greedy_cuts_fewer_bytes_than_round_robin(compiled):
    greedy = compile_system("mlp", system(), sizes=SMALLEST["mlp"], place_steps=2000)
    assert greedy.partition.crossing_bytes < compiled.partition.crossing_bytes


def test_a_cluster_without_cus_gets_nothing():
    cs = compile_system("mlp", system(), sizes=SMALLEST["mlp"], place_steps=2000,
                        clusters=[ClusterSpec(2), ClusterSpec(0)])
    assert cs.system_job.configs[1] is None and cs.cut_edges == 0
    # Its buffers are on the cluster that works.
    assert {b.mu[2] for b in cs.system_job.buffers} == {0}


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(clusters=[ClusterSpec(2)]), ValueError,
     "clusters must give one ClusterSpec per cluster (2), not 1"),
    (dict(clusters=[ClusterSpec(3), ClusterSpec(2)]), ValueError,
     "cluster 0 offers 3 CUs but its 2x2 fabric has 2"),
    (dict(clusters=[2, 2]), TypeError, "clusters[0] must be a ClusterSpec, not 2"),
    (dict(strategy="nope"), ValueError, "Strategy must be one of greedy, round_robin, static"),
])
def test_bad_cluster_specs(kwargs, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        compile_system("mlp", system(), sizes=SMALLEST["mlp"], **kwargs)


def test_coordinates_too_narrow_for_the_wide_grid():
    with pytest.raises(ValueError, match=re.escape(
            "2 clusters of 2 columns need coordinates for 4 columns (at most 16; the fabric's "
            "coord_bits = 1 hold 2)")):
        compile_system("mlp", system(coord_bits=1), sizes=SMALLEST["mlp"])


def test_placement_keeps_fixed_partitions_and_counts_link_hops():
    wl = build("mlp", batch=2, sizes=(8, 8, 4))
    names = list(wl.graph.order())
    parts = {n: i % 2 for i, n in enumerate(names)}
    plain = Fabric(2, 4)
    wide = Fabric(2, 4, cluster_cols=2)
    assert plain.distance((0, 0), (3, 1)) == 4
    assert wide.distance((0, 0), (1, 1)) == 2
    assert wide.distance((1, 0), (2, 0)) == 1 + wide.cluster_hops
    pinned = {0: (0, 0), 1: (3, 1)}
    pl = place(wl.graph, parts, wide, steps=500, cu_of=pinned)
    assert pl.cu_of == pinned
    with pytest.raises(PlacementError, match=re.escape("Partition 1 must be fixed to a CU tile")):
        place(wl.graph, parts, wide, steps=10, cu_of={0: (0, 0), 1: (1, 0)})
    with pytest.raises(PlacementError, match="Two partitions are fixed to one CU tile"):
        place(wl.graph, parts, wide, steps=10, cu_of={0: (0, 0), 1: (0, 0)})
