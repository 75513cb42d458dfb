"""``rdakit run --clusters N``: a workload compiled across clusters, run on the RTL system in
Amaranth's simulator, checked, and adapted at run time (seed 2's monitoring).

Each iteration compiles the workload with :func:`~rdakit.compiler.system_compile.compile_system`
for the current cluster specs, loads every cluster's bitstream, fills the inputs, starts the
clusters together, waits for all, reads the outputs and every tile's counters, compares the
outputs bit-exactly with numpy and checks that every MU of every cluster is empty again.

A cluster given an *injected load* of ``D`` cycles is busy with other work first: every one of
its CU programs is prefixed with a loop that spins ``D`` cycles (:func:`inject_load`; the
program's branch targets are moved past it, the register it counts in restored after it). The
compiler is not told. (Delaying the cluster's START instead would not do: START clears a CU's
tokens and mailbox, so tokens sent to it earlier would be lost.)

Then the monitor measures each cluster's *busy time*: the longest time one of its CUs was busy
with work (``busy_cycles - wait_cycles``: running, but not waiting for a token or reference
from another CU; the injected loop counts). Measured cycles are several times the cost
model's estimates (MU round trips, NoC and link latency), so the monitor first calibrates: the
cluster that ran fastest relative to its work sets the model-to-RTL ratio, and every cluster's
busy time is divided by it. :func:`~rdakit.compiler.partition.clusters.observed_clusters` then
turns the difference between calibrated time and the work given into a load, and the next
iteration's partition sees it: work moves away from a cluster that turned out slower than the
compiler thought.
"""

import dataclasses

import numpy as np

from rdakit.compiler.partition.clusters import ClusterSpec, observed_clusters
from rdakit.compiler.system_compile import compile_system, system_view
from rdakit.hdl.cluster.system import System
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.isa import Instr, Op, decode
from rdakit.sim.flows.e2e import cycle_budget
from rdakit.sim.runtime.clusters import release_buffers, run_system, setup_buffers
from rdakit.sim.runtime.counters import read_mu_counters
from rdakit.sim.runtime.host import AmaranthTransport, HostDriver, HostError, NoReply
from rdakit.sim.runtime.job import abandon
from rdakit.sim.verify.amaranth_sim import simulate

#: How far below the measured cycles a system's estimate may be (``docs/clusters.md``: 4.5 to
#: 26 times), for the cycle budget.
ESTIMATE_SLACK = 5

__all__ = ["SystemRunSpec", "run_system_session", "run_compiled", "check_outputs",
           "inject_load", "busy_times", "calibrated"]


@dataclasses.dataclass
class SystemRunSpec:
    """What ``rdakit run --clusters`` runs.

    Members
    -------
    workload, sizes :
        As :class:`~rdakit.sim.flows.e2e.RunSpec`'s.
    system : SystemParams
    cus : list of int or None
        CUs each cluster offers the compiler (default: all of them).
    strategy, inner : str
        Cross-cluster and within-cluster partitioners.
    iterations : int
        Runs; after each but the last the clusters' observed loads are fed back.
    delays : dict
        Cluster -> injected load (cycles its CUs spin before their programs; unknown to the
        compiler).
    seed, place_steps :
        The buffer placement.
    max_cycles : int or None
        Cycles after which a run that is not done counts as hung; ``None`` (the default) is
        :func:`~rdakit.sim.flows.e2e.cycle_budget` of the iteration's estimate times
        :data:`ESTIMATE_SLACK` (the system's estimates are up to 26 times low,
        ``docs/clusters.md``) plus the injected loads.
    """

    workload: str
    system: object
    sizes: dict = dataclasses.field(default_factory=dict)
    cus: list | None = None
    strategy: str = "greedy"
    inner: str = "multilevel"
    iterations: int = 1
    delays: dict = dataclasses.field(default_factory=dict)
    seed: int = 0
    place_steps: int = 20000
    max_cycles: int | None = None

    def __post_init__(self):
        n = self.system.clusters
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise ValueError(f"iterations must be a positive integer, not {self.iterations!r}")
        for c, d in self.delays.items():
            if not (isinstance(c, int) and 0 <= c < n):
                raise ValueError(f"an injected load names cluster {c!r}, but the system has "
                                 f"clusters 0 to {n - 1}")
            if not isinstance(d, int) or d < 0:
                raise ValueError(f"the injected load of cluster {c} must be a number of cycles "
                                 f">= 0, not {d!r}")
        if self.cus is not None and len(self.cus) != n:
            raise ValueError(f"cus must give one number per cluster ({n}), not {self.cus!r}")
        system_view(self.system)   # the compiler's view of the system must exist

    def budget(self, estimate):
        """Cycles an iteration estimated at ``estimate`` cycles may run before it counts as
        hung."""
        if self.max_cycles is not None:
            return self.max_cycles
        return cycle_budget(ESTIMATE_SLACK * max(1, int(estimate))) + sum(self.delays.values())

    def compile(self, clusters):
        """:func:`~rdakit.compiler.system_compile.compile_system` for ``clusters``."""
        return compile_system(self.workload, self.system, sizes=self.sizes, clusters=clusters,
                              strategy=self.strategy, inner=self.inner, seed=self.seed,
                              place_steps=self.place_steps)

    def cluster_specs(self):
        cus = self.cus or [len(self.system.fabric.tiles("C"))] * self.system.clusters
        return [ClusterSpec(int(k)) for k in cus]


