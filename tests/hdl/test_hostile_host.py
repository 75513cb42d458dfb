# amaranth: UnusedElaboratable=no
"""Hostile host input (issue 19, classes 1 and 2): nothing wedges the host port, nothing leaks.

One 2x2 fabric in Amaranth's simulator, shared by every test of the module (``SharedFabric``
serves one command body after another from a single simulation), with coordinates one bit
wider than the grid needs, so that references can name tiles off the grid. Every body runs under
a cycle bound: a port that stops answering fails the test instead of hanging it.
"""

import asyncio

import numpy as np
import pytest
from conftest import SharedFabric, hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.compiler.job import Job
from rdakit.errors import UserError
from rdakit.hdl.fabric.config_loader import LoadStatus
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.config import MU_MAP
from rdakit.hdl.spec.isa import assemble
from rdakit.hdl.spec.packets import HOST_IN_FLIGHT, HostCmd, MUOp, MUStatus, host_tag_bit
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.counters import read_mu_counters
from rdakit.sim.runtime.host import (
    HostArgumentError,
    HostDriver,
    HostTimeout,
)
from rdakit.sim.runtime.job import JobError, run_job
from rdakit.sim.verify.kernels import vector_add

#: A small MU (8 blocks, 4 buffer slots), one lane, coordinates of 2 bits on a 2x2 grid.
P = fabric_params(2, 2, coord_bits=2, lanes=1, mu_words=128, block_words=16, max_buffers=4,
                  prog_len=16, local_words=16)
CU_TILES, MU_TILES = P.tiles("C"), P.tiles("M")      # CUs (0, 0), (1, 1); MUs (1, 0), (0, 1)
MU = MU_TILES[0]
#: Cycles a command may wait for the fabric, in the driver and in the tests' own bound.
REPLY_CYCLES = 2_000


@pytest.fixture(scope="module")
def fabric():
    return SharedFabric(P, reply_cycles=REPLY_CYCLES)


async def free_blocks(host):
    """Free blocks of every MU."""
    return {xy: c["free_blocks"] for xy, c in
            (await read_mu_counters(host, ["free_blocks", "live_buffers"])).items()}


def bad_mu_ids():
    """MU IDs that name no MU: the CU tiles and every coordinate off the grid."""
    side = 1 << P.coord_bits
    return [P.mu_id(x, y) for y in range(side) for x in range(side)
            if not (x < P.cols and y < P.rows and P.kind(x, y) == "M")]


# --- the host port answers every MU request ----------------------------------------------------

@pytest.mark.parametrize("where", ["cu", "off_grid"])
def test_request_that_names_no_mu_is_answered(fabric, where):
    """An ALLOC at a CU tile, or at a tile off the grid, is answered at once with
    BAD_DESTINATION (op, tag and reference echoed); STATUS still answers, and an ALLOC at an
    MU then works."""
    mu = P.mu_id(0, 0) if where == "cu" else P.mu_id(3, 1)

    async def body(host):
        resp = await host.mu_request({"op": MUOp.ALLOC, "tag": 5, "ref": {"mu": mu, "buf": 3},
                                      "data": 1})
        st = await host.status()
        ref = await host.alloc(MU)
        freed = await host.free(ref)
        return resp, st, freed

    resp, st, freed = fabric.run(body)
    assert (resp["op"], resp["status"], resp["tag"], resp["ref"]) == (
        MUOp.ALLOC, MUStatus.BAD_DESTINATION, 5, {"mu": mu, "buf": 3})
    assert st["misrouted"] is False
    assert freed


@st.composite
def hostile_commands(draw):
    """A host command with fields chosen to hurt: an MU request with any opcode (undefined
    ones too) and any reference, mostly naming no MU, or a configuration read of any tile."""
    side = 1 << P.coord_bits
    if draw(st.integers(0, 4)) == 0:
        return {"kind": HostCmd.CFG_READ, "x": draw(st.integers(0, side - 1)),
                "y": draw(st.integers(0, side - 1)), "addr": draw(st.integers(0, 0xffff))}
    mu = draw(st.sampled_from(bad_mu_ids()) | st.integers(0, (1 << P.mu.mu_id_bits) - 1))
    # ALLOC only where it cannot allocate (the shared fabric's MUs stay as they are).
    op = draw(st.integers(0, 15).filter(lambda v: v != MUOp.ALLOC.value or mu in bad_mu_ids()))
    return {"kind": HostCmd.MU_REQUEST, "req": {
        "op": op, "tag": draw(st.integers(0, (1 << P.mu.tag_bits) - 1)),
        "ref": {"mu": mu, "buf": draw(st.integers(0, (1 << P.mu.buf_id_bits) - 1))},
        "index": draw(st.integers(0, (1 << P.mu.index_bits) - 1)),
        "data": draw(st.integers(0, 3))}}


