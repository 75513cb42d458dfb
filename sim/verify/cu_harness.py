"""A test harness for compute units: CUs wired straight to MUs, without a NoC.

:class:`CUHarness` is a synthesizable component holding some CUs and MUs of a fabric's layout.
A CU's request goes to the MU whose coordinates are its ``dst``; an MU's response becomes a
``RESPONSE`` message to the CU named by its ``dst`` (or, when the host bit of its tag is set,
goes out on ``host_resp``); a CU's token or reference goes to the CU named by its ``dst`` (a CU
may send to itself). Every MU input and every CU input has a round-robin arbiter, so a CU's
``msg_in`` takes one flit a cycle while the MUs and senders behind it wait.

:class:`HarnessDriver` does what the fabric's host would, from an Amaranth testbench: write a
:class:`~rdakit.hdl.spec.bitstream.TileConfig` over the configuration bus (the records of the
bitstream writer), load and read MU buffers through ``host_req``/``host_resp``, pulse ``start``
and wait for ``done``, and read back registers, status, counters and the local buffer.
:func:`run_program` does all of it in one simulation and returns a :class:`HarnessResult`
shaped like the interpreter's results (:mod:`rdakit.sim.models.interp`), so the two can be compared.
"""

import dataclasses
import random

import numpy as np
from amaranth.hdl import Const, Module, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from rdakit.hdl.compute.unit import ComputeUnit
from rdakit.hdl.memory.unit import MemoryUnit
from rdakit.hdl.spec.bitstream import TileConfig, _tile_records
from rdakit.hdl.spec.config import (
    CU_MAP,
    CU_PROFILE,
    CU_STATUS_BITS,
    TILE_COUNTERS,
    config_bus_signature,
    decode_cu_status,
)
from rdakit.hdl.spec.flit import flit_layout, pack_flit
from rdakit.hdl.spec.packets import (
    MsgKind,
    MUOp,
    MUStatus,
    host_tag_bit,
    msg_layout,
    mu_request_layout,
    mu_response_layout,
    unpack,
)
from rdakit.hdl.spec.params import FabricParams
from rdakit.hdl.spec.vector import pack_vector, unpack_vector
from rdakit.sim.verify.amaranth_sim import simulate

__all__ = ["CUHarness", "HarnessDriver", "HarnessError", "CUResult", "HarnessResult",
           "run_program", "run_session"]

_CODE_NAMES = {v: k for k, v in CU_STATUS_BITS.items()}


class HarnessError(RuntimeError):
    """A host request failed, or the CUs did not finish in time."""


def _round_robin(m, requests, name):
    """Grant one of ``requests`` (a list of 1-bit values), starting after the last one granted.
    Returns the grants and the register to update (``last``) when a grant is used."""
    n = len(requests)
    grants = [Signal(name=f"{name}_grant{i}") for i in range(n)]
    if n == 1:
        m.d.comb += grants[0].eq(requests[0])
        return grants, None
    last = Signal(range(n), name=f"{name}_last")
    for start in range(n):
        with m.If(last == start):
            taken = Const(0)
            for off in range(1, n + 1):
                i = (start + off) % n
                m.d.comb += grants[i].eq(requests[i] & ~taken)
                taken = taken | requests[i]
    return grants, last


