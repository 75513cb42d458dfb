"""Formal harnesses: the properties of the memory unit, the router and reference counting.

Each :class:`Property` names a harness (an elaboratable holding the design under proof, an
environment of ``Assume``/``AnySeq`` inputs and the ``Assert`` statements), how it is proven
(``prove`` is k-induction; ``bmc`` a bounded check) and the deliberately broken variants that
must make it fail. :data:`PROPERTIES` is the single list: ``rdakit verify``, the tests in
``tests/formal/`` and the table in ``docs/verification.md`` all read it.

Harnesses observe internal state through the private ``_observe=True`` argument of the
components (documented there), and inject bugs through ``_fault=``.
"""

import dataclasses
from collections.abc import Callable

from amaranth.asserts import AnyConst, AnySeq
from amaranth.hdl import Array, Assert, Assume, Cat, Const, Elaboratable, Module, Mux, Signal, Value
from amaranth.lib.fifo import SyncFIFO
from amaranth.utils import exact_log2

from rdakit.hdl.memory.free_list import FreeList
from rdakit.hdl.memory.unit import MU_STATES, MemoryUnit
from rdakit.hdl.noc.router import EJECT_DEPTH, Router, _ObservedQueue, xy_route
from rdakit.hdl.spec.flit import DIRECTIONS, PORT_DELTA, Port
from rdakit.hdl.spec.packets import MUOp, MUStatus
from rdakit.hdl.spec.params import MUParams

__all__ = ["Property", "PROPERTIES", "get_property", "prove", "properties_table"]


@dataclasses.dataclass(frozen=True)
class Property:
    """One proof: a harness, how it is run, and what it states.

    Members
    -------
    name : str
        Identifier (``unit.what``), also the SymbiYosys task name.
    statement : str
        What is proven, in words.
    harness : callable
        ``harness(fault)`` returns the elaboratable; ``fault`` is ``None`` or one of
        ``faults``.
    params : str
        The parameters of the design under proof.
    mode, depth : str, int
        ``"prove"`` (k-induction of length ``depth``) or ``"bmc"`` (bounded, ``depth`` cycles).
    expect : str
        ``"PASS"``, or ``"FAIL"`` for a property that is expected to have a counterexample (a
        demonstration of a known flaw).
    faults : tuple of str
        Broken variants (``fault`` values) for which the proof must fail.
    fault_depth : int
        Bound of the bounded check run on a broken variant, which must find a counterexample
        from the initial state (``FAIL``), not merely break the induction; ``0`` means
        ``depth``.
    ci : bool
        Part of the subset CI runs.
    """

    name: str
    statement: str
    harness: Callable
    params: str
    mode: str = "prove"
    depth: int = 10
    expect: str = "PASS"
    faults: tuple = ()
    fault_depth: int = 0
    ci: bool = True

    @property
    def where(self):
        return f"{self.harness.__module__}.{self.harness.__qualname__}"


def _popcount(bits):
    total = Const(0, 1)
    for b in bits:
        total = total + b
    return total


# --- Free list ---------------------------------------------------------------------------------

FREE_LIST_DEPTH = 4


