"""The memory unit (MU): buffer-level virtualization and partial-free, with the paper's baselines.

See ``docs/memory-unit.md`` for the specification (operations, checks in order, allocation
policy, timing); :class:`rdakit.sim.models.mu.MUModel` is its golden model.
"""

from types import SimpleNamespace

from amaranth.hdl import Cat, Const, Module, Mux, Signal, unsigned
from amaranth.lib import data, memory, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from rdakit.hdl.memory.block_table import BlockTable
from rdakit.hdl.memory.free_list import FreeList
from rdakit.hdl.spec.packets import MUOp, MUStatus, mu_request_layout, mu_response_layout
from rdakit.hdl.spec.params import AllocMode, MUParams, RefcountMode

__all__ = ["MemoryUnit", "COUNTER_WIDTH", "buffer_entry_layout", "MU_STATES", "CHECK_ORDER",
           "TIMING"]

#: States of the memory unit's control FSM (``obs.state`` is the index in this tuple).
MU_STATES = ("INIT", "EXEC", "RMW", "ALLOC", "FREE_WALK", "FREE_END", "COPY", "COPY_END")

#: The checks of each operation after the opcode and mode checks, in the order the unit makes
#: them (the first that fails gives the status). ``docs/memory-unit.md`` is generated from this
#: (``rdakit docs``); the golden model makes the same checks in the same order.
CHECK_ORDER = {
    MUOp.ALLOC: "`data == 0`: BAD_REQUEST; `data > max_weight`: WEIGHT_OVERFLOW; no free slot "
                "(or, in `single` mode, a buffer already live): OUT_OF_MEMORY; `reserve` mode "
                "with no region of the smallest class: OUT_OF_MEMORY",
    MUOp.WRITE: "ref valid; `index >= max_buffer_words`: OUT_OF_RANGE; `virtual`: block of "
                "`index` unmapped and no free block: OUT_OF_MEMORY; `reserve`: `index >= "
                "capacity` and no region of the class needed: OUT_OF_MEMORY",
    MUOp.APPEND: "ref valid; `length == max_buffer_words`: OUT_OF_RANGE; then as WRITE at "
                 "`index = length`",
    MUOp.READ: "ref valid; `index >= length`: OUT_OF_RANGE",
    MUOp.LEN: "ref valid",
    MUOp.RETURN: "ref valid; `w == 0`: BAD_REQUEST; `w > total - collected`: WEIGHT_OVERFLOW",
    MUOp.ADD_WEIGHT: "ref valid; `k == 0`: BAD_REQUEST; `total + k > max_weight`: "
                     "WEIGHT_OVERFLOW",
    MUOp.INCREF: "ref valid; `count == max_weight`: WEIGHT_OVERFLOW",
    MUOp.DECREF: "ref valid",
    MUOp.FETCH_ADD: "ref valid; `index >= length`: OUT_OF_RANGE; `virtual`: block of `index` "
                    "never mapped (a hole a sparse WRITE left): OUT_OF_RANGE",
    MUOp.UNLOCK: "as FETCH_ADD; then, in the second execute cycle once the word is read, "
                 "word `!= data` (the ticket): NOT_OWNER",
}

#: Execute cycles of each operation that passed its checks, without back-pressure (the latency,
#: acceptance to response, is one more). A refused request takes one execute cycle, but
#: NOT_OWNER (found in UNLOCK's second). ``docs/memory-unit.md`` is generated from this; the
#: golden model counts the same cycles (``MUModel.exec_cycles``), tested against the RTL.
TIMING = {
    MUOp.ALLOC: "2: the second reads the entry (generation) of the slot it takes",
    MUOp.WRITE: "1, also when it maps a new block (`virtual`); a `reserve` growth (`index >= "
                "capacity`): `length + 3`, the old words copied one per cycle behind one "
                "cycle of read latency, then the write",
    MUOp.APPEND: "as WRITE at `index = length`",
    MUOp.READ: "1",
    MUOp.LEN: "1",
    MUOp.RETURN: "1; one that frees the buffer: `2 + max(1, ceil(length / block_words))` in "
                 "`virtual` (the walk releases one virtual block per cycle), 2 in the others",
    MUOp.ADD_WEIGHT: "1",
    MUOp.INCREF: "1",
    MUOp.DECREF: "as RETURN",
    MUOp.FETCH_ADD: "2: the first reads the word, the second writes `old + k`",
    MUOp.UNLOCK: "2: the first reads the word, the second compares it with the ticket and "
                 "writes `ticket + 1` or answers NOT_OWNER",
}

#: Width of the performance counters.
COUNTER_WIDTH = 32


def buffer_entry_layout(p: MUParams):
    """One slot of the buffer table (with the weight table: total and collected weight)."""
    fields = {
        "live": 1,
        "gen": p.gen_bits,
        "length": p.length_bits,
        "total": p.weight_bits,
        "collected": p.weight_bits,
    }
    if p.alloc_mode is AllocMode.VIRTUAL:
        fields["tail"] = p.block_bits
        # Bit v: virtual block v is mapped (its block-table entry is the physical block).
        fields["mapped"] = p.max_vblocks
    if p.alloc_mode is AllocMode.RESERVE:
        fields["base"] = p.addr_bits
        fields["order"] = range(p.n_orders)
    return data.StructLayout(fields)


