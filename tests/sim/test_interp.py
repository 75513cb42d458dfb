"""The functional interpreter, checked against docs/compute-unit.md.

Programs are written in assembly. Most tests run one CU at (0, 0) of the default 2x2
checkerboard (CUs at (0, 0) and (1, 1), MUs at (1, 0) and (0, 1), 4 lanes); stream results are
compared bit for bit with numpy int32 arithmetic.
"""

import numpy as np
import pytest
from conftest import rand32, relu_shift, s32, wrap32

from rdakit.hdl.spec.bitstream import (
    BitstreamError,
    FabricConfig,
    TileConfig,
    read_bitstream,
    write_bitstream,
)
from rdakit.hdl.spec.config import CU_STATUS_BITS
from rdakit.hdl.spec.isa import AluFn, BMode, DMode, Instr, Op, alu, assemble, encode
from rdakit.hdl.spec.packets import MUOp, MUStatus
from rdakit.hdl.spec.params import CUParams, FabricParams
from rdakit.sim.models.interp import (
    DeadlockError,
    HostError,
    Interpreter,
    InterpreterError,
    StepLimitError,
    pack_vector,
    tile_id,
    unpack_vector,
)

P = FabricParams()
LANES = P.cu.lanes
MU = (1, 0)                  # the MU most tests use
MU_ID = tile_id(P, *MU)
OTHER_MU = (0, 1)
CU2 = (1, 1)

# A 2x3 fabric for the fan-out: a producer, two consumers, two MUs.
MOE = FabricParams(rows=2, cols=3, layout="CMC/CMC")
PRODUCER, CONSUMERS = (0, 0), [(2, 0), (0, 1)]


def interp(tiles, params=P, **kw):
    """An interpreter of ``{(x, y): TileConfig or assembly text}``."""
    tiles = {xy: TileConfig(program=assemble(t)) if isinstance(t, str) else t
             for xy, t in tiles.items()}
    return Interpreter(params, FabricConfig(params, tiles), **kw)


def run_one(text, *, regs=None, local=None, params=P, xy=(0, 0)):
    """Run one CU of assembly ``text``; return the interpreter and the result."""
    tile = TileConfig(program=assemble(text), regs=dict(regs or {}), local=dict(local or {}))
    it = Interpreter(params, FabricConfig(params, {xy: tile}))
    return it, it.run()


def stream_cfg(**fields):
    """SCFGI lines for stream fields given by name (enum members are written by value)."""
    return "\n".join(f"SCFGI {name}, {int(getattr(v, 'value', v))}" for name, v in fields.items())


# --- Scalar instructions ---------------------------------------------------------------------

# Every ALU function on (-7, 2), worked out by hand.
EXPECTED = {
    AluFn.ADD: -5, AluFn.SUB: -9, AluFn.MUL: -14, AluFn.AND: 0, AluFn.OR: -5, AluFn.XOR: -5,
    AluFn.SHL: -28, AluFn.SHR: -2, AluFn.SHRU: 0x3fff_fffe, AluFn.MIN: -7, AluFn.MAX: 2,
    AluFn.SLT: 1, AluFn.SEQ: 0, AluFn.RELU: 0, AluFn.PASS: -7, AluFn.SEL: -7,
}
PAIRS = [(-7, 2), (5, 3), (0x7fff_ffff, 1), (-1, 31), (-(1 << 31), 33), (12, 0), (3, 3),
         (-5, -5), (1 << 20, 1 << 20)]


@pytest.mark.parametrize("fn", list(AluFn), ids=lambda f: f.name)
def test_alu_every_function_scalar(fn):
    for a, b in PAIRS:
        _, res = run_one(f"""
            LI r1, {a}
            LI r2, {b}
            ALU {fn.name}, r3, r1, r2
            ALUI {fn.name}, r4, r1, {b}
            HALT
        """)
        regs = res.cu(0, 0).regs
        assert regs[3] == regs[4] == alu(fn, a, b), (fn, a, b)
        if (a, b) == (-7, 2):
            assert s32(regs[3]) == EXPECTED[fn]


@pytest.mark.parametrize("fn", list(AluFn), ids=lambda f: f.name)
@pytest.mark.parametrize("bmode", [BMode.LOCAL, BMode.SCALAR, BMode.ZERO], ids=lambda m: m.name)
def test_alu_every_function_lane_wise(fn, bmode):
    # Stream three words of A against B, results to the local buffer (SHIFT 0, no ReLU).
    rng = np.random.default_rng(fn.value)
    a = rand32(rng, (3, LANES))
    a[0] = [-7, 0x7fff_ffff, -(1 << 31), 0]
    b = rand32(rng, (3, LANES)) if bmode is BMode.LOCAL else None
    if b is not None:
        b[0] = [2, 1, 33, 0]
    scalar = -3
    it = interp({(0, 0): TileConfig(
        program=assemble(f"""
            {stream_cfg(A_STRIDE=1, N=3, B_MODE=bmode, B_VAL=scalar if bmode is BMode.SCALAR
                        else 0, B_STRIDE=1, D_MODE=DMode.LOCAL, D_BASE=20, D_STRIDE=1)}
            SCFG A_REF, r2
            SRUN {fn.name}, r0
            HALT
        """),
        local={w: b[w].tolist() for w in range(3)} if b is not None else {})})
    ref = it.load_buffer(MU, a)
    it.set_register((0, 0), 2, ref)
    res = it.run()
    assert res.ok
    if bmode is BMode.LOCAL:
        bb = b
    elif bmode is BMode.SCALAR:
        bb = np.full_like(a, scalar)
    else:
        bb = np.zeros_like(a)
    expected = [[s32(alu(fn, int(x), int(y))) for x, y in zip(ra, rb, strict=True)]
                for ra, rb in zip(a.tolist(), bb.tolist(), strict=True)]
    np.testing.assert_array_equal(res.cu(0, 0).local[20:23], expected)
    assert res.cu(0, 0).stream_steps == 3


