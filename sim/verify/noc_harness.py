"""A synthesizable traffic harness around a :class:`~rdakit.hdl.noc.mesh.Mesh`, for benchmarks.

Simulating 64 tiles from Python every cycle is slow, so the NoC benchmark drives the mesh from
hardware: every tile has a Bernoulli packet source (a xorshift generator compared with the
injection rate, an input) and a sink that accumulates counts and latencies and checks delivery.
The bench only sets the inputs, lets the simulator run thousands of cycles, and reads counters.

Source (per tile)
    Each cycle, with probability ``rate / 2**16`` while ``enable`` is high, a packet is
    generated: its destination is drawn from ``pattern`` (the distributions of
    :func:`rdakit.sim.models.noc.traffic_matrix`; uniform coordinates are
    ``(random byte * cols) >> 8``, exact on power-of-two meshes), and it is stamped with the
    current cycle and with ``measure``. Packets wait in a ``source_depth``-entry source queue
    (a packet generated into an empty queue is offered in the same cycle); a packet generated
    while that queue is full is dropped and counted in ``overflow`` (the offered load is then
    no longer honoured: the network is past saturation). The source numbers the packets it
    injects (``seq``).
Sink (per tile)
    Always ready. Counts every packet, checks that it was addressed to this tile and that its
    ``seq`` is later than the last one from the same source (in order, no duplicate), and for
    packets stamped ``measure`` accumulates latency: ejection cycle minus generation cycle,
    source queueing included.

Counters named "cleared" restart from 0 in a cycle with ``clear`` high.
"""

import functools
import random

from amaranth.hdl import Cat, Module, Mux, Signal
from amaranth.lib import data, enum, fifo, wiring
from amaranth.lib.memory import Memory
from amaranth.lib.wiring import In, Out

from rdakit.hdl.noc.mesh import Mesh, tile_index
from rdakit.hdl.noc.router import check_mesh_params
from rdakit.hdl.spec.packets import coord_layout
from rdakit.sim.models.noc import neighbor_table

__all__ = ["Pattern", "TrafficHarness", "harness_payload_layout", "RATE_ONE"]

#: The ``rate`` that generates a packet every cycle (rates are in units of 2**-16).
RATE_ONE = 1 << 16


class Pattern(enum.Enum, shape=3):
    """Traffic pattern of the harness (see :func:`rdakit.sim.models.noc.traffic_matrix`)."""

    UNIFORM = 0
    TRANSPOSE = 1
    BITCOMP = 2
    HOTSPOT = 3
    NEIGHBOR = 4


@functools.cache
def harness_payload_layout(coord_bits, ts_bits, seq_bits):
    """Payload of harness packets: generation cycle, source, sequence number, measured flag."""
    return data.StructLayout({"ts": ts_bits, "src": coord_layout(coord_bits),
                              "seq": seq_bits, "meas": 1})


def _xorshift32(s):
    a = s ^ (s << 13)[:32]
    b = a ^ (a >> 17)
    return b ^ (b << 5)[:32]


def _seed(*key):
    v = random.Random(repr(key)).getrandbits(32)
    return v or 1


