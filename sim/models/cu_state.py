"""What the interpreter works on and hands back: a CU's mutable state, the messages and
transactions between tiles, a run's result and the errors (:mod:`rdakit.sim.models.interp`
describes the semantics)."""

import collections
import dataclasses

import numpy as np

from rdakit.hdl.spec.bitstream import BitstreamError
from rdakit.hdl.spec.config import CU_STATUS_BITS, cu_status_word
from rdakit.hdl.spec.isa import AssemblyError, Instr, Op, StreamField, decode
from rdakit.hdl.spec.vector import MASK32

__all__ = [
    "RunResult", "CUState", "Message", "Transaction",
    "InterpreterError", "DeadlockError", "StepLimitError", "HostError", "tile_id",
]

NONE = CU_STATUS_BITS["NONE"]
CODE_NAMES = {v: k for k, v in CU_STATUS_BITS.items()}


def tile_id(params, x, y):
    """The ID of the tile at ``(x, y)`` (of a CU or an MU): ``y << coord_bits | x``."""
    return (y << params.coord_bits) | x


class InterpreterError(Exception):
    """Base class of the interpreter's errors."""


class HostError(InterpreterError):
    """A host helper got a response whose status is not OK.

    Members
    -------
    response : dict
        The response.
    """

    def __init__(self, message, response):
        super().__init__(message)
        self.response = response


class DeadlockError(InterpreterError):
    """Every CU still running is blocked in ``WAIT`` or ``RECV``, or in a stream between CUs
    (``SRUN`` waiting for a word or a credit).

    Members
    -------
    blocked : dict
        ``(x, y)`` of each blocked CU -> what it waits for.
    result : RunResult
        The state when the deadlock was found.
    """

    def __init__(self, blocked, result):
        what = "; ".join(f"CU {xy} {why}" for xy, why in blocked.items())
        super().__init__(f"Deadlock after {result.steps} steps: every running CU is blocked: "
                         f"{what}")
        self.blocked = blocked
        self.result = result


class StepLimitError(InterpreterError):
    """The run took ``max_steps`` steps without every CU halting.

    Members
    -------
    result : RunResult
        The state after the last step.
    """

    def __init__(self, max_steps, result):
        running = [xy for xy, s in result.cus.items() if not s.done]
        super().__init__(f"Step limit of {max_steps} reached with CUs {running} still running")
        self.result = result


