"""The importer's sigmoid and tanh (every spelling torch.nn offers) and its hand-written norms
(issue 20, part A): a Llama-style RMSNorm and a hand-written LayerNorm recognised as the IR's
``rms_norm`` and ``layer_norm`` (``compiler/frontend/norms.py``), giving the same integers as
``torch.nn.RMSNorm`` and ``torch.nn.LayerNorm``; what is not exactly such a norm left alone,
its ``pow``/``rsqrt``/``sqrt``/``var`` listed with their counts in the one error; a small
model of them bit-exact on the interpreter."""

import numpy as np
import pytest
from conftest import assert_interpreter_matches

from rdakit.compiler import intops
from rdakit.compiler.frontend import aten
from rdakit.compiler.frontend.importer import QMAX, ModelImportError, import_program

torch = pytest.importorskip("torch")
F = torch.nn.functional
D = 16


class Unary(torch.nn.Module):
    """A linear layer (so the op's input is a computed activation), then ``f``."""

    def __init__(self, f):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)
        self.f = f

    def forward(self, x):
        return self.f(self.lin(x))


def _import(module, x):
    torch.manual_seed(0)
    return import_program(torch.export.export(module.eval(), (x,)), (x,))


def _kinds(model):
    return [model.graph.kind(n) for n in model.graph.order()]


def _x(seed=1, rows=8):
    torch.manual_seed(seed)
    return torch.randn(rows, D)


# --- sigmoid and tanh -------------------------------------------------------------------------

SPELLINGS = {
    "torch.sigmoid": (torch.sigmoid, "sigmoid"),
    "F.sigmoid": (F.sigmoid, "sigmoid"),
    "nn.Sigmoid": (torch.nn.Sigmoid(), "sigmoid"),
    "Tensor.sigmoid": (lambda x: (3 * x).sigmoid(), "sigmoid"),
    "torch.tanh": (torch.tanh, "tanh"),
    "F.tanh": (F.tanh, "tanh"),
    "nn.Tanh": (torch.nn.Tanh(), "tanh"),
}


class Spellings(torch.nn.Module):
    """A linear layer, then every spelling: one output each."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)
        self.fs = list(f for f, _ in SPELLINGS.values())

    def forward(self, x):
        h = self.lin(x)
        return tuple(f(h) for f in self.fs)


@pytest.fixture(scope="module")
def activations():
    torch.manual_seed(0)
    return _import(Spellings(), _x())


def test_each_spelling_becomes_the_integer_kind(activations):
    """Every way torch.nn writes them exports to aten.sigmoid / aten.tanh and imports as the
    IR kind, close to float: measured max abs error 0.0058 (sigmoid), 0.0125 (sigmoid of 3x),
    0.017 (tanh), from the int8 input and output (a step of 1/127 of the largest) more than
    from the kernels (0.0009, 0.0018)."""
    model = activations
    kinds = _kinds(model)
    assert kinds.count("sigmoid") == 4 and kinds.count("tanh") == 3
    assert all(c["supported"] for c in model.coverage.values())
    for out in model.accuracy.outputs:
        assert out.cosine >= 0.9999, out
        assert out.max_abs_error <= 0.02, out


class _Only(torch.nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


def test_attributes_and_reference_path():
    """On a graph input of scale s: the node's attributes are intops' ``*_params(s)`` and the
    int8 result is the kernel's output rescaled to the output's scale, within one step."""
    model = _import(_Only(lambda x: (torch.sigmoid(x), torch.tanh(x))), _x(4, 4) * 3)
    g = model.graph
    (name, xq), = model.inputs.items()
    got = model.evaluate()
    for kind, out in (("sigmoid", "y0"), ("tanh", "y1")):
        node = next(n for n in g.order() if g.kind(n) == kind)
        attrs = g.nx.nodes[node]["attrs"]
        assert attrs == {"sigmoid": intops.sigmoid_params,
                         "tanh": intops.tanh_params}[kind](model.input_scales[name])
        real = intops.logistic_ref(kind, xq, attrs) * intops.output_scale(kind, attrs)
        want = np.clip(np.rint(real / model.output_scales[out]), -QMAX, QMAX)
        assert np.abs(got[out].astype(np.int64) - want).max() <= 1


# --- hand-written norms -------------------------------------------------------------------------

class LlamaRMSNorm(torch.nn.Module):
    """As transformers' LlamaRMSNorm writes it (float32 casts, weight before)."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


