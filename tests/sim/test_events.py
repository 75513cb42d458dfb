"""The event counts of compiled jobs (``rdakit.sim.runtime.events``) and the timed cost model:
counts that add up to the interpreter's, per node and per CU; cycles per node that add up to
the performance model's run; and estimates close to the RTL's cycles."""

import math

import pytest
from conftest import assert_interpreter_matches

from rdakit.compiler.compile import bitstream_for, compile_workload
from rdakit.compiler.cost import CostModel, TimedCostModel
from rdakit.compiler.graph import MEMORY_KINDS, DataflowGraph
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.flows.e2e import SMALLEST, RunSpec, run
from rdakit.sim.models.perf import PerfInterpreter
from rdakit.sim.runtime.events import (
    EVENTS,
    MAX_EVENT_NODES,
    TIMED_PASSES,
    ModelRank,
    OpTimer,
    cost_model,
    cu_events,
    node_cycles,
    node_events,
    op_events,
)
from rdakit.sim.runtime.job import prepare_interp, run_job_interp

P = fabric_params(2, 2, prog_len=1024)


@pytest.fixture(scope="module")
def moe_job():
    job, _ = compile_workload("moe", sizes=SMALLEST["moe"], params=P)
    return job


def test_events_add_up_to_the_interpreters_counts(moe_job):
    _, result, _ = run_job_interp(moe_job)
    per_cu = cu_events(moe_job)
    assert sum(c["steps"] for c in per_cu.values()) == sum(
        c.stream_steps for c in result.cus.values())
    # Every executed instruction is one event: an SRUN, a blocking MU instruction or another.
    assert sum(c["streams"] + c["mu"] + c["instructions"] for c in per_cu.values()) == sum(
        result.instructions.values())
    # The ops' events are the CUs' but for the prologues, messages and epilogues.
    per_op = op_events(moe_job)
    for kind in EVENTS:
        assert sum(c[kind] for c in per_op.values()) <= sum(c[kind] for c in per_cu.values())
    assert sum(c["steps"] for c in per_op.values()) == sum(c["steps"] for c in per_cu.values())


def test_node_events_share_a_lowered_op_by_work(moe_job):
    per_op = op_events(moe_job)
    per_node = node_events(moe_job)
    for kind in EVENTS:
        assert sum(c[kind] for c in per_node.values()) == pytest.approx(
            sum(c[kind] for c in per_op.values()))
    # The routing ops count what the sample tokens really did: an expert no token chose
    # streams nothing.
    steps = {n: per_node[n]["steps"] for n in per_node if n.endswith("_fc1")}
    assert min(steps.values()) < max(steps.values())


def test_node_cycles_add_up_to_the_performance_models_run(moe_job):
    # Every cycle of every CU from the start to its halt is an op's or fixed (prologue,
    # epilogue); the busiest CU's sum is the run's cycles.
    cycles, fixed = node_cycles(moe_job)
    model, _ = prepare_interp(moe_job, interpreter=PerfInterpreter)
    end = model.run_timed()
    start = model.timing.run_start
    assert 0 < fixed < end - start
    assert sum(cycles.values()) + fixed <= len(moe_job.programs) * (end - start)
    # Each compute node has its share; an expert no token chose costs less than one that got
    # tokens.
    compute = {n for n in moe_job.graph.order() if moe_job.graph.kind(n) not in MEMORY_KINDS}
    assert set(cycles) == compute and all(c > 0 for c in cycles.values())
    fc1 = [cycles[n] for n in cycles if n.endswith("_fc1")]
    assert min(fc1) < max(fc1)


def test_a_streams_tail_is_its_ops_not_the_next_ops():
    """One CU: a one-row matmul (one PACK_SUM stream of 1,024 steps) and then an add reading
    its product. The add's first instruction waits for the stream; those cycles are the
    matmul's, so that a partition putting the add on another CU is not charged them. On one
    CU the ops' cycles and the fixed ones still add up to the run."""
    import numpy as np

    g = DataflowGraph("tail")
    x = g.input("x", (1, 64), "int8")
    mm = g.add("matmul", x, g.const("w", np.ones((64, 64), np.int8)), name="mm")
    g.output("y", g.add("add", mm, g.const("b", np.arange(64, dtype=np.int32)[None]),
                        name="bias"))
    one = fabric_params(1, 2, prog_len=1024, mu_words=1 << 14)
    job, _ = compile_workload(g.validate(), params=one, partitioner="round_robin",
                              place_steps=1)
    cycles, fixed = node_cycles(job)
    model, _ = prepare_interp(job, interpreter=PerfInterpreter)
    end = model.run_timed()
    assert cycles["mm"] >= 64 * 64 // 4                          # its stream's steps
    assert cycles["bias"] < 100                                 # two short streams
    assert sum(cycles.values()) + fixed == pytest.approx(end - model.timing.run_start, abs=2)


