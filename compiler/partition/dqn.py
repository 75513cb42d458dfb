"""A DQN agent that assigns subgraphs to units, as in seed 3 (ATCRAD-RL), in numpy.

The environment is the partial schedule of
:class:`~rdakit.compiler.partition.greedy.SubgraphScheduler`: the graph is cut into subgraphs
(:func:`~rdakit.compiler.partition.greedy.decompose`), which are assigned one after the
other, in topological order; an action puts the current subgraph on one unit.
The *observation* of an action is a vector of :data:`FEATURES` describing that unit for that
subgraph (its load and utilization, when the inputs would be ready, when the subgraph would
finish, the transfers it would need, how much the makespan would grow...), normalized by the
graph's lower bound on the makespan, so one network serves any graph size and any number of
units. The Q-network maps an observation to ``Q(s, a)``; the agent takes the unit of largest Q.

The *reward* of a step is minus the growth of the estimated makespan of the partial schedule
(:meth:`SubgraphScheduler.estimate`, a lower bound on the makespan of any completion, which
equals the makespan once every subgraph is placed), over the graph's lower bound; an episode's
undiscounted return is thus minus its final estimated makespan, relative to the bound (plus a
constant). Training is DQN (Mnih et al., 2015) with double Q-learning targets: an MLP
Q-network, a replay buffer, a target network copied every ``target_every`` steps,
epsilon-greedy exploration decaying linearly, Huber loss, Adam, discount ``gamma``. Training
graphs are random layered DAGs (small ones, whose subgraphs are single nodes, and larger ones,
cut into chunks), grids and small workloads (MLP, decoder step, MoE), with 2 to 16 units.
Everything is deterministic from the seed.

The trained weights are saved with :meth:`DQNAgent.save` (npz) and reloaded with
:meth:`DQNAgent.load`; ``compiler/partition/data/dqn.npz`` is the agent shipped with rdakit
(:func:`train_default` rebuilds it).

The agent does not generalise beyond the unit counts it was trained on: at 64 units (4 times
its largest) it put 72-79% of the work of the benchmark's large graphs on one unit. An agent
records the unit counts it was trained on (``meta["units"]``; the shipped agent's are
:data:`TRAINED_UNITS`, the training default), and :class:`DQNPartitioner` refuses more units
than the largest of them with a :class:`~rdakit.compiler.partition.PartitionError` saying so.
"""

import dataclasses
import json
import pathlib
import time
from typing import ClassVar

import numpy as np

from rdakit.compiler import workloads
from rdakit.compiler.cost import CostModel, lower_bound
from rdakit.compiler.partition import PartitionError, Targets
from rdakit.compiler.partition.greedy import SubgraphScheduler, decompose
from rdakit.compiler.partition.wgraph import WeightedGraph

__all__ = ["FEATURES", "DQNAgent", "DQNPartitioner", "train", "train_default", "DEFAULT_WEIGHTS",
           "TRAINED_UNITS"]

#: Names of the observation features, in order (the network's input).
FEATURES = (
    "work_share", "avail", "ready", "finish_gap", "transfer", "local_bytes", "utilization",
    "makespan_growth", "progress", "is_earliest", "is_least_loaded", "finish_vs_makespan",
    "estimate_growth",
)
_VERSION = 1

#: The weights shipped with rdakit.
DEFAULT_WEIGHTS = pathlib.Path(__file__).parent / "data" / "dqn.npz"

#: The unit counts :func:`train` draws from by default (the shipped agent's).
TRAINED_UNITS = (2, 4, 8, 16)


def observe(sched, i, bound, options=None):
    """Observations of every unit for subgraph ``i``: an array ``(units, len(FEATURES))``, and
    the mask of units with capacity."""
    ready, start, finish, transfer, local, fits = sched.options(i) if options is None \
        else options
    k = sched.k
    scale = max(bound, 1.0)
    load = sched.loads + sched.busy
    grow = np.maximum(finish - sched.makespan, 0)
    x = np.empty((k, len(FEATURES)))
    x[:, 0] = sched.work[i] / max(sched.fair, 1.0)
    x[:, 1] = (sched.avail - sched.avail.min()) / scale
    x[:, 2] = (ready - ready.min()) / scale
    x[:, 3] = (finish - finish.min()) / scale
    x[:, 4] = transfer / max(transfer.max(), 1.0)
    x[:, 5] = local / max(local.sum(), 1.0)
    x[:, 6] = load / max(sched.fair, 1.0)
    x[:, 7] = grow / scale
    x[:, 8] = i / max(sched.count, 1)
    x[:, 9] = np.arange(k) == np.argmin(np.where(fits, finish, np.inf))
    x[:, 10] = np.arange(k) == np.argmin(load)
    x[:, 11] = (finish - sched.makespan) / scale
    x[:, 12] = (sched.estimate(i, (ready, start, finish, transfer, local, fits))
                - sched.estimate()) / scale
    return x, fits


