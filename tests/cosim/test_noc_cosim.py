"""Co-simulation of the NoC (generated Verilog under cocotb) on Icarus and Verilator.

``noc_tb.py`` holds the cocotb tests of a mesh (traffic patterns with a scoreboard and random
back-pressure); the harness test runs the synthesizable traffic harness of the benchmark and
checks its counters. Packet counts come from ``RDAKIT_NOC_PACKETS`` when set (fewer in CI).
"""

import json
import os
import pathlib

import pytest

from rdakit.cli import main
from rdakit.hdl.noc.mesh import Mesh
from rdakit.sim.bench.noc import run_harness
from rdakit.sim.models.noc import PATTERNS, tb_payload_layout
from rdakit.sim.verify.runner import BUILD_ROOT, require_simulator, run_cocotb

HERE = pathlib.Path(__file__).resolve().parent
SIMULATORS = ["icarus", "verilator"]
PACKETS = int(os.environ.get("RDAKIT_NOC_PACKETS", "3000"))


def _run_mesh(simulator, *, rows, cols, coord_bits, queues, packets, build_name, **config):
    require_simulator(simulator)
    dut = Mesh(rows=rows, cols=cols, coord_bits=coord_bits, queues=queues,
               payload_shape=tb_payload_layout(coord_bits))
    return run_cocotb(dut, simulator=simulator, test_module="noc_tb", test_dir=HERE,
                      build_name=build_name,
                      config=dict(rows=rows, cols=cols, coord_bits=coord_bits, packets=packets,
                                  **config))


@pytest.mark.cosim
@pytest.mark.parametrize("simulator", SIMULATORS)
def test_mesh_3x3_voq(simulator):
    """3×3 mesh with per-output queues (coordinates 2 bits wide, so some destinations lie
    outside): every pattern, back-pressure, rejection, counters, zero-load latency."""
    result = _run_mesh(simulator, rows=3, cols=3, coord_bits=2, queues="voq", packets=PACKETS,
                       build_name="noc-mesh-3x3-voq", seed=11)
    assert result["tests"] >= 7


@pytest.mark.cosim
@pytest.mark.parametrize("simulator", [
    "icarus", pytest.param("verilator", marks=pytest.mark.slow)])
@pytest.mark.parametrize("queues", ["fifo", "scan"])
def test_mesh_2x3(simulator, queues):
    """2×3 mesh with the other queue structures: the same checks (Verilator: slow set)."""
    result = _run_mesh(simulator, rows=2, cols=3, coord_bits=2, queues=queues,
                       packets=PACKETS // 2, build_name=f"noc-mesh-2x3-{queues}", seed=5)
    assert result["tests"] >= 7


@pytest.mark.cosim
@pytest.mark.slow
@pytest.mark.parametrize("simulator", SIMULATORS)
@pytest.mark.parametrize("queues", ["voq", "fifo", "scan"])
def test_mesh_4x4_long(simulator, queues):
    """Long runs on a 4×4 mesh: 20000 packets per pattern, heavy back-pressure."""
    result = _run_mesh(simulator, rows=4, cols=4, coord_bits=3, queues=queues, packets=20000,
                       build_name=f"noc-mesh-4x4-{queues}", seed=23, eject_pause=0.4,
                       rate=0.8)
    assert result["tests"] >= 7


def _check_points(points, patterns):
    assert {p["pattern"] for p in points} == set(patterns)
    for p in points:
        assert p["errors"] == 0, p
        assert p["drained"], p
        assert p["lost"] == 0, p
        if p["offered_rate"] <= 0.05:
            # Zero load: one cycle per hop plus two.
            assert abs(p["latency"] - p["zero_load_theory"]) < 0.35, p


@pytest.mark.cosim
def test_harness_3x3_icarus():
    """The benchmark's traffic harness under cocotb on Icarus: for every pattern two sweep
    points run and drain with no delivery error; the zero-load latency is hops + 2."""
    require_simulator("icarus")
    before = set((BUILD_ROOT / "runs").glob("noc-harness-3x3-icarus-results-*"))
    out = run_harness(rows=3, cols=3, queues="voq", depth=2, patterns=None,
                      rates=[0.02, 0.3], simulator="icarus", warmup=100, measure=600,
                      build_name="noc-harness-3x3")     # results in a run folder of its own
    _check_points(out["points"], PATTERNS)
    assert set((BUILD_ROOT / "runs").glob("noc-harness-3x3-icarus-results-*")) <= before
    json.dumps(out)


@pytest.mark.cosim
def test_bench_noc_command(tmp_path):
    """``rdakit bench noc`` on a 2x2 mesh (direct Verilator build of the harness): the JSON has
    the figures the issue asks for, the plot exists, the saturation is found."""
    require_simulator("verilator")
    out = tmp_path / "noc.json"
    plot = tmp_path / "noc.png"
    code = main(["bench", "noc", "--fabric", "2x2", "--queues", "voq", "--depth", "2",
                 "--warmup", "300", "--measure", "1000", "--refine", "1", "--no-area",
                 "--json", str(out), "--plot", str(plot)])
    assert code == 0
    report = json.loads(out.read_text())
    figures = report["figures"]
    assert figures["theoretical_limit"] == 1.0
    assert figures["delivery_errors"] == 0
    assert 0.5 < figures["saturation_throughput"] <= 1.0
    assert abs(figures["zero_load_latency"] - figures["zero_load_theory"]) < 0.35
    assert plot.stat().st_size > 1000
    assert set(report["tables"]) == {"latency_uniform_voq", "summary", "figures"}
    rows = report["tables"]["latency_uniform_voq"]
    assert any(r["saturated"] for r in rows) and not rows[0]["saturated"]


def test_bench_noc_rejects_bad_arguments(capsys):
    assert main(["bench", "noc", "--fabric", "3by3"]) == 2
    assert "--fabric must be ROWSxCOLS like 4x4, not '3by3'" in capsys.readouterr().err
    assert main(["bench", "noc", "--queues", "voq,vc"]) == 2
    assert "queues must be a comma-separated list" in capsys.readouterr().err
    assert main(["bench", "noc", "--hotspot", "9,9"]) == 2
    assert "hotspot must be X,Y inside the 4x4 mesh" in capsys.readouterr().err