def test_li_and_registers_from_the_configuration():
    _, res = run_one("LI r2, -5\nLI r3, 0xffffffff\nALU ADD, r4, r1, r2\nHALT", regs={1: -1, 7: 9})
    s = res.cu(0, 0)
    assert s.regs[1] == 0xffff_ffff and s.regs[7] == 9
    assert s32(s.regs[2]) == -5 and s32(s.regs[3]) == -1 and s32(s.regs[4]) == -6
    assert s.sregs.dtype == np.int32 and s.sregs[4] == -6


def test_branches():
    # r10 collects one bit per branch that is taken.
    _, res = run_one("""
            LI r1, 1
            LI r2, -1
            LI r10, 0
            BNZ r1, t0          # taken
            ALUI OR, r10, r10, 1
        t0: BNZ r0, t1          # not taken
            ALUI OR, r10, r10, 2
        t1: BZ r0, t2           # taken
            ALUI OR, r10, r10, 4
        t2: BZ r1, t3           # not taken
            ALUI OR, r10, r10, 8
        t3: BLT r2, r1, t4      # -1 < 1 signed: taken
            ALUI OR, r10, r10, 16
        t4: BLT r1, r2, t5      # 1 < -1: not taken
            ALUI OR, r10, r10, 32
        t5: JMP t6
            ALUI OR, r10, r10, 64
        t6: LI r3, 4            # LOOP runs its body 4 times
            LI r4, 0
        body: ALUI ADD, r4, r4, 10
            LOOP r3, body
            NOP
            HALT
    """)
    s = res.cu(0, 0)
    assert s.regs[10] == 2 | 8 | 32
    assert s.regs[4] == 40 and s.regs[3] == 0
    assert s.done and not s.error and s.code_name == "NONE"


def test_halt_reports_done_with_its_pc():
    _, res = run_one("NOP\nNOP\nHALT\nNOP")
    s = res.cu(0, 0)
    assert (s.done, s.error, s.pc, s.instructions) == (True, False, 2, 3)
    assert s.status == 1 | 2 << 16
    assert res.ok and res.instructions == {(0, 0): 3, CU2: 0}


def test_self_vset_vclr_and_register_wrap():
    _, res = run_one("SELF r1\nLI r2, 7\nVSET 1, r2\nVSET 6, r2\nHALT", xy=CU2)
    s = res.cu(*CU2)
    assert s.regs[1] == (1 << P.coord_bits | 1) == tile_id(P, *CU2)
    np.testing.assert_array_equal(s.V, [0, 7, 7, 0])          # lane 6 is lane 6 mod 4
    _, res = run_one("LI r2, 7\nVSET 0, r2\nVCLR\nHALT")
    np.testing.assert_array_equal(res.cu(0, 0).V, [0] * LANES)
    # With 8 registers, r9 is r1.
    small = P.replace(cu=CUParams(regs=8))
    _, res = run_one("LI r9, 5\nHALT", params=small)
    assert res.cu(0, 0).regs == (0, 5, 0, 0, 0, 0, 0, 0)


# --- MU instructions -------------------------------------------------------------------------

MU_PROGRAM = """
    ALLOC r2, r1, 2          # r2 = a buffer of total weight 2
    LI r10, 11
    VSET 0, r10
    LI r10, -12
    VSET 1, r10
    VAPPEND r3, r2           # word 0 = [11, -12, 0, 0]; r3 = 0
    LI r10, 13
    VSET 2, r10
    VAPPEND r4, r2           # word 1 = [11, -12, 13, 0]; r4 = 1
    LI r5, 5
    VWRITE r2, r5            # word 5; words 2..4 never written
    LEN r6, r2               # 6
    LI r7, 1
    READ 2, r8, r2, r7       # lane 2 of word 1 = 13
    READ 1, r9, r2, r0       # lane 1 of word 0 = -12
    VCLR
    VREAD r2, r7             # V = word 1
    ADDW r2, 1               # total 3
    RETI r2, 1
    LI r11, 1
    RET r2, r11              # 1 of 3 still outstanding
"""


def test_mu_instructions():
    it = interp({(0, 0): TileConfig(program=assemble(MU_PROGRAM + "HALT"), regs={1: MU_ID})},
                trace=True)
    res = it.run()
    assert res.ok
    s = res.cu(0, 0)
    ref = s.regs[2]
    assert it.ref_fields(ref) == {"mu": MU_ID, "buf": 0}
    assert (s.regs[3], s.regs[4], s.regs[6], s.regs[8], s32(s.regs[9])) == (0, 1, 6, 13, -12)
    np.testing.assert_array_equal(s.V, [11, -12, 13, 0])
    np.testing.assert_array_equal(it.read_buffer(MU, ref), [
        [11, -12, 0, 0], [11, -12, 13, 0], [0] * 4, [0] * 4, [0] * 4, [11, -12, 13, 0]])
    info = it.mu(*MU).live_buffers()[0]
    assert (info["total"], info["collected"]) == (3, 2)
    assert res.mu_ops[MU] == {MUOp.ALLOC: 1, MUOp.APPEND: 2, MUOp.WRITE: 1, MUOp.LEN: 1,
                              MUOp.READ: 3, MUOp.ADD_WEIGHT: 1, MUOp.RETURN: 2}
    assert res.mu_ops[OTHER_MU] == {}
    assert s.requests == 11
    # Requests carry the CU's coordinates and tag 0.
    assert all(t.request["src"] == {"x": 0, "y": 0} and t.request["tag"] == 0
               for t in it.transactions)
    assert [t.response["data"] for t in it.transactions if t.request["op"] is MUOp.RETURN] \
        == [2, 1]


