"""The MoE routing ops (topk, take, dispatch, combine) lowered into few, long events (issue 18):
bit-exact against the IR's numpy reference on the functional interpreter for random routings
(ties, INT_MIN rows, experts no token chose, every token to one expert, indices out of range
and repeated in a row when they do not come from a top-k), and the main job's routing ops free
of per-row round trips."""

import collections

import numpy as np
import pytest
from conftest import hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.compiler.compile import compile_workload
from rdakit.compiler.graph import DataflowGraph
from rdakit.hdl.spec.isa import Op
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.events import op_events
from rdakit.sim.runtime.job import run_job_interp

I32 = np.iinfo(np.int32)


def routing_graph(tokens, d, experts, k, shift, given_idx, weights=None):
    """``x`` routed by ``topk(logits)`` (or by the graph input ``idx`` when ``given_idx``:
    any values), gates ``take(logits, idx)`` (or the input ``gates``), each expert's rows
    ``relu(dispatch)`` (or, given ``weights``, ``dispatch @ weights[e]``), ``combine``; every
    result an output."""
    g = DataflowGraph("routing")
    x = g.input("x", (tokens, d), "int8")
    if given_idx:
        idx = g.input("idx", (tokens, k), "int32")
        gates = g.input("gates", (tokens, k), "int32")
    else:
        logits = g.input("logits", (tokens, experts), "int32")
        idx = g.add("topk", logits, name="tk", k=k)
        gates = g.add("take", logits, idx, name="gates")
        g.output("o_idx", idx)
        g.output("o_gates", gates)
    rows = [g.add("dispatch", x, idx, name=f"d{e}", expert=e, experts=experts)
            for e in range(experts)]
    if weights is None:
        ys = [g.add("relu", r, name=f"y{e}") for e, r in enumerate(rows)]
    else:
        ys = [g.add("matmul", r, g.const(f"w{e}", weights[e]), name=f"y{e}")
              for e, r in enumerate(rows)]
    g.output("o", g.add("combine", idx, gates, *ys, name="comb", shift=shift))
    return g.validate()


def assert_exact(g, inputs, lanes, local_words, seed=0):
    params = fabric_params(2, 2, prog_len=4096, lanes=lanes, local_words=local_words,
                           mu_words=8192)
    job, _ = compile_workload(g, params=params, partitioner="round_robin", place_steps=20,
                              split=1)
    job = job.with_inputs(inputs)
    outputs, result, _ = run_job_interp(job, schedule="random", seed=seed)
    assert result.ok, result.errors
    got, want = job.decode(outputs, check_padding=True), g.evaluate(inputs)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    return job


def read_ahead(job, node):
    """How many streams in ``node``'s code are configured before an LGET and started after it
    (the walk reading the next slot's scalars while the stream waits to start)."""
    count = 0
    for xy, info in job.programs.items():
        program = job.config.tiles[xy].program
        for name, _, _, a, b in info.ops:
            if name != node:
                continue
            configured = read = False
            for ins in program[a:b]:
                if ins.op in (Op.SCFG, Op.SCFGI):
                    configured, read = True, False
                elif ins.op is Op.LGET and configured:
                    read = True
                elif ins.op is Op.SRUN:
                    count += read
                    configured = read = False
    return count


@st.composite
def routings(draw):
    lanes = draw(st.sampled_from([1, 4]))
    tokens = draw(st.integers(1, 11))     # dispatch unrolls up to 8
    experts = draw(st.integers(1, 6))
    k = draw(st.integers(1, experts))
    d = draw(st.integers(1, 9))
    given_idx = draw(st.booleans())
    # 8 to 32 local words (4 lanes: a row of x fits): some forms do not fit and take the
    # per-row, per-chunk or per-expert form.
    local_words = draw(st.sampled_from([8, 16, 32, 64])) if lanes == 4 else 64
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    x = rng.integers(-128, 128, (tokens, d)).astype(np.int8)
    if given_idx:
        # In range, out of range, repeated in a row; or every token to one expert.
        lo, hi = draw(st.sampled_from([(0, experts), (-2, experts + 2), (1, 2)]))
        inputs = {"x": x, "idx": rng.integers(lo, hi, (tokens, k)).astype(np.int32),
                  "gates": rng.integers(-300, 300, (tokens, k)).astype(np.int32)}
    else:
        # Few values (ties everywhere: experts no token chose, all to the first ones), the
        # extremes (rows of INT_MIN), or any.
        pool = draw(st.sampled_from([[0], [-1, 0, 1], [I32.min, I32.max, 0, I32.min + 1],
                                     None]))
        logits = (rng.choice(pool, (tokens, experts)) if pool is not None
                  else rng.integers(I32.min, I32.max, (tokens, experts), endpoint=True))
        inputs = {"x": x, "logits": logits.astype(np.int32)}
    return (routing_graph(tokens, d, experts, k, draw(st.integers(0, 9)), given_idx),
            inputs, lanes, local_words, seed)


