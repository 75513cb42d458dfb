# amaranth: UnusedElaboratable=no
"""A 2x2 fabric in Amaranth's simulator: programs written through the bitstream writer, loaded
through the host port, run, and checked bit-exactly against numpy and the interpreter."""

import numpy as np
import pytest

from rdakit.hdl.fabric.config_loader import LoadStatus
from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.spec.bitstream import write_bitstream
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.host import AmaranthTransport, HostDriver, HostError
from rdakit.sim.runtime.job import run_job, run_job_interp
from rdakit.sim.verify.amaranth_sim import simulate
from rdakit.sim.verify.kernels import matvec, moe_fanout, vector_add

P = fabric_params(2, 2, layout="CC/CM", mu_words=2048, prog_len=32)


def run_on_fabric(params, body):
    fabric = Fabric(params)
    out = {}

    async def tb(ctx):
        out["value"] = await body(HostDriver(params, AmaranthTransport(ctx, fabric)))

    simulate(fabric, tb)
    return out["value"]


@pytest.fixture(scope="module")
def results():
    """One simulation running every job in turn (elaborating a fabric takes seconds)."""
    jobs = {"matvec": matvec(P, m=16, k=32), "add": vector_add(P, n=16),
            "moe": moe_fanout(P, n=8)}

    async def body(host):
        out = {}
        for name, job in jobs.items():
            before = await host.counters()
            out[name] = (job, await run_job(host, job), before)
        return out

    return run_on_fabric(P, body)


@pytest.mark.parametrize("name", ["add", "moe", "matvec"])
def test_job_is_bit_exact_and_matches_the_interpreter(results, name):
    job, result, _ = results[name]
    result.check(job)
    interp_outputs, interp_result, _ = run_job_interp(job)
    assert interp_result.ok
    for out in job.outputs:
        np.testing.assert_array_equal(result.outputs[out], interp_outputs[out])
    assert result.status == {"configured": True, "running": False, "done": True,
                             "error": False, "load_error": False, "misrouted": False}


def test_moe_shared_buffer_freed_exactly_once(results):
    job, result, before = results["moe"]
    mu = job.buffers[0].mu
    after = result.counters[mu]
    # The host allocated 1 + consumers buffers in that MU before START; during the run (the
    # span run_job's counters cover) the producer allocated the shared one, and only the
    # shared one was freed.
    host_allocs = sum(b.mu == mu for b in job.buffers)
    assert after["allocs"] == 1
    assert after["frees"] == 1
    assert after["live_buffers"] - before[mu]["live_buffers"] == host_allocs


def test_counters_count_work(results):
    job, result, _ = results["matvec"]
    busy = [c["busy_cycles"] for xy, c in result.counters.items() if P.kind(*xy) == "C"]
    assert all(b > 0 for b in busy)
    assert result.counters[(1, 1)]["flits_in"] > 0 and result.counters[(1, 1)]["flits_out"] > 0
    assert 0 < result.cycles < 20 * job.macs // P.cu.lanes


def test_mu_peak_is_per_run(results):
    """PEAK_HELD_WORDS restarts at START: the vector add after the larger matrix-vector
    product reports its own peak, its three 16-word buffers (a, b and c filled)."""
    _, big, _ = results["matvec"]
    _, add, _ = results["add"]
    assert big.counters[(1, 1)]["peak_held_words"] > 48
    assert add.counters[(1, 1)]["peak_held_words"] == 3 * 16


def test_malformed_bitstream_leaves_the_fabric_unconfigured():
    good = write_bitstream(vector_add(P).bind({"a": 0, "b": 0, "c": 0}))
    bad = bytearray(good)
    bad[-1] ^= 0x40

    async def body(host):
        status, _ = await host.load(bytes(bad))
        st = await host.status()
        with pytest.raises(HostError, match="START refused"):
            await host.start()
        status_good, _ = await host.load(good)
        return status, st, status_good, await host.status()

    status, st, status_good, st_good = run_on_fabric(P, body)
    assert status is LoadStatus.PAYLOAD_CRC
    assert st["configured"] is False and st["load_error"] is True
    assert status_good is LoadStatus.OK and st_good["configured"] is True


def test_init_wrong_params():
    with pytest.raises(TypeError, match=r"^Params must be a FabricParams, not 3$"):
        Fabric(3)


@pytest.mark.slow
def test_matvec_64x64_over_three_cus():
    """The issue's size in Amaranth's simulator (the default suite runs 16x32 above and 64x64
    under cocotb)."""
    job = matvec(P, m=64, k=64)

    async def body(host):
        return await run_job(host, job, counters=False)

    run_on_fabric(P, body).check(job)
