"""A two-stage pipeline between two CUs, as a job for the fabric tests, co-simulation and the
measurement of ``docs/compute-unit.md`` ("Streams between CUs"): the first CU computes
``y = (x * 3) >> 1`` over the rows of ``x`` and the second ``z = y + w`` (``w`` in its local
buffer), either through a stream between the CUs (``DMode.QUEUE``) or, as a lowering does
today, through a buffer in an MU (ALLOC, a stream appending, SENDREF; RECV, LEN, a stream
reading it, RETI)."""

import numpy as np

from rdakit.compiler.job import HostBuffer, Job, Ref
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.isa import BMode, DMode, assemble

__all__ = ["stream_pipeline", "stream_sum", "stream_then_read", "stream_micro_jobs",
           "STREAM_MICRO_RTL"]


def _cfg(**fields):
    return "\n".join(f"SCFGI {name}, {int(getattr(v, 'value', v))}" for name, v in fields.items())


def _setup(params, rows, mu, seed):
    """``(mu, lanes, rng)`` of a job whose consumer keeps ``rows`` words in its local buffer
    (the first MU unless ``mu`` is given); ``ValueError`` unless they fit."""
    if not 1 <= rows <= params.cu.local_words:
        raise ValueError(f"rows must be between 1 and local_words ({params.cu.local_words}), "
                         f"not {rows!r}")
    return mu or params.tiles("M")[0], params.cu.lanes, np.random.default_rng(seed)


def stream_pipeline(params, *, rows=16, producer=(0, 0), consumer=(1, 0), mu=None,
                    through_mu=False, delay=0, seed=0):
    """The job: ``x`` (``rows`` words) and the output ``z`` in the MU ``mu`` (the first MU by
    default), ``w`` in the consumer's local buffer; the consumer starts after a loop of
    ``delay`` cycles (a slow consumer: the producer runs out of credits).

    Raises
    ------
    ValueError
        If ``rows`` is not between 1 and the local buffer's words.
    """
    mu, lanes, rng = _setup(params, rows, mu, seed)
    x = rng.integers(-2 ** 23, 2 ** 23, size=(rows, lanes)).astype(np.int32)
    w = rng.integers(-2 ** 31, 2 ** 31, size=(rows, lanes), dtype=np.int64).astype(np.int32)
    to = params.mu_id(*consumer)
    first = _cfg(A_STRIDE=1, N=rows, B_MODE=BMode.SCALAR, B_VAL=3, SHIFT=1)
    second = _cfg(B_MODE=BMode.LOCAL, B_VAL=0, B_STRIDE=1, D_MODE=DMode.APPEND)
    if through_mu:
        produce = f"""
            LI r7, {params.mu_id(*mu)}
            ALLOC r2, r7, 1
            SCFG A_REF, r1
            SCFG D_REF, r2
            {first}
            {_cfg(D_MODE=DMode.APPEND)}
            SRUN MUL, r0
            LI r6, {to}
            LI r5, 1
            SENDREF 0, r6, r2, r5
            HALT
        """
        consume = f"""
            RECV 0, r2
            LEN r4, r2
            SCFG A_REF, r2
            SCFG N, r4
            SCFG D_REF, r1
            {_cfg(A_STRIDE=1)}
            {second}
            SRUN ADD, r0
            RETI r2, 1
            HALT
        """
    else:
        produce = f"""
            SCFG A_REF, r1
            LI r6, {to}
            SCFG D_REF, r6
            {first}
            {_cfg(D_MODE=DMode.QUEUE)}
            SRUN MUL, r0
            HALT
        """
        wait = f"LI r5, {delay}\nd: LOOP r5, d" if delay else ""
        consume = f"""
            {wait}
            SELF r2
            SCFG A_REF, r2
            SCFG D_REF, r1
            {_cfg(N=rows)}
            {second}
            SRUN ADD, r0
            HALT
        """
    tiles = {
        producer: TileConfig(program=assemble(produce), regs={1: Ref("x")}),
        consumer: TileConfig(program=assemble(consume), regs={1: Ref("z")},
                             local={i: [int(v) for v in row] for i, row in enumerate(w)}),
    }
    y = ((x.astype(np.int64) * 3) >> 1)
    z = ((y + w) & 0xffff_ffff).astype(np.uint32).view(np.int32)
    how = "an MU buffer" if through_mu else "a stream between the CUs"
    return Job(FabricConfig(params, tiles), [HostBuffer("x", mu, x), HostBuffer("z", mu)],
               ["z"], {"z": z}, cus_used=2,
               description=f"two-stage pipeline of {rows} rows through {how}")


