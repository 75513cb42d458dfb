"""Compiled jobs with streams between CUs (issue 18) on the RTL fabric in Amaranth's simulator,
queues of 4 words for tensors of 8 (the producers wait for credits), one shared run each: a
chain over two CUs, one streaming twice into the other, and two producers streaming into one
CU; in both the second stream into a CU waits for the consumer's token, sent once its stream
has read the first. Every
output bit-exact against the graph's reference and the functional interpreter."""

import pytest
from conftest import assert_rtl_matches_graph, assert_rtl_matches_interpreter

from rdakit.hdl.spec.params import fabric_params
from tests.compiler.test_lower_streams import (
    X,
    chain,
    lowered,
    queue_streams,
    two_producers,
    with_queue,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["chain", "two_producers"])
def shared_run(request):
    from rdakit.sim.bench.calibrate import rtl_cycles

    if request.param == "chain":
        g, parts = chain()
        params = with_queue(fabric_params(2, 2, prog_len=512), 4)
    else:
        g, parts = two_producers(interleaved=True)
        params = with_queue(fabric_params(2, 2, layout="CC/CM", prog_len=512), 4)
    job = lowered(g, parts, params)
    return g, job, rtl_cycles(job)             # checks every output against numpy


def test_the_job_streams(shared_run):
    _, job, _ = shared_run
    sends, reads = queue_streams(job)
    # the chain: CU 0 into CU 1 twice; two producers: both into one CU; both in turn
    assert len(sends) == 2 and len(reads) == 1


def test_streams_are_bit_exact_on_the_rtl(shared_run):
    g, job, result = shared_run
    assert_rtl_matches_graph(g, X, job, result)


def test_the_rtl_matches_the_interpreter(shared_run):
    _, job, result = shared_run
    assert_rtl_matches_interpreter(job, result)
