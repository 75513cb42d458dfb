"""``rdakit bench partition``: every partitioner on workloads, random DAGs and grids.

Two tables and a few headline figures (through :class:`rdakit.sim.bench.report.Report`):

``partition``
    One row per graph and partitioner: nodes, edges, units ``k``, ``cut`` (bytes; unit weights
    on the synthetic graphs), ``ref_cut`` (the known optimal or reference cut where there is
    one: :meth:`WeightedGraph.known_cut`), ``vs_metis`` (cut over METIS's cut),
    ``imbalance``, ``seconds`` (wall time of the strategy alone), the estimated ``makespan`` and
    its ``lower_bound``, and whether the quotient graph is ``acyclic``.
``makespan``
    On the workloads: the estimated makespan of the DQN agent beside the cost-based greedy,
    HEFT, round-robin and static (and the cut partitioners), over the lower bound.

Figures: ``dqn_train_seconds``, ``dqn_train_episodes``; ``grid_100k_k64_multilevel_seconds``
and ``_cut`` with ``grid_100k_k64_metis_cut`` (full run only); ``multilevel_vs_metis_geomean``
(geometric mean of the multilevel/METIS cut ratio over the graphs where both meet the balance
tolerance) and ``multilevel_within_5pct_of_metis`` (how many of those graphs);
``auto_vs_mtkahypar_worst`` and ``auto_within_5pct_of_mtkahypar`` (the default ``auto`` against
Mt-KaHyPar where both meet the balance rule), and the same two over the model suite's graphs
alone, ``models_auto_vs_mtkahypar_worst`` and ``models_auto_within_5pct_of_mtkahypar``.

The graphs come in families (:data:`FAMILIES`, ``--family``, each row's ``family``): the
built-in workloads (``workload``), the model suite's exported and imported graphs (``model``:
GPT-2, BERT, Mixtral and ResNet; left out, saying so in one printed line, when PyTorch cannot be
imported), transformer-shaped graphs (``transformer``), a ``path``, a layered ``chain``, random
layered DAGs (``dag``) and 2-D grids (``grid``).

With ``graph`` (``--graph FILE``), a user's graph alone, into each of ``units``
(``--units``), the shipped DQN agent instead of one trained for the run.
"""

import math
import time

import numpy as np

from rdakit.compiler import workloads
from rdakit.compiler.cost import CostModel
from rdakit.compiler.partition import (
    PartitionError,
    Targets,
    dqn,
    get_strategy,
    measure,
    run_strategy,
)
from rdakit.compiler.partition.balance import within_limits
from rdakit.compiler.partition.external import mtkahypar_missing
from rdakit.compiler.partition.wgraph import WeightedGraph
from rdakit.errors import UserError
from rdakit.sim.bench import models as model_bench
from rdakit.sim.bench.report import Report

__all__ = ["run", "graphs", "model_graphs", "PARTITIONERS", "FAMILIES", "MODEL_UNITS"]

#: Partitioners in table order.
PARTITIONERS = ("auto", "multilevel", "metis", "mtkahypar", "greedy", "dqn", "heft",
                "round_robin", "static")
EPS = 0.03
#: The families of graphs, in table order (``--family`` takes a subset).
FAMILIES = ("workload", "model", "transformer", "path", "chain", "dag", "grid")
#: Units each of the model suite's graphs is partitioned into.
MODEL_UNITS = (4, 16, 64)


