"""The board link's frame format: the one definition the bridge RTL, the host link and the docs use.

A host talks to a board's :class:`~rdakit.hdl.host.bridge.HostBridge` over a UART in frames::

    SOF  SEQ  KIND  LEN  HCRC  payload (LEN bytes)  CRC (2 bytes, high byte first)

``SOF`` is :data:`SOF`; ``HCRC`` (:data:`HEADER_CRC`) checks ``SEQ``, ``KIND`` and ``LEN``, so a
corrupted ``LEN`` is found before the payload is read (without it, a shorter ``LEN`` makes the
receiver read the CRC from payload bytes, which may hold it); the CRC (:data:`FRAME_CRC`) covers
``SEQ`` to the end of the payload. Both are from ``amaranth.lib.crc``'s catalogue, the same
parameters in hardware and in :func:`header_crc`, :func:`frame_crc`: every frame with at most
three bits flipped after its ``SOF`` is refused. A command payload is the packed
:func:`~rdakit.hdl.spec.packets.host_cmd_layout` value, little-endian, with its trailing zero
bytes left out (the receiver fills them with zeros); a reply payload is the packed
:func:`~rdakit.hdl.spec.packets.host_reply_layout` value, the same way. A payload with a bit the
layout does not have is ``BAD_LENGTH``.

Every frame the bridge receives gets exactly one answer frame with the same ``SEQ``: ``REPLY``,
``ACK`` or ``ERROR`` (``docs/boards.md``). A frame with any error is never applied, and nothing
of it reaches the fabric. A ``CMD`` frame with the ``SEQ`` *and the command* of the last one
applied is a resend: it is not applied again, its answer is sent again, so a host may always
resend a frame whose answer it did not get; a ``CMD`` with that ``SEQ`` and another command is a
new frame, applied. :class:`LinkModel` is the board's side in Python, the reference the bridge's
RTL is tested against on random byte streams.
"""

import dataclasses

from amaranth.lib import crc, enum

from rdakit.hdl.spec.packets import HostCmd, host_cmd_layout, host_reply_layout
from rdakit.hdl.spec.params import MUParams

__all__ = ["SOF", "FrameKind", "FrameError", "FRAME_CRC", "HEADER_CRC", "NO_REPLY", "FIELD_DOC",
           "KIND_DOC", "ERROR_DOC", "frame_crc", "header_crc", "cmd_bytes", "reply_bytes",
           "int_payload", "encode_frame", "Frame", "BadFrame", "FrameParser", "LinkModel",
           "Applied", "HEADER_BYTES", "TRAILER_BYTES"]

#: The first byte of every frame.
SOF = 0xA5
#: Bytes before the payload (SOF, SEQ, KIND, LEN, HCRC) and after it (CRC).
HEADER_BYTES = 5
TRAILER_BYTES = 2

#: CRC-16/CCITT-FALSE (poly 0x1021, init 0xFFFF), one byte a step.
FRAME_CRC = crc.catalog.CRC16_CCITT_FALSE(data_width=8)
#: CRC-8/AUTOSAR (poly 0x2F, init and xor 0xFF) of SEQ, KIND and LEN: Hamming distance 4 on
#: those 32 bits, so one to three flipped bits of the header are always found.
HEADER_CRC = crc.catalog.CRC8_AUTOSAR(data_width=8)


class FrameKind(enum.Enum, shape=8):
    """What a frame carries. Host to board: ``CMD``, ``OPEN``; board to host: the others."""

    CMD = 0x01     #: a host-port command
    OPEN = 0x02    #: start a session: forget the last SEQ applied
    REPLY = 0x81   #: the host port's reply to a command
    ACK = 0x82     #: the command (or OPEN) was applied and has no reply
    ERROR = 0x83   #: the frame was not applied; the payload is one FrameError byte


class FrameError(enum.Enum, shape=8):
    """The code of an ``ERROR`` frame."""

    BAD_CRC = 1
    BAD_LENGTH = 2
    BAD_KIND = 3
    TRUNCATED = 4
    SYNC = 5
    UART = 6
    BAD_HEADER = 7


def _crc_text(name, crc):
    alg = crc.algorithm
    digits = (alg.crc_width + 3) // 4
    return (f"polynomial 0x{alg.polynomial:0{digits}X}, initial 0x{alg.initial_crc:0{digits}X}, "
            f"reflected {alg.reflect_input}/{alg.reflect_output}, "
            f"xor 0x{alg.xor_output:0{digits}X} ({name})")


#: The bytes of a frame: (byte offsets, field, meaning), for the docs.
FIELD_DOC = [
    ("0", "`SOF`", f"0x{SOF:02X}"),
    ("1", "`SEQ`", "sequence number, echoed in the answer"),
    ("2", "`KIND`", "`FrameKind` below"),
    ("3", "`LEN`", "payload bytes"),
    ("4", "`HCRC`", "CRC-8 of bytes 1 to 3, checked before the payload is read: "
                    + _crc_text("CRC-8/AUTOSAR", HEADER_CRC)),
    ("5 ... 4+LEN", "payload", "little-endian, trailing zero bytes left out"),
    ("5+LEN, 6+LEN", "`CRC`", "CRC-16 of bytes 1 to 4+LEN, high byte first: "
                              + _crc_text("CRC-16/CCITT-FALSE", FRAME_CRC)),
]

