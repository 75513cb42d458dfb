"""Helpers for Amaranth's built-in simulator: the fast, no-tool backend of unit tests and benches.

``stream_put``/``stream_get`` move one payload through an ``amaranth.lib.stream`` port (after
Glasgow's helpers); :func:`simulate` runs testbenches on a component with a 1 ns ``sync`` clock
and an optional VCD file; :class:`StreamDriver` feeds a list of payloads into a stream and
collects another stream's output at the same time, with optional idle and back-pressure
patterns, recording the cycle of every transfer (for throughput and latency figures).
"""

import itertools
import random

from amaranth.hdl import ClockDomain, Elaboratable, Module
from amaranth.sim import Simulator

__all__ = ["simulate", "stream_put", "stream_get", "StreamDriver", "WithReset"]


class WithReset(Elaboratable):
    """Wraps a design in an explicit ``sync`` domain whose ``rst`` a testbench can drive,
    to test run-time reset (``ctx.set(top.rst, 1)``)."""

    def __init__(self, dut):
        self.dut = dut
        self.domain = ClockDomain("sync")
        self.rst = self.domain.rst

    def elaborate(self, platform):
        m = Module()
        m.domains.sync = self.domain
        m.submodules.dut = self.dut
        return m


def simulate(component, *testbenches, background=(), vcd=None, clock=1e-9):
    """Run ``testbenches`` (``async def tb(ctx)``) on ``component`` until they all return.

    ``background`` testbenches run alongside and are abandoned when the others finish.
    ``vcd`` is a file name (``str``) for a waveform dump.
    """
    sim = Simulator(component)
    sim.add_clock(clock)
    for tb in testbenches:
        sim.add_testbench(tb)
    for tb in background:
        sim.add_testbench(tb, background=True)
    if vcd is not None:
        with sim.write_vcd(str(vcd)):
            sim.run()
    else:
        sim.run()


async def stream_put(ctx, stream, payload):
    """Offer ``payload`` on ``stream`` until it is taken."""
    ctx.set(stream.valid, 1)
    ctx.set(stream.payload, payload)
    await ctx.tick().until(stream.ready)
    ctx.set(stream.valid, 0)


async def stream_get(ctx, stream):
    """Take one payload from ``stream``."""
    ctx.set(stream.ready, 1)
    payload, = await ctx.tick().sample(stream.payload).until(stream.valid)
    ctx.set(stream.ready, 0)
    return payload


def _pattern(kind, seed):
    if kind in (None, "none"):
        return itertools.repeat(True)
    if kind == "cycle":
        return itertools.cycle([True, True, True, False])
    rng = random.Random(seed)
    p = float(kind)
    return iter(lambda: rng.random() < p, None)


class StreamDriver:
    """Drive ``source`` with a list of integer payloads and collect ``sink`` in one simulation.

    Parameters
    ----------
    component : wiring.Component
        The design under test.
    source, sink : stream interfaces of ``component``
        Input and output streams.
    idle, backpressure : None, "cycle" or float
        Pause patterns: ``"cycle"`` is 1, 1, 1, 0; a float is the probability of going each
        cycle (seeded).

    After :meth:`run`, ``sent`` and ``received`` hold ``(cycle, payload)`` of each transfer.
    """

    def __init__(self, component, source, sink, *, idle=None, backpressure=None, seed=0):
        self.component = component
        self.source = source
        self.sink = sink
        self.idle = idle
        self.backpressure = backpressure
        self.seed = seed
        self.sent = []
        self.received = []

    def run(self, payloads, *, expect=None, max_cycles=None, vcd=None, feed=None):
        """Send ``payloads`` and collect ``expect`` outputs (default: one per payload sent).

        ``feed(received_value)`` may return more payloads to send (closed-loop stimulus).
        Cycle numbers count clock edges from the start of the simulation; a transfer at cycle
        *c* happened at edge *c*.
        """
        payloads = list(payloads)
        go_in = _pattern(self.idle, self.seed)
        go_out = _pattern(self.backpressure, self.seed + 1)
        limit = max_cycles or (100 * len(payloads) + 100_000)
        done = [False]
        src_payload = self.source.payload.as_value()
        sink_payload = self.sink.payload.as_value()

        async def producer(ctx):
            i = cycle = 0
            while not done[0]:
                offer = i < len(payloads) and next(go_in)
                ctx.set(self.source.valid, offer)
                if offer:
                    ctx.set(src_payload, payloads[i])
                _, _, ready = await ctx.tick().sample(self.source.ready)
                cycle += 1
                if offer and ready:
                    self.sent.append((cycle, payloads[i]))
                    i += 1

        async def consumer(ctx):
            cycle = 0
            while True:
                target = expect if expect is not None else len(payloads)
                if len(self.received) >= target and len(self.sent) >= len(payloads):
                    done[0] = True
                    return
                if cycle > limit:
                    raise TimeoutError(f"Stream driver: {len(self.received)} of {target} "
                                       f"outputs after {limit} cycles")
                r = next(go_out)
                ctx.set(self.sink.ready, r)
                _, _, valid, value = await ctx.tick().sample(self.sink.valid, sink_payload)
                cycle += 1
                if r and valid:
                    self.received.append((cycle, value))
                    if feed is not None:
                        payloads.extend(feed(value) or ())

        simulate(self.component, producer, consumer, vcd=vcd)
        return self.received
