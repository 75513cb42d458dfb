# amaranth: UnusedElaboratable=no
"""Workloads with memory dynamism (``sim/verify/dynamic.py``): bit-exact against numpy on the
interpreter for random seeds and sizes under every scheme, no leak, no premature free, the
performance model, and one small run on the RTL in Amaranth's simulator."""

import asyncio
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.spec.isa import Instr, Op
from rdakit.hdl.spec.packets import MUOp
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.models.cu_state import DeadlockError
from rdakit.sim.models.perf import ModelTransport
from rdakit.sim.runtime.host import AmaranthTransport, HostDriver
from rdakit.sim.runtime.job import prepare_interp, run_job, run_job_interp
from rdakit.sim.verify.amaranth_sim import simulate
from rdakit.sim.verify.dynamic import (
    SPLITS,
    generation,
    moe_dispatch,
    speculative,
    static_copies,
)

#: Three CUs decoding into one MU (where the host's buffers live too).
SCHEMES = {"weighted+virtual": {}, "counter+virtual": {"refcount": "counter"},
           "weighted+reserve": {"alloc_mode": "reserve"}}


def _params(**extra):
    return fabric_params(2, 2, layout="CC/CM", mu_words=512, block_words=4, prog_len=128,
                         **extra)


def _run_interp(job, **kw):
    """Run ``job`` on the interpreter; return outputs, result and the MUs' state before the
    run (after the host filled its buffers) and after it."""
    interp, refs = prepare_interp(job, **kw)
    before = {xy: m.counters() for xy, m in interp._mus.items()}
    result = interp.run(max_steps=50_000_000)
    out = interp.read_buffer(job.buffers[-1].mu, refs["io"])
    return out, result, before, interp


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), sequences=st.integers(1, 7), slots=st.integers(1, 3),
       scheme=st.sampled_from(sorted(SCHEMES)), schedule=st.sampled_from(["round_robin",
                                                                          "random"]))
def test_generation_is_bit_exact_and_leaves_no_buffer(seed, sequences, slots, scheme, schedule):
    """Any seed, batch and scheme, in any interleaving of the CUs: every sequence's result
    word as numpy's, every cache the CUs allocated freed and the MU's free lists as the host
    left them (same free blocks, slots and held words as before the run)."""
    p = _params(**SCHEMES[scheme])
    job = generation(p, sequences=sequences, slots=slots, min_len=1, max_len=9, seed=seed)
    out, result, before, interp = _run_interp(job, schedule=schedule, seed=seed)
    assert result.ok, result
    np.testing.assert_array_equal(out, job.expected["io"])
    mu = interp.mu(1, 1)
    after = mu.counters()
    assert after["allocs"] - before[(1, 1)]["allocs"] == sequences
    assert after["frees"] - before[(1, 1)]["frees"] == sequences
    for key in ("held_words", "live_buffers", "free_blocks", "free_slots"):
        assert after[key] == before[(1, 1)][key], key
    mu.check_invariants()


def test_lengths_are_drawn_at_run_time_not_compiled_in():
    """Two seeds give different lengths and the same programs: the sizes are data."""
    p = _params()
    a, b = generation(p, seed=1), generation(p, seed=2)
    assert a.lengths != b.lengths
    assert a.config.tiles == b.config.tiles
    assert a.tokens == sum(a.lengths)


def test_caches_outgrow_blocks_and_reservations():
    """Long sequences: the caches take several blocks (virtual) or grow past their
    reservation and are copied (reserve); every result is still numpy's."""
    for scheme, extra in SCHEMES.items():
        p = _params(**extra)
        job = generation(p, sequences=5, slots=2, min_len=10, max_len=20, seed=7)
        out, result, before, interp = _run_interp(job)
        assert result.ok, (scheme, result)
        np.testing.assert_array_equal(out, job.expected["io"])
        copied = interp.mu(1, 1).counters()["copy_cycles"] - before[(1, 1)]["copy_cycles"]
        assert (copied > 0) == (extra.get("alloc_mode") == "reserve"), (scheme, copied)