class CUHarness(wiring.Component):
    """CUs and MUs of a fabric, connected point to point.

    Parameters
    ----------
    fabric_params : FabricParams
        The fabric whose tiles are taken.
    cus, mus : list of (x, y), optional
        The CU and MU tiles to build (default: every tile of that kind).

    Members
    -------
    start : In(1)
        Start pulse of every CU.
    cfg : In(config_bus_signature()).array(len(cus))
        Each CU's configuration bus, in the order of ``cus``.
    host_req : In(stream.Signature(flit_layout(coord_bits, mu_request_layout(mu))))
        Requests of the host to the MU named by ``dst``; set the host bit of ``tag``.
    host_resp : Out(stream.Signature(mu_response_layout(mu)))
        Responses to requests with the host bit.
    done, error : Out(1)
        Every CU is done; some CU halted on an error.
    mu_stall, cu_stall : In(len(mus)), In(len(cus))
        Back-pressure for tests: while bit ``j`` is set, MU ``j`` takes no request (its sources
        wait); while bit ``i`` is set, nothing is delivered to CU ``i`` (the MUs and CUs
        sending to it wait).
    """

    def __init__(self, fabric_params, *, cus=None, mus=None):
        if not isinstance(fabric_params, FabricParams):
            raise TypeError(f"fabric_params must be a FabricParams, not {fabric_params!r}")
        p = fabric_params
        self.params = p
        self.cu_tiles = [tuple(t) for t in (p.tiles("C") if cus is None else cus)]
        self.mu_tiles = [tuple(t) for t in (p.tiles("M") if mus is None else mus)]
        if not self.cu_tiles or not self.mu_tiles:
            raise ValueError("cus and mus must each name at least one tile")
        for x, y in self.mu_tiles:
            if not (0 <= x < p.cols and 0 <= y < p.rows) or p.kind(x, y) != "M":
                raise ValueError(f"mus must be memory-unit tiles of the fabric, not ({x}, {y})")
        self.cus = [ComputeUnit(p, x=x, y=y) for x, y in self.cu_tiles]
        self.mus = [MemoryUnit(p.mu, mu_id=p.mu_id(x, y)) for x, y in self.mu_tiles]
        cb = p.coord_bits
        super().__init__({
            "start": In(1),
            "cfg": In(config_bus_signature()).array(len(self.cus)),
            "host_req": In(stream.Signature(flit_layout(cb, mu_request_layout(p.mu)))),
            "host_resp": Out(stream.Signature(mu_response_layout(p.mu))),
            "done": Out(1),
            "error": Out(1),
            "mu_stall": In(len(self.mus)),
            "cu_stall": In(len(self.cus)),
        })

    def elaborate(self, platform):
        p = self.params
        m = Module()
        for i, cu in enumerate(self.cus):
            m.submodules[f"cu{i}"] = cu
            wiring.connect(m, wiring.flipped(self.cfg[i]), cu.cfg)
            m.d.comb += cu.start.eq(self.start)
        for j, mu in enumerate(self.mus):
            m.submodules[f"mu{j}"] = mu
        m.d.comb += [
            self.done.eq(_all([cu.done for cu in self.cus])),
            self.error.eq(_any([cu.error for cu in self.cus])),
        ]

        def at(dst, tile):
            return (dst.x == tile[0]) & (dst.y == tile[1])

        # Requests: CUs and the host to each MU.
        req_srcs = [(cu.req, f"cu{i}") for i, cu in enumerate(self.cus)]
        req_srcs.append((self.host_req, "host"))
        req_ready = {name: [] for _, name in req_srcs}
        for j, (mu, tile) in enumerate(zip(self.mus, self.mu_tiles, strict=True)):
            wants = [src.valid & at(src.payload.dst, tile) & ~self.mu_stall[j]
                     for src, _ in req_srcs]
            grants, last = _round_robin(m, wants, f"mu{j}_req")
            payload = 0
            for g, (src, _) in zip(grants, req_srcs, strict=True):
                payload = payload | (src.payload.payload.as_value() & g.replicate(
                    len(mu.req.payload.as_value())))
            m.d.comb += [mu.req.valid.eq(_any(grants)), mu.req.payload.eq(payload)]
            for i, (g, (_, name)) in enumerate(zip(grants, req_srcs, strict=True)):
                req_ready[name].append(g & mu.req.ready)
                if last is not None:
                    with m.If(g & mu.req.ready):
                        m.d.sync += last.eq(i)
        for src, name in req_srcs:
            m.d.comb += src.ready.eq(_any(req_ready[name]))

        # Messages: MU responses and CU messages to each CU; host responses to the host.
        hbit = host_tag_bit(p.mu)
        msg_flit = flit_layout(p.coord_bits, msg_layout(p.mu))
        msg_srcs = []          # (valid, flit value, to host, ready list, responses)
        for j, mu in enumerate(self.mus):
            flit = Signal(msg_flit, name=f"mu{j}_flit")
            m.d.comb += [flit.dst.eq(mu.resp.payload.dst),
                         flit.payload.kind.eq(MsgKind.RESPONSE),
                         flit.payload.body.eq(mu.resp.payload)]
            msg_srcs.append((mu.resp, flit, mu.resp.payload.tag[hbit], []))
        for cu in self.cus:
            msg_srcs.append((cu.msg_out, cu.msg_out.payload, Const(0), []))
        sinks = [(cu.msg_in, tile, f"cu{i}_in", self.cu_stall[i])
                 for i, (cu, tile) in enumerate(zip(self.cus, self.cu_tiles, strict=True))]
        sinks.append((self.host_resp, None, "host_resp", Const(0)))
        for sink, tile, name, stall in sinks:
            if tile is None:
                wants = [src.valid & host for src, _, host, _ in msg_srcs]
            else:
                wants = [src.valid & ~host & at(flit.dst, tile) & ~stall
                         for src, flit, host, _ in msg_srcs]
            grants, last = _round_robin(m, wants, name)
            width = len(sink.payload.as_value())
            payload = 0
            for g, (_, flit, _, _) in zip(grants, msg_srcs, strict=True):
                value = flit.as_value() if tile is not None else flit.payload.body.as_value()
                payload = payload | (value & g.replicate(width))
            m.d.comb += [sink.valid.eq(_any(grants)), sink.payload.eq(payload)]
            for i, (g, (_, _, _, readies)) in enumerate(zip(grants, msg_srcs, strict=True)):
                readies.append(g & sink.ready)
                if last is not None:
                    with m.If(g & sink.ready):
                        m.d.sync += last.eq(i)
        for src, _, _, readies in msg_srcs:
            m.d.comb += src.ready.eq(_any(readies))
        return m


