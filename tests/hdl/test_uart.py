# amaranth: UnusedElaboratable=no
"""The UART against a bit-level model: exact bit timing, back-to-back bytes, framing errors,
overrun, glitches, and the divisor arithmetic."""

import random

import pytest
from amaranth.hdl import Module
from amaranth.lib import wiring

from rdakit.hdl.host.uart import UARTRx, UARTTx, baud_divisor
from rdakit.sim.runtime.host_link import uart_bits
from rdakit.sim.verify.amaranth_sim import simulate


@pytest.mark.parametrize("divisor", [4, 5, 9])
def test_tx_bit_timing_back_to_back(divisor):
    """Every bit lasts exactly ``divisor`` cycles and byte n+1's start bit follows byte n's
    stop bit with no idle cycle between them."""
    tx = UARTTx(divisor)
    data = [0x00, 0xff, 0xa5, 0x5a, 0x01, 0x80]
    levels = []

    async def feed(ctx):
        await ctx.tick().repeat(5)
        for b in data:
            ctx.set(tx.i.valid, 1)
            ctx.set(tx.i.payload, b)
            await ctx.tick().until(tx.i.ready)
        ctx.set(tx.i.valid, 0)
        await ctx.tick().repeat(12 * divisor)

    async def watch(ctx):
        while True:
            _, _, line = await ctx.tick().sample(tx.tx)
            levels.append(line)

    simulate(tx, feed, background=[watch])
    # The first byte starts after the cycle it was taken; find it and compare every cycle.
    start = levels.index(0)
    assert start >= 5 and all(v == 1 for v in levels[:start])    # idle high before it
    expect = [bit for b in data for bit in uart_bits(b) for _ in range(divisor)]
    assert levels[start:start + len(expect)] == expect
    assert all(v == 1 for v in levels[start + len(expect):])


def _rx_run(divisor, bits, *, take=True, n_expect):
    rx = UARTRx(divisor)
    got = []

    async def drive(ctx):
        ctx.set(rx.rx, 1)
        await ctx.tick().repeat(3)
        for bit in bits:
            ctx.set(rx.rx, bit)
            await ctx.tick().repeat(divisor)
        ctx.set(rx.rx, 1)
        await ctx.tick().repeat(4 * divisor)

    async def sink(ctx):
        ctx.set(rx.o.ready, take)
        while True:
            _, _, valid, payload = await ctx.tick().sample(rx.o.valid, rx.o.payload)
            if valid and take:
                got.append((payload.data, payload.framing_error, payload.overrun))

    simulate(rx, drive, background=[sink])
    return got


@pytest.mark.parametrize("divisor", [4, 6, 13])
def test_rx_random_bytes_back_to_back(divisor):
    rng = random.Random(divisor)
    data = [rng.randrange(256) for _ in range(40)] + [0x00, 0xff]
    got = _rx_run(divisor, [b for x in data for b in uart_bits(x)], n_expect=len(data))
    assert got == [(x, 0, 0) for x in data]


def test_rx_framing_error_then_recovers():
    """A byte with a low stop bit is flagged; the receiver waits for the line to go high (a
    break) and then receives the next byte normally."""
    bad = uart_bits(0x3c)[:-1] + [0, 0, 0]
    bits = uart_bits(0x11) + bad + [1] + uart_bits(0x22)
    assert _rx_run(4, bits, n_expect=3) == [(0x11, 0, 0), (0x3c, 1, 0), (0x22, 0, 0)]


def test_rx_start_glitch_is_not_a_byte():
    """A low pulse shorter than half a bit is ignored."""
    got = _rx_run(8, [1] * 2 + uart_bits(0x42), n_expect=1)
    assert got == [(0x42, 0, 0)]
    rx = UARTRx(8)
    seen = []

    async def drive(ctx):
        ctx.set(rx.rx, 0)
        await ctx.tick().repeat(2)        # 2 cycles low: a glitch
        ctx.set(rx.rx, 1)
        await ctx.tick().repeat(200)

    async def sink(ctx):
        ctx.set(rx.o.ready, 1)
        while True:
            _, _, valid = await ctx.tick().sample(rx.o.valid)
            seen.append(valid)

    simulate(rx, drive, background=[sink])
    assert not any(seen)


def test_rx_overrun_is_flagged_on_the_next_byte():
    """With nobody taking bytes, the first is held, the second and third are lost; the byte
    after them carries ``overrun``."""
    rx = UARTRx(4)
    got = []

    async def tb(ctx):
        ctx.set(rx.rx, 1)
        for b in (0x01, 0x02, 0x03):
            for bit in uart_bits(b):
                ctx.set(rx.rx, bit)
                await ctx.tick().repeat(4)
        await ctx.tick().repeat(8)
        ctx.set(rx.o.ready, 1)
        payload, = await ctx.tick().sample(rx.o.payload).until(rx.o.valid)
        got.append((payload.data, payload.overrun))
        for bit in uart_bits(0x04):
            ctx.set(rx.rx, bit)
            await ctx.tick().repeat(4)
        payload, = await ctx.tick().sample(rx.o.payload).until(rx.o.valid)
        got.append((payload.data, payload.overrun))

    simulate(rx, tb)
    assert got == [(0x01, 0), (0x04, 1)]


class _Loop(wiring.Component):
    def __init__(self, divisor):
        self.tx = UARTTx(divisor)
        self.rx = UARTRx(divisor)
        super().__init__({})

    def elaborate(self, platform):
        m = Module()
        m.submodules.tx, m.submodules.rx = self.tx, self.rx
        m.d.comb += self.rx.rx.eq(self.tx.tx)
        return m


@pytest.mark.parametrize("divisor", [4, 7])
def test_loopback_at_full_rate(divisor):
    loop = _Loop(divisor)
    data = list(range(0, 256, 7))
    got = []

    async def feed(ctx):
        for b in data:
            ctx.set(loop.tx.i.valid, 1)
            ctx.set(loop.tx.i.payload, b)
            await ctx.tick().until(loop.tx.i.ready)
        ctx.set(loop.tx.i.valid, 0)
        await ctx.tick().repeat(12 * divisor)

    async def sink(ctx):
        ctx.set(loop.rx.o.ready, 1)
        while True:
            _, _, valid, payload = await ctx.tick().sample(loop.rx.o.valid, loop.rx.o.payload)
            if valid:
                got.append(payload.data)

    simulate(loop, feed, background=[sink])
    assert got == data


@pytest.mark.parametrize("cls", [UARTRx, UARTTx])
@pytest.mark.parametrize("divisor", [3, 0, "8", True, 1 << 24])
def test_init_wrong_divisor(cls, divisor):
    with pytest.raises(TypeError, match=r"^Divisor must be an integer from 4 to 2\*\*24 - 1 "
                                        r"clocks per bit, not "):
        cls(divisor)


def test_baud_divisor():
    assert baud_divisor(12e6, 115200) == 104
    assert baud_divisor(50e6, 1_000_000) == 50
    with pytest.raises(ValueError, match=r"^Baud rate 4000000 is too fast for a 12 MHz clock"):
        baud_divisor(12e6, 4_000_000)
    with pytest.raises(ValueError, match=r"^Baud rate 2200000 at 12 MHz is off by 9\.1% with "
                                         r"a divisor of 5"):
        baud_divisor(12e6, 2_200_000)
    with pytest.raises(ValueError, match=r"^Baud rate must be positive, not 0$"):
        baud_divisor(12e6, 0)
