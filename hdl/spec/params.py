"""Parameter sets of rdakit's hardware, validated once and shared by RTL, models and compiler.

A parameter set is a frozen dataclass: it is hashable (so packet layouts derived from it can be
cached), it validates itself on construction with an error that names the offending parameter,
and it exposes the widths every other part of the project derives from it.
"""

import dataclasses
import enum

from amaranth.utils import ceil_log2, exact_log2

__all__ = ["AllocMode", "RefcountMode", "MUParams", "PLASTICINE_MU", "CUParams", "FabricParams",
           "fabric_params", "CLUSTERS"]


class AllocMode(enum.Enum):
    """How a memory unit places buffers in its scratchpad.

    ``VIRTUAL``
        Buffer-level virtualization (the seed paper): fixed-size blocks taken from a free list
        on the first touch of a virtual block, mapped through a block table.
    ``RESERVE``
        Baseline: a contiguous reservation of ``reserve_words``; a buffer that outgrows its region
        moves to a region twice as large (or as large as needed), copying its words one per cycle.
    ``SINGLE``
        Baseline: one live buffer per MU, owning the whole scratchpad.
    """

    VIRTUAL = "virtual"
    RESERVE = "reserve"
    SINGLE = "single"


class RefcountMode(enum.Enum):
    """How a memory unit decides when a shared buffer may be reclaimed.

    ``WEIGHTED``
        Partial-free (weighted reference counting): ``RETURN`` adds weight to the collected weight
        and the buffer is freed when it reaches the total; ``ADD_WEIGHT`` raises the total.
    ``COUNTER``
        Baseline: a reference counter with ``INCREF`` / ``DECREF``, freed at zero. Every update is
        acknowledged; whether a requester waits for the acknowledgement ("gating") is up to it.
    """

    WEIGHTED = "weighted"
    COUNTER = "counter"


def _check_int(name, value, *, minimum=1, maximum=None):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise TypeError(f"{name} must be an integer {bound}, not {value!r}")


def _check_pow2(name, value, *, minimum=1):
    _check_int(name, value, minimum=minimum)
    if value & (value - 1):
        raise TypeError(f"{name} must be a power of two, not {value!r}")


