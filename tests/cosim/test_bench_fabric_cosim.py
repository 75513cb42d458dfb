"""``rdakit bench fabric`` on Verilator, driven directly (a harness executable, no cocotb): the
2x2 matrix-vector product bit-exact (the bench checks it against numpy) in the performance
model's cycles, which are the RTL's on this kernel, its traffic bound from the tiles'
counters, with the area table of a 2x2 (whose routers
have three ports: it once built a 3x3's inner router with a 2x2's coordinate bits and failed)."""

import asyncio
import json

from rdakit.cli import main
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.models.perf import ModelTransport
from rdakit.sim.runtime.host import HostDriver
from rdakit.sim.runtime.job import run_job
from rdakit.sim.verify import kernels
from rdakit.sim.verify.runner import require_simulator


def test_bench_fabric_on_a_2x2_runs_the_matvec_in_the_models_cycles(tmp_path):
    require_simulator("verilator")
    path = tmp_path / "fabric.json"
    assert main(["bench", "fabric", "--fabric", "2x2", "--quick", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    params = fabric_params(rows=2, cols=2, mu_words=2048)     # bench fabric's own MU size
    job = kernels.matvec(params, m=64, k=64)
    model = asyncio.run(run_job(HostDriver(params, ModelTransport(params)), job))
    model.check(job)
    figures = data["figures"]
    assert figures["matvec_cycles"] == model.cycles
    assert figures["matvec_lower_bound"] == 64 * 64 / (params.cu.lanes * 2)
    # Each CU's reads alone: x copied (16 words) and its 32 rows of W (16 words each); its
    # writes of y and its messages besides, as the model counts them.
    lanes = params.cu.lanes
    assert figures["matvec_traffic_bound"] > 64 // lanes + 32 * (64 // lanes)
    assert figures["matvec_traffic_bound"] == max(
        c["flits_in" if params.kind(*xy) == "M" else "flits_out"]
        for xy, c in model.counters.items())
    assert [r["unit"] for r in data["tables"]["area"]][-1] == "router (request network, 3 ports)"
