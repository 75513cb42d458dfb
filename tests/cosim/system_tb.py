"""cocotb tests of a system of two clusters: remote MU access from host ports and CUs, a shared
buffer freed once after its last remote holder, a barrier across every CU of both clusters,
and a ticket lock under contention."""

import random

import cocotb
import numpy as np

from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.config import MU_MAP
from rdakit.hdl.spec.isa import assemble
from rdakit.hdl.spec.packets import MUOp, MUStatus
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.models.mu import MUModel
from rdakit.sim.runtime.clusters import (
    barrier_rounds,
    locked_increment,
    run_system,
    run_system_job,
)
from rdakit.sim.runtime.host import cocotb_host
from rdakit.sim.verify.cocotb_utils import tb_config
from rdakit.sim.verify.kernels import cluster_matvec


async def setup(dut):
    cfg = tb_config()
    params = fabric_params(**cfg["fabric"])
    hosts = await cocotb_host(dut, params, clusters=cfg["clusters"])
    return cfg, params, hosts


def cus(params):
    return params.tiles("C")


def mu_of(params, k):
    """The (x, y, cluster) of cluster k's first MU."""
    return (*params.tiles("M")[0], k)


@cocotb.test()
async def remote_requests_from_hosts(dut):
    """Random requests from both host ports at both clusters' MUs, against golden models."""
    cfg, params, hosts = await setup(dut)
    rng = random.Random(cfg.get("seed", 1))
    mu_ids = [params.mu_id(*mu_of(params, k)) for k in range(2)]
    models = {mu: MUModel(params.mu, mu) for mu in mu_ids}
    refs = {mu: [] for mu in mu_ids}
    ops = [MUOp.APPEND, MUOp.APPEND, MUOp.WRITE, MUOp.READ, MUOp.LEN, MUOp.RETURN,
           MUOp.FETCH_ADD, MUOp.UNLOCK]
    remote = 0
    for i in range(60):
        k = rng.randrange(2)
        mu = rng.choice(mu_ids)
        if not refs[mu] or rng.random() < 0.1:
            req = {"op": MUOp.ALLOC, "ref": {"mu": mu, "buf": 0}, "data": rng.randint(1, 3)}
        else:
            op = rng.choice(ops)
            req = {"op": op, "ref": rng.choice(refs[mu]), "index": rng.randrange(4),
                   "data": rng.getrandbits(32) if op in (MUOp.WRITE, MUOp.APPEND)
                   else rng.randint(0, 2)}
        req["tag"] = i % 8
        got = await hosts[k].mu_request(dict(req))
        want = models[mu].request({**req, "src": {"x": 0, "y": 0, "cluster": k}})
        assert got == want, (k, req, got, want)
        if req["op"] is MUOp.ALLOC and got["status"] is MUStatus.OK:
            refs[mu].append(got["ref"])
        remote += params.mu_cluster(mu) != k
    assert remote > 20


@cocotb.test()
async def shared_buffer_freed_once_after_the_last_remote_holder(dut):
    """A buffer of cluster 1 shared by one CU of each cluster with weight 1 each: the local CU
    returns its weight at once; the remote CU of cluster 0 waits, then reads, writes and
    appends to it remotely, copies it to its own cluster and returns the last weight. The
    buffer is freed exactly once, and only then."""
    cfg, params, hosts = await setup(dut)
    lanes = params.cu.lanes
    data = np.arange(3 * lanes, dtype=np.int32).reshape(3, lanes) * 7 - 5
    shared = await hosts[1].alloc(mu_of(params, 1), weight=2)
    await hosts[1].append_vectors(shared, data)
    out = await hosts[0].alloc(mu_of(params, 0))
    frees_before = await hosts[1].cfg_read(*mu_of(params, 1)[:2], MU_MAP.FREES)
    remote = assemble("""
            LI r7, 300
        wait: LOOP r7, wait       # let the local holder return first
            LI r4, 1
            VREAD r1, r4          # remote READ of word 1
            VAPPEND r5, r1        # remote APPEND: word 3 = word 1
            LI r4, 0
            VWRITE r1, r4         # remote WRITE: word 0 = word 1
            LEN r6, r1            # 4
        copy: LI r4, 0
        next: VREAD r1, r4
            VAPPEND r5, r2
            ALUI ADD, r4, r4, 1
            BLT r4, r6, next
            RETI r1, 1            # the last weight: frees the buffer
            HALT
    """)
    local = assemble("LEN r6, r1\nRETI r1, 1\nHALT")
    cu = cus(params)[0]      # one CU in each cluster
    await run_system(hosts, [
        FabricConfig(params, {cu: TileConfig(program=remote, regs={1: shared, 2: out})}),
        FabricConfig(params, {cu: TileConfig(program=local, regs={1: shared})}),
    ])
    got = await hosts[0].read_vectors(out)
    want = np.array([data[1], data[1], data[2], data[1]], dtype=np.int32)
    np.testing.assert_array_equal(got, want)
    x, y, _ = mu_of(params, 1)
    assert await hosts[1].cfg_read(x, y, MU_MAP.FREES) - frees_before == 1
    assert await hosts[1].cfg_read(x, y, MU_MAP.LIVE_BUFFERS) == 0
    r = await hosts[0].mu_request({"op": MUOp.LEN, "ref": hosts[0].ref_dict(shared)})
    assert r["status"] is MUStatus.BAD_REF
    await hosts[0].release(out)


