# amaranth: UnusedElaboratable=no
"""Streams between CUs on the RTL (issue 18): a producer CU's QUEUE stream sends its results
straight into a consumer CU's input queue, with credit flow control; the consumer's stream
reads the queue (``A_REF`` = its own ID) and ends at its producer's last word.

Two CUs of a 2x2 checkerboard wired to two MUs (:mod:`rdakit.sim.verify.cu_harness`), an input
queue of 8 words (smaller than the 12-row streams here, so the producer runs out of credits;
credits go back in pairs while the consumer pops every cycle). Every
scenario runs in one simulation (a module fixture) and is compared with numpy and with the
interpreter (:mod:`rdakit.sim.models.interp`).
"""

import numpy as np
import pytest
from conftest import rand32, s32, wrap32

from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.isa import BMode, DMode, assemble
from rdakit.hdl.spec.params import CUParams, FabricParams, MUParams
from rdakit.sim.models.interp import DeadlockError, Interpreter
from rdakit.sim.verify.cu_harness import HarnessError, run_session

LANES = 4
Q = 8
MU_P = MUParams(words=1024, block_words=16, max_buffers=16, max_buffer_words=128,
                buf_id_bits=6, weight_bits=4, mu_id_bits=2, index_bits=8,
                data_bits=32 * LANES, tag_bits=4, coord_bits=1)
P = FabricParams(rows=2, cols=2, mu=MU_P, cu=CUParams(
    lanes=LANES, prog_len=64, regs=8, local_words=16, outstanding=8, channels=4, mailbox=2,
    queue_words=Q))
CU0, CU1 = (0, 0), (1, 1)
MU_A, MU_B = (1, 0), (0, 1)
MU_A_ID, MU_B_ID = P.mu_id(*MU_A), P.mu_id(*MU_B)
CU0_ID, CU1_ID = P.mu_id(*CU0), P.mu_id(*CU1)
ROWS = 12

rng = np.random.default_rng(18)
X = rand32(rng, (ROWS, LANES)) >> 8            # the producer's input (in MU A)
W = rand32(rng, (ROWS, LANES))                 # the consumer's weights (its local buffer)


def cfg(**fields):
    return "\n".join(f"SCFGI {name}, {int(getattr(v, 'value', v))}" for name, v in fields.items())


#: The producer: y = (x * 3) >> 1 for every word of r1, sent to CU1's queue.
PRODUCE = f"""
    SCFG A_REF, r1
    LI r6, {CU1_ID}
    SCFG D_REF, r6
    {cfg(A_STRIDE=1, N=ROWS, B_MODE=BMode.SCALAR, B_VAL=3, SHIFT=1, D_MODE=DMode.QUEUE)}
    SRUN MUL, r0
    HALT
"""

#: The consumer: z = y + w (w from the local buffer), appended to r1; a delay loop of
#: ``delay`` iterations first (a slow consumer: the producer waits for credits).
def consume(delay=0):
    wait = f"LI r5, {delay}\nd: LOOP r5, d" if delay else ""
    return f"""
        {wait}
        SELF r2
        SCFG A_REF, r2
        SCFG D_REF, r1
        {cfg(N=ROWS, B_MODE=BMode.LOCAL, B_VAL=0, B_STRIDE=1, D_MODE=DMode.APPEND)}
        SRUN ADD, r3
        HALT
    """


#: The same two stages through an MU buffer: ALLOC, a stream appending, SENDREF; RECV, LEN, a
#: stream reading it, RETI.
PRODUCE_MU = f"""
    LI r7, {MU_B_ID}
    ALLOC r2, r7, 1
    SCFG A_REF, r1
    SCFG D_REF, r2
    {cfg(A_STRIDE=1, N=ROWS, B_MODE=BMode.SCALAR, B_VAL=3, SHIFT=1, D_MODE=DMode.APPEND)}
    SRUN MUL, r0
    LI r6, {CU1_ID}
    LI r5, 1
    SENDREF 0, r6, r2, r5
    HALT
"""
CONSUME_MU = f"""
    RECV 0, r2
    LEN r4, r2
    SCFG A_REF, r2
    SCFG N, r4
    SCFG D_REF, r1
    {cfg(A_STRIDE=1, B_MODE=BMode.LOCAL, B_VAL=0, B_STRIDE=1, D_MODE=DMode.APPEND)}
    SRUN ADD, r0
    RETI r2, 1
    HALT
"""

