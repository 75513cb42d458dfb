# amaranth: UnusedElaboratable=no
"""A stream between two CUs of cluster 1 of a two-cluster system (Amaranth's simulator): the
credits go back to the producer in its own cluster (the words carry the consumer's cluster
above the producer's coordinates), so a stream longer than the queue finishes, bit-exact."""

import numpy as np
import pytest

from rdakit.compiler.job import HostBuffer, Ref
from rdakit.hdl.cluster.system import System, SystemParams
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.isa import BMode, DMode, assemble
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.clusters import SystemJob, run_system_job
from rdakit.sim.runtime.host import AmaranthTransport, HostDriver
from rdakit.sim.verify.amaranth_sim import simulate

FP = fabric_params(1, 3, layout="CCM", cluster_bits=1, mu_words=256, max_buffers=4,
                   prog_len=16)
SP = SystemParams(FP, clusters=2, link_latency=6)
ROWS = 2 * FP.cu.queue_words + 8


@pytest.mark.slow   # a system of two clusters: 10-18 s
def test_stream_in_cluster_1_gets_its_credits_back():
    lanes = FP.cu.lanes
    a = np.arange(ROWS * lanes, dtype=np.int32).reshape(ROWS, lanes) - 50
    produce = assemble(f"""
        SCFG A_REF, r1
        LI r6, {FP.mu_id(1, 0, 1)}
        SCFG D_REF, r6
        SCFGI A_STRIDE, 1
        SCFGI N, {ROWS}
        SCFGI B_MODE, {BMode.ZERO.value}
        SCFGI D_MODE, {DMode.QUEUE.value}
        SRUN PASS, r0
        HALT
    """)
    consume = assemble(f"""
        SELF r2
        SCFG A_REF, r2
        SCFG D_REF, r1
        SCFGI N, {ROWS}
        SCFGI D_MODE, {DMode.APPEND.value}
        SRUN PASS, r0
        HALT
    """)
    job = SystemJob(
        configs=[FabricConfig(FP, {}), FabricConfig(FP, {
            (0, 0): TileConfig(program=produce, regs={1: Ref("a")}),
            (1, 0): TileConfig(program=consume, regs={1: Ref("y")})})],
        buffers=[HostBuffer("a", (2, 0, 1), a), HostBuffer("y", (2, 0, 1))],
        outputs=["y"], expected={"y": a})
    system = System(SP)
    out = {}

    async def tb(ctx):
        hosts = [HostDriver(FP, AmaranthTransport(ctx, system.host_port(k)))
                 for k in range(SP.clusters)]
        out["value"] = await run_system_job(hosts, job, max_cycles=5000)

    simulate(system, tb)
    outputs, _, _ = out["value"]
    np.testing.assert_array_equal(outputs["y"], a)
