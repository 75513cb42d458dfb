"""The command line: every command runs, bad parameters give a clear error, docs are current."""

import json
import subprocess
import sys

import pytest

from rdakit.cli import main
from rdakit.cli.docs import update


def rdakit(*args):
    return subprocess.run([sys.executable, "-m", "rdakit", *args], capture_output=True,
                          text=True, timeout=900)


def test_help_everywhere():
    for args in ([], ["verilog"], ["verilog", "mu"], ["bench"], ["bench", "mu"], ["doctor"],
                 ["docs"]):
        r = rdakit(*args, "--help")
        assert r.returncode == 0, r.stderr
        assert "usage: rdakit" in r.stdout


def test_verilog_mu_writes_a_module(tmp_path):
    out = tmp_path / "mu.v"
    assert main(["verilog", "mu", "--words", "256", "--block-words", "8", "--alloc-mode",
                 "reserve", "-o", str(out), "--name", "mu_top"]) == 0
    assert "module mu_top" in out.read_text()


def test_verilog_mu_rejects_bad_parameter(tmp_path):
    r = rdakit("verilog", "mu", "--words", "1000", "-o", str(tmp_path / "x.v"))
    assert r.returncode == 2
    assert r.stderr.strip() == "rdakit: error: words must be a power of two, not 1000"
    r = rdakit("verilog", "mu", "--mu-id", "99", "-o", str(tmp_path / "x.v"))
    assert r.returncode == 2
    assert "MU ID must be an integer from 0 to 63" in r.stderr


def test_doctor_lists_simulators():
    r = rdakit("doctor")
    assert "icarus" in r.stdout and "verilator" in r.stdout, r.stdout


def test_bench_mu_quick_json(tmp_path):
    out = tmp_path / "mu.json"
    r = rdakit("bench", "mu", "--quick", "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["bench"] == "mu"
    assert data["figures"]["read_throughput"] >= 0.99
    assert data["figures"]["write_throughput"] >= 0.99
    traces = data["tables"][next(t for t in data["tables"] if t.startswith("Traces"))]
    virtual = {r["trace"]: r for r in traces if r["mode"] == "virtual"}
    single = {r["trace"]: r for r in traces if r["mode"] == "single"}
    for name in virtual:
        assert virtual[name]["peak_utilization"] > single[name]["peak_utilization"]


def test_docs_are_generated_from_code():
    stale = update(check=True)
    assert not stale, f"run `rdakit docs`: {stale}"


@pytest.mark.parametrize("cmd", [["bench", "nonexistent"], ["verilog", "nothing"]])
def test_unknown_subcommand(cmd):
    r = rdakit(*cmd)
    assert r.returncode == 2 and "invalid choice" in r.stderr
