"""The golden model of the memory unit, checked against docs/memory-unit.md.

Most tests use a small MU (256 words of 16-word blocks, 4 slots with 2 generation bits, buffers
of up to 128 words, 4-bit weights) so that every limit is a few requests away.
"""

import collections
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdakit.hdl.spec.packets import (
    MUOp,
    MUStatus,
    mu_request_layout,
    mu_response_layout,
    pack,
    unpack,
)
from rdakit.hdl.spec.params import AllocMode, MUParams, RefcountMode
from rdakit.sim.models.mu import (
    ModelInvariantError,
    MUModel,
    add_weight,
    alloc,
    append,
    decref,
    fetch_add,
    incref,
    length,
    read,
    ret,
    unlock,
    write,
)
from rdakit.sim.verify.mu_stimulus import PROFILES, MUStimulus, random_requests

OK = MUStatus.OK
OUT_OF_MEMORY = MUStatus.OUT_OF_MEMORY
BAD_REF = MUStatus.BAD_REF
OUT_OF_RANGE = MUStatus.OUT_OF_RANGE
WEIGHT_OVERFLOW = MUStatus.WEIGHT_OVERFLOW
BAD_REQUEST = MUStatus.BAD_REQUEST
NOT_OWNER = MUStatus.NOT_OWNER

SMALL = MUParams(words=256, block_words=16, max_buffers=4, max_buffer_words=128,
                 weight_bits=4, buf_id_bits=4)

ALLOC_MODES = [pytest.param(a, id=a.value) for a in AllocMode]
REFCOUNTS = [pytest.param(r, id=r.value) for r in RefcountMode]
MODES = [pytest.param(a, r, id=f"{a.value}-{r.value}")
         for a, r in itertools.product(AllocMode, RefcountMode)]


def small(alloc_mode=AllocMode.VIRTUAL, refcount=RefcountMode.WEIGHTED, **changes):
    return SMALL.replace(alloc_mode=alloc_mode, refcount=refcount, **changes)


class MU:
    """A model with shorthands: ``mu(req)`` returns the response, ``mu.ok(req)`` its data
    (failing unless OK), ``mu.status(req)`` its status."""

    def __init__(self, params, mu_id=0):
        self.params = params
        self.model = MUModel(params, mu_id)

    def __call__(self, req):
        return self.model.request(req)

    def ok(self, req):
        resp = self.model.request(req)
        assert resp["status"] is OK, (req, resp)
        return resp["data"]

    def status(self, req):
        return self.model.request(req)["status"]

    def new(self, weight=1):
        resp = self.model.request(alloc(weight))
        assert resp["status"] is OK, resp
        return resp["ref"]

    def release(self, ref):
        """Free a buffer held with all its weight (or a count of 1): the data returned."""
        if self.params.refcount is RefcountMode.WEIGHTED:
            info = self.model.live_buffers()[ref["buf"] % self.params.max_buffers]
            return self.ok(ret(ref, info["total"] - info["collected"]))
        return self.ok(decref(ref))


def ref_of(slot, gen=0, mu=0, params=SMALL):
    return {"mu": mu, "buf": gen << params.slot_bits | slot}


# Packets.

def test_response_echoes_the_request():
    mu = MU(SMALL)
    resp = mu(alloc(3, src={"x": 5, "y": 2}, tag=0x9a))
    assert resp == {"op": MUOp.ALLOC, "status": OK, "dst": {"x": 5, "y": 2}, "tag": 0x9a,
                    "ref": {"mu": 0, "buf": 0}, "data": 3}
    resp = mu(read(ref_of(3), 7, src={"x": 1, "y": 6}, tag=4))
    assert resp == {"op": MUOp.READ, "status": BAD_REF, "dst": {"x": 1, "y": 6}, "tag": 4,
                    "ref": ref_of(3), "data": 0}


def test_missing_fields_are_zero_and_ops_may_be_ints():
    mu = MU(SMALL)
    assert mu({"op": 0, "data": 2}) == {"op": MUOp.ALLOC, "status": OK, "dst": {"x": 0, "y": 0},
                                        "tag": 0, "ref": {"mu": 0, "buf": 0}, "data": 2}
    assert mu({"op": 4})["data"] == 0
    assert mu({"op": 11}) == {"op": 11, "status": BAD_REQUEST, "dst": {"x": 0, "y": 0},
                              "tag": 0, "ref": {"mu": 0, "buf": 0}, "data": 0}


def test_responses_compare_equal_to_unpacked_packed_responses():
    packed, plain = MUModel(SMALL), MUModel(SMALL)
    req_layout, resp_layout = mu_request_layout(SMALL), mu_response_layout(SMALL)
    for req in random_requests(SMALL, 3000, seed=11):
        got = unpack(resp_layout, packed.request_int(pack(req_layout, req)))
        assert got == plain.request(req)


def test_alloc_names_the_mu():
    mu = MU(SMALL.replace(mu_id_bits=3), mu_id=5)
    ref = mu.new()
    assert ref == {"mu": 5, "buf": 0}
    assert mu.ok(write(ref, 0, 1)) == 0
    assert mu.status(read({"mu": 0, "buf": 0}, 0)) is BAD_REF


