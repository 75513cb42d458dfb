"""Register bookkeeping of the lowering: named registers and the reference cache.

Every CU has 16 registers, used by convention:

``R0`` .. ``R7`` (:data:`TEMPS` of them)
    An op's temporaries, free at every op boundary. Some have fixed roles: :data:`COUNT`
    (``R2``) counts the rows of :func:`~rdakit.compiler.lower.templates.row_loop` and holds
    a dynamic tensor's length; :data:`SCALAR` (``R5``) takes a word READ from a buffer or
    reduced by a stream; :data:`PEER` (``R6``) holds the ID of the tile a message or an
    ALLOC goes to, and the reference RECV delivers (its weight lands in :data:`ARG`);
    :data:`ARG` (``R7``) holds SENDREF's weight and, in the prologue, the MU ID of the
    reference table; :data:`SINK` (``R0``) takes results nobody reads (VAPPEND's index).
``R8`` .. ``R14`` (:data:`REF_REGS`)
    Buffer references: a cache (:class:`RefFile`) backed by the CU's reference table when
    they do not fit.
``R15`` (:data:`TABLE`)
    The reference table itself (an MU buffer the CU allocates in its prologue).
"""

from rdakit.compiler.lower.layout import LoweringError
from rdakit.hdl.spec.isa import Op

__all__ = ["Reg", "R0", "R1", "R2", "R3", "R4", "R5", "R6", "R7", "TEMPS", "REF_REGS", "TABLE",
           "SINK", "COUNT", "SCALAR", "PEER", "ARG", "RefFile"]


class Reg(int):
    """A register operand (a plain int is an immediate)."""


R0, R1, R2, R3, R4, R5, R6, R7 = (Reg(i) for i in range(8))

#: Temporaries r0..r7.
TEMPS = 8
#: Registers holding buffer references (a cache of the reference table).
REF_REGS = tuple(range(8, 15))
#: The register holding the reference table.
TABLE = Reg(15)

#: A result nobody reads.
SINK = R0
#: Row counter of a row loop; length of a dynamic tensor.
COUNT = R2
#: A word READ from a buffer, or the scalar a stream reduces to.
SCALAR = R5
#: ID of a message's (or an ALLOC's) destination tile; the reference RECV delivers.
PEER = R6
#: SENDREF's weight; RECV's weight; the reference table's MU ID in the prologue.
ARG = R7


class RefFile:
    """Which buffer reference is in which register, and which are in the CU's reference table
    (an MU buffer the CU allocates in its prologue when references do not fit r8..r14)."""

    def __init__(self, asm, where):
        self.asm = asm
        self.where = where
        self.reg = {}
        self.occ = {}
        self.slot = {}
        self.pinned = set()
        self.used = {}
        self.tick = 0
        self.n_slots = 0
        self.table = False

    def preload(self, key, r):
        """Reference ``key`` is in register ``r`` when the program starts (a host buffer's)."""
        self.reg[key] = r
        self.occ[r] = key
        self._touch(key)

    def preload_slot(self, key, slot):
        """Reference ``key`` is in slot ``slot`` of the table when the program starts."""
        self.slot[key] = slot
        self.n_slots += 1
        self.table = True

    def _touch(self, key):
        self.tick += 1
        self.used[key] = self.tick

    def _free(self):
        """A free reference register, evicting the least recently used unpinned reference
        (spilled to the table the first time)."""
        for r in REF_REGS:
            if r not in self.occ:
                return r
        cands = [r for r in REF_REGS if self.occ[r] not in self.pinned]
        if not cands:
            raise LoweringError(f"{self.where}: an op needs more than {len(REF_REGS)} buffer "
                                f"references at once")
        r = min(cands, key=lambda r: (self.used[self.occ[r]], r))
        key = self.occ.pop(r)
        del self.reg[key]
        if key not in self.slot:
            # Spill to the table (V and the evicted register are clobbered).
            self.asm.emit(Op.VSET, fn=0, ra=r)
            self.asm.emit(Op.VAPPEND, rd=r, ra=TABLE)
            self.slot[key] = self.n_slots
            self.n_slots += 1
            self.table = True
        return r

    def get(self, key):
        """The register holding reference ``key``, loading it from the table if it was
        spilled; pinned until :meth:`unpin`."""
        if key in self.reg:
            r = self.reg[key]
        else:
            if key not in self.slot:
                raise AssertionError(f"{self.where}: reference {key!r} is not held")
            r = self._free()
            self.asm.li(r, self.slot[key])
            self.asm.emit(Op.READ, fn=0, rd=r, ra=TABLE, rb=r)
            self.reg[key] = r
            self.occ[r] = key
        self.pinned.add(key)
        self._touch(key)
        return Reg(r)

    def new(self, key):
        """A register for a new reference ``key`` (pinned)."""
        r = self._free()
        self.reg[key] = r
        self.occ[r] = key
        self.pinned.add(key)
        self._touch(key)
        return Reg(r)

    def drop(self, key):
        """Forget reference ``key`` (its last use is past)."""
        r = self.reg.pop(key, None)
        if r is not None:
            del self.occ[r]
        self.slot.pop(key, None)
        self.pinned.discard(key)

    def unpin(self, key=None):
        """Let ``key`` (default: every reference) be evicted again."""
        if key is None:
            self.pinned.clear()
        else:
            self.pinned.discard(key)
