"""Streams between CUs in the interpreter (the golden model, ``docs/compute-unit.md``, "Streams
between CUs"): pipelines of two and three CUs bit-exact against numpy under any schedule and
any queue depth, the end-of-stream mark and the step count, what each misuse gets (a deadlock
report naming the waits, QUEUE_OVERFLOW, BAD_DESTINATION). Pure Python: the RTL's side is
``tests/hdl/test_cu_streams.py``."""

import numpy as np
import pytest
from conftest import wrap32
from hypothesis import given, settings
from hypothesis import strategies as st

from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.isa import BMode, DMode, assemble
from rdakit.hdl.spec.params import CUParams, FabricParams, MUParams, fabric_params
from rdakit.sim.models.interp import DeadlockError, Interpreter

LANES = 2


def fabric(queue_words, cols=2):
    """A 2 x ``cols`` checkerboard: CUs at (0, 0), (1, 1) (and (2, 0) with three columns)."""
    mu = MUParams(words=1024, block_words=16, max_buffers=8, max_buffer_words=256,
                  buf_id_bits=4, weight_bits=4, mu_id_bits=4, index_bits=8,
                  data_bits=32 * LANES, tag_bits=4, coord_bits=2)
    return FabricParams(rows=2, cols=cols, mu=mu, cu=CUParams(
        lanes=LANES, prog_len=64, regs=8, local_words=4, queue_words=queue_words))


def cfg(**fields):
    return "\n".join(f"SCFGI {name}, {int(getattr(v, 'value', v))}" for name, v in fields.items())


def producer(to_id, *, n_reg=3):
    """Sends ``x * 3`` of the first ``r[n_reg]`` words of r1 to the CU ``to_id``."""
    return f"""
        SCFG A_REF, r1
        LI r6, {to_id}
        SCFG D_REF, r6
        {cfg(A_STRIDE=1, B_MODE=BMode.SCALAR, B_VAL=3, D_MODE=DMode.QUEUE)}
        SCFG N, r{n_reg}
        SRUN MUL, r0
        HALT
    """


def middle(to_id, n, outer):
    """Takes words from its queue, adds 5, sends them on to ``to_id`` (N*OUTER at most)."""
    return f"""
        SELF r2
        SCFG A_REF, r2
        LI r6, {to_id}
        SCFG D_REF, r6
        {cfg(N=n, OUTER=outer, B_MODE=BMode.SCALAR, B_VAL=5, D_MODE=DMode.QUEUE)}
        SRUN ADD, r4
        HALT
    """


def consumer(n, outer):
    """Appends the words of its queue to r1 (N*OUTER at most); the count goes to r4."""
    return f"""
        SELF r2
        SCFG A_REF, r2
        SCFG D_REF, r1
        {cfg(N=n, OUTER=outer, B_MODE=BMode.ZERO, D_MODE=DMode.APPEND)}
        SRUN PASS, r4
        HALT
    """


def run(params, programs, regs, x, *, schedule="round_robin", seed=0):
    it = Interpreter(params, FabricConfig(params, {
        xy: TileConfig(program=assemble(text)) for xy, text in programs.items()}),
        schedule=schedule, seed=seed)
    refs = {"x": it.load_buffer((1, 0), x), "out": it.load_buffer((0, 1), np.zeros((0, LANES)))}
    for xy, rs in regs.items():
        for r, v in rs.items():
            it.set_register(xy, r, refs.get(v, v))
    res = it.run()
    return res, it.read_buffer((0, 1), refs["out"])


@settings(max_examples=60, deadline=None)
@given(q=st.integers(1, 6), words=st.integers(1, 20), n=st.integers(1, 8),
       outer=st.integers(1, 4), seed=st.integers(0, 2 ** 16))
def test_three_stage_pipeline_matches_numpy_under_any_schedule(q, words, n, outer, seed):
    # Producer (0, 0) -> middle (1, 1) -> consumer (2, 0): the producer sends `words` words
    # whatever depth the queues have; the middle and the consumer are configured for
    # N*OUTER steps and end at the producer's last word if it comes first (the mark passes
    # on): each reports its count. When N*OUTER is shorter, the words the middle leaves
    # queued hold credits: the producer finishes only if they fit its queue.
    p = fabric(q, cols=3)
    x = np.arange(words * LANES).reshape(words, LANES) - 7
    steps = min(words, n * outer)
    programs = {(0, 0): producer(p.mu_id(1, 1)), (1, 1): middle(p.mu_id(2, 0), n, outer),
                (2, 0): consumer(n, outer)}
    regs = {(0, 0): {1: "x", 3: words}, (2, 0): {1: "out"}}
    if words > steps + q:
        with pytest.raises(DeadlockError, match=r"CU \(0, 0\) at pc 8: SRUN waits for a credit"):
            run(p, programs, regs, x, schedule="random", seed=seed)
        return
    res, out = run(p, programs, regs, x, schedule="random", seed=seed)
    assert res.ok, res.errors
    np.testing.assert_array_equal(out, wrap32(x[:steps] * 3 + 5))
    assert res.cu(1, 1).regs[4] == res.cu(2, 0).regs[4] == steps


