"""MU capacity bookkeeping of the lowering.

:class:`Account` bounds what may be live in every MU at every allocation, under every timing
of the programs; :func:`replay_refs` gives the references the host's buffers get on a freshly
reset fabric, refusing what the MUs would refuse. Both compute from
:class:`~rdakit.hdl.spec.params.MUParams` what the allocator of ``docs/memory-unit.md`` does
(the golden model, :class:`rdakit.sim.models.mu.MUModel`, is checked against it in
``tests/compiler/test_lower_capacity.py``).
"""

import heapq

from rdakit.compiler.lower.layout import LoweringError
from rdakit.hdl.spec.packets import MUStatus
from rdakit.hdl.spec.params import AllocMode

__all__ = ["Account", "replay_refs"]


class _Buffer:
    """A buffer of the account: its MU, units, total weight, the stamps of its returned shares,
    and once every share is back, ``need``: the clock each returning CU's component must reach
    for the buffer to be certainly free (the latest of its returns on that CU)."""

    __slots__ = ("key", "units", "weight", "rets", "need", "revoked", "dead_for")

    def __init__(self, key, units, weight):
        self.key, self.units, self.weight = key, units, weight
        self.rets = []
        self.need = None
        self.revoked = False          # a share returned beyond its weight: never free
        self.dead_for = []            # the views that count it free


class _View:
    """What one CU knows of one MU's buffers: the units and slots of those certainly free by
    its latest event, how far it has read the MU's log of fully returned buffers, and per CU
    index a heap of the buffers waiting for that CU's clock to reach a value."""

    __slots__ = ("cursor", "units", "slots", "heaps")

    def __init__(self, n):
        self.cursor = 0
        self.units = self.slots = 0
        self.heaps = [[] for _ in range(n)]


