"""Packet layouts: the one definition of every packet that crosses a stream or the NoC.

The RTL, the golden models, the testbenches, the NoC and the compiler all import these. Layouts
depend on a parameter set (field widths), so they are built by cached functions of a frozen
:class:`~rdakit.hdl.spec.params.MUParams`. A :class:`amaranth.lib.data.Struct` places its first
field in the low bits of the flat vector.
"""

import functools

from amaranth.lib import data, enum

from rdakit.hdl.spec.params import MUParams

__all__ = [
    "MUOp", "MUStatus", "OP_DOC", "STATUS_DOC",
    "MsgKind", "STREAM_LAST", "STREAM_CREDIT", "coord_layout", "node_layout", "ref_layout",
    "mu_request_layout",
    "mu_response_layout", "msg_layout", "host_tag_bit", "HostCmd", "HOST_IN_FLIGHT",
    "host_cmd_layout", "host_reply_layout", "pack", "unpack",
]


class MUOp(enum.Enum, shape=4):
    """Operation of a memory-unit request."""

    ALLOC = 0
    WRITE = 1
    APPEND = 2
    READ = 3
    LEN = 4
    RETURN = 5
    ADD_WEIGHT = 6
    INCREF = 7
    DECREF = 8
    FETCH_ADD = 9
    UNLOCK = 10


class MUStatus(enum.Enum, shape=3):
    """Status of a memory-unit response. Anything but ``OK`` means nothing was changed."""

    OK = 0
    OUT_OF_MEMORY = 1
    BAD_REF = 2
    OUT_OF_RANGE = 3
    WEIGHT_OVERFLOW = 4
    BAD_REQUEST = 5
    NOT_OWNER = 6
    BAD_DESTINATION = 7


#: What each operation does: its request fields and its response ``data``. The docs table in
#: ``docs/memory-unit.md`` is generated from this (``rdakit docs``).
OP_DOC = {
    MUOp.ALLOC: ("data = total weight W (initial count in COUNTER mode)",
                 "ref = the new reference; data = W"),
    MUOp.WRITE: ("ref, index, data",
                 "data = index; length becomes max(length, index + 1)"),
    MUOp.APPEND: ("ref, data", "data = the index written (the old length)"),
    MUOp.READ: ("ref, index", "data = the word (0 inside a never-mapped block)"),
    MUOp.LEN: ("ref", "data = length"),
    MUOp.RETURN: ("ref, data = weight w (partial-free)",
                  "data = weight still outstanding; 0 means the buffer was freed"),
    MUOp.ADD_WEIGHT: ("ref, data = k", "data = the new total weight"),
    MUOp.INCREF: ("ref (COUNTER mode)", "data = the new count"),
    MUOp.DECREF: ("ref (COUNTER mode)", "data = the new count; 0 means the buffer was freed"),
    MUOp.FETCH_ADD: ("ref, index, data = k (atomic; locks, barriers)",
                     "data = the old word; the word becomes old + k (mod 2**data_bits)"),
    MUOp.UNLOCK: ("ref, index, data = ticket (release a ticket lock)",
                  "data = the old word; if it equals the ticket the word becomes ticket + 1, "
                  "else NOT_OWNER (data = 0) and nothing changes"),
}

STATUS_DOC = {
    MUStatus.OK: "the operation was applied",
    MUStatus.OUT_OF_MEMORY: "no free block, region or buffer slot",
    MUStatus.BAD_REF: "wrong MU ID, a slot never allocated, or a stale generation (freed)",
    MUStatus.OUT_OF_RANGE: ("READ, FETCH_ADD or UNLOCK at or past the length (FETCH_ADD and "
                            "UNLOCK also in a never-written block), or an index past the "
                            "largest buffer"),
    MUStatus.WEIGHT_OVERFLOW: ("RETURN of more weight than outstanding, a total or count "
                               "past weight_bits, or a weight wider than weight_bits"),
    MUStatus.BAD_REQUEST: ("unknown opcode, an operation of the other reference-counting mode, "
                           "or a zero weight"),
    MUStatus.NOT_OWNER: "UNLOCK with a ticket that is not the one being served",
    MUStatus.BAD_DESTINATION: ("the reference names no MU (a tile that is not an MU, a tile "
                               "off the grid, a cluster that does not exist): answered by the "
                               "fabric's host port or the system's cluster switch, never by an "
                               "MU"),
}


