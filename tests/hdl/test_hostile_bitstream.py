"""One definition of a valid bitstream (issue 19, class 7): the Python reader and the hardware
loader judge every bitstream alike.

Real bitstreams (a compiled workload and three kernels on a 2x2 fabric) are mutated: bits
flipped, words set, inserted and deleted, sections duplicated, reordered, dropped, emptied or
moved to another tile, record addresses and counts changed, header fields changed, words added
or cut at the end; the CRCs are then fixed up (mostly) so that the mutation reaches the content
checks. Each bitstream goes through :func:`read_bitstream` and through one simulation of the
:class:`ConfigLoader` that loads them all in turn: the verdicts (the :class:`LoadStatus`) must
be equal, a bitstream both accept must put the same words in every CU as the reader's
configuration says, a refused one must leave every CU disabled, and ``rdakit inspect`` must
list every bitstream the hardware loads.
"""

import collections
import functools
import struct
import zlib

import pytest
from amaranth.sim import Simulator
from conftest import hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.cli import main
from rdakit.compiler.compile import bitstream_for, compile_workload
from rdakit.hdl.fabric.config_loader import ConfigLoader
from rdakit.hdl.spec.bitstream import (
    HEADER,
    BitstreamError,
    LoadStatus,
    file_words,
    listing,
    params_hash,
    read_bitstream,
    writable_ranges,
    write_bitstream,
)
from rdakit.hdl.spec.config import CU_MAP
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.verify.kernels import matvec, moe_fanout, vector_add

P = fabric_params(2, 2, prog_len=64, mu_words=2048)      # CUs (0, 0) and (1, 1)
CUS = P.tiles("C")
HEADER_WORDS = HEADER.size // 4


class LoaderSim:
    """One simulation of a :class:`ConfigLoader` that loads bitstream after bitstream: ``begin``,
    the words one a cycle, three idle cycles; :meth:`load` returns the status, ``configured``
    and every bus write ``(broadcast, x, y, addr, data)`` from ``begin`` on."""

    def __init__(self, params):
        self.loader = ConfigLoader(params, params_hash=params_hash(params))
        self.sim = Simulator(self.loader)
        self.sim.add_clock(1e-9)
        self.queue = collections.deque()
        self.result = None
        self.sim.add_testbench(self._serve)

    async def _serve(self, ctx):
        ld = self.loader

        def write():
            return (ctx.get(ld.bus_broadcast), ctx.get(ld.bus_x), ctx.get(ld.bus_y),
                    ctx.get(ld.bus_addr), ctx.get(ld.bus_wdata))

        while True:
            if not self.queue:
                await ctx.tick()
                continue
            words = self.queue.popleft()
            ctx.set(ld.begin, 1)
            writes = [write()]
            await ctx.tick()
            ctx.set(ld.begin, 0)
            ctx.set(ld.words.valid, 1)
            for w in words:
                ctx.set(ld.words.payload, w)
                if ctx.get(ld.bus_we):
                    writes.append(write())
                await ctx.tick()
            ctx.set(ld.words.valid, 0)
            for _ in range(3):
                if ctx.get(ld.bus_we):
                    writes.append(write())
                await ctx.tick()
            self.result = (LoadStatus(ctx.get(ld.status)), ctx.get(ld.configured), writes)

    def load(self, words):
        self.queue.append(words)
        self.result = None
        while self.result is None:
            self.sim.advance()
        return self.result


def hardware_state(writes):
    """What every CU holds after ``writes``, starting from a reset fabric: address -> word,
    zero words left out (CONTROL holds bit 0; a CU ignores an address it does not map)."""
    mapped = writable_ranges(P)
    state = {xy: {} for xy in CUS}
    for broadcast, x, y, addr, data in writes:
        for xy in CUS if broadcast else [(x, y)]:
            if xy not in state:
                state.setdefault(("not a CU", xy), {})[addr] = data
            elif addr == CU_MAP.CONTROL:
                state[xy][addr] = data & 1
            elif any(lo <= addr < hi for lo, hi in mapped):
                state[xy][addr] = data
    return {xy: {a: v for a, v in s.items() if v} for xy, s in state.items()}


