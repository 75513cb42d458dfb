"""The fabric: an R x C grid of tiles (router + CU or MU) on two meshes, with one host port.

See ``docs/fabric.md``. The request network carries MU requests; the response network carries
MU responses, tokens and references, which every receiver accepts at once, so it always drains.
The host port shares tile (0, 0)'s network ports: its MU requests carry the top tag bit, and
responses with that bit go to the host instead of the tile's unit.

With ``cluster_bits`` (``docs/clusters.md``) the fabric is one cluster of a
:class:`~rdakit.hdl.cluster.system.System`: requests leaving a tile are stamped with the
cluster, and requests for another cluster's MU and responses for another cluster's requester are
routed to the bridge tile, which hands them to the ``bridge_*`` ports and injects what arrives on
them.
"""

from amaranth.hdl import Cat, Const, Module, Mux, Shape, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.fifo import SyncFIFOBuffered
from amaranth.lib.wiring import In, Out

from rdakit.hdl.compute.unit import ComputeUnit
from rdakit.hdl.fabric.config_loader import ConfigLoader, LoadStatus
from rdakit.hdl.memory.unit import MemoryUnit
from rdakit.hdl.noc.jitter import RATE_BITS, SEED_BITS
from rdakit.hdl.noc.mesh import DualMesh, tile_index
from rdakit.hdl.spec.bitstream import params_hash
from rdakit.hdl.spec.config import MU_MAP, STATUS_BITS, TILE_COUNTERS, config_bus_signature
from rdakit.hdl.spec.flit import flit_layout
from rdakit.hdl.spec.packets import (
    HOST_IN_FLIGHT,
    HostCmd,
    MsgKind,
    MUOp,
    MUStatus,
    host_cmd_layout,
    host_reply_layout,
    host_tag_bit,
    msg_layout,
    mu_request_layout,
)
from rdakit.hdl.spec.params import FabricParams

__all__ = ["Fabric", "MUTile", "HostPort", "Merge"]


