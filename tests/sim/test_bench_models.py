"""``rdakit bench models``: the model suite's rows (every key, ops counted as the importer walks
them, unsupported ops listed, not a crash) and the command's refusals (no torch, bad names)."""

import json
import sys

import pytest

from rdakit.cli import main
from rdakit.compiler.partition import DEFAULT_STRATEGY
from rdakit.errors import UserError

torch = pytest.importorskip("torch")

from rdakit.compiler.frontend import aten  # noqa: E402  (after the importorskip)
from rdakit.compiler.frontend import models as suite  # noqa: E402
from rdakit.sim.bench import models as bench  # noqa: E402


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """``rdakit bench models --quick --no-rtl --json F`` once: ``(exit status, JSON)``."""
    out = tmp_path_factory.mktemp("bench-models") / "models.json"
    status = main(["bench", "models", "--quick", "--no-rtl", "--json", str(out)])
    return status, json.loads(out.read_text())


def test_quick_json_has_a_row_with_every_key_per_model(quick):
    status, data = quick
    assert status == 0
    assert data["bench"] == "models"
    rows = data["tables"]["models"]
    assert [r["model"] for r in rows] == list(suite.MODELS)
    for r in rows:
        assert tuple(r) == bench.ROW_KEYS
        assert r["nodes"] > 0 and r["exported_nodes"] > 0 and r["params"] > 0
        assert r["export_seconds"] >= 0
        assert r["status"] in bench.STATUSES or r["status"].startswith(
            ("import failed: ", "does not fit: "))
    assert data["figures"]["models"] == len(suite.MODELS)
    assert data["figures"]["partitioner"] == DEFAULT_STRATEGY
    assert data["figures"]["failed_runs"] == 0
    assert set(data["titles"]) == {"models", "coverage", "figures"}


def test_coverage_table_agrees_with_the_rows(quick):
    _, data = quick
    cov = data["tables"]["coverage"]
    for r in data["tables"]["models"]:
        mine = [c for c in cov if c["model"] == r["model"]]
        assert sum(c["count"] for c in mine) == r["nodes"]
        assert len(mine) == r["op_kinds"]
        missing = [c for c in mine if not c["supported"]]
        assert len(missing) == r["unsupported_kinds"]
        # Nodes that read no model input are folded to constants, whatever their op.
        live = sorted(((c["count"] - c["folded"], c["op"]) for c in missing),
                      key=lambda item: (-item[0], item[1]))
        assert all(n > 0 for n, _ in live)
        assert sum(n for n, _ in live) == r["unsupported_nodes"]
        assert sum(c["folded"] for c in mine) == r["folded"]
        # Listed most nodes first, every one of them, and only those.
        assert (r["unsupported"] or "") == ", ".join(f"{op} x{n}" for n, op in live)
        assert (r["status"] == "unsupported") == bool(missing)
        assert all(c["ir"] == "" for c in missing)


def test_coverage_counts_are_the_fx_graphs_nodes(quick):
    """Each op's count is the number of call_function nodes of that target in the graph the
    importer walks, and every such node is counted."""
    _, data = quick
    name = "mixtral"                   # the most op kinds, data-dependent sizes included
    program, _ = suite.export(name, **bench.QUICK[name])
    walked = aten.prepare(program)
    want = {}
    for node in walked.graph.nodes:
        if node.op == "call_function":
            op = aten.op_name(node.target)
            want[op] = want.get(op, 0) + 1
    got = {c["op"]: c["count"] for c in data["tables"]["coverage"] if c["model"] == name}
    assert got == want
    row = next(r for r in data["tables"]["models"] if r["model"] == name)
    assert row["exported_nodes"] == sum(n.op == "call_function" for n in program.graph.nodes)


def test_a_model_with_unsupported_ops_is_a_row_listing_them():
    class Odd(torch.nn.Module):
        def forward(self, x):
            return torch.cumsum(torch.relu(x), dim=1).sort(dim=1).values

    program = torch.export.export(Odd(), (torch.randn(2, 3),))
    coverage = aten.op_coverage(program)
    row = bench.model_row("odd", program, coverage, params=0, export_seconds=0.1)
    assert row["status"] == "unsupported"
    assert row["unsupported"] == "aten.cumsum.default x1, aten.sort.default x1"
    assert (row["unsupported_kinds"], row["unsupported_nodes"]) == (2, 2)
    assert row["nodes"] == sum(c["count"] for c in coverage.values())
    assert tuple(row) == bench.ROW_KEYS
    assert row["compile_seconds"] is None and row["rtl_cycles"] is None


class _MLP(torch.nn.Module):
    """Ops every importer handles: what a suite model's row becomes once its ops are."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.fixture(scope="module")
def mlp():
    """A small MLP's ``(program, inputs, row)``: exported, counted, its row made."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        inputs = (torch.randn(2, 8),)
        program = torch.export.export(_MLP().eval(), inputs)
    row = bench.model_row("mlp", program, aten.op_coverage(program), params=0,
                          export_seconds=0.0)
    assert row["status"] is None and row["unsupported"] is None
    return program, inputs, row


