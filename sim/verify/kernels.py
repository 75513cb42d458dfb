"""Hand-written jobs for the fabric tests and benchmarks: vector add, matrix-vector and
matrix-matrix products spread over CUs, an MoE-style fan-out of a shared reference with split
weights (:class:`~rdakit.compiler.job.Job` each, with its numpy expectation)."""

import numpy as np

from rdakit.compiler.compile import placement_fabric
from rdakit.compiler.job import HostBuffer, Job, Ref, SystemJob
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.isa import assemble

__all__ = ["vector_add", "matvec", "matmul", "moe_fanout", "cluster_matvec"]


def _rng(seed):
    return np.random.default_rng(seed)


def _cu_id(params, xy):
    return params.mu_id(*xy)


def vector_add(params, *, n=16, cu=(0, 0), mu=None, seed=0):
    """c = a + b over ``n`` vector words: b is copied to the CU's local buffer, then a stream
    adds a to it and appends to c."""
    mu = mu or params.tiles("M")[0]
    lanes = params.cu.lanes
    if n > params.cu.local_words:
        raise ValueError(f"n must be at most local_words ({params.cu.local_words}), not {n}")
    rng = _rng(seed)
    a = rng.integers(-2**31, 2**31, size=(n, lanes), dtype=np.int64).astype(np.int32)
    b = rng.integers(-2**31, 2**31, size=(n, lanes), dtype=np.int64).astype(np.int32)
    buffers = [HostBuffer("a", mu, a), HostBuffer("b", mu, b), HostBuffer("c", mu)]
    program = assemble(f"""
        SCFG A_REF, r2
        SCFGI A_STRIDE, 1
        SCFGI N, {n}
        SCFGI D_MODE, 3          # LOCAL
        SCFGI D_STRIDE, 1
        SRUN PASS, r0            # local = b
        SCFG A_REF, r1
        SCFGI B_MODE, 1          # LOCAL
        SCFGI B_STRIDE, 1
        SCFGI D_MODE, 2          # APPEND
        SCFG D_REF, r3
        SRUN ADD, r0             # c = a + local
        HALT
    """)
    tile = TileConfig(program=program, regs={1: Ref("a"), 2: Ref("b"), 3: Ref("c")})
    with np.errstate(over="ignore"):
        c = (a.astype(np.int64) + b).astype(np.int32)
    return Job(FabricConfig(params, {cu: tile}), buffers, ["c"], {"c": c}, cus_used=1,
               description=f"vector add of {n * lanes} int32")


def _nearest_mu(params, xy):
    mus = params.tiles("M")
    return min(mus, key=lambda m: (abs(m[0] - xy[0]) + abs(m[1] - xy[1]), m[1], m[0]))


def _spread_mus(params, cus):
    """Each CU's own MU, near it and balanced (:meth:`Fabric.spread
    <rdakit.compiler.placement.Fabric.spread>`): the nearest MU alone sends three of a 4x4's
    eight CUs to one MU."""
    return placement_fabric(params).spread(cus)


def _matvec_program(kw, rows, *, return_x=False):
    """A CU's part of y = W x: copy x (``kw`` vector words, reference in r2) to the local
    buffer, optionally return the reference's share (``RETI``), then one PACK_SUM stream over
    its ``rows`` rows of W (r1) into y (r3)."""
    reti = "RETI r2, 1               # done with the shared x" if return_x else ""
    return assemble(f"""
        SCFG A_REF, r2
        SCFGI A_STRIDE, 1
        SCFGI N, {kw}
        SCFGI D_MODE, 3          # LOCAL: x into the local buffer
        SCFGI D_STRIDE, 1
        SRUN PASS, r0
        {reti}
        SCFG A_REF, r1
        SCFGI A_OSTRIDE, {kw}
        SCFGI OUTER, {rows}
        SCFGI B_MODE, 1          # LOCAL
        SCFGI B_STRIDE, 1
        SCFGI D_MODE, 8          # PACK_SUM
        SCFG D_REF, r3
        SRUN MUL, r0
        HALT
    """)


def _matvec_operands(params, m, k, seed, scale):
    """``(kw, W, x)`` of an m x k matrix-vector product, after checking the sizes fit."""
    lanes = params.cu.lanes
    if k % lanes or m % lanes:
        raise ValueError(f"m and k must be multiples of lanes ({lanes}), not {m} and {k}")
    kw = k // lanes
    if kw > params.cu.local_words:
        raise ValueError(f"k / lanes must be at most local_words ({params.cu.local_words}), "
                         f"not {kw}")
    rng = _rng(seed)
    w = rng.integers(-scale, scale, size=(m, k), dtype=np.int64).astype(np.int32)
    x = rng.integers(-scale, scale, size=(k,), dtype=np.int64).astype(np.int32)
    return kw, w, x