#: End of stream with a run-time length: the producer sends r3 words (r3 = 7, then 5, then 5),
#: the consumer's streams are configured for 16 and end at the producer's last word: a SUM
#: (count in r5), an ARGMAX (r6, r7; count in r0, the register after them modulo 8) and a
#: PACK_SUM of two-step rows (the last row has one step: V holds three lanes).
EOS_PRODUCE = f"""
    SCFG A_REF, r1
    LI r6, {CU1_ID}
    SCFG D_REF, r6
    {cfg(A_STRIDE=1, B_MODE=BMode.ZERO, D_MODE=DMode.QUEUE)}
    SCFG N, r3
    SRUN PASS, r0
    SCFGI N, 5
    SRUN PASS, r0
    SRUN PASS, r0
    HALT
"""
EOS_CONSUME = f"""
    SELF r2
    SCFG A_REF, r2
    SCFG D_REF, r1
    {cfg(N=16, B_MODE=BMode.ZERO, D_MODE=DMode.SUM)}
    SRUN PASS, r4
    {cfg(D_MODE=DMode.ARGMAX)}
    SRUN PASS, r6
    {cfg(N=2, OUTER=8, D_MODE=DMode.PACK_SUM)}
    SRUN PASS, r3
    HALT
"""

#: Misuse: both CUs stream Q words into CU1's queue (Q words), which CU1 never reads: each
#: producer holds Q credits, so a word finds the queue full.
OVERFLOW_SELF = f"""
    SCFG A_REF, r1
    LI r6, {CU1_ID}
    SCFG D_REF, r6
    {cfg(A_STRIDE=1, N=Q, D_MODE=DMode.QUEUE)}
    SRUN PASS, r0
    WAIT 0, 1
    HALT
"""
#: Misuse: a consumer that never reads: the producer stalls on credits, never done.
NEVER_READS = "WAIT 0, 1\nHALT"

#: Credits owed are not kept for a batch when the consumer stops popping: it takes one word
#: (a pair is the batch), then waits for a token the producer sends only after Q + 1 words,
#: which needs that one credit.
FLUSH_PRODUCE = PRODUCE.replace(f"N, {ROWS}", f"N, {Q + 1}").replace(
    "HALT", f"LI r7, {CU1_ID}\nSEND 0, r7, 1\nHALT")
FLUSH_CONSUME = f"""
    SELF r2
    SCFG A_REF, r2
    SCFG D_REF, r1
    {cfg(N=1, B_MODE=BMode.ZERO, D_MODE=DMode.APPEND)}
    SRUN PASS, r3
    WAIT 0, 1
    SCFGI N, {ROWS}
    SRUN PASS, r3
    HALT
"""

SCENARIOS = {
    # name: ({tile: program}, {tile: {register: buffer name or value}}, {tile: local})
    "pipeline": ({CU0: PRODUCE, CU1: consume()}, {CU0: {1: "x"}, CU1: {1: "out"}},
                 {CU1: W}),
    "slow_consumer": ({CU0: PRODUCE, CU1: consume(delay=80)},
                      {CU0: {1: "x"}, CU1: {1: "out"}}, {CU1: W}),
    "through_mu": ({CU0: PRODUCE_MU, CU1: CONSUME_MU}, {CU0: {1: "x"}, CU1: {1: "out"}},
                   {CU1: W}),
    "eos": ({CU0: EOS_PRODUCE, CU1: EOS_CONSUME}, {CU0: {1: "x", 3: 7}, CU1: {1: "out"}},
            {}),
    "bad_queue_destination": ({CU0: f"LI r6, {MU_B_ID}\nSCFG D_REF, r6\nSCFG A_REF, r1\n"
                                    f"{cfg(N=1, D_MODE=DMode.QUEUE)}\nSRUN PASS, r0\nHALT"},
                              {CU0: {1: "x"}}, {}),
    "bad_queue_source": ({CU0: f"LI r6, {CU1_ID}\nSCFG A_REF, r6\n"
                               f"{cfg(N=1, D_MODE=DMode.SUM)}\nSRUN PASS, r0\nHALT"},
                         {CU0: {1: 0}}, {}),
    "credits_flushed": ({CU0: FLUSH_PRODUCE, CU1: FLUSH_CONSUME},
                        {CU0: {1: "x"}, CU1: {1: "out"}}, {}),
    "overflow": ({CU0: PRODUCE.replace(f"N, {ROWS}", f"N, {Q}"), CU1: OVERFLOW_SELF},
                 {CU0: {1: "x"}, CU1: {1: "x"}}, {}),
    # Last: it leaves the CUs running.
    "never_reads": ({CU0: PRODUCE, CU1: NEVER_READS}, {CU0: {1: "x"}}, {}),
}
MAX_CYCLES = {"never_reads": 400}
#: Registers holding a reference the program allocated (besides those given a buffer): the
#: session's MUs hand out other slots than the interpreter's fresh ones.
ALLOCATED = {"through_mu": {CU0: {2}, CU1: {2}}}


