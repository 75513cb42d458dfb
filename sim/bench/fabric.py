"""``rdakit bench fabric``: matrix kernels on a 4x4 fabric's RTL beside the compute lower
bound, configuration-load cycles, and Yosys cell counts per tile type. On Verilator the fabric
is driven directly (a harness executable, as ``rdakit run`` drives it); on Icarus through
cocotb (``fabric_tb``)."""

import json
import pathlib
import tempfile

from rdakit.hdl.compute.unit import ComputeUnit
from rdakit.hdl.fabric.top import Fabric, MUTile
from rdakit.hdl.noc.router import Router
from rdakit.hdl.spec.packets import mu_request_layout
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.bench.mu import yosys_stat
from rdakit.sim.bench.report import Report
from rdakit.sim.flows.e2e import on_harness
from rdakit.sim.runtime.job import run_job
from rdakit.sim.verify import kernels
from rdakit.sim.verify.runner import require_simulator_or_raise, run_cocotb

__all__ = ["bench_fabric", "run_kernels"]


async def run_kernels(host, params, jobs, *, log=None):
    """Run ``jobs`` (``[name, keyword arguments]`` of :mod:`rdakit.sim.verify.kernels`) one
    after the other on ``host``, each checked against numpy; their rows (cycles, load cycles,
    MACs, CUs used, and the traffic bounds from the tiles' counters: ``mu_bound``, the
    requests the busiest MU received, and ``injection_bound``, the flits the busiest CU sent,
    each at one a cycle). ``log(text)`` hears of each."""
    rows = []
    for name, kwargs in jobs:
        job = getattr(kernels, name)(params, **kwargs)
        result = await run_job(host, job)
        result.check(job)
        tiles = result.counters
        rows.append({"job": name, "description": job.description, "cycles": result.cycles,
                     "load_cycles": result.load_cycles, "macs": job.macs,
                     "cus_used": job.cus_used,
                     "mu_bound": max(c["flits_in"] for xy, c in tiles.items()
                                     if params.kind(*xy) == "M"),
                     "injection_bound": max(c["flits_out"] for xy, c in tiles.items()
                                            if params.kind(*xy) == "C")})
        if log is not None:
            log(f"{job.description}: {result.cycles} cycles")
    return rows


def _run_direct(params, jobs):
    # rdakit run's build of the same fabric.
    return on_harness(params, lambda host: run_kernels(host, params, jobs))


def _cells(params):
    cx, cy = params.tiles("C")[0]
    mx, my = params.tiles("M")[0]
    # The fabric's busiest router: an inner one (5 ports) where the grid has one, else the
    # one at (1, 1) or (1, 0) of the grid as it is.
    x, y = min(1, params.cols - 1), min(1, params.rows - 1)
    ports = 1 + sum(0 <= x + dx < params.cols and 0 <= y + dy < params.rows
                    for dx, dy in ((1, 0), (-1, 0), (0, 1), (0, -1)))
    router = Router(payload_shape=_req_shape(params), x=x, y=y, rows=params.rows,
                    cols=params.cols, coord_bits=params.coord_bits,
                    depth=params.noc_depth, queues=params.noc_queues)
    return [
        {"unit": "compute unit", **yosys_stat(ComputeUnit(params, x=cx, y=cy))},
        {"unit": "memory tile (MU + adapters)", **yosys_stat(MUTile(params, x=mx, y=my))},
        {"unit": f"router (request network, {ports} ports)", **yosys_stat(router)},
    ]


def _req_shape(params):
    return mu_request_layout(params.mu)


def bench_fabric(fabric, *, simulator="verilator", quick=False, json_path=None):
    """``rdakit bench fabric`` on the fabric of ``fabric`` (keyword arguments of
    :func:`fabric_params`, JSON-able: they cross into the cocotb process): print its tables
    and, with ``json_path``, write the figures as JSON; returns the exit status."""
    params = fabric_params(**fabric)
    report = Report("fabric")
    require_simulator_or_raise(simulator)
    jobs = [["matvec", {"m": 64, "k": 64}]]
    if not quick:
        jobs.append(["matmul", {"m": 64, "k": 64, "n": 64}])
    if simulator == "verilator":
        rows = _run_direct(params, jobs)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = pathlib.Path(tmp) / "rows.json"
            run_cocotb(Fabric(params), simulator=simulator, test_module="fabric_tb",
                       test_dir=pathlib.Path(__file__).parent,
                       build_name=f"bench-fabric-{params.rows}x{params.cols}",
                       config={"fabric": fabric, "jobs": jobs, "out": str(out)})
            rows = json.loads(out.read_text())
    table = []
    for r in rows:
        bound = r["macs"] / (params.cu.lanes * r["cus_used"])
        traffic = max(r["mu_bound"], r["injection_bound"])
        table.append({**r, "lower_bound": bound, "cycles_over_bound": r["cycles"] / bound,
                      "cycles_over_traffic": r["cycles"] / traffic})
        report.figure(f"{r['job']}_cycles", r["cycles"])
        report.figure(f"{r['job']}_lower_bound", bound)
        report.figure(f"{r['job']}_cus_used", r["cus_used"])
        report.figure(f"{r['job']}_traffic_bound", max(r["mu_bound"], r["injection_bound"]))
    report.figure("config_load_cycles", rows[0]["load_cycles"])
    report.table(f"Kernels on a {params.rows}x{params.cols} fabric ({params.cu.lanes} lanes, "
                 f"{simulator}); lower bound = MACs / (lanes x CUs used); traffic: the busiest "
                 f"MU's requests and the busiest CU's flits, one a cycle", table, key="kernels")
    report.table("Area per tile type (Yosys coarse synthesis)", _cells(params), key="area")
    report.finish(json_path)
    return 0
