"""Streams between CUs in the lowering (issue 18): which edges qualify
(:func:`~rdakit.compiler.lower.streams.stream_refusal`, each refusal), that the programs with
streams are bit-exact and finish under random interleavings with queues smaller than the
tensors (credits exercised), that the walk refuses a stream its producer would hold up, and
that ``streams=False`` lowers every edge through an MU."""

import dataclasses

import numpy as np
import pytest
from conftest import hostile
from hypothesis import event, given, note
from hypothesis import strategies as st

from rdakit.compiler.compile import compile_workload, placement_fabric
from rdakit.compiler.graph import DataflowGraph
from rdakit.compiler.lower import lower
from rdakit.compiler.lower.passes import PIPELINE
from rdakit.compiler.lower.plan import Plan
from rdakit.compiler.lower.streams import stream_edges, stream_refusal
from rdakit.compiler.placement import place
from rdakit.hdl.spec.isa import DMode, Op, StreamField
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.flows.e2e import SMALLEST
from rdakit.sim.runtime.job import run_job_interp

X = {"x": np.arange(-16, 16, dtype=np.int32).reshape(4, 8)}


def with_queue(params, words):
    return dataclasses.replace(params, cu=dataclasses.replace(params.cu, queue_words=words))


def chain(n=4):
    """x + c on CU 0, >> 1 on CU 1, alternating: each op reads the one before from the other
    CU. r0 and r2 stream from CU 0 into CU 1 (r2 after CU 1's token that it has read r0); r1
    does not: its only pass reads the stream r0 and would send while CU 0 waits for it."""
    g = DataflowGraph("chain")
    x = g.input("x", (4, 8), "int32")
    c = g.const("c", np.arange(8, dtype=np.int32))
    parts = {"x": 0, "c": 0}
    for i in range(n):
        x = g.add("add", x, c, name=f"r{i}") if i % 2 == 0 else \
            g.add("shr", x, name=f"r{i}", shift=1)
        parts[f"r{i}"] = i % 2
    g.output("y", x)
    parts["y"] = (n - 1) % 2
    return g.validate(), parts


def lowered(g, parts, params, streams=True):
    return lower(g, parts, place(g, parts, placement_fabric(params), steps=0), params,
                 inputs=X, streams=streams)


def plan_of(g, parts, params):
    placement = place(g, parts, placement_fabric(params), steps=0)
    plan = Plan(g, parts, placement, params)
    for p in PIPELINE:
        p.apply(plan)
    return plan


def queue_streams(job):
    """``(producer CU, consumer CU)`` of every SRUN with D_MODE QUEUE, and the CUs whose
    programs read their own queue (a SELF)."""
    sends, reads = [], set()
    at = {job.params.mu_id(*cu): cu for cu in job.config.tiles}
    for cu, tile in job.config.tiles.items():
        mode, dst = None, {}
        for ins in tile.program:
            if ins.op is Op.LI:
                dst[ins.rd] = ins.imm
            if ins.op is Op.SCFGI and ins.fn == StreamField.D_MODE.value:
                mode = ins.imm
            if ins.op is Op.SCFG and ins.fn == StreamField.D_REF.value:
                dst["d_ref"] = dst.get(ins.ra)
            if ins.op is Op.SRUN and mode == DMode.QUEUE.value:
                sends.append((cu, at[dst["d_ref"]]))
            if ins.op is Op.SELF:
                reads.add(cu)
    return sends, reads


def check_runs(job, inputs, seeds=3):
    """Bit-exact against the graph under the round-robin and ``seeds`` random interleavings
    (a deadlock raises), every buffer but the outputs freed, no queue overflow."""
    want = job.graph.evaluate(inputs)
    for schedule, seed in [("round_robin", 0)] + [("random", s) for s in range(seeds)]:
        outputs, result, interp = run_job_interp(job, schedule=schedule, seed=seed)
        assert result.ok, result.errors
        got = job.decode(outputs, check_padding=True)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        live = sum(len(interp.mu(*m).live_buffers()) for m in job.params.tiles("M"))
        assert live == len(job.outputs)


