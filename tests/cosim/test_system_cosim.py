"""A system of two 1x3 clusters (CU, MU, CU) under cocotb on Icarus and Verilator."""

import pathlib

import pytest

from rdakit.fabric_args import fabric_params
from rdakit.hdl.system import System, SystemParams
from rdakit.sim.runner import SIMULATORS, require_simulator, run_cocotb

pytestmark = pytest.mark.cosim

HERE = pathlib.Path(__file__).parent

FABRIC = dict(rows=1, cols=3, layout="CMC", lanes=2, mu_words=256, max_buffers=4,
              prog_len=32, local_words=16, outstanding=4, cluster_bits=1)


@pytest.mark.parametrize("simulator", SIMULATORS)
def test_two_clusters(simulator):
    require_simulator(simulator)
    system = System(SystemParams(fabric_params(**FABRIC), clusters=2, link_latency=20))
    run_cocotb(system, simulator=simulator, test_module="system_tb", test_dir=HERE,
               build_name="system-2x1x3",
               config={"fabric": FABRIC, "clusters": 2, "rounds": 3, "increments": 4})
