"""cocotb side of ``tests/sim/test_verilator_scale.py``: a register built with the options
under test counts, and the register inside its submodule is reachable exactly when every
signal is public."""

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge, Timer

from rdakit.sim.verify.cocotb_utils import tb_config


@cocotb.test()
async def register(dut):
    cfg = tb_config()
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.rst.value = 1
    dut.a.value = 0
    await RisingEdge(dut.clk)
    dut.rst.value = 0
    for a in (5, 254, 255):
        dut.a.value = a
        await RisingEdge(dut.clk)
        await Timer(1, unit="ns")
        assert dut.o.value.to_unsigned() == (a + 1) % 256
    reachable = hasattr(dut, "inner") and hasattr(dut.inner, "count")
    assert reachable == cfg["inner_public"]
