"""R×C meshes of :class:`~rdakit.hdl.noc.router.Router`, and the dual (request + response) network.

Tiles are numbered row by row: tile ``t`` is at column ``x = t % cols`` and row
``y = t // cols``. Every port array of a mesh is indexed by that number.
"""

from amaranth.hdl import Module, Mux
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from rdakit.hdl.noc.jitter import RATE_BITS, SEED_BITS, add_stall, jitter_salt
from rdakit.hdl.noc.router import Router, check_mesh_params
from rdakit.hdl.spec.flit import DIRECTIONS, PORT_DELTA, Port, flit_layout
from rdakit.hdl.spec.packets import mu_request_layout, mu_response_layout
from rdakit.hdl.spec.params import MUParams

__all__ = ["Mesh", "DualMesh", "mesh_signature", "tile_index", "tile_coords"]


def tile_index(x, y, cols):
    """Number of the tile at column ``x``, row ``y``."""
    return y * cols + x


def tile_coords(t, cols):
    """``(x, y)`` of tile number ``t``."""
    return t % cols, t // cols


def mesh_signature(*, rows, cols, flit, counter_bits, jitter=False):
    """Signature of a mesh of ``rows * cols`` tiles carrying flits of layout ``flit``.

    Members
    -------
    inject : In(stream.Signature(flit)).array(n)
        Per tile, flits into the network (see :class:`~rdakit.hdl.noc.router.Router` ``inject``).
    eject : Out(stream.Signature(flit)).array(n)
        Per tile, flits for that tile.
    forwarded, blocked : Out(counter_bits).array(n, 5)
        Per tile and output port (indexed by :class:`~rdakit.hdl.spec.flit.Port`), the counters of
        that tile's router.
    rejected : Out(counter_bits).array(n)
        Per tile, injected flits dropped because their destination is outside the mesh.
    reject : Out(1).array(n)
        Per tile, high in the cycle such a flit is dropped.
    jitter_seed : In(32), jitter_rate : In(8)
        Only with ``jitter``: the link stall generators' seed and rate (:mod:`.jitter`).
    """
    n = rows * cols
    extra = {"jitter_seed": In(SEED_BITS), "jitter_rate": In(RATE_BITS)} if jitter else {}
    return wiring.Signature({
        "inject": In(stream.Signature(flit)).array(n),
        "eject": Out(stream.Signature(flit)).array(n),
        "forwarded": Out(counter_bits).array(n, len(Port)),
        "blocked": Out(counter_bits).array(n, len(Port)),
        "rejected": Out(counter_bits).array(n),
        "reject": Out(1).array(n),
        **extra,
    })


