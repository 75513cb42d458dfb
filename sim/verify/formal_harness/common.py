"""What the harnesses share: counting bits, a stream source, picking a broken variant."""

import functools

from amaranth.asserts import AnySeq
from amaranth.hdl import Assume, Const, Signal

__all__ = ["popcount", "stream_source", "variant"]


def variant(variants, fault):
    """The class ``variants[fault]``: the design under proof (``fault=None``) or one of its
    broken variants.

    Raises
    ------
    TypeError
        If ``fault`` is not a key of ``variants``.
    """
    if fault not in variants:
        names = ", ".join(repr(k) for k in variants if k is not None)
        raise TypeError(f"Fault must be one of {names}, not {fault!r}")
    return variants[fault]


def refuses_unknown(variants):
    """Decorate a harness builder ``f(fault=None)`` so that an unknown ``fault`` is refused
    before anything is built: a harness constructed and then dropped by the error would warn
    ``UnusedElaboratable`` later, in whatever test the garbage collector happens to run."""
    def decorate(build):
        @functools.wraps(build)
        def checked(fault=None):
            variant(variants, fault)
            return build(fault)
        return checked
    return decorate


def popcount(bits):
    total = Const(0, 1)
    for b in bits:
        total = total + b
    return total



def stream_source(m, port):
    """Drive the stream ``port`` (valid, payload) with anything that follows the stream rules:
    once valid, valid and payload hold until ready."""
    size = len(port.payload.as_value())
    m.d.comb += [port.valid.eq(AnySeq(1)), port.payload.eq(AnySeq(size))]
    waiting, last = Signal(), Signal(size)
    m.d.sync += [waiting.eq(port.valid & ~port.ready), last.eq(port.payload)]
    with m.If(waiting):
        m.d.comb += Assume(port.valid & (port.payload.as_value() == last))

