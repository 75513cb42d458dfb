# amaranth: UnusedElaboratable=no
"""The router alone, in Amaranth's simulator: routing decisions, lookahead ports, timing,
round-robin fairness under persistent contention, back-pressure, counters, rejection, the
difference between per-output queues and plain FIFOs, and parameter validation."""

import collections
import random
import re

import pytest
from amaranth.back import verilog
from amaranth.hdl import ClockDomain, Module
from amaranth.lib import data
from amaranth.sim import Simulator

from rdakit.hdl.noc.router import Router, link_signature, port_exists, reachable_outputs
from rdakit.hdl.spec.flit import DIRECTIONS, PORT_DELTA, Port, flit_layout, pack_flit, unpack_flit
from rdakit.sim.models.noc import xy_route

ALL_READY = (1 << len(Port)) - 1
QUEUES = ["voq", "fifo", "scan"]


def make_router(**kw):
    kw.setdefault("payload_shape", 16)
    return Router(**kw)


_CONVERTED = set()


def check_verilog(dut):
    """Convert each configuration a test simulates to Verilog once: Amaranth's simulator does
    not detect combinational loops, the Verilog backend does."""
    key = (dut.x, dut.y, dut.rows, dut.cols, dut.coord_bits, dut.depth, dut.queues,
           dut.counter_bits, repr(dut.payload_shape))
    if key not in _CONVERTED:
        verilog.convert(dut, name="top", emit_src=False)
        _CONVERTED.add(key)


def simulate(dut, testbench):
    check_verilog(dut)
    sim = Simulator(dut)
    sim.add_clock(1e-6)
    sim.add_testbench(testbench)
    sim.run()


class Harness:
    """Drives a router cycle by cycle from per-input queues, as its neighbours would.

    ``inputs[i]`` is a list of ``(flit, port)``: ``port`` is the lookahead output in this
    router (ignored for the local input, which routes itself). A link input offers its head only
    when the router's ready bit for that port is set, as an upstream router does. Every flit
    that leaves is recorded in ``out[o]`` as ``(cycle, flit, next_port)``.
    """

    def __init__(self, dut, *, out_ready=None, eject_ready=None):
        self.dut = dut
        self.inputs = {p: collections.deque() for p in Port}
        self.out = {p: [] for p in Port}
        self.accepted = {p: [] for p in Port}  # (cycle, flit)
        self.out_ready = out_ready or (lambda o, cycle: ALL_READY)
        self.eject_ready = eject_ready or (lambda cycle: 1)
        self.cycle = 0

    def send(self, inp, flit, port=None):
        self.inputs[inp].append((flit, port))

    async def step(self, ctx):
        dut = self.dut
        offered = {}
        for i, q in self.inputs.items():
            if i is Port.LOCAL:
                ctx.set(dut.inject.valid, bool(q))
                if q:
                    ctx.set(dut.inject.payload.as_value(), q[0][0])
                offered[i] = bool(q)
            elif dut.has_port(i):
                # The upstream router offers the oldest flit whose queue here has room (it
                # keeps flits for different queues apart, like a router with per-output
                # queues does).
                link = dut.link_in[i.value]
                ready = ctx.get(link.ready)
                pick = next((j for j, (_f, p) in enumerate(q) if (ready >> p.value) & 1), None)
                ctx.set(link.valid, pick is not None)
                if pick is not None:
                    q.rotate(-pick)
                    ctx.set(link.payload.as_value(), q[0][0])
                    ctx.set(link.port, q[0][1])
                offered[i] = pick
        for o in DIRECTIONS:
            ctx.set(dut.link_out[o.value].ready, self.out_ready(o, self.cycle))
        eject_ready = self.eject_ready(self.cycle)
        ctx.set(dut.eject.ready, eject_ready)
        for i, pick in offered.items():
            q = self.inputs[i]
            if i is Port.LOCAL:
                if pick and ctx.get(dut.inject.ready):
                    self.accepted[i].append((self.cycle, q.popleft()[0]))
            elif pick is not None:
                # A link transfer happens whenever valid is high.
                self.accepted[i].append((self.cycle, q.popleft()[0]))
                q.rotate(pick)
        for o in DIRECTIONS:
            link = dut.link_out[o.value]
            if ctx.get(link.valid):
                self.out[o].append((self.cycle, ctx.get(link.payload.as_value()),
                                    Port(ctx.get(link.port.as_value()))))
        if ctx.get(dut.eject.valid) and eject_ready:
            self.out[Port.LOCAL].append((self.cycle, ctx.get(dut.eject.payload.as_value()),
                                         None))
        await ctx.tick()
        self.cycle += 1

    async def run(self, ctx, cycles):
        for _ in range(cycles):
            await self.step(ctx)

    def pending(self):
        return sum(len(q) for q in self.inputs.values())


