# amaranth: UnusedElaboratable=no
"""The memory unit in Amaranth's simulator: parameters, Verilog, and response-by-response
equivalence with the golden model in every mode (the fast counterpart of tests/cosim)."""

import dataclasses
import gc
import types
import warnings

import pytest

from rdakit.hdl.memory.unit import MemoryUnit
from rdakit.hdl.spec.packets import MUOp, MUStatus, mu_request_layout, mu_response_layout, pack
from rdakit.hdl.spec.params import PLASTICINE_MU, AllocMode, MUParams, RefcountMode
from rdakit.sim.bench.mu import run_requests
from rdakit.sim.models.mu import (
    MUModel,
    alloc,
    append,
    decref,
    fetch_add,
    read,
    ret,
    unlock,
    write,
)
from rdakit.sim.verify.amaranth_sim import StreamDriver, simulate
from rdakit.sim.verify.mu_stimulus import MUStimulus
from rdakit.sim.verify.runner import generate_verilog

MODES = [(a, r) for a in AllocMode for r in RefcountMode]


# --- Parameters -------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,message", [
    ("words", 1000, r"^words must be a power of two, not 1000$"),
    ("words", 1, r"^words must be an integer at least 2, not 1$"),
    ("block_words", 3, r"^block_words must be a power of two, not 3$"),
    ("block_words", 1024, r"^block_words must be less than words \(1024\), not 1024$"),
    ("max_buffers", 6, r"^max_buffers must be a power of two, not 6$"),
    ("max_buffer_words", 8, r"^max_buffer_words must be between block_words \(16\) and words "
                            r"\(1024\), not 8$"),
    ("weight_bits", 0, r"^weight_bits must be an integer between 1 and 32, not 0$"),
    ("mu_id_bits", 17, r"^mu_id_bits must be an integer between 1 and 16, not 17$"),
    ("buf_id_bits", 3, r"^buf_id_bits must exceed log2\(max_buffers\) = 3 to leave room for "
                       r"generation bits, not 3$"),
    ("index_bits", 9, r"^index_bits must be at least log2\(max_buffer_words\) = 10, not 9$"),
    ("data_bits", 4, r"^data_bits must be an integer between 8 and 1024, not 4$"),
    ("tag_bits", -1, r"^tag_bits must be an integer between 0 and 32, not -1$"),
    ("coord_bits", 0, r"^coord_bits must be an integer between 1 and 8, not 0$"),
    ("alloc_mode", "paged", r"^alloc_mode must be one of 'virtual', 'reserve', 'single', "
                            r"not 'paged'$"),
    ("refcount", 3, r"^refcount must be a RefcountMode, not 3$"),
    ("reserve_words", 2048, r"^reserve_words must be at most max_buffer_words \(1024\), "
                            r"not 2048$"),
    ("words", "1024", r"^words must be an integer, not '1024'$"),
])
def test_init_wrong_param(field, value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        MUParams(**{field: value})


def test_init_weight_wider_than_data():
    with pytest.raises(ValueError, match=r"^weight_bits must be at most data_bits \(8\), "
                                         r"not 16$"):
        MUParams(data_bits=8, weight_bits=16, words=64, block_words=4)


def test_init_wrong_mu_id():
    with pytest.raises(TypeError, match=r"^MU ID must be an integer from 0 to 63 "
                                        r"\(mu_id_bits = 6\), not 64$"):
        MemoryUnit(MUParams(), mu_id=64)


def test_init_wrong_params_type():
    with pytest.raises(TypeError, match=r"^Params must be an MUParams, not \{\}$"):
        MemoryUnit({})


def test_plasticine_sizing_elaborates_to_verilog():
    p = PLASTICINE_MU
    assert (p.words * p.data_bits // 8, p.mu_id_bits, p.buf_id_bits) == (256 * 1024, 6, 16)
    assert p.addr_bits == 16 and p.index_bits == 16
    text = generate_verilog(MemoryUnit(p, mu_id=63))
    assert "module top" in text


@pytest.mark.parametrize("alloc,refcount", MODES)
def test_every_mode_converts_to_verilog(alloc, refcount):
    # Also a cheap check that no parametrization has a combinational loop.
    text = generate_verilog(MemoryUnit(MUParams(alloc_mode=alloc, refcount=refcount)))
    assert "always @*" not in text


# --- Behaviour --------------------------------------------------------------------------------

def small(alloc, refcount):
    return MUParams(words=128, block_words=8, max_buffers=4, buf_id_bits=4, weight_bits=3,
                    max_buffer_words=64, alloc_mode=alloc, refcount=refcount, reserve_words=4)


@pytest.mark.parametrize("alloc,refcount", MODES)
def test_random_stream_matches_model(alloc, refcount):
    p = small(alloc, refcount)
    stim = MUStimulus(p, seed=7, mu_id=2)
    model = MUModel(p, 2)
    reqs = []
    for _ in range(1500):
        r = stim.next_request()
        stim.observe(r, model.request(r))
        reqs.append(r)
    run_requests(p, reqs, mu_id=2, backpressure=0.6)   # raises on the first mismatch


def test_pipelined_reads_and_writes_one_per_cycle():
    p = MUParams()
    ref = {"mu": 0, "buf": 0}
    reqs = [{"op": MUOp.ALLOC, "data": 1}]
    reqs += [{"op": MUOp.APPEND, "ref": ref, "data": i} for i in range(256)]
    reqs += [{"op": MUOp.READ, "ref": ref, "index": i} for i in range(256)]
    res = run_requests(p, reqs)
    accepted = [c for c, _ in res.sent]
    # After ALLOC (two execute cycles), every APPEND and READ is accepted in the next cycle.
    assert accepted[-1] - accepted[1] == len(reqs) - 2
    assert [r["data"] for r in res.responses[257:]] == list(range(256))


def test_latency_is_two_cycles():
    p = MUParams()
    res = run_requests(p, [{"op": MUOp.ALLOC, "data": 1},
                           {"op": MUOp.LEN, "ref": {"mu": 0, "buf": 0}}], isolated=True)
    assert [r - s for (s, _), (r, _) in zip(res.sent, res.received, strict=True)] == [3, 2]


def test_free_releases_blocks_one_per_cycle():
    p = MUParams()
    ref = {"mu": 0, "buf": 0}
    latencies = {}
    for blocks in (1, 4, 16):
        reqs = [{"op": MUOp.ALLOC, "data": 1}]
        reqs += [{"op": MUOp.APPEND, "ref": ref, "data": i}
                 for i in range(blocks * p.block_words)]
        reqs += [{"op": MUOp.RETURN, "ref": ref, "data": 1}]
        res = run_requests(p, reqs)
        latencies[blocks] = res.received[-1][0] - res.sent[-1][0]
    assert latencies == {1: 4, 4: 7, 16: 19}


def test_back_pressure_loses_nothing():
    p = MUParams()
    ref = {"mu": 0, "buf": 0}
    reqs = [{"op": MUOp.ALLOC, "data": 1}]
    reqs += [{"op": MUOp.APPEND, "ref": ref, "data": 3 * i} for i in range(100)]
    reqs += [{"op": MUOp.READ, "ref": ref, "index": i} for i in range(100)]
    for bp in ("cycle", 0.3):
        res = run_requests(p, reqs, backpressure=bp)
        assert [r["data"] for r in res.responses[101:]] == [3 * i for i in range(100)]


def test_reserve_growth_costs_copy_cycles():
    p = MUParams(alloc_mode="reserve", reserve_words=16)
    ref = {"mu": 0, "buf": 0}
    reqs = [{"op": MUOp.ALLOC, "data": 1}]
    reqs += [{"op": MUOp.APPEND, "ref": ref, "data": i} for i in range(17)]
    res = run_requests(p, reqs, isolated=True)
    lat = [r - s for (s, _), (r, _) in zip(res.sent, res.received, strict=True)]
    assert lat[1:17] == [2] * 16
    # The 17th append moves 16 words to a 32-word region: one cycle a word, plus overhead.
    assert lat[17] == 2 + 16 + 2
    assert res.responses[-1]["status"] is MUStatus.OK


def test_unused_response_fields_are_deterministic():
    # An error response carries data 0 and echoes the request's ref, tag and source.
    p = MUParams()
    bad = {"op": MUOp.READ, "ref": {"mu": 0, "buf": 5}, "index": 3, "tag": 9,
           "src": {"x": 4, "y": 1}}
    res = run_requests(p, [bad])
    assert res.responses[0] == {"op": MUOp.READ, "status": MUStatus.BAD_REF,
                                "dst": {"x": 4, "y": 1}, "tag": 9,
                                "ref": {"mu": 0, "buf": 5}, "data": 0}
    mu = MemoryUnit(p)
    got = StreamDriver(mu, mu.req, mu.resp).run([pack(mu_request_layout(p), bad)])
    assert got[0][1] == pack(mu_response_layout(p), res.responses[0])


def test_params_are_one_definition():
    # The CLI options are generated from the dataclass: every field has one.
    from rdakit.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["verilog", "mu", "-o", "-", "--words", "2048"])
    assert args.words == 2048
    for f in dataclasses.fields(MUParams):
        assert hasattr(args, f.name)


def test_every_fsm_state_is_listed_for_the_observers(monkeypatch):
    """obs.state and the formal harnesses name the FSM's states by MU_STATES; a state added to
    the FSM but not to the list (as RMW once was) fails elaboration instead of silently
    reading as INIT."""
    from amaranth.back import rtlil

    import rdakit.hdl.memory.unit as mu

    monkeypatch.setattr(mu, "MU_STATES", tuple(s for s in mu.MU_STATES if s != "RMW"))
    with pytest.raises(AssertionError, match=r"MU_STATES lacks the FSM states \['RMW'\]"):
        rtlil.convert(MemoryUnit(MUParams(words=64, block_words=8, max_buffers=4,
                                          max_buffer_words=32)))
    with warnings.catch_warnings():     # the submodules the failed elaboration left unused
        warnings.simplefilter("ignore")
        gc.collect()


# --- The docs and the hardware agree (issue 19) -----------------------------------------------

def run_isolated(p, requests, *, mu_id=0):
    """Run ``requests`` through the RTL one at a time (each sent once the previous response has
    left) with no back-pressure. Returns the cycles until ``req.ready`` after reset, each
    request's latency, the responses (ints) and every counter port after the last response."""
    mu = MemoryUnit(p, mu_id=mu_id)
    req_layout = mu_request_layout(p)
    req_payload, resp_payload = mu.req.payload.as_value(), mu.resp.payload.as_value()
    out = types.SimpleNamespace(ready_after=0, latencies=[], responses=[], counters={})

    async def tb(ctx):
        while not ctx.get(mu.req.ready):
            await ctx.tick()
            out.ready_after += 1
        ctx.set(mu.resp.ready, 1)
        for r in requests:
            ctx.set(req_payload, pack(req_layout, r))
            ctx.set(mu.req.valid, 1)
            await ctx.tick().until(mu.req.ready)
            ctx.set(mu.req.valid, 0)
            cycles = valid = 0
            while not valid:
                _, _, valid, value = await ctx.tick().sample(mu.resp.valid, resp_payload)
                cycles += 1
            out.latencies.append(cycles)
            out.responses.append(value)
        await ctx.tick()
        out.counters = {name: ctx.get(getattr(mu, name))
                        for name in MUModel(p).counters()}

    simulate(mu, tb)
    return out


def agreement_stream(p, *, seed, n, mu_id=2):
    """Requests that reach every documented timing case of a mode (refused ALLOCs of each
    status, FETCH_ADD, UNLOCK by the holder and by another, frees of every size, reserve
    growths, every error), then a stream of the mixed stimulus; with the model after each."""
    model = MUModel(p, mu_id)
    stim = MUStimulus(p, seed=seed, mu_id=mu_id)
    weighted = p.refcount is RefcountMode.WEIGHTED
    reqs, cycles, responses = [], [], []

    def send(r):
        resp = model.request(r)
        stim.observe(r, resp)
        reqs.append(r)
        cycles.append(model.exec_cycles)
        responses.append(resp)
        return resp

    send(alloc(0))                                         # BAD_REQUEST
    send(alloc(p.max_weight + 1))                          # WEIGHT_OVERFLOW
    refs = [send(alloc(1))["ref"] for _ in range(p.max_buffers + 1)]   # the last: no slot
    ref = refs[0]
    for i in range(3):
        send(append(ref, 5 + i))
    send(fetch_add(ref, 1, 3))
    send(unlock(ref, 1, 9))                                # the holder: 6 + 3 = 9
    send(unlock(ref, 1, 9))                                # NOT_OWNER: the word is 10 now
    send(write(ref, 2 * p.block_words + 1, 7))             # sparse: a growth in reserve mode
    send(fetch_add(ref, p.block_words, 1))                 # a hole (virtual) or stale word
    for r in refs[:-1]:
        send(ret(r, 1) if weighted else decref(r))         # frees of 3 blocks, then 0
    while len(reqs) < n:
        send(stim.next_request())
    return reqs, cycles, responses, model


@pytest.fixture(scope="module", params=MODES, ids=[f"{a.value}-{r.value}" for a, r in MODES])
def agreement(request):
    """One RTL run per mode shared by the agreement tests: the stream, the model's execute
    cycles and responses, and what the RTL did."""
    p = small(*request.param)
    reqs, cycles, responses, model = agreement_stream(p, seed=11, n=400)
    return types.SimpleNamespace(p=p, reqs=reqs, cycles=cycles, responses=responses,
                                 model=model, rtl=run_isolated(p, reqs, mu_id=2))


def test_every_request_takes_the_documented_cycles(agreement):
    """Latency = the model's execute cycles + 1 for every request, also for refused ALLOCs
    (once 3 cycles; 2 as documented for errors), FETCH_ADD and UNLOCK (NOT_OWNER included),
    frees and reserve growths."""
    a = agreement
    p = a.p
    layout = mu_response_layout(p)
    assert a.rtl.responses == [pack(layout, r) for r in a.responses]
    got = [(i, r["op"], r["status"], lat)
           for i, (r, lat) in enumerate(zip(a.responses, a.rtl.latencies, strict=True))]
    want = [(i, r["op"], r["status"], c + 1)
            for i, (r, c) in enumerate(zip(a.responses, a.cycles, strict=True))]
    assert got == want
    # The stream reaches the cases the timing table names.
    seen = {(r["op"], r["status"]) for r in a.responses}
    ok, not_owner = MUStatus.OK, MUStatus.NOT_OWNER
    assert {(MUOp.ALLOC, s) for s in (ok, MUStatus.BAD_REQUEST, MUStatus.WEIGHT_OVERFLOW,
                                      MUStatus.OUT_OF_MEMORY)} <= seen
    assert {(MUOp.FETCH_ADD, ok), (MUOp.UNLOCK, ok), (MUOp.UNLOCK, not_owner)} <= seen
    if p.alloc_mode is AllocMode.RESERVE:
        assert a.model.growths > 0 and max(a.cycles) > 3


def test_counters_read_what_the_docs_say(agreement):
    """Every counter port equals the model's ``counters()``: copy_cycles the words copied
    (once one more per growth), busy_cycles the execute cycles, free_blocks 0 outside
    virtual mode, free_slots max_buffers - live_buffers."""
    a = agreement
    assert a.rtl.counters == a.model.counters()
    assert a.model.counters()["busy_cycles"] == sum(a.cycles)
    if a.p.alloc_mode is AllocMode.RESERVE:
        assert a.model.copy_words > 0


def test_ready_soon_after_reset(agreement):
    """req.ready rises max_buffers + 1 cycles after reset (once the walk of the block table
    made it max_buffers * max_vblocks)."""
    assert agreement.rtl.ready_after == agreement.p.max_buffers + 1


@pytest.mark.parametrize("params", [MUParams(), PLASTICINE_MU], ids=["default", "plasticine"])
def test_ready_after_reset_is_a_walk_over_slots(params):
    """9 cycles by default and 257 with the Plasticine preset (once 513 and 65,537)."""
    mu = MemoryUnit(params)
    cycles = []

    async def tb(ctx):
        n = 0
        while not ctx.get(mu.req.ready):
            assert n <= params.max_buffers, f"not ready after {n} cycles"
            await ctx.tick()
            n += 1
        cycles.append(n)

    simulate(mu, tb)
    assert cycles == [params.max_buffers + 1]


def test_reserve_growth_of_an_empty_buffer_copies_nothing():
    """A WRITE past the capacity of an empty buffer moves it without copying a word: 3 execute
    cycles and copy_cycles 0 (it counted 1)."""
    p = small(AllocMode.RESERVE, RefcountMode.WEIGHTED)
    ref = {"mu": 0, "buf": 0}
    reqs = [alloc(1), write(ref, p.reserve_words, 4), read(ref, p.reserve_words)]
    res = run_isolated(p, reqs, mu_id=0)
    assert res.latencies == [3, 4, 2]
    assert res.counters["copy_cycles"] == 0


def test_docs_tables_name_every_operation():
    """The check-order and timing tables of docs/memory-unit.md have a row per operation
    (FETCH_ADD and UNLOCK were missing) and are up to date with their source in code."""
    from rdakit.cli.docs import DOCS, SECTIONS, render

    text = (DOCS / "memory-unit.md").read_text()
    assert render(text, SECTIONS["memory-unit.md"]) == text, "run rdakit docs"
    for section in ("checks", "timing"):
        body = text.split(f"<!-- BEGIN GENERATED: {section} -->")[1].split("<!-- END")[0]
        rows = [line.split("|")[1].strip() for line in body.strip().splitlines()[2:]]
        assert rows == [op.name for op in MUOp], section


@pytest.mark.parametrize("alloc_mode", [AllocMode.RESERVE, AllocMode.SINGLE])
def test_never_written_words_read_what_the_physical_word_last_held(alloc_mode):
    """docs/memory-unit.md, Words never written, outside virtual mode: a word below the length
    that the buffer never wrote reads what an earlier buffer left in that physical word (0 if
    nothing wrote it), in the model and in the RTL; a growth copies it as it is."""
    p = small(alloc_mode, RefcountMode.WEIGHTED)
    ref0, ref1 = {"mu": 0, "buf": 0}, {"mu": 0, "buf": 1 << p.slot_bits}
    reqs = [alloc(1), append(ref0, 41), append(ref0, 42), ret(ref0, 1),   # slot 0, generation 1
            alloc(1), write(ref1, 3, 7), read(ref1, 0), read(ref1, 1), read(ref1, 2)]
    if alloc_mode is AllocMode.RESERVE:
        reqs += [write(ref1, p.reserve_words, 8), read(ref1, 1), read(ref1, 2)]   # a growth
    model = MUModel(p)
    want = [model.request(r) for r in reqs]
    assert [r["data"] for r in want[6:9]] == [41, 42, 0]
    if alloc_mode is AllocMode.RESERVE:
        assert [r["data"] for r in want[10:]] == [42, 0] and model.growths == 1
    got = run_isolated(p, reqs, mu_id=0).responses
    assert got == [pack(mu_response_layout(p), r) for r in want]
