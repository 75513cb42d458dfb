"""Workloads: graph evaluation equals the numpy references, bit for bit, on small sizes."""

import re

import numpy as np
import pytest

from rdakit.compiler import workloads
from rdakit.compiler.graph import DataflowGraph, GraphError


@pytest.mark.parametrize("build", [
    lambda: workloads.mlp(batch=3, sizes=(8, 16, 8, 4)),
    lambda: workloads.mlp(batch=1, sizes=(5, 3)),
    lambda: workloads.decoder_step(d_model=16, heads=2, d_ff=32, cache_len=5),
    lambda: workloads.decoder_step(d_model=16, heads=4, d_ff=16, cache_len=0),
    lambda: workloads.decoder_step(d_model=16, heads=2, d_ff=16, cache_len=3, batch=3),
    lambda: workloads.decoder_step(d_model=16, heads=2, d_ff=16, cache_len=0, batch=2),
    lambda: workloads.moe(tokens=12, d_model=8, d_ff=16, experts=4, k=2),
    lambda: workloads.switch(tokens=10, d_model=8, d_ff=8, experts=4),
    lambda: workloads.mixtral(tokens=16, d_model=8, d_ff=16),
], ids=["mlp", "mlp1", "decoder", "decoder0", "decoder_b3", "decoder0_b2", "moe", "switch",
        "mixtral"])
def test_graph_matches_reference(build):
    wl = build()
    assert wl.check()
    rng = np.random.default_rng(7)
    other = {k: rng.integers(-128, 128, size=v.shape, dtype=v.dtype)
             for k, v in wl.inputs.items()}
    assert wl.check(other)  # full int8 range too


def moe_by_expert(wl, x):
    """An independent MoE: group tokens by expert, run each expert once on its batch."""
    g = wl.graph
    c = {n: g.nx.nodes[n]["attrs"].get("value") for n in g.nx if g.kind(n) == "const"}
    shifts = {n: g.nx.nodes[n]["attrs"].get("shift") for n in g.nx if g.kind(n) == "shr"}
    experts, k = wl.options["experts"], wl.options["k"]
    logits = x.astype(np.int64) @ c["wg"].astype(np.int64)
    y = np.zeros((x.shape[0], c["wg"].shape[0]), dtype=np.int64)
    for e in range(experts):
        tokens, gates = [], []
        for t in range(x.shape[0]):
            order = sorted(range(experts), key=lambda j: (-logits[t, j], j))[:k]
            if e in order:
                tokens.append(t)
                gates.append(min(max(int(logits[t, e]) >> shifts["gate_shr"], 0), 127))
        if not tokens:
            continue
        h = x[tokens].astype(np.int64) @ c[f"e{e}_w1"].astype(np.int64)
        h = np.clip(np.maximum(h, 0) >> shifts[f"e{e}_act_shr"], -128, 127)
        o = np.clip((h @ c[f"e{e}_w2"].astype(np.int64)) >> shifts[f"e{e}_out_shr"], -128, 127)
        shift = g.nx.nodes["combine"]["attrs"]["shift"]
        y[tokens] += ((np.array(gates)[:, None] * o).astype(np.int32) >> shift)
    return y.astype(np.int32)


@pytest.mark.parametrize("k", [1, 2])
def test_moe_equals_direct_loop(k):
    wl = workloads.moe(tokens=20, d_model=8, d_ff=16, experts=8, k=k, seed=3)
    x = wl.inputs["x"]
    out = wl.graph.evaluate({"x": x})["y"]
    assert np.array_equal(out, moe_by_expert(wl, x))
    assert np.array_equal(out, wl.reference({"x": x})["y"])


def test_moe_expert_inputs_have_runtime_rows():
    wl = workloads.mixtral(tokens=16, d_model=8, d_ff=8)
    t = wl.graph.type_of("e3_in")
    assert t.dynamic and t.shape == (16, 8) and t.expected_rows == 4.0
    assert t.expected_nbytes == 32 and t.nbytes == 128


