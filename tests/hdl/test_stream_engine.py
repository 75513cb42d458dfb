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
from rdakit.hdl.compute.stream import StreamEngine
from rdakit.hdl.spec.config import CU_MAP
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
            else:
                b = np.zeros(LANES, dtype=np.int64)
            r = relu_shift(_NP_FN[fn](a.astype(np.int64), b.astype(np.int64)), cfg["shift"],
                           cfg["post"]).astype(np.int64)
            d = (cfg["d_base"] + k * cfg["d_stride"]) % (1 << 32)
            mode = DMode(cfg["d_mode"])
            if mode == DMode.LOCAL:
                local[d % 16] = r
            elif mode == DMode.LOCAL_ACC:
                local[d % 16] = wrap32(local[d % 16].astype(np.int64) + r)
            elif mode == DMode.WRITE:
                written[d % (1 << MU_P.index_bits)] = wrap32(r)
            elif mode == DMode.APPEND:
                appended.append(wrap32(r))
            results.append(wrap32(r))
        if DMode(cfg["d_mode"]) == DMode.PACK_SUM:
            pack.append(int(wrap32(sum(int(x.sum()) for x in results[-cfg["n"]:]))))
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


def run_stream(cfg, fn, a_mem, local, *, ready_pattern=(1,), refuse=None):
    """Run one stream on a fresh engine; return what the testbench saw, in the shape of
    :func:`reference` (``acc``/``index`` as signed ints), plus whether ``error`` rose."""
    dut = StreamEngine(P, x=0, y=0)
    seen = {}

    async def tb(ctx):
        for w in range(16):
            for lane in range(LANES):
                ctx.set(dut.cfg.sel, 1)
                ctx.set(dut.cfg.we, 1)
                ctx.set(dut.cfg.addr, CU_MAP.LOCAL + w * LANES + lane)
                ctx.set(dut.cfg.wdata, int(local[w][lane]) & 0xffff_ffff)
                await ctx.tick()
        ctx.set(dut.cfg.we, 0)
        fields = {name: 0 for name in dut.fields.shape().members}
        fields.update({k: v & 0xffff_ffff for k, v in cfg.items()})
        ctx.set(dut.fields, fields)
        ctx.set(dut.fn, fn)
        ctx.set(dut.active, 1)          # the CU runs
        ctx.set(dut.start, 1)
        await ctx.tick()
        ctx.set(dut.start, 0)
        v = 0
        pending = []            # (due cycle, tag, data, refused), in order
        written, appended, reads = {}, [], 0
        ready = itertools.cycle(ready_pattern)
        for cycle in range(2000):
            head = pending[0] if pending and pending[0][0] <= cycle else None
            if head is not None:
                pending.pop(0)
            is_read = head is not None and head[1] == TAG_READ
            ctx.set(dut.resp.valid, is_read)
            ctx.set(dut.resp.payload, {"data": head[2] if is_read else 0,
                                       "refused": head[3] if is_read else 0})
            ctx.set(dut.ack, head is not None and head[1] == TAG_WRITE)
            ctx.set(dut.v, v)
            ctx.set(dut.mu_req.ready, next(ready))
            if ctx.get(dut.done) or ctx.get(dut.error):
                seen["error"] = ctx.get(dut.error)
                seen["acc"] = ctx.get(dut.acc.as_signed())
                seen["index"] = ctx.get(dut.index)
                # Posted writes: ``done`` may come before the acknowledgements; deliver the
                # ones still owed and watch ``writes_pending`` until the last is back.
                owed = [p for p in pending if p[1] == TAG_WRITE]
                seen["owed_at_done"] = len(owed) + bool(head is not None
                                                         and head[1] == TAG_WRITE)
                seen["pending_trace"] = [ctx.get(dut.writes_pending)]
                await ctx.tick()
                ctx.set(dut.resp.valid, 0)
                for _ in owed:
                    seen["pending_trace"].append(ctx.get(dut.writes_pending))
                    ctx.set(dut.ack, 1)
                    await ctx.tick()
                ctx.set(dut.ack, 0)
                seen["pending_trace"].append(ctx.get(dut.writes_pending))
                break
            if ctx.get(dut.mu_req.valid) and ctx.get(dut.mu_req.ready):
                flit = ctx.get(dut.mu_req.payload)
                req = flit.payload
                assert (flit.dst.x, flit.dst.y) == (1, 0)
                if req.tag == TAG_READ:
                    assert req.op == MUOp.READ
                    word = pack_vector(a_mem[req.index % A_WORDS])
                    bad = refuse is not None and reads == refuse
                    reads += 1
                    pending.append((cycle + LATENCY, TAG_READ, word, int(bad)))
                else:
                    lanes = unpack_vector(req.data, LANES)
                    if req.op == MUOp.WRITE:
                        written[req.index] = lanes
                    else:
                        assert req.op == MUOp.APPEND
                        appended.append(lanes)
                    pending.append((cycle + LATENCY, TAG_WRITE, 0, 0))
            if ctx.get(dut.v_we):
                v = ctx.get(dut.v_next)
            await ctx.tick()
        else:
            raise AssertionError("The stream must finish in 2000 cycles, but it did not")
        ctx.set(dut.active, 0)
        await ctx.tick()
        out = np.zeros((16, LANES), dtype=np.int64)
        ctx.set(dut.cfg.re, 1)
        for w in range(16):
            for lane in range(LANES):
                ctx.set(dut.cfg.addr, CU_MAP.LOCAL + w * LANES + lane)
                await ctx.tick()
                out[w][lane] = ctx.get(dut.cfg.rdata)
        seen.update(local=wrap32(out), written=written, appended=appended, v=v)

    run_checked(dut, tb)
    return seen


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
}


def _config(name):
    cfg, fn = CONFIGS[name]
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
    ref_local, ref_written, ref_appended, ref_acc, ref_index = reference(
        {**cfg, "b_val": np.int32(np.uint32(cfg["b_val"] & 0xffff_ffff)).item(),
         "a_stride": np.int32(np.uint32(cfg["a_stride"])).item()},
        fn, a_mem, local)
    seen = run_stream(cfg, fn, a_mem, local, ready_pattern=ready_pattern)
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
    writes = cfg["d_mode"] in (DMode.WRITE.value, DMode.APPEND.value, DMode.PACK_SUM.value)
    assert not seen["error"]
    if writes:
        assert seen["owed_at_done"] > 0
        assert seen["pending_trace"][:-1] == [1] * (len(seen["pending_trace"]) - 1)
    else:
        assert seen["owed_at_done"] == 0
    assert seen["pending_trace"][-1] == 0
