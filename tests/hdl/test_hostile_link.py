# amaranth: UnusedElaboratable=no
"""The host link applies a frame exactly once or answers it with an error, whatever bytes arrive
(issue 19, class 6).

The bridge's :class:`~rdakit.hdl.host.bridge.FrameLink` runs in Amaranth's simulator at a byte a
cycle, without the serial line (the UART is tested in ``test_uart.py``, the whole bridge in
``test_host_bridge.py``), against a fake fabric: a Python testbench that takes commands after a
random delay and answers each (but ``LOAD_BEGIN``/``LOAD_WORD``) with a reply computed from it.
A script is a list of items: a byte (``int``), a byte with a UART error (:data:`BAD`, a framing
error or an overrun), a short gap (``("gap", n)``, fewer cycles than the link's timeout) or a
quiet line (:data:`QUIET`, longer than its timeout).
"""

import asyncio
import random

import pytest
from amaranth.sim import Simulator
from conftest import hostile
from hypothesis import assume, given
from hypothesis import strategies as st

from rdakit.hdl.host.bridge import FrameLink
from rdakit.hdl.spec.frames import (
    HEADER_BYTES,
    NO_REPLY,
    SOF,
    Applied,
    FrameError,
    FrameKind,
    LinkModel,
    encode_frame,
    frame_crc,
    int_payload,
)
from rdakit.hdl.spec.packets import HostCmd, host_cmd_layout, host_reply_layout, pack
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.host_link import FramedTransport, LinkError

P = fabric_params(1, 2, lanes=1, prog_len=16, local_words=16, mu_words=256, max_buffers=4)
CMD_LAYOUT = host_cmd_layout(P.mu)
CMD_BITS = CMD_LAYOUT.size
CMD_BYTES = (CMD_BITS + 7) // 8
REPLY_BITS = host_reply_layout(P.mu).size
TIMEOUT = 12                  # the link's, in cycles
QUIET = ("quiet",)
BAD = ("bad",)


def fake_reply(value):
    """The fake fabric's reply to command ``value``: any function of it, sometimes zero (an
    empty REPLY payload)."""
    if value % 7 == 0:
        return 0
    return (value * 0x9E3779B97F4A7C15 ^ value >> 13) % (1 << REPLY_BITS)


def has_reply(value):
    return HostCmd(value & 7) not in NO_REPLY


def cmd_value(**fields):
    return pack(CMD_LAYOUT, fields)


def cmd(seq, value):
    return encode_frame(FrameKind.CMD, seq, int_payload(value, CMD_BYTES))


def answer(kind, seq, payload=b""):
    return encode_frame(kind, seq, payload)


def error(seq, code):
    return answer(FrameKind.ERROR, seq, bytes([code.value]))


def reply(seq, value):
    return answer(FrameKind.REPLY, seq, int_payload(fake_reply(value), 255))


OPEN = encode_frame(FrameKind.OPEN, 200)
OPEN_ACK = answer(FrameKind.ACK, 200)
RESET = encode_frame(FrameKind.OPEN, 100)
RESET_ACK = answer(FrameKind.ACK, 100)


async def wait(ctx, cycles):
    if cycles:
        await ctx.tick().repeat(cycles)


async def put(ctx, stream):
    """Hold ``stream.valid`` until the payload is taken (no ``.until()``: its generator,
    abandoned when a simulation stops on an error, is reported as never closed)."""
    ctx.set(stream.valid, 1)
    while True:
        taken = ctx.get(stream.ready)
        await ctx.tick()
        if taken:
            break
    ctx.set(stream.valid, 0)