def _buffers():
    """The scenario's buffers: ``x`` in MU A, an empty ``out`` in MU B."""
    return {"x": (MU_A, X), "out": (MU_B, np.zeros((0, LANES), np.int32))}


def _tiles(name):
    programs, regs, local = SCENARIOS[name]
    return programs, regs, local


def _tile_config(program, regs, local, refs):
    values = {r: refs[v] if isinstance(v, str) else v for r, v in regs.items()}
    words = {w: [int(v) for v in row] for w, row in enumerate(local)} if local is not None \
        else {}
    return TileConfig(program=assemble(program), regs=values, local=words)


@pytest.fixture(scope="module")
def hw():
    """Every scenario on the RTL, one after the other in one simulation: name -> (the CUs'
    results, the ``out`` buffer's words, cycles) or the HarnessError of a run that did not
    finish."""
    async def body(ctx, drv):
        out = {}
        for name in SCENARIOS:
            programs, regs, local = _tiles(name)
            refs = {}
            for b, (mu, array) in _buffers().items():
                refs[b] = await drv.load_buffer(ctx, mu, array)
            for xy in (CU0, CU1):
                tile = (_tile_config(programs[xy], regs.get(xy, {}), local.get(xy), refs)
                        if xy in programs else TileConfig(enabled=False))
                await drv.configure(ctx, xy, tile)
            try:
                cycles = await drv.run(ctx, max_cycles=MAX_CYCLES.get(name, 5000))
            except HarnessError as e:
                out[name] = e
                continue
            cus = {xy: await drv.cu_result(ctx, xy, read_local=False) for xy in (CU0, CU1)}
            words = await drv.read_buffer(ctx, MU_B, refs["out"])
            out[name] = (cus, words, cycles)
        return out

    return run_session(P, body, cus=[CU0, CU1])


def interpret(name):
    """The scenario on the interpreter: (its result, the ``out`` buffer's words)."""
    programs, regs, local = _tiles(name)
    it = Interpreter(P, FabricConfig(P, {xy: _tile_config(programs[xy], {}, local.get(xy), {})
                                         for xy in programs}))
    refs = {b: it.load_buffer(mu, array) for b, (mu, array) in _buffers().items()}
    for xy, rs in regs.items():
        for r, v in rs.items():
            it.set_register(xy, r, refs[v] if isinstance(v, str) else v)
    res = it.run()
    return res, it.read_buffer(MU_B, refs["out"])


def _same_as_interpreter(hw, name):
    """The scenario's results on the RTL equal the interpreter's, but for the registers that
    hold references (the session's MUs hand out other slots)."""
    cus, words, _ = hw[name]
    res, expect = interpret(name)
    programs, regs, _ = SCENARIOS[name]
    for xy in programs:
        h, s = cus[xy], res.cu(*xy)
        refs = {r for r, v in regs.get(xy, {}).items() if isinstance(v, str)}
        refs |= ALLOCATED.get(name, {}).get(xy, set())

        def values(r, refs=refs):
            return [v for i, v in enumerate(r) if i not in refs]
        assert (h.done, h.code_name, values(h.regs)) == (s.done, s.code_name,
                                                          values(s.regs)), (name, xy)
    np.testing.assert_array_equal(words, expect)
    return cus, words