def free_list_exclusive(fault=None):
    """The free list against an environment that pops when it is not empty and pushes back
    only entries it holds. ``held`` is the environment's set of entries."""
    m = Module()
    depth = FREE_LIST_DEPTH
    m.submodules.dut = fl = FreeList(depth, _observe=True,
                                     _fault={"pop_keeps": "pop_keeps"}.get(fault))
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
        m.d.comb += Assert(_popcount([held[k], fresh, *on_stack]) == 1)
    m.d.comb += [
        Assert(fl.count == depth - _popcount(held)),
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


def _state(obs, name):
    return obs.state == MU_STATES.index(name)


class _MUHarness(Elaboratable):
    """A memory unit under an environment that sends arbitrary requests under the stream
    rules (valid held until accepted, payload stable meanwhile; tags numbered in order) and
    takes responses whenever it likes, with the invariants that make the proofs inductive.

    ``check`` selects the property-specific assertions added to the invariants.
    """

    def __init__(self, check, fault=None, params=MU_FORMAL):
        self.check, self.fault, self.p = check, fault, params

    def elaborate(self, platform):
        p = self.p
        m = Module()
        m.submodules.mu = mu = MemoryUnit(p, _observe=True, _fault=self.fault)
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
        return self.obs.blocktab.obs_entries[slot * self.p.max_vblocks + vb]

    def _nvb(self, length):
        return (length + (self.p.block_words - 1)) >> self.p.offset_bits

    def _invariants(self):
        m, mu, obs, p = self.m, self.mu, self.obs, self.p
        ob, sb = p.offset_bits, p.slot_bits
        blocks, slots, bt = obs.blocks, obs.slots, obs.blocktab
        init = _state(obs, "INIT")
        a = []   # assertions outside INIT
        s1_slot = obs.s1.ref.buf[:sb]

        # INIT: nothing in flight, free lists at their reset state, tables cleared so far.
        with m.If(init):
            m.d.comb += [Assert(~obs.s1_valid & ~obs.s2_valid & (obs.live == 0)),
                         Assert((slots.obs_n == 0) & (slots.obs_taken == 0)),
                         Assert((blocks.obs_n == 0) & (blocks.obs_taken == 0)),
                         Assert((obs.init_i <= p.max_buffers) & (mu.held_words == 0)),
                         Assert(bt.obs_clear <= len(bt.obs_entries))]
            for k, ent in enumerate(obs.buftab):
                with m.If(obs.init_i > k):
                    m.d.comb += Assert(ent.as_value() == 0)
            for k, ent in enumerate(bt.obs_entries):
                with m.If(bt.obs_clear > k):
                    m.d.comb += Assert(ent.as_value() == 0)
        a.append(bt.obs_clear == len(bt.obs_entries))
        a.append(obs.state < len(MU_STATES) - 2)          # no reserve-mode states
        a.append((blocks.obs_n <= p.n_blocks) & (blocks.obs_taken <= p.n_blocks))
        a.append((slots.obs_n <= p.max_buffers) & (slots.obs_taken <= p.max_buffers))

        # Slots: each is exactly one of live or free.
        for s in range(p.max_buffers):
            on_stack = [(slots.obs_n > j) & (slots.obs_stack[j] == s)
                        for j in range(p.max_buffers)]
            a.append(_popcount([obs.buftab[s].live, Const(s) >= slots.obs_taken, *on_stack])
                     == 1)
        a.append(obs.live == _popcount([e.live for e in obs.buftab]))

        # Blocks: each is exactly one of free or mapped by one (slot, virtual block); mapped
        # entries belong to live buffers and lie below their length.
        for b in range(p.n_blocks):
            on_stack = [(blocks.obs_n > j) & (blocks.obs_stack[j] == b)
                        for j in range(p.n_blocks)]
            mapped = [self._entry(s, v).valid & (self._entry(s, v).block == b)
                      for s in range(p.max_buffers) for v in range(p.max_vblocks)]
            a.append(_popcount([Const(b) >= blocks.obs_taken, *on_stack, *mapped]) == 1)
        n_mapped = _popcount([e.valid for e in bt.obs_entries])
        a.append(mu.free_blocks == p.n_blocks - n_mapped)
        a.append(mu.held_words == n_mapped * p.block_words)

        walking = _state(obs, "FREE_WALK")
        ending = _state(obs, "FREE_END")
        for s in range(p.max_buffers):
            ent = obs.buftab[s]
            a.append(ent.length <= p.max_buffer_words)
            a.append(ent.collected <= ent.total)
            for v in range(p.max_vblocks):
                valid = self._entry(s, v).valid
                # Entries being released by a free walk of this slot are gone below walk_vb.
                released = (s1_slot == s) & ((walking & (v < obs.walk_vb - obs.walk_pending))
                                             | ending)
                a.append(~valid | (ent.live & (v < self._nvb(ent.length)) & ~released))

        # The pipeline: reads presented on acceptance match the tables at execution.
        with m.If(~init):
            for k, cond in enumerate(a):
                m.d.comb += Assert(cond, f"inv_{k}")
            with m.If((_state(obs, "EXEC") | _state(obs, "RMW")) & obs.s1_valid):
                vb = obs.s1.index[ob:ob + exact_vbits(p)]
                for s in range(p.max_buffers):
                    with m.If(s1_slot == s):
                        m.d.comb += Assert(obs.entry == obs.buftab[s])
                        for v in range(p.max_vblocks):
                            with m.If(vb == v):
                                m.d.comb += Assert(bt.entry == self._entry(s, v))
            with m.If(_state(obs, "RMW")):
                # A read-modify-write that passed its checks: the word it read is still the
                # word at its address.
                m.d.comb += [Assert(obs.s1_valid & ((obs.s1.op == MUOp.FETCH_ADD)
                                                    | (obs.s1.op == MUOp.UNLOCK))),
                             Assert((obs.status == MUStatus.OK) & (obs.rmw_addr == obs.addr)),
                             Assert(obs.rmw_old == Array(obs.scratch)[obs.rmw_addr])]
            with m.If(_state(obs, "ALLOC")):
                m.d.comb += Assert(obs.s1_valid & (obs.s1.op == MUOp.ALLOC))
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
                                     Assert(obs.saved.gen == ent.gen)]
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
        parts += [e.as_value() for e in obs.blocktab.obs_entries]
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
        with m.If(~_state(obs, "INIT")):
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
        ok_exec = _state(obs, "EXEC") & obs.done & (obs.done_status == MUStatus.OK)
        with m.If(ok_exec & here & ((s1.op == MUOp.WRITE) | (s1.op == MUOp.APPEND))
                  & (obs.idx == w_index)):
            m.d.sync += [written.eq(1), value.eq(s1.data)]
        # FETCH_ADD adds to the word, UNLOCK by the ticket's holder bumps it, as they leave RMW.
        rmw_done = _state(obs, "RMW") & (~obs.s2_valid | mu.resp.ready)
        with m.If(rmw_done & here & (s1.index == w_index) & written):
            with m.If(s1.op == MUOp.FETCH_ADD):
                m.d.sync += value.eq(value + s1.data)
            with m.Elif(value == s1.data):
                m.d.sync += value.eq(value + 1)
        with m.If(_state(obs, "FREE_END") & obs.done & here):
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
        with m.If(~_state(obs, "INIT")):
            with m.If(expect):
                m.d.comb += Assert(obs.s2_valid & (obs.s2.op == MUOp.READ)
                                   & (obs.s2.status == MUStatus.OK))
            freeing = ((_state(obs, "FREE_WALK") | _state(obs, "FREE_END"))
                       & (s1.ref.buf[:sb] == w_slot))
            for s in range(p.max_buffers):
                ent = obs.buftab[s]
                with m.If((w_slot == s) & written & ~freeing):
                    m.d.comb += Assert(ent.live & (ent.length > w_index))
                    for v in range(p.max_vblocks):
                        with m.If(w_index[ob:ob + vbits] == v):
                            blk = self._entry(s, v)
                            m.d.comb += Assert(blk.valid)
                            for b in range(p.n_blocks):
                                with m.If(blk.block == b):
                                    for o in range(p.block_words):
                                        with m.If(w_index[:ob] == o):
                                            m.d.comb += Assert(
                                                obs.scratch[b * p.block_words + o] == value)
                # The tail is the block of the last word.
                freeing_s = ((_state(obs, "FREE_WALK") | _state(obs, "FREE_END"))
                             & (s1.ref.buf[:sb] == s))
                with m.If(ent.live & (ent.length != 0) & ~freeing_s):
                    last = (ent.length - 1)[ob:ob + vbits]
                    for v in range(p.max_vblocks):
                        with m.If(last == v):
                            m.d.comb += Assert(self._entry(s, v).valid
                                               & (self._entry(s, v).block == ent.tail))