def neighbour_route(router, port, dst):
    dx, dy = PORT_DELTA[port]
    return xy_route(router.x + dx, router.y + dy, *dst)


# --------------------------------------------------------------------------------------------
# Routing

@pytest.mark.parametrize("queues", QUEUES)
@pytest.mark.parametrize("x,y", [(1, 1), (0, 0), (2, 1), (1, 2)])
def test_local_injection_routes_xy(queues, x, y):
    """A flit injected locally leaves on the XY port towards every destination of the mesh, one
    cycle after its injection handshake (two for the local port), carrying the port it takes in
    the next router."""
    dut = make_router(x=x, y=y, rows=3, cols=3, queues=queues)
    h = Harness(dut)
    dests = [(dx, dy) for dy in range(3) for dx in range(3)]

    async def tb(ctx):
        for k, dst in enumerate(dests):
            flit = pack_flit(dut.flit, *dst, 0x100 + k)
            h.send(Port.LOCAL, flit)
            await h.run(ctx, 4)
            port = xy_route(x, y, *dst)
            assert len(h.out[port]) == 1, (dst, port, h.out)
            cycle, got, nxt = h.out[port].pop()
            assert got == flit
            sent = h.accepted[Port.LOCAL][-1][0]
            if port is Port.LOCAL:
                assert cycle == sent + 2
            else:
                assert cycle == sent + 1
                assert nxt is neighbour_route(dut, port, dst)
            assert not any(h.out.values())

    simulate(dut, tb)


@pytest.mark.parametrize("queues", QUEUES)
def test_link_inputs_follow_lookahead_port(queues):
    """A flit arriving on a link goes to the output its lookahead ``port`` names, and the
    router computes the next router's port for it; every (input, reachable output) pair."""
    dut = make_router(queues=queues)
    h = Harness(dut)

    async def tb(ctx):
        for inp in DIRECTIONS:
            for out in reachable_outputs(inp):
                # A destination that really lies beyond `out` from the middle router.
                ddx, ddy = PORT_DELTA[out]
                dst = (1 + ddx, 1 + ddy)
                flit = pack_flit(dut.flit, *dst, inp.value << 4 | out.value)
                h.send(inp, flit, out)
                await h.run(ctx, 4)
                assert [f for _c, f, _n in h.out[out]] == [flit], (inp, out, h.out)
                if out is not Port.LOCAL:
                    assert h.out[out][0][2] is neighbour_route(dut, out, dst)
                h.out[out].clear()
                assert not any(h.out.values())

    simulate(dut, tb)


def test_reachable_outputs_follow_xy():
    assert reachable_outputs(Port.NORTH) == (Port.SOUTH, Port.LOCAL)
    assert Port.WEST not in reachable_outputs(Port.WEST)
    assert Port.EAST not in reachable_outputs(Port.NORTH)
    assert port_exists(Port.WEST, 0, 0, 3, 3) is False
    assert port_exists(Port.SOUTH, 0, 0, 3, 3) is True


def test_edge_router_has_no_outside_ports():
    """A corner router's link outputs towards the outside stay idle and its ready bits 0."""
    dut = make_router(x=0, y=0, rows=2, cols=2)
    h = Harness(dut)

    async def tb(ctx):
        await h.run(ctx, 2)
        for d in (Port.NORTH, Port.WEST):
            assert ctx.get(dut.link_in[d.value].ready) == 0
            assert ctx.get(dut.link_out[d.value].valid) == 0
        for d in (Port.EAST, Port.SOUTH):
            assert ctx.get(dut.link_in[d.value].ready) != 0

    simulate(dut, tb)


