"""Placement: inside the grid and the capacities, deterministic, and clear errors."""

import itertools
import math
import os
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdakit.compiler import workloads
from rdakit.compiler.graph import DataflowGraph
from rdakit.compiler.partition import Targets, partition
from rdakit.compiler.placement import (
    Fabric,
    PlacementError,
    buffers_of,
    check_placement,
    place,
)

EXAMPLES = 6 if os.environ.get("CI") else 20


def test_default_fabric_is_a_checkerboard():
    f = Fabric(3, 4)
    assert f.layout == ("CMCM", "MCMC", "CMCM")
    assert f.kind(0, 0) == "C" and f.kind(1, 0) == "M" and f.kind(1, 1) == "C"
    assert len(f.cu_tiles) == 6 and len(f.mu_tiles) == 6
    assert f.cu_tiles[:3] == ((0, 0), (2, 0), (1, 1))


def test_fabric_validation():
    with pytest.raises(TypeError, match="^rows must be a positive integer, not 0$"):
        Fabric(0, 2)
    with pytest.raises(ValueError, match=re.escape("Fabric layout must be 2 rows of 2 tiles, "
                                                   "not ('CM',)")):
        Fabric(2, 2, layout=("CM",))
    with pytest.raises(TypeError, match=re.escape("Fabric layout tiles must be 'C' or 'M', "
                                                  "not ('CX', 'MC')")):
        Fabric(2, 2, layout=("CX", "MC"))
    f = Fabric(1, 3, layout=["CCM"])
    assert f.cu_tiles == ((0, 0), (1, 0)) and f.mu_tiles == ((2, 0),)


def test_buffers():
    wl = workloads.mlp(batch=2, sizes=(4, 8, 4))
    part_of = {n: (0 if n in ("x", "w0", "fc0", "b0", "bias0", "relu0", "act0_shr", "act0")
                   else 1) for n in wl.graph.nx}
    by_name = {b.name: b for b in buffers_of(wl.graph, part_of)}
    assert set(by_name) == {"x", "w0", "b0", "act0", "w1", "b1", "y"}
    assert by_name["act0"].producer == 0 and by_name["act0"].consumers == (1,)
    assert by_name["x"].producer is None and by_name["x"].words == 2  # 8 int8 bytes
    assert by_name["y"].producer == 1 and by_name["y"].consumers == ()


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.sampled_from(["mlp", "decoder", "mixtral"]), st.integers(1, 6), st.integers(3, 6),
       st.integers(3, 6), st.integers(0, 3))
def test_placement_within_grid_and_capacities(name, k, rows, cols, seed):
    options = {"mlp": dict(batch=2, sizes=(8, 16, 8)),
               "decoder": dict(d_model=16, heads=2, d_ff=16, cache_len=3),
               "mixtral": dict(tokens=8, d_model=8, d_ff=8)}[name]
    wl = workloads.build(name, **options)
    r = partition(wl.graph, Targets(k), "multilevel")
    fabric = Fabric(rows, cols, mu_words=4096, cu_program=256)
    used = {p for n, p in r.assignment().items()
            if wl.graph.kind(n) not in ("input", "const", "output")}
    if len(used) > len(fabric.cu_tiles):
        with pytest.raises(PlacementError, match=f"^{len(used)} partitions need a CU each"):
            place(wl.graph, r, fabric, seed=seed, steps=300)
        return
    pl = place(wl.graph, r, fabric, seed=seed, steps=300)
    check_placement(pl)
    for x, y in pl.cu_of.values():
        assert 0 <= x < cols and 0 <= y < rows and (x + y) % 2 == 0
    for b in pl.buffers:
        x, y = pl.mu_of[b.name]
        assert 0 <= x < cols and 0 <= y < rows and (x + y) % 2 == 1
    assert all(w <= fabric.mu_words for w in pl.mu_words().values())
    assert len(set(pl.cu_of.values())) == len(pl.cu_of)
    assert pl.cost <= pl.initial_cost


def test_annealing_is_deterministic_and_helps():
    wl = workloads.decoder_step(d_model=32, heads=4, d_ff=32, cache_len=4)
    r = partition(wl.graph, Targets(6), "multilevel")
    fabric = Fabric(6, 6, mu_words=2048)
    a = place(wl.graph, r, fabric, seed=5, steps=3000)
    b = place(wl.graph, r, fabric, seed=5, steps=3000)
    assert a.cu_of == b.cu_of and a.mu_of == b.mu_of and a.cost == b.cost
    assert a.cost <= a.initial_cost
    recomputed = 0
    for buf in a.buffers:
        x, y = a.mu_of[buf.name]
        ends = ([buf.producer] if buf.producer is not None else []) + list(buf.consumers)
        recomputed += buf.nbytes * sum(abs(x - a.cu_of[p][0]) + abs(y - a.cu_of[p][1])
                                       for p in ends)
    assert recomputed == a.cost
    h = a.hops(6)
    assert h.shape == (6, 6) and np.allclose(h, h.T) and (np.diag(h) == 0).all()