def _any(values):
    out = Const(0)
    for v in values:
        out = out | v
    return out


def _all(values):
    out = Const(1)
    for v in values:
        out = out & v
    return out


# --- Driving it from a testbench -------------------------------------------------------------

@dataclasses.dataclass
class CUResult:
    """The state of one CU after a run, read back over its configuration bus.

    ``regs`` are unsigned 32-bit; ``V`` and ``local`` are ``numpy.int32`` (``local`` is
    ``None`` when it was not read); ``counters`` holds the ``TILE_COUNTERS`` and
    its profile (``CU_PROFILE``).
    """

    x: int
    y: int
    status: int
    regs: tuple
    V: np.ndarray
    local: np.ndarray | None
    counters: dict

    @property
    def done(self):
        return bool(decode_cu_status(self.status)["done"])

    @property
    def error(self):
        return bool(decode_cu_status(self.status)["error"])

    @property
    def code(self):
        return decode_cu_status(self.status)["error_code"]

    @property
    def code_name(self):
        return _CODE_NAMES.get(self.code, str(self.code))

    @property
    def pc(self):
        return decode_cu_status(self.status)["pc"]

    @property
    def sregs(self):
        return np.array(self.regs, dtype=np.uint32).view(np.int32)


@dataclasses.dataclass
class HarnessResult:
    """What :func:`run_program` returns.

    Members
    -------
    refs : dict
        Name -> reference (register form) of every buffer loaded before the run.
    cus : dict
        ``(x, y)`` -> :class:`CUResult`.
    mus : dict
        ``(x, y)`` -> ``{reference: numpy.int32 array (length, lanes)}`` of every live buffer
        (``None`` when not read).
    cycles : int
        Cycles from ``start`` to the last CU's ``done``.
    """

    refs: dict
    cus: dict
    mus: dict
    cycles: int

    def cu(self, x, y):
        return self.cus[(x, y)]

    @property
    def errors(self):
        return {xy: r.code_name for xy, r in self.cus.items() if r.error}

    @property
    def ok(self):
        return not self.errors