@pytest.mark.parametrize("queue_words", [2, 3, 4])
def test_chain_streams_with_queues_smaller_than_the_tensor(queue_words):
    # 8 words a tensor through queues of 2-4: the producer runs out of credits and waits.
    g, parts = chain()
    params = with_queue(fabric_params(2, 2, prog_len=512), queue_words)
    job = lowered(g, parts, params)
    sends, reads = queue_streams(job)
    (cu0, cu1), = set(sends)
    assert len(sends) == 2 and reads == {cu1}
    # The second stream waits for the token CU 1 sends once it has read the first.
    assert [ins.op for ins in job.config.tiles[cu0].program].count(Op.WAIT) == 1
    check_runs(job, X, seeds=4)


def test_streams_off_lowers_every_edge_through_an_mu():
    g, parts = chain()
    params = fabric_params(2, 2, prog_len=512)
    off = lowered(g, parts, params, streams=False)
    assert queue_streams(off) == ([], set())
    on = lowered(g, parts, params)
    def count(job, op):
        return sum(ins.op is op for t in job.config.tiles.values() for ins in t.program)
    assert (count(off, Op.SENDREF), count(on, Op.SENDREF)) == (3, 1)
    # r0 and r2 (one pass each) go to the queue from that pass and need no buffer; no pass
    # is added.
    assert (count(off, Op.ALLOC), count(on, Op.ALLOC)) == (3, 1)
    assert count(on, Op.SRUN) == count(off, Op.SRUN)
    check_runs(off, X, seeds=1)


def held_up():
    """t = x + c and u = x >> 1 on CU 0, y = t + u on CU 1: t would stream, but u's reference
    is sent after t's stream, and CU 1 receives u before it reads t."""
    g = DataflowGraph("held")
    x = g.input("x", (4, 8), "int32")
    c = g.const("c", np.arange(8, dtype=np.int32))
    t = g.add("add", x, c, name="t")
    u = g.add("shr", x, name="u", shift=1)
    g.output("y", g.add("add", t, u, name="s"))
    return g.validate(), {"x": 0, "c": 0, "t": 0, "u": 0, "s": 1, "y": 1}


def test_walk_refuses_a_stream_its_producer_holds_up():
    # t qualifies by itself (one reader on another CU, its streamed operand), but CU 0 adds
    # u's SENDREF after t's stream and CU 1 RECVs u before its stream reads t: with 2 credits
    # the 8 words of t would wait for CU 1 and CU 1 for u's reference (a deadlock).
    g, parts = held_up()
    params = with_queue(fabric_params(2, 2, prog_len=512), 2)
    plan = plan_of(g, parts, params)
    assert stream_edges(plan) == ["t"]
    job = lowered(g, parts, params)
    assert queue_streams(job) == ([], set())
    check_runs(job, X, seeds=4)


def refusals(g, parts, params=None):
    plan = plan_of(g, parts, params or fabric_params(2, 2, prog_len=512))
    readers = plan.readers()
    return {op.out: stream_refusal(plan, op.out, readers) for op in plan.lops}


def test_refusals():
    g = DataflowGraph("refusals")
    x = g.input("x", (4, 8), "int32")
    d = g.input("d", (4, 8), "int32", dynamic=True)
    c = g.const("c", np.arange(8, dtype=np.int32))
    twice = g.add("add", x, c, name="twice")           # read by two ops
    g.add("relu", twice, name="t1")
    g.add("shr", twice, name="t2", shift=1)
    self_ = g.add("add", x, c, name="self")            # read twice by one op
    g.add("add", self_, self_, name="sq")
    out = g.add("shr", x, name="out", shift=2)         # a graph output
    dyn = g.add("relu", d, name="dyn")                 # dynamic
    g.add("shr", dyn, name="d1", shift=1)
    local = g.add("shr", x, name="local", shift=3)     # read on its producer's CU
    g.add("add", local, c, name="l1")
    ok = g.add("shr", x, name="ok", shift=4)           # qualifies
    g.add("add", ok, c, name="o1")
    for n in ("t1", "t2", "sq", "d1", "l1", "o1"):
        g.output(f"y_{n}", n)
    g.output("y_out", out)
    g.validate()
    parts = {n: 0 for n in g.order()}
    parts.update({n: 1 for n in ("t1", "t2", "sq", "d1", "o1", "y_t1", "y_t2", "y_sq",
                                 "y_d1", "y_o1")})
    got = refusals(g, parts)
    assert got["twice"] == "read by 2 ops"
    assert got["self"] == "read twice by its op"
    assert got["out"] == "in a host buffer (output)"
    assert got["dyn"].startswith("dynamic")
    assert got["local"] == "read on its producer's CU"
    assert got["ok"] is None