def reader_state(config):
    """What the reader's configuration says every CU holds, in the same form."""
    state = {xy: {} for xy in CUS}
    for xy, tile in config.tiles.items():
        s = state[xy]
        for pc, w in enumerate(tile.words()):
            s[CU_MAP.PROGRAM + 2 * pc], s[CU_MAP.PROGRAM + 2 * pc + 1] = w & 0xffff_ffff, w >> 32
        for r, v in tile.regs.items():
            s[CU_MAP.REGS + r] = v & 0xffff_ffff
        s[CU_MAP.CONTROL] = int(tile.enabled)
        for w, lanes in tile.local.items():
            for lane, v in enumerate(lanes):
                s[CU_MAP.LOCAL + w * P.cu.lanes + lane] = v & 0xffff_ffff
    return {xy: {a: v for a, v in s.items() if v} for xy, s in state.items()}


@pytest.fixture(scope="module")
def loader():
    return LoaderSim(P)


@functools.cache
def real_bitstreams():
    """The real bitstreams every mutation starts from, by name."""
    job, _ = compile_workload("mlp", sizes={"batch": 2, "sizes": (8, 8, 8)}, params=P)
    out = {"mlp": bitstream_for(job)}
    for name, job in (("add", vector_add(P, n=16)), ("matvec", matvec(P, m=16, k=32)),
                      ("moe", moe_fanout(P, n=8))):
        out[name] = write_bitstream(job.bind({b.name: 0 for b in job.buffers}))
    return out


def build(payload, *, magic=b"RDAB", version=1, flags=0, phash=None, length=None, crc=None,
          hcrc=None, tail=()):
    """A bitstream of ``payload`` words, each header field chosen or (by default) right,
    ``tail`` words after the payload."""
    body = struct.pack(f"<{len(payload)}I", *payload)
    head = HEADER.pack(magic, version, flags, params_hash(P) if phash is None else phash,
                       len(payload) if length is None else length,
                       zlib.crc32(body) if crc is None else crc, 0)
    head = head[:20] + struct.pack("<I", zlib.crc32(head[:20]) if hcrc is None else hcrc)
    return head + body + struct.pack(f"<{len(tail)}I", *tail)


def sections(payload):
    """The sections of a payload, each a list of words (the last one cut short where the
    payload is)."""
    out, pos = [], 0
    while pos < len(payload):
        start, n = pos, payload[pos] & 0xffff
        pos += 1
        for _ in range(n):
            if pos >= len(payload):
                break
            pos += 1 + (payload[pos] & 0xffff)
        out.append(payload[start:pos])
    return out


def verdicts(loader, data):
    """The reader's and the loader's verdict on ``data``: ``(status, state)``, the state of
    every CU only for a load both accept."""
    try:
        config = read_bitstream(data, P)
    except BitstreamError as e:
        ours = (e.status, None)
    else:
        ours = (LoadStatus.OK, reader_state(config))
        listing(config)     # what rdakit inspect prints of any bitstream the hardware loads
    status, configured, writes = loader.load(file_words(data))
    assert configured == (status is LoadStatus.OK)
    state = hardware_state(writes)
    if status is not LoadStatus.OK:
        # A refused load leaves no CU enabled; one still waiting for words (LOADING) may
        # have enabled the CUs of its complete sections, but is not configured (no START).
        if status is not LoadStatus.LOADING:
            assert all(s.get(CU_MAP.CONTROL, 0) == 0 for s in state.values()), state
        state = None
    return ours, (status, state)


def assert_agree(loader, data, status=None):
    ours, theirs = verdicts(loader, data)
    assert ours[0] == theirs[0], f"reader {ours[0]}, loader {theirs[0]}"
    assert ours[1] == theirs[1]
    if status is not None:
        assert ours[0] is status


# Addresses at the edges of a CU's writable ranges, and read-only or unmapped ones.
EDGES = sorted({a for lo, hi in writable_ranges(P) for a in (lo, hi - 1, hi)}
               | {CU_MAP.STATUS, CU_MAP.WAIT_CYCLES, 0x5000, 0xffff})


