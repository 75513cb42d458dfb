"""The torch.export front end: small modules of our own exported, imported, compiled for a 2x2
fabric and run on the functional interpreter bit-exact against the imported graph's evaluate;
quantized results close to float; every unsupported op listed with its count; layout ops as
free views or exact copies; requantization that cannot leave int32; bad programs refused."""

import math
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from conftest import hostile, interpreted
from hypothesis import given
from hypothesis import strategies as st

from rdakit.compiler.frontend import aten
from rdakit.compiler.frontend.graphfile import INLINE_ELEMENTS, write_graph_file
from rdakit.compiler.frontend.importer import (
    QMAX,
    ModelImportError,
    _Act,
    _Builder,
    import_program,
    load_program,
)
from rdakit.compiler.workloads import load_graph
from rdakit.errors import UserError

torch = pytest.importorskip("torch")

from rdakit.compiler.compile import compile_workload  # noqa: E402
from rdakit.hdl.spec.params import fabric_params  # noqa: E402

P2 = fabric_params(2, 2, prog_len=2048)


# --- the modules ------------------------------------------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Block(torch.nn.Module):
    """A ReLU-attention transformer block: heads split by view/transpose, scores scaled by a
    constant, residuals, a ReLU feed-forward."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.o = torch.nn.Linear(d, d)
        self.f1 = torch.nn.Linear(d, 2 * d)
        self.f2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        dh = d // self.heads
        q, k, v = (z.view(b, t, self.heads, dh).transpose(1, 2)
                   for z in self.qkv(x).split(d, -1))
        a = torch.relu(q @ k.transpose(-2, -1) / math.sqrt(dh)) / t
        c = (a @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(c)
        return x + self.f2(torch.relu(self.f1(x)))


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


class Layout(torch.nn.Module):
    """Every layout op the importer handles, between two computing ops."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):                              # x (2, 4, 8)
        y = self.fc(x)
        a, b = y.chunk(2, dim=-1)                      # (2, 4, 4) twice
        c = torch.cat([b, a], dim=1)                   # (2, 8, 4)
        p = c.permute(2, 0, 1).contiguous()            # (4, 2, 8)
        r = p.reshape(8, 8)[1:7]                       # (6, 8)
        s1, s2 = r.split([3, 3], dim=0)
        e = s1.unsqueeze(0).expand(2, 3, 8)            # (2, 3, 8)
        f = (e + s2).flatten(0, 1)                     # (6, 8)
        g = f.t().mean(0, keepdim=True)                # (1, 6)
        h = x.select(0, 1).sum(-1).unsqueeze(0)[:, 0:1].squeeze(-1)   # (1,)
        return g + h, torch.transpose(f, 0, 1).view(4, 2, 6)


def _export(module, *inputs, seed=0):
    torch.manual_seed(seed)
    return torch.export.export(module().eval(), tuple(inputs))


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(1)
    return import_program(_export(MLP, torch.randn(8, 16)), name="mlp")


@pytest.fixture(scope="module")
def attention():
    torch.manual_seed(2)
    return import_program(_export(Attention, torch.randn(1, 6, 16)), name="attention")


@pytest.fixture(scope="module")
def layout():
    torch.manual_seed(3)
    return import_program(_export(Layout, torch.randn(2, 4, 8)), name="layout")


def _interp_outputs(model):
    return interpreted(compile_workload(model.workload(), params=P2, place_steps=300)[0])


def _kinds(model):
    kinds = {}
    for n in model.graph.order():
        kinds[model.graph.kind(n)] = kinds.get(model.graph.kind(n), 0) + 1
    return kinds


# --- bit-exact and close to float -------------------------------------------------------------

@pytest.mark.parametrize("name", ["mlp", "attention", "layout"])
def test_interpreter_is_bit_exact_against_the_graph(name, request):
    model = request.getfixturevalue(name)
    got, want = _interp_outputs(model), model.evaluate()
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype == np.int8
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_mlp_is_close_to_float(mlp):
    acc = mlp.accuracy
    assert acc.cosine >= 0.99
    assert acc.top1 >= 0.95                 # a 10-class head: argmax over the last dimension
    want = mlp.float_outputs["y"]
    got = mlp.dequantize(mlp.evaluate())["y"]
    assert got.shape == want.shape == (8, 10)
    assert acc.max_abs_error == pytest.approx(float(np.max(np.abs(got - want))))
    assert acc.max_abs_error < 0.05 * float(np.max(np.abs(want)))
    assert mlp.example_source == "the program's example_inputs"
    assert list(mlp.inputs) == ["x"] and mlp.inputs["x"].dtype == np.int8