# --------------------------------------------------------------------------------------------
# Arbitration

CONTENTION = {
    # output: inputs that can reach it in the middle router of a 3x3 mesh
    Port.LOCAL: [Port.LOCAL, Port.NORTH, Port.EAST, Port.SOUTH, Port.WEST],
    Port.SOUTH: [Port.LOCAL, Port.NORTH, Port.EAST, Port.WEST],
    Port.EAST: [Port.LOCAL, Port.WEST],
}


@pytest.mark.parametrize("queues", QUEUES)
@pytest.mark.parametrize("out", list(CONTENTION), ids=lambda p: p.name.lower())
def test_round_robin_is_fair_under_persistent_contention(queues, out):
    """Every input that wants the same output all the time gets an equal share, and never
    waits more than one round (one grant to each other contender) between two grants."""
    dut = make_router(queues=queues)
    h = Harness(dut)
    contenders = CONTENTION[out]
    ddx, ddy = PORT_DELTA[out]
    dst = (1 + ddx, 1 + ddy)

    async def tb(ctx):
        for k in range(400):
            for i in contenders:
                h.send(i, pack_flit(dut.flit, *dst, i.value << 12 | k), out)
        await h.run(ctx, 300)
        served = [unpack_flit(dut.flit, f)[2] >> 12 for _c, f, _n in h.out[out]]
        assert len(served) >= 290 - 3      # one flit per cycle on the output
        counts = collections.Counter(served)
        assert max(counts.values()) - min(counts.values()) <= 1, counts
        assert set(counts) == {i.value for i in contenders}
        last = {}
        for n, src in enumerate(served):
            if src in last:
                assert n - last[src] <= len(contenders), (src, n, last[src])
            last[src] = n

    simulate(dut, tb)


def test_round_robin_fair_with_random_backpressure():
    """Fairness holds when the output is often not ready (shares within a few percent)."""
    dut = make_router()
    rng = random.Random(4)
    h = Harness(dut, out_ready=lambda o, c: ALL_READY if rng.random() < 0.4 else 0)
    contenders = CONTENTION[Port.SOUTH]

    async def tb(ctx):
        for k in range(400):
            for i in contenders:
                h.send(i, pack_flit(dut.flit, 1, 2, i.value << 12 | k), Port.SOUTH)
        await h.run(ctx, 600)
        counts = collections.Counter(unpack_flit(dut.flit, f)[2] >> 12
                                     for _c, f, _n in h.out[Port.SOUTH])
        total = sum(counts.values())
        assert total > 150
        for i in contenders:
            assert abs(counts[i.value] - total / len(contenders)) <= 2, counts

    simulate(dut, tb)


# --------------------------------------------------------------------------------------------
# Back-pressure, counters, ready bits

def test_backpressure_blocks_without_loss_and_counts():
    """With the east neighbour full, flits for the east wait (counted as blocked cycles),
    flits for other outputs pass; when it frees up everything leaves in order."""
    dut = make_router(depth=2)
    east_ready = {"on": False}
    h = Harness(dut, out_ready=lambda o, c: ALL_READY if o is not Port.EAST or east_ready["on"]
                else 0)

    async def tb(ctx):
        east = [pack_flit(dut.flit, 2, 1, k) for k in range(6)]
        for f in east:
            h.send(Port.WEST, f, Port.EAST)
        south = pack_flit(dut.flit, 1, 2, 0x77)
        h.send(Port.WEST, south, Port.SOUTH)
        await h.run(ctx, 10)
        assert h.out[Port.EAST] == []
        assert [f for _c, f, _n in h.out[Port.SOUTH]] == [south]
        # The queue (west -> east) is full: its ready bit is 0, the south bit is 1.
        ready = ctx.get(dut.link_in[Port.WEST.value].ready)
        assert (ready >> Port.EAST.value) & 1 == 0
        assert (ready >> Port.SOUTH.value) & 1 == 1
        blocked = ctx.get(dut.blocked[Port.EAST.value])
        assert blocked >= 8
        east_ready["on"] = True
        await h.run(ctx, 12)
        assert [f for _c, f, _n in h.out[Port.EAST]] == east
        assert ctx.get(dut.forwarded[Port.EAST.value]) == 6
        assert ctx.get(dut.forwarded[Port.SOUTH.value]) == 1
        assert ctx.get(dut.blocked[Port.EAST.value]) == blocked + 0

    simulate(dut, tb)


