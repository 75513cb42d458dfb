"""MU capacity bookkeeping of the lowering: the host's references on a fresh fabric, computed
from the parameters alone, are the ones the golden MU model hands out, and an MU refuses the same
buffers with the same status; the capacity bound counts what the allocator holds."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdakit.compiler.job import HostBuffer, Job
from rdakit.compiler.lower import LoweringError, replay_refs
from rdakit.compiler.lower.capacity import Account
from rdakit.hdl.spec.bitstream import FabricConfig
from rdakit.hdl.spec.packets import MUOp, MUStatus
from rdakit.hdl.spec.params import fabric_params
from rdakit.hdl.spec.vector import pack_vector
from rdakit.sim.models.mu import MUModel

EXAMPLES = 25 if os.environ.get("CI") else 100


def model_refs(job):
    """The references (or the error) of ``job``'s host buffers replayed on golden MU models:
    what replay_refs did before it computed them from the parameters."""
    p = job.params
    models, refs = {}, {}
    for b in job.buffers:
        mu = tuple(b.mu)
        model = models.setdefault(mu, MUModel(p.mu, p.mu_id(*mu)))
        resp = model.request({"op": MUOp.ALLOC, "data": b.weight})
        if resp["status"] is not MUStatus.OK:
            return f"MU {mu} refuses host buffer {b.name!r}: {resp['status'].name}"
        ref = resp["ref"]
        for row in ([] if b.data is None else np.asarray(b.data).tolist()):
            r = model.request({"op": MUOp.APPEND, "ref": ref, "data": pack_vector(row)})
            if r["status"] is not MUStatus.OK:
                return f"MU {mu} cannot hold host buffer {b.name!r}: {r['status'].name}"
        refs[b.name] = ref["mu"] | ref["buf"] << p.mu.mu_id_bits
    return refs


def job_of(params, buffers):
    return Job(FabricConfig(params, {}), buffers, [], {})


def replayed(job):
    try:
        return replay_refs(job)
    except LoweringError as e:
        return str(e)


MODES = [dict(alloc_mode="virtual"), dict(alloc_mode="reserve"), dict(alloc_mode="single"),
         dict(alloc_mode="virtual", refcount="counter")]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(m.values()))
@settings(max_examples=EXAMPLES, deadline=None)
@given(bufs=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 300), st.integers(0, 300)),
                     max_size=8))
def test_host_refs_match_the_golden_model(mode, bufs):
    params = fabric_params(2, 2, mu_words=256, max_buffers=4, **mode)
    mus = params.tiles("M")
    lanes = params.cu.lanes
    buffers = [HostBuffer(f"b{i}", mus[m % len(mus)],
                          None if rows == 0 else np.full((rows, lanes), i, np.int32), weight)
               for i, (m, rows, weight) in enumerate(bufs)]
    job = job_of(params, buffers)
    assert replayed(job) == model_refs(job)


def test_reserve_growth_leaves_regions_for_later_buffers():
    # A buffer that grows past its 16-word reservation moves to a 32-word region; its first
    # region is taken by the next buffer, so both fit where the bump allocator alone would not.
    params = fabric_params(2, 2, mu_words=64, alloc_mode="reserve")
    mu = params.tiles("M")[0]
    lanes = params.cu.lanes
    grown = HostBuffer("grown", mu, np.zeros((20, lanes), np.int32))
    small = HostBuffer("small", mu, np.zeros((16, lanes), np.int32))
    job = job_of(params, [grown, small])
    refs = replay_refs(job)
    assert refs == model_refs(job)
    assert refs["small"] >> params.mu.mu_id_bits == 1


@pytest.mark.parametrize("weight, status", [(0, "BAD_REQUEST"), (256, "WEIGHT_OVERFLOW")])
def test_refused_allocation_names_the_mu_buffer_and_status(weight, status):
    params = fabric_params(2, 2)
    mu = params.tiles("M")[0]
    with pytest.raises(LoweringError) as e:
        replay_refs(job_of(params, [HostBuffer("w", mu, None, weight)]))
    assert str(e.value) == f"MU {mu} refuses host buffer 'w': {status}"


def test_a_buffer_past_the_mu_is_refused_at_the_word_that_does_not_fit():
    params = fabric_params(2, 2, mu_words=256)
    mu = params.tiles("M")[0]
    big = HostBuffer("big", mu, np.zeros((257, params.cu.lanes), np.int32))
    with pytest.raises(LoweringError, match=r"cannot hold host buffer 'big': OUT_OF_RANGE$"):
        replay_refs(job_of(params, [big]))


@pytest.mark.parametrize("mode, words, units", [
    ("virtual", 0, 0), ("virtual", 1, 1), ("virtual", 16, 1), ("virtual", 17, 2),
    ("reserve", 0, 16), ("reserve", 16, 16), ("reserve", 17, 16 + 32),
    ("reserve", 49, 16 + 32 + 64),
    ("single", 40, 40)])
def test_account_units_are_what_the_allocator_holds(mode, words, units):
    params = fabric_params(2, 2, alloc_mode=mode)
    assert Account(params, params.tiles("C")).units(words) == units


def test_account_counts_a_buffer_live_until_every_share_returned_before():
    params = fabric_params(2, 2)
    cus = params.tiles("C")
    acct = Account(params, cus)
    m = acct.mus[0]
    a, b = cus[0], cus[1]
    alloc = acct.tick(a)
    acct.alloc(m, "t", 10, 2, alloc)
    acct.ret("t", acct.tick(a))
    ret_b = acct.tick(b)
    acct.ret("t", ret_b)
    # b's return is not known to a yet: still live for a, dead once a has heard from b.
    assert acct.live(m, acct.tick(a)) == (10, 1)
    acct.merge(a, ret_b)
    assert acct.live(m, acct.tick(a)) == (0, 0)
