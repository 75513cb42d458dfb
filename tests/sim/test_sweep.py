"""``rdakit sweep`` (issue 21): grid and Optuna sweeps on Dask with the performance model, the
area cache, resumption, the Pareto front and the refusals of bad input."""

import json
import pathlib

import pytest
from conftest import hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.cli import main
from rdakit.cli.compile import FIT_ERRORS
from rdakit.sim.bench import sweep

#: The smallest MoE: a point compiles and runs on the model in about half a second.
MOE = "moe:tokens=4,d_model=8,d_ff=8,experts=4,k=2"

#: The options of every sweep here: no Yosys (the area has its own tests), no progress bar.
QUICK = ["--workload", MOE, "--fixed", "partitioner=greedy", "--no-area",
         "--objective", "cycles,mu_peak_words", "-q"]


def _rows(folder):
    return [json.loads(line) for line in (folder / "points.jsonl").read_text().splitlines()]


#: Made-up areas of the grid's designs, put in the area cache before the sweep (so that the
#: workers find them and Yosys does not run): more lanes, more cells; more MU words, a few.
def _fake_area(kw):
    return {"cells": 1000 * kw["lanes"] + kw["mu_words"] // 512, "memory_bits": 1}


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """A 2 x 2 grid (lanes x MU words) on a LocalCluster of 2 workers, with a cells budget that
    excludes one design, run three times: once, again unchanged, and again after one line of
    the store was deleted."""
    from rdakit.cli.sweep import _BASE

    tmp = tmp_path_factory.mktemp("sweep")
    out = tmp / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RDAKIT_CACHE_DIR", str(tmp / "cache"))
        mp.setattr(sweep, "_compute_area", _fake_area)
        for lanes in (2, 4):
            for words in (512, 1024):
                sweep.fabric_area({**_BASE, "lanes": lanes, "mu_words": words})
        mp.undo()
        mp.setenv("RDAKIT_CACHE_DIR", str(tmp / "cache"))
        args = ["sweep", "--axis", "lanes=2,4", "--axis", "mu_words=512,1024", "--workload",
                MOE, "--fixed", "partitioner=greedy", "--objective", "cycles,cells",
                "--budget", "cells=4001.5", "-q", "--workers", "2", "-o", str(out)]
        first = main(args)
        summary1 = json.loads((out / "summary.json").read_text())
        again = main(args)
        summary2 = json.loads((out / "summary.json").read_text())
        lines = (out / "points.jsonl").read_text().splitlines()
        dropped = json.loads(lines[1])["key"]
        (out / "points.jsonl").write_text("\n".join(lines[:1] + lines[2:]) + "\n")
        third = main(args)
        summary3 = json.loads((out / "summary.json").read_text())
    return dict(out=out, codes=(first, again, third), summaries=(summary1, summary2, summary3),
                dropped=dropped)


@pytest.mark.long   # the shared grid fixture: three sweeps on a LocalCluster, ~16 s
def test_grid_evaluates_every_point_on_the_model(grid):
    out = grid["out"]
    assert grid["codes"][0] == 0
    s = grid["summaries"][0]
    assert (s["points"], s["evaluated"], s["reused"]) == (4, 4, 0)
    assert s["status"] == {"ok": 4}
    rows = {(r["lanes"], r["mu_words"]): r for r in csv_rows(out)}
    assert set(rows) == {("2", "512"), ("2", "1024"), ("4", "512"), ("4", "1024")}
    for (lanes, words), r in rows.items():
        assert r["numpy"] == r["interpreter"] == "ok"
        assert int(r["cycles"]) > 0 and float(r["cycles_over_bound"]) >= 1
        assert float(r["mu_utilization"]) == int(r["mu_peak_words"]) / int(r["mu_words"])
        assert int(r["cells"]) == 1000 * int(lanes) + int(words) // 512   # from the cache
    # 4 lanes take fewer cycles than 2 and the MU size changes nothing but the cells: the
    # smaller MU of each is on the front, and 4 lanes with 1024 words (4002 cells) is over the
    # budget.
    assert rows[("4", "512")]["cycles"] < rows[("2", "512")]["cycles"]
    assert rows[("4", "1024")]["within_budget"] == "False"
    assert {(r["lanes"], r["mu_words"]) for r in s["pareto"]} == {(2, 512), (4, 512)}
    assert {k for k, r in rows.items() if r["pareto"] == "True"} == {("2", "512"), ("4", "512")}
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "sweep.json").read_text())[sweep.MARK] == 1


