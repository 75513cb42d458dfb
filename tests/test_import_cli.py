"""``rdakit import`` and the .pt2 programs ``rdakit compile`` and ``rdakit run`` take: the graph
file it writes compiles, the program compiles and runs directly, and every bad input is refused
with exit 2 and a message naming what the user typed."""

import json
import shutil
import zipfile

import numpy as np
import pytest

from rdakit.cli import main

torch = pytest.importorskip("torch")


class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Unsupported(torch.nn.Module):
    def forward(self, x):
        return torch.atan(x) + torch.sin(x)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("programs")
    torch.manual_seed(0)
    torch.export.save(torch.export.export(TinyMLP().eval(), (torch.randn(2, 8),)),
                      folder / "mlp.pt2")
    torch.export.save(torch.export.export(Unsupported(), (torch.randn(2, 4),)),
                      folder / "unsupported.pt2")
    return folder


def test_import_writes_a_graph_file_that_compiles(programs, tmp_path, capsys):
    graph, report = tmp_path / "out" / "mlp.py", tmp_path / "r.json"
    assert main(["import", str(programs / "mlp.pt2"), "-o", str(graph), "--json",
                 str(report)]) == 0
    out = capsys.readouterr().out
    assert "imported mlp: 3 aten nodes of 2 kinds" in out
    assert "example inputs: the program's example_inputs" in out
    assert "accuracy of y against float: max abs error" in out
    assert f"wrote {graph} and {graph.with_suffix('.npz')}" in out
    data = json.loads(report.read_text())
    assert {"program", "graph", "ops", "example_inputs", "folded", "input_scales",
            "output_scales", "accuracy", "coverage"} <= set(data)
    assert data["coverage"]["aten.linear.default"]["count"] == 2
    assert data["accuracy"]["cosine"] >= 0.99
    assert main(["compile", str(graph), "--fabric", "2x2", "-o", str(tmp_path / "g.bit")]) == 0
    assert (tmp_path / "g.bit").stat().st_size > 0


def test_compile_takes_the_program_itself(programs, tmp_path, capsys):
    assert main(["compile", str(programs / "mlp.pt2"), "--fabric", "2x2", "--listing",
                 str(tmp_path / "l.txt")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("imported mlp: 3 aten nodes")
    assert "example inputs: the program's example_inputs" in out


@pytest.mark.parametrize("command", ["import", "compile", "run"])
def test_bad_programs_are_refused_naming_them(programs, tmp_path, capsys, command):
    text = tmp_path / "notes.pt2"
    text.write_text("hello")
    foreign = tmp_path / "foreign.pt2"
    with zipfile.ZipFile(foreign, "w") as z:
        z.writestr("a.txt", "b")
    cases = [
        (tmp_path / "none.pt2", f"'{tmp_path / 'none.pt2'}' does not exist"),
        (text, f"'{text}' is not a torch.export program (a .pt2 file from torch.export.save): "
               f"it is not a zip archive"),
        (foreign, f"'{foreign}' is not a torch.export program (a .pt2 file from "
                  f"torch.export.save): file in archive is not in a subdirectory: a.txt\n"),
        (programs / "unsupported.pt2", f"'{programs / 'unsupported.pt2'}' has 2 unsupported op "
                                       f"kinds (2 nodes): aten.atan.default x1, "
                                       f"aten.sin.default x1"),
    ]
    for path, message in cases:
        assert main([command, str(path), "--fabric" if command != "import" else "--seed",
                     "2x2" if command != "import" else "0"]) == 2, path
        err = capsys.readouterr().err
        assert err.startswith(f"rdakit: error: {message}"), err
        assert "Traceback" not in err


def test_outputs_never_overwrite_the_program(programs, tmp_path, capsys):
    prog = tmp_path / "prog.py"                      # a program saved under a .py name
    shutil.copy(programs / "mlp.pt2", prog)
    assert main(["import", str(prog), "-o", str(prog)]) == 2
    assert capsys.readouterr().err == (f"rdakit: error: --output '{prog}' is the input FILE.pt2 "
                                       f"'{prog}': writing it would destroy it\n")
    npz = tmp_path / "weights.npz"                   # the constants would land on the input
    shutil.copy(programs / "mlp.pt2", npz)
    assert main(["import", str(npz), "-o", str(tmp_path / "weights.py")]) == 2
    assert capsys.readouterr().err == (
        f"rdakit: error: --output '{tmp_path / 'weights.py'}': its constants would go to "
        f"'{npz}', the input program: writing it would destroy it\n")
    assert main(["import", str(programs / "mlp.pt2"), "-o", str(tmp_path / "g.txt")]) == 2
    assert "--output must name a Python file ending in .py, not" in capsys.readouterr().err
    assert main(["run", str(programs / "mlp.pt2"), "--size", "batch=2"]) == 2
    assert capsys.readouterr().err == ("rdakit: error: --size applies to built-in workloads, "
                                       "not to graph files\n")


@pytest.mark.slow          # 9.5 s: the RTL of a 2x2 fabric in Amaranth's simulator
def test_run_on_the_rtl_is_bit_exact(programs, tmp_path, capsys):
    """One RTL run of an imported MLP on a 2x2 fabric in Amaranth's simulator: outputs equal
    the graph's evaluate (the numpy reference of a .pt2) and the interpreter, bit for bit."""
    report = tmp_path / "run.json"
    assert main(["run", str(programs / "mlp.pt2"), "--fabric", "2x2", "--report",
                 str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["figures"]["numpy"] == "ok" and data["figures"]["interpreter"] == "ok"
    assert data["figures"]["cycles"] > 0
    assert "imported mlp" in capsys.readouterr().out
    assert np.isfinite(data["figures"]["utilization"])
