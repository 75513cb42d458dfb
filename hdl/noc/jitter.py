"""Random link stalls for race testing: one pseudo-random stall bit per NoC link.

A :class:`~rdakit.hdl.noc.mesh.Mesh` built with ``jitter=True`` puts a stall gate on every link
(router to router, and every tile's injection and ejection port). Each gate has its own 32-bit
xorshift generator; in a cycle where the low byte of its state is below ``rate`` the link
transfers nothing. Stalls delay flits by random amounts and let traffic on different paths
overtake each other, which is what the race tests of ``docs/race.md`` need; they never drop,
duplicate or reorder a flit on one path, because a gate lowers the handshake of its link for
the whole cycle (see :class:`~rdakit.hdl.noc.mesh.Mesh`).

While ``rate`` is 0 no link stalls and every generator holds ``seed ^ salt`` (its own constant
``salt``; the salt alone if that is 0, since xorshift stays at 0): a testbench sets ``seed``
with ``rate`` at 0, then raises ``rate`` to start a new, reproducible random scenario on the
same build. :func:`stall_sequence` is the Python model of one gate.
"""

import random

from amaranth.hdl import Mux, Signal

__all__ = ["xorshift32", "jitter_salt", "add_stall", "stall_sequence", "SEED_BITS",
           "RATE_BITS"]

#: Width of the ``jitter_seed`` input.
SEED_BITS = 32
#: Width of the ``jitter_rate`` input: a link stalls with probability ``rate / 256``.
RATE_BITS = 8


def xorshift32(s):
    """One step of Marsaglia's xorshift32 (13, 17, 5) on a 32-bit value: an Amaranth value, or
    an int for the model."""
    if isinstance(s, int):
        s ^= (s << 13) & 0xffff_ffff
        s ^= s >> 17
        return s ^ ((s << 5) & 0xffff_ffff)
    a = s ^ (s << 13)[:32]
    b = a ^ (a >> 17)
    return b ^ (b << 5)[:32]


def jitter_salt(*key):
    """The nonzero 32-bit constant of the gate named by ``key`` (deterministic)."""
    return random.Random(repr(key)).getrandbits(32) or 1


def add_stall(m, *, seed, rate, salt, name):
    """Add a gate's generator to module ``m``; return its stall signal (1 = no transfer this
    cycle). ``seed`` and ``rate`` are the mesh's inputs."""
    state = Signal(SEED_BITS, init=salt, name=f"jit_{name}")
    load = Signal(SEED_BITS, name=f"jit_{name}_load")
    m.d.comb += load.eq(Mux((seed ^ salt) == 0, salt, seed ^ salt))
    with m.If(rate == 0):
        m.d.sync += state.eq(load)
    with m.Else():
        m.d.sync += state.eq(xorshift32(state))
    stall = Signal(name=f"stall_{name}")
    m.d.comb += stall.eq(state[:8] < rate)
    return stall


def stall_sequence(seed, rate, salt, n):
    """The model: the first ``n`` stall bits of a gate after ``rate`` goes from 0 to ``rate``
    (the generator loaded with ``seed`` while it was 0)."""
    s = (seed ^ salt) or salt
    out = []
    for _ in range(n):
        out.append(int((s & 0xff) < rate))
        s = xorshift32(s)
    return out
