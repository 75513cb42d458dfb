"""Formal harnesses of the free list and the memory unit, and their broken variants.

A broken variant is a subclass of the product component that overrides one small step of its
``elaborate`` (see :class:`~rdakit.hdl.memory.unit.MemoryUnit` and
:class:`~rdakit.hdl.memory.free_list.FreeList`); the product classes know nothing of them.
"""

from amaranth.asserts import AnyConst, AnySeq
from amaranth.hdl import Array, Assert, Assume, Cat, Const, Elaboratable, Module, Mux, Signal
from amaranth.utils import exact_log2

from rdakit.hdl.memory.free_list import FreeList
from rdakit.hdl.memory.unit import MU_STATES, MemoryUnit
from rdakit.hdl.spec.packets import MUOp, MUStatus
from rdakit.hdl.spec.params import MUParams
from rdakit.sim.verify.formal_harness.common import popcount, refuses_unknown, variant

__all__ = ["FREE_LIST_DEPTH", "FREE_LIST_VARIANTS", "MU_FORMAL", "MU_PARAMS_TEXT", "MU_VARIANTS",
           "MUHarness", "mu_state", "free_list_exclusive", "mu_blocks", "mu_responses",
           "mu_errors", "mu_weights", "mu_read_write"]


# --- Broken variants ---------------------------------------------------------------------------

class _PopKeepsFreeList(FreeList):
    """``pop_keeps``: a pop from the stack leaves the entry on it, so it is handed out twice."""

    def _pop_stack(self, m, n, n_next):
        pass   # n_next keeps its default, n


#: The free list under proof (``None``) and its broken variants, by name.
FREE_LIST_VARIANTS = {None: FreeList, "pop_keeps": _PopKeepsFreeList}


class _WalkFreesHoles(MemoryUnit):
    """``walk_frees_holes``: freeing a buffer releases the block-table entry of every virtual
    block below its length, mapped or not, so the stale entry of a hole (left by a sparse
    WRITE, or never written since reset) goes onto the free list."""

    def _walk_releases(self, c):
        return c.walk_pending


class _ReturnNoOverflow(MemoryUnit):
    """``return_no_overflow``: ``RETURN`` of more weight than outstanding is applied instead of
    refused."""

    def _return_overflows(self, c):
        return Const(0)


class _ReturnFreesEarly(MemoryUnit):
    """``return_frees_early``: ``RETURN`` frees the buffer when one unit of weight is still
    outstanding."""

    def _return_frees(self, c):
        return c.weight + 1 == c.outstanding


class _ErrorWrites(MemoryUnit):
    """``error_writes``: a ``WRITE`` refused as out of range still updates the buffer's
    length."""

    def _refuse(self, m, c):
        super()._refuse(m, c)
        with m.If((c.op == MUOp.WRITE) & (c.status == MUStatus.OUT_OF_RANGE)):
            m.d.comb += [c.e_next.length.eq(c.new_len), c.bt_w.addr.eq(c.slot),
                         c.bt_w.data.eq(c.e_next), c.bt_w.en.eq(1)]


class _LenNoResponse(MemoryUnit):
    """``len_no_response``: ``LEN`` completes without a response."""

    def _answer_len(self, m, c):
        m.d.comb += c.s1_done.eq(1)


class _AppendNoTail(MemoryUnit):
    """``append_no_tail``: ``APPEND`` into a new block does not record it as the buffer's
    tail."""

    def _records_tail(self, c):
        return c.extends & ~c.is_append


class _FetchAddStale(MemoryUnit):
    """``fetch_add_stale``: ``FETCH_ADD`` answers the old word but writes it back unchanged."""

    def _fetch_add(self, c, old):
        return old


#: The memory unit under proof (``None``) and its broken variants, by name.
MU_VARIANTS = {None: MemoryUnit, "walk_frees_holes": _WalkFreesHoles,
               "return_no_overflow": _ReturnNoOverflow, "return_frees_early": _ReturnFreesEarly,
               "error_writes": _ErrorWrites, "len_no_response": _LenNoResponse,
               "append_no_tail": _AppendNoTail, "fetch_add_stale": _FetchAddStale}