def test_kv_cache_grows_one_entry_per_step():
    steps = workloads.run_decoder(4, d_model=16, heads=2, d_ff=16, seed=1)
    assert [s["k_cache_out"].shape[0] for s in steps] == [1, 2, 3, 4]
    for a, b in zip(steps, steps[1:], strict=False):
        assert np.array_equal(b["k_cache_out"][:-1], a["k_cache_out"])
        assert np.array_equal(b["v_cache_out"][:-1], a["v_cache_out"])
    ref = workloads.run_decoder(4, d_model=16, heads=2, d_ff=16, seed=1, use_reference=True)
    for a, b in zip(steps, ref, strict=True):
        assert all(np.array_equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("cache_len", [0, 3])
def test_batched_decoding_is_each_sequence_decoded_alone(cache_len):
    """A step of ``batch`` sequences gives each sequence what a one-sequence step gives it:
    its row of ``y`` and its caches, each sequence's caches inputs and outputs of their own
    (none when empty)."""
    sizes = dict(d_model=16, heads=2, d_ff=16, cache_len=cache_len, seed=4)
    wl = workloads.decoder_step(batch=4, **sizes)
    inputs = wl.inputs
    caches = [f"s{i}_{n}" for i in range(4) for n in ("k_cache", "v_cache")]
    assert sorted(inputs) == sorted(["x", *caches] if cache_len else ["x"])
    out = wl.graph.evaluate(inputs)
    assert sorted(out) == sorted(["y", *(f"{c}_out" for c in caches)])
    one = workloads.decoder_step(**sizes)
    for i in range(4):
        alone = one.graph.evaluate({"x": inputs["x"][i:i + 1],
                                    **{n: inputs[f"s{i}_{n}"] if cache_len else
                                       np.zeros((0, 16), np.int8)
                                       for n in ("k_cache", "v_cache")}})
        assert np.array_equal(out["y"][i:i + 1], alone["y"])
        for n in ("k_cache_out", "v_cache_out"):
            assert np.array_equal(out[f"s{i}_{n}"], alone[n]), (i, n)
    assert wl.graph.name.endswith("_b4") and wl.options["batch"] == 4


def test_build_by_name_and_errors():
    assert workloads.build("mlp", batch=2, sizes=(4, 4)).graph.name == "mlp_b2_4x4"
    with pytest.raises(ValueError, match="^Workload must be one of decoder, mixtral, mlp, moe, "
                                         "switch, not 'cnn'$"):
        workloads.build("cnn")
    with pytest.raises(TypeError, match="^batch must be a positive integer, not 0$"):
        workloads.mlp(batch=0)
    with pytest.raises(TypeError, match="^batch must be a positive integer, not 0$"):
        workloads.decoder_step(batch=0)
    with pytest.raises(ValueError, match="^heads must divide d_model \\(10\\), not 3$"):
        workloads.decoder_step(d_model=10, heads=3)
    with pytest.raises(ValueError, match="^k must be at most experts \\(2\\), not 3$"):
        workloads.moe(experts=2, k=3)


def test_load_graph(tmp_path):
    f = tmp_path / "user.py"
    f.write_text("import numpy as np\n"
                 "from rdakit.compiler.graph import DataflowGraph\n"
                 "def build():\n"
                 "    g = DataflowGraph('user')\n"
                 "    x = g.input('x', (2, 2), 'int8')\n"
                 "    g.output('y', g.add('relu', x))\n"
                 "    return g\n")
    g = workloads.load_graph(f)
    assert isinstance(g, DataflowGraph) and g.name == "user" and g.outputs == ["y"]
    f2 = tmp_path / "var.py"
    f2.write_text("from rdakit.compiler import workloads\n"
                  "graph = workloads.mlp(batch=1, sizes=(2, 2))\n")
    assert workloads.load_graph(f2).name == "mlp_b1_2x2"


def test_load_graph_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        workloads.load_graph(tmp_path / "missing.py")
    f = tmp_path / "empty.py"
    f.write_text("x = 1\n")
    with pytest.raises(GraphError, match=f"^Graph file {re.escape(repr(str(f)))} must define "
                                         f"build\\(\\) or graph$"):
        workloads.load_graph(f)
    f.write_text("graph = 3\n")
    with pytest.raises(GraphError, match="must provide a DataflowGraph, not int$"):
        workloads.load_graph(f)
    f.write_text("from rdakit.compiler.graph import DataflowGraph\n"
                 "graph = DataflowGraph('bad')\n"
                 "graph.add('relu', 'nothing', name='r')\n")
    with pytest.raises(GraphError, match="^Node 'r' reads from 'nothing'"):
        workloads.load_graph(f)
