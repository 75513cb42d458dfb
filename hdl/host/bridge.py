"""The board's host bridge: frames over a UART to and from the fabric's host port.

Format and rules in :mod:`rdakit.hdl.spec.frames` and ``docs/boards.md``. The receiver checks a
frame completely (kind, length, header check, payload bits, CRC, no UART error, no gap longer
than ``timeout`` cycles) before the command it carries reaches the fabric, so a corrupted frame
is answered with an ``ERROR`` frame and changes nothing; a frame is applied at most once (a
resend, the same SEQ and command again, is answered again). It accepts and answers exactly what
:class:`~rdakit.hdl.spec.frames.LinkModel` does, on every stream of bytes, UART errors and quiet
lines (``tests/hdl/test_hostile_link.py``). One frame is handled at a time: the host sends the
next frame after the answer to the last one; bytes that come while a frame is being handled wait
in the UART, which drops the ones after the first and flags the next byte taken (overrun).
"""

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.host.uart import UARTRx, UARTTx, check_divisor, rx_byte_layout
from rdakit.hdl.spec.frames import (
    FRAME_CRC,
    HEADER_CRC,
    NO_REPLY,
    SOF,
    FrameError,
    FrameKind,
    cmd_bytes,
    reply_bytes,
)
from rdakit.hdl.spec.packets import host_cmd_layout, host_reply_layout
from rdakit.hdl.spec.params import FabricParams

__all__ = ["FrameLink", "HostBridge", "BridgedFabric"]


def _fabric_side(p):
    """The members a host link shows the fabric's host port (MU parameters ``p``): commands
    out, replies in, and its frame counters."""
    return {"cmd": Out(stream.Signature(host_cmd_layout(p))),
            "reply": In(stream.Signature(host_reply_layout(p))),
            "frames_ok": Out(16), "frames_bad": Out(16)}


