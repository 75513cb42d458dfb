"""The host side of the board link: :class:`FramedTransport` speaks the frame protocol
(:mod:`rdakit.hdl.spec.frames`) over a byte port, as a
:class:`~rdakit.sim.runtime.host.HostDriver` transport.

A *port* moves bytes: ``async write(data)``, ``async read_byte() -> int | None`` (``None`` when
the line stayed quiet for the port's timeout) and ``async tick(n)``; its ``timeout`` and
``timeout_unit`` (``"cycles"``, ``"s"``) say how long a quiet line is, for error messages.
:class:`SimUARTPort` is the serial line of a :class:`~rdakit.hdl.host.bridge.HostBridge` in
Amaranth's simulator, bit by bit; ``rdakit.boards.serial_link.SerialPort`` is a real serial port
through pyserial. The same transport and the same driver run on both.

The transport sends one frame and waits for its answer before the next. A frame answered with
``ERROR``, or not answered in time, is sent again with the same SEQ (the bridge never applies a
bad frame, and answers a resent frame it already applied without applying it again), up to
``retries`` times. Every wait is bounded: for one try, until the line is quiet for the port's
timeout or :attr:`FramedTransport.max_answer_bytes` bytes came without the answer (a line that
never stops babbling); after the last try, :class:`LinkError` names the frame's kind and SEQ,
the tries, the wait of each and the errors answered.
"""

import collections

from rdakit.hdl.spec.frames import (
    HEADER_BYTES,
    TRAILER_BYTES,
    BadFrame,
    FrameError,
    FrameKind,
    FrameParser,
    cmd_bytes,
    encode_frame,
    int_payload,
    reply_bytes,
)
from rdakit.hdl.spec.packets import host_reply_layout

__all__ = ["FramedTransport", "LinkError", "SimUARTPort", "CocotbUARTPort", "uart_bits"]


_ERROR_CODES = frozenset(e.value for e in FrameError)


class LinkError(RuntimeError):
    """The board did not answer a frame after every retry, or answered it with a kind that
    does not answer it."""


class FramedTransport:
    """A host-driver transport over a byte port.

    Parameters
    ----------
    params : FabricParams
        The fabric behind the bridge (command and reply sizes).
    port : object
        A byte port (see the module's docstring).
    retries : int
        Resends of a frame before :class:`LinkError`.

    Members
    -------
    errors : list of (FrameError, seq)
        The ``ERROR`` answers received for this transport's frames.
    resends : int
        Frames sent again (after an ``ERROR`` or a timeout).
    bad_answers : int
        Bytes from the board that did not make a good frame, and ``ERROR`` frames without a
        known code (dropped).
    max_answer_bytes : int
        Bytes read while waiting for one answer before the try is given up: the answers of
        every try of a frame, twice over.
    """

    def __init__(self, params, port, *, retries=4):
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ValueError(f"Retries must be a non-negative integer, not {retries!r}")
        self.params = params
        self.port = port
        self.retries = retries
        self.cmd_bytes = cmd_bytes(params.mu)
        self.parser = FrameParser({FrameKind.REPLY: host_reply_layout(params.mu).size,
                                   FrameKind.ACK: 0, FrameKind.ERROR: 8})
        longest = HEADER_BYTES + reply_bytes(params.mu) + TRAILER_BYTES
        self.max_answer_bytes = 2 * (retries + 1) * longest
        self.seq = 0
        self.opened = False
        self.replies = collections.deque()
        self.errors = []
        self.resends = 0
        self.bad_answers = 0

    async def open(self):
        """Start a session (``OPEN``): the bridge forgets the last SEQ it applied, so the first
        command is applied whatever its SEQ."""
        answer = await self.exchange(FrameKind.OPEN)
        if answer.kind is not FrameKind.ACK:
            raise LinkError(f"OPEN answered with {answer.kind.name}")
        self.opened = True

    async def send(self, value):
        if not self.opened:
            await self.open()
        answer = await self.exchange(FrameKind.CMD, int_payload(value, self.cmd_bytes))
        if answer.kind is FrameKind.REPLY:
            self.replies.append(answer.value)
        elif answer.kind is not FrameKind.ACK:
            raise LinkError(f"a command answered with {answer.kind.name}")

    async def recv(self):
        if not self.replies:
            raise LinkError("no reply pending: the last command was acknowledged without one")
        return self.replies.popleft()

    async def tick(self, n=1):
        await self.port.tick(n)

    async def exchange(self, kind, payload=b""):
        """Send one frame and return its answer (a REPLY or ACK :class:`Frame`), resending it
        after an ``ERROR`` answer or a timeout."""
        seq = self.seq
        self.seq = (seq + 1) % 256
        frame = encode_frame(kind, seq, payload)
        errors = []
        for attempt in range(self.retries + 1):
            if attempt:
                self.resends += 1
            await self.port.write(frame)
            answer = await self._answer(seq)
            if answer is None:
                continue
            if answer.kind is FrameKind.ERROR:
                errors.append(FrameError(answer.payload[0]).name)
                self.errors.append((FrameError(answer.payload[0]), seq))
                continue
            return answer
        timeout = getattr(self.port, "timeout", None)
        quiet = (f"a quiet line of {timeout} {getattr(self.port, 'timeout_unit', '')}".rstrip()
                 if timeout is not None else "a quiet line")
        raise LinkError(f"no answer to a {FrameKind(kind).name} frame (SEQ {seq}) after "
                        f"{self.retries + 1} tries, each waiting until {quiet} or "
                        f"{self.max_answer_bytes} bytes without it; errors answered: "
                        f"{', '.join(errors) or 'none'}")

    async def _answer(self, seq):
        """The next good frame with SEQ ``seq`` (other SEQs are stale answers of resent
        frames, skipped), or ``None`` if the line goes quiet first or ``max_answer_bytes``
        bytes come without it."""
        for _ in range(self.max_answer_bytes):
            b = await self.port.read_byte()
            if b is None:
                self.bad_answers += len(self.parser.timeout())
                return None
            for event in self.parser.feed([b]):
                if isinstance(event, BadFrame):
                    self.bad_answers += 1
                elif event.seq == seq:
                    if event.kind is FrameKind.ERROR and (
                            len(event.payload) != 1
                            or event.payload[0] not in _ERROR_CODES):
                        self.bad_answers += 1
                        continue
                    return event
        self.bad_answers += len(self.parser.timeout())    # the frame in progress is dropped
        return None


