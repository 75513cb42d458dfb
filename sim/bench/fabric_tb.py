"""cocotb side of ``rdakit bench fabric``: runs the benchmark jobs on a fabric's Verilog and
writes their figures to the JSON file named in the configuration (``out``)."""

import json

import cocotb

from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.host import cocotb_host
from rdakit.sim.runtime.job import run_job
from rdakit.sim.verify import kernels
from rdakit.sim.verify.cocotb_utils import tb_config


@cocotb.test()
async def bench(dut):
    cfg = tb_config()
    params = fabric_params(**cfg["fabric"])
    host = await cocotb_host(dut, params)
    rows = []
    for name, kwargs in cfg["jobs"]:
        job = getattr(kernels, name)(params, **kwargs)
        result = await run_job(host, job, counters=False)
        result.check(job)
        rows.append({"job": name, "description": job.description, "cycles": result.cycles,
                     "load_cycles": result.load_cycles, "macs": job.macs,
                     "cus_used": job.cus_used})
        dut._log.info("%s: %d cycles", job.description, result.cycles)
    with open(cfg["out"], "w") as f:
        json.dump(rows, f)