class LinkSim:
    """One simulation of a FrameLink and its fake fabric that runs script after script (building
    a simulator takes longer than running a script): :meth:`run` hands the driver a script and
    advances the simulation until its answers are out. Every script starts on a clean link: a
    quiet line ends whatever came before and an OPEN (its ACK not returned) forgets the last
    command applied."""

    def __init__(self, timeout=TIMEOUT):
        self.timeout = timeout
        self.dut = FrameLink(P, timeout=timeout)
        self.script = None
        self.rng = random.Random(0)
        self.sim = Simulator(self.dut)
        self.sim.add_clock(1e-9)
        for tb in (self._drive, self._fabric, self._sink):
            self.sim.add_testbench(tb, background=True)

    def run(self, script, *, seed=0):
        """Feed ``script``; return the commands the fabric took and the bytes the link sent."""
        self.rng = random.Random(seed)
        self.commands, self.sent = [], bytearray()
        self.script = [QUIET, *RESET]
        while self.script is not None:
            self.sim.advance()
        assert self.sent == RESET_ACK and not self.commands
        self.sent.clear()
        self.script = list(script)
        while self.script is not None:
            self.sim.advance()
        return self.commands, bytes(self.sent)

    async def _drive(self, ctx):
        rx = self.dut.rx
        while True:
            await ctx.tick()
            if self.script is None:
                continue
            for item in self.script:
                if item == QUIET:
                    while not ctx.get(rx.ready):
                        await ctx.tick()
                    await ctx.tick().repeat(self.timeout + 2)
                elif isinstance(item, tuple) and item[0] == "gap":
                    await wait(ctx, item[1])
                else:
                    bad = item == BAD
                    ctx.set(rx.payload, {"data": 0x5A if bad else item,
                                         "framing_error": bad and self.rng.random() < 0.5,
                                         "overrun": bad})
                    await put(ctx, rx)
            # Until every answer is out: the core idle and the transmitter quiet for a while.
            idle = 0
            while idle < 4 * self.timeout + 40:
                await ctx.tick()
                busy = ctx.get(self.dut.tx.valid) or ctx.get(self.dut.cmd.valid)
                idle = 0 if busy else idle + 1
            self.script = None

    async def _fabric(self, ctx):
        cmd_, rep = self.dut.cmd, self.dut.reply
        while True:
            await ctx.tick()
            if not ctx.get(cmd_.valid):
                continue
            await wait(ctx, self.rng.randrange(3))
            ctx.set(cmd_.ready, 1)
            value = ctx.get(cmd_.payload.as_value())
            await ctx.tick()
            ctx.set(cmd_.ready, 0)
            self.commands.append(value)
            if has_reply(value):
                await wait(ctx, self.rng.randrange(4))
                ctx.set(rep.payload.as_value(), fake_reply(value))
                await put(ctx, rep)

    async def _sink(self, ctx):
        tx = self.dut.tx
        while True:
            ready = self.rng.random() < 0.8
            ctx.set(tx.ready, ready)
            _, _, valid, byte = await ctx.tick().sample(tx.valid, tx.payload)
            if ready and valid:
                self.sent.append(byte)


@pytest.fixture(scope="module")
def link():
    return LinkSim()


STATUS = cmd_value(kind=HostCmd.STATUS)
CYCLES = cmd_value(kind=HostCmd.CYCLES, addr=0x1234)


# --- The holes found, each as the byte sequence that showed it ----------------------------------

def test_a_new_frame_with_the_last_seq_is_applied_not_taken_for_a_resend(link):
    """A resend is the same frame again; a frame with the last SEQ but another command is a new
    frame, applied and answered with its own reply (it was answered with the old reply and
    dropped: acknowledged, not applied)."""
    script = [*OPEN, *cmd(5, STATUS), *cmd(5, STATUS), *cmd(5, CYCLES), *cmd(5, CYCLES)]
    commands, sent = link.run(script)
    assert commands == [STATUS, CYCLES]
    assert sent == OPEN_ACK + reply(5, STATUS) * 2 + reply(5, CYCLES) * 2


def shifted_crc_frame(seq):
    """A LOAD_WORD frame whose LEN, with one bit flipped, points the receiver at two payload
    bytes that hold the CRC of the shorter frame: the word is chosen to put them there."""
    word_at = CMD_LAYOUT["word"].offset
    full, short = 7, 5                  # LEN 7 -> 5 (bit 1 flipped)
    # Payload bytes 5 and 6 (the shorter frame's CRC) lie in the word, bits 0..18 before them.
    assert word_at + 32 > 8 * (full - 1) and 8 * short - word_at == 19
    head = bytearray(encode_frame(FrameKind.CMD, seq, bytes(full))[:HEADER_BYTES])
    head[3] ^= full ^ short
    for low in range(1, 1 << 12):
        prefix = int_payload(cmd_value(kind=HostCmd.LOAD_WORD, word=low), CMD_BYTES)
        crc = frame_crc(bytes(head[1:]) + prefix.ljust(short, b"\0")[:short])
        word = low | int.from_bytes(crc.to_bytes(2, "big"), "little") << 19
        value = cmd_value(kind=HostCmd.LOAD_WORD, word=word % (1 << 32))
        frame = bytearray(cmd(seq, value))
        if word >> 32 or frame[3] != full:
            continue
        frame[3] = short
        end = HEADER_BYTES + short
        assert frame_crc(bytes(frame[1:end])) == int.from_bytes(frame[end:end + 2], "big")
        return value, bytes(frame)
    raise AssertionError("no word puts the CRC there")


def test_a_corrupted_len_never_applies_a_shorter_command(link):
    """A LEN with one bit flipped, in front of a payload whose bytes happen to hold the CRC of
    the shorter frame: the link applied the LOAD_WORD with the top of its word cut off and
    acknowledged it. The header check (a CRC-8 of SEQ, KIND and LEN) refuses the frame before
    its payload, so no one-bit error of LEN can be read as another frame."""
    value, frame = shifted_crc_frame(9)
    commands, sent = link.run([*OPEN, *frame, QUIET])
    assert commands == []
    assert sent.startswith(OPEN_ACK + error(9, FrameError.BAD_HEADER))


