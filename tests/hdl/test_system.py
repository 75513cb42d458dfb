# amaranth: UnusedElaboratable=no
"""A system of two 1x2 clusters in Amaranth's simulator: remote MU requests from either host
port through the bridges, checked against the golden MU model, and the system's parameters."""

import random

import pytest

from rdakit.hdl.cluster.system import System, SystemParams
from rdakit.hdl.spec.config import MU_MAP
from rdakit.hdl.spec.packets import MUOp, MUStatus
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.models.mu import MUModel
from rdakit.sim.runtime.host import AmaranthTransport, HostDriver
from rdakit.sim.verify.amaranth_sim import simulate

FP = fabric_params(1, 2, cluster_bits=1, mu_words=256, max_buffers=4, prog_len=16)
SP = SystemParams(FP, clusters=2, link_latency=6)


def run_on_system(sp, body):
    system = System(sp)
    out = {}

    async def tb(ctx):
        hosts = [HostDriver(sp.fabric, AmaranthTransport(ctx, system.host_port(k)))
                 for k in range(sp.clusters)]
        out["value"] = await body(ctx, system, hosts)

    simulate(system, tb)
    return out["value"]


def random_requests(rng, n, mus):
    """A random mix of MU requests over the MUs in ``mus``, with refs drawn from earlier
    ALLOC responses (filled in while running) and some deliberately bad ones."""
    ops = [MUOp.ALLOC, MUOp.APPEND, MUOp.APPEND, MUOp.WRITE, MUOp.READ, MUOp.READ, MUOp.LEN,
           MUOp.RETURN, MUOp.ADD_WEIGHT]
    return [(rng.choice(ops), rng.choice(mus), rng.getrandbits(16), rng.randrange(8))
            for _ in range(n)]


@pytest.fixture(scope="module")
def remote_run():
    """Host 0 and host 1 each drive random requests at both clusters' MUs; every response is
    checked against a golden model of the MU it addressed."""
    rng = random.Random(3)
    mu_ids = [FP.mu_id(1, 0, k) for k in range(2)]
    models = {mu: MUModel(FP.mu, mu) for mu in mu_ids}

    async def body(ctx, system, hosts):
        refs = {mu: [] for mu in mu_ids}
        log = []
        for i, (op, mu, value, idx) in enumerate(random_requests(rng, 80, mu_ids)):
            k = i % 2   # alternate the host port
            if op is MUOp.ALLOC or not refs[mu]:
                req = {"op": MUOp.ALLOC, "ref": {"mu": mu, "buf": 0}, "data": 1 + value % 4}
            else:
                ref = rng.choice(refs[mu])
                req = {"op": op, "ref": ref, "index": idx,
                       "data": value if op in (MUOp.WRITE, MUOp.APPEND) else 1 + value % 2}
            req["tag"] = i % 8
            # The fabric stamps its own cluster into src, whatever the host port says.
            got = await hosts[k].mu_request({**req, "src": {"x": 1, "y": 0, "cluster": 1 - k}})
            req["src"] = {"x": 0, "y": 0, "cluster": k}
            want = models[mu].request(req)
            want["tag"] = req["tag"]
            log.append((k, mu, req, got, want))
            if op is MUOp.ALLOC and got["status"] is MUStatus.OK:
                refs[mu].append(got["ref"])
        counts = [int(ctx.get(system.req_packets[k])) for k in range(2)]
        rsp = [int(ctx.get(system.rsp_packets[k])) for k in range(2)]
        held = [await hosts[k].cfg_read(1, 0, MU_MAP.LIVE_BUFFERS) for k in range(2)]
        return log, counts, rsp, held, models

    return run_on_system(SP, body)


def test_remote_requests_match_the_golden_model(remote_run):
    log, *_ = remote_run
    assert any(k != FP.mu_cluster(mu) for k, mu, *_ in log)
    for k, mu, req, got, want in log:
        assert got == want, (k, mu, req)


def test_every_remote_request_crossed_the_links_once(remote_run):
    log, counts, rsp, *_ = remote_run
    for k in range(2):
        remote = sum(1 for kk, mu, *_ in log if kk == k and FP.mu_cluster(mu) != k)
        served = sum(1 for kk, mu, *_ in log if kk != k and FP.mu_cluster(mu) == k)
        assert counts[k] == remote      # requests out of cluster k
        assert rsp[k] == served         # responses out of cluster k


def test_live_buffers_match_the_model(remote_run):
    *_, held, models = remote_run
    for k in range(2):
        model = models[FP.mu_id(1, 0, k)]
        assert held[k] == sum(b is not None for b in model._live)