@cocotb.test()
async def barrier_across_every_cu_of_both_clusters(dut):
    """Every CU of both clusters runs rounds of a barrier held in cluster 1's MU."""
    cfg, params, hosts = await setup(dut)
    rounds = cfg.get("rounds", 3)
    n = 2 * len(cus(params))
    bar = await hosts[0].alloc(mu_of(params, 1))
    await hosts[0].append_vectors(bar, np.zeros((2, params.cu.lanes), np.int32))
    program = assemble(barrier_rounds(rounds, n))
    configs = [FabricConfig(params, {xy: TileConfig(program=program, regs={1: bar})
                                     for xy in cus(params)}) for _ in range(2)]
    cycles = await run_system(hosts, configs)
    words = await hosts[0].read_vectors(bar)
    assert words[0][0] == words[1][0] == rounds * n
    dut._log.info("barrier: %d rounds of %d CUs in %s cycles", rounds, n, cycles)
    await hosts[0].release(bar)


@cocotb.test()
async def lock_mutual_exclusion_under_contention(dut):
    """Every CU of both clusters increments one counter of cluster 0 under a ticket lock."""
    cfg, params, hosts = await setup(dut)
    n_inc = cfg.get("increments", 4)
    lock = await hosts[1].alloc(mu_of(params, 0))
    await hosts[1].append_vectors(lock, np.zeros((3, params.cu.lanes), np.int32))
    log = await hosts[1].alloc(mu_of(params, 1))
    configs = []
    tags = {}
    for k in range(2):
        tiles = {}
        for xy in cus(params):
            tags[(k, xy)] = tag = 100 * (k + 1) + len(tags)
            tiles[xy] = TileConfig(program=assemble(locked_increment(n_inc)),
                                   regs={0: tag, 1: lock, 2: log})
        configs.append(FabricConfig(params, tiles))
    await run_system(hosts, configs)
    words = await hosts[0].read_vectors(lock)
    total = n_inc * len(tags)
    assert words[2][0] == total, words           # no increment lost
    assert words[0][0] == words[1][0] == total   # every ticket served
    held = [int(v) for v in (await hosts[0].read_vectors(log))[:, 0]]
    assert sorted(held) == sorted(t for t in tags.values() for _ in range(n_inc))
    await hosts[0].release(lock)
    await hosts[0].release(log)


@cocotb.test()
async def matvec_partitioned_across_clusters_bit_exact(dut):
    """y = W x with W's rows split over the 4 CUs of both clusters and x one buffer of
    cluster 0 shared by all (read remotely by cluster 1), bit-exact against numpy; x is
    freed by the last CU to return it."""

    cfg, params, hosts = await setup(dut)
    job = cluster_matvec(params, clusters=2, m=cfg.get("m", 16), k=cfg.get("k", 32))
    x_mu = next(b.mu for b in job.buffers if b.name == "x")
    outputs, cycles, refs = await run_system_job(hosts, job)
    for name in job.outputs:
        np.testing.assert_array_equal(outputs[name], job.expected[name])
    r = await hosts[1].mu_request({"op": MUOp.LEN, "ref": hosts[1].ref_dict(refs["x"])})
    assert r["status"] is MUStatus.BAD_REF
    x, y, _ = x_mu
    assert await hosts[0].cfg_read(x, y, MU_MAP.LIVE_BUFFERS) == 0
    dut._log.info("%s: %s cycles", job.description, cycles)
