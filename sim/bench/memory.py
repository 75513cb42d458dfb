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
import pathlib

from rdakit.files import atomic_path
from rdakit.hdl.spec.packets import MUOp, MUStatus
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.models.mu import MUModel
from rdakit.sim.models.perf import ModelTransport
from rdakit.sim.runtime.host import HostDriver
from rdakit.sim.runtime.job import JobError, run_job
from rdakit.sim.verify.dynamic import generation

__all__ = ["SCHEMES", "FABRIC", "SIZES", "QUICK_SIZES", "SIMS", "Run", "run_workload",
           "scheme_params", "bench_rows", "bench_memory", "plot_occupancy", "TracedMU"]

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

#: The simulators: the performance model (default) and the RTL in Amaranth's simulator.
SIMS = ("model", "amaranth")


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


def scheme_params(scheme, base=None):
    """The fabric parameters of ``scheme`` (a key of :data:`SCHEMES`)."""
    extra, _ = SCHEMES[scheme]
    return fabric_params(**{**(base or FABRIC), **extra})


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


def _job(scheme, size, seed, params):
    _, change = SCHEMES[scheme]
    cus = params.tiles("C")[:change.get("cus", len(params.tiles("C")))]
    return generation(params, sequences=size.sequences, slots=change.get("slots", size.slots),
                      min_len=size.min_len, max_len=size.max_len, cus=cus, host_mu=HOST_MU,
                      cache_mus=dict.fromkeys(cus, CACHE_MU), seed=seed)


def run_workload(scheme, size, *, sim="model", seed=0, base=None):
    """Run the generation workload of ``size`` under ``scheme`` on ``sim``: a :class:`Run`."""
    params = scheme_params(scheme, base)
    job = _job(scheme, size, seed, params)
    if sim == "model":
        transport = ModelTransport(params)
        transport.mus = {xy: TracedMU(params.mu, params.mu_id(*xy),
                                      lambda t=transport: t.interp.now)
                         for xy in transport.mus}

        def stage(name):
            for m in transport.mus.values():
                m.recording = name == "run"

        result, error, counters = asyncio.run(_run(HostDriver(params, transport), job, stage))
        sent = sum(c.refs_sent for c in transport.interp.result().cus.values())
        cache = transport.mus[CACHE_MU]
        return Run(job, result, error, counters,
                   {xy: m.trace for xy, m in transport.mus.items()}, sent,
                   cache.bump if params.mu.alloc_mode.value == "reserve" else None)
    if sim == "amaranth":
        from rdakit.hdl.fabric.top import Fabric
        from rdakit.sim.runtime.host import AmaranthTransport
        from rdakit.sim.verify.amaranth_sim import simulate
        fabric = Fabric(params)
        out = {}

        async def tb(ctx):
            out["r"] = await _run(HostDriver(params, AmaranthTransport(ctx, fabric)), job, None)

        simulate(fabric, tb)
        return Run(job, *out["r"], {})
    raise ValueError(f"sim must be one of {', '.join(SIMS)}, not {sim!r}")


async def _run(host, job, stage):
    try:
        result = await run_job(host, job, on_stage=stage)
    except JobError as e:
        return None, str(e), e.counters
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


def _short(message):
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


def plot_occupancy(runs, size, path):
    """Utilization (live / held words) and held words of the cache MU over the run, one line
    per scheme, for the runs of ``size`` that have a trace; written as an image at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for (name, scheme), run in runs.items():
        if name != size or not run.traces:
            continue
        occ = _occupancy(run.traces, [CACHE_MU])
        if not occ:
            continue
        cycles = [c for c, _, _ in occ]
        label = scheme + ("" if run.error is None else " (out of memory)")
        top.plot(cycles, [live / held if held else 1.0 for _, live, held in occ], label=label,
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
    if area:
        report.table("Area of each scheme's MU (yosys coarse synthesis)", area_rows(),
                     key="area")
    if plot is not None and sim == "model":
        plot_size = PLOT_SIZE if any(s.name == PLOT_SIZE for s in sizes) else sizes[-1].name
        plot_occupancy(runs, plot_size, plot)
    report.figure("failed_runs", len(bad))
    report.finish(json_path)
    return 1 if bad else 0