class FrameLink(wiring.Component):
    """Frames in bytes to host-port commands, and answers to frames in bytes: the bridge without
    its UART.

    Parameters
    ----------
    params : FabricParams
        The fabric whose host port the link drives (command and reply layouts).
    timeout : int
        Cycles of silence inside a frame after which it is ``TRUNCATED`` (at least 1).

    Members
    -------
    rx : In(stream.Signature(rx_byte_layout))
        Received bytes, with the UART's ``framing_error`` and ``overrun`` flags. Not ready
        while a good frame waits for the core, or an error for its answer to start.
    tx : Out(stream.Signature(8))
        The bytes of the answer frames.
    cmd : Out(stream.Signature(host_cmd_layout(params.mu)))
        Commands to the fabric's host port, one per good ``CMD`` frame.
    reply : In(stream.Signature(host_reply_layout(params.mu)))
        The host port's replies.
    frames_ok, frames_bad : Out(16)
        Frames applied and frames answered with ``ERROR`` (wrapping counters, for LEDs and
        debugging).

    Latency: a command reaches ``cmd`` 3 cycles after the last CRC byte is taken; its answer
    frame starts 2 cycles after the reply (or the command, if it has none) is taken.
    """

    def __init__(self, params, *, timeout):
        if not isinstance(params, FabricParams):
            raise TypeError(f"Params must be a FabricParams, not {params!r}")
        if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 1:
            raise TypeError(f"Timeout must be a positive integer, not {timeout!r}")
        self.params = params
        self.timeout = timeout
        p = params.mu
        super().__init__({
            "rx": In(stream.Signature(rx_byte_layout)),
            "tx": Out(stream.Signature(8)),
            **_fabric_side(p),
        })

    def elaborate(self, platform):
        m = Module()
        p = self.params.mu
        n_cmd = cmd_bytes(p)
        n_reply = reply_bytes(p)
        cmd_bits = host_cmd_layout(p).size

        # --- receiver: bytes to a checked frame --------------------------------------------
        # The same states and checks as FrameParser (the reference it is tested against): SOF
        # hunt, SEQ, KIND (BAD_KIND), LEN (BAD_LENGTH), HCRC (BAD_HEADER: LEN is known good
        # before a payload byte is read), the payload (BAD_LENGTH for a bit above the command's
        # in its last byte), the CRC (BAD_CRC). A UART error in a frame is UART, a line quiet
        # for ``timeout`` cycles inside one is TRUNCATED; nothing of a frame leaves the receiver
        # before its CRC matched.
        m.submodules.rx_crc = rx_crc = FRAME_CRC.create()
        m.submodules.rx_hcrc = rx_hcrc = HEADER_CRC.create()
        buf = Signal(8 * n_cmd)            # the payload, zero-filled past LEN
        seq = Signal(8)
        kind = Signal(8)
        length = Signal(8)
        index = Signal(8)
        crc_hi = Signal(8)
        crc_lo = Signal(8)
        garbage = Signal()                 # a run of non-SOF bytes was already answered
        quiet = Signal(range(self.timeout + 1))    # cycles without a byte, up to ``timeout``
        ev_valid = Signal()                # a frame (or an error) waits for the core
        ev_seq = Signal(8)
        ev_error = Signal(FrameError, init=FrameError.BAD_CRC)
        ev_ok = Signal()                   # ev: a good frame (else ev_error)
        ev_taken = Signal()                # from the core
        pend_error = Signal(FrameError, init=FrameError.BAD_CRC)   # found, to hand over

        byte = self.rx.payload.data
        uart_bad = self.rx.payload.framing_error | self.rx.payload.overrun
        got = Signal()
        line_quiet = Signal()              # no byte for ``timeout`` cycles, none in this one
        m.d.comb += [
            got.eq(self.rx.valid & self.rx.ready),
            line_quiet.eq(~got & (quiet == self.timeout)),
            rx_crc.data.eq(byte),
            rx_hcrc.data.eq(byte),
        ]
        kind_ok = (byte == FrameKind.CMD.value) | (byte == FrameKind.OPEN.value)
        max_len = Mux(kind == FrameKind.CMD.value, n_cmd, 0)
        # The bits of the command's last payload byte above the layout (none if it is full).
        top_bits = Const(0)
        if cmd_bits % 8:
            top_bits = byte[cmd_bits % 8:]

        with m.If(ev_taken):
            m.d.sync += ev_valid.eq(0)

        def fail(error, *, run=True):
            # ``run``: the rest of the frame is one run of garbage (not after a quiet line).
            m.d.sync += [pend_error.eq(error), garbage.eq(run)]
            m.next = "REPORT"

        # A byte without a UART error, in a state that takes one.
        good = Signal()
        m.d.comb += good.eq(got & ~uart_bad)

        def count_quiet():
            m.d.comb += self.rx.ready.eq(1)
            with m.If(got):
                m.d.sync += quiet.eq(0)
            with m.Elif(quiet != self.timeout):
                m.d.sync += quiet.eq(quiet + 1)

        def take_byte(*, crc, hcrc=False):
            # What every state inside a frame does: take the byte (into the CRCs if asked),
            # count the quiet cycles, and fail on a UART error or a quiet line. The state's
            # own action goes under ``m.If(good)``.
            count_quiet()
            with m.If(got):
                m.d.comb += [rx_crc.valid.eq(crc), rx_hcrc.valid.eq(hcrc)]
            with m.If(got & uart_bad):
                fail(FrameError.UART)
            with m.Elif(line_quiet):
                fail(FrameError.TRUNCATED, run=False)

        with m.FSM(name="rx"):
            with m.State("HUNT"):
                count_quiet()
                # A quiet line ends a run of garbage: the next non-SOF byte is answered again.
                with m.If(line_quiet):
                    m.d.sync += garbage.eq(0)
                with m.If(good & (byte == SOF)):
                    m.d.sync += [garbage.eq(0), buf.eq(0), index.eq(0), seq.eq(0)]
                    m.d.comb += [rx_crc.start.eq(1), rx_hcrc.start.eq(1)]
                    m.next = "SEQ"
                with m.Elif(got & ~garbage):
                    m.d.sync += seq.eq(0)
                    fail(FrameError.SYNC)
            with m.State("SEQ"):
                take_byte(crc=True, hcrc=True)
                with m.If(good):
                    m.d.sync += seq.eq(byte)
                    m.next = "KIND"
            with m.State("KIND"):
                take_byte(crc=True, hcrc=True)
                with m.If(good):
                    m.d.sync += kind.eq(byte)
                    with m.If(kind_ok):
                        m.next = "LEN"
                    with m.Else():
                        fail(FrameError.BAD_KIND)
            with m.State("LEN"):
                take_byte(crc=True, hcrc=True)
                with m.If(good):
                    m.d.sync += length.eq(byte)
                    with m.If(byte > max_len):
                        fail(FrameError.BAD_LENGTH)
                    with m.Else():
                        m.next = "HCRC"
            with m.State("HCRC"):
                take_byte(crc=True)
                with m.If(good):
                    with m.If(byte != rx_hcrc.crc):
                        fail(FrameError.BAD_HEADER)
                    with m.Elif(length == 0):
                        m.next = "CRC_HI"
                    with m.Else():
                        m.next = "PAYLOAD"
            with m.State("PAYLOAD"):
                take_byte(crc=True)
                with m.If(good):
                    with m.If((index == n_cmd - 1) & (top_bits != 0)):
                        fail(FrameError.BAD_LENGTH)
                    with m.Else():
                        with m.Switch(index):
                            for i in range(n_cmd):
                                with m.Case(i):
                                    m.d.sync += buf[8 * i:8 * i + 8].eq(byte)
                        m.d.sync += index.eq(index + 1)
                        with m.If(index + 1 == length):
                            m.next = "CRC_HI"
            with m.State("CRC_HI"):
                take_byte(crc=False)
                with m.If(good):
                    m.d.sync += crc_hi.eq(byte)
                    m.next = "CRC_LO"
            with m.State("CRC_LO"):
                take_byte(crc=False)
                with m.If(good):
                    m.d.sync += crc_lo.eq(byte)
                    m.next = "CHECK"
            with m.State("CHECK"):
                with m.If(~ev_valid):
                    with m.If(rx_crc.crc == Cat(crc_lo, crc_hi)):
                        m.d.sync += [ev_valid.eq(1), ev_ok.eq(1), ev_seq.eq(seq)]
                        m.next = "HOLD"
                    with m.Else():
                        fail(FrameError.BAD_CRC)
            with m.State("REPORT"):
                with m.If(~ev_valid):
                    m.d.sync += [ev_valid.eq(1), ev_ok.eq(0), ev_error.eq(pend_error),
                                 ev_seq.eq(seq)]
                    m.next = "HUNT"
            with m.State("HOLD"):
                # ``buf``, ``kind`` and ``seq`` stay until the core has taken the frame.
                with m.If(ev_taken):
                    m.next = "HUNT"

        # --- core: apply a good frame once, choose the answer -------------------------------
        # A resend is a CMD with the SEQ and the command of the last one applied (since reset
        # or OPEN): answered again, not applied. A CMD with that SEQ and another command is a
        # new frame.
        last_seq = Signal(8)
        last_buf = Signal(8 * n_cmd)
        have_last = Signal()
        held_kind = Signal(8)              # ACK or REPLY: the answer of the last CMD applied
        held_reply = Signal(8 * n_reply)
        ans_kind = Signal(8)
        ans_seq = Signal(8)
        ans_error = Signal(8)
        ans_start = Signal()               # one-cycle pulse to the transmitter
        tx_busy = Signal()
        frames_ok = Signal(16)
        frames_bad = Signal(16)
        m.d.comb += [self.frames_ok.eq(frames_ok), self.frames_bad.eq(frames_bad)]

        kind_field = host_cmd_layout(p)["kind"]
        cmd_kind = buf[kind_field.offset:kind_field.offset + kind_field.width]
        no_reply = Const(0)
        for k in NO_REPLY:
            no_reply = no_reply | (cmd_kind == k.value)
        m.d.comb += self.cmd.payload.eq(buf[:cmd_bits])

        with m.FSM(name="core"):
            with m.State("IDLE"):
                with m.If(ev_valid & ~tx_busy):
                    m.d.sync += ans_seq.eq(ev_seq)
                    with m.If(~ev_ok):
                        m.d.comb += ev_taken.eq(1)
                        m.d.sync += [ans_kind.eq(FrameKind.ERROR.value),
                                     ans_error.eq(ev_error), frames_bad.eq(frames_bad + 1)]
                        m.next = "ANSWER"
                    with m.Elif(kind == FrameKind.OPEN.value):
                        m.d.comb += ev_taken.eq(1)
                        m.d.sync += [have_last.eq(0), ans_kind.eq(FrameKind.ACK.value),
                                     frames_ok.eq(frames_ok + 1)]
                        m.next = "ANSWER"
                    with m.Elif(have_last & (ev_seq == last_seq) & (buf == last_buf)):
                        # A resent frame: its command was applied; answer it again.
                        m.d.comb += ev_taken.eq(1)
                        m.d.sync += ans_kind.eq(held_kind)
                        m.next = "ANSWER"
                    with m.Else():
                        m.next = "ISSUE"
            with m.State("ISSUE"):
                m.d.comb += self.cmd.valid.eq(1)
                with m.If(self.cmd.ready):
                    m.d.comb += ev_taken.eq(1)
                    m.d.sync += [last_seq.eq(ev_seq), last_buf.eq(buf), have_last.eq(1),
                                 frames_ok.eq(frames_ok + 1)]
                    with m.If(no_reply):
                        m.d.sync += [held_kind.eq(FrameKind.ACK.value),
                                     ans_kind.eq(FrameKind.ACK.value)]
                        m.next = "ANSWER"
                    with m.Else():
                        m.next = "WAIT_REPLY"
            with m.State("WAIT_REPLY"):
                m.d.comb += self.reply.ready.eq(1)
                with m.If(self.reply.valid):
                    m.d.sync += [held_reply.eq(self.reply.payload.as_value()),
                                 held_kind.eq(FrameKind.REPLY.value),
                                 ans_kind.eq(FrameKind.REPLY.value)]
                    m.next = "ANSWER"
            with m.State("ANSWER"):
                m.d.comb += ans_start.eq(1)
                m.next = "IDLE"

        # --- transmitter: the answer frame ------------------------------------------------
        m.submodules.tx_crc = tx_crc = FRAME_CRC.create()
        m.submodules.tx_hcrc = tx_hcrc = HEADER_CRC.create()
        reply_len = Signal(8)              # held_reply without its trailing zero bytes
        for i in range(n_reply):
            with m.If(held_reply[8 * i:8 * i + 8] != 0):
                m.d.comb += reply_len.eq(i + 1)
        tx_len = Signal(8)
        tx_index = Signal(8)
        tx_byte = Signal(8)
        reply_byte = Signal(8)
        with m.Switch(tx_index):
            for i in range(n_reply):
                with m.Case(i):
                    m.d.comb += reply_byte.eq(held_reply[8 * i:8 * i + 8])
        m.d.comb += [self.tx.payload.eq(tx_byte), tx_crc.data.eq(tx_byte),
                     tx_hcrc.data.eq(tx_byte)]
        sent = self.tx.valid & self.tx.ready

        with m.FSM(name="tx"):
            with m.State("IDLE"):
                with m.If(ans_start):
                    m.d.sync += [
                        tx_busy.eq(1), tx_index.eq(0),
                        tx_len.eq(Mux(ans_kind == FrameKind.REPLY.value, reply_len,
                                      Mux(ans_kind == FrameKind.ERROR.value, 1, 0))),
                    ]
                    m.d.comb += [tx_crc.start.eq(1), tx_hcrc.start.eq(1)]
                    m.next = "SOF"
            for state, value, nxt, crc_in, hcrc_in in (
                    ("SOF", SOF, "SEQ", False, False), ("SEQ", ans_seq, "KIND", True, True),
                    ("KIND", ans_kind, "LEN", True, True), ("LEN", tx_len, "HCRC", True, True),
                    ("HCRC", tx_hcrc.crc, "PAYLOAD", True, False)):
                with m.State(state):
                    m.d.comb += [self.tx.valid.eq(1), tx_byte.eq(value),
                                 tx_crc.valid.eq(sent & crc_in),
                                 tx_hcrc.valid.eq(sent & hcrc_in)]
                    with m.If(sent):
                        m.next = nxt
                        if state == "HCRC":
                            with m.If(tx_len == 0):
                                m.next = "CRC_HI"
            with m.State("PAYLOAD"):
                m.d.comb += [self.tx.valid.eq(1), tx_crc.valid.eq(sent),
                             tx_byte.eq(Mux(ans_kind == FrameKind.ERROR.value, ans_error,
                                            reply_byte))]
                with m.If(sent):
                    m.d.sync += tx_index.eq(tx_index + 1)
                    with m.If(tx_index + 1 == tx_len):
                        m.next = "CRC_HI"
            with m.State("CRC_HI"):
                m.d.comb += [self.tx.valid.eq(1), tx_byte.eq(tx_crc.crc[8:])]
                with m.If(sent):
                    m.next = "CRC_LO"
            with m.State("CRC_LO"):
                m.d.comb += [self.tx.valid.eq(1), tx_byte.eq(tx_crc.crc[:8])]
                with m.If(sent):
                    m.d.sync += tx_busy.eq(0)
                    m.next = "IDLE"
        return m