def test_last_return_frees_and_a_stale_reference_fails():
    it = interp({(0, 0): TileConfig(program=assemble(MU_PROGRAM + "RETI r2, 1\nHALT"),
                                    regs={1: MU_ID})})
    res = it.run()
    assert res.ok
    assert it.mu(*MU).frees == 1 and it.mu(*MU).live_buffers() == {}
    with pytest.raises(HostError, match="READ|LEN") as e:
        it.read_buffer(MU, res.cu(0, 0).regs[2])
    assert e.value.response["status"] is MUStatus.BAD_REF


def test_indices_keep_their_low_index_bits():
    # Documented choice: a register used as an index is truncated to index_bits (16), as the
    # request field is; so is a reference to mu_id_bits + buf_id_bits.
    it = interp({(0, 0): TileConfig(program=assemble("""
        LI r7, 0x10001
        READ 0, r12, r2, r7      # word 1
        LI r8, 0x7fffc000
        ALU OR, r9, r2, r8       # junk above the reference's 14 bits
        READ 0, r13, r9, r0      # word 0
        HALT
    """))})
    it.set_register((0, 0), 2, it.load_buffer(MU, [[5] * LANES, [6] * LANES]))
    res = it.run()
    assert res.ok and res.cu(0, 0).regs[12:14] == (6, 5)


def test_counter_mode_incref_decref():
    params = P.replace(mu=P.mu.replace(refcount="counter"))
    it = interp({(0, 0): TileConfig(program=assemble("""
        ALLOC r2, r1, 1
        INCREF r2
        INCREF r2
        DECREF r2
        DECREF r2
        LEN r3, r2          # still live: count 1
        DECREF r2           # count 0: freed
        HALT
    """), regs={1: MU_ID})}, params=params)
    res = it.run()
    assert res.ok
    assert res.mu_ops[MU][MUOp.INCREF] == 2 and res.mu_ops[MU][MUOp.DECREF] == 3
    assert it.mu(*MU).frees == 1


# --- Error halts ----------------------------------------------------------------------------

def code(name):
    return CU_STATUS_BITS[name]


@pytest.mark.parametrize("text, pc", [
    ("LI r2, 1\nLI r3, 0\nVREAD r2, r3\nHALT", 2),            # slot 0 never allocated: BAD_REF
    ("ALLOC r2, r1, 1\nLI r3, 0\nREAD 0, r4, r2, r3\nHALT", 2),  # READ past the length
    ("ALLOC r2, r1, 0\nHALT", 0),                              # zero weight: BAD_REQUEST
    ("ALLOC r2, r1, 256\nHALT", 0),                            # past weight_bits
    ("ALLOC r2, r1, 1\nRETI r2, 2\nHALT", 1),                  # returns more than outstanding
    ("ALLOC r2, r1, 1\nRETI r2, 1\nLEN r3, r2\nHALT", 2),      # stale after the free
    ("ALLOC r2, r1, 1\nINCREF r2\nHALT", 1),                   # counter op in weighted mode
])
def test_mu_error_halts(text, pc):
    _, res = run_one(text, regs={1: MU_ID})
    s = res.cu(0, 0)
    assert (s.done, s.error, s.code, s.code_name, s.pc) == (True, True, code("MU_ERROR"),
                                                            "MU_ERROR", pc)
    assert s.status == 1 | 2 | code("MU_ERROR") << 8 | pc << 16
    assert res.mu_errors[MU] == 1 and not res.ok
    assert res.errors == {(0, 0): "MU_ERROR"}
    with pytest.raises(InterpreterError, match=r"CU \(0, 0\): MU_ERROR at pc"):
        res.check()


def test_mu_error_keeps_the_destination_register():
    _, res = run_one("LI r4, 77\nLI r2, 1\nLEN r4, r2\nHALT")
    assert res.cu(0, 0).regs[4] == 77 and res.cu(0, 0).code_name == "MU_ERROR"


def test_undefined_opcode():
    tile = TileConfig(program=[encode(Instr(Op.NOP)), 63, encode(Instr(Op.HALT))])
    res = Interpreter(P, FabricConfig(P, {(0, 0): tile})).run()
    assert (res.cu(0, 0).code_name, res.cu(0, 0).pc) == ("BAD_INSTRUCTION", 1)


@pytest.mark.parametrize("text", [
    f"SEND {P.cu.channels}, r0, 1\nHALT",
    f"WAIT {P.cu.channels}, 1\nHALT",
    f"SENDREF {P.cu.mailbox}, r0, r1, r2\nHALT",
    f"RECV {P.cu.mailbox}, r1\nHALT",
])
def test_channel_or_slot_out_of_range_is_a_bad_instruction(text):
    _, res = run_one(text)
    assert (res.cu(0, 0).code_name, res.cu(0, 0).pc) == ("BAD_INSTRUCTION", 0)


def test_pc_out_of_range():
    _, res = run_one("NOP")      # the rest of program memory is NOP
    s = res.cu(0, 0)
    assert (s.code_name, s.pc, s.instructions) == ("PC_OUT_OF_RANGE", P.cu.prog_len,
                                                   P.cu.prog_len)
    _, res = run_one("JMP 0x10000")
    assert (res.cu(0, 0).code_name, res.cu(0, 0).pc) == ("PC_OUT_OF_RANGE", 0x10000)


def test_token_overflow_halts_the_receiver():
    it = interp({
        (0, 0): f"LI r1, {tile_id(P, *CU2)}\nSEND 0, r1, 65535\nSEND 0, r1, 1\nHALT",
        CU2: "WAIT 1, 1\nHALT",      # never satisfied: the overflow ends it
    })
    res = it.run()
    assert res.cu(0, 0).done and not res.cu(0, 0).error
    assert res.cu(*CU2).code_name == "TOKEN_OVERFLOW" and res.cu(*CU2).pc == 0
    assert res.cu(*CU2).tokens[0] == 65535 and res.cu(0, 0).tokens_sent == 2


