# amaranth: UnusedElaboratable=no
"""The compute unit in Amaranth's simulator, wired straight to memory units
(:mod:`rdakit.sim.verify.cu_harness`): parameters, Verilog, every instruction and ALU function,
streams bit-exact against numpy, tokens and references between CUs, error halts, the configuration
space, stream throughput, and equivalence with the functional interpreter on generated programs.

Most tests run one CU at (0, 0) of a 2x2 checkerboard (MUs at (1, 0) and (0, 1), a second CU at
(1, 1)) with 4 lanes, 8 registers and a 16-word local buffer.
"""

import numpy as np
import pytest
from conftest import rand32, relu_shift, s32, wrap32

from rdakit.hdl.compute.unit import ComputeUnit
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.config import CU_MAP, CU_PROFILE, CU_STATUS_BITS, TILE_COUNTERS
from rdakit.hdl.spec.isa import AluFn, BMode, DMode, Instr, Op, alu, assemble, encode
from rdakit.hdl.spec.params import CUParams, FabricParams, MUParams
from rdakit.sim.verify.cu_harness import CUHarness, run_program, run_session
from rdakit.sim.verify.runner import generate_verilog

LANES = 4
MU_P = MUParams(words=256, block_words=16, max_buffers=4, max_buffer_words=128, buf_id_bits=4,
                weight_bits=4, mu_id_bits=2, index_bits=8, data_bits=32 * LANES, tag_bits=4,
                coord_bits=1)
P = FabricParams(rows=2, cols=2, mu=MU_P, cu=CUParams(
    lanes=LANES, prog_len=128, regs=8, local_words=16, outstanding=8, channels=4, mailbox=2))
CU0, CU1 = (0, 0), (1, 1)
MU_A, MU_B = (1, 0), (0, 1)
MU_A_ID, MU_B_ID = P.mu_id(*MU_A), P.mu_id(*MU_B)
CU1_ID = P.mu_id(*CU1)
CODE = CU_STATUS_BITS


def cfg(**fields):
    """SCFGI lines for stream fields given by name."""
    return "\n".join(f"SCFGI {name}, {int(getattr(v, 'value', v))}" for name, v in fields.items())


def run_one(text, *, regs=None, local=None, buffers=None, refs=None, params=P, **kw):
    """Run assembly ``text`` on the CU at (0, 0); ``buffers`` are loaded first and ``refs``
    ({register: buffer name}) put their references in registers."""
    tile = TileConfig(program=assemble(text), regs=dict(regs or {}), local=dict(local or {}))
    res = run_program(params, {CU0: tile}, buffers=buffers, regs={CU0: refs or {}}, **kw)
    return res, res.cu(*CU0)


# --- Parameters and Verilog -------------------------------------------------------------------

@pytest.mark.parametrize("args, error, message", [
    ((None, 0, 0), TypeError, r"^fabric_params must be a FabricParams, not None$"),
    ((P, 2, 0), TypeError, r"^x must be an integer from 0 to 1 \(cols = 2\), not 2$"),
    ((P, 0, -1), TypeError, r"^y must be an integer from 0 to 1 \(rows = 2\), not -1$"),
    ((P, True, 0), TypeError, r"^x must be an integer from 0 to 1 \(cols = 2\), not True$"),
    ((P, 1, 0), ValueError, r"^The tile at \(1, 0\) must be a compute unit \(C\), not a memory "
                            r"unit \(M\)$"),
])
def test_init_wrong_param(args, error, message):
    params, x, y = args
    with pytest.raises(error, match=message):
        ComputeUnit(params, x=x, y=y)


def test_local_buffer_must_fit_the_configuration_space():
    with pytest.raises(ValueError, match=r"^local_words must be at most 8192 with 4 lanes \(the "
                                         r"configuration space holds 32768 local elements\), "
                                         r"not 16384$"):
        P.cu.replace(local_words=16384)


def _fabric(lanes, **cu):
    mu = MUParams(words=64, block_words=8, max_buffers=2, buf_id_bits=2, mu_id_bits=2,
                  coord_bits=1, index_bits=6, data_bits=32 * lanes)
    return FabricParams(rows=1, cols=2, layout="CM", mu=mu, cu=CUParams(lanes=lanes, **cu))


#: The other widths simulated (test_other_widths): lanes and CU parameters.
WIDTHS = {
    "lanes1": (1, dict(regs=4, local_words=1, outstanding=2, channels=1, mailbox=1, prog_len=32)),
    "lanes2": (2, dict(regs=16, local_words=2, outstanding=3, prog_len=32)),
}


@pytest.mark.parametrize("params", [
    _fabric(1, prog_len=5, regs=4, local_words=1, outstanding=1, channels=1, mailbox=1),
    _fabric(2, prog_len=4096, regs=16, local_words=2, outstanding=256, channels=16, mailbox=16),
    _fabric(16, regs=16, local_words=4, outstanding=3, channels=3, mailbox=5),
    P,
    *[_fabric(lanes, **cu) for lanes, cu in WIDTHS.values()],
], ids=["lanes1-minimal", "lanes2-maximal", "lanes16", "tested-lanes4", "tested-lanes1",
        "tested-lanes2"])
def test_converts_to_verilog(params):
    # Also the check that no parametrization has a combinational loop.
    text = generate_verilog(ComputeUnit(params, x=0, y=0))
    assert "module top" in text and "always @*" not in text


def test_harness_converts_to_verilog():
    # Two CUs and two MUs closed in a loop: no combinational path from any ready or msg_in
    # back to a valid.
    assert "module top" in generate_verilog(CUHarness(P))


# --- Scalar instructions --------------------------------------------------------------------

PAIRS = [(-7, 2), (0x7fff_ffff, 1), (-1, 31), (-(1 << 31), 33), (12, 0), (-5, -5)]


def test_alu_every_function_scalar():
    # For each operand pair: every function with ALU and with ALUI, the two results of each
    # function in lanes 0 and 1 of a word appended to a buffer.
    rng = np.random.default_rng(0)
    pairs = PAIRS + [tuple(int(v) for v in rand32(rng, 2)) for _ in range(2)]

    def program(b):
        lines = []
        for fn in AluFn:
            lines += [f"ALU {fn.name}, r3, r1, r2", "VSET 0, r3", f"ALUI {fn.name}, r3, r1, {b}",
                      "VSET 1, r3", "VAPPEND r4, r5"]
        return assemble("\n".join(lines + ["HALT"]))

    async def body(ctx, drv):
        out = await drv.load_buffer(ctx, MU_A, np.zeros((0, LANES)))
        for a, b in pairs:
            await drv.configure(ctx, CU0, TileConfig(program=program(b),
                                                     regs={1: a, 2: b, 5: out}))
            await drv.run(ctx)
            status = await drv.cfg_read(ctx, CU0, CU_MAP.STATUS)
            assert status & 3 == 1, hex(status)
        return await drv.read_buffer(ctx, MU_A, out)

    words = run_session(P, body, cus=[CU0])
    assert words.shape == (len(pairs) * 16, LANES)
    for p, (a, b) in enumerate(pairs):
        for fn in AluFn:
            got = words[p * 16 + fn.value].view(np.uint32)
            assert (int(got[0]), int(got[1])) == (alu(fn, a, b),) * 2, (fn, a, b)


@pytest.mark.parametrize("bmode", [BMode.LOCAL, BMode.SCALAR], ids=lambda m: m.name)
def test_alu_every_function_lane_wise(bmode):
    # Two words of A against B, every function, results written to an MU (SHIFT 0, no ReLU).
    rng = np.random.default_rng(bmode.value)
    a = rand32(rng, (2, LANES))
    a[0] = [-7, 0x7fff_ffff, -(1 << 31), 5]
    b = rand32(rng, (2, LANES))
    b[0] = [2, 1, 33, 5]
    scalar = int(rng.integers(-(1 << 31), 1 << 31))
    lines = [f"LI r3, {MU_B_ID}", "ALLOC r2, r3, 1", "SCFG A_REF, r1", "SCFG D_REF, r2",
             cfg(A_STRIDE=1, N=2, B_MODE=bmode, B_VAL=scalar if bmode is BMode.SCALAR else 0,
                 B_STRIDE=1, D_MODE=DMode.WRITE, D_STRIDE=1)]
    for fn in AluFn:
        lines += [f"SCFGI D_BASE, {2 * fn.value}", f"SRUN {fn.name}, r0"]
    res, s = run_one("\n".join(lines + ["HALT"]), buffers={"a": (MU_A, a)}, refs={1: "a"},
                     local={0: b[0].tolist(), 1: b[1].tolist()}, read_local=False)
    assert res.ok, res.errors
    got = res.mus[MU_B][s.regs[2]]
    bb = b if bmode is BMode.LOCAL else np.full_like(a, scalar)
    for fn in AluFn:
        expected = [[s32(alu(fn, int(x), int(y))) for x, y in zip(ra, rb, strict=True)]
                    for ra, rb in zip(a.tolist(), bb.tolist(), strict=True)]
        np.testing.assert_array_equal(got[2 * fn.value:2 * fn.value + 2], expected,
                                      err_msg=fn.name)


