"""A five-port mesh router: XY routing, per-output input queues, round-robin output arbitration.

The microarchitecture, the link protocol and the choices behind them are described in
``docs/noc.md``; in short:

* **Single-flit packets.** A flit (:func:`~rdakit.hdl.spec.flit.flit_layout`) is a whole packet, so
  there is no wormhole state: every flit is routed, queued and arbitrated on its own.
* **Lookahead XY routing.** A link carries, beside the flit, the output port the flit will take
  in the *receiving* router (``port``); the sender computed it. A router therefore writes an
  arriving flit straight into the queue of its output, and computes (for storage beside the flit)
  the port it will take in the next router. Routing never sits on the path from queue to link.
* **Per-output input queues** (``queues="voq"``, the default): each input keeps one small FIFO
  per output that XY routing lets it reach (local: 5, east/west: 4, north/south: 2), so a flit
  waiting for a busy output never blocks a flit behind it that wants another one (no head-of-line
  blocking). Each output has one round-robin arbiter over the queues that hold flits for it and
  whose next queue has room; an input can send on several outputs in the same cycle.
  ``queues="scan"`` keeps the same queues but lets the oldest flit whose next queue has room
  leave first (:class:`ScanQueue`), which also removes blocking on the next router's queues.
  ``queues="fifo"`` keeps one FIFO per input instead (the plain design, with head-of-line
  blocking), for comparison.
* **One cycle per hop.** A flit granted in cycle *t* is written into the next router's queue at
  the end of *t* and can leave it in *t + 1*. A packet injected in cycle *t* that travels *h*
  hops is offered on the destination's ``eject`` port in cycle *t + h + 2* at zero load.
* **Registered ready.** A link's ``ready`` has one bit per output queue of the receiving input
  (the bit of output ``p`` means "the queue for ``p`` has room"); it comes straight from the
  queue levels, so no combinational path crosses more than one link. A sender raises ``valid``
  only for a flit whose queue has room, and the receiver always accepts it.
"""

import functools

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2

from rdakit.hdl.spec.flit import DIRECTIONS, PORT_DELTA, Port, check_coord_bits, flit_layout

__all__ = ["Router", "ScanQueue", "link_signature", "QUEUE_KINDS", "reachable_outputs",
           "port_exists", "check_mesh_params", "xy_route", "EJECT_DEPTH"]

#: Queue structures a router can be built with.
QUEUE_KINDS = ("voq", "fifo", "scan")

#: Depth of the ejection buffer in front of each ``eject`` port.
EJECT_DEPTH = 2

_REACHABLE = {
    # Under XY routing a flit moves in x first, then in y, then leaves: it never turns back and
    # never turns from y to x.
    Port.LOCAL: (Port.NORTH, Port.EAST, Port.SOUTH, Port.WEST, Port.LOCAL),
    Port.WEST: (Port.NORTH, Port.EAST, Port.SOUTH, Port.LOCAL),   # arrived moving east
    Port.EAST: (Port.NORTH, Port.SOUTH, Port.WEST, Port.LOCAL),   # arrived moving west
    Port.NORTH: (Port.SOUTH, Port.LOCAL),                         # arrived moving south
    Port.SOUTH: (Port.NORTH, Port.LOCAL),                         # arrived moving north
}


def reachable_outputs(inp):
    """The outputs a flit arriving on input port ``inp`` can take under XY routing."""
    return _REACHABLE[Port(inp)]


def port_exists(port, x, y, rows, cols):
    """Whether the router at ``(x, y)`` of a ``rows`` × ``cols`` mesh has a neighbour at
    ``port`` (the local port always exists)."""
    dx, dy = PORT_DELTA[Port(port)]
    return 0 <= x + dx < cols and 0 <= y + dy < rows


def _check_int(name, value, *, minimum, maximum):
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise TypeError(f"{name} must be an integer between {minimum} and {maximum}, "
                        f"not {value!r}")


