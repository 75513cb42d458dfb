"""Jobs: a fabric configuration with its host inputs, outputs and numpy expectation.

A :class:`Job` is everything needed to run a program on a fabric through the host port: the
:class:`~rdakit.compiler.bitstream.FabricConfig`, the buffers the host allocates and fills
before loading (their references are bound into the CUs' initial registers when the bitstream
is written, so a job runs on a fabric in any state), the buffers read back after done, and the
expected outputs. :func:`run_job` runs one with a
:class:`~rdakit.sim.host.HostDriver` on any backend; the kernel builders below make the jobs of
the fabric tests and benchmarks (vector add, matrix-vector and matrix-matrix products spread
over CUs, an MoE-style fan-out of a shared reference with split weights).
"""

import dataclasses

import numpy as np

from rdakit.compiler.bitstream import FabricConfig, TileConfig, write_bitstream
from rdakit.hdl.config import CU_STATUS_BITS, TILE_COUNTERS
from rdakit.hdl.config_loader import LoadStatus
from rdakit.hdl.isa import assemble

__all__ = ["HostBuffer", "Job", "JobError", "JobResult", "run_job", "run_job_interp",
           "prepare_interp", "Ref", "vector_add", "matvec", "matmul", "moe_fanout"]

#: CU error code -> name (docs/compute-unit.md).
CU_ERROR_NAMES = {code: name for name, code in CU_STATUS_BITS.items()}


@dataclasses.dataclass(frozen=True)
class Ref:
    """An initial register value that is the reference of host buffer ``name``, bound when
    the job's bitstream is written (:meth:`Job.bind`)."""

    name: str


@dataclasses.dataclass
class HostBuffer:
    """A buffer the host allocates (in this order) in MU ``mu`` with total weight ``weight``
    and fills with ``data`` (n × lanes int32, or ``None`` for an empty buffer)."""

    name: str
    mu: tuple
    data: np.ndarray | None = None
    weight: int = 1
    #: Weight the CUs return; the host returns the rest after reading the outputs.
    cu_returns: int = 0


@dataclasses.dataclass
class Job:
    config: FabricConfig
    buffers: list                    # HostBuffer, allocated in order
    outputs: list                    # names of buffers read back after the run
    expected: dict                   # name -> n × lanes int32 array
    macs: int = 0                    # multiply-accumulates, for lower bounds
    cus_used: int = 1
    description: str = ""

    @property
    def params(self):
        return self.config.params

    def bind(self, refs):
        """The configuration with every :class:`Ref` register replaced by ``refs[name]``."""
        tiles = {}
        for xy, tile in self.config.tiles.items():
            regs = {r: refs[v.name] if isinstance(v, Ref) else v for r, v in tile.regs.items()}
            tiles[xy] = dataclasses.replace(tile, regs=regs)
        return FabricConfig(self.params, tiles)


@dataclasses.dataclass
class JobResult:
    outputs: dict
    cycles: int
    load_cycles: int
    status: dict
    counters: dict

    def check(self, job):
        """Raise AssertionError naming the first output that differs from numpy."""
        for name, want in job.expected.items():
            got = self.outputs[name]
            if got.shape != want.shape:
                raise AssertionError(f"output {name!r} has shape {got.shape}, numpy's "
                                     f"{want.shape}")
            if not np.array_equal(got, want):
                bad = np.argwhere(got != want)
                raise AssertionError(f"output {name!r} differs from numpy in {len(bad)} "
                                     f"elements, first at {tuple(bad[0])}: "
                                     f"{got[tuple(bad[0])]} instead of {want[tuple(bad[0])]}")


class JobError(RuntimeError):
    """The fabric refused a job's bitstream or a CU halted on an error; ``counters`` holds the
    tiles' counters and states when they could be read."""

    def __init__(self, message, counters=None):
        super().__init__(message)
        self.counters = counters or {}


async def run_job(host, job, *, max_cycles=2_000_000, counters=True, on_stage=None,
                  on_poll=None):
    """Fill the host buffers, load the bound bitstream, start, wait, read back: returns a
    :class:`JobResult`. ``on_stage(name)`` is called as the job moves through ``"fill"``,
    ``"load"``, ``"run"`` and ``"read"``; ``on_poll(cycles)`` while it runs. Raises
    :class:`JobError` if the bitstream is refused or a CU halts on an error."""
    stage = on_stage or (lambda name: None)
    stage("fill")
    refs = {}
    for b in job.buffers:
        refs[b.name] = await host.alloc(b.mu, b.weight)
        if b.data is not None:
            await host.append_vectors(refs[b.name], b.data)
    stage("load")
    status, load_cycles = await host.load(write_bitstream(job.bind(refs)))
    if status is not LoadStatus.OK:
        raise JobError(f"bitstream rejected by the fabric: {status.name}")
    at_start = await host.counters() if counters else {}
    stage("run")
    await host.start()
    st = await host.wait_done(max_cycles=max_cycles, on_poll=on_poll)
    cycles = await host.run_cycles()
    stage("read")
    if st["error"]:
        tiles = await host.counters()
        errors = {xy: (CU_ERROR_NAMES.get(c["error_code"], c["error_code"]), c["pc"])
                  for xy, c in tiles.items() if c.get("error")}
        raise JobError(f"{job.description}: CUs halted on errors (code, pc): {errors}", tiles)
    outputs = {name: await host.read_vectors(refs[name]) for name in job.outputs}
    result = JobResult(outputs, cycles, load_cycles, st,
                       _since(job.params, at_start, await host.counters()) if counters else {})
    for b in job.buffers:         # the host's own weight: the job leaves no buffer behind
        if b.weight > b.cu_returns:
            await host.release(refs[b.name], b.weight - b.cu_returns)
    return result


