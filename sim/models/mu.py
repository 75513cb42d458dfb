"""Transaction-level golden model of the memory unit (MU).

:class:`MUModel` implements ``docs/memory-unit.md`` exactly, response by response: the checks in
their documented order, the allocation policies of the three allocation modes, both
reference-counting modes, and the *physical* scratchpad, so that a word never written inside a
reused block or region reads as whatever the hardware's memory last held there. A testbench
compares ``unpack(mu_response_layout(p), rtl_value)`` with :meth:`MUModel.request` by ``==``.
The model also knows the documented timing of each request (:attr:`MUModel.exec_cycles`) and
what every counter port of the RTL reads (:meth:`MUModel.counters`).

The module also has one helper per operation (:func:`alloc`, :func:`write`, :func:`append`,
:func:`read`, :func:`length`, :func:`ret`, :func:`add_weight`, :func:`incref`, :func:`decref`)
that builds a request dict.
"""

from rdakit.hdl.spec.packets import (
    MUOp,
    MUStatus,
    mu_request_layout,
    mu_response_layout,
    pack,
    unpack,
)
from rdakit.hdl.spec.params import AllocMode, MUParams, RefcountMode

__all__ = [
    "MUModel", "ModelInvariantError",
    "alloc", "write", "append", "read", "length", "ret", "add_weight", "incref", "decref",
    "fetch_add", "unlock",
]


class ModelInvariantError(Exception):
    """An internal invariant of :class:`MUModel` does not hold (a bug in the model)."""


_OK = MUStatus.OK
_OUT_OF_MEMORY = MUStatus.OUT_OF_MEMORY
_BAD_REF = MUStatus.BAD_REF
_OUT_OF_RANGE = MUStatus.OUT_OF_RANGE
_WEIGHT_OVERFLOW = MUStatus.WEIGHT_OVERFLOW
_BAD_REQUEST = MUStatus.BAD_REQUEST
_NOT_OWNER = MUStatus.NOT_OWNER

# Operations that take a second execute cycle once their checks pass.
_TWO_CYCLE_OPS = (MUOp.ALLOC.value, MUOp.FETCH_ADD.value, MUOp.UNLOCK.value)

# What the response's 4-bit ``op`` field unpacks to: a member for a valid encoding, else the int.
_OP_ECHO = tuple(MUOp(v) if v in MUOp._value2member_map_ else v for v in range(16))


class _Buffer:
    """The buffer-table entry of a live slot (the model keeps no entry for a free slot)."""

    __slots__ = ("slot", "gen", "length", "total", "collected", "blocks", "base", "order")

    def __init__(self, slot, gen, total):
        self.slot = slot
        self.gen = gen
        self.length = 0
        self.total = total       # total weight, or the count in COUNTER mode
        self.collected = 0       # always 0 in COUNTER mode
        self.blocks = {}         # VIRTUAL: virtual block -> physical block
        self.base = 0            # RESERVE: region base address; SINGLE: 0
        self.order = 0           # RESERVE: size class, capacity = reserve_words << order


