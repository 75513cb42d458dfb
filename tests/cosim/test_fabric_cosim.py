"""Whole fabrics under cocotb on Icarus and Verilator (2x2 and 4x4)."""

import pathlib

import pytest

from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.verify.runner import SIMULATORS, require_simulator, run_cocotb

pytestmark = pytest.mark.cosim

HERE = pathlib.Path(__file__).parent

FABRICS = {
    "2x2": (dict(rows=2, cols=2, layout="CC/CM", mu_words=4096),
            [("vector_add", {"n": 16}), ("matvec", {"m": 64, "k": 64}),
             ("moe_fanout", {"n": 8})]),
    "4x4": (dict(rows=4, cols=4, mu_words=2048, lanes=2),
            [("matvec", {"m": 64, "k": 64}), ("moe_fanout", {"n": 8}),
             ("vector_add", {"n": 16, "cu": (2, 2)})]),
}


@pytest.mark.parametrize("simulator", SIMULATORS)
@pytest.mark.parametrize("size", [
    "2x2",
    # A 4x4 fabric takes minutes to convert and build and about three to simulate per
    # simulator: run with -m slow.
    pytest.param("4x4", marks=pytest.mark.slow),
])
def test_fabric(simulator, size):
    require_simulator(simulator)
    fabric, jobs = FABRICS[size]
    run_cocotb(Fabric(fabric_params(**fabric)), simulator=simulator, test_module="fabric_tb",
               test_dir=HERE, build_name=f"fabric-{size}",
               config={"fabric": fabric, "jobs": [[name, kw] for name, kw in jobs]})
