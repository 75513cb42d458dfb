"""``rdakit bench fabric``: matrix kernels on a 4x4 fabric's RTL beside the compute lower
bound, configuration-load cycles, and Yosys cell counts per tile type."""

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
from rdakit.sim.verify.runner import require_simulator_or_raise, run_cocotb

__all__ = ["bench_fabric"]


def _cells(params):
    cx, cy = params.tiles("C")[0]
    mx, my = params.tiles("M")[0]
    router = Router(payload_shape=_req_shape(params), x=1, y=1, rows=max(params.rows, 3),
                    cols=max(params.cols, 3), coord_bits=params.coord_bits,
                    depth=params.noc_depth, queues=params.noc_queues)
    return [
        {"unit": "compute unit", **yosys_stat(ComputeUnit(params, x=cx, y=cy))},
        {"unit": "memory tile (MU + adapters)", **yosys_stat(MUTile(params, x=mx, y=my))},
        {"unit": "router (request network, 5 ports)", **yosys_stat(router)},
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
        table.append({**r, "lower_bound": bound, "cycles_over_bound": r["cycles"] / bound})
        report.figure(f"{r['job']}_cycles", r["cycles"])
        report.figure(f"{r['job']}_lower_bound", bound)
        report.figure(f"{r['job']}_cus_used", r["cus_used"])
    report.figure("config_load_cycles", rows[0]["load_cycles"])
    report.table(f"Kernels on a {params.rows}x{params.cols} fabric ({params.cu.lanes} lanes, "
                 f"{simulator}); lower bound = MACs / (lanes x CUs used)", table, key="kernels")
    report.table("Area per tile type (Yosys coarse synthesis)", _cells(params), key="area")
    report.finish(json_path)
    return 0
