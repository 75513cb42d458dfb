"""The inter-cluster link: a narrow, slow, credit-flow-controlled channel between two clusters.

See ``docs/clusters.md``. A :class:`Link` carries packets of any shape over ``width`` wires
with ``latency`` cycles of wire delay: each packet is cut into ``ceil(bits / width)`` beats,
lowest bits first, which cross a delay line of ``latency`` registers and are put together again
in a receive queue. The sender holds one credit per free place of that queue, spends one per
packet and gets it back, ``latency`` cycles late, when the packet leaves the queue, so a packet
is never sent to a full queue and nothing is ever dropped or duplicated.
"""

from amaranth.hdl import Cat, Module, Shape, Signal
from amaranth.lib import fifo, stream, wiring
from amaranth.lib.wiring import In, Out

__all__ = ["Link", "link_beats", "link_depth", "check_link_params"]


def link_beats(bits, width):
    """Beats a packet of ``bits`` bits takes on a link ``width`` bits wide."""
    return -(-bits // width)


def link_depth(bits, width, latency):
    """The receive-queue depth (credits) that lets a link run at one packet every
    ``link_beats(bits, width)`` cycles: enough packets to cover a credit's round trip."""
    beats = link_beats(bits, width)
    return -(-(2 * latency + beats + 3) // beats) + 1


def check_link_params(bits, *, width, latency, depth):
    """Validate a link's parameters for packets of ``bits`` bits; return the depth
    (:func:`link_depth` if ``depth`` is ``None``). Raises ``TypeError`` naming the parameter."""
    for name, value, hi in (("width", width, min(bits, 4096)), ("latency", latency, 256)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= hi:
            raise TypeError(f"{name} must be an integer from 1 to {hi}, not {value!r}")
    if depth is None:
        depth = link_depth(bits, width, latency)
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= 1024:
        raise TypeError(f"depth must be an integer from 1 to 1024, not {depth!r}")
    return depth


class Link(wiring.Component):
    """A point-to-point link of ``width`` wires and ``latency`` cycles, credit flow controlled.

    A packet accepted on ``i`` appears on ``o`` ``beats + latency + 2`` cycles later at the
    earliest (``beats = ceil(bits / width)``); packets leave in order, unchanged, each exactly
    once, whatever ``o.ready`` does. The link accepts one packet every ``beats`` cycles while it
    has credits; with the default ``depth`` it never runs out of them unless ``o`` stalls.

    Parameters
    ----------
    shape : shape-castable
        Shape of a packet.
    width : int
        Wires of the link, 1 to the packet's width (at most 4096).
    latency : int
        Cycles of wire delay each way (1 to 256); credits return with the same delay.
    depth : int or None
        Places in the receive queue (credits), 1 to 1024; ``None`` means
        :func:`link_depth`, enough for full throughput.

    Members
    -------
    i : In(stream.Signature(shape))
        Packets to send.
    o : Out(stream.Signature(shape))
        Packets received.
    packets : Out(32)
        Packets sent so far (the bits that crossed are ``packets * bits``).
    busy_cycles : Out(32)
        Cycles in which a beat was on the wires.

    Raises
    ------
    TypeError
        If a parameter has the wrong type or is out of range.
    """

    def __init__(self, shape, *, width, latency, depth=None):
        try:
            bits = Shape.cast(shape).width
        except TypeError:
            raise TypeError(f"shape must be a shape-castable object, not {shape!r}") from None
        if bits < 1:
            raise TypeError(f"shape must be at least 1 bit wide, not {shape!r}")
        depth = check_link_params(bits, width=width, latency=latency, depth=depth)
        self.shape = shape
        self.bits, self.width, self.latency, self.depth = bits, width, latency, depth
        self.beats = link_beats(bits, width)
        super().__init__({
            "i": In(stream.Signature(shape)),
            "o": Out(stream.Signature(shape)),
            "packets": Out(32),
            "busy_cycles": Out(32),
        })

    def elaborate(self, platform):
        m = Module()
        w, beats, bits = self.width, self.beats, self.bits

        # Sender: a shift register emptied ``w`` bits a cycle, lowest bits first.
        credits = Signal(range(self.depth + 1), init=self.depth)
        shreg = Signal(beats * w)
        left = Signal(range(beats + 1))
        credit_back = Signal()
        take = Signal()
        m.d.comb += [
            self.i.ready.eq((left <= 1) & (credits != 0)),
            take.eq(self.i.valid & self.i.ready),
        ]
        m.d.sync += credits.eq(credits + credit_back - take)
        with m.If(take):
            m.d.sync += [shreg.eq(self.i.payload), left.eq(beats),
                         self.packets.eq(self.packets + 1)]
        with m.Elif(left != 0):
            m.d.sync += [shreg.eq(shreg >> w), left.eq(left - 1)]
        with m.If(left != 0):
            m.d.sync += self.busy_cycles.eq(self.busy_cycles + 1)

        # The wires: ``latency`` registers of (valid, last, beat).
        valid, last, beat = left != 0, left == 1, shreg[:w]
        for k in range(self.latency):
            v, lst, b = Signal(name=f"wire{k}_valid"), Signal(name=f"wire{k}_last"), \
                Signal(w, name=f"wire{k}_beat")
            m.d.sync += [v.eq(valid), lst.eq(last), b.eq(beat)]
            valid, last, beat = v, lst, b

        # Receiver: beats shift in from the top, so the first beat ends in the low bits.
        m.submodules.queue = queue = fifo.SyncFIFOBuffered(width=bits, depth=self.depth)
        acc = Signal(beats * w)
        whole = Cat(acc[w:], beat)
        with m.If(valid):
            m.d.sync += acc.eq(whole)
        m.d.comb += [
            queue.w_data.eq(whole[:bits]),
            queue.w_en.eq(valid & last),
            self.o.valid.eq(queue.r_rdy),
            self.o.payload.eq(queue.r_data),
            queue.r_en.eq(self.o.ready),
        ]

        # Credits travel back over ``latency`` registers too.
        back = self.o.valid & self.o.ready
        for k in range(self.latency):
            c = Signal(name=f"credit{k}")
            m.d.sync += c.eq(back)
            back = c
        m.d.comb += credit_back.eq(back)
        return m
