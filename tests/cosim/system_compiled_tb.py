"""cocotb: a workload compiled across two clusters (compiler/system_compile.py) runs on the
system's Verilog bit-exact against numpy, tokens and references crossing the links, every
buffer of both clusters freed."""

import cocotb

from rdakit.compiler.system_compile import compile_system
from rdakit.hdl.cluster.system import SystemParams
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.flows.system import check_outputs, run_compiled
from rdakit.sim.runtime.host import cocotb_host
from rdakit.sim.verify.cocotb_utils import tb_config


@cocotb.test()
async def compiled_workload_across_clusters_bit_exact(dut):
    cfg = tb_config()
    sp = SystemParams(fabric_params(**cfg["fabric"]), clusters=2,
                      link_latency=cfg["link_latency"])
    hosts = await cocotb_host(dut, sp.fabric, clusters=2)
    cs = compile_system(cfg["workload"], sp, sizes=cfg["sizes"], strategy=cfg["strategy"],
                        place_steps=2000)
    assert cs.cut_edges > 0 and all(c is not None for c in cs.system_job.configs)
    links0 = [int(dut.req_packets__0.value), int(dut.req_packets__1.value)]
    outputs, cycles, _, live = await run_compiled(hosts, cs.system_job, max_cycles=200_000)
    assert check_outputs(cs.system_job, outputs) == "ok", check_outputs(cs.system_job, outputs)
    assert live == [0, 0], live
    crossed = [int(dut.req_packets__0.value) - links0[0],
               int(dut.req_packets__1.value) - links0[1]]
    dut._log.info(f"{cfg['workload']} across 2 clusters ({cfg['strategy']}): cycles {cycles}, "
                  f"{cs.cut_edges} graph edges between clusters, request packets over the "
                  f"links {crossed}")
