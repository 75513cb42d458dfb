"""The host driver: one API to load, fill, run and read a fabric on every backend.

:class:`HostDriver` speaks the host-port protocol (``docs/fabric.md``) through a *transport*
with two coroutines, ``send(cmd: int)`` and ``recv() -> int``, plus ``tick(n)`` to let cycles
pass. :class:`AmaranthTransport` drives a :class:`~rdakit.hdl.fabric.top.Fabric` in Amaranth's
simulator; :class:`CocotbTransport` drives its Verilog under cocotb (Icarus or Verilator);
:class:`HarnessTransport` drives it built into a Verilator harness executable, with no cocotb
and bursts run inside the executable (no round trip a cycle). The board bridge's UART transport
has the same three methods. A transport may also have
``burst(cmds) -> replies``, which sends commands that each have a reply while it takes the
replies in the same cycles (one command a cycle when the fabric keeps up); the driver uses it for
the MU requests of a vector transfer and otherwise keeps up to
:data:`~rdakit.hdl.spec.packets.HOST_IN_FLIGHT` of them outstanding with ``send`` and ``recv``.

Nothing waits without a bound. The simulator transports give up on a command the fabric does
not take, or a reply that does not come, after ``reply_cycles`` cycles; :meth:`HostDriver.wait_done`
after ``max_cycles``. Either raises :class:`HostTimeout` naming the command (and the MU or tile
it addressed) or the CUs still running. The driver refuses, before sending anything, what it can
know is wrong from the fabric's parameters (:class:`HostArgumentError`): an MU that is not an MU
tile of the grid, a cluster out of range, a reference, weight, tile or address that does not
fit its field.
"""

import numpy as np

from rdakit.errors import UserError
from rdakit.hdl.spec.bitstream import LoadStatus, file_words
from rdakit.hdl.spec.config import CU_MAP, STATUS_BITS, decode_cu_status
from rdakit.hdl.spec.packets import (
    HOST_IN_FLIGHT,
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

__all__ = ["HostDriver", "HostError", "HostArgumentError", "HostTimeout", "NoReply",
           "REPLY_CYCLES",
           "AmaranthTransport", "CocotbTransport", "cocotb_host", "HarnessTransport",
           "harness_host", "burst_timeout"]

#: Cycles a simulator transport waits for the fabric to take a command or to reply, by default:
#: far above any MU operation (a reserve-mode copy moves a word a cycle; an MU walks its block
#: table after reset), so only a fabric that will never answer reaches it.
REPLY_CYCLES = 1_000_000


class HostError(RuntimeError):
    """The fabric refused a host command or an MU request failed."""


class HostArgumentError(UserError, ValueError):
    """An argument of a :class:`HostDriver` call that cannot be right on this fabric (the
    message names it and what it must be); nothing was sent."""


class HostTimeout(HostError, TimeoutError):
    """The fabric did not take a command, reply or finish within its bound; the message names
    what was waited for and for how many cycles."""


class NoReply(HostTimeout):
    """The fabric did not take a command or did not reply to it within the transport's bound:
    the host port no longer answers (reset the fabric)."""


def _int(name, value, lo, hi):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) \
            or not lo <= value <= hi:
        raise HostArgumentError(f"{name} must be an integer from {lo} to {hi}, not {value!r}")
    return int(value)


