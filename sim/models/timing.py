"""The timing constants of the performance model (:mod:`rdakit.sim.models.perf`), in one place.

Every constant is a pipeline depth or latency of the RTL, in cycles, named for the register or
stage it stands for; the values are those of the RTL at the commit ``docs/performance-model.md``
names, measured with Amaranth's simulator (the micro-tests of ``tests/sim/test_perf_model.py``
pin them). A change of the RTL's pipelines is a change here, nowhere else. Depths the RTL
exports are imported, not copied (:data:`~rdakit.hdl.compute.stream.WQ_DEPTH`,
:data:`~rdakit.hdl.compute.stream.EXEC_STAGES`, ``CUParams.outstanding``).
"""

import dataclasses

from rdakit.hdl.spec.cu import EXEC_STAGES, WQ_DEPTH

__all__ = ["Timing", "TIMING", "WQ_DEPTH"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """Latencies of the fabric's pipelines (cycles).

    Members
    -------
    inject : int
        From the cycle a CU's request register (or message register, or an MU's response)
        takes a flit to the cycle it crosses its first link: the register, then the source
        router's queue.
    host_merge : int
        The extra cycle of a request injected at tile (0, 0), whose request port the host
        shares through a registered ``Merge`` (``hdl/fabric/top.py``).
    hop : int
        Per router-to-router link (one cycle a hop, ``docs/noc.md``).
    eject : int
        From the last link to the cycle the flit is offered on the destination's port (the
        destination router's queue and the ejection buffer).
    mu_response : int
        From the cycle an MU accepts a request to the cycle its response leaves, beyond the
        request's execute cycles (``MUModel.exec_cycles``).
    capture : int
        From a response on a CU's ``msg_in`` to the cycle the sequencer can use it (the
        response register: a blocking instruction retires then, a non-blocking one's register
        is written then and read the cycle after).
    fifo : int
        From a stream read's response on ``msg_in`` to the first cycle S0 can pop it (the
        response FIFO, ``SyncFIFOBuffered``: its memory, then its output register); the same
        for a word another CU's stream sent into the input queue (the same kind of FIFO).
    exec_stages : int
        Cycles from S0 popping a step to its result being delivered (the RTL's
        :data:`~rdakit.hdl.compute.stream.EXEC_STAGES`: S1 and S2); the engine is done
        ``exec_stages + 1`` cycles after the last pop at the earliest.
    write_queue : int
        From the last execute stage delivering a result to the write queue to the first cycle
        the write can take the request register.
    start_issue : int
        From SRUN handing a stream to an idle engine to the cycle the engine offers its first
        READ.
    token : int
        From a token or reference on ``msg_in`` to the cycle WAIT or RECV can take it.
    credit : int
        From credits on ``msg_in`` to the cycle the producer's engine can spend them (its
        credit counter).
    run_start : int
        From the host's START to the cycle the CUs execute their first instruction.
    run_end : int
        From the cycle the last CU halts to the end of the run the host's CYCLES counts.
    """

    inject: int = 1
    host_merge: int = 1
    hop: int = 1
    eject: int = 2
    mu_response: int = 1
    capture: int = 1
    fifo: int = 2
    exec_stages: int = EXEC_STAGES
    write_queue: int = 2
    start_issue: int = 1
    token: int = 1
    credit: int = 1
    run_start: int = 1
    run_end: int = 1


#: The RTL's timing (the calibration of ``docs/performance-model.md``).
TIMING = Timing()
