# amaranth: UnusedElaboratable=no
"""The host bridge end to end in Amaranth's simulator: the Python host driver, over the frame
transport and a bit-level serial line, runs a kernel on a fabric behind the bridge's UART; and
corrupted frames (bad CRC, truncated, bad length, bad kind, garbage, a UART framing error) are
answered with ERROR frames and change nothing in the fabric."""

import numpy as np
import pytest

from rdakit.hdl.host.bridge import BridgedFabric, FrameLink, HostBridge
from rdakit.hdl.spec.frames import (
    HEADER_BYTES,
    SOF,
    BadFrame,
    Frame,
    FrameError,
    FrameKind,
    FrameParser,
    cmd_bytes,
    encode_frame,
    frame_crc,
    int_payload,
    reply_bytes,
)
from rdakit.hdl.spec.packets import (
    HostCmd,
    MUOp,
    MUStatus,
    host_cmd_layout,
    host_reply_layout,
    pack,
)
from rdakit.hdl.spec.params import fabric_params
from rdakit.hdl.spec.vector import pack_vector
from rdakit.sim.runtime.host import HostDriver
from rdakit.sim.runtime.host_link import FramedTransport, SimUARTPort, uart_bits
from rdakit.sim.runtime.job import run_job
from rdakit.sim.verify.amaranth_sim import simulate
from rdakit.sim.verify.kernels import vector_add

P = fabric_params(1, 2, lanes=1, prog_len=16, local_words=16, mu_words=256, max_buffers=4)
DIV = 4
TIMEOUT = 40 * DIV          # the bridge's: a quiet line inside a frame
HOST_TIMEOUT = 3 * TIMEOUT  # the host's: no answer
MU = (1, 0)


class LossyPort:
    """A port that damages chosen transmissions: ``flip[i]`` is a byte offset whose bit 0 is
    flipped in the i-th frame written; ``drop_answer`` numbers frames whose answer is lost."""

    def __init__(self, port, *, flip=None, drop_answer=()):
        self.port = port
        self.flip = dict(flip or {})
        self.drop_answer = set(drop_answer)
        self.n = -1

    async def write(self, data):
        self.n += 1
        data = bytearray(data)
        if self.n in self.flip:
            data[self.flip[self.n]] ^= 1
        await self.port.write(data)
        if self.n in self.drop_answer:
            while await self.port.read_byte() is not None:
                pass

    async def read_byte(self):
        return await self.port.read_byte()

    async def tick(self, n=1):
        await self.port.tick(n)


def answers(port_events):
    return [(e.kind, e.seq, e.payload) if isinstance(e, Frame) else (e.error, e.seq)
            for e in port_events]


async def raw(port, data, *, bits=None):
    """Send raw bytes (or raw line levels), then collect the answer frames until the line is
    quiet for the host's timeout."""
    if bits is not None:
        await port.write_bits(bits)
    if data:
        await port.write(data)
    parser = FrameParser({FrameKind.REPLY: host_reply_layout(P.mu).size, FrameKind.ACK: 0,
                          FrameKind.ERROR: 8})
    events = []
    while (b := await port.read_byte()) is not None:
        events.extend(parser.feed([b]))
    return answers(events)


def cmd_frame(seq, fields):
    return encode_frame(FrameKind.CMD, seq, int_payload(pack(host_cmd_layout(P.mu), fields),
                                                        cmd_bytes(P.mu)))


def mu_req(ref, op, index=0, data=0):
    return {"kind": HostCmd.MU_REQUEST,
            "req": {"op": op, "ref": ref, "index": index, "data": data}}


