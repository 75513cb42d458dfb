"""Integer sigmoid and tanh compiled onto the RTL fabric and run in Amaranth's simulator (2x2,
one CU), one shared run: every output (a static input with padding lanes, and a dynamic input
with fewer rows than its bound) bit-exact against the graph's reference and the functional
interpreter."""

import pytest
from conftest import assert_rtl_matches_graph, assert_rtl_matches_interpreter

from rdakit.compiler.compile import compile_workload
from rdakit.hdl.spec.params import fabric_params
from tests.compiler.test_intops import intops_inputs
from tests.compiler.test_intops_logistic import logistic_graph

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared_run():
    from rdakit.sim.bench.calibrate import rtl_cycles

    g = logistic_graph(2, 5, "int8")
    params = fabric_params(2, 2, layout="CM/MM", prog_len=2048, lanes=4, local_words=64,
                           mu_words=1024)
    job, _ = compile_workload(g, params=params, partitioner="round_robin", place_steps=20)
    inputs = intops_inputs(g, 3, dynamic_rows=2)
    job = job.with_inputs(inputs)
    return g, inputs, job, rtl_cycles(job)             # checks every output against numpy


def test_sigmoid_and_tanh_are_bit_exact_on_the_rtl(shared_run):
    g, inputs, job, result = shared_run
    assert_rtl_matches_graph(g, inputs, job, result)


def test_the_rtl_matches_the_interpreter(shared_run):
    _, _, job, result = shared_run
    assert_rtl_matches_interpreter(job, result)
