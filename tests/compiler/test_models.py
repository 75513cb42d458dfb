"""The model suite (compiler/frontend/models.py): every model exports at small sizes, gives
finite float outputs of the right shape, and is the same, weights, inputs and outputs, on every
export; bad names and sizes are refused naming what was given."""

import pytest

torch = pytest.importorskip("torch")

from rdakit.compiler.frontend import models  # noqa: E402  (after the importorskip)

#: Small sizes of each model (the defaults are the issue's; these keep the file fast).
SMALL = {
    "gpt2": dict(vocab=32, d_model=16, heads=2, layers=1, tokens=4),
    "bert": dict(vocab=32, d_model=16, heads=2, layers=1, tokens=4, batch=2),
    "mixtral": dict(vocab=32, d_model=16, heads=4, kv_heads=2, d_ff=16, experts=4, k=2,
                    layers=1, tokens=4),
    "resnet": dict(widths=(4, 8), blocks=1, classes=10, image=16, batch=4),
}

SHAPES = {"gpt2": (1, 4, 32), "bert": (2, 4, 16), "mixtral": (1, 4, 32), "resnet": (4, 10)}


@pytest.fixture(scope="module")
def exports():
    """Each model exported twice at its small sizes: ``{name: (first, second)}``, each an
    ``(ExportedProgram, example_inputs)`` pair."""
    return {name: (models.export(name, **SMALL[name]), models.export(name, **SMALL[name]))
            for name in models.MODELS}


def test_the_suite_is_the_issues_four_models_at_the_issues_sizes():
    assert models.MODELS == ("gpt2", "bert", "mixtral", "resnet")
    for name in ("gpt2", "bert", "mixtral"):
        assert (models.SIZES[name]["d_model"], models.SIZES[name]["heads"],
                models.SIZES[name]["layers"]) == (64, 4, 2)
    assert (models.SIZES["mixtral"]["experts"], models.SIZES["mixtral"]["k"]) == (4, 2)
    assert models.SIZES["resnet"]["image"] == 32 and models.SIZES["resnet"]["classes"] == 10
    assert all(sizes["seed"] == 0 for sizes in models.SIZES.values())


@pytest.mark.parametrize("name", models.MODELS)
def test_export_gives_finite_outputs_of_the_models_shape(exports, name):
    (program, inputs), _ = exports[name]
    with torch.no_grad():
        out = program.module()(*inputs)
    assert tuple(out.shape) == SHAPES[name]
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    assert float(out.abs().max()) > 0
    # The exported program computes what the module does.
    module, _ = models.build(name, **SMALL[name])
    with torch.no_grad():
        assert torch.equal(module(*inputs), out)


@pytest.mark.parametrize("name", models.MODELS)
def test_two_exports_are_the_same(exports, name):
    (p1, in1), (p2, in2) = exports[name]
    assert len(in1) == len(in2) and all(torch.equal(a, b) for a, b in zip(in1, in2, strict=True))
    s1, s2 = p1.state_dict, p2.state_dict
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert [(n.op, str(n.target)) for n in p1.graph.nodes] == \
        [(n.op, str(n.target)) for n in p2.graph.nodes]
    with torch.no_grad():
        assert torch.equal(p1.module()(*in1), p2.module()(*in1))


def test_seed_changes_weights_and_inputs_and_leaves_the_callers_random_state():
    state = torch.random.get_rng_state()
    m0, (x0,) = models.build("gpt2", **SMALL["gpt2"])
    m1, (x1,) = models.build("gpt2", **SMALL["gpt2"], seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert not torch.equal(m0.wte.weight, m1.wte.weight) and not torch.equal(x0, x1)


def test_models_are_in_eval_mode_and_gpt2_ties_its_head():
    for name in models.MODELS:
        module, _ = models.build(name, **SMALL[name])
        assert not module.training
    gpt2, _ = models.build("gpt2", **SMALL["gpt2"])
    assert gpt2.lm_head.weight is gpt2.wte.weight


def test_exported_graphs_have_the_ops_of_their_architecture(exports):
    def targets(name):
        return {str(n.target) for n in exports[name][0][0].graph.nodes
                if n.op == "call_function"}

    attention = "aten.scaled_dot_product_attention.default"
    assert {attention, "aten.layer_norm.default", "aten.gelu.default",
            "aten.embedding.default"} <= targets("gpt2")
    assert {attention, "aten.layer_norm.default", "aten.gelu.default"} <= targets("bert")
    # Mixtral: RMSNorm, rotary embeddings (neg, cat), grouped-query attention (expand), SwiGLU
    # experts and the sparse top-k dispatch with its data-dependent sizes.
    assert {attention, "aten.rms_norm.default", "aten.silu.default", "aten.topk.default",
            "aten.softmax.int", "aten.neg.default", "aten.cat.default", "aten.expand.default",
            "aten.where.default", "aten.index_add_.default"} <= targets("mixtral")
    assert {"aten.conv2d.default", "aten.batch_norm.default", "aten.max_pool2d.default",
            "aten.adaptive_avg_pool2d.default", "aten.relu.default"} <= targets("resnet")


def test_causal_models_do_not_look_ahead():
    for name in ("gpt2", "mixtral"):
        module, (ids,) = models.build(name, **SMALL[name])
        changed = ids.clone()
        changed[0, -1] = (changed[0, -1] + 1) % SMALL[name]["vocab"]
        with torch.no_grad():
            a, b = module(ids), module(changed)
        assert torch.equal(a[0, :-1], b[0, :-1]) and not torch.equal(a[0, -1], b[0, -1])


def test_resnet_classes_differ_across_its_example_batch():
    """At its default sizes, as the bench runs it: top-1 agreement on a batch that a random
    network gives one class would measure nothing."""
    module, (images,) = models.build("resnet")
    assert tuple(images.shape) == (8, 3, 32, 32)
    with torch.no_grad():
        classes = module(images).argmax(dim=1)
    assert len(set(classes.tolist())) >= 4
    bn = module.stem[1]
    assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))


@pytest.mark.parametrize("name, sizes, message", [
    ("gpt3", {}, "model must be one of gpt2, bert, mixtral, resnet, not 'gpt3'"),
    ("gpt2", {"dmodel": 8},
     "gpt2 takes the sizes vocab, d_model, heads, layers, tokens, batch, seed, not 'dmodel'"),
    ("bert", {"heads": 0}, "bert's size heads must be a positive integer, not 0"),
    ("bert", {"tokens": True}, "bert's size tokens must be a positive integer, not True"),
    ("gpt2", {"seed": -1}, "gpt2's size seed must be an integer >= 0, not -1"),
    ("gpt2", {"d_model": 10, "heads": 4}, "d_model must be a multiple of heads, not 10 with "
                                           "heads 4"),
    ("mixtral", {"heads": 4, "kv_heads": 3},
     "heads must be a multiple of kv_heads, not 4 with kv_heads 3"),
    ("mixtral", {"d_model": 12, "heads": 4},
     "d_model // heads must be even (rotary embeddings turn pairs), not 3"),
    ("mixtral", {"k": 5}, "k must be at most experts (4), not 5"),
    ("resnet", {"widths": ()}, "widths must name at least one stage's channels, not ()"),
    ("resnet", {"widths": (4, "8")},
     "resnet's size widths must be a tuple of positive integers, not (4, '8')"),
])
def test_bad_names_and_sizes_are_refused_naming_them(name, sizes, message):
    with pytest.raises(ValueError) as e:
        models.build(name, **sizes)
    assert str(e.value) == message