def test_payload_bits_beyond_the_command_are_refused(link):
    """A 16-byte payload with a bit above the command's 125: BAD_LENGTH, not a command with the
    bit dropped."""
    assert CMD_BITS % 8
    payload = bytearray(int_payload(STATUS, CMD_BYTES).ljust(CMD_BYTES, b"\0"))
    payload[-1] |= 0x80
    commands, sent = link.run([*OPEN, *encode_frame(FrameKind.CMD, 3, bytes(payload))])
    assert commands == []
    assert sent == OPEN_ACK + error(3, FrameError.BAD_LENGTH)


def test_garbage_after_a_truncated_frame_is_a_new_run(link):
    """The line went quiet inside a frame (TRUNCATED): the garbage after it is a new run,
    answered with SYNC, as after any quiet line (it was silently dropped: the receiver's quiet
    counter ran past the timeout and the run flag of the truncated frame stayed)."""
    commands, sent = link.run([SOF, 0x44, QUIET, 0x00, 0x13])
    assert commands == []
    assert sent == error(0x44, FrameError.TRUNCATED) + error(0, FrameError.SYNC)


# --- The RTL against the model on random byte streams -----------------------------------------

#: A few commands, so that frames repeat: with a reply, without one (LOAD_WORD), with a reply
#: of zero (an empty REPLY payload), and the longest payload.
COMMANDS = [STATUS, CYCLES, cmd_value(kind=HostCmd.LOAD_WORD, word=0xDEADBEEF),
            cmd_value(kind=HostCmd.CFG_READ, x=1, addr=7 * 0x31), (1 << CMD_BITS) - 1]


def frame_bytes(kind, seq, value):
    if kind is FrameKind.OPEN:
        return encode_frame(kind, seq)
    return cmd(seq, value)


@st.composite
def damaged(draw, frame):
    """``frame`` as the line may deliver it: whole, or with bits flipped, a byte dropped,
    inserted, duplicated or replaced by a UART error, or cut short by a quiet line."""
    items = list(frame)
    how = draw(st.sampled_from(["whole", "whole", "flip", "drop", "insert", "dup", "bad",
                                "cut"]))
    at = draw(st.integers(0, len(items) - 1))
    if how == "flip":
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, len(items) - 1))
            items[at] ^= 1 << draw(st.integers(0, 7))
    elif how == "drop":
        del items[at]
    elif how == "insert":
        items.insert(at, draw(st.integers(0, 255)))
    elif how == "dup":
        items.insert(at, items[at])
    elif how == "bad":
        items[at] = BAD
    elif how == "cut":
        items[at:] = [QUIET]
    return items


