"""``rdakit bench partition --quick`` runs and writes the figures it promises."""

import json
import subprocess
import sys

from rdakit.cli import main


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
