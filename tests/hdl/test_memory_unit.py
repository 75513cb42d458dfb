# amaranth: UnusedElaboratable=no
"""The memory unit in Amaranth's simulator: parameters, Verilog, and response-by-response
equivalence with the golden model in every mode (the fast counterpart of tests/cosim)."""

import dataclasses
import gc
import warnings

import pytest

from rdakit.hdl.memory.unit import MemoryUnit
from rdakit.hdl.spec.packets import MUOp, MUStatus, mu_request_layout, mu_response_layout, pack
from rdakit.hdl.spec.params import PLASTICINE_MU, AllocMode, MUParams, RefcountMode
from rdakit.sim.bench.mu import run_requests
from rdakit.sim.models.mu import MUModel
from rdakit.sim.verify.amaranth_sim import StreamDriver
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