def test_too_wide_fields_are_refused():
    model = MUModel(SMALL)
    with pytest.raises(ValueError, match=r"Field 'index' must fit in 16 bits, not 65536"):
        model.request(read(ref_of(0), 1 << 16))
    with pytest.raises(ValueError, match=r"Field 'op' must fit in 4 bits, not 16"):
        model.request({"op": 16})
    with pytest.raises(ValueError, match=r"Field 'data' must fit in 32 bits, not -1"):
        model.request(alloc(-1))
    assert model.snapshot() == MUModel(SMALL).snapshot()


def test_constructor_errors():
    with pytest.raises(TypeError, match=r"params must be an MUParams, not 3"):
        MUModel(3)
    with pytest.raises(TypeError, match=r"mu_id must be an integer between 0 and 63, not 64"):
        MUModel(SMALL, 64)
    with pytest.raises(TypeError, match=r"profile must be one of 'mixed', 'fill', 'stream', "
                                        r"not 'burst'"):
        MUStimulus(SMALL, 0, profile="burst")
    with pytest.raises(TypeError, match=r"mu_id must be an integer between 0 and 63, not -1"):
        MUStimulus(SMALL, 0, mu_id=-1)


# Operations, in every mode.

@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_write_read_append_len(alloc_mode, refcount):
    mu = MU(small(alloc_mode, refcount))
    ref = mu.new()
    assert mu.ok(length(ref)) == 0
    assert mu.ok(write(ref, 5, 0xdead)) == 5            # WRITE answers the index
    assert mu.ok(length(ref)) == 6                      # length = max(length, index + 1)
    assert mu.ok(read(ref, 5)) == 0xdead
    assert mu.ok(read(ref, 2)) == 0                     # fresh memory holds 0 after reset
    assert mu.ok(append(ref, 77)) == 6                  # APPEND answers the index written
    assert mu.ok(read(ref, 6)) == 77
    assert mu.ok(write(ref, 1, 11)) == 1
    assert mu.ok(length(ref)) == 7                      # a write below the length keeps it
    assert [mu.ok(read(ref, i)) for i in range(7)] == [0, 11, 0, 0, 0, 0xdead, 77]


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_fetch_add_and_ticket_lock(alloc_mode, refcount):
    mu = MU(small(alloc_mode, refcount))
    ref = mu.new()
    mu.ok(write(ref, 0, 0))                              # next ticket
    mu.ok(write(ref, 1, 0))                              # ticket being served
    assert [mu.ok(fetch_add(ref, 0, 1)) for _ in range(3)] == [0, 1, 2]   # tickets 0, 1, 2
    assert mu.ok(read(ref, 0)) == 3
    top = (1 << mu.params.data_bits) - 1
    assert mu.ok(fetch_add(ref, 1, top)) == 0             # wraps modulo 2**data_bits
    assert mu.ok(fetch_add(ref, 1, 1)) == top
    assert mu.ok(read(ref, 1)) == 0
    before = mu.model.snapshot()
    assert mu(unlock(ref, 1, 1))["status"] is NOT_OWNER   # ticket 1 is not served yet
    assert mu(unlock(ref, 1, 1))["data"] == 0
    assert mu.model.snapshot() == before                  # a rejected release changes nothing
    assert mu.ok(unlock(ref, 1, 0)) == 0                   # the owner releases: serve ticket 1
    assert mu(unlock(ref, 1, 0))["status"] is NOT_OWNER    # a second release by 0 is rejected
    assert mu.ok(unlock(ref, 1, 1)) == 1
    assert mu.ok(read(ref, 1)) == 2
    for op in (fetch_add(ref, 2, 1), unlock(ref, 2, 0)):  # past the length
        assert mu(op)["status"] is OUT_OF_RANGE