class Account:
    """MU capacity, checked at every allocation with a bound that is safe under every timing.

    Every sync event (token or reference sent or received), allocation and return of a share
    gets a vector clock as the programs are generated (the global order of generation is a
    linearization of the programs' happens-before order). A buffer is certainly freed before an
    ALLOC if every share of it has been returned by an event that happens before the ALLOC
    (RETI waits for its response); every other buffer allocated before (in generation order)
    in the same MU is counted as live. That bounds the live set at every moment: in any
    reachable state, the live buffer allocated last was allocated while all the others were
    counted. Host buffers are allocated before the start (the host's shares of inputs and
    constant pools are returned by the CUs that read them); reference tables are live
    throughout. In ``reserve`` mode the regions of freed buffers are still counted (they return
    to per-class lists, not to the bump allocator); ``single`` mode has one buffer slot.

    The bookkeeping is incremental, so a whole lowering costs about linear time in its
    buffers rather than a scan of every earlier buffer at each ALLOC: a CU's vector clock only
    grows, so a buffer free for it stays free; each (MU, CU) view keeps the totals of the
    buffers free for that CU and files each fully returned buffer under one return it has not
    heard of yet (a heap per CU component), looked at again only when its clock passes it."""

    def __init__(self, params, cus):
        mp = params.mu
        self.mp = mp
        self.mode = mp.alloc_mode
        self.mus = params.tiles("M")
        self.cap = mp.n_blocks if self.mode is AllocMode.VIRTUAL else mp.words
        self.cap_slots = 1 if self.mode is AllocMode.SINGLE else mp.max_buffers
        self.index = {cu: i for i, cu in enumerate(cus)}
        self.vc = {cu: [0] * len(cus) for cu in cus}
        self.host = {m: [0, 0] for m in self.mus}    # static totals of the host buffers
        self.total = {m: [0, 0] for m in self.mus}   # units and slots of every buffer added
        self.done = {m: [] for m in self.mus}        # buffers with every share returned
        self.views = {}                              # (MU, CU index) -> _View
        self.by_key = {}
        self.mu_of = {}
        self.peak = {m: [0, 0] for m in self.mus}
        self._seq = 0                                # ties in the heaps

    def units(self, words):
        """Blocks (virtual) or words (reserve: every region of its growth; single) held."""
        if self.mode is AllocMode.VIRTUAL:
            return -(-words // self.mp.block_words)
        if self.mode is AllocMode.RESERVE:
            size = total = self.mp.reserve_words
            while size < words:
                size *= 2
                total += size
            return total
        return words

    def unit_words(self, units):
        return units * self.mp.block_words if self.mode is AllocMode.VIRTUAL else units

    # Vector clocks.

    def tick(self, cu):
        v = self.vc[cu]
        v[self.index[cu]] += 1
        return (self.index[cu], tuple(v))

    def next_stamp(self, cu):
        """The stamp :meth:`tick` will give ``cu``'s next event if nothing is merged first
        (to ask :meth:`fits` without making an event)."""
        v = list(self.vc[cu])
        v[self.index[cu]] += 1
        return (self.index[cu], tuple(v))

    def merge(self, cu, stamp):
        v = self.vc[cu]
        for i, x in enumerate(stamp[1]):
            if x > v[i]:
                v[i] = x

    @staticmethod
    def before(e, f):
        """Whether event ``e`` happens before event ``f`` (both ``(cu index, clock)``)."""
        return e[1][e[0]] <= f[1][e[0]] and e != f

    # Buffers.

    def add(self, m, key, units, weight):
        buf = _Buffer(key, units, weight)
        self.total[m][0] += units
        self.total[m][1] += 1
        self.by_key[key] = buf
        self.mu_of[key] = m
        if weight == 0:
            self._complete(m, buf)

    def _complete(self, m, buf):
        need = {}
        for i, clock in buf.rets:
            need[i] = max(need.get(i, 0), clock[i])
        buf.need = need
        self.done[m].append(buf)

    def _check(self, view, c, buf, vc):
        """Count ``buf`` free in ``view`` (of CU index ``c`` at clock ``vc``) if every return
        happens before, else file it under the first return that does not."""
        if buf.revoked:
            return
        for i, clock in buf.need.items():
            # An event of CU c itself happens before c's later events only (the stamp of the
            # query is never a return's, but a return of c at the query's clock is not before).
            at = clock + 1 if i == c else clock
            if vc[i] < at:
                self._seq += 1
                heapq.heappush(view.heaps[i], (at, self._seq, buf))
                return
        view.units += buf.units
        view.slots += 1
        buf.dead_for.append(view)

    def live(self, m, stamp):
        """Units and slots of the buffers of MU ``m`` that may be live at event ``stamp``.

        The stamps of one CU must come in the order of its events (its clock only grows)."""
        c, vc = stamp
        view = self.views.get((m, c))
        if view is None:
            view = self.views[(m, c)] = _View(len(vc))
        log = self.done[m]
        while view.cursor < len(log):
            view.cursor += 1
            self._check(view, c, log[view.cursor - 1], vc)
        for i, heap in enumerate(view.heaps):
            while heap and heap[0][0] <= vc[i]:
                self._check(view, c, heapq.heappop(heap)[2], vc)
        u, s = self.total[m]
        return (u if self.mode is AllocMode.RESERVE else u - view.units), s - view.slots

    def fits(self, m, units, stamp):
        u, s = self.live(m, stamp)
        return u + units <= self.cap and s + 1 <= self.cap_slots

    def alloc(self, m, key, units, weight, stamp):
        u, s = self.live(m, stamp)
        self.peak[m] = [max(self.peak[m][0], u + units), max(self.peak[m][1], s + 1)]
        self.add(m, key, units, weight)

    def ret(self, key, stamp):
        buf = self.by_key.get(key)
        if buf is None or buf.weight is None:
            return
        buf.rets.append(stamp)
        if len(buf.rets) == buf.weight:
            self._complete(self.mu_of[key], buf)
        elif len(buf.rets) == buf.weight + 1:
            # More returns than shares: never certainly free (counted live again).
            buf.revoked = True
            for view in buf.dead_for:
                view.units -= buf.units
                view.slots -= 1
            buf.dead_for = []

    def room(self, stamp):
        best_u = best_s = 0
        for m in self.mus:
            u, s = self.live(m, stamp)
            best_u = max(best_u, self.cap - u)
            best_s = max(best_s, self.cap_slots - s)
        return self.unit_words(best_u), best_s


class _HostBuffer:
    """A buffer the host allocated on a fresh MU: its slot, length and (reserve mode) region."""

    def __init__(self, slot, base):
        self.slot = slot
        self.base = base
        self.order = 0
        self.length = 0


class _FreshMU:
    """The allocator of one MU from reset as the host uses it: allocations and appends, never
    a free, so slots are handed out in order with generation 0, physical blocks (``virtual``)
    and regions (``reserve``) come from the never-used ones or, for regions, from those a
    growing buffer left behind.

    Every method returns the :class:`MUStatus` the MU answers; on an error nothing changed.
    """

    def __init__(self, mp):
        self.mp = mp
        self.slots = 0
        self.blocks = 0
        self.bump = 0
        self.regions = [[] for _ in range(mp.n_orders)]

    def _take_region(self, order):
        if self.regions[order]:
            return self.regions[order].pop()
        size = self.mp.reserve_words << order
        if self.bump + size > self.mp.words:
            return None
        base = self.bump
        self.bump += size
        return base

    def alloc(self, weight):
        """ALLOC with total weight ``weight``: ``(status, buffer or None)``."""
        mp = self.mp
        if weight >> mp.data_bits:
            raise ValueError(f"Field 'data' must fit in {mp.data_bits} bits, not {weight!r}")
        if weight == 0:
            return MUStatus.BAD_REQUEST, None
        if weight > mp.max_weight:
            return MUStatus.WEIGHT_OVERFLOW, None
        if self.slots == mp.max_buffers or (mp.alloc_mode is AllocMode.SINGLE and self.slots):
            return MUStatus.OUT_OF_MEMORY, None
        base = 0
        if mp.alloc_mode is AllocMode.RESERVE:
            base = self._take_region(0)
            if base is None:
                return MUStatus.OUT_OF_MEMORY, None
        self.slots += 1
        return MUStatus.OK, _HostBuffer(self.slots - 1, base)

    def append(self, buf):
        """APPEND one word to ``buf``."""
        mp = self.mp
        index = buf.length
        if index == mp.max_buffer_words:
            return MUStatus.OUT_OF_RANGE
        if mp.alloc_mode is AllocMode.VIRTUAL and index % mp.block_words == 0:
            if self.blocks == mp.n_blocks:
                return MUStatus.OUT_OF_MEMORY
            self.blocks += 1
        elif mp.alloc_mode is AllocMode.RESERVE and index >= mp.reserve_words << buf.order:
            # Grow into the smallest class whose capacity exceeds index; the old region goes
            # back to its class's list.
            order = (index >> (mp.reserve_words.bit_length() - 1)).bit_length()
            base = self._take_region(order)
            if base is None:
                return MUStatus.OUT_OF_MEMORY
            self.regions[buf.order].append(buf.base)
            buf.base, buf.order = base, order
        buf.length += 1
        return MUStatus.OK


def replay_refs(job):
    """The references the host gets for ``job``'s buffers on a freshly reset fabric: its
    allocations (and appends) replayed, in order, on the allocator of each MU.

    Returns
    -------
    dict
        Host buffer name -> reference (``mu_id | slot << mu_id_bits``).

    Raises
    ------
    LoweringError
        If an MU refuses an allocation or an append; the message names the MU, the buffer and
        the MU's status.
    """
    p = job.params
    mus, refs = {}, {}
    for b in job.buffers:
        mu = tuple(b.mu)
        fresh = mus.setdefault(mu, _FreshMU(p.mu))
        status, buf = fresh.alloc(b.weight)
        if status is not MUStatus.OK:
            raise LoweringError(f"MU {mu} refuses host buffer {b.name!r}: {status.name}")
        for _ in range(b.words):
            status = fresh.append(buf)
            if status is not MUStatus.OK:
                raise LoweringError(f"MU {mu} cannot hold host buffer {b.name!r}: "
                                    f"{status.name}")
        refs[b.name] = p.mu_id(*mu) | buf.slot << p.mu.mu_id_bits
    return refs
