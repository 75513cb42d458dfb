"""cocotb test of a stream between two CUs on a whole fabric's Verilog: the two-stage
pipeline of :mod:`rdakit.sim.verify.stream_jobs` through the stream and through an MU buffer,
bit-exact against numpy and the interpreter."""

import cocotb
import numpy as np

from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.host import cocotb_host
from rdakit.sim.runtime.job import run_job, run_job_interp
from rdakit.sim.verify.cocotb_utils import tb_config
from rdakit.sim.verify.stream_jobs import stream_pipeline


@cocotb.test()
async def pipeline_bit_exact(dut):
    cfg = tb_config()
    params = fabric_params(**cfg["fabric"])
    host = await cocotb_host(dut, params)
    cycles = {}
    for through_mu in (False, True):
        job = stream_pipeline(params, rows=cfg["rows"], through_mu=through_mu)
        result = await run_job(host, job)
        result.check(job)
        golden, golden_result, _ = run_job_interp(job)
        assert golden_result.ok
        np.testing.assert_array_equal(result.outputs["z"], golden["z"])
        cycles[through_mu] = result.cycles
        dut._log.info("%s: %d cycles", job.description, result.cycles)
    assert cycles[False] < cycles[True]
