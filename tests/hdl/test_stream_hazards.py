# amaranth: UnusedElaboratable=no
"""What an instruction after SRUN waits for (``sequencer.STREAM_HAZARDS``): only a stream in the
engine that touches what it names. Each program runs on the CU harness (Amaranth's simulator)
and on the functional interpreter, whose sequential semantics (a stream completes before the
next instruction) the hardware must reproduce: registers, the local buffer and every MU buffer
are compared. The timing test checks that an instruction that need not wait does not.
"""

import numpy as np
import pytest
from conftest import rand32
from test_compute_unit import CU0, LANES, MU_A, MU_B, MU_B_ID, P, _interpret, cfg

from rdakit.hdl.compute.sequencer import (
    AFTER_STREAM,
    MU_INSTRUCTIONS,
    STREAM_HAZARDS,
    STREAM_TOUCHES,
)
from rdakit.hdl.spec.bitstream import TileConfig
from rdakit.hdl.spec.isa import DMode, Op, assemble
from rdakit.sim.verify.cu_harness import run_program, run_session


def test_every_mu_instruction_has_its_hazards():
    assert set(MU_INSTRUCTIONS) <= set(STREAM_HAZARDS)
    assert set(AFTER_STREAM) == set(STREAM_HAZARDS)
    for op, touches in STREAM_HAZARDS.items():
        assert set(touches) <= {*STREAM_TOUCHES, "any"}, op
    assert STREAM_HAZARDS[Op.ALLOC] == ()          # a new buffer: nothing to wait for


#: Each case: a stream, then instructions that must (or need not) wait for it. The interpreter
#: decides what they see.
CASES = {
    # READ and LEN of the buffer a stream appends to wait for its writes.
    "read_len_after_append": f"""
        LI r7, {MU_B_ID}
        ALLOC r3, r7, 1
        SCFG A_REF, r1
        SCFG D_REF, r3
        {cfg(A_STRIDE=1, N=8, D_MODE=DMode.APPEND)}
        SRUN ADD, r0
        READ 2, r4, r3, r6
        LEN r5, r3
        ALU ADD, r4, r4, r5
        HALT
    """,
    # A READ of the buffer a stream reads need not wait; VWRITE to it must (the stream reads
    # the old words).
    "vwrite_after_read": f"""
        SCFG A_REF, r1
        {cfg(A_STRIDE=1, N=8, D_MODE=DMode.LOCAL, D_BASE=0, D_STRIDE=1)}
        SRUN ADD, r0
        READ 1, r4, r1, r6
        VSET 0, r4
        VWRITE r1, r6
        HALT
    """,
    # LGET of a word a stream writes in the local buffer.
    "lget_after_local_write": f"""
        SCFG A_REF, r1
        {cfg(A_STRIDE=1, N=6, D_MODE=DMode.LOCAL, D_BASE=0, D_STRIDE=1)}
        SRUN ADD, r0
        LGET r4, r6, 21
        HALT
    """,
    # LSET of a word a stream reads as B.
    "lset_after_local_read": f"""
        SCFG A_REF, r1
        {cfg(A_STRIDE=1, N=6, B_MODE=1, B_VAL=8, B_STRIDE=1, D_MODE=DMode.SUM)}
        SRUN ADD, r4
        LI r5, 99
        LSET r5, r6, 42
        HALT
    """,
    # VSET after PACK_SUM (which builds V) and VREAD, which loads V.
    "v_after_pack_sum": f"""
        LI r7, {MU_B_ID}
        ALLOC r3, r7, 1
        SCFG A_REF, r1
        SCFG D_REF, r3
        {cfg(A_STRIDE=1, N=2, OUTER=3, A_OSTRIDE=2, D_MODE=DMode.PACK_SUM)}
        SRUN ADD, r0
        VSET 3, r6
        VAPPEND r4, r3
        VREAD r1, r6
        VAPPEND r4, r3
        HALT
    """,
    # The sequencer's READs of buffer b while a stream writes buffer a's copy: the request
    # register takes one request a cycle and neither may be lost.
    "reads_beside_stream_writes": f"""
        LI r7, {MU_B_ID}
        ALLOC r3, r7, 1
        SCFG A_REF, r1
        SCFG D_REF, r3
        {cfg(A_STRIDE=1, N=8, D_MODE=DMode.APPEND)}
        SRUN XOR, r0
        READ 0, r4, r2, r6
        READ 1, r5, r2, r6
        ALU ADD, r4, r4, r5
        READ 2, r5, r2, r6
        ALU ADD, r4, r4, r5
        HALT
    """,
    # An instruction that fails waits until the stream before it has completed (its reduction
    # reaches the register).
    "error_after_stream": f"""
        SCFG A_REF, r1
        {cfg(A_STRIDE=1, N=8, D_MODE=DMode.MAX)}
        SRUN PASS, r4
        WAIT 7, 1
        HALT
    """,
}