# --- Free list ---------------------------------------------------------------------------------

FREE_LIST_DEPTH = 4


@refuses_unknown(FREE_LIST_VARIANTS)
def free_list_exclusive(fault=None):
    """The free list against an environment that pops when it is not empty and pushes back
    only entries it holds. ``held`` is the environment's set of entries."""
    m = Module()
    depth = FREE_LIST_DEPTH
    m.submodules.dut = fl = variant(FREE_LIST_VARIANTS, fault)(depth, _observe=True)
    held = Signal(depth)
    pop, push, push_data = AnySeq(1), AnySeq(1), AnySeq(fl.width)
    m.d.comb += [fl.pop.eq(pop), fl.push.eq(push), fl.push_data.eq(push_data)]
    with m.If(pop):
        m.d.comb += Assume(~fl.empty)
    with m.If(push):
        m.d.comb += Assume((push_data < depth) & held.bit_select(push_data, 1))

    held_next = Signal(depth)
    m.d.comb += held_next.eq(held)
    for k in range(depth):
        with m.If(push & (push_data == k)):
            m.d.comb += held_next[k].eq(0)
        with m.If(pop & (fl.head == k)):
            m.d.comb += held_next[k].eq(1)
    m.d.sync += held.eq(held_next)

    # Every entry is in exactly one place: held, on the stack, or never taken since reset.
    n, taken = fl.obs_n, fl.obs_taken
    m.d.comb += [Assert(n <= depth), Assert(taken <= depth)]
    for k in range(depth):
        on_stack = Cat(*((n > j) & (fl.obs_stack[j] == k) for j in range(depth)))
        fresh = Const(k) >= taken
        m.d.comb += Assert(popcount([held[k], fresh, *on_stack]) == 1)
    m.d.comb += [
        Assert(fl.count == depth - popcount(held)),
        Assert(fl.empty == (fl.count == 0)),
    ]
    with m.If(~fl.empty):
        m.d.comb += Assert(~held.bit_select(fl.head, 1) & (fl.head < depth))
    return m


# --- Memory unit -------------------------------------------------------------------------------

#: The memory unit under proof: 4 blocks of 2 words, 2 buffer slots of up to 2 virtual blocks,
#: 2-bit weights, one generation bit, 8-bit words; indices reach past the largest buffer.
MU_FORMAL = MUParams(words=8, block_words=2, max_buffers=2, max_buffer_words=4, weight_bits=2,
                     mu_id_bits=1, buf_id_bits=2, index_bits=3, data_bits=8, tag_bits=2,
                     coord_bits=1)

MU_PARAMS_TEXT = ("virtual, weighted; words=8, block_words=2 (4 blocks), max_buffers=2, "
                  "max_buffer_words=4, weight_bits=2, buf_id_bits=2, index_bits=3, data_bits=8")


def mu_state(obs, name):
    """Whether the observed memory unit is in the FSM state ``name``."""
    return obs.state == MU_STATES.index(name)


