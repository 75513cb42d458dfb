"""``rdakit bench memory``: workloads with memory dynamism on the whole fabric under each memory
scheme (issue 22).

Each workload of :mod:`rdakit.sim.verify.dynamic` runs as a job (the host fills its buffer,
loads the programs, starts, waits and reads back, :func:`~rdakit.sim.runtime.job.run_job`) on a
fabric that differs only in its MUs' scheme (:data:`SCHEMES`):

* ``virtual+partial``: buffer virtualization and partial-free (weighted reference counting),
  the seed paper's design;
* ``virtual+counter``: virtualization and counter-based reference counting (INCREF/DECREF;
  a copy of a reference is used only once its INCREF is acknowledged: "gating");
* ``reserve``: reserve-and-copy allocation (a buffer starts with ``reserve_words`` and moves to
  a region twice as large when it outgrows it, copying its words), partial-free;
* ``single``: one live buffer per MU (``alloc_mode="single"``) running the same batch, and
  ``single/1-slot``, the nearest honest equivalent that runs: the batch shrunk to one sequence
  at a time for each MU that holds caches (one CU, one slot).

The default fabric (:data:`FABRIC`) is 2x3: four CUs decode into one MU (the caches), the host's
buffer lives in the other. Every run is checked bit for bit against numpy. A run that an MU
refuses for lack of memory is a row whose ``check`` says so, with the number of refused
requests in ``oom_events``.

With ``sim="model"`` (the default) the MUs are the golden model's, wrapped to record every
request the CUs make with the cycle the model issues it (:attr:`PerfInterpreter.now
<rdakit.sim.models.perf.PerfInterpreter.now>`): the occupancy over time (live words, held
words), the references copied and the reference-counting messages, and the cycles from the last
use of each cache to the request that frees it. On the RTL (``sim="amaranth"``) the rows have
the fabric's counters only (cycles, allocations, frees, words copied, peak held words).
"""

import asyncio
import collections
import dataclasses
import json
import pathlib
import tempfile

import numpy as np

from rdakit.files import atomic_path
from rdakit.hdl.spec.packets import MUOp, MUStatus
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.models.cu_state import InterpreterError
from rdakit.sim.models.mu import MUModel
from rdakit.sim.models.perf import ModelTransport
from rdakit.sim.runtime.host import HostDriver, HostTimeout
from rdakit.sim.runtime.job import JobError, JobResult, prepare_interp, run_job
from rdakit.sim.verify.dynamic import (
    DRAFT_DEPTH,
    SPLITS,
    generation,
    moe_dispatch,
    speculative,
)

__all__ = ["SCHEMES", "FABRIC", "SIZES", "QUICK_SIZES", "SIMS", "Run", "run_workload",
           "scheme_params", "bench_rows", "bench_memory", "plot_occupancy", "TracedMU",
           "run_traced", "interpreter_failure", "moe_rows", "weight_rows", "MOE_SCHEMES",
           "speculative_rows", "build", "rebuild", "BUILDERS", "scheme_fabric", "COCOTB_SIMS"]

#: Scheme -> the fabric parameters that differ from :data:`FABRIC`, and the job's changes
#: (``slots`` and ``cus`` of :func:`~rdakit.sim.verify.dynamic.generation`).
SCHEMES = {
    "virtual+partial": ({}, {}),
    "virtual+counter": ({"refcount": "counter"}, {}),
    "reserve": ({"alloc_mode": "reserve"}, {}),
    "single": ({"alloc_mode": "single"}, {}),
    "single/1-slot": ({"alloc_mode": "single"}, {"slots": 1, "cus": 1}),
}

#: The fabric of the benchmark: CUs in the first two columns, MUs in the third; the caches go
#: to the MU at (2, 0), the host's buffer to the one at (2, 1).
FABRIC = dict(rows=2, cols=3, layout="CCM/CCM", mu_words=1024, block_words=4, prog_len=128,
              max_buffers=16)
CACHE_MU, HOST_MU = (2, 0), (2, 1)