#: The fabric the MLP is compiled for (a compiled job's program length, as rdakit run's).
FABRIC = dict(rows=2, cols=2, prog_len=2048)


def test_a_supported_model_is_imported_compiled_and_interpreted(mlp):
    program, inputs, row = mlp
    row = dict(row)
    bench.measure_import(row, "mlp", program, inputs, choose=lambda workload: FABRIC)
    assert row["status"] == "interpreted" and row["interp_check"] == "ok"
    assert row["fabric"] == "2x2/1024w" and row["ir_nodes"] > row["nodes"]
    assert row["estimated_cycles"] > 0 and row["interp_steps"] > 0
    assert row["lanes_bound"] == (8 * 8 + 8 * 4) * 2 / (4 * 2)   # MACs / (lanes x CUs)
    assert row["import_seconds"] >= 0 and row["compile_seconds"] >= 0
    assert 0.99 <= row["cosine"] <= 1 and row["top1"] == 1.0 and row["max_abs_error"] < 0.05
    assert row["rtl_cycles"] is None and row["rtl_check"] is None


def test_over_the_rtl_limit_is_not_run_on_the_rtl(mlp):
    program, inputs, row = mlp
    row = dict(row)
    bench.measure_import(row, "mlp", program, inputs, choose=lambda workload: FABRIC,
                         sim="amaranth", rtl_limit=1)
    assert row["status"] == "interpreted" and row["rtl_cycles"] is None


@pytest.mark.slow  # 6 s: Amaranth's simulator of a 2x2 fabric
def test_a_supported_model_runs_bit_exact_on_the_rtl(mlp):
    program, inputs, row = mlp
    row = dict(row)
    bench.measure_import(row, "mlp", program, inputs, choose=lambda workload: FABRIC,
                         sim="amaranth", rtl_limit=100_000)
    assert row["status"] == "ran" and row["rtl_check"] == "ok"
    assert 0.5 * row["estimated_cycles"] < row["rtl_cycles"] < 2 * row["estimated_cycles"]


def test_a_model_no_fabric_holds_is_a_row_saying_why(mlp):
    program, inputs, row = mlp
    row = dict(row)

    def choose(workload):
        raise UserError(f"{workload.name} does not fit the 1x2 fabric: too big")

    bench.measure_import(row, "mlp", program, inputs, choose=choose)
    assert row["status"] == "does not fit: mlp does not fit the 1x2 fabric: too big"
    assert row["cosine"] is not None and row["compile_seconds"] is None


def test_models_option_picks_and_orders_a_subset(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["bench", "models", "--quick", "--no-rtl", "--models", "resnet,resnet",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["tables"]["models"]
    assert [r["model"] for r in rows] == ["resnet"]
    assert "Op coverage" in capsys.readouterr().out


@pytest.mark.parametrize("models", ["gpt3", "gpt2,,bert", "GPT2"])
def test_unknown_model_is_refused_naming_it(models, capsys):
    assert main(["bench", "models", "--models", models]) == 2
    err = capsys.readouterr().err
    assert err == (f"rdakit: error: --models takes a comma-separated subset of "
                   f"gpt2,bert,mixtral,resnet, not {models!r}\n")


def test_without_torch_says_to_install_it(monkeypatch, capsys):
    # As if torch were not installed: importing it (and the suite, which imports it) fails.
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "rdakit.compiler.frontend.models")
    monkeypatch.delattr(sys.modules["rdakit.compiler.frontend"], "models")
    assert main(["bench", "models", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rdakit: error: rdakit bench models needs PyTorch, which cannot be "
                          "imported (")
    assert err.endswith("): pip install 'rdakit[torch]'\n") and "Traceback" not in err


def test_bench_models_has_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "models", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rdakit bench models")
    assert all(o in out for o in ("--models", "--quick", "--json", "--sim", "--rtl-limit"))


@pytest.mark.parametrize(("argv", "limit"), [
    ([], 100_000), (["--sim", "icarus"], 100_000), (["--sim", "verilator"], 20_000_000),
    (["--sim", "model"], 20_000_000), (["--sim", "verilator", "--rtl-limit", "5"], 5)])
def test_the_rtl_limit_follows_the_simulator_unless_given(argv, limit, monkeypatch):
    """Amaranth's simulator runs only the small models by default; Verilator, driven directly,
    and the model run the suite at its sizes (the ResNet's 14 million estimated cycles)."""
    pytest.importorskip("torch")
    from rdakit.sim.bench import models as bench_models
    from rdakit.sim.verify.runner import simulator_info

    if any(s in argv for s in ("icarus", "verilator")) \
            and not simulator_info(argv[argv.index("--sim") + 1]).ok:
        pytest.skip("simulator not installed")
    got = {}

    def measure(**kw):
        got.update(kw)
        return [], []

    monkeypatch.setattr(bench_models, "measure", measure)
    monkeypatch.setattr(bench_models, "write_report",
                        lambda *a, report, **kw: report.figure("failed_runs", 0))
    assert main(["bench", "models", "--models", "gpt2", *argv]) == 0
    assert got["rtl_limit"] == limit
