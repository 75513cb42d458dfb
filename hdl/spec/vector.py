"""Vector words: ``lanes`` 32-bit elements packed into one MU data word.

Lane ``l`` is in bits ``32*l + 31 : 32*l`` (``docs/compute-unit.md``). Elements are two's
complement: :func:`pack_vector` takes signed or unsigned 32-bit values, :func:`unpack_vector`
gives ``numpy.int32``.
"""

import numpy as np

__all__ = ["pack_vector", "unpack_vector", "vector_lanes", "MASK32"]

MASK32 = 0xffff_ffff


def pack_vector(values):
    """The integer word of a vector.

    Parameters
    ----------
    values : sequence of int
        One element a lane, each between ``-2**31`` and ``2**32 - 1`` (stored modulo
        ``2**32``); numpy integers are accepted.

    Raises
    ------
    ValueError
        If an element does not fit 32 bits.
    """
    word = 0
    for lane, v in enumerate(values):
        v = int(v)
        if not -(1 << 31) <= v <= MASK32:
            raise ValueError(f"Lane {lane} of a vector must fit 32 bits, not {v!r}")
        word |= (v & MASK32) << (32 * lane)
    return word


def vector_lanes(word, lanes):
    """The lanes of a vector word as a list of unsigned 32-bit integers."""
    return [(word >> (32 * lane)) & MASK32 for lane in range(lanes)]


def unpack_vector(word, lanes):
    """The lanes of a vector word as a ``numpy.int32`` array of shape ``(lanes,)``.

    Raises
    ------
    ValueError
        If ``word`` is negative or wider than ``32 * lanes`` bits.
    """
    word = int(word)
    if word < 0 or word >> (32 * lanes):
        raise ValueError(f"A vector word of {lanes} lanes must be an integer between 0 and "
                         f"2**{32 * lanes} - 1, not {word!r}")
    return np.array(vector_lanes(word, lanes), dtype=np.uint32).view(np.int32)