def test_mailbox_overflow_halts_the_receiver():
    it = interp({
        (0, 0): f"LI r1, {tile_id(P, *CU2)}\nLI r3, 1\nSENDREF 2, r1, r2, r3\n"
                f"SENDREF 2, r1, r2, r3\nHALT",
        CU2: "WAIT 0, 1\nHALT",
    })
    res = it.run()
    assert res.cu(*CU2).code_name == "MAILBOX_OVERFLOW"
    assert res.cu(*CU2).mailbox[2] == (0, 1) and res.cu(0, 0).refs_sent == 2


@pytest.mark.parametrize("fields", [
    dict(N=0), dict(OUTER=0), dict(N=1, B_MODE=max(m.value for m in BMode) + 1),
    dict(N=1, D_MODE=max(m.value for m in DMode) + 1), dict(N=1, B_MODE=-1)])
def test_bad_stream(fields):
    _, res = run_one(f"{stream_cfg(**fields)}\nSRUN ADD, r0\nHALT")
    s = res.cu(0, 0)
    assert (s.code_name, s.pc, s.stream_steps) == ("BAD_STREAM", len(fields), 0)
    assert res.mu_ops[MU] == {}


def test_stream_mu_error_halts_at_srun():
    # Word 2 of a 2-word buffer: the third step fails, after two writes.
    it = interp({(0, 0): TileConfig(program=assemble(f"""
        ALLOC r3, r1, 1
        SCFG A_REF, r2
        SCFG D_REF, r3
        {stream_cfg(A_STRIDE=1, N=3, D_MODE=DMode.APPEND)}
        SRUN PASS, r0
        HALT
    """), regs={1: MU_ID})})
    it.set_register((0, 0), 2, it.load_buffer(MU, [[1] * LANES, [2] * LANES]))
    res = it.run()
    s = res.cu(0, 0)
    assert (s.code_name, s.pc, s.stream_steps) == ("MU_ERROR", 6, 2)
    np.testing.assert_array_equal(it.read_buffer(MU, s.regs[3]), [[1] * LANES, [2] * LANES])


# --- Streams --------------------------------------------------------------------------------

def preload(it, xy, **buffers):
    """Load numpy arrays into MU buffers and put their references in registers
    (``r2=array`` or ``r2=(mu_xy, array)``)."""
    for name, value in buffers.items():
        mu, array = value if isinstance(value, tuple) else (MU, value)
        it.set_register(xy, int(name[1:]), it.load_buffer(mu, array))


@pytest.mark.parametrize("dmode", [DMode.WRITE, DMode.APPEND], ids=lambda m: m.name)
@pytest.mark.parametrize("shift, post", [(0, 0), (3, 1), (31, 0), (31, 1), (24, 2), (24, 3)])
def test_elementwise_to_an_mu(dmode, shift, post):
    # out = post((a reversed * b) >> shift), a read backwards with stride -1, out written from
    # word 2 with stride 2 (WRITE) or appended.
    rng = np.random.default_rng(shift)
    a = rand32(rng, (5, LANES))
    b = rand32(rng, (5, LANES))
    it = interp({(0, 0): TileConfig(program=assemble(f"""
        ALLOC r3, r1, 1
        SCFG A_REF, r2
        SCFG D_REF, r3
        {stream_cfg(A_BASE=4, A_STRIDE=-1, N=5, B_MODE=BMode.LOCAL, B_STRIDE=1, D_MODE=dmode,
                    D_BASE=2, D_STRIDE=2, SHIFT=shift, POST=post)}
        SRUN MUL, r0
        HALT
    """), regs={1: MU_ID}, local={w: b[w].tolist() for w in range(5)})}, trace=True)
    preload(it, (0, 0), r2=(OTHER_MU, a))
    res = it.run()
    assert res.ok
    got = it.read_buffer(MU, res.cu(0, 0).regs[3])
    expected = relu_shift(a[::-1] * b, shift, post)
    if dmode is DMode.WRITE:
        np.testing.assert_array_equal(got[2::2], expected)
        assert len(got) == 2 + 2 * 4 + 1
    else:
        np.testing.assert_array_equal(got, expected)
    assert res.mu_ops[OTHER_MU] == {MUOp.READ: 5}
    tags = {t.request["op"]: t.request["tag"] for t in it.transactions}
    assert tags[MUOp.ALLOC] == 0 and tags[MUOp.READ] == 1
    assert tags[MUOp.WRITE if dmode is DMode.WRITE else MUOp.APPEND] == 2


def test_elementwise_to_the_local_buffer_with_shift_and_relu():
    rng = np.random.default_rng(1)
    a = rand32(rng, (4, LANES))
    it = interp({(0, 0): TileConfig(program=assemble(f"""
        SCFG A_REF, r2
        {stream_cfg(A_STRIDE=1, N=4, B_MODE=BMode.SCALAR, B_VAL=-5, D_MODE=DMode.LOCAL,
                    D_BASE=8, D_STRIDE=3, SHIFT=2, POST=1)}
        SRUN SUB, r0
        HALT
    """))})
    preload(it, (0, 0), r2=a)
    res = it.run()
    np.testing.assert_array_equal(res.cu(0, 0).local[8:18:3], relu_shift(a + 5, 2, 1))
    assert res.mu_ops[MU] == {MUOp.READ: 4}        # host requests are not counted


