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

The hardware loader (:class:`rdakit.hdl.fabric.config_loader.ConfigLoader`) reads exactly
this stream of words, and both sides implement one definition of a valid bitstream
(``docs/bitstream.md``, Checks): :func:`read_bitstream` refuses a bitstream with the
:class:`LoadStatus` the loader reports for it, checked in the same order, and
:func:`writable_ranges` is the set of addresses both accept.
"""

import dataclasses
import hashlib
import struct
import zlib

import numpy as np
from amaranth.lib import enum

from rdakit.hdl.spec.config import CU_MAP
from rdakit.hdl.spec.isa import decode, disassemble_one, encode
from rdakit.hdl.spec.params import FabricParams

__all__ = [
    "MAGIC", "MAGIC_WORD", "VERSION", "HEADER", "LoadStatus", "LOAD_STATUS_DOC", "TileConfig",
    "FabricConfig", "BitstreamError", "params_hash", "writable_ranges", "file_words",
    "write_bitstream", "read_bitstream", "bitstream_words", "listing",
]

#: The first four bytes of every bitstream, and the same as the little-endian word the
#: hardware loader compares its first word with.
MAGIC = b"RDAB"
MAGIC_WORD = struct.unpack("<I", MAGIC)[0]
#: The format version (the low 16 bits of the second word); the loader refuses any other.
VERSION = 1
HEADER = struct.Struct("<4sHHIIII")
MAX_RECORD = 0xffff


class LoadStatus(enum.Enum, shape=4):
    """Outcome of a load: what the hardware loader reports (``LOAD_STATUS``) and the status of
    the :class:`BitstreamError` :func:`read_bitstream` raises for the same bitstream."""

    IDLE = 0           #: nothing loaded since reset
    LOADING = 1        #: a load is under way (or its bitstream ended early)
    OK = 2
    BAD_MAGIC = 3
    BAD_VERSION = 4    #: a format version other than ``VERSION``, or flags other than 0
    BAD_PARAMS = 5     #: the fabric parameter hash differs
    HEADER_CRC = 6
    PAYLOAD_CRC = 7
    BAD_TILE = 8       #: a section for a tile outside the grid or not a CU
    BAD_LENGTH = 9     #: the payload ended inside a section or record
    BAD_ADDRESS = 10   #: a data word for an address that is not in :func:`writable_ranges`
    BAD_ORDER = 11     #: a section not after the previous one in row-major order
    EMPTY = 12         #: a section with no records or a record with no data words
    TRAILING = 13      #: words after the payload the header announces


#: What each :class:`LoadStatus` means (the table in ``docs/bitstream.md``).
LOAD_STATUS_DOC = {
    LoadStatus.IDLE: "nothing loaded since reset",
    LoadStatus.LOADING: "a load is under way; after the last word: the bitstream ended before "
                        "its header or its announced payload did",
    LoadStatus.OK: "every check passed: `START` may run",
    LoadStatus.BAD_MAGIC: "the first word is not `RDAB`",
    LoadStatus.BAD_VERSION: "a format version other than 1, or flags other than 0",
    LoadStatus.BAD_PARAMS: "the parameter hash is not the fabric's",
    LoadStatus.HEADER_CRC: "the header CRC does not match the header",
    LoadStatus.PAYLOAD_CRC: "the payload CRC does not match the payload",
    LoadStatus.BAD_TILE: "a section for a tile outside the grid or not a CU",
    LoadStatus.BAD_LENGTH: "the payload ends inside a section or a record",
    LoadStatus.BAD_ADDRESS: "a data word for an address a CU cannot be configured at",
    LoadStatus.BAD_ORDER: "a section not after the previous one in row-major order (a second "
                          "section for a tile included)",
    LoadStatus.EMPTY: "a section with no records, or a record with no data words",
    LoadStatus.TRAILING: "words after the payload the header announces",
}


class BitstreamError(ValueError):
    """A bitstream or configuration that cannot be loaded; the message names the problem.

    Members
    -------
    status : LoadStatus or None
        What the hardware loader reports for the same bitstream; ``None`` for a configuration
        the writer refuses and for a file that is not a whole number of words (which the host
        cannot send).
    """

    def __init__(self, message, *, status=None):
        super().__init__(message)
        self.status = status


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


def writable_ranges(params):
    """The addresses of a CU's configuration space a bitstream may write, as half-open
    ``(start, stop)`` ranges: the program (two words an instruction), the initial registers,
    ``CONTROL`` and the local buffer. The reader and the hardware loader both refuse any
    other address."""
    cu = params.cu
    return ((CU_MAP.PROGRAM, CU_MAP.PROGRAM + 2 * cu.prog_len),
            (CU_MAP.REGS, CU_MAP.REGS + cu.regs),
            (CU_MAP.CONTROL, CU_MAP.CONTROL + 1),
            (CU_MAP.LOCAL, CU_MAP.LOCAL + cu.lanes * cu.local_words))


def file_words(data):
    """The 32-bit words the host sends the loader for the bitstream file ``data``.

    Raises
    ------
    BitstreamError
        If ``data`` is not a whole number of words (its last word could not be sent).
    """
    if len(data) % 4:
        raise BitstreamError(f"Bitstream is {len(data)} bytes, not a whole number of 32-bit "
                             f"words")
    return list(struct.unpack(f"<{len(data) // 4}I", data))


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

    The checks are those of the hardware loader, in its order (``docs/bitstream.md``): the
    first that fails raises, with the :class:`LoadStatus` the loader reports for it.

    Raises
    ------
    BitstreamError
        Bad magic, not a whole number of words, a truncated header or payload, a header CRC
        mismatch, an unknown version or flags, parameters that do not match the fabric, a
        payload CRC mismatch, a tile outside the grid or not a CU, sections out of row-major
        order, an empty section or record, an address a CU cannot be configured at, a payload
        ending inside a section, words after the payload.
    """
    if len(data) >= 4 and data[:4] != MAGIC:
        raise BitstreamError(f"Bad magic {bytes(data[:4])!r}: not an rdakit bitstream "
                             f"(expected {MAGIC!r})", status=LoadStatus.BAD_MAGIC)
    words = file_words(data)
    if len(data) < HEADER.size:
        raise BitstreamError(f"Bitstream is truncated: {len(data)} bytes, shorter than the "
                             f"{HEADER.size}-byte header", status=LoadStatus.LOADING)
    magic, version, flags, phash, length, crc, hcrc = HEADER.unpack_from(data)
    if zlib.crc32(data[:20]) != hcrc:
        raise BitstreamError("Header CRC mismatch: the header is corrupted",
                             status=LoadStatus.HEADER_CRC)
    if version != VERSION:
        raise BitstreamError(f"Unknown bitstream format version {version} (this rdakit reads "
                             f"version {VERSION})", status=LoadStatus.BAD_VERSION)
    if flags != 0:
        raise BitstreamError(f"Unknown bitstream flags {flags:#06x} (version {VERSION} has "
                             f"none: 0)", status=LoadStatus.BAD_VERSION)
    if phash != params_hash(params):
        raise BitstreamError(f"Bitstream was built for other fabric parameters (hash "
                             f"{phash:#010x}, this fabric {params_hash(params):#010x})",
                             status=LoadStatus.BAD_PARAMS)
    n_header = HEADER.size // 4
    held = len(words) - n_header
    if held < length:
        raise BitstreamError(f"Bitstream is truncated: the header announces {length} payload "
                             f"words, the file holds {held}", status=LoadStatus.LOADING)
    payload = words[n_header:n_header + length]
    body = data[HEADER.size:HEADER.size + 4 * length]
    if zlib.crc32(body) != crc:
        raise BitstreamError(f"Payload CRC mismatch: computed {zlib.crc32(body):#010x}, header "
                             f"says {crc:#010x}", status=LoadStatus.PAYLOAD_CRC)
    config = _parse(payload, params)
    if held > length:
        raise BitstreamError(f"Bitstream has {held - length} words after its payload (the "
                             f"header announces {length} payload words, the file holds {held})",
                             status=LoadStatus.TRAILING)
    return config


