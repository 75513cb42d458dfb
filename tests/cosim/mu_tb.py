"""cocotb tests of the memory unit's generated Verilog, checked against the golden model.

Run through ``tests/cosim/test_mu_cosim.py`` (pytest), which builds the design for Icarus or
Verilator with :func:`rdakit.sim.verify.runner.run_cocotb`. The configuration arrives in
``RDAKIT_TB_CONFIG``: the MU parameters, the MU ID, the number of random operations, the
back-pressure pattern and the seed.
"""

import collections

import cocotb

from rdakit.hdl.spec.packets import (
    MUOp,
    MUStatus,
    mu_request_layout,
    mu_response_layout,
    pack,
    unpack,
)
from rdakit.hdl.spec.params import MUParams
from rdakit.sim.models.mu import MUModel
from rdakit.sim.verify.cocotb_utils import ClockedBench, StreamSink, StreamSource, tb_config
from rdakit.sim.verify.mu_stimulus import MUStimulus

#: The counter ports, as the golden model names what each reads.
COUNTERS = tuple(MUModel(MUParams()).counters())


def setup():
    cfg = tb_config()
    params = MUParams(**cfg["params"])
    return cfg, params, cfg.get("mu_id", 0)


class MUBench:
    """Drives requests into the MU and checks every response against :class:`MUModel`.

    The tests of a module share one simulation, and a reset does not clear the scratchpad: a
    new bench's model starts from the words the previous bench's model left (every test drains
    its requests), so a word read before it is written here reads what the RTL holds.
    """

    _last = None

    def __init__(self, dut, params, mu_id, *, backpressure="none", idle="none", seed=0):
        self.dut = dut
        self.params = params
        self.mu_id = mu_id
        self.req_layout = mu_request_layout(params)
        self.resp_layout = mu_response_layout(params)
        self.bench = ClockedBench(dut)
        self.source = StreamSource(self.bench, "req", pause=idle, seed=seed)
        self.sink = StreamSink(self.bench, "resp", pause=backpressure, seed=seed + 1,
                               on_item=self._check, keep=False)
        last = MUBench._last
        if last is not None and (last.params, last.mu_id) == (params, mu_id):
            self.model = last.model.after_reset()
        else:
            self.model = MUModel(params, mu_id)
        MUBench._last = self
        # Requests not yet answered, oldest first (answered ones are dropped: a run of 10^7
        # operations must not keep them all), and the counts sent and answered.
        self.expected = collections.deque()
        self._sent = self._next = 0
        self.mismatches = []

    async def reset(self):
        await self.bench.reset()
        # Reset clears the tables, not the scratchpad: the new model starts from its words.
        self.model = self.model.after_reset()
        self.expected.clear()
        self._sent = self._next = 0

    def send(self, request):
        """Queue ``request`` (a dict) and the model's response to it; return the latter."""
        expected = self.model.request(request)
        self.source.send(pack(self.req_layout, request))
        self.expected.append((request, expected, pack(self.resp_layout, expected)))
        self._sent += 1
        return expected

    def _check(self, value):
        if not self.expected:
            self.mismatches.append(f"unexpected response {unpack(self.resp_layout, value)}")
            return
        request, expected, packed = self.expected.popleft()
        self._next += 1
        if value != packed and len(self.mismatches) < 10:
            self.mismatches.append(f"response {self._next - 1} to {request}: "
                                   f"got {unpack(self.resp_layout, value)}, expected {expected}")

    async def drain(self, *, timeout=None):
        """Run until every queued request has been answered, then check the answers."""
        limit = timeout or 200 * len(self.expected) + 20 * self.params.max_buffers * \
            self.params.max_vblocks + 10_000
        start = self.bench.cycles
        while self.expected or self.source.pending:
            await self.bench.cycle()
            assert self.bench.cycles - start < limit, (
                f"timeout: {self._next} of {self._sent} responses after {limit} cycles")
        assert not self.mismatches, "\n".join(self.mismatches)

    def counter(self, name):
        return getattr(self.dut, name).value.to_unsigned()