class Mesh(wiring.Component):
    """A ``rows`` × ``cols`` mesh of XY-routed routers with one local port per tile.

    Every flit injected with a destination inside the mesh is delivered exactly once, unchanged,
    on the ``eject`` port of its destination; flits between the same two tiles arrive in order
    (one XY path, FIFO queues). A destination outside the mesh (possible when ``coord_bits`` is
    wider than needed) is dropped at injection and counted. XY routing with single-flit packets
    cannot deadlock (its channel dependencies are acyclic), provided every tile eventually drains
    its ``eject`` port. Latency at zero load is ``hops + 2`` cycles from the injection handshake
    to the ejection offer; see :class:`~rdakit.hdl.noc.router.Router` for the rest.

    Parameters
    ----------
    rows, cols : int
        Mesh size, 1 to 256 each, at most ``2**coord_bits``.
    payload_shape : shape-castable
        Shape of the flit payload.
    coord_bits, depth, queues, counter_bits
        As for :class:`~rdakit.hdl.noc.router.Router`.
    jitter : bool
        Put a random stall gate on every link, injection and ejection port (race testing,
        ``docs/race.md``; off by default). A gate lowers a stream port's ``valid`` and
        ``ready`` together, and a router-to-router link's ``ready`` bits (the sender only
        raises ``valid`` for a queue whose bit is set), so a stalled link simply transfers
        nothing that cycle. ``jitter_salt`` keeps the gates of two meshes apart.

    Members
    -------
    See :func:`mesh_signature`.

    Raises
    ------
    TypeError
        If a parameter has the wrong type or is out of range.
    ValueError
        If the mesh does not fit in ``coord_bits``.
    """

    def __init__(self, *, rows, cols, payload_shape, coord_bits=None, depth=2, queues="voq",
                 counter_bits=32, jitter=False, jitter_salt=0, _observe=False):
        coord_bits = check_mesh_params(rows=rows, cols=cols, coord_bits=coord_bits, depth=depth,
                                       queues=queues, counter_bits=counter_bits)
        if not isinstance(jitter, bool):
            raise TypeError(f"jitter must be a bool, not {jitter!r}")
        self.flit = flit_layout(coord_bits, payload_shape)
        self.rows, self.cols, self.coord_bits = rows, cols, coord_bits
        self.payload_shape = payload_shape
        self.depth, self.queues, self.counter_bits = depth, queues, counter_bits
        self.jitter, self.jitter_salt = jitter, jitter_salt
        super().__init__(mesh_signature(rows=rows, cols=cols, flit=self.flit,
                                        counter_bits=counter_bits, jitter=jitter))
        # Test-only: every router built with the router's private `_observe`, and kept in
        # `obs_routers` ({(x, y): router}) for the formal harnesses to name their queues (their
        # broken variants override `router`).
        self._observe = _observe
        self.obs_routers = None
        if _observe:
            self.obs_routers = {(x, y): self.router(x, y)
                                for y in range(rows) for x in range(cols)}

    def _stall(self, m, *key):
        """The stall signal of a new gate named ``key`` (``None`` without jitter)."""
        if not self.jitter:
            return None
        return add_stall(m, seed=self.jitter_seed, rate=self.jitter_rate,
                         salt=jitter_salt(self.jitter_salt, *key),
                         name="_".join(str(k) for k in key))

    @staticmethod
    def _gated(m, src, dst, stall):
        """Connect stream ``src`` (a producer) to ``dst``, through a stall gate if ``stall``
        is not ``None``."""
        if stall is None:
            wiring.connect(m, src, dst)
            return
        m.d.comb += [dst.payload.eq(src.payload), dst.valid.eq(src.valid & ~stall),
                     src.ready.eq(dst.ready & ~stall)]

    @property
    def n_tiles(self):
        return self.rows * self.cols

    #: The class of the routers (the formal harnesses put broken variants here).
    router_class = Router

    def router(self, x, y):
        """A new router for position ``(x, y)`` with this mesh's parameters."""
        return self.router_class(payload_shape=self.payload_shape, x=x, y=y, rows=self.rows,
                                 cols=self.cols, coord_bits=self.coord_bits, depth=self.depth,
                                 queues=self.queues, counter_bits=self.counter_bits,
                                 _observe=self._observe)

    def elaborate(self, platform):
        m = Module()
        routers = {}
        for y in range(self.rows):
            for x in range(self.cols):
                r = routers[x, y] = (self.obs_routers[x, y] if self.obs_routers
                                     else self.router(x, y))
                m.submodules[f"r_{x}_{y}"] = r
                t = tile_index(x, y, self.cols)
                self._gated(m, wiring.flipped(self.inject[t]), r.inject,
                            self._stall(m, "inject", x, y))
                self._gated(m, r.eject, wiring.flipped(self.eject[t]),
                            self._stall(m, "eject", x, y))
                for p in Port:
                    m.d.comb += [self.forwarded[t][p.value].eq(r.forwarded[p.value]),
                                 self.blocked[t][p.value].eq(r.blocked[p.value])]
                m.d.comb += [self.rejected[t].eq(r.rejected), self.reject[t].eq(r.reject)]
        # Links: router (x, y)'s output towards d feeds its neighbour's input from the opposite
        # direction.
        opposite = {Port.NORTH: Port.SOUTH, Port.SOUTH: Port.NORTH,
                    Port.EAST: Port.WEST, Port.WEST: Port.EAST}
        for (x, y), r in routers.items():
            for d in DIRECTIONS:
                if r.has_port(d):
                    dx, dy = PORT_DELTA[d]
                    out, into = r.link_out[d.value], routers[x + dx, y + dy].link_in[
                        opposite[d].value]
                    stall = self._stall(m, "link", x, y, d.name)
                    if stall is None:
                        wiring.connect(m, out, into)
                    else:
                        m.d.comb += [into.valid.eq(out.valid), into.payload.eq(out.payload),
                                     into.port.eq(out.port),
                                     out.ready.eq(Mux(stall, 0, into.ready))]
        return m