class MUTile(wiring.Component):
    """A memory unit with its network adapters, counters and configuration-space reads.

    Requests arrive as request-network flits (the payload is the MU request); responses leave
    as response-network flits of kind RESPONSE addressed to the request's ``src``. With
    ``stamps`` the tile also counts cycles since reset and records when it last answered a READ
    with OK and when a buffer was last freed (``MU_MAP.LAST_READ_CYCLE``, ``LAST_FREE_CYCLE``).
    ``MU_MAP.PEAK_HELD_WORDS`` is the peak of words held since the last ``start`` (the host's
    START), so that each run on one fabric reports its own peak.
    """

    def __init__(self, params: FabricParams, *, x, y, cluster=0, stamps=False):
        self.params = params
        self.x, self.y, self.cluster = x, y, cluster
        self.stamps = stamps
        p = params.mu
        cb = params.coord_bits
        super().__init__({
            "req_in": In(stream.Signature(flit_layout(cb, mu_request_layout(p)))),
            "msg_out": Out(stream.Signature(flit_layout(cb, msg_layout(p)))),
            "cfg": In(config_bus_signature()),
            "start": In(1),
        })

    def elaborate(self, platform):
        m = Module()
        mu = MemoryUnit(self.params.mu, mu_id=self.params.mu_id(self.x, self.y, self.cluster))
        m.submodules.mu = mu
        m.d.comb += [
            mu.req.valid.eq(self.req_in.valid),
            mu.req.payload.eq(self.req_in.payload.payload),
            self.req_in.ready.eq(mu.req.ready),
            self.msg_out.valid.eq(mu.resp.valid),
            self.msg_out.payload.dst.eq(mu.resp.payload.dst),
            self.msg_out.payload.payload.kind.eq(MsgKind.RESPONSE),
            self.msg_out.payload.payload.body.eq(mu.resp.payload),
            mu.resp.ready.eq(self.msg_out.ready),
        ]
        flits_in = Signal(32)
        flits_out = Signal(32)
        stall = Signal(32)
        with m.If(self.req_in.valid & self.req_in.ready):
            m.d.sync += flits_in.eq(flits_in + 1)
        with m.If(self.msg_out.valid & self.msg_out.ready):
            m.d.sync += flits_out.eq(flits_out + 1)
        with m.If(self.msg_out.valid & ~self.msg_out.ready):
            m.d.sync += stall.eq(stall + 1)
        run_peak = Signal.like(mu.held_words)
        with m.If(self.start):
            m.d.sync += run_peak.eq(mu.held_words)
        with m.Elif(mu.held_words > run_peak):
            m.d.sync += run_peak.eq(mu.held_words)
        readable = {
            MU_MAP.STATUS: Const(0, 32),
            MU_MAP.HELD_WORDS: mu.held_words,
            MU_MAP.PEAK_HELD_WORDS: run_peak,
            MU_MAP.LIVE_BUFFERS: mu.live_buffers,
            MU_MAP.ALLOCS: mu.allocs,
            MU_MAP.FREES: mu.frees,
            MU_MAP.COPY_CYCLES: mu.copy_cycles,
            MU_MAP.BUSY_CYCLES: mu.busy_cycles,
            MU_MAP.FREE_BLOCKS: mu.free_blocks,
            TILE_COUNTERS["busy_cycles"]: mu.busy_cycles,
            TILE_COUNTERS["stall_cycles"]: stall,
            TILE_COUNTERS["flits_out"]: flits_out,
            TILE_COUNTERS["flits_in"]: flits_in,
        }
        if self.stamps:
            now, last_read, last_free = Signal(32), Signal(32), Signal(32)
            frees_seen = Signal.like(mu.frees)
            m.d.sync += [now.eq(now + 1), frees_seen.eq(mu.frees)]
            with m.If(mu.resp.valid & mu.resp.ready & (mu.resp.payload.op == MUOp.READ)
                      & (mu.resp.payload.status == MUStatus.OK)):
                m.d.sync += last_read.eq(now)
            with m.If(mu.frees != frees_seen):
                m.d.sync += last_free.eq(now)
            readable[MU_MAP.LAST_READ_CYCLE] = last_read
            readable[MU_MAP.LAST_FREE_CYCLE] = last_free
        with m.If(self.cfg.sel & self.cfg.re):
            with m.Switch(self.cfg.addr):
                for addr, value in readable.items():
                    with m.Case(addr):
                        m.d.sync += self.cfg.rdata.eq(value)
                with m.Default():
                    m.d.sync += self.cfg.rdata.eq(0)
        return m


class Merge(wiring.Component):
    """Two streams into one, round robin between waiting inputs; the output is registered
    (valid never depends on the output's ready)."""

    def __init__(self, shape):
        super().__init__({
            "a": In(stream.Signature(shape)),
            "b": In(stream.Signature(shape)),
            "o": Out(stream.Signature(shape)),
        })

    def elaborate(self, platform):
        m = Module()
        prefer_b = Signal()
        full = Signal()
        pick_b = self.b.valid & (prefer_b | ~self.a.valid)
        can_load = ~full | self.o.ready
        m.d.comb += [
            self.o.valid.eq(full),
            self.a.ready.eq(can_load & ~pick_b),
            self.b.ready.eq(can_load & pick_b),
        ]
        with m.If(self.o.valid & self.o.ready):
            m.d.sync += full.eq(0)
        with m.If(can_load & (self.a.valid | self.b.valid)):
            m.d.sync += [full.eq(1), prefer_b.eq(~pick_b),
                         self.o.payload.eq(Mux(pick_b, self.b.payload, self.a.payload))]
        return m