@pytest.mark.parametrize("stall", [0.0, 0.5])
@pytest.mark.parametrize("case", list(CASES))
def test_instructions_after_a_stream_see_what_the_interpreter_sees(case, stall):
    rng = np.random.default_rng(sorted(CASES).index(case))
    tiles = {CU0: TileConfig(program=assemble(CASES[case]), regs={6: 1},
                             local={w: rand32(rng, LANES).tolist()
                                    for w in range(P.cu.local_words)})}
    buffers = {"a": (MU_A, rand32(rng, (8, LANES))), "b": (MU_B, rand32(rng, (3, LANES)))}
    refs = {CU0: {1: "a", 2: "b"}}
    hw = run_program(P, tiles, buffers=buffers, regs=refs, cus=[CU0], stall=stall, seed=3)
    res, mus, names = _interpret(tiles, buffers, refs)
    h, s = hw.cu(*CU0), res.cu(*CU0)
    assert (h.error, h.code_name, h.pc, h.regs) == (s.error, s.code_name, s.pc, s.regs)
    np.testing.assert_array_equal(h.local, s.local)
    for xy in P.tiles("M"):
        assert set(hw.mus[xy]) == set(mus[xy]), xy
        for ref, words in mus[xy].items():
            np.testing.assert_array_equal(hw.mus[xy][ref], words)


def test_a_return_follows_the_streams_reads_not_its_end():
    # A 32-step SUM stream reads buffer a (8 reads outstanding: its last read leaves about 8
    # steps before its end). RETI of a may leave once every read has been issued, so of the 16
    # ALU instructions after it some retire while the stream still steps (the profile counts
    # them as step cycles, not instr): fewer than 16 instr cycles more than without them. Had
    # RETI waited for the stream's end, all 16 would retire after it.
    def program(k):
        alus = "\n".join(["ALUI ADD, r5, r5, 1"] * k)
        return assemble(f"""
            SCFG A_REF, r1
            {cfg(A_STRIDE=1, N=32, D_MODE=DMode.SUM)}
            SRUN ADD, r4
            RETI r1, 1
            {alus}
            HALT
        """)

    async def body(ctx, drv):
        instr = {}
        for k in (0, 16, 0, 16):      # the first run warms the network up
            a = await drv.load_buffer(ctx, MU_A, np.arange(32 * LANES).reshape(-1, LANES))
            await drv.configure(ctx, CU0, TileConfig(program=program(k), regs={1: a}))
            await drv.run(ctx)
            r = await drv.cu_result(ctx, CU0, read_local=False)
            assert not r.status & 2 and r.regs[4] == sum(range(32 * LANES)) and r.regs[5] == k
            instr[k] = r.counters["instr_cycles"]
            assert await drv.mu_buffers(ctx, MU_A) == {}      # RETI freed it
        return instr

    instr = run_session(P, body, cus=[CU0])
    assert 0 < instr[16] - instr[0] < 16, instr