class SquaresRMSNorm(LlamaRMSNorm):
    """``x * x``, ``torch.mean(dim=-1)``, the weight after."""

    def forward(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps) * self.weight


class BareRMSNorm(LlamaRMSNorm):
    """No weight."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class VarLayerNorm(torch.nn.Module):
    """``(x - mean) / sqrt(var(unbiased=False) + eps) * w + b``."""

    def __init__(self, eps=1e-5):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.b = torch.nn.Parameter(torch.linspace(-0.5, 0.5, D))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mu) / torch.sqrt(var + self.eps) * self.w + self.b


class SquaresLayerNorm(VarLayerNorm):
    """The variance as the mean of squared deviations, ``* rsqrt``, weight and bias first."""

    def forward(self, x):
        mu = torch.mean(x, dim=-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return self.b + self.w * ((x - mu) * torch.rsqrt(var + self.eps))


def _nn_norm(kind, module):
    """The torch.nn norm with the same weight, bias and eps."""
    if kind == "rms_norm":
        n = torch.nn.RMSNorm(D, eps=module.eps,
                             elementwise_affine=not isinstance(module, BareRMSNorm))
        if n.weight is not None:
            n.weight.data.copy_(module.weight.data)
    else:
        n = torch.nn.LayerNorm(D, eps=module.eps)
        n.weight.data.copy_(module.w.data)
        n.bias.data.copy_(module.b.data)
    return n


HAND = {"llama": (LlamaRMSNorm, "rms_norm"), "squares": (SquaresRMSNorm, "rms_norm"),
        "bare": (BareRMSNorm, "rms_norm"), "var": (VarLayerNorm, "layer_norm"),
        "squares_ln": (SquaresLayerNorm, "layer_norm")}


class Norms(torch.nn.Module):
    """A linear layer, then each norm of ``norms``: one output each."""

    def __init__(self, norms):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)
        self.norms = torch.nn.ModuleList(norms)

    def forward(self, x):
        h = self.lin(x)
        return tuple(n(h) for n in self.norms)


@pytest.fixture(scope="module")
def hand_norms():
    """The hand-written norms and the torch.nn ones of the same weights, imported, and the
    hand-written ones' program."""
    x = _x(2)
    hand = [make() for make, _ in HAND.values()]
    torch.manual_seed(0)
    module = Norms(hand).eval()
    program = torch.export.export(module, (x,))
    torch.manual_seed(0)
    nn_module = Norms([_nn_norm(kind, h) for h, (_, kind) in zip(hand, HAND.values(),
                                                                 strict=True)])
    return import_program(program, (x,)), _import(nn_module, x), program


def test_a_hand_written_norm_is_the_ir_norm(hand_norms):
    """Each is recognised as one norm op (no pow, rsqrt, sqrt or var left: every op
    supported), with the same integers as the torch.nn module of the same weights: the same
    kernel and attributes, the weight and bias folded in (no other op on them)."""
    model, nn_model, _ = hand_norms
    kinds = _kinds(model)
    assert kinds.count("rms_norm") == 3 and kinds.count("layer_norm") == 2
    assert all(c["supported"] for c in model.coverage.values())
    for out in model.accuracy.outputs:
        assert out.cosine >= 0.9998, out
    assert kinds == _kinds(nn_model)
    got, want = model.evaluate(), nn_model.evaluate()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_registry_marks_the_norm_ops_as_pattern_only(hand_norms):
    """The norm ops count as supported where a norm is recognised (op_coverage, which
    recognises them itself when not told)."""
    for op in _FULL.values():
        assert aten.ATEN_OPS[op].norm and aten.ATEN_OPS[op].pattern
    cov = aten.op_coverage(hand_norms[2])
    for op in ("aten.rsqrt.default", "aten.pow.Tensor_Scalar", "aten.sqrt.default",
               "aten.var.correction"):
        assert cov[op]["supported"], op