@pytest.mark.parametrize("name", ["attention", "layout"])
def test_other_modules_are_close_to_float(name, request):
    assert request.getfixturevalue(name).accuracy.cosine >= 0.99


def test_report_as_dict_has_every_output(layout):
    d = layout.accuracy.as_dict()
    assert [o["name"] for o in d["outputs"]] == ["y0", "y1"]
    assert d["cosine"] == min(o["cosine"] for o in d["outputs"])
    assert len(layout.accuracy.lines()) == 2


def test_weights_are_int8_per_output_channel(mlp):
    w = mlp.graph.nx.nodes["linear_w"]["attrs"]["value"]
    assert w.dtype == np.int8 and w.shape == (16, 32)         # (K, N): x @ w
    # Per output channel: every column reaches the int8 peak.
    assert (np.abs(w.astype(int)).max(axis=0) == QMAX).all()


# --- layout -------------------------------------------------------------------------------------

def test_views_that_keep_the_row_major_data_are_free():
    class Views(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)
            self.b = torch.nn.Linear(16, 4)

        def forward(self, x):                              # (6, 16)
            h = self.a(x).view(2, 3, 16).unsqueeze(0).squeeze(0).contiguous()
            return self.b(h.reshape(6, 16).flatten(0, -1).view(6, 16))
    model = import_program(_export(Views, torch.randn(6, 16)))
    kinds = _kinds(model)
    assert not {"slice", "concat", "transpose"} & set(kinds), kinds
    assert kinds["matmul"] == 2


def test_heads_are_slices_and_one_matmul_per_head(attention):
    kinds = _kinds(attention)
    # Per block: q/k/v slices of 2 heads, q.k^T and p.v per head, the projections.
    assert kinds["matmul"] == 2 * (2 * 2 + 4)
    # The merge of the heads: one concatenation per block.
    assert kinds["concat"] == 2
    assert kinds["transpose"] == 2 * 2                      # k^T per head


@hostile(30)
@given(data=st.data())
def test_any_layout_materializes_exactly(data):
    """A random chain of view ops on an element map, then materialized: the IR graph gives
    every element where the map says (views, transposes, slices, expands, concatenations)."""
    rows = data.draw(st.integers(1, 6), label="rows")
    cols = data.draw(st.integers(1, 6), label="cols")
    b = _Builder("layout")
    b.g.input("x", (rows, cols), "int32")
    a = b.act("x", (rows, cols), None, "int32").addr
    values = np.arange(rows * cols, dtype=np.int32).reshape(rows, cols)
    for _ in range(data.draw(st.integers(1, 5), label="steps")):
        op = data.draw(st.sampled_from(["reshape", "transpose", "slice", "expand", "cat"]))
        if op == "reshape" and a.size:
            dims = [d for d in range(1, a.size + 1) if a.size % d == 0]
            d = data.draw(st.sampled_from(dims))
            a = a.reshape(d, -1)
        elif op == "transpose" and a.ndim == 2:
            a = a.T
        elif op == "slice" and a.shape[0] > 1:
            lo = data.draw(st.integers(0, a.shape[0] - 1))
            a = a[lo:lo + data.draw(st.integers(1, a.shape[0] - lo))]
        elif op == "expand" and a.shape[0] == 1:
            a = np.broadcast_to(a, (data.draw(st.integers(1, 3)), *a.shape[1:]))
        elif op == "cat":
            a = np.concatenate([a, a[::-1]], axis=data.draw(st.integers(0, a.ndim - 1)))
    node = b.materialize(_Act(a, None, "int32"))
    b.g.output("y", node)
    flat = values.reshape(-1)
    got = b.g.validate().evaluate({"x": values})["y"]
    np.testing.assert_array_equal(got, flat[a.reshape(got.shape)])


