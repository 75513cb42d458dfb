"""The assembler of one CU program: labels, loops, and stream fields written only when they
change."""

import collections

from rdakit.compiler.lower.layout import MASK32
from rdakit.compiler.lower.registers import Reg
from rdakit.hdl.spec.cu import B_LOCAL_MODES, D_LOCAL_WRITES, D_MU_MODES
from rdakit.hdl.spec.isa import AluFn, BMode, DMode, Instr, Op, Post, StreamField

__all__ = ["Assembler"]


def intersect(states):
    """The stream fields known, with the same value, in every state of ``states``."""
    first = states[0]
    return {f: v for f, v in first.items()
            if v is not None and all(s.get(f) == v for s in states[1:])}


def _reg_value(r):
    """What a field written from register ``r`` is known to hold (until ``r`` changes)."""
    return ("r", int(r))


def written_registers(op, fields):
    """The registers instruction ``op`` with ``fields`` may write (an over-approximation)."""
    rd, ra = fields.get("rd", 0), fields.get("ra", 0)
    if op in (Op.LI, Op.ALU, Op.ALUI, Op.SELF, Op.LGET, Op.READ, Op.LEN, Op.ALLOC,
              Op.VAPPEND, Op.FADD):
        return {rd}
    if op in (Op.RECV, Op.SRUN):     # SRUN: rd for SUM and MAX, rd + 1 too for ARGMAX
        return {rd, rd + 1}
    if op is Op.LOOP:
        return {ra}
    return set()


