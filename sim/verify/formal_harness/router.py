"""Formal harnesses of the router (links, delivery, bounded response, the observed queue), and
the router's broken variants.

A broken variant is a subclass of :class:`~rdakit.hdl.noc.router.Router` that overrides one
small step of its ``elaborate`` (the local route, eligibility, injection room, the arbiter, a
queue's read enable); the router knows nothing of them.
"""

import dataclasses

from amaranth.asserts import AnySeq
from amaranth.hdl import Assert, Assume, Cat, Const, Elaboratable, Module, Mux, Signal, Value
from amaranth.lib.fifo import SyncFIFO

from rdakit.hdl.noc.router import (
    EJECT_DEPTH,
    Router,
    _first,
    _ObservedQueue,
    _round_robin,
    xy_route,
)
from rdakit.hdl.spec.flit import DIRECTIONS, PORT_DELTA, Port
from rdakit.sim.verify.formal_harness.common import (
    popcount,
    refuses_unknown,
    stream_source,
    variant,
)

__all__ = ["ROUTER_VARIANTS", "ROUTER_FORMAL", "ROUTER_PARAMS_TEXT", "ROUTER_DELIVERY_FORMAL",
           "ROUTER_DELIVERY_FIFO", "ROUTER_DELIVERY_SCAN", "ROUTER_STALL", "BoundedResponse",
           "ROUTER_BOUNDED_CORNER", "ROUTER_BOUNDED_MIDDLE", "ROUTER_BOUNDED_SHARED",
           "bounded_statement", "router_text", "queue_places", "assert_links_into_room",
           "router_links", "router_delivery", "router_delivery_fifo", "router_delivery_scan",
           "router_bounded", "router_bounded_middle", "router_bounded_shared",
           "router_observed_queue"]


# --- Broken variants ---------------------------------------------------------------------------

def _yx_route(dst, x, y):
    """Like :func:`~rdakit.hdl.noc.router.xy_route`, in y first."""
    top = (1 << len(dst.x)) - 1
    steps = [(dst.y > y, Port.SOUTH, y < top), (dst.y < y, Port.NORTH, y > 0),
             (dst.x > x, Port.EAST, x < top), (dst.x < x, Port.WEST, x > 0)]
    result = Port.LOCAL
    for cond, port, useful in reversed(steps):
        if useful:
            result = Mux(cond, port, result)
    return result


class _IgnoreRoom(Router):
    """``ignore_room``: a flit is sent on a link whether or not the receiver's queue has
    room."""

    def _can_send(self, o, waiting, room):
        return waiting if o is not Port.LOCAL else super()._can_send(o, waiting, room)


class _GrantKeeps(Router):
    """``grant_keeps``: a flit sent from the local input towards the east stays in its queue
    (it is sent again: a duplicate)."""

    def _dequeue(self, m, key, q, read):
        if key != (Port.LOCAL, Port.EAST):
            super()._dequeue(m, key, q, read)


class _InjectIgnoresRoom(Router):
    """``inject_ignores_room``: an injected flit whose queue is full is accepted (and lost)."""

    def _inject_room(self, port, room):
        return Const(1)


class _YXLocal(Router):
    """``yx_local``: injected flits are routed in y first."""

    def _local_route(self, dst):
        return _yx_route(dst, self.x, self.y)


class _FixedPriority(Router):
    """``fixed_priority``: each output goes to the first queue that can send instead of taking
    turns (a queue can wait for ever)."""

    def _arbiter(self, m, eligible, holding, name):
        return _first(m, eligible, f"{name}_grant")


class _PointerFollows(Router):
    """``pointer_follows``: each arbiter's pointer moves to every queue it grants, past a
    waiting queue that could not send (the round-robin of earlier versions, under which a queue
    can also wait for ever)."""

    def _arbiter(self, m, eligible, holding, name):
        return _round_robin(m, eligible, name)


