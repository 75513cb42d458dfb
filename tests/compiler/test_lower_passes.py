"""The lowering's passes, assembler and register bookkeeping, one unit at a time."""

import dataclasses

import pytest

from rdakit.compiler.lower.asm import Assembler
from rdakit.compiler.lower.layout import LoweringError
from rdakit.compiler.lower.passes import (
    LOWERABLE_KINDS,
    PIPELINE,
    CheckOrder,
    EliminateDead,
    FuseDispatch,
    FuseElementwise,
    FuseEpilogue,
    Legalize,
    LoweringPass,
    PlaceOutputs,
    ScheduleOrder,
)
from rdakit.compiler.lower.registers import R1, R2, R4, R5, REF_REGS, TABLE, RefFile, Reg
from rdakit.hdl.spec.isa import AluFn, DMode, Instr, Op, StreamField


def test_pipeline_is_named_frozen_passes_in_order():
    assert [p.name for p in PIPELINE] == ["legalize", "fuse-elementwise", "fuse-epilogue",
                                          "place-outputs", "eliminate-dead", "fuse-dispatch",
                                          "schedule-order", "check-order"]
    assert [type(p) for p in PIPELINE] == [Legalize, FuseElementwise, FuseEpilogue,
                                           PlaceOutputs, EliminateDead, FuseDispatch,
                                           ScheduleOrder, CheckOrder]
    for p in PIPELINE:
        assert isinstance(p, LoweringPass)
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.x = 1


def test_legalize_option_names_the_kinds_it_accepts():
    assert Legalize().kinds == LOWERABLE_KINDS
    assert Legalize(kinds=frozenset({"input"})) != Legalize()


# The assembler.

def test_stream_writes_a_field_only_when_its_value_changes():
    asm = Assembler()
    asm.stream(AluFn.PASS, a=R1, n=4, d_mode=DMode.SUM, rd=R5)
    first = len(asm)
    asm.stream(AluFn.PASS, a=R1, n=4, d_mode=DMode.SUM, rd=R5)
    # r1 has not changed: A_REF still holds it, so only SRUN is emitted.
    assert [i.op for i in asm.assemble(0)[first:]] == [Op.SRUN]
    # Once r1 is written (an ALUI), A_REF is written again; SUM's rd (r5) changing does not
    # matter to a field.
    asm.alui(AluFn.ADD, R1, R1, 1)
    first = len(asm)
    asm.stream(AluFn.PASS, a=R1, n=4, d_mode=DMode.SUM, rd=R5)
    code = asm.assemble(0)[first:]
    assert [i.op for i in code] == [Op.SCFG, Op.SRUN]
    assert code[0] == Instr(Op.SCFG, fn=StreamField.A_REF.value, ra=1)
    assert code[1] == Instr(Op.SRUN, fn=AluFn.PASS.value, rd=5)


def test_a_reduction_forgets_the_fields_set_from_its_registers():
    # An ARGMAX into r4 writes r4 and r5: a field set from r5 must be written again.
    asm = Assembler()
    asm.field(StreamField.B_VAL, R5)
    asm.stream(AluFn.MAX, a=R1, n=4, d_mode=DMode.ARGMAX, rd=R4)
    first = len(asm)
    asm.field(StreamField.B_VAL, R5)
    assert [i.op for i in asm.assemble(0)[first:]] == [Op.SCFG]


def test_a_label_knows_only_what_every_way_in_agrees_on():
    asm = Assembler()
    skip = asm.label()
    asm.branch(Op.BZ, skip, ra=R2)
    asm.field(StreamField.N, 7)
    asm.place(skip)
    asm.field(StreamField.N, 7)          # not known on the branch's way in: written again
    assert [i.op for i in asm.assemble(0)] == [Op.BZ, Op.SCFGI, Op.SCFGI]
    assert asm.assemble(10)[0].imm == 12


def test_a_loop_head_forgets_the_fields_its_body_writes():
    asm = Assembler()
    asm.li(R2, 3)

    def body(head):
        asm.field(StreamField.N, 1)
        asm.field(StreamField.N, 2)
        asm.branch(Op.LOOP, head, ra=R2)
    asm.loop(body)
    code = asm.assemble(0)
    assert [(i.op, i.imm) for i in code] == [(Op.LI, 3), (Op.SCFGI, 1), (Op.SCFGI, 2),
                                             (Op.LOOP, 1)]


def _before_and_in_loop(asm):
    """The code of ``asm`` before its loop's head, and from the head on."""
    code = asm.assemble(0)
    head = next(i for i in code if i.op is Op.LOOP).imm
    return code[:head], code[head:]