def check_mesh_params(*, rows, cols, coord_bits, depth, queues, counter_bits):
    """Validate the parameters a router and a mesh share; return ``coord_bits`` (its default,
    the fewest bits that hold every coordinate, filled in).

    Raises
    ------
    TypeError
        If a parameter has the wrong type or is out of its range.
    ValueError
        If ``rows`` or ``cols`` does not fit in ``coord_bits``.
    """
    _check_int("rows", rows, minimum=1, maximum=256)
    _check_int("cols", cols, minimum=1, maximum=256)
    if coord_bits is None:
        coord_bits = max(1, ceil_log2(max(rows, cols)))
    check_coord_bits(coord_bits)
    for name, value in (("rows", rows), ("cols", cols)):
        if value > 1 << coord_bits:
            raise ValueError(f"{name} must be at most 2**coord_bits = {1 << coord_bits}, "
                             f"not {value!r}")
    _check_int("depth", depth, minimum=1, maximum=64)
    if queues not in QUEUE_KINDS:
        raise TypeError(f"queues must be one of {', '.join(map(repr, QUEUE_KINDS))}, "
                        f"not {queues!r}")
    _check_int("counter_bits", counter_bits, minimum=1, maximum=64)
    return coord_bits


@functools.cache
def link_signature(flit_shape):
    """Signature of a router-to-router link, seen from the sender.

    Members
    -------
    valid : Out(1)
        A flit is on the link this cycle; the receiver takes it unconditionally.
    payload : Out(flit_shape)
        The flit.
    port : Out(Port)
        The output port the flit takes in the receiving router (lookahead route).
    ready : In(5)
        Bit ``p``: the receiver's queue for output ``p`` of this input has room. Registered
        state of the receiver; the sender raises ``valid`` only when the bit for ``port`` is 1.
    """
    return wiring.Signature({
        "valid": Out(1),
        "payload": Out(flit_shape),
        "port": Out(Port),
        "ready": In(len(Port)),
    })


def xy_route(dst, x, y):
    """Expression of the output port (a :class:`Port` value) that XY routing picks at the router
    ``(x, y)`` for the destination view ``dst``. Comparisons that are constant for these
    coordinates (``dst.x > x`` at the largest ``x`` the field holds, ``dst.x < 0``) are left out,
    so simulators that warn about them stay quiet."""
    top = (1 << len(dst.x)) - 1
    x_steps = [(dst.x > x, Port.EAST, x < top), (dst.x < x, Port.WEST, x > 0)]
    y_steps = [(dst.y > y, Port.SOUTH, y < top), (dst.y < y, Port.NORTH, y > 0)]
    steps = x_steps + y_steps
    result = Port.LOCAL
    for cond, port, useful in reversed(steps):
        if useful:
            result = Mux(cond, port, result)
    return result


def _first(m, bits, name):
    """One-hot signals: ``bits[k]`` and no earlier bit set (a priority chain)."""
    firsts = [Signal(name=f"{name}_{k}") for k in range(len(bits))]
    for k, b in enumerate(bits):
        m.d.comb += firsts[k].eq(b & ~Cat(*bits[:k]).any() if k else b)
    return firsts


def _round_robin(m, requests, name, *, waiting=None):
    """Grant one of ``requests`` this cycle: the first one after the pointer (wrapping around).
    Returns the list of grant signals (one-hot or all zero).

    ``waiting`` (a superset of ``requests``: the requesters that have something to send,
    whether or not they can send it this cycle) makes the turns fair under eligibility that
    comes and goes. The pointer moves to the granted requester only when it is the first
    *waiting* one after the pointer; when that one is waiting but cannot send, the grant goes
    to the next that can and the pointer stays, so the blocked requester keeps the first turn
    until it sends. A plain round-robin over ``requests`` would move the pointer past it, and
    a requester whose eligibility falls in the cycles of its turn could wait for ever (the
    starvation ``router.bounded_shared`` shows; see docs/verification.md). Without ``waiting`` the
    pointer follows every grant, so under persistent contention each requester is served once
    every ``len(requests)`` grants.

    Built from masks and priority chains rather than a ``Switch`` on the pointer: Yosys
    writes such a switch as an overlapping ``casez`` that Verilator lints."""
    n = len(requests)
    if n == 1:
        grant = Signal(name=f"{name}_grant_0")
        m.d.comb += grant.eq(requests[0])
        return [grant]
    last = Signal(range(n), init=n - 1, name=f"{name}_last")

    def after_pointer(bits, tag):
        # The first of `bits` after the pointer, else the first of them (wrapping around).
        upper = [Signal(name=f"{name}_{tag}_upper_{k}") for k in range(n)]
        for k in range(n):
            # Index 0 is never after the pointer.
            m.d.comb += upper[k].eq(bits[k] & (last < k) if k else 0)
        first_upper = _first(m, upper, f"{name}_{tag}_first_upper")
        first = _first(m, bits, f"{name}_{tag}_first")
        chosen = [Signal(name=f"{name}_{tag}_{k}") for k in range(n)]
        any_upper = Cat(*upper).any()
        for k in range(n):
            m.d.comb += chosen[k].eq(Mux(any_upper, first_upper[k], first[k]))
        return chosen

    grants = after_pointer(requests, "grant")
    turn = after_pointer(waiting, "turn") if waiting is not None else grants
    for k in range(n):
        with m.If(grants[k] & turn[k]):
            m.d.sync += last.eq(k)
    return grants


