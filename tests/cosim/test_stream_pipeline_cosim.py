"""A stream between two CUs on the 2x2 fabric's Verilog under Icarus (the build of
test_fabric_cosim.py's 2x2, shared through the build cache)."""

import pathlib

import pytest
from test_fabric_cosim import FABRICS

from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.verify.runner import require_simulator, run_cocotb

pytestmark = pytest.mark.cosim

HERE = pathlib.Path(__file__).parent


@pytest.mark.slow   # 44 s with the build cached on a loaded 2-core machine (52 s building)
def test_stream_pipeline_on_icarus():
    require_simulator("icarus")
    fabric, _ = FABRICS["2x2"]
    run_cocotb(Fabric(fabric_params(**fabric)), simulator="icarus",
               test_module="stream_pipeline_tb", test_dir=HERE, build_name="fabric-2x2",
               config={"fabric": fabric, "rows": 16})