def _release_before_last_read(job):
    """``job`` with each CU's cache released before the stream that reads it (a premature
    free)."""
    tiles = {}
    for xy, tile in job.config.tiles.items():
        prog = list(tile.program)
        rel = next(i for i, ins in enumerate(prog) if ins.op in (Op.RETI, Op.DECREF))
        srun = max(i for i, ins in enumerate(prog[:rel]) if ins.op is Op.SRUN)
        ins = prog.pop(rel)
        prog.insert(srun, ins)
        tiles[xy] = dataclasses.replace(tile, program=prog)
    return dataclasses.replace(job, config=dataclasses.replace(job.config, tiles=tiles))


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_a_premature_free_is_caught(scheme):
    """The checks can fail: releasing a cache before its last read makes that read a stale
    reference (MU_ERROR), where the kernel as written runs clean."""
    job = generation(_params(**SCHEMES[scheme]), sequences=3, slots=1, min_len=3, max_len=3)
    _, result, _ = run_job_interp(job)
    assert result.ok
    _, bad, _ = run_job_interp(_release_before_last_read(job))
    assert not bad.ok
    assert sum(bad.mu_errors.values()) > 0


def test_the_program_loops_instead_of_unrolling():
    """The programs do not grow with the number of sequences or their lengths."""
    p = _params()
    small = generation(p, sequences=1, min_len=1, max_len=1)
    big = generation(p, sequences=40, min_len=30, max_len=60)
    assert [t.program for t in small.config.tiles.values()] == \
        [t.program for t in big.config.tiles.values()]
    assert len(small.config.tiles[(0, 0)].program) < 80


@pytest.mark.parametrize("kw,message", [
    ({"sequences": 0}, r"^sequences must be an integer of at least 1, not 0$"),
    ({"min_len": 5, "max_len": 4}, r"^max_len must be at least min_len \(5\), not 4$"),
    ({"vocab": 12}, r"^vocab must be a power of two, not 12$"),
    ({"slots": 33}, r"^slots must be at most 32 \(the local buffer holds 8 elements a slot\), "
                    r"not 33$"),
])
def test_generation_refuses_sizes_it_cannot_run(kw, message):
    with pytest.raises(ValueError, match=message):
        generation(_params(), **kw)


def test_generation_refuses_a_program_memory_too_small():
    with pytest.raises(ValueError, match=r"^generation's program has \d+ instructions; "
                                         r"prog_len is 64$"):
        generation(fabric_params(2, 2, layout="CC/CM"))


@pytest.fixture(scope="module")
def model_run():
    """The generation workload on the performance model (0.1 s)."""
    p = _params()
    job = generation(p, sequences=6, slots=2, min_len=4, max_len=12, seed=3)
    return job, asyncio.run(run_job(HostDriver(p, ModelTransport(p)), job))


def test_generation_on_the_model(model_run):
    """Bit-exact on the model, every cache allocated during the run freed during it."""
    job, result = model_run
    result.check(job)
    c = result.counters[(1, 1)]
    assert c["allocs"] == c["frees"] == 6
    assert c["live_buffers"] == len(job.buffers)


@pytest.mark.long   # 12 s: elaborating and simulating a 2x2 fabric for ~800 cycles
def test_generation_on_the_rtl_matches_the_interpreter():
    """A small run on the RTL in Amaranth's simulator: outputs, allocations and frees as the
    interpreter's and numpy's."""
    p = fabric_params(2, 2, layout="CC/CM", mu_words=256, block_words=4, prog_len=128)
    job = generation(p, sequences=4, slots=2, min_len=2, max_len=6, seed=1)
    fabric = Fabric(p)
    out = {}

    async def tb(ctx):
        out["r"] = await run_job(HostDriver(p, AmaranthTransport(ctx, fabric)), job)

    simulate(fabric, tb)
    result = out["r"]
    result.check(job)
    interp_out, interp_result, _ = run_job_interp(job)
    assert interp_result.ok
    np.testing.assert_array_equal(result.outputs["io"], interp_out["io"])
    c = result.counters[(1, 1)]
    assert c["allocs"] == c["frees"] == 4
    assert c["live_buffers"] == len(job.buffers)