@cocotb.test()
async def outputs_resolvable_after_reset(dut):
    """Every output has a 0/1 value right after reset (Icarus -g2012 used to leave Xs)."""
    cfg, params, mu_id = setup()
    tb = MUBench(dut, params, mu_id)
    await tb.reset()
    for name in ("req__ready", "resp__valid", "resp__payload", *COUNTERS):
        assert getattr(dut, name).value.is_resolvable, f"{name} is {getattr(dut, name).value}"


@cocotb.test()
async def directed_every_operation_and_error(dut):
    """One of each operation and each error status, with the expected values spelled out."""
    cfg, params, mu_id = setup()
    tb = MUBench(dut, params, mu_id, backpressure="cycle")
    await tb.reset()
    weighted = params.refcount.value == "weighted"
    r = tb.send({"op": MUOp.ALLOC, "data": 2, "tag": 7, "src": {"x": 1, "y": 2}})
    assert r["status"] is MUStatus.OK and r["tag"] == 7 and r["dst"] == {"x": 1, "y": 2}
    ref = r["ref"]
    assert ref == {"mu": mu_id, "buf": 0}
    statuses = []
    for req in [
        {"op": MUOp.APPEND, "ref": ref, "data": 11},
        {"op": MUOp.APPEND, "ref": ref, "data": 12},
        {"op": MUOp.WRITE, "ref": ref, "index": 1, "data": 21},
        {"op": MUOp.READ, "ref": ref, "index": 1},
        {"op": MUOp.LEN, "ref": ref},
        {"op": MUOp.READ, "ref": ref, "index": 2},                       # OUT_OF_RANGE
        {"op": MUOp.WRITE, "ref": ref, "index": params.max_buffer_words}
        if params.index_bits > params.length_bits - 1 else {"op": MUOp.LEN, "ref": ref},
        {"op": MUOp.READ, "ref": {"mu": (mu_id + 1) % (1 << params.mu_id_bits), "buf": 0}},
        {"op": MUOp.READ, "ref": {"mu": mu_id, "buf": 1}},               # never allocated
        {"op": 15, "ref": ref},                                          # unknown opcode
        {"op": MUOp.ALLOC, "data": 0},                                   # zero weight
        {"op": MUOp.ALLOC, "data": min(params.max_weight + 1, (1 << params.data_bits) - 1)},
        {"op": MUOp.INCREF if weighted else MUOp.RETURN, "ref": ref, "data": 1},  # wrong mode
    ]:
        statuses.append(tb.send(req)["status"])
    assert statuses[:5] == [MUStatus.OK] * 5
    assert MUStatus.OUT_OF_RANGE in statuses and MUStatus.BAD_REF in statuses
    heavy = MUStatus.WEIGHT_OVERFLOW if params.weight_bits < params.data_bits else MUStatus.OK
    assert statuses[-4:-1] == [MUStatus.BAD_REQUEST, MUStatus.BAD_REQUEST, heavy]
    assert statuses[-1] is MUStatus.BAD_REQUEST
    if weighted:
        assert tb.send({"op": MUOp.RETURN, "ref": ref, "data": 3})["status"] is \
            MUStatus.WEIGHT_OVERFLOW
        assert tb.send({"op": MUOp.ADD_WEIGHT, "ref": ref, "data": 1})["data"] == 3
        assert tb.send({"op": MUOp.RETURN, "ref": ref, "data": 1})["data"] == 2
        assert tb.send({"op": MUOp.RETURN, "ref": ref, "data": 2})["data"] == 0   # freed
    else:
        assert tb.send({"op": MUOp.INCREF, "ref": ref})["data"] == 3
        for left in (2, 1, 0):
            assert tb.send({"op": MUOp.DECREF, "ref": ref})["data"] == left
    assert tb.send({"op": MUOp.READ, "ref": ref, "index": 0})["status"] is MUStatus.BAD_REF
    await tb.drain()
    assert tb.counter("live_buffers") == 0 and tb.counter("frees") == 1