def test_fetch_add_in_a_hole_is_out_of_range():
    mu = MU(small(AllocMode.VIRTUAL, RefcountMode.WEIGHTED))
    ref = mu.new()
    mu.ok(write(ref, 40, 7))                              # blocks 0 and 1 are holes
    assert mu(fetch_add(ref, 3, 1))["status"] is OUT_OF_RANGE
    assert mu(unlock(ref, 20, 0))["status"] is OUT_OF_RANGE
    assert mu.ok(fetch_add(ref, 40, 1)) == 7


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_out_of_range(alloc_mode, refcount):
    mu = MU(small(alloc_mode, refcount))
    ref = mu.new()
    assert mu.status(read(ref, 0)) is OUT_OF_RANGE      # at the length
    assert mu.status(write(ref, 128, 1)) is OUT_OF_RANGE    # past the largest buffer
    assert mu.status(write(ref, 0xffff, 1)) is OUT_OF_RANGE
    assert mu.ok(write(ref, 127, 1)) == 127
    assert mu.status(read(ref, 128)) is OUT_OF_RANGE
    assert mu.status(append(ref, 1)) is OUT_OF_RANGE    # length == max_buffer_words
    assert mu.ok(length(ref)) == 128


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_bad_ref(alloc_mode, refcount):
    p = small(alloc_mode, refcount, mu_id_bits=2)
    mu = MU(p, mu_id=1)
    ref = mu.new()
    assert ref == {"mu": 1, "buf": 0}
    ops = [write(ref, 0, 1), append(ref, 1), read(ref, 0), length(ref)]
    ops += [ret(ref, 1), add_weight(ref, 1)] if refcount is RefcountMode.WEIGHTED \
        else [incref(ref), decref(ref)]
    before = mu.model.snapshot()
    for req in ops:
        for bad in ({"mu": 2, "buf": 0},                    # another MU's ID
                    {"mu": 1, "buf": 1},                    # a slot never allocated
                    {"mu": 1, "buf": 1 << p.slot_bits}):    # the slot, another generation
            assert mu(dict(req, ref=bad)) == {"op": req["op"], "status": BAD_REF,
                                              "dst": {"x": 0, "y": 0}, "tag": 0, "ref": bad,
                                              "data": 0}
    assert mu.model.snapshot() == before


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_bad_request(alloc_mode, refcount):
    mu = MU(small(alloc_mode, refcount))
    ref = mu.new()
    before = mu.model.snapshot()
    for op in range(len(MUOp), 16):
        resp = mu({"op": op, "ref": ref, "data": 1})
        assert (resp["op"], resp["status"], resp["data"]) == (op, BAD_REQUEST, 0)
    other = [incref(ref), decref(ref)] if refcount is RefcountMode.WEIGHTED \
        else [ret(ref, 1), add_weight(ref, 1)]
    for req in other:
        assert mu.status(req) is BAD_REQUEST
        # The mode check comes before the reference check.
        assert mu.status(dict(req, ref={"mu": 3, "buf": 9})) is BAD_REQUEST
    assert mu.status(alloc(0)) is BAD_REQUEST
    assert mu.model.snapshot() == before


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_alloc_weight_checks(alloc_mode, refcount):
    mu = MU(small(alloc_mode, refcount))
    assert mu.status(alloc(0)) is BAD_REQUEST
    assert mu.status(alloc(16)) is WEIGHT_OVERFLOW      # max_weight = 15
    assert mu.status(alloc(2**32 - 1)) is WEIGHT_OVERFLOW
    assert mu.ok(alloc(15)) == 15
    assert mu.model.allocs == 1


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_alloc_checks_in_order(alloc_mode, refcount):
    mu = MU(small(alloc_mode, refcount))
    n = 1 if alloc_mode is AllocMode.SINGLE else 4
    for _ in range(n):
        mu.new()
    # With no slot left, a zero or oversized weight is still reported first.
    assert mu.status(alloc(0)) is BAD_REQUEST
    assert mu.status(alloc(16)) is WEIGHT_OVERFLOW
    assert mu.status(alloc(1)) is OUT_OF_MEMORY


@pytest.mark.parametrize("alloc_mode", ALLOC_MODES)
def test_weighted_return_and_add_weight(alloc_mode):
    mu = MU(small(alloc_mode))
    ref = mu.new(6)
    assert mu.status(ret(ref, 0)) is BAD_REQUEST
    assert mu.status(ret(ref, 7)) is WEIGHT_OVERFLOW    # more than outstanding
    assert mu.ok(ret(ref, 2)) == 4                      # RETURN answers what is outstanding
    assert mu.status(ret(ref, 5)) is WEIGHT_OVERFLOW
    assert mu.status(add_weight(ref, 0)) is BAD_REQUEST
    assert mu.status(add_weight(ref, 10)) is WEIGHT_OVERFLOW    # 6 + 10 > 15
    assert mu.ok(add_weight(ref, 9)) == 15              # ADD_WEIGHT answers the new total
    assert mu.model.live_buffers()[0]["collected"] == 2
    assert mu.ok(ret(ref, 12)) == 1
    assert mu.model.frees == 0
    assert mu.ok(ret(ref, 1)) == 0                      # collected == total: freed
    assert mu.model.frees == 1
    assert mu.status(ret(ref, 1)) is BAD_REF
    assert mu.status(read(ref, 0)) is BAD_REF


def test_weighted_checks_in_order():
    mu = MU(small())
    ref = mu.new(1)
    stale = {"mu": 0, "buf": 1}
    assert mu.status(ret(stale, 0)) is BAD_REF          # ref before weight
    assert mu.status(add_weight(stale, 99)) is BAD_REF
    assert mu.status(write(stale, 999, 1)) is BAD_REF   # ref before range
    assert mu.status(ret(ref, 2**32 - 1)) is WEIGHT_OVERFLOW


@pytest.mark.parametrize("alloc_mode", ALLOC_MODES)
def test_counter_incref_decref(alloc_mode):
    mu = MU(small(alloc_mode, RefcountMode.COUNTER))
    ref = mu.new(2)
    assert mu.ok(incref(ref)) == 3
    assert mu.ok(decref(ref)) == 2
    assert mu.ok(decref(ref)) == 1
    assert mu.model.frees == 0
    assert mu.ok(decref(ref)) == 0                      # the count reached 0: freed
    assert mu.model.frees == 1
    assert mu.status(decref(ref)) is BAD_REF
    assert mu.status(incref(ref)) is BAD_REF
    full = mu.new(15)
    assert mu.status(incref(full)) is WEIGHT_OVERFLOW   # count == max_weight
    assert mu.ok(decref(full)) == 14
    assert mu.ok(incref(full)) == 15