def test_a_loop_sets_its_invariant_fields_once_before_its_head():
    # A_STRIDE is always 1, N always 5 and A_REF always r9 (which the body leaves alone): they
    # are set before the loop. A_BASE comes from r1, which the body advances: it stays in the
    # body, and so does D_MODE, which the body sets to two values.
    asm = Assembler()
    asm.li(R2, 3)

    def body(head):
        asm.stream(AluFn.PASS, a=Reg(REF_REGS[1]), a_base=R1, n=5, d_mode=DMode.SUM, rd=R5)
        asm.stream(AluFn.PASS, a=Reg(REF_REGS[1]), a_base=R1, n=5, d_mode=DMode.MAX, rd=R5)
        asm.alui(AluFn.ADD, R1, R1, 5)
        asm.branch(Op.LOOP, head, ra=R2)
    asm.loop(body)
    pre, loop = _before_and_in_loop(asm)
    F = StreamField
    assert {(i.op, i.fn) for i in pre if i.op in (Op.SCFG, Op.SCFGI)} == {
        (Op.SCFG, F.A_REF.value), (Op.SCFGI, F.A_STRIDE.value), (Op.SCFGI, F.N.value)}
    fields = [(i.op, F(i.fn)) for i in loop if i.op in (Op.SCFG, Op.SCFGI)]
    assert fields == [(Op.SCFG, F.A_BASE), (Op.SCFGI, F.D_MODE), (Op.SCFGI, F.D_MODE)]


def test_a_loop_head_forgets_fields_set_from_registers_the_body_changes():
    # Before the loop A_BASE holds r1; the body changes r1 before its stream: A_BASE must be
    # written in the body even though the body sets it only from r1.
    asm = Assembler()
    asm.field(StreamField.A_BASE, R1)
    asm.li(R2, 3)

    def body(head):
        asm.stream(AluFn.PASS, a=Reg(REF_REGS[0]), a_base=R1, n=2, d_mode=DMode.SUM, rd=R5)
        asm.alui(AluFn.ADD, R1, R1, 2)
        asm.branch(Op.LOOP, head, ra=R2)
    asm.loop(body)
    _, loop = _before_and_in_loop(asm)
    assert Instr(Op.SCFG, fn=StreamField.A_BASE.value, ra=1) in loop


def test_registers_are_given_as_names_and_emitted_as_numbers():
    asm = Assembler()
    asm.emit(Op.READ, fn=0, rd=R5, ra=REF_REGS[0], rb=R5)
    (instr,) = asm.assemble(0)
    assert instr == Instr(Op.READ, rd=5, ra=8, rb=5)
    assert type(asm.code[0][1]["rd"]) is int


# The reference cache.

def test_references_spill_to_the_table_when_the_registers_are_full():
    asm = Assembler()
    refs = RefFile(asm, "CU (0, 0)")
    regs = [refs.new(f"b{i}") for i in range(len(REF_REGS))]
    assert regs == list(REF_REGS)
    refs.unpin()
    refs.get("b1")                        # b0 is now the least recently used
    r = refs.new("extra")
    assert r == REF_REGS[0] and refs.table and refs.n_slots == 1
    assert [i.op for i in asm.assemble(0)] == [Op.VSET, Op.VAPPEND]
    assert asm.assemble(0)[1] == Instr(Op.VAPPEND, rd=REF_REGS[0], ra=TABLE)
    refs.unpin()
    # b0 comes back from slot 0 into the register of the least recently used (b2), which is
    # spilled first to slot 1.
    r = refs.get("b0")
    assert r == REF_REGS[2] and refs.slot == {"b0": 0, "b2": 1}
    assert [(i.op, i.rd, i.ra) for i in asm.assemble(0)[2:]] == [
        (Op.VSET, 0, r), (Op.VAPPEND, r, TABLE), (Op.LI, r, 0), (Op.READ, r, TABLE)]


def test_an_op_needing_more_references_than_registers_is_refused():
    refs = RefFile(Assembler(), "CU (1, 0)")
    for i in range(len(REF_REGS)):
        refs.new(f"b{i}")
    with pytest.raises(LoweringError) as e:
        refs.new("one too many")
    assert str(e.value) == "CU (1, 0): an op needs more than 7 buffer references at once"


def test_a_length_left_in_a_register_replaces_len_until_the_register_changes():
    asm = Assembler()
    asm.set_length("y", R2)
    asm.length("y", R2, R4)              # already there: nothing to emit
    asm.length("y", R5, R4)              # a copy, not a LEN
    assert [op for op, _, _ in asm.code] == [Op.ALUI]
    asm.alui(AluFn.ADD, R2, R2, 1)       # R2 changes; R5 still holds it
    asm.length("y", R1, R4)
    asm.li(R5, 0)
    asm.length("y", R1, R4)              # R1 got it from R5 before R5 changed
    asm.length("z", R1, R4)              # never known: LEN
    assert [op for op, _, _ in asm.code][-3:] == [Op.ALUI, Op.LI, Op.LEN]
    asm.li(R1, 0)
    asm.length("y", R1, R4)
    assert asm.code[-1][0] is Op.LEN


@pytest.mark.parametrize("forget", ["label", "loop", "in place"])
def test_a_label_a_loop_or_a_buffer_growing_forgets_the_lengths(forget):
    asm = Assembler()
    asm.set_length("y", R2)
    if forget == "label":
        asm.place(asm.label())
    elif forget == "loop":
        asm.loop(lambda head: asm.branch(Op.LOOP, head, ra=R1))
    else:
        asm.forget_lengths()
    asm.length("y", R2, R4)
    assert asm.code[-1][0] is Op.LEN
