"""Parameter sets of rdakit's hardware, validated once and shared by RTL, models and compiler.

A parameter set is a frozen dataclass: it is hashable (so packet layouts derived from it can be
cached), it validates itself on construction with an error that names the offending parameter,
and it exposes the widths every other part of the project derives from it.
"""

import dataclasses
import enum

from amaranth.utils import exact_log2

__all__ = ["AllocMode", "RefcountMode", "MUParams", "PLASTICINE_MU"]


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
        _check_int("data_bits", self.data_bits, minimum=8, maximum=64)
        _check_int("tag_bits", self.tag_bits, minimum=0, maximum=32)
        _check_int("coord_bits", self.coord_bits, maximum=8)
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
