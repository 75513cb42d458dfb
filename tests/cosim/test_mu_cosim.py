"""The memory unit's Verilog under cocotb, on Icarus and Verilator, against the golden model.

``RDAKIT_MU_OPS`` sets the number of random operations of the main configuration (default
100,000 per simulator); the other configurations run a tenth of it.
"""

import dataclasses
import os
import pathlib

import pytest

from rdakit.hdl.memory.unit import MemoryUnit
from rdakit.hdl.spec.params import MUParams
from rdakit.sim.verify.runner import SIMULATORS, require_simulator, run_cocotb

pytestmark = pytest.mark.cosim

HERE = pathlib.Path(__file__).parent
OPS = int(os.environ.get("RDAKIT_MU_OPS", "100000"))

# (name, params, mu_id, share of OPS)
CONFIGS = [
    ("virtual-weighted", MUParams(), 5, 1.0),
    ("virtual-counter", MUParams(refcount="counter", weight_bits=4), 0, 0.1),
    ("reserve-weighted", MUParams(alloc_mode="reserve", reserve_words=4, words=512), 1, 0.1),
    ("single-counter", MUParams(alloc_mode="single", refcount="counter", words=256,
                                max_buffers=4), 2, 0.1),
    ("virtual-small-blocks", MUParams(words=256, block_words=4, max_buffers=16, buf_id_bits=6,
                                      weight_bits=3, max_buffer_words=64), 3, 0.1),
]


def _params_dict(p):
    return {k: (v.value if hasattr(v, "value") else v)
            for k, v in dataclasses.asdict(p).items()}


@pytest.mark.parametrize("simulator", SIMULATORS)
@pytest.mark.parametrize("name,params,mu_id,share", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_memory_unit(simulator, name, params, mu_id, share):
    require_simulator(simulator)
    run_cocotb(MemoryUnit(params, mu_id=mu_id), simulator=simulator, test_module="mu_tb",
               test_dir=HERE, build_name=f"mu-{name}",
               config={"params": _params_dict(params), "mu_id": mu_id,
                       "ops": max(1000, int(OPS * share)), "seed": 1234})
