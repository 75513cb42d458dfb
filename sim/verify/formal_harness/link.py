"""Formal harnesses of the board link's frame receiver
(:class:`~rdakit.hdl.host.bridge.FrameLink`), and its broken variants.

The link gets any bytes under the stream rules (any UART error flags, any gaps), a transmit
side and a fabric that take and answer whenever they like (within bounds for
``link.answers``). The properties are stated on the link's ports, against what the harness
keeps of them:

* the *record* of the last frame: the bytes taken from the first SOF without a UART error
  after the link last stopped taking bytes (it stops at the end of every frame and every error;
  before that SOF it hunts, and every byte but such a SOF is dropped or answered as garbage),
  with SEQ, KIND, LEN, the payload, whether the check bytes matched and whether any byte had a
  UART error or came after a gap longer than the timeout;
* the link's two CRC units (``amaranth.lib.crc`` processors, its submodules ``rx_crc`` and
  ``rx_hcrc``), whose ports a subclass of the link copies out: ``link.checked`` asserts they are
  started at the record's SOF and fed exactly SEQ to the end of the payload (the header check
  SEQ, KIND and LEN); then their results are those bytes' CRCs, and the record's check bytes
  are compared with them as they come. (A CRC computed a second time in the harness and
  compared at the end made z3 prove two CRC circuits equal through every timing of the
  bytes: five minutes for 12 cycles.)
* the answers, read from the transmit side (a frame's ``LEN`` says where it ends), and the
  frames applied: a command taken by the fabric, or an ``OPEN`` (``frames_ok`` counts up
  without a command).

``FrameLink`` has no observation signals for the rest of its state (its FSMs, the payload
index, the last ``SEQ`` and command applied), so no induction step could tie that state to the
record: the properties are bounded checks from reset (``mode bmc``) over every input of that
many cycles. Their cost doubles with about every cycle once a whole frame fits (z3 must follow
the link's state through every timing of the bytes), so the depths reach one or two short
frames; a proof for every depth needs the link to expose its state (an ``_observe`` as the
memory unit and the router have). The broken variants are built from the link without
changing it: a subclass that adds one statement after its ``elaborate``, or a wrapper around a
real link.
"""

from amaranth.asserts import AnySeq
from amaranth.hdl import Assert, Assume, Cat, Elaboratable, Module, Mux, Signal
from amaranth.lib import wiring

from rdakit.hdl.host.bridge import FrameLink
from rdakit.hdl.spec.frames import (
    FRAME_CRC,
    HEADER_BYTES,
    HEADER_CRC,
    NO_REPLY,
    SOF,
    TRAILER_BYTES,
    FrameKind,
    cmd_bytes,
    reply_bytes,
)
from rdakit.hdl.spec.packets import host_cmd_layout
from rdakit.hdl.spec.params import CUParams, FabricParams, MUParams
from rdakit.sim.verify.formal_harness.common import (
    popcount,
    refuses_unknown,
    stream_source,
    variant,
)

__all__ = ["LINK_FORMAL", "LINK_TIMEOUT", "FABRIC_WAIT", "ANSWER_BOUND", "LINK_PARAMS_TEXT",
           "LINK_VARIANTS", "link_checked", "link_once", "link_answers"]


#: The fabric whose command and reply layouts the link under proof carries: the smallest
#: memory unit there is, so the shortest commands (the layouts' fixed fields, 32-bit word and
#: 16-bit address, still make them 13 bytes).
LINK_FORMAL = FabricParams(
    rows=1, cols=2, cu=CUParams(lanes=1),
    mu=MUParams(words=2, block_words=1, max_buffers=1, weight_bits=1, mu_id_bits=2,
                buf_id_bits=1, index_bits=1, data_bits=32, tag_bits=4, coord_bits=1))
#: Cycles of silence inside a frame after which the link under proof ends it (``TRUNCATED``).
LINK_TIMEOUT = 2
#: ``link.answers``: the fabric takes a command at the latest in the ``FABRIC_WAIT``-th cycle
#: it is offered and offers its reply at the latest ``FABRIC_WAIT`` cycles after taking it.
FABRIC_WAIT = 2

_CMD_BYTES = cmd_bytes(LINK_FORMAL.mu)
_REPLY_BYTES = reply_bytes(LINK_FORMAL.mu)

