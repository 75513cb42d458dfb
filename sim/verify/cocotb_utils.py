"""cocotb drivers and monitors for ``amaranth.lib.stream`` ports, run from one clocked loop.

A :class:`ClockedBench` owns the clock and reset of a design and a list of endpoints. Each call
of :meth:`ClockedBench.cycle` advances one clock cycle in two phases: after the rising edge every
endpoint drives its inputs for the new cycle, then in the read-only phase every endpoint samples
the settled values and records the transfers that the next edge will make (``valid & ready``).
One coroutine for the whole bench is several times faster than one coroutine per endpoint.

Stream ports of an Amaranth component appear in its Verilog as ``<name>__valid``,
``<name>__ready`` and ``<name>__payload`` (the payload a flat vector, first field in the low bits).
"""

import itertools
import json
import os
import random

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ReadOnly, RisingEdge

__all__ = ["tb_config", "ClockedBench", "StreamSource", "StreamSink", "pauses"]


def tb_config():
    """The JSON configuration :func:`rdakit.sim.verify.runner.run_cocotb` passed to this run."""
    return json.loads(os.environ.get("RDAKIT_TB_CONFIG", "{}"))


def pauses(kind, *, seed=0):
    """An endless iterator of 1 (go) / 0 (pause) decisions.

    ``kind`` is ``"none"`` (always go), ``"cycle"`` (``1, 1, 1, 0`` as in cocotbext-axi) or a
    float probability of going each cycle (random, seeded).
    """
    if kind in (None, "none"):
        return itertools.repeat(1)
    if kind == "cycle":
        return itertools.cycle([1, 1, 1, 0])
    rng = random.Random(seed)
    p = float(kind)
    return iter(lambda: 1 if rng.random() < p else 0, None)


class ClockedBench:
    """Clock, reset and the per-cycle loop of a design with ``clk`` and ``rst`` ports."""

    def __init__(self, dut, *, period_ns=10):
        self.dut = dut
        self.cycles = 0
        self.endpoints = []
        # Triggers are reused: creating them every cycle is a large share of the cost.
        self._edge = RisingEdge(dut.clk)
        self._read_only = ReadOnly()
        cocotb.start_soon(Clock(dut.clk, period_ns, unit="ns").start())

    def add(self, endpoint):
        self.endpoints.append(endpoint)
        return endpoint

    async def reset(self, cycles=2):
        # Leave a read-only phase (the end of a previous cycle()) before writing.
        await RisingEdge(self.dut.clk)
        self.dut.rst.value = 1
        for ep in self.endpoints:
            ep.idle()
        for _ in range(cycles):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)
        await ReadOnly()

    async def cycle(self):
        await self._edge
        self.cycles += 1
        for ep in self.endpoints:
            ep.drive()
        await self._read_only
        for ep in self.endpoints:
            ep.sample()


class StreamSource:
    """Drives ``<name>__valid``/``__payload`` from a queue; pauses between items when asked.

    ``sent`` lists ``(cycle, value)`` of every transfer. A producer never waits for ``ready``
    before raising ``valid`` (the stream contract).
    """

    def __init__(self, bench, name, *, pause="none", seed=0):
        dut = bench.dut
        self.bench = bench
        self.valid = getattr(dut, f"{name}__valid")
        self.ready = getattr(dut, f"{name}__ready")
        self.payload = getattr(dut, f"{name}__payload")
        self.queue = []
        self._head = 0
        self.sent = []
        self._pause = pauses(pause, seed=seed)
        self._presenting = False
        bench.add(self)

    def send(self, value):
        self.queue.append(value)

    @property
    def pending(self):
        return len(self.queue) - self._head

    def idle(self):
        self.valid.value = 0

    def drive(self):
        if self._presenting:
            return  # still waiting for ready: hold valid and payload
        if self._head < len(self.queue) and next(self._pause):
            self.payload.value = self.queue[self._head]
            self.valid.value = 1
            self._presenting = True
        else:
            self.valid.value = 0

    def sample(self):
        if self._presenting and self.ready.value:
            self.sent.append((self.bench.cycles, self.queue[self._head]))
            self._head += 1
            self._presenting = False
            self._release()

    def _release(self):
        # Drop consumed items now and then so long runs do not keep them all.
        if self._head > 4096:
            del self.queue[:self._head]
            self._head = 0


class StreamSink:
    """Drives ``<name>__ready`` (with back-pressure when asked) and records every transfer as
    ``(cycle, value)`` in ``received``; ``on_item(value)`` is called for each one if given."""

    def __init__(self, bench, name, *, pause="none", seed=1, on_item=None, keep=True):
        dut = bench.dut
        self.bench = bench
        self.valid = getattr(dut, f"{name}__valid")
        self.ready = getattr(dut, f"{name}__ready")
        self.payload = getattr(dut, f"{name}__payload")
        self.name = name
        self.received = []
        self.count = 0
        self.keep = keep
        self.on_item = on_item
        self._pause = pauses(pause, seed=seed)
        self._ready = 0
        bench.add(self)

    def idle(self):
        self.ready.value = 0

    def drive(self):
        self._ready = next(self._pause)
        self.ready.value = self._ready

    def sample(self):
        if self._ready and self.valid.value:
            raw = self.payload.value
            if not raw.is_resolvable:
                raise AssertionError(f"{self.name} payload has unknown bits at cycle "
                                     f"{self.bench.cycles}: {raw}")
            value = raw.to_unsigned()
            self.count += 1
            if self.keep:
                self.received.append((self.bench.cycles, value))
            if self.on_item is not None:
                self.on_item(value)