def test_timed_cost_model_times_every_compute_node():
    model = cost_model("moe", sizes=SMALLEST["moe"], params=P)
    assert isinstance(model, TimedCostModel)
    job, _ = compile_workload("moe", sizes=SMALLEST["moe"], params=P)
    compute = {n for n in job.graph.order() if job.graph.kind(n) not in MEMORY_KINDS}
    assert {row[0] for row in model.cycles} == compute
    assert model.fixed_cycles > 0


def test_the_timed_model_times_each_dispatch_on_its_own():
    """On one CU every dispatch would fold into its expert's matmul, leaving it the work
    share of a copy; the timed model lowers without that fold, so a dispatch costs what it
    costs on a CU of its own (the estimate of a partition that separates them)."""
    one = fabric_params(1, 2, prog_len=4096, mu_words=1 << 16, max_buffers=64)

    def dispatch_cycles(passes):
        job, _ = compile_workload("moe", sizes=SMALLEST["moe"], params=one,
                                  partitioner="round_robin", place_steps=1, passes=passes)
        kinds = {kind for info in job.programs.values() for _, kind, *_ in info.ops}
        cycles, _ = node_cycles(job)
        return kinds, sum(c for n, c in cycles.items() if job.graph.kind(n) == "dispatch")

    kinds, alone = dispatch_cycles(TIMED_PASSES)
    assert "dispatch" in kinds and "matmul_routed" not in kinds
    kinds, folded = dispatch_cycles(None)
    assert "matmul_routed" in kinds and "dispatch" not in kinds
    assert alone > 2 * folded


def test_a_workload_that_does_not_fit_one_cu_falls_back_to_the_work_model():
    # Local buffer too small for the lowering's constants: the work model stands in.
    tiny = fabric_params(2, 2, prog_len=1024, local_words=1)
    model = cost_model("moe", sizes=SMALLEST["moe"], params=tiny)
    assert type(model) is CostModel


@pytest.mark.parametrize("workload", ["mlp", "switch"])
def test_estimates_are_close_to_the_rtl(workload):
    # The timed model's estimate (what `rdakit run` reports) against the RTL's cycles in
    # Amaranth's simulator.
    (row,) = run(RunSpec(workload, sizes=dict(SMALLEST[workload]), fabric=dict(prog_len=1024),
                         place_steps=2000))
    assert row["numpy"] == "ok"
    assert abs(row["estimated_cycles"] - row["cycles"]) <= 0.15 * row["cycles"], row


@pytest.mark.parametrize("workload", ["moe", "decoder"])
def test_schedule_order_runs_bit_exact(workload):
    # Each CU's ops by start cycle in the list schedule (the decoder appends to its KV caches
    # in place: the ops touching a buffer keep their order); the interpreter's outputs equal
    # numpy's, and some CU's ops are in another order than the graph's.
    sizes = SMALLEST[workload]
    model = cost_model(workload, sizes=sizes, params=P)
    graph_job, _ = compile_workload(workload, sizes=sizes, params=P, cost=model)
    job, _ = compile_workload(workload, sizes=sizes, params=P, cost=model, order="schedule")
    outputs, _, _ = run_job_interp(job)
    for name, want in job.expected.items():
        assert (outputs[name] == want).all(), name
    def order(j):
        return {cu: [name for name, *_ in info.ops] for cu, info in j.programs.items()}
    assert order(job) != order(graph_job)


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError,
                       match="^order must be one of 'graph', 'schedule', 'auto', not 'rank'$"):
        compile_workload("mlp", sizes=SMALLEST["mlp"], params=P, order="rank")


def test_a_graph_too_large_for_one_cu_keeps_the_work_model():
    # More nodes than one CU's program could hold: not lowered, the work model stands in.
    g = DataflowGraph("chain")
    x = g.input("x", (1, 4), "int32")
    for i in range(MAX_EVENT_NODES):
        x = g.add("relu", x, name=f"r{i}")
    g.output("y", x)
    assert type(cost_model(g.validate(), params=P)) is CostModel


@pytest.mark.parametrize("local_words, local_sum", [(64, True), (8, False)])
def test_combine_accumulates_in_the_local_buffer_when_the_output_fits(local_words, local_sum):
    # The main job's output (4 tokens x 2 words) fits 64 local words beside the staged indices
    # and gates: one LOCAL_ACC stream per routed token and one at the end. With 8 words it
    # does not (nor do the indices and gates, read by READ): two streams per routed token.
    # Both bit-exact on the interpreter.
    params = fabric_params(2, 2, prog_len=1024, local_words=local_words)
    job, _ = compile_workload("moe", sizes=SMALLEST["moe"], params=params)
    outputs, _, _ = run_job_interp(job)
    for name, want in job.expected.items():
        assert (outputs[name] == want).all(), name
    streams = op_events(job)["combine"]["streams"]
    routed = SMALLEST["moe"]["tokens"] * SMALLEST["moe"]["k"]
    # The zeroed output; two staging streams, the zeroed accumulator and the final sum.
    assert streams == (routed + 5 if local_sum else 2 * routed + 1)


