"""The formal harness of counter-based reference counting (the paper's Figure 1 scenario)."""

from amaranth.asserts import AnySeq
from amaranth.hdl import Assert, Assume, Mux, Signal

from rdakit.hdl.spec.packets import MUOp, MUStatus
from rdakit.sim.verify.formal_harness.common import popcount
from rdakit.sim.verify.formal_harness.memory import MU_FORMAL, MUHarness, mu_state

__all__ = ["refcount_counter"]


class _CounterHarness(MUHarness):
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
        n_dec = popcount([v & (op == MUOp.DECREF) for v, op in zip(self.net_valid, self.net_op,
                                                                   strict=True)]
                          + [obs.s1_valid & (s1.op == MUOp.DECREF)])
        n_inc = popcount([v & (op == MUOp.INCREF) for v, op in zip(self.net_valid, self.net_op,
                                                                   strict=True)]
                          + [obs.s1_valid & (s1.op == MUOp.INCREF)])
        n_alloc = popcount([v & (op == MUOp.ALLOC) for v, op in zip(self.net_valid, self.net_op,
                                                                    strict=True)]
                            + [obs.s1_valid & (s1.op == MUOp.ALLOC)])
        inc_ack = obs.s2_valid & (s2.op == MUOp.INCREF)
        alloc_ack = obs.s2_valid & (s2.op == MUOp.ALLOC)
        phase = self.phase
        with m.If(~mu_state(obs, "INIT")):
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



def refcount_counter(fault=None):
    """Counter-based reference counting with acknowledgement gating (Figure 1 scenario)."""
    return _CounterHarness(fault)