class DQNAgent:
    """The Q-network (an MLP with ReLU) and its training state.

    Parameters
    ----------
    hidden : tuple of int
        Widths of the hidden layers.
    seed : int
        Seed of the initial weights.

    Members
    -------
    params : list of numpy.ndarray
        ``[W0, b0, W1, b1, ...]``; the last layer has one output, ``Q(s, a)``.
    meta : dict
        How the agent was trained (episodes, seconds, seed...).
    """

    def __init__(self, hidden=(64, 64), seed=0):
        rng = np.random.default_rng(seed)
        sizes = [len(FEATURES), *hidden, 1]
        self.params = []
        for a, b in zip(sizes, sizes[1:], strict=False):
            self.params += [rng.normal(0, np.sqrt(2 / a), (a, b)), np.zeros(b)]
        self.hidden = tuple(hidden)
        self.meta = {}

    def q(self, x, params=None):
        """Q-values of observations ``x`` (``(..., features)`` -> ``(...)``)."""
        params = self.params if params is None else params
        h = x
        for j in range(0, len(params) - 2, 2):
            h = np.maximum(h @ params[j] + params[j + 1], 0)
        return (h @ params[-2] + params[-1])[..., 0]

    def act(self, x, fits):
        """Unit of largest Q among those that fit (the lowest index among equals)."""
        q = np.where(fits, self.q(x), -np.inf)
        return int(np.argmax(q))

    def _grad(self, x, target):
        """Huber loss of ``Q(x)`` against ``target`` and its gradient."""
        acts = [x]
        h = x
        n = len(self.params)
        for j in range(0, n - 2, 2):
            h = np.maximum(h @ self.params[j] + self.params[j + 1], 0)
            acts.append(h)
        out = (h @ self.params[-2] + self.params[-1])[:, 0]
        err = out - target
        loss = np.where(np.abs(err) < 1, 0.5 * err ** 2, np.abs(err) - 0.5).mean()
        d = (np.clip(err, -1, 1) / len(x))[:, None]
        grads = [None] * n
        for j in range(n - 2, -1, -2):
            grads[j] = acts[j // 2].T @ d
            grads[j + 1] = d.sum(axis=0)
            if j:
                d = (d @ self.params[j].T) * (acts[j // 2] > 0)
        return loss, grads

    def save(self, path):
        """Write the weights and training metadata to an npz file."""
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(self.meta, features=list(FEATURES), version=_VERSION,
                    hidden=list(self.hidden))
        arrays = {f"p{j}": p.astype(np.float32) for j, p in enumerate(self.params)}
        with open(path, "wb") as f:
            np.savez_compressed(f, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)

    @classmethod
    def load(cls, path):
        """Read an agent written by :meth:`save`.

        Raises
        ------
        FileNotFoundError
            If the file does not exist.
        ValueError
            If the file was written for other observation features.
        """
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"DQN weights file {str(path)!r} does not exist")
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            params = [data[f"p{j}"].astype(float) for j in range(len(data.files) - 1)]
        if meta.get("features") != list(FEATURES):
            raise ValueError(f"DQN weights in {str(path)!r} observe features "
                             f"{meta.get('features')!r}, not {list(FEATURES)!r}")
        agent = cls(tuple(meta["hidden"]))
        agent.params = params
        agent.meta = {k: v for k, v in meta.items()
                      if k not in ("features", "version", "hidden")}
        return agent


class _Adam:
    def __init__(self, params, lr):
        self.lr, self.t = lr, 0
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]

    def step(self, params, grads, b1=0.9, b2=0.999):
        self.t += 1
        for p, g, m, v in zip(params, grads, self.m, self.v, strict=True):
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            p -= self.lr * (m / (1 - b1 ** self.t)) / (np.sqrt(v / (1 - b2 ** self.t)) + 1e-8)


class _Replay:
    """Transitions ``(x, reward, next observations, next mask, done)``; next observations are
    padded to ``kmax`` units."""

    def __init__(self, size, kmax, rng):
        f = len(FEATURES)
        self.x = np.zeros((size, f))
        self.r = np.zeros(size)
        self.nx = np.zeros((size, kmax, f))
        self.nmask = np.zeros((size, kmax), dtype=bool)
        self.done = np.zeros(size, dtype=bool)
        self.size, self.n, self.i, self.rng = size, 0, 0, rng

    def add(self, x, r, nx, nmask, done):
        j = self.i
        self.x[j], self.r[j], self.done[j] = x, r, done
        self.nmask[j] = False
        if not done:
            k = len(nx)
            self.nx[j, :k] = nx
            self.nmask[j, :k] = nmask
        self.i = (j + 1) % self.size
        self.n = min(self.n + 1, self.size)

    def sample(self, batch):
        j = self.rng.integers(0, self.n, size=batch)
        return self.x[j], self.r[j], self.nx[j], self.nmask[j], self.done[j]


def _episode_graphs(rng, cost):
    """An endless stream of training graphs: random DAGs and small workloads."""
    wl = [workloads.mlp(batch=2, sizes=(32, 64, 32)),
          workloads.decoder_step(d_model=32, heads=4, d_ff=64, cache_len=4),
          workloads.moe(tokens=8, d_model=16, d_ff=32, experts=4, k=2)]
    fixed = [WeightedGraph.from_dataflow(w.graph, cost) for w in wl]
    while True:
        r = rng.random()
        if r < 0.2:
            yield fixed[int(rng.integers(len(fixed)))]
        elif r < 0.7:
            yield WeightedGraph.random_layered(int(rng.integers(4, 16)), int(rng.integers(3, 12)),
                                               degree=int(rng.integers(1, 4)),
                                               seed=int(rng.integers(1 << 30)))
        elif r < 0.85:
            # Larger than the subgraph budget: the agent also sees chunks of many nodes.
            yield WeightedGraph.random_layered(int(rng.integers(10, 40)),
                                               int(rng.integers(10, 40)),
                                               degree=int(rng.integers(1, 4)),
                                               seed=int(rng.integers(1 << 30)))
        else:
            yield WeightedGraph.grid(int(rng.integers(6, 30)), int(rng.integers(6, 30)))


def train(*, episodes=800, seed=0, cost=None, hidden=(64, 64), lr=1e-3, gamma=0.9,
          batch=64, buffer=20000, target_every=250, train_every=2, eps_start=1.0,
          eps_end=0.05, subgraphs_per_unit=8, units=TRAINED_UNITS, graphs=None):
    """Train a :class:`DQNAgent` on the cost model.

    Parameters
    ----------
    episodes : int
        Episodes (one graph partitioned onto a number of units each).
    seed : int
        Seed of everything (network, exploration, graphs).
    cost : CostModel, optional
        Cost model of the environment.
    hidden, lr, gamma, batch, buffer, target_every, train_every : optional
        Network widths, Adam's step size, discount, minibatch size, replay size, steps between
        target-network copies, steps between updates.
    eps_start, eps_end : float
        Exploration rate, decaying linearly over the first 80% of the episodes.
    subgraphs_per_unit : int
        :func:`decompose` granularity.
    units : sequence of int
        Numbers of units to draw from.
    graphs : iterable of WeightedGraph, optional
        Training graphs (default: random layered DAGs, grids and small workloads).

    Returns
    -------
    DQNAgent
        With ``meta`` holding the episodes, seconds and the mean return of the last tenth.
    """
    cost = CostModel() if cost is None else cost
    rng = np.random.default_rng(seed)
    agent = DQNAgent(hidden, seed=seed)
    target = [p.copy() for p in agent.params]
    opt = _Adam(agent.params, lr)
    memory = _Replay(buffer, max(units), rng)
    stream = iter(graphs) if graphs is not None else _episode_graphs(rng, cost)
    t0 = time.perf_counter()
    steps = 0
    returns = []
    for ep in range(episodes):
        eps = max(eps_end, eps_start - (eps_start - eps_end) * ep / max(1, 0.8 * episodes))
        wg = next(stream)
        k = int(rng.choice(units))
        sched = SubgraphScheduler(wg, Targets(k), cost, decompose(wg, subgraphs_per_unit * k))
        bound = lower_bound(wg, k)
        todo = [i for i in range(sched.count) if not sched.deferred[i]]
        total = 0.0
        x, fits = observe(sched, todo[0], bound) if todo else (None, None)
        for step, i in enumerate(todo):
            if rng.random() < eps:
                a = int(rng.choice(np.flatnonzero(fits)))
            else:
                a = agent.act(x, fits)
            before = sched.estimate()
            sched.assign(i, a)
            r = -(sched.estimate() - before) / max(bound, 1.0)
            total += r
            done = step == len(todo) - 1
            if done:
                memory.add(x[a], r, None, None, True)
            else:
                nx, nfits = observe(sched, todo[step + 1], bound)
                memory.add(x[a], r, nx, nfits, False)
                x, fits = nx, nfits
            steps += 1
            if memory.n >= batch and steps % train_every == 0:
                bx, br, bnx, bmask, bdone = memory.sample(batch)
                # Double DQN: the online network picks the next action, the target values it.
                best = np.where(bmask, agent.q(bnx), -np.inf).argmax(axis=1)
                qn = agent.q(bnx[np.arange(batch), best], target)
                y = br + gamma * np.where(bdone, 0.0, qn)
                _, grads = agent._grad(bx, y)
                opt.step(agent.params, grads)
            if steps % target_every == 0:
                target = [p.copy() for p in agent.params]
        returns.append(total)
    tail = returns[-max(1, episodes // 10):]
    agent.meta = {"episodes": episodes, "seed": seed, "steps": steps,
                  "seconds": round(time.perf_counter() - t0, 3),
                  "final_mean_return": round(float(np.mean(tail)), 4),
                  "subgraphs_per_unit": subgraphs_per_unit,
                  "units": sorted(int(u) for u in units)}
    return agent


def train_default(path=DEFAULT_WEIGHTS, **options):
    """Train the shipped agent (fixed seed) and save it to ``path``."""
    agent = train(**options)
    agent.save(path)
    return agent


@dataclasses.dataclass(frozen=True)
class DQNPartitioner:
    """Partition with a trained :class:`DQNAgent` (greedy policy, no exploration).

    Parameters
    ----------
    agent : DQNAgent, optional
        The agent; default: the one in ``weights``.
    weights : str or pathlib.Path, optional
        An npz file written by :meth:`DQNAgent.save`; default :data:`DEFAULT_WEIGHTS`.
    cost : CostModel
        Cost model of the environment.
    subgraphs_per_unit : int or None
        :func:`decompose` granularity (default: the agent's training granularity).
    """

    name: ClassVar[str] = "dqn"
    agent: DQNAgent | None = dataclasses.field(default=None, compare=False)
    weights: str | pathlib.Path | None = None
    cost: CostModel = CostModel()
    subgraphs_per_unit: int | None = None

    def __post_init__(self):
        if self.agent is None:
            path = DEFAULT_WEIGHTS if self.weights is None else pathlib.Path(self.weights)
            try:
                agent = DQNAgent.load(path)
            except FileNotFoundError:
                raise PartitionError(
                    f"DQN weights file {str(path)!r} does not exist; train one with "
                    f"rdakit.compiler.partition.dqn.train_default()") from None
            object.__setattr__(self, "agent", agent)

    def trained_units(self):
        """The unit counts the agent was trained on (:data:`TRAINED_UNITS` for an agent saved
        before they were recorded)."""
        return tuple(self.agent.meta.get("units", TRAINED_UNITS))

    def check_units(self, k):
        """Raise :class:`PartitionError` if ``k`` units are more than the agent was trained
        for."""
        trained = self.trained_units()
        if k > max(trained):
            raise PartitionError(
                f"The DQN agent was trained on {', '.join(map(str, trained))} units and does "
                f"not generalise to {k} (it loads one unit with most of the work); use at most "
                f"{max(trained)} units, another strategy, or train an agent with "
                f"rdakit.compiler.partition.dqn.train(units=...)")

    def partition(self, graph, targets):
        k = targets.count
        self.check_units(k)
        per_unit = self.subgraphs_per_unit or self.agent.meta.get("subgraphs_per_unit", 8)
        sched = SubgraphScheduler(graph, targets, self.cost, decompose(graph, per_unit * k))
        bound = lower_bound(graph, k, targets.loads)
        for i in range(sched.count):
            if sched.deferred[i]:
                continue
            options = sched.options(i)
            x, fits = observe(sched, i, bound, options)
            sched.assign(i, self.agent.act(x, fits), options)
        return sched.parts()
