"""The compute unit's stream engine alone in Amaranth's simulator: a testbench plays the
sequencer (fields, start, ``V``) and an MU (answers reads from a numpy array after a fixed
latency, applies writes and appends), with and without back-pressure on ``mu_req``; results are
checked bit for bit against numpy.
"""

import itertools

import numpy as np
import pytest
from conftest import rand32, relu_shift, run_checked, wrap32

from rdakit.hdl.compute.common import TAG_READ, TAG_WRITE
from rdakit.hdl.compute.stream import EXEC_STAGES, StreamEngine
from rdakit.hdl.spec.config import CU_MAP
from rdakit.hdl.spec.cu import D_MU_MODES
from rdakit.hdl.spec.isa import AluFn, BMode, DMode
from rdakit.hdl.spec.packets import MUOp
from rdakit.hdl.spec.params import CUParams, FabricParams, MUParams
from rdakit.hdl.spec.vector import pack_vector, unpack_vector

LANES = 4
MU_P = MUParams(words=256, block_words=16, max_buffers=4, max_buffer_words=128, buf_id_bits=4,
                weight_bits=4, mu_id_bits=2, index_bits=8, data_bits=32 * LANES, tag_bits=4,
                coord_bits=1)
P = FabricParams(rows=2, cols=2, mu=MU_P, cu=CUParams(
    lanes=LANES, prog_len=128, regs=8, local_words=16, outstanding=8, channels=4, mailbox=2))
A_WORDS = 64
#: Cycles from a request taken to its response (an MU attached directly).
LATENCY = 2

_NP_FN = {
    AluFn.ADD: lambda a, b: a + b,
    AluFn.SUB: lambda a, b: a - b,
    AluFn.MUL: lambda a, b: a * b,
    AluFn.MAX: np.maximum,
    AluFn.PASS: lambda a, b: a,
}


