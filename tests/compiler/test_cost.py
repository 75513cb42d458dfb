"""The cost model: op cycles, transfers, list schedules and the lower bound."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdakit.compiler import workloads
from rdakit.compiler.cost import (
    CostModel,
    TimedCostModel,
    hop_matrix,
    list_schedule,
    lower_bound,
    upward_rank,
)
from rdakit.compiler.partition.wgraph import WeightedGraph

EXAMPLES = 10 if os.environ.get("CI") else 40


def test_op_cycles():
    wl = workloads.mlp(batch=4, sizes=(64, 32))
    cost = CostModel(lanes=16, op_overhead=8)
    assert cost.op_cycles(wl.graph, "fc0") == 4 * 32 * 64 // 16 + 8
    assert cost.op_cycles(wl.graph, "bias0") == 4 * 32 // 16 + 8
    assert cost.op_cycles(wl.graph, "x") == 0 and cost.op_cycles(wl.graph, "w0") == 0
    assert cost.edge_bytes(wl.graph, "fc0", "bias0") == 4 * 32 * 4


def test_dynamic_tensors_cost_their_expected_rows():
    wl = workloads.moe(tokens=16, d_model=8, d_ff=16, experts=4, k=1)
    cost = CostModel(lanes=4, op_overhead=0)
    assert cost.op_cycles(wl.graph, "e0_fc1") == 4 * 16 * 8 // 4  # 4 expected rows of 16
    assert wl.graph.nx.edges["e0_in", "e0_fc1"]["bytes"] == 4 * 8
    assert wl.graph.nx.edges["e0_in", "e0_fc1"]["capacity_bytes"] == 16 * 8


def test_transfer_cycles():
    cost = CostModel(link_bytes=4, hop_cycles=2)
    assert cost.transfer_cycles(100, 0) == 0
    assert cost.transfer_cycles(100, 3) == 25 + 6
    assert cost.transfer_array([100, 1], [3, 0]).tolist() == [31, 0]
    h = hop_matrix(3, CostModel(mean_hops=2.5))
    assert h.tolist() == [[0, 2.5, 2.5], [2.5, 0, 2.5], [2.5, 2.5, 0]]
    assert hop_matrix(2, cost, [(0, 0), (2, 3)]).tolist() == [[0, 5], [5, 0]]


def test_timed_cost_model_charges_the_timed_cycles():
    # fc0 took 200 cycles on one CU; it costs the overlap's share of them on the fabric.
    wl = workloads.mlp(batch=4, sizes=(64, 32))
    cost = TimedCostModel(lanes=4, cycles=(("fc0", 200),), overlap=0.75, fixed_cycles=40)
    assert cost.op_cycles(wl.graph, "fc0") == 150
    # A node without cycles keeps the work model; memory nodes cost nothing.
    assert cost.op_cycles(wl.graph, "bias0") == CostModel(lanes=4).op_cycles(wl.graph, "bias0")
    assert cost.op_cycles(wl.graph, "x") == 0
    # A tensor between CUs costs the hand-over and the hops, whatever its size.
    assert cost.transfer_cycles(1000, 2) == cost.edge_cycles + 2 * cost.hop_cycles
    assert cost.transfer_array([1000, 4], [2, 0]).tolist() == [
        cost.edge_cycles + 2 * cost.hop_cycles, 0]
    # The prologue and epilogue are added once to a schedule's makespan; the work model adds
    # nothing.
    assert cost.estimate(1000) == 1040 and CostModel().estimate(1000) == 1000


def test_lead_starts_an_op_before_its_remote_inputs_arrive():
    # fc0 and bias0 on unit 0, their consumer act0_shr on unit 1: it starts when bias0's tensor
    # has been handed over, less the share `lead` of its own cycles (its ALLOC and
    # configuration), at most `lead_cycles`; a consumer on the producer's unit has nothing to
    # overlap.
    wl = workloads.mlp(batch=4, sizes=(64, 32))
    g = wl.graph
    timed = dict(fc0=200, bias0=20, act0_shr=100, act0=10)
    def schedule(lead, parts, lead_cycles=1000):
        cost = TimedCostModel(lanes=4, cycles=tuple(timed.items()), overlap=1, lead=lead,
                              lead_cycles=lead_cycles)
        wg = WeightedGraph.from_dataflow(g, cost)
        order = np.arange(wg.n)
        p = np.array([parts.get(n, 0) for n in wg.names])
        s = list_schedule(wg, p, 2, cost, order=order)
        at = {n: i for i, n in enumerate(wg.names)}
        return s.start[at["act0_shr"]], s.finish[at["bias0"]], cost
    start, ready, cost = schedule(0.0, {"act0_shr": 1, "act0": 1})
    assert start == ready + cost.transfer_cycles(1, cost.mean_hops)
    start_lead, _, _ = schedule(0.25, {"act0_shr": 1, "act0": 1})
    assert start_lead == start - 25
    assert schedule(0.25, {"act0_shr": 1, "act0": 1}, lead_cycles=20)[0] == start - 20
    assert schedule(0.25, {})[0] == schedule(0.0, {})[0] == ready


def test_a_streamed_edge_overlaps_its_two_ends():
    # bias0 on unit 0 streams to act0_shr on unit 1: the consumer starts stream_start cycles
    # after the producer starts (not after its end and a hand-over), and ends no sooner than
    # stream_tail cycles after the producer ends.
    g = workloads.mlp(batch=4, sizes=(64, 32)).graph
    cost = TimedCostModel(lanes=4, cycles=(("fc0", 200), ("bias0", 100), ("act0_shr", 30),
                                           ("act0", 10)), overlap=1, lead=0)
    wg = WeightedGraph.from_dataflow(g, cost)
    at = {n: i for i, n in enumerate(wg.names)}
    parts = np.array([1 if n in ("act0_shr", "act0") else 0 for n in wg.names])
    edge = [wg.names[u] == "bias0" and wg.names[v] == "act0_shr"
            for u, v in zip(wg.src.tolist(), wg.dst.tolist(), strict=True)]
    assert sum(edge) == 1
    whole = list_schedule(wg, parts, 2, cost, order=np.arange(wg.n))
    streamed = list_schedule(wg, parts, 2, cost, order=np.arange(wg.n), streamed=edge)
    b, c = at["bias0"], at["act0_shr"]
    assert whole.start[c] == whole.finish[b] + cost.transfer_cycles(1, cost.mean_hops)
    assert streamed.start[c] == streamed.start[b] + cost.stream_start
    assert streamed.finish[c] == streamed.finish[b] + cost.stream_tail
    assert streamed.makespan < whole.makespan
    # The work model charges a stream nothing: its consumer starts with its producer.
    work = CostModel(lanes=4)
    wg = WeightedGraph.from_dataflow(g, work)
    s = list_schedule(wg, parts, 2, work, order=np.arange(wg.n), streamed=edge)
    assert s.start[c] == s.start[b] and s.finish[c] >= s.finish[b]


@pytest.mark.parametrize("kw, message", [
    (dict(cycles=(("fc0", 1, 2),)), r"cycles must hold \(node, cycles\) rows, not "
                                    r"\('fc0', 1, 2\)"),
    (dict(cycles=(("fc0", -1),)), r"cycles must hold \(node, cycles\) rows, not \('fc0', -1\)"),
    (dict(overlap=0), r"overlap must be a number in \(0, 1\], not 0"),
    (dict(overlap=1.5), r"overlap must be a number in \(0, 1\], not 1.5"),
    (dict(fixed_cycles=-3), r"fixed_cycles must be a non-negative number, not -3"),
    (dict(lead=1), r"lead must be a number in \[0, 1\), not 1"),
    (dict(lead=-0.5), r"lead must be a number in \[0, 1\), not -0.5"),
    (dict(lead_cycles=-1), r"lead_cycles must be a non-negative integer, not -1"),
    (dict(lead_cycles=2.5), r"lead_cycles must be a non-negative integer, not 2.5"),
])
def test_timed_cost_model_validation(kw, message):
    with pytest.raises(TypeError, match=f"^{message}$"):
        TimedCostModel(**kw)


def test_cost_model_validation():
    with pytest.raises(TypeError, match="^lanes must be a positive integer, not 0$"):
        CostModel(lanes=0)
    with pytest.raises(TypeError, match="^hop_cycles must be a non-negative integer, not -1$"):
        CostModel(hop_cycles=-1)
    with pytest.raises(TypeError, match="^mean_hops must be a non-negative number, not 'x'$"):
        CostModel(mean_hops="x")


def test_list_schedule_by_hand():
    # a -> b, a -> c, b -> d, c -> d; work 10, 20, 30, 5; 8 bytes per edge.
    g = WeightedGraph("diamond", np.array([10, 20, 30, 5]), np.array([0, 0, 1, 2]),
                      np.array([1, 2, 3, 3]), np.array([8, 8, 8, 8]))
    cost = CostModel(link_bytes=4, hop_cycles=1, mean_hops=1)
    one = list_schedule(g, [0, 0, 0, 0], 2, cost)
    assert one.makespan == 65
    # b on unit 1 waits for a (10) and the transfer (2 flits + 1 hop); d waits for b (33) and
    # its transfer back (36), and for c on unit 0 (10 + 30).
    two = list_schedule(g, [0, 1, 0, 0], 2, cost)
    assert two.start.tolist() == [0, 13, 10, 40]
    assert two.makespan == 45
    assert two.busy.tolist() == [45, 20]
    assert lower_bound(g, 2) == 45  # the critical path a, c, d
    assert upward_rank(g, cost, 2).tolist() == [10 + 1.5 + 30 + 1.5 + 5, 20 + 1.5 + 5,
                                                 30 + 1.5 + 5, 5]


def test_loads_delay_units():
    g = WeightedGraph.path(3)
    s = list_schedule(g, [0, 0, 0], 2, CostModel(), loads=[100, 0])
    assert s.makespan == 103
    assert lower_bound(g, 2, [100, 0]) == 51.5


@st.composite
def dags(draw):
    n = draw(st.integers(1, 30))
    edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)),
                          max_size=3 * n))
    edges = sorted({(min(a, b), max(a, b)) for a, b in edges if a != b})
    w = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    ew = draw(st.lists(st.integers(1, 64), min_size=len(edges), max_size=len(edges)))
    src = np.array([a for a, _ in edges], dtype=np.int64)
    dst = np.array([b for _, b in edges], dtype=np.int64)
    return WeightedGraph("h", np.array(w), src, dst, np.array(ew, dtype=np.int64))


@settings(max_examples=EXAMPLES, deadline=None)
@given(dags(), st.integers(1, 5), st.data())
def test_makespan_respects_bounds_and_dependencies(g, k, data):
    parts = np.array(data.draw(st.lists(st.integers(0, k - 1), min_size=g.n, max_size=g.n)),
                     dtype=np.int64)
    cost = CostModel()
    s = list_schedule(g, parts, k, cost)
    assert s.makespan >= lower_bound(g, k) - 1e-9
    assert s.makespan <= g.total_weight + cost.transfer_array(g.edge_weight, 2).sum()
    for u, v, b in zip(g.src, g.dst, g.edge_weight, strict=True):
        hops = 0 if parts[u] == parts[v] else cost.mean_hops
        assert s.start[v] >= s.finish[u] + cost.transfer_cycles(int(b), hops)
    # No unit runs two nodes at once.
    for p in range(k):
        spans = sorted((s.start[v], s.finish[v]) for v in np.flatnonzero(parts == p)
                       if g.node_weight[v] > 0)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