def _pipeline(x, w):
    """numpy: z = ((x * 3) >> 1) + w, modulo 2**32."""
    y = wrap32(x.astype(np.int64) * 3).astype(np.int64) >> 1
    return wrap32(y + w)


@pytest.mark.parametrize("name", ["pipeline", "slow_consumer", "through_mu"])
def test_two_stage_pipeline_is_bit_exact(hw, name):
    # Through the queue (Q = 8 words for 12 results: the producer waits for credits), with a
    # consumer that starts 80 cycles late, and through an MU buffer: the same words.
    cus, words = _same_as_interpreter(hw, name)
    np.testing.assert_array_equal(words, _pipeline(X, W))
    assert not any(c.error for c in cus.values())


def test_stream_between_cus_is_faster_than_through_an_mu(hw):
    # The stages overlap row by row instead of one after the other.
    assert hw["pipeline"][2] < hw["through_mu"][2] * 0.8, (hw["pipeline"][2],
                                                           hw["through_mu"][2])


def test_credits_go_back_when_the_consumer_stops_popping(hw):
    # One word taken, then a wait: its credit is returned at once, not kept for a batch, so
    # the producer's last word and its token come (a batch kept would never finish the run).
    _, words = _same_as_interpreter(hw, "credits_flushed")
    np.testing.assert_array_equal(words, wrap32((X[:Q + 1].astype(np.int64) * 3) >> 1))
    assert hw["credits_flushed"][0][CU1].regs[3] == Q   # the second stream's count


def test_slow_consumer_back_pressures_the_producer(hw):
    # The producer holds 8 credits for 12 words: it waits until the consumer reads (a stall
    # of its stream, never a dropped word), so it runs about as long as the consumer's delay.
    fast, slow = hw["pipeline"][0][CU0], hw["slow_consumer"][0][CU0]
    assert slow.counters["busy_cycles"] > fast.counters["busy_cycles"] + 60
    assert slow.counters["flits_out"] == fast.counters["flits_out"]


def test_end_of_stream_gives_the_run_time_length(hw):
    cus, words = _same_as_interpreter(hw, "eos")
    r = cus[CU1].regs
    x = X.astype(np.int64)
    assert r[5] == 7 and s32(r[4]) == wrap32(x[:7].sum())
    flat = X[:5].reshape(-1)
    assert r[0] == 5 and s32(r[6]) == flat.max() and r[7] == int(np.argmax(flat))
    assert r[3] == 5                    # PACK_SUM's steps: rows of 2, 2 and 1
    rows = [x[0:2].sum(), x[2:4].sum(), x[4:5].sum(), 0]
    np.testing.assert_array_equal(words, wrap32([rows]))


@pytest.mark.parametrize("name", ["bad_queue_destination", "bad_queue_source"])
def test_queue_stream_to_or_from_the_wrong_tile_halts(hw, name):
    # A QUEUE stream's D_REF must name a CU, a stream's A_REF an MU or the CU itself.
    cus, _ = _same_as_interpreter(hw, name)
    srun_pc = {"bad_queue_destination": 5, "bad_queue_source": 4}[name]
    assert cus[CU0].code_name == "BAD_DESTINATION" and cus[CU0].pc == srun_pc


def test_word_arriving_at_a_full_queue_is_a_protocol_violation(hw):
    # Two producers into one queue: a word without room halts the consumer with
    # QUEUE_OVERFLOW (the host sees the error), as in the interpreter.
    cus, _, _ = hw["overflow"]
    res, _ = interpret("overflow")
    assert cus[CU1].code_name == res.cu(*CU1).code_name == "QUEUE_OVERFLOW"
    assert not cus[CU0].error and not res.cu(*CU0).error


def test_consumer_that_never_reads_stalls_the_producer(hw):
    # Not a NoC deadlock and no lost word: the producer waits for credits, and the host sees
    # a run that does not finish; the interpreter reports what each CU waits for.
    assert isinstance(hw["never_reads"], HarnessError)
    with pytest.raises(DeadlockError, match=r"CU \(0, 0\) at pc 9: SRUN waits for a credit to "
                                            r"send to CU \(1, 1\); CU \(1, 1\) at pc 0: WAIT"):
        interpret("never_reads")