def test_local_acc_with_outer_loop_and_wrapping_local_indices():
    # OUTER 2 x N 3 over 6 words; B from local with an outer stride; results accumulated into
    # local words 62, 63, 0, 1, 2, 3 (indices wrap modulo local_words = 64), which start with
    # values of their own.
    rng = np.random.default_rng(2)
    a = rand32(rng, (6, LANES))
    b = rand32(rng, (2, 3, LANES))          # at local 10 + o*5 + i
    init = rand32(rng, (6, LANES))
    dst = [62, 63, 0, 1, 2, 3]
    local = {10 + o * 5 + i: b[o, i].tolist() for o in range(2) for i in range(3)}
    local.update({w: init[j].tolist() for j, w in enumerate(dst)})
    it = interp({(0, 0): TileConfig(program=assemble(f"""
        SCFG A_REF, r2
        {stream_cfg(A_STRIDE=1, A_OSTRIDE=3, N=3, OUTER=2, B_MODE=BMode.LOCAL, B_VAL=10,
                    B_STRIDE=1, B_OSTRIDE=5, D_MODE=DMode.LOCAL_ACC, D_BASE=62, D_STRIDE=1)}
        SRUN MUL, r0
        HALT
    """), local=local)})
    preload(it, (0, 0), r2=a)
    res = it.run()
    assert res.ok
    got = res.cu(0, 0).local[dst]
    np.testing.assert_array_equal(got, wrap32(init + wrap32(a * b.reshape(6, LANES))))
    assert res.cu(0, 0).stream_steps == 6


@pytest.mark.parametrize(("b_val", "b_stride", "b_ostride"), [(5, 2, 3), (250, 1, 7)],
                         ids=["strided", "wraps"])
def test_elem_b_is_one_local_element_in_every_lane(b_val, b_stride, b_ostride):
    """B_MODE ELEM: operand B of step (o, i) is element ``B_VAL + o*B_OSTRIDE + i*B_STRIDE``
    of the local buffer (lane e mod lanes of word e / lanes, the buffer's elements wrapping
    like LGET's) in every lane."""
    rng = np.random.default_rng(b_val)
    a = rand32(rng, (6, LANES))
    init = rand32(rng, (P.cu.local_words, LANES))
    it = interp({(0, 0): TileConfig(program=assemble(f"""
        ALLOC r3, r1, 1
        SCFG A_REF, r2
        SCFG D_REF, r3
        {stream_cfg(A_STRIDE=1, A_OSTRIDE=2, N=2, OUTER=3, B_MODE=BMode.ELEM, B_VAL=b_val,
                    B_STRIDE=b_stride, B_OSTRIDE=b_ostride, D_MODE=DMode.APPEND)}
        SRUN SUB, r0
        HALT
    """), regs={1: MU_ID}, local={w: init[w].tolist() for w in range(P.cu.local_words)})})
    preload(it, (0, 0), r2=a)
    res = it.run()
    assert res.ok
    flat = init.reshape(-1)
    b = np.array([flat[(b_val + o * b_ostride + i * b_stride) % flat.size]
                  for o in range(3) for i in range(2)])
    np.testing.assert_array_equal(it.read_buffer(MU, res.cu(0, 0).regs[3]),
                                  wrap32(a - b[:, None]))


def test_outer_sum_adds_each_inner_step_up_over_the_outer_loop():
    """D_MODE OUTER_SUM: ``local[D_BASE + i*D_STRIDE]`` takes step (0, i)'s result, then adds
    step (o, i)'s for the later o; the last outer iteration appends the sums through SHIFT
    and POST instead: a row of scalars (ELEM) times a matrix, requantized, in one stream."""
    rng = np.random.default_rng(3)
    rows, words = 5, 3
    a = rand32(rng, (rows * words, LANES), bits=12)
    p = rand32(rng, (rows,), bits=12)
    local = {0: p[:4].tolist(), 1: [int(p[4]), 0, 0, 0],
             40: [9, 9, 9, 9], 42: [7, 7, 7, 7], 44: [5, 5, 5, 5]}   # overwritten, not added to
    it = interp({(0, 0): TileConfig(program=assemble(f"""
        ALLOC r3, r1, 1
        SCFG A_REF, r2
        SCFG D_REF, r3
        {stream_cfg(A_STRIDE=1, A_OSTRIDE=words, N=words, OUTER=rows, B_MODE=BMode.ELEM,
                    B_VAL=0, B_OSTRIDE=1, D_MODE=DMode.OUTER_SUM, D_BASE=40, D_STRIDE=2,
                    SHIFT=5, POST=1)}
        SRUN MUL, r0
        HALT
    """), regs={1: MU_ID}, local=local)})
    preload(it, (0, 0), r2=a)
    res = it.run()
    assert res.ok
    terms = a.reshape(rows, words, LANES).astype(np.int64) * p[:, None, None]
    np.testing.assert_array_equal(it.read_buffer(MU, res.cu(0, 0).regs[3]),
                                  relu_shift(wrap32(terms.sum(axis=0)), 5, 1))
    np.testing.assert_array_equal(res.cu(0, 0).local[[40, 42, 44]],
                                  wrap32(terms[:-1].sum(axis=0)))
    assert res.cu(0, 0).stream_steps == rows * words


def test_local_acc_accumulates_into_one_word():
    a = np.arange(5 * LANES).reshape(5, LANES) - 7
    it = interp({(0, 0): TileConfig(program=assemble(f"""
        SCFG A_REF, r2
        {stream_cfg(A_STRIDE=1, N=5, D_MODE=DMode.LOCAL_ACC, D_BASE=4, D_STRIDE=0)}
        SRUN PASS, r0
        HALT
    """), local={4: [100, 0, -100, 1]})})
    preload(it, (0, 0), r2=a)
    res = it.run()
    np.testing.assert_array_equal(res.cu(0, 0).local[4], a.sum(axis=0) + [100, 0, -100, 1])


