"""The kernel jobs on the functional interpreter: bit-exact against numpy, on 2x2 and 4x4."""

import numpy as np
import pytest

from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.job import run_job_interp
from rdakit.sim.verify.kernels import matmul, matvec, moe_fanout, vector_add

P2 = fabric_params(2, 2, layout="CC/CM", mu_words=4096)
P4 = fabric_params(4, 4, mu_words=2048)


@pytest.mark.parametrize("params,build", [
    (P2, lambda p: vector_add(p)),
    (P2, lambda p: matvec(p)),
    (P2, lambda p: matmul(p, m=16, k=16, n=8)),
    (P2, lambda p: moe_fanout(p)),
    (P4, lambda p: matvec(p)),
    (P4, lambda p: moe_fanout(p)),
], ids=["add-2x2", "matvec-2x2", "matmul-2x2", "moe-2x2", "matvec-4x4", "moe-4x4"])
def test_kernel_is_bit_exact(params, build):
    job = build(params)
    outputs, result, _ = run_job_interp(job)
    assert result.ok, result
    for name, want in job.expected.items():
        np.testing.assert_array_equal(outputs[name], want)


def test_matvec_uses_every_cu():
    job = matvec(P4)
    assert job.cus_used == len(P4.tiles("C")) and job.macs == 64 * 64


@pytest.mark.parametrize("seed", range(5))
def test_moe_shared_buffer_freed_exactly_once_in_any_order(seed):
    job = moe_fanout(P4)
    outputs, result, interp = run_job_interp(job, schedule="random", seed=seed)
    mu = interp.mu(*job.buffers[0].mu)
    assert mu.frees == 1 and mu.allocs == sum(b.mu == job.buffers[0].mu for b in job.buffers) + 1
    for name, want in job.expected.items():
        np.testing.assert_array_equal(outputs[name], want)


def test_bind_puts_each_buffer_reference_in_its_register():
    job = matvec(P4)
    refs = {b.name: 100 + i for i, b in enumerate(job.buffers)}
    bound = job.bind(refs)
    for xy, tile in bound.tiles.items():
        assert all(isinstance(v, int) for v in tile.regs.values())
        assert tile.regs[1] == refs[job.config.tiles[xy].regs[1].name]


def test_kernel_rejects_sizes_it_cannot_hold():
    with pytest.raises(ValueError, match=r"^k / lanes must be at most local_words \(64\), "
                                         r"not 128$"):
        matvec(P2, m=8, k=512)
    with pytest.raises(ValueError, match=r"^m and k must be multiples of lanes \(4\)"):
        matvec(P2, m=6, k=8)