@pytest.fixture(scope="module")
def session():
    """One simulation: a kernel through the driver, then every corruption case in turn."""
    top = BridgedFabric(P, divisor=DIV, timeout=TIMEOUT)
    port = SimUARTPort(None, top.rx, top.tx, divisor=DIV, timeout=HOST_TIMEOUT)
    out = {}

    async def tb(ctx):
        port.ctx = ctx
        ctx.set(top.rx, 1)
        await ctx.tick().repeat(10)
        link = FramedTransport(P, port)
        host = HostDriver(P, link)
        job = vector_add(P, n=8)
        out["job"] = (job, await run_job(host, job, counters=False))
        out["clean_link"] = (list(link.errors), link.resends, link.bad_answers)

        # A buffer holding one known word; every corrupted frame below tries to change it.
        ref = await host.alloc(MU)
        await host.append_vectors(ref, np.array([[1234]], np.int32))
        rd = host.ref_dict(ref)
        write = mu_req(rd, MUOp.WRITE, index=0, data=pack_vector([-7]))
        append = mu_req(rd, MUOp.APPEND, data=pack_vector([99]))
        seq = link.seq                  # a SEQ the bridge has not applied
        cases = {}

        good = cmd_frame(seq, write)
        bad_crc = bytearray(good)
        bad_crc[-4] ^= 0x10             # a payload bit
        cases["bad_crc"] = await raw(port, bad_crc)
        cases["truncated"] = await raw(port, good[:len(good) // 2])
        body = bytes([seq, FrameKind.CMD.value, cmd_bytes(P.mu) + 1]) + bytes(
            cmd_bytes(P.mu) + 1)
        cases["bad_length"] = await raw(port, bytes([SOF]) + body
                                        + frame_crc(body).to_bytes(2, "big"))
        body = bytes([seq, 0x55, 0])
        cases["bad_kind"] = await raw(port, bytes([SOF]) + body
                                      + frame_crc(body).to_bytes(2, "big"))
        body = bytes([seq, FrameKind.REPLY.value, 0])      # a board-to-host kind
        cases["reply_kind"] = await raw(port, bytes([SOF]) + body
                                        + frame_crc(body).to_bytes(2, "big"))
        cases["garbage"] = await raw(port, bytes([0x00, 0x13, 0x37, 0xff, 0x5a]))
        # A byte of the frame with a low stop bit.
        bits = [b for x in good[:5] for b in uart_bits(x)]
        bits += uart_bits(good[5])[:-1] + [0, 0, 1]
        cases["uart"] = await raw(port, good[6:], bits=bits)
        out["cases"] = cases
        out["seq"] = seq
        out["word_after_errors"] = (await host.read_vectors(ref)).tolist()

        # The same good frame twice (a resend): applied once, answered twice alike.
        app = cmd_frame(seq, append)
        first = await raw(port, app)
        second = await raw(port, app)
        out["dup"] = (first, second)
        link.seq = (seq + 1) % 256
        out["after_dup"] = (await host.read_vectors(ref)).tolist()

        # The transport resends by itself: a flipped bit in the first try of a frame, then a
        # lost answer; each command is applied exactly once.
        lossy = LossyPort(port, flip={0: 6}, drop_answer={2})
        link2 = FramedTransport(P, lossy)
        host2 = HostDriver(P, link2)
        link2.opened = True
        link2.seq = link.seq
        await host2.append_vectors(ref, np.array([[5]], np.int32))    # frames 0 (bad), 1
        await host2.append_vectors(ref, np.array([[6]], np.int32))    # frames 2 (lost), 3
        out["retry"] = (list(link2.errors), link2.resends,
                        (await host2.read_vectors(ref)).tolist())
        st = await host2.status()
        out["status"] = st
        out["counters"] = (ctx.get(top.frames_ok), ctx.get(top.frames_bad))

        # An MU request that names no MU (an ALLOC at the CU tile): the host port answers it
        # with BAD_DESTINATION; the link still answers OPEN and STATUS after it.
        cu = P.mu_id(0, 0)
        resp = await host2.mu_request({"op": MUOp.ALLOC, "ref": {"mu": cu, "buf": 0},
                                       "data": 1})
        opened = await raw(port, encode_frame(FrameKind.OPEN, 0x42))
        link2.opened = False            # the next command opens a session first
        out["no_mu"] = (resp["status"], opened, await host2.status(), list(link2.errors))

    simulate(top, tb, background=[port.receiver])
    return out


def test_kernel_through_the_uart_is_bit_exact(session):
    job, result = session["job"]
    result.check(job)
    assert result.status["done"] and not result.status["error"]
    assert session["clean_link"] == ([], 0, 0)      # a clean line needs no resend


@pytest.mark.parametrize("case, error", [
    ("bad_crc", FrameError.BAD_CRC), ("truncated", FrameError.TRUNCATED),
    ("bad_length", FrameError.BAD_LENGTH), ("bad_kind", FrameError.BAD_KIND),
    ("reply_kind", FrameError.BAD_KIND), ("uart", FrameError.UART),
])
def test_corrupted_frame_gets_one_error_answer(session, case, error):
    assert session["cases"][case] == [(FrameKind.ERROR, session["seq"], bytes([error.value]))]


def test_garbage_between_frames_gets_one_sync_answer(session):
    assert session["cases"]["garbage"] == [(FrameKind.ERROR, 0,
                                            bytes([FrameError.SYNC.value]))]


def test_corrupted_frames_change_nothing(session):
    assert session["word_after_errors"] == [[1234]]


def test_resent_frame_is_applied_once_and_answered_alike(session):
    first, second = session["dup"]
    assert first == second
    (kind, seq, payload), = first
    assert kind is FrameKind.REPLY and seq == session["seq"]
    assert session["after_dup"] == [[1234], [99]]


def test_transport_resends_after_error_and_lost_answer(session):
    errors, resends, words = session["retry"]
    assert errors == [(FrameError.BAD_CRC, errors[0][1])]
    assert resends == 2
    assert words == [[1234], [99], [5], [6]]
    assert session["status"]["configured"]


@pytest.mark.long   # the shared simulation (LONG in conftest.py lists its first test)
def test_link_answers_after_a_request_for_no_mu(session):
    status, opened, st, errors = session["no_mu"]
    assert status is MUStatus.BAD_DESTINATION
    assert opened == [(FrameKind.ACK, 0x42, b"")]
    assert st["configured"] and not st["error"]
    assert errors == [(FrameError.BAD_CRC, errors[0][1])]     # only the flipped bit before


def test_bridge_counts_frames(session):
    ok, bad = session["counters"]
    assert bad == 8         # six corrupted frames, the garbage run, the flipped bit
    assert ok > 50


def test_frame_parser_matches_the_format():
    """The Python model: a round trip, each error, and resynchronization."""
    parser = FrameParser({FrameKind.CMD: 32})
    f = encode_frame(FrameKind.CMD, 7, b"\x01\x02")
    assert parser.feed(f) == [Frame(FrameKind.CMD, 7, b"\x01\x02")]
    assert parser.feed(b"\x00\x01" + f) == [BadFrame(FrameError.SYNC),
                                            Frame(FrameKind.CMD, 7, b"\x01\x02")]
    bad = bytearray(f)
    bad[HEADER_BYTES] ^= 1
    assert parser.feed(bad) == [BadFrame(FrameError.BAD_CRC, 7)]
    bad = bytearray(f)
    bad[3] ^= 1                         # LEN: found by the header check
    assert parser.feed(bad) == [BadFrame(FrameError.BAD_HEADER, 7)]
    assert FrameParser({FrameKind.CMD: 12}).feed(
        encode_frame(FrameKind.CMD, 2, b"\x01\x10")) == [BadFrame(FrameError.BAD_LENGTH, 2)]
    assert parser.feed(b"\x00") == [] and parser.line_error() == []   # one run
    assert parser.feed(f[:3]) == [] and parser.line_error() == [BadFrame(FrameError.UART, 7)]
    assert parser.feed(encode_frame(FrameKind.CMD, 1, b"12345")) == [
        BadFrame(FrameError.BAD_LENGTH, 1)]
    assert parser.feed(f[:3]) == [] and parser.timeout() == [BadFrame(FrameError.TRUNCATED, 7)]
    assert parser.feed(encode_frame(FrameKind.ACK, 3)) == [BadFrame(FrameError.BAD_KIND, 3)]


def test_payload_sizes_hold_the_layouts():
    assert cmd_bytes(P.mu) * 8 >= host_cmd_layout(P.mu).size > (cmd_bytes(P.mu) - 1) * 8
    assert reply_bytes(P.mu) * 8 >= host_reply_layout(P.mu).size
    assert int_payload(0x0102, 4) == b"\x02\x01" and int_payload(0, 4) == b""
    with pytest.raises(ValueError, match=r"^Payload value must fit in 2 bytes, not 65536$"):
        int_payload(1 << 16, 2)
    with pytest.raises(ValueError, match=r"^SEQ must be a byte, not 256$"):
        encode_frame(FrameKind.CMD, 256)


def test_init_wrong_params():
    with pytest.raises(TypeError, match=r"^Params must be a FabricParams, not 3$"):
        HostBridge(3, divisor=4)
    with pytest.raises(TypeError, match=r"^Divisor must be an integer from 4"):
        HostBridge(P, divisor=2)
    with pytest.raises(TypeError, match=r"^Timeout must be an integer of at least 20 bit times "
                                        r"\(80 cycles\), not 79$"):
        HostBridge(P, divisor=4, timeout=79)
    with pytest.raises(TypeError, match=r"^Timeout must be a positive integer, not 0$"):
        FrameLink(P, timeout=0)
    with pytest.raises(TypeError, match=r"^Params must be a FabricParams, not None$"):
        FrameLink(None, timeout=10)

