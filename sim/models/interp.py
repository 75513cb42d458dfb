"""Functional interpreter: the golden model of a whole fabric, at the transaction level.

:class:`Interpreter` executes a :class:`~rdakit.hdl.spec.bitstream.FabricConfig` on the fabric
a :class:`~rdakit.hdl.spec.params.FabricParams` describes: one
:class:`~rdakit.sim.models.mu.MUModel` per MU tile (MU ID ``y << coord_bits | x``) and one CU
state per CU tile, each running the instruction set of ``docs/compute-unit.md``
(:mod:`rdakit.hdl.spec.isa`). Every MU operation of a CU is a request to the MU model named by the
reference, with the CU's coordinates as ``src``; tokens and references are delivered to the
destination CU at once. There is no notion of time: the only freedom is the interleaving of the
CUs, which is deterministic (round-robin) or seeded-random, so a race-free program gives the
same result under every schedule.

Scheduling
----------
A *step* is one instruction of one CU, or one step ``(o, i)`` of a running stream (``SRUN``
is executed a stream step at a time, so the MU requests of concurrent streams interleave). A CU
whose current instruction is a ``WAIT`` or ``RECV`` that cannot complete, or whose stream's
next step lacks a word of its input queue or a credit, is *blocked* and skipped (a blocked
instruction is not counted until it completes). ``round_robin`` runs the next
unblocked CU after the last one that ran, in row-major tile order; ``random`` picks an unblocked
CU uniformly with ``random.Random(seed)``. :meth:`Interpreter.run` returns when every enabled CU
has halted (``HALT`` or an error), raises :class:`DeadlockError` when every CU still running is
blocked, and :class:`StepLimitError` after ``max_steps`` steps (it can then be called again to
go on).

Semantics chosen where ``docs/compute-unit.md`` leaves room (the RTL must make the same choices)
-------------------------------------------------------------------------------------------------
* **Program memory** has ``prog_len`` words; words the configuration does not set are 0
  (``NOP``). Fetching at ``pc >= prog_len`` (by falling through or by a jump: the full 32-bit
  ``imm`` is compared) halts with ``PC_OUT_OF_RANGE``; an undefined opcode halts with
  ``BAD_INSTRUCTION`` when it is fetched, not when it is loaded.
* **Reported pc**: after ``HALT``, the pc of the ``HALT``; after an error, the pc of the
  instruction that failed (``SRUN`` for a stream), or the out-of-range pc. (The RTL posts stream
  writes, ``RET``, ``RETI``, ``DECREF`` and ``VWRITE``: a refusal of one of them halts it at the
  pc it has reached when the acknowledgement comes back, so compare only the code.) An
  overflow caused by an arriving message halts the *receiver* at whatever pc it is
  (timing-dependent in hardware: compare only the code).
* **Register fields** are taken modulo ``regs`` (as ``r[rd+1]`` is); **lane fields** (``READ``,
  ``VSET``) modulo ``lanes``. A **channel** (``SEND``, ``WAIT``) at or past ``channels`` or a
  **mailbox slot** (``SENDREF``, ``RECV``) at or past ``mailbox`` halts the executing CU with
  ``BAD_INSTRUCTION``.
* **Field truncation** as the packets have it: a register used as a reference keeps its low
  ``mu_id_bits + buf_id_bits`` bits (``mu`` low); an MU ID (``ALLOC``) its low ``mu_id_bits``;
  a CU ID (``SEND``, ``SENDREF``) its low ``2 * coord_bits`` (``x`` low); an index (``READ``,
  ``VREAD``, ``VWRITE``, stream addresses ``BASE + o*OSTRIDE + i*STRIDE``) its low
  ``index_bits`` (so a stride of ``-1``, i.e. ``0xffffffff``, walks backwards). ``WAIT imm``
  with ``imm > 65535`` never completes.
* **Bad destinations**: an MU request whose MU ID names a tile that is not an MU, or a token
  or reference sent to an ID that is not a CU tile (outside the grid, or an MU), halts the CU
  with ``BAD_DESTINATION`` before anything is sent.
* **Messages to a halted or disabled CU** are dropped (recorded in ``RunResult.dropped``); a
  halted CU's state no longer changes. A token that would take a counter past 65535 halts the
  receiver with ``TOKEN_OVERFLOW`` and is not added; a reference into a full slot halts it with
  ``MAILBOX_OVERFLOW`` and is not stored. A CU may send to itself.
* **Tokens**: ``SEND`` adds ``imm`` (32 bits) to the counter; ``WAIT aux, 0`` completes at once.
* **Streams** follow the pseudocode of ``docs/compute-unit.md`` step by step, in order: a step
  reads ``a`` from the MU, reads ``b`` from the local buffer (before the step's own local
  write), and then writes its result. A stream whose writes alias its own later reads (an MU
  word or a local word written at step ``k`` and read at a later step) therefore sees the new
  value here; the hardware issues reads ahead and may not, so such a stream is undefined.
  ``SHIFT`` is taken modulo 32 (like the ALU's shifts); ``POST`` uses bits 0 and 1 only
  (:class:`~rdakit.hdl.spec.isa.Post`), and in ``PACK_SUM`` both apply to each sum. ``N = 0``,
  ``OUTER = 0``, a ``B_MODE`` that is not a :class:`~rdakit.hdl.spec.isa.BMode` or a ``D_MODE``
  that is not a :class:`~rdakit.hdl.spec.isa.DMode`, are ``BAD_STREAM``. ``rd`` is written only by
  ``SUM``, ``MAX`` and ``ARGMAX`` (and ``r[rd+1]`` by ``ARGMAX``); ``V`` is changed only by
  ``PACK_SUM``, which starts from ``V = 0``, clears ``V`` after every append and so always
  leaves ``V = 0``. An MU error at step ``k`` halts with ``MU_ERROR`` with the writes of the
  steps before ``k`` applied (in hardware, which of them land is timing-dependent).
* **Streams between CUs** (``docs/compute-unit.md``, "Streams between CUs"): a step of a
  stream whose ``D_MODE`` is ``QUEUE`` needs a credit (the producer starts with
  ``queue_words``) and puts its result, marked last on the stream's last step, at the end of
  the input queue of the CU ``D_REF`` names; a step of a stream whose ``A_REF`` is the CU's own
  ID needs a word in its input queue, takes it as ``a`` and gives a credit back at once to the
  CU that sent the last word received (the RTL batches credits: only timing differs). Such a
  stream ends after the step that takes a word marked last and writes its step count to
  ``r[rd + w]``, ``w`` the registers its reduction writes. A step that lacks its word or its
  credit blocks the CU like a ``WAIT`` (it takes both before it runs: a program must not
  depend on the RTL's pipeline taking a word before its credit is there). A word arriving at
  a full queue, or a credit taking a producer past ``queue_words``, halts the receiver with
  ``QUEUE_OVERFLOW`` (it is dropped); words and credits for a halted CU are dropped.
* **Host requests** (:meth:`Interpreter.host_request`) go to the MU model of the named tile
  with ``src`` = that tile and the host bit of ``tag`` set
  (:func:`~rdakit.hdl.spec.packets.host_tag_bit`) unless the request says otherwise; they are
  not counted as CU operations.
"""

