# amaranth: UnusedElaboratable=no
"""Meshes and the dual (request/response) network in Amaranth's simulator: delivery exactly
once and in order under back-pressure, rejection of destinations outside the mesh, counters
against the XY routes, independence of the two networks, and parameter validation."""

import random
import re

import numpy as np
import pytest
from amaranth.back import verilog
from conftest import drive_mesh, run_checked

from rdakit.hdl.noc.mesh import DualMesh, Mesh, tile_coords, tile_index
from rdakit.hdl.spec.flit import Port, pack_flit
from rdakit.hdl.spec.packets import MUOp, mu_request_layout, mu_response_layout, pack
from rdakit.hdl.spec.params import MUParams
from rdakit.sim.models.noc import (
    PATTERNS,
    Destinations,
    NocScoreboard,
    hops,
    tb_payload_layout,
    theoretical_limit,
    traffic_matrix,
    xy_path,
    zero_load_latency,
)

MESHES = [(1, 1, "voq"), (1, 4, "voq"), (2, 2, "fifo"), (3, 2, "scan"), (2, 3, "voq")]


@pytest.mark.parametrize("rows,cols,queues", MESHES)
def test_mesh_delivers_everything_once_in_order(rows, cols, queues):
    """Random traffic (all patterns mixed, some destinations outside the mesh) with random
    back-pressure at every ejection port: all delivered exactly once, unchanged, in order per
    pair; rejected flits counted at their source; forwarded counters match the XY routes."""
    coord_bits = 2
    n = rows * cols
    dut = Mesh(rows=rows, cols=cols, coord_bits=coord_bits, queues=queues,
               payload_shape=tb_payload_layout(coord_bits))
    sb = NocScoreboard(rows, cols, coord_bits)
    rng = random.Random(rows * 10 + cols)
    draws = [Destinations(p, rows, cols, seed=k) for k, p in enumerate(PATTERNS)]
    queues_ = [[] for _ in range(n)]
    for _ in range(250):
        s = rng.randrange(n)
        if rng.random() < 0.05:
            dst = (rng.choice([x for x in range(4) if x >= cols] or [0]),
                   rng.choice([y for y in range(4) if y >= rows] or [0]))
            if dst[0] < cols and dst[1] < rows:
                dst = (3, 3)
        else:
            dst = rng.choice(draws).draw(s)
        queues_[s].append(sb.make(s, dst))

    async def tb(ctx):
        await drive_mesh(ctx, dut, n, queues_, ready_p=0.6, rng=rng,
                    on_eject=lambda c, t, f: sb.eject(t, f), limit=3000,
                    until=lambda: not any(queues_) and sb.outstanding == 0)
        sb.check_complete()
        assert not any(queues_)
        forwarded = np.array([[ctx.get(dut.forwarded[t][p]) for p in range(5)]
                              for t in range(n)])
        assert (forwarded == sb.forwarded).all()
        for t in range(n):
            assert ctx.get(dut.rejected[t]) == sb.rejects[t]

    run_checked(dut, tb)


def test_mesh_zero_load_latency():
    """Alone in a 1x4 mesh, a packet is offered at its destination hops + 2 cycles after its
    injection handshake."""
    dut = Mesh(rows=1, cols=4, payload_shape=8)

    async def tb(ctx):
        rng = random.Random(0)
        for s in range(4):
            for d in range(4):
                got = []
                q = [[] for _ in range(4)]
                q[s].append(pack_flit(dut.flit, d, 0, 0x5A))
                _c, inj = await drive_mesh(ctx, dut, 4, q, ready_p=1, rng=rng, limit=12,
                                      on_eject=lambda c, t, f, got=got: got.append((c, t, f)))
                assert len(got) == 1 and got[0][1] == d
                assert got[0][0] - inj[0][0] == hops((s, 0), (d, 0)) + 2

    run_checked(dut, tb)