def csv_rows(folder):
    import csv
    with open(folder / "results.csv") as f:
        yield from csv.DictReader(f)


@pytest.mark.long   # the shared grid fixture: three sweeps on a LocalCluster, ~16 s
def test_a_rerun_evaluates_nothing(grid):
    assert grid["codes"][1] == 0
    s = grid["summaries"][1]
    assert (s["points"], s["evaluated"], s["reused"]) == (4, 0, 4)
    assert s["pareto"] == grid["summaries"][0]["pareto"]


@pytest.mark.long   # the shared grid fixture: three sweeps on a LocalCluster, ~16 s
def test_a_deleted_row_and_only_it_is_evaluated_again(grid):
    assert grid["codes"][2] == 0
    s = grid["summaries"][2]
    assert (s["points"], s["evaluated"], s["reused"]) == (4, 1, 3)
    rows = _rows(grid["out"])
    assert rows[-1]["key"] == grid["dropped"]          # appended again, the others kept
    assert len(rows) == 4


@pytest.mark.long   # two four-trial searches on a LocalCluster, ~8 s
def test_optuna_search_on_an_existing_scheduler_is_reproducible(tmp_path):
    """Four Optuna trials (NSGA-II, seed 0) through ``--scheduler`` on a cluster the test
    started; the same search again asks for the same designs, all found in the store."""
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0", silence_logs=40) as cluster:     # (as sweep's)
        args = ["sweep", "--axis", "lanes=1,2,4", "--axis", "block_words=8,16", *QUICK,
                "--search", "optuna", "--trials", "4", "--budget", "mu_peak_words=100000",
                "--scheduler", cluster.scheduler_address,
                "-o", str(tmp_path / "o")]
        assert main(args) == 0
        first = json.loads((tmp_path / "o" / "summary.json").read_text())
        assert main(args) == 0
        second = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert first["evaluated"] == first["points"] >= 1
    assert first["points"] <= 4 and first["status"] == {"ok": first["points"]}
    assert second["evaluated"] == 0 and second["points"] == first["points"]
    assert second["pareto"] == first["pareto"]


# --- one point, in-process --------------------------------------------------------------------

def _point(**fabric):
    spec = sweep.SweepSpec(axes={}, workloads=(sweep.Workload("moe", {
        "tokens": 4, "d_model": 8, "d_ff": 8, "experts": 4, "k": 2}),),
        fixed={"partitioner": "greedy"}, base={"prog_len": 2048})
    [point] = spec.points(fabric)
    return point


def test_a_point_that_does_not_fit_is_a_row_with_its_reason():
    row = sweep.evaluate_point(_point(prog_len=64), FIT_ERRORS)
    assert row["status"] == "does not fit"
    assert "prog_len is 64" in row["reason"]


def test_axis_values_that_do_not_go_together_are_a_row():
    row = sweep.evaluate_point(_point(mu_words=1024, block_words=2048), FIT_ERRORS)
    assert row["status"] == "invalid design"
    assert "block_words must be less than words (1024)" in row["reason"]


def test_a_point_key_does_not_depend_on_how_sizes_are_spelled():
    a = _point()
    b = {**a, "sizes": {k: v for k, v in reversed(list(a["sizes"].items()))}}
    assert sweep.point_key(a) == sweep.point_key(b)
    assert sweep.point_key(a) != sweep.point_key(_point(lanes=2))


