# amaranth: UnusedElaboratable=no
"""The configuration loader against the Python bitstream writer, and every malformed case."""

import dataclasses
import struct
import zlib

import pytest

from rdakit.hdl.fabric.config_loader import ConfigLoader, LoadStatus
from rdakit.hdl.spec.bitstream import (
    HEADER,
    MAGIC,
    FabricConfig,
    TileConfig,
    bitstream_words,
    params_hash,
    write_bitstream,
)
from rdakit.hdl.spec.config import CU_MAP
from rdakit.hdl.spec.isa import assemble
from rdakit.hdl.spec.params import CUParams, FabricParams
from rdakit.sim.verify.amaranth_sim import simulate
from rdakit.sim.verify.runner import generate_verilog

P = FabricParams(rows=2, cols=3, cu=CUParams(lanes=4, prog_len=16))


def config():
    return FabricConfig(P, {
        (0, 0): TileConfig(program=assemble("LI r1, 5\nALUI ADD, r1, r1, 1\nHALT"),
                           regs={3: 7}, local={0: [1, 2, 3, 4], 1: [5, 6, 7, 8]}),
        (2, 0): TileConfig(program=assemble("HALT")),
        (1, 1): TileConfig(program=assemble("NOP\nHALT"), enabled=False),
    })


def raw(payload, *, magic=MAGIC, version=1, phash=None, length=None, crc=None, hcrc=None):
    """A bitstream with every header field chosen (CRCs computed unless given)."""
    body = struct.pack(f"<{len(payload)}I", *payload)
    head = HEADER.pack(magic, version, 0, params_hash(P) if phash is None else phash,
                       len(payload) if length is None else length,
                       zlib.crc32(body) if crc is None else crc, 0)
    head = head[:20] + struct.pack("<I", zlib.crc32(head[:20]) if hcrc is None else hcrc)
    return head + body


@dataclasses.dataclass
class Loaded:
    status: LoadStatus
    configured: bool
    writes: list            # (x, y, addr, data) of every write to one tile
    cycles: int
    broadcasts: list        # (index in writes when it happened, addr, data) of every broadcast