def test_shared_buffer_freed_once_after_the_last_remote_holder():
    """A buffer of cluster 1 with weight 3: host 1 (local) and host 0 (remote) return weight
    in turn; it is freed by the last return, exactly once, and later requests see BAD_REF."""
    mu = FP.mu_id(1, 0, 1)

    async def body(ctx, system, hosts):
        ref = hosts[1].ref_dict(await hosts[1].alloc((1, 0, 1), weight=3))
        out = []
        for k, w in ((0, 1), (1, 1), (0, 1), (0, 1)):
            r = await hosts[k].mu_request({"op": MUOp.RETURN, "ref": ref, "data": w})
            out.append((r["status"], r["data"],
                        await hosts[1].cfg_read(1, 0, MU_MAP.FREES)))
        return ref, out

    ref, out = run_on_system(SP, body)
    assert ref["mu"] == mu
    assert out == [(MUStatus.OK, 2, 0), (MUStatus.OK, 1, 0), (MUStatus.OK, 0, 1),
                   (MUStatus.BAD_REF, 0, 1)]


@pytest.mark.parametrize("kwargs,exc,message", [
    ({"fabric": 3}, TypeError, r"^fabric must be a FabricParams, not 3$"),
    ({"fabric": fabric_params(1, 2)}, ValueError, r"^fabric.mu.cluster_bits must be at least"),
    ({"clusters": 3}, ValueError, r"^clusters must be an integer from 1 to 2 "
                                  r"\(cluster_bits = 1\), not 3$"),
    ({"link_width": 0}, TypeError, r"^link_width must be an integer from 1 to \d+, not 0$"),
    ({"link_latency": 0}, TypeError, r"^link_latency must be an integer from 1 to 256, not 0$"),
    ({"link_depth": 0}, TypeError, r"^link_depth must be an integer from 1 to 1024, not 0$"),
    ({"bridge": (2, 0)}, TypeError, r"^bridge must be the \(x, y\) of a tile of the 1x2 grid"),
])
def test_wrong_parameters(kwargs, exc, message):
    args = {"fabric": FP, **kwargs}
    with pytest.raises(exc, match=message):
        SystemParams(**args)


