"""A system of clusters: N fabrics sharing one MU address space through bridges and links.

See ``docs/clusters.md``. Cluster ``k`` is a :class:`~rdakit.hdl.fabric.top.Fabric` built with
``cluster=k``; its MUs have IDs ``k << 2 * coord_bits | y << coord_bits | x``, so a reference
names its cluster and any tile (or host port) reaches any MU with the same packets. Requests
and responses for another cluster leave through the cluster's bridge tile, cross a
:class:`~rdakit.hdl.cluster.bridge.Link` (``link_width`` wires, ``link_latency`` cycles, credit flow
control) into a switch (a 1 x N mesh of routers, one per cluster, per network) that delivers them
to the destination cluster's bridge tile. Requests and responses keep separate links and
switches, as inside a fabric, so responses always drain.

A request for an MU of a cluster that does not exist (``clusters`` below ``2**cluster_bits``)
is answered where it would enter the request switch: a response with status ``BAD_DESTINATION``
goes back to its requester over the response switch, so a CU halts with ``MU_ERROR`` and a host
port replies instead of waiting forever. A token or a reference for such a cluster is dropped
there (nothing waits for it) and counted in ``dropped``.

Every cluster keeps its own host port (``cmd[k]``, ``reply[k]``): bitstreams, starts, status and
counters are per cluster, and any host port's MU requests reach every cluster's MUs.
"""

import dataclasses

from amaranth.hdl import Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from rdakit.hdl.cluster.bridge import Link, check_link_params
from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.noc.mesh import Mesh
from rdakit.hdl.spec.packets import (
    MsgKind,
    MUStatus,
    host_cmd_layout,
    host_reply_layout,
    msg_layout,
    mu_request_layout,
)
from rdakit.hdl.spec.params import FabricParams

__all__ = ["SystemParams", "System"]


