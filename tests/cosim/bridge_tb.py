"""cocotb tests of a fabric behind the host bridge: the host driver over the serial lines."""

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

from rdakit.hdl.spec.frames import (
    HEADER_BYTES,
    FrameError,
    FrameKind,
    cmd_bytes,
    encode_frame,
    int_payload,
)
from rdakit.hdl.spec.packets import HostCmd, MUOp, host_cmd_layout, pack
from rdakit.hdl.spec.params import fabric_params
from rdakit.hdl.spec.vector import pack_vector
from rdakit.sim.runtime.host import HostDriver
from rdakit.sim.runtime.host_link import CocotbUARTPort, FramedTransport
from rdakit.sim.runtime.job import run_job
from rdakit.sim.verify import kernels
from rdakit.sim.verify.cocotb_utils import tb_config


async def setup(dut):
    cfg = tb_config()
    params = fabric_params(**cfg["fabric"])
    cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
    dut.rx.value = 1
    dut.rst.value = 1
    for _ in range(3):
        await RisingEdge(dut.clk)
    dut.rst.value = 0
    port = CocotbUARTPort(dut, divisor=cfg["divisor"], timeout=cfg["host_timeout"])
    port.start()
    link = FramedTransport(params, port)
    return params, port, link, HostDriver(params, link)


@cocotb.test()
async def kernel_through_the_uart(dut):
    params, _, link, host = await setup(dut)
    job = kernels.vector_add(params, n=8)
    result = await run_job(host, job, counters=False)
    result.check(job)
    assert (link.errors, link.resends) == ([], 0)


@cocotb.test()
async def corrupted_write_is_answered_and_not_applied(dut):
    params, port, link, host = await setup(dut)
    ref = await host.alloc(params.tiles("M")[0])
    await host.append_vectors(ref, np.array([[1234]], np.int32))
    fields = {"kind": HostCmd.MU_REQUEST,
              "req": {"op": MUOp.WRITE, "ref": host.ref_dict(ref), "index": 0,
                      "data": pack_vector([-7])}}
    seq = link.seq
    frame = bytearray(encode_frame(FrameKind.CMD, seq, int_payload(
        pack(host_cmd_layout(params.mu), fields), cmd_bytes(params.mu))))
    frame[HEADER_BYTES] ^= 0x04         # a payload bit
    await port.write(frame)
    answer = []
    while (b := await port.read_byte()) is not None:
        answer.append(b)
    assert bytes(answer) == encode_frame(FrameKind.ERROR, seq, bytes([FrameError.BAD_CRC.value]))
    assert (await host.read_vectors(ref)).tolist() == [[1234]]