@cocotb.test()
async def random_stream_against_model(dut):
    """Constrained-random requests, every response compared with the model, with random
    back-pressure on the response port and idle cycles on the request port."""
    cfg, params, mu_id = setup()
    tb = MUBench(dut, params, mu_id, backpressure=cfg.get("backpressure", 0.7),
                 idle=cfg.get("idle", 0.9), seed=cfg.get("seed", 0))
    await tb.reset()
    stim = MUStimulus(params, seed=cfg.get("seed", 0), mu_id=mu_id)
    n = cfg.get("ops", 2000)
    sent = 0
    while sent < n:
        # Keep a bounded window of requests in flight so the model never runs far ahead.
        while tb.source.pending < 64 and sent < n:
            req = stim.next_request()
            stim.observe(req, tb.send(req))
            sent += 1
        await tb.bench.cycle()
        assert not tb.mismatches, "\n".join(tb.mismatches)
    await tb.drain()
    # Every counter reads what the docs define (the model's counters); busy_cycles also counts
    # the cycles the back-pressure held a request in the execute stage.
    for name, value in tb.model.counters().items():
        got = tb.counter(name)
        assert got >= value if name == "busy_cycles" else got == value, (name, got, value)
    assert tb.counter("live_buffers") == len(tb.model.live_buffers())
    dut._log.info("%d requests checked in %d cycles", n, tb.bench.cycles)


@cocotb.test()
async def fill_then_free_everything(dut):
    """Allocate and append until the MU is full, free everything, and find every block and
    slot free again exactly once; then fill again and get the same amount."""
    cfg, params, mu_id = setup()
    tb = MUBench(dut, params, mu_id)
    await tb.reset()
    filled = []
    for _round in range(2):
        refs = []
        words = 0
        while True:
            r = tb.send({"op": MUOp.ALLOC, "data": 1})
            if r["status"] is not MUStatus.OK:
                assert r["status"] is MUStatus.OUT_OF_MEMORY
                break
            refs.append(r["ref"])
            status = MUStatus.OK
            while status is MUStatus.OK:
                status = tb.send({"op": MUOp.APPEND, "ref": r["ref"], "data": words})["status"]
                words += status is MUStatus.OK
            if status is MUStatus.OUT_OF_MEMORY:
                break
            assert status is MUStatus.OUT_OF_RANGE      # this buffer is as large as can be
        await tb.drain()
        filled.append(words)
        if params.alloc_mode.value == "virtual":
            assert tb.counter("free_blocks") == 0
        for ref in refs:
            op = MUOp.RETURN if params.refcount.value == "weighted" else MUOp.DECREF
            assert tb.send({"op": op, "ref": ref, "data": 1})["data"] == 0
        await tb.drain()
        assert tb.counter("live_buffers") == 0 and tb.counter("held_words") == 0
        assert tb.counter("free_slots") == params.max_buffers
        if params.alloc_mode.value == "virtual":
            assert tb.counter("free_blocks") == params.n_blocks
            assert sorted(tb.model.free_blocks()) == list(range(params.n_blocks))
    assert filled[0] == filled[1] > 0


