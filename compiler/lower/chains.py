"""Elementwise chains: the stream passes an elementwise op (or a fused run of them) becomes.

A chain is a list of :class:`Stage` (one stream pass each: ``post(fn(a, b) >> shift)``);
:func:`append_stage` adds a stage or a :class:`Clip` to it, folding shifts, ReLUs and clips
into the stage before when that gives the same values (see the Lowering section of
``docs/compiler.md``).
"""

import dataclasses

from rdakit.compiler.lower.layout import MASK32
from rdakit.hdl.spec.isa import SAT8_MAX, SAT8_MIN, AluFn, Post, alu, post

__all__ = ["Stage", "Clip", "append_stage", "chain_zero"]

@dataclasses.dataclass(frozen=True)
class Stage:
    """One stream pass of an elementwise chain: ``post(fn(a, b) >> shift)`` (``post``: ReLU
    if ``relu``, then saturation to int8 if ``sat``, :func:`~rdakit.hdl.spec.isa.post`);
    ``imm`` is the scalar second operand (None: zero, or the chain's tensor operand for the
    first stage)."""

    fn: AluFn
    imm: int | None = None
    shift: int = 0
    relu: bool = False
    tensor: bool = False
    sat: bool = False


@dataclasses.dataclass(frozen=True)
class Clip:
    """Clamp to ``[lo, hi]`` (becomes one or two MAX/MIN stages, or folds into the stage
    before)."""

    lo: int
    hi: int


def fits32(v):
    """Whether ``v`` is a signed 32-bit value."""
    return -(1 << 31) <= v < (1 << 31)


def append_stage(stages, s):
    """Append stage (or clip) ``s`` to a chain, fusing what can be fused (see the Lowering
    section of docs/compiler.md)."""
    last = stages[-1] if stages else None
    if isinstance(s, Clip):
        lo, hi = s.lo, s.hi
        if last is not None and hi == SAT8_MAX and lo in (SAT8_MIN, 0):
            # The int8 range (or its ReLU half) after any stage is the stage's saturation:
            # clip(v, -128, 127) = sat(v), clip(v, 0, 127) = sat(relu(v)).
            stages[-1] = dataclasses.replace(last, relu=last.relu or lo == 0, sat=True)
            return stages
        if (last is not None and last.fn is AluFn.PASS and not last.tensor and not last.sat
                and not (last.relu and hi < 0)):
            # clip(v >> k) = min(max(v, lo << k), hi << k) >> k (floor is monotonic); after a
            # ReLU (and hi >= 0) the lower bound is 0 if lo <= 0, and the ReLU is moot if lo > 0.
            k = last.shift
            big_l, big_h = lo << k, hi << k
            if fits32(big_l) and fits32(big_h):
                if lo == 0 or (last.relu and lo < 0):
                    stages[-1] = Stage(AluFn.MIN, big_h, k, True)
                else:
                    stages[-1] = Stage(AluFn.MAX, big_l, 0, False)
                    stages.append(Stage(AluFn.MIN, big_h, k, False))
                return stages
        if last is not None and last.relu and lo <= 0:
            stages.append(Stage(AluFn.MIN, hi))          # the values are already >= 0
        elif lo == 0:
            stages.append(Stage(AluFn.MIN, hi, 0, True))
        else:
            stages.append(Stage(AluFn.MAX, lo))
            stages.append(Stage(AluFn.MIN, hi))
        return stages
    if last is not None and s.fn is AluFn.PASS and not s.tensor and not (last.sat and s.shift):
        # A shift or a ReLU after any stage folds into it: relu(v >> a) >> b = relu(v >> a+b)
        # (not a shift after a saturation; a ReLU commutes with it).
        stages[-1] = dataclasses.replace(last, shift=min(31, last.shift + s.shift),
                                         relu=last.relu or s.relu)
        return stages
    stages.append(s)
    return stages


def chain_zero(stages, known_b):
    """What the chain makes of a zero padding lane (None if it depends on run-time data)."""
    v = 0
    for s in stages:
        if s.tensor and not known_b:
            return None
        b = s.imm if s.imm is not None else 0
        r = alu(s.fn, v, b)
        r = post(r - (1 << 32) if r & (1 << 31) else r, s.shift,
                 (Post.RELU if s.relu else 0) | (Post.SAT8 if s.sat else 0))
        v = r & MASK32
    return v