def test_eject_backpressure_counts_local_blocked():
    dut = make_router()
    h = Harness(dut, eject_ready=lambda c: c >= 20)

    async def tb(ctx):
        flits = [pack_flit(dut.flit, 1, 1, k) for k in range(5)]
        for f in flits:
            h.send(Port.LOCAL, f)
        await h.run(ctx, 40)
        assert [f for _c, f, _n in h.out[Port.LOCAL]] == flits
        assert ctx.get(dut.forwarded[Port.LOCAL.value]) == 5
        assert ctx.get(dut.blocked[Port.LOCAL.value]) > 10

    simulate(dut, tb)


@pytest.mark.parametrize("queues,passes", [("voq", True), ("scan", True), ("fifo", False)])
def test_head_of_line_blocking(queues, passes):
    """A flit waiting for a blocked output holds up the flits behind it in a plain FIFO, but not
    with per-output queues."""
    dut = make_router(queues=queues, depth=4)
    h = Harness(dut, out_ready=lambda o, c: 0 if o is Port.EAST else ALL_READY)

    async def tb(ctx):
        h.send(Port.WEST, pack_flit(dut.flit, 2, 1, 1), Port.EAST)
        h.send(Port.WEST, pack_flit(dut.flit, 1, 2, 2), Port.SOUTH)
        await h.run(ctx, 10)
        assert bool(h.out[Port.SOUTH]) == passes

    simulate(dut, tb)


@pytest.mark.parametrize("queues,passes", [("voq", False), ("scan", True), ("fifo", False)])
def test_next_hop_blocking(queues, passes):
    """Two flits for the east output bound for different queues of the east neighbour: when
    the first one's queue there is full, a scan queue lets the second one go first (flits for
    the same next queue still leave in order); plain queues wait."""
    # From the middle of a 3x3 mesh, (2, 1) is local at the east neighbour and (2, 2) is south
    # there. The neighbour's queue (west -> local) is full, (west -> south) has room.
    dut = make_router(queues=queues, depth=4)
    h = Harness(dut, out_ready=lambda o, c: (1 << Port.SOUTH.value) if o is Port.EAST
                else ALL_READY)

    async def tb(ctx):
        far = [pack_flit(dut.flit, 2, 1, k) for k in range(2)]
        for f in far:
            h.send(Port.WEST, f, Port.EAST)
        turn = [pack_flit(dut.flit, 2, 2, 10 + k) for k in range(2)]
        for f in turn:
            h.send(Port.WEST, f, Port.EAST)
        await h.run(ctx, 10)
        got = [f for _c, f, _n in h.out[Port.EAST]]
        assert got == (turn if passes else [])
        h.out_ready = lambda o, c: ALL_READY
        await h.run(ctx, 10)
        got = [f for _c, f, _n in h.out[Port.EAST]]
        assert got == (turn + far if passes else far + turn)

    simulate(dut, tb)


def test_depth_one_streams_at_half_rate():
    """Ready is registered: a one-entry queue accepts a flit every other cycle."""
    dut = make_router(depth=1)
    h = Harness(dut)

    async def tb(ctx):
        for k in range(10):
            h.send(Port.WEST, pack_flit(dut.flit, 2, 1, k), Port.EAST)
        await h.run(ctx, 25)
        cycles = [c for c, _f, _n in h.out[Port.EAST]]
        assert len(cycles) == 10
        assert all(b - a == 2 for a, b in zip(cycles, cycles[1:], strict=False))

    simulate(dut, tb)


def test_streams_one_flit_per_cycle_at_depth_two():
    dut = make_router(depth=2)
    h = Harness(dut)

    async def tb(ctx):
        for k in range(10):
            h.send(Port.WEST, pack_flit(dut.flit, 2, 1, k), Port.EAST)
        await h.run(ctx, 14)
        cycles = [c for c, _f, _n in h.out[Port.EAST]]
        assert cycles == list(range(cycles[0], cycles[0] + 10))

    simulate(dut, tb)