class MUHarness(Elaboratable):
    """A memory unit under an environment that sends arbitrary requests under the stream
    rules (valid held until accepted, payload stable meanwhile; tags numbered in order) and
    takes responses whenever it likes, with the invariants that make the proofs inductive.

    ``check`` selects the property-specific assertions added to the invariants.
    """

    def __init__(self, check, fault=None, params=MU_FORMAL):
        self.check, self.p = check, params
        self.mu_class = variant(MU_VARIANTS, fault)

    def elaborate(self, platform):
        p = self.p
        m = Module()
        m.submodules.mu = mu = self.mu_class(p, _observe=True)
        obs = mu.obs
        self.m, self.mu, self.obs = m, mu, obs
        self._environment()
        self._invariants()
        getattr(self, f"_check_{self.check}")()
        return m

    # Environment: any request under the stream rules; tags count requests.
    def _requests(self):
        """Drive ``req`` and ``resp.ready``: any request, under the stream rules."""
        m, mu = self.m, self.mu
        req_layout = mu.req.payload.shape()
        valid, payload, ready = AnySeq(1), AnySeq(req_layout.size), AnySeq(1)
        m.d.comb += [mu.req.valid.eq(valid), mu.req.payload.eq(payload),
                     mu.resp.ready.eq(ready)]
        was_waiting = Signal()
        last = Signal(req_layout.size)
        m.d.sync += [was_waiting.eq(mu.req.valid & ~mu.req.ready), last.eq(mu.req.payload)]
        with m.If(was_waiting):
            m.d.comb += Assume(valid & (payload == last))
        m.d.comb += Assume(mu.req.payload.tag == self.sent)

    def _environment(self):
        m, mu = self.m, self.mu
        tag_bits = len(mu.req.payload.tag)
        self.sent = sent = Signal(tag_bits)       # requests accepted (mod 2**tag_bits)
        self.got = got = Signal(tag_bits)         # responses taken
        self._requests()
        with m.If(mu.req.valid & mu.req.ready):
            m.d.sync += sent.eq(sent + 1)
        with m.If(mu.resp.valid & mu.resp.ready):
            m.d.sync += got.eq(got + 1)
        # The response link keeps its side of the rules too.
        resp_waiting = Signal()
        resp_last = Signal(len(mu.resp.payload.as_value()))
        m.d.sync += [resp_waiting.eq(mu.resp.valid & ~mu.resp.ready),
                     resp_last.eq(mu.resp.payload.as_value())]
        with m.If(resp_waiting):
            m.d.comb += Assert(mu.resp.valid & (mu.resp.payload.as_value() == resp_last))

    def _entry(self, slot, vb):
        """The block-table entry (a physical block) of virtual block ``vb`` of ``slot``."""
        return self.obs.blocktab.obs_entries[slot * self.p.max_vblocks + vb]

    def _mapped(self, slot, vb):
        """Whether virtual block ``vb`` of ``slot`` is mapped (its bit in the buffer table)."""
        return self.obs.buftab[slot].mapped[vb]

    def _nvb(self, length):
        return (length + (self.p.block_words - 1)) >> self.p.offset_bits

    def _invariants(self):
        m, mu, obs, p = self.m, self.mu, self.obs, self.p
        ob, sb = p.offset_bits, p.slot_bits
        blocks, slots, bt = obs.blocks, obs.slots, obs.blocktab
        init = mu_state(obs, "INIT")
        a = []   # assertions outside INIT
        s1_slot = obs.s1.ref.buf[:sb]

        # INIT: nothing in flight, free lists at their reset state, buffer table cleared so
        # far (the block table is never cleared: an entry counts only while it is mapped).
        with m.If(init):
            m.d.comb += [Assert(~obs.s1_valid & ~obs.s2_valid & (obs.live == 0)),
                         Assert((slots.obs_n == 0) & (slots.obs_taken == 0)),
                         Assert((blocks.obs_n == 0) & (blocks.obs_taken == 0)),
                         Assert((obs.init_i <= p.max_buffers) & (mu.held_words == 0))]
            for k, ent in enumerate(obs.buftab):
                with m.If(obs.init_i > k):
                    m.d.comb += Assert(ent.as_value() == 0)
        a.append(obs.state < len(MU_STATES) - 2)          # no reserve-mode states
        a.append((blocks.obs_n <= p.n_blocks) & (blocks.obs_taken <= p.n_blocks))
        a.append((slots.obs_n <= p.max_buffers) & (slots.obs_taken <= p.max_buffers))

        # Slots: each is exactly one of live or free.
        for s in range(p.max_buffers):
            on_stack = [(slots.obs_n > j) & (slots.obs_stack[j] == s)
                        for j in range(p.max_buffers)]
            a.append(popcount([obs.buftab[s].live, Const(s) >= slots.obs_taken, *on_stack])
                     == 1)
        a.append(obs.live == popcount([e.live for e in obs.buftab]))

        # Blocks: each is exactly one of free or mapped by one (slot, virtual block); mapped
        # virtual blocks belong to live buffers and lie below their length. A free walk of a
        # slot has released the blocks of its virtual blocks below walk_vb (below walk_prev
        # while walk_prev's is being released), every one in FREE_END; their mapped bits go
        # with the whole entry at the end of FREE_END.
        walking = mu_state(obs, "FREE_WALK")
        ending = mu_state(obs, "FREE_END")

        def held(s, v):
            released = (s1_slot == s) & ((walking & (v < obs.walk_vb - obs.walk_pending))
                                         | ending)
            return self._mapped(s, v) & ~released

        for b in range(p.n_blocks):
            on_stack = [(blocks.obs_n > j) & (blocks.obs_stack[j] == b)
                        for j in range(p.n_blocks)]
            mapped = [held(s, v) & (self._entry(s, v) == b)
                      for s in range(p.max_buffers) for v in range(p.max_vblocks)]
            a.append(popcount([Const(b) >= blocks.obs_taken, *on_stack, *mapped]) == 1)
        n_mapped = popcount([held(s, v) for s in range(p.max_buffers)
                             for v in range(p.max_vblocks)])
        a.append(mu.free_blocks == p.n_blocks - n_mapped)
        a.append(mu.held_words == n_mapped * p.block_words)

        for s in range(p.max_buffers):
            ent = obs.buftab[s]
            a.append(ent.length <= p.max_buffer_words)
            a.append(ent.collected <= ent.total)
            for v in range(p.max_vblocks):
                a.append(~self._mapped(s, v) | (ent.live & (v < self._nvb(ent.length))))

        # The pipeline: reads presented on acceptance match the tables at execution.
        with m.If(~init):
            for k, cond in enumerate(a):
                m.d.comb += Assert(cond, f"inv_{k}")
            with m.If((mu_state(obs, "EXEC") | mu_state(obs, "RMW")) & obs.s1_valid):
                vb = obs.s1.index[ob:ob + exact_vbits(p)]
                for s in range(p.max_buffers):
                    with m.If(s1_slot == s):
                        m.d.comb += Assert(obs.entry == obs.buftab[s])
                        for v in range(p.max_vblocks):
                            with m.If(vb == v):
                                m.d.comb += Assert(bt.entry == self._entry(s, v))
            with m.If(mu_state(obs, "RMW")):
                # A read-modify-write that passed its checks: the word it read is still the
                # word at its address.
                m.d.comb += [Assert(obs.s1_valid & ((obs.s1.op == MUOp.FETCH_ADD)
                                                    | (obs.s1.op == MUOp.UNLOCK))),
                             Assert((obs.status == MUStatus.OK) & (obs.rmw_addr == obs.addr)),
                             Assert(obs.rmw_old == Array(obs.scratch)[obs.rmw_addr])]
            with m.If(mu_state(obs, "ALLOC")):
                # An ALLOC that passed its checks in EXEC, on state that has not changed since.
                m.d.comb += Assert(obs.s1_valid & (obs.s1.op == MUOp.ALLOC)
                                   & (obs.status == MUStatus.OK))
                for s in range(p.max_buffers):
                    with m.If(~slots.empty & (slots.head == s)):
                        m.d.comb += Assert(obs.entry == obs.buftab[s])
            with m.If(walking | ending):
                m.d.comb += Assert(obs.s1_valid & ~obs.s2_valid
                                   & ((obs.s1.op == MUOp.RETURN) | (obs.s1.op == MUOp.DECREF)))
                for s in range(p.max_buffers):
                    with m.If(s1_slot == s):
                        ent = obs.buftab[s]
                        m.d.comb += [Assert(ent.live & (obs.entry == ent)),
                                     Assert(obs.saved.gen == ent.gen),
                                     Assert(obs.saved.mapped == ent.mapped)]
                        with m.If(walking):
                            m.d.comb += [
                                Assert(obs.walk_n == self._nvb(ent.length)),
                                Assert((obs.walk_vb == 1) | (obs.walk_vb <= obs.walk_n)),
                                Assert(obs.walk_vb >= 1),
                                Assert(~obs.walk_pending | (obs.walk_prev + 1 == obs.walk_vb)),
                            ]
                            for v in range(p.max_vblocks):
                                with m.If(obs.walk_pending & (obs.walk_prev == v)):
                                    m.d.comb += Assert(bt.entry == self._entry(s, v))

        # Requests in flight: each accepted request has exactly one response, in order.
        in_flight = (self.sent - self.got)[:len(self.sent)]
        m.d.comb += Assert(in_flight == obs.s1_valid + obs.s2_valid)
        with m.If(obs.s2_valid):
            m.d.comb += Assert(obs.s2.tag == self.got)
        with m.If(obs.s1_valid):
            m.d.comb += Assert(obs.s1.tag == (self.got + obs.s2_valid)[:len(self.got)])

    def _check_blocks(self):
        pass   # the invariants are the property

    def _check_responses(self):
        mu = self.mu
        with self.m.If(mu.resp.valid):
            self.m.d.comb += Assert(mu.resp.payload.tag == self.got)

    def _snapshot(self):
        """Everything a request may change: tables, free lists, scratchpad, counts."""
        obs = self.obs
        parts = [e.as_value() for e in obs.buftab] + list(obs.scratch)
        parts += list(obs.blocktab.obs_entries)
        for fl in (obs.slots, obs.blocks):
            parts += [fl.obs_n, fl.obs_taken, *fl.obs_stack]
        parts += [obs.live, self.mu.held_words]
        return Cat(*parts)

    def _check_errors(self):
        m, obs = self.m, self.obs
        snap = self._snapshot()
        before = Signal(len(snap))
        refused = Signal()
        m.d.sync += [before.eq(snap),
                     refused.eq(obs.done & (obs.done_status != MUStatus.OK))]
        with m.If(refused):
            m.d.comb += Assert(snap == before, "refused request changed state")

    def _check_weights(self):
        m, mu, obs, p = self.m, self.mu, self.obs, self.p
        sb, wb = p.slot_bits, p.weight_bits
        req, resp = mu.req.payload, mu.resp.payload
        n = p.max_buffers
        # The environment as one holder per slot: the weight it holds (hw), the generation of
        # the reference it holds (hgen), and the weight of ADD_WEIGHT requests in flight.
        hw = [Signal(wb + 1, name=f"held_weight_{s}") for s in range(n)]
        hgen = [Signal(p.gen_bits, name=f"held_gen_{s}") for s in range(n)]
        ntags = 1 << len(req.tag)
        pend = [Signal(p.data_bits, name=f"pending_add_{t}") for t in range(ntags)]
        accept = mu.req.valid & mu.req.ready
        deliver = mu.resp.valid & mu.resp.ready
        slot_of = req.ref.buf[:sb]
        gen_of = req.ref.buf[sb:]
        # RETURN and ADD_WEIGHT only by a holder, RETURN of 1 .. what it holds.
        for s in range(n):
            holds = (req.ref.mu == 0) & (gen_of == hgen[s]) & (hw[s] != 0)
            with m.If(mu.req.valid & (slot_of == s)):
                with m.If(req.op == MUOp.RETURN):
                    m.d.comb += Assume(holds & (req.data != 0) & (req.data <= hw[s]))
                with m.If(req.op == MUOp.ADD_WEIGHT):
                    m.d.comb += Assume(holds)
            # A RETURN leaves the holder when it is sent; ADD_WEIGHT and ALLOC weight reach it
            # with their responses (both may happen in one cycle).
            returned = Mux(accept & (slot_of == s) & (req.op == MUOp.RETURN), req.data, 0)
            added = Const(0, p.data_bits)
            rslot = resp.ref.buf[:sb]
            got_ok = deliver & (rslot == s) & (resp.status == MUStatus.OK)
            for t in range(ntags):
                added = Mux(got_ok & (resp.op == MUOp.ADD_WEIGHT) & (resp.tag == t), pend[t],
                            added)
            m.d.sync += hw[s].eq(hw[s] - returned + added)
            with m.If(got_ok & (resp.op == MUOp.ALLOC)):
                m.d.sync += [hw[s].eq(resp.data[:wb]), hgen[s].eq(resp.ref.buf[sb:])]
        for t in range(ntags):
            with m.If(accept & (req.tag == t)):
                m.d.sync += pend[t].eq(req.data)

        # Weighted reference counting: total = collected + held + in flight, for every live
        # buffer; a holder holds no weight of a buffer that is not live.
        s1, s2 = obs.s1, obs.s2
        with m.If(~mu_state(obs, "INIT")):
            for s in range(n):
                ent = obs.buftab[s]
                holds = hgen[s] == ent.gen
                alloc_here = (obs.s2_valid & (s2.op == MUOp.ALLOC) & (s2.status == MUStatus.OK)
                              & (s2.ref.buf[:sb] == s))
                alloc_w = Mux(alloc_here, s2.data, 0)
                with m.If(alloc_here):
                    m.d.comb += Assert(ent.live & (s2.ref.buf[sb:] == ent.gen)
                                       & (s2.ref.mu == 0) & (s2.data == ent.total)
                                       & (ent.collected == 0) & (s2.data != 0))
                s1_here = obs.s1_valid & (s1.ref.buf[:sb] == s) & (s1.ref.buf[sb:] == ent.gen)
                ret_w = Mux(s1_here & (s1.op == MUOp.RETURN), s1.data, 0)
                add_w = Const(0, p.data_bits)
                for t in range(ntags):
                    add_w = Mux(obs.s2_valid & (s2.op == MUOp.ADD_WEIGHT)
                                & (s2.status == MUStatus.OK) & (s2.ref.buf[:sb] == s)
                                & (s2.tag == t), pend[t], add_w)
                add_here = (obs.s2_valid & (s2.op == MUOp.ADD_WEIGHT) & (s2.status == MUStatus.OK)
                            & (s2.ref.buf[:sb] == s))
                with m.If(add_here):
                    m.d.comb += Assert(ent.live & (s2.ref.buf[sb:] == ent.gen) & holds)
                with m.If(obs.s1_valid & (s1.ref.buf[:sb] == s)
                          & ((s1.op == MUOp.RETURN) | (s1.op == MUOp.ADD_WEIGHT))):
                    m.d.comb += Assert(ent.live & (s1.ref.buf[sb:] == ent.gen) & holds
                                       & (s1.ref.mu == 0) & ~alloc_here)
                    with m.If(s1.op == MUOp.ADD_WEIGHT):
                        m.d.comb += Assert(hw[s] != 0)
                with m.If(ent.live):
                    m.d.comb += Assert(
                        ent.total == ent.collected + Mux(holds, hw[s], 0) + alloc_w + ret_w
                        + add_w, f"weight accounting of slot {s}")
                    m.d.comb += Assert((alloc_w == 0) | (hw[s] == 0))
                with m.If(hw[s] != 0):
                    m.d.comb += Assert(ent.live & holds,
                                       f"weight held for a freed buffer in slot {s}")
            for t in range(ntags):
                with m.If(obs.s1_valid & (s1.tag == t)):
                    m.d.comb += Assert(pend[t] == s1.data)
            with m.If(obs.frees_now):
                m.d.comb += Assert(obs.entry.collected + s1.data == obs.entry.total,
                                   "freed before its weight was collected")

    def _check_read_write(self):
        m, mu, obs, p = self.m, self.mu, self.obs, self.p
        sb, ob = p.slot_bits, p.offset_bits
        vbits = exact_vbits(p)
        # One watched word: (slot, index) chosen by the solver, and what was last written.
        w_slot, w_index = AnyConst(sb), AnyConst(exact_log2(p.max_buffer_words))
        written = Signal()
        value = Signal(p.data_bits)
        s1 = obs.s1
        here = (s1.ref.buf[:sb] == w_slot)
        ok_exec = mu_state(obs, "EXEC") & obs.done & (obs.done_status == MUStatus.OK)
        with m.If(ok_exec & here & ((s1.op == MUOp.WRITE) | (s1.op == MUOp.APPEND))
                  & (obs.idx == w_index)):
            m.d.sync += [written.eq(1), value.eq(s1.data)]
        # FETCH_ADD adds to the word, UNLOCK by the ticket's holder bumps it, as they leave RMW.
        rmw_done = mu_state(obs, "RMW") & (~obs.s2_valid | mu.resp.ready)
        with m.If(rmw_done & here & (s1.index == w_index) & written):
            with m.If(s1.op == MUOp.FETCH_ADD):
                m.d.sync += value.eq(value + s1.data)
            with m.Elif(value == s1.data):
                m.d.sync += value.eq(value + 1)
        with m.If(mu_state(obs, "FREE_END") & obs.done & here):
            m.d.sync += written.eq(0)
        # A READ of the watched word: its response carries the value.
        expect = Signal()
        with m.If(ok_exec & here & (s1.op == MUOp.READ) & (s1.index == w_index) & written):
            m.d.sync += expect.eq(1)
        with m.Elif(mu.resp.ready):
            m.d.sync += expect.eq(0)
        with m.If(expect):
            m.d.comb += Assert(mu.resp.valid & (mu.resp.payload.data == value),
                               "read returned a different word")
        # Invariant: the watched word is mapped, inside the length, and holds the value.
        with m.If(~mu_state(obs, "INIT")):
            with m.If(expect):
                m.d.comb += Assert(obs.s2_valid & (obs.s2.op == MUOp.READ)
                                   & (obs.s2.status == MUStatus.OK))
            freeing = ((mu_state(obs, "FREE_WALK") | mu_state(obs, "FREE_END"))
                       & (s1.ref.buf[:sb] == w_slot))
            for s in range(p.max_buffers):
                ent = obs.buftab[s]
                with m.If((w_slot == s) & written & ~freeing):
                    m.d.comb += Assert(ent.live & (ent.length > w_index))
                    for v in range(p.max_vblocks):
                        with m.If(w_index[ob:ob + vbits] == v):
                            blk = self._entry(s, v)
                            m.d.comb += Assert(self._mapped(s, v))
                            for b in range(p.n_blocks):
                                with m.If(blk == b):
                                    for o in range(p.block_words):
                                        with m.If(w_index[:ob] == o):
                                            m.d.comb += Assert(
                                                obs.scratch[b * p.block_words + o] == value)
                # The tail is the block of the last word.
                freeing_s = ((mu_state(obs, "FREE_WALK") | mu_state(obs, "FREE_END"))
                             & (s1.ref.buf[:sb] == s))
                with m.If(ent.live & (ent.length != 0) & ~freeing_s):
                    last = (ent.length - 1)[ob:ob + vbits]
                    for v in range(p.max_vblocks):
                        with m.If(last == v):
                            m.d.comb += Assert(self._mapped(s, v)
                                               & (self._entry(s, v) == ent.tail))



def exact_vbits(p):
    """Bits of a virtual block number."""
    return exact_log2(p.max_vblocks)


@refuses_unknown(MU_VARIANTS)
def mu_blocks(fault=None):
    """Memory unit: blocks, slots and the block table are consistent (see the invariants)."""
    return MUHarness("blocks", fault)


@refuses_unknown(MU_VARIANTS)
def mu_responses(fault=None):
    """Memory unit: every request gets exactly one response, in order."""
    return MUHarness("responses", fault)


@refuses_unknown(MU_VARIANTS)
def mu_errors(fault=None):
    """Memory unit: a refused request changes nothing."""
    return MUHarness("errors", fault)


@refuses_unknown(MU_VARIANTS)
def mu_weights(fault=None):
    """Memory unit: weighted reference counting against holders of weight shares."""
    return MUHarness("weights", fault)



@refuses_unknown(MU_VARIANTS)
def mu_read_write(fault=None):
    """Memory unit: a read returns the last word written at that (buffer, index)."""
    return MUHarness("read_write", fault)

