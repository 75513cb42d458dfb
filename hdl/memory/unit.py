"""The memory unit (MU): buffer-level virtualization and partial-free, with the paper's baselines.

See ``docs/memory-unit.md`` for the specification (operations, checks in order, allocation
policy, timing); :class:`rdakit.sim.models.mu.MUModel` is its golden model.
"""

from amaranth.hdl import Cat, Const, Module, Mux, Signal, unsigned
from amaranth.lib import data, memory, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from rdakit.hdl.memory.block_table import BlockTable
from rdakit.hdl.memory.free_list import FreeList
from rdakit.hdl.spec.packets import MUOp, MUStatus, mu_request_layout, mu_response_layout
from rdakit.hdl.spec.params import AllocMode, MUParams, RefcountMode

__all__ = ["MemoryUnit", "COUNTER_WIDTH", "buffer_entry_layout", "MU_FAULTS", "MU_STATES"]

#: States of the memory unit's control FSM (``obs.state`` is the index in this tuple).
MU_STATES = ("INIT", "EXEC", "RMW", "ALLOC", "FREE_WALK", "FREE_END", "COPY", "COPY_END")

#: Deliberate bugs for the formal harnesses' self-test (``_fault=``), never for real designs:
#:
#: ``"walk_keeps_entry"``
#:     Freeing a buffer pushes its blocks onto the free list but leaves them mapped.
#: ``"blocks_pop_keeps"``
#:     The block free list leaves a popped block on its stack (handed out twice).
#: ``"return_no_overflow"``
#:     ``RETURN`` of more weight than outstanding is applied instead of refused.
#: ``"return_frees_early"``
#:     ``RETURN`` frees the buffer when one unit of weight is still outstanding.
#: ``"error_writes"``
#:     A ``WRITE`` refused as out of range still updates the buffer's length.
#: ``"len_no_response"``
#:     ``LEN`` completes without a response.
#: ``"append_no_tail"``
#:     ``APPEND`` into a new block does not record it as the buffer's tail.
#: ``"fetch_add_stale"``
#:     ``FETCH_ADD`` answers the old word but writes it back unchanged.
MU_FAULTS = ("walk_keeps_entry", "blocks_pop_keeps", "return_no_overflow", "return_frees_early",
             "error_writes", "len_no_response", "append_no_tail", "fetch_add_stale")

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
        Requests. After reset the unit clears its tables (one entry per cycle, the larger of
        ``max_buffers`` and ``max_buffers * max_vblocks`` cycles) before it raises ``ready``.
    resp : Out(stream.Signature(mu_response_layout(params)))
        Exactly one response per request, in request order, two cycles after acceptance at the
        earliest.
    held_words, peak_held_words, live_buffers, free_blocks, free_slots : Out
        Occupancy: words held for live buffers (see the docs for each mode), their peak since
        reset, live buffers, free physical blocks (``virtual``) and free buffer slots.
    allocs, frees, copy_cycles, busy_cycles : Out(32)
        Event counters: successful allocations, buffers freed, cycles spent copying
        (``reserve`` growth), cycles with a request in execution.

    Raises
    ------
    TypeError
        If ``params`` is not an :class:`MUParams` or ``mu_id`` does not fit ``mu_id_bits``.

    Notes
    -----
    Two private, test-only arguments serve the formal proofs (``rdakit.sim.verify.formal_harness``):
    ``_observe=True`` adds a member ``obs`` whose signals show the internal state (pipeline
    registers, FSM state, every entry of the buffer table, block table, free lists and
    scratchpad, see :meth:`_observation`); ``_fault`` injects one of :data:`MU_FAULTS`.
    """

    def __init__(self, params=None, *, mu_id=0, _observe=False, _fault=None):
        if params is None:
            params = MUParams()
        if not isinstance(params, MUParams):
            raise TypeError(f"Params must be an MUParams, not {params!r}")
        if not isinstance(mu_id, int) or not 0 <= mu_id < (1 << params.mu_id_bits):
            raise TypeError(f"MU ID must be an integer from 0 to {(1 << params.mu_id_bits) - 1} "
                            f"(mu_id_bits = {params.mu_id_bits}), not {mu_id!r}")
        if _fault is not None and _fault not in MU_FAULTS:
            raise TypeError(f"Fault must be one of {', '.join(map(repr, MU_FAULTS))}, "
                            f"not {_fault!r}")
        self.params = params
        self.mu_id = mu_id
        self._fault = _fault
        self.obs = self._observation(params, _fault) if _observe else None
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
        p = self.params
        m = Module()
        virtual = p.alloc_mode is AllocMode.VIRTUAL
        reserve = p.alloc_mode is AllocMode.RESERVE
        single = p.alloc_mode is AllocMode.SINGLE
        weighted = p.refcount is RefcountMode.WEIGHTED
        ob = p.offset_bits
        vbits = exact_log2(p.max_vblocks)
        sbits = p.slot_bits

        # --- Storage ------------------------------------------------------------------------
        entry_layout = buffer_entry_layout(p)
        m.submodules.buftab = buftab = memory.Memory(shape=entry_layout, depth=p.max_buffers,
                                                     init=[])
        bt_w = buftab.write_port()
        bt_r = buftab.read_port(transparent_for=(bt_w,))

        m.submodules.scratch = scratch = memory.Memory(shape=unsigned(p.data_bits),
                                                       depth=p.words, init=[])
        sp_w = scratch.write_port()
        sp_r = scratch.read_port()

        obs = self.obs
        fault = self._fault
        m.submodules.slots = slots = obs.slots if obs else FreeList(p.max_buffers)
        m.d.comb += self.free_slots.eq(slots.count)

        if virtual:
            m.submodules.blocktab = bk = obs.blocktab if obs else BlockTable(p)
            m.submodules.blocks = blocks = (
                obs.blocks if obs else
                FreeList(p.n_blocks, _fault="pop_keeps" if fault == "blocks_pop_keeps" else None))
            m.d.comb += self.free_blocks.eq(blocks.count)
        if reserve:
            regions = []
            for k in range(p.n_orders):
                fl = FreeList(p.words // (p.reserve_words << k), width=p.addr_bits, fresh=False)
                m.submodules[f"regions{k}"] = fl
                regions.append(fl)
            bump = Signal(range(p.words + 1))

        # --- Pipeline registers ----------------------------------------------------------------
        req_layout = mu_request_layout(p)
        resp_layout = mu_response_layout(p)
        s1_valid = Signal()
        s1 = Signal(req_layout)
        s2_valid = Signal()
        s2 = Signal(resp_layout)
        s2_from_scratch = Signal()   # response data is the scratchpad read port's output

        s2_free = ~s2_valid | self.resp.ready
        s1_done = Signal()           # the request in execution moves to the response register
        accept = Signal()
        init_done = Signal()

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
        in_slot = self.req.payload.ref.buf[:sbits]
        m.d.comb += [bt_r.addr.eq(in_slot), bt_r.en.eq(accept)]
        if virtual:
            in_vb = self.req.payload.index[ob:ob + vbits]
            m.d.comb += [bk.lookup_slot.eq(in_slot), bk.lookup_vblock.eq(in_vb),
                         bk.lookup_en.eq(accept)]

        # --- Execute stage: decode and checks -------------------------------------------------
        e = bt_r.data
        op = s1.op
        op_raw = op.as_value()
        slot = s1.ref.buf[:sbits]
        gen = s1.ref.buf[sbits:]
        ref_ok = (s1.ref.mu == self.mu_id) & e.live & (e.gen == gen)
        is_append = op == MUOp.APPEND
        is_rmw = (op == MUOp.FETCH_ADD) | (op == MUOp.UNLOCK)
        idx = Signal(p.index_bits + 1)
        m.d.comb += idx.eq(Mux(is_append, e.length, s1.index))
        new_len = Mux(idx + 1 > e.length, idx + 1, e.length)
        extends = idx >= e.length
        weight = s1.data
        outstanding = e.total - e.collected
        max_w = p.max_weight

        # Placement of the word at `idx` for WRITE/APPEND/READ, per mode.
        need_block = Signal()      # virtual: a block must be taken from the free list
        phys_block = Signal(p.block_bits)
        mapped = Signal()          # READ: the word lies in a mapped block (else it reads 0)
        addr = Signal(p.addr_bits)
        grow = Signal()            # reserve: the buffer must move to a larger region
        new_order = Signal(range(p.n_orders + 1))
        grow_ok = Signal()
        grow_base = Signal(p.addr_bits)
        if virtual:
            b = bk.entry
            with m.If(is_append):
                m.d.comb += [
                    need_block.eq(e.length[:ob] == 0),
                    phys_block.eq(Mux(need_block, blocks.head, e.tail)),
                ]
            with m.Else():
                m.d.comb += [
                    need_block.eq(~b.valid),
                    phys_block.eq(Mux(need_block, blocks.head, b.block)),
                ]
            m.d.comb += [
                mapped.eq(b.valid),
                addr.eq(Cat(idx[:ob], phys_block)),
            ]
        elif reserve:
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
            size = Const(p.reserve_words, p.addr_bits + 1) << new_order
            region_avail = Signal()
            region_head = Signal(p.addr_bits)
            for k, fl in enumerate(regions):
                with m.If(new_order == k):
                    m.d.comb += [region_avail.eq(~fl.empty), region_head.eq(fl.head)]
            m.d.comb += [
                grow_ok.eq(region_avail | (bump + size <= p.words)),
                grow_base.eq(Mux(region_avail, region_head, bump)),
            ]
        else:
            m.d.comb += [mapped.eq(1), addr.eq(idx)]

        status = Signal(MUStatus)
        known = op_raw < len(MUOp)
        with m.If(~known):
            m.d.comb += status.eq(MUStatus.BAD_REQUEST)
        with m.Elif((op == MUOp.INCREF) | (op == MUOp.DECREF) if weighted
                    else (op == MUOp.RETURN) | (op == MUOp.ADD_WEIGHT)):
            m.d.comb += status.eq(MUStatus.BAD_REQUEST)
        with m.Elif(op == MUOp.ALLOC):
            pass  # checked in its second cycle, once the slot's entry has been read
        with m.Elif(~ref_ok):
            m.d.comb += status.eq(MUStatus.BAD_REF)
        with m.Elif((op == MUOp.WRITE) | is_append):
            with m.If(is_append & (e.length == p.max_buffer_words)):
                m.d.comb += status.eq(MUStatus.OUT_OF_RANGE)
            with m.Elif(~is_append & (s1.index >= p.max_buffer_words)):
                m.d.comb += status.eq(MUStatus.OUT_OF_RANGE)
            if virtual:
                with m.Elif(need_block & blocks.empty):
                    m.d.comb += status.eq(MUStatus.OUT_OF_MEMORY)
            if reserve:
                with m.Elif(grow & ~grow_ok):
                    m.d.comb += status.eq(MUStatus.OUT_OF_MEMORY)
        with m.Elif(op == MUOp.READ):
            with m.If(s1.index >= e.length):
                m.d.comb += status.eq(MUStatus.OUT_OF_RANGE)
        with m.Elif(is_rmw):
            with m.If((s1.index >= e.length) | ~mapped):
                m.d.comb += status.eq(MUStatus.OUT_OF_RANGE)
        with m.Elif(op == MUOp.RETURN):
            with m.If(weight == 0):
                m.d.comb += status.eq(MUStatus.BAD_REQUEST)
            with m.Elif((weight > outstanding) & (fault != "return_no_overflow")):
                m.d.comb += status.eq(MUStatus.WEIGHT_OVERFLOW)
        with m.Elif(op == MUOp.ADD_WEIGHT):
            with m.If(weight == 0):
                m.d.comb += status.eq(MUStatus.BAD_REQUEST)
            with m.Elif(weight + e.total > max_w):
                m.d.comb += status.eq(MUStatus.WEIGHT_OVERFLOW)
        with m.Elif(op == MUOp.INCREF):
            with m.If(e.total == max_w):
                m.d.comb += status.eq(MUStatus.WEIGHT_OVERFLOW)
        ok = status == MUStatus.OK

        frees_now = Signal()
        with m.If(ok & (op == MUOp.RETURN)):
            if fault == "return_frees_early":
                m.d.comb += frees_now.eq(weight + 1 == outstanding)
            else:
                m.d.comb += frees_now.eq(weight == outstanding)
        with m.If(ok & (op == MUOp.DECREF)):
            m.d.comb += frees_now.eq(e.total == 1)

        # --- Execute stage: state machine ----------------------------------------------------
        # Response fields shared by every way out of the execute stage.
        resp_next = Signal(resp_layout)
        m.d.comb += [
            resp_next.op.eq(s1.op),
            resp_next.dst.eq(s1.src),
            resp_next.tag.eq(s1.tag),
            resp_next.ref.eq(s1.ref),
            resp_next.status.eq(status),
        ]

        def respond(*, data=0, from_scratch=False, fields=()):
            m.d.comb += s1_done.eq(1)
            m.d.sync += [s2_valid.eq(1), s2.eq(resp_next), s2.data.eq(data),
                         s2_from_scratch.eq(from_scratch), *fields]

        held = Signal.like(self.held_words)
        held_next = Signal.like(self.held_words)
        m.d.comb += [self.held_words.eq(held), held_next.eq(held)]
        m.d.sync += held.eq(held_next)
        with m.If(held > self.peak_held_words):
            m.d.sync += self.peak_held_words.eq(held)
        live = Signal.like(self.live_buffers)
        m.d.comb += self.live_buffers.eq(live)

        # Saved state of multi-cycle operations.
        walk_vb = Signal(vbits + 1)        # next virtual block to read
        walk_n = Signal(vbits + 1)         # virtual blocks to visit
        walk_pending = Signal()            # a block-table read was issued last cycle
        walk_prev = Signal(vbits + 1)
        saved_entry = Signal(entry_layout)
        copy_i = Signal(p.length_bits + 1)
        copy_src = Signal(p.addr_bits)
        copy_dst = Signal(p.addr_bits)
        grow_order = Signal.like(new_order)
        init_i = Signal(range(p.max_buffers + 1))
        rmw_addr = Signal(p.addr_bits)

        with m.If(s1_valid):
            m.d.sync += self.busy_cycles.eq(self.busy_cycles + 1)

        e_next = Signal(entry_layout)
        m.d.comb += e_next.eq(e)

        with m.FSM(init="INIT") as fsm:
            with m.State("INIT"):
                # Clear the buffer table after reset (the block table clears itself) so that
                # no stale entry survives a reset.
                m.d.comb += [bt_w.addr.eq(init_i), bt_w.en.eq(init_i < p.max_buffers),
                             bt_w.data.eq(0)]
                with m.If(init_i < p.max_buffers):
                    m.d.sync += init_i.eq(init_i + 1)
                with m.Elif(bk.ready if virtual else Const(1)):
                    m.next = "EXEC"

            with m.State("EXEC"):
                m.d.comb += init_done.eq(1)
                with m.If(s1_valid & s2_free):
                    with m.If(known & (op == MUOp.ALLOC) & (status == MUStatus.OK)):
                        # First cycle: read the entry of the slot the free list offers.
                        m.d.comb += [bt_r.addr.eq(slots.head), bt_r.en.eq(1)]
                        m.next = "ALLOC"
                    with m.Elif(frees_now):
                        m.d.sync += [saved_entry.eq(e), saved_entry.collected.eq(e.total)]
                        if virtual:
                            nvb = (e.length + (p.block_words - 1)) >> ob
                            m.d.sync += [walk_n.eq(nvb), walk_vb.eq(1),
                                         walk_pending.eq(nvb != 0), walk_prev.eq(0)]
                            m.d.comb += [bk.lookup_slot.eq(slot), bk.lookup_vblock.eq(0),
                                         bk.lookup_en.eq(1)]
                            m.next = "FREE_WALK"
                        else:
                            m.next = "FREE_END"
                    if reserve:
                        with m.Elif(grow & ok & ((op == MUOp.WRITE) | is_append)):
                            self._start_growth(m, p, regions, new_order, bump, size, grow_base,
                                               e, copy_i, copy_src, copy_dst, grow_order,
                                               held_next, held)
                            m.next = "COPY"
                    with m.Elif(ok & ((op == MUOp.WRITE) | is_append)):
                        m.d.comb += [sp_w.addr.eq(addr), sp_w.data.eq(s1.data), sp_w.en.eq(1),
                                     e_next.length.eq(new_len)]
                        if virtual:
                            with m.If(need_block):
                                m.d.comb += [
                                    blocks.pop.eq(1),
                                    bk.write_slot.eq(slot),
                                    bk.write_vblock.eq(idx[ob:ob + vbits]),
                                    bk.write_entry.valid.eq(1),
                                    bk.write_entry.block.eq(blocks.head),
                                    bk.write_en.eq(1),
                                    held_next.eq(held + p.block_words),
                                ]
                            with m.If(extends & ~(is_append if fault == "append_no_tail"
                                                  else Const(0))):
                                m.d.comb += e_next.tail.eq(phys_block)
                        m.d.comb += [bt_w.addr.eq(slot), bt_w.data.eq(e_next), bt_w.en.eq(1)]
                        respond(data=idx)
                    with m.Elif(ok & (op == MUOp.READ)):
                        m.d.comb += [sp_r.addr.eq(addr), sp_r.en.eq(1)]
                        respond(data=0, from_scratch=mapped)
                    with m.Elif(ok & is_rmw):
                        # Read-modify-write: read the word now, write it in RMW.
                        m.d.comb += [sp_r.addr.eq(addr), sp_r.en.eq(1)]
                        m.d.sync += rmw_addr.eq(addr)
                        m.next = "RMW"
                    with m.Elif(ok & (op == MUOp.LEN)):
                        if fault == "len_no_response":
                            m.d.comb += s1_done.eq(1)
                        else:
                            respond(data=e.length)
                    with m.Elif(ok & (op == MUOp.RETURN)):
                        m.d.comb += [e_next.collected.eq(e.collected + weight),
                                     bt_w.addr.eq(slot), bt_w.data.eq(e_next), bt_w.en.eq(1)]
                        respond(data=outstanding - weight)
                    with m.Elif(ok & ((op == MUOp.ADD_WEIGHT) | (op == MUOp.INCREF)
                                      | (op == MUOp.DECREF))):
                        total = Mux(op == MUOp.ADD_WEIGHT, e.total + weight,
                                    Mux(op == MUOp.INCREF, e.total + 1, e.total - 1))
                        m.d.comb += [e_next.total.eq(total),
                                     bt_w.addr.eq(slot), bt_w.data.eq(e_next), bt_w.en.eq(1)]
                        respond(data=total)
                    with m.Else():
                        respond(data=0)   # an error: nothing changes
                        if fault == "error_writes":
                            with m.If((op == MUOp.WRITE) & (status == MUStatus.OUT_OF_RANGE)):
                                m.d.comb += [e_next.length.eq(new_len), bt_w.addr.eq(slot),
                                             bt_w.data.eq(e_next), bt_w.en.eq(1)]

            with m.State("RMW"):
                # The old word is on the scratchpad read port: FETCH_ADD adds, UNLOCK bumps
                # the serving ticket if the requester holds it.
                old = sp_r.data
                owner = old == s1.data
                m.d.comb += sp_r.en.eq(0)     # hold the old word
                with m.If((op == MUOp.UNLOCK) & ~owner):
                    m.d.comb += resp_next.status.eq(MUStatus.NOT_OWNER)
                with m.If(s2_free):
                    m.next = "EXEC"
                    with m.If(op == MUOp.FETCH_ADD):
                        added = old if fault == "fetch_add_stale" else old + s1.data
                        m.d.comb += [sp_w.addr.eq(rmw_addr), sp_w.data.eq(added),
                                     sp_w.en.eq(1)]
                        respond(data=old)
                    with m.Elif(owner):
                        m.d.comb += [sp_w.addr.eq(rmw_addr), sp_w.data.eq(old + 1),
                                     sp_w.en.eq(1)]
                        respond(data=old)
                    with m.Else():
                        respond(data=0)

            with m.State("ALLOC"):
                # The entry of the slot to take is on the read port now.
                alloc_status = Signal(MUStatus)
                with m.If(weight == 0):
                    m.d.comb += alloc_status.eq(MUStatus.BAD_REQUEST)
                with m.Elif(weight > max_w):
                    m.d.comb += alloc_status.eq(MUStatus.WEIGHT_OVERFLOW)
                with m.Elif(slots.empty | (live != 0 if single else Const(0))):
                    m.d.comb += alloc_status.eq(MUStatus.OUT_OF_MEMORY)
                if reserve:
                    first = regions[0]
                    first_ok = ~first.empty | (bump + p.reserve_words <= p.words)
                    with m.Elif(~first_ok):
                        m.d.comb += alloc_status.eq(MUStatus.OUT_OF_MEMORY)
                m.d.comb += resp_next.status.eq(alloc_status)
                with m.If(s2_free):
                    m.next = "EXEC"
                    with m.If(alloc_status == MUStatus.OK):
                        new = Signal(entry_layout)
                        m.d.comb += [
                            new.live.eq(1),
                            new.gen.eq(e.gen),
                            new.total.eq(weight),
                            bt_w.addr.eq(slots.head), bt_w.data.eq(new), bt_w.en.eq(1),
                            slots.pop.eq(1),
                        ]
                        held_alloc = p.words if single else (p.reserve_words if reserve else 0)
                        if reserve:
                            with m.If(~first.empty):
                                m.d.comb += [first.pop.eq(1), new.base.eq(first.head)]
                            with m.Else():
                                m.d.comb += new.base.eq(bump)
                                m.d.sync += bump.eq(bump + p.reserve_words)
                        if held_alloc:
                            m.d.comb += held_next.eq(held + held_alloc)
                        m.d.sync += [live.eq(live + 1), self.allocs.eq(self.allocs + 1)]
                        respond(data=weight, fields=[
                            s2.ref.mu.eq(self.mu_id),
                            s2.ref.buf.eq(Cat(slots.head[:sbits], e.gen)),
                        ])
                    with m.Else():
                        respond(data=0)

            if virtual:
                with m.State("FREE_WALK"):
                    # Read the entry of virtual block walk_vb while releasing walk_prev's.
                    with m.If(walk_vb < walk_n):
                        m.d.comb += [bk.lookup_slot.eq(slot),
                                     bk.lookup_vblock.eq(walk_vb[:vbits]),
                                     bk.lookup_en.eq(1)]
                        m.d.sync += [walk_vb.eq(walk_vb + 1), walk_prev.eq(walk_vb)]
                    m.d.sync += walk_pending.eq(walk_vb < walk_n)
                    with m.If(walk_pending & bk.entry.valid):
                        m.d.comb += [
                            blocks.push.eq(1), blocks.push_data.eq(bk.entry.block),
                            bk.write_slot.eq(slot), bk.write_vblock.eq(walk_prev[:vbits]),
                            bk.write_entry.eq(0), bk.write_en.eq(fault != "walk_keeps_entry"),
                            held_next.eq(held - p.block_words),
                        ]
                    with m.If(walk_vb >= walk_n):
                        m.next = "FREE_END"

            with m.State("FREE_END"):
                with m.If(s2_free):
                    freed = Signal(entry_layout)
                    m.d.comb += [
                        freed.gen.eq(saved_entry.gen + 1),
                        bt_w.addr.eq(slot), bt_w.data.eq(freed), bt_w.en.eq(1),
                        slots.push.eq(1), slots.push_data.eq(slot),
                    ]
                    if reserve:
                        for k, fl in enumerate(regions):
                            with m.If(saved_entry.order == k):
                                m.d.comb += [fl.push.eq(1), fl.push_data.eq(saved_entry.base)]
                        m.d.comb += held_next.eq(
                            held - (Const(p.reserve_words, held.shape()) << saved_entry.order))
                    if single:
                        m.d.comb += held_next.eq(held - p.words)
                    m.d.sync += [live.eq(live - 1), self.frees.eq(self.frees + 1)]
                    m.d.comb += resp_next.status.eq(MUStatus.OK)
                    respond(data=0)
                    m.next = "EXEC"

            if reserve:
                with m.State("COPY"):
                    # Read word i of the old region while writing word i - 1 to the new one.
                    m.d.sync += self.copy_cycles.eq(self.copy_cycles + 1)
                    length = e.length
                    with m.If(copy_i < length):
                        m.d.comb += [sp_r.addr.eq(copy_src + copy_i), sp_r.en.eq(1)]
                    with m.If(copy_i != 0):
                        m.d.comb += [sp_w.addr.eq(copy_dst + copy_i - 1), sp_w.data.eq(sp_r.data),
                                     sp_w.en.eq(1)]
                    m.d.sync += copy_i.eq(copy_i + 1)
                    with m.If(copy_i >= length):
                        m.next = "COPY_END"

                with m.State("COPY_END"):
                    with m.If(s2_free):
                        # Release the old region, move the buffer, then do the write.
                        for k, fl in enumerate(regions):
                            with m.If(e.order == k):
                                m.d.comb += [fl.push.eq(1), fl.push_data.eq(e.base)]
                        grown = Signal(entry_layout)
                        m.d.comb += [
                            grown.eq(e),
                            grown.base.eq(copy_dst),
                            grown.order.eq(grow_order),
                            grown.length.eq(new_len),
                            bt_w.addr.eq(slot), bt_w.data.eq(grown), bt_w.en.eq(1),
                            sp_w.addr.eq(copy_dst + idx), sp_w.data.eq(s1.data), sp_w.en.eq(1),
                        ]
                        # The checks passed when the growth started; they would not now.
                        m.d.comb += resp_next.status.eq(MUStatus.OK)
                        respond(data=idx)
                        m.next = "EXEC"

        unlisted = set(fsm.encoding) - set(MU_STATES)
        if unlisted:      # obs.state and the formal harnesses name states by MU_STATES
            raise AssertionError(f"MU_STATES lacks the FSM states {sorted(unlisted)}")
        if obs:
            for k, state in enumerate(MU_STATES):
                if state in fsm.encoding:
                    with m.If(fsm.ongoing(state)):
                        m.d.comb += obs.state.eq(k)
            for k, word in enumerate(obs.scratch):
                port = scratch.read_port(domain="comb")
                m.d.comb += [port.addr.eq(k), word.eq(port.data)]
            for k, ent in enumerate(obs.buftab):
                port = buftab.read_port(domain="comb")
                m.d.comb += [port.addr.eq(k), ent.eq(port.data)]
            m.d.comb += [
                obs.s1_valid.eq(s1_valid), obs.s1.eq(s1), obs.s2_valid.eq(s2_valid),
                obs.s2.eq(s2), obs.s2_from_scratch.eq(s2_from_scratch), obs.entry.eq(e),
                obs.saved.eq(saved_entry), obs.walk_vb.eq(walk_vb), obs.walk_n.eq(walk_n),
                obs.walk_pending.eq(walk_pending), obs.walk_prev.eq(walk_prev),
                obs.init_i.eq(init_i), obs.live.eq(live), obs.status.eq(status),
                obs.frees_now.eq(frees_now), obs.done.eq(s1_done),
                obs.done_status.eq(resp_next.status), obs.idx.eq(idx), obs.addr.eq(addr),
                obs.mapped.eq(mapped), obs.rmw_addr.eq(rmw_addr), obs.rmw_old.eq(sp_r.data),
            ]
        return m

    @staticmethod
    def _observation(p, fault):
        """Signals that show the internal state to the formal harnesses (``_observe=True``)."""
        import types

        entry = buffer_entry_layout(p)
        sig = Signal
        return types.SimpleNamespace(
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
            blocks=(FreeList(p.n_blocks, _observe=True,
                             _fault="pop_keeps" if fault == "blocks_pop_keeps" else None)
                    if p.alloc_mode is AllocMode.VIRTUAL else None),
            blocktab=BlockTable(p, _observe=True) if p.alloc_mode is AllocMode.VIRTUAL else None,
        )

    @staticmethod
    def _start_growth(m, p, regions, new_order, bump, size, grow_base, e, copy_i, copy_src,
                      copy_dst, grow_order, held_next, held):
        # Take the new region now; the copy follows, then COPY_END writes the tables.
        region_taken = Signal()
        for k, fl in enumerate(regions):
            with m.If((new_order == k) & ~fl.empty):
                m.d.comb += [fl.pop.eq(1), region_taken.eq(1)]
        with m.If(~region_taken):
            m.d.sync += bump.eq(bump + size)
        old_cap = Const(p.reserve_words, held.shape()) << e.order
        m.d.comb += held_next.eq(held + size - old_cap)
        m.d.sync += [copy_i.eq(0), copy_src.eq(e.base), copy_dst.eq(grow_base),
                     grow_order.eq(new_order)]