# Allocation policy.

@pytest.mark.parametrize("refcount", REFCOUNTS)
@pytest.mark.parametrize("alloc_mode", ALLOC_MODES[:2])
def test_slots_lifo_then_fresh(alloc_mode, refcount):
    mu = MU(small(alloc_mode, refcount, max_buffers=8, buf_id_bits=5))
    refs = [mu.new() for _ in range(3)]
    assert [r["buf"] for r in refs] == [0, 1, 2]        # never-used slots in increasing order
    mu.release(refs[1])
    mu.release(refs[0])
    assert mu.model.free_slots() == [0, 1, 3, 4, 5, 6, 7]
    assert mu.model.generation(0) == mu.model.generation(1) == 1
    # The most recently freed slot first, with its new generation; then fresh slots.
    assert [mu.new()["buf"] for _ in range(3)] == [1 << 3 | 0, 1 << 3 | 1, 3]


def test_blocks_lifo_then_fresh_and_freed_in_virtual_block_order():
    mu = MU(small())
    a = mu.new()
    for index in (0, 40, 20):                           # virtual blocks 0, 2, 1
        mu.ok(write(a, index, index))
    assert mu.model.live_buffers()[0]["blocks"] == {0: 0, 2: 1, 1: 2}
    b = mu.new()
    mu.ok(write(b, 0, 1))
    assert mu.model.live_buffers()[1]["blocks"] == {0: 3}
    assert mu.model.free_blocks() == list(range(4, 16))
    mu.release(a)
    # Released in increasing virtual-block order: blocks 0, 2, 1; the last one is taken first.
    assert mu.model.free_blocks() == [1, 2, 0] + list(range(4, 16))
    c = mu.new()
    mu.ok(write(c, 100, 1))
    mu.ok(write(c, 0, 1))
    assert mu.model.live_buffers()[0]["blocks"] == {6: 1, 0: 2}


def test_virtual_stale_data_and_holes():
    mu = MU(small())
    a = mu.new()
    for i in range(32):
        mu.ok(append(a, 1000 + i))                      # blocks 0 and 1
    mu.release(a)
    b = mu.new()
    mu.ok(write(b, 3, 7))                               # takes block 1 (released last)
    mu.ok(write(b, 40, 8))                              # virtual block 2 takes block 0
    assert mu.ok(read(b, 0)) == 1016                    # never written: what block 1 held
    assert mu.ok(read(b, 3)) == 7
    assert mu.ok(read(b, 16)) == 0                      # virtual block 1: a hole, never mapped
    assert mu.ok(read(b, 31)) == 0
    assert mu.ok(read(b, 33)) == 1001                   # block 0, offset 1
    assert mu.ok(read(b, 40)) == 8


def test_virtual_out_of_memory():
    mu = MU(small())
    a, b = mu.new(), mu.new()
    for v in range(8):
        mu.ok(write(a, 16 * v, v))
    for v in range(8):
        mu.ok(write(b, 16 * v, v))                      # all 16 blocks mapped
    assert mu.model.free_blocks() == []
    before = mu.model.snapshot()
    assert mu.status(write(a, 127, 1)) is OK            # a mapped block needs nothing
    assert mu.model.snapshot() != before
    c = mu.new()
    before = mu.model.snapshot()
    assert mu.status(write(c, 0, 1)) is OUT_OF_MEMORY
    assert mu.status(append(c, 1)) is OUT_OF_MEMORY
    assert mu.status(write(c, 128, 1)) is OUT_OF_RANGE  # range is checked before memory
    assert mu.model.snapshot() == before
    mu.release(b)
    assert mu.ok(append(c, 5)) == 0


def test_generation_catches_a_stale_reference_after_slot_reuse():
    mu = MU(small())                                    # 2 generation bits
    old = mu.new()
    mu.ok(write(old, 0, 42))
    mu.release(old)
    new = mu.new()
    assert new == {"mu": 0, "buf": 1 << 2 | 0}          # same slot, next generation
    mu.ok(write(new, 0, 43))
    assert mu.status(read(old, 0)) is BAD_REF
    assert mu.status(ret(old, 1)) is BAD_REF
    assert mu.ok(read(new, 0)) == 43
    # The generation wraps: after 2**gen_bits reuses the old reference names the slot again.
    for _ in range(3):
        assert mu.status(read(old, 0)) is BAD_REF
        mu.release(mu.model.live_buffers()[0]["ref"])
        mu.new()
    assert mu.model.generation(0) == 0
    assert mu.ok(length(old)) == 0                     # aliases the live buffer of slot 0


# The paper's Figure 1(b): a reference shared while its count update is still in flight.