def _address_error(where, a, params):
    """The message for a data word at ``a``, which is not in :func:`writable_ranges`."""
    cu = params.cu
    if CU_MAP.PROGRAM + 2 * cu.prog_len <= a < CU_MAP.REGS:
        return f"{where}: program of more than {cu.prog_len} instructions (prog_len)"
    if CU_MAP.REGS + cu.regs <= a < CU_MAP.CONTROL:
        return f"{where}: register r{a - CU_MAP.REGS} does not exist (regs = {cu.regs})"
    if CU_MAP.LOCAL + cu.lanes * cu.local_words <= a <= 0xffff:
        return (f"{where}: local word {(a - CU_MAP.LOCAL) // cu.lanes} is outside the local "
                f"buffer ({cu.local_words} words)")
    return (f"{where}: address {a:#06x} is not a writable word of a compute unit's "
            f"configuration space (program, registers, CONTROL, local buffer)")


def _parse(words, params):
    """The payload's configuration, checked word by word in the loader's order: the first
    word that breaks a rule raises (a payload ending early is found at its last word)."""
    tiles = {}
    pos = 0
    lanes = params.cu.lanes
    ranges = writable_ranges(params)
    previous = None

    def next_word(what):
        nonlocal pos
        if pos == len(words):
            raise BitstreamError(f"The payload ends inside {what}", status=LoadStatus.BAD_LENGTH)
        pos += 1
        return words[pos - 1]

    while pos < len(words):
        head = next_word("a section")
        y, x, nrec = head >> 24, (head >> 16) & 0xff, head & 0xffff
        where = f"tile ({x}, {y})"
        if not (0 <= x < params.cols and 0 <= y < params.rows):
            raise BitstreamError(f"{where} is outside the {params.rows}x{params.cols} grid",
                                 status=LoadStatus.BAD_TILE)
        if params.kind(x, y) != "C":
            raise BitstreamError(f"{where} is a memory unit; only compute units take programs",
                                 status=LoadStatus.BAD_TILE)
        if previous == (x, y):
            raise BitstreamError(f"{where} has a second section (one section a tile)",
                                 status=LoadStatus.BAD_ORDER)
        if previous is not None and (y, x) < (previous[1], previous[0]):
            raise BitstreamError(f"{where} comes after tile {previous}: sections must be in "
                                 f"row-major order, one a tile", status=LoadStatus.BAD_ORDER)
        if nrec == 0:
            raise BitstreamError(f"{where}: a section with no records",
                                 status=LoadStatus.EMPTY)
        previous = (x, y)
        tile = TileConfig(enabled=False)
        program = {}
        for _ in range(nrec):
            rec = next_word(f"a record header of {where}")
            addr, count = rec >> 16, rec & 0xffff
            if count == 0:
                raise BitstreamError(f"{where}: a record at {addr:#06x} with no words",
                                     status=LoadStatus.EMPTY)
            for a in range(addr, addr + count):
                v = next_word(f"a record of {where}")
                if not any(lo <= a < hi for lo, hi in ranges):
                    raise BitstreamError(_address_error(where, a, params),
                                         status=LoadStatus.BAD_ADDRESS)
                if a == CU_MAP.CONTROL:
                    tile.enabled = bool(v & 1)
                elif a >= CU_MAP.LOCAL:
                    w, lane = divmod(a - CU_MAP.LOCAL, lanes)
                    tile.local.setdefault(w, [0] * lanes)[lane] = v
                elif a >= CU_MAP.REGS:
                    tile.regs[a - CU_MAP.REGS] = v
                else:
                    program[a - CU_MAP.PROGRAM] = v
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
            # Any word loads; one that is no instruction halts the CU when it runs.
            try:
                text = disassemble_one(decode(w))
            except ValueError as e:
                text = f"(not an instruction: {e})"
            out.append(f"  {pc:4d}: {w:016x}  {text}")
        for r, v in sorted(tile.regs.items()):
            out.append(f"  r{r} = {v}")
        for w, lanes in sorted(tile.local.items()):
            values = np.asarray(lanes, dtype=np.uint32).astype(np.int32).tolist()
            out.append(f"  local[{w}] = {values}")
    return "\n".join(out)