#: The router under proof (``None``) and its broken variants (``voq`` queues), by name.
ROUTER_VARIANTS = {None: Router, "ignore_room": _IgnoreRoom, "grant_keeps": _GrantKeeps,
                   "inject_ignores_room": _InjectIgnoresRoom, "yx_local": _YXLocal,
                   "fixed_priority": _FixedPriority, "pointer_follows": _PointerFollows}


# --- Router --------------------------------------------------------------------------------

#: The router under proof: the middle router of a 3 × 3 mesh (all five ports), 2-bit
#: coordinates and payloads, queues of 2 per (input, output) pair.
ROUTER_FORMAL = dict(payload_shape=2, x=1, y=1, rows=3, cols=3, coord_bits=2, depth=2,
                     queues="voq", counter_bits=1)

ROUTER_PARAMS_TEXT = "router (1, 1) of 3x3, voq queues of depth 2, 2-bit coordinates and payload"


def router_environment(m, r):
    """Drive every input of router ``r`` as its environment may: locally injected flits under
    the stream rules, and on each link that exists what a neighbour following the protocol
    sends (only into a queue with room, with the lookahead port XY routing gives, from a
    direction XY routing allows, for a tile inside the mesh); every receiver (the ejection
    port, the links' ready bits) stalls at will. Returns ``(inside, eject_ready, out_ready)``:
    the mesh test on a destination and the free ready bits, for harnesses that constrain them.
    """
    x, y, flit = r.x, r.y, r.flit
    dirs = [d for d in DIRECTIONS if r.has_port(d)]

    def inside(dst):
        return (dst.x < r.cols) & (dst.y < r.rows)

    stream_source(m, r.inject)
    eject_ready = AnySeq(1)
    m.d.comb += r.eject.ready.eq(eject_ready)
    out_ready = {d: AnySeq(len(Port)) for d in dirs}
    for d in dirs:
        m.d.comb += r.link_out[d.value].ready.eq(out_ready[d])
    came_from = {Port.WEST: lambda t: t.x >= x, Port.EAST: lambda t: t.x <= x,
                 Port.NORTH: lambda t: (t.x == x) & (t.y >= y),
                 Port.SOUTH: lambda t: (t.x == x) & (t.y <= y)}
    for d in dirs:
        link = r.link_in[d.value]
        m.d.comb += [link.valid.eq(AnySeq(1)), link.payload.eq(AnySeq(flit.size)),
                     link.port.eq(xy_route(link.payload.dst, x, y))]
        with m.If(link.valid):
            m.d.comb += Assume(inside(link.payload.dst) & came_from[d](link.payload.dst)
                               & link.ready.bit_select(link.port.as_value(), 1))
    return inside, eject_ready, out_ready


def assert_links_into_room(m, r):
    """Assert that router ``r`` drives each of its links only towards a queue with room (the
    link's ready bit for the flit's lookahead port)."""
    for d in DIRECTIONS:
        if r.has_port(d):
            out = r.link_out[d.value]
            with m.If(out.valid):
                m.d.comb += Assert(out.ready.bit_select(out.port.as_value(), 1),
                                   f"{d.name} link driven without room")


class _RouterHarness(Elaboratable):
    """One router with every input driven by the environment: locally injected flits under the
    stream rules, and flits on the four links as a neighbour would send them (only into a
    queue with room, with the lookahead port XY routing gives, arriving from a direction XY
    routing allows). Every receiver (the ejection port, the links' ready bits) stalls at will.
    """

    def __init__(self, fault=None):
        self.router_class = variant(ROUTER_VARIANTS, fault)

    def elaborate(self, platform):
        m = Module()
        m.submodules.router = r = self.router_class(**ROUTER_FORMAL)
        flit = r.flit

        router_environment(m, r)

        # Link rules: a link is driven only towards a queue with room; the ejection port keeps
        # valid and payload until taken.
        assert_links_into_room(m, r)
        ej_waiting, ej_last = Signal(), Signal(flit.size)
        m.d.sync += [ej_waiting.eq(r.eject.valid & ~r.eject.ready),
                     ej_last.eq(r.eject.payload)]
        with m.If(ej_waiting):
            m.d.comb += Assert(r.eject.valid & (r.eject.payload.as_value() == ej_last),
                               "eject changed while waiting")
        return m


