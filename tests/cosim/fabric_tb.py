"""cocotb tests of a whole fabric's Verilog: jobs loaded through the host port, checked
bit-exactly against numpy and against the functional interpreter."""

import cocotb
import numpy as np

from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.host import cocotb_host
from rdakit.sim.runtime.job import run_job, run_job_interp
from rdakit.sim.verify import kernels
from rdakit.sim.verify.cocotb_utils import tb_config


async def setup(dut):
    cfg = tb_config()
    params = fabric_params(**cfg["fabric"])
    return cfg, params, await cocotb_host(dut, params)


def build(params, spec):
    name, kwargs = spec
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    return getattr(kernels, name)(params, **kwargs)


@cocotb.test()
async def jobs_bit_exact(dut):
    """Every job of the configuration, one after the other on one fabric."""
    cfg, params, host = await setup(dut)
    for spec in cfg["jobs"]:
        job = build(params, spec)
        result = await run_job(host, job)
        result.check(job)
        golden, golden_result, _ = run_job_interp(job)
        assert golden_result.ok
        for out in job.outputs:
            np.testing.assert_array_equal(result.outputs[out], golden[out])
        assert not result.status["error"] and not result.status["misrouted"]
        if spec[0] == "moe_fanout":
            mu = job.buffers[0].mu
            assert result.counters[mu]["frees"] == 1     # counted from START
        dut._log.info("%s: %d cycles (load %d)", job.description, result.cycles,
                      result.load_cycles)


@cocotb.test()
async def corrupted_bitstream_is_refused(dut):
    """A payload CRC error: the loader reports it and START is refused."""
    from rdakit.hdl.fabric.config_loader import LoadStatus
    from rdakit.hdl.spec.bitstream import write_bitstream
    from rdakit.sim.runtime.host import HostError

    cfg, params, host = await setup(dut)
    job = kernels.vector_add(params, n=4)
    data = bytearray(write_bitstream(job.bind({b.name: 0 for b in job.buffers})))
    data[-2] ^= 1
    status, _ = await host.load(bytes(data))
    assert status is LoadStatus.PAYLOAD_CRC
    try:
        await host.start()
    except HostError:
        pass
    else:
        raise AssertionError("START was accepted after a corrupted load")
    assert not (await host.status())["configured"]
