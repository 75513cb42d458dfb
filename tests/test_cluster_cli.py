"""``rdakit verilog system`` and ``rdakit bench clusters``: a system's Verilog, the bench's
figures, their options, and clear errors."""

import json

import pytest

from rdakit.cli import main


def test_verilog_system_writes_a_module(tmp_path, capsys):
    out = tmp_path / "system.v"
    assert main(["verilog", "system", "--clusters", "2", "--fabric", "1x2",
                 "--lanes", "1", "--link-width", "8", "--link-latency", "4", "-o", str(out),
                 "--name", "sys_top"]) == 0
    text = out.read_text()
    assert "module sys_top" in text
    for port in ("cmd__0__payload", "cmd__1__payload", "reply__1__valid", "req_packets__1"):
        assert port in text
    assert "2 clusters of 1x2, links 8 wires, 4 cycles" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--clusters", "0"], "--clusters must be from 1 to 256, not 0"),
    (["--clusters", "2", "--bridge", "1"], "--bridge must be X,Y like 1,0, not '1'"),
    (["--clusters", "2", "--bridge", "2,0"],
     "bridge must be the (x, y) of a tile of the 2x2 grid, not (2, 0)"),
    (["--clusters", "2", "--link-latency", "0"],
     "--link-latency must be an integer from 1 to 256, not 0"),
    (["--clusters", "2", "--link-width", "0"], "--link-width must be an integer from 1 to"),
    (["--clusters", "2", "--fabric", "40x2"],
     "--fabric must be ROWSxCOLS with 1 to 16 rows and columns, not '40x2'"),
    (["--clusters", "257"], "--clusters must be from 1 to 256, not 257"),
])
def test_verilog_system_rejects_bad_options(tmp_path, capsys, args, message):
    assert main(["verilog", "system", *args, "-o", str(tmp_path / "x.v")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rdakit: error: ") and message in err, err
    assert not (tmp_path / "x.v").exists()


def test_bench_clusters(tmp_path):
    """On two 1x2 clusters: a remote access is slower than a local one and crosses the links;
    the matrix-vector product over both clusters is exact and frees the shared x; across
    clusters the greedy sends fewer bytes over the links than round-robin and gives a cluster
    with fewer CUs less work."""
    out = tmp_path / "clusters.json"
    assert main(["bench", "clusters", "--workloads", "mlp", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    tables = report["tables"]
    access, (matvec,), parts = tables["access"], tables["matvec"], tables["partitions"]
    local, remote = access
    assert remote["latency_cycles"] > local["latency_cycles"]
    assert remote["words_per_cycle"] < local["words_per_cycle"]
    assert local["link_packets"] == 0 < remote["link_packets"]
    assert matvec["exact"] is True and matvec["x_freed"] is True and matvec["link_packets"] > 0
    assert report["figures"]["remote_latency_ratio"] > 1
    by = {(r["clusters"], r["partitioner"]): r for r in parts}
    assert {c for c, _ in by} == {"4 4", "4 1", "4 4+2000", "4 4 4 4", "4 4 4 1"}
    for (c, s), r in by.items():
        assert r["est_cycles"] > 0 and len(r["work"]) == len(c.split())
        if s == "greedy":
            assert r["crossing_bytes"] < by[(c, "round_robin")]["crossing_bytes"]
    slow = by[("4 1", "greedy")]["work"]
    assert slow[1] < slow[0]


@pytest.mark.parametrize("command", [["verilog", "system", "-o", "x.v"], ["bench", "clusters"]])
@pytest.mark.parametrize("old", [["--rows", "1"], ["--cols", "2"]])
def test_system_commands_refuse_rows_and_cols(capsys, command, old):
    """A cluster's grid is spelled --fabric RxC only; --rows and --cols name the new spelling."""
    with pytest.raises(SystemExit) as e:
        main([*command, "--clusters", "2", *old])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {old[0]} was replaced by --fabric RxC (rows x columns), e.g. --fabric 3x3 " \
           f"for --rows 3 --cols 3" in err, err


def test_run_and_system_share_one_cluster_range(capsys):
    """``rdakit run --clusters`` and ``rdakit verilog system --clusters`` accept the same
    counts (hdl.spec.params.CLUSTERS) and refuse the others with the same message."""
    from rdakit.hdl.spec.params import CLUSTERS

    for n in (CLUSTERS.start - 1, CLUSTERS.stop):
        assert main(["run", *MLP, "--clusters", str(n)]) == 2
        run_err = capsys.readouterr().err
        assert main(["verilog", "system", "--clusters", str(n), "-o", "x.v"]) == 2
        assert capsys.readouterr().err == run_err == \
            f"rdakit: error: --clusters must be from 1 to 256, not {n}\n"


def test_bench_clusters_rejects_an_unknown_workload(capsys):
    assert main(["bench", "clusters", "--workloads", "mlp,gpt5"]) == 2
    assert "--workloads takes names of" in capsys.readouterr().err


MLP = ["mlp", "--size", "batch=2", "--size", "sizes=8,8,4", "-q"]


@pytest.mark.parametrize("args, message", [
    (["--clusters", "2", "--sim", "icarus"], "--clusters runs in the built-in simulator only"),
    (["--clusters", "0"], "--clusters must be from 1 to 256, not 0"),
    (["--clusters", "2", "--slow-cluster", "2", "--inject-load", "9"],
     "--slow-cluster must name a cluster from 0 to 1, not 2"),
    (["--clusters", "2", "--slow-cluster", "1"],
     "--slow-cluster K and --inject-load CYCLES go together"),
    (["--clusters", "2", "--slow-cluster", "1", "--inject-load", "-3"],
     "--inject-load must be cycles from 0 to 1000000 (each is simulated), not -3"),
    (["--slow-cluster", "1", "--inject-load", "9"], "--slow-cluster needs --clusters N"),
    (["--clusters", "2", "--cluster-cus", "3,2"],
     "--cluster-cus takes 2 numbers from 0 to 2 (the CUs of a cluster), not '3,2'"),
    (["--clusters", "2", "--cluster-cus", "a"],
     "--cluster-cus takes one number per cluster like 2,1, not 'a'"),
    (["--clusters", "2", "--link-latency", "0"],
     "--link-latency must be an integer from 1 to 256, not 0"),
    (["--clusters", "9", "--fabric", "2x2"],
     "9 clusters of 2 columns need coordinates for 18 columns (at most 16"),
])
def test_run_clusters_rejects_bad_options(capsys, args, message):
    assert main(["run", *MLP, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rdakit: error: ") and message in err, err


def test_run_clusters_too_large_a_workload(capsys):
    assert main(["run", "mlp", "-q", "--clusters", "2"]) == 2
    err = capsys.readouterr().err
    assert "mlp does not fit 2 clusters of 2x2: " in err, err


def test_run_clusters_adapts_away_from_a_loaded_cluster(tmp_path, capsys):
    """Two 2x2 clusters, cluster 1 spinning 1500 cycles before its programs: the first
    iteration (compiler unaware) gives it work and waits for it; the monitor sees its busy
    time, and the second iteration moves work off it and is faster. Every iteration bit-exact
    against numpy with every buffer freed."""
    report = tmp_path / "r.json"
    assert main(["run", *MLP, "--clusters", "2", "--adapt", "2", "--slow-cluster", "1",
                 "--inject-load", "1500", "--place-steps", "2000",
                 "--report", str(report)]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "PASS" in out
    rows = json.loads(report.read_text())["tables"]["iterations_full"]
    first, second = rows
    assert first["work"][1] > 0 and first["finish"][1] > 1500
    assert first["busy"][1] >= 1500
    assert second["loads"][1] > 0 and second["loads"][0] == 0
    assert second["work"][1] < first["work"][1]
    assert second["cycles"] < first["cycles"]
    assert all(r["numpy"] == "ok" and r["leaked_buffers"] == 0 for r in rows)


@pytest.mark.slow
def test_measured_workloads_across_clusters():
    """The MLP compiled across two 2x2 clusters by greedy and round-robin and run on the RTL:
    both exact and leak-free, greedy crossing fewer bytes and faster."""
    from rdakit.sim.bench.clusters import measured_rows

    rows = measured_rows(["mlp"], (2,), strategies=("greedy", "round_robin"),
                         place_steps=2000)
    by = {r["partitioner"]: r for r in rows}
    assert set(by) == {"greedy", "round_robin"}
    for r in rows:
        assert r["check"] == "ok" and r["cycles"] > 0 and len(r["work"]) == 2
    assert by["greedy"]["crossing_bytes"] < by["round_robin"]["crossing_bytes"]
    assert by["round_robin"]["link_packets"] > 0 and by["round_robin"]["vs_round_robin"] == 1
    assert by["greedy"]["cycles"] < by["round_robin"]["cycles"]


@pytest.mark.parametrize("option", [["--plot", "x.png"], ["--profile"], ["--waves", "x.vcd"]])
def test_single_fabric_outputs_are_refused_with_clusters(option, capsys):
    assert main(["run", *MLP, "--clusters", "2", *option]) == 2
    assert capsys.readouterr().err == ("rdakit: error: --waves, --plot and --profile are for a "
                                       "single fabric, not with --clusters\n")