def test_dual_mesh_responses_flow_while_requests_are_stuck():
    """With the request network full (no tile drains its request ejection port), responses
    still travel: the two networks share nothing."""
    p = MUParams()
    dut = DualMesh.for_mu(p, rows=2, cols=2)
    req_l = mu_request_layout(p)
    rsp_l = mu_response_layout(p)

    async def tb(ctx):
        # Fill the request network towards tile 3 until injection stalls everywhere.
        for _ in range(40):
            for t in range(4):
                ctx.set(dut.req.inject[t].valid, 1)
                req = pack(req_l, {"op": MUOp.READ, "src": {"x": t % 2, "y": t // 2},
                                   "tag": t})
                ctx.set(dut.req.inject[t].payload.as_value(), pack_flit(dut.request_flit, 1, 1,
                                                                         req))
                ctx.set(dut.req.eject[t].ready, 0)
            await ctx.tick()
        assert not any(ctx.get(dut.req.inject[t].ready) for t in range(4))
        for t in range(4):
            ctx.set(dut.req.inject[t].valid, 0)
        # Responses from tile 3 to every tile get through.
        got = []
        for d in range(4):
            x, y = tile_coords(d, 2)
            rsp = pack(rsp_l, {"op": MUOp.READ, "dst": {"x": x, "y": y}, "tag": d, "data": d})
            ctx.set(dut.rsp.inject[3].valid, 1)
            ctx.set(dut.rsp.inject[3].payload.as_value(), pack_flit(dut.response_flit, x, y,
                                                                     rsp))
            for t in range(4):
                ctx.set(dut.rsp.eject[t].ready, 1)
            while not ctx.get(dut.rsp.inject[3].ready):
                await ctx.tick()
            await ctx.tick()
        ctx.set(dut.rsp.inject[3].valid, 0)
        for _ in range(10):
            for t in range(4):
                if ctx.get(dut.rsp.eject[t].valid):
                    got.append(t)
            await ctx.tick()
        assert sorted(got) == [0, 1, 2, 3]
        assert ctx.get(dut.req.blocked[3][Port.LOCAL.value]) > 0

    run_checked(dut, tb)


def test_tile_numbering():
    assert tile_index(2, 1, 3) == 5
    assert tile_coords(5, 3) == (2, 1)


# --------------------------------------------------------------------------------------------
# Verilog (combinational-loop check) of every tested configuration, and port names.

@pytest.mark.parametrize("rows,cols,queues", [(4, 4, "voq"), (1, 3, "scan")])
def test_mesh_converts_to_verilog(rows, cols, queues):
    """Meshes convert with the expected port names (the simulated configurations convert in
    :func:`run`)."""
    dut = Mesh(rows=rows, cols=cols, queues=queues, coord_bits=2,
               payload_shape=tb_payload_layout(2))
    text = verilog.convert(dut, name="top", emit_src=False)
    n = rows * cols
    for name in (f"inject__{n - 1}__valid", f"eject__{n - 1}__payload",
                 f"forwarded__{n - 1}__4", f"blocked__0__{Port.EAST.value}",
                 f"rejected__{n - 1}", "reject__0"):
        assert re.search(rf"\b(input|output)\b.*\b{name}\b", text), name


def test_dual_mesh_converts_to_verilog():
    text = verilog.convert(DualMesh.for_mu(MUParams(), rows=2, cols=3), name="top",
                           emit_src=False)
    assert re.search(r"\binput\b.*\breq__inject__5__valid\b", text)
    assert re.search(r"\boutput\b.*\brsp__eject__0__payload\b", text)


@pytest.mark.slow
def test_mesh_8x8_converts_to_verilog():
    dut = Mesh(rows=8, cols=8, payload_shape=mu_request_layout(MUParams()), coord_bits=3)
    text = verilog.convert(dut, name="top", emit_src=False)
    assert "eject__63__valid" in text


# --------------------------------------------------------------------------------------------
# Parameter validation: one test per parameter, exact messages.

def mesh(**kw):
    kw.setdefault("rows", 2)
    kw.setdefault("cols", 2)
    kw.setdefault("payload_shape", 8)
    return Mesh(**kw)


def test_init_wrong_rows():
    with pytest.raises(TypeError, match=r"^rows must be an integer between 1 and 256, not 0$"):
        mesh(rows=0)
    with pytest.raises(ValueError, match=r"^rows must be at most 2\*\*coord_bits = 8, not 9$"):
        mesh(rows=9, coord_bits=3)


def test_init_wrong_cols():
    with pytest.raises(TypeError, match=r"^cols must be an integer between 1 and 256, "
                                        r"not 257$"):
        mesh(cols=257)


def test_init_wrong_payload_shape():
    with pytest.raises(TypeError, match=r"^payload_shape must be a shape-castable object, "
                                        r"not None$"):
        mesh(payload_shape=None)


def test_init_wrong_coord_bits():
    with pytest.raises(TypeError, match=r"^coord_bits must be an integer between 1 and 8, "
                                        r"not 0$"):
        mesh(coord_bits=0)


def test_init_wrong_depth():
    with pytest.raises(TypeError, match=r"^depth must be an integer between 1 and 64, not 65$"):
        mesh(depth=65)


def test_init_wrong_queues():
    with pytest.raises(TypeError, match=r"^queues must be one of 'voq', 'fifo', 'scan', "
                                        r"not None$"):
        mesh(queues=None)


def test_init_wrong_counter_bits():
    with pytest.raises(TypeError, match=r"^counter_bits must be an integer between 1 and 64, "
                                        r"not 0$"):
        mesh(counter_bits=0)


def test_dual_init_wrong_request_shape():
    with pytest.raises(TypeError, match=r"^request_shape must be a shape-castable object, "
                                        r"not 'req'$"):
        DualMesh(rows=2, cols=2, request_shape="req", response_shape=8)


def test_dual_init_wrong_response_shape():
    with pytest.raises(TypeError, match=r"^response_shape must be a shape-castable object, "
                                        r"not -1$"):
        DualMesh(rows=2, cols=2, request_shape=8, response_shape=-1)


def test_dual_init_wrong_geometry():
    with pytest.raises(TypeError, match=r"^rows must be an integer between 1 and 256, not 0$"):
        DualMesh(rows=0, cols=2, request_shape=8, response_shape=8)


# --------------------------------------------------------------------------------------------
# The reference model the scoreboards and the benchmark rely on.

@pytest.mark.parametrize("k", [2, 4, 6, 8, 16])
def test_uniform_limit_is_four_over_k(k):
    limit, _channel = theoretical_limit("uniform", k, k)
    assert limit == pytest.approx(min(1.0, 4 / k))


def test_uniform_limit_odd_k():
    # The middle links of an odd row carry (k-1)(k+1)/(4k) per unit rate.
    assert theoretical_limit("uniform", 5, 5)[0] == pytest.approx(20 / 24)
    assert theoretical_limit("uniform", 3, 3)[0] == 1.0


def test_pattern_limits():
    # Hotspot: the hot tile's ejection port carries n*h + (1 - h) per unit rate.
    limit, channel = theoretical_limit("hotspot", 8, 8, hotspot=(4, 4), hot_fraction=0.25)
    assert limit == pytest.approx(1 / (64 * 0.25 + 0.75))
    assert channel == (4, 4, Port.LOCAL)
    # Transpose on k x k under XY: k - 1 flows share the first west link of row 0.
    assert theoretical_limit("transpose", 8, 8)[0] == pytest.approx(1 / 7)
    assert theoretical_limit("bitcomp", 8, 8)[0] == pytest.approx(0.25)
    assert theoretical_limit("uniform", 1, 1) == (1.0, None)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_traffic_matrices_are_distributions_and_sampled_faithfully(pattern):
    rows, cols = 3, 4
    P = traffic_matrix(pattern, rows, cols, hotspot=(1, 2))
    assert P.shape == (12, 12)
    assert np.allclose(P.sum(axis=1), 1)
    draw = Destinations(pattern, rows, cols, seed=1, hotspot=(1, 2))
    counts = np.zeros(12)
    for _ in range(3000):
        x, y = draw.draw(5)
        counts[tile_index(x, y, cols)] += 1
    assert np.abs(counts / 3000 - P[5]).max() < 0.04


def test_xy_path_goes_x_first():
    path = xy_path((0, 0), (2, 1))
    assert [p for _xy, p in path] == [Port.EAST, Port.EAST, Port.SOUTH, Port.LOCAL]
    assert zero_load_latency("uniform", 8, 8) == pytest.approx(2 + 2 * (64 - 1) / (3 * 8))


def test_scoreboard_catches_loss_duplication_reordering_and_corruption():
    sb = NocScoreboard(2, 2, 1)
    a = sb.make(0, (1, 1))
    b = sb.make(0, (1, 1))
    with pytest.raises(AssertionError, match="sequence number 1, expected 0"):
        sb.eject(3, b)
    sb = NocScoreboard(2, 2, 1)
    a = sb.make(0, (1, 1))
    with pytest.raises(AssertionError, match="delivered at tile 2"):
        sb.eject(2, a)
    sb = NocScoreboard(2, 2, 1)
    a = sb.make(0, (1, 1))
    sb.eject(3, a)
    with pytest.raises(AssertionError, match="duplicate or corrupted"):
        sb.eject(3, a)
    sb = NocScoreboard(2, 2, 1)
    a = sb.make(0, (1, 1))
    with pytest.raises(AssertionError, match="corrupted"):
        sb.eject(3, a ^ (1 << 5))
    sb = NocScoreboard(2, 2, 1)
    sb.make(1, (0, 0))
    with pytest.raises(AssertionError, match="1 packets never delivered"):
        sb.check_complete()