class _CounterHarness(_MUHarness):
    """Counter-based reference counting (the baseline) in the scenario of the paper's
    Figure 1: holder A allocates a buffer (count 1), copies its reference to holder B with an
    ``INCREF``, and later both send ``DECREF``. Requests cross a network that may deliver the
    (at most two) messages in flight in either order. With acknowledgement gating A waits for
    the ``INCREF``'s response before handing the copy to B; without it (the ``"ungated"``
    variant) it hands it over at once, and the ``INCREF`` can arrive after A's ``DECREF``.

    The property: while a holder holds the reference, the buffer is live with the reference's
    generation (it has not been freed).
    """

    def __init__(self, fault=None):
        super().__init__("counter", None, MU_FORMAL.replace(refcount="counter"))
        self.gated = fault != "ungated"

    def _requests(self):
        m, mu = self.m, self.mu
        m.d.comb += mu.resp.ready.eq(1)
        # The network: two message slots (an opcode each; every message names the reference
        # A was given), delivered in an order the solver picks, under the stream rules.
        self.net_valid = net_valid = [Signal(name=f"net_valid_{k}") for k in range(2)]
        self.net_op = net_op = [Signal(MUOp, name=f"net_op_{k}") for k in range(2)]
        self.ref = ref = Signal(mu.req.payload.ref.shape())
        self.a_holds, self.b_holds = a_holds, b_holds = Signal(), Signal()
        phase = Signal(range(5))      # A: 0 send ALLOC, 1 wait, 2 send INCREF, 3 wait, 4 hold
        self.phase = phase
        pick, was_waiting, last_pick = AnySeq(1), Signal(), Signal()
        sel = Signal()
        m.d.comb += sel.eq(Mux(was_waiting, last_pick,
                               Mux(net_valid[0] & net_valid[1], pick, net_valid[1])))
        m.d.sync += [was_waiting.eq(mu.req.valid & ~mu.req.ready), last_pick.eq(sel)]
        # The network may hold a message back for any time (but not take back an offer).
        deliver = AnySeq(1)
        m.d.comb += [
            mu.req.valid.eq(Mux(sel, net_valid[1], net_valid[0]) & (deliver | was_waiting)),
            mu.req.payload.op.eq(Mux(sel, net_op[1], net_op[0])),
            mu.req.payload.ref.eq(ref),
            mu.req.payload.tag.eq(self.sent),
            mu.req.payload.data.eq(1),           # ALLOC: initial count 1
        ]
        taken = [mu.req.valid & mu.req.ready & (sel == k) for k in range(2)]
        # A message enters the first free slot (after this cycle's delivery).
        free0 = ~net_valid[0] | taken[0]
        free1 = ~net_valid[1] | taken[1]
        for k in range(2):
            with m.If(taken[k]):
                m.d.sync += net_valid[k].eq(0)

        def send(op):
            with m.If(free0):
                m.d.sync += [net_valid[0].eq(1), net_op[0].eq(op)]
            with m.Else():
                m.d.sync += [net_valid[1].eq(1), net_op[1].eq(op)]
            return free0 | free1

        resp = mu.resp.payload
        got_ok = mu.resp.valid & (resp.status == MUStatus.OK)
        a_done, b_done = AnySeq(1), AnySeq(1)   # when each holder finishes with the buffer
        # B's DECREF has priority for a free slot in the same cycle as A's; A retries.
        b_sends = b_holds & b_done & (free0 | free1)
        with m.If(b_sends):
            send(MUOp.DECREF)
            m.d.sync += b_holds.eq(0)
        a_free = Mux(b_sends, free0 & free1, free0 | free1)
        with m.Switch(phase):
            with m.Case(0):
                send(MUOp.ALLOC)
                m.d.sync += phase.eq(1)
            with m.Case(1):
                with m.If(got_ok & (resp.op == MUOp.ALLOC)):
                    m.d.sync += [ref.eq(resp.ref), a_holds.eq(1), phase.eq(2)]
            with m.Case(2):
                with m.If(a_free & ~b_sends):
                    send(MUOp.INCREF)
                    if self.gated:
                        m.d.sync += phase.eq(3)
                    else:
                        m.d.sync += [b_holds.eq(1), phase.eq(4)]
            with m.Case(3):
                with m.If(got_ok & (resp.op == MUOp.INCREF)):
                    m.d.sync += [b_holds.eq(1), phase.eq(4)]
            with m.Case(4):
                with m.If(a_holds & a_done & a_free & ~b_sends):
                    send(MUOp.DECREF)
                    m.d.sync += a_holds.eq(0)
        m.d.comb += Assume(phase <= 4)

    def _check_counter(self):
        m, obs, p = self.m, self.obs, self.p
        sb = p.slot_bits
        rslot, rgen = self.ref.buf[:sb], self.ref.buf[sb:]
        ent = Signal.like(obs.buftab[0])
        for s in range(p.max_buffers):
            with m.If(rslot == s):
                m.d.comb += ent.eq(obs.buftab[s])
        live = ent.live & (ent.gen == rgen)
        with m.If(self.a_holds | self.b_holds):
            m.d.comb += Assert(live, "buffer freed while a holder holds its reference")
        # Invariants (gated protocol): the count is the holders plus the DECREFs not yet
        # applied plus the copy being handed over.
        if not self.gated:
            return
        s1, s2 = obs.s1, obs.s2
        n_dec = _popcount([v & (op == MUOp.DECREF) for v, op in zip(self.net_valid, self.net_op,
                                                                   strict=True)]
                          + [obs.s1_valid & (s1.op == MUOp.DECREF)])
        n_inc = _popcount([v & (op == MUOp.INCREF) for v, op in zip(self.net_valid, self.net_op,
                                                                   strict=True)]
                          + [obs.s1_valid & (s1.op == MUOp.INCREF)])
        n_alloc = _popcount([v & (op == MUOp.ALLOC) for v, op in zip(self.net_valid, self.net_op,
                                                                    strict=True)]
                            + [obs.s1_valid & (s1.op == MUOp.ALLOC)])
        inc_ack = obs.s2_valid & (s2.op == MUOp.INCREF)
        alloc_ack = obs.s2_valid & (s2.op == MUOp.ALLOC)
        phase = self.phase
        with m.If(~_state(obs, "INIT")):
            m.d.comb += [
                Assert((phase == 0) | (phase == 1) | (n_alloc == 0)),
                Assert((phase != 0) | (n_alloc == 0) & ~alloc_ack & (obs.live == 0)
                       & ~obs.s1_valid & ~obs.s2_valid & (n_dec == 0) & (n_inc == 0)),
                Assert((phase != 1) | (n_alloc + alloc_ack == 1) & (n_dec == 0) & (n_inc == 0)),
                Assert((phase != 1) | (obs.live == alloc_ack)),
                Assert((phase == 3) | (n_inc + inc_ack == 0)),
                Assert((phase != 3) | (n_inc + inc_ack == 1)),
                Assert((phase == 4) | ~self.b_holds),
                Assert(((phase != 2) & (phase != 3)) | self.a_holds),
                Assert((phase >= 2) | ~self.a_holds),
                Assert(~obs.s1_valid | (s1.op == MUOp.ALLOC) | (s1.op == MUOp.INCREF)
                       | (s1.op == MUOp.DECREF)),
                Assert(~obs.s2_valid | (s2.op == MUOp.ALLOC) | (s2.op == MUOp.INCREF)
                       | (s2.op == MUOp.DECREF)),
                *(Assert(~v | (op == MUOp.ALLOC) | (op == MUOp.INCREF) | (op == MUOp.DECREF))
                  for v, op in zip(self.net_valid, self.net_op, strict=True)),
                Assert((phase < 2) | (obs.live <= 1)),
                Assert(~alloc_ack | (s2.status == MUStatus.OK)),
                Assert(~inc_ack | (s2.status == MUStatus.OK)),
                Assert(~obs.s2_valid | (s2.op != MUOp.DECREF) | (s2.status == MUStatus.OK)),
            ]
            with m.If(phase >= 2):
                m.d.comb += Assert(self.ref.mu == 0)
                with m.If(live):
                    m.d.comb += Assert(ent.total == self.a_holds + self.b_holds + n_dec
                                       + inc_ack, "count = holders + DECREFs in flight")
                    m.d.comb += Assert(ent.collected == 0)
                with m.Else():
                    m.d.comb += Assert(~self.a_holds & ~self.b_holds & (n_dec == 0)
                                       & (n_inc == 0) & ~inc_ack)
                    # Freed: nothing else is live either.
                    m.d.comb += Assert(obs.live == 0)
            with m.If(alloc_ack):
                m.d.comb += [Assert(obs.live == 1)]
                for s in range(p.max_buffers):
                    with m.If(s2.ref.buf[:sb] == s):
                        m.d.comb += Assert(obs.buftab[s].live & (obs.buftab[s].total == 1)
                                           & (obs.buftab[s].gen == s2.ref.buf[sb:])
                                           & (s2.ref.mu == 0))