@refuses_unknown(ROUTER_VARIANTS)
def router_links(fault=None):
    """Router: valid/ready rules on every link, with receivers that stall at will."""
    return _RouterHarness(fault)


#: The router whose delivery is proven: the middle router of a 3 × 3 mesh (all five ports,
#: 17 queues), 2-bit coordinates, a 1-bit payload that marks the tracked flit.
ROUTER_DELIVERY_FORMAL = dict(payload_shape=1, x=1, y=1, rows=3, cols=3, coord_bits=2, depth=2,
                              queues="voq", counter_bits=1)

#: The same router with the other two queue kinds.
ROUTER_DELIVERY_FIFO = dict(ROUTER_DELIVERY_FORMAL, queues="fifo")
ROUTER_DELIVERY_SCAN = dict(ROUTER_DELIVERY_FORMAL, queues="scan")

#: The bounded-response environment: a receiver's ready bit is never low for more than
#: ``ROUTER_STALL`` cycles in a row.
ROUTER_STALL = 1

#: Width of the words in the queue equivalence check (any width behaves alike).
QUEUE_EQUIV_WIDTH = 3


@dataclasses.dataclass(frozen=True)
class BoundedResponse:
    """A router whose bounded response is proven, and its bound.

    Members
    -------
    params : dict
        The router's parameters.
    stay : int
        The tracked flit stays in one place (a queue slot, a slot of the ejection buffer) at
        most ``stay`` cycles, so it leaves within :attr:`bound` cycles of entering its queue.
        The least bound that holds (the next lower one has a counterexample).
    """

    params: dict
    stay: int

    @property
    def bound(self):
        return self.stay * (self.params["depth"] + EJECT_DEPTH)


#: The corner router of a 2 × 2 mesh (east, south and local ports): each output is shared by at
#: most two queues, or by three whose flits all wait for the same room (the ejection buffer).
#: With a per-place bound of 5, a flit at the head of a queue for the ejection port waits while
#: the two other queues for it go first, each after the ejection buffer drained.
ROUTER_BOUNDED_CORNER = BoundedResponse(
    dict(payload_shape=1, x=0, y=0, rows=2, cols=2, coord_bits=1, depth=2, queues="voq",
         counter_bits=1), stay=6)

#: The middle router of a 3 × 3 mesh (all five ports): each output to a neighbour is shared by up
#: to four queues, the ejection port by five.
ROUTER_BOUNDED_MIDDLE = BoundedResponse(
    dict(payload_shape=1, x=1, y=1, rows=3, cols=3, coord_bits=2, depth=2, queues="voq",
         counter_bits=1), stay=10)

#: The router (1, 0) of a 3 × 3 mesh (west, east, south and local ports), where the plain
#: round-robin over eligible queues let a queue wait for ever: its south output is shared by
#: three queues whose flits wait for different queues of the next router.
ROUTER_BOUNDED_SHARED = BoundedResponse(
    dict(payload_shape=1, x=1, y=0, rows=3, cols=3, coord_bits=2, depth=2, queues="voq",
         counter_bits=1), stay=8)


def bounded_statement(b):
    return (f"Bounded response: with receivers whose ready bits are never low for more than "
            f"{ROUTER_STALL} cycle in a row, the tracked flit stays at most {b.stay} cycles in "
            f"one queue slot or ejection-buffer slot and leaves at the latest in its {b.bound}th "
            f"cycle in the router (and is neither lost, duplicated nor misrouted, as in "
            f"router.delivery).")


def router_text(p):
    return (f"router ({p['x']}, {p['y']}) of {p['rows']}x{p['cols']}, {p['queues']} queues of "
            f"depth {p['depth']} (registers, `_observe`), {p['coord_bits']}-bit coordinates, 1-bit "
            f"payload (the tracked flit's mark)")