class HostDriver:
    """Load a bitstream, move data in and out of MU buffers, run, and read counters."""

    def __init__(self, params, transport, *, clusters=None, cluster=0):
        self.params = params
        self.transport = transport
        self.cmd_layout = host_cmd_layout(params.mu)
        self.reply_layout = host_reply_layout(params.mu)
        self.lanes = params.cu.lanes
        #: Clusters of the system the fabric is part of (``None``: as many as ``cluster_bits``
        #: can name); references to others are refused.
        self.clusters = 1 << params.cluster_bits if clusters is None else \
            _int("clusters", clusters, 1, 1 << params.cluster_bits)
        #: The cluster whose host port this is (the MUs :meth:`live_refs` probes).
        self.cluster = _int("cluster", cluster, 0, self.clusters - 1)

    async def _command(self, fields, *, reply=True, what=None):
        """Send one command; return its reply (a dict). ``what`` names it in a timeout."""
        try:
            word = pack(self.cmd_layout, fields)
        except ValueError as e:
            raise HostArgumentError(f"{fields['kind'].name}: {e}") from None
        what = what or fields["kind"].name
        try:
            await self.transport.send(word)
            if not reply:
                return None
            r = unpack(self.reply_layout, await self.transport.recv())
        except TimeoutError as e:
            raise NoReply(f"{what}: {e}") from None
        if r["kind"] is not fields["kind"]:
            raise HostError(f"reply of kind {r['kind']} to a {fields['kind'].name} command")
        return r

    # --- what the driver refuses -----------------------------------------------------------

    def check_tile(self, xy, *, kind=None, name="tile"):
        """``(x, y)`` (or ``(x, y, cluster)``) of a tile of the grid (of ``kind`` "C" or "M")
        as a tuple of ints; raises :class:`HostArgumentError` naming ``name`` otherwise."""
        p = self.params
        what = {"M": "an MU", "C": "a CU", None: "a"}[kind]
        ok = isinstance(xy, (tuple, list)) and len(xy) in (2, 3) and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in xy)
        if ok:
            x, y, *c = (int(v) for v in xy)
            ok = 0 <= x < p.cols and 0 <= y < p.rows and (kind is None or p.kind(x, y) == kind)
            if c and not 0 <= c[0] < self.clusters:
                raise HostArgumentError(f"{name} {tuple(xy)!r} names cluster {c[0]}, but the "
                                        f"system has clusters 0 to {self.clusters - 1}")
        if not ok:
            tiles = ", ".join(str(t) for t in p.tiles(kind))
            raise HostArgumentError(f"{name} must be the (x, y) of {what} tile of the "
                                    f"{p.rows}x{p.cols} fabric ({tiles}), not {xy!r}")
        return tuple(int(v) for v in xy)

    def check_ref(self, ref, *, name="ref"):
        """A reference (an int as a CU register holds it) whose MU is an MU tile of the grid
        and of a cluster that exists; returns it as a dict ``{mu, buf}``."""
        p = self.params
        bits = p.mu.mu_id_bits + p.mu.buf_id_bits
        ref = _int(name, ref, 0, (1 << bits) - 1)
        d = self.ref_dict(ref)
        x, y = p.mu_coords(d["mu"])
        cluster = p.mu_cluster(d["mu"])
        if not (x < p.cols and y < p.rows and p.kind(x, y) == "M") \
                or cluster >= self.clusters:
            where = f"({x}, {y})" + (f" of cluster {cluster}" if p.cluster_bits else "")
            raise HostArgumentError(f"{name} {ref:#x} names MU {d['mu']}, tile {where}, which "
                                    f"is not an MU of the {p.rows}x{p.cols} fabric"
                                    + (f" with {self.clusters} clusters" if p.cluster_bits
                                       else ""))
        return d

    # --- configuration ---------------------------------------------------------------------

    async def load(self, bitstream):
        """Load a bitstream (bytes); return ``(LoadStatus, load cycles)``."""
        await self._command({"kind": HostCmd.LOAD_BEGIN}, reply=False)
        for word in file_words(bitstream):
            await self._command({"kind": HostCmd.LOAD_WORD, "word": word}, reply=False)
        await self.transport.tick(4)
        word = (await self._command({"kind": HostCmd.LOAD_STATUS}))["word"]
        return LoadStatus(word & 0xf), word >> 8

    async def cfg_read(self, x, y, addr):
        """Word ``addr`` of the configuration space of tile ``(x, y)``."""
        x, y = self.check_tile((x, y))
        addr = _int("addr", addr, 0, 0xffff)
        return (await self._command({"kind": HostCmd.CFG_READ, "x": x, "y": y, "addr": addr},
                                    what=f"CFG_READ of tile ({x}, {y}) address {addr:#x}")
                )["word"]

    # --- MU access -------------------------------------------------------------------------

    async def mu_request(self, request):
        """Send one MU request (a dict of ``mu_request_layout``) as it is; return the response
        dict. Only field widths are checked: a reference that names no MU is answered by the
        fabric with ``BAD_DESTINATION`` (the methods below refuse it before sending)."""
        ref = request.get("ref", {})
        mu = ref.get("mu", 0) if isinstance(ref, dict) else ref
        op = request.get("op")
        op = op.name if isinstance(op, MUOp) else op
        return (await self._command({"kind": HostCmd.MU_REQUEST, "req": request},
                                    what=f"MU_REQUEST {op} to MU {mu}"))["resp"]

    async def _ok(self, request):
        resp = await self.mu_request(request)
        if resp["status"] is not MUStatus.OK:
            status = getattr(resp["status"], "name", resp["status"])
            raise HostError(f"{request['op'].name} failed: {status}")
        return resp

    async def mu_burst(self, requests, *, what):
        """Send MU requests for one MU pipelined (up to ``HOST_IN_FLIGHT`` outstanding, through
        the transport's ``burst`` when it has one); return their responses in request order.
        Each request's tag is its position modulo the tags the host may use, checked on its
        response (requests to one MU are answered in order: a response out of order is a
        :class:`HostError`). ``what`` names the transfer in a timeout."""
        tags = 1 << (self.params.mu.tag_bits - 1)
        words = []
        for i, request in enumerate(requests):
            try:
                words.append(pack(self.cmd_layout, {"kind": HostCmd.MU_REQUEST,
                                                    "req": {**request, "tag": i % tags}}))
            except ValueError as e:
                raise HostArgumentError(f"MU_REQUEST: {e}") from None
        try:
            burst = getattr(self.transport, "burst", None)
            if burst is not None:
                replies = await burst(words)
            else:
                replies = []
                for i, word in enumerate(words):
                    if i >= HOST_IN_FLIGHT:
                        replies.append(await self.transport.recv())
                    await self.transport.send(word)
                while len(replies) < len(words):
                    replies.append(await self.transport.recv())
        except TimeoutError as e:
            raise NoReply(f"{what}: {e}") from None
        responses = []
        for i, reply in enumerate(replies):
            r = unpack(self.reply_layout, reply)
            if r["kind"] is not HostCmd.MU_REQUEST or r["resp"]["tag"] != i % tags:
                raise HostError(f"{what}: reply {i} is of kind {r['kind']} with tag "
                                f"{r['resp']['tag']}, not the MU_REQUEST reply of tag {i % tags}")
            responses.append(r["resp"])
        return responses

    async def _all_ok(self, requests, *, what):
        responses = await self.mu_burst(requests, what=what)
        for request, resp in zip(requests, responses, strict=True):
            if resp["status"] is not MUStatus.OK:
                status = getattr(resp["status"], "name", resp["status"])
                raise HostError(f"{request['op'].name} failed: {status}")
        return responses

    async def alloc(self, mu_xy, weight=1):
        """Allocate a buffer in the MU at ``mu_xy`` (``(x, y)``, or ``(x, y, cluster)``) with
        total weight ``weight``; return its reference (an int as a CU register holds it)."""
        xy = self.check_tile(mu_xy, kind="M", name="mu_xy")
        weight = _int("weight", weight, 1, (1 << self.params.mu.weight_bits) - 1)
        mu = self.params.mu_id(*xy)
        resp = await self._ok({"op": MUOp.ALLOC, "ref": {"mu": mu, "buf": 0}, "data": weight})
        return self.ref_int(resp["ref"])

    def ref_int(self, ref):
        return ref["mu"] | ref["buf"] << self.params.mu.mu_id_bits

    def ref_dict(self, ref):
        bits = self.params.mu.mu_id_bits
        return {"mu": ref & ((1 << bits) - 1), "buf": ref >> bits}

    async def release(self, ref, weight=1):
        """Give back ``weight`` of buffer ``ref`` (RETURN, or DECREF in counter mode)."""
        d = self.check_ref(ref)
        weight = _int("weight", weight, 1, (1 << self.params.mu.weight_bits) - 1)
        if self.params.mu.refcount.value == "counter":
            for _ in range(weight):
                await self._ok({"op": MUOp.DECREF, "ref": d})
        else:
            await self._ok({"op": MUOp.RETURN, "ref": d, "data": weight})

    async def free(self, ref):
        """Free buffer ``ref`` whatever weight (or count) is still outstanding, as after a
        failed job whose CUs will never return theirs; return whether it was live (a stale or
        freed reference is not an error). At most two requests in partial-free (the response
        to a RETURN of 1 says what is left), one a count in counter mode."""
        d = self.check_ref(ref)
        counter = self.params.mu.refcount.value == "counter"
        resp = await self.mu_request({"op": MUOp.DECREF if counter else MUOp.RETURN,
                                      "ref": d, "data": 1})
        if resp["status"] is MUStatus.BAD_REF:
            return False
        while resp["status"] is MUStatus.OK and resp["data"]:
            resp = await self.mu_request({"op": MUOp.DECREF if counter else MUOp.RETURN,
                                          "ref": d, "data": resp["data"]})
        if resp["status"] is not MUStatus.OK:
            raise HostError(f"freeing {ref:#x} failed: {resp['status'].name}")
        return True

    async def live_refs(self, mu_xy, limit=None):
        """The references of the buffers live in the MU at ``mu_xy`` (``(x, y)`` of this host
        port's cluster, or ``(x, y, cluster)``), found by asking LEN of
        every slot and generation (``2**buf_id_bits`` requests at most; it stops after
        ``limit`` found): how the host finds buffers it never saw, such as those a failed
        job's CUs allocated."""
        xy = self.check_tile(mu_xy, kind="M", name="mu_xy")
        mp = self.params.mu
        mu = self.params.mu_id(*xy) if len(xy) == 3 else self.params.mu_id(*xy, self.cluster)
        slot_bits = (mp.max_buffers - 1).bit_length()
        found = []
        for slot in range(mp.max_buffers):
            for gen in range(1 << (mp.buf_id_bits - slot_bits)):
                if limit is not None and len(found) >= limit:
                    return found
                buf = gen << slot_bits | slot
                resp = await self.mu_request({"op": MUOp.LEN, "ref": {"mu": mu, "buf": buf}})
                if resp["status"] is MUStatus.OK:
                    found.append(self.ref_int({"mu": mu, "buf": buf}))
                    break
        return found

    async def append_vectors(self, ref, array):
        """Append the rows of ``array`` (n × lanes int32) to buffer ``ref``."""
        d = self.check_ref(ref)
        a = np.asarray(array)
        if a.size % self.lanes:
            raise HostArgumentError(f"array must hold whole vectors of {self.lanes} lanes, "
                                    f"not {a.size} elements (shape {a.shape})")
        await self._all_ok([{"op": MUOp.APPEND, "ref": d, "data": pack_vector(row)}
                            for row in a.reshape(-1, self.lanes)],
                           what=f"APPEND of {a.size // self.lanes} vectors to MU {d['mu']}")

    async def read_vectors(self, ref, n=None):
        """Read ``n`` vector words (default: the buffer's length) as an n × lanes array."""
        d = self.check_ref(ref)
        if n is None:
            n = (await self._ok({"op": MUOp.LEN, "ref": d}))["data"]
        n = _int("n", n, 0, 1 << self.params.mu.index_bits)
        responses = await self._all_ok([{"op": MUOp.READ, "ref": d, "index": i}
                                        for i in range(n)],
                                       what=f"READ of {n} vectors from MU {d['mu']}")
        rows = [unpack_vector(resp["data"], self.lanes) for resp in responses]
        return np.array(rows, dtype=np.int32).reshape(n, self.lanes)

    # --- running ---------------------------------------------------------------------------

    async def start(self):
        """Start every enabled CU. Raises :class:`HostError` saying why the fabric refused:
        no bitstream passed its checks, or the last run has not finished (a new load stops
        it)."""
        if not (await self._command({"kind": HostCmd.START}))["ok"]:
            st = await self.status()
            if st["running"]:
                raise HostError("START refused: the last run has not finished (loading a "
                                "bitstream stops every CU)")
            raise HostError("START refused: the fabric is not configured")

    async def status(self):
        word = (await self._command({"kind": HostCmd.STATUS}))["word"]
        return {name: bool(word >> bit & 1) for name, bit in STATUS_BITS.items()}

    async def wait_done(self, *, max_cycles=1_000_000, poll=64, on_poll=None, stop_on_error=True):
        """Poll until every CU has halted, or (``stop_on_error``) until one has halted on an
        error, since the others may then wait forever for data it will never send; return the
        status. Raises :class:`HostTimeout` after ``max_cycles`` cycles, naming the CUs still
        running and their pc.

        ``on_poll(cycles)``, if given, is called after every poll with the cycles waited so far
        (progress bars)."""
        max_cycles = _int("max_cycles", max_cycles, 0, 1 << 62)
        poll = _int("poll", poll, 1, 1 << 30)
        waited = 0
        while True:
            st = await self.status()
            if st["done"] or (stop_on_error and st["error"]):
                return st
            if waited >= max_cycles:
                running = await self.running_cus()
                raise HostTimeout(
                    f"the fabric was not done {waited} cycles after START (the bound was "
                    f"{max_cycles}): CUs still running (x, y): pc "
                    + (", ".join(f"{xy}: {pc}" for xy, pc in running.items()) or "none"))
            step = min(poll, max_cycles - waited)
            await self.transport.tick(step)
            waited += step
            if on_poll is not None:
                on_poll(waited)

    async def running_cus(self):
        """The CUs that are running: ``{(x, y): pc}``."""
        out = {}
        for xy in self.params.tiles("C"):
            s = decode_cu_status(await self.cfg_read(*xy, CU_MAP.STATUS))
            if not s["done"]:
                out[xy] = s["pc"]
        return out

    async def stop(self):
        """Stop every CU (a bitstream load begins: every CU is disabled and stopped; the
        fabric is unconfigured until the next load)."""
        await self._command({"kind": HostCmd.LOAD_BEGIN}, reply=False)
        await self.transport.tick(4)

    async def run_cycles(self):
        return (await self._command({"kind": HostCmd.CYCLES}))["word"]

    async def counters(self):
        """Every tile's counters: ``{(x, y): {name: value}}`` (MUs add their occupancy; see
        :func:`~rdakit.sim.runtime.counters.read_counters`)."""
        return await read_counters(self)