class MemoryUnit(wiring.Component):
    """A memory unit serving allocate / write / append / read / length / return-weight requests.

    Parameters
    ----------
    params : MUParams
        Sizes and modes (validated by :class:`MUParams`).
    mu_id : int
        This MU's ID; references carrying another ID get ``BAD_REF``.

    Members
    -------
    req : In(stream.Signature(mu_request_layout(params)))
        Requests. After reset the unit clears its buffer table, one slot per cycle, and raises
        ``ready`` ``max_buffers + 1`` cycles after reset (the block table needs no clearing).
    resp : Out(stream.Signature(mu_response_layout(params)))
        Exactly one response per request, in request order, two cycles after acceptance at the
        earliest (``docs/memory-unit.md``, Timing, gives every operation's latency).
    held_words, peak_held_words, live_buffers : Out
        Occupancy: words held for live buffers (see the docs for each mode), their peak since
        reset (it follows ``held_words`` one cycle late), live buffers.
    free_blocks : Out(range(params.n_blocks + 1))
        Physical blocks free (``virtual``: on the free-block list or never used since reset);
        0 in the other modes, which have no blocks.
    free_slots : Out(range(params.max_buffers + 1))
        Buffer slots free: ``max_buffers - live_buffers``.
    allocs, frees, copy_cycles, busy_cycles : Out(32)
        Event counters: successful allocations, buffers freed, cycles that copy a word in
        ``reserve`` growths (one word each: the words copied), and cycles with a request in
        the execute stage (its execute cycles, plus the cycles it waits there for the response
        register under back-pressure).

    Raises
    ------
    TypeError
        If ``params`` is not an :class:`MUParams` or ``mu_id`` does not fit ``mu_id_bits``.

    Notes
    -----
    The private, test-only argument ``_observe=True`` serves the formal proofs
    (``rdakit.sim.verify.formal_harness``): it adds a member ``obs`` whose signals show the
    internal state (pipeline registers, FSM state, every entry of the buffer table, block table,
    free lists and scratchpad, see :meth:`_observation`). The harnesses' broken variants are
    subclasses that override one of the small steps of :meth:`elaborate` (``_return_overflows``,
    ``_return_frees``, ``_records_tail``, ``_fetch_add``, ``_answer_len``, ``_refuse``,
    ``_walk_releases``).
    """

    def __init__(self, params=None, *, mu_id=0, _observe=False):
        if params is None:
            params = MUParams()
        if not isinstance(params, MUParams):
            raise TypeError(f"Params must be an MUParams, not {params!r}")
        if not isinstance(mu_id, int) or not 0 <= mu_id < (1 << params.mu_id_bits):
            raise TypeError(f"MU ID must be an integer from 0 to {(1 << params.mu_id_bits) - 1} "
                            f"(mu_id_bits = {params.mu_id_bits}), not {mu_id!r}")
        self.params = params
        self.mu_id = mu_id
        self.obs = self._observation(params) if _observe else None
        held_width = exact_log2(params.words) + 1
        super().__init__({
            "req": In(stream.Signature(mu_request_layout(params))),
            "resp": Out(stream.Signature(mu_response_layout(params))),
            "held_words": Out(held_width),
            "peak_held_words": Out(held_width),
            "live_buffers": Out(range(params.max_buffers + 1)),
            "free_blocks": Out(range(params.n_blocks + 1)),
            "free_slots": Out(range(params.max_buffers + 1)),
            "allocs": Out(COUNTER_WIDTH),
            "frees": Out(COUNTER_WIDTH),
            "copy_cycles": Out(COUNTER_WIDTH),
            "busy_cycles": Out(COUNTER_WIDTH),
        })

    def elaborate(self, platform):
        m = Module()
        # The steps below share one namespace `c` of signals and sub-components; each adds to
        # it in the order the hardware is described (which fixes the generated Verilog).
        c = SimpleNamespace(p=self.params)
        self._storage(m, c)
        self._pipeline(m, c)
        self._decode(m, c)
        self._placement(m, c)
        self._checks(m, c)
        self._execute_registers(m, c)
        with m.FSM(init="INIT") as fsm:
            with m.State("INIT"):
                self._init_state(m, c)
            with m.State("EXEC"):
                self._exec_state(m, c)
            with m.State("RMW"):
                self._rmw_state(m, c)
            with m.State("ALLOC"):
                self._alloc_state(m, c)
            if c.virtual:
                with m.State("FREE_WALK"):
                    self._free_walk_state(m, c)
            with m.State("FREE_END"):
                self._free_end_state(m, c)
            if c.reserve:
                with m.State("COPY"):
                    self._copy_state(m, c)
                with m.State("COPY_END"):
                    self._copy_end_state(m, c)

        unlisted = set(fsm.encoding) - set(MU_STATES)
        if unlisted:      # obs.state and the formal harnesses name states by MU_STATES
            raise AssertionError(f"MU_STATES lacks the FSM states {sorted(unlisted)}")
        if self.obs:
            self._drive_observation(m, c, fsm)
        return m

    # --- Storage, pipeline, decode ----------------------------------------------------------

    def _storage(self, m, c):
        """The buffer table, the scratchpad, the free lists and (``virtual``) the block table."""
        p = c.p
        c.virtual = p.alloc_mode is AllocMode.VIRTUAL
        c.reserve = p.alloc_mode is AllocMode.RESERVE
        c.single = p.alloc_mode is AllocMode.SINGLE
        c.weighted = p.refcount is RefcountMode.WEIGHTED
        c.ob = p.offset_bits
        c.vbits = exact_log2(p.max_vblocks)
        c.sbits = p.slot_bits

        c.entry_layout = entry_layout = buffer_entry_layout(p)
        m.submodules.buftab = buftab = memory.Memory(shape=entry_layout, depth=p.max_buffers,
                                                     init=[])
        bt_w = buftab.write_port()
        bt_r = buftab.read_port(transparent_for=(bt_w,))

        m.submodules.scratch = scratch = memory.Memory(shape=unsigned(p.data_bits),
                                                       depth=p.words, init=[])
        sp_w = scratch.write_port()
        sp_r = scratch.read_port()
        c.buftab, c.bt_w, c.bt_r = buftab, bt_w, bt_r
        c.scratch, c.sp_w, c.sp_r = scratch, sp_w, sp_r

        obs = self.obs
        m.submodules.slots = slots = obs.slots if obs else FreeList(p.max_buffers)
        m.d.comb += self.free_slots.eq(slots.count)
        c.slots = slots
        c.live = live = Signal.like(self.live_buffers)     # live buffers
        m.d.comb += self.live_buffers.eq(live)

        if c.virtual:
            m.submodules.blocktab = bk = obs.blocktab if obs else BlockTable(p)
            m.submodules.blocks = blocks = obs.blocks if obs else FreeList(p.n_blocks)
            m.d.comb += self.free_blocks.eq(blocks.count)
            c.bk, c.blocks = bk, blocks
        if c.reserve:
            regions = []
            for k in range(p.n_orders):
                fl = FreeList(p.words // (p.reserve_words << k), width=p.addr_bits, fresh=False)
                m.submodules[f"regions{k}"] = fl
                regions.append(fl)
            bump = Signal(range(p.words + 1))
            c.regions, c.bump = regions, bump

    def _pipeline(self, m, c):
        """The request register (s1) and the response register (s2), their handshakes, and
        the table reads presented when a request is accepted."""
        p, bt_r, sp_r = c.p, c.bt_r, c.sp_r
        req_layout = mu_request_layout(p)
        c.resp_layout = mu_response_layout(p)
        s1_valid = Signal()
        s1 = Signal(req_layout)
        s2_valid = Signal()
        s2 = Signal(c.resp_layout)
        s2_from_scratch = Signal()   # response data is the scratchpad read port's output

        c.s2_free = ~s2_valid | self.resp.ready
        s1_done = Signal()           # the request in execution moves to the response register
        accept = Signal()
        init_done = Signal()
        c.s1_valid, c.s1, c.s2_valid, c.s2, c.s2_from_scratch = (s1_valid, s1, s2_valid, s2,
                                                                 s2_from_scratch)
        c.s1_done, c.init_done = s1_done, init_done

        m.d.comb += [
            self.req.ready.eq(init_done & (~s1_valid | s1_done)),
            accept.eq(self.req.valid & self.req.ready),
            self.resp.valid.eq(s2_valid),
            self.resp.payload.eq(s2),
        ]
        with m.If(s2_from_scratch):
            m.d.comb += self.resp.payload.data.eq(sp_r.data)
        with m.If(s2_valid & self.resp.ready):
            m.d.sync += s2_valid.eq(0)
        with m.If(s2_from_scratch & ~self.resp.ready):
            # Keep the read data: the read port may serve a copy before the response leaves.
            m.d.sync += [s2.data.eq(sp_r.data), s2_from_scratch.eq(0)]
        with m.Elif(s2_from_scratch):
            m.d.sync += s2_from_scratch.eq(0)

        with m.If(accept):
            m.d.sync += [s1_valid.eq(1), s1.eq(self.req.payload)]
        with m.Elif(s1_done):
            m.d.sync += s1_valid.eq(0)

        # Table reads for the incoming request (overridden by multi-cycle operations below).
        in_slot = self.req.payload.ref.buf[:c.sbits]
        m.d.comb += [bt_r.addr.eq(in_slot), bt_r.en.eq(accept)]
        if c.virtual:
            in_vb = self.req.payload.index[c.ob:c.ob + c.vbits]
            m.d.comb += [c.bk.lookup_slot.eq(in_slot), c.bk.lookup_vblock.eq(in_vb),
                         c.bk.lookup_en.eq(accept)]

    def _decode(self, m, c):
        """The request in execution: its fields, its buffer's entry and the word it names."""
        p, s1, sbits = c.p, c.s1, c.sbits
        c.e = e = c.bt_r.data
        c.op = op = s1.op
        c.op_raw = op.as_value()
        c.slot = s1.ref.buf[:sbits]
        gen = s1.ref.buf[sbits:]
        c.ref_ok = (s1.ref.mu == self.mu_id) & e.live & (e.gen == gen)
        c.is_append = is_append = op == MUOp.APPEND
        c.is_rmw = (op == MUOp.FETCH_ADD) | (op == MUOp.UNLOCK)
        idx = Signal(p.index_bits + 1)
        m.d.comb += idx.eq(Mux(is_append, e.length, s1.index))
        c.idx = idx
        c.new_len = Mux(idx + 1 > e.length, idx + 1, e.length)
        c.extends = idx >= e.length
        c.weight = s1.data
        c.outstanding = e.total - e.collected
        c.max_w = p.max_weight

    def _placement(self, m, c):
        """Where the word at ``idx`` lies for WRITE/APPEND/READ, per allocation mode: the
        scratchpad address, whether it is mapped, and whether storing it needs a new block
        (``virtual``) or a larger region (``reserve``)."""
        p, e, idx, ob = c.p, c.e, c.idx, c.ob
        need_block = Signal()      # virtual: a block must be taken from the free list
        phys_block = Signal(p.block_bits)
        mapped = Signal()          # the word lies in a mapped block (else a READ gives 0)
        addr = Signal(p.addr_bits)
        grow = Signal()            # reserve: the buffer must move to a larger region
        new_order = Signal(range(p.n_orders + 1))
        grow_ok = Signal()
        grow_base = Signal(p.addr_bits)
        c.need_block, c.phys_block, c.mapped, c.addr = need_block, phys_block, mapped, addr
        c.grow, c.new_order, c.grow_ok, c.grow_base = grow, new_order, grow_ok, grow_base
        if c.virtual:
            blocks = c.blocks
            m.d.comb += mapped.eq(e.mapped.bit_select(idx[ob:ob + c.vbits], 1))
            with m.If(c.is_append):
                m.d.comb += [
                    need_block.eq(e.length[:ob] == 0),
                    phys_block.eq(Mux(need_block, blocks.head, e.tail)),
                ]
            with m.Else():
                m.d.comb += [
                    need_block.eq(~mapped),
                    phys_block.eq(Mux(need_block, blocks.head, c.bk.entry)),
                ]
            m.d.comb += addr.eq(Cat(idx[:ob], phys_block))
        elif c.reserve:
            rb = exact_log2(p.reserve_words)
            capacity = Const(p.reserve_words, p.length_bits) << e.order
            m.d.comb += [
                grow.eq(idx >= capacity),
                mapped.eq(1),
                addr.eq(e.base + idx),
            ]
            # Smallest class whose capacity exceeds idx: the bit length of idx >> rb.
            q = idx >> rb
            for k in range(p.n_orders):
                with m.If(q >= (1 << k) if k else q != 0):
                    m.d.comb += new_order.eq(k + 1)
            c.size = size = Const(p.reserve_words, p.addr_bits + 1) << new_order
            region_avail = Signal()
            region_head = Signal(p.addr_bits)
            for k, fl in enumerate(c.regions):
                with m.If(new_order == k):
                    m.d.comb += [region_avail.eq(~fl.empty), region_head.eq(fl.head)]
            m.d.comb += [
                grow_ok.eq(region_avail | (c.bump + size <= p.words)),
                grow_base.eq(Mux(region_avail, region_head, c.bump)),
            ]
        else:
            m.d.comb += [mapped.eq(1), addr.eq(idx)]

    def _checks(self, m, c):
        """The status of the request in execution (the checks in the order of the docs), and
        whether it frees its buffer."""
        p, e, op, s1, weight = c.p, c.e, c.op, c.s1, c.weight
        is_append, max_w = c.is_append, c.max_w
        status = Signal(MUStatus)
        c.status = status
        c.known = known = c.op_raw < len(MUOp)
        with m.If(~known):
            m.d.comb += status.eq(MUStatus.BAD_REQUEST)
        with m.Elif((op == MUOp.INCREF) | (op == MUOp.DECREF) if c.weighted
                    else (op == MUOp.RETURN) | (op == MUOp.ADD_WEIGHT)):
            m.d.comb += status.eq(MUStatus.BAD_REQUEST)
        with m.Elif(op == MUOp.ALLOC):
            # Nothing here depends on the slot's entry, which ALLOC reads in its second cycle:
            # a refused ALLOC is answered in one execute cycle like every error.
            with m.If(weight == 0):
                m.d.comb += status.eq(MUStatus.BAD_REQUEST)
            with m.Elif(weight > max_w):
                m.d.comb += status.eq(MUStatus.WEIGHT_OVERFLOW)
            with m.Elif(c.slots.empty | (c.live != 0 if c.single else Const(0))):
                m.d.comb += status.eq(MUStatus.OUT_OF_MEMORY)
            if c.reserve:
                first = c.regions[0]
                with m.Elif(first.empty & (c.bump + p.reserve_words > p.words)):
                    m.d.comb += status.eq(MUStatus.OUT_OF_MEMORY)
        with m.Elif(~c.ref_ok):
            m.d.comb += status.eq(MUStatus.BAD_REF)
        with m.Elif((op == MUOp.WRITE) | is_append):
            with m.If(is_append & (e.length == p.max_buffer_words)):
                m.d.comb += status.eq(MUStatus.OUT_OF_RANGE)
            with m.Elif(~is_append & (s1.index >= p.max_buffer_words)):
                m.d.comb += status.eq(MUStatus.OUT_OF_RANGE)
            if c.virtual:
                with m.Elif(c.need_block & c.blocks.empty):
                    m.d.comb += status.eq(MUStatus.OUT_OF_MEMORY)
            if c.reserve:
                with m.Elif(c.grow & ~c.grow_ok):
                    m.d.comb += status.eq(MUStatus.OUT_OF_MEMORY)
        with m.Elif(op == MUOp.READ):
            with m.If(s1.index >= e.length):
                m.d.comb += status.eq(MUStatus.OUT_OF_RANGE)
        with m.Elif(c.is_rmw):
            with m.If((s1.index >= e.length) | ~c.mapped):
                m.d.comb += status.eq(MUStatus.OUT_OF_RANGE)
        with m.Elif(op == MUOp.RETURN):
            with m.If(weight == 0):
                m.d.comb += status.eq(MUStatus.BAD_REQUEST)
            with m.Elif(self._return_overflows(c)):
                m.d.comb += status.eq(MUStatus.WEIGHT_OVERFLOW)
        with m.Elif(op == MUOp.ADD_WEIGHT):
            with m.If(weight == 0):
                m.d.comb += status.eq(MUStatus.BAD_REQUEST)
            with m.Elif(weight + e.total > max_w):
                m.d.comb += status.eq(MUStatus.WEIGHT_OVERFLOW)
        with m.Elif(op == MUOp.INCREF):
            with m.If(e.total == max_w):
                m.d.comb += status.eq(MUStatus.WEIGHT_OVERFLOW)
        c.ok = ok = status == MUStatus.OK

        frees_now = Signal()
        c.frees_now = frees_now
        with m.If(ok & (op == MUOp.RETURN)):
            m.d.comb += frees_now.eq(self._return_frees(c))
        with m.If(ok & (op == MUOp.DECREF)):
            m.d.comb += frees_now.eq(e.total == 1)

    # --- Steps the formal harnesses' broken variants override -------------------------------

    def _return_overflows(self, c):
        """Whether a ``RETURN`` of nonzero weight is refused: more than is outstanding."""
        # (`& True` and `& ~Const(0)` below change no logic; they keep the numbering of the
        # generated Verilog's wires as it was when these steps were inline. Drop them when the
        # golden Verilog in the layout checks is next regenerated.)
        return (c.weight > c.outstanding) & True

    def _return_frees(self, c):
        """Whether an accepted ``RETURN`` frees its buffer: it returns all that is
        outstanding."""
        return c.weight == c.outstanding

    def _records_tail(self, c):
        """Whether a ``WRITE``/``APPEND`` records its block as the buffer's tail (``virtual``):
        it writes at or past the length."""
        return c.extends & ~Const(0)

    def _fetch_add(self, c, old):
        """The word a ``FETCH_ADD`` writes back, given the ``old`` word."""
        return old + c.s1.data

    def _answer_len(self, m, c):
        """Answer an accepted ``LEN``: the buffer's length."""
        self._respond(m, c, data=c.e.length)

    def _refuse(self, m, c):
        """Answer a refused request (its status is the error): nothing changes."""
        self._respond(m, c, data=0)

    def _walk_releases(self, c):
        """Whether the free walk releases the block of virtual block ``walk_prev`` (whose
        block-table entry is on the lookup port): it was looked up, and it is mapped."""
        return c.walk_pending & c.saved_entry.mapped.bit_select(c.walk_prev[:c.vbits], 1)

    # --- Execute stage: state machine --------------------------------------------------------

    def _execute_registers(self, m, c):
        """The response every way out of the execute stage shares, the occupancy and
        counters, and the saved state of multi-cycle operations."""
        p, s1 = c.p, c.s1
        resp_next = Signal(c.resp_layout)
        c.resp_next = resp_next
        m.d.comb += [
            resp_next.op.eq(s1.op),
            resp_next.dst.eq(s1.src),
            resp_next.tag.eq(s1.tag),
            resp_next.ref.eq(s1.ref),
            resp_next.status.eq(c.status),
        ]

        held = Signal.like(self.held_words)
        held_next = Signal.like(self.held_words)
        m.d.comb += [self.held_words.eq(held), held_next.eq(held)]
        m.d.sync += held.eq(held_next)
        with m.If(held > self.peak_held_words):
            m.d.sync += self.peak_held_words.eq(held)
        c.held, c.held_next = held, held_next

        # Saved state of multi-cycle operations.
        walk_vb = Signal(c.vbits + 1)      # next virtual block to read
        walk_n = Signal(c.vbits + 1)       # virtual blocks to visit
        walk_pending = Signal()            # a block-table read was issued last cycle
        walk_prev = Signal(c.vbits + 1)
        saved_entry = Signal(c.entry_layout)
        copy_i = Signal(p.length_bits + 1)
        copy_src = Signal(p.addr_bits)
        copy_dst = Signal(p.addr_bits)
        grow_order = Signal.like(c.new_order)
        init_i = Signal(range(p.max_buffers + 1))
        rmw_addr = Signal(p.addr_bits)
        c.walk_vb, c.walk_n, c.walk_pending, c.walk_prev = walk_vb, walk_n, walk_pending, walk_prev
        c.saved_entry, c.copy_i, c.copy_src, c.copy_dst = saved_entry, copy_i, copy_src, copy_dst
        c.grow_order, c.init_i, c.rmw_addr = grow_order, init_i, rmw_addr

        with m.If(c.s1_valid):
            m.d.sync += self.busy_cycles.eq(self.busy_cycles + 1)

        e_next = Signal(c.entry_layout)
        m.d.comb += e_next.eq(c.e)
        c.e_next = e_next

    def _respond(self, m, c, *, data=0, from_scratch=False, fields=()):
        """Move the request in execution to the response register, with ``data``."""
        m.d.comb += c.s1_done.eq(1)
        m.d.sync += [c.s2_valid.eq(1), c.s2.eq(c.resp_next), c.s2.data.eq(data),
                     c.s2_from_scratch.eq(from_scratch), *fields]

    def _init_state(self, m, c):
        # Clear the buffer table after reset, one slot a cycle, so that no stale entry survives
        # a reset: no slot is live, every generation is 0 and (virtual) no block is mapped, so
        # the block table needs no clearing.
        p, bt_w, init_i = c.p, c.bt_w, c.init_i
        m.d.comb += [bt_w.addr.eq(init_i), bt_w.en.eq(init_i < p.max_buffers),
                     bt_w.data.eq(0)]
        with m.If(init_i < p.max_buffers):
            m.d.sync += init_i.eq(init_i + 1)
        with m.Else():
            m.next = "EXEC"

    def _exec_state(self, m, c):
        # Execute the request in s1 once the response register is free: single-cycle
        # operations answer now; the others start their multi-cycle state.
        p, e, op, ok, slot, is_append = c.p, c.e, c.op, c.ok, c.slot, c.is_append
        sp_r = c.sp_r
        m.d.comb += c.init_done.eq(1)
        with m.If(c.s1_valid & c.s2_free):
            with m.If(c.known & (op == MUOp.ALLOC) & (c.status == MUStatus.OK)):
                # First cycle: read the entry of the slot the free list offers.
                m.d.comb += [c.bt_r.addr.eq(c.slots.head), c.bt_r.en.eq(1)]
                m.next = "ALLOC"
            with m.Elif(c.frees_now):
                m.d.sync += [c.saved_entry.eq(e), c.saved_entry.collected.eq(e.total)]
                if c.virtual:
                    bk = c.bk
                    nvb = (e.length + (p.block_words - 1)) >> c.ob
                    m.d.sync += [c.walk_n.eq(nvb), c.walk_vb.eq(1),
                                 c.walk_pending.eq(nvb != 0), c.walk_prev.eq(0)]
                    m.d.comb += [bk.lookup_slot.eq(slot), bk.lookup_vblock.eq(0),
                                 bk.lookup_en.eq(1)]
                    m.next = "FREE_WALK"
                else:
                    m.next = "FREE_END"
            if c.reserve:
                with m.Elif(c.grow & ok & ((op == MUOp.WRITE) | is_append)):
                    self._start_growth(m, c)
                    m.next = "COPY"
            with m.Elif(ok & ((op == MUOp.WRITE) | is_append)):
                self._exec_write(m, c)
            with m.Elif(ok & (op == MUOp.READ)):
                m.d.comb += [sp_r.addr.eq(c.addr), sp_r.en.eq(1)]
                self._respond(m, c, data=0, from_scratch=c.mapped)
            with m.Elif(ok & c.is_rmw):
                # Read-modify-write: read the word now, write it in RMW.
                m.d.comb += [sp_r.addr.eq(c.addr), sp_r.en.eq(1)]
                m.d.sync += c.rmw_addr.eq(c.addr)
                m.next = "RMW"
            with m.Elif(ok & (op == MUOp.LEN)):
                self._answer_len(m, c)
            with m.Elif(ok & (op == MUOp.RETURN)):
                m.d.comb += [c.e_next.collected.eq(e.collected + c.weight),
                             c.bt_w.addr.eq(slot), c.bt_w.data.eq(c.e_next), c.bt_w.en.eq(1)]
                self._respond(m, c, data=c.outstanding - c.weight)
            with m.Elif(ok & ((op == MUOp.ADD_WEIGHT) | (op == MUOp.INCREF)
                              | (op == MUOp.DECREF))):
                total = Mux(op == MUOp.ADD_WEIGHT, e.total + c.weight,
                            Mux(op == MUOp.INCREF, e.total + 1, e.total - 1))
                m.d.comb += [c.e_next.total.eq(total),
                             c.bt_w.addr.eq(slot), c.bt_w.data.eq(c.e_next), c.bt_w.en.eq(1)]
                self._respond(m, c, data=total)
            with m.Else():
                self._refuse(m, c)

    def _exec_write(self, m, c):
        # WRITE/APPEND that passed its checks and needs no growth: store the word, extend the
        # length and (virtual) map a new block.
        p, e_next, bt_w = c.p, c.e_next, c.bt_w
        m.d.comb += [c.sp_w.addr.eq(c.addr), c.sp_w.data.eq(c.s1.data), c.sp_w.en.eq(1),
                     e_next.length.eq(c.new_len)]
        if c.virtual:
            bk, blocks, ob = c.bk, c.blocks, c.ob
            vb = c.idx[ob:ob + c.vbits]
            with m.If(c.need_block):
                m.d.comb += [
                    blocks.pop.eq(1),
                    bk.write_slot.eq(c.slot),
                    bk.write_vblock.eq(vb),
                    bk.write_block.eq(blocks.head),
                    bk.write_en.eq(1),
                    e_next.mapped.eq(c.e.mapped | (Const(1, p.max_vblocks) << vb)),
                    c.held_next.eq(c.held + p.block_words),
                ]
            with m.If(self._records_tail(c)):
                m.d.comb += e_next.tail.eq(c.phys_block)
        m.d.comb += [bt_w.addr.eq(c.slot), bt_w.data.eq(e_next), bt_w.en.eq(1)]
        self._respond(m, c, data=c.idx)

    def _rmw_state(self, m, c):
        # The old word is on the scratchpad read port: FETCH_ADD adds, UNLOCK bumps the
        # serving ticket if the requester holds it.
        op, sp_r, sp_w, s1 = c.op, c.sp_r, c.sp_w, c.s1
        old = sp_r.data
        owner = old == s1.data
        m.d.comb += sp_r.en.eq(0)     # hold the old word
        with m.If((op == MUOp.UNLOCK) & ~owner):
            m.d.comb += c.resp_next.status.eq(MUStatus.NOT_OWNER)
        with m.If(c.s2_free):
            m.next = "EXEC"
            with m.If(op == MUOp.FETCH_ADD):
                added = self._fetch_add(c, old)
                m.d.comb += [sp_w.addr.eq(c.rmw_addr), sp_w.data.eq(added), sp_w.en.eq(1)]
                self._respond(m, c, data=old)
            with m.Elif(owner):
                m.d.comb += [sp_w.addr.eq(c.rmw_addr), sp_w.data.eq(old + 1), sp_w.en.eq(1)]
                self._respond(m, c, data=old)
            with m.Else():
                self._respond(m, c, data=0)

    def _alloc_state(self, m, c):
        # An ALLOC that passed its checks (in EXEC, on state that has not changed since): the
        # entry of the slot to take is on the read port now. The new entry is all zero (no
        # length, no weight collected, no block mapped) but for live, generation and weight.
        p, e, weight, slots, bt_w = c.p, c.e, c.weight, c.slots, c.bt_w
        single, reserve, held = c.single, c.reserve, c.held
        m.d.comb += c.resp_next.status.eq(MUStatus.OK)
        with m.If(c.s2_free):
            m.next = "EXEC"
            new = Signal(c.entry_layout)
            m.d.comb += [
                new.live.eq(1),
                new.gen.eq(e.gen),
                new.total.eq(weight),
                bt_w.addr.eq(slots.head), bt_w.data.eq(new), bt_w.en.eq(1),
                slots.pop.eq(1),
            ]
            held_alloc = p.words if single else (p.reserve_words if reserve else 0)
            if reserve:
                first = c.regions[0]
                with m.If(~first.empty):
                    m.d.comb += [first.pop.eq(1), new.base.eq(first.head)]
                with m.Else():
                    m.d.comb += new.base.eq(c.bump)
                    m.d.sync += c.bump.eq(c.bump + p.reserve_words)
            if held_alloc:
                m.d.comb += c.held_next.eq(held + held_alloc)
            m.d.sync += [c.live.eq(c.live + 1), self.allocs.eq(self.allocs + 1)]
            self._respond(m, c, data=weight, fields=[
                c.s2.ref.mu.eq(self.mu_id),
                c.s2.ref.buf.eq(Cat(slots.head[:c.sbits], e.gen)),
            ])

    def _free_walk_state(self, m, c):
        # Read the entry of virtual block walk_vb while releasing walk_prev's block if it is
        # mapped. The mapped bits go with the whole entry in FREE_END.
        bk, blocks = c.bk, c.blocks
        walk_vb, walk_n = c.walk_vb, c.walk_n
        with m.If(walk_vb < walk_n):
            m.d.comb += [bk.lookup_slot.eq(c.slot),
                         bk.lookup_vblock.eq(walk_vb[:c.vbits]),
                         bk.lookup_en.eq(1)]
            m.d.sync += [walk_vb.eq(walk_vb + 1), c.walk_prev.eq(walk_vb)]
        m.d.sync += c.walk_pending.eq(walk_vb < walk_n)
        with m.If(self._walk_releases(c)):
            m.d.comb += [blocks.push.eq(1), blocks.push_data.eq(bk.entry),
                         c.held_next.eq(c.held - c.p.block_words)]
        with m.If(walk_vb >= walk_n):
            m.next = "FREE_END"

    def _free_end_state(self, m, c):
        # Release the slot (with the next generation) and, per mode, the buffer's storage.
        p, saved_entry, held, held_next = c.p, c.saved_entry, c.held, c.held_next
        with m.If(c.s2_free):
            freed = Signal(c.entry_layout)
            m.d.comb += [
                freed.gen.eq(saved_entry.gen + 1),
                c.bt_w.addr.eq(c.slot), c.bt_w.data.eq(freed), c.bt_w.en.eq(1),
                c.slots.push.eq(1), c.slots.push_data.eq(c.slot),
            ]
            if c.reserve:
                for k, fl in enumerate(c.regions):
                    with m.If(saved_entry.order == k):
                        m.d.comb += [fl.push.eq(1), fl.push_data.eq(saved_entry.base)]
                m.d.comb += held_next.eq(
                    held - (Const(p.reserve_words, held.shape()) << saved_entry.order))
            if c.single:
                m.d.comb += held_next.eq(held - p.words)
            m.d.sync += [c.live.eq(c.live - 1), self.frees.eq(self.frees + 1)]
            m.d.comb += c.resp_next.status.eq(MUStatus.OK)
            self._respond(m, c, data=0)
            m.next = "EXEC"

    def _copy_state(self, m, c):
        # Read word i of the old region while writing word i - 1 to the new one.
        # The first cycle only reads (the read port's latency); copy_cycles counts the cycles
        # that copy a word, so it is the number of words copied.
        sp_r, sp_w, copy_i = c.sp_r, c.sp_w, c.copy_i
        length = c.e.length
        with m.If(copy_i < length):
            m.d.comb += [sp_r.addr.eq(c.copy_src + copy_i), sp_r.en.eq(1)]
        with m.If(copy_i != 0):
            m.d.comb += [sp_w.addr.eq(c.copy_dst + copy_i - 1), sp_w.data.eq(sp_r.data),
                         sp_w.en.eq(1)]
            m.d.sync += self.copy_cycles.eq(self.copy_cycles + 1)
        m.d.sync += copy_i.eq(copy_i + 1)
        with m.If(copy_i >= length):
            m.next = "COPY_END"

    def _copy_end_state(self, m, c):
        e, copy_dst = c.e, c.copy_dst
        with m.If(c.s2_free):
            # Release the old region, move the buffer, then do the write.
            for k, fl in enumerate(c.regions):
                with m.If(e.order == k):
                    m.d.comb += [fl.push.eq(1), fl.push_data.eq(e.base)]
            grown = Signal(c.entry_layout)
            m.d.comb += [
                grown.eq(e),
                grown.base.eq(copy_dst),
                grown.order.eq(c.grow_order),
                grown.length.eq(c.new_len),
                c.bt_w.addr.eq(c.slot), c.bt_w.data.eq(grown), c.bt_w.en.eq(1),
                c.sp_w.addr.eq(copy_dst + c.idx), c.sp_w.data.eq(c.s1.data), c.sp_w.en.eq(1),
            ]
            # The checks passed when the growth started; they would not now.
            m.d.comb += c.resp_next.status.eq(MUStatus.OK)
            self._respond(m, c, data=c.idx)
            m.next = "EXEC"

    def _drive_observation(self, m, c, fsm):
        """Drive ``obs`` (``_observe=True``) from the internal state."""
        obs = self.obs
        for k, state in enumerate(MU_STATES):
            if state in fsm.encoding:
                with m.If(fsm.ongoing(state)):
                    m.d.comb += obs.state.eq(k)
        for k, word in enumerate(obs.scratch):
            port = c.scratch.read_port(domain="comb")
            m.d.comb += [port.addr.eq(k), word.eq(port.data)]
        for k, ent in enumerate(obs.buftab):
            port = c.buftab.read_port(domain="comb")
            m.d.comb += [port.addr.eq(k), ent.eq(port.data)]
        m.d.comb += [
            obs.s1_valid.eq(c.s1_valid), obs.s1.eq(c.s1), obs.s2_valid.eq(c.s2_valid),
            obs.s2.eq(c.s2), obs.s2_from_scratch.eq(c.s2_from_scratch), obs.entry.eq(c.e),
            obs.saved.eq(c.saved_entry), obs.walk_vb.eq(c.walk_vb), obs.walk_n.eq(c.walk_n),
            obs.walk_pending.eq(c.walk_pending), obs.walk_prev.eq(c.walk_prev),
            obs.init_i.eq(c.init_i), obs.live.eq(c.live), obs.status.eq(c.status),
            obs.frees_now.eq(c.frees_now), obs.done.eq(c.s1_done),
            obs.done_status.eq(c.resp_next.status), obs.idx.eq(c.idx), obs.addr.eq(c.addr),
            obs.mapped.eq(c.mapped), obs.rmw_addr.eq(c.rmw_addr), obs.rmw_old.eq(c.sp_r.data),
        ]

    @staticmethod
    def _observation(p):
        """Signals that show the internal state to the formal harnesses (``_observe=True``)."""
        entry = buffer_entry_layout(p)
        sig = Signal
        return SimpleNamespace(
            state=sig(range(len(MU_STATES))),
            s1_valid=sig(), s1=sig(mu_request_layout(p)),
            s2_valid=sig(), s2=sig(mu_response_layout(p)), s2_from_scratch=sig(),
            entry=sig(entry),                   # the buffer-table read port's output
            buftab=[sig(entry, name=f"obs_buf_{k}") for k in range(p.max_buffers)],
            scratch=[sig(p.data_bits, name=f"obs_word_{k}") for k in range(p.words)],
            saved=sig(entry),
            walk_vb=sig(p.vblock_bits + 1), walk_n=sig(p.vblock_bits + 1),
            walk_pending=sig(), walk_prev=sig(p.vblock_bits + 1),
            init_i=sig(range(p.max_buffers + 1)),
            live=sig(range(p.max_buffers + 1)),
            status=sig(MUStatus), frees_now=sig(),
            done=sig(), done_status=sig(MUStatus),   # a response is produced, its status
            idx=sig(p.index_bits + 1), addr=sig(p.addr_bits), mapped=sig(),
            rmw_addr=sig(p.addr_bits), rmw_old=sig(p.data_bits),   # RMW: the word, its value
            slots=FreeList(p.max_buffers, _observe=True),
            blocks=(FreeList(p.n_blocks, _observe=True)
                    if p.alloc_mode is AllocMode.VIRTUAL else None),
            blocktab=BlockTable(p, _observe=True) if p.alloc_mode is AllocMode.VIRTUAL else None,
        )

    def _start_growth(self, m, c):
        # Take the new region now; the copy follows, then COPY_END writes the tables.
        p, e, held, new_order = c.p, c.e, c.held, c.new_order
        region_taken = Signal()
        for k, fl in enumerate(c.regions):
            with m.If((new_order == k) & ~fl.empty):
                m.d.comb += [fl.pop.eq(1), region_taken.eq(1)]
        with m.If(~region_taken):
            m.d.sync += c.bump.eq(c.bump + c.size)
        old_cap = Const(p.reserve_words, held.shape()) << e.order
        m.d.comb += c.held_next.eq(held + c.size - old_cap)
        m.d.sync += [c.copy_i.eq(0), c.copy_src.eq(e.base), c.copy_dst.eq(c.grow_base),
                     c.grow_order.eq(new_order)]
