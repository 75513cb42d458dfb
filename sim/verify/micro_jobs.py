"""Micro-jobs of the performance model's timing rules (``docs/performance-model.md``): small
hand-written programs on a 2x2 fabric, each exercising one rule of the sequencer, the stream
engine, the MU or the NoC, run on the RTL and on the model by ``tests/sim/test_perf_model.py``.

Every job runs on CU (0, 0) (and CU (1, 1) where two CUs meet) with its buffers in MU (1, 0):
``a`` and ``b`` hold 16 words, ``c`` is empty, ``d`` (MU (0, 1)) is empty."""

import numpy as np

from rdakit.compiler.job import HostBuffer, Job, Ref
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.isa import BMode, DMode, assemble
from rdakit.hdl.spec.params import fabric_params

__all__ = ["MICRO_PARAMS", "MICRO4_PARAMS", "micro_jobs", "micro4_jobs"]

#: The fabric of the micro-jobs.
MICRO_PARAMS = fabric_params(2, 2, prog_len=32)

#: The fabric of the four-CU micro-jobs (``rdakit bench memory``'s: four CUs, two MUs).
MICRO4_PARAMS = fabric_params(2, 3, layout="CCM/CCM", prog_len=32)

_CU0, _CU1 = (0, 0), (1, 1)
_MU0, _MU1 = (1, 0), (0, 1)
_REGS = {1: Ref("a"), 2: Ref("b"), 3: Ref("c"), 4: Ref("d")}


def _stream(a, n, d_mode, *, d_ref=None, fn="PASS", b_mode=BMode.ZERO, b_val=0, outer=1,
            d_base=0, rd="r0"):
    """The instructions of one stream reading ``n`` x ``outer`` words of register ``a``."""
    lines = [f"SCFG A_REF, {a}", "SCFGI A_STRIDE, 1", f"SCFGI N, {n}", f"SCFGI OUTER, {outer}",
             f"SCFGI A_OSTRIDE, {n}", f"SCFGI B_MODE, {b_mode.value}",
             f"SCFGI B_VAL, {b_val}", "SCFGI B_STRIDE, 1", f"SCFGI D_MODE, {d_mode.value}",
             "SCFGI D_STRIDE, 1", f"SCFGI D_BASE, {d_base}"]
    if d_ref:
        lines.append(f"SCFG D_REF, {d_ref}")
    return [*lines, f"SRUN {fn}, {rd}"]


def _job(name, programs, params=MICRO_PARAMS, mus=(_MU0, _MU1)):
    lanes = params.cu.lanes
    rng = np.random.default_rng(len(name))
    data = {k: rng.integers(-100, 100, size=(16, lanes)).astype(np.int32) for k in "ab"}
    buffers = [HostBuffer("a", mus[0], data["a"]), HostBuffer("b", mus[0], data["b"]),
               HostBuffer("c", mus[0]), HostBuffer("d", mus[1])]
    tiles = {cu: TileConfig(program=assemble("\n".join([*lines, "HALT"])), regs=dict(_REGS))
             for cu, lines in programs.items()}
    return Job(FabricConfig(params, tiles), buffers, [], {}, cus_used=len(programs),
               description=f"micro-job {name}")


def micro_jobs():
    """The micro-jobs by name: ``{name: Job}``."""
    cu1_id = MICRO_PARAMS.mu_id(*_CU1)
    jobs = {}
    for n in (1, 4, 16):               # results kept in the local buffer
        jobs[f"local{n}"] = {_CU0: _stream("r1", n, DMode.LOCAL)}
    for n in (1, 8):                   # results appended to an MU (one hop, then two)
        jobs[f"append{n}"] = {_CU0: _stream("r1", n, DMode.APPEND, d_ref="r3")}
    jobs["append8_far"] = {_CU0: _stream("r1", 8, DMode.APPEND, d_ref="r4")}
    jobs["write8"] = {_CU0: _stream("r1", 8, DMode.WRITE, d_ref="r2")}
    jobs["pack_sum"] = {_CU0: _stream("r1", 4, DMode.PACK_SUM, d_ref="r3", fn="MUL",
                                      b_mode=BMode.SCALAR, b_val=3, outer=4)}
    # A reduction, then an instruction that names its register.
    jobs["sum8"] = {_CU0: [*_stream("r1", 8, DMode.SUM, fn="ADD", rd="r5"),
                           "ALU ADD, r6, r5, r5"]}
    # MU instructions after a stream: one that may overtake it (LEN of the buffer it reads),
    # one that waits for it (LEN of the buffer it appends to), a blocking one.
    jobs["len_after"] = {_CU0: [*_stream("r1", 8, DMode.LOCAL), "LEN r7, r1",
                                "ALU ADD, r8, r7, r7"]}
    jobs["len_waits"] = {_CU0: [*_stream("r1", 8, DMode.APPEND, d_ref="r3"), "LEN r7, r3",
                                "ALU ADD, r8, r7, r7"]}
    jobs["vread_after"] = {_CU0: [*_stream("r1", 8, DMode.LOCAL), "LI r9, 2", "VREAD r2, r9",
                                  "VWRITE r2, r9"]}
    # A request for the buffer a stream reads: it follows the stream's last read.
    jobs["addw_after"] = {_CU0: [*_stream("r1", 16, DMode.LOCAL), "ADDW r1, 1", "RETI r1, 1"]}
    # Two streams back to back: the second's reads prefetched (same MU, it does not read what
    # the first writes), and not (it reads the buffer the first appends to).
    jobs["two_prefetch"] = {_CU0: [*_stream("r1", 8, DMode.LOCAL),
                                   *_stream("r2", 8, DMode.LOCAL, d_base=8)]}
    jobs["two_dependent"] = {_CU0: [*_stream("r1", 8, DMode.APPEND, d_ref="r3"),
                                    *_stream("r3", 8, DMode.LOCAL)]}
    # Two CUs on one MU at once.
    jobs["two_cus"] = {_CU0: _stream("r1", 16, DMode.LOCAL),
                       _CU1: _stream("r2", 16, DMode.APPEND, d_ref="r4")}
    # A token from one CU to the other.
    jobs["token"] = {_CU0: [f"LI r9, {cu1_id}", "SEND 0, r9, 1"], _CU1: ["WAIT 0, 1"]}
    return {name: _job(name, programs) for name, programs in jobs.items()}


def micro4_jobs():
    """The four-CU micro-jobs on :data:`MICRO4_PARAMS` by name: ``{name: Job}``. Every CU
    streams from MU (2, 0) at once (``a`` and ``b`` there, ``d`` in MU (2, 1)): the hot MU of
    ``rdakit bench memory``, whose requests wait in the routers' queues."""
    cus = MICRO4_PARAMS.tiles("C")
    mus = ((2, 0), (2, 1))
    jobs = {
        # Reads only: 16 steps each to the local buffer.
        "four_cus": {cu: _stream("r1" if k % 2 else "r2", 16, DMode.LOCAL)
                     for k, cu in enumerate(cus)},
        # Reads from the hot MU, every result appended to the other MU.
        "four_cus_append": {cu: _stream("r1" if k % 2 else "r2", 8, DMode.APPEND, d_ref="r4")
                            for k, cu in enumerate(cus)},
    }
    return {name: _job(name, programs, MICRO4_PARAMS, mus) for name, programs in jobs.items()}
