"""cocotb tests of a :class:`rdakit.hdl.noc.mesh.Mesh` (generated Verilog), run by
``test_noc_cosim.py`` on Icarus and Verilator.

Drivers, monitor, model and checker are separate: every tile's ``inject`` port has a
:class:`StreamSource` fed by a traffic generator (:class:`rdakit.sim.models.noc.Destinations`),
every ``eject`` port a :class:`StreamSink` with random back-pressure whose items go to the
scoreboard (:class:`rdakit.sim.models.noc.NocScoreboard`: exactly once, right tile, unchanged, in
order per source/destination pair). After the traffic the network must drain completely, and
the routers' counters must match the routes of the delivered packets.

Configuration (``RDAKIT_TB_CONFIG``): ``rows``, ``cols``, ``coord_bits``, ``packets`` (per
pattern), ``rate`` (probability that a source offers its next packet in a cycle),
``eject_pause`` (probability that a sink is ready in a cycle), ``reject_fraction`` (share of
packets addressed outside the mesh), ``seed``.
"""

import random

import cocotb
import numpy as np

from rdakit.hdl.spec.flit import Port
from rdakit.sim.models.noc import PATTERNS, Destinations, NocScoreboard, hops
from rdakit.sim.verify.cocotb_utils import ClockedBench, StreamSink, StreamSource, tb_config

CFG = tb_config()
ROWS = CFG.get("rows", 3)
COLS = CFG.get("cols", 3)
COORD_BITS = CFG.get("coord_bits", 2)
N = ROWS * COLS


class MeshTB:
    """Clock, reset, one source and one sink per tile, and the scoreboard."""

    def __init__(self, dut, *, rate="none", eject_pause="none", seed=0):
        self.dut = dut
        self.bench = ClockedBench(dut)
        self.sb = NocScoreboard(ROWS, COLS, COORD_BITS)
        self.sources = [StreamSource(self.bench, f"inject__{t}", pause=rate, seed=seed + t)
                        for t in range(N)]
        self.sinks = [StreamSink(self.bench, f"eject__{t}", pause=eject_pause,
                                 seed=seed + 1000 + t, on_item=self._checker(t))
                      for t in range(N)]

    def _checker(self, t):
        return lambda value: self.sb.eject(t, value)

    def counters(self, name):
        """A router counter array of the mesh as a numpy array (tiles × ports)."""
        return np.array([[getattr(self.dut, f"{name}__{t}__{p}").value.to_unsigned()
                          for p in range(len(Port))] for t in range(N)])

    async def drain(self, limit):
        """Run until every source is empty and every packet delivered, at most ``limit``
        cycles; fail (deadlock or loss) otherwise."""
        for _ in range(limit):
            if self.sb.outstanding == 0 and not any(s.pending for s in self.sources):
                break
            await self.bench.cycle()
        assert not any(s.pending for s in self.sources), (
            f"sources still hold {sum(s.pending for s in self.sources)} packets after {limit} "
            f"cycles (injection stalled: deadlock?)")
        self.sb.check_complete()
        # A few more cycles: nothing else may come out.
        for _ in range(10):
            await self.bench.cycle()


@cocotb.test()
async def test_outputs_resolvable_after_reset(dut):
    """Every output is a known value right after reset (Icarus would show X)."""
    tb = MeshTB(dut)
    for t in range(N):
        # `ready` of an inject port depends on the payload (the flit's output queue).
        getattr(dut, f"inject__{t}__payload").value = 0
    await tb.bench.reset()
    for t in range(N):
        for name in ("valid", "payload"):
            assert getattr(dut, f"eject__{t}__{name}").value.is_resolvable
        assert getattr(dut, f"inject__{t}__ready").value.is_resolvable
        assert getattr(dut, f"rejected__{t}").value.is_resolvable
        assert getattr(dut, f"reject__{t}").value.is_resolvable
        for p in range(len(Port)):
            assert getattr(dut, f"forwarded__{t}__{p}").value.to_unsigned() == 0
            assert getattr(dut, f"blocked__{t}__{p}").value.to_unsigned() == 0


@cocotb.test()
async def test_zero_load_latency(dut):
    """Alone in the network, a packet is offered at its destination hops + 2 cycles after
    its injection handshake, for every source and destination."""
    tb = MeshTB(dut)
    await tb.bench.reset()
    for s in range(N):
        for d in range(N):
            dst = (d % COLS, d // COLS)
            tb.sources[s].send(tb.sb.make(s, dst))
            await tb.drain(100)
            sent = tb.sources[s].sent[-1][0]
            got = tb.sinks[d].received[-1][0]
            want = hops((s % COLS, s // COLS), dst) + 2
            assert got - sent == want, (f"tile {s} to tile {d}: latency {got - sent} cycles, "
                                        f"expected {want}")


@cocotb.test()
@cocotb.parametrize(pattern=list(PATTERNS))
async def test_traffic(dut, pattern):
    """Several thousand packets of one pattern with random back-pressure at every ejection
    port; some addressed outside the mesh. Everything drains, exactly once and in order; the
    forwarded counters match the XY routes; the rejected counters match the bad packets."""
    seed = CFG.get("seed", 1) + PATTERNS.index(pattern) * 7919
    tb = MeshTB(dut, rate=CFG.get("rate", 0.6), eject_pause=CFG.get("eject_pause", 0.6),
                seed=seed)
    await tb.bench.reset()
    rng = random.Random(seed)
    dests = Destinations(pattern, ROWS, COLS, seed=seed, hotspot=(COLS // 2, ROWS // 2))
    reject_fraction = CFG.get("reject_fraction", 0.02) if COLS < 1 << COORD_BITS else 0
    packets = CFG.get("packets", 3000)
    for _ in range(packets):
        s = rng.randrange(N)
        if rng.random() < reject_fraction:
            dst = (rng.randrange(COLS, 1 << COORD_BITS), rng.randrange(1 << COORD_BITS))
        else:
            dst = dests.draw(s)
        tb.sources[s].send(tb.sb.make(s, dst))
    await tb.drain(limit=40 * packets + 2000)
    dut._log.info("%s: %d packets delivered, %d rejected, in %d cycles", pattern,
                  tb.sb.delivered, sum(tb.sb.rejects.values()), tb.bench.cycles)
    forwarded = tb.counters("forwarded")
    assert (forwarded == tb.sb.forwarded).all(), (
        f"forwarded counters differ from the XY routes:\n{forwarded}\nexpected\n"
        f"{tb.sb.forwarded}")
    for t in range(N):
        got = getattr(dut, f"rejected__{t}").value.to_unsigned()
        assert got == tb.sb.rejects[t], f"tile {t}: rejected {got}, expected {tb.sb.rejects[t]}"
    blocked = tb.counters("blocked")
    if CFG.get("eject_pause", 0.6) not in ("none", 1, 1.0):
        # With back-pressure at every sink, ejection ports must have been blocked sometimes.
        assert blocked[:, Port.LOCAL.value].sum() > 0
