"""``rdakit bench memory`` (``sim/bench/memory.py``): the schemes table's invariants on the
performance model, an out-of-memory run reported as a row, the command line and its bad
input."""

import json

import pytest

from rdakit.cli import main
from rdakit.hdl.spec.packets import MUStatus
from rdakit.sim.bench.memory import (
    CACHE_MU,
    SCHEMES,
    Size,
    TracedMU,
    _occupancy,
    bench_rows,
    moe_rows,
    run_workload,
    speculative_rows,
    weight_rows,
)
from rdakit.sim.verify.runner import require_simulator

#: Two sizes: short caches (a few blocks) and caches that outgrow their reservation many times
#: over, at a pressure where reserve-and-copy runs out of address space.
SMALL = Size("small", 8, 4, 16)
GROWING = Size("growing", 12, 16, 64)


@pytest.fixture(scope="module")
def table():
    """Every scheme at both sizes on the model (about 2 s)."""
    rows, runs = bench_rows(sizes=(SMALL, GROWING))
    return {(r["size"], r["scheme"]): r for r in rows}, runs


def test_every_scheme_at_every_size(table):
    rows, _ = table
    assert set(rows) == {(s.name, scheme) for s in (SMALL, GROWING) for scheme in SCHEMES}


def test_runs_that_fit_are_bit_exact_and_free_every_cache(table):
    rows, runs = table
    for key, r in rows.items():
        if r["check"] == "out of memory":
            continue
        assert r["check"] == "ok", (key, r["check"])
        n = runs[key].job.lengths
        assert r["allocs"] == r["frees"] == len(n), key
        assert r["tokens"] == sum(n)
        assert r["oom_events"] == 0
        assert r["tokens_per_kcycle"] == round(1000 * r["tokens"] / r["cycles"], 2)


def test_virtualization_copies_nothing_and_reserve_copies_when_caches_outgrow(table):
    rows, runs = table
    for size in (SMALL, GROWING):
        for scheme in ("virtual+partial", "virtual+counter", "single/1-slot"):
            assert rows[(size.name, scheme)]["copied_words"] == 0
    # Caches of 4..16 rows outgrow the 4-word reservation: every growth copies the old rows.
    assert rows[("small", "reserve")]["copied_words"] > 0
    assert rows[("small", "reserve")]["reserved_words"] >= rows[("small", "reserve")][
        "peak_held_words"]


def test_virtualization_uses_memory_best(table):
    rows, _ = table
    for size in (SMALL, GROWING):
        virtual = rows[(size.name, "virtual+partial")]["peak_utilization"]
        assert virtual > 0.9
        assert virtual > rows[(size.name, "reserve")]["peak_utilization"]
        assert virtual > rows[(size.name, "single/1-slot")]["peak_utilization"]
    # Batching: the same tokens on one slot of one CU take several times as long.
    assert rows[("growing", "virtual+partial")]["tokens_per_kcycle"] > \
        2 * rows[("growing", "single/1-slot")]["tokens_per_kcycle"]


def test_out_of_memory_is_a_row_not_a_crash(table):
    """One buffer per MU cannot hold a batch of caches: the MU refuses the second ALLOC, the
    CU halts, the row says so; reserve-and-copy runs out of address space on growing caches
    (regions are never merged) while virtualization runs them."""
    rows, runs = table
    for size in (SMALL, GROWING):
        r = rows[(size.name, "single")]
        assert r["check"] == "out of memory" and r["cycles"] is None and r["oom_events"] > 0
        assert r["tokens_per_kcycle"] is None
    r = rows[("growing", "reserve")]
    assert r["check"] == "out of memory" and r["oom_events"] > 0
    # The live caches hold far less than the MU: the address space went to regions parked on
    # the free lists of classes the growths no longer ask for.
    assert r["reserved_words"] > 0.9 * runs[("growing", "reserve")].job.params.mu.words
    assert r["reserved_words"] > 1.5 * r["peak_held_words"]
    assert rows[("growing", "virtual+partial")]["check"] == "ok"