class MUModel:
    """Golden model of one memory unit, at the transaction level.

    Each call to :meth:`request` is one request and returns its one response. The model has no
    clock, but it counts the execute cycles each request takes in the RTL without back-pressure
    (``docs/memory-unit.md``, Timing: the latency is one more). Every error response has
    ``data = 0`` and leaves the model exactly as it was (but for the cycle counts).

    Parameters
    ----------
    params : MUParams
        The MU's parameters, including its allocation and reference-counting modes.
    mu_id : int
        The MU ID this unit answers to; a request whose ``ref.mu`` differs gets ``BAD_REF``.

    Members
    -------
    params : MUParams
    mu_id : int
    held_words : int
        Words kept for live buffers: mapped blocks times ``block_words`` (``virtual``), the sum
        of live capacities (``reserve``), ``words`` per live buffer (``single``).
    peak_held_words : int
        Largest ``held_words`` since construction.
    live_words : int
        Sum of the lengths of the live buffers.
    allocs, frees : int
        Successful ALLOCs, and buffers freed.
    copy_words : int
        Words copied by ``reserve``-mode growth.
    growths : int
        ``reserve``-mode moves to a larger region.
    exec_cycles : int
        Execute cycles of the last request: 1, but 2 for an ALLOC that passed its checks and a
        FETCH_ADD or UNLOCK that passed theirs (NOT_OWNER included), ``2 + max(1, ceil(length /
        block_words))`` for a free in ``virtual`` mode (2 in the others), ``length + 3`` for a
        ``reserve`` growth. Its latency is ``exec_cycles + 1`` cycles.
    busy_cycles : int
        Sum of ``exec_cycles`` over every request: the RTL's ``busy_cycles`` counter without
        back-pressure on its responses.

    Raises
    ------
    TypeError
        If ``params`` is not an :class:`MUParams` or ``mu_id`` does not fit ``mu_id_bits``.
    """

    def __init__(self, params, mu_id=0):
        if not isinstance(params, MUParams):
            raise TypeError(f"params must be an MUParams, not {params!r}")
        if (not isinstance(mu_id, int) or isinstance(mu_id, bool)
                or not 0 <= mu_id < 1 << params.mu_id_bits):
            raise TypeError(f"mu_id must be an integer between 0 and "
                            f"{(1 << params.mu_id_bits) - 1}, not {mu_id!r}")
        self.params = params
        self.mu_id = mu_id
        p = params
        self._mode = p.alloc_mode
        self._slot_bits = p.slot_bits
        self._slot_mask = p.max_buffers - 1
        self._gen_mask = (1 << p.gen_bits) - 1
        self._offset_bits = p.offset_bits
        self._offset_mask = p.block_words - 1
        self._reserve_bits = p.reserve_words.bit_length() - 1
        self._max_weight = p.max_weight
        self._max_buffer_words = p.max_buffer_words
        self._field_widths = (p.coord_bits, p.tag_bits, p.mu_id_bits, p.buf_id_bits,
                              p.index_bits, p.data_bits)
        self._cluster_bits = p.cluster_bits
        self._data_mask = (1 << p.data_bits) - 1

        # Physical state, as the hardware holds it after reset.
        self._mem = [0] * p.words
        self._slot_stack = []                    # freed slots, most recent last
        self._slot_fresh = 0                     # lowest slot never used
        self._gen = [0] * p.max_buffers
        self._live = [None] * p.max_buffers      # _Buffer of each live slot
        self._n_live = 0
        self._block_stack = []                   # freed physical blocks, most recent last
        self._block_fresh = 0                    # lowest block never used
        self._region_stacks = [[] for _ in range(p.n_orders)]
        self._bump = 0

        self.held_words = 0
        self.peak_held_words = 0
        self.live_words = 0
        self.allocs = 0
        self.frees = 0
        self.copy_words = 0
        self.growths = 0
        self.exec_cycles = 0
        self.busy_cycles = 0
        self._freed_length = 0                   # length of the buffer the last free freed

        weighted = p.refcount is RefcountMode.WEIGHTED
        handlers = [self._bad_request] * 16
        handlers[MUOp.ALLOC.value] = self._alloc
        handlers[MUOp.WRITE.value] = self._write
        handlers[MUOp.APPEND.value] = self._append
        handlers[MUOp.READ.value] = self._read
        handlers[MUOp.LEN.value] = self._len
        handlers[MUOp.FETCH_ADD.value] = self._fetch_add
        handlers[MUOp.UNLOCK.value] = self._unlock
        if weighted:
            handlers[MUOp.RETURN.value] = self._return
            handlers[MUOp.ADD_WEIGHT.value] = self._add_weight
        else:
            handlers[MUOp.INCREF.value] = self._incref
            handlers[MUOp.DECREF.value] = self._decref
        self._handlers = tuple(handlers)
        self._store = {AllocMode.VIRTUAL: self._store_virtual,
                       AllocMode.RESERVE: self._store_reserve,
                       AllocMode.SINGLE: self._store_single}[self._mode]
        self._load = {AllocMode.VIRTUAL: self._load_virtual,
                      AllocMode.RESERVE: self._load_reserve,
                      AllocMode.SINGLE: self._load_single}[self._mode]

    # Requests and responses.

    def request(self, req):
        """Apply one request and return its response.

        Parameters
        ----------
        req : dict
            The fields of :func:`~rdakit.hdl.spec.packets.mu_request_layout`: ``op`` (an
            :class:`MUOp` or an int), ``src`` (``{x, y}``), ``tag``, ``ref`` (``{mu, buf}``),
            ``index``, ``data``. Missing fields (also inside ``src`` and ``ref``) are 0.

        Returns
        -------
        dict
            The response as :func:`~rdakit.hdl.spec.packets.unpack` of
            :func:`~rdakit.hdl.spec.packets.mu_response_layout` gives it: ``op`` (the request's op,
            an :class:`MUOp` or, for 9 to 15, an int), ``status`` (:class:`MUStatus`), ``dst``
            (the request's ``src``), ``tag``, ``ref`` and ``data``.

        Raises
        ------
        ValueError
            If a field does not fit its width in the packet.
        """
        op = req.get("op", 0)
        if isinstance(op, MUOp):
            op = op.value
        src = req.get("src")
        x, y = (src.get("x", 0), src.get("y", 0)) if src else (0, 0)
        tag = req.get("tag", 0)
        ref = req.get("ref")
        mu, buf = (ref.get("mu", 0), ref.get("buf", 0)) if ref else (0, 0)
        index = req.get("index", 0)
        data = req.get("data", 0)
        cb, tb, mb, bb, ib, db = self._field_widths
        if ((op >> 4) | (x >> cb) | (y >> cb) | (tag >> tb) | (mu >> mb) | (buf >> bb)
                | (index >> ib) | (data >> db)):
            self._reject_fields(op, x, y, tag, mu, buf, index, data)

        dst = {"x": x, "y": y}
        if self._cluster_bits:
            cluster = src.get("cluster", 0) if src else 0
            if cluster >> self._cluster_bits:
                raise ValueError(f"Field 'src.cluster' must fit in {self._cluster_bits} bits, "
                                 f"not {cluster!r}")
            dst["cluster"] = cluster
        frees, growths, copied = self.frees, self.growths, self.copy_words
        status, rdata, new_ref = self._handlers[op](mu, buf, index, data)
        self.exec_cycles = cycles = self._cycles(op, status, frees, growths, copied)
        self.busy_cycles += cycles
        return {
            "op": _OP_ECHO[op],
            "status": status,
            "dst": dst,
            "tag": tag,
            "ref": new_ref if new_ref is not None else {"mu": mu, "buf": buf},
            "data": rdata,
        }

    def request_int(self, value):
        """Apply one packed request (an int of ``mu_request_layout``); return the packed
        response (an int of ``mu_response_layout``)."""
        p = self.params
        return pack(mu_response_layout(p), self.request(unpack(mu_request_layout(p), value)))

    def _cycles(self, op, status, frees, growths, copied):
        """Execute cycles of a request that gave ``status``, given the counts before it."""
        if status is not _OK and status is not _NOT_OWNER:
            return 1                               # every check fails in the first cycle
        if op in _TWO_CYCLE_OPS:
            return 2                               # a second table or scratchpad read
        if self.frees != frees:
            if self._mode is AllocMode.VIRTUAL:    # a walk over the virtual blocks
                return 2 + max(1, -(-self._freed_length >> self._offset_bits))
            return 2
        if self.growths != growths:                # the copy, one word a cycle
            return self.copy_words - copied + 3
        return 1

    def _reject_fields(self, op, x, y, tag, mu, buf, index, data):
        cb, tb, mb, bb, ib, db = self._field_widths
        for name, value, width in (("op", op, 4), ("src.x", x, cb), ("src.y", y, cb),
                                   ("tag", tag, tb), ("ref.mu", mu, mb), ("ref.buf", buf, bb),
                                   ("index", index, ib), ("data", data, db)):
            if value >> width:
                raise ValueError(f"Field {name!r} must fit in {width} bits, not {value!r}")

    def _lookup(self, mu, buf):
        """The live buffer a reference names, or None if the reference is not valid."""
        if mu != self.mu_id:
            return None
        b = self._live[buf & self._slot_mask]
        if b is None or b.gen != (buf >> self._slot_bits) & self._gen_mask:
            return None
        return b

    # Operations. Each returns (status, data, new ref or None) and changes nothing on an error.

    def _bad_request(self, mu, buf, index, data):
        return _BAD_REQUEST, 0, None

    def _alloc(self, mu, buf, index, data):
        if data == 0:
            return _BAD_REQUEST, 0, None
        if data > self._max_weight:
            return _WEIGHT_OVERFLOW, 0, None
        if not self._slot_stack and self._slot_fresh == len(self._live):
            return _OUT_OF_MEMORY, 0, None
        mode = self._mode
        if mode is AllocMode.SINGLE and self._n_live:
            return _OUT_OF_MEMORY, 0, None
        base = 0
        if mode is AllocMode.RESERVE:
            base = self._take_region(0)
            if base is None:
                return _OUT_OF_MEMORY, 0, None
        if self._slot_stack:
            slot = self._slot_stack.pop()
        else:
            slot = self._slot_fresh
            self._slot_fresh += 1
        gen = self._gen[slot]
        b = _Buffer(slot, gen, data)
        b.base = base
        self._live[slot] = b
        self._n_live += 1
        self.allocs += 1
        if mode is AllocMode.RESERVE:
            self._hold(self.params.reserve_words)
        elif mode is AllocMode.SINGLE:
            self._hold(self.params.words)
        return _OK, data, {"mu": self.mu_id, "buf": gen << self._slot_bits | slot}

    def _write(self, mu, buf, index, data):
        b = self._lookup(mu, buf)
        if b is None:
            return _BAD_REF, 0, None
        if index >= self._max_buffer_words:
            return _OUT_OF_RANGE, 0, None
        if not self._store(b, index, data):
            return _OUT_OF_MEMORY, 0, None
        return _OK, index, None

    def _append(self, mu, buf, index, data):
        b = self._lookup(mu, buf)
        if b is None:
            return _BAD_REF, 0, None
        index = b.length
        if index == self._max_buffer_words:
            return _OUT_OF_RANGE, 0, None
        if not self._store(b, index, data):
            return _OUT_OF_MEMORY, 0, None
        return _OK, index, None

    def _read(self, mu, buf, index, data):
        b = self._lookup(mu, buf)
        if b is None:
            return _BAD_REF, 0, None
        if index >= b.length:
            return _OUT_OF_RANGE, 0, None
        return _OK, self._load(b, index), None

    def _rmw_address(self, mu, buf, index):
        """(status, physical address) of the word a FETCH_ADD or UNLOCK changes."""
        b = self._lookup(mu, buf)
        if b is None:
            return _BAD_REF, None
        if index >= b.length:
            return _OUT_OF_RANGE, None
        if self._mode is AllocMode.VIRTUAL:
            block = b.blocks.get(index >> self._offset_bits)
            if block is None:
                return _OUT_OF_RANGE, None       # a hole never written holds no word
            return _OK, block << self._offset_bits | index & self._offset_mask
        if self._mode is AllocMode.RESERVE:
            return _OK, b.base + index
        return _OK, index

    def _fetch_add(self, mu, buf, index, data):
        status, addr = self._rmw_address(mu, buf, index)
        if status is not _OK:
            return status, 0, None
        old = self._mem[addr]
        self._mem[addr] = (old + data) & self._data_mask
        return _OK, old, None

    def _unlock(self, mu, buf, index, data):
        status, addr = self._rmw_address(mu, buf, index)
        if status is not _OK:
            return status, 0, None
        old = self._mem[addr]
        if old != data:
            return _NOT_OWNER, 0, None
        self._mem[addr] = (old + 1) & self._data_mask
        return _OK, old, None

    def _len(self, mu, buf, index, data):
        b = self._lookup(mu, buf)
        if b is None:
            return _BAD_REF, 0, None
        return _OK, b.length, None

    def _return(self, mu, buf, index, data):
        b = self._lookup(mu, buf)
        if b is None:
            return _BAD_REF, 0, None
        if data == 0:
            return _BAD_REQUEST, 0, None
        outstanding = b.total - b.collected
        if data > outstanding:
            return _WEIGHT_OVERFLOW, 0, None
        b.collected += data
        outstanding -= data
        if outstanding == 0:
            self._free(b)
        return _OK, outstanding, None

    def _add_weight(self, mu, buf, index, data):
        b = self._lookup(mu, buf)
        if b is None:
            return _BAD_REF, 0, None
        if data == 0:
            return _BAD_REQUEST, 0, None
        if b.total + data > self._max_weight:
            return _WEIGHT_OVERFLOW, 0, None
        b.total += data
        return _OK, b.total, None

    def _incref(self, mu, buf, index, data):
        b = self._lookup(mu, buf)
        if b is None:
            return _BAD_REF, 0, None
        if b.total == self._max_weight:
            return _WEIGHT_OVERFLOW, 0, None
        b.total += 1
        return _OK, b.total, None

    def _decref(self, mu, buf, index, data):
        b = self._lookup(mu, buf)
        if b is None:
            return _BAD_REF, 0, None
        b.total -= 1
        if b.total == 0:
            self._free(b)
        return _OK, b.total, None

    # Placement. A store returns False (having changed nothing) if it needs memory there is not.

    def _store_virtual(self, b, index, data):
        vblock = index >> self._offset_bits
        block = b.blocks.get(vblock)
        if block is None:
            if self._block_stack:
                block = self._block_stack.pop()
            elif self._block_fresh < self.params.n_blocks:
                block = self._block_fresh
                self._block_fresh += 1
            else:
                return False
            b.blocks[vblock] = block
            self._hold(self.params.block_words)
        self._mem[block << self._offset_bits | index & self._offset_mask] = data
        self._extend(b, index)
        return True

    def _store_reserve(self, b, index, data):
        capacity = self.params.reserve_words << b.order
        if index >= capacity:
            # The smallest class whose capacity exceeds index:
            # 2**(order - 1) <= index / reserve_words < 2**order.
            order = (index >> self._reserve_bits).bit_length()
            base = self._take_region(order)
            if base is None:
                return False
            n = b.length
            mem = self._mem
            mem[base:base + n] = mem[b.base:b.base + n]
            self.copy_words += n
            self.growths += 1
            self._region_stacks[b.order].append(b.base)
            b.base = base
            b.order = order
            self._hold((self.params.reserve_words << order) - capacity)
        self._mem[b.base + index] = data
        self._extend(b, index)
        return True

    def _store_single(self, b, index, data):
        self._mem[index] = data
        self._extend(b, index)
        return True

    def _load_virtual(self, b, index):
        block = b.blocks.get(index >> self._offset_bits)
        if block is None:
            return 0                           # a hole never mapped reads as 0
        return self._mem[block << self._offset_bits | index & self._offset_mask]

    def _load_reserve(self, b, index):
        return self._mem[b.base + index]

    def _load_single(self, b, index):
        return self._mem[index]

    def _extend(self, b, index):
        if index >= b.length:
            self.live_words += index + 1 - b.length
            b.length = index + 1

    def _take_region(self, order):
        stack = self._region_stacks[order]
        if stack:
            return stack.pop()
        size = self.params.reserve_words << order
        if self._bump + size > self.params.words:
            return None
        base = self._bump
        self._bump += size
        return base

    def _hold(self, n):
        self.held_words += n
        if self.held_words > self.peak_held_words:
            self.peak_held_words = self.held_words

    def _free(self, b):
        mode = self._mode
        if mode is AllocMode.VIRTUAL:
            # Blocks go back in increasing virtual-block order: the last one released (the
            # highest virtual block) is the first one the next allocation takes.
            blocks = b.blocks
            self._block_stack.extend(blocks[v] for v in sorted(blocks))
            self.held_words -= len(blocks) * self.params.block_words
        elif mode is AllocMode.RESERVE:
            self._region_stacks[b.order].append(b.base)
            self.held_words -= self.params.reserve_words << b.order
        else:
            self.held_words -= self.params.words
        self._freed_length = b.length
        slot = b.slot
        self._live[slot] = None
        self._n_live -= 1
        self._slot_stack.append(slot)
        self._gen[slot] = (self._gen[slot] + 1) & self._gen_mask
        self.live_words -= b.length
        self.frees += 1

    # Introspection.

    def counters(self):
        """What the RTL's counter ports read once every response has left, by port name:
        ``held_words``, ``peak_held_words``, ``live_buffers``, ``free_blocks`` (0 outside
        ``virtual`` mode), ``free_slots``, ``allocs``, ``frees``, ``copy_cycles`` (the words
        copied) and ``busy_cycles`` (as the RTL counts it without back-pressure; with
        back-pressure the RTL's is larger)."""
        virtual = self._mode is AllocMode.VIRTUAL
        return {
            "held_words": self.held_words,
            "peak_held_words": self.peak_held_words,
            "live_buffers": self._n_live,
            "free_blocks": len(self._block_stack) + self.params.n_blocks - self._block_fresh
            if virtual else 0,
            "free_slots": len(self._slot_stack) + self.params.max_buffers - self._slot_fresh,
            "allocs": self.allocs,
            "frees": self.frees,
            "copy_cycles": self.copy_words,
            "busy_cycles": self.busy_cycles,
        }

    def free_slots(self):
        """Free buffer slots, in the order allocations will take them."""
        return self._slot_stack[::-1] + list(range(self._slot_fresh, self.params.max_buffers))

    def free_blocks(self):
        """Free physical blocks (``virtual`` mode), in the order writes will take them.

        In the other modes blocks are not used and this is every block in increasing order.
        """
        return self._block_stack[::-1] + list(range(self._block_fresh, self.params.n_blocks))

    def free_regions(self):
        """Freed regions (``reserve`` mode): ``{order: [base, ...]}`` in the order allocations
        of that class take them. Memory from :attr:`bump` up has never been reserved."""
        return {order: stack[::-1] for order, stack in enumerate(self._region_stacks)}

    @property
    def bump(self):
        """The ``reserve``-mode bump pointer: the lowest address never reserved."""
        return self._bump

    def generation(self, slot):
        """The current generation of ``slot``."""
        return self._gen[slot]

    def live_buffers(self):
        """The live buffers: ``{slot: info}``.

        ``info`` is a dict with ``ref`` (the reference, ``{mu, buf}``), ``gen``, ``length``,
        ``total`` (the count in ``counter`` mode), ``collected``, ``capacity`` (words it may hold
        without taking memory: mapped blocks times ``block_words`` in ``virtual`` mode),
        ``blocks`` (``{virtual block: physical block}``, ``virtual``) and ``base`` and ``order``
        (``reserve``; ``base`` is 0 in ``single`` mode).
        """
        p = self.params
        out = {}
        for b in self._live:
            if b is None:
                continue
            if self._mode is AllocMode.VIRTUAL:
                capacity = len(b.blocks) * p.block_words
            elif self._mode is AllocMode.RESERVE:
                capacity = p.reserve_words << b.order
            else:
                capacity = p.max_buffer_words
            out[b.slot] = {
                "ref": {"mu": self.mu_id, "buf": b.gen << self._slot_bits | b.slot},
                "gen": b.gen, "length": b.length, "total": b.total, "collected": b.collected,
                "capacity": capacity, "blocks": dict(b.blocks), "base": b.base, "order": b.order,
            }
        return out

    def after_reset(self):
        """The model of this MU after a run-time reset: a reset clears every table but not the
        scratchpad, so the new model starts from this one's words."""
        fresh = MUModel(self.params, self.mu_id)
        fresh._mem = list(self._mem)
        return fresh

    def memory(self):
        """A copy of the physical scratchpad (a list of ``words`` ints)."""
        return list(self._mem)

    def snapshot(self):
        """Everything the model holds, as a value comparable with ``==`` (a deep copy)."""
        return (
            tuple(self._mem), tuple(self._slot_stack), self._slot_fresh, tuple(self._gen),
            self.live_buffers(), tuple(self._block_stack), self._block_fresh,
            tuple(tuple(s) for s in self._region_stacks), self._bump,
            self.held_words, self.peak_held_words, self.live_words, self.allocs, self.frees,
            self.copy_words, self.growths,
        )

    def check_invariants(self):
        """Check the model's internal consistency.

        Raises
        ------
        ModelInvariantError
            If a physical block is both free and mapped, neither, or mapped twice (``virtual``);
            if regions overlap or leave the scratchpad (``reserve``); if a slot is both free and
            live, or neither; if a live buffer has collected all its weight (or a zero count),
            a length past its capacity, or ``held_words`` and ``live_words`` disagree with the
            buffers.
        """
        p = self.params

        def fail(message):
            raise ModelInvariantError(message)

        # Slots: each one exactly once, either free or live.
        free_slots = self.free_slots()
        if len(set(free_slots)) != len(free_slots):
            fail(f"free-slot list holds a slot twice: {free_slots}")
        for slot in range(p.max_buffers):
            b = self._live[slot]
            is_free = slot in free_slots
            if (b is not None) == is_free:
                state = "both free and live" if is_free else "neither free nor live"
                fail(f"slot {slot} is {state}")
            if b is not None and (b.slot != slot or b.gen != self._gen[slot]):
                fail(f"slot {slot} holds a buffer of slot {b.slot} generation {b.gen}, "
                     f"generation is {self._gen[slot]}")
        live = [b for b in self._live if b is not None]
        if len(live) != self._n_live:
            fail(f"live count is {self._n_live}, but {len(live)} slots are live")
        if self._mode is AllocMode.SINGLE and len(live) > 1:
            fail(f"single mode has {len(live)} live buffers")

        for b in live:
            if p.refcount is RefcountMode.COUNTER and b.collected:
                fail(f"slot {b.slot} has collected weight {b.collected} in counter mode")
            if not 0 <= b.collected < b.total <= p.max_weight:
                fail(f"slot {b.slot} has collected {b.collected} of total {b.total} "
                     f"(max {p.max_weight}) and is still live")
            if not 0 <= b.length <= p.max_buffer_words:
                fail(f"slot {b.slot} has length {b.length}")

        # Placement and held words.
        if self._mode is AllocMode.VIRTUAL:
            free_blocks = self.free_blocks()
            owner = {}
            for block in free_blocks:
                if block in owner:
                    fail(f"block {block} is in the free-block list twice")
                owner[block] = "free"
            for b in live:
                for vblock, block in b.blocks.items():
                    if not 0 <= vblock < p.max_vblocks or vblock * p.block_words >= b.length:
                        fail(f"slot {b.slot} maps virtual block {vblock} with length "
                             f"{b.length}")
                    if block in owner:
                        state = "both free and mapped" if owner[block] == "free" else \
                            f"mapped twice (also by slot {owner[block]})"
                        fail(f"block {block} is {state}")
                    owner[block] = b.slot
            missing = sorted(set(range(p.n_blocks)) - set(owner))
            if missing:
                fail(f"blocks {missing} are neither free nor mapped")
            held = sum(len(b.blocks) for b in live) * p.block_words
        elif self._mode is AllocMode.RESERVE:
            regions = [(base, p.reserve_words << order, "free")
                       for order, stack in enumerate(self._region_stacks) for base in stack]
            regions += [(b.base, p.reserve_words << b.order, b.slot) for b in live]
            regions.sort(key=lambda r: r[0])
            end = 0
            for base, size, who in regions:
                if base < end or base + size > self._bump:
                    fail(f"region [{base}, {base + size}) of {who} overlaps another or lies "
                         f"past the bump pointer {self._bump}")
                end = base + size
            if self._bump > p.words:
                fail(f"bump pointer {self._bump} is past the scratchpad ({p.words} words)")
            if sum(size for _, size, _ in regions) != self._bump:
                fail(f"regions cover {sum(s for _, s, _ in regions)} words below the bump "
                     f"pointer {self._bump}")
            for b in live:
                if b.length > p.reserve_words << b.order:
                    fail(f"slot {b.slot} has length {b.length} past its capacity")
            held = sum(p.reserve_words << b.order for b in live)
        else:
            held = len(live) * p.words
        if held != self.held_words:
            fail(f"held_words is {self.held_words}, but live buffers hold {held}")
        if self.peak_held_words < self.held_words:
            fail(f"peak_held_words {self.peak_held_words} is below held_words "
                 f"{self.held_words}")
        live_words = sum(b.length for b in live)
        if live_words != self.live_words:
            fail(f"live_words is {self.live_words}, but live buffers are {live_words} long")
        if self.allocs - self.frees != len(live):
            fail(f"{self.allocs} allocs and {self.frees} frees leave {len(live)} live buffers")


