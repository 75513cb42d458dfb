"""The lowering receives an op's remote inputs before ALLOCating its output when the MU it would
use has no room otherwise: the ALLOC then knows the buffers the producers freed before sending.
Where the MU has room anyway the ALLOC goes first (its answer comes while the CU waits), and
either order gives the same outputs under any interleaving."""

import numpy as np
import pytest

from rdakit.compiler.compile import compile_workload, placement_fabric
from rdakit.compiler.graph import DataflowGraph
from rdakit.compiler.lower import lower
from rdakit.compiler.lower.lowerer import Lowerer
from rdakit.compiler.placement import place
from rdakit.hdl.spec.isa import Op
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.job import run_job_interp


def chain(n=4):
    """x + c on CU 0, >> 1 on CU 1, alternating: each op reads the one before from the other
    CU; the constant's pool stays on CU 0 to the end."""
    g = DataflowGraph("chain")
    x = g.input("x", (4, 8), "int32")
    c = g.const("c", np.arange(8, dtype=np.int32))
    parts = {"x": 0, "c": 0}
    for i in range(n):
        x = g.add("add", x, c, name=f"r{i}") if i % 2 == 0 else \
            g.add("shr", x, name=f"r{i}", shift=1)
        parts[f"r{i}"] = i % 2
    g.output("y", x)
    parts["y"] = (n - 1) % 2
    return g.validate(), parts


X = {"x": np.arange(-16, 16, dtype=np.int32).reshape(4, 8)}


def lowered(max_buffers):
    g, parts = chain()
    params = fabric_params(2, 2, prog_len=512, max_buffers=max_buffers)
    return lower(g, parts, place(g, parts, placement_fabric(params), steps=0), params,
                 inputs=X)


def first(job, cu, op):
    return next(i for i, ins in enumerate(job.config.tiles[cu].program) if ins.op is op)


def check_runs(job, inputs, seeds=3):
    """Bit-exact against the graph on ``inputs`` under the round-robin and ``seeds`` random
    interleavings, every buffer but the outputs freed."""
    want = job.graph.evaluate(inputs)
    for schedule, seed in [("round_robin", 0)] + [("random", s) for s in range(seeds)]:
        outputs, result, interp = run_job_interp(job, schedule=schedule, seed=seed)
        assert result.ok, result.errors
        got = job.decode(outputs, check_padding=True)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        live = sum(len(interp.mu(*m).live_buffers()) for m in job.params.tiles("M"))
        assert live == len(job.outputs)


def test_receive_first_when_the_mu_is_full():
    # Two buffer slots an MU: y, the pool of CU 0 and x (until CU 0 has read it) take three of
    # the four. r1 fits only once CU 1 knows that CU 0 freed x before sending r0; ALLOCated
    # before the RECV it counted x live ("fits in no MU ... 0 buffer slots free").
    job = lowered(max_buffers=2)
    assert first(job, (1, 1), Op.RECV) < first(job, (1, 1), Op.ALLOC)
    check_runs(job, X)


def test_alloc_first_when_the_mu_has_room():
    # With room, CU 1's ALLOC goes before its RECV: the MU answers while it waits for r0.
    job = lowered(max_buffers=16)
    assert first(job, (1, 1), Op.ALLOC) < first(job, (1, 1), Op.RECV)
    check_runs(job, X)


@pytest.mark.parametrize("name,grid,partitioner,sizes", [
    # combine reads its 8 experts from other CUs: more references than the registers hold
    ("mixtral", (4, 4), "round_robin", dict(tokens=8, d_model=8, d_ff=12)),
    ("decoder", (2, 2), "greedy", dict(d_model=16, heads=2, d_ff=24, cache_len=3))])
def test_receiving_first_everywhere_gives_the_same_outputs(monkeypatch, name, grid,
                                                           partitioner, sizes):
    monkeypatch.setattr(Lowerer, "fits_first", lambda self, g, t: False)
    params = fabric_params(*grid, prog_len=2048)
    job = compile_workload(name, sizes=sizes, params=params,
                           partitioner=partitioner, place_steps=300)[0]
    check_runs(job, job.workload.inputs)


def test_more_remote_inputs_than_reference_registers(monkeypatch):
    # Received first, a concatenation of 9 tensors from the other CU takes the first of them
    # before its ALLOC as the registers allow beside its output (6 of 7), the rest as its
    # template reaches them (all 9 pinned at once: "an op needs more than 7 references").
    monkeypatch.setattr(Lowerer, "fits_first", lambda self, g, t: False)
    g = DataflowGraph("wide")
    x = g.input("x", (4, 8), "int32")
    parts = {"x": 0, "cat": 1, "y": 1}
    parts.update({f"a{i}": 0 for i in range(9)})
    cat = g.add("concat", *[g.add("shr", x, name=f"a{i}", shift=i) for i in range(9)],
                name="cat", axis=0)
    g.output("y", g.add("relu", cat, name="r"))
    parts.update(r=1)
    g.validate()
    params = fabric_params(2, 2, prog_len=512)
    job = lower(g, parts, place(g, parts, placement_fabric(params), steps=0), params, inputs=X)
    program = job.config.tiles[(1, 1)].program
    a, b = next((a, b) for name, _, _, a, b in job.programs[(1, 1)].ops if name == "cat")
    ops = [ins.op for ins in program[a:b]]
    assert ops.count(Op.RECV) == 9 and ops[:ops.index(Op.ALLOC)].count(Op.RECV) == 6
    check_runs(job, X)