@cocotb.test()
async def figure_1b_race(dut):
    """The paper's Figure 1(b): a +1 delayed behind a -1. With counters (no acknowledgement
    gating) the buffer is freed while CU2 still holds a reference; with partial-free, CU1
    splits its weight without any message and nothing is freed early, in either order."""
    cfg, params, mu_id = setup()
    tb = MUBench(dut, params, mu_id)
    await tb.reset()
    if params.refcount.value == "counter":
        ref = tb.send({"op": MUOp.ALLOC, "data": 1})["ref"]          # CU3 holds it
        tb.send({"op": MUOp.APPEND, "ref": ref, "data": 42})
        # CU1 copies the reference for CU2 and sends +1; CU3 drops its reference and sends -1;
        # the NoC delivers the -1 first.
        dec = tb.send({"op": MUOp.DECREF, "ref": ref, "src": {"x": 3, "y": 0}})
        inc = tb.send({"op": MUOp.INCREF, "ref": ref, "src": {"x": 1, "y": 0}})
        use = tb.send({"op": MUOp.READ, "ref": ref, "index": 0, "src": {"x": 2, "y": 0}})
        await tb.drain()
        assert dec["data"] == 0 and tb.counter("frees") == 1            # freed prematurely
        assert inc["status"] is MUStatus.BAD_REF
        assert use["status"] is MUStatus.BAD_REF                        # CU2 lost its buffer
        # With acknowledgement gating CU1 waits for the +1's response before CU2 may run,
        # so the +1 is applied first and CU2's read succeeds.
        ref = tb.send({"op": MUOp.ALLOC, "data": 1})["ref"]
        tb.send({"op": MUOp.APPEND, "ref": ref, "data": 43})
        assert tb.send({"op": MUOp.INCREF, "ref": ref})["data"] == 2    # the acknowledgement
        assert tb.send({"op": MUOp.DECREF, "ref": ref})["data"] == 1    # CU3 drops its ref
        assert tb.send({"op": MUOp.READ, "ref": ref, "index": 0})["data"] == 43
        assert tb.send({"op": MUOp.DECREF, "ref": ref})["data"] == 0
        await tb.drain()
        assert tb.counter("frees") == 2
    else:
        for order in ((3, 2), (2, 3)):
            ref = tb.send({"op": MUOp.ALLOC, "data": 2})["ref"]      # MU hands CU1 weight 2
            tb.send({"op": MUOp.APPEND, "ref": ref, "data": 42})
            # CU1 splits 2 into 1 (CU2) + 1 (CU3): no message. Returns arrive in either order.
            frees_before = tb.model.frees
            first = tb.send({"op": MUOp.RETURN, "ref": ref, "data": 1,
                             "src": {"x": order[0], "y": 0}})
            assert first["data"] == 1 and tb.model.frees == frees_before   # not freed
            assert tb.send({"op": MUOp.READ, "ref": ref, "index": 0})["data"] == 42
            assert tb.send({"op": MUOp.RETURN, "ref": ref, "data": 1})["data"] == 0
        await tb.drain()
        assert tb.counter("frees") == 2


@cocotb.test()
async def run_time_reset(dut):
    """A reset in the middle of traffic leaves an MU that behaves like a new one."""
    cfg, params, mu_id = setup()
    tb = MUBench(dut, params, mu_id)
    await tb.reset()
    ref = tb.send({"op": MUOp.ALLOC, "data": 1})["ref"]
    for i in range(3 * params.block_words):
        tb.send({"op": MUOp.APPEND, "ref": ref, "data": i})
    await tb.drain()
    await tb.reset()
    for name in ("live_buffers", "held_words", "allocs", "frees"):
        assert tb.counter(name) == 0, name
    # The old reference is gone, and a new allocation gets slot 0, generation 0 again.
    assert tb.send({"op": MUOp.LEN, "ref": ref})["status"] is MUStatus.BAD_REF
    assert tb.send({"op": MUOp.ALLOC, "data": 1})["ref"] == {"mu": mu_id, "buf": 0}
    await tb.drain()


@cocotb.test()
async def sustained_throughput(dut):
    """Back-to-back WRITEs then READs to mapped words, no back-pressure: one per cycle."""
    cfg, params, mu_id = setup()
    tb = MUBench(dut, params, mu_id)
    await tb.reset()
    ref = tb.send({"op": MUOp.ALLOC, "data": 1})["ref"]
    n = min(params.max_buffer_words, params.words // 2)
    for i in range(n):
        tb.send({"op": MUOp.APPEND, "ref": ref, "data": i})
    await tb.drain()
    for op in (MUOp.WRITE, MUOp.READ):
        start = len(tb.source.sent)
        for i in range(n):
            tb.send({"op": op, "ref": ref, "index": i, "data": i ^ 0x55})
        await tb.drain()
        cycles = [c for c, _ in tb.source.sent[start:]]
        rate = (len(cycles) - 1) / (cycles[-1] - cycles[0])
        dut._log.info("%s: %d requests at %.4f per cycle", op.name, n, rate)
        assert rate >= 0.99, f"{op.name} throughput {rate:.4f} < 0.99"