def test_branches_and_loop():
    # r6 collects one bit per branch that is not taken.
    res, s = run_one("""
            LI r1, 1
            LI r2, -1
            LI r6, 0
            BNZ r1, t0          # taken
            ALUI OR, r6, r6, 1
        t0: BNZ r0, t1          # not taken
            ALUI OR, r6, r6, 2
        t1: BZ r0, t2           # taken
            ALUI OR, r6, r6, 4
        t2: BZ r1, t3           # not taken
            ALUI OR, r6, r6, 8
        t3: BLT r2, r1, t4      # -1 < 1 signed: taken
            ALUI OR, r6, r6, 16
        t4: BLT r1, r2, t5      # 1 < -1: not taken
            ALUI OR, r6, r6, 32
        t5: JMP t6
            ALUI OR, r6, r6, 64
        t6: LI r3, 4            # LOOP runs its body 4 times
            LI r4, 0
        body: ALUI ADD, r4, r4, 10
            LOOP r3, body
            SELF r5
            LI r7, 7
            VSET 5, r7          # lane 5 mod 4
            LI r15, 9           # r15 is r7 with 8 registers
            HALT
    """, read_local=False, read_mus=False)
    assert s.regs[6] == 2 | 8 | 32
    assert (s.regs[4], s.regs[3], s.regs[5], s.regs[7]) == (40, 0, 0, 9)
    np.testing.assert_array_equal(s.V, [0, 7, 0, 0])
    assert (s.done, s.error, s.code_name, s.pc) == (True, False, "NONE", 25)
    # One cycle an instruction, taken branches included: 27 retired, then the HALT.
    assert s.counters["busy_cycles"] == 27 + 1
    assert s.counters["stall_cycles"] == 0


# --- MU instructions ------------------------------------------------------------------------

MU_PROGRAM = """
    ALLOC r2, r1, 2          # r2 = a buffer of total weight 2
    LI r7, 11
    VSET 0, r7
    LI r7, -12
    VSET 1, r7
    VAPPEND r3, r2           # word 0 = [11, -12, 0, 0]; r3 = 0
    LI r7, 13
    VSET 2, r7
    VAPPEND r4, r2           # word 1 = [11, -12, 13, 0]; r4 = 1
    LI r5, 5
    VWRITE r2, r5            # word 5; words 2..4 never written
    LEN r6, r2               # 6
    LI r7, 1
    READ 2, r5, r2, r7       # lane 2 of word 1 = 13
    READ 5, r7, r2, r0       # lane 1 of word 0 = -12
    VCLR
    LI r3, 1
    VREAD r2, r3             # V = word 1
    ADDW r2, 1               # total 3
    RETI r2, 1
    LI r3, 1
    RET r2, r3               # 1 of 3 still outstanding
    LI r3, 0
"""


def test_mu_instructions():
    res, s = run_one(MU_PROGRAM + "HALT", regs={1: MU_A_ID}, read_local=False)
    assert res.ok, res.errors
    ref = s.regs[2]
    assert ref == MU_A_ID        # {mu: 1, buf: 0} (slot 0, generation 0)
    assert (s.regs[4], s.regs[5], s.regs[6], s32(s.regs[7])) == (1, 13, 6, -12)
    np.testing.assert_array_equal(s.V, [11, -12, 13, 0])
    np.testing.assert_array_equal(res.mus[MU_A][ref], [
        [11, -12, 0, 0], [11, -12, 13, 0], [0] * 4, [0] * 4, [0] * 4, [11, -12, 13, 0]])
    # Still live with weight 1 outstanding: RETI 1 frees it.
    res, s = run_one(MU_PROGRAM + "RETI r2, 1\nHALT", regs={1: MU_A_ID}, read_local=False)
    assert res.ok and res.mus[MU_A] == {}
    assert s.counters["flits_out"] == s.counters["flits_in"] == 12


def test_counter_mode_incref_decref():
    params = P.replace(mu=MU_P.replace(refcount="counter"))
    res, s = run_one("""
        ALLOC r2, r1, 1
        INCREF r2
        DECREF r2
        LEN r3, r2          # still live: count 1
        DECREF r2           # count 0: freed
        HALT
    """, regs={1: MU_A_ID}, params=params, read_local=False)
    assert res.ok and res.mus[MU_A] == {}


@pytest.mark.parametrize("text, pc", [
    ("LI r2, 1\nLI r3, 0\nVREAD r2, r3\nHALT", 2),             # slot 0 never allocated: BAD_REF
    ("ALLOC r2, r1, 1\nLI r3, 0\nREAD 0, r4, r2, r3\nHALT", 2),  # READ past the length
    ("ALLOC r2, r1, 0\nHALT", 0),                                # zero weight: BAD_REQUEST
    ("ALLOC r2, r1, 1\nRETI r2, 2\nHALT", 2),                    # more than outstanding
    # ^ RETI is posted: its refusal comes back while HALT waits for it (the pc reached)
    ("ALLOC r2, r1, 1\nRETI r2, 1\nLEN r3, r2\nHALT", 2),        # stale after the free
    ("ALLOC r2, r1, 1\nINCREF r2\nHALT", 1),                     # counter op in weighted mode
    ("ALLOC r2, r1, 1\nVAPPEND r3, r2\nLI r3, 0\nLI r5, 1\nUNLOCK r5, r2, r3\nHALT", 4),
    # ^ UNLOCK with ticket 1 while ticket 0 is served: NOT_OWNER
    ("ALLOC r2, r1, 1\nLI r3, 0\nFADD r5, r2, r3, 1\nHALT", 2),  # FADD past the length
])
def test_mu_error_halts(text, pc):
    _, s = run_one(text, regs={1: MU_A_ID, 4: 77}, read_local=False, read_mus=False)
    assert (s.done, s.error, s.code_name, s.pc) == (True, True, "MU_ERROR", pc)
    assert s.status == 1 | 2 | CODE["MU_ERROR"] << 8 | pc << 16
    assert s.regs[4] == 77                     # the destination is not written


_ONE_WORD = "ALLOC r2, r1, 1\nVCLR\nVAPPEND r3, r2\n"      # r2: a one-word buffer in MU A


@pytest.mark.parametrize("text, pc, sent", [
    (f"LI r4, {CU1_ID}\nLEN r5, r4\nHALT", 1, 0),                  # a CU is not an MU
    ("ALLOC r2, r0, 1\nHALT", 0, 0),                                 # tile (0, 0) is a CU
    (f"LI r4, {MU_A_ID}\nSEND 0, r4, 1\nHALT", 1, 0),               # a token to an MU
    (f"LI r4, {MU_B_ID}\nLI r5, 1\nSENDREF 0, r4, r1, r5\nHALT", 2, 0),  # a reference to one
    (f"SCFGI A_REF, {CU1_ID}\n{cfg(N=1, OUTER=1, D_MODE=DMode.LOCAL)}\nSRUN PASS, r0\nHALT",
     4, 0),                                                           # a stream from a CU
    (f"{_ONE_WORD}SCFG A_REF, r2\nSCFGI D_REF, {CU1_ID}\n"
     f"{cfg(N=1, OUTER=1, D_MODE=DMode.APPEND)}\nSRUN PASS, r0\nHALT", 8, 2),  # ... to a CU
])
def test_a_wrong_destination_halts_before_sending(text, pc, sent):
    """A request to a tile that is not an MU, or a message to one that is not a CU, halts the
    CU with BAD_DESTINATION before anything is sent (else the fabric would drop the flit as
    misrouted and the CU would wait forever), as the interpreter does."""
    tiles = {CU0: TileConfig(program=assemble(text), regs={1: MU_A_ID})}
    hw = run_program(P, tiles, cus=[CU0], read_local=False, read_mus=False, max_cycles=2000)
    s = hw.cu(*CU0)
    assert (s.done, s.error, s.code_name, s.pc) == (True, True, "BAD_DESTINATION", pc)
    assert s.counters["flits_out"] == sent          # only the buffer's ALLOC and APPEND
    res, _, _ = _interpret(tiles, {}, {})
    m = res.cu(*CU0)
    assert (m.code_name, m.pc, m.requests + m.tokens_sent + m.refs_sent) == (
        "BAD_DESTINATION", pc, sent)


def test_a_stream_to_local_ignores_d_ref():
    """D_REF is only a destination in the WRITE, APPEND and PACK_SUM modes."""
    text = (f"{_ONE_WORD}SCFG A_REF, r2\nSCFGI D_REF, {CU1_ID}\n"
            f"{cfg(N=1, OUTER=1, D_MODE=DMode.LOCAL)}\nSRUN PASS, r0\nHALT")
    _, s = run_one(text, regs={1: MU_A_ID}, read_mus=False)
    assert (s.done, s.error) == (True, False)