class Halt(Exception):
    """Raised inside an instruction to halt the CU executing it with an error code."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


@dataclasses.dataclass(frozen=True)
class Message:
    """A token or reference sent by a CU.

    Members
    -------
    step : int
        The interpreter step that sent it (1 for the first step).
    src, dst : tuple of int
        ``(x, y)`` of the sender and of the receiver.
    kind : str
        ``"token"`` or ``"ref"``; ``"word"`` (a QUEUE stream's result, recorded with
        ``trace=True`` or when dropped) or ``"credit"`` (dropped only).
    tag : int
        The channel (token), the mailbox slot (reference), 1 for a word marked last.
    ref : int
        The reference (0 for a token).
    data : int
        The token count, the weight sent with the reference, the word, the credits.
    """

    step: int
    src: tuple
    dst: tuple
    kind: str
    tag: int
    ref: int
    data: int


@dataclasses.dataclass(frozen=True)
class Transaction:
    """One MU request of a CU and its response (recorded with ``trace=True``)."""

    step: int
    cu: tuple
    mu: tuple
    request: dict
    response: dict


@dataclasses.dataclass(eq=False)
class CUState:
    """The state of one CU (a snapshot).

    Members
    -------
    x, y, id : int
        Coordinates and ID (``y << coord_bits | x``).
    enabled : bool
        Whether the configuration enables it (a disabled CU is done at once).
    done, error : bool
        Halted; halted on an error.
    code : int
        The error code (:data:`~rdakit.hdl.spec.config.CU_STATUS_BITS`), 0 if none.
    pc : int
        The program counter (see the module docstring for its value after a halt).
    regs : tuple of int
        The registers, unsigned 32-bit.
    V : numpy.ndarray
        The staging vector, ``int32`` of shape ``(lanes,)``.
    local : numpy.ndarray
        The local buffer, ``int32`` of shape ``(local_words, lanes)``.
    tokens : tuple of int
        The token counters.
    mailbox : tuple
        Per slot, ``(ref, weight)`` or ``None``.
    instructions, stream_steps, requests : int
        Instructions completed, stream steps run, MU requests made.
    tokens_sent, refs_sent : int
        ``SEND`` and ``SENDREF`` messages sent.
    """

    x: int
    y: int
    id: int
    enabled: bool
    done: bool
    error: bool
    code: int
    pc: int
    regs: tuple
    V: np.ndarray
    local: np.ndarray
    tokens: tuple
    mailbox: tuple
    instructions: int
    stream_steps: int
    requests: int
    tokens_sent: int
    refs_sent: int

    @property
    def code_name(self):
        """The name of :attr:`code` in :data:`~rdakit.hdl.spec.config.CU_STATUS_BITS`."""
        return CODE_NAMES.get(self.code, str(self.code))

    @property
    def sregs(self):
        """The registers as a ``numpy.int32`` array."""
        return np.array(self.regs, dtype=np.uint32).view(np.int32)

    @property
    def status(self):
        """The STATUS word (``CU_MAP.STATUS``, laid out as
        :data:`~rdakit.hdl.spec.config.CU_STATUS`)."""
        return cu_status_word(done=self.done, error=self.error, code=self.code, pc=self.pc)

    def key(self):
        """Everything as a tuple of plain values (comparable with ``==``)."""
        return (self.x, self.y, self.enabled, self.done, self.error, self.code, self.pc,
                self.regs, tuple(self.V.tolist()), tuple(map(tuple, self.local.tolist())),
                self.tokens, self.mailbox, self.instructions, self.stream_steps,
                self.requests, self.tokens_sent, self.refs_sent)

    def __eq__(self, other):
        if not isinstance(other, CUState):
            return NotImplemented
        return self.key() == other.key()

    __hash__ = None


@dataclasses.dataclass(eq=False)
class RunResult:
    """What :meth:`Interpreter.run` returns (also attached to its exceptions).

    Members
    -------
    cus : dict
        ``(x, y)`` -> :class:`CUState`, for every CU tile (disabled ones included).
    mu_ops : dict
        ``(x, y)`` of every MU -> ``collections.Counter`` of the :class:`MUOp` of the CU
        requests it answered.
    mu_errors : dict
        ``(x, y)`` of every MU -> CU requests it answered with a status other than OK.
    steps : int
        Steps run since the interpreter was built.
    finished : bool
        Every CU has halted.
    dropped : tuple of Message
        Messages sent to a CU that had halted (or is disabled).
    """

    cus: dict
    mu_ops: dict
    mu_errors: dict
    steps: int
    finished: bool
    dropped: tuple

    def cu(self, x, y):
        """The :class:`CUState` of the CU at ``(x, y)``."""
        return self.cus[(x, y)]

    @property
    def errors(self):
        """``(x, y)`` -> error name, for every CU that halted on an error."""
        return {xy: s.code_name for xy, s in self.cus.items() if s.error}

    @property
    def ok(self):
        """Every CU halted without error."""
        return self.finished and not self.errors

    @property
    def instructions(self):
        """``(x, y)`` -> instructions completed."""
        return {xy: s.instructions for xy, s in self.cus.items()}

    def check(self):
        """Raise :class:`InterpreterError` naming every CU that halted on an error, with its
        pc."""
        if self.errors:
            what = ", ".join(f"CU {xy}: {name} at pc {self.cus[xy].pc}"
                             for xy, name in self.errors.items())
            raise InterpreterError(f"CUs halted on errors: {what}")
        return self

    def key(self):
        """Every CU's state and the MU operation counts as plain values (comparable)."""
        return (tuple((xy, s.key()) for xy, s in sorted(self.cus.items())),
                tuple((xy, tuple(sorted((op.value, n) for op, n in c.items())))
                      for xy, c in sorted(self.mu_ops.items())))


class CUMachine:
    """The mutable state of one CU."""

    def __init__(self, x, y, cu_id, params, tile):
        cp = params.cu
        self.x, self.y, self.xy, self.id = x, y, (x, y), cu_id
        self.enabled = tile is not None and bool(tile.enabled)
        self.program = [Instr(Op.NOP)] * cp.prog_len
        self.regs = [0] * cp.regs
        self.local = [[0] * cp.lanes for _ in range(cp.local_words)]
        if tile is not None:
            for pc, word in enumerate(tile.words()):
                if not isinstance(word, int) or not 0 <= word < 1 << 64:
                    raise BitstreamError(f"tile ({x}, {y}): instruction {pc} must be a 64-bit "
                                         f"word or an Instr, not {word!r}")
                try:
                    self.program[pc] = decode(word)
                except AssemblyError:
                    self.program[pc] = None          # BAD_INSTRUCTION when fetched
            for r, v in tile.regs.items():
                self.regs[r] = int(v) & MASK32
            for w, values in tile.local.items():
                self.local[w] = [int(v) & MASK32 for v in values]
        # What `start` sets.
        self.pc = 0
        self.V = [0] * cp.lanes
        self.fields = [0] * len(StreamField)
        self.fields[StreamField.OUTER.value] = 1
        self.tokens = [0] * cp.channels
        self.mailbox = [None] * cp.mailbox
        self.stream = None                           # the running SRUN (a generator)
        # Streams between CUs (DMode.QUEUE): the input queue of (word, last) another CU's
        # stream sent, the CU that sent the last word (credits go back to it), the credits
        # this CU holds as a producer, and what the running stream's next step needs:
        # (a word from the queue, a credit) or None.
        self.queue = collections.deque()
        self.q_src = None
        self.credits = cp.queue_words
        self.stream_need = None
        self.halted = not self.enabled
        self.code = NONE
        self.instructions = self.stream_steps = self.requests = 0
        self.tokens_sent = self.refs_sent = 0
