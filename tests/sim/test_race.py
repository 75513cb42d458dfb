"""The race scenarios' programs on the functional interpreter (random CU interleavings, no
time): counters without gating free early under some interleavings, the gated schemes and
partial-free never do, every scheme frees the buffer exactly once, and the message counts the
bench reports agree with the programs. Plus the outcome classification and scenario limits."""

import collections

import pytest

from rdakit.hdl.spec.config import CU_STATUS_BITS
from rdakit.sim.bench.race import (
    BAD_PC,
    SCHEMES,
    WEIGHT_BITS,
    classify,
    expected_messages,
    make_scenario,
    plan,
    run_interp,
    summarize,
)

N = 60


@pytest.mark.parametrize("scheme", SCHEMES)
def test_schemes_on_the_interpreter(scheme):
    totals = collections.Counter()
    for i in range(N):
        sc = make_scenario(scheme, i, seed=7)
        out, interp = run_interp(sc, seed=i)
        totals.update(out)
        assert not out["other_error"] and not out["leak"] and not out["double"], (sc, out)
        assert out["hung"] == 0
        if out["premature"]:
            continue
        assert interp.mu(1, 1).frees == 1
        exp = expected_messages(sc)
        res = interp.result()
        cus = [res.cu(*xy) for xy in sc.holders]
        assert sum(c.requests for c in cus) == exp["reads"] + exp["refcount"]
        assert sum(c.refs_sent for c in cus) == exp["refs"]
        assert sum(c.tokens_sent for c in cus) == exp["tokens"]
        if scheme == "partial":
            totals["addw"] += exp["addw"]
    if scheme == "counter":
        assert totals["premature"] > 0          # the positive control races
    else:
        assert totals["premature"] == 0
    if scheme == "partial":
        assert totals["addw"] > N // 4          # weight exhaustion is exercised


def test_partial_free_weights_stay_within_weight_bits():
    """Initial weight plus every possible ADD_WEIGHT fits the MU's weight bits, and every
    build of WEIGHT_BITS gets scenarios."""
    seen = set()
    for i in range(300):
        sc = make_scenario("partial", i)
        seen.add(sc.weight_bits)
        worst = sc.weight + sum(sc.addw[h] * len(sc.children(h))
                                for h in range(len(sc.holders)))
        assert worst <= (1 << sc.weight_bits) - 1
    assert seen == set(WEIGHT_BITS)


def test_plan_groups_scenarios_by_build():
    groups = plan(12)
    assert set(groups) == {("counter", 4), ("weighted", 2), ("weighted", 3), ("weighted", 4)}
    assert len(groups["counter", 4]) == 36
    assert sum(len(v) for v in groups.values()) == 48


def test_classify():
    sc = make_scenario("counter", 0)
    a, b = sc.holders[:2]
    mu = {"frees": 1, "live_buffers": 0, "last_read": 10, "last_free": 20}
    ok = {xy: 1 for xy in sc.holders}
    assert classify(sc, ok, mu)["premature"] == 0
    bad_ref = {**ok, b: 1 | 2 | CU_STATUS_BITS["MU_ERROR"] << 8}
    assert classify(sc, bad_ref, mu)["premature"] == 1
    wrong_data = {**ok, b: 3 | CU_STATUS_BITS["PC_OUT_OF_RANGE"] << 8 | BAD_PC << 16}
    assert classify(sc, wrong_data, mu)["premature"] == 1
    other = {**ok, a: 3 | CU_STATUS_BITS["BAD_INSTRUCTION"] << 8}
    assert classify(sc, other, mu)["other_error"] == 1
    assert classify(sc, ok, {**mu, "last_free": 5})["premature"] == 1
    assert classify(sc, ok, {**mu, "live_buffers": 1, "frees": 0})["leak"] == 1
    assert classify(sc, ok, {**mu, "frees": 2})["double"] == 1


def test_summarize_counts_extra_messages():
    row = dict(scheme="partial", topology="pair", holders=2, copies=1, cycles=100, clean=1,
               premature=0, leak=0, double=0, other_error=0, hung=0, latency=12,
               mu_requests=5, expected_reads=2, cu_messages=1, expected_refs=1,
               expected_refcount=3, expected_tokens=0, expected_addw=1)
    (r,) = summarize([row])
    assert r["msgs_per_scenario"] == 3 and r["extra_msgs_per_copy"] == 1
    assert r["count_mismatches"] == 0 and r["latency_p50"] == 12


def test_make_scenario_wrong_scheme():
    with pytest.raises(ValueError, match=r"^scheme must be one of counter, gated, token, "
                                         r"partial, not 'plain'$"):
        make_scenario("plain", 0)


@pytest.mark.parametrize("argv,message", [
    (["--scenarios", "0"], "--scenarios must be at least 1, not 0"),
    (["--schemes", "counter,plain"], "--schemes must be a comma-separated list of counter, "
                                     "gated, token, partial, not 'plain'"),
])
def test_bench_race_rejects_bad_options(argv, message, capsys):
    from rdakit.cli import main

    assert main(["bench", "race", *argv]) == 2
    assert message in capsys.readouterr().err