@pytest.mark.parametrize("words", [1, 7])
def test_sum_dot_product(words):
    rng = np.random.default_rng(words)
    x = rand32(rng, (words, LANES))
    w = rand32(rng, (words, LANES))
    it = interp({(0, 0): TileConfig(program=assemble(f"""
        SCFG A_REF, r2
        {stream_cfg(A_STRIDE=1, N=words, B_MODE=BMode.LOCAL, B_VAL=0, B_STRIDE=1,
                    D_MODE=DMode.SUM)}
        LI r5, 99
        VSET 0, r5
        SRUN MUL, r5
        HALT
    """), local={i: w[i].tolist() for i in range(words)})})
    preload(it, (0, 0), r2=x)
    res = it.run()
    assert s32(res.cu(0, 0).regs[5]) == wrap32(wrap32(x * w).astype(np.int64).sum())
    np.testing.assert_array_equal(res.cu(0, 0).V, [99, 0, 0, 0])   # V untouched


@pytest.mark.parametrize("rows", [1, 6, 8, 9])
@pytest.mark.parametrize("shift, post", [(0, 0), (4, 1), (20, 2), (19, 3)])
def test_matrix_vector_product_with_pack_sum(rows, shift, post):
    # y = post(W x >> shift): W is rows x 8 (two words a row, row-major), x in local words
    # 0..1. One outer iteration a row; PACK_SUM packs four sums a word, SHIFT and POST applied
    # to each sum (ReLU, saturation to int8). V holds junk first: PACK_SUM starts from 0.
    cols = 2 * LANES
    rng = np.random.default_rng(rows + shift)
    W = rand32(rng, (rows, cols))
    x = rand32(rng, cols)
    it = interp({(0, 0): TileConfig(program=assemble(f"""
        ALLOC r3, r1, 1
        SCFG A_REF, r2
        SCFG D_REF, r3
        {stream_cfg(A_STRIDE=1, A_OSTRIDE=2, N=2, OUTER=rows, B_MODE=BMode.LOCAL, B_VAL=0,
                    B_STRIDE=1, B_OSTRIDE=0, D_MODE=DMode.PACK_SUM, SHIFT=shift, POST=post)}
        LI r5, -1
        VSET 3, r5
        SRUN MUL, r0
        HALT
    """), regs={1: MU_ID}, local={0: x[:LANES].tolist(), 1: x[LANES:].tolist()})})
    preload(it, (0, 0), r2=W.reshape(2 * rows, LANES))
    res = it.run()
    assert res.ok
    y = relu_shift(wrap32((W * x).sum(axis=1)), shift, post)
    padded = np.zeros(-(-rows // LANES) * LANES, dtype=np.int32)
    padded[:rows] = y
    np.testing.assert_array_equal(it.read_buffer(MU, res.cu(0, 0).regs[3]),
                                  padded.reshape(-1, LANES))
    np.testing.assert_array_equal(res.cu(0, 0).V, [0] * LANES)
    assert res.mu_ops[MU][MUOp.APPEND] == -(-rows // LANES)
    assert res.cu(0, 0).stream_steps == 2 * rows


def test_max_and_argmax_take_the_first_of_ties():
    a = np.array([[-9, -3, -8, -3],
                  [-5, -3, -4, -6],
                  [-3, -7, -3, -10]])
    it = interp({(0, 0): TileConfig(program=assemble(f"""
        SCFG A_REF, r2
        {stream_cfg(A_STRIDE=1, N=3, D_MODE=DMode.MAX)}
        SRUN PASS, r4
        {stream_cfg(D_MODE=DMode.ARGMAX)}
        SRUN PASS, r6
        {stream_cfg(A_BASE=1, N=1, A_OSTRIDE=1, OUTER=2)}
        SRUN PASS, r15        # index in r0: r[rd+1] wraps
        HALT
    """))})
    preload(it, (0, 0), r2=a)
    res = it.run()
    regs = res.cu(0, 0).regs
    assert s32(regs[4]) == -3
    assert (s32(regs[6]), regs[7]) == (-3, 1)       # word 0, lane 1, the first -3
    # From word 1: k = 0 is word 1, k = 1 is word 2; -3 first at k = 0, lane 1.
    assert (s32(regs[15]), regs[0]) == (-3, 1)


def test_argmax_index_counts_steps_over_outer_iterations():
    a = np.zeros((4, LANES), dtype=np.int64)
    a[2, 0] = 51 << 2           # 51 after SHIFT 2, at k = 2, lane 0
    a[3, 2] = (51 << 2) + 3     # also 51 after the shift: a later tie
    it = interp({(0, 0): TileConfig(program=assemble(f"""
        SCFG A_REF, r2
        {stream_cfg(A_STRIDE=1, A_OSTRIDE=2, N=2, OUTER=2, SHIFT=2, D_MODE=DMode.ARGMAX)}
        SRUN PASS, r4
        HALT
    """))})
    preload(it, (0, 0), r2=a)
    res = it.run()
    assert (res.cu(0, 0).regs[4], res.cu(0, 0).regs[5]) == (51, 2 * LANES + 0)


# --- Tokens and references ------------------------------------------------------------------

def test_tokens_ping_pong():
    a, b = tile_id(P, 0, 0), tile_id(P, *CU2)
    it = interp({
        (0, 0): f"LI r1, {b}\nLI r2, 3\nloop: SEND 1, r1, 2\nWAIT 0, 1\nLOOP r2, loop\nHALT",
        CU2: f"LI r1, {a}\nLI r2, 3\nloop: WAIT 1, 2\nSEND 0, r1, 1\nLOOP r2, loop\nHALT",
    }, trace=True)
    res = it.run()
    assert res.ok
    assert res.cu(0, 0).tokens_sent == res.cu(*CU2).tokens_sent == 3
    assert all(t == 0 for s in res.cus.values() for t in s.tokens)
    # A blocked WAIT is not counted until it completes: 2 + 3 * 3 + 1 each.
    assert res.instructions == {(0, 0): 12, CU2: 12}
    assert [(m.src, m.dst, m.tag, m.data) for m in it.messages[:2]] == [
        ((0, 0), CU2, 1, 2), (CU2, (0, 0), 0, 1)]


def test_send_and_sendref_to_itself():
    me = tile_id(P, 0, 0)
    _, res = run_one(f"""
        LI r1, {me}
        LI r2, 0x1234
        LI r3, 5
        SEND 3, r1, 4
        WAIT 3, 4
        SENDREF 1, r1, r2, r3
        RECV 1, r15          # r15 = ref, r0 = weight (wraps)
        HALT
    """)
    s = res.cu(0, 0)
    assert (s.regs[15], s.regs[0]) == (0x1234, 5) and s.mailbox[1] is None


MOE_PRODUCER = f"""
    # r1 = MU ID, r2, r3 = consumer IDs, r7 = the input (in the other MU)
    ALLOC r4, r1, 3              # the expert input: weight 3, one for each holder
    SCFG A_REF, r7
    SCFG D_REF, r4
    {stream_cfg(A_STRIDE=1, N=4, D_MODE=DMode.APPEND)}
    SRUN PASS, r0                # append the input to it
    LI r8, 1
    SENDREF 0, r2, r4, r8        # weight 1 to each consumer
    SENDREF 0, r3, r4, r8
    SCFG A_REF, r4
    {stream_cfg(D_MODE=DMode.SUM)}
    SRUN PASS, r9                # its own use of the buffer
    RET r4, r8                   # and its own weight back
    HALT
"""

MOE_CONSUMER = f"""
    RECV 0, r4                   # r4 = reference, r5 = weight
    SCFG A_REF, r4
    {stream_cfg(A_STRIDE=1, N=4, B_MODE=BMode.LOCAL, B_STRIDE=1, D_MODE=DMode.SUM)}
    SRUN MUL, r6                 # a dot product with this expert's weights
    LEN r7, r4
    RET r4, r5
    HALT
"""


def moe(schedule, seed=0):
    rng = np.random.default_rng(7)
    x = rand32(rng, (4, LANES))
    experts = [rand32(rng, (4, LANES)) for _ in CONSUMERS]
    tiles = {PRODUCER: TileConfig(program=assemble(MOE_PRODUCER), regs={
        1: tile_id(MOE, 1, 0), 2: tile_id(MOE, *CONSUMERS[0]), 3: tile_id(MOE, *CONSUMERS[1])})}
    for xy, w in zip(CONSUMERS, experts, strict=True):
        tiles[xy] = TileConfig(program=assemble(MOE_CONSUMER),
                               local={i: w[i].tolist() for i in range(4)})
    it = Interpreter(MOE, FabricConfig(MOE, tiles), schedule=schedule, seed=seed, trace=True)
    it.set_register(PRODUCER, 7, it.load_buffer((1, 1), x))
    return it, it.run(), x, experts


@pytest.mark.parametrize("schedule, seeds", [("round_robin", [0]), ("random", range(20))])
def test_moe_fan_out_frees_the_buffer_when_the_last_weight_returns(schedule, seeds):
    finals = []
    orders = set()
    for seed in seeds:
        it, res, x, experts = moe(schedule, seed)
        assert res.ok, res.errors
        p = res.cu(*PRODUCER)
        assert s32(p.regs[9]) == wrap32(x.sum())
        for xy, w in zip(CONSUMERS, experts, strict=True):
            c = res.cu(*xy)
            assert s32(c.regs[6]) == wrap32(wrap32(x * w).astype(np.int64).sum())
            assert (c.regs[4], c.regs[5], c.regs[7]) == (p.regs[4], 1, 4)
        assert p.refs_sent == 2
        # Three returns of weight 1: outstanding 2, 1, then 0 (freed), whoever comes last.
        mu = it.mu(1, 0)
        rets = [t for t in it.transactions if t.request["op"] is MUOp.RETURN]
        assert [t.response["data"] for t in rets] == [2, 1, 0]
        assert rets[-1] is [t for t in it.transactions if t.mu == (1, 0)][-1]
        assert (mu.allocs, mu.frees, mu.live_buffers()) == (1, 1, {})
        with pytest.raises(HostError) as e:
            it.read_buffer((1, 0), p.regs[4])
        assert e.value.response["status"] is MUStatus.BAD_REF
        assert it.mu(1, 1).frees == 0
        orders.add(tuple(t.cu for t in rets))
        finals.append((res.key(), mu.snapshot()))
    # Race-free: the same final state under every schedule; and the schedules differ.
    assert all(f == finals[0] for f in finals)
    if schedule == "random":
        assert len(orders) > 1


def test_a_configuration_read_back_from_its_bitstream_runs_the_same():
    it, res, _, _ = moe("round_robin")
    tiles = {PRODUCER: TileConfig(program=assemble(MOE_PRODUCER), regs={
        1: tile_id(MOE, 1, 0), 2: tile_id(MOE, *CONSUMERS[0]), 3: tile_id(MOE, *CONSUMERS[1])})}
    for xy in CONSUMERS:
        tiles[xy] = TileConfig(program=assemble(MOE_CONSUMER),
                               local={w: res.cu(*xy).local[w].tolist() for w in range(4)})
    config = read_bitstream(write_bitstream(FabricConfig(MOE, tiles)), MOE)
    again = Interpreter(MOE, config)
    x = it.mu(1, 1).live_buffers()[0]
    again.set_register(PRODUCER, 7, again.load_buffer((1, 1), it.read_buffer((1, 1), x["ref"])))
    assert again.run().key() == res.key()


def test_random_schedule_is_reproducible():
    first = moe("random", 5)
    again = moe("random", 5)
    assert first[1].steps == again[1].steps
    assert [t.cu for t in first[0].transactions] == [t.cu for t in again[0].transactions]


# --- Deadlock, limits, routing, configuration ----------------------------------------------

def test_deadlock_names_the_blocked_cus():
    it = interp({
        (0, 0): f"LI r1, {tile_id(P, *CU2)}\nWAIT 2, 1\nSEND 2, r1, 1\nHALT",
        CU2: "LI r1, 0\nRECV 3, r4\nSEND 2, r1, 1\nHALT",
    })
    with pytest.raises(DeadlockError, match=r"every running CU is blocked: CU \(0, 0\) at pc 1: "
                                            r"WAIT for 1 tokens on channel 2 \(has 0\); "
                                            r"CU \(1, 1\) at pc 1: RECV on mailbox slot 3 "
                                            r"\(empty\)") as e:
        it.run()
    assert set(e.value.blocked) == {(0, 0), CU2}
    assert e.value.result.steps == 2 and not e.value.result.finished


def test_deadlock_after_the_others_halted():
    it = interp({(0, 0): "HALT", CU2: "WAIT 0, 70000\nHALT"}, schedule="random", seed=3)
    with pytest.raises(DeadlockError) as e:
        it.run()
    assert list(e.value.blocked) == [CU2]
    assert e.value.result.cu(0, 0).done


def test_step_limit_and_resuming():
    it = interp({(0, 0): "LI r1, 100\nloop: LOOP r1, loop\nHALT"})
    with pytest.raises(StepLimitError, match=r"Step limit of 50 reached with CUs \[\(0, 0\)\]"):
        it.run(max_steps=50)
    assert it.state(0, 0).regs[1] == 51
    res = it.run()
    assert res.ok and res.steps == 102


def test_a_program_for_an_mu_tile_is_rejected():
    config = FabricConfig(P, {MU: TileConfig(program=assemble("HALT"))})
    with pytest.raises(BitstreamError, match=r"tile \(1, 0\) is a memory unit"):
        Interpreter(P, config)


@pytest.mark.parametrize("text, pc", [
    (f"LI r1, {MU_ID}\nSEND 0, r1, 1\nHALT", 1),                  # an MU
    ("LI r1, 7\nLI r2, 1\nSENDREF 0, r1, r0, r2\nHALT", 2),        # outside the grid
    (f"LI r1, {tile_id(P, *CU2)}\nLEN r2, r1\nHALT", 1),           # a CU is not an MU
    ("ALLOC r2, r0, 1\nHALT", 0),                                   # tile (0, 0) is a CU
])
def test_a_wrong_destination_halts_before_sending(text, pc):
    interp = Interpreter(P, FabricConfig(P, {(0, 0): TileConfig(program=assemble(text))}))
    res = interp.run()
    s = res.cu(0, 0)
    assert (s.done, s.error, s.code_name, s.pc) == (True, True, "BAD_DESTINATION", pc)
    assert s.requests == 0 and s.tokens_sent == 0 and s.refs_sent == 0


def test_disabled_cu_is_done_and_drops_messages():
    config = FabricConfig(P, {
        (0, 0): TileConfig(program=assemble(f"LI r1, {tile_id(P, *CU2)}\nSEND 0, r1, 1\nHALT")),
        CU2: TileConfig(program=assemble("WAIT 0, 1\nHALT"), enabled=False),
    })
    res = Interpreter(P, config).run()
    s = res.cu(*CU2)
    assert (s.enabled, s.done, s.error, s.instructions, s.tokens[0]) == (False, True, False, 0, 0)
    assert s.status == 1
    assert [(m.src, m.dst, m.kind) for m in res.dropped] == [((0, 0), CU2, "token")]


def test_constructor_checks():
    config = FabricConfig(P, {})
    with pytest.raises(TypeError, match="schedule must be 'round_robin' or 'random', not 'fifo'"):
        Interpreter(P, config, schedule="fifo")
    with pytest.raises(ValueError, match="config.params must be"):
        Interpreter(MOE, config)
    with pytest.raises(TypeError, match="params must be a FabricParams"):
        Interpreter(None, config)
    res = Interpreter(P, config).run()          # every CU disabled: nothing to do
    assert res.finished and res.steps == 0


# --- Host helpers and vectors ---------------------------------------------------------------

def test_host_load_and_read_buffer():
    it = interp({})
    data = np.array([[1, -2, 3, -(1 << 31)], [0x7fff_ffff, 0, -1, 5]])
    ref = it.load_buffer(OTHER_MU, data, weight=2)
    np.testing.assert_array_equal(it.read_buffer(OTHER_MU, ref), data)
    assert it.ref_fields(ref)["mu"] == tile_id(P, *OTHER_MU)
    assert it.mu(*OTHER_MU).live_buffers()[0]["total"] == 2
    resp = it.host_request(OTHER_MU, {"op": MUOp.LEN, "ref": it.ref_fields(ref)})
    assert resp["data"] == 2 and resp["tag"] >> (P.mu.tag_bits - 1) == 1
    with pytest.raises(HostError, match="BAD_REF"):
        it.read_buffer(MU, ref)                 # the reference names the other MU
    with pytest.raises(ValueError, match=r"array must have shape \(words, 4\)"):
        it.load_buffer(MU, [1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"Tile \(0, 0\) must be a memory unit"):
        it.mu(0, 0)


def test_pack_and_unpack_vector():
    word = pack_vector([1, -1, 0, -(1 << 31)])
    assert word == 1 | 0xffff_ffff << 32 | 0x8000_0000 << 96
    np.testing.assert_array_equal(unpack_vector(word, 4), [1, -1, 0, -(1 << 31)])
    assert unpack_vector(word, 4).dtype == np.int32
    with pytest.raises(ValueError, match="Lane 1 of a vector must fit 32 bits"):
        pack_vector([0, 1 << 32])
    with pytest.raises(ValueError, match="vector word of 2 lanes"):
        unpack_vector(1 << 64, 2)