#: ``link.answers``: while the link owes answers, the next one starts within this many cycles
#: in which no answer is being sent (the least bound the bounded check proves).
ANSWER_BOUND = 6
#: Frames or errors the link can owe answers for at once: one in its core, one waiting for
#: the core, one that ended while that one waited.
_MAX_PENDING = 3

LINK_PARAMS_TEXT = (f"commands of {_CMD_BYTES} bytes, replies of {_REPLY_BYTES} "
                    f"(words=2, block_words=1, max_buffers=1, 1x2 tiles), "
                    f"timeout={LINK_TIMEOUT}")


# --- Broken variants ---------------------------------------------------------------------------

class _CRCUnchecked(FrameLink):
    """``crc_unchecked``: the frame CRC takes no byte, so a frame whose CRC field holds the
    CRC's initial value passes whatever it carries."""

    def elaborate(self, platform):
        m = super().elaborate(platform)
        m.d.comb += m.submodules.rx_crc.valid.eq(0)
        return m


class _HeaderUnchecked(FrameLink):
    """``header_unchecked``: the header check takes no byte, so any ``SEQ``, ``KIND`` and
    ``LEN`` pass with the check byte of no bytes (a ``LEN`` with flipped bits is believed)."""

    def elaborate(self, platform):
        m = super().elaborate(platform)
        m.d.comb += m.submodules.rx_hcrc.valid.eq(0)
        return m


class _AppliesTwice(FrameLink):
    """``applies_twice``: every command reaches the fabric twice (a real link, whose command
    the wrapper offers the fabric once more after it was taken), as a resend applied again
    would."""

    def elaborate(self, platform):
        m = Module()
        m.submodules.link = link = FrameLink(self.params, timeout=self.timeout)
        wiring.connect(m, wiring.flipped(self.rx), link.rx)
        wiring.connect(m, link.tx, wiring.flipped(self.tx))
        wiring.connect(m, wiring.flipped(self.reply), link.reply)
        m.d.comb += [self.frames_ok.eq(link.frames_ok), self.frames_bad.eq(link.frames_bad)]
        again = Signal()
        held = Signal(host_cmd_layout(self.params.mu).size)
        m.d.comb += [
            self.cmd.valid.eq(link.cmd.valid | again),
            self.cmd.payload.eq(Mux(again, held, link.cmd.payload.as_value())),
            link.cmd.ready.eq(self.cmd.ready & ~again),
        ]
        with m.If(link.cmd.valid & link.cmd.ready):
            m.d.sync += [again.eq(1), held.eq(link.cmd.payload.as_value())]
        with m.Elif(again & self.cmd.ready):
            m.d.sync += again.eq(0)
        return m


class _TxStuck(FrameLink):
    """``tx_stuck``: the transmitter never offers the first byte of an answer, so the link
    waits for it for ever."""

    def elaborate(self, platform):
        m = super().elaborate(platform)
        m.d.comb += self.tx.valid.eq(0)
        return m


class _LateTimeout(FrameLink):
    """``late_timeout``: the link waits 3 cycles longer than its timeout before it ends a frame
    cut short."""

    def __init__(self, params, *, timeout):
        super().__init__(params, timeout=timeout + 3)


#: The link under proof (``None``) and its broken variants, by name.
LINK_VARIANTS = {None: FrameLink, "crc_unchecked": _CRCUnchecked,
                 "header_unchecked": _HeaderUnchecked, "applies_twice": _AppliesTwice,
                 "tx_stuck": _TxStuck, "late_timeout": _LateTimeout}


# --- The harness -------------------------------------------------------------------------------

#: The link's CRC units (submodules of its ``elaborate``) whose ports the harness reads.
_UNITS = ("rx_crc", "rx_hcrc")