def queue_places(m, r, marked):
    """Assert the invariants of what router ``r`` (built with ``_observe``) holds: queue levels
    in range; every queued flit waits in the queue of the output XY routing picks here and
    carries the port XY routing picks in the next router; every flit in the ejection buffer is
    addressed to this tile. Returns the places a flit can be in, as ``(here, distance)``:
    ``here`` is high when a copy of the flit ``marked`` picks out is in that queue slot or
    ejection-buffer slot, ``distance`` the number of places it still has to pass in this router
    (itself included)."""
    x, y = r.x, r.y

    def neighbour(d):
        dx, dy = PORT_DELTA[d]
        return x + dx, y + dy

    tag = f"r{x}{y}"
    places = []
    for (i, o), q in r.obs_queues.items():
        m.d.comb += Assert(q.obs_level <= q.depth, "queue level in range")
        oname = o.name.lower() if o is not None else "any"
        for k, slot in enumerate(q.obs_slots):
            e = r.entry_layout(Value.cast(slot))   # a raw word or a ScanQueue view
            here = Signal(name=f"at_{tag}_{i.name.lower()}_{oname}_{k}")
            m.d.comb += here.eq((q.obs_level > k) & marked(e.flit))
            places.append((here, k + 1 + (EJECT_DEPTH if o is Port.LOCAL else 0)))
            with m.If(q.obs_level > k):
                if o is None:
                    # `fifo` queues: the entry names its output here; the lookahead port is
                    # XY routing's at the neighbour that output leads to.
                    m.d.comb += Assert(xy_route(e.flit.dst, x, y) == e.port.as_value(),
                                       "flit queued off its XY route")
                    nxt = r._next_route(m, f"expect_{tag}_{i.name.lower()}_{k}", e.port,
                                        e.flit.dst).as_value()
                else:
                    m.d.comb += Assert(xy_route(e.flit.dst, x, y) == o,
                                       "flit queued off its XY route")
                    nxt = xy_route(e.flit.dst, *neighbour(o)) if o is not Port.LOCAL \
                        else Port.LOCAL
                m.d.comb += Assert(e.next.as_value() == nxt,
                                   "flit queued with a wrong lookahead port")
    ej = r.obs_eject
    m.d.comb += Assert(ej.obs_level <= ej.depth, "ejection level in range")
    for k, slot in enumerate(ej.obs_slots):
        f = r.flit(slot)
        here = Signal(name=f"at_{tag}_eject_{k}")
        m.d.comb += here.eq((ej.obs_level > k) & marked(f))
        places.append((here, k + 1))
        with m.If(ej.obs_level > k):
            m.d.comb += Assert((f.dst.x == x) & (f.dst.y == y),
                               "flit in the ejection buffer of the wrong tile")
    return places


