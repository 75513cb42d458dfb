"""The command line: every command runs, bad parameters give a clear error, docs are current."""

import json
import re
import subprocess
import sys

import pytest

from rdakit.cli import UserError, main
from rdakit.cli.docs import update
from rdakit.cli.options import parse_grid


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
    assert r.stderr.strip() == ("rdakit: error: --words must be a power of two from 32 to "
                                "65536, not 1000")
    r = rdakit("verilog", "mu", "--mu-id", "99", "-o", str(tmp_path / "x.v"))
    assert r.returncode == 2
    assert "--mu-id must be from 0 to 63" in r.stderr


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
    assert set(data["tables"]) == {"throughput", "latency", "free", "traces", "area", "figures"}
    assert data["titles"]["traces"].startswith("Traces on a 4096-word MU")
    traces = data["tables"]["traces"]
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


@pytest.mark.parametrize("command", [
    ["verilog"], ["verilog", "mu"], ["verilog", "router"], ["verilog", "noc"],
    ["verilog", "fabric"], ["verilog", "system"], ["bench"], ["bench", "mu"], ["bench", "noc"],
    ["bench", "fabric"], ["bench", "e2e"], ["bench", "race"], ["bench", "clusters"],
    ["bench", "partition"], ["bench", "calibrate"], ["bench", "boards"], ["bench", "models"],
    ["bench", "memory"], ["compile"], ["sweep"],
    ["inspect"], ["import"], ["run"], ["board"], ["board", "build"], ["board", "run"],
    ["doctor"], ["docs"], ["verify"],
])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: rdakit {' '.join(command)}")


def test_grid_has_one_parser():
    assert parse_grid("3x4") == (3, 4)
    for bad in ("3by4", "3x", "x4", "3x4x5", "-1x2", " 3x4"):
        with pytest.raises(UserError, match=rf"^--fabric must be ROWSxCOLS like 4x4, not "
                                             rf"'{re.escape(bad)}'$"):
            parse_grid(bad)
    with pytest.raises(UserError, match="^--grids must be ROWSxCOLS like 4x4, not '3'$"):
        parse_grid("3", "--grids")


def test_verilog_noc_takes_fabric(tmp_path, capsys):
    out = tmp_path / "noc.v"
    assert main(["verilog", "noc", "--fabric", "1x2", "--payload", "8", "-o", str(out)]) == 0
    assert "module top" in out.read_text()
    assert "(1x2 mesh, " in capsys.readouterr().out
    assert main(["verilog", "router", "--fabric", "2x2", "--x", "0", "--y", "0", "--payload",
                 "8", "-o", str(out)]) == 0
    assert "router (0, 0) of 2x2, voq queues of 2" in capsys.readouterr().out


ROWS_COLS = ("was replaced by --fabric RxC (rows x columns), e.g. --fabric 3x3 for --rows 3 "
             "--cols 3")


@pytest.mark.parametrize("argv, message", [
    (["verilog", "noc", "--rows", "3", "--cols", "3", "-o", "-"], f"--rows {ROWS_COLS}"),
    (["verilog", "noc", "--cols", "3", "--fabric", "3x3", "-o", "-"], f"--cols {ROWS_COLS}"),
    (["verilog", "router", "--rows", "3", "-o", "-"], f"--rows {ROWS_COLS}"),
    (["verilog", "system", "--clusters", "2", "--rows", "2", "--cols", "2", "-o", "-"],
     f"--rows {ROWS_COLS}"),
    (["verilog", "fabric", "--cols", "2", "-o", "-"], f"--cols {ROWS_COLS}"),
    (["bench", "noc", "--mesh", "2x2"],
     "--mesh was replaced by --fabric RxC (rows x columns): use --fabric 2x2"),
    (["bench", "noc", "--mesh", "big"],
     "--mesh was replaced by --fabric RxC (rows x columns): use --fabric 4x4"),
    (["bench", "clusters", "--rows", "1"], f"--rows {ROWS_COLS}"),
    (["compile", "mlp", "--mesh", "4x4"],
     "--mesh was replaced by --fabric RxC (rows x columns): use --fabric 4x4"),
])
def test_old_grid_spellings_are_refused(argv, message, capsys):
    """Every grid is spelled --fabric RxC; the old --rows R --cols C and --mesh RxC exit 2 with
    a message naming --fabric, before anything is built."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {message}\n" in err, err
