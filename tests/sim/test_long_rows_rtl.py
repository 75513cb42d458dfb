"""Rows longer than the local buffer on the RTL (issue 20): a top-k (and the take of its
indices), reductions over rows and a matmul whose K is longer than the local buffer, compiled
for one CU of an Amaranth 2x2 fabric with 16 local words, one shared run, bit-exact against
the graph's reference and the functional interpreter."""

import numpy as np
import pytest
from conftest import assert_rtl_matches_graph, assert_rtl_matches_interpreter

from rdakit.compiler.compile import compile_workload
from rdakit.hdl.spec.params import fabric_params
from tests.compiler.test_long_rows import long_graph

pytestmark = pytest.mark.slow

COLS = 4 * 17 - 1          # 17 words on 4 lanes, padding lanes in the last one


@pytest.fixture(scope="module")
def shared_run():
    from rdakit.sim.bench.calibrate import rtl_cycles

    g = long_graph(2, COLS, 3, 6)
    params = fabric_params(2, 2, layout="CM/MM", prog_len=2048, lanes=4, local_words=16,
                           mu_words=1024)
    job, _ = compile_workload(g, params=params, partitioner="round_robin", place_steps=20)
    x = np.random.default_rng(5).integers(-3, 3, (2, COLS)).astype(np.int32)
    x[0, [15, 16, 63, COLS - 1]] = np.iinfo(np.int32).max      # ties across words
    x[1, :] = np.iinfo(np.int32).min
    inputs = {"x": x}
    job = job.with_inputs(inputs)
    return g, inputs, job, rtl_cycles(job)              # checks every output against numpy


def test_long_rows_are_bit_exact_on_the_rtl(shared_run):
    g, inputs, job, result = shared_run
    assert_rtl_matches_graph(g, inputs, job, result)


def test_the_rtl_matches_the_interpreter(shared_run):
    _, _, job, result = shared_run
    assert_rtl_matches_interpreter(job, result)
