"""The stream engine's side of streams between CUs, alone in Amaranth's simulator: a testbench
plays the sequencer, the network bringing words into the input queue and the consumer
returning credits. A stream reading the queue and sending to another CU's (A_REF = this CU,
D_MODE QUEUE): its words in order with the last one marked, at most ``queue_words`` without
credits back, its own credits back to the words' sender, its end at the marked word with the
count; the protocol violations raise ``q_error``."""

import numpy as np
from conftest import rand32, run_checked, wrap32

from rdakit.hdl.compute.stream import StreamEngine
from rdakit.hdl.spec.isa import AluFn, BMode, DMode
from rdakit.hdl.spec.packets import STREAM_CREDIT, STREAM_LAST, MsgKind
from rdakit.hdl.spec.params import CUParams, FabricParams, MUParams
from rdakit.hdl.spec.vector import pack_vector, unpack_vector

LANES = 2
Q = 4
MU_P = MUParams(words=256, block_words=16, max_buffers=4, max_buffer_words=128, buf_id_bits=4,
                weight_bits=4, mu_id_bits=2, index_bits=8, data_bits=32 * LANES, tag_bits=4,
                coord_bits=1)
P = FabricParams(rows=2, cols=2, mu=MU_P, cu=CUParams(
    lanes=LANES, prog_len=16, regs=8, local_words=4, outstanding=4, channels=1, mailbox=1,
    queue_words=Q))
SELF_ID, PRODUCER_ID, CONSUMER_ID = 0, 3, 3      # this CU (0, 0); the other CU (1, 1)


def _fields(dut, **cfg):
    fields = {name: 0 for name in dut.fields.shape().members}
    fields.update(outer=1, **cfg)
    return fields


def test_queue_to_queue_stream():
    # 7 words arrive (the 6th marked last) for a stream configured for 10 steps that adds 5
    # to each and sends it on: it runs 6 steps, sends 6 words (the 6th marked), never more
    # than Q ahead of the credits the testbench returns (after 20 cycles each), gives back 6
    # credits to the words' sender, and leaves the 7th word queued.
    words = rand32(np.random.default_rng(3), (7, LANES)) >> 4
    dut = StreamEngine(P, x=0, y=0)
    out = {"sent": [], "credits": [], "outstanding": []}

    async def tb(ctx):
        ctx.set(dut.active, 1)
        ctx.set(dut.msg_out.ready, 1)
        ctx.set(dut.fields, _fields(dut, a_ref=SELF_ID, n=10, b_mode=BMode.SCALAR.value,
                                    b_val=5, d_mode=DMode.QUEUE.value, d_ref=CONSUMER_ID))
        ctx.set(dut.fn, AluFn.ADD)
        ctx.set(dut.start, 1)
        await ctx.tick()
        ctx.set(dut.start, 0)
        returns = []                       # cycles at which the consumer's credits come back
        held = Q
        for cycle in range(300):
            k = cycle // 3                 # a word every third cycle
            arrive = cycle % 3 == 0 and k < len(words)
            ctx.set(dut.q_in.valid, arrive)
            if arrive:
                ctx.set(dut.q_in.payload, {"data": pack_vector(words[k]), "last": k == 5,
                                           "src": PRODUCER_ID})
            back = cycle in returns
            ctx.set(dut.credit_in, back)
            ctx.set(dut.credit_count, 1)
            held += back
            if ctx.get(dut.msg_out.valid):
                flit = ctx.get(dut.msg_out.payload)
                body = flit.payload.body
                assert flit.payload.kind == MsgKind.STREAM
                if body.tag & STREAM_CREDIT:
                    assert (flit.dst.x, flit.dst.y, body.ref.mu) == (1, 1, SELF_ID)
                    out["credits"].append(body.data)
                else:
                    assert (flit.dst.x, flit.dst.y, body.ref.mu) == (1, 1, SELF_ID)
                    out["sent"].append((unpack_vector(body.data, LANES), body.tag))
                    held -= 1
                    assert held >= 0, "a word sent without a credit"
                    returns.append(cycle + 20)
            assert not ctx.get(dut.q_error)
            if ctx.get(dut.done):
                out["count"] = ctx.get(dut.count)
                out["cycle"] = cycle
                break
            await ctx.tick()
        ctx.set(dut.q_in.valid, 0)
        for _ in range(3):                 # the credits of the last pops
            if ctx.get(dut.msg_out.valid):
                out["credits"].append(ctx.get(dut.msg_out.payload).payload.body.data)
            await ctx.tick()

    run_checked(dut, tb)
    sent = np.array([w for w, _ in out["sent"]])
    np.testing.assert_array_equal(sent, wrap32(words[:6].astype(np.int64) + 5))
    assert [t for _, t in out["sent"]] == [0] * 5 + [STREAM_LAST]
    assert out["count"] == 6 and sum(out["credits"]) == 6


def test_word_at_a_full_queue_and_credits_past_the_depth_are_errors():
    dut = StreamEngine(P, x=0, y=0)
    errors = []

    async def tb(ctx):
        ctx.set(dut.active, 1)
        ctx.set(dut.msg_out.ready, 1)
        ctx.set(dut.q_in.payload, {"data": 7, "last": 0, "src": PRODUCER_ID})
        for _ in range(Q + 1):             # no stream reads them: the last finds Q words
            ctx.set(dut.q_in.valid, 1)
            errors.append(ctx.get(dut.q_error))
            await ctx.tick()
        ctx.set(dut.q_in.valid, 0)
        ctx.set(dut.credit_in, 1)          # the producer holds Q credits: one more is too many
        ctx.set(dut.credit_count, 1)
        errors.append(ctx.get(dut.q_error))
        await ctx.tick()
        ctx.set(dut.credit_in, 0)
        errors.append(ctx.get(dut.q_error))

    run_checked(dut, tb)
    assert errors == [0] * Q + [1, 1, 0]
