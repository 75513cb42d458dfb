"""Row splitting (compiler/split.py): the split graph computes the same values bit for bit,
its blocks spread over the CUs, ``split="auto"`` keeps the faster estimate, and bad ``--split``
values are refused."""

import numpy as np
import pytest
from conftest import assert_interpreter_matches, hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.cli import main
from rdakit.compiler import intops, workloads
from rdakit.compiler.compile import compile_workload, placement_fabric
from rdakit.compiler.graph import DataflowGraph
from rdakit.compiler.lower import sample_inputs
from rdakit.compiler.split import column_blocks, row_blocks, split_cols, split_graph, split_rows
from rdakit.hdl.spec.isa import AluFn, Op
from rdakit.hdl.spec.params import fabric_params


def _mixed(rows):
    """A graph with every way a split continues and ends: a matmul chain with a broadcast
    bias, a residual add of the same shape (split alike), a softmax, a layer norm, a
    transpose (which takes the whole tensor back) and two outputs."""
    rng = np.random.default_rng(rows)
    g = DataflowGraph("mixed")
    x = g.input("x", (rows, 8), "int8")
    w = g.const("w", rng.integers(-8, 8, (8, 8), dtype=np.int8))
    h = g.add("matmul", x, w, name="mm")
    h = g.add("add", h, g.const("b", rng.integers(-50, 50, (8,), dtype=np.int32)), name="bias")
    h = g.add("clip", g.add("shr", h, name="shr", shift=3), name="act", lo=-128, hi=127,
              dtype="int8")
    r = g.add("add", h, x, name="residual")
    r8 = g.add("clip", r, name="r8", lo=-128, hi=127, dtype="int8")
    s = g.add("softmax", r8, name="soft", **intops.softmax_params(0.1, 7))
    c = g.add("softmax", r8, name="causal", **intops.softmax_params(0.1, 7), causal=0)
    n = g.add("layer_norm", r8, g.const("gamma", np.full((8,), 3, np.int8)),
              g.const("beta", np.zeros((8,), np.int32)), name="norm",
              **intops.layer_norm_params(0.1, 10, 8))
    g.output("y", s)
    g.output("c", c)
    g.output("t", g.add("transpose", n, name="tr"))
    return g


@pytest.mark.parametrize("rows,parts", [(16, 8), (5, 3), (2, 4)])
def test_split_graph_evaluates_bit_exactly(rows, parts):
    g = _mixed(rows).validate()
    s = split_rows(g, parts)
    assert len(s) > len(g)
    kinds = [s.kind(n) for n in s.order()]
    assert kinds.count("matmul") == min(parts, rows)          # one matmul per block
    assert kinds.count("softmax") == min(parts, rows) + 1     # the causal one is whole
    assert kinds.count("transpose") == 1                      # not row-wise: whole
    inputs = sample_inputs(g)
    want, got = g.evaluate(inputs), s.evaluate(inputs)
    assert sorted(want) == sorted(got)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_nothing_splits_without_rows_or_parts():
    g = _mixed(1).validate()
    assert len(split_rows(g, 8)) == len(g)                    # one row: nothing to split
    g = _mixed(8).validate()
    assert len(split_rows(g, 1)) == len(g)


@hostile(30)
@given(rows=st.integers(1, 200), parts=st.integers(1, 20))
def test_row_blocks_cover_the_rows_in_order(rows, parts):
    blocks = row_blocks(rows, parts)
    assert len(blocks) == min(rows, parts)
    assert blocks[0][0] == 0 and blocks[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
    sizes = [b - a for a, b in blocks]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_bad_parts_are_refused():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="parts must be a positive integer"):
            split_rows(_mixed(4), bad)
    with pytest.raises(ValueError, match="split must be a positive integer or 'auto'"):
        compile_workload("mlp", params=fabric_params(rows=2, cols=2), split=0)


def test_split_job_is_bit_exact_and_spreads_its_blocks():
    """The MLP with 8 row blocks on a 4x4 fabric: every CU gets a block, the interpreter's
    outputs equal numpy's, and the estimate falls well below the unsplit job's."""
    params = fabric_params(rows=4, cols=4, mu_words=8192, prog_len=512)
    wl = workloads.build("mlp", batch=16, sizes=(64, 128, 64))
    whole, s1 = compile_workload(wl, params=params, partitioner="heft", split=1)
    job, s8 = compile_workload(wl, params=params, partitioner="heft", split=8)
    assert s1.split == 1 and s8.split == 8 and s8.nodes == s1.nodes
    assert s8.parts == len(params.tiles("C")) > s1.parts
    assert s8.estimated_cycles < s1.estimated_cycles / 4
    assert_interpreter_matches(job, wl.reference(wl.inputs))
    _, auto = compile_workload(wl, params=params, partitioner="heft", split="auto")
    assert auto.split == 8 and auto.estimated_cycles == s8.estimated_cycles