def graphs(quick, cost):
    """The benchmark's synthetic graphs and workloads: ``(family, WeightedGraph, k)`` triples
    (the model suite's are :func:`model_graphs`')."""
    out = []
    if quick:
        sizes = {"mlp": [dict(batch=4, sizes=(64, 128, 64))],
                 "decoder": [dict(d_model=32, heads=4, d_ff=64, cache_len=8)],
                 "mixtral": [dict(tokens=16, d_model=32, d_ff=64)],
                 "switch": [dict(tokens=16, d_model=32, d_ff=64)]}
        for name, options in sizes.items():
            for o in options:
                out.append(("workload", WeightedGraph.from_dataflow(
                    workloads.build(name, **o).graph, cost), 4))
        out += [("transformer", WeightedGraph.transformer(2, 256, 64, 4), 16),
                ("path", WeightedGraph.path(1000), 8),
                ("chain", WeightedGraph.layered_chain(24, 6), 4),
                ("dag", WeightedGraph.random_layered(20, 50, seed=1), 8),
                ("grid", WeightedGraph.grid(32, 32), 8)]
        return out
    sizes = {"mlp": [dict(batch=8, sizes=(128, 256, 256, 128)),
                     dict(batch=32, sizes=(256, 512, 512, 512, 256))],
             "decoder": [dict(d_model=64, heads=4, d_ff=128, cache_len=16),
                         dict(d_model=128, heads=8, d_ff=512, cache_len=64)],
             "mixtral": [dict(tokens=32, d_model=64, d_ff=128),
                         dict(tokens=128, d_model=128, d_ff=256)],
             "switch": [dict(tokens=64, d_model=64, d_ff=128, experts=16)]}
    for name, options in sizes.items():
        for o in options:
            g = WeightedGraph.from_dataflow(workloads.build(name, **o).graph, cost)
            out += [("workload", g, 4), ("workload", g, 16)]
    for g in (WeightedGraph.transformer(2, 768, 128, 12),
              WeightedGraph.transformer(12, 768, 128, 12),
              WeightedGraph.transformer(2, 256, 64, 4, experts=8),
              WeightedGraph.transformer(4, 512, 128, 8, experts=8)):
        out += [("transformer", g, 4), ("transformer", g, 16), ("transformer", g, 64)]
    out += [("path", WeightedGraph.path(10000), 16),
            ("chain", WeightedGraph.layered_chain(64, 16), 8),
            ("dag", WeightedGraph.random_layered(20, 50, seed=1), 8),
            ("dag", WeightedGraph.random_layered(100, 100, seed=2), 16),
            ("dag", WeightedGraph.random_layered(200, 500, seed=3), 64)]
    for r, c in ((32, 32), (100, 100), (316, 316)):
        out += [("grid", WeightedGraph.grid(r, c), 8), ("grid", WeightedGraph.grid(r, c), 64)]
    return out


def model_graphs(quick, cost):
    """The model suite's graphs, each into :data:`MODEL_UNITS`: ``(cases, said)``.

    Each model (:data:`rdakit.compiler.frontend.models.MODELS`) is exported as ``rdakit bench
    models`` exports it (:func:`rdakit.sim.bench.models.export`, the :data:`QUICK
    <rdakit.sim.bench.models.QUICK>` sizes with ``quick``), imported
    (:func:`~rdakit.compiler.frontend.importer.import_program`) and its workload's graph weighed
    by ``cost``. ``cases`` are ``("model", WeightedGraph, k)`` triples; ``said`` lists one line
    per model left out (all of them, in one line, when PyTorch cannot be imported).
    """
    try:
        # Deferred: the suite imports torch (optional: rdakit[torch]).
        from rdakit.compiler.frontend import models as suite
        from rdakit.compiler.frontend.importer import import_program
    except ImportError as e:
        return [], [f"model graphs left out: PyTorch cannot be imported ({e}); "
                    f"pip install 'rdakit[torch]'"]
    cases, said = [], []
    for name in suite.MODELS:
        program, inputs = model_bench.export(name, quick=quick)
        try:
            workload = import_program(program, inputs, name=name).workload()
        except UserError as e:
            said.append(f"model graph {name} left out: the importer refused it: {e}")
            continue
        g = WeightedGraph.from_dataflow(workload.graph, cost)
        cases += [("model", g, k) for k in MODEL_UNITS]
    return cases, said