def test_out_of_mesh_destination_is_rejected():
    """coord_bits=2 on a 3x3 mesh lets a tile name column or row 3: such a flit is accepted at
    once, dropped, flagged for one cycle and counted; it never appears on any output."""
    dut = make_router(rows=3, cols=3, coord_bits=2)
    h = Harness(dut)

    async def tb(ctx):
        pulses = 0
        for dst in [(3, 0), (0, 3), (3, 3), (1, 1)]:
            h.send(Port.LOCAL, pack_flit(dut.flit, *dst, 5))
        for _ in range(8):
            if h.inputs[Port.LOCAL]:
                ctx.set(dut.inject.valid, 1)
                ctx.set(dut.inject.payload.as_value(), h.inputs[Port.LOCAL][0][0])
                pulses += ctx.get(dut.reject)
            await h.step(ctx)
        assert pulses == 3
        assert [c for c, _f in h.accepted[Port.LOCAL]] == [0, 1, 2, 3]
        assert ctx.get(dut.rejected) == 3
        assert len(h.out[Port.LOCAL]) == 1
        assert sum(len(v) for v in h.out.values()) == 1

    simulate(dut, tb)


def test_reset_clears_state():
    """A run-time reset empties the queues and clears the counters."""
    dut = make_router()
    top = Module()
    top.domains.sync = cd = ClockDomain()
    top.submodules.dut = dut
    h = Harness(dut, out_ready=lambda o, c: 0)

    async def tb(ctx):
        for k in range(3):
            h.send(Port.WEST, pack_flit(dut.flit, 2, 1, k), Port.EAST)
        await h.run(ctx, 6)
        assert ctx.get(dut.blocked[Port.EAST.value]) > 0
        assert (ctx.get(dut.link_in[Port.WEST.value].ready) >> Port.EAST.value) & 1 == 0
        h.inputs[Port.WEST].clear()       # the upstream router is reset too
        ctx.set(cd.rst, 1)
        await ctx.tick()
        ctx.set(cd.rst, 0)
        assert ctx.get(dut.blocked[Port.EAST.value]) == 0
        assert (ctx.get(dut.link_in[Port.WEST.value].ready) >> Port.EAST.value) & 1 == 1
        h.out_ready = lambda o, c: ALL_READY
        await h.run(ctx, 5)
        assert h.out[Port.EAST] == []

    check_verilog(dut)
    sim = Simulator(top)
    sim.add_clock(1e-6)
    sim.add_testbench(tb)
    sim.run()


# --------------------------------------------------------------------------------------------
# Structure and Verilog

CONFIGS = [
    dict(),
    dict(queues="fifo"),
    dict(x=0, y=0, rows=1, cols=1),
    dict(x=3, y=0, rows=2, cols=4, depth=1),
    dict(x=7, y=7, rows=8, cols=8, depth=4, counter_bits=16),
    dict(x=1, y=1, rows=3, cols=3, coord_bits=2, queues="fifo", depth=3),
    dict(queues="scan", depth=3),
    dict(x=0, y=1, rows=2, cols=2, queues="scan", depth=1),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
                         or "default")
def test_converts_to_verilog(cfg):
    """Every tested configuration converts (no combinational loop) with the expected ports."""
    dut = make_router(**cfg)
    text = verilog.convert(dut, name="top", emit_src=False)
    for name in ("inject__valid", "eject__ready", "link_in__0__ready", "link_out__3__port",
                 "forwarded__4", "blocked__0", "rejected", "reject"):
        assert re.search(rf"\b(input|output)\b.*\b{name}\b", text), name


def test_flit_layout_and_signature():
    dut = make_router(payload_shape=data.StructLayout({"a": 5, "b": 7}), rows=4, cols=4)
    assert dut.flit is flit_layout(2, data.StructLayout({"a": 5, "b": 7}))
    assert dut.flit.size == 2 + 2 + 12
    assert dut.flit["dst"].offset == 0
    sig = link_signature(dut.flit)
    assert sig.members["ready"].shape == 5
    assert dut.signature.members["link_out"].dimensions == (4,)


# --------------------------------------------------------------------------------------------
# Parameter validation: one test per parameter, exact messages.

