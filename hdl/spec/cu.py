"""The compute unit's instruction classes and the stream engine's timing constants: what the
sequencer and the stream engine are built from and what the performance model
(:mod:`rdakit.sim.models.perf`), the docs' tables and the tests import, defined once here so
that the golden models never import a hardware component."""

from rdakit.hdl.spec.isa import BMode, DMode, Op
from rdakit.hdl.spec.packets import MUOp

__all__ = ["MU_OP", "MU_INSTRUCTIONS", "FENCED", "POSTED", "NONBLOCKING", "STREAM_TOUCHES",
           "STREAM_TOUCH_DOC", "STREAM_HAZARDS", "AFTER_STREAM", "D_MU_MODES", "D_LOCAL_WRITES",
           "D_LOCAL_READS", "B_LOCAL_MODES", "WQ_DEPTH",
           "EXEC_STAGES", "credit_batch"]

#: The D_MODE values whose results go to an MU (D_REF; OUTER_SUM's last outer iteration's).
D_MU_MODES = (DMode.WRITE.value, DMode.APPEND.value, DMode.PACK_SUM.value,
              DMode.OUTER_SUM.value)
#: The D_MODE values that write the local buffer, and those of them that read the word they
#: write (an accumulation).
D_LOCAL_WRITES = (DMode.LOCAL.value, DMode.LOCAL_ACC.value, DMode.OUTER_SUM.value)
D_LOCAL_READS = (DMode.LOCAL_ACC.value, DMode.OUTER_SUM.value)
#: The B_MODE values that read operand B from the local buffer.
B_LOCAL_MODES = (BMode.LOCAL.value, BMode.ELEM.value)

def credit_batch(queue_words):
    """How many credits a consumer gathers before it returns them in one message while its
    stream takes a word from its input queue every cycle (``DMode.QUEUE``): a quarter of the
    queue, at least 1. In any cycle it takes no word it returns what it owes at once, so a
    stall never keeps a credit from its producer."""
    return max(1, queue_words // 4)


#: Depth of the stream engine's queue of results waiting to be written to an MU.
WQ_DEPTH = 4

#: The stream engine's execute stages after S0 (S1: ``fn(a, b)``, the multiplier; S2: shift,
#: ReLU, delivery): a step popped in cycle ``t`` is delivered in cycle ``t + EXEC_STAGES``.
EXEC_STAGES = 2

MU_OP = {
    Op.ALLOC: MUOp.ALLOC, Op.READ: MUOp.READ, Op.VREAD: MUOp.READ, Op.VWRITE: MUOp.WRITE,
    Op.VAPPEND: MUOp.APPEND, Op.LEN: MUOp.LEN, Op.RET: MUOp.RETURN, Op.RETI: MUOp.RETURN,
    Op.ADDW: MUOp.ADD_WEIGHT, Op.INCREF: MUOp.INCREF, Op.DECREF: MUOp.DECREF,
    Op.FADD: MUOp.FETCH_ADD, Op.UNLOCK: MUOp.UNLOCK,
}

#: The instructions that send an MU a request (and the MU operation of each: ``MU_OP``).
MU_INSTRUCTIONS = tuple(MU_OP)


#: The instructions that wait until every posted stream write is acknowledged before they
#: act: what another CU or the host may observe after them (a token, a reference, a released
#: lock or ticket, the CU's done) must not overtake the writes. Every other request goes to an
#: MU over the same path as the writes to it and is served after them.
FENCED = (Op.SEND, Op.SENDREF, Op.HALT, Op.FADD, Op.UNLOCK)

#: The MU instructions that are posted like stream writes: their result is only a status, so
#: they retire once the request register takes them, with tag 2, and their acknowledgements are
#: counted with the stream's (a refused one halts the CU with MU_ERROR when it comes back).
POSTED = (Op.RET, Op.RETI, Op.DECREF, Op.VWRITE)

#: The MU instructions that do not block: they retire once their request leaves, and the
#: response writes ``rd`` when it arrives; an instruction naming that register, another MU
#: request or a fence waits for it (one such request at a time).
NONBLOCKING = (Op.ALLOC, Op.READ, Op.LEN)

#: What a stream in the engine touches, as far as the instructions after its SRUN care (the
#: engine holds one executing stream and one waiting behind it; SRUN retires as soon as the
#: engine takes the stream). Each is a bit of the scoreboard's entry for the stream:
#: ``a_ref``, the MU buffer it reads (A_REF); ``d_ref``, the MU buffer it writes or appends to
#: (D_REF, for a D_MODE of ``D_MU_MODES``); ``local_r`` and ``local_w``, the local buffer read
#: (B_MODE LOCAL or ELEM, D_MODE LOCAL_ACC or OUTER_SUM) and written (LOCAL, LOCAL_ACC,
#: OUTER_SUM); ``v``, the staging vector
#: (PACK_SUM).
STREAM_TOUCHES = ("a_ref", "d_ref", "local_r", "local_w", "v")

#: What each touch means, for the docs' table (``rdakit docs``); ``any`` is every stream.
STREAM_TOUCH_DOC = {
    "a_ref": "reads the MU buffer the instruction names (A_REF) and has reads still to issue",
    "d_ref": "writes or appends to the MU buffer the instruction names (D_REF)",
    "local_r": "reads the local buffer (B_MODE LOCAL or ELEM, D_MODE LOCAL_ACC or OUTER_SUM)",
    "local_w": "writes the local buffer (D_MODE LOCAL, LOCAL_ACC, OUTER_SUM)",
    "v": "builds V (D_MODE PACK_SUM)",
    "any": "any stream",
}

#: Per instruction, the touches of a stream it must wait for (every stream the engine holds
#: that has one of them): an MU request must not overtake a stream's writes to its buffer, nor
#: (when it changes or frees the buffer) the stream's reads of it — a request reaches an MU over
#: the same path as the stream's and is served after them, so it may leave once the stream's
#: reads have all been issued (``a_ref``) and once its writes have (the stream is done); LGET
#: and LSET must not overtake what a stream reads or writes in the local buffer;
#: what reads or writes ``V`` waits for PACK_SUM. ``"any"``: every stream (the fences).
#: ALLOC names a new buffer and waits for nothing; an instruction not listed waits only for a
#: stream whose reduction writes a register it names (a scoreboard of two entries), and SRUN
#: while a stream already waits in the engine.
STREAM_HAZARDS = {
    Op.ALLOC: (),
    Op.READ: ("d_ref",),
    Op.LEN: ("d_ref",),
    Op.VREAD: ("d_ref", "v"),
    Op.VWRITE: ("a_ref", "d_ref", "v"),
    Op.VAPPEND: ("a_ref", "d_ref", "v"),
    **{o: ("a_ref", "d_ref") for o in (Op.RET, Op.RETI, Op.DECREF, Op.INCREF, Op.ADDW)},
    **{o: ("any",) for o in FENCED},
    Op.VSET: ("v",),
    Op.VCLR: ("v",),
    Op.LGET: ("local_w",),
    Op.LSET: ("local_r", "local_w"),
}

#: The instructions that may wait for a stream the engine holds (:data:`STREAM_HAZARDS`).
AFTER_STREAM = tuple(STREAM_HAZARDS)
