# amaranth: UnusedElaboratable=no
"""The performance model on streams between CUs (``docs/performance-model.md``): the micro-jobs
of :mod:`rdakit.sim.verify.stream_jobs` bit-exact on the model and within their tolerance of
the RTL's recorded cycles (the check of the record on Amaranth is ``slow``)."""

import asyncio

import pytest

from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.models.perf import ModelTransport
from rdakit.sim.runtime.host import AmaranthTransport, HostDriver
from rdakit.sim.runtime.job import run_job
from rdakit.sim.verify.amaranth_sim import simulate
from rdakit.sim.verify.stream_jobs import STREAM_MICRO_RTL, stream_micro_jobs

P = fabric_params(2, 2, layout="CC/CM", mu_words=4096)

#: Cycles the model may be off by: through an MU, the existing model's error (contention of
#: the two CUs' requests); a long stream, the order in which the producer's ejection port
#: takes read responses and credits.
TOLERANCE = {"sum48": 1}


async def _cycles(host, jobs):
    out = {}
    for name, job in jobs.items():
        result = await run_job(host, job)
        result.check(job)                       # numpy, every buffer freed
        out[name] = result.cycles
    return out


@pytest.fixture(scope="module")
def model():
    return asyncio.run(_cycles(HostDriver(P, ModelTransport(P)), stream_micro_jobs(P)))


def test_model_times_streams_between_cus(model):
    assert set(model) == set(STREAM_MICRO_RTL)
    off = {name: (model[name], rtl) for name, rtl in STREAM_MICRO_RTL.items()
           if abs(model[name] - rtl) > TOLERANCE.get(name, 0)}
    assert not off, off


@pytest.mark.slow
def test_recorded_cycles_are_the_rtls():
    fabric = Fabric(P)
    rtl = {}

    async def tb(ctx):
        rtl.update(await _cycles(HostDriver(P, AmaranthTransport(ctx, fabric)),
                                 stream_micro_jobs(P)))

    simulate(fabric, tb)
    assert rtl == STREAM_MICRO_RTL