def test_init_wrong_payload_shape():
    with pytest.raises(TypeError, match=r"^payload_shape must be a shape-castable object, "
                                        r"not 'wide'$"):
        make_router(payload_shape="wide")


def test_init_wrong_rows():
    with pytest.raises(TypeError, match=r"^rows must be an integer between 1 and 256, not 0$"):
        make_router(rows=0)
    with pytest.raises(ValueError, match=r"^rows must be at most 2\*\*coord_bits = 4, not 5$"):
        make_router(rows=5, coord_bits=2)


def test_init_wrong_cols():
    with pytest.raises(TypeError, match=r"^cols must be an integer between 1 and 256, "
                                        r"not '3'$"):
        make_router(cols="3")
    with pytest.raises(ValueError, match=r"^cols must be at most 2\*\*coord_bits = 2, not 3$"):
        make_router(rows=2, cols=3, y=0, coord_bits=1)


def test_init_wrong_coord_bits():
    with pytest.raises(TypeError, match=r"^coord_bits must be an integer between 1 and 8, "
                                        r"not 9$"):
        make_router(coord_bits=9)


def test_init_wrong_x():
    with pytest.raises(TypeError, match=r"^x must be an integer between 0 and 255, not -1$"):
        make_router(x=-1)
    with pytest.raises(ValueError, match=r"^x must be less than cols \(3\), not 3$"):
        make_router(x=3)


def test_init_wrong_y():
    with pytest.raises(TypeError, match=r"^y must be an integer between 0 and 255, not 1.5$"):
        make_router(y=1.5)
    with pytest.raises(ValueError, match=r"^y must be less than rows \(2\), not 2$"):
        make_router(y=2, rows=2)


def test_init_wrong_depth():
    with pytest.raises(TypeError, match=r"^depth must be an integer between 1 and 64, not 0$"):
        make_router(depth=0)


def test_init_wrong_queues():
    with pytest.raises(TypeError, match=r"^queues must be one of 'voq', 'fifo', 'scan', "
                                        r"not 'vc'$"):
        make_router(queues="vc")


def test_init_wrong_counter_bits():
    with pytest.raises(TypeError, match=r"^counter_bits must be an integer between 1 and 64, "
                                        r"not True$"):
        make_router(counter_bits=True)


@pytest.mark.parametrize("keep_turn", [True, False])
def test_arbiter_keeps_the_turn_of_a_blocked_queue(keep_turn):
    """The starvation pattern `router.bounded_shared` is about, on the arbiter alone: queue B
    always holds a flit and can send only in the cycles when A can too (their flits wait for the
    same next queue, whose room A's flit uses up); C can send in the other cycles. The arbiter
    of earlier versions (the pointer follows every grant, `pointer_follows`) grants A, C, A, C,
    ... for ever; with the waiting queues seen, B goes within two cycles of its room's return."""
    from amaranth.hdl import Signal

    from rdakit.hdl.noc.router import _round_robin

    m = Module()
    m.domains.sync = ClockDomain()
    phase = Signal()
    m.d.sync += phase.eq(~phase)
    eligible = [Signal(name=n) for n in "abc"]
    m.d.comb += [eligible[0].eq(~phase), eligible[1].eq(~phase), eligible[2].eq(phase)]
    waiting = [Signal(name=f"w{n}") for n in "abc"]
    m.d.comb += [w.eq(1) for w in waiting]
    grants = _round_robin(m, eligible, "arb", waiting=waiting if keep_turn else None)
    granted = []

    async def tb(ctx):
        for _ in range(40):
            await ctx.delay(1e-8)
            g = [ctx.get(s) for s in grants]
            assert sum(g) == 1, "one grant per cycle: a cycle with a sender is never wasted"
            granted.append("abc"[g.index(1)])
            await ctx.tick()

    sim = Simulator(m)
    sim.add_clock(1e-6)
    sim.add_testbench(tb)
    sim.run()
    if keep_turn:
        # B, A and C take turns: B waits at most one round of the three.
        b_cycles = [k for k, x in enumerate(granted) if x == "b"]
        assert b_cycles and b_cycles[0] <= 3, granted
        assert all(j - i <= 4 for i, j in zip(b_cycles, b_cycles[1:], strict=False)), granted
    else:
        assert "b" not in granted, granted