def test_placement_accepts_an_array_in_graph_order():
    wl = workloads.mlp(batch=1, sizes=(4, 4))
    parts = np.zeros(len(wl.graph), dtype=np.int64)
    pl = place(wl.graph, parts, Fabric(2, 2), steps=0)
    assert pl.cu_of == {0: (0, 0)}


# --- what does not fit ------------------------------------------------------------------------

def test_more_partitions_than_cus():
    wl = workloads.mlp(batch=2, sizes=(8, 8, 8, 8))
    r = partition(wl.graph, Targets(4), "round_robin")
    with pytest.raises(PlacementError, match="^4 partitions need a CU each but the 2x2 fabric "
                                             "has 2 CUs$"):
        place(wl.graph, r, Fabric(2, 2))


def test_buffer_larger_than_an_mu():
    wl = workloads.mlp(batch=2, sizes=(64, 64))
    with pytest.raises(PlacementError, match="^Buffer 'w0' needs 1024 words but an MU holds "
                                             "512$"):
        place(wl.graph, np.zeros(len(wl.graph), dtype=np.int64), Fabric(2, 2, mu_words=512))


def test_buffers_beyond_total_capacity():
    # x 16 words, w0 and w1 256, b0 and b1 32, y 16.
    wl = workloads.mlp(batch=2, sizes=(32, 32, 32))
    with pytest.raises(PlacementError, match="^Buffers need 608 words in total but the 2 MUs "
                                             "of the 2x2 fabric hold 512$"):
        place(wl.graph, np.zeros(len(wl.graph), dtype=np.int64), Fabric(2, 2, mu_words=256))


def test_buffers_that_cannot_be_packed():
    # Three 60-word inputs and a 1-word output: 181 words fit in two MUs of 100 in total, but
    # no MU can take two of the inputs.
    g = DataflowGraph("three")
    a, b, c = (g.input(n, (1, 60), "int32") for n in "abc")
    s = g.add("add", g.add("add", a, b, name="ab"), c, name="abc")
    g.output("y", g.add("reduce_sum", s, name="sum"))
    with pytest.raises(PlacementError, match="^Buffer 'c' \\(60 words\\) fits in no MU: the "
                                             "largest free space left is 40 words$"):
        place(g, np.zeros(len(g), dtype=np.int64), Fabric(2, 2, mu_words=100))


def test_program_too_long():
    wl = workloads.mlp(batch=2, sizes=(8, 8, 8, 8))
    with pytest.raises(PlacementError, match="^Partition 0 has 14 ops but a CU program holds "
                                             "at most 8$"):
        place(wl.graph, np.zeros(len(wl.graph), dtype=np.int64), Fabric(2, 2, cu_program=8))


def test_unsupported_op():
    wl = workloads.moe(tokens=4, d_model=4, d_ff=4, experts=2, k=1)
    fabric = Fabric(2, 2, cu_ops={"matmul", "relu", "shr", "clip", "take", "dispatch",
                                  "combine"})
    with pytest.raises(PlacementError, match="^Node 'gate_topk' has op kind 'topk', which the "
                                             "CUs of the 2x2 fabric do not support"):
        place(wl.graph, np.zeros(len(wl.graph), dtype=np.int64), fabric)


@pytest.mark.parametrize("rows,cols", [(2, 2), (3, 3), (4, 4), (2, 5), (8, 8)])
def test_spread_balances_mus_at_least_distance(rows, cols):
    # Every CU gets an MU, no MU serves more than its share, and no other assignment under
    # that share is cheaper (checked by brute force where small, by the nearest bound else).
    f = Fabric(rows, cols)
    cus, mus = f.cu_tiles, f.mu_tiles
    mu_of = f.spread(cus)
    share = math.ceil(len(cus) / len(mus))
    assert set(mu_of) == set(cus) and set(mu_of.values()) <= set(mus)
    load = {m: list(mu_of.values()).count(m) for m in mus}
    assert max(load.values()) <= share

    def cost(assign):
        n = {m: 0 for m in mus}
        total = 0
        for c, m in assign.items():
            total += f.distance(c, m) + n[m]
            n[m] += 1
        return total
    if len(cus) <= 5:
        best = min(cost(dict(zip(cus, ms, strict=True)))
                   for ms in itertools.product(mus, repeat=len(cus))
                   if max(ms.count(m) for m in ms) <= share)
        assert cost(mu_of) == best
    if len(cus) == len(mus) and (rows * cols) % 2 == 0:   # checkerboard: a perfect matching
        assert all(f.distance(c, m) == 1 for c, m in mu_of.items())
        assert max(load.values()) == 1


def test_spread_without_mus_is_refused():
    with pytest.raises(PlacementError, match="has no MU tile"):
        Fabric(1, 2, ("CC",)).spread([(0, 0)])
