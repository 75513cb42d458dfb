"""``rdakit bench partition --quick`` runs and writes the figures it promises, the model
suite's graphs among them."""

import json
import subprocess
import sys

import pytest

from rdakit.cli import main
from rdakit.compiler.partition.external import mtkahypar_missing
from rdakit.sim.bench import partition


def test_bench_partition_quick(tmp_path, capsys):
    out = tmp_path / "partition.json"
    assert main(["bench", "partition", "--quick", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["bench"] == "partition"
    rows = data["tables"]["partition"]
    graphs = {r["graph"] for r in rows}
    assert {"grid_32x32", "path_1000", "dag_20x50_s1"} <= graphs
    for r in rows:
        if "refused" in r:
            continue
        assert {"graph", "partitioner", "cut", "imbalance", "seconds"} <= set(r)
        assert r["cut"] >= 0 and r["imbalance"] >= 0 and r["seconds"] >= 0
    names = {r["partitioner"] for r in rows}
    assert {"auto", "multilevel", "metis", "greedy", "dqn", "heft", "round_robin",
            "static"} <= names
    # A transformer's graph into 16 units (its LM head 3 times the even share): the default
    # meets the balance rule, the throughput measures are there.
    auto = [r for r in rows if r["family"] == "transformer" and r["partitioner"] == "auto"]
    assert auto and auto[0]["balanced"] and auto[0]["bottleneck"] > 0
    assert auto[0]["busiest_link"] > 0 and "empty" in auto[0]
    path = [r for r in rows if r["graph"] == "path_1000" and r["partitioner"] == "multilevel"]
    assert path[0]["cut"] == path[0]["ref_cut"] == 7
    spans = data["tables"]["makespan"]
    assert spans and all(r["dqn"] >= r["lower_bound"] for r in spans)
    assert data["figures"]["dqn_train_seconds"] > 0
    assert "partition: cut, balance and time" in capsys.readouterr().out


def test_bench_partition_is_a_command():
    out = subprocess.run([sys.executable, "-m", "rdakit", "bench", "partition", "--help"],
                         capture_output=True, text=True, check=True)
    assert "--quick" in out.stdout and "--json" in out.stdout


# --- the model suite's graphs (issue 20) -------------------------------------------------------

def _auto_over_mtkahypar(rows):
    """``auto``'s cut over Mt-KaHyPar's for each graph and ``k`` of ``rows`` where both meet
    the balance rule, as the bench's figures are defined (docs/compiler.md)."""
    by = {(r["graph"], r["k"], r["partitioner"]): r for r in rows if "refused" not in r}
    ratios = []
    for (graph, k, name), auto in by.items():
        mk = by.get((graph, k, "mtkahypar"))
        if name == "auto" and mk and mk["cut"] > 0 and auto["balanced"] and mk["balanced"]:
            ratios.append(auto["cut"] / mk["cut"])
    return ratios


def test_bench_partition_measures_the_model_suites_graphs(tmp_path):
    pytest.importorskip("torch")
    from rdakit.compiler.frontend.models import MODELS

    out = tmp_path / "partition.json"
    assert main(["bench", "partition", "--quick", "--family", "model,path",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["tables"]["partition"]
    assert {r["family"] for r in rows} == {"model", "path"}
    models = [r for r in rows if r["family"] == "model"]
    # Every model of the suite, imported at the quick sizes, into 4, 16 and 64 units by every
    # cut partitioner.
    missing = mtkahypar_missing()           # None, or why Mt-KaHyPar cannot be imported
    cuts = [p for p in ("auto", "multilevel", "metis", "mtkahypar")
            if not (p == "mtkahypar" and missing)]
    assert {(r["graph"], r["k"], r["partitioner"]) for r in models} >= {
        (m, k, p) for m in MODELS for k in partition.MODEL_UNITS for p in cuts}
    assert all(r["nodes"] > 100 for r in models)
    figures = data["figures"]
    if missing:
        assert "models_auto_vs_mtkahypar_worst" not in figures
        return
    # The figures are the rows': the path's graph counts in the overall ones only.
    everything, suite = _auto_over_mtkahypar(rows), _auto_over_mtkahypar(models)
    assert 0 < len(suite) < len(everything)
    for prefix, ratios in (("", everything), ("models_", suite)):
        assert figures[f"{prefix}auto_vs_mtkahypar_worst"] == round(max(ratios), 4)
        assert (figures[f"{prefix}auto_within_5pct_of_mtkahypar"]
                == f"{sum(r <= 1.05 for r in ratios)}/{len(ratios)}")
    # Issue 20's target, at the quick sizes: the default within 5 % of Mt-KaHyPar.
    assert figures["models_auto_vs_mtkahypar_worst"] <= 1.05


def test_bench_partition_without_torch_leaves_the_model_graphs_out(monkeypatch, capsys):
    # As if torch were not installed: importing it (and the suite, which imports it) fails.
    import rdakit.compiler.frontend as frontend

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "rdakit.compiler.frontend.models", raising=False)
    monkeypatch.delattr(frontend, "models", raising=False)
    report = partition.run(quick=True, families=("model", "path"))
    assert {r["family"] for r in report.tables["partition"]} == {"path"}
    assert "models_auto_vs_mtkahypar_worst" not in report.figures
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "model graphs" in line]
    assert said == ["model graphs left out: PyTorch cannot be imported (import of torch halted; "
                    "None in sys.modules); pip install 'rdakit[torch]'"]
    assert "Traceback" not in out


@pytest.mark.parametrize("args, message", [
    (["--family", "model,nope"], "rdakit: error: --family takes a comma-separated subset of "
                                 "workload,model,transformer,path,chain,dag,grid, not "
                                 "'model,nope'\n"),
    (["--family", ""], "rdakit: error: --family takes a comma-separated subset of "
                       "workload,model,transformer,path,chain,dag,grid, not ''\n"),
    (["--family", "path", "--graph", "g.json"],
     "rdakit: error: --family chooses among the benchmark's graphs; it does not apply with "
     "--graph\n"),
])
def test_bench_partition_refuses_a_bad_family_with_exit_2(args, message, capsys):
    assert main(["bench", "partition", *args]) == 2
    assert capsys.readouterr().err == message


def test_bench_partition_family_model_without_torch_is_refused(monkeypatch, capsys):
    import rdakit.compiler.frontend as frontend

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "rdakit.compiler.frontend.models", raising=False)
    monkeypatch.delattr(frontend, "models", raising=False)
    assert main(["bench", "partition", "--family", "path,model"]) == 2
    err = capsys.readouterr().err
    assert err == ("rdakit: error: --family model needs PyTorch, which cannot be imported "
                   "(import of torch halted; None in sys.modules): pip install "
                   "'rdakit[torch]'\n")
