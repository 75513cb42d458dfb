"""A free list: a LIFO stack of released entries in front of entries never used since reset."""

from amaranth.hdl import Module, Mux, Signal, unsigned
from amaranth.lib import memory, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import ceil_log2

__all__ = ["FreeList"]


class FreeList(wiring.Component):
    """Free list of the integers ``0 .. depth - 1`` (physical blocks, buffer slots, regions).

    A pop takes the most recently pushed entry if there is one, otherwise (with ``fresh``) the
    lowest entry never taken since reset. So reset is instant (no memory to initialize) and the
    order in which entries are handed out is fully determined, which the golden model of the
    memory unit reproduces. Without ``fresh`` the list starts empty and holds only what is
    pushed (the region lists of the reserve-and-copy allocator).

    The stack lives in a memory with a transparent read port addressed by the *next* stack
    pointer, so ``head`` is valid in every cycle, including right after a push, and a pop and a
    push may happen in the same cycle.

    Parameters
    ----------
    depth : int
        Number of entries (at least 1).
    width : int or None
        Width of an entry; ``None`` means ``ceil_log2(depth)`` (at least 1).
    fresh : bool
        Whether entries never taken since reset are free (``True``) or the list starts empty.

    Members
    -------
    head : Out(width)
        The entry a pop takes now. Meaningless when ``empty``.
    empty : Out(1)
        Nothing to pop.
    count : Out(range(depth + 1))
        Entries free.
    pop : In(1)
        Take ``head`` at the end of this cycle. Must not be asserted when ``empty``.
    push : In(1)
        Release ``push_data`` at the end of this cycle. Must not overflow ``depth``.
    push_data : In(width)
        The entry released.

    Raises
    ------
    TypeError
        If ``depth`` is not a positive integer or ``width`` is too narrow.

    Notes
    -----
    The private, test-only argument ``_observe=True`` serves the formal proofs
    (``rdakit.sim.verify.formal_harness``): it adds the members ``obs_stack`` (every stack
    entry, through combinational read ports), ``obs_n`` (entries on the stack) and
    ``obs_taken`` (fresh entries handed out), so that invariants can name the state. The
    harnesses' broken variants are subclasses that override :meth:`_pop_stack`.
    """

    def __init__(self, depth, *, width=None, fresh=True, _observe=False):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise TypeError(f"Depth must be a positive integer, not {depth!r}")
        if width is None:
            width = max(1, ceil_log2(depth))
        if not isinstance(width, int) or width < 1 or (fresh and (depth - 1) >> width):
            raise TypeError(f"Width must be a positive integer that holds {depth - 1}, "
                            f"not {width!r}")
        self.depth = depth
        self.width = width
        self.fresh = fresh
        self._observe = bool(_observe)
        if self._observe:
            self.obs_stack = [Signal(width, name=f"obs_stack_{k}") for k in range(depth)]
            self.obs_n = Signal(range(depth + 1))
            self.obs_taken = Signal(range(depth + 1))
        super().__init__({
            "head": Out(width),
            "empty": Out(1),
            "count": Out(range(depth + 1)),
            "pop": In(1),
            "push": In(1),
            "push_data": In(width),
        })

    def _pop_stack(self, m, n, n_next):
        """Drive ``n_next``, the number of entries on the stack after a pop from it (and no
        push) in a cycle with ``n`` entries."""
        m.d.comb += n_next.eq(n - 1)

    def elaborate(self, platform):
        m = Module()
        m.submodules.mem = mem = memory.Memory(shape=unsigned(self.width), depth=self.depth,
                                               init=[])
        wp = mem.write_port()
        rp = mem.read_port(transparent_for=(wp,))

        n = Signal(range(self.depth + 1))          # entries on the stack
        n_next = Signal.like(n)
        taken = Signal(range(self.depth + 1))      # fresh entries handed out since reset
        taken_next = Signal.like(taken)
        on_stack = n != 0

        m.d.comb += [
            n_next.eq(n),
            taken_next.eq(taken),
            wp.data.eq(self.push_data),
        ]
        if self.fresh:
            m.d.comb += [
                self.head.eq(Mux(on_stack, rp.data, taken)),
                self.empty.eq(~on_stack & (taken == self.depth)),
                self.count.eq(n + (self.depth - taken)),
            ]
        else:
            m.d.comb += [
                self.head.eq(rp.data),
                self.empty.eq(~on_stack),
                self.count.eq(n),
            ]

        with m.If(self.pop & self.push):
            # Replace the top of the stack, or take a fresh entry and start the stack.
            m.d.comb += wp.en.eq(1)
            with m.If(on_stack):
                m.d.comb += wp.addr.eq(n - 1)
            with m.Else():
                m.d.comb += [wp.addr.eq(0), n_next.eq(1)]
                if self.fresh:
                    m.d.comb += taken_next.eq(taken + 1)
        with m.Elif(self.pop):
            with m.If(on_stack):
                self._pop_stack(m, n, n_next)
            with m.Else():
                m.d.comb += taken_next.eq(taken + 1)
        with m.Elif(self.push):
            m.d.comb += [wp.en.eq(1), wp.addr.eq(n), n_next.eq(n + 1)]

        m.d.comb += [rp.en.eq(1), rp.addr.eq(n_next - 1)]
        m.d.sync += [n.eq(n_next), taken.eq(taken_next)]
        if self._observe:
            for k, obs in enumerate(self.obs_stack):
                port = mem.read_port(domain="comb")
                m.d.comb += [port.addr.eq(k), obs.eq(port.data)]
            m.d.comb += [self.obs_n.eq(n), self.obs_taken.eq(taken)]
        return m