class Assembler:
    """A CU program under construction: instructions with labels, and what is known of the
    stream fields at each point, so that a field is only written when its value changes.

    A field's known value is a number, or ``("r", n)`` when it was written from register ``n``
    and ``n`` has not changed since. At a label the knowledge is the intersection over every way
    in. A loop's head forgets the fields its body writes, except the loop invariants: a field
    the body only ever sets to one value (a number, or a register the body does not write) is
    set once before the loop instead (the body is emitted up to three times: to find what it
    writes, then for real)."""

    def __init__(self):
        self.code = []
        self.labels = {}
        self.incoming = collections.defaultdict(list)
        self.known = {f: 0 for f in StreamField}
        self.known[StreamField.OUTER] = 1
        self.reachable = True
        self.written = set()                      # fields written (in the current loop body)
        self.values = collections.defaultdict(set)  # field -> the values written to it
        self.regs_written = set()                  # registers written
        # Tensor -> the register holding its length in words, put there by this program's own
        # code and not written since (straight-line code only: a label or a loop forgets).
        self.lengths = {}
        # Registers known to hold this CU's own ID (SELF, not written since): a stream whose
        # A_REF is one of them reads the CU's input queue and writes its step count to its rd.
        self.self_regs = set()
        self._next = 0

    def __len__(self):
        return len(self.code)

    def _append(self, op, fields, label, regs=None):
        fields = {k: int(v) for k, v in fields.items()}
        self.code.append((op, fields, label))
        regs = written_registers(op, fields) if regs is None else regs
        self.self_regs -= regs
        if op is Op.SELF:
            self.self_regs.add(fields["rd"])
        if regs:
            self.regs_written |= regs
            gone = {_reg_value(r) for r in regs}
            self.known = {f: v for f, v in self.known.items() if v not in gone}
            self.lengths = {t: r for t, r in self.lengths.items() if r not in regs}

    def emit(self, op, **fields):
        """Append instruction ``op`` (fields as :class:`~rdakit.hdl.spec.isa.Instr` names them;
        registers may be given as :class:`Reg`)."""
        self._append(op, fields, None)
        if op is Op.HALT:
            self.reachable = False

    def branch(self, op, label, **fields):
        """Append branch ``op`` to ``label`` (its ``imm`` is set by :meth:`assemble`)."""
        self._append(op, fields, label)
        if label not in self.labels:
            self.incoming[label].append(dict(self.known))
        if op is Op.JMP:
            self.reachable = False

    def label(self):
        """A new label, to :meth:`place` later."""
        self._next += 1
        return f"L{self._next}"

    def place(self, label):
        """Put ``label`` at the next instruction."""
        states = self.incoming.pop(label, [])
        if self.reachable:
            states.append(self.known)
        self.known = intersect(states) if states else {}
        self.labels[label] = len(self.code)
        self.reachable = True
        self.lengths = {}

    def loop(self, body):
        """Emit ``body(head)``, which ends with a backward branch to ``head``; the stream fields
        it sets to one value on every pass are set before it instead."""
        saved = (len(self.code), dict(self.labels),
                 {k: list(v) for k, v in self.incoming.items()}, set(self.written),
                 {f: set(v) for f, v in self.values.items()}, set(self.regs_written))
        entry = dict(self.known)
        self.lengths = {}
        writes, hoist, regs = set(), {}, set()
        for attempt in range(4):
            self.written, self.values, self.regs_written = (
                set(), collections.defaultdict(set), set())
            self.known = dict(entry)
            for f, v in hoist.items():           # the preheader
                self.field(f, v)
            pre = (set(self.written), {f: set(v) for f, v in self.values.items()})
            self.written, self.values = set(), collections.defaultdict(set)
            head = self.label()
            self.labels[head] = len(self.code)
            # The head forgets the fields the body writes and the registers it changes.
            gone = {_reg_value(r) for r in regs}
            self.known = {f: v for f, v in self.known.items()
                          if (f not in writes or f in hoist) and v not in gone}
            self.reachable = True
            body(head)
            seen = self.written | set(hoist)
            # Invariants: one value, a number or a register the body leaves alone.
            found = {}
            for f, vals in self.values.items():
                (v, *others) = vals
                if others:
                    continue
                if not isinstance(v, tuple):
                    found[f] = v
                elif v[1] not in self.regs_written:
                    found[f] = Reg(v[1])
            new_hoist = {f: v for f, v in {**hoist, **found}.items()
                         if f not in self.values or f in found}
            if writes >= seen and new_hoist == hoist and regs >= self.regs_written:
                break
            if attempt == 3:  # pragma: no cover - three passes always suffice
                raise AssertionError("loop body writes different fields on each pass")
            writes |= seen
            regs |= self.regs_written
            hoist = new_hoist
            del self.code[saved[0]:]
            self.labels = dict(saved[1])
            self.incoming = collections.defaultdict(list, {k: list(v)
                                                           for k, v in saved[2].items()})
        # What the loop wrote counts for an enclosing loop, the preheader's writes included.
        self.written |= saved[3] | pre[0]
        for f, v in (*saved[4].items(), *pre[1].items()):
            self.values[f] |= v
        self.regs_written |= saved[5]

    def set_length(self, tensor, reg):
        """Register ``reg`` now holds the length in words of ``tensor`` (until it is written,
        or a label or loop comes)."""
        self.lengths[tensor] = int(reg)

    def length(self, tensor, rd, ref):
        """``rd`` = the length in words of ``tensor`` (buffer ``ref``): a copy of the register
        that holds it when the code before left it there (no LEN: its round trip, and the wait
        for a stream still appending to the buffer, are saved), else LEN."""
        known = self.lengths.get(tensor)
        if known is None:
            self.emit(Op.LEN, rd=int(rd), ra=int(ref))
        elif known != int(rd):
            self.alui(AluFn.ADD, rd, known, 0)
            self.lengths[tensor] = int(rd)

    def forget_lengths(self):
        """No register is known to hold a length any more (a buffer grows in place)."""
        self.lengths = {}

    def li(self, rd, imm):
        """``rd = imm``."""
        self.emit(Op.LI, rd=int(rd), imm=int(imm))

    def alui(self, fn, rd, ra, imm):
        """``rd = fn(ra, imm)``."""
        self.emit(Op.ALUI, fn=fn.value, rd=int(rd), ra=int(ra), imm=int(imm))

    def alu(self, fn, rd, ra, rb):
        """``rd = fn(ra, rb)``."""
        self.emit(Op.ALU, fn=fn.value, rd=int(rd), ra=int(ra), rb=int(rb))

    def field(self, f, v):
        """Set stream field ``f`` to register ``v`` (a :class:`Reg`) or to the value ``v``
        (written only if it is not known to hold it already)."""
        value = _reg_value(v) if isinstance(v, Reg) else int(v) & MASK32
        self.values[f].add(value)
        if self.known.get(f) == value:
            return
        if isinstance(v, Reg):
            self.emit(Op.SCFG, fn=f.value, ra=int(v))
        else:
            self.emit(Op.SCFGI, fn=f.value, imm=value)
        self.known[f] = value
        self.written.add(f)

    def stream(self, fn, *, a, n, a_base=0, a_stride=1, outer=1, a_ostride=0,
               b_mode=BMode.ZERO, b_val=0, b_stride=0, b_ostride=0, d_mode=DMode.DISCARD,
               d_ref=None, d_base=0, d_stride=1, shift=0, relu=False, sat=False, rd=0,
               run=True):
        """Configure and run one stream (only the fields it uses are written). With ``run``
        false, only configure it and return a function that emits its ``SRUN``: instructions
        between them may reuse the registers its fields were read from."""
        F = StreamField
        self.field(F.A_REF, a)
        self.field(F.A_BASE, a_base)
        self.field(F.A_STRIDE, a_stride)
        self.field(F.N, n)
        self.field(F.OUTER, outer)
        if isinstance(outer, Reg) or outer != 1:
            self.field(F.A_OSTRIDE, a_ostride)
        self.field(F.B_MODE, b_mode.value)
        if b_mode.value in B_LOCAL_MODES:
            self.field(F.B_VAL, b_val)
            self.field(F.B_STRIDE, b_stride)
            if isinstance(outer, Reg) or outer != 1:
                self.field(F.B_OSTRIDE, b_ostride)
        elif b_mode is BMode.SCALAR:
            self.field(F.B_VAL, b_val)
        self.field(F.D_MODE, d_mode.value)
        if d_mode.value in D_MU_MODES or d_mode is DMode.QUEUE:
            self.field(F.D_REF, d_ref)
        if d_mode is DMode.WRITE or d_mode.value in D_LOCAL_WRITES:
            self.field(F.D_BASE, d_base)
            self.field(F.D_STRIDE, d_stride)
        self.field(F.SHIFT, shift)
        self.field(F.POST, int(Post.RELU if relu else 0) | int(Post.SAT8 if sat else 0))
        rd = int(rd)
        reduces = {DMode.SUM: {rd}, DMode.MAX: {rd}, DMode.ARGMAX: {rd, rd + 1}}
        regs = reduces.get(d_mode, set())
        if isinstance(a, Reg) and int(a) in self.self_regs:
            # A stream over the input queue writes the steps it ran after its reduction's.
            regs = regs | {(rd + len(regs)) % 16}

        def srun():
            self._append(Op.SRUN, {"fn": fn.value, "rd": rd}, None, regs=regs)
        if not run:
            return srun
        srun()

    def assemble(self, offset):
        """The instructions, with branch targets resolved for a program where this code
        starts at pc ``offset``."""
        out = []
        for op, f, label in self.code:
            if label is not None:
                f = dict(f, imm=self.labels[label] + offset)
            out.append(Instr(op, **f))
        return out
