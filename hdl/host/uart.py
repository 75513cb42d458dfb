"""An 8N1 UART: a receiver and a transmitter of byte streams at a fixed clocks-per-bit divisor.

The host bridge (:mod:`rdakit.hdl.host.bridge`) talks to a host over them. amaranth-stdio is not
on PyPI, so they are written here, after its design: the receiver synchronizes the line, waits
half a bit after the falling edge of the start bit, checks the start bit is still low there and
samples every bit in its middle; the transmitter sends a start bit, eight data bits LSB first and
one stop bit, and takes the next byte in the cycle its stop bit ends, so bytes go back to back.
"""

from amaranth.hdl import Cat, Module, Signal
from amaranth.lib import data, stream, wiring
from amaranth.lib.cdc import FFSynchronizer
from amaranth.lib.wiring import In, Out

__all__ = ["UARTRx", "UARTTx", "rx_byte_layout", "baud_divisor", "check_divisor"]

#: A received byte: ``data``, ``framing_error`` (its stop bit was low: the byte is garbage),
#: ``overrun`` (bytes were lost before this one because the previous byte was not taken in time).
rx_byte_layout = data.StructLayout({"data": 8, "framing_error": 1, "overrun": 1})


def check_divisor(divisor):
    if not isinstance(divisor, int) or isinstance(divisor, bool) or not 4 <= divisor < 1 << 24:
        raise TypeError(f"Divisor must be an integer from 4 to 2**24 - 1 clocks per bit, "
                        f"not {divisor!r}")


def baud_divisor(clk_hz, baud, *, tolerance=0.02):
    """The clocks-per-bit divisor for ``baud`` at ``clk_hz``; a ``ValueError`` when the rounded
    divisor misses the baud rate by more than ``tolerance`` (a UART tolerates a few percent)."""
    if not baud > 0:
        raise ValueError(f"Baud rate must be positive, not {baud!r}")
    divisor = round(clk_hz / baud)
    if divisor < 4:
        raise ValueError(f"Baud rate {baud} is too fast for a {clk_hz / 1e6:g} MHz clock "
                         f"(at least 4 clocks a bit, at most {clk_hz / 4:.0f} baud)")
    error = abs(clk_hz / divisor - baud) / baud
    if error > tolerance:
        raise ValueError(f"Baud rate {baud} at {clk_hz / 1e6:g} MHz is off by {error:.1%} "
                         f"with a divisor of {divisor} (tolerance {tolerance:.0%})")
    return divisor


class UARTRx(wiring.Component):
    """UART receiver, 8N1.

    Parameters
    ----------
    divisor : int
        Clock cycles per bit (at least 4).

    Members
    -------
    rx : In(1)
        The serial line (idle high); synchronized inside.
    o : Out(stream.Signature(rx_byte_layout))
        Received bytes. A byte is held until taken; a byte that completes while the previous one
        is still held is dropped and the next byte taken carries ``overrun``. A byte whose stop
        bit is low is passed on with ``framing_error`` set, and the receiver then waits for the
        line to go idle (a break) before looking for the next start bit.

    Latency: a byte is valid 2 cycles (synchronizer) after the middle of its stop bit.
    """

    def __init__(self, divisor):
        check_divisor(divisor)
        self.divisor = divisor
        super().__init__({"rx": In(1, init=1), "o": Out(stream.Signature(rx_byte_layout))})

    def elaborate(self, platform):
        m = Module()
        rx = Signal(init=1)
        m.submodules.sync = FFSynchronizer(self.rx, rx, init=1)

        count = Signal(range(self.divisor))
        bit = Signal(range(8))
        shreg = Signal(8)
        lost = Signal()

        with m.If(self.o.valid & self.o.ready):
            m.d.sync += self.o.valid.eq(0)

        def emit(framing):
            with m.If(self.o.valid & ~self.o.ready):
                m.d.sync += lost.eq(1)     # the held byte stays; this one is dropped
            with m.Else():
                m.d.sync += [self.o.valid.eq(1), self.o.payload.data.eq(shreg),
                             self.o.payload.framing_error.eq(framing),
                             self.o.payload.overrun.eq(lost), lost.eq(0)]

        with m.FSM():
            with m.State("IDLE"):
                with m.If(~rx):
                    m.d.sync += count.eq(self.divisor // 2 - 1)
                    m.next = "START"
            with m.State("START"):
                m.d.sync += count.eq(count - 1)
                with m.If(count == 0):
                    m.d.sync += [count.eq(self.divisor - 1), bit.eq(0)]
                    # A start bit that is high again in its middle was a glitch.
                    with m.If(rx):
                        m.next = "IDLE"
                    with m.Else():
                        m.next = "DATA"
            with m.State("DATA"):
                m.d.sync += count.eq(count - 1)
                with m.If(count == 0):
                    m.d.sync += [count.eq(self.divisor - 1), shreg.eq(Cat(shreg[1:], rx)),
                                 bit.eq(bit + 1)]
                    with m.If(bit == 7):
                        m.next = "STOP"
            with m.State("STOP"):
                m.d.sync += count.eq(count - 1)
                with m.If(count == 0):
                    emit(~rx)
                    m.next = "IDLE"
                    with m.If(~rx):
                        m.next = "BREAK"
            with m.State("BREAK"):
                with m.If(rx):
                    m.next = "IDLE"
        return m


class UARTTx(wiring.Component):
    """UART transmitter, 8N1.

    Parameters
    ----------
    divisor : int
        Clock cycles per bit (at least 4).

    Members
    -------
    i : In(stream.Signature(8))
        Bytes to send. A byte is taken when the line is idle or in the last cycle of the
        previous stop bit, so a stream of bytes goes out back to back, 10 bits a byte.
    tx : Out(1)
        The serial line, high when idle.
    """

    def __init__(self, divisor):
        check_divisor(divisor)
        self.divisor = divisor
        super().__init__({"i": In(stream.Signature(8)), "tx": Out(1, init=1)})

    def elaborate(self, platform):
        m = Module()
        count = Signal(range(self.divisor))
        bits = Signal(range(11))          # bits left to send, the current one included
        shreg = Signal(10, init=1)        # shreg[0] is on the line
        last = (bits == 0) | ((bits == 1) & (count == 0))
        m.d.comb += [self.tx.eq(shreg[0]), self.i.ready.eq(last)]
        with m.If(self.i.valid & self.i.ready):
            m.d.sync += [shreg.eq(Cat(0, self.i.payload, 1)), bits.eq(10),
                         count.eq(self.divisor - 1)]
        with m.Elif(bits != 0):
            m.d.sync += count.eq(count - 1)
            with m.If(count == 0):
                m.d.sync += [count.eq(self.divisor - 1), bits.eq(bits - 1),
                             shreg.eq(Cat(shreg[1:], 1))]
        return m