def _row_blocks(m, lanes, n):
    """Blocks of ``lanes`` rows per unit when ``m`` rows are split over ``n`` units."""
    blocks = m // lanes
    return [blocks // n + (i < blocks % n) for i in range(n)]


def matvec(params, *, m=64, k=64, cus=None, seed=1, scale=100):
    """y = W x with W (m × k) and x (k) int32 (small values), rows split over ``cus`` in
    blocks of ``lanes`` rows; each CU streams its rows of W from the MU nearest to it with x
    in its local buffer, packing the dot products into y's vector words (PACK_SUM)."""
    lanes = params.cu.lanes
    cus = cus or params.tiles("C")
    kw, w, x = _matvec_operands(params, m, k, seed, scale)
    per = _row_blocks(m, lanes, len(cus))
    buffers, tiles, expected, outputs = [], {}, {}, []
    row = 0
    plan = []
    mu_of = _spread_mus(params, [c for c, nb in zip(cus, per, strict=True) if nb])
    for i, (cu, nb) in enumerate(zip(cus, per, strict=True)):
        if nb == 0:
            continue
        rows = nb * lanes
        mu = mu_of[cu]
        if f"x{mu}" not in {b.name for b in buffers}:    # one copy of x per MU
            buffers.append(HostBuffer(f"x{mu}", mu, x.reshape(-1, lanes)))
        buffers += [HostBuffer(f"w{i}", mu, w[row:row + rows].reshape(-1, lanes)),
                    HostBuffer(f"y{i}", mu)]
        y = (w[row:row + rows].astype(np.int64) @ x.astype(np.int64))
        expected[f"y{i}"] = y.astype(np.int32).reshape(-1, lanes)
        outputs.append(f"y{i}")
        plan.append((i, cu, rows, mu))
        row += rows
    for i, cu, rows, mu in plan:
        program = _matvec_program(kw, rows)
        tiles[cu] = TileConfig(program=program,
                               regs={1: Ref(f"w{i}"), 2: Ref(f"x{mu}"), 3: Ref(f"y{i}")})
    return Job(FabricConfig(params, tiles), buffers, outputs, expected, macs=m * k,
               cus_used=len(plan), description=f"{m}x{k} matrix-vector product")


def matmul(params, *, m=64, k=64, n=64, cus=None, seed=2, scale=30):
    """C = A B (m × k times k × n): each CU owns a block of rows of C; for every column j of B
    (kept transposed in an MU) it copies the column to its local buffer and runs one
    PACK_SUM stream over its rows of A. Outputs are Cᵀ blocks (column-major results)."""
    lanes = params.cu.lanes
    cus = cus or params.tiles("C")
    if k % lanes or m % lanes:
        raise ValueError(f"m and k must be multiples of lanes ({lanes}), not {m} and {k}")
    kw = k // lanes
    rng = _rng(seed)
    a = rng.integers(-scale, scale, size=(m, k), dtype=np.int64).astype(np.int32)
    b = rng.integers(-scale, scale, size=(k, n), dtype=np.int64).astype(np.int32)
    blocks = m // lanes
    per = [blocks // len(cus) + (i < blocks % len(cus)) for i in range(len(cus))]
    buffers, tiles, expected, outputs, plan = [], {}, {}, [], []
    row = 0
    mu_of = _spread_mus(params, [c for c, nb in zip(cus, per, strict=True) if nb])
    for i, (cu, nb) in enumerate(zip(cus, per, strict=True)):
        if nb == 0:
            continue
        rows = nb * lanes
        mu = mu_of[cu]
        if f"bt{mu}" not in {x.name for x in buffers}:   # one copy of Bᵀ per MU
            buffers.append(HostBuffer(f"bt{mu}", mu, b.T.copy().reshape(-1, lanes)))
        buffers += [HostBuffer(f"a{i}", mu, a[row:row + rows].reshape(-1, lanes)),
                    HostBuffer(f"c{i}", mu)]
        c = a[row:row + rows].astype(np.int64) @ b.astype(np.int64)
        # Column j of this block of C is rows/lanes vector words, columns one after another.
        expected[f"c{i}"] = c.T.astype(np.int32).reshape(-1, lanes)
        outputs.append(f"c{i}")
        plan.append((i, cu, rows, mu))
        row += rows
    for i, cu, rows, mu in plan:
        program = assemble(f"""
            LI r4, {n}               # columns left
            LI r5, 0                 # word offset of column j in Bᵀ
            SCFGI A_STRIDE, 1
            SCFGI D_STRIDE, 1
            SCFGI B_STRIDE, 1
            SCFG D_REF, r3
        column:
            SCFG A_REF, r2
            SCFG A_BASE, r5
            SCFGI A_OSTRIDE, 0
            SCFGI N, {kw}
            SCFGI OUTER, 1
            SCFGI B_MODE, 0
            SCFGI D_MODE, 3          # LOCAL: column j of B
            SRUN PASS, r0
            SCFG A_REF, r1
            SCFGI A_BASE, 0
            SCFGI A_OSTRIDE, {kw}
            SCFGI OUTER, {rows}
            SCFGI B_MODE, 1          # LOCAL
            SCFGI D_MODE, 8          # PACK_SUM: column j of this block of C
            SRUN MUL, r0
            ALUI ADD, r5, r5, {kw}
            LOOP r4, column
            HALT
        """)
        tiles[cu] = TileConfig(program=program,
                               regs={1: Ref(f"a{i}"), 2: Ref(f"bt{mu}"), 3: Ref(f"c{i}")})
    return Job(FabricConfig(params, tiles), buffers, outputs, expected, macs=m * k * n,
               cus_used=len(plan), description=f"{m}x{k}x{n} matrix product")


def moe_fanout(params, *, n=8, producer=None, consumers=None, seed=3):
    """An MoE-style fan-out: the producer allocates a buffer with weight 1 + consumers, fills
    it, keeps weight 1 and sends the reference with weight 1 to each consumer (no message to
    the MU); each consumer scales the shared input by its own factor into its output buffer
    and returns its weight; the producer returns its own. The buffer is freed exactly once,
    when the last weight arrives."""
    cus = params.tiles("C")
    producer = producer or cus[0]
    consumers = consumers or [c for c in cus if c != producer]
    if not consumers:
        raise ValueError("moe_fanout needs at least two CUs")
    lanes = params.cu.lanes
    rng = _rng(seed)
    x = rng.integers(-1000, 1000, size=(n, lanes), dtype=np.int64).astype(np.int32)
    mu = _nearest_mu(params, producer)
    buffers = [HostBuffer("x", mu, x)]
    expected, outputs = {}, []
    for j, c in enumerate(consumers):
        buffers.append(HostBuffer(f"out{j}", _nearest_mu(params, c)))
        expected[f"out{j}"] = (x.astype(np.int64) * (j + 2)).astype(np.int32)
        outputs.append(f"out{j}")
    sends = "\n".join(f"LI r4, {_cu_id(params, c)}\nSENDREF 0, r4, r3, r5"
                      for c in consumers)
    producer_prog = assemble(f"""
        ALLOC r3, r1, {len(consumers) + 1}
        SCFG A_REF, r2
        SCFGI A_STRIDE, 1
        SCFGI N, {n}
        SCFGI D_MODE, 2          # APPEND into the shared buffer
        SCFG D_REF, r3
        SRUN PASS, r0
        LI r5, 1
        {sends}
        RETI r3, 1
        HALT
    """)
    tiles = {producer: TileConfig(program=producer_prog,
                                  regs={1: params.mu_id(*mu), 2: Ref("x")})}
    for j, c in enumerate(consumers):
        prog = assemble(f"""
            RECV 0, r1               # r1 = shared reference, r2 = its weight
            SCFG A_REF, r1
            SCFGI A_STRIDE, 1
            SCFGI N, {n}
            SCFGI B_MODE, 2          # SCALAR
            SCFGI B_VAL, {j + 2}
            SCFGI D_MODE, 2          # APPEND
            SCFG D_REF, r6
            SRUN MUL, r0
            RET r1, r2
            HALT
        """)
        tiles[c] = TileConfig(program=prog, regs={6: Ref(f"out{j}")})
    return Job(FabricConfig(params, tiles), buffers, outputs, expected,
               cus_used=1 + len(consumers),
               description=f"MoE fan-out of {n} words to {len(consumers)} consumers")


def cluster_matvec(params, *, clusters=2, m=16, k=32, seed=3, scale=100):
    """y = W x over every CU of ``clusters`` clusters: the rows of W are split over the CUs
    (in blocks of ``lanes``), each CU's rows in an MU of its own cluster, its part of y
    appended there too; x is one buffer in cluster 0 shared by every CU (read remotely by the
    other clusters), with a weight of one per CU: each CU returns it once x is in its local
    buffer, so x is freed exactly once, by the last of them."""
    lanes = params.cu.lanes
    kw, w, x = _matvec_operands(params, m, k, seed, scale)
    cus = [(xy, c) for c in range(clusters) for xy in params.tiles("C")]
    per = _row_blocks(m, lanes, len(cus))
    mus = params.tiles("M")
    x_mu = (*mus[0], 0)
    used = sum(1 for nb in per if nb)
    buffers = [HostBuffer("x", x_mu, x.reshape(-1, lanes), weight=used, cu_returns=used)]
    tiles = [{} for _ in range(clusters)]
    expected, outputs = {}, []
    row = 0
    for i, ((xy, c), nb) in enumerate(zip(cus, per, strict=True)):
        if nb == 0:
            continue
        rows = nb * lanes
        mu = _nearest_mu(params, xy)
        buffers += [HostBuffer(f"w{i}", (*mu, c), w[row:row + rows].reshape(-1, lanes)),
                    HostBuffer(f"y{i}", (*mu, c))]
        y = w[row:row + rows].astype(np.int64) @ x.astype(np.int64)
        expected[f"y{i}"] = y.astype(np.int32).reshape(-1, lanes)
        outputs.append(f"y{i}")
        program = _matvec_program(kw, rows, return_x=True)
        tiles[c][xy] = TileConfig(program=program,
                                  regs={1: Ref(f"w{i}"), 2: Ref("x"), 3: Ref(f"y{i}")})
        row += rows
    configs = [FabricConfig(params, t) if t else None for t in tiles]
    return SystemJob(configs, buffers, outputs, expected,
                     description=f"{m}x{k} matrix-vector product over {clusters} clusters")