# --- Router --------------------------------------------------------------------------------

#: The router under proof: the middle router of a 3 × 3 mesh (all five ports), 2-bit
#: coordinates and payloads, queues of 2 per (input, output) pair.
ROUTER_FORMAL = dict(payload_shape=2, x=1, y=1, rows=3, cols=3, coord_bits=2, depth=2,
                     queues="voq", counter_bits=1)

ROUTER_PARAMS_TEXT = "router (1, 1) of 3x3, voq queues of depth 2, 2-bit coordinates and payload"


def _stream_source(m, port):
    """Drive the stream ``port`` (valid, payload) with anything that follows the stream rules:
    once valid, valid and payload hold until ready."""
    size = len(port.payload.as_value())
    m.d.comb += [port.valid.eq(AnySeq(1)), port.payload.eq(AnySeq(size))]
    waiting, last = Signal(), Signal(size)
    m.d.sync += [waiting.eq(port.valid & ~port.ready), last.eq(port.payload)]
    with m.If(waiting):
        m.d.comb += Assume(port.valid & (port.payload.as_value() == last))


def _router_environment(m, r):
    """Drive every input of router ``r`` as its environment may: locally injected flits under
    the stream rules, and on each link that exists what a neighbour following the protocol
    sends (only into a queue with room, with the lookahead port XY routing gives, from a
    direction XY routing allows, for a tile inside the mesh); every receiver (the ejection
    port, the links' ready bits) stalls at will. Returns ``(inside, eject_ready, out_ready)``:
    the mesh test on a destination and the free ready bits, for harnesses that constrain them.
    """
    x, y, flit = r.x, r.y, r.flit
    dirs = [d for d in DIRECTIONS if r.has_port(d)]

    def inside(dst):
        return (dst.x < r.cols) & (dst.y < r.rows)

    _stream_source(m, r.inject)
    eject_ready = AnySeq(1)
    m.d.comb += r.eject.ready.eq(eject_ready)
    out_ready = {d: AnySeq(len(Port)) for d in dirs}
    for d in dirs:
        m.d.comb += r.link_out[d.value].ready.eq(out_ready[d])
    came_from = {Port.WEST: lambda t: t.x >= x, Port.EAST: lambda t: t.x <= x,
                 Port.NORTH: lambda t: (t.x == x) & (t.y >= y),
                 Port.SOUTH: lambda t: (t.x == x) & (t.y <= y)}
    for d in dirs:
        link = r.link_in[d.value]
        m.d.comb += [link.valid.eq(AnySeq(1)), link.payload.eq(AnySeq(flit.size)),
                     link.port.eq(xy_route(link.payload.dst, x, y))]
        with m.If(link.valid):
            m.d.comb += Assume(inside(link.payload.dst) & came_from[d](link.payload.dst)
                               & link.ready.bit_select(link.port.as_value(), 1))
    return inside, eject_ready, out_ready


def _assert_links_into_room(m, r):
    """Assert that router ``r`` drives each of its links only towards a queue with room (the
    link's ready bit for the flit's lookahead port)."""
    for d in DIRECTIONS:
        if r.has_port(d):
            out = r.link_out[d.value]
            with m.If(out.valid):
                m.d.comb += Assert(out.ready.bit_select(out.port.as_value(), 1),
                                   f"{d.name} link driven without room")


class _RouterHarness(Elaboratable):
    """One router with every input driven by the environment: locally injected flits under the
    stream rules, and flits on the four links as a neighbour would send them (only into a
    queue with room, with the lookahead port XY routing gives, arriving from a direction XY
    routing allows). Every receiver (the ejection port, the links' ready bits) stalls at will.
    """

    def __init__(self, fault=None):
        self.fault = fault

    def elaborate(self, platform):
        m = Module()
        m.submodules.router = r = Router(**ROUTER_FORMAL, _fault=self.fault)
        flit = r.flit

        _router_environment(m, r)

        # Link rules: a link is driven only towards a queue with room; the ejection port keeps
        # valid and payload until taken.
        _assert_links_into_room(m, r)
        ej_waiting, ej_last = Signal(), Signal(flit.size)
        m.d.sync += [ej_waiting.eq(r.eject.valid & ~r.eject.ready),
                     ej_last.eq(r.eject.payload)]
        with m.If(ej_waiting):
            m.d.comb += Assert(r.eject.valid & (r.eject.payload.as_value() == ej_last),
                               "eject changed while waiting")
        return m


def router_links(fault=None):
    """Router: valid/ready rules on every link, with receivers that stall at will."""
    return _RouterHarness(fault)


#: The router whose delivery is proven: the middle router of a 3 × 3 mesh (all five ports,
#: 17 queues), 2-bit coordinates, a 1-bit payload that marks the tracked flit.
ROUTER_DELIVERY_FORMAL = dict(payload_shape=1, x=1, y=1, rows=3, cols=3, coord_bits=2, depth=2,
                              queues="voq", counter_bits=1)

#: The same router with the other two queue kinds.
ROUTER_DELIVERY_FIFO = dict(ROUTER_DELIVERY_FORMAL, queues="fifo")
ROUTER_DELIVERY_SCAN = dict(ROUTER_DELIVERY_FORMAL, queues="scan")

#: The bounded-response environment: a receiver's ready bit is never low for more than
#: ``ROUTER_STALL`` cycles in a row.
ROUTER_STALL = 1

#: Width of the words in the queue equivalence check (any width behaves alike).
QUEUE_EQUIV_WIDTH = 3


