"""The formal harness of credit flow control between CUs (streams between CUs, issue 18).

A producer's :class:`~rdakit.hdl.compute.credits.CreditCounter` and a consumer's
:class:`~rdakit.hdl.compute.credits.CreditReturn` with the consumer's input queue (the
``SyncFIFOBuffered`` of ``queue_words + 1`` entries the stream engine builds) between them; the
environment plays everything else: the producer's stream sends whenever it holds a credit and
wants to, the network delivers words after any delay, the consumer's stream pops whenever a
word is there and it wants to, the consumer's message register is free when the environment
says (it may carry the consumer's own words), and credit messages cross the network (a
register, then one more slot) after any delay.

The property: credits held + words in flight + words queued + credits owed + credits in
messages = ``queue_words``, always; so a word never arrives at a full queue and returned
credits never pass the depth.
"""

from amaranth.asserts import AnySeq
from amaranth.hdl import Assert, Module, Mux, Signal
from amaranth.lib import fifo

from rdakit.hdl.compute.credits import CreditCounter, CreditReturn
from rdakit.sim.verify.formal_harness.common import refuses_unknown, variant

__all__ = ["CREDITS_QUEUE_WORDS", "CREDIT_VARIANTS", "credits_conserved"]

#: The queue depth under proof (a batch of ``credit_batch(3)`` = 1: every path is exercised).
CREDITS_QUEUE_WORDS = 3


class _KeepsOwed(CreditReturn):
    """``returns_twice``: a credit message leaves but the credits stay owed, so they are
    returned again with the next one."""

    def settle(self, m):
        m.d.sync += self.count.eq(self.count + self.pop)


CREDIT_VARIANTS = {None: CreditReturn, "returns_twice": _KeepsOwed}


@refuses_unknown(CREDIT_VARIANTS)
def credits_conserved(fault=None):
    """Producer and consumer credits around one input queue (see the module docstring)."""
    m = Module()
    q = CREDITS_QUEUE_WORDS
    m.submodules.held = held = CreditCounter(q)
    m.submodules.owed = owed = variant(CREDIT_VARIANTS, fault)(q)
    m.submodules.queue = queue = fifo.SyncFIFOBuffered(width=1, depth=q + 1)

    # Words: the producer sends with a credit; the network holds them for any time.
    in_flight = Signal(range(q + 1))
    send = AnySeq(1) & (held.credits != 0)
    arrive = AnySeq(1) & (in_flight != 0)
    m.d.comb += [held.spend.eq(send), held.clear.eq(0), owed.clear.eq(0)]
    m.d.sync += in_flight.eq(in_flight + send - arrive)
    overflow = arrive & (queue.level >= q)
    m.d.comb += [queue.w_en.eq(arrive & ~overflow), queue.w_data.eq(0)]

    # The consumer's stream pops when it wants to.
    pop = AnySeq(1) & queue.r_rdy
    m.d.comb += [queue.r_en.eq(pop), owed.pop.eq(pop)]

    # Credit messages: the consumer's message register, then a slot of the network; each moves
    # on when the environment lets it (the register also when it is free for a credit).
    reg_valid, reg_count = Signal(), Signal(range(q + 1))
    net_valid, net_count = Signal(), Signal(range(q + 1))
    deliver = net_valid & AnySeq(1)
    advance = reg_valid & (~net_valid | deliver) & AnySeq(1)
    m.d.comb += [owed.free.eq((~reg_valid | advance) & AnySeq(1)),
                 held.back.eq(deliver), held.back_count.eq(net_count)]
    with m.If(owed.send):
        m.d.sync += [reg_valid.eq(1), reg_count.eq(owed.count)]
    with m.Elif(advance):
        m.d.sync += reg_valid.eq(0)
    with m.If(advance):
        m.d.sync += [net_valid.eq(1), net_count.eq(reg_count)]
    with m.Elif(deliver):
        m.d.sync += net_valid.eq(0)

    total = (held.credits + in_flight + queue.level + owed.count
             + Mux(reg_valid, reg_count, 0) + Mux(net_valid, net_count, 0))
    m.d.comb += [
        Assert(total == q, "credits held + words in flight + queued + owed + credits in flight "
                           "is the queue depth"),
        Assert(~overflow, "a word arrived at a full queue"),
        Assert(~held.over, "returned credits passed the queue depth"),
    ]
    return m
