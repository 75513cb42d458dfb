"""A compiled job with streams between CUs (issue 18) on the RTL fabric in Amaranth's simulator
(2x2, two CUs, queues of 4 words for tensors of 8: the producers wait for credits), one shared
run: every output bit-exact against the graph's reference and the functional interpreter,
every buffer but the outputs freed."""

import numpy as np
import pytest

from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.job import run_job_interp
from tests.compiler.test_lower_streams import X, chain, lowered, queue_streams, with_queue

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared_run():
    from rdakit.sim.bench.calibrate import rtl_cycles

    g, parts = chain()
    params = with_queue(fabric_params(2, 2, prog_len=512), 4)
    job = lowered(g, parts, params)
    return g, job, rtl_cycles(job)             # checks every output against numpy


def test_the_job_streams(shared_run):
    _, job, _ = shared_run
    sends, reads = queue_streams(job)
    assert len(sends) == 2 and len(reads) == 2


def test_streams_are_bit_exact_on_the_rtl(shared_run):
    g, job, result = shared_run
    got = job.decode(result.outputs, check_padding=True)
    want = g.evaluate(X)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_the_rtl_matches_the_interpreter(shared_run):
    _, job, result = shared_run
    outputs, run, _ = run_job_interp(job)
    assert run.ok and not result.status["error"] and result.cycles > 0
    for out in job.outputs:
        np.testing.assert_array_equal(result.outputs[out], outputs[out], err_msg=out)
