"""Constrained-random requests for a memory unit (MU), for scoreboard tests.

:class:`MUStimulus` makes requests and learns from the responses it is shown: the references it
holds come from ALLOC responses, their lengths and weights from later responses, and a reference
is dropped (and kept as a stale one) when a response says it was freed or is not valid. It never
looks inside the MU, so the same stimulus drives the golden model and the RTL; it also works when
several requests are in flight before their responses come back (it then sometimes makes a
request that fails, which the scoreboard checks like any other).

:func:`random_requests` runs a stimulus against a :class:`~rdakit.sim.models.mu.MUModel` and yields
its requests, for pure-Python use.
"""

import random

from rdakit.hdl.spec.packets import MUOp, MUStatus
from rdakit.hdl.spec.params import AllocMode, MUParams, RefcountMode
from rdakit.sim.models.mu import MUModel

__all__ = ["MUStimulus", "random_requests", "PROFILES"]

#: The traffic profiles of :class:`MUStimulus`.
PROFILES = ("mixed", "fill", "stream")

_REF_OPS = (MUOp.WRITE, MUOp.APPEND, MUOp.READ, MUOp.LEN, MUOp.RETURN, MUOp.ADD_WEIGHT,
            MUOp.INCREF, MUOp.DECREF)
_STALE_KEEP = 16
_OP_OF = {op.value: op for op in MUOp}


class _View:
    """What the stimulus knows of one reference it holds."""

    __slots__ = ("buf", "length", "total", "outstanding", "full", "vblocks", "seen")

    def __init__(self, buf, weight):
        self.buf = buf
        self.length = 0
        self.total = weight          # the count in COUNTER mode
        self.outstanding = weight    # weight not yet returned; the count in COUNTER mode
        self.full = False            # an APPEND answered OUT_OF_RANGE
        self.vblocks = set()         # virtual blocks written (so mapped, in VIRTUAL mode)
        self.seen = {}               # index -> the word last seen there (for UNLOCK tickets)


