"""What the tests share: the marks that split the suite, and helpers more than one file needs.

The suite in three loops (README.md, "Tests"):

* the inner loop, ``pytest -m "not cosim and not slow"`` (``scripts/run-tests.sh --quick``):
  every module in Amaranth's simulator, the models and the compiler, in under two minutes on
  two cores;
* the default suite (``pytest``, what CI runs): the inner loop, plus co-simulation of the
  small designs on Icarus and Verilator;
* ``-m slow``: board builds, 4x4 fabrics and meshes, long random streams. ``formal`` (the
  SymbiYosys proofs) runs on its own, ``-m formal``.

Marks come from two places. A test file of co-simulation (``tests/cosim/``) is ``cosim`` as a
whole (:func:`pytest_collection_modifyitems`); a long test is ``slow`` where it is written
(``@pytest.mark.slow``, ``pytest.param(..., marks=pytest.mark.slow)``) or, for the ones that
became long without their files saying so, in :data:`SLOW` here with the reason.

Helpers are plain functions, imported by name (``from conftest import wrap32``): pytest puts
this folder on ``sys.path`` to load this file (the tests are not a package).
"""

import pathlib

import numpy as np
import pytest
from amaranth.back import verilog
from amaranth.sim import Simulator

HERE = pathlib.Path(__file__).resolve().parent

#: Tests marked ``slow`` here rather than in their files, by node id under ``tests/``, with the
#: time each took alone on a 2-core machine.
SLOW = {
    "boards/test_build.py::test_icebreaker_1x2_build_says_it_does_not_fit":
        "Yosys and nextpnr on a 1x2 fabric: about 4 minutes",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = pathlib.Path(str(item.path)).resolve()
        try:
            rel = path.relative_to(HERE)
        except ValueError:
            continue
        if rel.parts[0] == "cosim":
            item.add_marker(pytest.mark.cosim)
        nodeid = f"{rel.as_posix()}::{item.name.split('[')[0]}"
        if nodeid in SLOW:
            item.add_marker(pytest.mark.slow)


# --- Amaranth simulation --------------------------------------------------------------------

def run_checked(dut, testbench):
    """Simulate ``dut`` with ``testbench`` on a 1 MHz clock, after converting it to Verilog:
    every simulated configuration is also checked for combinational loops, which Amaranth's
    simulator does not detect (it hangs)."""
    verilog.convert(dut, name="top", emit_src=False)
    sim = Simulator(dut)
    sim.add_clock(1e-6)
    sim.add_testbench(testbench)
    sim.run()


async def drive_mesh(ctx, net, n, queues, *, ready_p, rng, on_eject, limit, until=None):
    """Offer the head of ``queues[t]`` on ``net.inject[t]`` and drain ``net.eject[t]`` with
    probability ``ready_p``, for at most ``limit`` cycles or until ``until()``; call
    ``on_eject(cycle, t, payload)`` for every ejection. Returns the cycles run and the
    ``(cycle, tile, payload)`` of every injection."""
    injected = []
    for cycle in range(limit):
        if until is not None and until():
            return cycle, injected
        for t in range(n):
            ctx.set(net.inject[t].valid, bool(queues[t]))
            if queues[t]:
                ctx.set(net.inject[t].payload.as_value(), queues[t][0])
            ctx.set(net.eject[t].ready, rng.random() < ready_p)
        for t in range(n):
            if queues[t] and ctx.get(net.inject[t].ready):
                injected.append((cycle, t, queues[t].pop(0)))
            if ctx.get(net.eject[t].valid) and ctx.get(net.eject[t].ready):
                on_eject(cycle, t, ctx.get(net.eject[t].payload.as_value()))
        await ctx.tick()
    return limit, injected


# --- 32-bit arithmetic of the compute unit and its interpreter ------------------------------

def s32(v):
    """A register value as a signed integer."""
    return v - (1 << 32) if v & (1 << 31) else v


def wrap32(x):
    """int32 of an integer array, modulo 2**32 (numpy's int64 arithmetic wraps modulo 2**64,
    which keeps the low 32 bits exact)."""
    return (np.asarray(x, dtype=np.int64) & 0xffff_ffff).astype(np.uint32).view(np.int32)


def rand32(rng, shape, bits=31):
    """Random signed integers of ``bits + 1`` bits (int64), from the generator ``rng``."""
    return rng.integers(-(1 << bits), 1 << bits, size=shape, dtype=np.int64)


def relu_shift(x, shift, post):
    """The stream engine's output stage: arithmetic shift right, then ReLU if ``post``."""
    y = wrap32(x) >> shift
    return np.maximum(y, 0) if post else y