def reference(cfg, fn, a_mem, local):
    """What a stream does, in numpy: ``(local, written {index: lanes}, appended [lanes],
    acc, index)``."""
    local = local.copy()
    written, appended, results = {}, [], []
    pack = []
    for o in range(cfg["outer"]):
        for i in range(cfg["n"]):
            k = o * cfg["n"] + i
            a = a_mem[(cfg["a_base"] + o * cfg["a_ostride"] + i * cfg["a_stride"]) % A_WORDS]
            if cfg["b_mode"] == BMode.LOCAL.value:
                b = local[(cfg["b_val"] + o * cfg["b_ostride"] + i * cfg["b_stride"]) % 16]
            elif cfg["b_mode"] == BMode.SCALAR.value:
                b = np.full(LANES, cfg["b_val"], dtype=np.int64)
            elif cfg["b_mode"] == BMode.ELEM.value:
                e = (cfg["b_val"] + o * cfg["b_ostride"] + i * cfg["b_stride"]) % (16 * LANES)
                b = np.full(LANES, local[e // LANES][e % LANES], dtype=np.int64)
            else:
                b = np.zeros(LANES, dtype=np.int64)
            r = _NP_FN[fn](a.astype(np.int64), b.astype(np.int64))
            if DMode(cfg["d_mode"]) not in (DMode.PACK_SUM, DMode.OUTER_SUM):  # (on a sum)
                r = relu_shift(r, cfg["shift"], cfg["post"]).astype(np.int64)
            d = (cfg["d_base"] + k * cfg["d_stride"]) % (1 << 32)
            mode = DMode(cfg["d_mode"])
            if mode == DMode.LOCAL:
                local[d % 16] = r
            elif mode == DMode.LOCAL_ACC:
                local[d % 16] = wrap32(local[d % 16].astype(np.int64) + r)
            elif mode == DMode.OUTER_SUM:
                d = (cfg["d_base"] + i * cfg["d_stride"]) % 16
                total = wrap32(r if o == 0 else local[d].astype(np.int64) + r)
                if o == cfg["outer"] - 1:
                    appended.append(wrap32(relu_shift(total, cfg["shift"], cfg["post"])))
                else:
                    local[d] = total
            elif mode == DMode.WRITE:
                written[d % (1 << MU_P.index_bits)] = wrap32(r)
            elif mode == DMode.APPEND:
                appended.append(wrap32(r))
            results.append(wrap32(r))
        if DMode(cfg["d_mode"]) == DMode.PACK_SUM:
            total = wrap32(sum(int(x.sum()) for x in results[-cfg["n"]:]))
            pack.append(int(relu_shift(total, cfg["shift"], cfg["post"])))
            if len(pack) == LANES or o == cfg["outer"] - 1:
                appended.append(wrap32(pack + [0] * (LANES - len(pack))))
                pack = []
    flat = np.concatenate(results)
    acc = index = None
    if DMode(cfg["d_mode"]) == DMode.SUM:
        acc = int(wrap32(flat.astype(np.int64).sum()))
    elif DMode(cfg["d_mode"]) in (DMode.MAX, DMode.ARGMAX):
        acc, index = int(flat.max()), int(flat.argmax())
    return local, written, appended, acc, index


class _MU:
    """The MU the testbench plays: answers reads from ``a_mem`` and acknowledges writes and
    appends ``LATENCY`` cycles after it takes them, in order; read number ``refuse`` (counted
    from 0) is refused."""

    def __init__(self, a_mem, refuse=None):
        self.a_mem, self.refuse = a_mem, refuse
        self.pending = []       # (due cycle, tag, data, refused), in order
        self.written, self.appended, self.reads = {}, [], 0

    def respond(self, ctx, dut, cycle):
        """Drive this cycle's response or acknowledgement, if one is due; return it."""
        head = self.pending[0] if self.pending and self.pending[0][0] <= cycle else None
        if head is not None:
            self.pending.pop(0)
        is_read = head is not None and head[1] == TAG_READ
        ctx.set(dut.resp.valid, is_read)
        ctx.set(dut.resp.payload, {"data": head[2] if is_read else 0,
                                   "refused": head[3] if is_read else 0})
        ctx.set(dut.ack, head is not None and head[1] == TAG_WRITE)
        return head

    def take(self, ctx, dut, cycle):
        """Take the request ``mu_req`` hands over this cycle, if any."""
        if not (ctx.get(dut.mu_req.valid) and ctx.get(dut.mu_req.ready)):
            return
        flit = ctx.get(dut.mu_req.payload)
        req = flit.payload
        assert (flit.dst.x, flit.dst.y) == (1, 0)
        if req.tag == TAG_READ:
            assert req.op == MUOp.READ
            word = pack_vector(self.a_mem[req.index % A_WORDS])
            bad = self.refuse is not None and self.reads == self.refuse
            self.reads += 1
            self.pending.append((cycle + LATENCY, TAG_READ, word, int(bad)))
        else:
            lanes = unpack_vector(req.data, LANES)
            if req.op == MUOp.WRITE:
                self.written[req.index] = lanes
            else:
                assert req.op == MUOp.APPEND
                self.appended.append(lanes)
            self.pending.append((cycle + LATENCY, TAG_WRITE, 0, 0))


async def _write_local(ctx, dut, local):
    for w in range(16):
        for lane in range(LANES):
            ctx.set(dut.cfg.sel, 1)
            ctx.set(dut.cfg.we, 1)
            ctx.set(dut.cfg.addr, CU_MAP.LOCAL + w * LANES + lane)
            ctx.set(dut.cfg.wdata, int(local[w][lane]) & 0xffff_ffff)
            await ctx.tick()
    ctx.set(dut.cfg.we, 0)


async def _read_local(ctx, dut):
    out = np.zeros((16, LANES), dtype=np.int64)
    ctx.set(dut.cfg.re, 1)
    for w in range(16):
        for lane in range(LANES):
            ctx.set(dut.cfg.addr, CU_MAP.LOCAL + w * LANES + lane)
            await ctx.tick()
            out[w][lane] = ctx.get(dut.cfg.rdata)
    ctx.set(dut.cfg.re, 0)
    return wrap32(out)


def run_streams(streams, a_mem, local, *, ready_pattern=(1,), refuse=None, stop_after=None):
    """Run ``streams`` (``(cfg, fn)`` pairs) one after the other on one engine, each from the
    local buffer ``local``; return what the testbench saw of each, in the shape of
    :func:`reference` (``acc``/``index`` as signed ints), plus whether ``error`` rose.

    The testbench plays the sequencer: it drops ``active`` in the cycle ``error`` rises (the
    steps before the refused read must be complete then). With ``stop_after = k`` it also drops
    ``active`` during the first stream, as a CU that stops mid-stream: in the first cycle after
    the k-th step entered the pipeline (``step``) in which the steps of the two cycles before
    are still in it; it records in ``delivered`` the steps that entered at least
    ``EXEC_STAGES`` cycles before: those must be all the stream did. While ``active`` is low
    (ten cycles, the stale read responses arriving) the engine must offer no request and not
    write ``V``; then ``clear`` and the next stream."""
    dut = StreamEngine(P, x=0, y=0)
    seen_all = []

    async def tb(ctx):
        mu = _MU(a_mem, refuse)
        ready = itertools.cycle(ready_pattern)
        cycle = 0
        for number, (cfg, fn) in enumerate(streams):
            stop = stop_after if number == 0 else None
            seen = {}
            seen_all.append(seen)
            await _write_local(ctx, dut, local)
            cycle += 16 * LANES
            fields = {name: 0 for name in dut.fields.shape().members}
            fields.update({k: v & 0xffff_ffff for k, v in cfg.items()})
            ctx.set(dut.fields, fields)
            ctx.set(dut.fn, fn)
            ctx.set(dut.active, 1)          # the CU runs
            ctx.set(dut.start, 1)
            await ctx.tick()
            cycle += 1
            ctx.set(dut.start, 0)
            mu.written, mu.appended = {}, []
            v = 0
            steps = []                      # the cycles in which a step entered the pipeline
            for _ in range(2000):
                head = mu.respond(ctx, dut, cycle)
                ctx.set(dut.v, v)
                ctx.set(dut.mu_req.ready, next(ready))
                if (stop is not None and len(steps) >= stop
                        and steps[-2:] == [cycle - 2, cycle - 1]):
                    ctx.set(dut.active, 0)
                    steps += [cycle] * ctx.get(dut.step)
                    seen["delivered"] = sum(c <= cycle - EXEC_STAGES for c in steps)
                    seen["error"] = ctx.get(dut.error)
                    mu.take(ctx, dut, cycle)
                    await ctx.tick()
                    cycle += 1
                    for _ in range(10):
                        mu.respond(ctx, dut, cycle)
                        assert not ctx.get(dut.mu_req.valid) and not ctx.get(dut.v_we)
                        await ctx.tick()
                        cycle += 1
                    ctx.set(dut.clear, 1)
                    await ctx.tick()
                    cycle += 1
                    ctx.set(dut.clear, 0)
                    break
                if ctx.get(dut.done) or ctx.get(dut.error):
                    seen["error"] = ctx.get(dut.error)
                    seen["acc"] = ctx.get(dut.acc.as_signed())
                    seen["index"] = ctx.get(dut.index)
                    if seen["error"]:
                        ctx.set(dut.active, 0)
                    # Posted writes: ``done`` may come before the acknowledgements; deliver the
                    # ones still owed and watch ``writes_pending`` until the last is back.
                    owed = [p for p in mu.pending if p[1] == TAG_WRITE]
                    mu.pending = []
                    seen["owed_at_done"] = len(owed) + bool(head is not None
                                                             and head[1] == TAG_WRITE)
                    seen["pending_trace"] = [ctx.get(dut.writes_pending)]
                    await ctx.tick()
                    cycle += 1
                    ctx.set(dut.resp.valid, 0)
                    for _ in owed:
                        seen["pending_trace"].append(ctx.get(dut.writes_pending))
                        ctx.set(dut.ack, 1)
                        await ctx.tick()
                        cycle += 1
                    ctx.set(dut.ack, 0)
                    seen["pending_trace"].append(ctx.get(dut.writes_pending))
                    break
                if ctx.get(dut.step):
                    steps.append(cycle)
                mu.take(ctx, dut, cycle)
                if ctx.get(dut.v_we):
                    v = ctx.get(dut.v_next)
                await ctx.tick()
                cycle += 1
            else:
                raise AssertionError("The stream must finish in 2000 cycles, but it did not")
            seen["steps"] = len(steps)
            active = ctx.get(dut.active)
            ctx.set(dut.active, 0)
            await ctx.tick()
            seen.update(local=await _read_local(ctx, dut), written=mu.written,
                        appended=mu.appended, v=v)
            cycle += 1 + 16 * LANES
            if seen["error"]:
                break
            ctx.set(dut.active, active)

    run_checked(dut, tb)
    return seen_all


def run_stream(cfg, fn, a_mem, local, *, ready_pattern=(1,), refuse=None):
    """:func:`run_streams` of one stream."""
    return run_streams([(cfg, fn)], a_mem, local, ready_pattern=ready_pattern,
                       refuse=refuse)[0]


CONFIGS = {
    "add_local_b_to_local": (dict(a_base=3, a_stride=2, a_ostride=5, n=4, outer=2,
                                  b_mode=BMode.LOCAL.value, b_val=1, b_stride=1, b_ostride=4,
                                  d_mode=DMode.LOCAL.value, d_base=8, d_stride=1),
                             AluFn.ADD),
    "mul_scalar_shift_relu_write": (dict(a_base=0, a_stride=1, n=6, outer=1,
                                         b_mode=BMode.SCALAR.value, b_val=-3, shift=2, post=1,
                                         d_ref=0b01, d_mode=DMode.WRITE.value, d_base=10,
                                         d_stride=3), AluFn.MUL),
    "sub_local_acc": (dict(a_base=7, a_stride=-1 & 0xffff_ffff, n=3, outer=3, a_ostride=9,
                           b_mode=BMode.LOCAL.value, b_val=0, b_stride=2,
                           d_mode=DMode.LOCAL_ACC.value, d_base=4, d_stride=0), AluFn.SUB),
    "sum": (dict(a_base=1, a_stride=1, n=5, outer=2, a_ostride=20, d_mode=DMode.SUM.value),
            AluFn.PASS),
    "argmax": (dict(a_base=2, a_stride=3, n=4, outer=3, a_ostride=1,
                    b_mode=BMode.SCALAR.value, b_val=5, d_mode=DMode.ARGMAX.value), AluFn.MAX),
    "append": (dict(a_base=0, a_stride=2, n=5, outer=1, d_ref=0b01,
                    d_mode=DMode.APPEND.value), AluFn.PASS),
    "pack_sum": (dict(a_base=0, a_stride=1, n=3, outer=6, a_ostride=3, d_ref=0b01,
                      d_mode=DMode.PACK_SUM.value, shift=4), AluFn.ADD),
    "pack_sum_requant": (dict(a_base=0, a_stride=1, n=3, outer=6, a_ostride=3, d_ref=0b01,
                              d_mode=DMode.PACK_SUM.value, b_mode=BMode.SCALAR.value,
                              b_val=-7, shift=6, post=3), AluFn.MUL),
    "mul_shift_saturate_append": (dict(a_base=0, a_stride=1, n=6, outer=1,
                                       b_mode=BMode.SCALAR.value, b_val=5, shift=6, post=2,
                                       d_ref=0b01, d_mode=DMode.APPEND.value), AluFn.MUL),
    # A row times a matrix, requantized: sum_o (local element (9 + o) * A row o), then
    # SHIFT, ReLU and saturation, appended (local[10 ..] the sums before the last row).
    "elem_b_outer_sum": (dict(a_base=2, a_stride=1, n=4, outer=6, a_ostride=5,
                              b_mode=BMode.ELEM.value, b_val=9, b_ostride=1, shift=9, post=3,
                              d_ref=0b01, d_mode=DMode.OUTER_SUM.value, d_base=10, d_stride=1),
                         AluFn.MUL),
    # ELEM with both strides (elements across words and lanes), wrapping past the buffer.
    "elem_b_strided_append": (dict(a_base=1, a_stride=2, n=3, outer=4, a_ostride=7,
                                   b_mode=BMode.ELEM.value, b_val=58, b_stride=3, b_ostride=5,
                                   shift=1, post=1, d_ref=0b01, d_mode=DMode.APPEND.value),
                              AluFn.SUB),
    # OUTER_SUM with a stride, B LOCAL and a shift of the sums.
    "outer_sum_strided_shift": (dict(a_base=0, a_stride=1, n=3, outer=5, a_ostride=3,
                                     b_mode=BMode.LOCAL.value, b_val=0, b_stride=1,
                                     b_ostride=1, shift=3, d_ref=0b01,
                                     d_mode=DMode.OUTER_SUM.value, d_base=7, d_stride=2),
                                AluFn.MUL),
    # OUTER_SUM of one outer iteration: the steps' results through the output stage, appended.
    "outer_sum_one_row": (dict(a_base=3, a_stride=1, n=5, outer=1, b_mode=BMode.SCALAR.value,
                               b_val=-9, shift=2, post=1, d_ref=0b01,
                               d_mode=DMode.OUTER_SUM.value, d_base=2, d_stride=1),
                          AluFn.MUL),
}


def _config(name, table=CONFIGS):
    cfg, fn = table[name]
    cfg = {"a_ref": 0b01, "a_ostride": 0, "b_stride": 0, "b_ostride": 0, "b_val": 0,
           "b_mode": BMode.ZERO.value, "shift": 0, "post": 0, "d_base": 0, "d_stride": 0,
           "d_ref": 0, **cfg}
    return cfg, fn


@pytest.mark.parametrize("ready_pattern", [(1,), (1, 1, 0, 1, 0)], ids=["ready", "pressure"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_stream_matches_numpy(name, ready_pattern):
    cfg, fn = _config(name)
    rng = np.random.default_rng(sorted(CONFIGS).index(name))
    a_mem = rand32(rng, (A_WORDS, LANES), bits=12)
    local = rand32(rng, (16, LANES), bits=12)
    seen = run_stream(cfg, fn, a_mem, local, ready_pattern=ready_pattern)
    _check(seen, cfg, fn, a_mem, local)


def _check(seen, cfg, fn, a_mem, local):
    """``seen`` is what :func:`reference` says the stream does."""
    ref_local, ref_written, ref_appended, ref_acc, ref_index = reference(
        {**cfg, "b_val": np.int32(np.uint32(cfg["b_val"] & 0xffff_ffff)).item(),
         "a_stride": np.int32(np.uint32(cfg["a_stride"])).item()},
        fn, a_mem, local)
    assert not seen["error"]
    np.testing.assert_array_equal(seen["local"], ref_local)
    assert seen["written"].keys() == ref_written.keys()
    for index, lanes in ref_written.items():
        np.testing.assert_array_equal(seen["written"][index], lanes)
    assert len(seen["appended"]) == len(ref_appended)
    for got, want in zip(seen["appended"], ref_appended, strict=True):
        np.testing.assert_array_equal(got, want)
    if ref_acc is not None:
        assert seen["acc"] == ref_acc
    if ref_index is not None:
        assert seen["index"] == ref_index
    if cfg["d_mode"] == DMode.PACK_SUM.value:
        assert seen["v"] == 0, "PACK_SUM must leave V cleared after its last append"


def test_refused_read_raises_error_after_earlier_steps():
    """The third read is refused: the two steps before it are written (and acknowledged),
    then ``error`` rises instead of ``done``."""
    cfg, fn = _config("mul_scalar_shift_relu_write")
    rng = np.random.default_rng(7)
    a_mem = rand32(rng, (A_WORDS, LANES), bits=12)
    local = np.zeros((16, LANES), dtype=np.int64)
    seen = run_stream(cfg, fn, a_mem, local, refuse=2)
    assert seen["error"]
    assert sorted(seen["written"]) == [10, 13]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_writes_are_posted_and_counted_until_acknowledged(name):
    """``done`` comes once every write is issued, not acknowledged: a stream that writes to an
    MU finishes with acknowledgements still owed (the MU's latency is 2), ``writes_pending``
    stays up until the last of them arrives and falls with it; a stream that keeps its
    results in the CU owes none."""
    cfg, fn = _config(name)
    rng = np.random.default_rng(11)
    seen = run_stream(cfg, fn, rand32(rng, (A_WORDS, LANES), bits=12),
                      rand32(rng, (16, LANES), bits=12))
    writes = cfg["d_mode"] in D_MU_MODES
    assert not seen["error"]
    if writes:
        assert seen["owed_at_done"] > 0
        assert seen["pending_trace"][:-1] == [1] * (len(seen["pending_trace"]) - 1)
    else:
        assert seen["owed_at_done"] == 0
    assert seen["pending_trace"][-1] == 0


# --- The pipeline's hazards -------------------------------------------------------------------

#: Streams whose steps depend on the steps just before them, through the local buffer or ``V``:
#: a step enters the pipeline before the one ahead of it has delivered (``EXEC_STAGES`` cycles
#: after it entered), so each relies on the engine's stall (B), the read ports' transparency
#: (B two steps back, the LOCAL_ACC destination) or V's update in S2 (PACK_SUM).
HAZARDS = {
    # B reads the word the step before wrote: local[4 + k] = a * local[3 + k] >> 2.
    "b_reads_the_previous_result": (dict(a_base=0, a_stride=1, n=7, outer=1, shift=2,
                                         b_mode=BMode.LOCAL.value, b_val=3, b_stride=1,
                                         d_mode=DMode.LOCAL.value, d_base=4, d_stride=1),
                                    AluFn.MUL),
    # ... the word written two steps before (in the cycle B is read).
    "b_reads_the_result_two_back": (dict(a_base=0, a_stride=1, n=7, outer=1,
                                         b_mode=BMode.LOCAL.value, b_val=2, b_stride=1,
                                         d_mode=DMode.LOCAL.value, d_base=4, d_stride=1),
                                    AluFn.SUB),
    # LOCAL_ACC onto one word, step after step.
    "local_acc_one_word": (dict(a_base=0, a_stride=1, n=6, outer=1,
                                d_mode=DMode.LOCAL_ACC.value, d_base=5, d_stride=0),
                           AluFn.PASS),
    # ... B reading that word too: local[5] += a + local[5].
    "local_acc_and_b_one_word": (dict(a_base=0, a_stride=1, n=5, outer=1,
                                      b_mode=BMode.LOCAL.value, b_val=5, b_stride=0,
                                      d_mode=DMode.LOCAL_ACC.value, d_base=5, d_stride=0),
                                 AluFn.ADD),
    # OUTER_SUM with one step an outer iteration: every step adds into the word the step just
    # ahead of it writes.
    "outer_sum_one_word": (dict(a_base=0, a_stride=1, n=1, outer=7, a_ostride=1,
                                b_mode=BMode.ELEM.value, b_val=3, b_ostride=1, d_ref=0b01,
                                d_mode=DMode.OUTER_SUM.value, d_base=12, d_stride=1),
                           AluFn.MUL),
    # ELEM reads a lane of the word the step before wrote: local[4 + k] = a - local[3 + k][2].
    "elem_b_reads_the_previous_result": (dict(a_base=0, a_stride=1, n=6, outer=1,
                                              b_mode=BMode.ELEM.value, b_val=3 * LANES + 2,
                                              b_stride=LANES, d_mode=DMode.LOCAL.value,
                                              d_base=4, d_stride=1), AluFn.SUB),
    # PACK_SUM with every step ending its inner loop: V changes in consecutive cycles.
    "pack_sum_every_step": (dict(a_base=0, a_stride=1, n=1, outer=9, d_ref=0b01,
                                 d_mode=DMode.PACK_SUM.value), AluFn.ADD),
}


@pytest.fixture(scope="module")
def hazard_runs():
    """Every stream of :data:`HAZARDS` in one simulation, from the same local buffer."""
    rng = np.random.default_rng(5)
    a_mem = rand32(rng, (A_WORDS, LANES), bits=12)
    local = rand32(rng, (16, LANES), bits=12)
    streams = [_config(name, HAZARDS) for name in HAZARDS]
    seen = run_streams(streams, a_mem, local)
    return a_mem, local, dict(zip(HAZARDS, seen, strict=True))


@pytest.mark.parametrize("name", list(HAZARDS))
def test_dependent_steps_match_numpy(hazard_runs, name):
    a_mem, local, seen = hazard_runs
    cfg, fn = _config(name, HAZARDS)
    assert not seen[name]["error"]
    _check(seen[name], cfg, fn, a_mem, local)


def test_refused_read_mid_pipeline_completes_the_steps_before_it():
    """PACK_SUM of one step an inner loop, the fifth read refused: the fourth step, which fills
    V's last lane and appends V, is still in the pipeline when the refused response reaches
    S0, and ``error`` waits until its append is issued and acknowledged (the testbench drops
    ``active`` in the cycle ``error`` rises, as a CU that stops there)."""
    cfg, fn = _config("pack_sum_every_step", HAZARDS)
    rng = np.random.default_rng(3)
    a_mem = rand32(rng, (A_WORDS, LANES), bits=12)
    local = np.zeros((16, LANES), dtype=np.int64)
    seen = run_stream(cfg, fn, a_mem, local, refuse=LANES)
    assert seen["error"]
    want = reference({**cfg, "outer": LANES}, fn, a_mem, local)[2]
    assert len(want) == len(seen["appended"]) == 1
    np.testing.assert_array_equal(seen["appended"][0], want[0])


def test_write_queue_full_under_back_pressure_loses_no_write():
    """The request port refuses for 12 cycles in every 20 while responses keep arriving: the
    results fill the write queue, and S0 stops popping while the queue could not take every
    result still in the pipeline. Every write arrives."""
    cfg, fn = _config("mul_scalar_shift_relu_write")
    cfg.update(n=12, d_stride=1)
    rng = np.random.default_rng(1)
    a_mem = rand32(rng, (A_WORDS, LANES), bits=12)
    local = np.zeros((16, LANES), dtype=np.int64)
    seen = run_stream(cfg, fn, a_mem, local, ready_pattern=(1,) * 8 + (0,) * 12)
    assert not seen["error"]
    _check(seen, cfg, fn, a_mem, local)


def test_stream_stopped_mid_pipeline_is_dropped():
    """``active`` falls while two steps are in the pipeline (a CU stopping mid-stream): the
    local buffer holds the results of exactly the steps delivered before (``EXEC_STAGES``
    cycles after they entered), no request or ``V`` write follows, and the next stream, after
    ``clear``, runs as if on a fresh engine (the stale responses and results are dropped)."""
    stopped, stopped_fn = _config("add_local_b_to_local")
    after, after_fn = _config("pack_sum")
    rng = np.random.default_rng(9)
    a_mem = rand32(rng, (A_WORDS, LANES), bits=12)
    local = rand32(rng, (16, LANES), bits=12)
    first, second = run_streams([(stopped, stopped_fn), (after, after_fn)], a_mem, local,
                                stop_after=3)
    k = first["delivered"]
    assert 2 <= k < first["steps"] < stopped["n"] * stopped["outer"]
    outer, n = divmod(k, stopped["n"])
    want = reference({**stopped, "outer": outer}, stopped_fn, a_mem, local)[0] if outer else local
    if n:       # the steps of the last, partial inner loop, from where the others left the buffer
        base = {**stopped, "outer": 1, "n": n, "a_base": stopped["a_base"] + outer
                * stopped["a_ostride"], "b_val": stopped["b_val"] + outer * stopped["b_ostride"],
                "d_base": stopped["d_base"] + outer * stopped["n"] * stopped["d_stride"]}
        want = reference(base, stopped_fn, a_mem, want)[0]
    np.testing.assert_array_equal(first["local"], want)
    _check(second, after, after_fn, a_mem, local)
