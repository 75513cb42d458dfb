"""cocotb side of ``rdakit run`` and ``rdakit bench e2e`` on Icarus and Verilator: runs the
sessions of the configuration's :class:`~rdakit.sim.flows.e2e.RunSpec` list one after the other on
the fabric's Verilog and writes their iteration rows to the JSON file named ``out``."""

import json

import cocotb

from rdakit.sim.flows.e2e import FileProgress, RunSpec, run_specs
from rdakit.sim.runtime.host import cocotb_host
from rdakit.sim.verify.cocotb_utils import tb_config


@cocotb.test()
async def run(dut):
    cfg = tb_config()
    specs = [RunSpec.from_dict(s) for s in cfg["specs"]]
    host = await cocotb_host(dut, specs[0].params)
    rows = await run_specs(host, specs, progress=FileProgress(cfg["progress"]))
    with open(cfg["out"], "w") as f:
        json.dump(rows, f, default=lambda v: v.item() if hasattr(v, "item") else str(v))