@hostile(30)
@given(cmds=st.lists(hostile_commands(), min_size=1, max_size=6))
def test_hostile_commands_never_wedge_the_port(fabric, cmds):
    """Random MU requests and configuration reads, each followed by STATUS: every one gets its
    reply; a request that names no MU gets BAD_DESTINATION with its op and tag (less the host
    bit) echoed; a read of a tile off the grid replies ok = 0; nothing is misrouted."""
    host_mask = (1 << host_tag_bit(P.mu)) - 1

    async def body(host):
        out = []
        for cmd in cmds:
            reply = await host._command(cmd)
            out.append((cmd, reply, await host.status()))
        return out

    for cmd, reply, st_ in fabric.run(body):
        assert st_["misrouted"] is False
        if cmd["kind"] is HostCmd.CFG_READ:
            on_grid = cmd["x"] < P.cols and cmd["y"] < P.rows
            assert reply["ok"] == on_grid
            assert on_grid or reply["word"] == 0
            continue
        req, resp = cmd["req"], reply["resp"]
        if req["ref"]["mu"] in bad_mu_ids():
            assert resp["status"] is MUStatus.BAD_DESTINATION
            assert (getattr(resp["op"], "value", resp["op"]), resp["tag"], resp["ref"]) == (
                req["op"], req["tag"] & host_mask, req["ref"])
        else:
            assert resp["status"] is not MUStatus.BAD_DESTINATION


# --- the driver refuses what it can know is wrong ---------------------------------------------

class _Refuse:
    """A transport that fails the test if the driver sends anything."""

    async def send(self, value):
        pytest.fail("the driver sent a command it should have refused")

    recv = tick = send


REF_AT_CU = P.mu_id(0, 0) | 1 << P.mu.mu_id_bits
REFUSALS = [
    ("alloc", ((0, 0),), r"^mu_xy must be the \(x, y\) of an MU tile of the 2x2 fabric "
                         r"\(\(1, 0\), \(0, 1\)\), not \(0, 0\)$"),
    ("alloc", ((3, 0),), r"^mu_xy must be the \(x, y\) of an MU tile .* not \(3, 0\)$"),
    ("alloc", ((1, 0, 1),), r"^mu_xy \(1, 0, 1\) names cluster 1, but the system has "
                            r"clusters 0 to 0$"),
    ("alloc", ("MU",), r"^mu_xy must be the \(x, y\) of an MU tile .* not 'MU'$"),
    ("alloc", ((1, 0), 0), r"^weight must be an integer from 1 to 255, not 0$"),
    ("alloc", ((1, 0), 256), r"^weight must be an integer from 1 to 255, not 256$"),
    ("release", (REF_AT_CU,), r"^ref 0x10 names MU 0, tile \(0, 0\), which is not an MU of "
                              r"the 2x2 fabric$"),
    ("read_vectors", (1 << 12,), r"^ref must be an integer from 0 to 4095, not 4096$"),
    ("read_vectors", (-1,), r"^ref must be an integer from 0 to 4095, not -1$"),
    ("free", (P.mu_id(3, 3),), r"^ref 0xf names MU 15, tile \(3, 3\), which is not an MU"),
    ("cfg_read", (2, 0, 0), r"^tile must be the \(x, y\) of a tile of the 2x2 fabric"),
    ("cfg_read", (0, 0, 0x10000), r"^addr must be an integer from 0 to 65535, not 65536$"),
]


@pytest.mark.parametrize("method, args, message", REFUSALS,
                         ids=[f"{m}{i}" for i, (m, _, _) in enumerate(REFUSALS)])
def test_driver_refuses_what_names_nothing(method, args, message):
    """Nothing is sent; the error names the argument, what it must be and what it was, and
    is a UserError (the command line prints it and exits 2) and a ValueError."""
    host = HostDriver(P, _Refuse())
    with pytest.raises(HostArgumentError, match=message) as e:
        asyncio.run(getattr(host, method)(*args))
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)


def test_driver_refuses_bad_shapes_and_bounds():
    host = HostDriver(fabric_params(2, 2, coord_bits=2, lanes=2), _Refuse())
    with pytest.raises(HostArgumentError, match=r"^array must hold whole vectors of 2 lanes, "
                                                r"not 3 elements \(shape \(3,\)\)$"):
        asyncio.run(host.append_vectors(P.mu_id(*MU), np.zeros(3)))
    with pytest.raises(HostArgumentError, match=r"^max_cycles must be an integer from 0"):
        asyncio.run(host.wait_done(max_cycles=-5))
    with pytest.raises(HostArgumentError, match=r"^clusters must be an integer from 1 to 1, "
                                                r"not 2$"):
        HostDriver(P, _Refuse(), clusters=2)