@st.composite
def streams(draw):
    """A session: an OPEN, then frames (new, resent, damaged), garbage, gaps and quiet lines."""
    script = [*OPEN]
    last = None
    for _ in range(draw(st.integers(1, 12))):
        what = draw(st.sampled_from(["frame", "frame", "frame", "resend", "garbage", "gap",
                                     "quiet"]))
        if what == "frame" or (what == "resend" and last is None):
            kind = draw(st.sampled_from([FrameKind.CMD] * 5 + [FrameKind.OPEN]))
            last = frame_bytes(kind, draw(st.integers(0, 3)), draw(st.sampled_from(COMMANDS)))
            script += draw(damaged(last))
        elif what == "resend":
            script += draw(damaged(last))
        elif what == "garbage":
            script += draw(st.lists(st.integers(0, 255) | st.just(BAD), max_size=4))
        elif what == "gap":
            script.append(("gap", draw(st.integers(1, TIMEOUT // 2))))
        else:
            script.append(QUIET)
    return script + [QUIET]


def model_run(script):
    """What the reference (frames.LinkModel) applies and answers for ``script``."""
    model = LinkModel(P.mu, fake_reply)
    events = []
    for item in script:
        if item == QUIET:
            events += model.timeout()
        elif item == BAD:
            events += model.line_error()
        elif isinstance(item, int):
            events += model.feed([item])
    commands = [e.value for e in events if isinstance(e, Applied)]
    sent = b"".join(encode_frame(e.kind, e.seq, e.payload) for e in events
                    if not isinstance(e, Applied))
    return commands, sent


@hostile(40)
@given(script=streams(), seed=st.integers(0, 1 << 16))
def test_link_applies_what_the_model_applies_and_answers_alike(link, script, seed):
    """The scoreboard: the commands the fabric receives are those of the frames the model
    accepts, each once, in order, and every byte the link sends is the model's answer."""
    assert link.run(script, seed=seed) == model_run(script)


@hostile(200)
@given(kind=st.sampled_from([FrameKind.CMD, FrameKind.OPEN]), seq=st.integers(0, 255),
       value=st.integers(0, (1 << CMD_BITS) - 1),
       flips=st.lists(st.integers(8, 8 * 64), min_size=1, max_size=3, unique=True))
def test_a_frame_with_up_to_three_flipped_bits_is_never_applied(kind, seq, value, flips):
    """The format's promise (pure Python, on the model): one to three bits flipped anywhere
    after SOF (LEN and HCRC included) and the frame is refused, whatever the bytes after it."""
    frame = bytearray(frame_bytes(kind, seq, value))
    flips = [f for f in flips if f < 8 * len(frame)]
    assume(flips)
    for f in flips:
        frame[f // 8] ^= 1 << f % 8
    model = LinkModel(P.mu, fake_reply)
    model.feed(OPEN)
    events = model.feed(frame) + model.timeout()
    assert not [e for e in events if isinstance(e, Applied) or e.kind is FrameKind.ACK]
    assert events[0].kind is FrameKind.ERROR


# --- The host's side: every wait bounded, named when it gives up ------------------------------

class FakePort:
    """A byte port with a scripted board behind it: ``answer(frame)`` gives the bytes the board
    sends back for each frame written (then the line is quiet). ``babble`` sends garbage
    forever instead. Reads are counted so that a transport that never stops reading fails the
    test instead of hanging it."""

    timeout = 7
    timeout_unit = "cycles"

    def __init__(self, answer=lambda frame: b"", *, babble=False):
        self.answer = answer
        self.babble = babble
        self.pending = bytearray()
        self.reads = 0

    async def write(self, data):
        self.pending += self.answer(bytes(data))

    async def read_byte(self):
        self.reads += 1
        assert self.reads < 100_000, "the transport never stopped reading"
        if self.babble:
            return 0x00
        return self.pending.pop(0) if self.pending else None

    async def tick(self, n=1):
        pass


def transport(port):
    return FramedTransport(P, port)


def test_a_babbling_line_is_a_link_error_naming_the_frame():
    """Bytes that never make the answer (noise, another device): the transport gave up only
    when the line went quiet, so it read forever."""
    link = transport(FakePort(babble=True))
    with pytest.raises(LinkError, match=r"^no answer to a OPEN frame \(SEQ 0\) after 5 tries, "
                                        r"each waiting until a quiet line of 7 cycles or "
                                        rf"{link.max_answer_bytes} bytes without it; errors "
                                        r"answered: none$"):
        asyncio.run(link.send(STATUS))


def test_an_error_answer_with_an_unknown_code_is_dropped_not_a_crash():
    """An ERROR frame whose code is no FrameError (a corrupted answer that passed its CRC, a
    newer board): it raised ValueError out of the transport."""
    link = transport(FakePort(lambda f: answer(FrameKind.ERROR, f[1], b"\x42")))
    with pytest.raises(LinkError, match=r"^no answer to a OPEN frame \(SEQ 0\) after 5 tries, "
                                        r".* errors answered: none$"):
        asyncio.run(link.send(STATUS))
    assert link.bad_answers == 5


def test_error_answers_are_named_and_a_resend_succeeds():
    """A board that refuses the first two tries (BAD_CRC, TRUNCATED) and then answers."""
    tries = []

    def board(frame):
        tries.append(frame)
        if frame[2] == FrameKind.OPEN.value:
            return answer(FrameKind.ACK, frame[1])
        if len(tries) <= 3:
            return error(frame[1], [FrameError.BAD_CRC, FrameError.TRUNCATED][len(tries) - 2])
        return reply(frame[1], STATUS)

    link = transport(FakePort(board))
    asyncio.run(link.send(STATUS))
    assert asyncio.run(link.recv()) == fake_reply(STATUS)
    assert link.errors == [(FrameError.BAD_CRC, 1), (FrameError.TRUNCATED, 1)]
    assert link.resends == 2 and tries[1] == tries[2] == tries[3]


def test_no_answer_names_the_errors_answered():
    link = transport(FakePort(lambda f: error(f[1], FrameError.BAD_CRC)))
    with pytest.raises(LinkError, match=r"^no answer to a OPEN frame \(SEQ 0\) after 5 tries, "
                                        r".*; errors answered: BAD_CRC, BAD_CRC, BAD_CRC, "
                                        r"BAD_CRC, BAD_CRC$"):
        asyncio.run(link.send(STATUS))


def test_retries_must_be_a_count():
    with pytest.raises(ValueError, match=r"^Retries must be a non-negative integer, not -1$"):
        FramedTransport(P, FakePort(), retries=-1)