#: Branches whose ``imm`` is a program address (moved by :func:`inject_load`).
_BRANCHES = ("JMP", "BNZ", "BZ", "BLT", "LOOP")

#: The register the injected loop counts in (restored to its initial value after the loop).
_LOAD_REG = 15


def inject_load(config, cycles):
    """``config`` (a FabricConfig) with every CU program prefixed by ``LOOP r15, 0`` run
    ``cycles`` times (r15 starts at ``cycles``) and ``LI r15, <its initial value>``: the CUs
    are busy for ``cycles`` cycles before their own work. Branch targets move by 2.

    Raises
    ------
    ValueError
        If ``cycles`` is not a positive integer below 2**31 or a program has no room for the
        two instructions."""
    if not isinstance(cycles, int) or not 0 < cycles < 1 << 31:
        raise ValueError(f"an injected load must be from 1 to 2**31 - 1 cycles, not {cycles!r}")
    prog_len = config.params.cu.prog_len
    tiles = {}
    for xy, tile in config.tiles.items():
        if not tile.enabled:
            tiles[xy] = tile
            continue
        if len(tile.program) + 2 > prog_len:
            raise ValueError(f"tile {xy}: no room for the injected load's 2 instructions "
                             f"({len(tile.program)} of prog_len {prog_len} used)")
        program = [Instr(Op.LOOP, ra=_LOAD_REG, imm=0),
                   Instr(Op.LI, rd=_LOAD_REG, imm=tile.regs.get(_LOAD_REG, 0))]
        for w in tile.words():
            ins = decode(w)
            if ins.op.name in _BRANCHES:
                ins = dataclasses.replace(ins, imm=ins.imm + 2)
            program.append(ins)
        tiles[xy] = TileConfig(program, {**tile.regs, _LOAD_REG: cycles}, tile.local)
    return FabricConfig(config.params, tiles)


def busy_times(counters, n, ran):
    """Each cluster's busy time: the most cycles one of its CUs spent on work (``busy -
    wait``); 0 for a cluster not in ``ran`` (its counters are an earlier run's) or whose CUs
    did nothing."""
    out = []
    for c in range(n):
        if c not in ran:
            out.append(0)
            continue
        own = [t["busy_cycles"] - t["wait_cycles"] for t in counters[c].values()
               if "wait_cycles" in t and t["busy_cycles"]]
        out.append(max(own) if own else 0)
    return out


def calibrated(work, times, cus):
    """``times`` in the cost model's units. A cluster's time is its busiest CU's, so it is
    compared with its work per CU (``work / cus``); the smallest ratio of time to work per CU
    over the clusters that got work is taken as running as modelled, and every time is
    divided by it."""
    work = np.asarray(work, dtype=float)
    times = np.asarray(times, dtype=float)
    cus = np.maximum(np.asarray(cus, dtype=float), 1)
    busy = (work > 0) & (times > 0)
    if not busy.any():
        return times
    ratio = float(np.min(times[busy] / (work[busy] / cus[busy])))
    return times / ratio


