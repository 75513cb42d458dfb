"""cocotb side of ``rdakit bench fabric``: runs the benchmark jobs on a fabric's Verilog and
writes their figures to the JSON file named in the configuration (``out``)."""

import json

import cocotb

from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.bench.fabric import run_kernels
from rdakit.sim.runtime.host import cocotb_host
from rdakit.sim.verify.cocotb_utils import tb_config


@cocotb.test()
async def bench(dut):
    cfg = tb_config()
    params = fabric_params(**cfg["fabric"])
    host = await cocotb_host(dut, params)
    rows = await run_kernels(host, params, cfg["jobs"], log=dut._log.info)
    with open(cfg["out"], "w") as f:
        json.dump(rows, f)