@st.composite
def mutations(draw):
    """A real bitstream, mutated: ``(what was done, bytes)``."""
    bases = real_bitstreams()
    name = draw(st.sampled_from(sorted(bases)))
    payload = list(struct.unpack(f"<{len(bases[name]) // 4 - HEADER_WORDS}I",
                                 bases[name][HEADER.size:]))
    done = [name]
    fields = {}
    for _ in range(draw(st.integers(1, 3))):
        secs = sections(payload)
        kind = draw(st.sampled_from([
            "flip", "set", "insert", "delete", "section", "record", "duplicate", "swap",
            "drop", "retile", "empty section", "empty record", "header", "tail", "cut"]))
        done.append(kind)
        starts = [sum(len(s) for s in secs[:i]) for i in range(len(secs))]
        if kind == "flip" and payload:
            i = draw(st.integers(0, len(payload) - 1))
            payload[i] ^= 1 << draw(st.integers(0, 31))
        elif kind == "set" and payload:
            payload[draw(st.integers(0, len(payload) - 1))] = draw(st.integers(0, 2**32 - 1))
        elif kind == "insert":
            payload.insert(draw(st.integers(0, len(payload))), draw(st.integers(0, 2**32 - 1)))
        elif kind == "delete" and payload:
            del payload[draw(st.integers(0, len(payload) - 1))]
        elif kind == "section" and secs:
            # A section header for any tile of a 4x4 square (outside the grid too).
            i = draw(st.sampled_from(starts))
            payload[i] = (draw(st.integers(0, 3)) << 24 | draw(st.integers(0, 3)) << 16
                          | draw(st.sampled_from([0, 1, 2, payload[i] & 0xffff])))
        elif kind == "record" and secs:
            s = draw(st.integers(0, len(secs) - 1))
            pos, heads = starts[s] + 1, []
            for _ in range(payload[starts[s]] & 0xffff):
                if pos >= len(payload):
                    break
                heads.append(pos)
                pos += 1 + (payload[pos] & 0xffff)
            i = draw(st.sampled_from(heads or [starts[s]]))
            count = payload[i] & 0xffff
            if draw(st.booleans()):
                payload[i] = draw(st.sampled_from(EDGES)) << 16 | count
            else:
                payload[i] = payload[i] & 0xffff_0000 | draw(st.sampled_from(
                    [0, max(count - 1, 0), count + 1]))
        elif kind == "duplicate" and secs:
            s = draw(st.integers(0, len(secs) - 1))
            payload = sum(secs[:s + 1] + secs[s:], [])
        elif kind == "swap" and len(secs) > 1:
            a, b = draw(st.lists(st.integers(0, len(secs) - 1), min_size=2, max_size=2,
                                 unique=True))
            secs[a], secs[b] = secs[b], secs[a]
            payload = sum(secs, [])
        elif kind == "drop" and secs:
            del secs[draw(st.integers(0, len(secs) - 1))]
            payload = sum(secs, [])
        elif kind == "retile" and secs:
            s = draw(st.integers(0, len(secs) - 1))
            x, y = draw(st.sampled_from(CUS))
            secs[s] = [y << 24 | x << 16 | secs[s][0] & 0xffff] + secs[s][1:]
            payload = sum(secs, [])
        elif kind == "empty section":
            x, y = draw(st.sampled_from(CUS))
            secs.insert(draw(st.integers(0, len(secs))), [y << 24 | x << 16])
            payload = sum(secs, [])
        elif kind == "empty record" and secs:
            s = draw(st.integers(0, len(secs) - 1))
            secs[s] = [secs[s][0] + 1, draw(st.sampled_from(EDGES)) << 16] + secs[s][1:]
            payload = sum(secs, [])
        elif kind == "header":
            field = draw(st.sampled_from(["version", "flags", "phash", "length"]))
            if field == "length":
                fields["length"] = max(0, len(payload) + draw(st.sampled_from([-2, -1, 1, 2])))
            else:
                fields[field] = draw(st.integers(0, 2**(16 if field != "phash" else 32) - 1))
            done[-1] = field
        elif kind == "tail":
            fields["tail"] = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=2))
        elif kind == "cut" and payload:
            fields["length"] = len(payload)
            del payload[-draw(st.integers(1, min(3, len(payload)))):]
    # Mostly fix the CRCs up, so that the mutation reaches the content checks.
    if draw(st.integers(0, 9)) == 0:
        fields["crc"] = draw(st.integers(0, 2**32 - 1))
        done.append("payload CRC")
    if draw(st.integers(0, 19)) == 0:
        fields["hcrc"] = draw(st.integers(0, 2**32 - 1))
        done.append("header CRC")
    return done, build(payload, **fields)