def _auto_vs_mtkahypar(g, targets, results):
    """``auto``'s cut over Mt-KaHyPar's when both meet the balance rule (and Mt-KaHyPar ran
    and cut something), else None."""
    mk, auto = results.get("mtkahypar"), results["auto"]
    if mk is not None and mk.cut > 0 and all(within_limits(g, targets, r.parts, EPS)
                                             for r in (mk, auto)):
        return auto.cut / mk.cut
    return None


def _vs_mtkahypar_figures(report, prefix, ratios):
    """The worst ``auto`` / Mt-KaHyPar ratio of ``ratios`` and how many are within 5 %, as
    figures ``<prefix>auto_vs_mtkahypar_worst`` and ``<prefix>auto_within_5pct_of_mtkahypar``
    (none without ratios)."""
    if ratios:
        report.figure(f"{prefix}auto_vs_mtkahypar_worst", round(max(ratios), 4))
        report.figure(f"{prefix}auto_within_5pct_of_mtkahypar",
                      f"{sum(r <= 1.05 for r in ratios)}/{len(ratios)}")


def _strategy(name, cost, agent):
    if name == "dqn":
        return get_strategy("dqn", agent=agent, cost=cost)
    if name in ("greedy", "heft"):
        return get_strategy(name, cost=cost)
    if name in ("auto", "multilevel", "metis", "mtkahypar"):
        return get_strategy(name, eps=EPS)
    return get_strategy(name)


#: Unit counts a user's graph (``--graph``) is partitioned into by default.
USER_UNITS = (4, 16, 64)
#: Most units ``--units`` takes (Mt-KaHyPar and the partition's measures are per unit pair).
MAX_UNITS = 1024