def test_fetch_add_and_unlock():
    res, s = run_one("""
        ALLOC r2, r1, 1
        VCLR
        VAPPEND r3, r2      # word 0: next ticket
        VAPPEND r3, r2      # word 1: ticket served
        LI r0, 0
        LI r6, 1
        FADD r4, r2, r0, 1  # r4 = ticket 0
        FADD r5, r2, r0, 1  # r5 = ticket 1
        UNLOCK r4, r2, r6   # serve ticket 1
        READ 0, r7, r2, r6
        FADD r3, r2, r0, -1 # r3 = 2; word 0 = 1
        FADD r0, r2, r6, -3 # r0 = 1; word 1 = -2 (borrowing into every lane)
        HALT
    """, regs={1: MU_A_ID}, read_local=False)
    assert res.ok, res.errors
    assert [s.regs[i] for i in (4, 5, 7, 3, 0)] == [0, 1, 1, 2, 1]
    ref = s.regs[2]
    np.testing.assert_array_equal(res.mus[MU_A][ref], [[1, 0, 0, 0], [-2, -1, -1, -1]])


LOCKED_INCREMENT = """
        LI r6, 0            # word 0: next ticket
        LI r5, 1            # word 1: ticket served
        LI r4, 2            # word 2: the shared counter
        LI r7, {n}
    loop:
        FADD r2, r1, r6, 1  # take a ticket
    spin:
        READ 0, r3, r1, r5
        ALU SEQ, r3, r3, r2
        BZ r3, spin         # until it is served
        READ 0, r3, r1, r4  # a plain read-modify-write of the counter, under the lock
        ALUI ADD, r3, r3, 1
        VCLR
        VSET 0, r3
        VWRITE r1, r4
        SELF r3
        VCLR
        VSET 0, r3
        VAPPEND r3, r0      # log who held the lock
        UNLOCK r2, r1, r5
        LOOP r7, loop
        HALT
"""


@pytest.mark.parametrize("stall", [0.0, 0.3])
def test_ticket_lock_mutual_exclusion_and_fairness(stall):
    n = 6
    tile = TileConfig(program=assemble(LOCKED_INCREMENT.format(n=n)))
    res = run_program(P, {CU0: tile, CU1: tile},
                      buffers={"lock": (MU_A, np.zeros((3, LANES), np.int32)),
                               "log": (MU_B, np.zeros((0, LANES), np.int32))},
                      regs={CU0: {1: "lock", 0: "log"}, CU1: {1: "lock", 0: "log"}},
                      read_local=False, stall=stall, seed=5)
    assert res.ok, res.errors
    lock = next(iter(res.mus[MU_A].values()))
    assert lock[2][0] == 2 * n                     # no increment lost
    assert lock[0][0] == lock[1][0] == 2 * n       # every ticket taken was served
    log = [row[0] for row in next(iter(res.mus[MU_B].values()))]
    assert sorted(log) == sorted([P.mu_id(*CU0)] * n + [P.mu_id(*CU1)] * n)
    # FIFO: while both wait, the lock alternates between them.
    middle = log[1:-1]
    assert all(a != b for a, b in zip(middle, middle[1:], strict=False)), log


def test_without_the_lock_increments_are_lost():
    # The same read-modify-write without the lock: both CUs read the same old value.
    text = "LI r4, 2\nLI r7, 6\nloop: READ 0, r3, r1, r4\nALUI ADD, r3, r3, 1\nVCLR\n" \
           "VSET 0, r3\nVWRITE r1, r4\nLOOP r7, loop\nHALT"
    tile = TileConfig(program=assemble(text))
    res = run_program(P, {CU0: tile, CU1: tile},
                      buffers={"lock": (MU_A, np.zeros((3, LANES), np.int32))},
                      regs={CU0: {1: "lock"}, CU1: {1: "lock"}}, read_local=False)
    assert res.ok, res.errors
    assert next(iter(res.mus[MU_A].values()))[2][0] < 12


def test_stream_read_error_halts_in_order():
    # Word 2 of a 2-word buffer: the third step fails after the first two were appended.
    res, s = run_one(f"""
        ALLOC r3, r1, 1
        SCFG A_REF, r2
        SCFG D_REF, r3
        {cfg(A_STRIDE=1, N=3, D_MODE=DMode.APPEND)}
        SRUN PASS, r0
        HALT
    """, regs={1: MU_B_ID}, buffers={"a": (MU_A, [[1] * LANES, [2] * LANES])}, refs={2: "a"},
        read_local=False)
    assert (s.code_name, s.pc) == ("MU_ERROR", 6)
    np.testing.assert_array_equal(res.mus[MU_B][s.regs[3]], [[1] * LANES, [2] * LANES])


def test_errors_of_the_sequencer():
    # Several programs run one after the other in one simulation (start reloads everything).
    # The first values past the modes there are.
    NO_BMODE, NO_DMODE = (max(m.value for m in e) + 1 for e in (BMode, DMode))
    cases = [
        ([encode(Instr(Op.NOP)), 63, encode(Instr(Op.HALT))], "BAD_INSTRUCTION", 1),
        (assemble("NOP\nSEND 4, r0, 1\nHALT"), "BAD_INSTRUCTION", 1),
        (assemble("WAIT 4, 1\nHALT"), "BAD_INSTRUCTION", 0),
        (assemble("SENDREF 2, r0, r1, r2\nHALT"), "BAD_INSTRUCTION", 0),
        (assemble("RECV 2, r1\nHALT"), "BAD_INSTRUCTION", 0),
        (assemble("JMP 200"), "PC_OUT_OF_RANGE", 200),
        (assemble("JMP 0x10005"), "PC_OUT_OF_RANGE", 5),     # STATUS holds 16 bits of pc
        (assemble("JMP 125\nHALT\nHALT"), "PC_OUT_OF_RANGE", 128),   # runs off the end
        (assemble("SCFGI N, 0\nSRUN ADD, r0"), "BAD_STREAM", 1),
        (assemble("SCFGI N, 1\nSCFGI OUTER, 0\nSRUN ADD, r0"), "BAD_STREAM", 2),
        (assemble(f"SCFGI N, 1\nSCFGI B_MODE, {NO_BMODE}\nSRUN ADD, r0"), "BAD_STREAM", 2),
        (assemble("SCFGI N, 1\nSCFGI B_MODE, -1\nSRUN ADD, r0"), "BAD_STREAM", 2),
        (assemble(f"SCFGI N, 1\nSCFGI D_MODE, {NO_DMODE}\nSRUN ADD, r0"), "BAD_STREAM", 2),
        (assemble("LI r1, 3\nHALT"), "NONE", 1),
    ]

    async def body(ctx, drv):
        out = []
        for program, _, _ in cases:
            await drv.configure(ctx, CU0, TileConfig(program=program))
            await drv.run(ctx)
            out.append(await drv.cfg_read(ctx, CU0, CU_MAP.STATUS))
        return out

    statuses = run_session(P, body, cus=[CU0])
    for status, (_, name, pc) in zip(statuses, cases, strict=True):
        error = name != "NONE"
        assert status == 1 | error << 1 | CODE[name] << 8 | pc << 16, (name, hex(status))


# --- Streams --------------------------------------------------------------------------------

@pytest.mark.parametrize("dmode", [DMode.WRITE, DMode.APPEND], ids=lambda m: m.name)
@pytest.mark.parametrize("shift, post", [(0, 0), (3, 1), (24, 2), (24, 3)])
def test_elementwise_to_an_mu(dmode, shift, post):
    # out = post((a reversed * b) >> shift): a read backwards, b from the local buffer, out
    # written from word 2 with stride 2 (WRITE) or appended.
    rng = np.random.default_rng(shift)
    a = rand32(rng, (5, LANES))
    b = rand32(rng, (5, LANES))
    res, s = run_one(f"""
        ALLOC r3, r1, 1
        SCFG A_REF, r2
        SCFG D_REF, r3
        {cfg(A_BASE=4, A_STRIDE=-1, N=5, B_MODE=BMode.LOCAL, B_STRIDE=1, D_MODE=dmode,
             D_BASE=2, D_STRIDE=2, SHIFT=shift, POST=post)}
        SRUN MUL, r0
        HALT
    """, regs={1: MU_A_ID}, local={w: b[w].tolist() for w in range(5)},
        buffers={"a": (MU_B, a)}, refs={2: "a"}, read_local=False)
    assert res.ok, res.errors
    got = res.mus[MU_A][s.regs[3]]
    expected = relu_shift(a[::-1] * b, shift, post)
    if dmode is DMode.WRITE:
        np.testing.assert_array_equal(got[2::2], expected)
        assert len(got) == 2 + 2 * 4 + 1
    else:
        np.testing.assert_array_equal(got, expected)


def test_elementwise_add_relu_to_the_local_buffer():
    rng = np.random.default_rng(1)
    a = rand32(rng, (4, LANES))
    res, s = run_one(f"""
        SCFG A_REF, r2
        {cfg(A_STRIDE=1, N=4, B_MODE=BMode.SCALAR, B_VAL=-5, D_MODE=DMode.LOCAL, D_BASE=8,
             D_STRIDE=3, SHIFT=2, POST=1)}
        SRUN SUB, r0
        HALT
    """, buffers={"a": (MU_A, a)}, refs={2: "a"}, read_mus=False)
    assert res.ok
    # Words 8, 11, 14 and 17 mod 16 = 1.
    np.testing.assert_array_equal(s.local[[8, 11, 14, 1]], relu_shift(a + 5, 2, 1))