KIND_DOC = {
    FrameKind.CMD: ("host", "a packed host command (trailing zero bytes left out)",
                    "REPLY, or ACK for LOAD_BEGIN / LOAD_WORD"),
    FrameKind.OPEN: ("host", "none", "ACK; the next CMD is applied whatever its SEQ"),
    FrameKind.REPLY: ("board", "a packed host-port reply (trailing zero bytes left out)", "—"),
    FrameKind.ACK: ("board", "none", "—"),
    FrameKind.ERROR: ("board", "one byte: the FrameError code", "—"),
}

ERROR_DOC = {
    FrameError.BAD_CRC: "the CRC does not match",
    FrameError.BAD_LENGTH: "the payload is longer than the kind's (a CMD's packed command, "
                           "none for OPEN): LEN, or a bit of the last byte the layout does not "
                           "have",
    FrameError.BAD_KIND: "KIND is not a host-to-board kind",
    FrameError.TRUNCATED: "the line went quiet inside a frame for longer than the bridge's "
                          "timeout",
    FrameError.SYNC: "bytes other than SOF between frames, answered once a run (with SEQ 0); "
                     "a run, like the rest of a frame found bad, ends at a SOF or a quiet line",
    FrameError.UART: "a byte of the frame had a framing error (its stop bit was low), or bytes "
                     "were lost (overrun)",
    FrameError.BAD_HEADER: "HCRC does not match SEQ, KIND and LEN (checked before the payload)",
}

#: Host-port commands that have no reply: the bridge answers them with ACK.
NO_REPLY = frozenset({HostCmd.LOAD_BEGIN, HostCmd.LOAD_WORD})


def frame_crc(data):
    """The frame CRC of ``data`` (bytes), as the bridge computes it."""
    return FRAME_CRC.compute(bytes(data))


def header_crc(seq, kind, length):
    """The header check byte of a frame's ``SEQ``, ``KIND`` and ``LEN``."""
    return HEADER_CRC.compute(bytes([seq, kind, length]))


def cmd_bytes(p: MUParams):
    """Bytes of a packed host command: the longest CMD payload."""
    return (host_cmd_layout(p).size + 7) // 8


def reply_bytes(p: MUParams):
    """Bytes of a packed host-port reply: the longest REPLY payload."""
    return (host_reply_layout(p).size + 7) // 8


def int_payload(value, nbytes):
    """``value`` as at most ``nbytes`` little-endian bytes, trailing zero bytes left out."""
    if value < 0 or value >> (8 * nbytes):
        raise ValueError(f"Payload value must fit in {nbytes} bytes, not {value!r}")
    return value.to_bytes(nbytes, "little").rstrip(b"\0")


def encode_frame(kind, seq, payload=b""):
    """The bytes of one frame."""
    kind = FrameKind(kind)
    if not 0 <= seq < 256:
        raise ValueError(f"SEQ must be a byte, not {seq!r}")
    if len(payload) > 255:
        raise ValueError(f"Payload must be at most 255 bytes, not {len(payload)}")
    body = bytes([seq, kind.value, len(payload), header_crc(seq, kind.value, len(payload))])
    body += bytes(payload)
    return bytes([SOF]) + body + frame_crc(body).to_bytes(2, "big")


@dataclasses.dataclass(frozen=True)
class Frame:
    """A frame that passed its checks."""

    kind: FrameKind
    seq: int
    payload: bytes

    @property
    def value(self):
        """The payload as a little-endian integer (a packed command or reply)."""
        return int.from_bytes(self.payload, "little")


@dataclasses.dataclass(frozen=True)
class BadFrame:
    """Bytes that did not make a frame: ``error`` says why, ``seq`` is the SEQ byte if read."""

    error: FrameError
    seq: int | None = None