# --- every wait is bounded; every way out of a job frees what the job allocated ---------------

def _job_with(program, description):
    """vector_add's buffers (and CU (0, 0)'s references to them), with ``program`` on CU (1, 1)
    too, its r4 the ID of the first MU."""
    job = vector_add(P, n=8, mu=MU)
    tiles = dict(job.config.tiles)
    tiles[(1, 1)] = TileConfig(program=assemble(program), regs={4: P.mu_id(*MU)})
    return Job(FabricConfig(P, tiles), job.buffers, job.outputs, job.expected,
               description=description)


#: CU (1, 1) allocates a buffer and fills a block of it, then waits for a token nobody sends.
HANG = """
    ALLOC r5, r4, 1
    LI r6, 3
    VWRITE r5, r6
    WAIT 0, 1
    HALT
"""
#: CU (1, 1) allocates a buffer, fills a block of it, then reads past its length (MU_ERROR).
FAIL = """
    ALLOC r5, r4, 1
    LI r6, 3
    VWRITE r5, r6
    LI r6, 40
    READ 0, r7, r5, r6
    HALT
"""


def test_failed_jobs_free_everything_and_the_next_job_runs(fabric):
    """On the small MU: a job whose bitstream the fabric rejects (made for other parameters:
    the parameter hash differs), a job whose CU halts with MU_ERROR after allocating a buffer
    of its own, and a job that never finishes (a CU waits for a token forever; the bound is
    300 cycles and the timeout names that CU and its pc) each leave the MUs' free blocks and
    live buffers as they were; then a correct job runs and passes, and leaves them too."""
    other = fabric_params(2, 2, coord_bits=2, lanes=1, mu_words=128, block_words=16,
                          max_buffers=4, prog_len=16, local_words=16, noc_depth=3)
    rejected = vector_add(other, n=8, mu=MU)
    failing = _job_with(FAIL, "a CU reading past a buffer")
    hanging = _job_with(HANG, "a CU waiting forever")
    good = vector_add(P, n=8, mu=MU)

    async def body(host):
        start = await free_blocks(host)
        out = {}
        for name, job in (("rejected", rejected), ("failing", failing), ("hanging", hanging)):
            try:
                await run_job(host, job, max_cycles=300, counters=False)
            except Exception as e:
                out[name] = e
            out[name + "_blocks"] = await free_blocks(host)
        out["good"] = await run_job(host, good, counters=False)
        out["end"] = await free_blocks(host)
        out["live"] = await read_mu_counters(host, ["live_buffers"])
        return start, out

    start, out = fabric.run(body)
    assert isinstance(out["rejected"], JobError)
    assert str(out["rejected"]) == f"bitstream rejected by the fabric: {LoadStatus.BAD_PARAMS.name}"
    assert isinstance(out["failing"], JobError)
    assert "(1, 1): ('MU_ERROR'" in str(out["failing"])
    assert isinstance(out["hanging"], HostTimeout)
    assert str(out["hanging"]) == ("the fabric was not done 300 cycles after START (the bound "
                                   "was 300): CUs still running (x, y): pc (1, 1): 3")
    for name in ("rejected", "failing", "hanging"):
        assert out[name + "_blocks"] == start, name
    out["good"].check(good)
    assert out["end"] == start
    assert all(c["live_buffers"] == 0 for c in out["live"].values())


def test_a_reply_that_never_comes_names_the_command(fabric):
    """The transport's bound: a command the port does not take (its reply queue is full of
    the replies of commands sent with ``reply=False``, which nobody takes) ends in a
    HostTimeout naming the command and the cycles, not a hang."""
    async def body(host):
        for _ in range(HOST_IN_FLIGHT):                               # their replies stay
            await host._command({"kind": HostCmd.STATUS}, reply=False)
        host.transport.reply_cycles = 100
        try:
            await host.cfg_read(1, 0, MU_MAP.FREE_BLOCKS)
        except HostTimeout as e:
            error = e
        host.transport.reply_cycles = REPLY_CYCLES
        for _ in range(HOST_IN_FLIGHT):                               # take them
            await host.transport.recv()
        return error, await host.status()

    error, st = fabric.run(body)
    assert str(error) == (f"CFG_READ of tile (1, 0) address {MU_MAP.FREE_BLOCKS:#x}: the "
                          f"fabric did not take the command in 100 cycles")
    assert st["configured"] is not None
