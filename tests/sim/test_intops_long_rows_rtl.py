"""The chunked lowering of the row-wise integer ops (layer_norm, rms_norm, softmax plain,
causal and on a dynamic input) on rows longer than the local buffer, compiled onto the RTL
fabric and run in Amaranth's simulator: every output bit-exact against the graph's reference
and the functional interpreter."""

import numpy as np
import pytest

from rdakit.compiler.compile import compile_workload
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.job import run_job_interp
from tests.compiler.test_intops import intops_inputs, long_row_graph

# One CU. Rows of 38 elements on 4 lanes (10 words, padding lanes in the last) with 16 local
# words: the norms take the chunked form in one chunk, softmax in two chunks of 5 words.
#: About 6,300 cycles of a 2x2 fabric, 17 s.
pytestmark = pytest.mark.slow

PARAMS = fabric_params(2, 2, layout="CM/MM", prog_len=2048, lanes=4, local_words=16,
                       mu_words=1024)


@pytest.fixture(scope="module")
def shared_run():
    from rdakit.sim.bench.calibrate import rtl_cycles

    g = long_row_graph(2, 38, "int8", ["ln", "rms", "sm", "smc", "smd"], seed=3)
    job, _ = compile_workload(g, params=PARAMS, partitioner="round_robin", place_steps=20)
    inputs = intops_inputs(g, 3, dynamic_rows=2)
    job = job.with_inputs(inputs)
    return g, inputs, job, rtl_cycles(job)             # checks every output against numpy


def test_long_rows_are_bit_exact_on_the_rtl(shared_run):
    g, inputs, job, result = shared_run
    got = job.decode(result.outputs, check_padding=True)
    want = g.evaluate(inputs)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_long_rows_on_the_rtl_match_the_interpreter(shared_run):
    _, _, job, result = shared_run
    outputs, run, _ = run_job_interp(job)
    assert run.ok and not result.status["error"] and result.cycles > 0
    for out in job.outputs:
        np.testing.assert_array_equal(result.outputs[out], outputs[out], err_msg=out)