def test_more_words_than_the_consumer_takes_leave_the_producer_waiting():
    # 7 words for a consumer stream of 4 steps and a queue of 2: the producer gets 2 + 4
    # credits, and the seventh word none (a stall, not a lost word).
    p = fabric(2)
    x = np.arange(14).reshape(7, LANES)
    with pytest.raises(DeadlockError, match=r"^Deadlock after \d+ steps: every running CU is "
                                            r"blocked: CU \(0, 0\) at pc 8: SRUN waits for a "
                                            r"credit to send to CU \(1, 1\)$"):
        run(p, {(0, 0): producer(p.mu_id(1, 1)), (1, 1): consumer(4, 1)},
            {(0, 0): {1: "x", 3: 7}, (1, 1): {1: "out"}}, x)


def test_consumer_waits_for_words():
    p = fabric(4)
    with pytest.raises(DeadlockError, match=r"CU \(1, 1\) at pc 7: SRUN waits for a word in "
                                            r"its input queue"):
        run(p, {(1, 1): consumer(4, 1)}, {(1, 1): {1: "out"}}, np.zeros((1, LANES)))


def test_count_register_follows_the_reduction():
    # SUM writes rd, the count goes to rd + 1; ARGMAX writes rd and rd + 1, the count rd + 2
    # (modulo the registers).
    p = fabric(8)
    x = np.array([[1, 9], [4, -2], [9, 0]])
    cons = f"""
        SELF r2
        SCFG A_REF, r2
        {cfg(N=3, B_MODE=BMode.ZERO, D_MODE=DMode.SUM)}
        SRUN PASS, r4
        {cfg(D_MODE=DMode.ARGMAX)}
        SRUN PASS, r6
        HALT
    """
    prod = producer(p.mu_id(1, 1)).replace("SRUN MUL, r0", "SRUN MUL, r0\nSRUN MUL, r0")
    res, _ = run(p, {(0, 0): prod, (1, 1): cons}, {(0, 0): {1: "x", 3: 3}}, x)
    r = res.cu(1, 1).regs
    assert (r[4], r[5]) == (3 * x.sum(), 3)
    assert (r[6], r[7], r[0]) == (27, 1, 3)      # the first of the two 27s: k 0, lane 1


def test_two_producers_into_one_queue_overflow_it():
    # Each producer holds queue_words credits: together they overfill a queue nobody reads.
    p = fabric(2)
    send = producer(p.mu_id(1, 1)).replace("HALT", "WAIT 0, 1\nHALT")
    res, _ = run(p, {(0, 0): producer(p.mu_id(1, 1)), (1, 1): send},
                 {(0, 0): {1: "x", 3: 2}, (1, 1): {1: "x", 3: 2}}, np.ones((2, LANES)))
    assert res.errors == {(1, 1): "QUEUE_OVERFLOW"}


def test_credits_returned_to_the_wrong_producer_overflow_it():
    # A consumer returns credits to the sender of the last word it received: after words of
    # two producers, one of them gets credits for the other's words and passes queue_words.
    p = fabric(4, cols=3)
    c = p.mu_id(1, 1)
    prod = producer(c).replace("HALT", "WAIT 0, 1\nHALT")
    # Two streams: each ends at a producer's last word.
    cons = consumer(4, 1).replace("SELF r2", "WAIT 0, 2\nSELF r2").replace(
        "SRUN PASS, r4", "SRUN PASS, r4\nSRUN PASS, r4").replace(
        "HALT", f"LI r6, {p.mu_id(0, 0)}\nSEND 0, r6, 1\nLI r6, {p.mu_id(2, 0)}\n"
                "SEND 0, r6, 1\nHALT")
    prod_then_token = prod.replace("SRUN MUL, r0", f"SRUN MUL, r0\nLI r7, {c}\nSEND 0, r7, 1")
    res, out = run(p, {(0, 0): prod_then_token, (2, 0): prod_then_token, (1, 1): cons},
                   {(0, 0): {1: "x", 3: 2}, (2, 0): {1: "x", 3: 2}, (1, 1): {1: "out"}},
                   np.ones((2, LANES)))
    assert list(res.errors.values()) == ["QUEUE_OVERFLOW"]
    assert len(out) == 4


def test_queue_words_parameter():
    # The input queue's depth: fabric_params passes it on; CUParams checks it like the rest.
    assert fabric_params(2, 2, queue_words=2).cu.queue_words == 2
    assert fabric_params(2, 2).cu.queue_words == 16
    for bad in (0, 1025, True, "4"):
        with pytest.raises(TypeError, match=r"^queue_words must be an integer"):
            CUParams(queue_words=bad)


@pytest.mark.parametrize("text, pc", [
    ("LI r6, 1\nSCFG D_REF, r6\nSCFG A_REF, r1\nSCFGI D_MODE, 9\nSCFGI N, 1\nSRUN PASS, r0", 5),
    ("LI r6, 5\nSCFG A_REF, r6\nSCFGI N, 1\nSRUN PASS, r0", 3),
], ids=["queue_to_an_mu", "queue_of_another_cu"])
def test_queue_stream_naming_the_wrong_tile_halts(text, pc):
    # D_REF 1 is the MU at (1, 0); A_REF 5 the CU at (1, 1), not this one.
    p = fabric(4)
    res, _ = run(p, {(0, 0): text + "\nHALT"}, {(0, 0): {1: "x"}}, np.ones((1, LANES)))
    assert res.errors == {(0, 0): "BAD_DESTINATION"} and res.cu(0, 0).pc == pc