async def _burst(values, cycle, reply_cycles):
    """The transports' ``burst``: ``await cycle(value)`` offers ``value`` (``None``: nothing)
    for one cycle with the reply stream ready and returns ``(sent, taken, reply)``; commands go
    in order and replies are collected until every command has its reply. ``TimeoutError``
    after ``reply_cycles`` cycles in a row without either."""
    replies, i, waited = [], 0, 0
    while len(replies) < len(values):
        sent, taken, reply = await cycle(values[i] if i < len(values) else None)
        i += sent
        if taken:
            replies.append(reply)
        waited = 0 if sent or taken else waited + 1
        if waited >= reply_cycles:
            raise burst_timeout(reply_cycles, i, len(values), len(replies))
    return replies


def burst_timeout(cycles, sent, total, replies):
    """The ``TimeoutError`` of a burst that made no progress for ``cycles`` cycles after
    ``sent`` of its ``total`` commands were taken and ``replies`` replies came."""
    return TimeoutError(f"no progress in {cycles} cycles after {sent} of {total} commands were "
                        f"taken and {replies} replies came")


class AmaranthTransport:
    """Host commands through a :class:`~rdakit.hdl.fabric.top.Fabric`'s ports in Amaranth's
    simulator (inside an ``async def testbench(ctx)``). ``send`` and ``recv`` raise
    ``TimeoutError`` after ``reply_cycles`` cycles."""

    def __init__(self, ctx, fabric, *, reply_cycles=REPLY_CYCLES):
        self.ctx = ctx
        self.fabric = fabric
        self.reply_cycles = _int("reply_cycles", reply_cycles, 1, 1 << 62)
        self._cmd = fabric.cmd.payload.as_value()
        self._reply = fabric.reply.payload.as_value()

    async def send(self, value):
        ctx = self.ctx
        ctx.set(self.fabric.cmd.valid, 1)
        ctx.set(self._cmd, value)
        for _ in range(self.reply_cycles):
            _, _, taken = await ctx.tick().sample(self.fabric.cmd.ready)
            if taken:
                break
        else:
            ctx.set(self.fabric.cmd.valid, 0)
            raise TimeoutError(f"the fabric did not take the command in "
                               f"{self.reply_cycles} cycles")
        ctx.set(self.fabric.cmd.valid, 0)

    async def recv(self):
        ctx = self.ctx
        ctx.set(self.fabric.reply.ready, 1)
        for _ in range(self.reply_cycles):
            _, _, valid, value = await ctx.tick().sample(self.fabric.reply.valid, self._reply)
            if valid:
                break
        else:
            ctx.set(self.fabric.reply.ready, 0)
            raise TimeoutError(f"no reply in {self.reply_cycles} cycles")
        ctx.set(self.fabric.reply.ready, 0)
        return value

    async def burst(self, values):
        """Send ``values`` (commands that each have a reply), one a cycle as the fabric takes
        them, taking replies in the same cycles; return the replies. ``TimeoutError`` after
        ``reply_cycles`` cycles without progress."""
        ctx, cmd, reply = self.ctx, self.fabric.cmd, self.fabric.reply

        async def cycle(value):
            ctx.set(cmd.valid, value is not None)
            if value is not None:
                ctx.set(self._cmd, value)
            _, _, sent, taken, got = await ctx.tick().sample(
                cmd.valid & cmd.ready, reply.valid, self._reply)
            return bool(sent), bool(taken), got

        ctx.set(reply.ready, 1)
        try:
            return await _burst(values, cycle, self.reply_cycles)
        finally:
            ctx.set(cmd.valid, 0)
            ctx.set(reply.ready, 0)

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
    ``reply__*``, or the ``cmd`` and ``reply`` prefixes given); the clock must already run.
    ``send`` and ``recv`` raise ``TimeoutError`` after ``reply_cycles`` cycles."""

    def __init__(self, dut, *, cmd="cmd", reply="reply", reply_cycles=REPLY_CYCLES):
        from cocotb.triggers import ReadOnly, RisingEdge  # deferred: cocotb is a test extra

        self.reply_cycles = _int("reply_cycles", reply_cycles, 1, 1 << 62)
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
        for _ in range(self.reply_cycles):
            await self._ro
            taken = bool(self._cmd_ready.value)
            await self._edge
            if taken:
                break
        else:
            self._cmd_valid.value = 0
            raise TimeoutError(f"the fabric did not take the command in "
                               f"{self.reply_cycles} cycles")
        self._cmd_valid.value = 0

    async def recv(self):
        self._reply_ready.value = 1
        for _ in range(self.reply_cycles):
            await self._ro
            if self._reply_valid.value:
                value = self._reply_payload.value.to_unsigned()
                await self._edge
                break
            await self._edge
        else:
            self._reply_ready.value = 0
            raise TimeoutError(f"no reply in {self.reply_cycles} cycles")
        self._reply_ready.value = 0
        return value

    async def burst(self, values):
        """As :meth:`AmaranthTransport.burst`: one command a cycle while replies are taken."""
        async def cycle(value):
            self._cmd_valid.value = value is not None
            if value is not None:
                self._cmd_payload.value = value
            await self._ro
            sent = value is not None and bool(self._cmd_ready.value)
            taken = bool(self._reply_valid.value)
            got = self._reply_payload.value.to_unsigned() if taken else None
            await self._edge
            return sent, taken, got

        self._reply_ready.value = 1
        try:
            return await _burst(values, cycle, self.reply_cycles)
        finally:
            self._cmd_valid.value = 0
            self._reply_ready.value = 0

    async def tick(self, n=1):
        for _ in range(n):
            await self._edge


async def harness_host(proc, params):
    """Reset a fabric built into a Verilator harness executable (``proc``, a running
    :class:`~rdakit.sim.verify.runner.HarnessProcess`) as :func:`cocotb_host` does and return a
    :class:`HostDriver` on its host port."""
    proc.set("cmd__valid", 0)
    proc.set("reply__ready", 0)
    proc.set("rst", 1)
    await proc.run(3)
    proc.set("rst", 0)
    await proc.run(1)
    return HostDriver(params, HarnessTransport(proc))


class HarnessTransport:
    """Host commands through the fabric's Verilog built into a Verilator harness executable
    (``proc``: a :class:`~rdakit.sim.verify.runner.HarnessProcess`, ports ``cmd__*`` and
    ``reply__*`` or the prefixes given). ``burst`` runs in the executable, a command a cycle as
    the fabric takes them, and ``tick`` runs its cycles there: neither costs a round trip a
    cycle, so filling a large fabric's inputs takes the simulator's time, not the host's.
    Cycle for cycle the same as :class:`CocotbTransport` (inputs set, both handshakes sampled
    before the clock edge). ``send`` and ``recv`` raise ``TimeoutError`` after
    ``reply_cycles`` cycles."""

    def __init__(self, proc, *, cmd="cmd", reply="reply", reply_cycles=REPLY_CYCLES):
        self.reply_cycles = _int("reply_cycles", reply_cycles, 1, 1 << 62)
        self.proc = proc
        self._cmd, self._reply = cmd, reply

    async def send(self, value):
        proc, cmd = self.proc, self._cmd
        proc.set(f"{cmd}__payload", value)
        proc.set(f"{cmd}__valid", 1)
        try:
            for _ in range(self.reply_cycles):
                taken = proc.get(f"{cmd}__ready")
                await proc.run(1)
                if taken:
                    return
            raise TimeoutError(f"the fabric did not take the command in {self.reply_cycles} "
                               f"cycles")
        finally:
            proc.set(f"{cmd}__valid", 0)

    async def recv(self):
        proc, reply = self.proc, self._reply
        proc.set(f"{reply}__ready", 1)
        try:
            for _ in range(self.reply_cycles):
                valid, value = proc.get_many([f"{reply}__valid", f"{reply}__payload"])
                await proc.run(1)
                if valid:
                    return value
            raise TimeoutError(f"no reply in {self.reply_cycles} cycles")
        finally:
            proc.set(f"{reply}__ready", 0)

    async def burst(self, values):
        """As :meth:`AmaranthTransport.burst`, inside the harness executable."""
        return self.proc.burst(self._cmd, self._reply, values, limit=self.reply_cycles)[0]

    async def tick(self, n=1):
        await self.proc.run(n)
