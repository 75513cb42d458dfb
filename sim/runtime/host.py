"""The host driver: one API to load, fill, run and read a fabric on every backend.

:class:`HostDriver` speaks the host-port protocol (``docs/fabric.md``) through a *transport*
with two coroutines, ``send(cmd: int)`` and ``recv() -> int``, plus ``tick(n)`` to let cycles
pass. :class:`AmaranthTransport` drives a :class:`~rdakit.hdl.fabric.top.Fabric` in Amaranth's
simulator; :class:`CocotbTransport` drives its Verilog under cocotb (Icarus or Verilator). The
board bridge's UART transport has the same three methods.
"""

import struct

import numpy as np

from rdakit.hdl.fabric.config_loader import LoadStatus
from rdakit.hdl.spec.config import STATUS_BITS
from rdakit.hdl.spec.packets import (
    HostCmd,
    MUOp,
    MUStatus,
    host_cmd_layout,
    host_reply_layout,
    pack,
    unpack,
)
from rdakit.hdl.spec.vector import pack_vector, unpack_vector
from rdakit.sim.runtime.counters import read_counters

__all__ = ["HostDriver", "HostError", "AmaranthTransport", "CocotbTransport", "cocotb_host"]


class HostError(RuntimeError):
    """The fabric refused a host command or an MU request failed."""


class HostDriver:
    """Load a bitstream, move data in and out of MU buffers, run, and read counters."""

    def __init__(self, params, transport):
        self.params = params
        self.transport = transport
        self.cmd_layout = host_cmd_layout(params.mu)
        self.reply_layout = host_reply_layout(params.mu)
        self.lanes = params.cu.lanes

    async def _command(self, fields, *, reply=True):
        await self.transport.send(pack(self.cmd_layout, fields))
        if reply:
            r = unpack(self.reply_layout, await self.transport.recv())
            if r["kind"] is not fields["kind"]:
                raise HostError(f"reply of kind {r['kind']} to a {fields['kind'].name} command")
            return r
        return None

    # --- configuration ---------------------------------------------------------------------

    async def load(self, bitstream):
        """Load a bitstream (bytes); return ``(LoadStatus, load cycles)``."""
        await self._command({"kind": HostCmd.LOAD_BEGIN}, reply=False)
        n = len(bitstream) // 4
        for word in struct.unpack(f"<{n}I", bitstream[:4 * n]):
            await self._command({"kind": HostCmd.LOAD_WORD, "word": word}, reply=False)
        await self.transport.tick(4)
        word = (await self._command({"kind": HostCmd.LOAD_STATUS}))["word"]
        return LoadStatus(word & 0xf), word >> 8

    async def cfg_read(self, x, y, addr):
        return (await self._command({"kind": HostCmd.CFG_READ, "x": x, "y": y,
                                     "addr": addr}))["word"]

    # --- MU access -------------------------------------------------------------------------

    async def mu_request(self, request):
        """Send one MU request (a dict of ``mu_request_layout``); return the response dict."""
        return (await self._command({"kind": HostCmd.MU_REQUEST, "req": request}))["resp"]

    async def _ok(self, request):
        resp = await self.mu_request(request)
        if resp["status"] is not MUStatus.OK:
            raise HostError(f"{request['op'].name} failed: {resp['status'].name}")
        return resp

    async def alloc(self, mu_xy, weight=1):
        """Allocate a buffer in the MU at ``mu_xy``; return its reference (an int as a CU
        register holds it)."""
        mu = self.params.mu_id(*mu_xy)
        resp = await self._ok({"op": MUOp.ALLOC, "ref": {"mu": mu, "buf": 0}, "data": weight})
        return self.ref_int(resp["ref"])

    def ref_int(self, ref):
        return ref["mu"] | ref["buf"] << self.params.mu.mu_id_bits

    def ref_dict(self, ref):
        bits = self.params.mu.mu_id_bits
        return {"mu": ref & ((1 << bits) - 1), "buf": ref >> bits}

    async def release(self, ref, weight=1):
        """Give back ``weight`` of buffer ``ref`` (RETURN, or DECREF in counter mode)."""
        if self.params.mu.refcount.value == "counter":
            for _ in range(weight):
                await self._ok({"op": MUOp.DECREF, "ref": self.ref_dict(ref)})
        else:
            await self._ok({"op": MUOp.RETURN, "ref": self.ref_dict(ref), "data": weight})

    async def append_vectors(self, ref, array):
        """Append the rows of ``array`` (n × lanes int32) to buffer ``ref``."""
        for row in np.asarray(array).reshape(-1, self.lanes):
            await self._ok({"op": MUOp.APPEND, "ref": self.ref_dict(ref),
                            "data": pack_vector(row)})

    async def read_vectors(self, ref, n=None):
        """Read ``n`` vector words (default: the buffer's length) as an n × lanes array."""
        if n is None:
            n = (await self._ok({"op": MUOp.LEN, "ref": self.ref_dict(ref)}))["data"]
        rows = []
        for i in range(n):
            resp = await self._ok({"op": MUOp.READ, "ref": self.ref_dict(ref), "index": i})
            rows.append(unpack_vector(resp["data"], self.lanes))
        return np.array(rows, dtype=np.int32).reshape(n, self.lanes)

    # --- running ---------------------------------------------------------------------------

    async def start(self):
        if not (await self._command({"kind": HostCmd.START}))["ok"]:
            raise HostError("START refused: the fabric is not configured")

    async def status(self):
        word = (await self._command({"kind": HostCmd.STATUS}))["word"]
        return {name: bool(word >> bit & 1) for name, bit in STATUS_BITS.items()}

    async def wait_done(self, *, max_cycles=1_000_000, poll=64, on_poll=None, stop_on_error=True):
        """Poll until every CU has halted, or (``stop_on_error``) until one has halted on an
        error, since the others may then wait forever for data it will never send; return the
        status. Raises TimeoutError.

        ``on_poll(cycles)``, if given, is called after every poll with the cycles waited so far
        (progress bars)."""
        waited = 0
        while True:
            st = await self.status()
            if st["done"] or (stop_on_error and st["error"]):
                return st
            if waited > max_cycles:
                raise TimeoutError(f"fabric not done after {max_cycles} cycles: {st}")
            await self.transport.tick(poll)
            waited += poll
            if on_poll is not None:
                on_poll(waited)

    async def run_cycles(self):
        return (await self._command({"kind": HostCmd.CYCLES}))["word"]

    async def counters(self):
        """Every tile's counters: ``{(x, y): {name: value}}`` (MUs add their occupancy; see
        :func:`~rdakit.sim.runtime.counters.read_counters`)."""
        return await read_counters(self)