class HarnessDriver:
    """Testbench helpers for a :class:`CUHarness` (every method takes the testbench's
    ``ctx``)."""

    def __init__(self, harness):
        self.h = harness
        p = harness.params
        self.params = p
        self.lanes = p.cu.lanes
        self.req_flit = harness.host_req.payload.shape()
        self.resp_layout = mu_response_layout(p.mu)
        self.host_tag = 1 << host_tag_bit(p.mu)

    def index(self, cu_xy):
        return self.h.cu_tiles.index(tuple(cu_xy))

    # Configuration bus.

    async def cfg_write(self, ctx, cu_xy, addr, words):
        """Write ``words`` (an int or a list) from ``addr`` on, one a cycle."""
        bus = self.h.cfg[self.index(cu_xy)]
        words = [words] if isinstance(words, int) else list(words)
        ctx.set(bus.sel, 1)
        ctx.set(bus.we, 1)
        for i, w in enumerate(words):
            ctx.set(bus.addr, addr + i)
            ctx.set(bus.wdata, int(w) & 0xffff_ffff)
            await ctx.tick()
        ctx.set(bus.we, 0)
        ctx.set(bus.sel, 0)

    async def cfg_read(self, ctx, cu_xy, addrs):
        """Read the words at ``addrs`` (an int or a list), one a cycle (pipelined)."""
        bus = self.h.cfg[self.index(cu_xy)]
        single = isinstance(addrs, int)
        addrs = [addrs] if single else list(addrs)
        out = []
        ctx.set(bus.sel, 1)
        ctx.set(bus.re, 1)
        for a in addrs:
            ctx.set(bus.addr, a)
            await ctx.tick()
            out.append(ctx.get(bus.rdata))
        ctx.set(bus.re, 0)
        ctx.set(bus.sel, 0)
        return out[0] if single else out

    async def configure(self, ctx, cu_xy, tile):
        """Write the configuration records of ``tile`` (as the bitstream holds them)."""
        for addr, words in _tile_records(self.params, tile):
            await self.cfg_write(ctx, cu_xy, addr, words)

    # MU access through the host port.

    async def mu_requests(self, ctx, mu_xy, requests, *, max_cycles=100_000):
        """Send ``requests`` (dicts of request fields) to the MU at ``mu_xy`` back to back;
        return their responses (dicts) in order."""
        h = self.h
        x, y = mu_xy
        flits = []
        for r in requests:
            r = dict(r)
            r.setdefault("tag", self.host_tag)
            r.setdefault("src", {"x": x, "y": y})
            flits.append(pack_flit(self.req_flit, x, y, r))
        payload = h.host_req.payload.as_value()
        ctx.set(h.host_resp.ready, 1)
        out, i, cycles = [], 0, 0
        while len(out) < len(flits):
            if cycles > max_cycles:
                raise HarnessError(f"MU {mu_xy}: {len(out)} of {len(flits)} responses after "
                                   f"{max_cycles} cycles")
            ctx.set(h.host_req.valid, i < len(flits))
            if i < len(flits):
                ctx.set(payload, flits[i])
            _, _, ready, valid, value = await ctx.tick().sample(
                h.host_req.ready, h.host_resp.valid, h.host_resp.payload.as_value())
            cycles += 1
            if i < len(flits) and ready:
                i += 1
            if valid:
                out.append(unpack(self.resp_layout, value))
        ctx.set(h.host_req.valid, 0)
        ctx.set(h.host_resp.ready, 0)
        return out

    async def _ok(self, ctx, mu_xy, requests):
        resps = await self.mu_requests(ctx, mu_xy, requests)
        for r, q in zip(resps, requests, strict=True):
            if r["status"] is not MUStatus.OK:
                raise HarnessError(f"Host {MUOp(q['op']).name} to MU {tuple(mu_xy)} failed "
                                   f"with {r['status']}")
        return resps

    def ref_int(self, ref):
        """A reference ``{mu, buf}`` in register form."""
        return ref["mu"] | ref["buf"] << self.params.mu.mu_id_bits

    def ref_fields(self, ref):
        mp = self.params.mu
        return {"mu": ref & ((1 << mp.mu_id_bits) - 1),
                "buf": (ref >> mp.mu_id_bits) & ((1 << mp.buf_id_bits) - 1)}

    async def load_buffer(self, ctx, mu_xy, array, weight=1):
        """Allocate a buffer in the MU at ``mu_xy``, append the rows of ``array`` (shape
        ``(words, lanes)``) and return its reference (register form)."""
        a = np.asarray(array)
        if a.ndim != 2 or a.shape[1] != self.lanes:
            raise ValueError(f"array must have shape (words, {self.lanes}), not {a.shape}")
        ref = (await self._ok(ctx, mu_xy, [{"op": MUOp.ALLOC, "data": weight}]))[0]["ref"]
        await self._ok(ctx, mu_xy, [{"op": MUOp.APPEND, "ref": ref, "data": pack_vector(row)}
                                    for row in a.tolist()])
        return self.ref_int(ref)

    async def read_buffer(self, ctx, mu_xy, ref):
        """The words of buffer ``ref`` as a ``numpy.int32`` array ``(length, lanes)``."""
        fields = self.ref_fields(ref)
        n = (await self._ok(ctx, mu_xy, [{"op": MUOp.LEN, "ref": fields}]))[0]["data"]
        resps = await self._ok(ctx, mu_xy, [{"op": MUOp.READ, "ref": fields, "index": i}
                                            for i in range(n)])
        out = np.zeros((n, self.lanes), dtype=np.int32)
        for i, r in enumerate(resps):
            out[i] = unpack_vector(r["data"], self.lanes)
        return out

    async def mu_buffers(self, ctx, mu_xy):
        """Every live buffer of the MU at ``mu_xy``: ``{reference: array}`` (every slot and
        generation is probed with LEN)."""
        mp = self.params.mu
        mu_id = self.params.mu_id(*mu_xy)
        probes = [{"mu": mu_id, "buf": g << mp.slot_bits | s}
                  for s in range(mp.max_buffers) for g in range(1 << mp.gen_bits)]
        resps = await self.mu_requests(ctx, mu_xy, [{"op": MUOp.LEN, "ref": r} for r in probes])
        out = {}
        for ref, r in zip(probes, resps, strict=True):
            if r["status"] is MUStatus.OK:
                out[self.ref_int(ref)] = await self.read_buffer(ctx, mu_xy, self.ref_int(ref))
        return out

    # Running.

    async def run(self, ctx, *, max_cycles=100_000):
        """Pulse ``start`` and wait until every CU is done; return the cycles it took."""
        h = self.h
        ctx.set(h.start, 1)
        await ctx.tick()
        ctx.set(h.start, 0)
        cycles = 1
        while not ctx.get(h.done):
            if cycles >= max_cycles:
                raise HarnessError(f"CUs not done after {max_cycles} cycles")
            await ctx.tick()
            cycles += 1
        return cycles

    async def cu_result(self, ctx, cu_xy, *, read_local=True):
        """Read back the state of the CU at ``cu_xy``."""
        p = self.params.cu
        cu = self.h.cus[self.index(cu_xy)]
        regs = await self.cfg_read(ctx, cu_xy, [CU_MAP.REGS + r for r in range(p.regs)])
        status = await self.cfg_read(ctx, cu_xy, CU_MAP.STATUS)
        where = {**TILE_COUNTERS, **CU_PROFILE}
        counters = dict(zip(where, await self.cfg_read(ctx, cu_xy, list(where.values())),
                            strict=True))
        local = None
        if read_local:
            words = await self.cfg_read(ctx, cu_xy, list(range(
                CU_MAP.LOCAL, CU_MAP.LOCAL + p.local_words * p.lanes)))
            local = np.array(words, dtype=np.uint32).view(np.int32).reshape(
                p.local_words, p.lanes)
        V = unpack_vector(ctx.get(cu.v), p.lanes)
        return CUResult(cu_xy[0], cu_xy[1], status, tuple(regs), V, local, counters)