class MUStimulus:
    """A constrained-random source of requests for one MU, steered by the responses.

    Call :meth:`next_request` for a request and :meth:`observe` with each request and its
    response, in response order (requests may be in flight in between).

    Parameters
    ----------
    params : MUParams
        The MU's parameters (the stimulus follows its allocation and reference-counting modes).
    seed : int
        Seed of the stimulus' own random generator; the requests depend only on it and on the
        responses.
    mu_id : int
        The MU ID of the unit under test.
    profile : str
        ``"mixed"``: mostly READ/WRITE/APPEND on live references, with ALLOCs, frees (RETURN or
        DECREF), weight updates (ADD_WEIGHT or INCREF) and about one request in eight made to
        fail (stale and foreign references, indices out of range, zero and oversized weights,
        unknown opcodes and operations of the other reference-counting mode). The number of
        live buffers it aims at is drawn again every 256 requests; in one draw out of four it
        frees nothing and writes sparsely until memory runs out, then tries an APPEND that
        needs memory. A count set to ``max_weight`` (to make INCREF overflow; only with
        ``weight_bits <= 8``) is then run down by DECREFs.
        ``"fill"``: ALLOC and APPEND until OUT_OF_MEMORY, then free every buffer, and again.
        ``"stream"``: fill a buffer, then long bursts of READ/WRITE below its length.

    Members
    -------
    requests : int
        Requests made so far.

    Raises
    ------
    TypeError
        If ``params`` is not an :class:`MUParams`, ``mu_id`` does not fit ``mu_id_bits`` or
        ``profile`` is not one of :data:`PROFILES`.
    """

    def __init__(self, params, seed, mu_id=0, profile="mixed"):
        if not isinstance(params, MUParams):
            raise TypeError(f"params must be an MUParams, not {params!r}")
        if (not isinstance(mu_id, int) or isinstance(mu_id, bool)
                or not 0 <= mu_id < 1 << params.mu_id_bits):
            raise TypeError(f"mu_id must be an integer between 0 and "
                            f"{(1 << params.mu_id_bits) - 1}, not {mu_id!r}")
        if profile not in PROFILES:
            choices = ", ".join(repr(p) for p in PROFILES)
            raise TypeError(f"profile must be one of {choices}, not {profile!r}")
        self.params = params
        self.mu_id = mu_id
        self.profile = profile
        self.requests = 0
        self._rng = random.Random(seed)
        self._weighted = params.refcount is RefcountMode.WEIGHTED
        self._single = params.alloc_mode is AllocMode.SINGLE
        self._offset_bits = params.offset_bits
        self._views = {}             # buf -> _View, in allocation order
        self._stale = []             # buf IDs of freed buffers, most recent last
        self._oom = None             # op of an OUT_OF_MEMORY since the profile last looked
        self._target = 1             # "mixed": live buffers to aim at
        self._hog = False            # "mixed": free nothing until memory runs out
        self._drain = None           # "mixed", counter mode: buf of a count being run down
        self._probed = False         # "mixed": the last request was an APPEND after an OOM
        self._phase = "fill" if profile == "fill" else "setup"
        self._goal = 0               # "stream": length to fill to, then burst length
        self._next = {"mixed": self._mixed, "fill": self._fill,
                      "stream": self._stream}[profile]

    # The interface.

    def next_request(self):
        """Return the next request (a new dict of ``mu_request_layout`` fields)."""
        self.requests += 1
        return self._next()

    def observe(self, request, response):
        """Learn from the response to ``request`` (both dicts, the response as unpacked)."""
        status = response["status"]
        op = request["op"]
        op = _OP_OF.get(op, op)              # an int encoding of a valid op counts as the op
        if status is MUStatus.OUT_OF_MEMORY:
            self._oom = op
            return
        if op is MUOp.ALLOC:
            if status is MUStatus.OK:
                buf = response["ref"]["buf"]
                self._views[buf] = _View(buf, request["data"])
                if buf in self._stale:
                    self._stale.remove(buf)
            return
        ref = request["ref"]
        if ref["mu"] != self.mu_id:
            return
        view = self._views.get(ref["buf"])
        if view is None:
            return
        data = response["data"]
        if status is MUStatus.OK and op in (MUOp.WRITE, MUOp.READ, MUOp.FETCH_ADD,
                                            MUOp.UNLOCK):
            mask = (1 << self.params.data_bits) - 1
            view.seen[request["index"]] = {
                MUOp.WRITE: request["data"], MUOp.READ: data,
                MUOp.FETCH_ADD: (data + request["data"]) & mask,
                MUOp.UNLOCK: (data + 1) & mask}[op]
        elif status is MUStatus.OK and op is MUOp.APPEND:
            view.seen[data] = request["data"]
        if status is MUStatus.BAD_REF:
            self._drop(view)
        elif status is MUStatus.OUT_OF_RANGE:
            if op is MUOp.APPEND:
                view.full = True
                view.length = self.params.max_buffer_words
        elif status is MUStatus.OK:
            if op is MUOp.WRITE or op is MUOp.APPEND:
                view.vblocks.add(data >> self._offset_bits)
                if data >= view.length:
                    view.length = data + 1
                view.full = view.length == self.params.max_buffer_words
            elif op is MUOp.LEN:
                view.length = data
            elif op is MUOp.RETURN:
                view.outstanding = data
                if data == 0:
                    self._drop(view)
            elif op is MUOp.ADD_WEIGHT:
                view.total = data
                view.outstanding += request["data"]
            elif op is MUOp.INCREF or op is MUOp.DECREF:
                view.total = view.outstanding = data
                if data == 0:
                    self._drop(view)

    def _drop(self, view):
        del self._views[view.buf]
        self._stale.append(view.buf)
        if len(self._stale) > _STALE_KEEP:
            del self._stale[0]

    # Request building.

    def _req(self, op, buf=0, index=0, data=0, mu=None):
        rng = self._rng
        p = self.params
        return {
            "op": op,
            "src": {"x": rng.getrandbits(p.coord_bits), "y": rng.getrandbits(p.coord_bits)},
            "tag": rng.getrandbits(p.tag_bits),
            "ref": {"mu": self.mu_id if mu is None else mu, "buf": buf},
            "index": index,
            "data": data,
        }

    def _word(self):
        return self._rng.getrandbits(self.params.data_bits)

    def _beyond(self, low, width):
        """An integer in ``[low, 2**width)``: the boundary half the time (None if empty)."""
        high = 1 << width
        if low >= high:
            return None
        if self._rng.random() < 0.5:
            return low
        return self._rng.randrange(low, high)

    def _alloc(self):
        rng = self._rng
        max_weight = self.params.max_weight
        if self._weighted:
            p_max = 0.03
        else:
            p_max = (0.1 if self._single else 0.02) * self._may_count_to_max()
        if rng.random() < p_max:
            weight = max_weight
        else:
            weight = rng.randint(1, min(8 if self._weighted else 3, max_weight))
        return self._req(MUOp.ALLOC, data=weight)

    def _append_needs_memory(self, view):
        """Whether an APPEND to ``view`` would take a block or a region."""
        p = self.params
        n = view.length
        if n >= p.max_buffer_words or p.alloc_mode is AllocMode.SINGLE:
            return False
        if p.alloc_mode is AllocMode.VIRTUAL:
            return n >> p.offset_bits not in view.vblocks
        # A region's capacity is the smallest class holding the length (at least 1 word).
        return n % p.reserve_words == 0 and (n // p.reserve_words).bit_count() == 1

    def _may_count_to_max(self):
        """Whether a count may be set to max_weight: it takes max_weight DECREFs to run down,
        so only with weights of at most 8 bits, and one such count at a time."""
        max_weight = self.params.max_weight
        return max_weight <= 255 and all(2 * v.total <= max_weight
                                         for v in self._views.values())

    def _release(self, view):
        """RETURN some or all of the weight held, or DECREF."""
        if not self._weighted:
            return self._req(MUOp.DECREF, view.buf)
        held = max(1, view.outstanding)
        w = held if self._rng.random() < 0.5 else self._rng.randint(1, held)
        return self._req(MUOp.RETURN, view.buf, data=w)

    def _release_all(self, view):
        """RETURN all the weight held (most of the time), or DECREF."""
        if self._weighted and self._rng.random() < 0.8:
            return self._req(MUOp.RETURN, view.buf, data=max(1, view.outstanding))
        return self._release(view)

    def _share(self, view):
        """ADD_WEIGHT or INCREF within range (as if the reference were copied)."""
        max_weight = self.params.max_weight
        if not self._weighted:
            if view.total >= max_weight:
                return self._req(MUOp.DECREF, view.buf)
            return self._req(MUOp.INCREF, view.buf)
        room = max_weight - view.total
        if room <= 0:
            return self._release(view)
        return self._req(MUOp.ADD_WEIGHT, view.buf, data=self._rng.randint(1, min(4, room)))

    def _write(self, view, sparse=0.1):
        rng = self._rng
        n = view.length
        top = self.params.max_buffer_words
        r = rng.random()
        if n and r < 0.45 * (1 - sparse):
            index = rng.randrange(n)
        elif r < 1 - sparse:
            index = min(top - 1, n + rng.randrange(self.params.block_words))
        else:
            index = rng.randrange(top)        # sparse: leaves holes, maps far blocks
        return self._req(MUOp.WRITE, view.buf, index, self._word())

    def _read(self, view):
        n = view.length
        if not n:
            return self._req(MUOp.LEN, view.buf)
        return self._req(MUOp.READ, view.buf, self._rng.randrange(n))

    # The "mixed" profile.

    def _mixed(self):
        rng = self._rng
        p = self.params
        if self.requests % 256 == 1:
            # Now and then a phase that only takes memory, until it runs out.
            self._hog = rng.random() < 0.25
            most = 1 if self._single else p.max_buffers
            self._target = most if self._hog else rng.randint(0, most)
        views = list(self._views.values())
        if self._oom is MUOp.ALLOC and self._hog:
            self._oom = None                    # out of slots: keep hogging memory
            self._target = len(views)
        elif self._oom is not None:
            self._oom = None
            self._hog = False
            self._target = min(self._target, max(0, len(views) - 1))
            # Memory just ran out: an APPEND that needs a new block or region should fail too
            # (once: not again after the failure of such an APPEND).
            hungry = [v for v in views if self._append_needs_memory(v)]
            if hungry and not self._probed:
                self._probed = True
                return self._req(MUOp.APPEND, rng.choice(hungry).buf, data=self._word())
        self._probed = False
        r = rng.random()
        if r < 0.12:
            return self._error(views)
        if self._drain is not None:
            if self._drain not in self._views:
                self._drain = None
            elif r < 0.5:
                return self._req(MUOp.DECREF, self._drain)
        if not views:
            return self._alloc()
        r = rng.random()
        below = len(views) < self._target
        if r < (0.10 if below else 0.01):
            return self._alloc()
        view = rng.choice(views)
        r = rng.random()
        if not self._hog and r < (0.03 if below else 0.12):
            if not self._weighted and rng.random() < 0.5:
                # A count drops by one per DECREF: aim at the buffer closest to being freed.
                view = min(views, key=lambda v: v.total)
            return self._release(view)
        r = rng.random()
        if r < (0.04 if self._weighted else 0.02):
            return self._share(view)
        if r < 0.34:
            return self._write(view, 0.5 if self._hog else 0.1)
        if r < 0.58:
            return self._req(MUOp.APPEND, view.buf, data=self._word())
        if r < 0.90:
            return self._read(view)
        if r < 0.94:
            return self._rmw(view)
        return self._req(MUOp.LEN, view.buf)

    def _rmw(self, view):
        """A FETCH_ADD, or an UNLOCK with the word last seen there as its ticket (stale now
        and then, so NOT_OWNER too)."""
        rng = self._rng
        if not view.length:
            return self._req(MUOp.LEN, view.buf)
        index = rng.randrange(view.length)
        if rng.random() < 0.5:
            k = rng.randint(1, 3) if rng.random() < 0.7 else self._word()
            return self._req(MUOp.FETCH_ADD, view.buf, index, k)
        ticket = view.seen.get(index, self._word())
        return self._req(MUOp.UNLOCK, view.buf, index, ticket)

    def _error(self, views):
        """A request meant to fail (it may not, if the stimulus' view is behind)."""
        rng = self._rng
        p = self.params
        view = rng.choice(views) if views else None
        kind = rng.randrange(12)
        if kind == 0:
            op = rng.randint(len(MUOp), 15)
            buf = view.buf if view and rng.random() < 0.5 else rng.getrandbits(p.buf_id_bits)
            return self._req(op, buf, rng.getrandbits(p.index_bits), self._word())
        if kind == 1:
            op = rng.choice((MUOp.INCREF, MUOp.DECREF) if self._weighted
                            else (MUOp.RETURN, MUOp.ADD_WEIGHT))
            return self._req(op, view.buf if view else 0, data=rng.randint(0, 3))
        if kind == 2 and self._stale:
            op = rng.choice((_REF_OPS[:6] if self._weighted else _REF_OPS[:4] + _REF_OPS[6:])
                            + (MUOp.FETCH_ADD, MUOp.UNLOCK))
            return self._req(op, rng.choice(self._stale), 0, 1)
        if kind == 3 and view:
            mu = (self.mu_id + rng.randrange(1, 1 << p.mu_id_bits)) % (1 << p.mu_id_bits)
            return self._req(rng.choice(_REF_OPS[:4]), view.buf, 0, 1, mu=mu)
        if kind == 4:
            return self._req(rng.choice(_REF_OPS), rng.getrandbits(p.buf_id_bits),
                             data=rng.randint(0, 2))
        if kind == 5 and view:
            index = self._beyond(view.length, p.index_bits)
            if index is not None:
                op = rng.choice((MUOp.READ, MUOp.READ, MUOp.FETCH_ADD, MUOp.UNLOCK))
                return self._req(op, view.buf, index)
        if kind == 6 and view:
            index = self._beyond(p.max_buffer_words, p.index_bits)
            if index is not None:
                return self._req(MUOp.WRITE, view.buf, index, self._word())
        if kind == 7 and view:
            full = [v for v in views if v.full]
            if full:
                return self._req(MUOp.APPEND, rng.choice(full).buf, data=self._word())
            # Fill one up, preferably the longest (in reserve mode: the one with most room).
            longest = max(views, key=lambda v: v.length)
            return self._req(MUOp.WRITE, longest.buf, p.max_buffer_words - 1, self._word())
        if kind == 8:
            if rng.random() < 0.5:
                return self._req(MUOp.ALLOC, data=0)
            weight = self._beyond(p.max_weight + 1, p.data_bits)
            if weight is not None:
                return self._req(MUOp.ALLOC, data=weight)
        if kind == 9 and view and not self._weighted:
            # A count at max_weight takes max_weight DECREFs to free: keep one such buffer at
            # a time, and drain it once INCREF has overflowed.
            counted = [v for v in views if v.total >= p.max_weight]
            if counted:
                self._drain = rng.choice(counted).buf
                return self._req(MUOp.INCREF, self._drain)
            if self._may_count_to_max():
                return self._req(MUOp.ALLOC, data=p.max_weight)
        elif kind == 9 and view:
            if rng.random() < 0.3:
                return self._req(rng.choice((MUOp.RETURN, MUOp.ADD_WEIGHT)), view.buf, data=0)
            if rng.random() < 0.5:
                w = self._beyond(view.outstanding + 1, p.data_bits)
                if w is not None:
                    return self._req(MUOp.RETURN, view.buf, data=w)
            k = self._beyond(max(1, p.max_weight - view.total + 1), p.data_bits)
            if k is not None:
                return self._req(MUOp.ADD_WEIGHT, view.buf, data=k)
        if kind == 10 and view:
            # A WRITE far out, which may need memory there is not.
            return self._req(MUOp.WRITE, view.buf, rng.randrange(p.max_buffer_words),
                             self._word())
        # Slots may run out (or, in single mode, a buffer is live).
        return self._alloc()

    # The "fill" profile.

    def _fill(self):
        rng = self._rng
        if self._oom is not None:
            self._oom = None
            self._phase = "drain"
        views = list(self._views.values())
        if self._phase == "drain":
            if views:
                if rng.random() < 0.1:
                    return self._read(rng.choice(views))
                return self._release_all(views[-1])
            self._phase = "fill"
        open_ = [v for v in views if not v.full]
        if not open_ or rng.random() < 0.01:
            return self._alloc()
        view = open_[-1] if rng.random() < 0.7 else rng.choice(open_)
        if rng.random() < 0.05:
            return self._read(view)
        return self._req(MUOp.APPEND, view.buf, data=self._word())

    # The "stream" profile.

    def _stream(self):
        rng = self._rng
        p = self.params
        views = list(self._views.values())
        if self._oom is not None:
            self._oom = None
            if self._phase == "setup" and views:
                self._goal = views[-1].length       # no memory for more: stream what is there
        if not views:
            self._phase = "setup"
            self._goal = rng.randint(1, max(1, min(p.max_buffer_words, p.words // 2)))
            return self._alloc()
        view = views[-1]
        if self._phase == "setup":
            if view.length < self._goal:
                return self._req(MUOp.APPEND, view.buf, data=self._word())
            self._phase = "burst"
            self._goal = rng.randint(64, 512)
        if self._phase == "burst" and self._goal <= 0:
            if rng.random() < 0.5:
                self._phase = "release"
            else:
                self._goal = rng.randint(64, 512)
        if self._phase == "burst" and view.length:
            self._goal -= 1
            index = rng.randrange(view.length)
            if rng.random() < 0.6:
                return self._req(MUOp.READ, view.buf, index)
            return self._req(MUOp.WRITE, view.buf, index, self._word())
        return self._release_all(view)


def random_requests(params, n, *, seed, mu_id=0, profile="mixed"):
    """Yield ``n`` requests of an :class:`MUStimulus` that learns from a private
    :class:`~rdakit.sim.models.mu.MUModel`.

    The sequence depends only on the arguments, so a caller that applies it to its own model (or
    to the RTL, which must answer the same) sees the same requests.

    Parameters
    ----------
    params : MUParams
    n : int
        Number of requests.
    seed : int
    mu_id : int
    profile : str
        One of :data:`PROFILES`.

    Yields
    ------
    dict
        A request of ``mu_request_layout`` fields.
    """
    stimulus = MUStimulus(params, seed, mu_id=mu_id, profile=profile)
    model = MUModel(params, mu_id=mu_id)
    for _ in range(n):
        request = stimulus.next_request()
        yield request
        stimulus.observe(request, model.request(request))