def run(*, quick=False, json_path=None, console=None, seed=0, graph=None, units=USER_UNITS,
        families=FAMILIES):
    """Run the benchmark; print the tables and write ``json_path`` if given.

    Parameters
    ----------
    families : sequence of str
        The families of graphs measured (a subset of :data:`FAMILIES`; without ``graph``).
    graph : WeightedGraph, optional
        A user's graph (:func:`~rdakit.compiler.partition.wgraph.load`): every partitioner on
        it alone, into each of ``units``, with the shipped DQN agent (no training).

    Returns
    -------
    Report

    Raises
    ------
    ValueError
        If ``families`` is not a subset of :data:`FAMILIES`.
    """
    if isinstance(families, str) or not set(families) <= set(FAMILIES):
        raise ValueError(f"families must be a subset of {', '.join(FAMILIES)}, "
                         f"not {families!r}")
    report = Report("partition", console=console)
    cost = CostModel()
    if graph is None:
        episodes = 60 if quick else 800
        t0 = time.perf_counter()
        agent = dqn.train(episodes=episodes, seed=seed, cost=cost)
        report.figure("dqn_train_seconds", round(time.perf_counter() - t0, 2))
        report.figure("dqn_train_episodes", episodes)
        cases = [c for c in graphs(quick, cost) if c[0] in families]
        if "model" in families:
            found, said = model_graphs(quick, cost)
            for line in said:
                report.console.print(line, markup=False)
            cases += found
        cases.sort(key=lambda c: FAMILIES.index(c[0]))     # stable: each family keeps its order
    else:
        agent = dqn.DQNAgent.load(dqn.DEFAULT_WEIGHTS)
        cases = [("user", graph, int(k)) for k in units]
    skip = mtkahypar_missing()
    names = [p for p in PARTITIONERS if not (p == "mtkahypar" and skip)]
    rows, span_rows, ratios, vs_kahypar = [], [], [], []
    for family, g, k in cases:
        targets = Targets(k)
        results, refused = {}, {}
        for name in names:
            strategy = _strategy(name, cost, agent)
            try:
                parts, seconds, said = run_strategy(strategy, g, targets)
            except PartitionError as e:     # the DQN beyond the units it was trained on
                refused[name] = str(e)
                continue
            results[name] = measure(g, targets, parts, cost, strategy=name, seconds=seconds,
                                    warnings=said)
        metis_cut = results["metis"].cut
        ref = g.known_cut(k)
        for name, r in results.items():
            rows.append({"graph": g.name, "family": family, "nodes": g.n, "edges": g.m, "k": k,
                         "partitioner": name, "cut": r.cut, "ref_cut": ref,
                         "vs_metis": round(r.cut / metis_cut, 3) if metis_cut else None,
                         "imbalance": round(r.imbalance, 4),
                         "balanced": within_limits(g, targets, r.parts, EPS),
                         "bottleneck": round(r.bottleneck), "busiest_link": r.busiest_link,
                         "empty": len(r.empty_units), "seconds": round(r.seconds, 3),
                         "makespan": r.makespan, "lower_bound": round(r.lower_bound),
                         "acyclic": r.quotient_acyclic, "warnings": "; ".join(r.warnings)})
        for name, why in refused.items():
            rows.append({"graph": g.name, "family": family, "nodes": g.n, "edges": g.m, "k": k,
                         "partitioner": name, "refused": why})
        ml, me = results["multilevel"], results["metis"]
        if ml.imbalance <= EPS + 1e-9 and me.imbalance <= EPS + 1e-9 and me.cut > 0:
            ratios.append(ml.cut / me.cut)
        ratio = _auto_vs_mtkahypar(g, targets, results)
        if ratio is not None:
            vs_kahypar.append((family, ratio))
        if family == "workload" and "dqn" in results:
            row = {"graph": g.name, "k": k, "lower_bound": round(ml.lower_bound)}
            for name in ("dqn", "greedy", "heft", "round_robin", "static", "multilevel",
                         "metis"):
                row[name] = results[name].makespan
            row["dqn_vs_best"] = round(row["dqn"] / min(row[n] for n in (
                "greedy", "heft", "round_robin", "static")), 3)
            span_rows.append(row)
        if g.name == "grid_316x316" and k == 64:
            report.figure("grid_100k_k64_multilevel_seconds", round(ml.seconds, 2))
            report.figure("grid_100k_k64_multilevel_cut", ml.cut)
            report.figure("grid_100k_k64_metis_cut", me.cut)
    columns = ["graph", "k", "nodes", "partitioner", "cut", "ref_cut", "vs_metis", "imbalance",
               "balanced", "bottleneck", "busiest_link", "empty", "seconds", "makespan",
               "lower_bound", "acyclic"]
    # Warnings and refusals are long: under the table (and in every row of the JSON).
    said = {}
    for r in rows:
        for text in filter(None, [r.get("warnings"), r.get("refused")]):
            said.setdefault(text, []).append(f"{r['graph']} k={r['k']} {r['partitioner']}")
    notes = (f"balance tolerance {EPS} for auto, multilevel, METIS and Mt-KaHyPar (balanced: "
             f"within the balance rule's limits); the schedulers "
             f"(greedy, dqn, heft) and baselines do not target balance"
             + (f"; Mt-KaHyPar skipped: {skip}" if skip else "")
             + "".join(f"\n{', '.join(where[:4])}{' ...' if len(where) > 4 else ''}: {text}"
                       for text, where in said.items()))
    report.table("partition: cut, balance and time", rows, key="partition", columns=columns,
                 notes=notes)
    report.table("makespan on workloads (cycles, cost model)", span_rows, key="makespan",
                 notes="dqn_vs_best: DQN over the best of greedy, HEFT, round-robin, static")
    if ratios:
        report.figure("multilevel_vs_metis_geomean",
                      round(math.exp(float(np.mean(np.log(ratios)))), 4))
        report.figure("multilevel_within_5pct_of_metis",
                      f"{sum(r <= 1.05 for r in ratios)}/{len(ratios)}")
    _vs_mtkahypar_figures(report, "", [r for _, r in vs_kahypar])
    _vs_mtkahypar_figures(report, "models_", [r for f, r in vs_kahypar if f == "model"])
    report.finish(json_path)
    return report
