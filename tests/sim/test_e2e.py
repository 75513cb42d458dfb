"""End to end (``rdakit run``): compile, run on the RTL, check against numpy and the
interpreter, report, adapt; and the errors."""

import asyncio
import dataclasses
import json
import pathlib
import re

import numpy as np
import pytest

from rdakit.cli import main
from rdakit.compiler.adapt import MeasuredCostModel, measured_cost
from rdakit.compiler.cost import CostModel
from rdakit.sim.flows import e2e
from rdakit.sim.flows.e2e import PROFILE_CATEGORIES, SMALLEST, RunSpec
from rdakit.sim.runtime.host import NoReply, harness_host
from rdakit.sim.verify.runner import (
    SIMULATORS,
    HarnessProcess,
    require_simulator,
)

FABRIC_2X2 = {"rows": 2, "cols": 2, "prog_len": 2048}
FABRIC_4X4 = {"rows": 4, "cols": 4, "prog_len": 2048}


def _sizes_args(name):
    out = []
    for k, v in SMALLEST[name].items():
        value = ",".join(map(str, v)) if isinstance(v, tuple) else str(v)
        out += ["--size", f"{k}={value}"]
    return out


#: A graph whose one op (a concat of 18 inputs) reads more host buffers than a CU's
#: registers pass: the rest come in a reference table the host fills.
MANY_INPUTS = ("from rdakit.compiler.graph import DataflowGraph\n"
               "def build():\n"
               "    g = DataflowGraph('many')\n"
               "    xs = [g.input(f'x{i}', (2, 5), 'int32') for i in range(18)]\n"
               "    g.output('y', g.add('concat', *xs, name='stacked', axis=0))\n"
               "    return g\n")

#: Two sequences decoded in one step (``decoder_step(batch=...)``).
BATCHED_DECODER = {**SMALLEST["decoder"], "batch": 2}

#: A mixture of experts whose combined output (8 rows of 8 words) does not fit a 2x2's 64 local
#: words beside the staged indices and gates but four rows do: combined a chunk of rows at a
#: time (``templates.combine_chunks``; ``test_the_chunked_combine_on_the_model`` checks it is).
CHUNKED_MOE = {"tokens": 8, "d_model": 32, "d_ff": 4, "experts": 4, "k": 2}


def test_batched_decoding_on_the_model():
    """Two sequences' step on the performance model: bit-exact, every buffer freed."""
    (rows,) = e2e.run_many([RunSpec("decoder", BATCHED_DECODER, FABRIC_2X2)], sim="model")
    _check_rows(rows, RunSpec("decoder", BATCHED_DECODER, FABRIC_2X2))


def test_the_chunked_combine_on_the_model(monkeypatch):
    """CHUNKED_MOE, which the RTL runs below, combines a chunk of rows at a time: bit-exact on
    the performance model, every buffer freed."""
    from rdakit.compiler.lower import templates

    chunked = []
    real = templates.combine_chunks
    monkeypatch.setattr(templates, "combine_chunks", lambda *a: chunked.append(1) or real(*a))
    spec = RunSpec("moe", CHUNKED_MOE, FABRIC_2X2)
    (rows,) = e2e.run_many([spec], sim="model")
    _check_rows(rows, spec)
    assert chunked