@dataclasses.dataclass(frozen=True)
class BoundedResponse:
    """A router whose bounded response is proven, and its bound.

    Members
    -------
    params : dict
        The router's parameters.
    stay : int
        The tracked flit stays in one place (a queue slot, a slot of the ejection buffer) at
        most ``stay`` cycles, so it leaves within :attr:`bound` cycles of entering its queue.
        The least bound that holds (the next lower one has a counterexample).
    """

    params: dict
    stay: int

    @property
    def bound(self):
        return self.stay * (self.params["depth"] + EJECT_DEPTH)


#: The corner router of a 2 × 2 mesh (east, south and local ports): each output is shared by at
#: most two queues, or by three whose flits all wait for the same room (the ejection buffer).
#: With a per-place bound of 5, a flit at the head of a queue for the ejection port waits while
#: the two other queues for it go first, each after the ejection buffer drained.
ROUTER_BOUNDED_CORNER = BoundedResponse(
    dict(payload_shape=1, x=0, y=0, rows=2, cols=2, coord_bits=1, depth=2, queues="voq",
         counter_bits=1), stay=6)

#: The middle router of a 3 × 3 mesh (all five ports): each output to a neighbour is shared by up
#: to four queues, the ejection port by five.
ROUTER_BOUNDED_MIDDLE = BoundedResponse(
    dict(payload_shape=1, x=1, y=1, rows=3, cols=3, coord_bits=2, depth=2, queues="voq",
         counter_bits=1), stay=10)

#: The router (1, 0) of a 3 × 3 mesh (west, east, south and local ports), where the plain
#: round-robin over eligible queues let a queue wait for ever: its south output is shared by
#: three queues whose flits wait for different queues of the next router.
ROUTER_BOUNDED_SHARED = BoundedResponse(
    dict(payload_shape=1, x=1, y=0, rows=3, cols=3, coord_bits=2, depth=2, queues="voq",
         counter_bits=1), stay=8)


def _bounded_statement(b):
    return (f"Bounded response: with receivers whose ready bits are never low for more than "
            f"{ROUTER_STALL} cycle in a row, the tracked flit stays at most {b.stay} cycles in "
            f"one queue slot or ejection-buffer slot and leaves at the latest in its {b.bound}th "
            f"cycle in the router (and is neither lost, duplicated nor misrouted, as in "
            f"router.delivery).")


def _mesh_text(p):
    return (f"{p['rows']}x{p['cols']} mesh, voq queues of depth {p['depth']} (registers, "
            f"`_observe`), {p['coord_bits']}-bit coordinates, 1-bit payload (the tracked flit's "
            f"mark)")


def _router_text(p):
    return (f"router ({p['x']}, {p['y']}) of {p['rows']}x{p['cols']}, {p['queues']} queues of "
            f"depth {p['depth']} (registers, `_observe`), {p['coord_bits']}-bit coordinates, 1-bit "
            f"payload (the tracked flit's mark)")


def _queue_places(m, r, marked):
    """Assert the invariants of what router ``r`` (built with ``_observe``) holds: queue levels
    in range; every queued flit waits in the queue of the output XY routing picks here and
    carries the port XY routing picks in the next router; every flit in the ejection buffer is
    addressed to this tile. Returns the places a flit can be in, as ``(here, distance)``:
    ``here`` is high when a copy of the flit ``marked`` picks out is in that queue slot or
    ejection-buffer slot, ``distance`` the number of places it still has to pass in this router
    (itself included)."""
    x, y = r.x, r.y

    def neighbour(d):
        dx, dy = PORT_DELTA[d]
        return x + dx, y + dy

    tag = f"r{x}{y}"
    places = []
    for (i, o), q in r.obs_queues.items():
        m.d.comb += Assert(q.obs_level <= q.depth, "queue level in range")
        oname = o.name.lower() if o is not None else "any"
        for k, slot in enumerate(q.obs_slots):
            e = r.entry_layout(Value.cast(slot))   # a raw word or a ScanQueue view
            here = Signal(name=f"at_{tag}_{i.name.lower()}_{oname}_{k}")
            m.d.comb += here.eq((q.obs_level > k) & marked(e.flit))
            places.append((here, k + 1 + (EJECT_DEPTH if o is Port.LOCAL else 0)))
            with m.If(q.obs_level > k):
                if o is None:
                    # `fifo` queues: the entry names its output here; the lookahead port is
                    # XY routing's at the neighbour that output leads to.
                    m.d.comb += Assert(xy_route(e.flit.dst, x, y) == e.port.as_value(),
                                       "flit queued off its XY route")
                    nxt = r._next_route(m, f"expect_{tag}_{i.name.lower()}_{k}", e.port,
                                        e.flit.dst).as_value()
                else:
                    m.d.comb += Assert(xy_route(e.flit.dst, x, y) == o,
                                       "flit queued off its XY route")
                    nxt = xy_route(e.flit.dst, *neighbour(o)) if o is not Port.LOCAL \
                        else Port.LOCAL
                m.d.comb += Assert(e.next.as_value() == nxt,
                                   "flit queued with a wrong lookahead port")
    ej = r.obs_eject
    m.d.comb += Assert(ej.obs_level <= ej.depth, "ejection level in range")
    for k, slot in enumerate(ej.obs_slots):
        f = r.flit(slot)
        here = Signal(name=f"at_{tag}_eject_{k}")
        m.d.comb += here.eq((ej.obs_level > k) & marked(f))
        places.append((here, k + 1))
        with m.If(ej.obs_level > k):
            m.d.comb += Assert((f.dst.x == x) & (f.dst.y == y),
                               "flit in the ejection buffer of the wrong tile")
    return places


