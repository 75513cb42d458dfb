"""A 1x2 fabric behind the UART host bridge under cocotb on Icarus and Verilator."""

import pathlib

import pytest

from rdakit.hdl.host.bridge import BridgedFabric
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.verify.runner import SIMULATORS, require_simulator, run_cocotb

pytestmark = pytest.mark.cosim

HERE = pathlib.Path(__file__).parent
FABRIC = dict(rows=1, cols=2, lanes=1, prog_len=16, local_words=16, mu_words=256, max_buffers=4)
DIVISOR = 4


# About a minute a simulator (80k cycles, mostly bits on the serial line); the default suite
# runs the same end-to-end test in Amaranth's simulator (tests/hdl/test_host_bridge.py).
@pytest.mark.slow
@pytest.mark.parametrize("simulator", SIMULATORS)
def test_bridge(simulator):
    require_simulator(simulator)
    top = BridgedFabric(fabric_params(**FABRIC), divisor=DIVISOR, timeout=40 * DIVISOR)
    run_cocotb(top, simulator=simulator, test_module="bridge_tb", test_dir=HERE,
               build_name="bridge-1x2",
               config={"fabric": FABRIC, "divisor": DIVISOR, "host_timeout": 120 * DIVISOR})