def _check_rows(rows, spec):
    assert len(rows) == spec.iterations
    for r in rows:
        assert r["hw_error"] is None, r["hw_error"]
        assert r["numpy"] == "ok" and r["interpreter"] == "ok", (r["numpy"], r["interpreter"])
        assert r["leaked_buffers"] == 0 and r["allocs"] == r["frees"] > 0
        assert r["cycles"] >= r["lower_bound"] > 0
        assert 0 < r["utilization"] <= 1 and r["noc_flits"] > 0 and r["mu_peak_words"] > 0
        assert not r["misrouted"]
        # The rooflines: a CU's lanes do one MAC a cycle, an MU takes one request a cycle, a
        # CU sends one flit a cycle; each bound is the figure of the busiest tile.
        cus = [t for t in r["tiles"] if t["kind"] == "CU"]
        mus = [t for t in r["tiles"] if t["kind"] == "MU"]
        assert r["mu_bound"] == max(t["flits_in"] for t in mus) > 0
        assert r["injection_bound"] == max(t["flits_out"] for t in cus) > 0
        assert r["cycles"] >= max(r["lanes_bound"], r["mu_bound"], r["injection_bound"])
        assert r["cycles_over_bound"] == pytest.approx(r["cycles"] / max(
            r["lower_bound"], r["lanes_bound"], r["mu_bound"], r["injection_bound"]))
        # The profile: each CU's categories sum to its busy cycles, and the hardware executed
        # exactly the stream steps the interpreter did.
        profile = {p["tile"]: p for p in r["profile"]}
        busy = {t["tile"]: t["busy"] for t in cus if t["busy"]}
        assert set(profile) == {*busy, "total"}
        for tile, p in profile.items():
            cats = [p[c] for c in PROFILE_CATEGORIES]
            assert min(cats) >= 0 and sum(cats) == p["busy"]
            assert tile == "total" or p["busy"] == busy[tile]
        assert profile["total"]["step"] == r["interpreter_stream_steps"] > 0
        assert all(t["busy"] <= r["cycles"] and t["wait"] <= t["stall"] <= t["busy"]
                   for t in cus)


# --- the CLI on the built-in simulator --------------------------------------------------------