def _observed(link_class):
    """``link_class`` with the ports of its two CRC units copied out: ``obs[unit][port]`` for
    ``unit`` in ``rx_crc`` (the frame CRC) and ``rx_hcrc`` (the header check), ``port`` in
    ``start``, ``valid``, ``data``, ``crc`` (``amaranth.lib.crc.Processor``'s)."""

    class Observed(link_class):
        def __init__(self, params, *, timeout):
            super().__init__(params, timeout=timeout)
            self.obs = {unit: {"start": Signal(name=f"obs_{unit}_start"),
                               "valid": Signal(name=f"obs_{unit}_valid"),
                               "data": Signal(8, name=f"obs_{unit}_data"),
                               "crc": Signal(algo.crc_width, name=f"obs_{unit}_crc")}
                        for unit, algo in zip(_UNITS, (FRAME_CRC.algorithm,
                                                       HEADER_CRC.algorithm), strict=True)}

        def elaborate(self, platform):
            m = super().elaborate(platform)
            for unit, ports in self.obs.items():
                proc = m.submodules[unit]
                m.d.comb += [sig.eq(getattr(proc, port)) for port, sig in ports.items()]
            return m

    Observed.__name__ = Observed.__qualname__ = f"Observed{link_class.__name__}"
    return Observed