# Request builders. ``ref`` is a reference dict ``{mu, buf}`` (as an ALLOC response gives it).

def _request(op, ref=None, index=0, data=0, src=None, tag=0):
    return {
        "op": op,
        "src": {"x": 0, "y": 0} if src is None else {
            "x": src.get("x", 0), "y": src.get("y", 0),
            **({"cluster": src["cluster"]} if "cluster" in src else {})},
        "tag": tag,
        "ref": {"mu": 0, "buf": 0} if ref is None else {"mu": ref["mu"], "buf": ref["buf"]},
        "index": index,
        "data": data,
    }


def alloc(weight, *, src=None, tag=0):
    """ALLOC a buffer of total weight (or initial count) ``weight``."""
    return _request(MUOp.ALLOC, data=weight, src=src, tag=tag)


def write(ref, index, data, *, src=None, tag=0):
    """WRITE ``data`` at ``index`` of ``ref``."""
    return _request(MUOp.WRITE, ref, index, data, src, tag)


def append(ref, data, *, src=None, tag=0):
    """APPEND ``data`` to ``ref``."""
    return _request(MUOp.APPEND, ref, 0, data, src, tag)


def read(ref, index, *, src=None, tag=0):
    """READ the word at ``index`` of ``ref``."""
    return _request(MUOp.READ, ref, index, 0, src, tag)