#: MU-tile counters that count from reset (the others are occupancy readings).
_MU_CUMULATIVE = (*TILE_COUNTERS, "allocs", "frees", "copy_cycles")


def _since(params, before, after):
    """The counters of one run: a CU's restart at START; an MU tile's count from reset, so
    their values at START are subtracted (occupancy and peak are kept as read)."""
    out = {}
    for xy, c in after.items():
        if params.kind(*xy) == "C":
            out[xy] = c
        else:
            out[xy] = {k: v - before[xy][k] if k in _MU_CUMULATIVE else v for k, v in c.items()}
    return out


def prepare_interp(job, *, interpreter=None, **kwargs):
    """An interpreter for ``job`` with its host buffers loaded and their references bound into
    the CUs' registers; ``kwargs`` go to :class:`~rdakit.sim.interp.Interpreter` (or the
    subclass ``interpreter``). Returns ``(interpreter, refs)``."""
    from .interp import Interpreter

    placeholders = {b.name: 0 for b in job.buffers}
    interp = (interpreter or Interpreter)(job.params, job.bind(placeholders), **kwargs)
    refs = {}
    for b in job.buffers:
        data = b.data if b.data is not None else np.zeros((0, job.params.cu.lanes), np.int32)
        refs[b.name] = interp.load_buffer(b.mu, data, weight=b.weight)
    for xy, tile in job.config.tiles.items():
        for r, v in tile.regs.items():
            if isinstance(v, Ref):
                interp.set_register(xy, r, refs[v.name])
    return interp, refs


def run_job_interp(job, *, schedule="round_robin", seed=0):
    """Run ``job`` on the functional interpreter (the golden model); returns the outputs and
    the interpreter's result."""
    interp, refs = prepare_interp(job, schedule=schedule, seed=seed)
    result = interp.run(max_steps=50_000_000)
    outputs = {name: interp.read_buffer(next(b.mu for b in job.buffers if b.name == name),
                                        refs[name]) for name in job.outputs}
    return outputs, result, interp


# --- Kernels ----------------------------------------------------------------------------------

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


def matvec(params, *, m=64, k=64, cus=None, seed=1, scale=100):
    """y = W x with W (m × k) and x (k) int32 (small values), rows split over ``cus`` in
    blocks of ``lanes`` rows; each CU streams its rows of W from the MU nearest to it with x
    in its local buffer, packing the dot products into y's vector words (PACK_SUM)."""
    lanes = params.cu.lanes
    cus = cus or params.tiles("C")
    if k % lanes or m % lanes:
        raise ValueError(f"m and k must be multiples of lanes ({lanes}), not {m} and {k}")
    kw = k // lanes
    if kw > params.cu.local_words:
        raise ValueError(f"k / lanes must be at most local_words ({params.cu.local_words}), "
                         f"not {kw}")
    rng = _rng(seed)
    w = rng.integers(-scale, scale, size=(m, k), dtype=np.int64).astype(np.int32)
    x = rng.integers(-scale, scale, size=(k,), dtype=np.int64).astype(np.int32)
    blocks = m // lanes
    per = [blocks // len(cus) + (i < blocks % len(cus)) for i in range(len(cus))]
    buffers, tiles, expected, outputs = [], {}, {}, []
    row = 0
    plan = []
    for i, (cu, nb) in enumerate(zip(cus, per, strict=True)):
        if nb == 0:
            continue
        rows = nb * lanes
        mu = _nearest_mu(params, cu)
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
        program = assemble(f"""
            SCFG A_REF, r2
            SCFGI A_STRIDE, 1
            SCFGI N, {kw}
            SCFGI D_MODE, 3          # LOCAL: x into the local buffer
            SCFGI D_STRIDE, 1
            SRUN PASS, r0
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
    for i, (cu, nb) in enumerate(zip(cus, per, strict=True)):
        if nb == 0:
            continue
        rows = nb * lanes
        mu = _nearest_mu(params, cu)
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