async def run_compiled(hosts, system_job, *, delays=None, max_cycles=2_000_000):
    """Run a compiled :class:`~rdakit.sim.runtime.clusters.SystemJob` on any simulator (``hosts``:
    one HostDriver per cluster): set up the buffers, run every cluster (``run_system``; a CU
    error raises RuntimeError), read the outputs and counters, release the host's weight.
    ``delays``: cluster -> injected load (:func:`inject_load`). Returns ``(outputs, cycles,
    counters, live buffers per cluster)``. On any error every cluster's CUs are stopped and
    the buffers the host allocated freed (:func:`~rdakit.sim.runtime.job.abandon`) before it
    is raised."""
    refs = {}
    live_before = [await read_mu_counters(h, ["live_buffers"]) for h in hosts]
    try:
        refs = await setup_buffers(hosts, system_job, refs)
        delays = delays or {}
        configs = [inject_load(c, delays[k]) if c is not None and delays.get(k) else c
                   for k, c in enumerate(system_job.bind(refs))]
        cycles = await run_system(hosts, configs, max_cycles=max_cycles)
        counters = [await h.counters() for h in hosts]
        outputs = {name: await hosts[0].read_vectors(refs[name])
                   for name in system_job.outputs}
        await release_buffers(hosts, system_job, refs)
    except NoReply:
        raise
    except Exception as e:
        try:
            for k, h in enumerate(hosts):
                mine = [refs[b.name] for b in system_job.buffers
                        if b.name in refs and b.mu[2] == k]
                left = await abandon(h, mine, live_before[k])
                if left:
                    e.add_note(f"cluster {k}: {left}")
        except Exception as cleanup:
            e.add_note(f"cleaning up after the job failed too: {cleanup}")
        raise
    live = [sum(t.get("live_buffers", 0) for t in (await h.counters()).values()) for h in hosts]
    return outputs, cycles, counters, live


def run_system_session(spec, *, progress=None):
    """Run ``spec`` on the RTL system in Amaranth's simulator; return one row per iteration:
    ``cycles`` (the last cluster's finish), per cluster ``finish`` (its run cycles),
    ``busy``, ``work`` (the estimate of the work given), ``cus_used``, the cluster ``loads``
    the compiler assumed, ``estimated_cycles``, ``crossing_bytes``, ``cut_edges``,
    ``link_packets``, ``numpy`` (``ok`` or what differs), ``leaked_buffers`` and ``hw_error``."""
    progress = progress or (lambda stage, done=None, total=None: None)
    sp = spec.system
    n = sp.clusters
    specs = spec.cluster_specs()
    progress("iteration 1: compiling")
    first = spec.compile(specs)     # before the build: a workload that does not fit fails fast
    system = System(sp)
    rows = []

    async def tb(ctx):
        nonlocal specs
        hosts = [HostDriver(sp.fabric, AmaranthTransport(ctx, system.host_port(k)),
                            clusters=n, cluster=k) for k in range(n)]
        for it in range(spec.iterations):
            if it:
                progress(f"iteration {it + 1}: compiling")
            cs = spec.compile(specs) if it else first
            row = {"iteration": it + 1, **cs.row()}
            links0 = [int(ctx.get(system.req_packets[k])) + int(ctx.get(system.rsp_packets[k]))
                      for k in range(n)]
            progress(f"iteration {it + 1}: running")
            try:
                outputs, cycles, counters, live = await run_compiled(
                    hosts, cs.system_job, delays=spec.delays,
                    max_cycles=spec.budget(row.get("estimated_cycles") or 1))
            except (RuntimeError, HostError, TimeoutError) as e:
                message = " ".join([str(e), *getattr(e, "__notes__", ())])
                row.update(cycles=None, numpy="not run", hw_error=message, leaked_buffers=0)
                rows.append(row)
                return
            finish = [cycles.get(k, 0) for k in range(n)]
            busy = busy_times(counters, n, cycles)
            row.update(
                cycles=max(finish), finish=finish, busy=busy,
                link_packets=sum(int(ctx.get(system.req_packets[k]))
                                 + int(ctx.get(system.rsp_packets[k])) - links0[k]
                                 for k in range(n)),
                numpy=check_outputs(cs.system_job, outputs), leaked_buffers=sum(live),
                hw_error=None)
            rows.append(row)
            if it + 1 < spec.iterations:
                work = list(cs.partition.work)
                specs = observed_clusters(specs, work,
                                          calibrated(work, busy, row["cus_used"]))

    simulate(system, tb)
    return rows


def check_outputs(system_job, outputs):
    """``"ok"`` if every output equals numpy's bit for bit, else what differs."""
    for name, want in system_job.expected.items():
        got = outputs[name]
        if got.shape != want.shape:
            return f"{name}: shape {got.shape}, numpy's {want.shape}"
        if not np.array_equal(got, want):
            return f"{name}: {int(np.sum(got != want))} words differ from numpy"
    return "ok"
