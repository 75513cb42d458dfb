"""Running a job (:class:`~rdakit.compiler.job.Job`): on a fabric through a
:class:`~rdakit.sim.runtime.host.HostDriver` on any backend (:func:`run_job`: fill, load,
start, wait, read back, counters of the run), or on the functional interpreter
(:func:`run_job_interp`, the golden model).
"""

import dataclasses

import numpy as np

from rdakit.compiler.job import Ref
from rdakit.hdl.fabric.config_loader import LoadStatus
from rdakit.hdl.spec.bitstream import write_bitstream
from rdakit.hdl.spec.config import CU_MAP, CU_STATUS_BITS
from rdakit.sim.models.interp import Interpreter
from rdakit.sim.runtime.counters import read_mu_counters, run_delta
from rdakit.sim.runtime.host import NoReply

__all__ = ["JobError", "JobResult", "run_job", "run_job_interp", "prepare_interp",
           "CU_ERROR_NAMES", "abandon"]

#: CU error code -> name (docs/compute-unit.md).
CU_ERROR_NAMES = {code: name for name, code in CU_STATUS_BITS.items()}


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
    :class:`JobError` if the bitstream is refused or a CU halts on an error, and
    :class:`~rdakit.sim.runtime.host.HostTimeout` if the fabric is not done after
    ``max_cycles``.

    Every way out leaves the MUs as the job found them: on success the CUs and the host have
    returned every weight; on any error the job is abandoned (:func:`abandon`: its CUs are
    stopped, the buffers it allocated freed) before the error is raised, so the next job on
    the same fabric starts clean."""
    stage = on_stage or (lambda name: None)
    refs = {}
    live_before = await read_mu_counters(host, ["live_buffers"])
    try:
        stage("fill")
        for b in job.buffers:
            refs[b.name] = await host.alloc(b.mu, b.weight)
            data = b.contents(refs, job.params.cu.lanes)
            if data is not None:
                await host.append_vectors(refs[b.name], data)
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
            raise JobError(f"{job.description}: CUs halted on errors (code, pc): {errors}",
                           tiles)
        outputs = {name: await host.read_vectors(refs[name]) for name in job.outputs}
        result = JobResult(outputs, cycles, load_cycles, st,
                           run_delta(job.params, at_start, await host.counters())
                           if counters else {})
        for b in job.buffers:         # the host's own weight: the job leaves no buffer behind
            if b.weight > b.cu_returns:
                await host.release(refs[b.name], b.weight - b.cu_returns)
        return result
    except NoReply:
        raise                          # the fabric does not answer: nothing more can be done
    except Exception as e:
        try:
            left = await abandon(host, refs.values(), live_before)
        except Exception as cleanup:
            left = f"cleaning up after the job failed too: {cleanup}"
        if left:
            e.add_note(left)
        raise


async def abandon(host, refs, live_before):
    """Clean up after a job that failed on ``host``: stop every CU (a bitstream load begins,
    so the fabric is unconfigured until the next one), let in-flight requests land, free the
    buffers ``refs`` the host allocated whatever weight is still outstanding, and free the
    buffers the job's CUs allocated: those live in an MU beyond its ``live_before`` count
    (``read_mu_counters(host, ["live_buffers"])`` before the job), when that MU held none
    before the job (otherwise they cannot be told from the others, and are left). They are
    looked for first among the CUs' registers (read before the CUs stop, which resets them),
    where a CU keeps what it allocated, then by
    :meth:`~rdakit.sim.runtime.host.HostDriver.live_refs`. Returns ``""`` or a sentence naming
    what was left."""
    p = host.params
    seen = {await host.cfg_read(*xy, CU_MAP.REGS + r)
            for xy in p.tiles("C") for r in range(p.cu.regs)}
    await host.stop()
    await host.transport.tick(16 * (p.rows + p.cols) + 64)
    for ref in refs:
        await host.free(ref)
    left = []
    now = await read_mu_counters(host, ["live_buffers"])
    ref_mask = (1 << (p.mu.mu_id_bits + p.mu.buf_id_bits)) - 1
    for xy, c in now.items():
        extra = c["live_buffers"] - live_before[xy]["live_buffers"]
        if extra <= 0:
            continue
        if live_before[xy]["live_buffers"]:
            left.append(f"{extra} in MU {xy}")
            continue
        mu = p.mu_id(*xy, host.cluster)
        for ref in sorted({v & ref_mask for v in seen}):
            if extra and host.ref_dict(ref)["mu"] == mu and await host.free(ref):
                extra -= 1
        for ref in await host.live_refs(xy, limit=extra) if extra else ():
            await host.free(ref)
    if left:
        return (f"buffers the job's CUs allocated could not be told from those held before "
                f"the job, and were left: {', '.join(left)}")
    return ""


def prepare_interp(job, *, interpreter=None, **kwargs):
    """An interpreter for ``job`` with its host buffers loaded and their references bound into
    the CUs' registers; ``kwargs`` go to :class:`~rdakit.sim.models.interp.Interpreter` (or the
    subclass ``interpreter``). Returns ``(interpreter, refs)``."""
    placeholders = {b.name: 0 for b in job.buffers}
    interp = (interpreter or Interpreter)(job.params, job.bind(placeholders), **kwargs)
    refs = {}
    for b in job.buffers:
        data = b.contents(refs, job.params.cu.lanes)
        if data is None:
            data = np.zeros((0, job.params.cu.lanes), np.int32)
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