#: Cycles after which a run counts as hung (the longest, one slot decoding 32 sequences of
#: up to 128 tokens, takes 360,000).
MAX_CYCLES = 2_000_000

#: The RTL may take this many times the model's cycles (it took 1.1 times on the runs
#: measured, ``docs/results.md``) before a run counts as hung.
RTL_BUDGET = 4

#: The simulators: the performance model (default), the RTL in Amaranth's simulator, and the
#: RTL's Verilog on Verilator (a harness executable driven from this process) or under cocotb
#: on Icarus (one build per scheme).
COCOTB_SIMS = ("verilator", "icarus")
SIMS = ("model", "amaranth", *COCOTB_SIMS)


@dataclasses.dataclass(frozen=True)
class Size:
    """One size of the generation workload: ``sequences`` of ``min_len..max_len`` tokens,
    ``slots`` per CU."""

    name: str
    sequences: int
    min_len: int
    max_len: int
    slots: int = 4


#: The sizes of the benchmark: with 4 CUs of 4 slots, 16 caches live at once in a 1024-word
#: MU; "full" is where virtualization still fits and the MU is nearly full at its peak.
SIZES = (Size("light", 32, 8, 32), Size("half", 32, 16, 64), Size("full", 32, 40, 120),
         Size("over", 32, 48, 128))
#: ``--quick``.
QUICK_SIZES = (Size("light", 8, 4, 16), Size("half", 12, 16, 64))
#: The columns printed (the JSON has every key of a row).
COLUMNS = ("size", "scheme", "check", "cycles", "tokens_per_kcycle", "peak_utilization",
           "peak_held_words", "copied_words", "sync_messages", "messages_per_copy",
           "free_latency_mean", "oom_events")
#: The columns of the MoE table and of the weight study.
MOE_COLUMNS = ("scheme", "check", "cycles", "tokens_per_kcycle", "ref_copies",
               "copy_messages", "release_messages", "messages_per_copy",
               "release_messages_per_ref", "free_latency_mean", "oom_events")
WEIGHT_COLUMNS = ("weight_bits", "split", "check", "cycles", "ref_copies", "add_weight",
                  "messages_per_copy", "release_messages_per_ref")
#: The size whose occupancy over time is plotted.
PLOT_SIZE = "full"


class TracedMU(MUModel):
    """The golden MU model, recording each request while :attr:`recording` is set:
    ``(cycle, op, (slot, gen), status, data, live_words, held_words)`` with the cycle from
    ``clock()``."""

    def __init__(self, params, mu_id, clock):
        super().__init__(params, mu_id)
        self.clock = clock
        self.recording = False
        self.trace = []

    def request(self, req):
        resp = super().request(req)
        if self.recording:
            ref = resp["ref"] if req["op"] is MUOp.ALLOC else req.get("ref")
            buf = ref["buf"] if ref else None
            self.trace.append((self.clock(), req["op"], buf, resp["status"], resp["data"],
                               self.live_words, self.held_words))
        return resp


def scheme_fabric(scheme, base=None):
    """The keyword arguments of :func:`fabric_params` of ``scheme`` (a key of
    :data:`SCHEMES`) on the fabric ``base`` (default :data:`FABRIC`)."""
    extra, _ = SCHEMES[scheme]
    return {**(base or FABRIC), **extra}


def scheme_params(scheme, base=None):
    """The fabric parameters of ``scheme`` (a key of :data:`SCHEMES`)."""
    return fabric_params(**scheme_fabric(scheme, base))


#: The job builders of :mod:`rdakit.sim.verify.dynamic` a recipe may name.
BUILDERS = {"generation": generation, "moe_dispatch": moe_dispatch, "speculative": speculative}


def build(builder, fabric, **kwargs):
    """``BUILDERS[builder](fabric_params(**fabric), **kwargs)`` with its
    :attr:`~rdakit.sim.verify.dynamic.DynamicJob.recipe` set, so that :func:`rebuild` makes
    the same job in another process."""
    job = BUILDERS[builder](fabric_params(**fabric), **kwargs)
    return dataclasses.replace(job, recipe={"builder": builder, "fabric": fabric,
                                            "kwargs": _encode(kwargs)})