import collections
import random
import struct

import numpy as np

from rdakit.hdl.spec.bitstream import FabricConfig
from rdakit.hdl.spec.config import CU_STATUS_BITS
from rdakit.hdl.spec.cu import D_MU_MODES
from rdakit.hdl.spec.isa import AluFn, BMode, DMode, Op, Post, StreamField, alu, post
from rdakit.hdl.spec.packets import MUOp, MUStatus, host_tag_bit
from rdakit.hdl.spec.params import FabricParams
from rdakit.hdl.spec.vector import MASK32, pack_vector, unpack_vector, vector_lanes
from rdakit.sim.models.cu_state import (
    CUMachine,
    CUState,
    DeadlockError,
    Halt,
    HostError,
    InterpreterError,
    Message,
    RunResult,
    StepLimitError,
    Transaction,
    tile_id,
)
from rdakit.sim.models.mu import MUModel

__all__ = [
    "Interpreter", "RunResult", "CUState", "Message", "Transaction",
    "InterpreterError", "DeadlockError", "StepLimitError", "HostError",
    "tile_id", "pack_vector", "unpack_vector",
]

SCHEDULES = ("round_robin", "random")

#: Largest value of a token counter (16 bits).
TOKEN_MAX = 0xffff

_NONE = CU_STATUS_BITS["NONE"]
_MU_ERROR = CU_STATUS_BITS["MU_ERROR"]
_BAD_INSTRUCTION = CU_STATUS_BITS["BAD_INSTRUCTION"]
_PC_OUT_OF_RANGE = CU_STATUS_BITS["PC_OUT_OF_RANGE"]
_MAILBOX_OVERFLOW = CU_STATUS_BITS["MAILBOX_OVERFLOW"]
_TOKEN_OVERFLOW = CU_STATUS_BITS["TOKEN_OVERFLOW"]
_BAD_STREAM = CU_STATUS_BITS["BAD_STREAM"]
_BAD_DESTINATION = CU_STATUS_BITS["BAD_DESTINATION"]
_QUEUE_OVERFLOW = CU_STATUS_BITS["QUEUE_OVERFLOW"]

# Request tags (docs/compute-unit.md, Messages).
_TAG_BLOCKING, _TAG_STREAM_READ, _TAG_STREAM_WRITE = 0, 1, 2

_SF = StreamField

#: The registers a stream's reduction writes from ``rd`` on (a stream reading the input queue
#: writes its step count to the next one).
_REDUCED_REGS = {DMode.SUM: 1, DMode.MAX: 1, DMode.ARGMAX: 2}


def _signed(v):
    v &= MASK32
    return v - (1 << 32) if v & (1 << 31) else v


