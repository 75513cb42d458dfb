"""The performance model (``--sim model``, ``docs/performance-model.md``): bit-exact (its results
are the interpreter's), the RTL's counters and report keys, and cycles within 10 % of the RTL
(the comparisons with Amaranth's simulator are ``slow``)."""

import asyncio

import pytest

from rdakit.cli import main
from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.bench.e2e import WORKLOADS
from rdakit.sim.flows.e2e import PROFILE_CATEGORIES, SMALLEST, RunSpec, run
from rdakit.sim.models.perf import ModelTransport, Network
from rdakit.sim.runtime.host import AmaranthTransport, HostDriver
from rdakit.sim.runtime.job import run_job
from rdakit.sim.verify.amaranth_sim import simulate
from rdakit.sim.verify.kernels import matvec, vector_add

FABRIC_2X2 = {"rows": 2, "cols": 2, "prog_len": 2048}

#: The error the issue allows between the model's cycles and the RTL's.
TOLERANCE = 0.10

#: The report keys the model must give exactly as the RTL does (what it counts, not when).
EXACT = ("noc_flits", "mu_peak_words", "allocs", "frees", "leaked_buffers",
         "interpreter_stream_steps", "mu_bound", "injection_bound")


def _main_job(partitioner="multilevel"):
    """The README's main job: moe at its smallest sizes on 2x2."""
    return RunSpec("moe", SMALLEST["moe"], FABRIC_2X2, partitioner=partitioner)


@pytest.fixture(scope="module")
def model_row():
    return run(_main_job(), sim="model")[-1]


def test_model_is_bit_exact_and_reports_every_key(model_row):
    r = model_row
    assert r["hw_error"] is None
    assert r["numpy"] == "ok" and r["interpreter"] == "ok"
    assert r["leaked_buffers"] == 0 and r["allocs"] == r["frees"] > 0
    assert r["cycles"] >= max(r["lower_bound"], r["mu_bound"], r["injection_bound"])
    # The profile: every CU's categories sum to its busy cycles, the engine executed exactly
    # the interpreter's stream steps, and a CU is busy at most the run's cycles.
    profile = {p["tile"]: p for p in r["profile"]}
    for p in profile.values():
        cats = [p[c] for c in PROFILE_CATEGORIES]
        assert min(cats) >= 0 and sum(cats) == p["busy"]
    assert profile["total"]["step"] == r["interpreter_stream_steps"] > 0
    cus = [t for t in r["tiles"] if t["kind"] == "CU"]
    assert all(t["wait"] <= t["stall"] <= t["busy"] <= r["cycles"] for t in cus)


@pytest.fixture(scope="module")
def rtl_main_row():
    return run(_main_job(), sim="amaranth")[-1]


@pytest.mark.slow
def test_main_job_within_tolerance_of_the_rtl(model_row, rtl_main_row):
    """One Amaranth run of the main job (~17 s)."""
    r, m = rtl_main_row, model_row
    assert abs(m["cycles"] / r["cycles"] - 1) <= TOLERANCE, (m["cycles"], r["cycles"])
    for key in EXACT:
        assert m[key] == r[key], key
    assert [t["flits_out"] for t in m["tiles"]] == [t["flits_out"] for t in r["tiles"]]
    assert [p["step"] for p in m["profile"]] == [p["step"] for p in r["profile"]]


@pytest.mark.slow
@pytest.mark.parametrize("partitioner", ["multilevel", "round_robin"])
@pytest.mark.parametrize("workload", WORKLOADS)
def test_bench_e2e_workloads_within_tolerance_of_the_rtl(workload, partitioner):
    """Every ``bench e2e`` workload (2x2, two partitioners) on both: fails beyond 10 %."""
    spec = RunSpec(workload, SMALLEST[workload], FABRIC_2X2, partitioner=partitioner)
    r = run(spec, sim="amaranth")[-1]
    m = run(spec, sim="model")[-1]
    assert m["numpy"] == m["interpreter"] == "ok"
    assert abs(m["cycles"] / r["cycles"] - 1) <= TOLERANCE, (m["cycles"], r["cycles"])
    for key in EXACT:
        assert m[key] == r[key], key


#: Micro-jobs of the timing rules: one CU, one MU; a stream of n steps kept in the CU then
#: one appended to an MU (vector add), and a matrix-vector product.
MICRO_PARAMS = fabric_params(2, 2, prog_len=32)


def _micro_jobs():
    jobs = {f"add{n}": vector_add(MICRO_PARAMS, n=n) for n in (1, 4, 16, 32)}
    jobs["matvec"] = matvec(MICRO_PARAMS, m=8, k=16)
    return jobs


async def _cycles(host, jobs):
    return {name: (await run_job(host, job)).cycles for name, job in jobs.items()}


@pytest.mark.slow
def test_micro_jobs_within_tolerance_of_the_rtl():
    jobs = _micro_jobs()
    fabric = Fabric(MICRO_PARAMS)
    rtl = {}

    async def tb(ctx):
        rtl.update(await _cycles(HostDriver(MICRO_PARAMS, AmaranthTransport(ctx, fabric)), jobs))

    simulate(fabric, tb)
    model = asyncio.run(_cycles(HostDriver(MICRO_PARAMS, ModelTransport(MICRO_PARAMS)), jobs))
    for name in jobs:
        assert abs(model[name] / rtl[name] - 1) <= TOLERANCE, (name, model[name], rtl[name])


def test_an_mu_takes_one_request_a_cycle():
    """Two CUs' requests reaching one MU in the same cycle: the second is accepted a cycle
    later; a request of two execute cycles (ALLOC) holds the MU for both."""
    net = Network()
    a = net.request((0, 0), (1, 0), 10, 1)
    b = net.request((1, 1), (1, 0), 10, 1)
    assert b == a + 1
    net = Network()
    first = net.mu_accept((1, 0), 5, 2)
    assert (first, net.mu_accept((1, 0), 5, 1)) == (5, 7)


def test_a_link_takes_one_flit_a_cycle():
    """Two flits sent the same cycle over the same link: the second arrives a cycle later;
    each hop costs a cycle."""
    net = Network()
    one = net.send("req", (0, 0), (1, 0), 0)
    assert net.send("req", (0, 0), (1, 0), 0) == one + 1
    assert Network().send("req", (0, 0), (1, 1), 0) == one + 1


def test_waves_with_the_model_is_refused(tmp_path, capsys):
    path = tmp_path / "w.vcd"
    assert main(["run", "moe", "--sim", "model", "--waves", str(path), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"--waves {path} needs a simulation of the RTL" in err
    assert not path.exists()