def load(data):
    """Feed ``data`` to a loader (a ``begin``, the words, three idle cycles)."""
    loader = ConfigLoader(P, params_hash=params_hash(P))
    words = list(struct.unpack(f"<{len(data) // 4}I", data[:len(data) // 4 * 4]))
    writes, broadcasts = [], []
    result = {}

    def record(ctx):
        if ctx.get(loader.bus_we) and ctx.get(loader.bus_broadcast):
            broadcasts.append((len(writes), ctx.get(loader.bus_addr), ctx.get(loader.bus_wdata)))
        elif ctx.get(loader.bus_we):
            writes.append((ctx.get(loader.bus_x), ctx.get(loader.bus_y),
                           ctx.get(loader.bus_addr), ctx.get(loader.bus_wdata)))

    async def tb(ctx):
        ctx.set(loader.begin, 1)
        record(ctx)
        await ctx.tick()
        ctx.set(loader.begin, 0)
        for w in words:
            ctx.set(loader.words.valid, 1)
            ctx.set(loader.words.payload, w)
            record(ctx)
            await ctx.tick()
        ctx.set(loader.words.valid, 0)
        for _ in range(3):
            record(ctx)
            await ctx.tick()
        result["status"] = LoadStatus(ctx.get(loader.status))
        result["configured"] = ctx.get(loader.configured)
        result["cycles"] = ctx.get(loader.cycles)

    simulate(loader, tb)
    # The begin cycle disables every CU with a broadcast write.
    assert broadcasts[0] == (0, CU_MAP.CONTROL, 0)
    return Loaded(result["status"], result["configured"], writes, result["cycles"], broadcasts)


def expected_writes(cfg):
    words = bitstream_words(cfg)
    out, pos = [], 0
    while pos < len(words):
        head = words[pos]
        pos += 1
        x, y, n = (head >> 16) & 0xff, head >> 24, head & 0xffff
        for _ in range(n):
            addr, count = words[pos] >> 16, words[pos] & 0xffff
            pos += 1
            out += [(x, y, addr + i, words[pos + i]) for i in range(count)]
            pos += count
    return out


def test_loads_a_bitstream_and_writes_every_record():
    cfg = config()
    got = load(write_bitstream(cfg))
    assert got.status is LoadStatus.OK and got.configured
    assert got.writes == expected_writes(cfg)
    assert len(got.broadcasts) == 1
    # One word a cycle: header, payload, the CRC check.
    assert got.cycles == 6 + len(bitstream_words(cfg)) + 1


def test_empty_payload_is_a_valid_load():
    got = load(raw([]))
    assert got.status is LoadStatus.OK and got.configured and got.writes == []


@pytest.mark.parametrize("kwargs,status", [
    ({"magic": b"XDAB"}, LoadStatus.BAD_MAGIC),
    ({"version": 2}, LoadStatus.BAD_VERSION),
    ({"phash": 0x1234}, LoadStatus.BAD_PARAMS),
    ({"hcrc": 0}, LoadStatus.HEADER_CRC),
    ({"crc": 0xdeadbeef}, LoadStatus.PAYLOAD_CRC),
])
def test_bad_header_fields_are_rejected_before_any_write(kwargs, status):
    got = load(raw(bitstream_words(config()), **kwargs))
    assert got.status is status and not got.configured
    if status is not LoadStatus.PAYLOAD_CRC:
        assert got.writes == []


def test_corrupted_payload_leaves_the_fabric_unconfigured():
    data = bytearray(write_bitstream(config()))
    data[HEADER.size + 9] ^= 0x10
    got = load(bytes(data))
    assert got.status is LoadStatus.PAYLOAD_CRC and not got.configured


@pytest.mark.parametrize("tile", [(3, 0), (0, 2), (1, 0)])   # outside, outside, an MU
def test_section_for_a_tile_that_is_not_a_cu(tile):
    x, y = tile
    got = load(raw([y << 24 | x << 16 | 1, 0x3000 << 16 | 1, 1]))
    assert got.status is LoadStatus.BAD_TILE and not got.configured and got.writes == []


@pytest.mark.parametrize("payload", [
    [0 << 24 | 0 << 16 | 2, 0x3000 << 16 | 1, 1],        # a second record announced, missing
    [0 << 24 | 0 << 16 | 1, 0x3000 << 16 | 2, 1],        # a record one word short
    [0 << 24 | 0 << 16 | 1],                              # a record announced, missing
])
def test_payload_ending_inside_a_section(payload):
    got = load(raw(payload))
    assert got.status is LoadStatus.BAD_LENGTH and not got.configured


def test_a_new_begin_restarts_after_an_error():
    got = load(raw([], magic=b"NOPE") + write_bitstream(config()))
    assert got.status is LoadStatus.BAD_MAGIC and got.writes == []   # discarded, not parsed
    got = load(write_bitstream(config()))
    assert got.status is LoadStatus.OK and got.configured


def test_a_word_after_a_load_that_passed_refuses_it():
    # Before, the loader ignored it (the reader refused the file): now both say TRAILING,
    # and the CUs the load enabled are disabled again.
    got = load(write_bitstream(config()) + bytes(4))
    assert got.status is LoadStatus.TRAILING and not got.configured
    assert got.writes == expected_writes(config())
    assert got.broadcasts[1:] == [(len(got.writes), CU_MAP.CONTROL, 0)]


def test_a_refused_load_disables_every_cu_again():
    # (0, 0)'s section is complete and enables it; the next section is for an MU. Nothing is
    # written after the error, and the end of the load disables every CU.
    enable = [0 << 24 | 0 << 16 | 1, CU_MAP.CONTROL << 16 | 1, 1]
    got = load(raw(enable + [0 << 24 | 1 << 16 | 1, CU_MAP.CONTROL << 16 | 1, 1]))
    assert got.status is LoadStatus.BAD_TILE and not got.configured
    assert got.writes == [(0, 0, CU_MAP.CONTROL, 1)]
    assert got.broadcasts[1:] == [(1, CU_MAP.CONTROL, 0)]


def test_a_payload_error_waits_for_the_payload_crc():
    # The loader used to report the bad tile at once; the reader reported the CRC. Both report
    # the CRC now (a corrupted payload is reported as corrupted), and the tile when it holds.
    bad = [0 << 24 | 1 << 16 | 1, CU_MAP.CONTROL << 16 | 1, 1, 0, 0]
    assert load(raw(bad, crc=0)).status is LoadStatus.PAYLOAD_CRC
    assert load(raw(bad)).status is LoadStatus.BAD_TILE


def test_converts_to_verilog():
    assert "module top" in generate_verilog(ConfigLoader(P, params_hash=1))


def test_init_wrong_params():
    with pytest.raises(TypeError, match=r"^Params must be a FabricParams, not 1$"):
        ConfigLoader(1, params_hash=0)