class TrafficHarness(wiring.Component):
    """A :class:`~rdakit.hdl.noc.mesh.Mesh` with a packet source and a checking sink per tile.

    Parameters
    ----------
    rows, cols, depth, queues, coord_bits
        Of the mesh (see :class:`~rdakit.hdl.noc.mesh.Mesh`).
    ts_bits : int
        Width of timestamps; latencies are measured modulo ``2**ts_bits``.
    seq_bits : int
        Width of per-source sequence numbers (the in-order check is modulo ``2**seq_bits``).
    source_depth : int
        Entries of each source queue.
    counter_bits : int
        Width of the counters.

    Members
    -------
    rate : In(17)
        Injection probability per tile and cycle, in units of 2**-16 (:data:`RATE_ONE` = 1).
    pattern : In(Pattern)
    hotspot : In(coord_layout)
        Hot tile of the ``HOTSPOT`` pattern.
    hot_rate : In(17)
        Probability (units of 2**-16) that a ``HOTSPOT`` packet goes to the hot tile.
    enable : In(1)
        Generate packets.
    measure : In(1)
        Stamp generated packets as measured, and count the measurement window.
    clear : In(1)
        Restart the cleared counters.
    epoch : In(8)
        The sinks' in-order check compares a packet's sequence number only with the last one
        received from the same source in the same epoch (non-zero). The sweep starts a new epoch
        for each traffic pattern (with the network empty): a sink that has heard nothing from a
        source for more than ``2**(seq_bits - 1)`` of that source's packets (a pattern such as
        ``bitcomp`` sends each source's packets to one tile only) would otherwise take its next
        number, modulo ``2**seq_bits``, for an old one.
    generated, ejected : Out(counter_bits).array(n)
        Per tile, packets generated (and queued) and packets received, since reset.
    offered, overflow, meas_sent, meas_recv, window_ejected : Out(counter_bits).array(n)
        Per tile, cleared: packets generated while ``measure`` (dropped ones included); dropped
        because the source queue was full; measured packets queued; measured packets
        received; packets received while ``measure``.
    lat_sum : Out(48).array(n)
        Per tile, cleared: sum of the latencies of measured packets received.
    lat_max : Out(ts_bits).array(n)
        Per tile, cleared: largest such latency.
    errors : Out(counter_bits).array(n)
        Per tile, since reset: packets received that were addressed to another tile, or whose
        sequence number was not later than the previous one from the same source.
    forwarded, blocked : Out(counter_bits).array(n, 5)
        The mesh's router counters.
    """

    def __init__(self, *, rows, cols, depth=2, queues="voq", coord_bits=None, ts_bits=20,
                 seq_bits=16, source_depth=256, counter_bits=32):
        for name, value, lo, hi in (("ts_bits", ts_bits, 8, 32), ("seq_bits", seq_bits, 4, 32),
                                    ("source_depth", source_depth, 1, 1024)):
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise TypeError(f"{name} must be an integer between {lo} and {hi}, "
                                f"not {value!r}")
        self._mesh_kw = dict(rows=rows, cols=cols, depth=depth, queues=queues,
                             coord_bits=coord_bits, counter_bits=counter_bits)
        self.coord_bits = check_mesh_params(**self._mesh_kw)
        self.payload = harness_payload_layout(self.coord_bits, ts_bits, seq_bits)
        self.rows, self.cols = rows, cols
        self.ts_bits, self.seq_bits, self.source_depth = ts_bits, seq_bits, source_depth
        self.counter_bits = counter_bits
        n = rows * cols
        cb = counter_bits
        super().__init__({
            "rate": In(17), "pattern": In(Pattern), "hotspot": In(coord_layout(self.coord_bits)),
            "hot_rate": In(17), "enable": In(1), "measure": In(1), "clear": In(1),
            "epoch": In(8),
            **{name: Out(cb).array(n) for name in (
                "generated", "ejected", "offered", "overflow", "meas_sent", "meas_recv",
                "window_ejected", "errors")},
            "lat_sum": Out(48).array(n),
            "lat_max": Out(ts_bits).array(n),
            "forwarded": Out(cb).array(n, 5),
            "blocked": Out(cb).array(n, 5),
        })

    def elaborate(self, platform):
        m = Module()
        mesh = m.submodules.mesh = Mesh(payload_shape=self.payload, **self._mesh_kw)
        rows, cols = self.rows, self.cols
        now = Signal(self.ts_bits)
        m.d.sync += now.eq(now + 1)
        entry = data.StructLayout({"ts": self.ts_bits, "dst": coord_layout(self.coord_bits),
                                   "meas": 1})

        def count(m, counter, cond, *, cleared=True):
            with m.If(self.clear & cleared):
                m.d.sync += counter.eq(0)
            with m.Elif(cond):
                m.d.sync += counter.eq(counter + 1)

        for y in range(rows):
            for x in range(cols):
                t = tile_index(x, y, cols)
                inj, ej = mesh.inject[t], mesh.eject[t]
                for p in range(5):
                    m.d.comb += [self.forwarded[t][p].eq(mesh.forwarded[t][p]),
                                 self.blocked[t][p].eq(mesh.blocked[t][p])]

                # --- source
                ga = Signal(32, init=_seed("a", t), name=f"ga_{t}")
                gb = Signal(32, init=_seed("b", t), name=f"gb_{t}")
                m.d.sync += [ga.eq(_xorshift32(ga)), gb.eq(_xorshift32(gb))]
                gen = Signal(name=f"gen_{t}")
                m.d.comb += gen.eq(self.enable & (ga[:16] < self.rate))
                ux = ((gb[0:8] * cols) >> 8)[:self.coord_bits]
                uy = ((gb[8:16] * rows) >> 8)[:self.coord_bits]
                # Destination of a new packet. Mux trees rather than `Switch`: Yosys writes a
                # switch as an overlapping `casez` that Verilator lints.
                table = neighbor_table(x, y, rows, cols)
                nb = gb[16:18]
                nx = Mux(nb[1], Mux(nb[0], table[3][0], table[2][0]),
                         Mux(nb[0], table[1][0], table[0][0]))
                ny = Mux(nb[1], Mux(nb[0], table[3][1], table[2][1]),
                         Mux(nb[0], table[1][1], table[0][1]))
                hot = ga[16:32] < self.hot_rate
                choices = [
                    (Pattern.TRANSPOSE, y % cols, x % rows),
                    (Pattern.BITCOMP, cols - 1 - x, rows - 1 - y),
                    (Pattern.HOTSPOT, Mux(hot, self.hotspot.x, ux), Mux(hot, self.hotspot.y, uy)),
                    (Pattern.NEIGHBOR, nx, ny),
                ]
                dx, dy = ux, uy
                for pat, cx, cy in choices:
                    dx = Mux(self.pattern == pat, cx, dx)
                    dy = Mux(self.pattern == pat, cy, dy)
                dst = Signal(coord_layout(self.coord_bits), name=f"dst_{t}")
                m.d.comb += [dst.x.eq(dx), dst.y.eq(dy)]

                q = fifo.SyncFIFO(width=entry.size, depth=self.source_depth)
                m.submodules[f"src_q_{t}"] = q
                new = Signal(entry, name=f"new_{t}")
                m.d.comb += [new.ts.eq(now), new.dst.eq(dst), new.meas.eq(self.measure)]
                head = Signal(entry, name=f"head_{t}")
                m.d.comb += head.eq(Mux(q.r_rdy, q.r_data, new))
                seq = Signal(self.seq_bits, name=f"seq_{t}")
                pl = inj.payload.payload
                m.d.comb += [
                    inj.valid.eq(q.r_rdy | gen),
                    inj.payload.dst.eq(head.dst),
                    pl.ts.eq(head.ts), pl.src.x.eq(x), pl.src.y.eq(y), pl.seq.eq(seq),
                    pl.meas.eq(head.meas),
                    q.r_en.eq(inj.ready),
                ]
                with m.If(inj.valid & inj.ready):
                    m.d.sync += seq.eq(seq + 1)
                push = Signal(name=f"push_{t}")
                dropped = Signal(name=f"dropped_{t}")
                m.d.comb += [push.eq(gen & (q.r_rdy | ~inj.ready)),
                             dropped.eq(push & ~q.w_rdy),
                             q.w_en.eq(push), q.w_data.eq(new)]
                count(m, self.generated[t], gen & ~dropped, cleared=False)
                count(m, self.offered[t], gen & self.measure)
                count(m, self.overflow[t], dropped)
                count(m, self.meas_sent[t], gen & self.measure & ~dropped)

                # --- sink
                m.d.comb += ej.ready.eq(1)
                got = ej.payload.payload
                lat = Signal(self.ts_bits, name=f"lat_{t}")
                m.d.comb += lat.eq(now - got.ts)
                src_idx = Signal(range(rows * cols), name=f"src_idx_{t}")
                m.d.comb += src_idx.eq(got.src.y * cols + got.src.x)
                epoch_bits = len(self.epoch)
                last = Memory(shape=self.seq_bits + epoch_bits, depth=rows * cols, init=[])
                m.submodules[f"last_{t}"] = last
                rd = last.read_port(domain="comb")
                wr = last.write_port()
                m.d.comb += [rd.addr.eq(src_idx), wr.addr.eq(src_idx),
                             wr.data.eq(Cat(got.seq, self.epoch)),
                             wr.en.eq(ej.valid)]
                seen = Signal(name=f"seen_{t}")
                m.d.comb += seen.eq((rd.data[self.seq_bits:] == self.epoch) & self.epoch.any())
                step = Signal(self.seq_bits, name=f"step_{t}")
                m.d.comb += step.eq(got.seq - rd.data[:self.seq_bits])
                bad = Signal(name=f"bad_{t}")
                m.d.comb += bad.eq(
                    (ej.payload.dst.x != x) | (ej.payload.dst.y != y)
                    | (seen & ((step == 0) | step[-1])))
                count(m, self.ejected[t], ej.valid, cleared=False)
                count(m, self.window_ejected[t], ej.valid & self.measure)
                count(m, self.errors[t], ej.valid & bad, cleared=False)
                count(m, self.meas_recv[t], ej.valid & got.meas)
                with m.If(self.clear):
                    m.d.sync += [self.lat_sum[t].eq(0), self.lat_max[t].eq(0)]
                with m.Elif(ej.valid & got.meas):
                    m.d.sync += self.lat_sum[t].eq(self.lat_sum[t] + lat)
                    with m.If(lat > self.lat_max[t]):
                        m.d.sync += self.lat_max[t].eq(lat)
        return m