def test_one_release_message_per_cache_and_none_at_a_copy(table):
    """Generation copies no reference: partial-free and counters both send exactly one
    message per cache, at its release."""
    rows, _ = table
    for scheme in ("virtual+partial", "virtual+counter"):
        r = rows[("growing", scheme)]
        assert r["ref_copies"] == 0 and r["copy_messages"] == 0
        assert r["release_messages"] == r["sync_messages"] == r["frees"]
        assert r["free_latency_mean"] > 0


def test_trace_occupancy_is_the_mu_model_state(table):
    _, runs = table
    run = runs[("growing", "virtual+partial")]
    trace = run.traces[CACHE_MU]
    assert trace and all(isinstance(t[3], MUStatus) for t in trace)
    occ = _occupancy(run.traces, [CACHE_MU])
    assert [o[0] for o in occ] == sorted(o[0] for o in occ)
    assert max(h for _, _, h in occ) == run.counters[CACHE_MU]["peak_held_words"]
    assert occ[-1][1:] == (0, 0)       # every cache freed: nothing live, nothing held


def test_traced_mu_records_only_while_asked():
    from rdakit.sim.bench.memory import scheme_params
    p = scheme_params("virtual+partial").mu
    mu = TracedMU(p, 0, lambda: 7)
    mu.request({"op": 0, "data": 1})
    assert mu.trace == []
    mu.recording = True
    mu.request({"op": 0, "data": 1})
    assert len(mu.trace) == 1 and mu.trace[0][0] == 7


def test_unknown_sim_is_refused():
    with pytest.raises(ValueError, match=r"^sim must be one of model, amaranth, verilator, "
                                         r"icarus, not 'x'$"):
        run_workload("reserve", SMALL, sim="x")