class _LinkHarness(Elaboratable):
    """The link (``link_class``) in the environment described in the module's docstring, with
    the assertions of ``check``: ``"checked"``, ``"once"`` or ``"answers"``."""

    def __init__(self, link_class, check):
        self.link_class = link_class
        self.check = check

    def elaborate(self, platform):
        m = Module()
        self.m = m
        link_class = self.link_class
        if self.check == "checked":
            link_class = _observed(link_class)
        self.link = link = link_class(LINK_FORMAL, timeout=LINK_TIMEOUT)
        m.submodules.link = link
        self._environment()
        if self.check == "checked":
            self._shadow(check_header=link.obs["rx_hcrc"]["crc"],
                         check_crc=link.obs["rx_crc"]["crc"])
        elif self.check == "once":
            self._shadow()
        getattr(self, f"_check_{self.check}")()
        return m

    def _environment(self):
        m, link = self.m, self.link
        stream_source(m, link.rx)
        self.got = link.rx.valid & link.rx.ready
        self.byte = link.rx.payload.data
        self.uart_bad = link.rx.payload.framing_error | link.rx.payload.overrun
        m.d.comb += [link.tx.ready.eq(AnySeq(1)), link.cmd.ready.eq(AnySeq(1))]
        # The fabric: one reply, any value under the stream rules, for each command taken that
        # has one (all but NO_REPLY's).
        self.taken = taken = link.cmd.valid & link.cmd.ready
        kind = link.cmd.payload.kind
        self.has_reply = ~popcount([kind == k for k in NO_REPLY]).bool()
        self.owes = owes = Signal()
        stream_source(m, link.reply)
        with m.If(link.reply.valid):
            m.d.comb += Assume(owes)
        with m.If(taken & self.has_reply):
            m.d.sync += owes.eq(1)
        with m.Elif(link.reply.valid & link.reply.ready):
            m.d.sync += owes.eq(0)
        # A frame applied: a command taken, or an OPEN (frames_ok counts up without one).
        self.prev_ok = prev_ok = Signal(16)
        self.prev_taken = prev_taken = Signal()
        m.d.sync += [prev_ok.eq(link.frames_ok), prev_taken.eq(taken)]
        self.open_applied = (link.frames_ok != prev_ok) & ~prev_taken

    def _shadow(self, check_header=None, check_crc=None):
        """The record of the last frame (the module's docstring); ``check_header`` and
        ``check_crc`` are what its check bytes are compared with as they come."""
        m, link, got, byte = self.m, self.link, self.got, self.byte
        armed = Signal(init=1)            # the next good SOF starts a new record
        started = Signal()                # a record exists
        index = Signal(8)                 # bytes recorded after the SOF (up to 255)
        seq, kind, length = Signal(8), Signal(8), Signal(8)
        crc_hi = Signal(8)
        payload = Signal(8 * _CMD_BYTES)
        damaged = Signal()                # a UART error, or a gap longer than the timeout
        gap = Signal(range(LINK_TIMEOUT + 2))    # cycles without a byte, up to timeout + 1
        header_ok, crc_ok = Signal(), Signal()

        with m.If(got):
            m.d.sync += gap.eq(0)
        with m.Elif(gap != LINK_TIMEOUT + 1):
            m.d.sync += gap.eq(gap + 1)
        prev_ready = Signal(init=1)
        m.d.sync += prev_ready.eq(link.rx.ready)
        with m.If(prev_ready & ~link.rx.ready):
            m.d.sync += armed.eq(1)

        self.begins = begins = got & armed & (byte == SOF) & ~self.uart_bad
        self.recording = recording = got & started & ~armed
        self.index, self.length = index, length
        with m.If(begins):
            m.d.sync += [armed.eq(0), started.eq(1), index.eq(0), payload.eq(0),
                         damaged.eq(0), header_ok.eq(0), crc_ok.eq(0)]
        with m.Elif(recording):
            with m.If(index != 255):
                m.d.sync += index.eq(index + 1)
            with m.If(self.uart_bad | (gap > LINK_TIMEOUT)):
                m.d.sync += damaged.eq(1)
            with m.If(index == HEADER_BYTES - 1 + length):
                m.d.sync += crc_hi.eq(byte)
            with m.If(index == HEADER_BYTES + length):
                if check_crc is not None:
                    m.d.sync += crc_ok.eq(Cat(byte, crc_hi) == check_crc)
            with m.Switch(index):
                with m.Case(0):
                    m.d.sync += seq.eq(byte)
                with m.Case(1):
                    m.d.sync += kind.eq(byte)
                with m.Case(2):
                    m.d.sync += length.eq(byte)
                if check_header is not None:
                    with m.Case(3):
                        m.d.sync += header_ok.eq(byte == check_header)
                for i in range(_CMD_BYTES):
                    with m.Case(HEADER_BYTES - 1 + i):
                        with m.If(i < length):
                            m.d.sync += payload[8 * i:8 * i + 8].eq(byte)

        def frame(kind_value, max_length):
            """The record is a whole frame of that kind without damage whose check bytes
            matched the link's CRC units as they came."""
            return (started & (kind == kind_value.value) & (length <= max_length)
                    & (index == HEADER_BYTES - 1 + length + TRAILER_BYTES) & ~damaged
                    & header_ok & crc_ok)

        self.frame = frame
        self.seq = seq
        self.payload = payload

    def _check_checked(self):
        m, link = self.m, self.link
        # The link's CRC units are fed what the frame format says, from the SOF that starts
        # the record: the frame CRC SEQ to the end of the payload, the header check SEQ, KIND
        # and LEN; neither anything else. Then (amaranth.lib.crc being right) their results
        # are the CRCs of those bytes, and a good frame is one whose check bytes equal them.
        in_body = (self.index < HEADER_BYTES - 1) | (self.index - (HEADER_BYTES - 1)
                                                      < self.length)
        fed_right = Signal()
        wrong = 0
        for unit, fed in (("rx_crc", self.recording & in_body),
                          ("rx_hcrc", self.recording & (self.index < 3))):
            ports = link.obs[unit]
            wrong = wrong | (ports["start"] != self.begins) | (ports["valid"] != fed) | (
                ports["valid"] & (ports["data"] != self.byte))
        with m.If(self.begins):
            m.d.sync += fed_right.eq(1)
        with m.If(wrong):
            m.d.sync += fed_right.eq(0)
        self.fed_right = fed_right

        def good(kind, max_length):
            return self.fed_right & self.frame(kind, max_length)

        with m.If(link.cmd.valid):
            m.d.comb += Assert(good(FrameKind.CMD, _CMD_BYTES)
                               & (self.payload == link.cmd.payload.as_value()),
                               "command issued without a good frame carrying it")
        with m.If(self.open_applied):
            m.d.comb += Assert(good(FrameKind.OPEN, 0), "OPEN applied without a good OPEN frame")
        # frames_ok counts the frames applied, one at a time.
        m.d.comb += Assert((link.frames_ok == self.prev_ok)
                           | (link.frames_ok == (self.prev_ok + 1)[:16]))
        with m.If(self.prev_taken):
            m.d.comb += Assert(link.frames_ok == (self.prev_ok + 1)[:16])

    def _check_once(self):
        m, link = self.m, self.link
        value = link.cmd.payload.as_value()
        have_last = Signal()
        last_seq = Signal(8)
        last_cmd = Signal(len(value))
        with m.If(self.taken):
            m.d.comb += Assert(~have_last | (self.seq != last_seq) | (value != last_cmd),
                               "the last command applied was applied again")
            m.d.sync += [have_last.eq(1), last_seq.eq(self.seq), last_cmd.eq(value)]
        with m.If(self.open_applied):
            m.d.sync += have_last.eq(0)

    def _check_answers(self):
        m, link = self.m, self.link
        # The fabric answers within FABRIC_WAIT cycles; the transmit side takes every byte.
        waited = Signal(range(FABRIC_WAIT + 1))
        m.d.sync += waited.eq(Mux(link.cmd.valid & ~link.cmd.ready, waited + 1, 0))
        with m.If(link.cmd.valid & (waited == FABRIC_WAIT - 1)):
            m.d.comb += Assume(link.cmd.ready)
        owed = Signal(range(FABRIC_WAIT + 1))
        m.d.sync += owed.eq(Mux(self.owes & ~link.reply.valid, owed + 1, 0))
        with m.If(self.owes & (owed == FABRIC_WAIT - 1)):
            m.d.comb += Assume(link.reply.valid)
        m.d.comb += Assume(link.tx.ready)

        # Frames end where the link stops taking bytes (a good frame waits for the core, an
        # error for its answer to be queued): each such event gets one answer.
        prev_ready = Signal(init=1)
        m.d.sync += prev_ready.eq(link.rx.ready)
        ended = prev_ready & ~link.rx.ready

        # Answers, read from the transmit side: a frame starts with its first byte sent.
        sent = link.tx.valid & link.tx.ready
        pos = Signal(8)
        length = Signal(8)
        started = sent & (pos == 0)
        with m.If(sent):
            with m.If(pos == 0):
                m.d.comb += Assert(link.tx.payload == SOF, "answer without SOF")
            with m.If(pos == 3):
                m.d.sync += length.eq(link.tx.payload)
                m.d.comb += Assert(link.tx.payload <= _REPLY_BYTES)
            end = (pos > 3) & (pos == HEADER_BYTES + length + TRAILER_BYTES - 1)
            m.d.sync += pos.eq(Mux(end, 0, pos + 1))

        # The ends not answered yet, and the cycles the oldest of them has waited while
        # nothing was being sent (an answer being sent holds up the next one for as long as
        # the transmit side takes; that time is not the link's).
        pending = Signal(range(_MAX_PENDING + 2))
        wait = Signal(range(ANSWER_BOUND + 2))
        m.d.comb += [
            Assert(~started | (pending != 0), "an answer without a frame"),
            Assert(pending <= _MAX_PENDING),
            Assert((pending == 0) | (wait <= ANSWER_BOUND),
                   f"a frame not answered within {ANSWER_BOUND} cycles of the line being free"),
            Assert(link.rx.ready | ended | (pending != 0),
                   "the link stopped taking bytes while it owed no answer"),
        ]
        m.d.sync += pending.eq(pending - started + ended)
        with m.If(started | (pending == 0)):
            m.d.sync += wait.eq(0)
        with m.Elif(~link.tx.valid & (wait != ANSWER_BOUND + 1)):
            m.d.sync += wait.eq(wait + 1)

        # A frame cut short ends: after a SOF taken without a UART error (which starts a frame
        # or is inside one), the link stops taking bytes at the latest timeout + 2 cycles after
        # the last byte (quiet counts the cycles after it).
        in_frame = Signal()
        quiet = Signal(range(LINK_TIMEOUT + 4))
        m.d.sync += quiet.eq(Mux(self.got, 0, Mux(quiet == LINK_TIMEOUT + 3, quiet,
                                                   quiet + 1)))
        with m.If(ended):
            m.d.sync += in_frame.eq(0)
        with m.Elif(self.got & (self.byte == SOF) & ~self.uart_bad):
            m.d.sync += in_frame.eq(1)
        m.d.comb += Assert(~in_frame | (quiet <= LINK_TIMEOUT + 1),
                           "a frame cut short was not ended by the timeout")


@refuses_unknown(LINK_VARIANTS)
def link_checked(fault=None):
    """No frame is applied unless the bytes the link took last are a good frame of it."""
    return _LinkHarness(variant(LINK_VARIANTS, fault), "checked")


@refuses_unknown(LINK_VARIANTS)
def link_once(fault=None):
    """The last command applied is not applied again by a frame with its SEQ."""
    return _LinkHarness(variant(LINK_VARIANTS, fault), "once")


@refuses_unknown(LINK_VARIANTS)
def link_answers(fault=None):
    """Every frame, and every run of bytes in error, is answered within a bound."""
    return _LinkHarness(variant(LINK_VARIANTS, fault), "answers")
