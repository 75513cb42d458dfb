"""The assembler of one CU program: labels, loops, and stream fields written only when they
change."""

import collections

from rdakit.compiler.lower.layout import MASK32
from rdakit.compiler.lower.registers import Reg
from rdakit.hdl.spec.isa import BMode, DMode, Instr, Op, StreamField

__all__ = ["Assembler"]


def intersect(states):
    """The stream fields known, with the same value, in every state of ``states``."""
    first = states[0]
    return {f: v for f, v in first.items()
            if v is not None and all(s.get(f) == v for s in states[1:])}


class Assembler:
    """A CU program under construction: instructions with labels, and what is known of the
    stream fields at each point, so that a field is only written when its value changes.

    At a label the knowledge is the intersection over every way in; a loop's head forgets the
    fields its body writes (the body is emitted twice: once to find them, once for real)."""

    def __init__(self):
        self.code = []
        self.labels = {}
        self.incoming = collections.defaultdict(list)
        self.known = {f: 0 for f in StreamField}
        self.known[StreamField.OUTER] = 1
        self.reachable = True
        self.written = set()
        self._next = 0

    def __len__(self):
        return len(self.code)

    def emit(self, op, **fields):
        """Append instruction ``op`` (fields as :class:`~rdakit.hdl.spec.isa.Instr` names them;
        registers may be given as :class:`Reg`)."""
        self.code.append((op, {k: int(v) for k, v in fields.items()}, None))
        if op is Op.HALT:
            self.reachable = False

    def branch(self, op, label, **fields):
        """Append branch ``op`` to ``label`` (its ``imm`` is set by :meth:`assemble`)."""
        self.code.append((op, {k: int(v) for k, v in fields.items()}, label))
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

    def loop(self, body):
        """Emit ``body(head)``, which ends with a backward branch to ``head``."""
        saved = (len(self.code), dict(self.labels),
                 {k: list(v) for k, v in self.incoming.items()}, set(self.written))
        entry = dict(self.known)
        writes = set()
        for attempt in range(3):
            self.written = set()
            head = self.label()
            self.labels[head] = len(self.code)
            self.known = {f: v for f, v in entry.items() if f not in writes}
            self.reachable = True
            body(head)
            if writes >= self.written:
                break
            if attempt == 2:  # pragma: no cover - two passes always suffice
                raise AssertionError("loop body writes different fields on each pass")
            writes |= self.written
            del self.code[saved[0]:]
            self.labels = dict(saved[1])
            self.incoming = collections.defaultdict(list, {k: list(v)
                                                           for k, v in saved[2].items()})
        self.written |= saved[3]

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
        if isinstance(v, Reg):
            self.emit(Op.SCFG, fn=f.value, ra=int(v))
            self.known[f] = None
        else:
            v = int(v) & MASK32
            if self.known.get(f) == v:
                return
            self.emit(Op.SCFGI, fn=f.value, imm=v)
            self.known[f] = v
        self.written.add(f)

    def stream(self, fn, *, a, n, a_base=0, a_stride=1, outer=1, a_ostride=0,
               b_mode=BMode.ZERO, b_val=0, b_stride=0, b_ostride=0, d_mode=DMode.DISCARD,
               d_ref=None, d_base=0, d_stride=1, shift=0, relu=False, rd=0):
        """Configure and run one stream (only the fields it uses are written)."""
        F = StreamField
        self.field(F.A_REF, a)
        self.field(F.A_BASE, a_base)
        self.field(F.A_STRIDE, a_stride)
        self.field(F.N, n)
        self.field(F.OUTER, outer)
        if isinstance(outer, Reg) or outer != 1:
            self.field(F.A_OSTRIDE, a_ostride)
        self.field(F.B_MODE, b_mode.value)
        if b_mode is BMode.LOCAL:
            self.field(F.B_VAL, b_val)
            self.field(F.B_STRIDE, b_stride)
            if isinstance(outer, Reg) or outer != 1:
                self.field(F.B_OSTRIDE, b_ostride)
        elif b_mode is BMode.SCALAR:
            self.field(F.B_VAL, b_val)
        self.field(F.D_MODE, d_mode.value)
        if d_mode in (DMode.WRITE, DMode.APPEND, DMode.PACK_SUM):
            self.field(F.D_REF, d_ref)
        if d_mode in (DMode.WRITE, DMode.LOCAL, DMode.LOCAL_ACC):
            self.field(F.D_BASE, d_base)
            self.field(F.D_STRIDE, d_stride)
        self.field(F.SHIFT, shift)
        self.field(F.POST, int(relu))
        self.emit(Op.SRUN, fn=fn.value, rd=int(rd))

    def assemble(self, offset):
        """The instructions, with branch targets resolved for a program where this code
        starts at pc ``offset``."""
        out = []
        for op, f, label in self.code:
            if label is not None:
                f = dict(f, imm=self.labels[label] + offset)
            out.append(Instr(op, **f))
        return out