def test_front_is_per_workload_and_within_the_budget(tmp_path):
    """Rows of two workloads from a store: each workload has its own front, taken among the
    points that ran and are within the budget."""
    spec = sweep.SweepSpec(axes={"lanes": (1, 2, 4)}, objectives=("cycles", "mu_peak_words"),
                           budget={"mu_peak_words": 50},
                           workloads=(sweep.Workload("moe", {"tokens": 4}),
                                      sweep.Workload("mlp")))
    points = [p for v in spec.grid() for p in spec.points(v)]
    store = sweep.SweepStore(tmp_path)
    made = {("moe", 1): (30, 10), ("moe", 2): (20, 60), ("moe", 4): (25, 20),
            ("mlp", 1): (5, 5), ("mlp", 2): (4, 6), ("mlp", 4): None}
    for p in points:
        m = made[p["workload"], p["fabric"]["lanes"]]
        store.add({"key": sweep.point_key(p), **sweep._design_columns(p),
                   **({"status": "does not fit", "reason": "r"} if m is None else
                      {"status": "ok", "cycles": m[0], "mu_peak_words": m[1]})})
    rows = sweep._finish_rows(spec, points, store, {})
    front = {(r["workload"], r["lanes"]) for r in rows if r["pareto"]}
    # moe lanes 2 is over the budget (60 words); moe 4 beats moe 1 on cycles, 1 beats 4 on
    # words; mlp 4 did not fit.
    assert front == {("moe", 1), ("moe", 4), ("mlp", 1), ("mlp", 2)}
    assert [r["within_budget"] for r in rows if r["workload"] == "moe"] == [True, False, True]


# --- the area ---------------------------------------------------------------------------------

