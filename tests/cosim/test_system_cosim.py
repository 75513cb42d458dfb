"""A system of two 1x3 clusters (CU, MU, CU) under cocotb on Icarus and Verilator."""

import pathlib

import pytest

from rdakit.hdl.cluster.system import System, SystemParams
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.verify.runner import SIMULATORS, require_simulator, run_cocotb

pytestmark = pytest.mark.cosim

HERE = pathlib.Path(__file__).parent

FABRIC = dict(rows=1, cols=3, layout="CMC", lanes=1, mu_words=256, max_buffers=8,
              prog_len=32, local_words=16, outstanding=4, cluster_bits=1)


@pytest.mark.parametrize("simulator", SIMULATORS)
def test_two_clusters(simulator):
    require_simulator(simulator)
    system = System(SystemParams(fabric_params(**FABRIC), clusters=2, link_latency=20))
    run_cocotb(system, simulator=simulator, test_module="system_tb", test_dir=HERE,
               build_name="system-2x1x3",
               config={"fabric": FABRIC, "clusters": 2, "rounds": 3, "increments": 4,
                       "m": 8, "k": 16})


#: Two 2x2 clusters for compiled programs (one lane and 128 instructions keep the build
#: small; the MLP needs 51): coordinates for the 4 columns side by side.
COMPILED = dict(rows=2, cols=2, lanes=1, prog_len=128, cluster_bits=1, coord_bits=2)


@pytest.mark.parametrize("simulator", SIMULATORS)
def test_compiled_workload_across_two_clusters(simulator):
    """The smallest MLP compiled across two 2x2 clusters (round-robin across clusters, so
    tokens and references cross the links) runs bit-exact against numpy."""
    from rdakit.sim.flows.e2e import SMALLEST

    require_simulator(simulator)
    system = System(SystemParams(fabric_params(**COMPILED), clusters=2, link_latency=20))
    run_cocotb(system, simulator=simulator, test_module="system_compiled_tb", test_dir=HERE,
               build_name="system-2x2x2-l1",
               config={"fabric": COMPILED, "link_latency": 20, "workload": "mlp",
                       "sizes": SMALLEST["mlp"], "strategy": "round_robin"})


def test_system_verilog_passes_verilator_lint_wall(tmp_path):
    import os
    import subprocess

    from rdakit.cli import main

    info = require_simulator("verilator")
    out = tmp_path / "system.v"
    assert main(["verilog", "system", "--clusters", "2", "--fabric", "1x2",
                 "--lanes", "1", "-o", str(out)]) == 0
    r = subprocess.run([info.path, "--lint-only", "-Wall", "--top-module", "top", str(out)],
                       capture_output=True, text=True, env={**os.environ, **info.env},
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