class MsgKind(enum.Enum, shape=2):
    """What a flit of the response ("message") network carries.

    The response network carries only messages its receiver always accepts at once: MU
    responses (to a request the receiver made, with room reserved for it), tokens (a counter
    increment), references (a write into a mailbox slot) and stream words between CUs (a word
    into an input queue the sender holds a credit for, or credits returned: a counter
    increment). So it never backs up into the request network, whatever the request network
    holds.
    """

    RESPONSE = 0   #: an MU response: ``body`` is the response
    TOKEN = 1      #: ``body.tag`` = channel, ``body.data`` = count
    REF = 2        #: ``body.tag`` = mailbox slot, ``body.ref`` = reference, ``body.data`` = weight
    STREAM = 3     #: between CUs' streams (``DMode.QUEUE``): ``body.ref`` = the sender's CU ID,
    #:              ``body.tag`` = flags (:data:`STREAM_LAST`, :data:`STREAM_CREDIT`),
    #:              ``body.data`` = the word for the input queue, or the credits returned


#: ``body.tag`` bit of a STREAM message: the word is the last of its producer's stream.
STREAM_LAST = 1
#: ``body.tag`` bit of a STREAM message: no word; ``body.data`` credits go back to the producer.
STREAM_CREDIT = 2


def host_tag_bit(p: MUParams):
    """The top bit of a request's tag marks requests of the fabric's host port: their responses
    are delivered to the host, not to the unit of the tile the host port shares."""
    return p.tag_bits - 1


@functools.cache
def coord_layout(coord_bits):
    """Tile coordinates ``{x, y}``."""
    return data.StructLayout({"x": coord_bits, "y": coord_bits})


@functools.cache
def node_layout(p: MUParams):
    """The address of a requester: ``{x, y}`` (:func:`coord_layout`) in a lone fabric, and
    ``{x, y, cluster}`` when ``p.cluster_bits`` is not 0. The cluster lies above the
    coordinates, so assigning a node to a flit's ``dst`` keeps ``{x, y}``."""
    if p.cluster_bits == 0:
        return coord_layout(p.coord_bits)
    return data.StructLayout({"x": p.coord_bits, "y": p.coord_bits,
                              "cluster": p.cluster_bits})


@functools.cache
def ref_layout(p: MUParams):
    """A reference: ``{mu, buf}``; ``buf`` holds the slot in its low bits, the generation above.
    In a system of clusters ``mu`` holds the cluster above the MU's coordinates."""
    return data.StructLayout({"mu": p.mu_id_bits, "buf": p.buf_id_bits})


@functools.cache
def mu_request_layout(p: MUParams):
    """A request to a memory unit (one flit on the request network)."""
    return data.StructLayout({
        "op": MUOp,
        "src": node_layout(p),
        "tag": p.tag_bits,
        "ref": ref_layout(p),
        "index": p.index_bits,
        "data": p.data_bits,
    })


@functools.cache
def mu_response_layout(p: MUParams):
    """A response of a memory unit (one flit on the response network)."""
    return data.StructLayout({
        "op": MUOp,
        "status": MUStatus,
        "dst": node_layout(p),
        "tag": p.tag_bits,
        "ref": ref_layout(p),
        "data": p.data_bits,
    })


@functools.cache
def msg_layout(p: MUParams):
    """A flit payload of the response network: ``{kind, body}``, ``body`` an MU response."""
    return data.StructLayout({"kind": MsgKind, "body": mu_response_layout(p)})