def test_real_bitstreams_are_accepted_alike(loader):
    for data in real_bitstreams().values():
        assert_agree(loader, data, LoadStatus.OK)


@hostile(150)
@given(data=st.data())
def test_reader_and_loader_agree_on_mutated_bitstreams(loader, data):
    done, bitstream = data.draw(mutations(), label="mutation")
    assert_agree(loader, bitstream)


def payload_of(name="add"):
    data = real_bitstreams()[name]
    return list(struct.unpack(f"<{len(data) // 4 - HEADER_WORDS}I", data[HEADER.size:]))


def with_record(payload, section, addr, data):
    """``payload`` with a record of ``data`` at ``addr`` added in front of ``section``'s
    records."""
    secs = sections(payload)
    secs[section] = [secs[section][0] + 1, addr << 16 | len(data), *data] + secs[section][1:]
    return sum(secs, [])


# Each class of disagreement found by the test above before the one definition, as a case:
# (the bitstream from the "add" kernel's payload, the status, the reader's message).
CASES = {
    # The loader ignored words after the payload; the reader said "truncated".
    "trailing word": (lambda p: build(p, tail=[0]), LoadStatus.TRAILING,
                      r"^Bitstream has 1 words after its payload \(the header announces \d+ "
                      r"payload words, the file holds \d+\)$"),
    # The loader wrote words a CU ignores (read-only, unmapped, beyond the program, the
    # registers or the local buffer), the reader refused them.
    "read-only STATUS": (lambda p: build(with_record(p, 0, CU_MAP.STATUS, [1])),
                         LoadStatus.BAD_ADDRESS, r"^tile \(0, 0\): address 0x3001 is not a "
                         r"writable word of a compute unit's configuration space"),
    "unmapped address": (lambda p: build(with_record(p, 0, 0x5000, [1])),
                         LoadStatus.BAD_ADDRESS, r"address 0x5000 is not a writable word"),
    "beyond prog_len": (lambda p: build(with_record(p, 0, 2 * P.cu.prog_len, [1])),
                        LoadStatus.BAD_ADDRESS,
                        r"^tile \(0, 0\): program of more than 64 instructions \(prog_len\)$"),
    "no such register": (lambda p: build(with_record(p, 0, CU_MAP.REGS + P.cu.regs, [1])),
                         LoadStatus.BAD_ADDRESS,
                         r"^tile \(0, 0\): register r16 does not exist \(regs = 16\)$"),
    "beyond the local buffer": (
        lambda p: build(with_record(p, 0, CU_MAP.LOCAL + P.cu.lanes * P.cu.local_words, [1])),
        LoadStatus.BAD_ADDRESS,
        r"^tile \(0, 0\): local word 64 is outside the local buffer \(64 words\)$"),
    # The reader listed the second section alone, the loader held both.
    "second section": (lambda p: build(p + [0 << 24 | 0 << 16 | 1, CU_MAP.REGS << 16 | 1, 9]),
                       LoadStatus.BAD_ORDER,
                       r"^tile \(0, 0\) has a second section \(one section a tile\)$"),
    "empty second section": (lambda p: build(p + [0]), LoadStatus.BAD_ORDER,
                             r"^tile \(0, 0\) has a second section"),
    # Both accepted sections out of the documented row-major order.
    "out of order": (lambda p: build([1 << 24 | 1 << 16 | 1, CU_MAP.CONTROL << 16 | 1, 1] + p),
                     LoadStatus.BAD_ORDER, r"^tile \(0, 0\) comes after tile \(1, 1\): "
                                           r"sections must be in row-major order, one a tile$"),
    # Both accepted (and the reader listed) sections and records that write nothing.
    "empty section": (lambda p: build([1 << 24 | 1 << 16]), LoadStatus.EMPTY,
                      r"^tile \(1, 1\): a section with no records$"),
    "empty record": (lambda p: build(with_record(p, 0, CU_MAP.REGS, [])), LoadStatus.EMPTY,
                     r"^tile \(0, 0\): a record at 0x2000 with no words$"),
    # Both accepted flags the format does not define.
    "flags": (lambda p: build(p, flags=1), LoadStatus.BAD_VERSION,
              r"^Unknown bitstream flags 0x0001 \(version 1 has none: 0\)$"),
    # The same refusal, but for different reasons: now the CRC first, as the reader did.
    "bad version, bad header CRC": (lambda p: build(p, version=2, hcrc=0),
                                    LoadStatus.HEADER_CRC, r"^Header CRC mismatch"),
    "bad tile, bad payload CRC": (lambda p: build([0 << 24 | 1 << 16 | 1] + p[1:], crc=0),
                                  LoadStatus.PAYLOAD_CRC, r"^Payload CRC mismatch"),
    # The loader waits for the missing words; the reader says why.
    "payload cut": (lambda p: build(p, length=len(p) + 1), LoadStatus.LOADING,
                    r"^Bitstream is truncated: the header announces \d+ payload words, the "
                    r"file holds \d+$"),
    "payload ends inside a record": (lambda p: build(p[:-1]), LoadStatus.BAD_LENGTH,
                                     r"^The payload ends inside a record of tile \(0, 0\)$"),
}


