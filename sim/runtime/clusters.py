"""Programs and host helpers for a :class:`~rdakit.hdl.cluster.system.System` of clusters.

Synchronization is served by the MUs (``docs/clusters.md``): a *ticket lock* is two words of a
buffer (word ``i`` the next ticket, word ``i + 1`` the ticket served); ``FADD`` on the first
takes a ticket, the holder spins reading the second until it is served, and ``UNLOCK`` with its
ticket serves the next one (FIFO fair; an ``UNLOCK`` by anyone else is refused with
``NOT_OWNER``). A *barrier* for ``n`` participants is one word counting arrivals: round ``r``
is passed once it reaches ``(r + 1) * n``, so it is reusable without a reset.

The assembly builders below are used by the RTL tests on Amaranth's simulator and under cocotb.
"""



from rdakit.compiler.job import SystemJob
from rdakit.hdl.fabric.config_loader import LoadStatus
from rdakit.hdl.spec.bitstream import write_bitstream

__all__ = ["LOCKED_INCREMENT", "BARRIER_ROUNDS", "locked_increment", "barrier_rounds",
           "run_system", "SystemJob", "run_system_job", "setup_buffers", "release_buffers"]

#: Every CU runs this ``{n}`` times: take a ticket of the lock in buffer r1 (words 0 and 1),
#: wait to be served, increment word 2 of r1 with a plain READ and VWRITE (a race without the
#: lock), append its own tag r0 to the log buffer r2 (if r2 is not 0), release.
LOCKED_INCREMENT = """
        LI r6, 0            # word 0: next ticket
        LI r5, 1            # word 1: ticket served
        LI r4, 2            # word 2: the shared counter
        LI r7, {n}
    loop:
        FADD r3, r1, r6, 1  # take a ticket
        VCLR
    spin:
        READ 0, r8, r1, r5
        ALU SEQ, r8, r8, r3
        BZ r8, spin         # until it is served
        READ 0, r8, r1, r4  # a plain read-modify-write of the counter, under the lock
        ALUI ADD, r8, r8, 1
        VSET 0, r8
        VWRITE r1, r4
        BZ r2, unlock
        VSET 0, r0
        VAPPEND r8, r2      # log who held the lock
    unlock:
        UNLOCK r3, r1, r5
        LOOP r7, loop
        HALT
"""

#: ``{rounds}`` rounds of a barrier for ``{n}`` participants in buffer r1: each round every CU
#: counts its work in word 1, arrives at word 0 and waits until the round is complete; then
#: all the round's work must be visible (else the CU jumps out of its program and halts on
#: PC_OUT_OF_RANGE).
BARRIER_ROUNDS = """
        LI r4, 0            # word 0: arrivals
        LI r5, 1            # word 1: work done
        LI r6, 0            # arrivals that complete this round
        LI r7, {rounds}
        LI r2, {n}
    loop:
        FADD r3, r1, r5, 1  # this round's work
        ALU ADD, r6, r6, r2
        FADD r3, r1, r4, 1  # arrive
    spin:
        READ 0, r3, r1, r4
        BLT r3, r6, spin
        READ 0, r3, r1, r5  # every participant's work of this round is done
        BLT r3, r6, broken
        LOOP r7, loop
        HALT
    broken:
        JMP 100000
"""


def locked_increment(n):
    """Assembly of :data:`LOCKED_INCREMENT` with ``n`` increments."""
    return LOCKED_INCREMENT.format(n=n)


def barrier_rounds(rounds, n):
    """Assembly of :data:`BARRIER_ROUNDS`: ``rounds`` rounds for ``n`` participants."""
    return BARRIER_ROUNDS.format(rounds=rounds, n=n)


async def run_system(hosts, configs, *, max_cycles=1_000_000):
    """Load each cluster's :class:`~rdakit.hdl.spec.bitstream.FabricConfig` (``configs[k]``,
    ``None`` to leave cluster ``k`` idle) through its host, start them one after the other,
    wait until all are done; returns each started cluster's run cycles. Raises
    ``RuntimeError`` naming the CUs that halted on an error."""
    started = []
    for k, config in enumerate(configs):
        if config is None:
            continue
        status, _ = await hosts[k].load(write_bitstream(config))
        if status is not LoadStatus.OK:
            raise RuntimeError(f"cluster {k} refused its bitstream: {status.name}")
        started.append(k)
    for k in started:
        await hosts[k].start()
    cycles = {}
    for k in started:
        st = await hosts[k].wait_done(max_cycles=max_cycles)
        cycles[k] = await hosts[k].run_cycles()
        if st["error"] or st["misrouted"]:
            errors = {xy: (c["error_code"], c["pc"])
                      for xy, c in (await hosts[k].counters()).items() if c.get("error")}
            raise RuntimeError(f"cluster {k}: status {st}; CUs halted on errors "
                               f"(code, pc): {errors}")
    return cycles


async def setup_buffers(hosts, job, refs=None):
    """Allocate and fill the job's buffers, each through its own cluster's host port; returns
    their references by name (in ``refs`` if given, filled as they are allocated, so that a
    caller can free those allocated before an error)."""
    refs = {} if refs is None else refs
    for b in job.buffers:
        host = hosts[b.mu[2]]
        refs[b.name] = await host.alloc(b.mu, b.weight)
        data = b.contents(refs, host.params.cu.lanes)
        if data is not None:
            await host.append_vectors(refs[b.name], data)
    return refs


async def release_buffers(hosts, job, refs):
    """Return the weight the host still holds of each of the job's buffers."""
    for b in job.buffers:
        if b.weight > b.cu_returns:
            await hosts[b.mu[2]].release(refs[b.name], b.weight - b.cu_returns)


async def run_system_job(hosts, job, *, max_cycles=1_000_000):
    """Allocate and fill the job's buffers (each through its own cluster's host port), run
    every cluster, read the outputs back and return the host's remaining weight. Returns
    ``(outputs, cycles, refs)``."""
    refs = await setup_buffers(hosts, job)
    cycles = await run_system(hosts, job.bind(refs), max_cycles=max_cycles)
    outputs = {name: await hosts[0].read_vectors(refs[name]) for name in job.outputs}
    await release_buffers(hosts, job, refs)
    return outputs, cycles, refs
