"""Mixture-of-experts routing in the torch.export importer (compiler/frontend/moe.py): a sparse
MoE written as the reference Mixtral is (softmax router, top-k, renormalised gates, one-hot
mask, torch.where, x[token], index_add_) imports with every op supported as topk, take,
dispatch and combine, close to float and bit-exact on the interpreter for 2x2; the variants
(torch.where(chosen == e), gates not renormalised) too; a routing it does not recognise is
refused naming the node, and the routing ops used elsewhere count as unsupported."""

import functools

import numpy as np
import pytest
from conftest import assert_interpreter_matches

from rdakit.compiler.frontend.importer import ModelImportError, import_program

torch = pytest.importorskip("torch")

from rdakit.compiler.compile import compile_workload  # noqa: E402
from rdakit.compiler.frontend import aten  # noqa: E402
from rdakit.hdl.spec.params import fabric_params  # noqa: E402

TOKENS, D, FF = 8, 16, 16


class Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(D, FF, bias=False)
        self.w2 = torch.nn.Linear(FF, D, bias=False)
        self.w3 = torch.nn.Linear(D, FF, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TinyMoE(torch.nn.Module):
    """``experts`` SwiGLU experts, top-``k`` routing. ``mask``: "one_hot" (the reference's
    one-hot mask permuted to (experts, k, tokens)) or "eq" (``torch.where(chosen == e)``,
    token-major); ``renormalise`` the gates or not; ``expert_tail`` applied to each expert's
    output (a variant the importer must refuse)."""

    def __init__(self, experts, k, *, mask="one_hot", renormalise=True, expert_tail=None):
        super().__init__()
        self.k, self.mask, self.renormalise, self.tail = k, mask, renormalise, expert_tail
        self.inp = torch.nn.Linear(D, D)
        self.router = torch.nn.Linear(D, experts, bias=False)
        self.experts = torch.nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x):
        x = self.inp(x)
        gates = torch.nn.functional.softmax(self.router(x), dim=-1)
        gates, chosen = torch.topk(gates, self.k, dim=-1)
        if self.renormalise:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            if self.mask == "eq":
                token, slot = torch.where(chosen == e)
            else:
                slot, token = torch.where(mask[e])
            y = expert(x[token])
            if self.tail is not None:
                y = self.tail(y)
            out.index_add_(0, token, y * gates[token, slot, None])
        return out + x


def _export(module, x):
    torch.manual_seed(0)
    with torch.no_grad():
        return torch.export.export(module.eval(), (x,))


def _module(*args, **kw):
    torch.manual_seed(1)
    return TinyMoE(*args, **kw)


def _inputs():
    return torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(2))


def _kinds(model):
    return [d["kind"] for _, d in model.graph.nx.nodes(data=True)]


@pytest.fixture(scope="module", params=[(4, 2, "one_hot", True), (3, 1, "one_hot", True),
                                        (4, 1, "eq", False)],
                ids=["top2_of_4", "top1_of_3", "top1_of_4_eq_not_renormalised"])
def imported(request):
    experts, k, mask, renormalise = request.param
    return _import(experts, k, mask, renormalise), experts, k


@functools.cache
def _import(experts, k, mask="one_hot", renormalise=True):
    """The tiny MoE imported (once per configuration in the session)."""
    x = _inputs()
    return import_program(_export(_module(experts, k, mask=mask, renormalise=renormalise), x),
                          (x,), name="moe")


def test_routing_imports_with_every_op_supported_and_close_to_float(imported):
    model, experts, k = imported
    assert all(c["supported"] for c in model.coverage.values()), model.coverage
    kinds = _kinds(model)
    assert kinds.count("topk") == 1 and kinds.count("combine") == 1
    assert kinds.count("dispatch") == experts
    assert "take" in kinds or k == 1      # a top-1 renormalised gate is the constant 1
    assert model.accuracy.cosine >= 0.99, model.accuracy.lines()


def test_routing_compiles_for_2x2_and_is_bit_exact_on_the_interpreter(imported):
    model, _, _ = imported
    job = compile_workload(model.workload(), params=fabric_params(
        2, 2, prog_len=2048, mu_words=4096))[0]
    assert_interpreter_matches(job, model.evaluate())


def test_the_gates_are_the_softmax_of_the_chosen_logits():
    """Renormalised top-k probabilities are the softmax over the chosen logits: the imported
    gates follow the float gates to the int8 step of the probabilities (2^-7)."""
    x = _inputs()
    module = _module(4, 2)
    values = _values(_import(4, 2))
    gates = next(n for n in values if n.endswith("_gates"))
    idx = next(n for n in values if n.endswith("_idx"))
    with torch.no_grad():
        h = module.inp(x)
        p, chosen = torch.topk(torch.softmax(module.router(h), -1), 2, dim=-1)
        want = (p / p.sum(-1, keepdim=True)).numpy()
    agree = (values[idx] == chosen.numpy()).all(axis=1)     # the same experts, same order
    assert agree.mean() >= 0.75
    assert np.max(np.abs(values[gates][agree] / 128 - want[agree])) <= 3 / 128