def test_lget_and_lset_move_one_lane_between_a_register_and_the_local_buffer():
    # LSET writes one element (lane e mod lanes of word e / lanes; the other lanes keep their
    # values); LGET reads one back; element indices r[rb] + imm wrap modulo the buffer. An LGET
    # right after a stream that writes the local buffer waits for it and sees its result.
    rng = np.random.default_rng(3)
    a = rand32(rng, (2, LANES))
    lw = P.cu.local_words
    res, s = run_one(f"""
        LI r3, -77
        LI r4, {5 * LANES}
        LSET r3, r4, {lw * LANES + 2}     # word 5, lane 2 (wrapping)
        LSET r4, r4, {-LANES + 1}         # word 4, lane 1
        LGET r5, r4, 2
        LGET r6, r4, {-LANES + 1}
        SCFG A_REF, r2
        {cfg(A_STRIDE=1, N=2, D_MODE=DMode.LOCAL, D_BASE=9, D_STRIDE=1)}
        SRUN PASS, r0
        LGET r7, r4, {5 * LANES + 3}      # word 10, lane 3: the stream's second result
        HALT
    """, local={5: [11] * LANES}, buffers={"a": (MU_A, a)}, refs={2: "a"}, read_mus=False)
    assert res.ok
    assert (s32(s.regs[5]), s.regs[6], s32(s.regs[7])) == (-77, 5 * LANES, a[1, 3])
    want5 = [11] * LANES
    want5[2] = -77
    np.testing.assert_array_equal(s.local[5], want5)
    assert s.local[4][1] == 5 * LANES and s.local[4][0] == 0


def test_local_acc_with_outer_loop_and_wrapping_local_indices():
    # OUTER 2 x N 3 over 6 words; B from local with an outer stride; results accumulated into
    # local words 14, 15, 0, 1, 2, 3 (indices wrap modulo 16), which start with values.
    rng = np.random.default_rng(2)
    a = rand32(rng, (6, LANES))
    b = rand32(rng, (2, 3, LANES))          # at local 4 + o*5 + i
    init = rand32(rng, (6, LANES))
    dst = [14, 15, 0, 1, 2, 3]
    local = {4 + o * 5 + i: b[o, i].tolist() for o in range(2) for i in range(3)}
    local.update({w: init[j].tolist() for j, w in enumerate(dst)})
    res, s = run_one(f"""
        SCFG A_REF, r2
        {cfg(A_STRIDE=1, A_OSTRIDE=3, N=3, OUTER=2, B_MODE=BMode.LOCAL, B_VAL=4, B_STRIDE=1,
             B_OSTRIDE=5, D_MODE=DMode.LOCAL_ACC, D_BASE=14, D_STRIDE=1)}
        SRUN MUL, r0
        HALT
    """, local=local, buffers={"a": (MU_A, a)}, refs={2: "a"}, read_mus=False)
    assert res.ok
    np.testing.assert_array_equal(s.local[dst], wrap32(init + wrap32(a * b.reshape(6, LANES))))


def test_local_acc_into_one_word_and_b_reading_the_words_it_writes():
    # D_STRIDE 0: every step adds to the word the previous step wrote (one cycle earlier).
    # Then a stream whose B reads the word its previous step wrote: local[k+1] = a + local[k].
    a = np.arange(5 * LANES).reshape(5, LANES) - 7
    res, s = run_one(f"""
        SCFG A_REF, r2
        {cfg(A_STRIDE=1, N=5, D_MODE=DMode.LOCAL_ACC, D_BASE=4, D_STRIDE=0)}
        SRUN PASS, r0
        {cfg(B_MODE=BMode.LOCAL, B_VAL=8, B_STRIDE=1, D_MODE=DMode.LOCAL, D_BASE=9,
             D_STRIDE=1)}
        SRUN ADD, r0
        HALT
    """, local={4: [100, 0, -100, 1], 8: [1, 2, 3, 4]}, buffers={"a": (MU_A, a)},
        refs={2: "a"}, read_mus=False)
    np.testing.assert_array_equal(s.local[4], a.sum(axis=0) + [100, 0, -100, 1])
    np.testing.assert_array_equal(s.local[9:14], np.cumsum(a, axis=0) + [1, 2, 3, 4])


@pytest.mark.parametrize("words", [1, 7])
def test_sum_dot_product(words):
    rng = np.random.default_rng(words)
    x = rand32(rng, (words, LANES))
    w = rand32(rng, (words, LANES))
    res, s = run_one(f"""
        SCFG A_REF, r2
        {cfg(A_STRIDE=1, N=words, B_MODE=BMode.LOCAL, B_STRIDE=1, D_MODE=DMode.SUM)}
        LI r5, 99
        VSET 0, r5
        SRUN MUL, r5
        HALT
    """, local={i: w[i].tolist() for i in range(words)}, buffers={"x": (MU_A, x)},
        refs={2: "x"}, read_local=False, read_mus=False)
    assert s32(s.regs[5]) == wrap32(wrap32(x * w).astype(np.int64).sum())
    np.testing.assert_array_equal(s.V, [99, 0, 0, 0])       # V untouched


@pytest.mark.parametrize("rows, shift, post", [(1, 0, 0), (6, 4, 1), (9, 0, 0), (6, 20, 2),
                                              (9, 19, 3)])