class HostBridge(wiring.Component):
    """UART frames to host-port commands and host-port replies to UART frames: a
    :class:`FrameLink` between a :class:`~rdakit.hdl.host.uart.UARTRx` and a
    :class:`~rdakit.hdl.host.uart.UARTTx`.

    Parameters
    ----------
    params : FabricParams
        The fabric whose host port the bridge drives (command and reply layouts).
    divisor : int
        UART clocks per bit (at least 4).
    timeout : int
        Cycles of silence inside a frame after which it is ``TRUNCATED`` (at least 20 bit
        times: a host may pause between bytes).

    Members
    -------
    rx : In(1), tx : Out(1)
        The UART lines (idle high).
    cmd, reply, frames_ok, frames_bad
        The :class:`FrameLink`'s.

    Latency: the :class:`FrameLink`'s, plus the UART receiver's (a byte is delivered 2 cycles
    after the middle of its stop bit).
    """

    def __init__(self, params, *, divisor, timeout=None):
        if not isinstance(params, FabricParams):
            raise TypeError(f"Params must be a FabricParams, not {params!r}")
        check_divisor(divisor)
        if timeout is None:
            timeout = 200 * divisor
        if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 20 * divisor:
            raise TypeError(f"Timeout must be an integer of at least 20 bit times "
                            f"({20 * divisor} cycles), not {timeout!r}")
        self.params = params
        self.divisor = divisor
        self.timeout = timeout
        p = params.mu
        super().__init__({
            "rx": In(1, init=1),
            "tx": Out(1, init=1),
            **_fabric_side(p),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.uart_rx = urx = UARTRx(self.divisor)
        m.submodules.uart_tx = utx = UARTTx(self.divisor)
        m.submodules.link = link = FrameLink(self.params, timeout=self.timeout)
        m.d.comb += [urx.rx.eq(self.rx), self.tx.eq(utx.tx)]
        wiring.connect(m, urx.o, link.rx)
        wiring.connect(m, link.tx, utx.i)
        wiring.connect(m, link.cmd, wiring.flipped(self.cmd))
        wiring.connect(m, wiring.flipped(self.reply), link.reply)
        m.d.comb += [self.frames_ok.eq(link.frames_ok), self.frames_bad.eq(link.frames_bad)]
        return m


class BridgedFabric(wiring.Component):
    """A fabric behind a host bridge: what a board holds, without its pins.

    Parameters
    ----------
    params : FabricParams
    divisor, timeout : int
        Of the :class:`HostBridge`.

    Members
    -------
    rx : In(1), tx : Out(1)
        The UART lines.
    configured, done, error : Out(1)
        The fabric's (for LEDs).
    frames_ok, frames_bad : Out(16)
        The bridge's counters.
    """

    def __init__(self, params, *, divisor, timeout=None):
        self.bridge = HostBridge(params, divisor=divisor, timeout=timeout)
        self.fabric = Fabric(params)
        self.params = params
        super().__init__({
            "rx": In(1, init=1),
            "tx": Out(1, init=1),
            "configured": Out(1),
            "done": Out(1),
            "error": Out(1),
            "frames_ok": Out(16),
            "frames_bad": Out(16),
        })

    def elaborate(self, platform):
        m = Module()
        m.submodules.bridge = bridge = self.bridge
        m.submodules.fabric = fabric = self.fabric
        wiring.connect(m, bridge.cmd, fabric.cmd)
        wiring.connect(m, fabric.reply, bridge.reply)
        m.d.comb += [
            bridge.rx.eq(self.rx),
            self.tx.eq(bridge.tx),
            self.configured.eq(fabric.configured),
            self.done.eq(fabric.done),
            self.error.eq(fabric.error),
            self.frames_ok.eq(bridge.frames_ok),
            self.frames_bad.eq(bridge.frames_bad),
        ]
        return m