class _RouterTrackHarness(Elaboratable):
    """One router, with its queues observed, under the environment of :class:`_RouterHarness`
    (any traffic on every input under the link rules; receivers that stall), tracking one flit:
    the only flit whose payload bit is set, chosen by the environment (any flit on any input, at
    any time). Since the router never looks at payloads, what holds for that flit holds for
    every flit.

    The invariants count its copies (every queue slot and ejection-buffer slot below the
    queue's level whose flit is marked): copies + departed = arrived ≤ 1; every queued flit
    sits in the queue of the output XY routing picks here and carries the port XY routing picks
    in the next router; every flit in the ejection buffer is addressed to this tile.
    ``check="bounded"`` (with ``bounded``, a :class:`BoundedResponse`) adds receivers whose
    ready bits are never low for more than :data:`ROUTER_STALL` cycles in a row and asserts
    that the flit stays at most ``bounded.stay`` cycles in one place and leaves within
    ``bounded.bound`` cycles.
    """

    def __init__(self, check, fault=None, params=ROUTER_DELIVERY_FORMAL, bounded=None):
        if bounded is not None:
            params = bounded.params
        self.check, self.params, self.bounded = check, params, bounded
        self.router_class = variant(ROUTER_VARIANTS, fault)

    def elaborate(self, platform):
        m = Module()
        m.submodules.router = r = self.router_class(**self.params, _observe=True)
        x, y = r.x, r.y
        dirs = [d for d in DIRECTIONS if r.has_port(d)]

        def marked(f):
            return f.payload[0]

        inj = r.inject
        inside, ej_ready, out_ready = router_environment(m, r)
        with m.If(inj.valid & marked(inj.payload)):
            m.d.comb += Assume(inside(inj.payload.dst))

        # The tracked flit: arrives at most once, on any input.
        arriving = [inj.valid & inj.ready & marked(inj.payload)]
        arriving += [r.link_in[d.value].valid & marked(r.link_in[d.value].payload)
                     for d in dirs]
        arrived = Signal()
        m.d.comb += Assume(popcount([arrived, *arriving]) <= 1)
        with m.If(Cat(*arriving).any()):
            m.d.sync += arrived.eq(1)

        def neighbour(d):
            dx, dy = PORT_DELTA[d]
            return x + dx, y + dy

        # Departures, on the XY port, with the XY lookahead port of the next router.
        leaving = []
        for d in dirs:
            out = r.link_out[d.value]
            go = Signal(name=f"leaves_{d.name.lower()}")
            m.d.comb += go.eq(out.valid & marked(out.payload))
            leaving.append(go)
            with m.If(go):
                m.d.comb += [
                    Assert(xy_route(out.payload.dst, x, y) == d,
                           f"tracked flit left on {d.name}, not its XY port"),
                    Assert(out.port.as_value() == xy_route(out.payload.dst, *neighbour(d)),
                           f"tracked flit left on {d.name} with a wrong lookahead port")]
        ejecting = Signal()
        m.d.comb += ejecting.eq(r.eject.valid & r.eject.ready & marked(r.eject.payload))
        leaving.append(ejecting)
        with m.If(ejecting):
            m.d.comb += Assert((r.eject.payload.dst.x == x) & (r.eject.payload.dst.y == y),
                               "tracked flit ejected at the wrong tile")
        departed = Signal(2)
        m.d.sync += departed.eq(departed + popcount(leaving))

        places = queue_places(m, r, marked)
        copies = popcount([p for p, _ in places])
        m.d.comb += [Assert(departed <= 1, "tracked flit left more than once"),
                     Assert(copies + departed == arrived, "tracked flit lost or duplicated")]
        self.m, self.places = m, places
        self.ej_ready, self.out_ready = ej_ready, out_ready
        if self.check == "bounded":
            self._check_bounded()
        return m

    def _check_bounded(self):
        m, places = self.m, self.places
        stall, stay_max = ROUTER_STALL, self.bounded.stay
        # Receivers: no ready bit low for more than `stall` cycles in a row.
        bits = [self.ej_ready] + [rdy[p] for rdy in self.out_ready.values()
                                  for p in range(len(Port))]
        for k, bit in enumerate(bits):
            low = Signal(range(stall + 1), name=f"low_run_{k}")
            m.d.sync += low.eq(Mux(bit, 0, low + 1))
            m.d.comb += [Assume(bit | (low < stall)), Assert(low <= stall, "low run in range")]
        # Where the flit is (one-hot over the places while present), how long it has stayed
        # there and how long it has been in the router.
        where = Cat(*(p for p, _ in places))
        present = where.any()
        prev = Signal(len(where))
        m.d.sync += prev.eq(where)
        dmax = max(dist for _, dist in places)
        dist = Const(0, range(dmax + 1))
        for p, dd in places:
            dist = Mux(p, dd, dist)
        total = stay_max * dmax   # self.bounded.bound
        stay, stay_r = Signal(range(stay_max + 1)), Signal(range(stay_max + 1))
        age, age_r = Signal(range(total + 1)), Signal(range(total + 1))
        m.d.comb += [stay.eq(Mux(present & (where == prev), stay_r + 1, 0)),
                     age.eq(Mux(present & prev.any(), age_r + 1, 0))]
        m.d.sync += [stay_r.eq(stay), age_r.eq(age)]
        with m.If(present):
            m.d.comb += [
                Assert(stay < stay_max, f"tracked flit stayed over {stay_max} cycles in one place"),
                Assert(age <= stay + stay_max * (dmax - dist), "age within the bound so far"),
                Assert(age < total, f"tracked flit still in the router after {total} cycles"),
            ]