def test_matrix_vector_product_with_pack_sum(rows, shift, post):
    # y = W x: W is rows x 8 (two words a row), x in local words 0..1; one outer iteration a
    # row, four sums a word of the result. V holds junk first: PACK_SUM starts from 0.
    cols = 2 * LANES
    rng = np.random.default_rng(rows + shift)
    W = rand32(rng, (rows, cols))
    x = rand32(rng, cols)
    res, s = run_one(f"""
        ALLOC r3, r1, 1
        SCFG A_REF, r2
        SCFG D_REF, r3
        {cfg(A_STRIDE=1, A_OSTRIDE=2, N=2, OUTER=rows, B_MODE=BMode.LOCAL, B_STRIDE=1,
             B_OSTRIDE=0, D_MODE=DMode.PACK_SUM, SHIFT=shift, POST=post)}
        LI r5, -1
        VSET 3, r5
        SRUN MUL, r0
        HALT
    """, regs={1: MU_A_ID}, local={0: x[:LANES].tolist(), 1: x[LANES:].tolist()},
        buffers={"W": (MU_B, W.reshape(2 * rows, LANES))}, refs={2: "W"}, read_local=False)
    assert res.ok, res.errors
    y = relu_shift(wrap32((W * x).sum(axis=1)), shift, post)   # SHIFT and POST: each sum
    padded = np.zeros(-(-rows // LANES) * LANES, dtype=np.int32)
    padded[:rows] = y
    np.testing.assert_array_equal(res.mus[MU_A][s.regs[3]], padded.reshape(-1, LANES))
    np.testing.assert_array_equal(s.V, [0] * LANES)


def test_max_and_argmax_take_the_first_of_ties():
    a = np.array([[-9, -3, -8, -3],
                  [-5, -3, -4, -6],
                  [-3, -7, -3, -10]])
    res, s = run_one(f"""
        SCFG A_REF, r2
        {cfg(A_STRIDE=1, N=3, D_MODE=DMode.MAX)}
        SRUN PASS, r4
        {cfg(D_MODE=DMode.ARGMAX)}
        SRUN PASS, r5
        {cfg(A_BASE=1, N=1, A_OSTRIDE=1, OUTER=2)}
        SRUN PASS, r7          # index in r0: r[rd+1] wraps
        {cfg(A_BASE=0, A_STRIDE=1, N=3, OUTER=1, B_MODE=BMode.SCALAR, B_VAL=-(1 << 31))}
        SRUN AND, r2           # every element INT_MIN: the first one, index 0
        HALT
    """, buffers={"a": (MU_A, a)}, refs={2: "a"}, read_local=False, read_mus=False)
    assert s32(s.regs[4]) == -3
    assert (s32(s.regs[5]), s.regs[6]) == (-3, 1)       # word 0, lane 1
    assert (s32(s.regs[7]), s.regs[0]) == (-3, 1)       # from word 1: k = 0, lane 1
    assert (s32(s.regs[2]), s.regs[3]) == (-(1 << 31), 0)


def test_argmax_index_counts_steps_over_outer_iterations():
    a = np.zeros((4, LANES), dtype=np.int64)
    a[2, 0] = 51 << 2           # 51 after SHIFT 2, at k = 2, lane 0
    a[3, 2] = (51 << 2) + 3     # also 51 after the shift: a later tie
    res, s = run_one(f"""
        SCFG A_REF, r2
        {cfg(A_STRIDE=1, A_OSTRIDE=2, N=2, OUTER=2, SHIFT=2, D_MODE=DMode.ARGMAX)}
        SRUN PASS, r4
        HALT
    """, buffers={"a": (MU_A, a)}, refs={2: "a"}, read_local=False, read_mus=False)
    assert (s.regs[4], s.regs[5]) == (51, 2 * LANES + 0)


@pytest.mark.parametrize("lanes, cu", WIDTHS.values(), ids=WIDTHS)
def test_other_widths(lanes, cu):
    # PACK_SUM (rows of W times 3), ARGMAX over W and LOCAL_ACC of W's words into a local
    # buffer of one or two words, on a 1x2 fabric (CU, MU).
    params = _fabric(lanes, **cu)
    rows = 3
    rng = np.random.default_rng(lanes)
    W = rand32(rng, (2 * rows, lanes))
    init = rand32(rng, (cu["local_words"], lanes))
    res = run_program(params, {CU0: TileConfig(program=assemble(f"""
        LI r3, {params.mu_id(1, 0)}
        ALLOC r2, r3, 1
        SCFG A_REF, r1
        SCFG D_REF, r2
        {cfg(A_STRIDE=1, A_OSTRIDE=2, N=2, OUTER=rows, B_MODE=BMode.SCALAR, B_VAL=3,
             D_MODE=DMode.PACK_SUM)}
        SRUN MUL, r0
        {cfg(D_MODE=DMode.ARGMAX, B_MODE=BMode.ZERO)}
        SRUN ADD, r3
        {cfg(D_MODE=DMode.LOCAL_ACC, D_BASE=0, D_STRIDE=1)}
        SRUN PASS, r0
        HALT
    """), local={w: init[w].tolist() for w in range(cu["local_words"])})},
        buffers={"W": ((1, 0), W)}, regs={CU0: {1: "W"}})
    assert res.ok, res.errors
    s = res.cu(*CU0)
    y = wrap32(wrap32(W.reshape(rows, 2 * lanes) * 3).astype(np.int64).sum(axis=1))
    padded = np.zeros(-(-rows // lanes) * lanes, dtype=np.int32)
    padded[:rows] = y
    np.testing.assert_array_equal(res.mus[(1, 0)][s.regs[2]], padded.reshape(-1, lanes))
    flat = W.reshape(-1)
    assert (s32(s.regs[3]), s.regs[4 % cu["regs"]]) == (flat.max(), int(np.argmax(flat)))
    acc = init.copy()
    for k in range(2 * rows):
        acc[k % cu["local_words"]] += W[k]
    np.testing.assert_array_equal(s.local, wrap32(acc))


# --- Throughput -------------------------------------------------------------------------------

def _stream_cycles(n_values, dmode):
    program = assemble(f"""
        SCFG A_REF, r1
        SCFG D_REF, r2
        {cfg(A_STRIDE=1, D_STRIDE=1, D_MODE=dmode)}
        SCFG N, r3
        SRUN ADD, r4
        HALT
    """)

    async def body(ctx, drv):
        a = await drv.load_buffer(ctx, MU_A, np.arange(max(n_values) * LANES).reshape(-1, LANES))
        d = await drv.load_buffer(ctx, MU_B, np.zeros((0, LANES)))
        out = []
        for n in n_values:
            await drv.configure(ctx, CU0, TileConfig(program=program, regs={1: a, 2: d, 3: n}))
            await drv.run(ctx)
            r = await drv.cu_result(ctx, CU0, read_local=False)
            assert r.status == 1 | 7 << 16
            if dmode is DMode.SUM:
                assert r.regs[4] == sum(range(n * LANES))
            out.append(r.counters["busy_cycles"])
        return out

    return run_session(P, body, cus=[CU0])


def test_stream_runs_one_step_a_cycle():
    # A stream reading one MU into SUM: one step a cycle once the first response is back. The
    # constant is the 6 other instructions, the start cycle and the fill: issue (1), MU (2),
    # response FIFO (2), S0, S1 and S2 (3).
    short, long = _stream_cycles([16, 48], DMode.SUM)
    assert long - short == 32
    assert long <= 48 + 40, long


def test_stream_writing_an_mu_runs_two_cycles_a_step():
    short, long = _stream_cycles([16, 48], DMode.WRITE)
    assert 2 * 32 <= long - short <= 2 * 32 + 4


def test_instructions_after_srun_overlap_the_stream():
    # SRUN retires when the engine takes the stream: eight SCFGs configuring the next stream and
    # a loop counter run beside a 16-step stream and cost no cycle; an ALUI reading the SUM's
    # register waits for the stream and sees its result; the next SRUN runs with the new fields
    # (the running stream's were taken when it started).
    def program(k):
        fill = "\n".join(["SCFGI B_VAL, 0"] * k)
        return assemble(f"""
            SCFG A_REF, r1
            {cfg(A_STRIDE=1, N=16, D_MODE=DMode.SUM)}
            SRUN ADD, r4
            {fill}
            SCFGI N, 2
            ALUI ADD, r5, r4, 1
            SRUN ADD, r6
            HALT
        """)

    async def body(ctx, drv):
        a = await drv.load_buffer(ctx, MU_A, np.arange(16 * LANES).reshape(-1, LANES))
        busy = {}
        for k in (0, 8, 0, 8):          # the first run of a session warms the network up
            await drv.configure(ctx, CU0, TileConfig(program=program(k), regs={1: a}))
            await drv.run(ctx)
            r = await drv.cu_result(ctx, CU0, read_local=False)
            assert not r.status & 2
            assert r.regs[4] == sum(range(16 * LANES))
            assert r.regs[5] == r.regs[4] + 1
            assert r.regs[6] == sum(range(2 * LANES))
            busy[k] = r.counters["busy_cycles"]
        return busy

    busy = run_session(P, body, cus=[CU0])
    assert busy[8] == busy[0], busy


def _write_then(k_alus):
    """Busy cycles of a 16-step stream written to an MU, then ``k_alus`` ALU instructions,
    then HALT; and the words the MU holds when the CU is done."""
    alus = "\n".join(["ALUI ADD, r5, r5, 1"] * k_alus)
    program = assemble(f"""
        SCFG A_REF, r1
        SCFG D_REF, r2
        {cfg(A_STRIDE=1, D_STRIDE=1, D_MODE=DMode.WRITE, N=16)}
        SRUN ADD, r4
        {alus}
        HALT
    """)

    async def body(ctx, drv):
        a = await drv.load_buffer(ctx, MU_A, np.arange(16 * LANES).reshape(-1, LANES))
        d = await drv.load_buffer(ctx, MU_B, np.zeros((16, LANES)))
        await drv.configure(ctx, CU0, TileConfig(program=program, regs={1: a, 2: d}))
        await drv.run(ctx)
        r = await drv.cu_result(ctx, CU0, read_local=False)
        assert r.status == 1 | (7 + k_alus) << 16 and r.regs[5] == k_alus   # HALT, no error
        return r.counters["busy_cycles"], await drv.read_buffer(ctx, MU_B, d)

    return run_session(P, body, cus=[CU0])


def test_stream_writes_are_posted_and_halt_waits_for_them():
    # SRUN retires once its writes are issued: the instructions after it run while the
    # acknowledgements come back (the MU's round trip), so six ALU instructions cost less
    # than six cycles; HALT still waits for the last acknowledgement, so every word is in the
    # MU when the CU reports done.
    bare, written = _write_then(0)
    six, _ = _write_then(6)
    assert six - bare < 6, (bare, six)
    np.testing.assert_array_equal(written, np.arange(16 * LANES).reshape(-1, LANES))


def test_alloc_read_and_len_do_not_block():
    # ALLOC, READ and LEN retire once their request leaves; four ALU instructions that do not
    # name the result register overlap the round trip, an instruction naming it waits and sees
    # the response, and a refused READ halts the CU at the READ's pc with MU_ERROR.
    async def body(ctx, drv):
        busy = {}
        a = await drv.load_buffer(ctx, MU_A, np.arange(8 * LANES).reshape(-1, LANES))
        for k in (0, 4, 0, 4):          # the first run of a session warms the network up
            alus = "\n".join(["ALUI ADD, r5, r5, 1"] * k)
            program = assemble(f"""
                LI r6, 3
                READ 2, r3, r1, r6
                {alus}
                ALUI ADD, r4, r3, 1
                LEN r7, r1
                {alus}
                ALU ADD, r4, r4, r7
                HALT
            """)
            await drv.configure(ctx, CU0, TileConfig(program=program, regs={1: a}))
            await drv.run(ctx)
            r = await drv.cu_result(ctx, CU0, read_local=False)
            assert not r.status & 2 and r.regs[5] == 2 * k
            assert r.regs[4] == 3 * LANES + 2 + 1 + 8
            busy[k] = r.counters["busy_cycles"]
        program = assemble("LI r6, 9\nREAD 0, r3, r1, r6\nALUI ADD, r5, r5, 1\nHALT")
        await drv.configure(ctx, CU0, TileConfig(program=program, regs={1: a, 5: 0}))
        await drv.run(ctx)
        r = await drv.cu_result(ctx, CU0, read_local=False)
        return busy, r

    busy, refused = run_session(P, body, cus=[CU0])
    assert busy[4] - busy[0] < 2 * 4, busy
    assert refused.status & 2 and refused.status >> 16 == 1           # at the READ
    assert (refused.status >> 8) & 0xff == CODE["MU_ERROR"]


def test_returns_are_posted():
    # RETI retires once its request leaves (its response is only a status): four ALU
    # instructions after it overlap the MU's round trip; the buffer is still freed by the time
    # the CU is done (HALT waits for the acknowledgement).
    async def body(ctx, drv):
        busy = {}
        for k in (0, 4, 0, 4):          # the first run of a session warms the network up
            alus = "\n".join(["ALUI ADD, r5, r5, 1"] * k)
            program = assemble(f"ALLOC r2, r1, 1\nRETI r2, 1\n{alus}\nHALT")
            await drv.configure(ctx, CU0, TileConfig(program=program, regs={1: MU_A_ID}))
            await drv.run(ctx)
            r = await drv.cu_result(ctx, CU0, read_local=False)
            assert r.status == 1 | (2 + k) << 16 and r.regs[5] == k
            assert await drv.mu_buffers(ctx, MU_A) == {}
            busy[k] = r.counters["busy_cycles"]
        return busy

    busy = run_session(P, body, cus=[CU0])
    assert busy[4] - busy[0] < 4, busy


def test_profile_counts_every_cycle_once():
    # A writing stream of 8 steps, a SEND to itself right after it (a fence: the writes are
    # posted), a WAIT for that token and a blocking LEN: every running cycle lands in exactly
    # one CU_PROFILE category, and each category sees what the program does.
    me = P.mu_id(*CU0)
    program = assemble(f"""
        SCFG A_REF, r1
        SCFG D_REF, r2
        {cfg(A_STRIDE=1, D_STRIDE=1, D_MODE=DMode.WRITE, N=8)}
        SRUN ADD, r4
        LI r5, {me}
        SEND 0, r5, 1
        WAIT 0, 1
        LEN r6, r2
        HALT
    """)

    async def body(ctx, drv):
        a = await drv.load_buffer(ctx, MU_A, np.arange(8 * LANES).reshape(-1, LANES))
        d = await drv.load_buffer(ctx, MU_B, np.zeros((8, LANES)))
        await drv.configure(ctx, CU0, TileConfig(program=program, regs={1: a, 2: d}))
        await drv.run(ctx)
        return await drv.cu_result(ctx, CU0, read_local=False)

    r = run_session(P, body, cus=[CU0])
    c = r.counters
    assert r.regs[6] == 8 and not r.status & 2
    profile = {n: c[n] for n in CU_PROFILE}
    assert sum(profile.values()) <= c["busy_cycles"]
    assert c["busy_cycles"] - sum(profile.values()) <= 4      # "other": registers busy
    assert c["step_cycles"] == 8
    assert c["fence_cycles"] > 0 and c["mu_cycles"] >= 3 and c["stream_idle_cycles"] > 0
    assert c["instr_cycles"] >= 10                            # SCFG, SRUN, LI, SEND, WAIT, ...


# --- Tokens and references ------------------------------------------------------------------

def test_tokens_ping_pong_between_two_cus():
    me = P.mu_id(*CU0)
    res = run_program(P, {
        CU0: TileConfig(program=assemble(
            f"LI r1, {CU1_ID}\nLI r2, 3\nloop: SEND 1, r1, 2\nWAIT 0, 1\nLOOP r2, loop\n"
            f"ALUI ADD, r3, r3, 1\nHALT")),
        CU1: TileConfig(program=assemble(
            f"LI r1, {me}\nLI r2, 3\nloop: WAIT 1, 2\nSEND 0, r1, 1\nLOOP r2, loop\nHALT")),
    }, read_local=False, read_mus=False)
    assert res.ok, res.errors
    assert res.cu(*CU0).regs[3] == 1 and res.cu(*CU0).counters["flits_out"] == 3
    assert res.cu(*CU1).counters["flits_in"] == 3


@pytest.mark.parametrize("delay", [5, 40])
def test_wait_cycles_count_the_waits_for_another_cu(delay):
    """CU1 waits in WAIT (then RECV) while CU0 loops ``delay`` times before sending: its
    wait_cycles grow with the delay and stay within its stalls; CU0 never waits."""
    res = run_program(P, {
        CU0: TileConfig(program=assemble(
            f"LI r1, {CU1_ID}\nLI r2, {delay}\nloop: LOOP r2, loop\nSEND 0, r1, 1\n"
            f"LI r2, {delay}\nloop2: LOOP r2, loop2\nSENDREF 0, r1, r1, r2\nHALT")),
        CU1: TileConfig(program=assemble("WAIT 0, 1\nRECV 0, r4\nHALT")),
    }, read_local=False, read_mus=False)
    assert res.ok, res.errors
    c0, c1 = res.cu(*CU0).counters, res.cu(*CU1).counters
    assert c0["wait_cycles"] == 0
    assert 2 * delay <= c1["wait_cycles"] <= c1["stall_cycles"] <= c1["busy_cycles"]
    assert c1["wait_cycles"] <= 2 * delay + 20


def test_send_and_sendref_to_itself():
    _, s = run_one("""
        SELF r1
        LI r2, 0x1234
        LI r3, 5
        SEND 3, r1, 4
        WAIT 3, 4
        SENDREF 1, r1, r2, r3
        RECV 1, r7           # r7 = ref, r0 = weight (wraps)
        HALT
    """, read_local=False, read_mus=False)
    assert (s.regs[7], s.regs[0], s.code_name) == (0x1234 & 0x3f, 5, "NONE")


@pytest.mark.parametrize("stall", [0.0, 0.4])
def test_reference_passing_frees_the_buffer_after_both_returns(stall):
    # CU0 fills a buffer of weight 2, gives weight 1 to CU1; both sum it and return their
    # weight: the buffer is freed whoever returns last.
    rng = np.random.default_rng(5)
    x = rand32(rng, (4, LANES))
    w = rand32(rng, (4, LANES))
    producer = f"""
        ALLOC r4, r1, 2
        SCFG A_REF, r7
        SCFG D_REF, r4
        {cfg(A_STRIDE=1, N=4, D_MODE=DMode.APPEND)}
        SRUN PASS, r0
        LI r5, 1
        SENDREF 0, r2, r4, r5
        SCFG A_REF, r4
        {cfg(D_MODE=DMode.SUM)}
        SRUN PASS, r6
        RET r4, r5
        HALT
    """
    consumer = f"""
        RECV 0, r4                 # r4 = reference, r5 = weight
        SCFG A_REF, r4
        {cfg(A_STRIDE=1, N=4, B_MODE=BMode.LOCAL, B_STRIDE=1, D_MODE=DMode.SUM)}
        SRUN MUL, r6
        LEN r7, r4
        RET r4, r5
        HALT
    """
    res = run_program(P, {
        CU0: TileConfig(program=assemble(producer), regs={1: MU_A_ID, 2: CU1_ID}),
        CU1: TileConfig(program=assemble(consumer), local={i: w[i].tolist() for i in range(4)}),
    }, buffers={"x": (MU_B, x)}, regs={CU0: {7: "x"}}, read_local=False, stall=stall)
    assert res.ok, res.errors
    p, c = res.cu(*CU0), res.cu(*CU1)
    assert s32(p.regs[6]) == wrap32(x.sum())
    assert s32(c.regs[6]) == wrap32(wrap32(x * w).astype(np.int64).sum())
    assert (c.regs[4], c.regs[5], c.regs[7]) == (p.regs[4], 1, 4)
    assert res.mus[MU_A] == {}                          # freed
    assert list(res.mus[MU_B]) == [res.refs["x"]]


@pytest.mark.parametrize("stall", [0.0, 0.3])
def test_two_cus_streaming_from_one_mu_at_once(stall):
    rng = np.random.default_rng(6)
    x = rand32(rng, (24, LANES))
    text = f"SCFG A_REF, r1\n{cfg(A_STRIDE=1, N=24, D_MODE=DMode.SUM)}\nSRUN ADD, r2\nHALT"
    tiles = {xy: TileConfig(program=assemble(text)) for xy in (CU0, CU1)}
    res = run_program(P, tiles, buffers={"x": (MU_A, x)}, regs={xy: {1: "x"} for xy in tiles},
                      read_local=False, read_mus=False, stall=stall)
    for xy in tiles:
        assert s32(res.cu(*xy).regs[2]) == wrap32(x.sum())


def test_token_overflow_halts_the_receiver():
    res = run_program(P, {
        CU0: TileConfig(program=assemble(
            f"LI r1, {CU1_ID}\nSEND 0, r1, 65535\nSEND 0, r1, 1\nHALT")),
        CU1: TileConfig(program=assemble("WAIT 1, 1\nHALT")),
    }, read_local=False, read_mus=False)
    assert res.errors == {CU1: "TOKEN_OVERFLOW"} and res.cu(*CU1).pc == 0


def test_mailbox_overflow_halts_the_receiver():
    res = run_program(P, {
        CU0: TileConfig(program=assemble(
            f"LI r1, {CU1_ID}\nLI r3, 1\nSENDREF 1, r1, r2, r3\nSENDREF 1, r1, r2, r3\nHALT")),
        CU1: TileConfig(program=assemble("WAIT 0, 1\nHALT")),
    }, read_local=False, read_mus=False)
    assert res.errors == {CU1: "MAILBOX_OVERFLOW"}


def test_messages_to_a_cu_that_does_not_run_are_dropped():
    # CU1 is disabled when the tokens arrive; enabled for the second run, it starts with none.
    async def body(ctx, drv):
        await drv.configure(ctx, CU0, TileConfig(program=assemble(
            f"LI r1, {CU1_ID}\nSEND 0, r1, 1\nHALT")))
        await drv.configure(ctx, CU1, TileConfig(program=assemble("WAIT 0, 1\nLI r2, 5\nHALT"),
                                                 enabled=False))
        await drv.run(ctx)
        first = await drv.cfg_read(ctx, CU1, CU_MAP.STATUS)
        await drv.configure(ctx, CU0, TileConfig(program=assemble("HALT")))
        await drv.cfg_write(ctx, CU1, CU_MAP.CONTROL, 1)
        ctx.set(drv.h.start, 1)
        await ctx.tick()
        ctx.set(drv.h.start, 0)
        await ctx.tick().repeat(50)
        return first, await drv.cu_result(ctx, CU1, read_local=False)

    first, r = run_session(P, body)
    assert first == 1                     # disabled: done at once
    assert (r.done, r.pc, r.regs[2]) == (False, 0, 0)    # still waiting for its token


# --- Configuration space --------------------------------------------------------------------

def test_configuration_read_back_and_status():
    program = assemble("LI r1, 3\nALUI ADD, r2, r1, 4\nHALT")
    words = [encode(i) for i in program]
    tile = TileConfig(program=program, regs={3: -2, 7: 0x1234_5678},
                      local={2: [1, -2, 3, -4], 15: [5, 6, 7, 8]})

    async def body(ctx, drv):
        before = await drv.cfg_read(ctx, CU0, CU_MAP.STATUS)
        await drv.configure(ctx, CU0, tile)
        prog = await drv.cfg_read(ctx, CU0, list(range(CU_MAP.PROGRAM, CU_MAP.PROGRAM + 6)))
        regs = await drv.cfg_read(ctx, CU0, [CU_MAP.REGS + r for r in range(8)])
        local = await drv.cfg_read(ctx, CU0, [CU_MAP.LOCAL + w * LANES + lane
                                              for w in (2, 15) for lane in range(LANES)])
        control = await drv.cfg_read(ctx, CU0, CU_MAP.CONTROL)
        unmapped = await drv.cfg_read(ctx, CU0, [CU_MAP.REGS + 8, 0x4000, CU_MAP.PROGRAM + 256,
                                                 CU_MAP.LOCAL + 16 * LANES])
        cycles = await drv.run(ctx)
        after = await drv.cu_result(ctx, CU0)
        # A second start reloads the initial registers.
        await drv.cfg_write(ctx, CU0, CU_MAP.REGS + 3, 9)
        await drv.run(ctx)
        again = await drv.cu_result(ctx, CU0)
        return before, prog, regs, local, control, unmapped, cycles, after, again

    before, prog, regs, local, control, unmapped, cycles, after, again = run_session(
        P, body, cus=[CU0])
    assert before == 1                                  # not started: done
    assert prog == [w >> s & 0xffff_ffff for w in words for s in (0, 32)]
    assert regs == [0, 0, 0, 0xffff_fffe, 0, 0, 0, 0x1234_5678]
    assert local == [1, 0xffff_fffe, 3, 0xffff_fffc, 5, 6, 7, 8]
    assert control == 1
    assert unmapped == [0, 0, 0, 0]
    assert after.status == 1 | 2 << 16
    assert after.regs == (0, 3, 7, 0xffff_fffe, 0, 0, 0, 0x1234_5678)
    np.testing.assert_array_equal(after.local[[2, 15]], [[1, -2, 3, -4], [5, 6, 7, 8]])
    # Three instructions, one a cycle: all three running cycles are "instr" in the profile.
    assert after.counters == {"busy_cycles": 3, "stall_cycles": 0, "flits_out": 0,
                              "flits_in": 0, "step_cycles": 0, "wait_cycles": 0,
                              "fence_cycles": 0, "mu_cycles": 0, "stream_idle_cycles": 0,
                              "instr_cycles": 3}
    assert set(after.counters) == set(TILE_COUNTERS) | set(CU_PROFILE) and cycles == 4
    assert again.regs[1:4] == (3, 7, 9)


# --- Equivalence with the functional interpreter --------------------------------------------

#: Faults a generated program may end with (before its HALT), and the code they halt with.
FAULTS = {
    None: "NONE",
    "read": "MU_ERROR",           # READ past the end of r1
    "stream": "MU_ERROR",         # a stream appending r1's words to r2 and reading past its end
    "bad_stream": "BAD_STREAM",
    "bad_op": "BAD_INSTRUCTION",  # opcode 63
    "jump": "PC_OUT_OF_RANGE",
    "queues": "NONE",             # no fault: streams through the CU's own input queue too
}


def random_program(rng, fault=None):
    """A random program: scalar and vector instructions, MU instructions on buffer r1 (8 words,
    in MU A) and r2 (allocated in MU B), loops, self-sent tokens, and streams with random fields
    (A indices kept inside r1, at most 128 words in r2), then one of :data:`FAULTS`. Returns
    the instructions (``Instr`` or words) and their text. With ``fault="queues"`` it also
    sends streams' results to the CU's own input queue (``DMode.QUEUE``, at most
    ``queue_words`` words queued) and runs streams reading it (``A_REF`` = ``SELF``), which end
    at the last word of a producing stream or after N*OUTER steps."""
    lw = P.cu.local_words
    lines = [f"LI r7, {MU_B_ID}", "ALLOC r2, r7, 1"]
    out_len = 0
    labels = 0
    dst = [3, 4, 5, 6]
    queued = []        # the words each producing stream left in the queue, oldest first

    def reg():
        return int(rng.integers(0, 8))

    kinds = ["li", "alu", "alui", "vset", "vclr", "vappend", "vwrite", "read", "vread", "loop",
             "tokens", "stream", "stream", "stream", "lget", "lset"]
    if fault == "queues":
        kinds += ["queue"] * 10
    for _ in range(int(rng.integers(6, 11))):
        kind = rng.choice(kinds)
        d = int(rng.choice(dst))
        if kind == "li":
            lines.append(f"LI r{d}, {int(rand32(rng, ()))}")
        elif kind == "alu":
            lines.append(f"ALU {AluFn(int(rng.integers(16))).name}, r{d}, r{reg()}, r{reg()}")
        elif kind == "alui":
            lines.append(f"ALUI {AluFn(int(rng.integers(16))).name}, r{d}, r{reg()}, "
                         f"{int(rand32(rng, ()))}")
        elif kind == "vset":
            lines.append(f"VSET {int(rng.integers(8))}, r{reg()}")
        elif kind == "lget":
            lines.append(f"LGET r{d}, r{reg()}, {int(rng.integers(-lw * LANES, 2 * lw * LANES))}")
        elif kind == "lset":
            lines.append(f"LSET r{reg()}, r{reg()}, "
                         f"{int(rng.integers(-lw * LANES, 2 * lw * LANES))}")
        elif kind == "vclr":
            lines.append("VCLR")
        elif kind == "vappend" and out_len < 120:
            lines.append(f"VAPPEND r{d}, r2")
            out_len += 1
        elif kind == "vwrite":
            index = int(rng.integers(0, 128))
            lines += [f"LI r6, {index}", "VWRITE r2, r6"]
            out_len = max(out_len, index + 1)
        elif kind == "read":
            lines += [f"LI r6, {int(rng.integers(8))}",
                      f"READ {int(rng.integers(8))}, r{int(rng.choice([3, 4, 5]))}, r1, r6"]
        elif kind == "vread":
            lines += [f"LI r6, {int(rng.integers(8))}", "VREAD r1, r6"]
        elif kind == "loop":
            labels += 1
            lines += [f"LI r6, {int(rng.integers(1, 4))}",
                      f"l{labels}: ALUI {AluFn(int(rng.integers(16))).name}, r3, r3, "
                      f"{int(rng.integers(-9, 9))}", f"LOOP r6, l{labels}"]
        elif kind == "tokens":
            lines += ["SELF r7", f"SEND 2, r7, {int(rng.integers(1, 5))}", "WAIT 2, 1"]
        elif kind == "stream":
            n, outer = int(rng.integers(1, 5)), int(rng.integers(1, 4))
            while True:
                stride, ostride = int(rng.integers(-1, 3)), int(rng.integers(-3, 4))
                idx = [o * ostride + i * stride for o in range(outer) for i in range(n)]
                if max(idx) - min(idx) < 8:
                    break
            base = int(rng.integers(-min(idx), 8 - max(idx)))
            dmode = DMode(int(rng.integers(9)))
            steps = n * outer
            d_base, d_stride = int(rng.integers(0, lw * 2)), int(rng.integers(-2, 3))
            if dmode is DMode.WRITE:
                d_stride = int(rng.integers(0, 3))
                d_base = int(rng.integers(0, 128 - d_stride * (steps - 1)))
                out_len = max(out_len, d_base + d_stride * (steps - 1) + 1)
            added = {DMode.APPEND: steps, DMode.PACK_SUM: -(-outer // LANES)}.get(dmode, 0)
            if out_len + added > 128:
                dmode = DMode.SUM
            else:
                out_len += added
            bmode = BMode(int(rng.integers(3)))
            b_val = int(rand32(rng, ())) if bmode is BMode.SCALAR else int(rng.integers(lw))
            lines += ["SCFG A_REF, r1", "SCFG D_REF, r2", cfg(
                A_BASE=base, A_STRIDE=stride, A_OSTRIDE=ostride, N=n, OUTER=outer,
                B_MODE=bmode, B_VAL=b_val, B_STRIDE=int(rng.integers(-2, 3)),
                B_OSTRIDE=int(rng.integers(-3, 4)), D_MODE=dmode, D_BASE=d_base,
                D_STRIDE=d_stride, SHIFT=int(rng.choice([0, 0, rng.integers(32)])),
                POST=int(rng.integers(4))),
                f"SRUN {AluFn(int(rng.integers(16))).name}, r{d}"]
        elif kind == "queue" and queued and rng.random() < 0.5:
            # Read the queue: up to the first producing stream's last word.
            n, outer = int(rng.integers(1, 5)), int(rng.integers(1, 4))
            if n * outer < queued[0]:
                queued[0] -= n * outer
            else:
                queued.pop(0)
            dmode = rng.choice([DMode.DISCARD, DMode.LOCAL, DMode.LOCAL_ACC, DMode.SUM,
                                DMode.MAX, DMode.ARGMAX])
            bmode = BMode(int(rng.integers(3)))
            b_val = int(rand32(rng, ())) if bmode is BMode.SCALAR else int(rng.integers(lw))
            lines += ["SELF r7", "SCFG A_REF, r7", cfg(
                N=n, OUTER=outer, B_MODE=bmode, B_VAL=b_val, B_STRIDE=int(rng.integers(-2, 3)),
                B_OSTRIDE=int(rng.integers(-3, 4)), D_MODE=dmode,
                D_BASE=int(rng.integers(0, lw * 2)), D_STRIDE=int(rng.integers(-2, 3)),
                SHIFT=int(rng.choice([0, 0, rng.integers(32)])), POST=int(rng.integers(4))),
                f"SRUN {AluFn(int(rng.integers(16))).name}, r{d}"]
        elif kind == "queue" and sum(queued) < P.cu.queue_words:
            # Send r1's words (inside it) to the CU's own queue, as much as it has room for.
            room = P.cu.queue_words - sum(queued)
            n = int(rng.integers(1, min(room, 8) + 1))
            base = int(rng.integers(0, 9 - n))
            queued.append(n)
            lines += ["SELF r7", "SCFG D_REF, r7", "SCFG A_REF, r1", cfg(
                A_BASE=base, A_STRIDE=1, N=n, OUTER=1, B_MODE=BMode.SCALAR,
                B_VAL=int(rand32(rng, ())), D_MODE=DMode.QUEUE, SHIFT=0, POST=0),
                f"SRUN {AluFn(int(rng.integers(16))).name}, r{d}"]
    if fault == "read":
        lines += ["LI r6, 8", "READ 0, r3, r1, r6"]
    elif fault == "stream":
        lines += ["SCFG A_REF, r1", "SCFG D_REF, r2", cfg(
            A_BASE=0, A_STRIDE=1, N=10, OUTER=1, B_MODE=BMode.ZERO,
            D_MODE=DMode.APPEND if out_len <= 120 else DMode.LOCAL, SHIFT=0, POST=0),
            "SRUN PASS, r3"]
    elif fault == "bad_stream":
        lines += ["SCFGI N, 0", "SRUN ADD, r3"]
    elif fault == "jump":
        lines += ["JMP 1000"]
    text = "\n".join(lines + ["HALT"])
    program = assemble(text)
    if fault == "bad_op":
        program.insert(len(program) - 1, 63)
        text += "\n(opcode 63 before the HALT)"
    return program, text


def _interpret(tiles, buffers, refs):
    from rdakit.sim.models.interp import Interpreter

    it = Interpreter(P, FabricConfig(P, tiles))
    names = {name: it.load_buffer(mu, array) for name, (mu, array) in buffers.items()}
    for xy, regs in refs.items():
        for r, name in regs.items():
            it.set_register(xy, r, names[name])
    res = it.run()
    mus = {}
    for xy in P.tiles("M"):
        mus[xy] = {}
        for info in it.mu(*xy).live_buffers().values():
            ref = info["ref"]["mu"] | info["ref"]["buf"] << P.mu.mu_id_bits
            mus[xy][ref] = it.read_buffer(xy, ref)
    return res, mus, names


@pytest.mark.parametrize("stall", [0.0, 0.5])
def test_streams_queued_in_the_engine_keep_program_order(stall):
    # Back-to-back streams: the next is handed over while one runs and its reads go out early
    # only when that is safe. Streams 1 and 2 append to a buffer in MU B (2: one PACK_SUM word at
    # its end); stream 3 reads it, that word first (it must wait for the writes); stream 4 reads
    # MU B too (prefetched); stream 5 reads MU A (its responses must not overtake stream 4's);
    # an ALU instruction reads the ARGMAX registers. Registers, the local buffer and the MUs
    # equal the interpreter's.
    rng = np.random.default_rng(7)
    text = f"""
        LI r7, {MU_B_ID}
        ALLOC r3, r7, 1
        SCFG A_REF, r1
        SCFG D_REF, r3
        {cfg(A_STRIDE=1, N=4, D_MODE=DMode.APPEND)}
        SRUN ADD, r0
        {cfg(OUTER=2, A_OSTRIDE=0, D_MODE=DMode.PACK_SUM)}
        SRUN ADD, r0
        SCFG A_REF, r3
        {cfg(A_BASE=4, A_STRIDE=-1, N=5, OUTER=1, D_MODE=DMode.SUM)}
        SRUN PASS, r4
        SCFG A_REF, r2
        {cfg(A_BASE=0, A_STRIDE=1, N=3, D_MODE=DMode.LOCAL, D_BASE=2, D_STRIDE=1)}
        SRUN XOR, r0
        SCFG A_REF, r1
        {cfg(N=4, OUTER=2, A_OSTRIDE=0, D_MODE=DMode.ARGMAX)}
        SRUN MAX, r5
        ALU ADD, r7, r4, r6
        HALT
    """
    tiles = {CU0: TileConfig(program=assemble(text), regs={})}
    buffers = {"a": (MU_A, rand32(rng, (4, LANES))), "b": (MU_B, rand32(rng, (3, LANES)))}
    refs = {CU0: {1: "a", 2: "b"}}
    hw = run_program(P, tiles, buffers=buffers, regs=refs, cus=[CU0], stall=stall, seed=1)
    res, mus, names = _interpret(tiles, buffers, refs)
    h, s = hw.cu(*CU0), res.cu(*CU0)
    assert not h.error and (h.pc, h.regs) == (s.pc, s.regs)
    a = buffers["a"][1].astype(np.int64)
    assert s32(h.regs[4]) == s32(int(3 * a.sum()) & 0xffff_ffff)
    assert h.regs[7] == (h.regs[4] + h.regs[6]) & 0xffff_ffff
    np.testing.assert_array_equal(h.local, s.local)
    for xy in P.tiles("M"):
        for ref, words in mus[xy].items():
            np.testing.assert_array_equal(hw.mus[xy][ref], words)


@pytest.mark.parametrize("seed, fault, stall", [
    (0, None, 0.0), (1, "stream", 0.0), (2, None, 0.4), (3, "stream", 0.4), (4, "read", 0.0),
    (5, "bad_op", 0.0), (24, "queues", 0.0), (22, "queues", 0.4), (35, "queues", 0.0),
])
def test_random_programs_match_the_interpreter(seed, fault, stall):
    # With stall > 0, random back-pressure on every MU and CU input of the harness. A stream
    # that reads past the end of its buffer halts in order, after the steps before it.
    pytest.importorskip("rdakit.sim.models.interp")
    rng = np.random.default_rng(100 + seed)
    program, text = random_program(rng, fault)
    local = {w: rand32(rng, LANES).tolist() for w in range(P.cu.local_words)}
    regs = {r: int(rand32(rng, ())) for r in (0, 3, 4, 5, 6)}
    tiles = {CU0: TileConfig(program=program, regs=regs, local=local)}
    buffers = {"a": (MU_A, rand32(rng, (8, LANES)))}
    refs = {CU0: {1: "a"}}
    hw = run_program(P, tiles, buffers=buffers, regs=refs, cus=[CU0], stall=stall, seed=seed)
    res, mus, names = _interpret(tiles, buffers, refs)
    assert hw.refs == names
    h, s = hw.cu(*CU0), res.cu(*CU0)
    where = f"program:\n{text}"
    assert (h.done, h.error, h.code_name, h.pc) == (s.done, s.error, s.code_name, s.pc), where
    assert h.code_name == FAULTS[fault], where
    assert h.regs == s.regs, where
    np.testing.assert_array_equal(h.V, s.V, err_msg=where)
    np.testing.assert_array_equal(h.local, s.local, err_msg=where)
    for xy in P.tiles("M"):
        assert sorted(hw.mus[xy]) == sorted(mus[xy]), where
        for ref, words in mus[xy].items():
            np.testing.assert_array_equal(hw.mus[xy][ref], words, err_msg=where)