def test_a_routers_rows_split_and_its_combine_trusts_the_blocks_indices():
    """The mixture of experts split two ways: the router's top-k and take run on the row
    blocks of the gate logits (take with its indices split alike, the indices' blocks sliced
    once), the blocks' indices are concatenated for dispatch and combine, and the graph and a
    job of it on the interpreter compute the same values bit for bit. The combine knows the
    concatenated indices came from top-k blocks, so it walks the slots without checking them
    (no SLT, the range test, in its code)."""
    wl = workloads.build("moe", tokens=4, d_model=8, d_ff=8, experts=4)
    s = split_rows(wl.graph, 2)
    assert [n for n in s.order() if s.kind(n) in ("topk", "take")] == [
        "gate_topk@0", "gate_topk@1", "gate_take@0", "gate_take@1"]
    assert s.kind("gate_topk") == "concat" and s.kind("gate") == "concat"
    assert s.inputs_of("gate_take@0") == ("gate_logits@0", "gate_topk@0")
    assert sum(s.kind(n) == "slice" for n in s.order()) == 2       # x's two blocks, once
    want = wl.reference(wl.inputs)
    got = s.evaluate(wl.inputs)
    np.testing.assert_array_equal(got["y"], want["y"])
    params = fabric_params(rows=2, cols=2, mu_words=1024, prog_len=1024)
    job, summary = compile_workload(wl, params=params, partitioner="greedy", split=2)
    assert summary.split == 2
    assert_interpreter_matches(job, want)
    (cu, start, end), = [(cu, a, b) for cu, info in job.programs.items()
                         for name, _, _, a, b in info.ops if name == "combine"]
    code = job.config.tiles[cu].program[start:end]
    assert code and not any(i.op is Op.ALUI and i.fn == AluFn.SLT.value for i in code)


class _Rank:
    """A rank that gives each candidate the cycles ``cycles(job)`` says, and notes the jobs."""

    name = "a test's rank"

    def __init__(self, cycles):
        self.cycles, self.jobs = cycles, []

    def __call__(self, job):
        self.jobs.append(job)
        return self.cycles(job)


def test_a_rank_keeps_the_candidate_with_fewest_of_its_cycles():
    """With ``rank``, the candidates (every strategy, split and unsplit) are kept by its cycles,
    not by the estimate, and the summary says so; a rank that cannot tell one candidate leaves
    the estimate's choice."""
    params = fabric_params(rows=2, cols=2, prog_len=1024)
    wl = workloads.build("mlp", batch=8, sizes=(16, 32, 16))
    _, by_estimate = compile_workload(wl, params=params, partitioner="fastest", split="auto")
    assert by_estimate.ranked == ()
    # A rank that prefers the most estimated cycles: the slowest candidate by estimate wins.
    estimates = {}

    def cycles(job):
        estimates[id(job)] = len(estimates)          # candidates in the order compiled
        return 100 - len(estimates)

    rank = _Rank(cycles)
    job, kept = compile_workload(wl, params=params, partitioner="fastest", split="auto",
                                 rank=rank)
    assert len(rank.jobs) == 8                        # 4 strategies, unsplit and split
    assert job is rank.jobs[-1] and kept.split == 2
    how, best, n, first = kept.ranked
    assert (how, best, n) == ("a test's rank", 92, 8)
    assert any(line.startswith("kept by a test's rank: 92 cycles, the fewest of 8 candidates")
               for line in kept.lines())
    # One candidate the rank cannot tell: the estimates decide, as without a rank.
    rank = _Rank(lambda job: None if len(rank.jobs) == 3 else 1)
    _, kept = compile_workload(wl, params=params, partitioner="fastest", split="auto",
                               rank=rank)
    assert kept.ranked == () and kept.estimated_cycles == by_estimate.estimated_cycles
    assert kept.partitioner == by_estimate.partitioner and kept.split == by_estimate.split
    # order="auto": every candidate in both orders, the graph's first.
    rank = _Rank(lambda job: 1)
    _, kept = compile_workload(wl, params=params, partitioner="heft", split="auto",
                               order="auto", rank=rank)
    assert len(rank.jobs) == 4 and kept.order == "graph" and kept.ranked[2] == 4
    rank = _Rank(lambda job: 10 - len(rank.jobs))          # the last: split, schedule order
    _, kept = compile_workload(wl, params=params, partitioner="heft", split="auto",
                               order="auto", rank=rank)
    assert kept.order == "schedule" and kept.split == 2
    assert "ops in schedule order" in kept.lines()[0]
    # One candidate only: nothing to rank.
    rank = _Rank(lambda job: 1)
    _, kept = compile_workload(wl, params=params, partitioner="heft", split=1, rank=rank)
    assert rank.jobs == [] and kept.ranked == ()


def test_split_cli_option(tmp_path, capsys):
    assert main(["compile", "mlp", "--size", "batch=4", "--size", "sizes=16,32,16", "--fabric",
                 "2x2", "--split", "2", "--partitioner", "greedy"]) == 0
    assert "rows split 2 ways" in capsys.readouterr().out
    for bad in ("0", "two", "1.5", "-3"):
        assert main(["compile", "mlp", "--split", bad]) == 2
        assert capsys.readouterr().err == (f"rdakit: error: --split takes auto or a positive "
                                           f"number of row blocks, not {bad!r}\n")
    assert main(["run", "mlp", "--clusters", "2", "--split", "2"]) == 2
    assert "--split applies to one fabric" in capsys.readouterr().err
    assert main(["run", "mlp", "--clusters", "2", "--order", "graph"]) == 2
    assert "--order applies to one fabric" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["compile", "mlp", "--order", "random"])
    assert e.value.code == 2
    assert "argument --order: invalid choice: 'random'" in capsys.readouterr().err


