# amaranth: UnusedElaboratable=no
"""Link jitter (random stall gates on every mesh link, ``docs/race.md``) in Amaranth's
simulator: nothing lost, duplicated, reordered or corrupted at high stall rates, the gates'
stall bits equal the Python model, rate 0 is the unjittered mesh, and stalls really delay."""

import random

import numpy as np
import pytest
from amaranth.back import verilog
from conftest import drive_mesh, run_checked

from rdakit.hdl.fabric.top import Fabric
from rdakit.hdl.noc.jitter import jitter_salt, stall_sequence, xorshift32
from rdakit.hdl.noc.mesh import DualMesh, Mesh
from rdakit.hdl.spec.flit import pack_flit
from rdakit.hdl.spec.params import FabricParams
from rdakit.sim.models.noc import PATTERNS, Destinations, NocScoreboard, hops, tb_payload_layout


@pytest.mark.parametrize("rows,cols,queues,rate", [(2, 3, "voq", 220), (3, 2, "fifo", 160),
                                                   (2, 2, "scan", 250)])
def test_jittered_mesh_delivers_everything_once_in_order(rows, cols, queues, rate):
    """Random traffic with random back-pressure and every link stalling most cycles: the
    scoreboard sees every flit exactly once, unchanged, in order per pair, and the routers'
    forwarded counters still match the XY routes."""
    coord_bits = 2
    n = rows * cols
    dut = Mesh(rows=rows, cols=cols, coord_bits=coord_bits, queues=queues, jitter=True,
               payload_shape=tb_payload_layout(coord_bits))
    sb = NocScoreboard(rows, cols, coord_bits)
    rng = random.Random(rate)
    draws = [Destinations(p, rows, cols, seed=k) for k, p in enumerate(PATTERNS)]
    queues_ = [[] for _ in range(n)]
    for _ in range(150):
        s = rng.randrange(n)
        queues_[s].append(sb.make(s, rng.choice(draws).draw(s)))

    async def tb(ctx):
        ctx.set(dut.jitter_seed, 0x1234_5678 + rate)
        await ctx.tick()
        ctx.set(dut.jitter_rate, rate)
        cycles, _ = await drive_mesh(ctx, dut, n, queues_, ready_p=0.7, rng=rng,
                                on_eject=lambda c, t, f: sb.eject(t, f), limit=20000,
                                until=lambda: not any(queues_) and sb.outstanding == 0)
        sb.check_complete()
        assert not any(queues_) and cycles < 20000
        forwarded = np.array([[ctx.get(dut.forwarded[t][p]) for p in range(5)]
                              for t in range(n)])
        assert (forwarded == sb.forwarded).all()

    run_checked(dut, tb)


def test_stall_bits_match_the_model():
    """Every gate's generator: loaded from seed ^ salt while rate is 0, then one xorshift step
    a cycle; it stalls when its low byte is below rate. Checked bit for bit against
    :func:`stall_sequence` on the ejection gate of tile 0 by watching its valid."""
    dut = Mesh(rows=1, cols=2, payload_shape=8, jitter=True, jitter_salt="t")
    seed, rate = 0xDEAD_BEEF, 128
    want = stall_sequence(seed, rate, jitter_salt("t", "eject", 0, 0), 200)
    assert 60 < sum(want) < 140              # about half the cycles stall

    async def tb(ctx):
        ctx.set(dut.jitter_seed, seed)
        await ctx.tick()
        # A flit waits at tile 0's ejection buffer: the buffer offers it every cycle, so the
        # port's valid is exactly "not stalled" once it is there.
        ctx.set(dut.inject[0].valid, 1)
        ctx.set(dut.inject[0].payload.as_value(), pack_flit(dut.flit, 0, 0, 0x5A))
        await ctx.tick().repeat(4)
        ctx.set(dut.inject[0].valid, 0)
        ctx.set(dut.jitter_rate, rate)
        got = []
        for _ in range(200):
            got.append(1 - ctx.get(dut.eject[0].valid))
            await ctx.tick()
        assert got == want

    run_checked(dut, tb)


def test_model_generator_is_xorshift32():
    assert xorshift32(1) == 0x4_2021
    assert stall_sequence(5, 0, 7, 10) == [0] * 10       # rate 0: never
    assert stall_sequence(5, 5, 5, 3)[0] == int((5 & 0xff) < 5)  # seed ^ salt = 0: the salt


@pytest.mark.parametrize("jitter", [False, True])
def test_rate_zero_is_the_plain_mesh_and_stalls_delay(jitter):
    """At rate 0 a jittered mesh has the plain mesh's zero-load latency (hops + 2); at rate 200
    the same packets take longer on average."""
    dut = Mesh(rows=1, cols=4, payload_shape=8, jitter=jitter)

    async def tb(ctx):
        rng = random.Random(0)
        for rate in ([0, 200] if jitter else [0]):
            lat = []
            for s in range(4):
                for d in range(4):
                    if jitter:
                        ctx.set(dut.jitter_rate, 0)
                        ctx.set(dut.jitter_seed, s * 4 + d)
                        await ctx.tick()
                        ctx.set(dut.jitter_rate, rate)
                    got = []
                    q = [[] for _ in range(4)]
                    q[s].append(pack_flit(dut.flit, d, 0, 0x5A))
                    _c, inj = await drive_mesh(ctx, dut, 4, q, ready_p=1, rng=rng, limit=400,
                                          on_eject=lambda c, t, f, got=got: got.append((c, t)))
                    assert len(got) == 1 and got[0][1] == d
                    lat.append(got[0][0] - inj[0][0] - (hops((s, 0), (d, 0)) + 2))
            if rate == 0:
                assert lat == [0] * 16
            else:
                assert min(lat) >= 0 and sum(lat) > 3 * 16

    run_checked(dut, tb)


def test_dual_mesh_and_fabric_have_jitter_ports_only_when_asked():
    kw = dict(rows=2, cols=2, request_shape=8, response_shape=8)
    assert "jitter_rate" not in DualMesh(**kw).signature.members
    assert DualMesh(jitter=True, **kw).signature.members["jitter_seed"].shape == 32
    assert "jitter_seed" not in Fabric(FabricParams()).signature.members
    text = verilog.convert(Fabric(FabricParams(), jitter=True, stamps=True), name="top",
                           emit_src=False)
    assert "jitter_seed" in text and "jitter_rate" in text


@pytest.mark.parametrize("cls,kw", [
    (Mesh, dict(rows=2, cols=2, payload_shape=8)),
    (DualMesh, dict(rows=2, cols=2, request_shape=8, response_shape=8)),
])
def test_init_wrong_jitter(cls, kw):
    with pytest.raises(TypeError, match=r"^jitter must be a bool, not 1$"):
        cls(jitter=1, **kw)


@pytest.mark.parametrize("name", ["jitter", "stamps"])
def test_fabric_init_wrong_option(name):
    with pytest.raises(TypeError, match=rf"^{name} must be a bool, not 'yes'$"):
        Fabric(FabricParams(), **{name: "yes"})
