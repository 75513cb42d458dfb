"""The formal harness of a whole mesh (end-to-end delivery of a tracked flit)."""

from amaranth.asserts import AnySeq
from amaranth.hdl import Assert, Assume, Cat, Elaboratable, Module, Signal

from rdakit.hdl.noc.mesh import Mesh, tile_coords
from rdakit.sim.verify.formal_harness.common import (
    popcount,
    refuses_unknown,
    stream_source,
    variant,
)
from rdakit.sim.verify.formal_harness.router import (
    ROUTER_VARIANTS,
    assert_links_into_room,
    queue_places,
)

__all__ = ["MESH_DELIVERY_FORMAL", "mesh_text", "mesh_delivery"]


class _VariantMesh(Mesh):
    """A mesh whose routers are ``router_class`` (a broken variant of the router)."""

    def __init__(self, *, router_class, **kwargs):
        self.router_class = router_class   # before Mesh builds its observed routers
        super().__init__(**kwargs)


def mesh_text(p):
    """The parameters column of a mesh property."""
    return (f"{p['rows']}x{p['cols']} mesh, voq queues of depth {p['depth']} (registers, "
            f"`_observe`), {p['coord_bits']}-bit coordinates, 1-bit payload (the tracked flit's "
            f"mark)")



#: The mesh whose end-to-end delivery is proven: 3 × 3 routers (every kind: corner, edge,
#: middle), queues of depth 2 (registers), 2-bit coordinates, a 1-bit payload that marks the
#: tracked flit.
MESH_DELIVERY_FORMAL = dict(rows=3, cols=3, payload_shape=1, coord_bits=2, depth=2,
                            queues="voq", counter_bits=1)


class _MeshTrackHarness(Elaboratable):
    """A whole mesh (its routers' queues observed) with every tile injecting anything under the
    stream rules and every ejection port stalling at will, tracking one flit: the only flit
    whose payload bit is set, injected at any tile at any time (the mesh never looks at
    payloads, so what holds for it holds for every flit). The invariants are those of
    :func:`queue_places` for every router and the count of the flit's copies over all of
    them: copies + delivered = injected ≤ 1. Links carry a flit from one router's queue into the
    next router's queue in one cycle, so a flit is always in exactly one queue slot or
    ejection-buffer slot until its destination's ``eject`` port delivers it; every link is
    driven only towards a queue with room."""

    def __init__(self, fault=None, params=MESH_DELIVERY_FORMAL):
        self.router_class = variant(ROUTER_VARIANTS, fault)
        self.params = params

    def elaborate(self, platform):
        m = Module()
        m.submodules.mesh = mesh = _VariantMesh(**self.params, router_class=self.router_class,
                                                _observe=True)

        def marked(f):
            return f.payload[0]

        injected, delivered = [], []
        for t in range(mesh.n_tiles):
            x, y = tile_coords(t, mesh.cols)
            inj, ej = mesh.inject[t], mesh.eject[t]
            stream_source(m, inj)
            m.d.comb += ej.ready.eq(AnySeq(1))
            injected.append(inj.valid & inj.ready & marked(inj.payload))
            with m.If(inj.valid & marked(inj.payload)):
                # A flit for a tile outside the mesh is dropped at injection, by design.
                m.d.comb += Assume((inj.payload.dst.x < mesh.cols)
                                   & (inj.payload.dst.y < mesh.rows))
            out = Signal(name=f"delivered_{x}{y}")
            m.d.comb += out.eq(ej.valid & ej.ready & marked(ej.payload))
            delivered.append(out)
            with m.If(out):
                m.d.comb += Assert((ej.payload.dst.x == x) & (ej.payload.dst.y == y),
                                   "tracked flit delivered at the wrong tile")
        arrived = Signal()
        m.d.comb += Assume(popcount([arrived, *injected]) <= 1)
        with m.If(Cat(*injected).any()):
            m.d.sync += arrived.eq(1)
        departed = Signal(2)
        m.d.sync += departed.eq(departed + popcount(delivered))

        places = []
        for r in mesh.obs_routers.values():
            places += queue_places(m, r, marked)
            assert_links_into_room(m, r)
        copies = popcount([p for p, _ in places])
        m.d.comb += [Assert(departed <= 1, "tracked flit delivered more than once"),
                     Assert(copies + departed == arrived, "tracked flit lost or duplicated")]
        return m


@refuses_unknown(ROUTER_VARIANTS)
def mesh_delivery(fault=None):
    """Mesh: one tracked flit is delivered exactly once, at its destination."""
    return _MeshTrackHarness(fault)