# --- requantization -------------------------------------------------------------------------------

@hostile(30)
@given(k=st.integers(1, 4096), in_scale=st.floats(1e-4, 10), w_scale=st.floats(1e-4, 10),
       out_scale=st.floats(1e-5, 100), bias=st.floats(-1e3, 1e3), data=st.data())
def test_requantization_cannot_leave_int32_and_rounds(k, in_scale, w_scale, out_scale, bias,
                                                      data):
    """Whatever the scales and the bound of the accumulator, the integer multiplier, rounding
    term and shift keep every intermediate value in int32, and the result is the rounded,
    saturated real value (within one step where the multiplier lost precision)."""
    bound = QMAX * QMAX * k
    b = _Builder("rq")
    b.g.input("acc", (1, 4), "int32")
    node = b.requant([("acc", in_scale * w_scale, bound)], out_scale, bias=bias, stem="y",
                     shape2d=(1, 4))
    b.g.output("out", node)
    g = b.g.validate()
    acc = np.asarray(data.draw(st.lists(st.integers(-bound, bound), min_size=4, max_size=4)),
                     dtype=np.int32).reshape(1, 4)
    # Every intermediate value, in int64, stays inside int32 (so int32 wraparound never acts).
    values = {"acc": acc.astype(np.int64)}
    for n in g.order():
        kind, ins = g.kind(n), g.inputs_of(n)
        attrs = g.nx.nodes[n]["attrs"]
        if kind == "const":
            values[n] = attrs["value"].astype(np.int64)
        elif kind == "mul":
            values[n] = values[ins[0]] * values[ins[1]]
        elif kind == "add":
            values[n] = values[ins[0]] + values[ins[1]]
        elif kind == "shr":
            values[n] = values[ins[0]] >> attrs["shift"]
        elif kind == "clip":
            values[n] = np.clip(values[ins[0]], attrs["lo"], attrs["hi"])
        if kind != "input" and n in values:
            assert np.abs(values[n]).max() < 2 ** 31, n
    got = g.evaluate({"acc": acc})["out"].astype(np.int64)
    real = (acc.astype(np.float64) * in_scale * w_scale + bias) / out_scale
    want = np.clip(np.floor(real + 0.5), -QMAX, QMAX)
    tolerance = 1 + 2.0 ** -20 * bound * in_scale * w_scale / out_scale
    assert np.abs(got - want).max() <= tolerance


# --- coverage and errors --------------------------------------------------------------------------

class Unsupported(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        w = torch.sin(self.w)                      # reads no input: folded, not refused
        y = torch.sin(x) @ w + torch.sin(x * 2)
        return torch.atan(y) + torch.cos(y) + torch.cos(y * 3)


@pytest.fixture(scope="module")
def unsupported():
    return _export(Unsupported, torch.randn(2, 4))


def test_every_unsupported_op_is_listed_with_its_count(unsupported):
    with pytest.raises(ModelImportError) as e:
        import_program(unsupported)
    assert isinstance(e.value, UserError)
    assert str(e.value) == ("The program has 3 unsupported op kinds (5 nodes): "
                            "aten.cos.default x2, aten.sin.default x2, aten.atan.default x1")


def test_coverage_counts_the_graph_and_folds_constant_nodes(unsupported):
    cov = aten.op_coverage(unsupported)
    graph = aten.prepare(unsupported).graph
    calls = [n for n in graph.nodes if n.op == "call_function"]
    assert sum(c["count"] for c in cov.values()) == len(calls)
    assert cov["aten.sin.default"] == {"count": 3, "folded": 1, "supported": False, "ir": []}
    assert cov["aten.matmul.default"]["supported"]
    assert cov["aten.matmul.default"]["ir"][0] == "matmul"
    assert aten.op_coverage(unsupported, decompose=False).keys() == cov.keys()


def test_nodes_that_read_no_input_fold_to_constants():
    class Folded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 4))

        def forward(self, x):
            return x @ (torch.sin(self.w) * 2)
    model = import_program(_export(Folded, torch.randn(3, 8)))
    assert model.folded == 2 and model.accuracy.cosine >= 0.99
    assert _kinds(model)["matmul"] == 1