def test_refusal_of_an_operand_that_is_not_streamed():
    # b of x + b (same shape) is staged in the local buffer, not read as the A stream.
    g = DataflowGraph("operand")
    x = g.input("x", (4, 8), "int32")
    b = g.add("shr", x, name="b", shift=1)
    g.output("y", g.add("add", x, b, name="s"))
    g.validate()
    got = refusals(g, {"x": 0, "b": 0, "s": 1, "y": 1})
    assert got["b"] == "not the streamed operand of ew"


WORKLOADS = [(name, grid) for name in SMALLEST for grid in ((2, 2), (4, 4))]


@pytest.mark.long
@pytest.mark.parametrize("name,grid", WORKLOADS, ids=[f"{n}-{g[0]}x{g[1]}" for n, g in WORKLOADS])
def test_workloads_bit_exact_with_streams(name, grid):
    params = with_queue(fabric_params(*grid, prog_len=2048), 4)
    job, _ = compile_workload(name, sizes=SMALLEST[name], params=params,
                              partitioner="fastest", place_steps=300, streams=True)
    check_runs(job, job.workload.inputs, seeds=2)


def test_split_graph_streams_its_row_blocks():
    # mlp split into 2 row blocks on 2x2: a block's last elementwise chain streams into the
    # concatenation on the other CU.
    params = with_queue(fabric_params(2, 2, prog_len=2048), 2)
    job, summary = compile_workload("mlp", sizes=SMALLEST["mlp"], params=params,
                                    partitioner="greedy", split=2, place_steps=300,
                                    streams=True)
    assert summary.split == 2
    sends, reads = queue_streams(job)
    assert sends and len(reads) == len(sends)
    check_runs(job, job.workload.inputs, seeds=3)


@pytest.mark.parametrize("bad", ["no", 0, None])
def test_streams_option_must_be_a_bool(bad):
    with pytest.raises(ValueError, match=f"streams must be True or False, not {bad!r}"):
        compile_workload("mlp", params=fabric_params(2, 2), streams=bad)


def two_producers(interleaved):
    """a = x + c on CU 0 and b = x >> 1 on CU 2, both read on CU 1 by ops writing outputs; with
    ``interleaved`` the graph's order is a, relu(a), b, b >> 2 (b's producer comes after the
    consumer of a), else a, b, relu(a), b >> 2."""
    g = DataflowGraph("two")
    x = g.input("x", (4, 8), "int32")
    c = g.const("c", np.arange(8, dtype=np.int32))
    a = g.add("add", x, c, name="a")
    if interleaved:
        g.output("ya", g.add("relu", a, name="ra"))
        b = g.add("shr", x, name="b", shift=1)
    else:
        b = g.add("shr", x, name="b", shift=1)
        g.output("ya", g.add("relu", a, name="ra"))
    g.output("yb", g.add("shr", b, name="rb", shift=2))
    parts = {"x": 0, "c": 0, "a": 0, "b": 2, "ra": 1, "ya": 1, "rb": 1, "yb": 1}
    return g.validate(), parts


@pytest.mark.parametrize("queue_words", [2, 4])
def test_second_producer_into_a_cu_waits_for_the_consumers_token(queue_words):
    # b's producer WAITs for CU 1's token, sent once CU 1's stream has read all of a (its SEND
    # waits for the stream): one producer per queue at a time, so two streams into CU 1.
    g, parts = two_producers(interleaved=True)
    params = with_queue(fabric_params(2, 2, layout="CC/CM", prog_len=512), queue_words)
    job = lowered(g, parts, params)
    sends, reads = queue_streams(job)
    assert len(sends) == 2 and len({dst for _, dst in sends}) == 1 and len(reads) == 1
    b_cu = next(cu for cu, p in job.programs.items() if any(o[0] == "b" for o in p.ops))
    assert [ins.op for ins in job.config.tiles[b_cu].program].count(Op.WAIT) == 1
    check_runs(job, X, seeds=4)