def _staller(h, probability, seed):
    # Random back-pressure: each cycle every stall bit is set with the given probability.
    async def staller(ctx):
        rng = random.Random(seed)
        n_mu, n_cu = len(h.mus), len(h.cus)
        while True:
            ctx.set(h.mu_stall, sum((rng.random() < probability) << j for j in range(n_mu)))
            ctx.set(h.cu_stall, sum((rng.random() < probability) << i for i in range(n_cu)))
            await ctx.tick()
    return staller


def run_program(params, tiles, *, buffers=None, regs=None, cus=None, mus=None,
                read_local=True, read_mus=True, max_cycles=100_000, stall=0.0, seed=0,
                vcd=None):
    """Build a :class:`CUHarness`, load buffers, configure the CUs, run and read back.

    Parameters
    ----------
    params : FabricParams
    tiles : dict
        ``(x, y)`` -> :class:`TileConfig` of each CU to enable (the harness holds exactly these
        CUs unless ``cus`` says otherwise).
    buffers : dict, optional
        Name -> ``(mu_xy, array)`` or ``(mu_xy, array, weight)``, loaded in order before the
        configuration (so references are deterministic: slot 0, 1, ... of a fresh MU).
    regs : dict, optional
        ``(x, y)`` -> ``{register: buffer name}``: initial registers holding references.
    read_local, read_mus : bool
        Read back every CU's local buffer; every MU's live buffers.
    stall : float
        Probability of each stall bit (:class:`CUHarness`) in each cycle, drawn with ``seed``:
        random back-pressure on every MU input and CU input.

    Returns
    -------
    HarnessResult
    """
    cus = list(tiles) if cus is None else cus
    h = CUHarness(params, cus=cus, mus=mus)
    drv = HarnessDriver(h)
    out = {}

    async def bench(ctx):
        refs = {}
        for name, spec in (buffers or {}).items():
            mu_xy, array, *weight = spec
            refs[name] = await drv.load_buffer(ctx, mu_xy, array, *weight)
        for xy in h.cu_tiles:
            tile = tiles.get(xy, TileConfig(enabled=False))
            extra = {r: refs[name] for r, name in (regs or {}).get(xy, {}).items()}
            if extra:
                tile = dataclasses.replace(tile, regs={**tile.regs, **extra})
            await drv.configure(ctx, xy, tile)
        cycles = await drv.run(ctx, max_cycles=max_cycles)
        results = {xy: await drv.cu_result(ctx, xy, read_local=read_local) for xy in h.cu_tiles}
        contents = {xy: (await drv.mu_buffers(ctx, xy) if read_mus else None)
                    for xy in h.mu_tiles}
        out["result"] = HarnessResult(refs, results, contents, cycles)

    background = [_staller(h, stall, seed)] if stall else []
    simulate(h, bench, background=background, vcd=vcd)
    return out["result"]


def run_session(params, body, *, cus=None, mus=None, vcd=None):
    """Build a :class:`CUHarness` and run ``async def body(ctx, driver)`` on it (for several
    runs in one simulation); return what ``body`` returns."""
    h = CUHarness(params, cus=cus, mus=mus)
    drv = HarnessDriver(h)
    out = {}

    async def bench(ctx):
        out["value"] = await body(ctx, drv)

    simulate(h, bench, vcd=vcd)
    return out.get("value")