class HostPort(wiring.Component):
    """The host's way into the fabric: bitstream loading, MU requests, configuration reads,
    start and status (``docs/fabric.md``). MU requests are pipelined: up to
    :data:`~rdakit.hdl.spec.packets.HOST_IN_FLIGHT` commands with a reply may be outstanding
    (sent, their reply not yet taken); replies come in the order of the commands for requests to
    one MU, and any command that is not an MU request waits for every request in flight, so its
    reply comes after theirs.

    Every command with a reply gets it, whatever its fields. An MU request whose reference
    does not name an MU tile of the grid (a CU, or coordinates off the grid: the layout is a
    constant table here, as in the CU's sequencer) is not sent: it is answered at once with
    ``BAD_DESTINATION`` (the MU is never asked, nothing changes). A request for an MU of a
    cluster that does not exist is answered the same way by the system's cluster switch
    (:class:`~rdakit.hdl.cluster.system.System`). ``CFG_READ`` of a tile off the grid replies
    ``ok`` = 0 and ``word`` = 0. ``LOAD_BEGIN`` also stops every CU still running (``stop``),
    so a job that failed or hung never keeps the next one from starting.

    Members
    -------
    cmd : In(stream.Signature(host_cmd_layout(mu)))
    reply : Out(stream.Signature(host_reply_layout(mu)))
    req_out : Out(stream of request flits)
        Host MU requests, into tile (0, 0)'s request injection.
    resp_in : In(stream of response-network flits)
        Responses to them (the top tag bit set).
    loader_* / bus_* : the configuration loader and the configuration-bus master.
    start : Out(1)
        One-cycle pulse to every CU and MU tile.
    stop : Out(1)
        One-cycle pulse to every CU, the cycle after ``LOAD_BEGIN``'s broadcast has disabled
        them all: a CU started while disabled stops (``docs/compute-unit.md``).
    all_done, any_error, misrouted : In(1)
        Aggregated CU state and the fabric's misrouted-message flag.
    """

    def __init__(self, params: FabricParams, *, params_hash):
        self.params = params
        self.params_hash = params_hash
        p = params.mu
        cb = params.coord_bits
        super().__init__({
            "cmd": In(stream.Signature(host_cmd_layout(p))),
            "reply": Out(stream.Signature(host_reply_layout(p))),
            "req_out": Out(stream.Signature(flit_layout(cb, mu_request_layout(p)))),
            "resp_in": In(stream.Signature(flit_layout(cb, msg_layout(p)))),
            "bus_we": Out(1),
            "bus_re": Out(1),
            "bus_broadcast": Out(1),
            "bus_x": Out(cb),
            "bus_y": Out(cb),
            "bus_addr": Out(16),
            "bus_wdata": Out(32),
            "bus_rdata": In(32),
            "start": Out(1),
            "stop": Out(1),
            "all_done": In(1),
            "any_error": In(1),
            "misrouted": In(1),
            "configured": Out(1),
        })

    def elaborate(self, platform):
        params = self.params
        p = params.mu
        cb = params.coord_bits
        m = Module()
        m.submodules.loader = loader = ConfigLoader(params, params_hash=self.params_hash)
        m.d.comb += self.configured.eq(loader.configured)

        cmd = self.cmd.payload
        # Every reply goes through one queue, in the order of the commands. MU requests are
        # pipelined: one is sent whenever the queue has room for every reply outstanding
        # (requests in flight plus replies queued), so the response network never waits on the
        # host and the host may send the next request before the last is answered. Any other
        # command waits until no request is in flight, so its reply comes after theirs.
        m.submodules.replies = replies = SyncFIFOBuffered(
            width=Shape.cast(host_reply_layout(p)).width, depth=HOST_IN_FLIGHT)
        push = Signal(host_reply_layout(p))
        m.d.comb += [
            replies.w_data.eq(push),
            self.reply.valid.eq(replies.r_rdy),
            self.reply.payload.eq(replies.r_data),
            replies.r_en.eq(self.reply.ready),
        ]
        in_flight = Signal(range(HOST_IN_FLIGHT + 1))
        room = Signal()
        quiet = Signal()
        m.d.comb += [room.eq(in_flight + replies.level < HOST_IN_FLIGHT),
                     quiet.eq(in_flight == 0)]

        running = Signal()
        run_cycles = Signal(32)
        with m.If(running):
            m.d.sync += run_cycles.eq(run_cycles + 1)
            with m.If(self.all_done):
                m.d.sync += running.eq(0)
        with m.If(loader.begin):
            m.d.sync += running.eq(0)
        # LOAD_BEGIN's broadcast disables every CU; a start pulse the next cycle stops those
        # still running (a disabled CU that starts goes idle), so a failed or hung job cannot
        # keep the next one from starting.
        m.d.sync += self.stop.eq(loader.begin)

        status = Signal(32)
        m.d.comb += [
            status[STATUS_BITS["configured"]].eq(loader.configured),
            status[STATUS_BITS["running"]].eq(running),
            status[STATUS_BITS["done"]].eq(self.all_done),
            status[STATUS_BITS["error"]].eq(self.any_error),
            status[STATUS_BITS["load_error"]].eq(
                (loader.status != LoadStatus.OK) & (loader.status != LoadStatus.IDLE)
                & (loader.status != LoadStatus.LOADING)),
            status[STATUS_BITS["misrouted"]].eq(self.misrouted),
        ]

        # Loader words pass straight through; the loader drives the bus while it writes.
        m.d.comb += [
            loader.words.payload.eq(cmd.word),
            self.bus_we.eq(loader.bus_we),
            self.bus_broadcast.eq(loader.bus_broadcast),
            self.bus_x.eq(loader.bus_x),
            self.bus_y.eq(loader.bus_y),
            self.bus_addr.eq(loader.bus_addr),
            self.bus_wdata.eq(loader.bus_wdata),
        ]

        # Host MU requests: the top tag bit marks them; src is tile (0, 0). A request whose
        # reference does not name an MU tile of the grid is answered here (BAD_DESTINATION):
        # sent, it would be dropped as misrouted (a CU tile) or at injection (off the grid),
        # and the port would wait forever for its response.
        host_bit = host_tag_bit(p)
        mu_tiles = Const(params.tile_mask("M"), 1 << 2 * cb)
        names_mu = mu_tiles.bit_select(cmd.req.ref.mu[:2 * cb], 1)
        on_grid = (cmd.x < params.cols) & (cmd.y < params.rows)
        req = Signal(mu_request_layout(p))
        m.d.comb += [
            req.eq(cmd.req),
            req.src.x.eq(0),
            req.src.y.eq(0),
            req.tag.eq(cmd.req.tag | (1 << host_bit)),
            self.req_out.payload.payload.eq(req),
            self.req_out.payload.dst.x.eq(cmd.req.ref.mu[:cb]),
            self.req_out.payload.dst.y.eq(cmd.req.ref.mu[cb:2 * cb]),
            self.resp_in.ready.eq(1),    # room is reserved: see `room`
        ]
        sent = Signal()
        answered = Signal()
        m.d.comb += [sent.eq(self.req_out.valid & self.req_out.ready),
                     answered.eq(self.resp_in.valid & ~quiet)]
        m.d.sync += in_flight.eq(in_flight + sent - answered)

        read_ok = Signal()
        with m.FSM():
            with m.State("IDLE"):
                # A command with an immediate reply runs when nothing is in flight (its reply
                # after theirs) and the queue has room for it.
                answer = Signal()
                m.d.comb += [answer.eq(self.cmd.valid & quiet & room),
                             push.kind.eq(cmd.kind), push.ok.eq(1)]
                with m.Switch(cmd.kind):
                    with m.Case(HostCmd.LOAD_BEGIN):
                        m.d.comb += [loader.begin.eq(self.cmd.valid),
                                     self.cmd.ready.eq(1)]
                    with m.Case(HostCmd.LOAD_WORD):
                        m.d.comb += [loader.words.valid.eq(self.cmd.valid),
                                     self.cmd.ready.eq(1)]
                    with m.Case(HostCmd.MU_REQUEST):
                        with m.If(~names_mu):
                            m.d.comb += [
                                self.cmd.ready.eq(answer), replies.w_en.eq(answer),
                                push.ok.eq(0),
                                push.resp.op.eq(cmd.req.op),
                                push.resp.status.eq(MUStatus.BAD_DESTINATION),
                                push.resp.tag.eq(cmd.req.tag & ~(1 << host_bit)),
                                push.resp.ref.eq(cmd.req.ref),
                            ]
                        with m.Else():
                            m.d.comb += [self.req_out.valid.eq(self.cmd.valid & room),
                                         self.cmd.ready.eq(self.req_out.ready & room)]
                    with m.Case(HostCmd.CFG_READ):
                        with m.If(answer & ~loader.bus_we):
                            m.d.comb += [self.bus_re.eq(on_grid), self.bus_x.eq(cmd.x),
                                         self.bus_y.eq(cmd.y), self.bus_addr.eq(cmd.addr),
                                         self.cmd.ready.eq(1)]
                            m.d.sync += read_ok.eq(on_grid)
                            m.next = "READ"
                    with m.Case(HostCmd.START):
                        m.d.comb += [self.cmd.ready.eq(answer), replies.w_en.eq(answer)]
                        with m.If(loader.configured & ~running):
                            with m.If(answer):
                                m.d.comb += self.start.eq(1)
                                m.d.sync += [running.eq(1), run_cycles.eq(0)]
                        with m.Else():
                            m.d.comb += push.ok.eq(0)
                    with m.Case(HostCmd.STATUS):
                        m.d.comb += [self.cmd.ready.eq(answer), replies.w_en.eq(answer),
                                     push.word.eq(status)]
                    with m.Case(HostCmd.CYCLES):
                        m.d.comb += [self.cmd.ready.eq(answer), replies.w_en.eq(answer),
                                     push.word.eq(run_cycles)]
                    with m.Case(HostCmd.LOAD_STATUS):
                        m.d.comb += [self.cmd.ready.eq(answer), replies.w_en.eq(answer),
                                     push.word.eq(Cat(loader.status.as_value(), Const(0, 4),
                                                      loader.cycles[:24]))]
            with m.State("READ"):
                # Entered with nothing in flight and room in the queue: the reply goes in now.
                m.d.comb += [replies.w_en.eq(1), push.kind.eq(HostCmd.CFG_READ),
                             push.ok.eq(read_ok), push.word.eq(Mux(read_ok, self.bus_rdata, 0))]
                m.next = "IDLE"
        # A response: queued (a command's immediate reply never comes in the same cycle, as it
        # waits for nothing to be in flight). One arriving with nothing in flight is not the
        # host's: dropped, as before.
        with m.If(answered):
            body = self.resp_in.payload.payload.body
            m.d.comb += [replies.w_en.eq(1), push.kind.eq(HostCmd.MU_REQUEST), push.ok.eq(1),
                         push.resp.eq(body), push.resp.tag.eq(body.tag & ~(1 << host_bit))]
        return m


