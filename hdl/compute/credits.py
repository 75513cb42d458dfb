"""Credit flow control of streams between CUs: the producer's credits and the consumer's
credits owed (``docs/compute-unit.md``, "Streams between CUs").

A producer CU holds one credit per word of room in its consumer's input queue; a QUEUE stream
sends a word only with a credit (:class:`CreditCounter`). The consumer owes a credit for every
word its stream takes from the queue and sends them back in batches (:class:`CreditReturn`).
So credits held + words in flight + words queued + credits owed + credits in flight stay equal
to the queue's depth, and a word always finds room: the proof is the formal property
``cu.credits`` (:mod:`rdakit.sim.verify.formal_harness.credits`).
"""

from amaranth.hdl import Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from rdakit.hdl.spec.cu import credit_batch

__all__ = ["CreditCounter", "CreditReturn"]


def _check_depth(queue_words):
    if not isinstance(queue_words, int) or isinstance(queue_words, bool) or queue_words < 1:
        raise TypeError(f"queue_words must be a positive integer, not {queue_words!r}")


class CreditCounter(wiring.Component):
    """The producer's credits: ``queue_words`` after ``clear``, one spent per word sent, those
    returned added back.

    Parameters
    ----------
    queue_words : int
        The consumer's input queue depth (every CU's ``CUParams.queue_words``).

    Members
    -------
    credits : Out(range(queue_words + 1))
        Credits held (a word may be sent while it is not 0).
    spend : In(1)
        A word is sent this cycle (only while ``credits`` is not 0).
    back : In(1), back_count : In(32)
        Credits returned by the consumer arrive.
    clear : In(1)
        The CU's start: every credit is held again.
    over : Out(1)
        The credits returned would take ``credits`` past ``queue_words`` (a protocol
        violation, QUEUE_OVERFLOW): they are dropped.

    Latency: ``credits`` changes at the clock edge after ``spend`` or ``back``.
    """

    def __init__(self, queue_words):
        _check_depth(queue_words)
        self.queue_words = queue_words
        super().__init__({
            "credits": Out(range(queue_words + 1), init=queue_words),
            "spend": In(1),
            "back": In(1),
            "back_count": In(32),
            "clear": In(1),
            "over": Out(1),
        })

    def elaborate(self, platform):
        m = Module()
        q = self.queue_words
        total = Signal(33)
        m.d.comb += [total.eq(self.credits + Mux(self.back, self.back_count, 0)),
                     self.over.eq(total > q)]
        with m.If(self.over):
            m.d.sync += self.credits.eq(self.credits - self.spend)
        with m.Else():
            m.d.sync += self.credits.eq(total - self.spend)
        with m.If(self.clear):
            m.d.sync += self.credits.eq(q)
        return m


class CreditReturn(wiring.Component):
    """The consumer's credits owed: one per word taken from the input queue, sent back in one
    message while the queue is popped every cycle and ``credit_batch(queue_words)`` are owed,
    and in any cycle without a pop (a stalled or finished stream never keeps a credit).

    Parameters
    ----------
    queue_words : int
        The input queue depth.

    Members
    -------
    pop : In(1)
        A word is taken from the queue this cycle.
    free : In(1)
        A credit message can be loaded into the message register this cycle (the CU runs).
    send : Out(1)
        A credit message carrying ``count`` is loaded this cycle.
    count : Out(range(queue_words + 1))
        The credits owed.
    clear : In(1)
        The CU's start: nothing is owed.

    Latency: ``send`` is combinational from ``count``, ``pop`` and ``free``; ``count`` becomes
    this cycle's pop (0 or 1) after a send.
    """

    def __init__(self, queue_words):
        _check_depth(queue_words)
        self.queue_words = queue_words
        super().__init__({
            "pop": In(1),
            "free": In(1),
            "send": Out(1),
            "count": Out(range(queue_words + 1)),
            "clear": In(1),
        })

    def elaborate(self, platform):
        m = Module()
        batch = credit_batch(self.queue_words)
        m.d.comb += self.send.eq(self.free & (self.count != 0)
                                 & ((self.count >= batch) | ~self.pop))
        self.settle(m)
        with m.If(self.clear):
            m.d.sync += self.count.eq(0)
        return m

    def settle(self, m):
        """What is owed after this cycle: what was not sent, plus this cycle's pop."""
        m.d.sync += self.count.eq(Mux(self.send, 0, self.count) + self.pop)
