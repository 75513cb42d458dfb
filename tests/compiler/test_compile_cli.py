"""``rdakit compile`` and ``rdakit bench calibrate``: the summary, the bitstream, graph files and
errors that name what does not fit."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY_GRAPH

from rdakit.cli import main
from rdakit.cli.compile import parse_sizes
from rdakit.cli.options import AUTO_GRIDS
from rdakit.compiler import workloads
from rdakit.compiler.compile import FASTEST, bitstream_for, compile_workload
from rdakit.compiler.cost import CostModel
from rdakit.compiler.lower import LoweringError
from rdakit.compiler.partition import partition
from rdakit.compiler.workloads import WORKLOADS, mlp
from rdakit.hdl.spec.bitstream import read_bitstream
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.bench.calibrate import CalibratedCostModel, fit
from rdakit.sim.models.interp import Interpreter
from rdakit.sim.runtime.events import cost_model

MLP = ["--size", "batch=2", "--size", "sizes=8,16,8"]


def test_compile_prints_the_summary_and_writes_the_bitstream(tmp_path, capsys):
    out, lst = tmp_path / "mlp.bit", tmp_path / "mlp.lst"
    assert main(["compile", "mlp", *MLP, "--fabric", "2x2", "--prog-len", "512",
                 "--partitioner", "static", "-o", str(out), "--listing", str(lst)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("graph mlp_b2_8x16x8: 15 nodes, partitioner static\n")
    assert re.search(r"^parts \d, cut \d+ bytes, imbalance \d\.\d{3}, estimated cycles \d+ "
                     r"\(lower bound \d+\)$", text, re.M)
    assert re.search(r"^  CU \(0, 0\): \d+ instructions$", text, re.M)
    assert re.search(r"^  MU \(1, 0\): host buffers .*; at most \d+ words in \d+ buffers$",
                     text, re.M)
    assert f"wrote {out} (" in text and f"wrote {lst}" in text
    params = fabric_params(2, 2, prog_len=512)
    job, summary = compile_workload("mlp", sizes=dict(batch=2, sizes=(8, 16, 8)),
                                    params=params, partitioner="static")
    data = out.read_bytes()
    assert data == bitstream_for(job)
    # The bitstream runs as it is on a fresh fabric (the host allocates in job order).
    interp = Interpreter(params, read_bitstream(data, params))
    refs = {}
    for b in job.buffers:
        refs[b.name] = interp.load_buffer(
            b.mu, b.data if b.data is not None else np.zeros((0, 4), np.int32), b.weight)
    assert interp.run(max_steps=1_000_000).ok
    y = interp.read_buffer(next(b.mu for b in job.buffers if b.name == "y"), refs["y"])
    np.testing.assert_array_equal(job.decode({"y": y})["y"],
                                  job.workload.reference(job.workload.inputs)["y"])
    assert "tile (0, 0) CU enabled" in lst.read_text()
    assert summary.parts == len(job.programs) and summary.estimated_cycles > 0


def test_compile_a_graph_file(tmp_path, capsys):
    path = tmp_path / "tiny.py"
    path.write_text(TINY_GRAPH)
    assert main(["compile", str(path), "--prog-len", "256", "-o", str(tmp_path / "t.bit")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert re.fullmatch(rf"graph tiny: 5 nodes, partitioner fastest: ({'|'.join(FASTEST)})"
                        r"(, rows split 2 ways \(10 nodes\))?", first), first
    assert main(["compile", str(path), "--size", "batch=2"]) == 2
    assert capsys.readouterr().err == ("rdakit: error: --size applies to built-in "
                                       "workloads, not to graph files\n")


@pytest.mark.parametrize("args,message", [
    (["nope"], "Workload must be one of decoder, mixtral, mlp, moe, switch or a Python file, "
               "not 'nope'"),
    (["mlp", "--size", "batch"], "--size must be KEY=VALUE, not 'batch'"),
    (["mlp", "--size", "batch=x"], "--size batch must be an integer or integers separated "
                                   "by commas, not 'x'"),
    (["mlp", "--size", "batch=0"], "--size batch must be a positive integer, not 0"),
    (["mlp", *MLP, "--prog-len", "32", "--fabric", "2x2", "--mu-words", "1024"],
     "The program of CU (1, 1) (2 ops: 'fc0', 'bias0') is 48 instructions long but prog_len is "
     "32 (a larger --prog-len, fabric or another partitioner may fit)"),
    (["mlp", "--fabric", "2x2", "--mu-words", "1024"],
     "Constant 'w1' (transposed) needs 2048 words but an MU buffer holds at most 1024 "
     "(max_buffer_words)"),
    (["mlp", *MLP, "--fabric", "2"], "--fabric must be ROWSxCOLS like 4x4, not '2'"),
])
def test_compile_errors(args, message, capsys):
    assert main(["compile", *args, "--place-steps", "200"]) == 2
    assert capsys.readouterr().err == f"rdakit: error: {message}\n"


@pytest.mark.parametrize("workload", sorted(set(WORKLOADS) - {"mlp"}))
def test_every_workload_compiles_at_its_default_sizes(workload, tmp_path, capsys):
    """``rdakit compile NAME`` with no option: ``--fabric auto`` picks the smallest fabric of
    :data:`AUTO_GRIDS` (and MU size) the workload fits and names it (mlp: the hostile-input
    suite, tests/test_hostile_cli.py)."""
    assert main(["compile", workload, "-o", str(tmp_path / "w.bit")]) == 0
    out = capsys.readouterr().out
    chosen = [line for line in out.splitlines() if line.startswith("fabric ")]
    assert len(chosen) == 1 and "the smallest that fits" in chosen[0], out
    assert chosen[0].split()[1] in {f"{r}x{c}" for r, c in AUTO_GRIDS}, out
    assert (tmp_path / "w.bit").read_bytes()[:4] == b"RDAB"


def test_the_main_job_stays_on_2x2(capsys):
    """``--fabric auto`` keeps the README's main job on the 2x2 fabric with 1024-word MUs."""
    assert main(["compile", "moe", "--size", "tokens=4", "--size", "d_model=8", "--size",
                 "d_ff=8", "--size", "experts=4"]) == 0
    assert ("fabric 2x2 with 1024-word MUs: the smallest that fits moe_t4_d8_f8_e4_k2 "
            "(--fabric 2x2 --mu-words 1024 gives the same)") in capsys.readouterr().out