class Fabric(wiring.Component):
    """An R x C fabric of CU and MU tiles with its host port.

    Parameters
    ----------
    params : FabricParams
        The fabric (validated by :class:`FabricParams`).

    Members
    -------
    cmd : In(stream.Signature(host_cmd_layout(params.mu)))
        Host commands.
    reply : Out(stream.Signature(host_reply_layout(params.mu)))
        Host replies.
    configured, done, error : Out(1)
        A bitstream passed every check; every CU has halted; a CU halted on an error.
    bridge_req_out, bridge_rsp_out : Out(stream of request / message payloads)
        Only with ``cluster_bits``: requests for another cluster's MU and responses for
        another cluster's requester, leaving through the bridge tile.
    bridge_req_in, bridge_rsp_in : In(stream of request / message payloads)
        Only with ``cluster_bits``: requests for this cluster's MUs and responses for this
        cluster's requesters, arriving from other clusters.

    Other parameters
    ----------------
    cluster : int
        This fabric's cluster ID (part of its MUs' IDs), below ``2**cluster_bits``.
    bridge : (int, int) or None
        ``(x, y)`` of the bridge tile; ``None`` is the last tile ``(cols - 1, rows - 1)``.
    jitter, stamps : bool
        Off by default, leaving the design unchanged: ``jitter`` adds random stall gates on
        every link of both networks (:class:`~rdakit.hdl.noc.mesh.Mesh`, ``docs/race.md``), driven
        by the ``jitter_seed : In(32)`` and ``jitter_rate : In(8)`` ports (0 rate = none);
        ``stamps`` the MU tiles' cycle stamps (:class:`MUTile`). Both are for the race tests
        and ``rdakit bench race``; neither is a fabric parameter (a bitstream does not depend
        on them).
    """

    def __init__(self, params: FabricParams, *, cluster=0, bridge=None, jitter=False,
                 stamps=False):
        if not isinstance(params, FabricParams):
            raise TypeError(f"Params must be a FabricParams, not {params!r}")
        if not isinstance(cluster, int) or isinstance(cluster, bool) \
                or not 0 <= cluster < (1 << params.cluster_bits):
            raise TypeError(f"cluster must be an integer from 0 to "
                            f"{(1 << params.cluster_bits) - 1} (cluster_bits = "
                            f"{params.cluster_bits}), not {cluster!r}")
        if bridge is None:
            bridge = (params.cols - 1, params.rows - 1)
        if not (isinstance(bridge, tuple) and len(bridge) == 2
                and all(isinstance(v, int) for v in bridge)
                and 0 <= bridge[0] < params.cols and 0 <= bridge[1] < params.rows):
            raise TypeError(f"bridge must be the (x, y) of a tile of the {params.rows}x"
                            f"{params.cols} grid, not {bridge!r}")
        self.params = params
        self.params_hash = params_hash(params)
        self.cluster, self.bridge = cluster, bridge
        for name, value in (("jitter", jitter), ("stamps", stamps)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, not {value!r}")
        self.jitter, self.stamps = jitter, stamps
        p = params.mu
        ports = {
            "cmd": In(stream.Signature(host_cmd_layout(p))),
            "reply": Out(stream.Signature(host_reply_layout(p))),
            "configured": Out(1),
            "done": Out(1),
            "error": Out(1),
            **({"jitter_seed": In(SEED_BITS), "jitter_rate": In(RATE_BITS)} if jitter else {}),
        }
        if params.cluster_bits:
            ports.update({
                "bridge_req_out": Out(stream.Signature(mu_request_layout(p))),
                "bridge_req_in": In(stream.Signature(mu_request_layout(p))),
                "bridge_rsp_out": Out(stream.Signature(msg_layout(p))),
                "bridge_rsp_in": In(stream.Signature(msg_layout(p))),
            })
        super().__init__(ports)

    def elaborate(self, platform):
        fp = self.params
        p = fp.mu
        cb = fp.coord_bits
        m = Module()
        m.submodules.noc = noc = DualMesh(
            rows=fp.rows, cols=fp.cols, request_shape=mu_request_layout(p),
            response_shape=msg_layout(p), coord_bits=cb, depth=fp.noc_depth,
            queues=fp.noc_queues, jitter=self.jitter)
        if self.jitter:
            m.d.comb += [noc.jitter_seed.eq(self.jitter_seed),
                         noc.jitter_rate.eq(self.jitter_rate)]
        m.submodules.host = host = HostPort(fp, params_hash=self.params_hash)
        wiring.connect(m, wiring.flipped(self.cmd), host.cmd)
        wiring.connect(m, host.reply, wiring.flipped(self.reply))
        m.d.comb += self.configured.eq(host.configured)

        host_bit = host_tag_bit(p)
        req_flit = flit_layout(cb, mu_request_layout(p))
        msg_flit = flit_layout(cb, msg_layout(p))
        misrouted = Signal()
        done_bits, error_bits = [], []
        rdata = {}
        read_tile = Signal(range(fp.rows * fp.cols))

        for (x, y) in fp.tiles():
            t = tile_index(x, y, fp.cols)
            req_in, req_eject = noc.req.inject[t], noc.req.eject[t]
            rsp_in, rsp_eject = noc.rsp.inject[t], noc.rsp.eject[t]
            if fp.cluster_bits:
                req_in, req_eject, rsp_in, rsp_eject = self._cluster_ports(
                    m, x, y, req_in, req_eject, rsp_in, rsp_eject)
            if (x, y) == (0, 0):
                # The host shares this tile's ports: merge its requests, split the responses.
                m.submodules.host_merge = merge = Merge(req_flit)
                wiring.connect(m, merge.o, req_in)
                wiring.connect(m, host.req_out, merge.b)
                req_in = merge.a
                m.submodules.host_split = split = _Split(msg_flit, host_bit)
                wiring.connect(m, rsp_eject, split.i)
                wiring.connect(m, split.host, host.resp_in)
                rsp_eject = split.unit
            if fp.kind(x, y) == "C":
                cu = ComputeUnit(fp, x=x, y=y)
                m.submodules[f"cu_{x}_{y}"] = cu
                wiring.connect(m, cu.req, req_in)
                wiring.connect(m, cu.msg_out, rsp_in)
                wiring.connect(m, rsp_eject, cu.msg_in)
                # A CU takes no requests: one arriving is misrouted and dropped.
                m.d.comb += req_eject.ready.eq(1)
                with m.If(req_eject.valid):
                    m.d.sync += misrouted.eq(1)
                m.d.comb += cu.start.eq(host.start | host.stop)
                done_bits.append(cu.done)
                error_bits.append(cu.error)
                unit_cfg = cu.cfg
            else:
                tile = MUTile(fp, x=x, y=y, cluster=self.cluster, stamps=self.stamps)
                m.submodules[f"mu_{x}_{y}"] = tile
                wiring.connect(m, req_eject, tile.req_in)
                m.d.comb += tile.start.eq(host.start)
                wiring.connect(m, tile.msg_out, rsp_in)
                # An MU takes no messages (its own requests' responses go to the host above).
                m.d.comb += rsp_eject.ready.eq(1)
                with m.If(rsp_eject.valid):
                    m.d.sync += misrouted.eq(1)
                m.d.comb += req_in.valid.eq(0)     # an MU makes no requests
                unit_cfg = tile.cfg
            hit = (host.bus_x == x) & (host.bus_y == y)
            m.d.comb += [
                unit_cfg.sel.eq(hit | host.bus_broadcast),
                unit_cfg.we.eq(host.bus_we),
                unit_cfg.re.eq(host.bus_re & hit),
                unit_cfg.addr.eq(host.bus_addr),
                unit_cfg.wdata.eq(host.bus_wdata),
            ]
            rdata[t] = unit_cfg.rdata
        with m.If(host.bus_re):
            m.d.sync += read_tile.eq(host.bus_y * fp.cols + host.bus_x)
        with m.Switch(read_tile):
            for t, value in rdata.items():
                with m.Case(t):
                    m.d.comb += host.bus_rdata.eq(value)
        m.d.comb += [
            self.done.eq(Cat(*done_bits).all()),
            self.error.eq(Cat(*error_bits).any()),
            host.all_done.eq(self.done),
            host.any_error.eq(self.error),
            host.misrouted.eq(misrouted),
        ]
        return m


    def _cluster_ports(self, m, x, y, req_in, req_eject, rsp_in, rsp_eject):
        """Wrap one tile's network ports for a cluster: stamp and redirect what the tile
        injects, and at the bridge tile share the ports with the bridge. Returns the ports the
        tile's unit (and host port) use instead."""
        fp = self.params
        p, cb = fp.mu, fp.coord_bits
        own = self.cluster
        bx, by = self.bridge
        req_flit = flit_layout(cb, mu_request_layout(p))
        msg_flit = flit_layout(cb, msg_layout(p))

        def remote_req(payload):
            return payload.ref.mu[2 * cb:] != own

        def remote_msg(payload):
            # Responses, tokens and references alike: ``body.dst`` names the receiver.
            return payload.body.dst.cluster != own

        if (x, y) == self.bridge:
            # Requests and responses from other clusters join this tile's injections; those
            # ejected here for other clusters leave through the bridge.
            for name, flit, inj in (("req", req_flit, req_in), ("rsp", msg_flit, rsp_in)):
                merge = m.submodules[f"bridge_{name}_merge"] = Merge(flit)
                wiring.connect(m, merge.o, inj)
                arrive = getattr(self, f"bridge_{name}_in")
                pay = arrive.payload
                m.d.comb += [
                    merge.b.valid.eq(arrive.valid),
                    arrive.ready.eq(merge.b.ready),
                    merge.b.payload.payload.eq(pay),
                ]
                if name == "req":
                    m.d.comb += [merge.b.payload.dst.x.eq(pay.ref.mu[:cb]),
                                 merge.b.payload.dst.y.eq(pay.ref.mu[cb:2 * cb])]
                    req_in = merge.a
                else:
                    m.d.comb += [merge.b.payload.dst.x.eq(pay.body.dst.x),
                                 merge.b.payload.dst.y.eq(pay.body.dst.y)]
                    rsp_in = merge.a
            for name, flit, ej, remote in (("req", req_flit, req_eject, remote_req),
                                           ("rsp", msg_flit, rsp_eject, remote_msg)):
                fork = m.submodules[f"bridge_{name}_fork"] = _Fork(flit, remote)
                wiring.connect(m, ej, fork.i)
                leave = getattr(self, f"bridge_{name}_out")
                m.d.comb += [
                    leave.valid.eq(fork.b.valid),
                    leave.payload.eq(fork.b.payload.payload),
                    fork.b.ready.eq(leave.ready),
                ]
                if name == "req":
                    req_eject = fork.a
                else:
                    rsp_eject = fork.a

        # What the tile injects: requests get this cluster as their source, and go to the
        # bridge tile when their MU is elsewhere; responses to another cluster go there too.
        def stamp_fn(m, i, o):
            m.d.comb += o.payload.src.cluster.eq(own)
            with m.If(remote_req(i.payload)):
                m.d.comb += [o.dst.x.eq(bx), o.dst.y.eq(by)]

        def redirect_fn(m, i, o):
            with m.If(remote_msg(i.payload)):
                m.d.comb += [o.dst.x.eq(bx), o.dst.y.eq(by)]

        stamp = m.submodules[f"stamp_{x}_{y}"] = _Rewrite(req_flit, stamp_fn)
        wiring.connect(m, stamp.o, req_in)
        redirect = m.submodules[f"redirect_{x}_{y}"] = _Rewrite(msg_flit, redirect_fn)
        wiring.connect(m, redirect.o, rsp_in)
        return stamp.i, req_eject, redirect.i, rsp_eject


class _Rewrite(wiring.Component):
    """A combinational pass-through; ``rewrite(m, i_payload, o_payload)`` overrides fields of
    the output payload (later ``comb`` assignments win)."""

    def __init__(self, shape, rewrite):
        self.rewrite = rewrite
        super().__init__({
            "i": In(stream.Signature(shape)),
            "o": Out(stream.Signature(shape)),
        })

    def elaborate(self, platform):
        m = Module()
        m.d.comb += [self.o.valid.eq(self.i.valid), self.i.ready.eq(self.o.ready),
                     self.o.payload.eq(self.i.payload)]
        self.rewrite(m, self.i.payload, self.o.payload)
        return m


class _Fork(wiring.Component):
    """Flits to ``b`` when ``predicate(flit.payload)`` holds, else to ``a``; combinational."""

    def __init__(self, shape, predicate):
        self.predicate = predicate
        super().__init__({
            "i": In(stream.Signature(shape)),
            "a": Out(stream.Signature(shape)),
            "b": Out(stream.Signature(shape)),
        })

    def elaborate(self, platform):
        m = Module()
        to_b = self.predicate(self.i.payload.payload)
        m.d.comb += [
            self.a.payload.eq(self.i.payload),
            self.b.payload.eq(self.i.payload),
            self.a.valid.eq(self.i.valid & ~to_b),
            self.b.valid.eq(self.i.valid & to_b),
            self.i.ready.eq(Mux(to_b, self.b.ready, self.a.ready)),
        ]
        return m


class _Split(wiring.Component):
    """Response-network flits for tile (0, 0): host responses (RESPONSE with the top tag bit)
    to ``host``, the rest to ``unit``. Both sides always accept, so ``i`` always drains."""

    def __init__(self, shape, host_bit):
        self.host_bit = host_bit
        super().__init__({
            "i": In(stream.Signature(shape)),
            "host": Out(stream.Signature(shape)),
            "unit": Out(stream.Signature(shape)),
        })

    def elaborate(self, platform):
        m = Module()
        body = self.i.payload.payload.body
        to_host = (self.i.payload.payload.kind == MsgKind.RESPONSE) & body.tag[self.host_bit]
        m.d.comb += [
            self.host.payload.eq(self.i.payload),
            self.unit.payload.eq(self.i.payload),
            self.host.valid.eq(self.i.valid & to_host),
            self.unit.valid.eq(self.i.valid & ~to_host),
            self.i.ready.eq(Mux(to_host, self.host.ready, self.unit.ready)),
        ]
        return m