class ScanQueue(wiring.Component):
    """A queue from which the oldest entry whose next queue has room leaves.

    Entries (of ``layout``, with a ``next`` field naming a port) are kept in arrival order in
    ``depth`` registers. ``r_data`` is the oldest entry whose bit in ``room`` (indexed by its
    ``next``) is set; ``r_rdy`` says there is one; ``r_en`` removes it and the younger entries
    close up. Entries with the same ``next`` therefore leave in order, and an entry blocked by
    a full next queue does not hold up younger entries bound for other queues. ``w_rdy`` is
    registered (``count != depth``), like :class:`~amaranth.lib.fifo.SyncFIFO`'s; an entry
    written in cycle *t* can leave in *t + 1*.
    """

    def __init__(self, layout, depth):
        self.layout, self.depth = layout, depth
        super().__init__({
            "w_en": In(1), "w_data": In(layout), "w_rdy": Out(1),
            "room": In(len(Port)),
            "r_rdy": Out(1), "r_data": Out(layout), "r_en": In(1),
            "any": Out(1),
        })
        # The entries (oldest first, valid below the count), for the formal harnesses.
        self.obs_slots = [Signal(layout, name=f"slot_{k}") for k in range(depth)]
        self.obs_level = Signal(range(depth + 1), name="count")

    def elaborate(self, platform):
        m = Module()
        d = self.depth
        slots, count = self.obs_slots, self.obs_level
        m.d.comb += [self.w_rdy.eq(count != d), self.any.eq(count != 0)]
        ok = [Signal(name=f"ok_{k}") for k in range(d)]
        first = [Signal(name=f"first_{k}") for k in range(d)]
        for k in range(d):
            m.d.comb += ok[k].eq((count > k) & self.room.bit_select(slots[k].next.as_value(), 1))
            m.d.comb += first[k].eq(ok[k] & ~Cat(*ok[:k]).any() if k else ok[k])
        m.d.comb += self.r_rdy.eq(Cat(*ok).any())
        data = Const(0, self.layout.size)
        for k in reversed(range(d)):
            data = Mux(first[k], slots[k].as_value(), data)
        m.d.comb += self.r_data.eq(data)
        deq = Signal()
        enq = Signal()
        m.d.comb += [deq.eq(self.r_en & self.r_rdy), enq.eq(self.w_en & self.w_rdy)]
        # Entries younger than the one leaving move down one slot; a new entry goes to the
        # first free slot after that (a later assignment wins).
        for k in range(d - 1):
            with m.If(deq & Cat(*first[:k + 1]).any()):
                m.d.sync += slots[k].eq(slots[k + 1])
        wpos = Signal(range(d + 1))
        m.d.comb += wpos.eq(count - deq)
        for k in range(d):
            with m.If(enq & (wpos == k)):
                m.d.sync += slots[k].eq(self.w_data)
        m.d.sync += count.eq(count + enq - deq)
        return m


