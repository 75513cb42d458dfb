"""cocotb side of ``rdakit bench memory --sim verilator|icarus``: rebuilds the job from its
recipe (:func:`rdakit.sim.bench.memory.rebuild`), runs it on the fabric's Verilog, checks it
against numpy and writes its cycles, error and counters to the JSON file named in the
configuration (``out``)."""

import json

import cocotb

from rdakit.sim.bench.memory import _run, rebuild
from rdakit.sim.runtime.host import cocotb_host
from rdakit.sim.verify.cocotb_utils import tb_config


@cocotb.test()
async def bench(dut):
    cfg = tb_config()
    job = rebuild(cfg["recipe"])
    host = await cocotb_host(dut, job.params)
    result, error, counters = await _run(host, job, None, cfg["max_cycles"])
    with open(cfg["out"], "w") as f:
        json.dump({"cycles": result.cycles if result else None,
                   "load_cycles": result.load_cycles if result else None, "error": error,
                   "counters": [[list(xy), c] for xy, c in counters.items()]}, f)
