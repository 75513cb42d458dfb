"""cocotb side of the race runs (``rdakit bench race``, ``tests/cosim/test_race_cosim.py``):
runs the scenarios of one build of the race fabric back to back, resetting the fabric before
each, and writes one result row per scenario to the JSON file named in the configuration."""

import json

import cocotb
from cocotb.triggers import RisingEdge, Timer

from rdakit.sim.bench.race import build_key, make_scenario, race_params, run_scenario
from rdakit.sim.runtime.host import CocotbTransport, cocotb_host
from rdakit.sim.verify.cocotb_utils import tb_config


class _SleepyTransport(CocotbTransport):
    """Lets ``n`` cycles pass with one timer instead of ``n`` clock edges (Python wakes twice,
    not ``n`` times, while the host polls for done)."""

    async def tick(self, n=1):
        if n > 2:
            await Timer((n - 1) * PERIOD_NS, unit="ns")
            n = 1
        await super().tick(n)


PERIOD_NS = 10


@cocotb.test()
async def race_scenarios(dut):
    cfg = tb_config()
    params = race_params(cfg["refcount"], cfg["weight_bits"])
    dut.jitter_rate.value = 0
    dut.jitter_seed.value = 0
    host = await cocotb_host(dut, params, period_ns=PERIOD_NS)
    host.transport = _SleepyTransport(dut)

    async def reset():
        dut.rst.value = 1
        for _ in range(2):
            await RisingEdge(dut.clk)
        dut.rst.value = 0
        await RisingEdge(dut.clk)

    rows = []
    for scheme, index in cfg["scenarios"]:
        sc = make_scenario(scheme, index, seed=cfg["seed"],
                           weight_bits=cfg.get("partial_weight_bits"))
        assert build_key(sc.scheme, sc.weight_bits) == (cfg["refcount"], cfg["weight_bits"])
        rows.append(await run_scenario(dut, host, params, sc, reset=reset))
        if len(rows) % 250 == 0:
            dut._log.info("%d of %d scenarios", len(rows), len(cfg["scenarios"]))
    with open(cfg["out"], "w") as f:
        json.dump(rows, f)
    dut._log.info("%d race scenarios", len(rows))
