"""The compute unit's sequencer alone in Amaranth's simulator: programs loaded over its
configuration port, run from ``start`` to HALT, their registers, STATUS and cycle counts checked
against what the ISA says; the testbench plays the stream engine (``stream_done``) and the
network (tokens on ``msg_in``, messages taken from ``msg_out``).
"""

from conftest import run_checked, s32

from rdakit.hdl.compute.sequencer import Sequencer
from rdakit.hdl.spec.config import CU_MAP, decode_cu_status
from rdakit.hdl.spec.isa import DMode, assemble, encode
from rdakit.hdl.spec.packets import MsgKind
from rdakit.hdl.spec.params import CUParams, FabricParams, MUParams

LANES = 4
MU_P = MUParams(words=256, block_words=16, max_buffers=4, max_buffer_words=128, buf_id_bits=4,
                weight_bits=4, mu_id_bits=2, index_bits=8, data_bits=32 * LANES, tag_bits=4,
                coord_bits=1)
P = FabricParams(rows=2, cols=2, mu=MU_P, cu=CUParams(
    lanes=LANES, prog_len=128, regs=8, local_words=16, outstanding=8, channels=4, mailbox=2))
CU1_ID = P.mu_id(1, 1)


async def cfg_write(ctx, dut, addr, value):
    """Write one word of ``dut``'s configuration space (one cycle)."""
    ctx.set(dut.cfg.sel, 1)
    ctx.set(dut.cfg.we, 1)
    ctx.set(dut.cfg.addr, addr)
    ctx.set(dut.cfg.wdata, value & 0xffff_ffff)
    await ctx.tick()
    ctx.set(dut.cfg.we, 0)


async def cfg_read(ctx, dut, addr):
    """Read one word of ``dut``'s configuration space (one cycle)."""
    ctx.set(dut.cfg.sel, 1)
    ctx.set(dut.cfg.re, 1)
    ctx.set(dut.cfg.addr, addr)
    await ctx.tick()
    ctx.set(dut.cfg.re, 0)
    return ctx.get(dut.cfg.rdata)


def run(text, *, regs=None, on_cycle=None, limit=500):
    """Load ``text`` and the initial ``regs`` into a fresh sequencer at (0, 0), start it and run
    until ``done``; ``on_cycle(ctx, dut, cycle)`` drives the other inputs each cycle. Returns
    ``(registers (signed), STATUS fields, cycles from start to done)``."""
    dut = Sequencer(P, x=0, y=0)
    out = {}

    def write(ctx, addr, value):
        return cfg_write(ctx, dut, addr, value)

    def read(ctx, addr):
        return cfg_read(ctx, dut, addr)

    async def tb(ctx):
        for pc, word in enumerate(map(encode, assemble(text))):
            await write(ctx, CU_MAP.PROGRAM + 2 * pc, word & 0xffff_ffff)
            await write(ctx, CU_MAP.PROGRAM + 2 * pc + 1, word >> 32)
        for r, value in (regs or {}).items():
            await write(ctx, CU_MAP.REGS + r, value)
        await write(ctx, CU_MAP.CONTROL, 1)
        ctx.set(dut.msg_out.ready, 1)
        ctx.set(dut.start, 1)
        await ctx.tick()
        ctx.set(dut.start, 0)
        for cycle in range(limit):
            if on_cycle is not None:
                on_cycle(ctx, dut, cycle)
            if ctx.get(dut.done):
                out["cycles"] = cycle
                break
            await ctx.tick()
        else:
            raise AssertionError(f"The program must halt in {limit} cycles, but it did not")
        out["regs"] = [s32(await read(ctx, CU_MAP.REGS + r)) for r in range(P.cu.regs)]
        out["status"] = decode_cu_status(await read(ctx, CU_MAP.STATUS))

    run_checked(dut, tb)
    return out["regs"], out["status"], out["cycles"]


def test_registers_and_branches_one_cycle_each():
    """Taken and untaken branches, LOOP, ALU and ALUI: the registers as the ISA says, one cycle
    an instruction (HALT included), STATUS pc at the HALT."""
    regs, status, cycles = run("""
            LI r1, 5
            LI r2, 0
        loop: ALU ADD, r2, r2, r1     # r2 = 5 + 4 + 3 + 2 + 1
            LOOP r1, loop
            LI r3, 7
            BLT r3, r2, big           # 7 < 15: taken
            LI r4, 111
            HALT
        big: ALUI MUL, r4, r3, -3
            BNZ r1, 0                 # r1 is 0: not taken
            BZ r1, done               # taken
            LI r5, 1
        done: SELF r6
            HALT
    """, regs={5: 42, 7: -9})
    assert regs == [0, 0, 15, 7, -21, 42, 0, -9]
    assert status == {"done": 1, "error": 0, "error_code": 0, "pc": 13}
    assert cycles == 2 + 2 * 5 + 2 + 3 + 2


def test_pc_out_of_range_and_bad_instruction_halt_with_their_codes():
    _, status, _ = run("LI r1, 1\nJMP 127\n")
    assert (status["error"], status["error_code"], status["pc"]) == (1, 3, 128)
    _, status, _ = run("NOP\nSEND 4, r0, 1\nHALT")
    assert (status["error"], status["error_code"], status["pc"]) == (1, 2, 1)