@hostile(30)
@given(routings())
def test_random_routings_are_bit_exact(case):
    """Random sizes, lanes, local buffers and routings: every output equals numpy's."""
    g, inputs, lanes, local_words, seed = case
    assert_exact(g, inputs, lanes, local_words, seed)


@hostile(30)
@given(case=routings(), n=st.integers(1, 6), one_cu=st.booleans())
def test_a_dispatch_folds_into_the_matmul_reading_its_rows(case, n, one_cu):
    """Each expert ``dispatch(x) @ W_e``: on one CU (or where the partitioner put both on
    one), the dispatch folds into the matmul (``matmul_routed``: the routed rows go from x
    to the local buffer, no buffer of their own) whenever a row of x fits the local buffer
    beside the constants; bit-exact for random routings (out of range and repeated indices
    too), sizes, lanes and local buffers, under random interleavings."""
    g, inputs, lanes, local_words, seed = case
    tokens, d = inputs["x"].shape
    experts = sum(1 for node in g.order() if g.kind(node) == "dispatch")
    rng = np.random.default_rng(seed)
    weights = rng.integers(-128, 128, (experts, d, n)).astype(np.int8)
    given_idx = "idx" in inputs
    shift = g.nx.nodes["comb"]["attrs"]["shift"]
    g = routing_graph(tokens, d, experts, inputs.get("idx", np.zeros((1, 1))).shape[1]
                      if given_idx else g.type_of("tk").shape[1], shift, given_idx, weights)
    rows, cols = (1, 2) if one_cu else (2, 2)
    params = fabric_params(rows, cols, prog_len=4096, lanes=lanes, local_words=local_words,
                           mu_words=8192, max_buffers=64)
    job, _ = compile_workload(g, params=params, partitioner="round_robin", place_steps=20,
                              split=1, inputs=inputs)
    outputs, result, _ = run_job_interp(job, schedule="random", seed=seed)
    assert result.ok, result.errors
    got, want = job.decode(outputs, check_padding=True), g.evaluate(inputs)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    kinds = collections.Counter(kind for info in job.programs.values()
                                for _, kind, *_ in info.ops)
    assert kinds["matmul_routed"] + kinds["dispatch"] == experts
    if one_cu and -(-d // lanes) <= local_words - lanes:     # beside the transposes' identity
        assert kinds["matmul_routed"] == experts


@pytest.mark.parametrize("lanes", [1, 4])
def test_every_token_to_one_expert_and_experts_no_token_chose(lanes):
    """Logits that send every token to experts 2 and 0 (k = 2 of 5): three experts get no
    row, two get every row; and indices given straight, all to expert 3."""
    tokens, experts = 5, 5
    logits = np.full((tokens, experts), -7, np.int32)
    logits[:, 2], logits[:, 0] = 9, I32.min + 1
    logits[:, [1, 3, 4]] = I32.min
    g = routing_graph(tokens, 6, experts, 2, 3, False)
    x = np.arange(tokens * 6, dtype=np.int8).reshape(tokens, 6) - 12
    assert_exact(g, {"x": x, "logits": logits}, lanes, 64)
    g = routing_graph(tokens, 6, experts, 2, 3, True)
    idx = np.full((tokens, 2), 3, np.int32)
    assert_exact(g, {"x": x, "idx": idx, "gates": np.full((tokens, 2), 5, np.int32)},
                 lanes, 64)


@pytest.mark.parametrize("tokens, experts, k, d", [
    (11, 4, 2, 16), (9, 5, 3, 16), (6, 3, 1, 16), (3, 4, 2, 36)])
def test_combine_a_chunk_of_rows_at_a_time(tokens, experts, k, d, monkeypatch):
    """Top-k routings whose combined output does not fit 32 local words beside the tables and
    the staged indices and gates, but a few rows do: the slot walk a chunk of rows at a time
    (chunks of two rows and a last one of one row with 11 and 9 tokens; k = 1 with no local
    row; one chunk and the rest, unrolled), bit-exact for several schedules. Each token's
    last stream waits to start until the next token's slot 0 is read (an LGET waits for a
    stream writing the local buffer): in the loop's chunk and the last one."""
    from rdakit.compiler.lower import templates

    chunked = []
    real = templates.combine_chunks
    monkeypatch.setattr(templates, "combine_chunks",
                        lambda *a: chunked.append(a[2].name) or real(*a))
    rng = np.random.default_rng(tokens)
    g = routing_graph(tokens, d, experts, k, 4, False)
    inputs = {"x": rng.integers(-128, 128, (tokens, d)).astype(np.int8),
              "logits": rng.integers(-50, 50, (tokens, experts)).astype(np.int32)}
    for seed in range(3):
        job = assert_exact(g, inputs, 4, 32, seed)
    assert chunked and set(chunked) == {"comb"}     # (the lowering may run twice)
    assert read_ahead(job, "comb") >= 2


MAIN = {"tokens": 4, "d_model": 8, "d_ff": 8, "experts": 4}


@pytest.fixture(scope="module")
def main_events():
    params = fabric_params(2, 2, prog_len=2048, mu_words=1024)
    job, _ = compile_workload("moe", sizes=MAIN, params=params, partitioner="greedy")
    outputs, result, _ = run_job_interp(job)
    assert result.ok
    for name, want in job.expected.items():
        assert (outputs[name] == want).all(), name
    events = op_events(job)
    kinds = {name: kind for info in job.programs.values() for name, kind, *_ in info.ops}
    return {kind: sum((c for n, c in events.items() if kinds[n] == kind),
                      start=collections.Counter())
            for kind in ("topk", "take", "dispatch", "combine")}


def test_top_k_and_take_make_no_round_trip_a_row(main_events):
    """The main job's top-k and take build their result in the local buffer and write it with
    one stream: their one blocking MU instruction is the output's ALLOC (a VAPPEND a row
    before, 5 each)."""
    assert main_events["topk"]["mu"] == 1
    assert main_events["take"]["mu"] == 1
    # take: x and the indices staged, the output zeroed and written: 4 streams, not one a row.
    assert main_events["take"]["streams"] == 4


def test_combine_walks_the_slots_not_every_token_for_every_expert(main_events):
    """combine's instructions grow with the routing slots (tokens x k = 8), not with tokens x
    experts (262 before)."""
    assert main_events["combine"]["instructions"] <= 160


def test_dispatch_tests_a_slot_with_one_lget_and_a_branch(main_events):
    """Each dispatch stages the indices XORed with its expert and unrolls the 4 tokens: 4
    experts x 4 tokens x 2 slots at 2 instructions, where the XOR, the loop and the row
    pointers took 207 instructions before."""
    assert main_events["dispatch"]["instructions"] <= 160


@pytest.mark.parametrize("d_model, local_words, streams, most", [
    (8, 64, 13, 160), (8, 16, 16, 250), (16, 16, 14, 180), (8, 8, 17, None)])
def test_combine_forms_by_what_the_local_buffer_holds(d_model, local_words, streams, most):
    """The main job's combine (and with d_model 16). With 64 local words the slot walk: the
    zeroed output and accumulators, two staged tables, a stream a slot, the final sum (13
    streams). With 16 its tables do not fit beside the output: expert by expert, the indices
    restaged XORed with each expert (4 streams), a LOCAL_ACC stream a routed slot (16); at
    d_model 16 only a row of the output fits beside the tables: the slot walk a row at a time,
    a stream a routed slot and one adding each row's local part (14; expert by expert, two
    streams a routed slot, 22 streams and 307 instructions). With 8 nothing is staged: the
    tables are read with READ (two streams a routed slot and the zeroed output: 17). All
    bit-exact; the three new forms run at most ``most`` instructions (the scan of every
    token's slots with XORs for every expert before: 262, 262, 333)."""
    params = fabric_params(2, 2, prog_len=2048, mu_words=1024, local_words=local_words)
    job, _ = compile_workload("moe", sizes=dict(MAIN, d_model=d_model), params=params,
                              partitioner="greedy")
    outputs, result, _ = run_job_interp(job)
    assert result.ok
    for name, want in job.expected.items():
        assert (outputs[name] == want).all(), name
    combine = op_events(job)["combine"]
    assert combine["streams"] == streams
    if most is not None:
        assert combine["instructions"] <= most


def test_the_main_job_runs_within_the_issues_target_on_the_performance_model():
    """Issue 18's target for the README main job is 1,300 cycles (the RTL runs within a few
    per cent of the model: 1,293 against 1,262). 1,451 with the routing ops of before, 1,256
    before combine read the next token's slot 0 ahead of the last slot's stream."""
    from rdakit.sim.flows import e2e
    spec = e2e.RunSpec(workload="moe", sizes=MAIN, partitioner="greedy",
                       fabric={"rows": 2, "cols": 2, "mu_words": 1024, "prog_len": 2048})
    (row,) = e2e.run(spec, sim="model")
    assert (row["numpy"], row["interpreter"]) == ("ok", "ok")
    assert row["cycles"] <= 1250
