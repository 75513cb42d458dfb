"""Fabric configurations and their bitstream: a Python description, a writer and a reader.

A :class:`FabricConfig` says what every tile runs: for each CU its program (instruction words),
initial registers and local-buffer contents, and whether it takes part. The compiler produces
one, the functional interpreter executes one, and :func:`write_bitstream` /
:func:`read_bitstream` turn it into bytes and back. The format is in ``docs/bitstream.md``:

* a 24-byte header, little-endian: magic ``b"RDAB"``, format version (u16), flags (u16), the
  fabric parameter hash (u32), the payload length in 32-bit words (u32), the CRC-32
  (ISO-HDLC, as ``zlib.crc32``) of the payload (u32), and the CRC-32 of the first 20 header
  bytes (u32);
* the payload: one section per configured tile, in row-major order. A section is a header
  word ``y << 24 | x << 16 | records`` followed by its records; a record is a word
  ``address << 16 | count`` followed by ``count`` data words written to consecutive addresses
  of the tile's configuration space (:mod:`rdakit.hdl.spec.config`).

The hardware loader reads exactly this stream of words.
"""

import dataclasses
import hashlib
import struct
import zlib

import numpy as np

from rdakit.hdl.spec.config import CU_MAP
from rdakit.hdl.spec.isa import decode, disassemble_one, encode
from rdakit.hdl.spec.params import FabricParams

__all__ = [
    "MAGIC", "MAGIC_WORD", "VERSION", "HEADER", "TileConfig", "FabricConfig", "BitstreamError",
    "params_hash", "write_bitstream", "read_bitstream", "bitstream_words", "listing",
]

#: The first four bytes of every bitstream, and the same as the little-endian word the
#: hardware loader compares its first word with.
MAGIC = b"RDAB"
MAGIC_WORD = struct.unpack("<I", MAGIC)[0]
#: The format version (the low 16 bits of the second word); the loader refuses any other.
VERSION = 1
HEADER = struct.Struct("<4sHHIIII")
MAX_RECORD = 0xffff


class BitstreamError(ValueError):
    """A bitstream or configuration that cannot be loaded; the message names the problem."""


@dataclasses.dataclass
class TileConfig:
    """What one CU runs.

    Members
    -------
    program : list of int
        Instruction words (64-bit), at most ``prog_len``.
    regs : dict of int to int
        Initial register values (32-bit, unsigned or negative); the others start at 0.
    local : dict of int to sequence of int
        Initial local-buffer words: word index -> ``lanes`` 32-bit elements.
    enabled : bool
        Whether the CU runs (a disabled CU reports done at once).
    """

    program: list = dataclasses.field(default_factory=list)
    regs: dict = dataclasses.field(default_factory=dict)
    local: dict = dataclasses.field(default_factory=dict)
    enabled: bool = True

    def words(self):
        """The program as 64-bit words (``Instr`` items are encoded)."""
        return [w if isinstance(w, int) else encode(w) for w in self.program]


@dataclasses.dataclass
class FabricConfig:
    """The configuration of every CU of a fabric; tiles not listed are disabled."""

    params: FabricParams
    tiles: dict = dataclasses.field(default_factory=dict)   # (x, y) -> TileConfig

    def validate(self):
        """Raise :class:`BitstreamError` naming the first tile that cannot be configured."""
        p = self.params
        for (x, y), tile in sorted(self.tiles.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            where = f"tile ({x}, {y})"
            if not (0 <= x < p.cols and 0 <= y < p.rows):
                raise BitstreamError(f"{where} is outside the {p.rows}x{p.cols} grid")
            if p.kind(x, y) != "C":
                raise BitstreamError(f"{where} is a memory unit; only compute units take "
                                     f"programs")
            if len(tile.program) > p.cu.prog_len:
                raise BitstreamError(f"{where}: program of {len(tile.program)} instructions "
                                     f"is longer than prog_len ({p.cu.prog_len})")
            for r in tile.regs:
                if not 0 <= r < p.cu.regs:
                    raise BitstreamError(f"{where}: register r{r} does not exist "
                                         f"(regs = {p.cu.regs})")
            for w, lanes in tile.local.items():
                if not 0 <= w < p.cu.local_words:
                    raise BitstreamError(f"{where}: local word {w} is outside the local buffer "
                                         f"({p.cu.local_words} words)")
                if len(lanes) != p.cu.lanes:
                    raise BitstreamError(f"{where}: local word {w} has {len(lanes)} lanes, "
                                         f"not {p.cu.lanes}")


def params_hash(params):
    """A 32-bit hash of every fabric parameter: a bitstream is only loaded on a fabric whose
    parameters hash the same."""
    text = repr(dataclasses.asdict(params)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:4], "little")


