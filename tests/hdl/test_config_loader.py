# amaranth: UnusedElaboratable=no
"""The configuration loader against the Python bitstream writer, and every malformed case."""

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


def load(data):
    """Feed ``data`` to a loader; return (status, configured, writes, cycles)."""
    loader = ConfigLoader(P, params_hash=params_hash(P))
    words = list(struct.unpack(f"<{len(data) // 4}I", data[:len(data) // 4 * 4]))
    writes = []
    result = {}

    async def tb(ctx):
        ctx.set(loader.begin, 1)
        # The begin cycle disables every CU with a broadcast write.
        result["begin"] = (ctx.get(loader.bus_we), ctx.get(loader.bus_broadcast),
                           ctx.get(loader.bus_addr), ctx.get(loader.bus_wdata))
        await ctx.tick()
        ctx.set(loader.begin, 0)
        for w in words:
            ctx.set(loader.words.valid, 1)
            ctx.set(loader.words.payload, w)
            if ctx.get(loader.bus_we):
                writes.append(_write(ctx, loader))
            await ctx.tick()
        ctx.set(loader.words.valid, 0)
        for _ in range(3):
            await ctx.tick()
        result["status"] = LoadStatus(ctx.get(loader.status))
        result["configured"] = ctx.get(loader.configured)
        result["cycles"] = ctx.get(loader.cycles)

    simulate(loader, tb)
    assert result["begin"] == (1, 1, CU_MAP.CONTROL, 0)
    return result["status"], result["configured"], writes, result["cycles"]


def _write(ctx, loader):
    return (ctx.get(loader.bus_x), ctx.get(loader.bus_y), ctx.get(loader.bus_addr),
            ctx.get(loader.bus_wdata))


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
    status, configured, writes, cycles = load(write_bitstream(cfg))
    assert status is LoadStatus.OK and configured
    assert writes == expected_writes(cfg)
    # One word a cycle: header, payload, the CRC check.
    assert cycles == 6 + len(bitstream_words(cfg)) + 1


def test_empty_payload_is_a_valid_load():
    status, configured, writes, _ = load(raw([]))
    assert status is LoadStatus.OK and configured and writes == []


@pytest.mark.parametrize("kwargs,status", [
    ({"magic": b"XDAB"}, LoadStatus.BAD_MAGIC),
    ({"version": 2}, LoadStatus.BAD_VERSION),
    ({"phash": 0x1234}, LoadStatus.BAD_PARAMS),
    ({"hcrc": 0}, LoadStatus.HEADER_CRC),
    ({"crc": 0xdeadbeef}, LoadStatus.PAYLOAD_CRC),
])
def test_bad_header_fields_are_rejected_before_any_write(kwargs, status):
    got, configured, writes, _ = load(raw(bitstream_words(config()), **kwargs))
    assert got is status and not configured
    if status is not LoadStatus.PAYLOAD_CRC:
        assert writes == []


def test_corrupted_payload_leaves_the_fabric_unconfigured():
    data = bytearray(write_bitstream(config()))
    data[HEADER.size + 9] ^= 0x10
    status, configured, _, _ = load(bytes(data))
    assert status is LoadStatus.PAYLOAD_CRC and not configured


@pytest.mark.parametrize("tile", [(3, 0), (0, 2), (1, 0)])   # outside, outside, an MU
def test_section_for_a_tile_that_is_not_a_cu(tile):
    x, y = tile
    status, configured, writes, _ = load(raw([y << 24 | x << 16 | 1, 0x3000 << 16 | 1, 1]))
    assert status is LoadStatus.BAD_TILE and not configured and writes == []


@pytest.mark.parametrize("payload", [
    [0 << 24 | 0 << 16 | 2, 0x3000 << 16 | 1, 1],        # a second record announced, missing
    [0 << 24 | 0 << 16 | 1, 0x3000 << 16 | 2, 1],        # a record one word short
    [0 << 24 | 0 << 16 | 1],                              # a record announced, missing
])
def test_payload_ending_inside_a_section(payload):
    status, configured, _, _ = load(raw(payload))
    assert status is LoadStatus.BAD_LENGTH and not configured


def test_a_new_begin_restarts_after_an_error():
    status, configured, _, _ = load(raw([], magic=b"NOPE") + write_bitstream(config()))
    assert status is LoadStatus.BAD_MAGIC   # the rest was discarded, not parsed
    status, configured, _, _ = load(write_bitstream(config()))
    assert status is LoadStatus.OK and configured


def test_converts_to_verilog():
    assert "module top" in generate_verilog(ConfigLoader(P, params_hash=1))


def test_init_wrong_params():
    with pytest.raises(TypeError, match=r"^Params must be a FabricParams, not 1$"):
        ConfigLoader(1, params_hash=0)