class _ObservedQueue(wiring.Component):
    """A FIFO queue in registers, with the ports and the timing of
    :class:`~amaranth.lib.fifo.SyncFIFO` (first word fall-through; ``r_rdy`` is
    ``level != 0``, ``w_rdy`` is ``level != depth``, both registered; a word written in cycle
    *t* can be read in *t + 1*), whose contents the formal harnesses can name: ``obs_slots[k]``
    is the ``k``-th oldest entry, valid when ``k < obs_level``. Used instead of ``SyncFIFO``
    only under the router's private ``_observe=True``: the entries of a memory are not visible to
    k-induction's invariants.
    """

    def __init__(self, *, width, depth):
        self.width, self.depth = width, depth
        super().__init__({
            "w_en": In(1), "w_data": In(width), "w_rdy": Out(1),
            "r_en": In(1), "r_data": Out(width), "r_rdy": Out(1),
        })
        self.obs_slots = [Signal(width, name=f"slot_{k}") for k in range(depth)]
        self.obs_level = Signal(range(depth + 1), name="level")

    def elaborate(self, platform):
        m = Module()
        slots, level, d = self.obs_slots, self.obs_level, self.depth
        m.d.comb += [self.w_rdy.eq(level != d), self.r_rdy.eq(level != 0),
                     self.r_data.eq(slots[0])]
        deq, enq = Signal(), Signal()
        m.d.comb += [deq.eq(self.r_en & self.r_rdy), enq.eq(self.w_en & self.w_rdy)]
        # The entries move down one slot when the oldest leaves; a new entry goes to the first
        # free slot after that (a later assignment wins).
        with m.If(deq):
            for k in range(d - 1):
                m.d.sync += slots[k].eq(slots[k + 1])
        for k in range(d):
            with m.If(enq & (level - deq == k)):
                m.d.sync += slots[k].eq(self.w_data)
        m.d.sync += level.eq(level + enq - deq)
        return m