# A stream step's lanes a vector at a time (issue 21: the step is the interpreter's hot loop).
# Each function takes the lanes of ``a`` (unsigned 32-bit) and of ``b`` (any integers, taken
# modulo 2**32 as :func:`~rdakit.hdl.spec.isa.alu` takes them) and returns what ``alu`` returns
# for each lane; ``(v ^ _H) - _H`` is the signed value of an unsigned 32-bit ``v``.
# tests/sim/test_interp_lanes.py checks every function against ``alu``.
_H = 1 << 31
_M = MASK32
_VECTOR_ALU = {
    AluFn.ADD: lambda a, b: [(x + y) & _M for x, y in zip(a, b, strict=True)],
    AluFn.SUB: lambda a, b: [(x - y) & _M for x, y in zip(a, b, strict=True)],
    AluFn.MUL: lambda a, b: [(x * y) & _M for x, y in zip(a, b, strict=True)],
    AluFn.AND: lambda a, b: [x & y & _M for x, y in zip(a, b, strict=True)],
    AluFn.OR: lambda a, b: [(x | y) & _M for x, y in zip(a, b, strict=True)],
    AluFn.XOR: lambda a, b: [(x ^ y) & _M for x, y in zip(a, b, strict=True)],
    AluFn.SHL: lambda a, b: [(x << (y & 31)) & _M for x, y in zip(a, b, strict=True)],
    AluFn.SHR: lambda a, b: [(((x ^ _H) - _H) >> (y & 31)) & _M
                             for x, y in zip(a, b, strict=True)],
    AluFn.SHRU: lambda a, b: [x >> (y & 31) for x, y in zip(a, b, strict=True)],
    AluFn.MIN: lambda a, b: [x if (x ^ _H) <= ((y & _M) ^ _H) else y & _M
                             for x, y in zip(a, b, strict=True)],
    AluFn.MAX: lambda a, b: [x if (x ^ _H) >= ((y & _M) ^ _H) else y & _M
                             for x, y in zip(a, b, strict=True)],
    AluFn.SLT: lambda a, b: [int((x ^ _H) < ((y & _M) ^ _H))
                             for x, y in zip(a, b, strict=True)],
    AluFn.SEQ: lambda a, b: [int(x == y & _M) for x, y in zip(a, b, strict=True)],
    AluFn.RELU: lambda a, b: [0 if x & _H else x for x in a],
    AluFn.PASS: lambda a, b: list(a),
    AluFn.SEL: lambda a, b: [x if y & _M else 0 for x, y in zip(a, b, strict=True)],
}
_VECTOR_ALU.update({fn.value: f for fn, f in list(_VECTOR_ALU.items())})


def _vector_post(res, shift, bits):
    """A step's lanes after the stream's ``SHIFT`` and ``POST`` (:func:`~rdakit.hdl.spec.\
isa.post`), unsigned: ``_signed(v) >> shift``, 0 if negative and ``Post.RELU``, clamped to
    int8 if ``Post.SAT8``, modulo 2**32."""
    if bits & Post.SAT8:
        return [post((v ^ _H) - _H, shift, bits) & _M for v in res]
    if bits:
        return [0 if v & _H else v >> shift for v in res]
    if shift:
        return [(((v ^ _H) - _H) >> shift) & _M for v in res]
    return res