def _ms(v, dim=-1, keepdim=True):
    return v.pow(2).mean(dim, keepdim=keepdim)


def _shared(h):
    v = _ms(h)
    return h * torch.rsqrt(v + 1e-6) + v


#: Departures from the pattern, each of h (a computed activation) and x (the input).
NOT_NORMS = [
    # the reduction over another dimension, or without keepdim (then unsqueezed)
    lambda h, x: h * torch.rsqrt(_ms(h, 0) + 1e-6),
    lambda h, x: h * torch.rsqrt(_ms(h, keepdim=False) + 1e-6)[:, None],
    # no eps; eps from the inputs; eps outside the square root
    lambda h, x: h * torch.rsqrt(_ms(h)),
    lambda h, x: h * torch.rsqrt(_ms(h) + x[:, :1] ** 2),
    lambda h, x: (h - h.mean(-1, keepdim=True))
    / (torch.sqrt(h.var(-1, keepdim=True, unbiased=False)) + 1e-5),
    # another numerator; squares of another tensor
    lambda h, x: x * torch.rsqrt(_ms(h) + 1e-6),
    lambda h, x: h * torch.rsqrt((h * x).mean(-1, keepdim=True) + 1e-6),
    # the unbiased variance
    lambda h, x: (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, keepdim=True) + 1e-5),
    # the mean of squares read elsewhere too
    _shared,
]


class Departs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x):
        h = self.lin(x)
        return tuple(f(h, x) if f is not _shared else f(h) for f in NOT_NORMS)


_FULL = {"pow": "aten.pow.Tensor_Scalar", "rsqrt": "aten.rsqrt.default",
         "sqrt": "aten.sqrt.default", "var": "aten.var.correction"}


def test_what_is_not_exactly_a_norm_is_refused_with_counts():
    """No departure from the pattern is recognised (each alone in its own chain), and the one
    error lists the norm ops left with their counts (op_coverage says the same)."""
    from rdakit.compiler.frontend import norms
    program = torch.export.export(Departs().eval(), (_x(3),))
    walked = aten.prepare(program)
    assert norms.recognise(walked, aten.live_nodes(walked)) == {}
    with pytest.raises(ModelImportError) as e:
        import_program(program)
    assert str(e.value) == ("The program has 4 unsupported op kinds (18 nodes): "
                            "aten.pow.Tensor_Scalar x7, aten.rsqrt.default x7, "
                            "aten.sqrt.default x2, aten.var.correction x2")
    cov = aten.op_coverage(walked, decompose=False)
    assert [n for n, c in cov.items() if not c["supported"]] == sorted(_FULL.values())


# --- a model of them on the interpreter -------------------------------------------------------

class GatedBlock(torch.nn.Module):
    """Llama RMSNorm, then a sigmoid-gated and a tanh branch, then a hand-written LayerNorm."""

    def __init__(self):
        super().__init__()
        self.norm = LlamaRMSNorm()
        self.gate = torch.nn.Linear(D, D)
        self.up = torch.nn.Linear(D, D)
        self.out = VarLayerNorm()

    def forward(self, x):
        h = self.norm(x)
        return self.out(torch.sigmoid(self.gate(h)) * torch.tanh(self.up(h)) + x)


def test_a_gated_block_runs_bit_exact_on_the_interpreter():
    from rdakit.compiler.compile import compile_workload
    from rdakit.hdl.spec.params import fabric_params
    model = _import(GatedBlock(), _x(5, 6))
    assert {"rms_norm", "layer_norm", "sigmoid", "tanh"} <= set(_kinds(model))
    assert model.accuracy.cosine >= 0.999, model.accuracy.as_dict()
    job = compile_workload(model.workload(), params=fabric_params(2, 2, prog_len=2048),
                           place_steps=20)[0]
    assert_interpreter_matches(job, model.evaluate())