class FrameParser:
    """Turns a byte stream into :class:`Frame` and :class:`BadFrame` events, like the bridge's
    receiver: bytes before a SOF are one ``SYNC`` event a run, and ``max_bits`` maps each kind
    accepted to its longest payload in bits (a kind not in it is ``BAD_KIND``; a payload of more
    bytes, or with a bit above them in its last byte, is ``BAD_LENGTH``). Two things besides
    bytes are the caller's: :meth:`line_error`, a byte received with a UART error, and
    :meth:`timeout`, a quiet line (longer than the receiver's timeout)."""

    def __init__(self, max_bits):
        self.max_bits = {FrameKind(k): n for k, n in max_bits.items()}
        self._reset()
        self._garbage = False

    def _reset(self):
        self._state = "HUNT"
        self._body = bytearray()
        self._len = 0

    @property
    def in_frame(self):
        return self._state != "HUNT"

    def timeout(self):
        """The line went quiet: a frame in progress is ``TRUNCATED``; a run of garbage ends."""
        self._garbage = False
        if self._state == "HUNT":
            return []
        seq = self._body[0] if self._body else None
        self._reset()
        return [BadFrame(FrameError.TRUNCATED, seq)]

    def line_error(self):
        """A byte with a UART error (framing error or overrun): inside a frame, the frame is
        ``UART``; between frames, a byte of garbage."""
        if self._state == "HUNT":
            return self._garbage_byte()
        return self._fail(FrameError.UART)

    def feed(self, data):
        """Feed bytes; return the events they complete."""
        out = []
        for b in bytes(data):
            out.extend(self._byte(b))
        return out

    def _fail(self, error):
        seq = self._body[0] if self._body else None
        self._reset()
        self._garbage = True          # the rest of this frame is one run of garbage
        return [BadFrame(error, seq)]

    def _garbage_byte(self):
        if self._garbage:
            return []
        self._garbage = True
        return [BadFrame(FrameError.SYNC)]

    def _byte(self, b):
        st = self._state
        if st == "HUNT":
            if b == SOF:
                self._garbage = False
                self._state = "SEQ"
                return []
            return self._garbage_byte()
        self._body.append(b)
        if st == "SEQ":
            self._state = "KIND"
        elif st == "KIND":
            try:
                kind = FrameKind(b)
            except ValueError:
                kind = None
            if kind not in self.max_bits:
                return self._fail(FrameError.BAD_KIND)
            self._state = "LEN"
        elif st == "LEN":
            if b > (self.max_bits[FrameKind(self._body[1])] + 7) // 8:
                return self._fail(FrameError.BAD_LENGTH)
            self._len = b
            self._state = "HCRC"
        elif st == "HCRC":
            if b != header_crc(*self._body[:3]):
                return self._fail(FrameError.BAD_HEADER)
            self._state = "PAYLOAD" if self._len else "CRC"
        elif st == "PAYLOAD":
            index = len(self._body) - HEADER_BYTES     # of this byte in the payload
            if b >> (self.max_bits[FrameKind(self._body[1])] - 8 * index):
                return self._fail(FrameError.BAD_LENGTH)
            if index + 1 == self._len:
                self._state = "CRC"
        elif st == "CRC":
            if len(self._body) == HEADER_BYTES - 1 + self._len + TRAILER_BYTES:
                body = bytes(self._body[:-2])
                ok = frame_crc(body) == int.from_bytes(self._body[-2:], "big")
                seq, kind = body[0], FrameKind(body[1])
                self._reset()
                if not ok:
                    self._garbage = True
                    return [BadFrame(FrameError.BAD_CRC, seq)]
                return [Frame(kind, seq, body[HEADER_BYTES - 1:])]
        return []


@dataclasses.dataclass(frozen=True)
class Applied:
    """A command the bridge gives the fabric's host port (its packed value)."""

    value: int


class LinkModel:
    """The board's side of the link in Python: the bridge's receiver (a :class:`FrameParser`
    of ``CMD`` and ``OPEN`` frames) and its rule of applying a frame once.

    Parameters
    ----------
    p : MUParams
        The command and reply layouts.
    fabric : callable
        ``fabric(value)`` is the host port's reply (a packed value) to the command ``value``,
        called once for each command applied that has a reply.

    :meth:`feed`, :meth:`line_error` and :meth:`timeout` are the parser's; they return, in
    order, the :class:`Applied` commands and the answer :class:`Frame` objects.
    """

    def __init__(self, p: MUParams, fabric):
        self.layout = host_cmd_layout(p)
        self.fabric = fabric
        self.reply_bytes = reply_bytes(p)
        self.parser = FrameParser({FrameKind.CMD: self.layout.size, FrameKind.OPEN: 0})
        self.last = None              # (SEQ, command, answer) of the last CMD applied

    def feed(self, data):
        return self._core(self.parser.feed(data))

    def line_error(self):
        return self._core(self.parser.line_error())

    def timeout(self):
        return self._core(self.parser.timeout())

    def _core(self, events):
        out = []
        for e in events:
            if isinstance(e, BadFrame):
                out.append(Frame(FrameKind.ERROR, e.seq or 0, bytes([e.error.value])))
            elif e.kind is FrameKind.OPEN:
                self.last = None
                out.append(Frame(FrameKind.ACK, e.seq, b""))
            elif self.last is not None and self.last[:2] == (e.seq, e.value):
                out.append(self.last[2])
            else:
                out.append(Applied(e.value))
                kind_field = self.layout["kind"]
                cmd_kind = e.value >> kind_field.offset & ((1 << kind_field.width) - 1)
                if HostCmd(cmd_kind) in NO_REPLY:
                    answer = Frame(FrameKind.ACK, e.seq, b"")
                else:
                    answer = Frame(FrameKind.REPLY, e.seq,
                                   int_payload(self.fabric(e.value), self.reply_bytes))
                self.last = (e.seq, e.value, answer)
                out.append(answer)
        return out