def stream_sum(params, *, rows=12, producer=(0, 0), consumer=(1, 0), mu=None, seed=0):
    """End of stream with a run-time length: the producer sends ``rows`` words (a register's
    count), the consumer's SUM stream is configured for the local buffer's words and ends at
    the producer's last word; it appends ``[sum, count, 0, ...]`` to ``z``."""
    mu = mu or params.tiles("M")[0]
    lanes = params.cu.lanes
    x = np.random.default_rng(seed).integers(-2 ** 20, 2 ** 20, size=(rows, lanes)) \
        .astype(np.int32)
    produce = f"""
        SCFG A_REF, r1
        LI r6, {params.mu_id(*consumer)}
        SCFG D_REF, r6
        {_cfg(A_STRIDE=1, B_MODE=BMode.ZERO, D_MODE=DMode.QUEUE)}
        SCFG N, r3
        SRUN PASS, r0
        HALT
    """
    consume = f"""
        SELF r2
        SCFG A_REF, r2
        {_cfg(N=params.cu.local_words, B_MODE=BMode.ZERO, D_MODE=DMode.SUM)}
        SRUN PASS, r4
        VCLR
        VSET 0, r4
        VSET 1, r5
        VAPPEND r0, r1
        HALT
    """
    tiles = {producer: TileConfig(program=assemble(produce), regs={1: Ref("x"), 3: rows}),
             consumer: TileConfig(program=assemble(consume), regs={1: Ref("z")})}
    z = np.zeros((1, lanes), np.int32)
    z[0, 0] = np.int64(x.astype(np.int64).sum()).astype(np.int32)
    z[0, 1] = rows
    return Job(FabricConfig(params, tiles), [HostBuffer("x", mu, x), HostBuffer("z", mu)],
               ["z"], {"z": z}, cus_used=2,
               description=f"a SUM over a stream of {rows} words ending at its last word")


def stream_then_read(params, *, rows=16, outer=8, producer=(0, 0), consumer=(1, 0), mu=None,
                     seed=0):
    """A stream reading the input queue followed by one reading an MU, whose reads the engine
    prefetches while the first pops words from the queue: the producer sends ``x`` (``rows``
    words) into the consumer's queue; the consumer copies them to its local buffer, then
    multiplies ``outer`` rows of ``w`` (``rows`` words each, in the MU) by them, one
    ``PACK_SUM`` a row, into ``z``. (The engine once counted every pop as a read response
    given back, so the queue's pops beside the prefetched reads left its count of reads
    outstanding wrong and the second stream waiting for responses that never came: the
    model suite's Mixtral and BERT hung with streams between CUs.)

    Raises
    ------
    ValueError
        If ``rows`` is not between 1 and the local buffer's words.
    """
    mu, lanes, rng = _setup(params, rows, mu, seed)
    x = rng.integers(-1000, 1000, size=(rows, lanes)).astype(np.int32)
    w = rng.integers(-1000, 1000, size=(outer * rows, lanes)).astype(np.int32)
    produce = f"""
        SCFG A_REF, r1
        LI r6, {params.mu_id(*consumer)}
        SCFG D_REF, r6
        {_cfg(A_STRIDE=1, N=rows, B_MODE=BMode.ZERO, D_MODE=DMode.QUEUE)}
        SRUN PASS, r0
        HALT
    """
    consume = f"""
        SELF r2
        SCFG A_REF, r2
        {_cfg(N=rows, B_MODE=BMode.ZERO, D_MODE=DMode.LOCAL, D_STRIDE=1)}
        SRUN PASS, r0
        SCFG A_REF, r3
        SCFG D_REF, r1
        {_cfg(A_STRIDE=1, A_OSTRIDE=rows, OUTER=outer, B_MODE=BMode.LOCAL, B_STRIDE=1,
              D_MODE=DMode.PACK_SUM)}
        SRUN MUL, r0
        HALT
    """
    tiles = {producer: TileConfig(program=assemble(produce), regs={1: Ref("x")}),
             consumer: TileConfig(program=assemble(consume), regs={1: Ref("z"), 3: Ref("w")})}
    sums = (w.astype(np.int64).reshape(outer, rows * lanes)
            @ x.astype(np.int64).reshape(rows * lanes))
    sums = np.concatenate([sums, np.zeros(-outer % lanes, np.int64)])
    z = (sums & 0xffff_ffff).astype(np.uint32).view(np.int32).reshape(-1, lanes)
    return Job(FabricConfig(params, tiles),
               [HostBuffer("x", mu, x), HostBuffer("w", mu, w), HostBuffer("z", mu)],
               ["z"], {"z": z}, cus_used=2, macs=outer * rows * lanes,
               description=f"a stream of {rows} words, then {outer} rows read from an MU")


def stream_micro_jobs(params):
    """The micro-jobs of streams between CUs the performance model is checked on
    (``docs/performance-model.md``), by name; :data:`STREAM_MICRO_RTL` holds their RTL
    cycles on ``fabric_params(2, 2, layout="CC/CM", mu_words=4096)``."""
    return {
        "pipeline16": stream_pipeline(params, rows=16),
        "pipeline32": stream_pipeline(params, rows=32),
        "slow_consumer": stream_pipeline(params, rows=32, delay=60),
        "through_mu16": stream_pipeline(params, rows=16, through_mu=True),
        "sum_eos": stream_sum(params, rows=12),
        "sum48": stream_sum(params, rows=48),
        "sum64": stream_sum(params, rows=64),
        "then_read": stream_then_read(params),
    }


#: The RTL's cycles of :func:`stream_micro_jobs` (Amaranth's simulator, at the commit that
#: added them).
STREAM_MICRO_RTL = {"pipeline16": 66, "pipeline32": 98, "slow_consumer": 133,
                    "through_mu16": 152, "sum_eos": 62, "sum48": 108, "sum64": 129,
                    "then_read": 215}