def _tile_records(params, tile):
    records = []
    words = []
    for w in tile.words():
        words += [w & 0xffff_ffff, w >> 32]
    if words:
        records.append((CU_MAP.PROGRAM, words))
    if tile.regs:
        regs = [0] * params.cu.regs
        for r, v in tile.regs.items():
            regs[r] = int(v) & 0xffff_ffff
        records.append((CU_MAP.REGS, regs))
    if tile.local:
        # Consecutive words form one record.
        for start, block in _runs(sorted(tile.local.items())):
            data = [int(v) & 0xffff_ffff for _, lanes in block for v in lanes]
            records.append((CU_MAP.LOCAL + start * params.cu.lanes, data))
    records.append((CU_MAP.CONTROL, [1 if tile.enabled else 0]))
    out = []
    for addr, data in records:
        for i in range(0, len(data), MAX_RECORD):
            chunk = data[i:i + MAX_RECORD]
            out.append((addr + i, chunk))
    return out


def _runs(items):
    run, start = [], None
    for w, lanes in items:
        if run and w != start + len(run):
            yield start, run
            run = []
        if not run:
            start = w
        run.append((w, lanes))
    if run:
        yield start, run


def bitstream_words(config):
    """The payload of ``config`` as 32-bit words."""
    config.validate()
    payload = []
    for (x, y), tile in sorted(config.tiles.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        records = _tile_records(config.params, tile)
        payload.append(y << 24 | x << 16 | len(records))
        for addr, data in records:
            payload.append(addr << 16 | len(data))
            payload.extend(data)
    return payload


def write_bitstream(config):
    """The bitstream (bytes) of a :class:`FabricConfig`."""
    payload = bitstream_words(config)
    body = struct.pack(f"<{len(payload)}I", *payload)
    head = HEADER.pack(MAGIC, VERSION, 0, params_hash(config.params), len(payload),
                       zlib.crc32(body), 0)
    head = head[:20] + struct.pack("<I", zlib.crc32(head[:20]))
    return head + body


def read_bitstream(data, params):
    """Check a bitstream against ``params`` and return its :class:`FabricConfig`.

    Raises
    ------
    BitstreamError
        Bad magic, an unknown version, a header or payload CRC mismatch, a truncated file,
        parameters that do not match the fabric, a tile outside the grid or not a CU, a
        program too long, an address outside a tile's configuration space.
    """
    if len(data) < HEADER.size:
        raise BitstreamError(f"Bitstream is truncated: {len(data)} bytes, shorter than the "
                             f"{HEADER.size}-byte header")
    magic, version, _flags, phash, length, crc, hcrc = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BitstreamError(f"Bad magic {magic!r}: not an rdakit bitstream (expected "
                             f"{MAGIC!r})")
    if zlib.crc32(data[:20]) != hcrc:
        raise BitstreamError("Header CRC mismatch: the header is corrupted")
    if version != VERSION:
        raise BitstreamError(f"Unknown bitstream format version {version} (this rdakit reads "
                             f"version {VERSION})")
    if phash != params_hash(params):
        raise BitstreamError(f"Bitstream was built for other fabric parameters (hash "
                             f"{phash:#010x}, this fabric {params_hash(params):#010x})")
    body = data[HEADER.size:]
    if len(body) != 4 * length:
        raise BitstreamError(f"Bitstream is truncated: the header announces {length} payload "
                             f"words, the file holds {len(body) / 4:g}")
    if zlib.crc32(body) != crc:
        raise BitstreamError(f"Payload CRC mismatch: computed {zlib.crc32(body):#010x}, header "
                             f"says {crc:#010x}")
    words = list(struct.unpack(f"<{length}I", body))
    return _parse(words, params)


def _parse(words, params):
    tiles = {}
    pos = 0
    lanes = params.cu.lanes

    def take(n, what):
        nonlocal pos
        if pos + n > len(words):
            raise BitstreamError(f"Bitstream is truncated inside {what}")
        out = words[pos:pos + n]
        pos += n
        return out

    while pos < len(words):
        head, = take(1, "a tile header")
        y, x, nrec = head >> 24, (head >> 16) & 0xff, head & 0xffff
        where = f"tile ({x}, {y})"
        if not (0 <= x < params.cols and 0 <= y < params.rows):
            raise BitstreamError(f"{where} is outside the {params.rows}x{params.cols} grid")
        if params.kind(x, y) != "C":
            raise BitstreamError(f"{where} is a memory unit; only compute units take programs")
        tile = TileConfig(enabled=False)
        program = {}
        for _ in range(nrec):
            rec, = take(1, f"a record header of {where}")
            addr, count = rec >> 16, rec & 0xffff
            data = take(count, f"a record of {where}")
            for i, v in enumerate(data):
                a = addr + i
                if CU_MAP.PROGRAM <= a < CU_MAP.PROGRAM + 2 * params.cu.prog_len:
                    program[a - CU_MAP.PROGRAM] = v
                elif CU_MAP.PROGRAM + 2 * params.cu.prog_len <= a < CU_MAP.REGS:
                    raise BitstreamError(f"{where}: program of more than {params.cu.prog_len} "
                                         f"instructions (prog_len)")
                elif CU_MAP.REGS <= a < CU_MAP.REGS + params.cu.regs:
                    tile.regs[a - CU_MAP.REGS] = v
                elif a == CU_MAP.CONTROL:
                    tile.enabled = bool(v & 1)
                elif CU_MAP.LOCAL <= a < CU_MAP.LOCAL + lanes * params.cu.local_words:
                    w, lane = divmod(a - CU_MAP.LOCAL, lanes)
                    tile.local.setdefault(w, [0] * lanes)[lane] = v
                else:
                    raise BitstreamError(f"{where}: address {a:#06x} is not in a compute "
                                         f"unit's configuration space")
        n = (max(program) + 2) // 2 if program else 0
        tile.program = [program.get(2 * pc, 0) | program.get(2 * pc + 1, 0) << 32
                        for pc in range(n)]
        tile.regs = {r: v for r, v in tile.regs.items() if v}
        tiles[(x, y)] = tile
    return FabricConfig(params, tiles)


def listing(config):
    """A readable listing: every tile with its program disassembled, registers and local
    buffer."""
    p = config.params
    out = [f"fabric {p.rows}x{p.cols}, {p.cu.lanes} lanes, parameter hash "
           f"{params_hash(p):#010x}"]
    for (x, y), tile in sorted(config.tiles.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        state = "enabled" if tile.enabled else "disabled"
        out.append(f"\ntile ({x}, {y}) CU {state}: {len(tile.program)} instructions")
        for pc, w in enumerate(tile.words()):
            out.append(f"  {pc:4d}: {w:016x}  {disassemble_one(decode(w))}")
        for r, v in sorted(tile.regs.items()):
            out.append(f"  r{r} = {v}")
        for w, lanes in sorted(tile.local.items()):
            values = np.asarray(lanes, dtype=np.uint32).astype(np.int32).tolist()
            out.append(f"  local[{w}] = {values}")
    return "\n".join(out)