def test_area_is_computed_once_per_hardware_and_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("RDAKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sweep, "_sources_digest", lambda: "0" * 16)     # 3 s saved
    calls = []
    monkeypatch.setattr(sweep, "_compute_area",
                        lambda kw: calls.append(kw) or {"cells": kw["lanes"], "memory_bits": 1})
    a = _point()["fabric"]
    assert sweep.fabric_area(a)["cells"] == 4
    assert sweep.fabric_area(dict(a))["cells"] == 4          # from the disk
    assert len(calls) == 1
    assert sweep.fabric_area({**a, "lanes": 2})["cells"] == 2
    assert len(calls) == 2
    assert list((tmp_path / "cache" / "sweep-area").glob("area_*/area.json"))


def test_area_sums_tiles_and_router_classes(monkeypatch):
    """A 3x3 fabric: 5 CUs, 4 MU tiles, and routers of 9 position classes (each of the two
    networks), each counted once per tile of its class."""
    from rdakit.hdl.compute.unit import ComputeUnit
    from rdakit.hdl.fabric.top import MUTile

    def stat(component):
        # Count it as used, as elaborating it would: else Amaranth warns when it is collected
        # (UnusedElaboratable, an error in whichever test is running then).
        component._MustUse__used = True
        if isinstance(component, ComputeUnit):
            return {"cells": 1000, "memory_bits": 10}
        if isinstance(component, MUTile):
            return {"cells": 100, "memory_bits": 1}
        return {"cells": 1, "memory_bits": 0}
    monkeypatch.setattr(sweep, "yosys_stat", stat)
    area = sweep._compute_area({**_point()["fabric"], "rows": 3, "cols": 3})
    assert (area["cu_count"], area["mu_tile_count"]) == (5, 4)
    assert area["router_cells"] == 2 * 9
    assert area["cells"] == 5 * 1000 + 4 * 100 + 18
    assert area["memory_bits"] == 5 * 10 + 4


# --- the Pareto front -------------------------------------------------------------------------

def _brute_front(values):
    def dominates(a, b):
        return all(x <= y for x, y in zip(a, b, strict=True)) and a != b
    return [i for i, v in enumerate(values) if not any(dominates(w, v) for w in values)]


@given(st.integers(1, 4).flatmap(lambda k: st.lists(
    st.tuples(*[st.integers(0, 6)] * k), max_size=25)))
def test_pareto_front_equals_brute_force(values):
    assert sweep.pareto_front(values) == _brute_front(values)


# --- refusals ---------------------------------------------------------------------------------

BASE = ["sweep", "--workload", MOE, "--no-area", "--objective", "cycles"]


@pytest.mark.parametrize("extra, message", [
    (["--axis", "lane=4"], "--axis 'lane' is not a design parameter"),
    (["--axis", "lanes=3"], "--axis lanes must be a power of two from 1 to 16, not 3"),
    (["--axis", "lanes=four"], "--axis lanes must be integers, not 'four'"),
    (["--axis", "lanes"], "--axis must be NAME=VALUE,VALUE,..., not 'lanes'"),
    (["--axis", "lanes=4,4"], "--axis lanes repeats a value"),
    (["--axis", "fabric=2by2"], "--axis fabric must be ROWSxCOLS like 4x4, not '2by2'"),
    (["--axis", "fabric=40x40"], "--axis fabric must be ROWSxCOLS with 1 to 16"),
    (["--axis", "partitioner=best"], "--axis partitioner must be one of"),
    (["--axis", "mu_words=1000"], "--axis mu_words must be a power of two"),
    (["--axis", "noc_queues=lifo"], "--axis noc_queues must be 'voq' or 'fifo', not 'lifo'"),
    (["--fixed", "block_words=3"], "--fixed block_words must be a power of two"),
    (["--fixed", "tokens=3"], "--fixed 'tokens' is not a design parameter"),
    (["--axis", "lanes=4", "--fixed", "lanes=8"], "--axis lanes is also fixed"),
    (["--workload", "moe:tokens=x"], "--workload 'moe:tokens=x': --size tokens must be an"),
    (["--workload", "moe:colour=3"], "workload 'moe:colour=3': --size colour is not a size"),
    (["--workload", "nosuch"], "workload 'nosuch'"),
    (["--objective", "speed"], "--objective 'speed' is not a metric"),
    (["--objective", "cells"], "cells (an objective or a budget) needs the area"),
    (["--budget", "cells"], "--budget must be METRIC=MAX"),
    (["--budget", "cycles=lots"], "--budget cycles must be a number, not 'lots'"),
    (["--budget", "area=5"], "--budget 'area' is not a metric"),
    (["--trials", "3"], "--trials is for --search optuna"),
    (["--trials", "0", "--search", "optuna"], "--trials must be at least 1, not 0"),
    (["--workers", "0"], "--workers must be at least 1, not 0"),
    (["--workers", "2", "--scheduler", "tcp://x:1"], "--workers starts a LocalCluster"),
    (["--scheduler", "nowhere"], "--scheduler 'nowhere': cannot connect (missing port"),
])
def test_bad_options_exit_2_naming_the_input(extra, message, tmp_path, capsys):
    assert main([*BASE, *extra, "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name, text, message", [
    ("s.toml", "axes = [", "s.toml: not valid TOML"),
    ("s.json", "{", "s.json: not valid JSON"),
    ("s.toml", "axis = {}", "s.toml: unknown key 'axis'"),
    ("s.toml", "[axes]\nlanes = []", "s.toml: axes.lanes must be a non-empty list"),
    ("s.toml", "[axes]\nlanes = [3]", "s.toml: axes.lanes must be a power of two from 1 to 16"),
    ("s.toml", "[axes]\nmu_wrds = [4096]", "s.toml: axes 'mu_wrds' is not a design parameter"),
    ("s.json", '{"axes": {"lanes": ["4"]}}', "s.json: axes.lanes must be integers, not '4'"),
    ("s.toml", "[fixed]\nnoc_depth = 0", "s.toml: fixed.noc_depth must be an integer from 1"),
    ("s.toml", "workloads = [{name = 'moe', sizes = {tokens = 'x'}}]",
     "s.toml: workloads[0]: size tokens must be an integer"),
    ("s.toml", "search = 'random'", "s.toml: search must be 'grid' or 'optuna'"),
    ("s.toml", "area = 'yes'", "s.toml: area must be true or false, not 'yes'"),
    ("s.yaml", "", "the spec file must be .toml or .json, not"),
])
def test_bad_spec_files_exit_2_naming_the_entry(name, text, message, tmp_path, capsys):
    path = tmp_path / name
    path.write_text(text)
    assert main([*BASE, str(path), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_a_missing_spec_file_exits_2(tmp_path, capsys):
    assert main([*BASE, str(tmp_path / "none.toml"), "-o", str(tmp_path / "o")]) == 2
    assert "cannot read the spec file" in capsys.readouterr().err


@hostile(30)
@given(name=st.text(max_size=12), values=st.text(max_size=20))
def test_hostile_axes_are_refused_without_a_traceback(name, values, tmp_path_factory):
    """Any ``--axis NAME=VALUES``: refused with exit 2 (a valid one reaches the bogus objective
    after it, also exit 2), never an exception."""
    out = tmp_path_factory.mktemp("hostile") / "o"
    assert main(["sweep", "--workload", MOE, "--no-area", f"--axis={name}={values}",
                 "--objective", "bogus", "-o", str(out)]) == 2
    assert not out.exists()


@hostile(30)
@given(text=st.one_of(st.text(max_size=20), st.builds(
    lambda name, sizes: f"{name}:{sizes}", st.sampled_from(["moe", "mlp", "switch", "x"]),
    st.text(alphabet="tokens_dmlf=,0123456789-", max_size=24))))
def test_hostile_workloads_are_refused_without_a_traceback(text, tmp_path_factory):
    """Any ``--workload`` text: refused with exit 2 naming it (a valid one reaches the bogus
    objective after it, also exit 2), never an exception."""
    out = tmp_path_factory.mktemp("hostile-workload") / "o"
    assert main(["sweep", f"--workload={text}", "--no-area", "--objective", "bogus",
                 "-o", str(out)]) == 2
    assert not out.exists()


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 70) | st.floats(allow_nan=True)
                     | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
_NAMES = st.sampled_from(["lanes", "mu_words", "fabric", "layout", "partitioner", "alloc_mode",
                          "noc_depth", "tokens", "name", "sizes", ""])


@hostile(30)
@given(spec=st.dictionaries(st.sampled_from(["axes", "fixed", "workloads", "objectives",
                                             "budget", "search", "trials", "seed",
                                             "place_steps", "area", "other"]),
                            _JSON | st.dictionaries(_NAMES, _JSON, max_size=3)
                            | st.lists(st.dictionaries(_NAMES, _JSON, max_size=2),
                                       max_size=2), max_size=5))
def test_hostile_spec_files_are_refused_without_a_traceback(spec, tmp_path_factory):
    """Any JSON spec file: refused with exit 2 naming what is wrong (one that passes reaches
    the bogus objective after it, also exit 2), never an exception."""
    folder = tmp_path_factory.mktemp("hostile-spec")
    path = folder / "s.json"
    path.write_text(json.dumps(spec))
    assert main(["sweep", str(path), "--workload", MOE, "--no-area", "--objective", "bogus",
                 "-o", str(folder / "o")]) == 2
    assert not (folder / "o").exists()


@pytest.mark.parametrize("setup, message", [
    (lambda d: (d / "results.csv").write_text("mine\n"), "holds results.csv, which is not a "
                                                         "sweep's"),
    (lambda d: (d / "sweep.json").write_text("{}"), "is not a sweep's"),
    (lambda d: (d / "sweep.json").write_text("not json"), "is not a sweep's"),
])
def test_a_folder_of_other_files_is_not_overwritten(setup, message, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    setup(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main([*BASE, "-o", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_output_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    assert main([*BASE, "-o", str(f)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


# --- the model confirmed on the RTL -----------------------------------------------------------

@pytest.mark.slow
def test_confirm_runs_the_front_on_verilator(tmp_path):
    """The front of a one-point sweep on 2x2 re-run on Verilator: its RTL cycles and the
    model's error (within the model's 10 % target) are added to the row."""
    out = tmp_path / "o"
    assert main(["sweep", *QUICK, "--workers", "1", "--confirm", "verilator",
                 "-o", str(out)]) == 0
    [row] = json.loads((out / "summary.json").read_text())["pareto"]
    assert row["rtl_cycles"] > 0
    assert abs(row["model_error"]) <= 0.10
    assert _rows(out)[0]["rtl_cycles"] == row["rtl_cycles"]


def test_docs_example_spec_is_valid(tmp_path):
    """The spec of docs/sweep.md's worked example passes every check of the command line."""
    from rdakit.cli import build_parser
    from rdakit.cli.sweep import spec_from_args

    root = pathlib.Path(__file__).resolve().parents[2]
    text = (root / "docs" / "sweep.md").read_text()
    (tmp_path / "moe.toml").write_text(text.split("```toml\n", 1)[1].split("```", 1)[0])
    args = build_parser().parse_args(["sweep", str(tmp_path / "moe.toml"),
                                      "-o", str(tmp_path / "o")])
    spec = spec_from_args(args)
    assert spec.workloads[0].name == "moe" and len(spec.grid()) > 1
