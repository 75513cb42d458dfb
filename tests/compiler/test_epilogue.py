"""A matmul's requantization in the stream that computes it (passes.FuseEpilogue): an
elementwise chain that is one output stage (``clip(relu(v >> s), -128, 127)``, a shift, a
ReLU, the int8 range) folds into the ``matmul_nt`` producing what it reads, and the PACK_SUM
streams apply SHIFT and POST to each sum; or into a ``matmul_axpy`` (one row times a run-time
B, attention's ``p @ V``), whose OUTER_SUM stream applies them to its sums. Bit-exact
against numpy for random sizes, lanes, local buffers and chains, under random interleavings;
the fold happens exactly where it may."""

import collections

import numpy as np
from conftest import hostile
from hypothesis import example, given
from hypothesis import strategies as st

from rdakit.compiler.compile import compile_workload
from rdakit.compiler.graph import DataflowGraph
from rdakit.compiler.lower.layout import LoweringError
from rdakit.compiler.lower.templates import axpy_form
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.job import run_job_interp

#: Chains after the matmul: (ops, whether they are one output stage, so they fold).
CHAINS = {
    "requant_relu": ([("relu",), ("shr",), ("clip", -128, 127)], True),
    "requant": ([("shr",), ("clip", -128, 127)], True),
    "relu_half": ([("shr",), ("clip", 0, 127)], True),
    "shift": ([("shr",)], True),
    "relu": ([("relu",)], True),
    "narrow_clip": ([("shr",), ("clip", -100, 100)], False),     # MAX and MIN: two passes
    "add_bias": ([("add",), ("shr",)], False),                   # a tensor operand
}


def graph(rows, k, n, chain, shift, runtime_a, runtime_b, rng):
    g = DataflowGraph("epilogue")
    a = g.input("a", (rows, k), "int8")
    if runtime_a:
        a = g.add("relu", a, name="a_relu")      # A computed on the fabric, not a host buffer
    if runtime_b:                                # B computed too: one row of A, matmul_axpy
        b = g.add("relu", g.input("b", (k, n), "int8"), name="b_relu")
    else:
        b = g.const("w", rng.integers(-128, 128, (k, n)).astype(np.int8))
    y = g.add("matmul", a, b, name="mm")
    for i, (kind, *args) in enumerate(CHAINS[chain][0]):
        if kind == "shr":
            y = g.add("shr", y, name=f"c{i}", shift=shift)
        elif kind == "clip":
            y = g.add("clip", y, name=f"c{i}", lo=args[0], hi=args[1], dtype="int8"
                      if args == [-128, 127] else "int32")
        elif kind == "add":
            y = g.add("add", y, g.const("bias", rng.integers(-9, 9, (1, n)).astype(np.int32)),
                      name=f"c{i}")
        else:
            y = g.add(kind, y, name=f"c{i}")
    g.output("y", y)
    return g.validate()


@hostile(30)
# A row of the product longer than the local buffer: B transposed (matmul_nt), where
# matmul_axpy's accumulator was refused.
@example(rows=1, k=1, n=9, chain="shift", shift=0, lanes=1, local_words=8, runtime_a=False,
         runtime_b=True, one_cu=True, seed=0)