class _RouterTrackHarness(Elaboratable):
    """One router, with its queues observed, under the environment of :class:`_RouterHarness`
    (any traffic on every input under the link rules; receivers that stall), tracking one flit:
    the only flit whose payload bit is set, chosen by the environment (any flit on any input, at
    any time). Since the router never looks at payloads, what holds for that flit holds for
    every flit.

    The invariants count its copies (every queue slot and ejection-buffer slot below the
    queue's level whose flit is marked): copies + departed = arrived ≤ 1; every queued flit
    sits in the queue of the output XY routing picks here and carries the port XY routing picks
    in the next router; every flit in the ejection buffer is addressed to this tile.
    ``check="bounded"`` (with ``bounded``, a :class:`BoundedResponse`) adds receivers whose
    ready bits are never low for more than :data:`ROUTER_STALL` cycles in a row and asserts
    that the flit stays at most ``bounded.stay`` cycles in one place and leaves within
    ``bounded.bound`` cycles.
    """

    def __init__(self, check, fault=None, params=ROUTER_DELIVERY_FORMAL, bounded=None):
        if bounded is not None:
            params = bounded.params
        self.check, self.fault, self.params, self.bounded = check, fault, params, bounded

    def elaborate(self, platform):
        m = Module()
        m.submodules.router = r = Router(**self.params, _fault=self.fault, _observe=True)
        x, y = r.x, r.y
        dirs = [d for d in DIRECTIONS if r.has_port(d)]

        def marked(f):
            return f.payload[0]

        inj = r.inject
        inside, ej_ready, out_ready = _router_environment(m, r)
        with m.If(inj.valid & marked(inj.payload)):
            m.d.comb += Assume(inside(inj.payload.dst))

        # The tracked flit: arrives at most once, on any input.
        arriving = [inj.valid & inj.ready & marked(inj.payload)]
        arriving += [r.link_in[d.value].valid & marked(r.link_in[d.value].payload)
                     for d in dirs]
        arrived = Signal()
        m.d.comb += Assume(_popcount([arrived, *arriving]) <= 1)
        with m.If(Cat(*arriving).any()):
            m.d.sync += arrived.eq(1)

        def neighbour(d):
            dx, dy = PORT_DELTA[d]
            return x + dx, y + dy

        # Departures, on the XY port, with the XY lookahead port of the next router.
        leaving = []
        for d in dirs:
            out = r.link_out[d.value]
            go = Signal(name=f"leaves_{d.name.lower()}")
            m.d.comb += go.eq(out.valid & marked(out.payload))
            leaving.append(go)
            with m.If(go):
                m.d.comb += [
                    Assert(xy_route(out.payload.dst, x, y) == d,
                           f"tracked flit left on {d.name}, not its XY port"),
                    Assert(out.port.as_value() == xy_route(out.payload.dst, *neighbour(d)),
                           f"tracked flit left on {d.name} with a wrong lookahead port")]
        ejecting = Signal()
        m.d.comb += ejecting.eq(r.eject.valid & r.eject.ready & marked(r.eject.payload))
        leaving.append(ejecting)
        with m.If(ejecting):
            m.d.comb += Assert((r.eject.payload.dst.x == x) & (r.eject.payload.dst.y == y),
                               "tracked flit ejected at the wrong tile")
        departed = Signal(2)
        m.d.sync += departed.eq(departed + _popcount(leaving))

        places = _queue_places(m, r, marked)
        copies = _popcount([p for p, _ in places])
        m.d.comb += [Assert(departed <= 1, "tracked flit left more than once"),
                     Assert(copies + departed == arrived, "tracked flit lost or duplicated")]
        self.m, self.places = m, places
        self.ej_ready, self.out_ready = ej_ready, out_ready
        if self.check == "bounded":
            self._check_bounded()
        return m

    def _check_bounded(self):
        m, places = self.m, self.places
        stall, stay_max = ROUTER_STALL, self.bounded.stay
        # Receivers: no ready bit low for more than `stall` cycles in a row.
        bits = [self.ej_ready] + [rdy[p] for rdy in self.out_ready.values()
                                  for p in range(len(Port))]
        for k, bit in enumerate(bits):
            low = Signal(range(stall + 1), name=f"low_run_{k}")
            m.d.sync += low.eq(Mux(bit, 0, low + 1))
            m.d.comb += [Assume(bit | (low < stall)), Assert(low <= stall, "low run in range")]
        # Where the flit is (one-hot over the places while present), how long it has stayed
        # there and how long it has been in the router.
        where = Cat(*(p for p, _ in places))
        present = where.any()
        prev = Signal(len(where))
        m.d.sync += prev.eq(where)
        dmax = max(dist for _, dist in places)
        dist = Const(0, range(dmax + 1))
        for p, dd in places:
            dist = Mux(p, dd, dist)
        total = stay_max * dmax   # self.bounded.bound
        stay, stay_r = Signal(range(stay_max + 1)), Signal(range(stay_max + 1))
        age, age_r = Signal(range(total + 1)), Signal(range(total + 1))
        m.d.comb += [stay.eq(Mux(present & (where == prev), stay_r + 1, 0)),
                     age.eq(Mux(present & prev.any(), age_r + 1, 0))]
        m.d.sync += [stay_r.eq(stay), age_r.eq(age)]
        with m.If(present):
            m.d.comb += [
                Assert(stay < stay_max, f"tracked flit stayed over {stay_max} cycles in one place"),
                Assert(age <= stay + stay_max * (dmax - dist), "age within the bound so far"),
                Assert(age < total, f"tracked flit still in the router after {total} cycles"),
            ]


class _QueueEquivHarness(Elaboratable):
    """The router's :class:`~rdakit.hdl.noc.router._ObservedQueue` beside the
    :class:`~amaranth.lib.fifo.SyncFIFO` it stands for, fed the same writes and reads: their
    ``w_rdy`` and ``r_rdy`` agree, and so does ``r_data`` while ``r_rdy``. The broken variant
    ``deeper`` builds the register queue one entry deeper."""

    def __init__(self, fault=None):
        self.fault = fault

    def elaborate(self, platform):
        m = Module()
        width, depth = QUEUE_EQUIV_WIDTH, ROUTER_DELIVERY_FORMAL["depth"]
        assert depth == EJECT_DEPTH   # one check covers the queues and the ejection buffer
        m.submodules.ref = ref = SyncFIFO(width=width, depth=depth)
        m.submodules.obs = obs = _ObservedQueue(width=width,
                                                depth=depth + (self.fault == "deeper"))
        w_en, w_data, r_en = AnySeq(1), AnySeq(width), AnySeq(1)
        for q in (ref, obs):
            m.d.comb += [q.w_en.eq(w_en), q.w_data.eq(w_data), q.r_en.eq(r_en)]
        m.d.comb += [Assert(ref.w_rdy == obs.w_rdy, "w_rdy differs"),
                     Assert(ref.r_rdy == obs.r_rdy, "r_rdy differs")]
        with m.If(ref.r_rdy):
            m.d.comb += Assert(ref.r_data == obs.r_data, "r_data differs")
        return m


def router_observed_queue(fault=None):
    """Router: the observed register queue behaves as the SyncFIFO of normal builds."""
    return _QueueEquivHarness(fault)


def router_delivery(fault=None):
    """Router: one tracked flit is neither lost nor duplicated and leaves on its XY port."""
    return _RouterTrackHarness("delivery", fault)


def router_delivery_fifo(fault=None):
    """Router delivery with ``fifo`` queues (one per input)."""
    return _RouterTrackHarness("delivery", fault, ROUTER_DELIVERY_FIFO)