class Router(wiring.Component):
    """A router of an XY-routed 2D mesh, with five ports (north, east, south, west, local).

    Packets are single flits ``{dst: {x, y}, payload}``. A flit takes the east or west output
    until its column matches, then north or south until its row matches, then the local output
    (``eject``). Flits between the same two tiles follow the same path through FIFO queues, so
    they arrive in order.

    Latency: one cycle per hop (a flit written into a queue in cycle *t* can be forwarded in
    *t + 1*), plus one cycle through the ejection buffer: a flit injected in cycle *t* to this
    tile is on ``eject`` in *t + 2*; each extra hop adds one cycle. Each output forwards at most
    one flit per cycle; each input accepts at most one per cycle.

    Parameters
    ----------
    payload_shape : shape-castable
        Shape of the flit payload.
    x, y : int
        Column and row of this router. The defaults (with ``rows = cols = 3``) describe a router
        in the middle of a mesh, with all five ports.
    rows, cols : int
        Size of the mesh, 1 to 256 each and at most ``2**coord_bits``. Ports towards the outside
        of the mesh are not built (their link outputs stay 0 and their inputs are ignored).
    coord_bits : int or None
        Width of each destination coordinate, 1 to 8; ``None`` is the fewest bits that hold
        ``max(rows, cols) - 1``. A wider field lets tiles name destinations outside the mesh,
        which ``inject`` rejects.
    depth : int
        Entries of each input queue, 1 to 64. With ``depth=1`` a queue accepts a flit only every
        other cycle (ready is registered), so 2 is the smallest depth that streams.
    queues : str
        ``"voq"``: one FIFO per (input, reachable output) pair; ``"scan"``: the same queues,
        from which the oldest flit whose next queue has room leaves (:class:`ScanQueue`);
        ``"fifo"``: one FIFO per input.
    counter_bits : int
        Width of the counters (they wrap), 1 to 64.

    Members
    -------
    inject : In(stream.Signature(flit))
        Flits from the local tile. ``ready`` depends on the payload (the queue of the flit's
        output must have room) but never on anything outside this router. A destination
        outside the mesh is accepted at once and dropped, pulsing ``reject`` and counting in
        ``rejected``.
    eject : Out(stream.Signature(flit))
        Flits for the local tile, through a :data:`EJECT_DEPTH`-entry buffer.
    link_in : In(link_signature(flit)).array(4)
        Links from the neighbours, indexed by :class:`Port` (north, east, south, west).
    link_out : Out(link_signature(flit)).array(4)
        Links to the neighbours, indexed the same way.
    forwarded : Out(counter_bits).array(5)
        Flits sent per output port (indexed by :class:`Port`; ``LOCAL`` counts flits written
        into the ejection buffer).
    blocked : Out(counter_bits).array(5)
        Cycles in which at least one flit waited for the output and none was sent (every
        waiting flit's next queue, or the ejection buffer, was full).
    rejected : Out(counter_bits)
        Injected flits dropped because their destination is outside the mesh.
    reject : Out(1)
        High in the cycle such a flit is dropped.

    Raises
    ------
    TypeError
        If a parameter has the wrong type or is out of range.
    ValueError
        If ``x``/``y`` lies outside the mesh or the mesh does not fit in ``coord_bits``.

    Notes
    -----
    The formal harnesses (``rdakit.sim.verify.formal_harness``) build their broken variants as
    subclasses that override one of the small steps of :meth:`elaborate` (``_local_route``,
    ``_can_send``, ``_inject_room``, ``_arbiter``, ``_dequeue``). The private, test-only
    ``_observe=True``
    builds every ``SyncFIFO`` queue, and the ejection buffer, as an :class:`_ObservedQueue`
    (registers, same ports and timing as the ``SyncFIFO`` otherwise used) and lists the queues
    in ``obs_queues`` (``{(input, output): queue}``, output ``None`` for the one queue per
    input of ``fifo`` mode; ``scan`` queues are :class:`ScanQueue` as always, which keep their
    entries in registers) and the ejection buffer in ``obs_eject``, so that the harnesses'
    invariants can name what the queues hold (``obs_slots``, ``obs_level``); nothing changes
    without it.
    """

    def __init__(self, *, payload_shape, x=1, y=1, rows=3, cols=3, coord_bits=None, depth=2,
                 queues="voq", counter_bits=32, _observe=False):
        coord_bits = check_mesh_params(rows=rows, cols=cols, coord_bits=coord_bits, depth=depth,
                                       queues=queues, counter_bits=counter_bits)
        _check_int("x", x, minimum=0, maximum=255)
        _check_int("y", y, minimum=0, maximum=255)
        if x >= cols:
            raise ValueError(f"x must be less than cols ({cols}), not {x!r}")
        if y >= rows:
            raise ValueError(f"y must be less than rows ({rows}), not {y!r}")
        self.flit = flit_layout(coord_bits, payload_shape)
        self.payload_shape = payload_shape
        self.x, self.y, self.rows, self.cols = x, y, rows, cols
        self.coord_bits = coord_bits
        self.depth = depth
        self.queues = queues
        self.counter_bits = counter_bits
        link = link_signature(self.flit)
        super().__init__({
            "inject": In(stream.Signature(self.flit)),
            "eject": Out(stream.Signature(self.flit)),
            "link_in": In(link).array(len(DIRECTIONS)),
            "link_out": Out(link).array(len(DIRECTIONS)),
            "forwarded": Out(counter_bits).array(len(Port)),
            "blocked": Out(counter_bits).array(len(Port)),
            "rejected": Out(counter_bits),
            "reject": Out(1),
        })
        self._observe = _observe
        if _observe:
            ports = [p for p in Port if self.has_port(p)]
            entry, width = self.entry_layout, self.entry_layout.size
            if queues == "fifo":
                # One queue per input; its entries name their output (`port`).
                self.obs_queues = {(i, None): _ObservedQueue(width=width, depth=depth)
                                   for i in ports}
            else:
                self.obs_queues = {
                    (i, o): (ScanQueue(entry, depth) if queues == "scan"
                             else _ObservedQueue(width=width, depth=depth))
                    for i in ports for o in reachable_outputs(i) if o in ports}
            self.obs_eject = _ObservedQueue(width=self.flit.size, depth=EJECT_DEPTH)

    def has_port(self, port):
        """Whether this router has a neighbour at ``port`` (``LOCAL`` always exists)."""
        return port_exists(port, self.x, self.y, self.rows, self.cols)

    @property
    def entry_layout(self):
        """Layout of a queue entry: the flit, the port it takes in the next router (``next``)
        and, in ``fifo`` mode, the port it takes here (``port``)."""
        fields = {"flit": self.flit, "next": Port}
        if self.queues == "fifo":
            fields["port"] = Port
        return data.StructLayout(fields)

    def _next_route(self, m, name, port, dst):
        # The port the flit will take in the neighbour it leaves towards: XY routing evaluated
        # at that neighbour's (constant) coordinates, selected by this router's output port.
        # (Mux chains rather than `Switch` throughout: Yosys writes a switch as an overlapping
        # `casez` that Verilator lints.)
        nxt = Signal(Port, name=name)
        value = Port.LOCAL
        for d in DIRECTIONS:
            if self.has_port(d):
                dx, dy = PORT_DELTA[d]
                value = Mux(port == d, xy_route(dst, self.x + dx, self.y + dy), value)
        m.d.comb += nxt.eq(value)
        return nxt

    def elaborate(self, platform):
        m = Module()
        ports = [p for p in Port if self.has_port(p)]
        entry = self.entry_layout

        # Arrivals: (valid, flit, output port here) for each input that exists.
        dst = self.inject.payload.dst
        outside = Signal()
        limits = []
        if self.cols < 1 << self.coord_bits:
            limits.append(dst.x >= self.cols)
        if self.rows < 1 << self.coord_bits:
            limits.append(dst.y >= self.rows)
        m.d.comb += outside.eq(Cat(*limits).any() if limits else Const(0))
        local_port = Signal(Port)
        m.d.comb += local_port.eq(self._local_route(dst))
        arrivals = {Port.LOCAL: (self.inject.valid & ~outside, self.inject.payload, local_port)}
        for d in DIRECTIONS:
            if self.has_port(d):
                link = self.link_in[d.value]
                arrivals[d] = (link.valid, link.payload, link.port)

        # The ejection buffer, and the room bits an output offers (per next-router port).
        if self._observe:
            eject_q = self.obs_eject
        else:
            eject_q = fifo.SyncFIFO(width=self.flit.size, depth=EJECT_DEPTH)
        m.submodules.eject_q = eject_q
        m.d.comb += [self.eject.valid.eq(eject_q.r_rdy),
                     self.eject.payload.eq(eject_q.r_data),
                     eject_q.r_en.eq(self.eject.ready)]

        def room_vector(o):
            if o is Port.LOCAL:
                return eject_q.w_rdy.replicate(len(Port))
            return self.link_out[o.value].ready

        # Queues. `cands[o]` lists, per input holding flits for output `o`, (input, waiting,
        # eligible, head entry, queue): a flit waits; the head (or, in scan queues, the oldest
        # flit whose next queue has room) is eligible when its next queue has room.
        cands = {o: [] for o in ports}
        keys = {}   # id(queue): (input, output), output None for the one queue of `fifo` mode
        for i, (valid, flit, port) in arrivals.items():
            lname = i.name.lower()
            w = Signal(entry, name=f"{lname}_entry")
            m.d.comb += [w.flit.eq(flit),
                         w.next.eq(self._next_route(m, f"{lname}_next", port, flit.dst))]
            outs = [o for o in reachable_outputs(i) if o in ports]
            room = {}
            if self.queues == "fifo":
                m.d.comb += w.port.eq(port)
                if self._observe:
                    q = self.obs_queues[i, None]
                else:
                    q = fifo.SyncFIFO(width=entry.size, depth=self.depth)
                m.submodules[f"q_{lname}"] = q
                keys[id(q)] = (i, None)
                m.d.comb += [q.w_data.eq(w), q.w_en.eq(valid)]
                head = entry(q.r_data)
                for o in outs:
                    room[o] = q.w_rdy
                    waiting = q.r_rdy & (head.port == o)
                    ok = waiting & room_vector(o).bit_select(head.next.as_value(), 1)
                    cands[o].append((i, waiting, ok, head, q))
            else:
                for o in outs:
                    if self.queues == "scan":
                        q = self.obs_queues[i, o] if self._observe else ScanQueue(entry,
                                                                                  self.depth)
                        m.d.comb += q.room.eq(room_vector(o))
                        head, waiting, ok = q.r_data, q.any, q.r_rdy
                    else:
                        if self._observe:
                            q = self.obs_queues[i, o]
                        else:
                            q = fifo.SyncFIFO(width=entry.size, depth=self.depth)
                        head, waiting = entry(q.r_data), q.r_rdy
                        ok = self._can_send(o, waiting,
                                            room_vector(o).bit_select(head.next.as_value(), 1))
                    m.submodules[f"q_{lname}_{o.name.lower()}"] = q
                    keys[id(q)] = (i, o)
                    m.d.comb += [q.w_data.eq(w), q.w_en.eq(valid & (port == o))]
                    room[o] = q.w_rdy
                    cands[o].append((i, waiting, ok, head, q))
            if i is Port.LOCAL:
                m.d.comb += self.inject.ready.eq(outside | self._inject_room(port, room))
            else:
                m.d.comb += self.link_in[i.value].ready.eq(
                    Cat(*(room.get(p, Const(0)) for p in Port)))

        with m.If(self.inject.valid & outside):
            m.d.comb += self.reject.eq(1)
            m.d.sync += self.rejected.eq(self.rejected + 1)

        # Allocation: one round-robin arbiter per output over the queues holding an eligible
        # flit for it.
        dequeue = {}
        for o in ports:
            oname = o.name.lower()
            eligible, holding = [], []
            for i, wait, ok, _head, _q in cands[o]:
                e = Signal(name=f"{oname}_from_{i.name.lower()}")
                h = Signal(name=f"{oname}_holds_{i.name.lower()}")
                m.d.comb += [e.eq(ok), h.eq(wait)]
                eligible.append(e)
                holding.append(h)
            grants = self._arbiter(m, eligible, holding, f"arb_{oname}")
            sent = Signal(name=f"{oname}_sent")
            waiting = Signal(name=f"{oname}_waiting")
            m.d.comb += [sent.eq(Cat(*grants).any()),
                         waiting.eq(Cat(*(c[1] for c in cands[o])).any())]
            out_flit = Signal(self.flit, name=f"{oname}_flit")
            out_next = Signal(Port, name=f"{oname}_next")
            for g, (_i, _waiting, _ok, head, q) in zip(grants, cands[o], strict=True):
                with m.If(g):
                    m.d.comb += [out_flit.eq(head.flit), out_next.eq(head.next)]
                dequeue.setdefault(id(q), (q, []))[1].append(g)
            if o is Port.LOCAL:
                m.d.comb += [eject_q.w_en.eq(sent), eject_q.w_data.eq(out_flit)]
            else:
                link = self.link_out[o.value]
                m.d.comb += [link.valid.eq(sent), link.payload.eq(out_flit),
                             link.port.eq(out_next)]
            with m.If(sent):
                m.d.sync += self.forwarded[o.value].eq(self.forwarded[o.value] + 1)
            with m.Elif(waiting):
                m.d.sync += self.blocked[o.value].eq(self.blocked[o.value] + 1)
        for q, grants in dequeue.values():
            self._dequeue(m, keys[id(q)], q, Cat(*grants).any())
        return m

    # Steps of `elaborate` that the formal harnesses' broken variants override.

    def _local_route(self, dst):
        """The output port here of a flit injected for ``dst``: XY routing."""
        return xy_route(dst, self.x, self.y)

    def _can_send(self, o, waiting, room):
        """Whether the head of a ``voq`` queue for output ``o`` is eligible: a flit ``waiting``
        whose next queue has ``room``."""
        return waiting & room

    def _inject_room(self, port, room):
        """Whether an injected flit for output ``port`` fits: ``room[o]`` of its queue."""
        ready = Const(0)
        for o, r in room.items():
            ready = Mux(port == o, r, ready)
        return ready

    def _arbiter(self, m, eligible, holding, name):
        """The grants of one output's arbiter over the queues with an ``eligible`` flit for it,
        given those ``holding`` one (see :func:`_round_robin`)."""
        return _round_robin(m, eligible, name, waiting=holding)

    def _dequeue(self, m, key, q, read):
        """Drive the read enable of the queue ``q`` (``key``: its (input, output)) from
        ``read``, the OR of the grants of the outputs it feeds."""
        m.d.comb += q.r_en.eq(read)