def _values(model):
    """Every IR node's value on the model's inputs (the graph's own op semantics)."""
    import networkx as nx

    from rdakit.compiler.graph import OP_KINDS
    g, values = model.graph.nx, {}
    for n in nx.topological_sort(g):
        data = g.nodes[n]
        if data["kind"] == "input":
            values[n] = model.inputs[n]
        else:
            values[n] = OP_KINDS[data["kind"]].evaluate([values[i] for i in data["inputs"]],
                                                        data["attrs"])
    return values


def test_an_expert_that_mixes_its_rows_is_refused_naming_the_node():
    x = _inputs()
    module = _module(3, 1, expert_tail=lambda y: y - y.mean(0, keepdim=True))
    with pytest.raises(ModelImportError, match=r"node mean \(aten\.mean\.dim\): expert 0 "
                                               r"applies aten\.mean\.dim to its rows"):
        import_program(_export(module, x), (x,))


def test_a_mask_that_is_not_one_experts_is_refused_naming_the_nonzero():
    """mask[:, 0] (which expert each token chose first, for every expert at once) is made of
    mask ops only, but it is not one expert's tokens: its nonzero is refused."""
    class Wrong(TinyMoE):
        def forward(self, x):
            x = self.inp(x)
            gates, chosen = torch.topk(torch.softmax(self.router(x), -1), 1, dim=-1)
            mask = torch.nn.functional.one_hot(chosen, num_classes=3).permute(2, 1, 0)
            out = torch.zeros_like(x)
            for expert in self.experts:
                _, token = torch.where(mask[:, 0])
                out.index_add_(0, token, expert(x[token]) * gates[token, 0, None])
            return out
    x = _inputs()
    torch.manual_seed(1)
    with pytest.raises(ModelImportError, match=r"node nonzero \(aten\.nonzero\.default\): the "
                                               r"mask of this nonzero is not one expert's"):
        import_program(_export(Wrong(3, 1), x), (x,))


def test_other_uses_of_the_routing_indices_are_refused_naming_the_node():
    class Shifted(TinyMoE):
        def forward(self, x):
            x = self.inp(x)
            gates, chosen = torch.topk(torch.softmax(self.router(x), -1), 1, dim=-1)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                token, slot = torch.where(chosen >= e)     # not a one-hot column
                out.index_add_(0, token, expert(x[token]) * gates[token, slot, None])
            return out
    x = _inputs()
    torch.manual_seed(1)
    with pytest.raises(ModelImportError, match=r"node ge \(aten\.ge\.Scalar\): the routing "
                                               r"indices of topk are used by aten\.ge\.Scalar"):
        import_program(_export(Shifted(3, 1), x), (x,))


def test_routing_ops_outside_a_routing_are_unsupported():
    """x[idx] on an index input is not a routing: index.Tensor is listed as unsupported (it
    was before routings were recognised, and must stay so outside them)."""
    class Gather(torch.nn.Module):
        def forward(self, x, idx):
            return x[idx] * 2
    program = torch.export.export(Gather(), (torch.randn(4, 3), torch.tensor([0, 2])))
    cov = aten.op_coverage(program)
    assert cov["aten.index.Tensor"]["supported"] is False
    with pytest.raises(ModelImportError, match=r"aten\.index\.Tensor x1"):
        import_program(program)


def test_a_program_decomposed_by_its_user_imports_too():
    """torch's default decompositions turn index_add_ into index_put, zeros_like into
    full_like and unbind into slices: the same routing, recognised in that spelling too (the
    rest is kept whole: decomposed, silu becomes a sigmoid the importer refuses)."""
    x = _inputs()
    table = torch.export.default_decompositions()
    ops = (torch.ops.aten.index_add.default, torch.ops.aten.zeros_like.default,
           torch.ops.aten.unbind.int)
    program = _export(_module(4, 2), x).run_decompositions({op: table[op] for op in ops})
    names = {str(n.target) for n in program.graph.nodes}
    assert {"aten.index_put.default", "aten.full_like.default"} <= names
    assert "aten.unbind.int" not in names and "aten.index_add.default" not in names
    model = import_program(program, (x,))
    assert all(c["supported"] for c in model.coverage.values())
    assert _kinds(model).count("dispatch") == 4
    assert model.accuracy.cosine >= 0.99


def test_a_top1_renormalised_gate_is_exactly_one():
    """With one chosen expert, p / p.sum() is 1: the combine's gates are 1 (an int8 softmax
    of one logit would give 127/128, every output 0.8 % short)."""
    values = _values(_import(3, 1))
    gates = next(n for n in values if n.endswith("_gates"))
    assert (values[gates] == 1).all()