@pytest.mark.parametrize("alloc_mode", ALLOC_MODES)
def test_counter_race_frees_a_buffer_still_referenced(alloc_mode):
    mu = MU(small(alloc_mode, RefcountMode.COUNTER))
    ref = mu.new(1)                                     # A holds the only count
    mu.ok(write(ref, 0, 5))
    # A hands the reference to B and sends INCREF for B; the INCREF is delayed in the network
    # and A's DECREF (A is done with the buffer) arrives first.
    assert mu.ok(decref(ref)) == 0                      # freed while B holds a reference
    delayed_incref = incref(ref)
    assert mu.status(delayed_incref) is BAD_REF
    reused = mu.new(1)                                  # someone else gets the slot
    mu.ok(write(reused, 0, 6))
    assert mu.status(read(ref, 0)) is BAD_REF           # B's read fails (not 6: generations)
    mu.release(reused)
    # Gating on the INCREF's acknowledgement avoids the race (at the price of a round trip).
    ref = mu.new(1)
    mu.ok(write(ref, 0, 5))
    assert mu.ok(incref(ref)) == 2
    assert mu.ok(decref(ref)) == 1
    assert mu.ok(read(ref, 0)) == 5
    assert mu.ok(decref(ref)) == 0


@pytest.mark.parametrize("alloc_mode", ALLOC_MODES)
@pytest.mark.parametrize("order", ["a_first", "b_first"])
def test_weighted_sharing_has_no_race(order, alloc_mode):
    mu = MU(small(alloc_mode))
    ref = mu.new(8)                                     # A holds weight 8
    mu.ok(write(ref, 0, 5))
    # A gives B half its weight with the reference: no message to the MU at all.
    a_return, b_read, b_return = ret(ref, 4), read(ref, 0), ret(ref, 4)
    if order == "a_first":
        assert mu.ok(a_return) == 4                     # A is done: 4 still outstanding
        assert mu.ok(b_read) == 5
        assert mu.ok(b_return) == 0                     # freed only after all weight is back
    else:
        assert mu.ok(b_read) == 5
        assert mu.ok(b_return) == 4
        assert mu.ok(a_return) == 0
    assert mu.model.frees == 1
    assert mu.status(read(ref, 0)) is BAD_REF


# Reserve-and-copy.

def test_reserve_regions_growth_and_copy():
    mu = MU(small(AllocMode.RESERVE))                   # classes of 16, 32, 64, 128 words
    a = mu.new()
    mu.new()
    info = mu.model.live_buffers()
    assert (info[0]["base"], info[1]["base"], mu.model.bump) == (0, 16, 32)
    for i in range(16):
        mu.ok(append(a, 100 + i))
    assert mu.model.copy_words == 0
    assert mu.ok(append(a, 116)) == 16                  # length == capacity: grow to 32 words
    info = mu.model.live_buffers()[0]
    assert (info["base"], info["order"], info["capacity"]) == (32, 1, 32)
    assert mu.model.copy_words == 16
    assert mu.model.free_regions() == {0: [0], 1: [], 2: [], 3: []}
    assert [mu.ok(read(a, i)) for i in range(17)] == list(range(100, 117))
    assert mu.model.held_words == 32 + 16
    # A new buffer takes the freed class-0 region, with the data A left there.
    c = mu.new()
    assert mu.model.live_buffers()[2]["base"] == 0
    mu.ok(write(c, 5, 1))
    assert mu.ok(read(c, 3)) == 103
    # A write far past the capacity goes straight to the smallest class that holds it.
    assert mu.ok(write(a, 40, 9)) == 40                 # 64 words: [64, 128)
    info = mu.model.live_buffers()[0]
    assert (info["base"], info["order"]) == (64, 2)
    assert mu.model.copy_words == 16 + 17
    assert mu.model.growths == 2
    assert [mu.ok(read(a, i)) for i in range(17)] == list(range(100, 117))
    assert mu.model.free_regions() == {0: [], 1: [32], 2: [], 3: []}
    assert mu.model.bump == 128


def test_reserve_out_of_memory_changes_nothing():
    mu = MU(small(AllocMode.RESERVE))
    a, b = mu.new(), mu.new()
    mu.ok(write(a, 127, 1))                             # 128 words at [32, 160)
    mu.ok(write(b, 5, 2))
    assert mu.status(write(b, 64, 3)) is OUT_OF_MEMORY  # needs 128 words: 160 + 128 > 256
    assert mu.status(write(b, 16, 3)) is OK             # 32 words fit: [160, 192)
    mu.ok(write(b, 32, 3))                              # 64 words: [192, 256)
    before = mu.model.snapshot()
    assert mu.status(write(b, 64, 3)) is OUT_OF_MEMORY
    assert mu.model.snapshot() == before
    # The freed 32-word region is not merged with its neighbour to make room.
    mu.release(a)
    assert mu.ok(write(b, 64, 3)) == 64                 # A's 128-word region, reused whole


def test_reserve_alloc_out_of_memory_with_slots_free():
    mu = MU(small(AllocMode.RESERVE, words=64, max_buffer_words=64, max_buffers=8,
                  buf_id_bits=4))
    refs = [mu.new() for _ in range(4)]                 # four 16-word regions fill 64 words
    before = mu.model.snapshot()
    assert mu.status(alloc(1)) is OUT_OF_MEMORY
    assert mu.model.snapshot() == before
    mu.release(refs[2])
    assert mu.new() == {"mu": 0, "buf": 1 << 3 | 2}
    assert mu.model.live_buffers()[2]["base"] == 32


# Single buffer per MU.

