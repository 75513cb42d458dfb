"""The bitstream writer and reader: round trips, listings, and every malformed case."""

import struct
import subprocess
import sys
import zlib

import pytest

from rdakit.hdl.spec.bitstream import (
    HEADER,
    BitstreamError,
    FabricConfig,
    LoadStatus,
    TileConfig,
    listing,
    params_hash,
    read_bitstream,
    write_bitstream,
)
from rdakit.hdl.spec.isa import assemble, encode
from rdakit.hdl.spec.params import fabric_params

P = fabric_params(2, 3, prog_len=8, lanes=2)


def config():
    return FabricConfig(P, {
        (0, 0): TileConfig(program=assemble("LI r1, -5\nALUI MUL, r2, r1, 3\nHALT"),
                           regs={1: 7, 15: 0xffff_ffff}, local={0: [1, -2], 3: [5, 6]}),
        (2, 0): TileConfig(program=assemble("HALT"), enabled=False),
        (1, 1): TileConfig(program=[encode(i) for i in assemble("NOP\nHALT")]),
    })


def reheader(data, **fields):
    """Rewrite header fields of a bitstream and fix the header CRC (unless hcrc is given)."""
    magic, version, flags, phash, length, crc, hcrc = HEADER.unpack_from(data)
    values = dict(magic=magic, version=version, flags=flags, phash=phash, length=length,
                  crc=crc)
    values.update({k: v for k, v in fields.items() if k != "hcrc"})
    head = HEADER.pack(values["magic"], values["version"], values["flags"], values["phash"],
                       values["length"], values["crc"], 0)
    head = head[:20] + struct.pack("<I", fields.get("hcrc", zlib.crc32(head[:20])))
    return head + data[HEADER.size:]


def test_round_trip():
    cfg = config()
    back = read_bitstream(write_bitstream(cfg), P)
    assert set(back.tiles) == set(cfg.tiles)
    for xy, tile in cfg.tiles.items():
        got = back.tiles[xy]
        assert got.words() == tile.words()
        assert got.enabled == tile.enabled
        assert {r: v & 0xffff_ffff for r, v in tile.regs.items() if v} == got.regs
        assert {w: [v & 0xffff_ffff for v in lanes] for w, lanes in tile.local.items()} == \
            got.local


def test_bytes_do_not_depend_on_insertion_order():
    a = config()
    b = FabricConfig(P, dict(reversed(list(config().tiles.items()))))
    assert write_bitstream(a) == write_bitstream(b)


def test_listing_disassembles():
    text = listing(read_bitstream(write_bitstream(config()), P))
    assert "tile (0, 0) CU enabled: 3 instructions" in text
    assert "ALUI MUL, r2, r1, 3" in text and "LI r1, -5" in text
    assert "tile (2, 0) CU disabled" in text
    assert "local[0] = [1, -2]" in text


def test_listing_shows_a_word_that_is_no_instruction():
    # The loader loads any program word (the CU halts on it with BAD_INSTRUCTION); inspect
    # raised AssemblyError with a traceback.
    cfg = FabricConfig(P, {(0, 0): TileConfig(program=[0x2c, encode(assemble("HALT")[0])])})
    text = listing(read_bitstream(write_bitstream(cfg), P))
    assert "     0: 000000000000002c  (not an instruction: Opcode 44 is not defined" in text
    assert "     1: " in text and "HALT" in text


@pytest.mark.parametrize("mutate,message,status", [
    (lambda d: d[:12], r"^Bitstream is truncated: 12 bytes, shorter than the 24-byte header$",
     LoadStatus.LOADING),
    (lambda d: d[:10], r"^Bitstream is 10 bytes, not a whole number of 32-bit words$", None),
    (lambda d: b"XXXX" + d[4:], r"^Bad magic b'XXXX': not an rdakit bitstream",
     LoadStatus.BAD_MAGIC),
    (lambda d: d[:20] + b"\0\0\0\0" + d[24:], r"^Header CRC mismatch", LoadStatus.HEADER_CRC),
    (lambda d: reheader(d, version=7), r"^Unknown bitstream format version 7",
     LoadStatus.BAD_VERSION),
    (lambda d: reheader(d, flags=2), r"^Unknown bitstream flags 0x0002", LoadStatus.BAD_VERSION),
    (lambda d: reheader(d, phash=1), r"^Bitstream was built for other fabric parameters",
     LoadStatus.BAD_PARAMS),
    (lambda d: d[:-4], r"^Bitstream is truncated: the header announces \d+ payload words, "
                       r"the file holds \d+$", LoadStatus.LOADING),
    (lambda d: d + b"\0" * 8, r"^Bitstream has 2 words after its payload", LoadStatus.TRAILING),
    (lambda d: d[:30] + bytes([d[30] ^ 1]) + d[31:], r"^Payload CRC mismatch",
     LoadStatus.PAYLOAD_CRC),
])
def test_malformed(mutate, message, status):
    with pytest.raises(BitstreamError, match=message) as e:
        read_bitstream(mutate(write_bitstream(config())), P)
    assert e.value.status is status