def uart_bits(byte):
    """The line levels of one 8N1 byte: start bit, data bits LSB first, stop bit."""
    return [0] + [byte >> i & 1 for i in range(8)] + [1]


class SimUARTPort:
    """The serial line of a bridge in Amaranth's simulator.

    ``write`` drives ``rx`` bit by bit from the calling testbench; a background testbench
    (:meth:`receiver`, add it with ``background=True``) decodes ``tx`` like a UART receiver
    (waiting for the falling edge of a start bit, sampling each bit in its middle) into a
    queue, which ``read_byte`` takes from. ``timeout`` is in cycles. ``write_bits`` sends raw
    line levels, one a bit time (tests use it for framing errors).
    """

    timeout_unit = "cycles"

    def __init__(self, ctx, rx, tx, *, divisor, timeout):
        self.ctx = ctx
        self.rx = rx
        self.tx = tx
        self.divisor = divisor
        self.timeout = timeout
        self.received = collections.deque()
        self.framing_errors = 0

    async def write(self, data):
        for byte in bytes(data):
            await self.write_bits(uart_bits(byte))

    async def write_bits(self, bits):
        for bit in bits:
            self.ctx.set(self.rx, bit)
            await self.ctx.tick().repeat(self.divisor)

    async def read_byte(self):
        waited = 0
        while not self.received:
            if waited >= self.timeout:
                return None
            await self.ctx.tick().repeat(self.divisor)
            waited += self.divisor
        return self.received.popleft()

    async def tick(self, n=1):
        await self.ctx.tick().repeat(n)

    async def receiver(self, ctx):
        d = self.divisor
        while True:
            await ctx.negedge(self.tx)
            await ctx.tick().repeat(d // 2)
            if ctx.get(self.tx):
                continue                    # a glitch, not a start bit
            byte = 0
            for i in range(8):
                await ctx.tick().repeat(d)
                byte |= ctx.get(self.tx) << i
            await ctx.tick().repeat(d)
            if not ctx.get(self.tx):
                self.framing_errors += 1
                continue
            self.received.append(byte)


class CocotbUARTPort:
    """The serial line of a bridge's Verilog under cocotb (ports ``rx``, ``tx``, ``clk``), like
    :class:`SimUARTPort`: ``write`` drives ``rx``; :meth:`start` launches a receiver that decodes
    ``tx`` into a queue. ``timeout`` is in cycles. The clock must already run.

    Its methods import cocotb themselves: cocotb is in the ``test`` extra only, and this module
    is also the link to a real board (``rdakit board``), which must run without it."""

    timeout_unit = "cycles"

    def __init__(self, dut, *, divisor, timeout):
        self.dut = dut
        self.divisor = divisor
        self.timeout = timeout
        self.received = collections.deque()
        self.framing_errors = 0

    def start(self):
        import cocotb  # deferred: cocotb is a test extra

        self.dut.rx.value = 1
        cocotb.start_soon(self._receiver())

    async def write(self, data):
        for byte in bytes(data):
            await self.write_bits(uart_bits(byte))

    async def write_bits(self, bits):
        from cocotb.triggers import ClockCycles  # deferred: cocotb is a test extra

        for bit in bits:
            self.dut.rx.value = bit
            await ClockCycles(self.dut.clk, self.divisor)

    async def read_byte(self):
        from cocotb.triggers import ClockCycles  # deferred: cocotb is a test extra

        waited = 0
        while not self.received:
            if waited >= self.timeout:
                return None
            await ClockCycles(self.dut.clk, self.divisor)
            waited += self.divisor
        return self.received.popleft()

    async def tick(self, n=1):
        from cocotb.triggers import ClockCycles  # deferred: cocotb is a test extra

        await ClockCycles(self.dut.clk, n)

    async def _receiver(self):
        from cocotb.triggers import ClockCycles, FallingEdge  # deferred: cocotb is a test extra

        d, tx, clk = self.divisor, self.dut.tx, self.dut.clk
        while True:
            await FallingEdge(tx)
            await ClockCycles(clk, d // 2)
            if tx.value:
                continue
            byte = 0
            for i in range(8):
                await ClockCycles(clk, d)
                byte |= int(tx.value) << i
            await ClockCycles(clk, d)
            if not tx.value:
                self.framing_errors += 1
                continue
            self.received.append(byte)