def test_single_mode():
    mu = MU(small(AllocMode.SINGLE))
    a = mu.new()
    assert mu.model.held_words == 256                   # the whole scratchpad
    assert mu.status(alloc(1)) is OUT_OF_MEMORY         # slots are free, but one buffer is live
    mu.ok(write(a, 100, 9))
    mu.ok(write(a, 3, 8))
    assert mu.model.memory()[100] == 9                  # address = index
    mu.release(a)
    assert mu.model.held_words == 0
    b = mu.new()
    assert b == {"mu": 0, "buf": 1 << 2}                # slot 0 again, next generation
    mu.ok(write(b, 120, 1))
    assert mu.ok(read(b, 100)) == 9                     # stale data of the previous buffer
    assert mu.ok(read(b, 3)) == 8


# Counters and the whole-MU properties.

@pytest.mark.parametrize("alloc_mode", ALLOC_MODES)
def test_held_and_live_words(alloc_mode):
    mu = MU(small(alloc_mode))
    a = mu.new()
    mu.ok(write(a, 20, 1))
    held = {AllocMode.VIRTUAL: 16, AllocMode.RESERVE: 32, AllocMode.SINGLE: 256}[alloc_mode]
    assert (mu.model.held_words, mu.model.live_words) == (held, 21)
    mu.ok(append(a, 1))
    assert mu.model.live_words == 22
    mu.release(a)
    assert (mu.model.held_words, mu.model.peak_held_words) == (0, held)
    assert (mu.model.live_words, mu.model.allocs, mu.model.frees) == (0, 1, 1)


def fill_then_free_all(mu):
    """ALLOC and APPEND until OUT_OF_MEMORY, then free every buffer; the statuses seen."""
    seen, refs, i = set(), [], 0
    while True:
        resp = mu(alloc(1))
        seen.add(resp["status"])
        if resp["status"] is not OK:
            break
        refs.append(resp["ref"])
        while (status := mu.status(append(refs[-1], i))) is OK:
            i += 1
        seen.add(status)
        if status is OUT_OF_MEMORY:
            break
    for ref in refs:
        assert mu.release(ref) == 0
    return seen


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_fill_then_free_all_leaves_everything_free_once(alloc_mode, refcount):
    p = small(alloc_mode, refcount)
    mu = MU(p)
    for _ in range(3):
        assert OUT_OF_MEMORY in fill_then_free_all(mu)
        model = mu.model
        assert sorted(model.free_slots()) == list(range(p.max_buffers))
        assert sorted(model.free_blocks()) == list(range(p.n_blocks))
        assert model.live_buffers() == {}
        assert (model.held_words, model.live_words) == (0, 0)
        assert model.allocs == model.frees > 0
        if alloc_mode is AllocMode.RESERVE:
            free = sum((p.reserve_words << k) * len(bases)
                       for k, bases in model.free_regions().items())
            assert free == model.bump
        model.check_invariants()


# Random runs.

def run(params, n, seed, profile="mixed", check_every=1000, on_response=None):
    model = MUModel(params)
    stimulus = MUStimulus(params, seed, profile=profile)
    for i in range(n):
        req = stimulus.next_request()
        resp = model.request(req)
        if on_response is not None:
            on_response(model, req, resp)
        stimulus.observe(req, resp)
        if i % check_every == 0:
            model.check_invariants()
    model.check_invariants()
    return model


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_invariants_hold_after_random_requests(alloc_mode, refcount):
    run(small(alloc_mode, refcount), 20_000, seed=1)
    run(MUParams(alloc_mode=alloc_mode, refcount=refcount), 5_000, seed=2)
    for profile in ("fill", "stream"):
        run(small(alloc_mode, refcount), 5_000, seed=3, profile=profile)


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_a_failed_request_changes_nothing(alloc_mode, refcount):
    failures = 0

    def check(model, req, resp):
        nonlocal failures
        if resp["status"] is not OK:
            failures += 1
            assert resp["data"] == 0
            assert resp["ref"] == req["ref"]
            assert model.snapshot() == snapshot[0]
        snapshot[0] = model.snapshot()

    snapshot = [MUModel(small(alloc_mode, refcount)).snapshot()]
    run(small(alloc_mode, refcount), 3_000, seed=4, on_response=check)
    assert failures > 200