@given(rows=st.integers(1, 6), k=st.integers(1, 40), n=st.integers(1, 12),
       chain=st.sampled_from(sorted(CHAINS)), shift=st.integers(0, 20),
       lanes=st.sampled_from([1, 4]), local_words=st.sampled_from([8, 16, 64]),
       runtime_a=st.booleans(), runtime_b=st.booleans(), one_cu=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_requantization_runs_in_the_matmul_stream(rows, k, n, chain, shift, lanes,
                                                    local_words, runtime_a, runtime_b, one_cu,
                                                    seed):
    rng = np.random.default_rng(seed)
    if runtime_b:
        rows = 1
    g = graph(rows, k, n, chain, shift, runtime_a, runtime_b, rng)
    inputs = {"a": rng.integers(-128, 128, (rows, k)).astype(np.int8)}
    if runtime_b:
        inputs["b"] = rng.integers(-128, 128, (k, n)).astype(np.int8)
    params = fabric_params(1, 2, lanes=lanes, local_words=local_words, prog_len=4096,
                           mu_words=8192) if one_cu else fabric_params(
        2, 2, lanes=lanes, local_words=local_words, prog_len=4096, mu_words=8192)
    try:
        job, _ = compile_workload(g, params=params, partitioner="round_robin", place_steps=20,
                                  split=1, inputs=inputs)
    except LoweringError as e:
        # matmul_axpy sums a row of the product in the local buffer: refused, clearly, when
        # that row does not fit beside the constants (a row longer than the whole buffer
        # takes the transposed form instead).
        assert runtime_b and "the accumulator of a row of the product" in str(e), e
        assert local_words - 2 * lanes < -(-n // lanes) < local_words   # only the constants
        return
    outputs, result, _ = run_job_interp(job, schedule="random", seed=seed)
    assert result.ok, result.errors
    np.testing.assert_array_equal(job.decode(outputs, check_padding=True)["y"],
                                  g.evaluate(inputs)["y"])
    ops = {name: (kind, cu) for cu, info in job.programs.items()
           for name, kind, *_ in info.ops}
    kinds = collections.Counter(kind for kind, _ in ops.values())
    chain_cus = {cu for name, (kind, cu) in ops.items() if name.startswith("c")}
    # Where the fold may happen: the chain is one output stage on the matmul's CU, and a row
    # of A (for matmul_axpy, and a row of the product) fits the local buffer beside the
    # constants (a lane mask, the transposes' identity).
    axpy = runtime_b and axpy_form(k, -(-k // lanes), -(-n // lanes), local_words)
    need = -(-k // lanes) + (-(-n // lanes) if axpy else 0)
    foldable = CHAINS[chain][1] and need <= local_words - 2 * lanes
    assert kinds["matmul_axpy" if axpy else "matmul_nt"] == 1, kinds
    if one_cu and foldable:
        assert kinds["ew"] == runtime_a + runtime_b, kinds      # (a_relu, b_relu)
        assert not chain_cus
    if not CHAINS[chain][1]:
        assert chain_cus                                         # never folded


def test_a_shift_relu_or_clip_stays_with_the_op_it_reads(monkeypatch):
    """The multilevel partition of the smallest MLP on 2x2 puts its first layer's clip on the
    other CU (a pass and a hand-over there for a node it sees as a few cycles);
    ``fuse_chains`` moves it back to its chain's CU, where the lowering folds it, and the
    job is faster on the performance model."""
    from rdakit.compiler import compile as compile_mod
    from rdakit.sim.flows.e2e import SMALLEST
    from rdakit.sim.runtime.events import ModelRank

    params = fabric_params(2, 2, prog_len=1024)

    def cus(job):
        return {n: cu for _, _, cu, nodes in job.lowered for n in nodes}

    def cut_chains(job):
        g, at = job.graph, cus(job)
        return [n for n in g.order() if g.kind(n) in compile_mod.FUSED_KINDS
                and g.kind(g.inputs_of(n)[0]) not in ("input", "const")
                and list(g.nx.successors(g.inputs_of(n)[0])) == [n]
                and at[n] != at[g.inputs_of(n)[0]]]

    def compiled():
        return compile_workload("mlp", sizes=SMALLEST["mlp"], params=params,
                                partitioner="multilevel", place_steps=2000)[0]

    job = compiled()
    assert not cut_chains(job)
    with monkeypatch.context() as m:
        m.setattr(compile_mod, "fuse_chains", lambda graph, result, cost: result)
        raw = compiled()
    assert cut_chains(raw) == ["act0"]
    rank = ModelRank()
    assert rank(job) < rank(raw)
