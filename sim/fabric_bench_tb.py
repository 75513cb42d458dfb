"""cocotb side of ``rdakit bench fabric``: runs the benchmark jobs on a fabric's Verilog and
writes their figures to the JSON file named in the configuration (``out``)."""

import json

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

from rdakit.fabric_args import fabric_params
from rdakit.sim import kernels
from rdakit.sim.cocotb_utils import tb_config
from rdakit.sim.host import CocotbTransport, HostDriver


@cocotb.test()
async def bench(dut):
    cfg = tb_config()
    params = fabric_params(**cfg["fabric"])
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.cmd__valid.value = 0
    dut.reply__ready.value = 0
    dut.rst.value = 1
    for _ in range(3):
        await RisingEdge(dut.clk)
    dut.rst.value = 0
    await RisingEdge(dut.clk)
    host = HostDriver(params, CocotbTransport(dut))
    rows = []
    for name, kwargs in cfg["jobs"]:
        job = getattr(kernels, name)(params, **kwargs)
        result = await kernels.run_job(host, job, counters=False)
        result.check(job)
        rows.append({"job": name, "description": job.description, "cycles": result.cycles,
                     "load_cycles": result.load_cycles, "macs": job.macs,
                     "cus_used": job.cus_used})
        dut._log.info("%s: %d cycles", job.description, result.cycles)
    with open(cfg["out"], "w") as f:
        json.dump(rows, f)
