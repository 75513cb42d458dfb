# amaranth: UnusedElaboratable=no
"""The host port's pipelined MU requests (``docs/fabric.md``, "Host port"): a vector transfer
moves a word a cycle once the first round trip is paid, without a burst-capable transport it
keeps ``HOST_IN_FLIGHT`` requests outstanding, and replies come in command order (per MU for MU
requests; any other command after every request before it), checked by a scoreboard on random
command sequences. One 2x2 fabric in Amaranth's simulator shared by the module."""

import numpy as np
import pytest
from conftest import SharedFabric, hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.hdl.spec.packets import HOST_IN_FLIGHT, HostCmd, MUOp, MUStatus, pack, unpack
from rdakit.hdl.spec.params import fabric_params

P = fabric_params(2, 2, coord_bits=2, lanes=2, mu_words=512, block_words=16, max_buffers=4,
                  prog_len=16, local_words=16)
MUS = P.tiles("M")                                     # (1, 0), (0, 1)
ROWS = 64


@pytest.fixture(scope="module")
def fabric():
    return SharedFabric(P, reply_cycles=2_000)


class Serial:
    """The same transport without ``burst``: the driver falls back to ``send`` and ``recv``."""

    def __init__(self, transport):
        self.send, self.recv, self.tick = transport.send, transport.recv, transport.tick


def test_vector_transfers_move_a_word_a_cycle(fabric):
    """APPEND and READ of 64 vectors take under 64 + 40 cycles each (a word a cycle after the
    first round trip; one request at a time took a round trip, about 10 cycles, a word), the
    data come back as written, and the transport without burst (send, recv, a window of
    HOST_IN_FLIGHT) moves the same data at under three cycles a word."""
    data = np.random.default_rng(1).integers(-2**31, 2**31, (ROWS, P.cu.lanes), dtype=np.int64)

    async def body(host):
        cycles = {}
        ref = await host.alloc(MUS[1])
        t = fabric.cycles
        await host.append_vectors(ref, data)
        cycles["append"] = fabric.cycles - t
        t = fabric.cycles
        back = await host.read_vectors(ref, ROWS)
        cycles["read"] = fabric.cycles - t
        burst = host.transport
        host.transport = Serial(burst)
        try:
            t = fabric.cycles
            again = await host.read_vectors(ref, ROWS)
            cycles["serial read"] = fabric.cycles - t
        finally:
            host.transport = burst
        await host.free(ref)
        return cycles, back, again

    cycles, back, again = fabric.run(body)
    assert np.array_equal(back, data.astype(np.int32)) and np.array_equal(again, back)
    assert cycles["append"] < ROWS + 40 and cycles["read"] < ROWS + 40, cycles
    assert cycles["serial read"] < 3 * ROWS + 40, cycles


def test_replies_come_in_command_order(fabric):
    """Requests sent without waiting, then STATUS, a request naming no MU and CFG_READ: the
    replies are the requests' (tags in order), then STATUS's, BAD_DESTINATION, CFG_READ's; a
    command waits for the requests in flight, never overtakes them."""
    n = HOST_IN_FLIGHT - 3

    async def body(host):
        ref = host.ref_dict(await host.alloc(MUS[0]))
        cmds = [{"kind": HostCmd.MU_REQUEST, "req": {"op": MUOp.LEN, "ref": ref, "tag": i}}
                for i in range(n)]
        cmds += [{"kind": HostCmd.STATUS},
                 {"kind": HostCmd.MU_REQUEST,
                  "req": {"op": MUOp.LEN, "ref": {"mu": P.mu_id(0, 0)}, "tag": 5}},
                 {"kind": HostCmd.CFG_READ, "x": 1, "y": 0, "addr": 0}]
        for c in cmds:
            await host._command(c, reply=False)
        replies = [unpack(host.reply_layout, await host.transport.recv()) for _ in cmds]
        await host.free(host.ref_int(ref))
        return replies

    replies = fabric.run(body)
    assert [r["kind"] for r in replies] == [HostCmd.MU_REQUEST] * n + [
        HostCmd.STATUS, HostCmd.MU_REQUEST, HostCmd.CFG_READ]
    assert [r["resp"]["tag"] for r in replies[:n]] == list(range(n))
    assert all(r["resp"]["status"] is MUStatus.OK for r in replies[:n])
    assert replies[n + 1]["resp"]["status"] is MUStatus.BAD_DESTINATION


COMMANDS = st.one_of(
    st.tuples(st.just("mu"), st.sampled_from(range(len(MUS)))),
    st.tuples(st.just("status"), st.none()),
    st.tuples(st.just("bad"), st.none()),
    st.tuples(st.just("cfg"), st.none()))


@hostile(10)
@given(cmds=st.lists(COMMANDS, min_size=1, max_size=40),
       window=st.integers(1, HOST_IN_FLIGHT))
def test_random_commands_scoreboard(fabric, cmds, window):
    """Random commands kept up to ``window`` outstanding: every command gets exactly one reply
    of its kind; MU requests to one MU are answered in order (tags), and every other command's
    reply comes after the replies of every command before it and before those after it."""
    async def body(host):
        refs = [host.ref_dict(await host.alloc(xy)) for xy in MUS]
        words, expect = [], []
        for i, (kind, arg) in enumerate(cmds):
            tag = i % 8
            if kind == "mu":
                c = {"kind": HostCmd.MU_REQUEST,
                     "req": {"op": MUOp.LEN, "ref": refs[arg], "tag": tag}}
            elif kind == "bad":
                c = {"kind": HostCmd.MU_REQUEST,
                     "req": {"op": MUOp.READ, "ref": {"mu": P.mu_id(1, 1)}, "tag": tag}}
            elif kind == "status":
                c = {"kind": HostCmd.STATUS}
            else:
                c = {"kind": HostCmd.CFG_READ, "x": 0, "y": 1, "addr": 0}
            words.append(pack(host.cmd_layout, c))
            expect.append((kind, arg, tag))
        replies = []
        for i, w in enumerate(words):
            if i >= window:
                replies.append(unpack(host.reply_layout, await host.transport.recv()))
            await host.transport.send(w)
        while len(replies) < len(words):
            replies.append(unpack(host.reply_layout, await host.transport.recv()))
        for ref in refs:
            await host.free(host.ref_int(ref))
        return expect, replies

    expect, replies = fabric.run(body)
    assert len(replies) == len(expect)
    # Match each reply to its command: the next unanswered MU request to that MU (by tag and
    # MU), or, for any other command, the earliest unanswered command, which must be it.
    pending = list(range(len(expect)))
    mu_of = {P.mu_id(*xy): k for k, xy in enumerate(MUS)}
    for r in replies:
        if r["kind"] is HostCmd.MU_REQUEST and r["resp"]["status"] is MUStatus.OK:
            k = mu_of[r["resp"]["ref"]["mu"]]
            i = next(i for i in pending if expect[i][:2] == ("mu", k))
            assert r["resp"]["tag"] == expect[i][2]
            # Nothing other than MU requests (to any MU) may be pending before it.
            assert all(expect[j][0] == "mu" for j in pending if j < i), (expect, replies)
        else:
            i = pending[0]
            want = {"status": HostCmd.STATUS, "cfg": HostCmd.CFG_READ,
                    "bad": HostCmd.MU_REQUEST}[expect[i][0]]
            assert r["kind"] is want, (i, expect, replies)
            if want is HostCmd.MU_REQUEST:
                assert r["resp"]["status"] is MUStatus.BAD_DESTINATION
        pending.remove(i)
    assert not pending