def test_srun_retires_at_once_and_its_reduction_is_scoreboarded():
    """SRUN hands the fields to the stream engine and retires at once: the instructions after it
    run while the stream does (SCFG included, without changing the running stream's fields),
    one naming a register of the reduction waits until ``stream_done`` writes it (ARGMAX: the
    value to rd, the index to rd + 1), and HALT waits for the stream."""
    seen = {"retired": [], "done": None}

    def engine(ctx, dut, cycle):
        if ctx.get(dut.stream_start):
            seen["start"] = cycle
            seen["fields"] = ctx.get(dut.fields)
            seen["fn"] = ctx.get(dut.fn)
        if ctx.get(dut.retire):
            seen["retired"].append(cycle)
        # The engine: busy from the cycle after the handover until done, ten cycles later.
        start = seen.get("start")
        busy = start is not None and start < cycle <= start + 10
        done = busy and cycle == start + 10
        if done:
            seen["done"] = cycle
        ctx.set(dut.stream_busy, busy)
        ctx.set(dut.stream_done, done)
        ctx.set(dut.stream_acc, 0xffff_fff0)
        ctx.set(dut.stream_index, 77)

    regs, status, cycles = run(f"""
        SCFGI N, 3
        SCFGI OUTER, 2
        SCFGI A_REF, 1
        SCFGI D_MODE, {DMode.ARGMAX.value}
        SRUN MAX, r2
        LI r5, 9
        SCFGI N, 7
        ALUI ADD, r6, r3, 1
        HALT
    """, on_cycle=engine)
    f = seen["fields"]
    assert (f.n, f.outer, f.a_ref, f.d_mode) == (3, 2, 1, DMode.ARGMAX.value)
    assert seen["start"] == 4
    start, done = seen["start"], seen["done"]
    assert done == start + 10
    # SRUN, LI and SCFGI retire in consecutive cycles; ALUI only after the index is written.
    assert seen["retired"][4:7] == [start, start + 1, start + 2]
    assert seen["retired"][7] == done + 1
    assert (regs[2], regs[3], regs[5], regs[6]) == (-16, 77, 9, 78)
    assert status["error"] == 0
    assert cycles == done + 3


def test_wait_counts_tokens_and_send_leaves_a_message():
    """WAIT stalls until two tokens arrive on channel 1; SEND puts a token message for CU
    (1, 1) on ``msg_out``; HALT retires once the message has left."""
    sent = []

    def network(ctx, dut, cycle):
        token = cycle in (5, 9)
        ctx.set(dut.msg_in.valid, token)
        ctx.set(dut.msg_in.payload, {"payload": {"kind": MsgKind.TOKEN,
                                                 "body": {"tag": 1, "data": 1}}})
        if ctx.get(dut.msg_out.valid):
            sent.append(ctx.get(dut.msg_out.payload))

    regs, status, cycles = run(f"""
        WAIT 1, 2
        LI r1, {CU1_ID}
        SEND 3, r1, 6
        HALT
    """, on_cycle=network)
    assert status["error"] == 0
    # WAIT retires in cycle 10 (the second token counted), LI and SEND take one cycle each;
    # HALT waits one cycle for the message register to empty, then done rises.
    assert cycles == 10 + 2 + 1 + 2
    assert len(sent) == 1
    msg = sent[0]
    assert (msg.dst.x, msg.dst.y, msg.payload.kind) == (1, 1, MsgKind.TOKEN)
    assert (msg.payload.body.tag, msg.payload.body.data) == (3, 6)
    assert regs[1] == CU1_ID


def test_a_new_load_forgets_the_last_jobs_initial_registers():
    """A load begins by disabling every CU (CONTROL = 0); the initial registers of the job before
    must not survive into a bitstream that sets none (the reader and the interpreter start it
    from zeros)."""
    dut = Sequencer(P, x=0, y=0)
    seen = {}

    def write(ctx, addr, value):
        return cfg_write(ctx, dut, addr, value)

    async def start_and_read(ctx):
        ctx.set(dut.start, 1)
        await ctx.tick()
        ctx.set(dut.start, 0)
        for _ in range(20):
            if ctx.get(dut.done):
                break
            await ctx.tick()
        return await cfg_read(ctx, dut, CU_MAP.REGS + 5)

    async def tb(ctx):
        halt = encode(assemble("HALT")[0])
        for job in ("first", "second"):
            await write(ctx, CU_MAP.CONTROL, 0)               # the load begins
            await write(ctx, CU_MAP.PROGRAM, halt & 0xffff_ffff)
            await write(ctx, CU_MAP.PROGRAM + 1, halt >> 32)
            if job == "first":
                await write(ctx, CU_MAP.REGS + 5, 42)
            await write(ctx, CU_MAP.CONTROL, 1)
            seen[job] = await start_and_read(ctx)

    run_checked(dut, tb)
    assert seen == {"first": 42, "second": 0}