@dataclasses.dataclass(frozen=True)
class SystemParams:
    """Parameters of a system of clusters.

    Parameters
    ----------
    fabric : FabricParams
        Every cluster's fabric; its ``mu.cluster_bits`` must be at least 1 and hold
        ``clusters - 1``.
    clusters : int
        Number of clusters, 1 to ``2**cluster_bits``.
    link_width : int or None
        Wires of each inter-cluster link; ``None`` is a quarter of the request packet's width
        (a quarter of the NoC's bandwidth).
    link_latency : int
        Cycles of wire delay of each link, 1 to 256.
    link_depth : int or None
        Receive queue (credits) of each link; ``None`` is enough for full throughput.
    bridge : (int, int) or None
        ``(x, y)`` of the bridge tile in every cluster; ``None`` is ``(cols - 1, rows - 1)``.

    Raises
    ------
    TypeError, ValueError
        If a parameter is invalid or the parameters are inconsistent; the message names them.
    """

    fabric: FabricParams
    clusters: int = 2
    link_width: int | None = None
    link_latency: int = 20
    link_depth: int | None = None
    bridge: tuple | None = None

    def __post_init__(self):
        if not isinstance(self.fabric, FabricParams):
            raise TypeError(f"fabric must be a FabricParams, not {self.fabric!r}")
        cb = self.fabric.cluster_bits
        if cb == 0:
            raise ValueError("fabric.mu.cluster_bits must be at least 1 in a system of "
                             "clusters, not 0")
        if not isinstance(self.clusters, int) or isinstance(self.clusters, bool) \
                or not 1 <= self.clusters <= 1 << cb:
            raise ValueError(f"clusters must be an integer from 1 to {1 << cb} "
                             f"(cluster_bits = {cb}), not {self.clusters!r}")
        if self.link_width is None:
            object.__setattr__(self, "link_width", -(-self.request_bits // 4))
        if self.bridge is None:
            object.__setattr__(self, "bridge", (self.fabric.cols - 1, self.fabric.rows - 1))
        if isinstance(self.bridge, list):
            object.__setattr__(self, "bridge", tuple(self.bridge))
        bits = min(self.request_bits, self.response_bits)
        try:
            check_link_params(bits, width=self.link_width, latency=self.link_latency,
                              depth=self.link_depth)
        except TypeError as e:
            raise TypeError(f"link_{e}") from None
        b = self.bridge
        if not (isinstance(b, tuple) and len(b) == 2 and all(isinstance(v, int) for v in b)
                and 0 <= b[0] < self.fabric.cols and 0 <= b[1] < self.fabric.rows):
            raise TypeError(f"bridge must be the (x, y) of a tile of the {self.fabric.rows}x"
                            f"{self.fabric.cols} grid, not {b!r}")

    def replace(self, **changes):
        """Return a copy with some parameters changed (and validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def request_bits(self):
        """Bits of a request packet on a link."""
        return mu_request_layout(self.fabric.mu).size

    @property
    def response_bits(self):
        """Bits of a response-network packet on a link."""
        return msg_layout(self.fabric.mu).size


class System(wiring.Component):
    """``clusters`` fabrics joined by bridges, links and switches (``docs/clusters.md``).

    Members
    -------
    cmd : In(stream.Signature(host_cmd_layout(mu))).array(clusters)
        Host commands of each cluster's host port.
    reply : Out(stream.Signature(host_reply_layout(mu))).array(clusters)
        Host replies of each cluster's host port.
    configured, done, error : Out(clusters)
        Per cluster (bit ``k``): as :class:`~rdakit.hdl.fabric.top.Fabric`'s.
    req_packets, rsp_packets : Out(32).array(clusters)
        Request and response packets that left each cluster over its links.
    link_busy : Out(32).array(clusters)
        Beat-cycles of each cluster's two outgoing links (request link plus response link).
    dropped : Out(32)
        Tokens and references addressed to a cluster that does not exist (with ``clusters``
        below ``2**cluster_bits``), dropped at the switch. (A request for such a cluster is
        not dropped: it is answered with ``BAD_DESTINATION``.)
    """

    def __init__(self, params: SystemParams):
        if not isinstance(params, SystemParams):
            raise TypeError(f"params must be a SystemParams, not {params!r}")
        self.params = params
        p = params.fabric.mu
        n = params.clusters
        super().__init__({
            "cmd": In(stream.Signature(host_cmd_layout(p))).array(n),
            "reply": Out(stream.Signature(host_reply_layout(p))).array(n),
            "configured": Out(n),
            "done": Out(n),
            "error": Out(n),
            "req_packets": Out(32).array(n),
            "rsp_packets": Out(32).array(n),
            "link_busy": Out(32).array(n),
            "dropped": Out(32),
        })

    def host_port(self, k):
        """``cmd`` and ``reply`` of cluster ``k``, as
        :class:`~rdakit.sim.runtime.host.AmaranthTransport` wants them."""
        return _HostPort(self.cmd[k], self.reply[k])

    def elaborate(self, platform):
        sp = self.params
        fp = sp.fabric
        p, cb, n = fp.mu, fp.coord_bits, sp.clusters
        m = Module()
        scb = max(1, fp.cluster_bits)
        shapes = {"req": mu_request_layout(p), "rsp": msg_layout(p)}
        switches = {}
        for name, shape in shapes.items():
            switches[name] = m.submodules[f"switch_{name}"] = Mesh(
                rows=1, cols=n, payload_shape=shape, coord_bits=scb, depth=fp.noc_depth,
                queues=fp.noc_queues)
        fabrics = []
        # Clusters that do not exist have IDs (n < 2**cluster_bits): requests for them.
        phantom_ids = n < (1 << fp.cluster_bits)
        for k in range(n):
            f = m.submodules[f"cluster{k}"] = Fabric(fp, cluster=k, bridge=sp.bridge)
            fabrics.append(f)
            wiring.connect(m, wiring.flipped(self.cmd[k]), f.cmd)
            wiring.connect(m, f.reply, wiring.flipped(self.reply[k]))
            m.d.comb += [self.configured[k].eq(f.configured), self.done[k].eq(f.done),
                         self.error[k].eq(f.error)]
            links = {}
            for name, shape in shapes.items():
                link = links[name] = m.submodules[f"link{k}_{name}"] = Link(
                    shape, width=sp.link_width, latency=sp.link_latency, depth=sp.link_depth)
                wiring.connect(m, getattr(f, f"bridge_{name}_out"), link.i)
                ej = switches[name].eject[k]
                arrive = getattr(f, f"bridge_{name}_in")
                m.d.comb += [
                    arrive.valid.eq(ej.valid),
                    ej.ready.eq(arrive.ready),
                    arrive.payload.eq(ej.payload.payload),
                ]
                counter = self.req_packets[k] if name == "req" else self.rsp_packets[k]
                m.d.comb += counter.eq(link.packets)
            m.d.comb += self.link_busy[k].eq(links["req"].busy_cycles
                                              + links["rsp"].busy_cycles)

            # Into the switches, each packet to the cluster it names.
            req, rsp = links["req"].o, links["rsp"].o
            req_inj, rsp_inj = switches["req"].inject[k], switches["rsp"].inject[k]
            to = req.payload.ref.mu[2 * cb:]
            m.d.comb += [
                req_inj.payload.payload.eq(req.payload), req_inj.payload.dst.x.eq(to),
                req_inj.payload.dst.y.eq(0), rsp_inj.payload.dst.y.eq(0),
            ]
            if not phantom_ids:
                m.d.comb += [
                    req_inj.valid.eq(req.valid), req.ready.eq(req_inj.ready),
                    rsp_inj.valid.eq(rsp.valid), rsp.ready.eq(rsp_inj.ready),
                    rsp_inj.payload.payload.eq(rsp.payload),
                    rsp_inj.payload.dst.x.eq(rsp.payload.body.dst.cluster),
                ]
                continue
            # A request for a cluster that does not exist would be dropped by the request
            # switch, and its requester would wait forever: it becomes a BAD_DESTINATION
            # response to the requester instead, taking the response switch's injection that
            # cycle (the response link's packet waits; valid never depends on ready).
            phantom = Signal(name=f"phantom{k}")
            answer = Signal(shapes["rsp"], name=f"phantom{k}_answer")
            m.d.comb += [
                phantom.eq(req.valid & (to >= n)),
                answer.kind.eq(MsgKind.RESPONSE),
                answer.body.op.eq(req.payload.op),
                answer.body.status.eq(MUStatus.BAD_DESTINATION),
                answer.body.dst.eq(req.payload.src),
                answer.body.tag.eq(req.payload.tag),
                answer.body.ref.eq(req.payload.ref),
                req_inj.valid.eq(req.valid & ~phantom),
                req.ready.eq(Mux(phantom, rsp_inj.ready, req_inj.ready)),
                rsp_inj.valid.eq(rsp.valid | phantom),
                rsp.ready.eq(rsp_inj.ready & ~phantom),
                rsp_inj.payload.payload.eq(Mux(phantom, answer, rsp.payload)),
                rsp_inj.payload.dst.x.eq(Mux(phantom, req.payload.src.cluster,
                                             rsp.payload.body.dst.cluster)),
            ]
        m.d.comb += self.dropped.eq(sum(
            (switches[name].rejected[k] for name in shapes for k in range(n)), start=0)[:32])
        return m


class _HostPort:
    def __init__(self, cmd, reply):
        self.cmd, self.reply = cmd, reply
