"""The DQN agent: deterministic training, weights saved and reloaded, the shipped agent."""

import json

import numpy as np
import pytest

from rdakit.compiler import workloads
from rdakit.compiler.cost import CostModel, lower_bound
from rdakit.compiler.partition import PartitionError, Targets, dqn, partition
from rdakit.compiler.partition.greedy import SubgraphScheduler, decompose
from rdakit.compiler.partition.wgraph import WeightedGraph


def tiny_training(seed=0):
    graphs = [WeightedGraph.random_layered(5, 4, seed=s) for s in range(1000)]
    return dqn.train(episodes=6, seed=seed, batch=8, graphs=iter(graphs), units=(2, 3))


def test_training_is_deterministic():
    a, b = tiny_training(), tiny_training()
    assert all(np.array_equal(p, q) for p, q in zip(a.params, b.params, strict=True))
    c = tiny_training(seed=1)
    assert not np.array_equal(a.params[0], c.params[0])
    assert a.meta["episodes"] == 6 and a.meta["steps"] > 0


def test_save_and_reload(tmp_path):
    agent = tiny_training()
    path = tmp_path / "agent.npz"
    agent.save(path)
    loaded = dqn.DQNAgent.load(path)
    x = np.random.default_rng(0).normal(size=(5, len(dqn.FEATURES)))
    assert np.allclose(agent.q(x), loaded.q(x), rtol=1e-5, atol=1e-5)
    assert loaded.meta["episodes"] == 6
    g = WeightedGraph.random_layered(6, 5, seed=9)
    a = partition(g, Targets(3), "dqn", agent=loaded).parts
    b = partition(g, Targets(3), "dqn", weights=path).parts
    assert np.array_equal(a, b)


def test_reload_rejects_other_features(tmp_path):
    path = tmp_path / "other.npz"
    with open(path, "wb") as f:
        np.savez(f, meta=np.array(json.dumps({"features": ["a"], "hidden": [4]})),
                 p0=np.zeros((1, 4)), p1=np.zeros(4), p2=np.zeros((4, 1)), p3=np.zeros(1))
    with pytest.raises(ValueError, match="observe features \\['a'\\]"):
        dqn.DQNAgent.load(path)


def test_missing_weights(tmp_path):
    missing = tmp_path / "none.npz"
    with pytest.raises(PartitionError, match=f"^DQN weights file '{missing}' does not exist; "
                                             f"train one with "):
        dqn.DQNPartitioner(weights=missing)


def test_shipped_agent_partitions_workloads():
    assert dqn.DEFAULT_WEIGHTS.is_file()
    agent = dqn.DQNAgent.load(dqn.DEFAULT_WEIGHTS)
    assert agent.meta["episodes"] > 0
    wl = workloads.mixtral(tokens=16, d_model=16, d_ff=32)
    r = partition(wl.graph, Targets(4), "dqn")
    assert set(r.assignment()) == set(wl.graph.nx.nodes)
    assert r.makespan >= r.lower_bound


def test_observation_and_reward_definition():
    g = WeightedGraph.random_layered(4, 3, seed=2)
    cost = CostModel()
    sched = SubgraphScheduler(g, Targets(2), cost, decompose(g, 64))
    bound = lower_bound(g, 2)
    first = next(i for i in range(sched.count) if not sched.deferred[i])
    x, fits = dqn.observe(sched, first, bound)
    assert x.shape == (2, len(dqn.FEATURES)) and fits.all()
    after = sched.estimate(first)
    sched.assign(first, 1)
    assert sched.estimate() == pytest.approx(after[1])
    # Once everything is placed, the estimate is the makespan of the partial schedule.
    for i in range(sched.count):
        if sched.unit[i] < 0 and not sched.deferred[i]:
            sched.assign(i, 0)
    assert sched.estimate() == sched.makespan