def expected_outcomes(params):
    """Every (op, status) the MU can answer in its modes."""
    weighted = params.refcount is RefcountMode.WEIGHTED
    memory = {OUT_OF_MEMORY} if params.alloc_mode is not AllocMode.SINGLE else set()
    outcomes = {
        MUOp.ALLOC: {OK, BAD_REQUEST, WEIGHT_OVERFLOW, OUT_OF_MEMORY},
        MUOp.WRITE: {OK, BAD_REF, OUT_OF_RANGE} | memory,
        MUOp.APPEND: {OK, BAD_REF, OUT_OF_RANGE} | memory,
        MUOp.READ: {OK, BAD_REF, OUT_OF_RANGE},
        MUOp.LEN: {OK, BAD_REF},
        MUOp.RETURN: {OK, BAD_REF, BAD_REQUEST, WEIGHT_OVERFLOW} if weighted else {BAD_REQUEST},
        MUOp.ADD_WEIGHT: ({OK, BAD_REF, BAD_REQUEST, WEIGHT_OVERFLOW} if weighted
                          else {BAD_REQUEST}),
        MUOp.INCREF: {BAD_REQUEST} if weighted else {OK, BAD_REF, WEIGHT_OVERFLOW},
        MUOp.DECREF: {BAD_REQUEST} if weighted else {OK, BAD_REF},
        MUOp.FETCH_ADD: {OK, BAD_REF, OUT_OF_RANGE},
        MUOp.UNLOCK: {OK, BAD_REF, OUT_OF_RANGE, NOT_OWNER},
    }
    outcomes.update({op: {BAD_REQUEST} for op in range(len(MUOp), 16)})
    return {(op, status) for op, statuses in outcomes.items() for status in statuses}


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_mixed_stimulus_exercises_every_outcome(alloc_mode, refcount):
    # Several fresh MUs: in reserve mode, regions never merge, so whether a buffer can still
    # grow to max_buffer_words (and an APPEND find it full) depends on the early history.
    p = small(alloc_mode, refcount)
    seen = collections.Counter()
    for seed in range(4):
        run(p, 5_000, seed=seed, on_response=lambda m, q, r: seen.update([(r["op"],
                                                                            r["status"])]))
    assert set(seen) == expected_outcomes(p)
    oks = sum(n for (op, status), n in seen.items() if status is OK)
    assert oks > 0.6 * 20_000


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_fill_profile_fills_and_empties_the_mu(alloc_mode, refcount):
    emptied = 0

    def count(model, req, resp):
        nonlocal emptied
        if resp["status"] is OK and model.frees and not model.live_buffers():
            emptied += req["op"] in (MUOp.RETURN, MUOp.DECREF)

    model = run(small(alloc_mode, refcount), 10_000, seed=6, profile="fill", on_response=count)
    assert emptied >= 5
    assert model.peak_held_words >= SMALL.words - SMALL.max_buffer_words


def test_stream_profile_is_mostly_reads_and_writes():
    kinds = collections.Counter()
    run(SMALL, 10_000, seed=7, profile="stream",
        on_response=lambda m, q, r: kinds.update([(q["op"], r["status"])]))
    streamed = kinds[MUOp.READ, OK] + kinds[MUOp.WRITE, OK]
    assert streamed > 0.75 * 10_000
    assert kinds[MUOp.ALLOC, OK] >= 5


@pytest.mark.parametrize("profile", PROFILES)
def test_stimulus_with_another_mu_id(profile):
    p = SMALL.replace(mu_id_bits=3)
    model = MUModel(p, mu_id=6)
    statuses = collections.Counter()
    for req in random_requests(p, 3000, seed=14, mu_id=6, profile=profile):
        resp = model.request(req)
        statuses[resp["status"]] += 1
        if req["op"] is MUOp.ALLOC and resp["status"] is OK:
            assert resp["ref"]["mu"] == 6
    model.check_invariants()
    assert statuses[OK] > 1500 and model.allocs > 5


def test_one_slot_mu():
    mu = MU(SMALL.replace(max_buffers=1, buf_id_bits=1))
    a = mu.new()
    assert a == {"mu": 0, "buf": 0}
    assert mu.status(alloc(1)) is OUT_OF_MEMORY
    mu.release(a)
    assert mu.new() == {"mu": 0, "buf": 1}
    assert mu.status(read(a, 0)) is BAD_REF
    run(SMALL.replace(max_buffers=1, buf_id_bits=1), 3000, seed=15)


@pytest.mark.parametrize("profile", PROFILES)
def test_stimulus_is_deterministic(profile):
    first = list(random_requests(SMALL, 2000, seed=8, profile=profile))
    assert list(random_requests(SMALL, 2000, seed=8, profile=profile)) == first
    assert list(random_requests(SMALL, 2000, seed=9, profile=profile)) != first


def test_stimulus_learns_from_unpacked_responses():
    """Fed what a testbench unpacks from the RTL (ints and members alike), the stimulus makes
    the same requests as when fed the model's dicts."""
    p = small(refcount=RefcountMode.COUNTER)
    req_layout, resp_layout = mu_request_layout(p), mu_response_layout(p)
    model, stimulus = MUModel(p), MUStimulus(p, 10)
    got = []
    for _ in range(3000):
        req = stimulus.next_request()
        seen_req = unpack(req_layout, pack(req_layout, req))
        resp = unpack(resp_layout, model.request_int(pack(req_layout, req)))
        stimulus.observe(seen_req, resp)
        got.append(req)
    assert got == list(random_requests(p, 3000, seed=10))


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_stimulus_with_requests_in_flight(alloc_mode, refcount):
    p = small(alloc_mode, refcount)
    model, stimulus = MUModel(p), MUStimulus(p, 12)
    in_flight = collections.deque()
    statuses = collections.Counter()
    for _ in range(5000):
        in_flight.append(stimulus.next_request())
        if len(in_flight) == 4:
            req = in_flight.popleft()
            resp = model.request(req)
            statuses[resp["status"]] += 1
            stimulus.observe(req, resp)
    model.check_invariants()
    assert statuses[OK] > 2500