def payload_bitstream(words):
    body = struct.pack(f"<{len(words)}I", *words)
    head = HEADER.pack(b"RDAB", 1, 0, params_hash(P), len(words), zlib.crc32(body), 0)
    return head[:20] + struct.pack("<I", zlib.crc32(head[:20])) + body


@pytest.mark.parametrize("words,message", [
    ([0 << 24 | 3 << 16 | 0], r"^tile \(3, 0\) is outside the 2x3 grid$"),
    ([0 << 24 | 1 << 16 | 0], r"^tile \(1, 0\) is a memory unit; only compute units take "),
    ([0 << 24 | 0 << 16 | 1, 0x0000 << 16 | 18] + [0] * 18,
     r"^tile \(0, 0\): program of more than 8 instructions \(prog_len\)$"),
    ([0 << 24 | 0 << 16 | 1, 0x5000 << 16 | 1, 0],
     r"^tile \(0, 0\): address 0x5000 is not a writable word of a compute unit's "
     r"configuration space \(program, registers, CONTROL, local buffer\)$"),
    ([0 << 24 | 0 << 16 | 1, 0x3001 << 16 | 1, 0], r"^tile \(0, 0\): address 0x3001 is not a "
                                                   r"writable word"),
    ([0 << 24 | 0 << 16 | 1, 0x2010 << 16 | 1, 0],
     r"^tile \(0, 0\): register r16 does not exist \(regs = 16\)$"),
    ([0 << 24 | 0 << 16 | 1, 0x8080 << 16 | 1, 0],
     r"^tile \(0, 0\): local word 64 is outside the local buffer \(64 words\)$"),
    ([0 << 24 | 0 << 16 | 2, 0x3000 << 16 | 1, 1], r"^The payload ends inside a record "
                                                   r"header of tile \(0, 0\)$"),
    ([0 << 24 | 0 << 16 | 1, 0x3000 << 16 | 2, 1], r"^The payload ends inside a record "
                                                   r"of tile \(0, 0\)$"),
    ([0 << 24 | 0 << 16 | 0], r"^tile \(0, 0\): a section with no records$"),
    ([0 << 24 | 0 << 16 | 1, 0x3000 << 16 | 0], r"^tile \(0, 0\): a record at 0x3000 with no "
                                                r"words$"),
    ([0 << 24 | 2 << 16 | 1, 0x3000 << 16 | 1, 1, 0 << 24 | 0 << 16 | 1, 0x3000 << 16 | 1, 1],
     r"^tile \(0, 0\) comes after tile \(2, 0\): sections must be in row-major order"),
    ([0 << 24 | 0 << 16 | 1, 0x3000 << 16 | 1, 1, 0 << 24 | 0 << 16 | 1, 0x2000 << 16 | 1, 1],
     r"^tile \(0, 0\) has a second section \(one section a tile\)$"),
])
def test_malformed_payload(words, message):
    with pytest.raises(BitstreamError, match=message):
        read_bitstream(payload_bitstream(words), P)


@pytest.mark.parametrize("tiles,message", [
    ({(5, 0): TileConfig()}, r"^tile \(5, 0\) is outside the 2x3 grid$"),
    ({(1, 0): TileConfig()}, r"^tile \(1, 0\) is a memory unit"),
    ({(0, 0): TileConfig(program=assemble("NOP\n" * 9))},
     r"^tile \(0, 0\): program of 9 instructions is longer than prog_len \(8\)$"),
    ({(0, 0): TileConfig(regs={16: 1})}, r"^tile \(0, 0\): register r16 does not exist"),
    ({(0, 0): TileConfig(local={64: [0, 0]})}, r"^tile \(0, 0\): local word 64 is outside"),
    ({(0, 0): TileConfig(local={0: [0]})}, r"^tile \(0, 0\): local word 0 has 1 lanes, not 2$"),
])
def test_writer_rejects(tiles, message):
    with pytest.raises(BitstreamError, match=message):
        write_bitstream(FabricConfig(P, tiles))


def test_inspect_command(tmp_path):
    path = tmp_path / "x.bit"
    path.write_bytes(write_bitstream(config()))
    args = ["--fabric", "2x3", "--prog-len", "8", "--lanes", "2"]
    r = subprocess.run([sys.executable, "-m", "rdakit", "inspect", str(path), *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "ALUI MUL, r2, r1, 3" in r.stdout
    path.write_bytes(b"XXXX" + write_bitstream(config())[4:])
    r = subprocess.run([sys.executable, "-m", "rdakit", "inspect", str(path), *args],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Bad magic" in r.stderr
    r = subprocess.run([sys.executable, "-m", "rdakit", "inspect", str(path), "--fabric", "2x2"],
                       capture_output=True, text=True)
    assert r.returncode == 2