def router_delivery_scan(fault=None):
    """Router delivery with ``scan`` queues (the oldest flit whose next queue has room)."""
    return _RouterTrackHarness("delivery", fault, ROUTER_DELIVERY_SCAN)


def router_bounded(fault=None):
    """Router: a tracked flit leaves within a bound, with receivers that stall boundedly
    (the corner router of a 2 × 2 mesh)."""
    return _RouterTrackHarness("bounded", fault, bounded=ROUTER_BOUNDED_CORNER)


def router_bounded_middle(fault=None):
    """Router: bounded response at the middle router of a 3 × 3 mesh (all five ports)."""
    return _RouterTrackHarness("bounded", fault, bounded=ROUTER_BOUNDED_MIDDLE)


def router_bounded_shared(fault=None):
    """Router: bounded response where three queues with different next queues share an
    output (the router (1, 0) of a 3 × 3 mesh)."""
    return _RouterTrackHarness("bounded", fault, bounded=ROUTER_BOUNDED_SHARED)


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
    :func:`_queue_places` for every router and the count of the flit's copies over all of
    them: copies + delivered = injected ≤ 1. Links carry a flit from one router's queue into the
    next router's queue in one cycle, so a flit is always in exactly one queue slot or
    ejection-buffer slot until its destination's ``eject`` port delivers it; every link is
    driven only towards a queue with room."""

    def __init__(self, fault=None, params=MESH_DELIVERY_FORMAL):
        self.fault, self.params = fault, params

    def elaborate(self, platform):
        from rdakit.hdl.noc.mesh import Mesh, tile_coords

        m = Module()
        m.submodules.mesh = mesh = Mesh(**self.params, _fault=self.fault, _observe=True)

        def marked(f):
            return f.payload[0]

        injected, delivered = [], []
        for t in range(mesh.n_tiles):
            x, y = tile_coords(t, mesh.cols)
            inj, ej = mesh.inject[t], mesh.eject[t]
            _stream_source(m, inj)
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
        m.d.comb += Assume(_popcount([arrived, *injected]) <= 1)
        with m.If(Cat(*injected).any()):
            m.d.sync += arrived.eq(1)
        departed = Signal(2)
        m.d.sync += departed.eq(departed + _popcount(delivered))

        places = []
        for r in mesh.obs_routers.values():
            places += _queue_places(m, r, marked)
            _assert_links_into_room(m, r)
        copies = _popcount([p for p, _ in places])
        m.d.comb += [Assert(departed <= 1, "tracked flit delivered more than once"),
                     Assert(copies + departed == arrived, "tracked flit lost or duplicated")]
        return m


def mesh_delivery(fault=None):
    """Mesh: one tracked flit is delivered exactly once, at its destination."""
    return _MeshTrackHarness(fault)


def exact_vbits(p):
    return exact_log2(p.max_vblocks)


def mu_blocks(fault=None):
    """Memory unit: blocks, slots and the block table are consistent (see the invariants)."""
    return _MUHarness("blocks", fault)


def mu_responses(fault=None):
    """Memory unit: every request gets exactly one response, in order."""
    return _MUHarness("responses", fault)


def mu_errors(fault=None):
    """Memory unit: a refused request changes nothing."""
    return _MUHarness("errors", fault)


def mu_weights(fault=None):
    """Memory unit: weighted reference counting against holders of weight shares."""
    return _MUHarness("weights", fault)


def refcount_counter(fault=None):
    """Counter-based reference counting with acknowledgement gating (Figure 1 scenario)."""
    return _CounterHarness(fault)


def mu_read_write(fault=None):
    """Memory unit: a read returns the last word written at that (buffer, index)."""
    return _MUHarness("read_write", fault)


# --- The list ----------------------------------------------------------------------------------

PROPERTIES = [
    Property(
        name="free_list.exclusive",
        statement="Every entry of a free list is exactly one of: held by the environment, on "
                  "the stack, never taken since reset; the head is never held; the count is "
                  "the number of entries not held.",
        harness=free_list_exclusive, params=f"depth={FREE_LIST_DEPTH}", depth=4,
        faults=("pop_keeps",)),
    Property(
        name="mu.blocks",
        statement="Every physical block is exactly one of: free (on the free list or never "
                  "taken) or mapped by one (live buffer, virtual block below its length); "
                  "every slot is live or free; the free-block count and held words match; the "
                  "pipeline's table reads match the tables.",
        harness=mu_blocks, params=MU_PARAMS_TEXT, depth=6,
        faults=("walk_keeps_entry",), fault_depth=13),
    Property(
        name="mu.responses",
        statement="Every accepted request gets exactly one response, in request order (tags "
                  "count requests); requests in flight are exactly those in the pipeline; the "
                  "response link holds valid and payload until ready.",
        harness=mu_responses, params=MU_PARAMS_TEXT, depth=6,
        faults=("len_no_response",), fault_depth=11),
    Property(
        name="mu.errors",
        statement="A request refused with an error status changes nothing (tables, free lists, "
                  "scratchpad, counts); under arbitrary requests collected weight never exceeds "
                  "total weight.",
        harness=mu_errors, params=MU_PARAMS_TEXT, depth=6,
        faults=("error_writes", "return_no_overflow"), fault_depth=11),
    Property(
        name="mu.weights",
        statement="Weighted reference counting with the environment as holders of weight "
                  "shares: for every live buffer total = collected + held + in flight; a buffer "
                  "is freed only when collected = total; no holder holds weight of a freed "
                  "buffer.",
        harness=mu_weights, params=MU_PARAMS_TEXT, depth=6,
        faults=("return_frees_early",), fault_depth=11),
    Property(
        name="mu.read_write",
        statement="A READ of a (buffer, index) returns the last word written there by WRITE or "
                  "APPEND, as FETCH_ADD and UNLOCK (by the ticket's holder) then changed it "
                  "(one word chosen by the solver, watched from its write to the free of its "
                  "buffer).",
        harness=mu_read_write, params=MU_PARAMS_TEXT, depth=6,
        faults=("append_no_tail", "fetch_add_stale"), fault_depth=16),
    Property(
        name="router.links",
        statement="With receivers that stall at will and any traffic on all five inputs: a "
                  "router drives a link only towards a queue with room (the link's ready bit "
                  "for the flit's lookahead port); its ejection port holds valid and payload "
                  "until taken.",
        harness=router_links, params=ROUTER_PARAMS_TEXT, depth=4,
        faults=("ignore_room",), fault_depth=6),
    Property(
        name="router.delivery",
        statement="One flit chosen by the environment (any flit, on any of the five inputs, at "
                  "any time), tracked through the router's queues: it is neither lost nor "
                  "duplicated (copies queued + departed = arrived, at most once); every queued "
                  "flit waits for the output XY routing picks and carries the port XY routing "
                  "picks in the next router; it leaves on that output with that lookahead port, "
                  "or on the ejection port only at its destination.",
        harness=router_delivery, params=_router_text(ROUTER_DELIVERY_FORMAL), depth=2,
        faults=("grant_keeps", "inject_ignores_room", "yx_local"), fault_depth=4),
    Property(
        name="router.delivery_fifo",
        statement="router.delivery for the `fifo` queue kind: one queue per input, whose "
                  "entries name their output here (every queued flit's output is XY routing's "
                  "and its lookahead port XY routing's at the neighbour that output leads to).",
        harness=router_delivery_fifo,
        params=_router_text(ROUTER_DELIVERY_FIFO), depth=2,
        faults=("inject_ignores_room", "yx_local"), fault_depth=4),
    Property(
        name="router.delivery_scan",
        statement="router.delivery for the `scan` queue kind: per-output queues from which the "
                  "oldest flit whose next queue has room leaves, so flits leave out of arrival "
                  "order; every entry of every queue is counted.",
        harness=router_delivery_scan,
        params=_router_text(ROUTER_DELIVERY_SCAN), depth=2,
        faults=("grant_keeps", "inject_ignores_room", "yx_local"), fault_depth=4),
    Property(
        name="router.bounded",
        statement=_bounded_statement(ROUTER_BOUNDED_CORNER),
        harness=router_bounded, params=_router_text(ROUTER_BOUNDED_CORNER.params), depth=7,
        faults=("fixed_priority",), fault_depth=10),
    Property(
        name="router.bounded_shared",
        statement=_bounded_statement(ROUTER_BOUNDED_SHARED) + " Here three queues whose flits "
                  "wait for different queues of the next router share the south output; the "
                  "broken variant is the round-robin of earlier versions (the pointer follows "
                  "every grant, past a queue that could not send), under which the flit can "
                  "wait for ever.",
        harness=router_bounded_shared, params=_router_text(ROUTER_BOUNDED_SHARED.params),
        depth=9, faults=("pointer_follows",), fault_depth=12),
    Property(
        name="router.bounded_middle",
        statement=_bounded_statement(ROUTER_BOUNDED_MIDDLE) + " The middle router: every "
                  "port, up to four queues per output to a neighbour and five for the ejection "
                  "port.",
        harness=router_bounded_middle, params=_router_text(ROUTER_BOUNDED_MIDDLE.params),
        depth=12, faults=("fixed_priority",), fault_depth=14, ci=False),
    Property(
        name="mesh.delivery",
        statement="A whole mesh, every tile injecting anything under the stream rules and every "
                  "ejection port stalling at will; one flit chosen by the environment (any "
                  "tile, any time, for any tile of the mesh) is delivered exactly once, on the "
                  "ejection port of its destination: copies in all routers' queues + delivered "
                  "= injected ≤ 1, with router.delivery's invariants in every router and every "
                  "link driven only towards a queue with room.",
        harness=mesh_delivery, params=_mesh_text(MESH_DELIVERY_FORMAL), depth=2,
        faults=("grant_keeps", "ignore_room", "yx_local"), fault_depth=4),
    Property(
        name="router.observed_queue",
        statement="The register queue that router.delivery and router.bounded build under "
                  "`_observe` behaves as the SyncFIFO of normal builds: under any writes and "
                  "reads, the same w_rdy and r_rdy, and the same r_data while r_rdy. Bounded "
                  "check of 8 cycles from reset; every state of the pair (levels, pointers, "
                  "live entries) is reached within 3.",
        harness=router_observed_queue, params="2 entries of 3 bits", mode="bmc", depth=8,
        faults=("deeper",)),
    Property(
        name="refcount.counter_gated",
        statement="Counter-based reference counting with acknowledgement gating: holder A "
                  "copies its reference to B with an INCREF and waits for its response before "
                  "handing the copy over; DECREFs and the INCREF cross a network that may "
                  "reorder them. While a holder holds the reference the buffer is not freed. "
                  "The broken variant without gating produces the paper's Figure 1(b): A's "
                  "DECREF overtakes the INCREF and frees the buffer while B holds it.",
        harness=refcount_counter, params=MU_PARAMS_TEXT.replace("weighted", "counter"),
        depth=6, faults=("ungated",), fault_depth=22),
]


def get_property(name):
    """The :class:`Property` called ``name``.

    Raises
    ------
    ValueError
        If there is no such property.
    """
    for prop in PROPERTIES:
        if prop.name == name:
            return prop
    names = ", ".join(p.name for p in PROPERTIES)
    raise ValueError(f"Property must be one of {names}, not {name!r}")


def prove(prop, *, fault=None, workdir=None, timeout=None):
    """Run ``prop`` (a :class:`Property` or its name), or its broken variant ``fault``, and
    return the :class:`~rdakit.sim.verify.formal.FormalResult`.

    Raises
    ------
    ValueError
        If ``fault`` is not one of the property's broken variants.
    """
    from rdakit.sim.verify.formal import run_sby

    if isinstance(prop, str):
        prop = get_property(prop)
    if fault is not None and fault not in prop.faults:
        raise ValueError(f"Fault of {prop.name} must be one of "
                         f"{', '.join(map(repr, prop.faults)) or 'none'}, not {fault!r}")
    name = prop.name.replace(".", "-") + (f"-{fault}" if fault else "")
    if fault is None:
        mode, depth = prop.mode, prop.depth
    else:
        # A broken variant must show a real counterexample from the initial state.
        mode, depth = "bmc", prop.fault_depth or prop.depth
    return run_sby(prop.harness(fault), name=name, mode=mode, depth=depth, workdir=workdir,
                   timeout=timeout)


def properties_table():
    """The Markdown table of :data:`PROPERTIES` in ``docs/verification.md``."""
    lines = ["| property | states | harness | parameters | mode, depth | broken variants "
             "(bounded check depth) | CI |", "|---|---|---|---|---|---|---|"]
    for prop in PROPERTIES:
        mode = "k-induction" if prop.mode == "prove" else "bounded"
        faults = ", ".join(f"`{f}`" for f in prop.faults) or "-"
        if prop.faults:
            faults += f" ({prop.fault_depth or prop.depth})"
        lines.append(f"| `{prop.name}` | {prop.statement} | `{prop.where}` | {prop.params} "
                     f"| {mode}, {prop.depth} | {faults} | {'yes' if prop.ci else 'no'} |")
    return "\n".join(lines)