def rebuild(recipe):
    """The job of a :func:`build` recipe."""
    return build(recipe["builder"], recipe["fabric"], **_decode(recipe["kwargs"]))


def _encode(v):
    """JSON of keyword arguments whose tuples (tiles) and dicts keyed by tiles must come back
    as they were."""
    if isinstance(v, tuple):
        return {"tuple": [_encode(x) for x in v]}
    if isinstance(v, dict):
        return {"items": [[_encode(k), _encode(x)] for k, x in v.items()]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    return v


def _decode(v):
    if isinstance(v, dict) and "tuple" in v:
        return tuple(_decode(x) for x in v["tuple"])
    if isinstance(v, dict):
        return {_decode(k): _decode(x) for k, x in v["items"]}
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


@dataclasses.dataclass
class Run:
    """One run: the job, its result (``None`` if it failed), why it failed, the fabric's
    counters and, on the model, the MU traces by tile."""

    job: object
    result: object
    error: str | None
    counters: dict
    traces: dict
    refs_sent: int = 0
    #: ``reserve`` mode: words of the cache MU ever reserved (its bump pointer at the end:
    #: regions are never merged, so freed ones of other classes cannot serve a growth).
    reserved_words: int | None = None


def _job(scheme, size, seed, base):
    _, change = SCHEMES[scheme]
    fabric = scheme_fabric(scheme, base)
    cus = fabric_params(**fabric).tiles("C")
    cus = cus[:change.get("cus", len(cus))]
    return build("generation", fabric, sequences=size.sequences,
                 slots=change.get("slots", size.slots), min_len=size.min_len,
                 max_len=size.max_len, cus=cus, host_mu=HOST_MU,
                 cache_mus=dict.fromkeys(cus, CACHE_MU), seed=seed)


def run_workload(scheme, size, *, sim="model", seed=0, base=None):
    """Run the generation workload of ``size`` under ``scheme`` on ``sim``: a :class:`Run`."""
    return run_traced(_job(scheme, size, seed, base), sim=sim)


def interpreter_failure(job):
    """Why ``job`` fails on the interpreter (the status of the first MU request refused, or
    the deadlock that follows), or ``None`` if it runs and matches numpy. A run that would
    leave CUs waiting forever (experts whose router halted) is found here, in milliseconds,
    rather than by a simulation's timeout."""
    try:
        interp, refs = prepare_interp(job, trace=True)
    except InterpreterError as e:      # the host's own buffer does not fit
        return "out of memory" if "OUT_OF_MEMORY" in str(e) else str(e)
    try:
        result = interp.run(max_steps=50_000_000)
        ok = result.ok
    except InterpreterError:
        ok = False
    if not ok:
        refused = next((t.response["status"] for t in interp.transactions
                        if t.response["status"] is not MUStatus.OK), None)
        return _FAILURES.get(refused, f"the interpreter failed ({refused})")
    mu = next(b.mu for b in job.buffers if b.name == job.outputs[0])
    for name in job.outputs:
        if not np.array_equal(interp.read_buffer(mu, refs[name]), job.expected[name]):
            return f"output {name!r} differs from numpy on the interpreter"
    return None


#: What the benchmark's check column says for a run an MU refused.
_FAILURES = {MUStatus.OUT_OF_MEMORY: "out of memory", MUStatus.WEIGHT_OVERFLOW:
             "weight overflow", MUStatus.BAD_REQUEST: "refused (bad request)"}


def run_traced(job, *, sim="model", precheck=False):
    """Run ``job`` on ``sim`` (the model with traced MUs, or Amaranth's simulator): a
    :class:`Run`. With ``precheck`` it runs on the interpreter first and, if it fails there,
    is not simulated (the :class:`Run` has no result and says why)."""
    params = job.params
    if precheck:
        why = interpreter_failure(job)
        if why is not None:
            return Run(job, None, why, {}, {})
    if sim == "model":
        transport = ModelTransport(params)
        transport.mus = {xy: TracedMU(params.mu, params.mu_id(*xy),
                                      lambda t=transport: t.interp.now)
                         for xy in transport.mus}

        def stage(name):
            for m in transport.mus.values():
                m.recording = name == "run"

        result, error, counters = asyncio.run(_run(HostDriver(params, transport), job, stage))
        if error is not None:
            refused = next((t[3] for m in transport.mus.values() for t in m.trace
                            if t[3] is not MUStatus.OK), None)
            error = _FAILURES.get(refused, error)
        sent = sum(c.refs_sent for c in transport.interp.result().cus.values())
        cache = transport.mus[CACHE_MU]
        return Run(job, result, error, counters,
                   {xy: m.trace for xy, m in transport.mus.items()}, sent,
                   cache.bump if params.mu.alloc_mode.value == "reserve" else None)
    if sim == "amaranth":
        # The model first (milliseconds): a run it finds failing is not simulated (CUs left
        # waiting for a halted one would keep the RTL busy until the cycle budget), and the
        # RTL's budget is a margin over the model's cycles.
        model = run_traced(job, sim="model")
        if model.result is None:
            return Run(job, None, model.error, {}, {})
        budget = RTL_BUDGET * model.result.cycles + 10_000
        from rdakit.hdl.fabric.top import Fabric
        from rdakit.sim.runtime.host import AmaranthTransport
        from rdakit.sim.verify.amaranth_sim import simulate
        fabric = Fabric(params)
        out = {}

        async def tb(ctx):
            out["r"] = await _run(HostDriver(params, AmaranthTransport(ctx, fabric)), job, None,
                                  budget)

        simulate(fabric, tb)
        return Run(job, *out["r"], {})
    if sim in COCOTB_SIMS:
        model = run_traced(job, sim="model")
        if model.result is None:
            return Run(job, None, model.error, {}, {})
        budget = RTL_BUDGET * model.result.cycles + 10_000
        if sim == "verilator":
            return _run_direct(job, budget)
        return _run_cocotb(job, sim, budget)
    raise ValueError(f"sim must be one of {', '.join(SIMS)}, not {sim!r}")


def _run_direct(job, budget):
    """``job`` on the fabric's Verilog built into a Verilator harness executable and driven
    from this process (``e2e.on_harness``: the build ``rdakit run --sim verilator`` drives,
    one per scheme's fabric, cached): a :class:`Run` with the fabric's counters."""
    from rdakit.sim.flows.e2e import VERILATOR_BUILD, on_harness

    result, error, counters = on_harness(job.params, lambda host: _run(host, job, None, budget),
                                         VERILATOR_BUILD)
    return Run(job, result, error, counters, {})


def _run_cocotb(job, sim, budget):
    """``job`` (built by :func:`build`) on the fabric's Verilog under cocotb (``memory_tb``):
    a :class:`Run` with the fabric's counters."""
    from rdakit.hdl.fabric.top import Fabric
    from rdakit.sim.verify.runner import run_cocotb

    params = job.params
    with tempfile.TemporaryDirectory(prefix="rdakit-memory-") as tmp:
        out = pathlib.Path(tmp) / "run.json"
        run_cocotb(Fabric(params), simulator=sim, test_module="memory_tb",
                   test_dir=pathlib.Path(__file__).parent,
                   build_name=f"bench-memory-{params.rows}x{params.cols}",
                   config={"recipe": job.recipe, "out": str(out), "max_cycles": budget})
        data = json.loads(out.read_text())
    counters = {tuple(xy): c for xy, c in data["counters"]}
    result = None
    if data["cycles"] is not None:
        result = JobResult({}, data["cycles"], data["load_cycles"], {}, counters)
    return Run(job, result, data["error"], counters, {})


async def _run(host, job, stage, max_cycles=None):
    try:
        result = await run_job(host, job, on_stage=stage, max_cycles=max_cycles or MAX_CYCLES)
    except JobError as e:
        return None, str(e), e.counters
    except HostTimeout as e:
        # CUs waiting forever for messages a halted CU would have sent (the model knows at
        # START; the driver gives up after MAX_CYCLES).
        return None, str(e), {}
    try:
        result.check(job)
    except AssertionError as e:
        return result, str(e), result.counters
    return result, None, result.counters


def _occupancy(traces, mus):
    """``[(cycle, live, held)]`` over the MUs ``mus`` after each request, in cycle order."""
    events = sorted((t[0], i, xy, t) for xy in mus for i, t in enumerate(traces.get(xy, ())))
    live, held, out = dict.fromkeys(mus, 0), dict.fromkeys(mus, 0), []
    first = {xy: True for xy in mus}
    for cycle, _, xy, t in events:
        if first[xy]:
            first[xy] = False
        live[xy], held[xy] = t[5], t[6]
        out.append((cycle, sum(live.values()), sum(held.values())))
    return out


def _messages(traces, mus):
    """Reference-counting traffic and the cycles from each buffer's last use to its free."""
    ops = collections.Counter()
    last_use, latencies = {}, []
    for xy in mus:
        for cycle, op, buf, status, data, *_ in traces.get(xy, ()):
            ops[op] += 1
            key = (xy, buf)
            if op in (MUOp.RETURN, MUOp.DECREF):
                if status is MUStatus.OK and data == 0 and key in last_use:
                    latencies.append(cycle - last_use.pop(key))
            elif op not in (MUOp.INCREF, MUOp.ADD_WEIGHT) and status is MUStatus.OK:
                last_use[key] = cycle
    oom = sum(1 for xy in mus for t in traces.get(xy, ()) if t[3] is MUStatus.OUT_OF_MEMORY)
    return ops, latencies, oom


def _row(scheme, size, run):
    c = run.counters.get(CACHE_MU, {})
    cycles = run.result.cycles if run.result else None
    row = {"size": size.name, "scheme": scheme,
           "check": "ok" if run.error is None else _short(run.error),
           "cycles": cycles, "tokens": run.job.tokens,
           "tokens_per_kcycle": (round(1000 * run.job.tokens / cycles, 2)
                                 if cycles and run.error is None else None),
           "copied_words": c.get("copy_cycles"), "allocs": c.get("allocs"),
           "frees": c.get("frees"), "peak_held_words": c.get("peak_held_words")}
    if run.traces:
        occ = _occupancy(run.traces, [CACHE_MU])
        cycle, live, held = max(occ, key=lambda e: (e[2], e[1]), default=(0, 0, 0))
        ops, lat, oom = _messages(run.traces, [CACHE_MU])
        refs_sent = run.refs_sent
        copy_msgs = ops[MUOp.INCREF] + ops[MUOp.ADD_WEIGHT]
        release = ops[MUOp.RETURN] + ops[MUOp.DECREF]
        row.update({
            "peak_held_words": held, "live_words_at_peak": live,
            "peak_utilization": round(live / held, 3) if held else None,
            "ref_copies": refs_sent, "copy_messages": copy_msgs,
            "release_messages": release, "sync_messages": copy_msgs + release,
            "messages_per_copy": round(copy_msgs / refs_sent, 2) if refs_sent else None,
            "free_latency_mean": round(sum(lat) / len(lat), 1) if lat else None,
            "free_latency_max": max(lat, default=None), "oom_events": oom,
            "reserved_words": run.reserved_words})
        if oom and run.error:
            row["check"] = "out of memory"
    return row


# --- MoE with run-time dispatch and the weight study -----------------------------------------

#: The MoE table's schemes: :data:`SCHEMES` but the one-slot equivalent (the router has one
#: token buffer live at a time already); partial-free splits weight as ``fanout``.
MOE_SCHEMES = ("virtual+partial", "virtual+counter", "reserve", "single")
#: ``(tokens, words a token)`` of the MoE table, and with ``--quick``.
MOE_SIZE, MOE_QUICK = (32, 8), (16, 4)
#: Weight bits and tokens of the weight study.
WEIGHT_BITS = (2, 3, 4, 5, 6, 8, 12, 16)
WEIGHT_TOKENS = 32


def _moe_job(fabric, tokens, d, split, seed):
    cus = fabric_params(**fabric).tiles("C")
    return build("moe_dispatch", fabric, tokens=tokens, d=d, split=split, router=cus[0],
                 experts=cus[1:], host_mu=HOST_MU, token_mu=CACHE_MU, seed=seed)


def moe_row(run, **key):
    """A row of the MoE tables: the run's cycles, the references copied and every message
    the reference counting sent, per copy and per reference, and the cycles from each token
    buffer's last use to its free."""
    job = run.job
    row = {**key, "check": "ok" if run.error is None else _short(run.error),
           "cycles": run.result.cycles if run.result and run.error is None else None,
           "tokens": job.tokens}
    row["tokens_per_kcycle"] = (round(1000 * job.tokens / row["cycles"], 2)
                                if row["cycles"] else None)
    if not run.traces or run.error is not None:
        return row
    ops, lat, oom = _messages(run.traces, [CACHE_MU])
    copies = run.refs_sent - job.control_refs
    refs = copies + ops[MUOp.ALLOC]
    copy_msgs = ops[MUOp.INCREF] + ops[MUOp.ADD_WEIGHT]
    release = ops[MUOp.RETURN] + ops[MUOp.DECREF]
    row.update({
        "buffers": ops[MUOp.ALLOC], "ref_copies": copies, "add_weight": ops[MUOp.ADD_WEIGHT],
        "copy_messages": copy_msgs, "release_messages": release,
        "sync_messages": copy_msgs + release,
        "messages_per_copy": round(copy_msgs / copies, 3) if copies else None,
        "release_messages_per_ref": round(release / refs, 3) if refs else None,
        "free_latency_mean": round(sum(lat) / len(lat), 1) if lat else None,
        "free_latency_max": max(lat, default=None), "oom_events": oom})
    return row


def moe_rows(*, size=MOE_SIZE, schemes=MOE_SCHEMES, sim="model", seed=0, base=None):
    """The MoE with run-time dispatch under each scheme: ``(rows, runs)``."""
    tokens, d = size
    rows, runs = [], {}
    for scheme in schemes:
        job = _moe_job(scheme_fabric(scheme, base), tokens, d, "fanout", seed)
        run = run_traced(job, sim=sim, precheck=True)
        runs[scheme] = run
        rows.append(moe_row(run, scheme=scheme))
    return rows, runs


#: Rounds of the speculative-decoding table, and with ``--quick``.
SPEC_ROUNDS, SPEC_QUICK = 60, 12


def speculative_rows(*, rounds=SPEC_ROUNDS, schemes=MOE_SCHEMES, sim="model", seed=0,
                     base=None):
    """Speculative decoding under each scheme: ``(rows, runs)``."""
    rows, runs = [], {}
    for scheme in schemes:
        fabric = scheme_fabric(scheme, base)
        cus = fabric_params(**fabric).tiles("C")
        job = build("speculative", fabric, rounds=rounds, drafter=cus[0], verifiers=cus[1:],
                    host_mu=HOST_MU, cache_mu=CACHE_MU, seed=seed)
        run = run_traced(job, sim=sim, precheck=True)
        runs[scheme] = run
        rows.append(moe_row(run, scheme=scheme))
    return rows, runs


def weight_rows(*, bits=WEIGHT_BITS, splits=SPLITS, tokens=WEIGHT_TOKENS, d=4, seed=0,
                base=None):
    """The weight study on the model: the MoE dispatch with partial-free at each weight width
    and splitting strategy; ADD_WEIGHT traffic, cycles, and the widths a strategy cannot run
    with (a weight overflow, or an allocation wider than the weight)."""
    rows = []
    for b in bits:
        fabric = {**(base or FABRIC), "weight_bits": b}
        for split in splits:
            run = run_traced(_moe_job(fabric, tokens, d, split, seed), precheck=True)
            rows.append(moe_row(run, weight_bits=b, split=split))
    return rows


def _short(message):
    if message in _FAILURES.values():
        return message
    if "MU_ERROR" in message:
        return "MU refused a request (" + message.split(":", 1)[0] + ")"
    return message.splitlines()[0][:120]


def bench_rows(*, sizes=SIZES, schemes=tuple(SCHEMES), sim="model", seed=0, base=None):
    """Every scheme at every size: ``(rows, runs)``, ``runs[(size, scheme)]`` the
    :class:`Run`."""
    rows, runs = [], {}
    for size in sizes:
        for scheme in schemes:
            run = run_workload(scheme, size, sim=sim, seed=seed, base=base)
            runs[(size.name, scheme)] = run
            rows.append(_row(scheme, size, run))
    return rows, runs


def plot_occupancy(runs, size, path, messages=None):
    """Utilization (live / held words) and held words of the cache MU over the run, one line
    per scheme, for the runs of ``size`` that have a trace, and with ``messages`` (``{workload:
    rows}`` of :func:`moe_row`) the reference-counting messages per copy and per reference of
    each scheme that ran; written as an image at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if messages else 2
    fig = plt.figure(figsize=(8, 3 * panels))
    top = fig.add_subplot(panels, 1, 1)
    bottom = fig.add_subplot(panels, 1, 2, sharex=top)
    if messages:
        _plot_messages(fig.add_subplot(panels, 1, 3), messages)
    for (name, scheme), run in runs.items():
        if name != size or not run.traces:
            continue
        occ = _occupancy(run.traces, [CACHE_MU])
        if not occ:
            continue
        cycles = [c for c, _, _ in occ]
        label = scheme + ("" if run.error is None else " (out of memory)")
        top.plot(cycles, [live / held if held else float("nan") for _, live, held in occ],
                 label=label,
                 linewidth=0.8)
        bottom.plot(cycles, [held for _, _, held in occ], label=label, linewidth=0.8)
    words = next(iter(runs.values())).job.params.mu.words
    bottom.axhline(words, color="grey", linestyle=":", linewidth=0.8)
    top.set_ylabel("live / held words")
    top.set_ylim(0, 1.02)
    bottom.set_ylabel(f"held words (MU: {words})")
    bottom.set_xlabel("cycle (performance model)")
    top.legend(fontsize=7, loc="lower right")
    top.set_title(f"Generation with continuous batching, size {size!r}: the cache MU")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format=pathlib.Path(path).suffix[1:] or "png")
    plt.close(fig)


def _plot_messages(ax, messages):
    labels, per_copy, per_ref = [], [], []
    for workload, rows in messages.items():
        for r in rows:
            if r.get("messages_per_copy") is None:
                continue
            labels.append(f"{workload}\n{r['scheme']}")
            per_copy.append(r["messages_per_copy"])
            per_ref.append(r["release_messages_per_ref"])
    x = np.arange(len(labels))
    ax.bar(x - 0.2, per_copy, 0.4, label="messages at a copy (INCREF, ADD_WEIGHT) per copy")
    ax.bar(x + 0.2, per_ref, 0.4, label="messages at a release per reference")
    ax.set_xticks(x, labels, fontsize=6)
    ax.set_ylabel("messages")
    ax.legend(fontsize=7)
    ax.set_title("Reference-counting messages (performance model)", fontsize=9)


def area_rows(base=None):
    """Yosys cells and memory bits of the MU of each scheme with distinct MU parameters (the
    ``single/1-slot`` run uses the ``single`` MU)."""
    from rdakit.hdl.memory.unit import MemoryUnit
    from rdakit.sim.bench.mu import yosys_stat

    rows = []
    for scheme in SCHEMES:
        if "/" in scheme:
            continue
        rows.append({"scheme": scheme, **yosys_stat(MemoryUnit(scheme_params(scheme,
                                                                             base).mu))})
    return rows


def bench_memory(*, quick=False, sim="model", seed=0, area=True, plot=None, json_path=None,
                 report=None):
    """``rdakit bench memory``: print the tables and, with ``json_path``, write them as JSON;
    ``plot`` an image of the occupancy over time. Returns the exit status: 1 if a run that
    had memory enough gave a wrong result."""
    from rdakit.sim.bench.report import Report

    report = report or Report("memory")
    sizes = QUICK_SIZES if quick else SIZES
    rows, runs = bench_rows(sizes=sizes, sim=sim, seed=seed)
    p = FABRIC
    report.table(f"Generation with continuous batching on a {p['rows']}x{p['cols']} fabric "
                 f"({sim}): 4 CUs x slots decode into one {p['mu_words']}-word MU "
                 f"({p['block_words']}-word blocks); lengths drawn at run time", rows,
                 key="generation", columns=COLUMNS)
    bad = [r for r in rows if r["check"] not in ("ok", "out of memory")]
    for r in rows:
        if r["check"] == "ok":
            key = f"{r['size']}_{r['scheme'].replace('+', '_').replace('/1-', '_1')}"
            report.figure(f"{key}_tokens_per_kcycle", r["tokens_per_kcycle"])
            if r.get("peak_utilization") is not None:
                report.figure(f"{key}_peak_utilization", r["peak_utilization"])
    tokens, d = MOE_QUICK if quick else MOE_SIZE
    m_rows, _ = moe_rows(size=(tokens, d), sim=sim, seed=seed)
    report.table(f"MoE with run-time dispatch: a router sends each of {tokens} token buffers "
                 f"({d + 1} words) to the experts its gate picks at run time (3 CUs); "
                 f"partial-free splits one weight per expert", m_rows, key="moe",
                 columns=MOE_COLUMNS)
    bad += [r for r in m_rows if r["check"] not in ("ok", "out of memory")]
    for r in m_rows:
        if r["check"] == "ok" and r.get("messages_per_copy") is not None:
            key = r["scheme"].replace("+", "_")
            report.figure(f"moe_{key}_messages_per_copy", r["messages_per_copy"])
            report.figure(f"moe_{key}_tokens_per_kcycle", r["tokens_per_kcycle"])
    rounds = SPEC_QUICK if quick else SPEC_ROUNDS
    s_rows, _ = speculative_rows(rounds=rounds, sim=sim, seed=seed)
    report.table(f"Speculative decoding, {rounds} rounds: a drafter shares its prefix cache "
                 f"with 3 verifiers each round (a branch of {DRAFT_DEPTH} candidates each), "
                 f"appends the longest accepted prefix, releases every branch "
                 f"(tokens = rounds)", s_rows, key="speculative", columns=MOE_COLUMNS)
    bad += [r for r in s_rows if r["check"] not in ("ok", "out of memory")]
    if sim == "model":
        w_rows = weight_rows(bits=(2, 4, 8) if quick else WEIGHT_BITS,
                             tokens=8 if quick else WEIGHT_TOKENS, seed=seed)
        report.table("Weight study (partial-free, MoE dispatch on the model): weight bits x "
                     "splitting strategy", w_rows, key="weights", columns=WEIGHT_COLUMNS)
        bad += [r for r in w_rows
                if r["check"] not in ("ok", "weight overflow", "refused (bad request)")]
    if area:
        report.table("Area of each scheme's MU (yosys coarse synthesis)", area_rows(),
                     key="area")
    if plot is not None and sim == "model":
        plot_size = PLOT_SIZE if any(s.name == PLOT_SIZE for s in sizes) else sizes[-1].name
        plot_occupancy(runs, plot_size, plot, {"moe": m_rows, "speculative": s_rows})
    report.figure("failed_runs", len(bad))
    report.finish(json_path)
    return 1 if bad else 0