@pytest.mark.long   # 5 s: the whole quick bench (generation, MoE, weight study) and its plot
def test_cli_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "m.json", tmp_path / "m.png"
    assert main(["bench", "memory", "--quick", "--no-area", "--json", out,
                 "--plot", png]) == 0
    data = json.loads(out.read_text())
    assert data["bench"] == "memory"
    rows = data["tables"]["generation"]
    assert {r["scheme"] for r in rows} == set(SCHEMES)
    assert data["figures"]["failed_runs"] == 0
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("args,message", [
    (["--seed", "-1"], "--seed"),
    (["--plot", "x.txt"], "--plot"),
    (["--sim", "amaranth", "--plot", "x.png"], "--plot needs --sim model"),
])
def test_cli_refuses_bad_input(tmp_path, capsys, args, message):
    assert main(["bench", "memory", "--quick", "--no-area", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rdakit: error:") and message in err and "Traceback" not in err


def test_cli_refuses_an_unknown_simulator(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "memory", "--sim", "ghdl"])
    assert e.value.code == 2
    assert "invalid choice: 'ghdl'" in capsys.readouterr().err


@pytest.mark.slow   # 37 s: a 2x3 fabric of 128-instruction programs in Amaranth's simulator
# (the kernel's own RTL test, tests/sim/test_dynamic_workloads.py, is a 2x2 in the suite)
def test_the_rtl_agrees_with_the_model():
    """A tiny run of the bench on the RTL: bit-exact, the same allocations, frees and copied
    words as the model."""
    tiny = Size("tiny", 3, 2, 6, slots=1)
    rtl = run_workload("reserve", tiny, sim="amaranth")
    model = run_workload("reserve", tiny)
    assert rtl.error is None and model.error is None
    for key in ("allocs", "frees", "copy_cycles"):
        assert rtl.counters[CACHE_MU][key] == model.counters[CACHE_MU][key], key


@pytest.fixture(scope="module")
def moe_table():
    """The MoE table and a small weight study on the model (about 1 s)."""
    rows, _ = moe_rows(size=(12, 2))
    return {r["scheme"]: r for r in rows}, weight_rows(bits=(2, 3, 4, 8), tokens=12, d=2)


def test_moe_partial_free_sends_nothing_at_a_copy_and_one_message_a_reference(moe_table):
    """The issue's target on the fabric: partial-free, no message at a copy and one per
    reference at its return; counters one INCREF per copy, acknowledged before the copy is
    sent, which costs cycles."""
    rows, _ = moe_table
    partial, counter = rows["virtual+partial"], rows["virtual+counter"]
    for r in (partial, counter):
        assert r["check"] == "ok" and r["ref_copies"] > 0
        assert r["release_messages_per_ref"] == 1.0
    assert partial["messages_per_copy"] == 0 and partial["copy_messages"] == 0
    assert counter["messages_per_copy"] == 1
    assert counter["sync_messages"] == partial["sync_messages"] + counter["ref_copies"]
    assert counter["cycles"] > partial["cycles"]
    assert rows["single"]["check"] == "out of memory"


def test_weight_study_rows(moe_table):
    _, rows = moe_table
    by = {(r["weight_bits"], r["split"]): r for r in rows}
    # 2-bit weights hold at most 3: one per expert plus the router's is 4.
    assert all(by[(2, s)]["check"] == "weight overflow" for s in ("fanout", "static"))
    for b in (3, 4, 8):
        # The static analysis finds one copy site per expert: the fan-out's split exactly.
        assert by[(b, "static")]["cycles"] == by[(b, "fanout")]["cycles"]
        assert by[(b, "fanout")]["add_weight"] == 0
    # Halving needs ADD_WEIGHT where a token goes to every expert with few weight bits.
    assert by[(8, "halving")]["add_weight"] == 0
    assert all(r["check"] in ("ok", "weight overflow") for r in rows)


def test_speculative_table():
    """Partial-free copies the shared prefix with no message (the weight comes back with the
    reference); counters pay an INCREF a copy; every branch is reclaimed."""
    rows = {r["scheme"]: r for r in speculative_rows(rounds=6)[0]}
    partial, counter = rows["virtual+partial"], rows["virtual+counter"]
    assert partial["check"] == counter["check"] == "ok"
    assert partial["ref_copies"] == counter["ref_copies"] == 6 * 3 * 2
    assert partial["copy_messages"] == 0 and counter["copy_messages"] == 6 * 3
    assert partial["release_messages"] == 1 + 6 * 3 * 2
    assert counter["release_messages"] == partial["release_messages"] + 6 * 3
    assert rows["single"]["check"] == "out of memory"


def test_a_run_the_model_finds_failing_is_not_simulated_on_the_rtl():
    """One buffer per MU: the router's second token buffer is refused and the experts would
    wait for it forever; on the RTL that would be a simulation to the cycle budget. The model
    finds it first, and the row says out of memory at once."""
    rows, runs = moe_rows(size=(4, 2), schemes=("single",), sim="amaranth")
    assert rows[0]["check"] == "out of memory" and rows[0]["cycles"] is None
    assert runs["single"].result is None


def test_a_recipe_rebuilds_the_same_job():
    """What crosses into a cocotb process (JSON) builds the same job there."""
    from rdakit.sim.bench.memory import _job, _moe_job, rebuild, scheme_fabric
    for job in (_job("single/1-slot", SMALL, 3, None),
                _moe_job(scheme_fabric("virtual+counter"), 4, 2, "static", 1)):
        again = rebuild(json.loads(json.dumps(job.recipe)))
        assert again.config == job.config and again.buffers[0].mu == job.buffers[0].mu
        assert all((again.expected[k] == v).all() for k, v in job.expected.items())


@pytest.mark.parametrize("sim", [
    # 60 s: an Icarus build and run of the 2x3 fabric under cocotb.
    pytest.param("icarus", marks=pytest.mark.slow),
    pytest.param("verilator", marks=pytest.mark.cosim)])
def test_the_verilog_agrees_with_the_model(sim):
    """On Icarus the cocotb path (the job rebuilt from its recipe in the simulator's process),
    on Verilator the harness driven from this process: bit-exact, the same allocations, frees
    and copied words as the model."""
    require_simulator(sim)
    tiny = Size("tiny", 3, 2, 6, slots=1)
    rtl = run_workload("reserve", tiny, sim=sim)
    model = run_workload("reserve", tiny)
    assert rtl.error is None and rtl.result.cycles > 0
    for key in ("allocs", "frees", "copy_cycles"):
        assert rtl.counters[CACHE_MU][key] == model.counters[CACHE_MU][key], key
