# amaranth: UnusedElaboratable=no
"""A stream between two CUs of a whole 2x2 fabric (routers, host port, bitstream loader) in
Amaranth's simulator: the two-stage pipeline of :mod:`rdakit.sim.verify.stream_jobs` through the
stream and through an MU buffer, bit-exact against numpy and the interpreter, every buffer
freed; the stream's run is the shorter. And a stream reading the input queue followed by one
whose MU reads the engine prefetches meanwhile (``stream_then_read``: it hung before the
engine counted only read responses as reads given back)."""

import numpy as np
import pytest

from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.host import AmaranthTransport, HostDriver
from rdakit.sim.runtime.job import run_job, run_job_interp
from rdakit.sim.verify.amaranth_sim import simulate
from rdakit.sim.verify.stream_jobs import stream_pipeline, stream_then_read

#: The fabric of tests/cosim/test_fabric_cosim.py's 2x2 (CUs at (0, 0), (1, 0), (0, 1)).
P = fabric_params(2, 2, layout="CC/CM", mu_words=4096)
ROWS = 32


@pytest.fixture(scope="module")
def results():
    jobs = {how: stream_pipeline(P, rows=ROWS, through_mu=how == "mu")
            for how in ("stream", "mu")}
    jobs["then_read"] = stream_then_read(P)
    fabric = Fabric(P)
    out = {}

    async def tb(ctx):
        host = HostDriver(P, AmaranthTransport(ctx, fabric))
        for how, job in jobs.items():
            out[how] = (job, await run_job(host, job, max_cycles=5000))

    simulate(fabric, tb)
    return out


@pytest.mark.parametrize("how", ["stream", "mu", "then_read"])
def test_pipeline_is_bit_exact_on_the_fabric(results, how):
    job, result = results[how]
    result.check(job)                     # numpy, every buffer freed
    outputs, res, _ = run_job_interp(job)
    assert res.ok
    np.testing.assert_array_equal(result.outputs["z"], outputs["z"])


def test_stream_is_faster_than_an_mu_buffer(results):
    assert results["stream"][1].cycles < 0.7 * results["mu"][1].cycles
