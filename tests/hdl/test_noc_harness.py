"""The benchmark's traffic harness on Amaranth's simulator: the sinks' in-order check and its
epochs (``rdakit bench noc`` starts one per traffic pattern)."""

import pytest
from amaranth.sim import Simulator

from rdakit.sim.verify.noc_harness import RATE_ONE, Pattern, TrafficHarness


def _run_phases(epochs):
    """Uniform (100 cycles), bitcomp (500), uniform (100) traffic on a 2x2 mesh with 7-bit
    sequence numbers, each phase in the given epoch, the network drained between phases.
    Returns (errors, generated, ejected) summed over the tiles."""
    h = TrafficHarness(rows=2, cols=2, depth=2, seq_bits=7)
    phases = [Pattern.UNIFORM, Pattern.BITCOMP, Pattern.UNIFORM]
    result = {}

    async def tb(ctx):
        ctx.set(h.rate, RATE_ONE // 2)
        for pattern, epoch, cycles in zip(phases, epochs, [100, 500, 100], strict=True):
            ctx.set(h.pattern, pattern)
            ctx.set(h.epoch, epoch)
            ctx.set(h.enable, 1)
            await ctx.tick().repeat(cycles)
            ctx.set(h.enable, 0)
            await ctx.tick().repeat(60)
        result["errors"] = sum(ctx.get(h.errors[t]) for t in range(4))
        result["generated"] = sum(ctx.get(h.generated[t]) for t in range(4))
        result["ejected"] = sum(ctx.get(h.ejected[t]) for t in range(4))

    sim = Simulator(h)
    sim.add_clock(1e-6)
    sim.add_testbench(tb)
    sim.run()
    return result["errors"], result["generated"], result["ejected"]


def test_new_epoch_per_pattern_no_false_errors():
    """With a new epoch per phase every packet arrives and none is flagged, although during
    bitcomp each source sends far more than 2**6 packets to one tile only."""
    errors, generated, ejected = _run_phases([1, 2, 3])
    assert generated > 200 and ejected == generated
    assert errors == 0


@pytest.mark.parametrize("epochs", [[1, 1, 1], [0, 0, 0]])
def test_check_is_live_within_an_epoch(epochs):
    """In one epoch the check compares numbers modulo 2**7: after bitcomp a sink takes the next
    number from a source it has not heard from for over 64 of its packets for an old one (the
    false errors `bench noc --pattern all` reported before the sweep started epochs). Epoch 0
    never compares, so nothing is flagged."""
    errors, generated, ejected = _run_phases(epochs)
    assert ejected == generated
    if epochs[0]:
        assert errors > 0
    else:
        assert errors == 0


def test_router_area_finds_yosys_without_an_activated_venv(monkeypatch):
    """``bench noc``'s router area runs Yosys from beside this Python when ``PATH`` lacks it
    (the venv not activated), and counts cells and flip-flops of a small router."""
    from rdakit.hdl.noc.router import Router
    from rdakit.sim.bench.noc import router_area

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("RDAKIT_YOSYS", raising=False)
    area = router_area(Router(payload_shape=4, x=0, y=0, rows=2, cols=2, counter_bits=4))
    assert area["flip_flops"] > 0
    assert area["cells"] > area["flip_flops"]
    assert area["logic_cells"] == area["cells"] - area["flip_flops"]