TINY = MUParams(words=64, block_words=8, max_buffers=2, max_buffer_words=32, weight_bits=2,
                mu_id_bits=1, buf_id_bits=2, index_bits=6, data_bits=8, tag_bits=2, coord_bits=1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, (1 << mu_request_layout(TINY).size) - 1), max_size=200))
def test_any_packed_request_is_answered_consistently(values):
    """Raw request words (a 25-bit request of a tiny MU) are answered in order, echoing op,
    source and tag; an error has data 0, echoes the reference and changes nothing."""
    req_layout, resp_layout = mu_request_layout(TINY), mu_response_layout(TINY)
    model = MUModel(TINY)
    for value in values:
        before = model.snapshot()
        req = unpack(req_layout, value)
        resp = unpack(resp_layout, model.request_int(value))
        assert (resp["op"], resp["dst"], resp["tag"]) == (req["op"], req["src"], req["tag"])
        if resp["status"] is not OK:
            assert (resp["data"], resp["ref"]) == (0, req["ref"])
            assert model.snapshot() == before
        model.check_invariants()


def test_invariant_violations_are_reported():
    model = MUModel(SMALL)
    model.request(alloc(1))
    model._slot_stack.append(0)
    with pytest.raises(ModelInvariantError, match=r"slot 0 is both free and live"):
        model.check_invariants()
    model = MUModel(SMALL)
    ref = model.request(alloc(1))["ref"]
    model.request(write(ref, 0, 1))
    model._block_stack.append(0)
    with pytest.raises(ModelInvariantError, match=r"block 0 is both free and mapped"):
        model.check_invariants()
    model._block_stack.pop()
    model.held_words += 1
    with pytest.raises(ModelInvariantError, match=r"held_words is 17, but live buffers hold 16"):
        model.check_invariants()



# Timing and counters (docs/memory-unit.md, Timing and Words held, counters).

@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_exec_cycles_follow_the_timing_table(alloc_mode, refcount):
    p = small(alloc_mode, refcount, words=512, reserve_words=64)
    mu = MU(p)
    seen = []

    def cycles_of(req):
        """The status of ``req`` and the execute cycles the model counts for it."""
        status = mu(req)["status"]
        seen.append(mu.model.exec_cycles)
        return status, seen[-1]

    assert cycles_of(alloc(0)) == (BAD_REQUEST, 1)               # every error: one cycle
    assert cycles_of(alloc(p.max_weight + 1)) == (WEIGHT_OVERFLOW, 1)
    assert cycles_of(alloc(1)) == (OK, 2)
    ref = ref_of(0, params=p)
    assert cycles_of(read(ref, 0)) == (OUT_OF_RANGE, 1)
    assert {cycles_of(append(ref, i)) for i in range(40)} == {(OK, 1)}
    assert cycles_of(read(ref, 39)) == (OK, 1)
    assert cycles_of(fetch_add(ref, 3, 1)) == (OK, 2)
    assert cycles_of(unlock(ref, 3, 4)) == (OK, 2)
    assert cycles_of(unlock(ref, 3, 4)) == (NOT_OWNER, 2)       # found in the second cycle
    growth = cycles_of(write(ref, 64, 1))                         # 40 words, capacity 64
    assert growth == (OK, 40 + 3 if alloc_mode is AllocMode.RESERVE else 1)
    assert cycles_of(length(ref)) == (OK, 1)
    weighted = refcount is RefcountMode.WEIGHTED
    # 65 words: 5 virtual blocks walked in virtual mode.
    assert cycles_of(ret(ref, 1) if weighted else decref(ref)) == \
        (OK, 2 + 5 if alloc_mode is AllocMode.VIRTUAL else 2)
    assert cycles_of(alloc(1)) == (OK, 2)
    ref = ref_of(0, 1, params=p)
    assert cycles_of(ret(ref, 1) if weighted else decref(ref)) == \
        (OK, 3 if alloc_mode is AllocMode.VIRTUAL else 2)         # nothing to walk
    assert cycles_of({"op": 15}) == (BAD_REQUEST, 1)
    assert mu.model.busy_cycles == sum(seen)


@pytest.mark.parametrize("alloc_mode, refcount", MODES)
def test_counters_are_the_ports_the_docs_define(alloc_mode, refcount):
    p = small(alloc_mode, refcount)
    mu = MU(p)
    single = alloc_mode is AllocMode.SINGLE
    refs = [mu.new() for _ in range(1 if single else 3)]
    for i in range(20):
        mu.ok(append(refs[0], i))
    mu.release(refs[-1])
    c = mu.model.counters()
    live = 0 if single else 2
    assert c["free_blocks"] == (p.n_blocks - 2 if alloc_mode is AllocMode.VIRTUAL else 0)
    assert c["free_slots"] == p.max_buffers - live == p.max_buffers - c["live_buffers"]
    assert (c["allocs"], c["frees"]) == (len(refs), 1)
    assert c["copy_cycles"] == mu.model.copy_words
    assert c["busy_cycles"] == mu.model.busy_cycles
    assert (c["held_words"], c["peak_held_words"]) == (mu.model.held_words,
                                                       mu.model.peak_held_words)
    assert set(c) == {"held_words", "peak_held_words", "live_buffers", "free_blocks",
                      "free_slots", "allocs", "frees", "copy_cycles", "busy_cycles"}
