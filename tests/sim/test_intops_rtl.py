"""The integer non-linear ops compiled onto the RTL fabric and run in Amaranth's simulator, one
shared run per case, every output bit-exact against the graph's reference and the functional
interpreter:

* ``ops``: every kind (exp, softmax causal and not, GELU, SiLU, LayerNorm, RMSNorm, embedding)
  in its row form;
* ``long_rows``: the chunked lowering of the row-wise kinds (layer_norm, rms_norm, softmax plain,
  causal and on a dynamic input) on rows longer than the local buffer.
"""

import pytest
from conftest import assert_rtl_matches_graph, assert_rtl_matches_interpreter

from rdakit.compiler.compile import compile_workload
from rdakit.hdl.spec.params import fabric_params
from tests.compiler.test_intops import intops_graph, intops_inputs, long_row_graph

#: The shared runs take 15-40 s (about 20,000 cycles of a 2x2 fabric) and 17 s (about 6,300
#: cycles): long runs.
pytestmark = pytest.mark.slow


def _fabric(local_words):
    # One CU (the others are MUs), so every op's program runs on one tile.
    return fabric_params(2, 2, layout="CM/MM", prog_len=2048, lanes=4, local_words=local_words,
                         mu_words=1024)


CASES = {
    # 2 rows of 5 columns on 4 lanes leave padding lanes in every row.
    "ops": (lambda: intops_graph(2, 5, "int8", seed=3, vocab=4, ids=3), _fabric(64)),
    # Rows of 38 elements on 4 lanes (10 words, padding lanes in the last) with 16 local words:
    # the norms take the chunked form in one chunk, softmax in two chunks of 5 words.
    "long_rows": (lambda: long_row_graph(2, 38, "int8", ["ln", "rms", "sm", "smc", "smd"],
                                         seed=3), _fabric(16)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def shared_run(request):
    from rdakit.sim.bench.calibrate import rtl_cycles

    make_graph, params = CASES[request.param]
    g = make_graph()
    job, _ = compile_workload(g, params=params, partitioner="round_robin", place_steps=20)
    inputs = intops_inputs(g, 3, dynamic_rows=2)
    job = job.with_inputs(inputs)
    return g, inputs, job, rtl_cycles(job)             # checks every output against numpy


def test_every_op_is_bit_exact_on_the_rtl(shared_run):
    g, inputs, job, result = shared_run
    assert_rtl_matches_graph(g, inputs, job, result)


def test_the_rtl_matches_the_interpreter(shared_run):
    _, _, job, result = shared_run
    assert_rtl_matches_interpreter(job, result)