def test_registry_names_ops_torch_has():
    """Every registered name is an op torch has (a typo would never match a node), every
    handled op is registered, and the kinds it needs exist in the IR."""
    for name, op in aten.ATEN_OPS.items():
        assert op.name == name
        if name.startswith("aten."):
            _, packet, overload = name.split(".")
            assert hasattr(getattr(torch.ops.aten, packet), overload), name
        assert aten.supported(name), name


def test_a_divisor_computed_from_the_inputs_is_refused_naming_the_node():
    class Div(torch.nn.Module):
        def forward(self, x):
            return x / (x.sum(-1, keepdim=True) + 1)
    with pytest.raises(ModelImportError, match=r"^The program: node div \(aten.div.Tensor\): "
                                               r"the divisor must be a constant"):
        import_program(_export(Div, torch.randn(2, 4)))


def test_bad_files_are_refused_naming_them(tmp_path):
    missing = tmp_path / "none.pt2"
    with pytest.raises(ModelImportError, match=f"^'{missing}' does not exist$"):
        import_program(missing)
    with pytest.raises(ModelImportError, match=f"^'{tmp_path}' is not a file$"):
        load_program(tmp_path)
    text = tmp_path / "model.pt2"
    text.write_text("not a model")
    with pytest.raises(ModelImportError, match=r"is not a torch.export program \(a .pt2 file "
                                               r"from torch.export.save\): it is not a zip"):
        import_program(text)
    other = tmp_path / "other.pt2"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("hello.txt", "a zip, but no program")
    with pytest.raises(ModelImportError, match=f"^'{other}' is not a torch.export program"):
        import_program(other)
    with pytest.raises(ModelImportError, match="needs a torch.export.ExportedProgram or the "
                                               "path of a .pt2 file, not int"):
        import_program(3)


def test_saved_program_imports_the_same_and_random_inputs_are_seeded(tmp_path, mlp):
    path = tmp_path / "mlp.pt2"
    torch.manual_seed(1)
    ep = _export(MLP, torch.randn(8, 16))
    torch.export.save(ep, path)
    again = import_program(path)
    assert again.name == "mlp" and again.example_source == "the program's example_inputs"
    np.testing.assert_array_equal(again.evaluate()["y"], mlp.evaluate()["y"])
    ep.example_inputs = None
    torch.export.save(ep, tmp_path / "bare.pt2")
    first, second = import_program(tmp_path / "bare.pt2"), import_program(tmp_path / "bare.pt2")
    assert first.example_source == "random (seed 0)"
    np.testing.assert_array_equal(first.inputs["x"], second.inputs["x"])
    other = import_program(tmp_path / "bare.pt2", seed=1)
    assert not np.array_equal(other.inputs["x"], first.inputs["x"])


def test_the_compiler_and_cli_work_without_torch(tmp_path):
    """With torch unimportable, rdakit, the compiler and the CLI import, and a .pt2 gets a
    clear error (exit 2) saying what to install."""
    path = tmp_path / "m.pt2"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x", "y")
    code = ("import sys; sys.modules['torch'] = None\n"
            "import rdakit, rdakit.cli, rdakit.compiler.compile\n"
            "import rdakit.compiler.frontend.aten, rdakit.compiler.frontend.importer\n"
            "from rdakit.cli import main\n"
            f"sys.exit(main(['compile', {str(path)!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"rdakit: error: '{path}' is a torch.export program: importing "
                                f"it needs PyTorch; install it with pip install "
                                f"'rdakit[torch]'")


# --- the graph file -----------------------------------------------------------------------------

def test_graph_file_round_trips(tmp_path, attention):
    written = write_graph_file(attention.graph, tmp_path / "attn.py", header="attention")
    assert [p.name for p in written] == ["attn.py", "attn.npz"]
    source = written[0].read_text()
    assert "CONSTANTS = dict(_npz)" in source and "def build():" in source
    with np.load(written[1]) as big:
        assert big.files and all(big[k].size > INLINE_ELEMENTS for k in big.files)
    graph = load_graph(written[0])
    assert graph.name == attention.graph.name and len(graph) == len(attention.graph)
    got, want = graph.evaluate(attention.inputs), attention.evaluate()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