class HostCmd(enum.Enum, shape=3):
    """Commands of the fabric's host port (``docs/fabric.md``)."""

    LOAD_BEGIN = 0    #: start a bitstream load (no reply)
    LOAD_WORD = 1     #: ``word`` is the next bitstream word (no reply)
    MU_REQUEST = 2    #: send ``req`` to the MU ``req.ref.mu``; the reply's ``resp`` answers it
    CFG_READ = 3      #: reply ``word`` = word ``addr`` of tile (``x``, ``y``)
    START = 4         #: start every enabled CU; reply ``ok`` = 0 if not configured
    STATUS = 5        #: reply ``word`` = status bits (``docs/fabric.md``)
    CYCLES = 6        #: reply ``word`` = cycles of the last run, START to done
    LOAD_STATUS = 7   #: reply ``word`` = LoadStatus | load cycles << 8


#: Replies the host port holds for the host: the depth of its reply queue, and so the commands
#: with a reply that may be outstanding (sent, reply not yet taken). MU requests are pipelined
#: up to this many (``docs/fabric.md``, "Host port"); the host driver keeps its bursts within it.
HOST_IN_FLIGHT = 16


@functools.cache
def host_cmd_layout(p: MUParams):
    """A command on the host port."""
    return data.StructLayout({
        "kind": HostCmd,
        "x": p.coord_bits,
        "y": p.coord_bits,
        "addr": 16,
        "word": 32,
        "req": mu_request_layout(p),
    })


@functools.cache
def host_reply_layout(p: MUParams):
    """A reply of the host port (one per command but LOAD_BEGIN and LOAD_WORD)."""
    return data.StructLayout({
        "kind": HostCmd,
        "ok": 1,
        "word": 32,
        "resp": mu_response_layout(p),
    })


#: The field table of each layout :func:`pack` and :func:`unpack` have seen, by ``id`` (the layout
#: is kept with it, so its ``id`` is never reused): asking an Amaranth layout for its fields and
#: their widths costs microseconds a field, and the host packs and unpacks every command.
_TABLES = {}


def _table(layout):
    """``(name, offset, width, mask, kind, sub)`` per field of ``layout``, built once: ``kind``
    is ``"struct"`` (``sub`` = the nested layout), ``"enum"`` (``sub`` = its members by value)
    or ``None``."""
    entry = _TABLES.get(id(layout))
    if entry is not None and entry[0] is layout:
        return entry[1]
    rows = []
    for name, field in layout:
        shape = field.shape
        if isinstance(shape, data.StructLayout):
            kind, sub = "struct", shape
        elif isinstance(shape, enum.EnumMeta):
            kind, sub = "enum", {member.value: member for member in shape}
        else:
            kind, sub = None, None
        width = field.width
        rows.append((name, field.offset, width, (1 << width) - 1, kind, sub))
    table = tuple(rows)
    _TABLES[id(layout)] = (layout, table)
    return table


def pack(layout, fields):
    """Pack a dict of field values (nested dicts for nested structs, enums as members or
    integers) into the integer a stream carries. Missing fields are zero."""
    value = 0
    for name, offset, width, mask, kind, sub in _table(layout):
        if name not in fields:
            continue
        v = fields[name]
        if kind == "struct":
            v = pack(sub, v) if isinstance(v, dict) else int(v)
        elif isinstance(v, enum.Enum):
            v = v.value
        v = int(v)
        if v < 0 or v > mask:
            raise ValueError(f"Field {name!r} of width {width} cannot hold {v!r}")
        value |= v << offset
    return value


def unpack(layout, value):
    """Unpack an integer into a dict of fields (nested dicts, enum fields as members; an
    encoding outside the enum stays an integer)."""
    out = {}
    for name, offset, _width, mask, kind, sub in _table(layout):
        v = (value >> offset) & mask
        if kind == "struct":
            v = unpack(sub, v)
        elif kind == "enum":
            v = sub.get(v, v)
        out[name] = v
    return out