class DualMesh(wiring.Component):
    """Two independent meshes of the same geometry: a request network and a response network.

    Requests and responses never share a queue or a link, so a request network filled up by
    requests that nobody accepts cannot stop the responses that would let them drain.

    Parameters
    ----------
    rows, cols : int
        Mesh size (both networks).
    request_shape, response_shape : shape-castable
        Payload shapes of the two networks.
    coord_bits, depth, queues, counter_bits
        As for :class:`Mesh`, shared by both networks.

    Members
    -------
    req : Out(mesh_signature(...))
        The request network's ports (``req.inject[t]``, ``req.eject[t]``, counters).
    rsp : Out(mesh_signature(...))
        The response network's ports.
    """

    def __init__(self, *, rows, cols, request_shape, response_shape, coord_bits=None, depth=2,
                 queues="voq", counter_bits=32, jitter=False):
        coord_bits = check_mesh_params(rows=rows, cols=cols, coord_bits=coord_bits, depth=depth,
                                       queues=queues, counter_bits=counter_bits)
        flits = []
        for name, shape in (("request_shape", request_shape),
                            ("response_shape", response_shape)):
            try:
                flits.append(flit_layout(coord_bits, shape))
            except TypeError:
                raise TypeError(f"{name} must be a shape-castable object, "
                                f"not {shape!r}") from None
        self.request_flit, self.response_flit = flits
        if not isinstance(jitter, bool):
            raise TypeError(f"jitter must be a bool, not {jitter!r}")
        self._mesh_kw = dict(rows=rows, cols=cols, coord_bits=coord_bits, depth=depth,
                             queues=queues, counter_bits=counter_bits, jitter=jitter)
        self.jitter = jitter
        self.request_shape, self.response_shape = request_shape, response_shape
        self.rows, self.cols, self.coord_bits = rows, cols, coord_bits
        sig = dict(rows=rows, cols=cols, counter_bits=counter_bits)
        super().__init__({"req": Out(mesh_signature(flit=self.request_flit, **sig)),
                          "rsp": Out(mesh_signature(flit=self.response_flit, **sig)),
                          **({"jitter_seed": In(SEED_BITS), "jitter_rate": In(RATE_BITS)}
                             if jitter else {})})

    @classmethod
    def for_mu(cls, params: MUParams, *, rows, cols, **kwargs):
        """The memory network of :class:`~rdakit.hdl.spec.params.MUParams` ``params``: requests
        carry :func:`~rdakit.hdl.spec.packets.mu_request_layout`, responses
        :func:`~rdakit.hdl.spec.packets.mu_response_layout`, with ``params.coord_bits``."""
        return cls(rows=rows, cols=cols, request_shape=mu_request_layout(params),
                   response_shape=mu_response_layout(params), coord_bits=params.coord_bits,
                   **kwargs)

    def elaborate(self, platform):
        m = Module()
        m.submodules.req = req = Mesh(payload_shape=self.request_shape, jitter_salt="req",
                                      **self._mesh_kw)
        m.submodules.rsp = rsp = Mesh(payload_shape=self.response_shape, jitter_salt="rsp",
                                      **self._mesh_kw)
        if self.jitter:
            for net in (req, rsp):
                m.d.comb += [net.jitter_seed.eq(self.jitter_seed),
                             net.jitter_rate.eq(self.jitter_rate)]
        # (wiring.flipped() of a whole mesh interface fails on its port arrays in Amaranth 0.5,
        # so the ports are connected one by one.)
        for outer, inner in ((self.req, req), (self.rsp, rsp)):
            for t in range(self.rows * self.cols):
                wiring.connect(m, wiring.flipped(outer.inject[t]), inner.inject[t])
                wiring.connect(m, wiring.flipped(outer.eject[t]), inner.eject[t])
                m.d.comb += [outer.rejected[t].eq(inner.rejected[t]),
                             outer.reject[t].eq(inner.reject[t])]
                for p in range(len(Port)):
                    m.d.comb += [outer.forwarded[t][p].eq(inner.forwarded[t][p]),
                                 outer.blocked[t][p].eq(inner.blocked[t][p])]
        return m