def length(ref, *, src=None, tag=0):
    """LEN of ``ref``."""
    return _request(MUOp.LEN, ref, 0, 0, src, tag)


def ret(ref, w, *, src=None, tag=0):
    """RETURN weight ``w`` of ``ref`` (partial-free)."""
    return _request(MUOp.RETURN, ref, 0, w, src, tag)


def add_weight(ref, k, *, src=None, tag=0):
    """ADD_WEIGHT ``k`` to the total weight of ``ref``."""
    return _request(MUOp.ADD_WEIGHT, ref, 0, k, src, tag)


def incref(ref, *, src=None, tag=0):
    """INCREF ``ref`` (counter mode)."""
    return _request(MUOp.INCREF, ref, 0, 0, src, tag)


def decref(ref, *, src=None, tag=0):
    """DECREF ``ref`` (counter mode)."""
    return _request(MUOp.DECREF, ref, 0, 0, src, tag)


def fetch_add(ref, index, k, *, src=None, tag=0):
    """FETCH_ADD ``k`` to word ``index`` of ``ref``."""
    return _request(MUOp.FETCH_ADD, ref, index, k, src, tag)


def unlock(ref, index, ticket, *, src=None, tag=0):
    """UNLOCK the ticket lock whose serving word is ``index`` of ``ref``, holding ``ticket``."""
    return _request(MUOp.UNLOCK, ref, index, ticket, src, tag)