def test_run_smallest_moe_on_the_builtin_simulator(tmp_path, capsys):
    report, plot = tmp_path / "r.json", tmp_path / "u.png"
    rc = main(["run", "moe", *_sizes_args("moe"), "--report", str(report), "--plot", str(plot),
               "-q"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS" in out and "Tiles" in out
    data = json.loads(report.read_text())
    assert data["figures"]["numpy"] == "ok" and data["figures"]["interpreter"] == "ok"
    assert data["figures"]["allocs"] == data["figures"]["frees"]
    rows = data["tables"]["iterations_full"]
    assert rows[0]["cycles"] == data["figures"]["cycles"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _check_documented_keys(data)


def _documented_report_keys():
    """The keys of docs/e2e.md's "Report keys" table (a row may name several: `a`, `b`)."""
    text = (pathlib.Path(__file__).parents[2] / "docs" / "e2e.md").read_text()
    section = text.split("## Report keys", 1)[1].split("\n## ", 1)[0]
    keys = []
    for line in section.splitlines():
        if line.startswith("| `"):
            keys += re.findall(r"`(\w+)`", line.split("|")[1])
    return keys


#: The keys of a row of ``tiles`` (docs/e2e.md: kind, busy, stall, wait, flits in/out,
#: utilization; for MUs allocs, frees, peak words), in the table's order.
TILE_KEYS = ["tile", "kind", "busy", "stall", "wait", "utilization", "active", "flits_out",
             "flits_in", "peak_words", "allocs", "frees", "live_after"]


def _check_documented_keys(data):
    documented = _documented_report_keys()
    assert "tiles" in documented and "cycles" in documented
    row = data["tables"]["iterations_full"][0]
    assert set(documented) <= set(row), set(documented) - set(row)
    # Every documented key is a headline figure too, except the per-tile tables and the
    # figures that only the iteration rows carry.
    row_only = {"tiles", "profile", "estimated_cycles", "interpreter_instructions",
                "interpreter_stream_steps"}
    assert set(documented) - row_only <= set(data["figures"])
    for t in row["tiles"]:
        assert list(t) == TILE_KEYS
        assert re.fullmatch(r"\(\d+, \d+\)", t["tile"])


def test_tile_row_json_is_the_documented_row_and_reads_back():
    t = e2e.TileRow(tile=(1, 0), kind="MU", busy=9, stall=2, wait=None, utilization=0.5,
                    active=0.25, flits_out=3, flits_in=4, peak_words=8, allocs=1, frees=1,
                    live_after=0)
    d = t.as_json()
    assert list(d) == TILE_KEYS and d["tile"] == "(1, 0)"
    assert e2e.TileRow.from_json(json.loads(json.dumps(d))) == t


def test_workload_too_large_for_the_fabric(capsys):
    rc = main(["run", "mlp", "--size", "batch=64", "--size", "sizes=512,512,512",
               "--fabric", "1x2", "-q"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "does not fit the 1x2 fabric" in err and "words" in err


@pytest.mark.parametrize("args,message", [
    (["--adapt", "0"], "--adapt takes a number of iterations >= 1"),
    (["--fabric", "2by2"], "--fabric must be ROWSxCOLS"),
    (["--size", "tokens"], "--size must be KEY=VALUE"),
])
def test_bad_options(args, message, capsys):
    assert main(["run", "moe", *args, "-q"]) == 2
    assert message in capsys.readouterr().err


def test_unknown_workload(capsys):
    assert main(["run", "transformer-xl", "-q"]) == 2
    assert "Workload must be one of" in capsys.readouterr().err


def _tampered(monkeypatch, tamper):
    original = RunSpec.compile

    def compile_(self, *args, **kwargs):
        job, summary = original(self, *args, **kwargs)
        tamper(job)
        return job, summary

    monkeypatch.setattr(RunSpec, "compile", compile_)


def test_mismatch_exits_nonzero(monkeypatch, capsys):
    """A wrong expectation (as if the hardware computed something else) fails the run."""
    def tamper(job):
        name = job.outputs[0]
        job.expected[name] = job.expected[name].copy()
        job.expected[name][0, 0] += 1

    _tampered(monkeypatch, tamper)
    rc = main(["run", "switch", *_sizes_args("switch"), "-q"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED" in out and "differs from numpy in 1 elements" in out


def test_hardware_error_exits_nonzero(monkeypatch, capsys):
    """A CU that halts on an error (here an undefined instruction patched into a program)
    fails the run with the CU and the error named."""
    import dataclasses

    def tamper(job):
        xy, tile = next(iter(job.config.tiles.items()))
        if not tile.program:
            xy, tile = next((k, t) for k, t in job.config.tiles.items() if t.program)
        program = list(tile.program)
        program[len(program) // 2] = 0x3f            # opcode 63: undefined
        job.config.tiles[xy] = dataclasses.replace(tile, program=program)

    _tampered(monkeypatch, tamper)
    rc = main(["run", "switch", *_sizes_args("switch"), "-q"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "BAD_INSTRUCTION" in out


# The fast model in the default suite; the same on Amaranth's simulator takes 28 s.
@pytest.mark.parametrize("sim", ["model", pytest.param("amaranth", marks=pytest.mark.slow)])
def test_adaptation_runs_iterations_and_learns_costs(tmp_path, sim):
    spec = RunSpec("switch", SMALLEST["switch"], FABRIC_2X2, iterations=3)
    rows = e2e.run(spec, sim=sim)
    _check_rows(rows, spec)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    # After the first run the model has measured every CU: the partitioner's model predicts
    # the CUs' working cycles of the second run better than the work model did the first's
    # (it under-estimates this fabric several times over).
    first, second = rows[0], rows[1]

    def error(row):
        return max(abs(a["predicted"] - a["measured"]) / a["measured"]
                   for a in row["adaptation"])

    assert error(second) < error(first)
    assert {a["cu"] for a in first["adaptation"]} == {
        f"{xy}" for xy in spec.params.tiles("C") if any(
            a["cu"] == f"{xy}" for a in first["adaptation"])}


# --- the measured cost model ----------------------------------------------------------------

def test_measured_cost_scales_nodes_by_their_cu_and_averages_runs():
    spec = RunSpec("switch", SMALLEST["switch"], FABRIC_2X2)
    job, _ = spec.compile()
    base = CostModel(lanes=4)
    by_cu = {}
    for _n, _k, cu, nodes in job.lowered:
        by_cu.setdefault(tuple(cu), []).extend(nodes)
    predicted = {cu: sum(base.op_cycles(job.graph, n) for n in nodes)
                 for cu, nodes in by_cu.items()}
    counters = {cu: {"busy_cycles": 3 * p + 50, "wait_cycles": 50}
                for cu, p in predicted.items()}      # every CU three times slower
    model, rows = measured_cost(base, job, counters)
    assert isinstance(model, MeasuredCostModel) and len(rows) == len(by_cu)
    node = by_cu[next(iter(by_cu))][0]
    assert model.factor(node) == pytest.approx(3.0)
    if base.op_cycles(job.graph, node):
        assert model.op_cycles(job.graph, node) == round(3 * base.op_cycles(job.graph, node))
    # A second run at the predicted speed: the factor becomes the geometric mean sqrt(3).
    counters = {cu: {"busy_cycles": p, "wait_cycles": 0} for cu, p in predicted.items()}
    model2, _ = measured_cost(model, job, counters)
    assert model2.factor(node) == pytest.approx(np.sqrt(3.0))
    with pytest.raises(ValueError, match="No counters for CU"):
        measured_cost(base, job, {})
    with pytest.raises(ValueError, match="Runs of node"):
        MeasuredCostModel(lanes=4, samples=(("a", 0.0, 0),))


def test_run_many_needs_one_fabric():
    a = RunSpec("switch", SMALLEST["switch"], FABRIC_2X2)
    b = RunSpec("switch", SMALLEST["switch"], FABRIC_4X4)
    with pytest.raises(ValueError, match="same fabric"):
        e2e.run_many([a, b])
    with pytest.raises(ValueError, match="Simulator must be one of"):
        e2e.run_many([a], sim="modelsim")
    with pytest.raises(ValueError, match="iterations must be a positive integer"):
        RunSpec("switch", iterations=0)


# --- every workload on Icarus and Verilator ---------------------------------------------------

@pytest.mark.cosim
@pytest.mark.parametrize("simulator", SIMULATORS)
@pytest.mark.parametrize("fabric", [
    FABRIC_2X2,
    # 4x4: minutes to convert and build per simulator; run with -m slow.
    pytest.param(FABRIC_4X4, marks=pytest.mark.slow),
], ids=["2x2", "4x4"])
def test_every_workload_on_the_rtl(simulator, fabric, tmp_path):
    """Each built-in workload, compiled for the fabric, runs on the Verilog bit-exactly: its
    outputs equal numpy's and the functional interpreter's, and every buffer is freed. On
    Verilator both drivers run it (the harness executable, the flows' default, and the cocotb
    testbench) and agree on every figure of every row, cycle for cycle. With them, a graph
    whose one op reads more host buffers than a CU's registers pass (the rest in a reference
    table the host fills)."""
    require_simulator(simulator)
    many = tmp_path / "many_inputs.py"
    many.write_text(MANY_INPUTS)
    specs = [RunSpec(name, sizes, fabric) for name, sizes in SMALLEST.items()]
    specs += [RunSpec("decoder", BATCHED_DECODER, fabric), RunSpec("moe", CHUNKED_MOE, fabric),
              RunSpec(str(many), {}, fabric)]
    results = e2e.run_many(specs, sim=simulator)
    assert len(results) == len(specs)
    for spec, rows in zip(specs, results, strict=True):
        _check_rows(rows, spec)
    if simulator == "verilator":
        cocotb = e2e.run_many(specs, sim=simulator,
                              build=dataclasses.replace(e2e.VERILATOR_BUILD, driver="cocotb"))
        assert cocotb == results


@pytest.mark.cosim
def test_the_harness_transport_gives_up_on_a_fabric_that_does_not_answer():
    """A fabric held in reset takes no command and sends no reply: the harness's burst, send
    and recv raise ``TimeoutError`` after their bound, naming what was waited for, and the
    driver reports it as :class:`NoReply` naming the transfer."""
    require_simulator("verilator")
    params = RunSpec("mlp", SMALLEST["mlp"], FABRIC_2X2).params
    harness = e2e.fabric_harness(params)

    async def session(proc):
        host = await harness_host(proc, params)
        fresh = await host.run_cycles()                    # answered: the port is alive
        proc.set("rst", 1)
        host.transport.reply_cycles = 5
        with pytest.raises(NoReply, match="no progress in 5 cycles after [0-2] of 2 commands were "
                           "taken and 0 replies came"):
            await host.append_vectors(host.ref_int({"mu": params.mu_id(1, 0), "buf": 0}),
                                      np.zeros((2, params.cu.lanes), np.int32))
        with pytest.raises(TimeoutError, match="no reply in 5 cycles"):
            await host.transport.recv()
        return fresh

    with HarnessProcess(harness) as proc:
        assert asyncio.run(session(proc)) >= 0


# --- rdakit bench e2e -------------------------------------------------------------------------

# The fast model in the default suite (0.3 s); the same on Amaranth's simulator takes 24 s.
@pytest.mark.parametrize("sim", ["model", pytest.param("amaranth", marks=pytest.mark.slow)])
def test_bench_e2e_json_has_the_figures_per_workload_and_configuration(tmp_path, capsys, sim):
    path = tmp_path / "e2e.json"
    rc = main(["bench", "e2e", "--sim", sim, "--fabric", "2x2", "--workloads", "mlp",
               "--partitioners", "multilevel,round_robin", "--place-steps", "2000",
               "--json", str(path)])
    assert rc == 0
    data = json.loads(path.read_text())
    parts, memory = data["tables"]["partitioners"], data["tables"]["memory_schemes"]
    assert [r["partitioner"] for r in parts] == ["multilevel", "round_robin"]
    assert [r["scheme"] for r in memory] == ["weighted+virtual", "counter+virtual",
                                             "weighted+reserve"]
    for r in parts + memory:
        assert r["check"] == "ok"
        assert r["cycles"] >= r["lower_bound"] > 0
        assert r["cycles"] >= max(r["lanes_bound"], r["mu_bound"]) and r["mu_bound"] > 0
        assert r["cycles_over_bound"] >= 1
        assert 0 < r["utilization"] <= 1
    # Reserve-and-copy holds whole buffers: never less MU memory than virtualization.
    assert memory[2]["mu_peak_words"] >= memory[0]["mu_peak_words"]
    assert "Memory schemes" in capsys.readouterr().out


def test_bench_e2e_rejects_unknown_names():
    assert main(["bench", "e2e", "--workloads", "resnet"]) == 2
    assert main(["bench", "e2e", "--partitioners", "magic"]) == 2


def test_cycle_budget_follows_the_estimate():
    """A run counts as hung after 20 times its estimate (at least 50,000 cycles), not after a
    fixed five million: seconds of simulation rather than hours, and the reason is given;
    ``max_cycles`` still overrides it."""
    spec = RunSpec("mlp")
    assert spec.budget(1000) == (50_000, "20 x the estimate of 1000 cycles, at least 50000")
    assert spec.budget(10_000)[0] == 200_000
    assert RunSpec("mlp", max_cycles=123).budget(10_000) == (123, "max_cycles")
    with pytest.raises(ValueError, match=r"^max_cycles must be a positive integer or None, "
                                         r"not 0$"):
        RunSpec("mlp", max_cycles=0)


def test_a_hung_run_is_reported_with_its_budget(monkeypatch):
    """A run that does not finish within its budget is a row with a hardware error that names
    the budget, the estimate it came from and the CUs still running, not a hang."""
    from rdakit.sim.runtime.host import HostTimeout

    async def hang(host, job, *, max_cycles, **kwargs):
        raise HostTimeout(f"the fabric was not done {max_cycles} cycles after START")

    spec = RunSpec("mlp", sizes=SMALLEST["mlp"], fabric=FABRIC_2X2)

    class Host:                  # what run_session asks of the host before the run
        params = spec.params

        async def cfg_read(self, x, y, addr):
            return 0

    monkeypatch.setattr(e2e, "run_job", hang)
    rows = asyncio.run(e2e.run_session(Host(), spec))
    assert rows[0]["hw_error"].startswith("not done within its budget of 50000 cycles (20 x "
                                          "the estimate of ")
    assert rows[0]["hw_error"].endswith("the fabric was not done 50000 cycles after START")
    assert e2e.failed(rows)