def test_default_link_is_a_quarter_of_a_request():
    assert SP.link_width == -(-SP.request_bits // 4)
    assert SP.bridge == (1, 0)


def test_system_needs_system_params():
    with pytest.raises(TypeError, match=r"^params must be a SystemParams, not 1$"):
        System(1)


def test_fabric_cluster_must_fit_cluster_bits():
    from rdakit.hdl.fabric.top import Fabric
    with pytest.raises(TypeError, match=r"^cluster must be an integer from 0 to 1"):
        Fabric(FP, cluster=2)
    with pytest.raises(TypeError, match=r"^bridge must be the \(x, y\) of a tile"):
        Fabric(FP, bridge=(0, 1))


@pytest.mark.slow
def test_remote_access_costs_two_link_crossings():
    from rdakit.sim.bench.clusters import measure_access

    fig = measure_access(SP, reads=8, words=32)
    local, remote = fig["local"], fig["remote"]
    assert local["link_packets"] == 0
    assert remote["link_packets"] == 2 * (8 + 32)       # a request and a response each
    # A round trip crosses two links: each at least beats + latency cycles.
    beats = -(-SP.request_bits // SP.link_width)
    assert remote["latency_cycles"] >= local["latency_cycles"] + 2 * (beats + SP.link_latency)
    assert remote["words_per_cycle"] < local["words_per_cycle"]


def test_bridge_on_the_host_tile():
    """The bridge may share tile (0, 0) with the host port (and a CU): remote requests from
    both host ports still get their responses, and the data crosses intact."""
    sp = SP.replace(bridge=(0, 0), link_latency=2, link_width=5)

    async def body(ctx, system, hosts):
        out = []
        for k in range(2):
            ref = await hosts[k].alloc((1, 0, 1 - k))
            await hosts[k].append_vectors(ref, [[k, 2, 3, 4 + k]])
            out.append((await hosts[1 - k].read_vectors(ref)).tolist())
            await hosts[1 - k].release(ref)
        return out, int(ctx.get(system.dropped))

    out, dropped = run_on_system(sp, body)
    assert out == [[[0, 2, 3, 4]], [[1, 2, 3, 5]]]
    assert dropped == 0


def test_four_clusters_every_pair():
    """Four clusters: every host port allocates and fills a buffer in every cluster, the next
    host port reads it back, its own cluster frees it; every request crosses the switch to the
    right cluster."""
    fp = fabric_params(1, 2, cluster_bits=2, lanes=1, mu_words=64, max_buffers=4, prog_len=8)
    sp = SystemParams(fp, clusters=4, link_latency=5)

    async def body(ctx, system, hosts):
        out = {}
        for a in range(4):
            for b in range(4):
                ref = await hosts[a].alloc((1, 0, b))
                await hosts[a].append_vectors(ref, [[a * 10 + b]])
                out[a, b] = int((await hosts[(a + 1) % 4].read_vectors(ref))[0, 0])
                await hosts[b].release(ref)
        return out, [int(ctx.get(system.req_packets[k])) for k in range(4)]

    out, packets = run_on_system(sp, body)
    assert out == {(a, b): a * 10 + b for a in range(4) for b in range(4)}
    # Host a: ALLOC and APPEND in the 3 other clusters, LEN and READ of 3 buffers elsewhere.
    assert packets == [12] * 4


def test_tokens_and_references_cross_clusters():
    """The CU of cluster 0 hands a buffer of its cluster (with its weight) and three tokens to
    the CU of cluster 1, which waits for them, copies the buffer into one of cluster 1 and
    returns the weight: the copy is exact and the buffer freed by that remote return."""
    import numpy as np

    from rdakit.compiler.job import HostBuffer, Ref
    from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
    from rdakit.hdl.spec.isa import assemble
    from rdakit.sim.runtime.clusters import SystemJob, run_system_job

    lanes = FP.cu.lanes
    a = np.arange(4 * lanes, dtype=np.int32).reshape(4, lanes) * 7 - 9
    to = FP.mu_id(0, 0, 1)
    sender = assemble(f"""
        LI r4, {to}
        LI r3, 1
        SENDREF 0, r4, r1, r3
        SEND 1, r4, 3
        HALT
    """)
    receiver = assemble("""
        WAIT 1, 3
        RECV 0, r2
        SCFG A_REF, r2
        SCFGI A_STRIDE, 1
        SCFGI N, 4
        SCFGI D_MODE, 2
        SCFG D_REF, r5
        SRUN PASS, r0
        RET r2, r3
        HALT
    """)
    job = SystemJob(
        configs=[FabricConfig(FP, {(0, 0): TileConfig(program=sender, regs={1: Ref("a")})}),
                 FabricConfig(FP, {(0, 0): TileConfig(program=receiver, regs={5: Ref("y")})})],
        buffers=[HostBuffer("a", (1, 0, 0), a, weight=1, cu_returns=1),
                 HostBuffer("y", (1, 0, 1))],
        outputs=["y"], expected={"y": a})

    async def body(ctx, system, hosts):
        outputs, cycles, refs = await run_system_job(hosts, job, max_cycles=20_000)
        frees = await hosts[0].cfg_read(1, 0, MU_MAP.FREES)
        return outputs, cycles, frees, int(ctx.get(system.rsp_packets[0]))

    outputs, cycles, frees, rsp0 = run_on_system(SP, body)
    np.testing.assert_array_equal(outputs["y"], a)
    assert frees == 1
    assert rsp0 >= 2        # the reference and the tokens left cluster 0 over its link


def test_request_for_a_cluster_that_does_not_exist_is_answered():
    """Three clusters with cluster IDs of 2 bits, so cluster 3 has an ID but no fabric: a CU
    of cluster 0 that ALLOCs in it halts with MU_ERROR (at the ALLOC, as for any refusal)
    instead of waiting forever, a host port's request for it is answered with
    BAD_DESTINATION, and the system goes on: nothing is dropped, and a buffer in cluster 2 is
    allocated, filled and read back."""
    from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig, write_bitstream
    from rdakit.hdl.spec.isa import assemble

    fp = fabric_params(1, 2, cluster_bits=2, lanes=1, mu_words=64, max_buffers=4, prog_len=8)
    sp = SystemParams(fp, clusters=3, link_latency=3)
    nowhere = fp.mu_id(1, 0, 3)
    program = assemble(f"""
        LI r1, {nowhere}
        ALLOC r2, r1, 1
        ALUI ADD, r3, r2, 1
        HALT
    """)

    async def body(ctx, system, hosts):
        status, _ = await hosts[0].load(write_bitstream(
            FabricConfig(fp, {(0, 0): TileConfig(program=program)})))
        await hosts[0].start()
        st = await hosts[0].wait_done(max_cycles=2_000)
        cu = (await hosts[0].counters())[(0, 0)]
        resp = await hosts[1].mu_request({"op": MUOp.LEN, "tag": 3,
                                          "ref": {"mu": nowhere, "buf": 5}})
        ref = await hosts[1].alloc((1, 0, 2))
        await hosts[1].append_vectors(ref, [[7]])
        back = (await hosts[0].read_vectors(ref)).tolist()
        await hosts[1].release(ref)
        return status, st, cu, resp, back, int(ctx.get(system.dropped))

    status, st, cu, resp, back, dropped = run_on_system(sp, body)
    assert status.name == "OK"
    assert st["error"] and st["done"]
    assert (cu["error_code"], cu["pc"]) == (1, 1)          # MU_ERROR at the ALLOC refused
    assert (resp["status"], resp["op"], resp["tag"], resp["ref"]) == (
        MUStatus.BAD_DESTINATION, MUOp.LEN, 3, {"mu": nowhere, "buf": 5})
    assert back == [[7]]
    assert dropped == 0