class Interpreter:
    """Execute a fabric configuration on golden models of its tiles.

    Parameters
    ----------
    params : FabricParams
        The fabric.
    config : FabricConfig
        What every CU runs; ``config.params`` must equal ``params``. CU tiles it does not
        list are disabled.
    schedule : str
        ``"round_robin"`` or ``"random"`` (see the module docstring).
    seed : int
        Seed of the ``"random"`` schedule.
    trace : bool
        Record every MU request of a CU (:attr:`transactions`) and every message
        (:attr:`messages`).

    Members
    -------
    params : FabricParams
    steps : int
        Steps run so far.
    transactions : list of Transaction
        With ``trace=True``: the CU requests, in order.
    messages : list of Message
        With ``trace=True``: the tokens and references sent, in order.

    Raises
    ------
    TypeError
        If an argument has the wrong type or ``schedule`` is unknown.
    ValueError
        If ``config.params`` is not ``params``, or a reference does not fit a 32-bit register.
    BitstreamError
        If the configuration cannot be loaded (:meth:`FabricConfig.validate`: a program for an
        MU tile, a program too long, ...; or an instruction word wider than 64 bits).
    """

    def __init__(self, params, config, *, schedule="round_robin", seed=0, trace=False):
        if not isinstance(params, FabricParams):
            raise TypeError(f"params must be a FabricParams, not {params!r}")
        if not isinstance(config, FabricConfig):
            raise TypeError(f"config must be a FabricConfig, not {config!r}")
        if schedule not in SCHEDULES:
            raise TypeError(f"schedule must be 'round_robin' or 'random', not {schedule!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an integer, not {seed!r}")
        if config.params != params:
            raise ValueError("config.params must be the interpreter's params; the configuration "
                             "was made for another fabric")
        mp = params.mu
        if mp.mu_id_bits + mp.buf_id_bits > 32:
            raise ValueError(f"A reference ({mp.mu_id_bits} + {mp.buf_id_bits} bits) must fit a "
                             f"32-bit register")
        config.validate()
        self.params = params
        self._schedule = schedule
        self._rng = random.Random(seed)
        self._trace = trace
        self._lanes = params.cu.lanes
        self._regs = params.cu.regs
        self._prog_len = params.cu.prog_len
        self._mu_bits = mp.mu_id_bits
        self._mu_mask = (1 << mp.mu_id_bits) - 1
        self._buf_mask = (1 << mp.buf_id_bits) - 1
        self._ref_mask = (1 << (mp.mu_id_bits + mp.buf_id_bits)) - 1
        self._index_mask = (1 << mp.index_bits) - 1
        self._id_mask = (1 << (2 * params.coord_bits)) - 1

        self._mus = {(x, y): MUModel(mp, params.mu_id(x, y)) for x, y in params.tiles("M")}
        self._mu_ops = {xy: collections.Counter() for xy in self._mus}
        # MU ID -> ((x, y), its model or None), filled as requests name them (mu_coords and the
        # tile lookup cost a microsecond, and every stream step makes one or two requests).
        self._mu_routes = {}
        self._mu_errors = dict.fromkeys(self._mus, 0)
        self._cus = {(x, y): CUMachine(x, y, tile_id(params, x, y), params,
                                       config.tiles.get((x, y)))
                     for x, y in params.tiles("C")}
        self._order = list(self._cus.values())       # row-major
        self._rr = 0
        self.steps = 0
        self.host_requests = 0
        self.dropped = []
        self.transactions = []
        self.messages = []

    # Tiles.

    def mu(self, x, y):
        """The :class:`MUModel` of the MU at ``(x, y)``."""
        try:
            return self._mus[(x, y)]
        except KeyError:
            raise ValueError(f"Tile ({x}, {y}) must be a memory unit of the "
                             f"{self.params.rows}x{self.params.cols} fabric") from None

    def state(self, x, y):
        """A :class:`CUState` snapshot of the CU at ``(x, y)``."""
        try:
            cu = self._cus[(x, y)]
        except KeyError:
            raise ValueError(f"Tile ({x}, {y}) must be a compute unit of the "
                             f"{self.params.rows}x{self.params.cols} fabric") from None
        return self._snapshot(cu)

    def _snapshot(self, cu):
        return CUState(
            x=cu.x, y=cu.y, id=cu.id, enabled=cu.enabled, done=cu.halted,
            error=cu.code != _NONE, code=cu.code, pc=cu.pc, regs=tuple(cu.regs),
            V=np.array(cu.V, dtype=np.uint32).view(np.int32),
            local=np.array(cu.local, dtype=np.uint32).view(np.int32),
            tokens=tuple(cu.tokens), mailbox=tuple(cu.mailbox),
            instructions=cu.instructions, stream_steps=cu.stream_steps, requests=cu.requests,
            tokens_sent=cu.tokens_sent, refs_sent=cu.refs_sent)

    def result(self):
        """A :class:`RunResult` of the current state."""
        return RunResult(
            cus={xy: self._snapshot(cu) for xy, cu in self._cus.items()},
            mu_ops={xy: collections.Counter(c) for xy, c in self._mu_ops.items()},
            mu_errors=dict(self._mu_errors), steps=self.steps,
            finished=all(cu.halted for cu in self._order), dropped=tuple(self.dropped))

    # References.

    def make_ref(self, mu_xy, buf):
        """The register form of the reference to buffer ID ``buf`` of the MU at ``mu_xy``."""
        return tile_id(self.params, *mu_xy) | buf << self._mu_bits

    def ref_fields(self, ref):
        """``{mu, buf}`` of a reference in register form."""
        return {"mu": ref & self._mu_mask, "buf": (ref >> self._mu_bits) & self._buf_mask}

    def _ref_int(self, ref):
        if isinstance(ref, dict):
            return ref.get("mu", 0) | ref.get("buf", 0) << self._mu_bits
        return int(ref)

    # The host port.

    def set_register(self, cu_xy, r, value):
        """Set the initial value of register ``r`` of the CU at ``cu_xy``, as the host writes
        ``CU_MAP.REGS`` before ``start`` (for instance a reference :meth:`load_buffer`
        returned). Only before the first step.

        Raises
        ------
        InterpreterError
            If the run has begun.
        """
        cu = self._cus.get(tuple(cu_xy))
        if cu is None:
            raise ValueError(f"Tile {tuple(cu_xy)} must be a compute unit of the "
                             f"{self.params.rows}x{self.params.cols} fabric")
        if not 0 <= r < self._regs:
            raise ValueError(f"Register must be between 0 and {self._regs - 1}, not {r!r}")
        if self.steps:
            raise InterpreterError("Registers are loaded at start: set_register must be called "
                                   "before the run begins")
        cu.regs[r] = int(value) & MASK32

    def host_request(self, mu_xy, request):
        """Send one request to the MU at ``mu_xy`` as the host port would; return its response.

        ``request`` is a dict of :func:`~rdakit.hdl.spec.packets.mu_request_layout` fields (as
        :meth:`MUModel.request` takes); ``src`` defaults to ``mu_xy`` and ``tag`` to the host
        bit.
        """
        model = self.mu(*mu_xy)
        req = dict(request)
        req.setdefault("src", {"x": mu_xy[0], "y": mu_xy[1]})
        req.setdefault("tag", 1 << host_tag_bit(self.params.mu))
        self.host_requests += 1
        return model.request(req)

    def _host_ok(self, mu_xy, request):
        resp = self.host_request(mu_xy, request)
        if resp["status"] is not MUStatus.OK:
            raise HostError(f"Host {MUOp(request['op']).name} to MU {tuple(mu_xy)} failed "
                            f"with {resp['status'].name}", resp)
        return resp

    def load_buffer(self, mu_xy, array, weight=1):
        """Allocate a buffer of total weight ``weight`` in the MU at ``mu_xy``, append the rows
        of ``array`` and return its reference (register form).

        Parameters
        ----------
        array : array-like of int, shape ``(words, lanes)``
            Signed or unsigned 32-bit elements.

        Raises
        ------
        ValueError
            If ``array`` is not two-dimensional with ``lanes`` columns.
        HostError
            If the MU refuses the allocation or an append.
        """
        a = np.asarray(array)
        if a.ndim != 2 or a.shape[1] != self._lanes:
            raise ValueError(f"array must have shape (words, {self._lanes}), not {a.shape}")
        resp = self._host_ok(mu_xy, {"op": MUOp.ALLOC, "data": weight})
        ref = resp["ref"]
        for row in a.tolist():
            self._host_ok(mu_xy, {"op": MUOp.APPEND, "ref": ref, "data": pack_vector(row)})
        return self._ref_int(ref)

    def read_buffer(self, mu_xy, ref):
        """The words of buffer ``ref`` (register form or ``{mu, buf}``) of the MU at
        ``mu_xy``, as a ``numpy.int32`` array of shape ``(length, lanes)``.

        Raises
        ------
        HostError
            If the reference is not valid there (for instance freed).
        """
        fields = self.ref_fields(self._ref_int(ref))
        n = self._host_ok(mu_xy, {"op": MUOp.LEN, "ref": fields})["data"]
        out = np.zeros((n, self._lanes), dtype=np.int32)
        for i in range(n):
            word = self._host_ok(mu_xy, {"op": MUOp.READ, "ref": fields, "index": i})["data"]
            out[i] = unpack_vector(word, self._lanes)
        return out

    # Scheduling.

    def run(self, max_steps=1_000_000):
        """Run until every CU has halted.

        Returns
        -------
        RunResult

        Raises
        ------
        DeadlockError
            If every CU still running is blocked in ``WAIT`` or ``RECV``, or in a stream
            waiting for a word of its input queue or for a credit.
        StepLimitError
            If ``max_steps`` steps did not finish the run (``run`` may be called again).
        """
        if not isinstance(max_steps, int) or max_steps < 0:
            raise TypeError(f"max_steps must be a non-negative integer, not {max_steps!r}")
        for _ in range(max_steps):
            cu = self._pick()
            if cu is None:
                return self.result()
            self.steps += 1
            self._step(cu)
        if all(cu.halted for cu in self._order):
            return self.result()
        raise StepLimitError(max_steps, self.result())

    def _pick(self):
        """The CU to step next; None if all have halted; DeadlockError if all are blocked."""
        order = self._order
        if self._schedule == "round_robin":
            n = len(order)
            for j in range(n):
                cu = order[(self._rr + j) % n]
                if not cu.halted and self._blocked(cu) is None:
                    self._rr = (self._rr + j + 1) % n
                    return cu
        else:
            ready = [cu for cu in order if not cu.halted and self._blocked(cu) is None]
            if ready:
                return self._rng.choice(ready)
        blocked = {cu.xy: f"at pc {cu.pc}: {self._blocked(cu)}" for cu in order
                   if not cu.halted}
        if not blocked:
            return None
        raise DeadlockError(blocked, self.result())

    def _blocked(self, cu):
        """What the CU waits for, or None if its next step can run."""
        if cu.stream is not None:
            need = cu.stream_need
            if need is None:
                return None
            pops, dst = need
            if pops and not cu.queue:
                return "SRUN waits for a word in its input queue"
            if dst is not None and cu.credits == 0:
                return f"SRUN waits for a credit to send to CU {dst}"
            return None
        if cu.pc >= self._prog_len:
            return None
        ins = cu.program[cu.pc]
        if ins is None:
            return None
        if ins.op is Op.WAIT and ins.aux < len(cu.tokens) and cu.tokens[ins.aux] < ins.imm:
            return (f"WAIT for {ins.imm} tokens on channel {ins.aux} (has "
                    f"{cu.tokens[ins.aux]})")
        if ins.op is Op.RECV and ins.aux < len(cu.mailbox) and cu.mailbox[ins.aux] is None:
            return f"RECV on mailbox slot {ins.aux} (empty)"
        return None

    def _step(self, cu):
        try:
            if cu.stream is not None:
                self._advance_stream(cu)
            else:
                self._execute(cu)
        except Halt as h:
            self._halt(cu, h.code)

    def _halt(self, cu, code):
        cu.halted = True
        cu.code = code
        cu.stream_need = None
        if cu.stream is not None:
            cu.stream.close()
            cu.stream = None

    # Instructions.

    def _execute(self, cu):
        pc = cu.pc
        if pc >= self._prog_len:
            raise Halt(_PC_OUT_OF_RANGE)
        ins = cu.program[pc]
        if ins is None:
            raise Halt(_BAD_INSTRUCTION)
        op = ins.op
        r = cu.regs
        rmask = self._regs - 1
        rd, ra, rb = ins.rd & rmask, ins.ra & rmask, ins.rb & rmask
        imm = ins.imm
        nxt = pc + 1
        send = None

        if op is Op.NOP:
            pass
        elif op is Op.HALT:
            cu.instructions += 1
            cu.halted = True
            return
        elif op is Op.LI:
            r[rd] = imm
        elif op is Op.ALU:
            r[rd] = alu(ins.fn, r[ra], r[rb])
        elif op is Op.ALUI:
            r[rd] = alu(ins.fn, r[ra], imm)
        elif op is Op.JMP:
            nxt = imm
        elif op is Op.BNZ:
            if r[ra]:
                nxt = imm
        elif op is Op.BZ:
            if not r[ra]:
                nxt = imm
        elif op is Op.BLT:
            if _signed(r[ra]) < _signed(r[rb]):
                nxt = imm
        elif op is Op.LOOP:
            r[ra] = (r[ra] - 1) & MASK32
            if r[ra]:
                nxt = imm
        elif op is Op.ALLOC:
            resp = self._request(cu, MUOp.ALLOC, r[ra] & self._mu_mask, data=imm)
            r[rd] = self._ref_int(resp["ref"])
        elif op is Op.READ:
            resp = self._request(cu, MUOp.READ, r[ra], index=r[rb])
            r[rd] = vector_lanes(resp["data"], self._lanes)[ins.fn % self._lanes]
        elif op is Op.VREAD:
            cu.V = vector_lanes(self._request(cu, MUOp.READ, r[ra], index=r[rb])["data"],
                                self._lanes)
        elif op is Op.VWRITE:
            self._request(cu, MUOp.WRITE, r[ra], index=r[rb], data=pack_vector(cu.V))
        elif op is Op.VAPPEND:
            r[rd] = self._request(cu, MUOp.APPEND, r[ra], data=pack_vector(cu.V))["data"]
        elif op is Op.VSET:
            cu.V = list(cu.V)
            cu.V[ins.fn % self._lanes] = r[ra]
        elif op is Op.VCLR:
            cu.V = [0] * self._lanes
        elif op is Op.LGET:
            w, ln = divmod((r[rb] + imm) % (len(cu.local) * self._lanes), self._lanes)
            r[rd] = cu.local[w][ln]
        elif op is Op.LSET:
            w, ln = divmod((r[rb] + imm) % (len(cu.local) * self._lanes), self._lanes)
            cu.local[w] = list(cu.local[w])
            cu.local[w][ln] = r[ra]
        elif op is Op.LEN:
            r[rd] = self._request(cu, MUOp.LEN, r[ra])["data"]
        elif op is Op.RET:
            self._request(cu, MUOp.RETURN, r[ra], data=r[rb])
        elif op is Op.RETI:
            self._request(cu, MUOp.RETURN, r[ra], data=imm)
        elif op is Op.ADDW:
            self._request(cu, MUOp.ADD_WEIGHT, r[ra], data=imm)
        elif op is Op.INCREF:
            self._request(cu, MUOp.INCREF, r[ra])
        elif op is Op.DECREF:
            self._request(cu, MUOp.DECREF, r[ra])
        elif op is Op.FADD:
            k = _signed(imm) & ((1 << 32 * self._lanes) - 1)
            r[rd] = self._request(cu, MUOp.FETCH_ADD, r[ra], index=r[rb], data=k)["data"] \
                & MASK32
        elif op is Op.UNLOCK:
            self._request(cu, MUOp.UNLOCK, r[ra], index=r[rb], data=r[rd])
        elif op is Op.SEND:
            if ins.aux >= len(cu.tokens):
                raise Halt(_BAD_INSTRUCTION)
            self._check_cu_id(r[ra])
            send = (r[ra], "token", ins.aux, 0, imm)
        elif op is Op.WAIT:
            if ins.aux >= len(cu.tokens):
                raise Halt(_BAD_INSTRUCTION)
            if cu.tokens[ins.aux] < imm:
                return                                   # blocked (the scheduler skips it)
            cu.tokens[ins.aux] -= imm
        elif op is Op.SENDREF:
            if ins.aux >= len(cu.mailbox):
                raise Halt(_BAD_INSTRUCTION)
            self._check_cu_id(r[rd])
            send = (r[rd], "ref", ins.aux, r[ra] & self._ref_mask, r[rb])
        elif op is Op.RECV:
            if ins.aux >= len(cu.mailbox):
                raise Halt(_BAD_INSTRUCTION)
            slot = cu.mailbox[ins.aux]
            if slot is None:
                return                                   # blocked
            r[rd], r[(rd + 1) & rmask] = slot
            cu.mailbox[ins.aux] = None
        elif op is Op.SCFG:
            cu.fields[ins.fn] = r[ra]
        elif op is Op.SCFGI:
            cu.fields[ins.fn] = imm
        elif op is Op.SRUN:
            cu.stream = self._stream(cu, ins.fn, rd)
            self._advance_stream(cu)
            return
        elif op is Op.SELF:
            r[rd] = cu.id
        else:  # pragma: no cover - every Op is handled above
            raise AssertionError(op)

        cu.pc = nxt
        cu.instructions += 1
        if send is not None:
            # After the sender's own update, so a message to itself that overflows halts it
            # at the next pc.
            self._send(cu, pc, *send)

    def _request(self, cu, op, ref, *, index=0, data=0, tag=_TAG_BLOCKING):
        """Apply one MU request of ``cu``; return the response, or halt with MU_ERROR."""
        mu_id = ref & self._mu_mask
        route = self._mu_routes.get(mu_id)
        if route is None:
            xy = self.params.mu_coords(mu_id)
            route = self._mu_routes[mu_id] = (xy, self._mus.get(xy))
        (x, y), model = route
        if model is None:
            raise Halt(_BAD_DESTINATION)   # not an MU: the CU halts before sending
        req = {"op": op, "src": {"x": cu.x, "y": cu.y}, "tag": tag,
               "ref": {"mu": mu_id, "buf": (ref >> self._mu_bits) & self._buf_mask},
               "index": index & self._index_mask, "data": data}
        resp = model.request(req)
        cu.requests += 1
        self._mu_ops[(x, y)][op] += 1
        if self._trace:
            self.transactions.append(Transaction(self.steps, cu.xy, (x, y), req, resp))
        if resp["status"] is not MUStatus.OK:
            self._mu_errors[(x, y)] += 1
            raise Halt(_MU_ERROR)
        return resp

    def _names_mu(self, ref):
        """Whether ``ref``'s MU ID names an MU tile of the grid."""
        return self.params.mu_coords(ref & self._mu_mask) in self._mus

    def _check_cu_id(self, dst_id):
        """Halt with BAD_DESTINATION unless ``dst_id`` names a CU tile of the grid."""
        x, y = self.params.mu_coords(dst_id & self._id_mask)
        if (x, y) not in self._cus and not (x < self.params.cols and y < self.params.rows
                                            and self.params.kind(x, y) == "C"):
            raise Halt(_BAD_DESTINATION)

    def _describe(self, x, y):
        p = self.params
        if not (x < p.cols and y < p.rows):
            return f"outside the {p.rows}x{p.cols} grid"
        return "a compute unit" if p.kind(x, y) == "C" else "a memory unit"

    def _send(self, cu, pc, dst_id, kind, tag, ref, data):
        dst_id &= self._id_mask
        x, y = self.params.mu_coords(dst_id)
        dst = self._cus.get((x, y))
        if dst is None:
            # _check_cu_id halted the sender before: this is the interpreter's own bug.
            raise InterpreterError(f"message from CU {cu.xy} at pc {pc} to tile ({x}, {y}), "
                                   f"which is {self._describe(x, y)}")
        msg = Message(self.steps, cu.xy, dst.xy, kind, tag, ref, data)
        if kind == "token":
            cu.tokens_sent += 1
        else:
            cu.refs_sent += 1
        if self._trace:
            self.messages.append(msg)
        if dst.halted:
            self.dropped.append(msg)
        elif kind == "token":
            if dst.tokens[tag] + data > TOKEN_MAX:
                self._halt(dst, _TOKEN_OVERFLOW)
            else:
                dst.tokens[tag] += data
        elif dst.mailbox[tag] is not None:
            self._halt(dst, _MAILBOX_OVERFLOW)
        else:
            dst.mailbox[tag] = (ref, data)

    # Streams.

    def _advance_stream(self, cu):
        try:
            next(cu.stream)
        except StopIteration:
            cu.stream = None
            cu.pc += 1
            cu.instructions += 1

    def _stream(self, cu, fn, rd):
        """SRUN as a generator: each ``next`` runs one step ``(o, i)``; the last one finishes
        the instruction. Raises Halt on an error."""
        f = list(cu.fields)
        n, outer = f[_SF.N.value], f[_SF.OUTER.value]
        if n == 0 or outer == 0:
            raise Halt(_BAD_STREAM)
        try:
            bmode = BMode(f[_SF.B_MODE.value])
            dmode = DMode(f[_SF.D_MODE.value])
        except ValueError:
            raise Halt(_BAD_STREAM) from None
        lanes = self._lanes
        local = cu.local
        lw = len(local)
        shift = f[_SF.SHIFT.value] & 31
        bits = f[_SF.POST.value] & (Post.RELU | Post.SAT8)
        a_ref, a_base = f[_SF.A_REF.value], f[_SF.A_BASE.value]
        a_stride, a_ostride = f[_SF.A_STRIDE.value], f[_SF.A_OSTRIDE.value]
        b_val, b_stride, b_ostride = (f[_SF.B_VAL.value], f[_SF.B_STRIDE.value],
                                      f[_SF.B_OSTRIDE.value])
        d_ref, d_base, d_stride = f[_SF.D_REF.value], f[_SF.D_BASE.value], f[_SF.D_STRIDE.value]
        # Like the RTL, both destinations are checked before the first request is sent. An
        # A_REF naming this CU is its input queue; a QUEUE stream's D_REF names a CU.
        pops = (a_ref & self._id_mask) == cu.id
        if ((not pops and not self._names_mu(a_ref))
                or (dmode.value in D_MU_MODES and not self._names_mu(d_ref))):
            raise Halt(_BAD_DESTINATION)
        q_dst = None
        if dmode is DMode.QUEUE:
            self._check_cu_id(d_ref)
            q_dst = self._cus[self.params.mu_coords(d_ref & self._id_mask)]
        need = (pops, q_dst.xy if q_dst is not None else None)
        zero = [0] * lanes
        scalar = [b_val] * lanes
        vector_alu = _VECTOR_ALU[fn]       # fn is a 4-bit field: every value is an AluFn
        step_post = _vector_post
        if dmode in (DMode.PACK_SUM, DMode.OUTER_SUM):
            # SHIFT and POST apply to each sum, not to each step.
            sum_shift, sum_bits, shift, bits = shift, bits, 0, 0
        lane_format = struct.Struct(f"<{lanes}I")
        unpack_lanes, pack_lanes = lane_format.unpack, lane_format.pack
        nbytes = 4 * lanes
        from_bytes = int.from_bytes
        total = 0                       # SUM
        best, best_index = None, 0      # MAX, ARGMAX
        if dmode is DMode.PACK_SUM:
            cu.V = [0] * lanes
        k = 0
        ended = False                   # a word marked last was taken (A from the queue)
        for o in range(outer):
            acc = 0
            for i in range(n):
                if k:
                    yield
                if pops or q_dst is not None:
                    # The step needs a word from the queue and a credit before it runs.
                    cu.stream_need = need
                    while (pops and not cu.queue) or (q_dst is not None and cu.credits == 0):
                        yield
                    cu.stream_need = None
                if pops:
                    word, ended = self._pop_word(cu)
                else:
                    word = self._request(cu, MUOp.READ, a_ref, tag=_TAG_STREAM_READ,
                                         index=a_base + o * a_ostride + i * a_stride)["data"]
                a = unpack_lanes(word.to_bytes(nbytes, "little"))
                if bmode is BMode.ZERO:
                    b = zero
                elif bmode is BMode.LOCAL:
                    b = local[(b_val + o * b_ostride + i * b_stride) % lw]
                elif bmode is BMode.ELEM:
                    e = (b_val + o * b_ostride + i * b_stride) & MASK32
                    b = [local[(e // lanes) % lw][e % lanes]] * lanes
                else:
                    b = scalar
                res = step_post(vector_alu(a, b), shift, bits)

                if dmode is DMode.WRITE:
                    self._request(cu, MUOp.WRITE, d_ref, index=d_base + k * d_stride,
                                  data=from_bytes(pack_lanes(*res), "little"),
                                  tag=_TAG_STREAM_WRITE)
                elif dmode is DMode.APPEND:
                    self._request(cu, MUOp.APPEND, d_ref,
                                  data=from_bytes(pack_lanes(*res), "little"),
                                  tag=_TAG_STREAM_WRITE)
                elif dmode is DMode.LOCAL:
                    local[(d_base + k * d_stride) % lw] = res
                elif dmode is DMode.LOCAL_ACC:
                    w = (d_base + k * d_stride) % lw
                    local[w] = [(x + y) & MASK32 for x, y in zip(local[w], res, strict=True)]
                elif dmode is DMode.OUTER_SUM:
                    w = (d_base + i * d_stride) % lw
                    if o:
                        res = [(x + y) & MASK32 for x, y in zip(local[w], res, strict=True)]
                    if o == outer - 1:
                        self._request(cu, MUOp.APPEND, d_ref, tag=_TAG_STREAM_WRITE,
                                      data=from_bytes(pack_lanes(*_vector_post(
                                          res, sum_shift, sum_bits)), "little"))
                    else:
                        local[w] = res
                elif dmode is DMode.SUM:
                    total += sum(res)
                elif dmode in (DMode.MAX, DMode.ARGMAX):
                    for lane, v in enumerate(res):
                        v = _signed(v)
                        if best is None or v > best:
                            best, best_index = v, k * lanes + lane
                elif dmode is DMode.PACK_SUM:
                    acc += sum(res)
                elif dmode is DMode.QUEUE:
                    self._push_word(cu, q_dst, from_bytes(pack_lanes(*res), "little"),
                                    ended or (o == outer - 1 and i == n - 1))
                k += 1
                cu.stream_steps += 1
                if ended:
                    break
            if dmode is DMode.PACK_SUM:
                lane = o % lanes
                cu.V[lane] = post(_signed(acc & MASK32), sum_shift, sum_bits) & MASK32
                if lane == lanes - 1:
                    self._append_v(cu, d_ref)
            if ended:
                break
        if dmode is DMode.PACK_SUM and (o + 1) % lanes:
            self._append_v(cu, d_ref)
        rmask = self._regs - 1
        if dmode is DMode.SUM:
            cu.regs[rd] = total & MASK32
        elif dmode is DMode.MAX:
            cu.regs[rd] = best & MASK32
        elif dmode is DMode.ARGMAX:
            cu.regs[rd] = best & MASK32
            cu.regs[(rd + 1) & rmask] = best_index & MASK32
        if pops:
            cu.regs[(rd + _REDUCED_REGS.get(dmode, 0)) & rmask] = k

    def _pop_word(self, cu):
        """Take the word at the head of ``cu``'s input queue and give its producer (the CU
        that sent the last word received) a credit; return ``(word, last)``."""
        word, last = cu.queue.popleft()
        src = cu.q_src
        if src.halted:
            self.dropped.append(Message(self.steps, cu.xy, src.xy, "credit", 0, 0, 1))
        elif src.credits >= self.params.cu.queue_words:
            if src is cu:
                raise Halt(_QUEUE_OVERFLOW)
            self._halt(src, _QUEUE_OVERFLOW)
        else:
            src.credits += 1
        return word, last

    def _push_word(self, cu, dst, word, last):
        """A QUEUE stream's step: spend a credit and put ``word`` in ``dst``'s input queue."""
        cu.credits -= 1
        if self._trace:
            self.messages.append(Message(self.steps, cu.xy, dst.xy, "word", int(last), 0, word))
        if dst.halted:
            self.dropped.append(Message(self.steps, cu.xy, dst.xy, "word", int(last), 0, word))
        elif len(dst.queue) >= self.params.cu.queue_words:
            if dst is cu:
                raise Halt(_QUEUE_OVERFLOW)
            self._halt(dst, _QUEUE_OVERFLOW)
        else:
            dst.queue.append((word, last))
            dst.q_src = cu

    def _append_v(self, cu, d_ref):
        self._request(cu, MUOp.APPEND, d_ref, data=pack_vector(cu.V), tag=_TAG_STREAM_WRITE)
        cu.V = [0] * self._lanes