@pytest.mark.parametrize("case", CASES)
def test_each_class_of_disagreement(loader, case):
    make, status, message = CASES[case]
    data = make(payload_of())
    with pytest.raises(BitstreamError, match=message) as e:
        read_bitstream(data, P)
    assert e.value.status is status
    assert_agree(loader, data, status)


def test_a_record_does_not_wrap_past_0xffff():
    # With a local buffer that fills the configuration space up to 0xffff, the loader's
    # 16-bit address wrapped to 0x0000 and wrote the program; the reader refused.
    full = fabric_params(2, 2, lanes=16, local_words=2048)
    assert writable_ranges(full)[-1][1] == 0x10000
    body = [0 << 24 | 0 << 16 | 1, 0xffff << 16 | 2, 7, 9]
    head = HEADER.pack(b"RDAB", 1, 0, params_hash(full), len(body),
                       zlib.crc32(struct.pack("<4I", *body)), 0)
    data = head[:20] + struct.pack("<I", zlib.crc32(head[:20])) + struct.pack("<4I", *body)
    with pytest.raises(BitstreamError, match=r"^tile \(0, 0\): address 0x10000 is not a "
                                             r"writable word") as e:
        read_bitstream(data, full)
    assert e.value.status is LoadStatus.BAD_ADDRESS
    status, configured, writes = LoaderSim(full).load(file_words(data))
    assert status is LoadStatus.BAD_ADDRESS and not configured
    assert [w[3] for w in writes if not w[0]] == [0xffff]     # nothing written at 0x0000


def test_a_file_of_part_of_a_word_is_refused_before_the_hardware():
    # The host driver sent whole words and dropped the rest, so the loader accepted a valid
    # bitstream followed by one to three bytes that the reader refused.
    data = real_bitstreams()["add"] + b"\1\2"
    message = r"^Bitstream is \d+ bytes, not a whole number of 32-bit words$"
    with pytest.raises(BitstreamError, match=message) as e:
        read_bitstream(data, P)
    assert e.value.status is None
    with pytest.raises(BitstreamError, match=message):
        file_words(data)


@pytest.mark.parametrize("case", ["out of order", "unmapped address", "trailing word"])
def test_inspect_refuses_with_the_file_and_the_reason(case, tmp_path, capsys):
    make, status, message = CASES[case]
    path = tmp_path / "bad.bit"
    path.write_bytes(make(payload_of()))
    assert main(["inspect", str(path), "--fabric", "2x2", "--mu-words", "2048"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rdakit: error: {path}: ")
    assert f"(the fabric's loader refuses it: {status.name})" in err
    assert "Traceback" not in err