# --- MoE with run-time dispatch ----------------------------------------------------------------

def _moe_params(**extra):
    return fabric_params(2, 3, layout="CCM/CCM", prog_len=128, **extra)


def _moe(p, **kw):
    return moe_dispatch(p, host_mu=(2, 1), token_mu=(2, 0), **kw)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 10), d=st.integers(1, 6),
       split=st.sampled_from(SPLITS), counter=st.booleans(),
       schedule=st.sampled_from(["round_robin", "random"]))
def test_moe_dispatch_is_bit_exact_and_frees_every_token(seed, tokens, d, split, counter,
                                                         schedule):
    """Any gate outcome, split and interleaving: every (token, expert) word as numpy's, and
    each token buffer freed exactly once, by whichever holder returns last."""
    p = _moe_params(refcount="counter" if counter else "weighted")
    job = _moe(p, tokens=tokens, d=d, split=split, seed=seed)
    outputs, result, interp = run_job_interp(job, schedule=schedule, seed=seed)
    assert result.ok, result
    np.testing.assert_array_equal(outputs["io"], job.expected["io"])
    mu = interp.mu(2, 0)
    assert mu.allocs == mu.frees == tokens
    assert mu.live_buffers() == {}
    ops = result.mu_ops[(2, 0)]
    copies = sum(c.refs_sent for c in result.cus.values()) - job.control_refs
    if counter:
        assert ops[MUOp.INCREF] == copies and ops[MUOp.DECREF] == copies + tokens
    else:
        # Partial-free: no message at a copy, one at each return.
        assert ops[MUOp.INCREF] == 0 and ops[MUOp.RETURN] == copies + tokens
        if split != "halving":
            assert ops[MUOp.ADD_WEIGHT] == 0


def test_moe_holders_are_decided_by_data():
    """The gate picks between none and all of the experts, token by token."""
    job = _moe(_moe_params(), tokens=32, d=2, seed=5)
    x = job.buffers[0].data[:64].reshape(32, 2, -1)
    picked = {int((x[t, 0, :3] > 0).sum()) for t in range(32)}
    assert picked == {0, 1, 2, 3}


def test_static_analysis_counts_the_copies_of_the_token_buffer():
    """The router's program sends the token buffer from one SENDREF per expert (the stop
    messages send register r0): the static split allocates that many plus one."""
    for n in (1, 2, 3):
        p = _moe_params()
        cus = p.tiles("C")
        job = _moe(p, tokens=2, split="static", router=cus[0], experts=cus[1:1 + n])
        assert static_copies(job.config.tiles[cus[0]].program) == n
        assert any(ins.op is Op.ALLOC and ins.imm == n + 1
                   for ins in job.config.tiles[cus[0]].program)


def test_halving_adds_weight_when_the_router_holds_one():
    """Halving with 3-bit weights (4 allocated): the third copy of a token finds the router
    holding 1 and raises the total once; with 2-bit weights the second raise overflows."""
    def all_three(p, seed):
        return _moe(p, tokens=8, d=1, split="halving", seed=seed)
    seed = next(s for s in range(100) if (all_three(_moe_params(), s).buffers[0].data[:8, :3]
                                          > 0).all(axis=1).any())
    _, ok, _ = run_job_interp(all_three(_moe_params(weight_bits=3), seed))
    assert ok.ok and ok.mu_ops[(2, 0)][MUOp.ADD_WEIGHT] > 0
    with pytest.raises(DeadlockError):       # the router halts, the experts wait for it
        run_job_interp(all_three(_moe_params(weight_bits=2), seed))