def test_each_cus_constant_pool_is_in_its_home_mu():
    """Every CU streams its weights from its own MU (its home MU, the placement's spread of
    CUs over MUs): with MUs big enough for several pools, the MoE's experts' pools used to
    pile into the MU holding most of their constants and its one request a cycle bounded
    every CU reading them."""
    params = fabric_params(rows=4, cols=4, mu_words=8192, prog_len=2048)
    job, _ = compile_workload("moe", sizes=dict(tokens=4, d_model=16, d_ff=16), params=params,
                              partitioner="heft", split=1)
    home = placement_fabric(params).spread(sorted(job.programs, key=lambda c: (c[1], c[0])))
    pools = {b.name: b.mu for b in job.buffers if b.name.startswith("const@")}
    assert len(pools) == len(job.programs) > 4
    for name, mu in pools.items():
        cu = tuple(int(v) for v in name[len("const@"):].split("#")[0].split(","))
        assert mu == home[cu], name
    assert len(set(pools.values())) == len(pools)          # one pool per MU here


@hostile(30)
@given(cols=st.integers(1, 300), parts=st.integers(1, 20), lanes=st.sampled_from([1, 2, 4, 8]))
def test_column_blocks_start_at_words_and_cover_the_columns(cols, parts, lanes):
    blocks = column_blocks(cols, parts, lanes)
    assert len(blocks) == min(parts, -(-cols // lanes))
    assert blocks[0][0] == 0 and blocks[-1][1] == cols
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
    assert all(a % lanes == 0 and b > a for a, b in blocks)


def test_decoder_step_splits_by_columns_and_evaluates_bit_exactly():
    """One token: its projections and FFN matmuls split by the weights' columns, the bias,
    requantization and residual adds continue on the blocks, and the whole graph computes the
    same values; a job of it runs bit-exactly on the interpreter."""
    wl = workloads.build("decoder", d_model=32, d_ff=64, cache_len=4)
    g = wl.graph
    s = split_cols(g, 4, lanes=4)
    matmuls = [n for n in s.order() if s.kind(n) == "matmul"]
    assert sum(n.startswith("ff1@c") for n in matmuls) == 4
    assert sum(n.startswith("q_proj@c") for n in matmuls) == 4
    assert s.kind("ff1_act") == "concat" and s.kind("res2") == "concat"
    want, got = g.evaluate(wl.inputs), s.evaluate(wl.inputs)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert len(split_graph(g, 4, lanes=4)) == len(s)    # one row: nothing for split_rows
    params = fabric_params(rows=4, cols=4, mu_words=2048, prog_len=1024)
    job, summary = compile_workload(wl, params=params, partitioner="greedy", split=4)
    assert summary.split == 4
    assert_interpreter_matches(job, wl.reference(wl.inputs))


@pytest.mark.long
@pytest.mark.parametrize("workload,sizes", [
    ("mlp", {"batch": 4, "sizes": (16, 32, 16)}),                       # rows
    ("decoder", {"d_model": 16, "d_ff": 32, "cache_len": 4, "heads": 2}),   # columns
])
def test_split_jobs_on_the_rtl(workload, sizes):
    """Split two ways on a 2x2 fabric, in Amaranth's simulator: bit-exact against numpy and
    the interpreter, every buffer freed."""
    from rdakit.sim.flows import e2e

    spec = e2e.RunSpec(workload, sizes, {"rows": 2, "cols": 2, "prog_len": 1024},
                       partitioner="greedy", split=2)
    _, summary = spec.compile()
    assert summary.split == 2
    (row,) = e2e.run(spec, sim="amaranth")
    assert row["numpy"] == "ok" and row["interpreter"] == "ok", row
    assert row["leaked_buffers"] == 0


def test_a_split_warns_of_no_constant_the_users_graph_reads():
    """The column split replaces each weight by its blocks; the weight itself, read by the
    user's graph, is no node "read by no output" to warn about."""
    params = fabric_params(rows=2, cols=2, mu_words=8192, prog_len=1024)
    _, summary = compile_workload("decoder", sizes=dict(d_model=16, heads=2, d_ff=16,
                                                        cache_len=2),
                                  params=params, partitioner="heft", split=2)
    assert summary.split == 2 and summary.unused == () and summary.warnings() == []
    g = DataflowGraph("dead")
    x = g.input("x", (1, 4), "int8")
    g.input("ignored", (1, 4), "int8")
    g.output("y", g.add("relu", x, name="r"))
    _, summary = compile_workload(g, params=params, partitioner="heft", split=2)
    assert summary.unused == ("ignored",)