def test_parse_sizes():
    assert parse_sizes(["batch=4", "sizes=8,16,8", "k=1"]) == {"batch": 4, "sizes": (8, 16, 8),
                                                               "k": 1}


def test_compile_from_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rdakit", "compile", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "usage: rdakit compile" in r.stdout
    assert "--partitioner" in r.stdout and "--size KEY=VALUE" in r.stdout


def test_bench_calibrate_quick(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["bench", "calibrate", "--quick", "--no-rtl", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["bench"] == "calibrate"
    figures = data["figures"]
    for key in ("op_groups", "mean_abs_rel_error", "mean_rel_error",
                "mean_abs_rel_error_expected_sizes", "fitted_work_factor",
                "fitted_op_overhead", "fitted_mean_abs_rel_error",
                "fitted_per_category_mean_abs_rel_error", "calibrated_coefficients"):
        assert key in figures
    assert figures["op_groups"] > 10
    assert figures["fitted_per_category_mean_abs_rel_error"] <= figures["mean_abs_rel_error"]
    assert set(data["tables"]) == {"op_groups", "makespan", "categories", "figures"}
    rows = data["tables"]["op_groups"]
    assert all(r["measured"] > 0 for r in rows)
    # The calibrated model plugs into the partitioners.
    coefficients = tuple((c, a, b) for c, (a, b) in figures["calibrated_coefficients"].items())
    cost = CalibratedCostModel(lanes=4, coefficients=coefficients)
    wl = mlp(batch=2, sizes=(8, 16, 8))
    assert cost.op_cycles(wl.graph, "fc0") != CostModel(lanes=4).op_cycles(wl.graph, "fc0")
    assert partition(wl.graph, 2, "greedy", cost=cost).makespan > 0


def test_fit_recovers_a_linear_model():
    rows = [{"lanes_work": w, "nodes": n, "measured": 3 * w + 7 * n}
            for w, n in ((10, 1), (40, 2), (5, 1), (100, 3))]
    a, b, err = fit(rows)
    assert abs(a - 3) < 1e-9 and abs(b - 7) < 1e-9 and err < 1e-12


def test_fastest_keeps_the_strategy_with_the_fewest_estimated_cycles():
    # The README main job, unsplit: the estimates of FASTEST's strategies differ, and the one
    # kept is their least (greedy's on this graph, where the multilevel cut is the smallest).
    wl = workloads.moe(tokens=4, d_model=8, d_ff=8, experts=4)
    p = fabric_params(rows=2, cols=2, prog_len=2048, mu_words=1024)
    cost = cost_model(wl, params=p)
    each = {name: compile_workload(wl, params=p, partitioner=name, schedule_cost=cost)[1]
            for name in FASTEST}
    job, summary = compile_workload(wl, params=p, partitioner="fastest", schedule_cost=cost,
                                    split=1)
    best = min(FASTEST, key=lambda n: each[n].estimated_cycles)
    assert len({s.estimated_cycles for s in each.values()}) > 1
    assert summary.partitioner == f"fastest: {best}"
    assert summary.estimated_cycles == each[best].estimated_cycles
    assert summary.cut == each[best].cut


def test_a_fit_check_compiles_candidates_only_until_one_fits(monkeypatch):
    """``first_fit`` (what ``--fabric auto`` asks of each fabric it tries) returns the first
    candidate that compiles, unranked, and compiles no other; where none fits it raises the
    error the full compilation raises."""
    import rdakit.compiler.compile as compile_module

    wl = workloads.moe(tokens=4, d_model=8, d_ff=8, experts=4)
    p = fabric_params(rows=2, cols=2, prog_len=2048, mu_words=1024)
    calls = []
    real = compile_module.compile_workload
    monkeypatch.setattr(compile_module, "compile_workload",
                        lambda *a, **kw: calls.append(kw.get("partitioner")) or real(*a, **kw))
    job, summary = compile_module.compile_workload(wl, params=p, partitioner="fastest",
                                                   first_fit=True)
    assert calls == ["fastest", FASTEST[0]]
    assert (summary.partitioner, summary.split, summary.order, summary.ranked) == (
        FASTEST[0], 1, "graph", ())
    small = fabric_params(rows=2, cols=2, prog_len=2048, mu_words=64)
    with pytest.raises(LoweringError) as full:
        real(wl, params=small, partitioner="fastest")
    with pytest.raises(LoweringError) as fit:
        real(wl, params=small, partitioner="fastest", first_fit=True)
    assert str(fit.value) == str(full.value)


def test_fastest_is_refused_across_clusters(capsys):
    assert main(["run", "mlp", "--clusters", "2", "--partitioner", "fastest"]) == 2
    assert capsys.readouterr().err == (
        "rdakit: error: --partitioner fastest compiles one fabric with several strategies; "
        "across clusters name one of the strategies (default multilevel)\n")