class _QueueEquivHarness(Elaboratable):
    """The router's :class:`~rdakit.hdl.noc.router._ObservedQueue` beside the
    :class:`~amaranth.lib.fifo.SyncFIFO` it stands for, fed the same writes and reads: their
    ``w_rdy`` and ``r_rdy`` agree, and so does ``r_data`` while ``r_rdy``. The broken variant
    ``deeper`` builds the register queue one entry deeper."""

    def __init__(self, fault=None):
        self.fault = fault

    def elaborate(self, platform):
        m = Module()
        width, depth = QUEUE_EQUIV_WIDTH, ROUTER_DELIVERY_FORMAL["depth"]
        assert depth == EJECT_DEPTH   # one check covers the queues and the ejection buffer
        m.submodules.ref = ref = SyncFIFO(width=width, depth=depth)
        m.submodules.obs = obs = _ObservedQueue(width=width,
                                                depth=depth + (self.fault == "deeper"))
        w_en, w_data, r_en = AnySeq(1), AnySeq(width), AnySeq(1)
        for q in (ref, obs):
            m.d.comb += [q.w_en.eq(w_en), q.w_data.eq(w_data), q.r_en.eq(r_en)]
        m.d.comb += [Assert(ref.w_rdy == obs.w_rdy, "w_rdy differs"),
                     Assert(ref.r_rdy == obs.r_rdy, "r_rdy differs")]
        with m.If(ref.r_rdy):
            m.d.comb += Assert(ref.r_data == obs.r_data, "r_data differs")
        return m


def router_observed_queue(fault=None):
    """Router: the observed register queue behaves as the SyncFIFO of normal builds."""
    return _QueueEquivHarness(fault)


@refuses_unknown(ROUTER_VARIANTS)
def router_delivery(fault=None):
    """Router: one tracked flit is neither lost nor duplicated and leaves on its XY port."""
    return _RouterTrackHarness("delivery", fault)


@refuses_unknown(ROUTER_VARIANTS)
def router_delivery_fifo(fault=None):
    """Router delivery with ``fifo`` queues (one per input)."""
    return _RouterTrackHarness("delivery", fault, ROUTER_DELIVERY_FIFO)


@refuses_unknown(ROUTER_VARIANTS)
def router_delivery_scan(fault=None):
    """Router delivery with ``scan`` queues (the oldest flit whose next queue has room)."""
    return _RouterTrackHarness("delivery", fault, ROUTER_DELIVERY_SCAN)


@refuses_unknown(ROUTER_VARIANTS)
def router_bounded(fault=None):
    """Router: a tracked flit leaves within a bound, with receivers that stall boundedly
    (the corner router of a 2 × 2 mesh)."""
    return _RouterTrackHarness("bounded", fault, bounded=ROUTER_BOUNDED_CORNER)


@refuses_unknown(ROUTER_VARIANTS)
def router_bounded_middle(fault=None):
    """Router: bounded response at the middle router of a 3 × 3 mesh (all five ports)."""
    return _RouterTrackHarness("bounded", fault, bounded=ROUTER_BOUNDED_MIDDLE)


@refuses_unknown(ROUTER_VARIANTS)
def router_bounded_shared(fault=None):
    """Router: bounded response where three queues with different next queues share an
    output (the router (1, 0) of a 3 × 3 mesh)."""
    return _RouterTrackHarness("bounded", fault, bounded=ROUTER_BOUNDED_SHARED)