@dataclasses.dataclass(frozen=True)
class MUParams:
    """Parameters of a memory unit (MU) and of the packets that address it.

    Parameters
    ----------
    words : int
        Scratchpad size in words; a power of two.
    block_words : int
        Words per block (the unit of virtualization); a power of two dividing ``words``.
    max_buffers : int
        Buffer slots (live buffers at once); a power of two.
    max_buffer_words : int or None
        Largest buffer one MU can hold, a power of two between ``block_words`` and ``words``;
        ``None`` means ``words``. It sizes the block table
        (``max_buffers * max_buffer_words / block_words`` entries).
    weight_bits : int
        Width of total and collected weights (and of the counter in ``COUNTER`` mode).
    mu_id_bits : int
        Width of the MU ID in a reference.
    buf_id_bits : int
        Width of the buffer ID in a reference: ``log2(max_buffers)`` slot bits plus generation
        bits (at least one), which make a reference to a freed buffer stale even after its slot
        is reused.
    index_bits : int
        Width of the index field of a request; at least ``log2(max_buffer_words)``.
    data_bits : int
        Word width of the scratchpad and of the data field of packets.
    tag_bits : int
        Width of the requester's tag, echoed in the response.
    coord_bits : int
        Width of each tile coordinate (x and y) of the requester, echoed in the response.
    alloc_mode : AllocMode
        Virtualization or one of the baselines.
    refcount : RefcountMode
        Partial-free or the counter baseline.
    reserve_words : int or None
        Initial reservation of a buffer in ``RESERVE`` mode; a power of two between 1 and
        ``max_buffer_words``. ``None`` means ``block_words``.
    cluster_bits : int
        Width of the cluster ID (0 to 8) in a requester's address (``src`` of a request,
        ``dst`` of a response, :func:`~rdakit.hdl.spec.packets.node_layout`). 0, the default, is a
        single fabric and leaves every packet as it was; in a system of clusters
        (``docs/clusters.md``) the MU ID also holds the cluster above the coordinates.

    Raises
    ------
    TypeError
        If a parameter has the wrong type or is out of its range.
    ValueError
        If parameters are individually valid but inconsistent with each other.
    """

    words: int = 1024
    block_words: int = 16
    max_buffers: int = 8
    max_buffer_words: int | None = None
    weight_bits: int = 8
    mu_id_bits: int = 6
    buf_id_bits: int = 8
    index_bits: int = 16
    data_bits: int = 32
    tag_bits: int = 8
    coord_bits: int = 3
    alloc_mode: AllocMode = AllocMode.VIRTUAL
    refcount: RefcountMode = RefcountMode.WEIGHTED
    reserve_words: int | None = None
    cluster_bits: int = 0

    def __post_init__(self):
        if isinstance(self.alloc_mode, str):
            object.__setattr__(self, "alloc_mode", _enum_value(AllocMode, "alloc_mode",
                                                               self.alloc_mode))
        if isinstance(self.refcount, str):
            object.__setattr__(self, "refcount", _enum_value(RefcountMode, "refcount",
                                                             self.refcount))
        if not isinstance(self.alloc_mode, AllocMode):
            raise TypeError(f"alloc_mode must be an AllocMode, not {self.alloc_mode!r}")
        if not isinstance(self.refcount, RefcountMode):
            raise TypeError(f"refcount must be a RefcountMode, not {self.refcount!r}")
        _check_pow2("words", self.words, minimum=2)
        _check_pow2("block_words", self.block_words)
        _check_pow2("max_buffers", self.max_buffers)
        if self.max_buffer_words is None:
            object.__setattr__(self, "max_buffer_words", self.words)
        _check_pow2("max_buffer_words", self.max_buffer_words)
        if self.reserve_words is None:
            object.__setattr__(self, "reserve_words", self.block_words)
        _check_pow2("reserve_words", self.reserve_words)
        _check_int("weight_bits", self.weight_bits, maximum=32)
        _check_int("mu_id_bits", self.mu_id_bits, maximum=16)
        _check_int("buf_id_bits", self.buf_id_bits, maximum=32)
        _check_int("index_bits", self.index_bits, maximum=32)
        _check_int("data_bits", self.data_bits, minimum=8, maximum=1024)
        _check_int("tag_bits", self.tag_bits, minimum=0, maximum=32)
        _check_int("coord_bits", self.coord_bits, maximum=8)
        _check_int("cluster_bits", self.cluster_bits, minimum=0, maximum=8)
        if self.block_words >= self.words:
            raise ValueError(f"block_words must be less than words ({self.words}), "
                             f"not {self.block_words!r}")
        if not self.block_words <= self.max_buffer_words <= self.words:
            raise ValueError(f"max_buffer_words must be between block_words "
                             f"({self.block_words}) and words ({self.words}), "
                             f"not {self.max_buffer_words!r}")
        if self.reserve_words > self.max_buffer_words:
            raise ValueError(f"reserve_words must be at most max_buffer_words "
                             f"({self.max_buffer_words}), not {self.reserve_words!r}")
        if self.buf_id_bits <= self.slot_bits:
            raise ValueError(f"buf_id_bits must exceed log2(max_buffers) = {self.slot_bits} "
                             f"to leave room for generation bits, not {self.buf_id_bits!r}")
        if self.index_bits < exact_log2(self.max_buffer_words):
            raise ValueError(f"index_bits must be at least log2(max_buffer_words) = "
                             f"{exact_log2(self.max_buffer_words)}, not {self.index_bits!r}")
        if self.weight_bits > self.data_bits:
            raise ValueError(f"weight_bits must be at most data_bits ({self.data_bits}), "
                             f"not {self.weight_bits!r}")
        if self.length_bits > self.data_bits:
            raise ValueError(f"data_bits must hold a buffer length ({self.length_bits} bits), "
                             f"not {self.data_bits!r}")

    def replace(self, **changes):
        """Return a copy with some parameters changed (and validated again).

        ``max_buffer_words`` and ``reserve_words`` that still have their derived values
        (``words`` and ``block_words``) are derived again from the new parameters.
        """
        if "max_buffer_words" not in changes and self.max_buffer_words == self.words:
            changes["max_buffer_words"] = None
        if "reserve_words" not in changes and self.reserve_words == self.block_words:
            changes["reserve_words"] = None
        return dataclasses.replace(self, **changes)

    # Derived widths. Each is the single definition the RTL, the models and the docs use.

    @property
    def n_blocks(self):
        """Physical blocks in the scratchpad."""
        return self.words // self.block_words

    @property
    def max_vblocks(self):
        """Virtual blocks of the largest buffer."""
        return self.max_buffer_words // self.block_words

    @property
    def slot_bits(self):
        """Bits of a buffer ID that select its slot (the low bits)."""
        return exact_log2(self.max_buffers)

    @property
    def gen_bits(self):
        """Generation bits of a buffer ID (the high bits)."""
        return self.buf_id_bits - self.slot_bits

    @property
    def addr_bits(self):
        """Bits of a physical word address."""
        return exact_log2(self.words)

    @property
    def offset_bits(self):
        """Bits of a word offset inside a block."""
        return exact_log2(self.block_words)

    @property
    def block_bits(self):
        """Bits of a physical block number (at least 1)."""
        return max(1, exact_log2(self.n_blocks))

    @property
    def vblock_bits(self):
        """Bits of a virtual block number (at least 1)."""
        return max(1, exact_log2(self.max_vblocks))

    @property
    def length_bits(self):
        """Bits of a buffer length (0 to ``max_buffer_words`` inclusive)."""
        return exact_log2(self.max_buffer_words) + 1

    @property
    def n_orders(self):
        """Size classes of the reserve-and-copy allocator: ``reserve_words * 2**k`` words."""
        return exact_log2(self.max_buffer_words // self.reserve_words) + 1

    @property
    def max_weight(self):
        """Largest total weight (or count) a buffer can have."""
        return (1 << self.weight_bits) - 1


def _enum_value(cls, name, value):
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise TypeError(f"{name} must be one of {choices}, not {value!r}") from None


#: The sizing of the seed paper, from Plasticine: a 256 KB MU of 4-byte words (64K words,
#: 16-bit physical block+offset), 64 MUs (6-bit MU ID), 16-bit buffer IDs and 16-bit virtual
#: block+offset. 256 buffer slots leave 8 generation bits in the 16-bit buffer ID.
PLASTICINE_MU = MUParams(words=65536, block_words=256, max_buffers=256, weight_bits=16,
                         mu_id_bits=6, buf_id_bits=16, index_bits=16, data_bits=32)


@dataclasses.dataclass(frozen=True)
class CUParams:
    """Parameters of a compute unit (CU). See ``docs/compute-unit.md``.

    Parameters
    ----------
    lanes : int
        SIMD lanes of 32-bit integers; a vector word (one MU word) holds ``lanes`` elements, so
        the fabric's ``data_bits`` is ``32 * lanes``. A power of two from 1 to 16.
    prog_len : int
        Instructions a CU's program memory holds (4 to 4096).
    regs : int
        Scalar registers (a power of two from 4 to 16).
    local_words : int
        Vector words of the CU's local buffer (a power of two from 1 to 65536).
    outstanding : int
        READ requests a stream may have in flight (1 to 256); also the depth of the response
        buffer, so responses can always be accepted.
    channels : int
        Token channels (counters) per CU (1 to 16).
    mailbox : int
        Reference mailbox slots per CU (1 to 16).
    queue_words : int
        Depth of the input queue another CU's stream sends words into (``DMode.QUEUE``), and
        so the credits a producer starts with (1 to 1024).

    Raises
    ------
    TypeError
        If a parameter has the wrong type or is out of its range.
    """

    lanes: int = 4
    prog_len: int = 64
    regs: int = 16
    local_words: int = 64
    outstanding: int = 16
    channels: int = 8
    mailbox: int = 4
    queue_words: int = 16

    def __post_init__(self):
        _check_pow2("lanes", self.lanes)
        if self.lanes > 16:
            raise TypeError(f"lanes must be a power of two from 1 to 16, not {self.lanes!r}")
        _check_int("prog_len", self.prog_len, minimum=4, maximum=4096)
        _check_pow2("regs", self.regs, minimum=4)
        if self.regs > 16:
            raise TypeError(f"regs must be a power of two from 4 to 16, not {self.regs!r}")
        _check_pow2("local_words", self.local_words)
        if self.local_words > 65536:
            raise TypeError(f"local_words must be a power of two from 1 to 65536, "
                            f"not {self.local_words!r}")
        if self.local_words * self.lanes > 0x8000:
            raise ValueError(f"local_words must be at most {0x8000 // self.lanes} with "
                             f"{self.lanes} lanes (the configuration space holds 32768 local "
                             f"elements), not {self.local_words!r}")
        _check_int("outstanding", self.outstanding, maximum=256)
        _check_int("channels", self.channels, maximum=16)
        _check_int("mailbox", self.mailbox, maximum=16)
        _check_int("queue_words", self.queue_words, maximum=1024)

    def replace(self, **changes):
        """Return a copy with some parameters changed (and validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def data_bits(self):
        """Width of a vector word: 32 bits a lane."""
        return 32 * self.lanes


@dataclasses.dataclass(frozen=True)
class FabricParams:
    """Parameters of a fabric: an R x C grid of tiles, each a router and a CU or an MU.

    Parameters
    ----------
    rows, cols : int
        Grid size, 1 to 16 each (``coord_bits`` must hold them).
    layout : str or None
        One character a tile, rows separated by ``/``: ``C`` a compute unit, ``M`` a memory
        unit; ``None`` is a checkerboard with a CU at (0, 0) (``(x + y) % 2 == 0`` is a CU).
        At least one CU and one MU.
    cu : CUParams
        Every CU's parameters.
    mu : MUParams
        Every MU's parameters. Its ``data_bits`` must be ``32 * cu.lanes``, its ``mu_id_bits``
        ``2 * coord_bits + cluster_bits`` (an MU's ID is its cluster and coordinates,
        ``cluster << 2 * coord_bits | y << coord_bits | x``; the cluster is 0 in a lone
        fabric), and its ``coord_bits`` must hold ``rows - 1`` and ``cols - 1``.
    noc_depth : int
        Depth of each router input queue.
    noc_queues : str
        ``"voq"`` (per-output input queues) or ``"fifo"``.

    Raises
    ------
    TypeError, ValueError
        If a parameter is invalid or the parameters are inconsistent; the message names them.
    """

    rows: int = 2
    cols: int = 2
    layout: str | None = None
    cu: CUParams = dataclasses.field(default_factory=CUParams)
    mu: MUParams = dataclasses.field(default_factory=lambda: MUParams(
        words=1024, block_words=16, max_buffers=16, buf_id_bits=8, data_bits=128,
        mu_id_bits=6, coord_bits=3, index_bits=16))
    noc_depth: int = 2
    noc_queues: str = "voq"

    def __post_init__(self):
        _check_int("rows", self.rows, maximum=16)
        _check_int("cols", self.cols, maximum=16)
        if not isinstance(self.cu, CUParams):
            raise TypeError(f"cu must be a CUParams, not {self.cu!r}")
        if not isinstance(self.mu, MUParams):
            raise TypeError(f"mu must be an MUParams, not {self.mu!r}")
        _check_int("noc_depth", self.noc_depth, maximum=64)
        if self.noc_queues not in ("voq", "fifo"):
            raise TypeError(f"noc_queues must be 'voq' or 'fifo', not {self.noc_queues!r}")
        cb = self.mu.coord_bits
        if max(self.rows, self.cols) > (1 << cb):
            raise ValueError(f"mu.coord_bits ({cb}) must hold rows ({self.rows}) and cols "
                             f"({self.cols})")
        want = 2 * cb + self.mu.cluster_bits
        if self.mu.mu_id_bits != want:
            raise ValueError(f"mu.mu_id_bits must be 2 * coord_bits + cluster_bits = {want}, "
                             f"not {self.mu.mu_id_bits!r}")
        if self.mu.data_bits != self.cu.data_bits:
            raise ValueError(f"mu.data_bits must be 32 * cu.lanes = {self.cu.data_bits}, "
                             f"not {self.mu.data_bits!r}")
        if self.mu.mu_id_bits + self.mu.buf_id_bits > 32:
            raise ValueError(f"mu.mu_id_bits + mu.buf_id_bits must be at most 32 (a CU register "
                             f"holds a reference), not {self.mu.mu_id_bits + self.mu.buf_id_bits}")
        if self.mu.tag_bits < 4:
            raise ValueError(f"mu.tag_bits must be at least 4 (the fabric reserves the top "
                             f"bit for the host), not {self.mu.tag_bits!r}")
        grid = self.grid
        kinds = {k for row in grid for k in row}
        if "C" not in kinds or "M" not in kinds:
            raise ValueError(f"layout must have at least one CU (C) and one MU (M), "
                             f"not {self.layout!r}")

    def replace(self, **changes):
        """Return a copy with some parameters changed (and validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def grid(self):
        """The layout as a list of rows of ``"C"``/``"M"``."""
        if self.layout is None:
            return [["C" if (x + y) % 2 == 0 else "M" for x in range(self.cols)]
                    for y in range(self.rows)]
        if not isinstance(self.layout, str):
            raise TypeError(f"layout must be a string like 'CM/MC', not {self.layout!r}")
        rows = self.layout.split("/")
        if len(rows) != self.rows or any(len(r) != self.cols for r in rows) \
                or set("".join(rows)) - {"C", "M"}:
            raise ValueError(f"layout must be {self.rows} rows of {self.cols} characters C or "
                             f"M separated by '/', not {self.layout!r}")
        return [list(r) for r in rows]

    @property
    def coord_bits(self):
        return self.mu.coord_bits

    def kind(self, x, y):
        """``"C"`` or ``"M"``: what the tile at column ``x``, row ``y`` holds."""
        return self.grid[y][x]

    def tiles(self, kind=None):
        """``(x, y)`` of every tile (of one kind), row by row."""
        return [(x, y) for y in range(self.rows) for x in range(self.cols)
                if kind is None or self.grid[y][x] == kind]

    def tile_mask(self, kind):
        """The layout as a constant table: bit ``y << coord_bits | x`` set for every tile of
        ``kind`` ("C" or "M"). The sequencer and the host port check a destination with it."""
        return sum(1 << (y << self.coord_bits | x) for x, y in self.tiles(kind))

    @property
    def cluster_bits(self):
        return self.mu.cluster_bits

    def mu_id(self, x, y, cluster=0):
        """The MU ID of the tile at ``(x, y)`` of cluster ``cluster``:
        ``cluster << 2 * coord_bits | y << coord_bits | x``."""
        if not isinstance(cluster, int) or not 0 <= cluster < (1 << self.cluster_bits):
            raise ValueError(f"cluster must be an integer from 0 to "
                             f"{(1 << self.cluster_bits) - 1} (cluster_bits = "
                             f"{self.cluster_bits}), not {cluster!r}")
        return (cluster << (2 * self.coord_bits)) | (y << self.coord_bits) | x

    def mu_coords(self, mu_id):
        """The ``(x, y)`` of the MU with ID ``mu_id`` inside its cluster."""
        mask = (1 << self.coord_bits) - 1
        return mu_id & mask, (mu_id >> self.coord_bits) & mask

    def mu_cluster(self, mu_id):
        """The cluster of the MU with ID ``mu_id`` (0 in a lone fabric)."""
        return mu_id >> (2 * self.coord_bits)


#: The cluster counts a system of clusters may have: an MU ID holds its cluster in at most 8 bits
#: (``MUParams.cluster_bits``), so 1 to 256. Every command taking ``--clusters`` checks this range.
CLUSTERS = range(1, (1 << 8) + 1)


def fabric_params(rows=2, cols=2, *, layout=None, lanes=4, prog_len=64, local_words=64,
                  outstanding=16, mu_words=1024, block_words=16, max_buffers=16,
                  weight_bits=8, alloc_mode="virtual", refcount="weighted", noc_depth=2,
                  noc_queues="voq", cluster_bits=0, coord_bits=None, queue_words=16):
    """A consistent :class:`FabricParams` from the few numbers people choose: the MU word is
    ``32 * lanes`` bits, MU IDs are ``2 * coord_bits + cluster_bits`` bits, coordinates hold
    the grid (``cluster_bits`` > 0 for a cluster of a system, ``docs/clusters.md``);
    ``coord_bits`` may ask for wider coordinates than the grid needs."""
    if coord_bits is None:
        coord_bits = max(1, ceil_log2(max(rows, cols)))
    mu = MUParams(words=mu_words, block_words=block_words, max_buffers=max_buffers,
                  buf_id_bits=max(ceil_log2(max_buffers) + 4, 8), weight_bits=weight_bits,
                  data_bits=32 * lanes, mu_id_bits=2 * coord_bits + cluster_bits,
                  coord_bits=coord_bits, index_bits=16, alloc_mode=alloc_mode, refcount=refcount,
                  cluster_bits=cluster_bits)
    cu = CUParams(lanes=lanes, prog_len=prog_len, local_words=local_words,
                  outstanding=outstanding, queue_words=queue_words)
    return FabricParams(rows=rows, cols=cols, layout=layout, cu=cu, mu=mu,
                        noc_depth=noc_depth, noc_queues=noc_queues)