def test_second_producer_before_the_first_consumer_is_refused():
    # b's stream would come before CU 1 has read a (its token later in the walk): an MU.
    g, parts = two_producers(interleaved=False)
    params = with_queue(fabric_params(2, 2, layout="CC/CM", prog_len=512), 2)
    job = lowered(g, parts, params)
    sends, _ = queue_streams(job)
    assert len(sends) == 1
    check_runs(job, X, seeds=4)


def test_refusal_of_a_producer_without_a_last_pass():
    # A matmul appends its rows with PACK_SUM streams, one a row: it cannot send to a queue
    # from one last pass (a copy pass would cost it more than the hand-over), so m stays in an
    # MU; the elementwise chain after it streams.
    from rdakit.compiler.lower.lowerer import Lowerer

    g = DataflowGraph("producer")
    x = g.input("x", (4, 8), "int32")
    w = g.const("w", np.ones((8, 8), dtype=np.int32))
    m = g.add("matmul", x, w, name="m")
    r = g.add("relu", m, name="r")
    g.output("y", g.add("shr", r, name="s", shift=1))
    g.validate()
    params = fabric_params(2, 2, layout="CC/CM", prog_len=512)
    parts = {"x": 0, "w": 0, "m": 0, "r": 1, "s": 2, "y": 2}
    plan = plan_of(g, parts, params)
    lw = Lowerer(plan, params)
    free = lw.local_free()
    got = {op.out: stream_refusal(plan, op.out, plan.readers(), free,
                                  lambda op: lw.last_pass(op, free)) for op in plan.lops}
    assert got["m"] == "its producer (matmul_nt) has no last pass over the whole tensor"
    assert got["r"] is None
    job = lower(g, parts, place(g, parts, placement_fabric(params), steps=0), params,
                inputs=X, streams=True)
    assert len(queue_streams(job)[0]) == 1
    check_runs(job, X, seeds=2)


OPS = st.lists(st.tuples(st.sampled_from(["add_c", "shr", "relu", "add", "max", "sub"]),
                         st.integers(0, 99), st.integers(0, 99), st.integers(0, 2)),
               min_size=2, max_size=7)


@hostile(30)
@given(ops=OPS, queue_words=st.integers(2, 4), seed=st.integers(0, 2 ** 16))
def test_random_graphs_with_streams_finish_bit_exact(ops, queue_words, seed):
    # Random elementwise DAGs on three CUs (each op reads one or two earlier tensors), queues
    # of 2-4 words for tensors of 8: whatever streams the selection and the walk keep, the
    # programs finish under a random interleaving with the graph's outputs.
    g = DataflowGraph("random")
    names = [g.input("x", (4, 8), "int32")]
    c = g.const("c", np.arange(-4, 4, dtype=np.int32))
    parts = {"x": 0, "c": 0}
    for k, (kind, a, b, cu) in enumerate(ops):
        x, y = names[-1 - a % min(2, len(names))], names[b % len(names)]
        name = f"n{k}"
        if kind == "add_c":
            g.add("add", x, c, name=name)
        elif kind == "shr":
            g.add("shr", x, name=name, shift=1)
        elif kind == "relu":
            g.add("relu", x, name=name)
        else:
            g.add(kind, x, y, name=name)
        names.append(name)
        parts[name] = cu
    read = {i for n in names[1:] for i in g.inputs_of(n)}
    for n in names[1:]:
        if n not in read:
            g.output(f"y_{n}", n)
            parts[f"y_{n}"] = parts[n]
    g.validate()
    used = sorted(set(parts.values()))
    parts = {n: used.index(p) for n, p in parts.items()}
    params = with_queue(fabric_params(2, 2, layout="CC/CM", prog_len=1024), queue_words)
    job = lowered(g, parts, params)
    note(f"streams {queue_streams(job)}")
    event(f"{len(queue_streams(job)[0])} streams")
    outputs, result, _ = run_job_interp(job, schedule="random", seed=seed)
    assert result.ok, result.errors
    got = job.decode(outputs, check_padding=True)
    want = g.evaluate(X)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
