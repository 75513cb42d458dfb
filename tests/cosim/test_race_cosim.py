"""Race injection on a whole fabric's Verilog (``docs/race.md``): random link delays and
random scenarios; counters without gating must free early at least once (the positive
control), the gated schemes and partial-free never; every scheme frees the buffer exactly
once with no leak, and the message counts measured in hardware equal the programs'."""

import pytest

from rdakit.sim.bench.race import SCHEMES, run_race, summarize
from rdakit.sim.verify.runner import require_simulator

pytestmark = pytest.mark.cosim


def check(rows, n, schemes):
    table = {r["scheme"]: r for r in summarize(rows)}
    assert set(table) == set(schemes)
    for scheme, r in table.items():
        assert r["scenarios"] == n
        assert r["leaks"] == 0 and r["double_frees"] == 0, r
        assert r["other_errors"] == 0, r
        assert r["count_mismatches"] == 0, r
        if scheme == "counter":
            assert r["premature_frees"] >= 1, r          # the positive control races
        else:
            assert r["premature_frees"] == 0 and r["hung"] == 0, r
            assert r["latency_mean"] is not None and r["latency_mean"] > 0
        if scheme == "partial":
            assert r["addw"] > 0
    # A clean run frees exactly once, after the last good READ.
    for row in rows:
        if row["clean"]:
            assert row["frees"] == 1 and row["live_buffers"] == 0
            assert row["last_free"] > row["last_read"]


# Default suite: every scheme on Icarus (two builds of seconds each: counter and partial-free
# with 2 weight bits). The same on Verilator is one -O0 C++ build of two and a half minutes
# from a clean checkout, so it runs with -m slow, as do the long runs below.
@pytest.mark.parametrize("simulator,schemes,n", [
    pytest.param("verilator", ("counter", "gated", "token"), 34, marks=pytest.mark.slow),
    ("icarus", ("counter", "gated", "token", "partial"), 12),
])
def test_race(simulator, schemes, n):
    require_simulator(simulator)
    rows = run_race(n, simulator=simulator, schemes=schemes, weight_bits=2)
    check(rows, n, schemes)


@pytest.mark.slow
@pytest.mark.parametrize("simulator,n", [("verilator", 1000), ("icarus", 100)])
def test_race_many(simulator, n):
    require_simulator(simulator)
    rows = run_race(n, simulator=simulator, optimize=simulator == "verilator")
    check(rows, n, SCHEMES)