@pytest.mark.parametrize("kw,message", [
    ({"split": "thirds"}, r"^split must be one of halving, fanout, static, not 'thirds'$"),
    ({"tokens": 0}, r"^tokens must be an integer of at least 1, not 0$"),
    ({"experts": [(0, 1)] * 4}, r"^moe_dispatch needs 1 to 3 experts"),
])
def test_moe_dispatch_refuses_what_it_cannot_run(kw, message):
    with pytest.raises(ValueError, match=message):
        _moe(_moe_params(), **kw)


def test_counters_without_the_incref_free_too_early():
    """The check can fail: counter-based counting with the copies' INCREFs left out frees a
    token buffer when the router drops its count, before the experts read it (a stale
    reference, MU_ERROR), where the kernel as written runs clean in the same schedules."""
    p = _moe_params(refcount="counter")
    job = _moe(p, tokens=6, d=2, seed=1)
    router = p.tiles("C")[0]
    tile = job.config.tiles[router]
    no_incref = dataclasses.replace(job, config=dataclasses.replace(job.config, tiles={
        **job.config.tiles, router: dataclasses.replace(tile, program=[
            Instr(Op.NOP) if ins.op is Op.INCREF else ins for ins in tile.program])}))
    for seed in range(3):
        assert run_job_interp(job, schedule="random", seed=seed)[1].ok
        try:
            _, bad, _ = run_job_interp(no_incref, schedule="random", seed=seed)
        except DeadlockError as e:       # an expert halted: the router waits for its ack
            bad = e.result
        assert not bad.ok and sum(bad.mu_errors.values()) > 0


# --- Speculative decoding ----------------------------------------------------------------------

@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), rounds=st.integers(1, 12), counter=st.booleans(),
       reserve=st.booleans(), schedule=st.sampled_from(["round_robin", "random"]))
def test_speculative_is_bit_exact_and_reclaims_every_branch(seed, rounds, counter, reserve,
                                                            schedule):
    """Any draft data and interleaving: the cache's checksum, length and last token as
    numpy's; three branches allocated and freed a round, the prefix freed once at the end;
    partial-free sends no message for the prefix's copies (one RETURN frees it), counters
    an INCREF and a DECREF for each."""
    p = _moe_params(refcount="counter" if counter else "weighted",
                    alloc_mode="reserve" if reserve else "virtual")
    job = speculative(p, rounds=rounds, host_mu=(2, 1), cache_mu=(2, 0), seed=seed)
    outputs, result, interp = run_job_interp(job, schedule=schedule, seed=seed)
    assert result.ok, result
    np.testing.assert_array_equal(outputs["io"], job.expected["io"])
    mu = interp.mu(2, 0)
    assert mu.allocs == mu.frees == 1 + 3 * rounds and mu.live_buffers() == {}
    ops = result.mu_ops[(2, 0)]
    if counter:
        assert ops[MUOp.INCREF] == 3 * rounds and ops[MUOp.DECREF] == 1 + 9 * rounds
    else:
        assert ops[MUOp.RETURN] == 1 + 6 * rounds and ops[MUOp.ADD_WEIGHT] == 0


def test_speculative_cache_keeps_the_accepted_entries():
    """The prefix grows by the accepted entries only: from 1 entry by 0 to 3 a round."""
    job = speculative(_moe_params(), rounds=20, host_mu=(2, 1), cache_mu=(2, 0), seed=4)
    length = int(job.expected["io"][-1, 1])
    assert 1 < length < 1 + 3 * 20


def test_speculative_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match=r"^vocab must be a power of two of at least 8, "
                                         r"not 4$"):
        speculative(_moe_params(), vocab=4)
    with pytest.raises(ValueError, match=r"^rounds must be an integer of at least 1, not 0$"):
        speculative(_moe_params(), rounds=0)