class AmaranthTransport:
    """Host commands through a :class:`~rdakit.hdl.fabric.top.Fabric`'s ports in Amaranth's
    simulator (inside an ``async def testbench(ctx)``)."""

    def __init__(self, ctx, fabric):
        self.ctx = ctx
        self.fabric = fabric
        self._cmd = fabric.cmd.payload.as_value()
        self._reply = fabric.reply.payload.as_value()

    async def send(self, value):
        ctx = self.ctx
        ctx.set(self.fabric.cmd.valid, 1)
        ctx.set(self._cmd, value)
        await ctx.tick().until(self.fabric.cmd.ready)
        ctx.set(self.fabric.cmd.valid, 0)

    async def recv(self):
        ctx = self.ctx
        ctx.set(self.fabric.reply.ready, 1)
        value, = await ctx.tick().sample(self._reply).until(self.fabric.reply.valid)
        ctx.set(self.fabric.reply.ready, 0)
        return value

    async def tick(self, n=1):
        await self.ctx.tick().repeat(n)


async def cocotb_host(dut, params, *, period_ns=10, clusters=None):
    """Start the clock of a fabric's Verilog under cocotb, reset it, and return a
    :class:`HostDriver` on its host port; for a :class:`~rdakit.hdl.cluster.system.System` of
    ``clusters`` clusters, a list of one driver per cluster's host port (``cmd__k__*``)."""
    # Deferred: cocotb is a test extra, and the driver also runs a real board without it.
    import cocotb
    from cocotb.clock import Clock
    from cocotb.triggers import RisingEdge

    cocotb.start_soon(Clock(dut.clk, period_ns, unit="ns").start())
    prefixes = ["cmd", "reply"] if clusters is None else \
        [f"{port}__{k}" for k in range(clusters) for port in ("cmd", "reply")]
    for prefix in prefixes:
        getattr(dut, f"{prefix}__{'valid' if prefix.startswith('cmd') else 'ready'}").value = 0
    dut.rst.value = 1
    for _ in range(3):
        await RisingEdge(dut.clk)
    dut.rst.value = 0
    await RisingEdge(dut.clk)
    if clusters is None:
        return HostDriver(params, CocotbTransport(dut))
    return [HostDriver(params, CocotbTransport(dut, cmd=f"cmd__{k}", reply=f"reply__{k}"))
            for k in range(clusters)]


class CocotbTransport:
    """Host commands through the fabric's Verilog under cocotb (ports ``cmd__*``,
    ``reply__*``, or the ``cmd`` and ``reply`` prefixes given); the clock must already run."""

    def __init__(self, dut, *, cmd="cmd", reply="reply"):
        from cocotb.triggers import ReadOnly, RisingEdge  # deferred: cocotb is a test extra

        self.dut = dut
        self._edge = RisingEdge(dut.clk)
        self._ro = ReadOnly()
        self._cmd_valid = getattr(dut, f"{cmd}__valid")
        self._cmd_ready = getattr(dut, f"{cmd}__ready")
        self._cmd_payload = getattr(dut, f"{cmd}__payload")
        self._reply_valid = getattr(dut, f"{reply}__valid")
        self._reply_ready = getattr(dut, f"{reply}__ready")
        self._reply_payload = getattr(dut, f"{reply}__payload")

    async def send(self, value):
        self._cmd_payload.value = value
        self._cmd_valid.value = 1
        while True:
            await self._ro
            taken = bool(self._cmd_ready.value)
            await self._edge
            if taken:
                break
        self._cmd_valid.value = 0

    async def recv(self):
        self._reply_ready.value = 1
        while True:
            await self._ro
            if self._reply_valid.value:
                value = self._reply_payload.value.to_unsigned()
                await self._edge
                break
            await self._edge
        self._reply_ready.value = 0
        return value

    async def tick(self, n=1):
        for _ in range(n):
            await self._edge
