"""Run-time adaptation: fold measured per-CU costs back into the cost model and re-partition.

After a run, the host reads every CU's counters (``busy_cycles`` and ``wait_cycles``,
docs/compute-unit.md). :func:`measured_cost` compares each CU's *working* cycles (busy minus
the cycles stalled in WAIT/RECV on another CU: instructions, streams and the memory stalls of
its own requests) with what the cost model predicted for the graph nodes lowered onto it, and
returns a :class:`MeasuredCostModel` whose node costs are scaled by that ratio. The next
compilation partitions with it, so nodes that proved more expensive than predicted (long
instruction sequences, reductions, far MUs) weigh more and the partitioner rebalances them
(seeds 2 and 3: run-time monitoring feeding re-partitioning).

Waits for tokens and references are left out of the measured cost on purpose: a CU waiting for
another CU is idle, and charging its nodes for it would move work away from the waiting CU
instead of from the one it waits for. Within a CU the ratio is spread evenly over its nodes
(the counters are per CU, not per op).
"""

import dataclasses
import math

from rdakit.compiler.cost import CostModel

__all__ = ["MeasuredCostModel", "measured_cost"]


@dataclasses.dataclass(frozen=True)
class MeasuredCostModel(CostModel):
    """A :class:`~rdakit.compiler.cost.CostModel` whose op cycles are the base model's scaled
    by a measured factor per graph node.

    ``samples`` holds ``(node, sum of log ratios, runs)``: each run of a node on some CU adds
    the log of that CU's measured over predicted (base-model) cycles; the node's factor is the
    geometric mean over its runs. Averaging, rather than multiplying corrections run after run,
    keeps the model from oscillating when nodes move between CUs. Nodes never measured keep
    factor 1.
    """

    samples: tuple = ()

    def __post_init__(self):
        super().__post_init__()
        factors = {}
        for node, log_sum, runs in self.samples:
            if not isinstance(runs, int) or runs < 1:
                raise ValueError(f"Runs of node {node!r} must be a positive integer, not "
                                 f"{runs!r}")
            factors[node] = math.exp(log_sum / runs)
        object.__setattr__(self, "_factors", factors)

    def op_cycles(self, graph, node):
        base = super().op_cycles(graph, node)
        if base == 0:
            return 0
        return max(1, int(round(base * self._factors.get(node, 1.0))))

    def factor(self, node):
        """The node's measured factor (1 if never measured)."""
        return self._factors.get(node, 1.0)


def _nodes_by_cu(job):
    out = {}
    for _name, _kind, cu, nodes in job.lowered:
        out.setdefault(tuple(cu), []).extend(nodes)
    return out


def measured_cost(cost, job, counters):
    """The cost model for the next partitioning, from the counters of a run of ``job``.

    Parameters
    ----------
    cost : CostModel
        The model ``job`` was compiled with (a :class:`MeasuredCostModel` after the first
        iteration: its samples are kept and this run's are added).
    job : CompiledJob
        The job that ran (its ``lowered`` list maps graph nodes to CUs).
    counters : dict
        ``{(x, y): {"busy_cycles": ..., "wait_cycles": ..., ...}}`` as read by
        :meth:`~rdakit.sim.runtime.host.HostDriver.counters`.

    Returns
    -------
    (MeasuredCostModel, list of dict)
        The new model and one row per CU: cycles predicted by the base model and by ``cost``,
        cycles measured, and the measured ratio.
    """
    graph = job.graph
    fields = {f.name: getattr(cost, f.name) for f in dataclasses.fields(CostModel)}
    base = CostModel(**fields)
    samples = {node: (log_sum, runs) for node, log_sum, runs in getattr(cost, "samples", ())}
    rows = []
    for cu, nodes in sorted(_nodes_by_cu(job).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if cu not in counters:
            raise ValueError(f"No counters for CU {cu}")
        c = counters[cu]
        measured = max(0, c["busy_cycles"] - c["wait_cycles"])
        predicted = sum(base.op_cycles(graph, n) for n in nodes)
        if not predicted or not measured:
            continue
        ratio = measured / predicted
        for n in nodes:
            log_sum, runs = samples.get(n, (0.0, 0))
            samples[n] = (log_sum + math.log(ratio), runs + 1)
        rows.append({"cu": f"{cu}", "nodes": len(nodes), "predicted_base": predicted,
                     "predicted": sum(cost.op_cycles(graph, n) for n in nodes),
                     "measured": measured, "busy": c["busy_cycles"],
                     "waiting": c["wait_cycles"], "ratio": ratio})
    model = MeasuredCostModel(**fields, samples=tuple(
        (n, ls, r) for n, (ls, r) in sorted(samples.items(), key=lambda kv: str(kv[0]))))
    return model, rows