def test_model_rank_is_the_performance_models_run(moe_job, monkeypatch):
    model, _ = prepare_interp(moe_job, interpreter=PerfInterpreter)
    rank = ModelRank()
    assert rank(moe_job) == model.run_timed()
    assert ModelRank(max_steps=10)(moe_job) is None          # too long to tell
    # The same job again (as another strategy's candidate) is not run again; another is.
    runs = []
    monkeypatch.setattr(rank, "_run", lambda job, bound=None: runs.append(job) or 7)
    assert rank(moe_job) == model.run_timed() and runs == []
    other, _ = compile_workload("moe", sizes=SMALLEST["moe"], params=P, partitioner="heft")
    assert rank(other) == 7 and runs == [other]


def test_model_rank_stops_a_run_past_its_bound(moe_job):
    """With a bound below a job's cycles the run stops once past it (math.inf: slower), a
    bound at or above them gives the cycles; a cut run is not taken for the job's figure:
    asked again without a bound (or with a higher one) it runs to the end."""
    full, _ = prepare_interp(moe_job, interpreter=OpTimer)         # (counts its steps)
    cycles = full.run_timed()
    cut, _ = prepare_interp(moe_job, interpreter=OpTimer)
    assert cut.run_timed(until=cycles // 2) == math.inf
    assert cut.steps < full.steps                               # stopped early
    rank = ModelRank()
    assert rank(moe_job, bound=cycles // 2) == math.inf
    runs = []
    real = rank._run
    rank._run = lambda job, bound=None: runs.append(bound) or real(job, bound)
    assert rank(moe_job, bound=cycles // 4) == math.inf and runs == []   # known: no run
    assert rank(moe_job, bound=cycles) == cycles and runs == [cycles]
    assert rank(moe_job) == cycles and runs == [cycles]                 # the full run kept
    assert ModelRank()(moe_job, bound=cycles - 1) > cycles - 1       # (any figure above)
    assert ModelRank()(moe_job, bound=cycles + 100) == cycles


def test_a_bounded_rank_keeps_what_the_full_runs_keep():
    """Ranking with runs stopped at the fewest cycles so far keeps the job the full runs
    keep, with the same figures in the summary (the estimate's choice is run to the end)."""
    class Full:
        name = ModelRank.name

        def __init__(self):
            self.model = ModelRank()

        def __call__(self, job):
            return self.model(job)

    params = fabric_params(2, 2, mu_words=2048, prog_len=2048)
    sizes = dict(SMALLEST["moe"], tokens=8)
    kept = [compile_workload("moe", sizes=sizes, params=params, partitioner="fastest",
                             order="auto", rank=rank) for rank in (ModelRank(), Full())]
    (job_b, bounded), (job_f, full) = kept
    assert bounded.ranked == full.ranked and bounded.how() == full.how()
    assert bitstream_for(job_b) == bitstream_for(job_f)


def test_split_auto_keeps_the_job_the_model_finds_fastest():
    """The 4x4 decoder step at d_model 64: the estimates keep a job of 4,590 cycles on the
    model where the 4-way split one takes 3,700 (5,601 and 4,022 before ``p @ V`` was one
    stream); ranked by the performance model, auto keeps the fewest cycles of all twelve
    candidates (unsplit, split 8 and 4 ways, four strategies), and says what the estimate
    would have kept."""
    params = fabric_params(4, 4, mu_words=8192, prog_len=2048)
    sizes = dict(d_model=64, cache_len=16)
    rank = ModelRank()
    timed = cost_model("decoder", sizes=sizes, params=params)       # as rdakit run estimates
    job, summary = compile_workload("decoder", sizes=sizes, params=params, schedule_cost=timed,
                                    partitioner="fastest", split="auto", rank=rank)
    how, cycles, n, by_estimate = summary.ranked
    assert n == 12 and cycles == rank(job) and summary.split == 4
    assert cycles < by_estimate                          # the estimate's choice: 24 % slower
    alone = [rank(compile_workload("decoder", sizes=sizes, params=params, partitioner=p,
                                   split=s)[0])
             for s in (1, 8, 4) for p in ("multilevel", "greedy", "metis", "heft")]
    assert cycles == min(alone) and by_estimate in alone
    assert_interpreter_matches(job, job.workload.reference(job.workload.inputs))
