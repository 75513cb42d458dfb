"""The interpreter computes a stream step's lanes a vector at a time (issue 21, M3): for every
ALU function, SHIFT and POST, the lanes equal what ``alu`` and the stream's post-processing give
lane by lane (``docs/compute-unit.md``: ``_signed(alu(fn, a, b)) >> shift``, ReLU, saturation
to int8, mod 2**32)."""

from conftest import hostile
from hypothesis import given
from hypothesis import strategies as st

from rdakit.hdl.spec.isa import AluFn, alu
from rdakit.sim.models.interp import _VECTOR_ALU, _signed, _vector_post

# Words near the edges (0, 1, the sign bit, all ones) as well as anywhere.
WORD = st.one_of(st.sampled_from([0, 1, 2, 31, 32, 0x7fff_ffff, 0x8000_0000, 0xffff_ffff]),
                 st.integers(0, 0xffff_ffff))
# b comes from a register, a field or the local buffer: taken modulo 2**32 like alu takes it.
B_WORD = st.one_of(WORD, st.integers(-(1 << 40), 1 << 40))


def _lane_by_lane(fn, a, b, shift, post):
    out = []
    for x, y in zip(a, b, strict=True):
        v = _signed(alu(fn, x, y)) >> shift
        if post & 1 and v < 0:
            v = 0
        if post & 2:
            v = -128 if v < -128 else 127 if v > 127 else v
        out.append(v & 0xffff_ffff)
    return out


@hostile(200)
@given(fn=st.sampled_from(list(AluFn)), lanes=st.integers(1, 8), data=st.data(),
       shift=st.one_of(st.just(0), st.integers(0, 31)), post=st.integers(0, 3),
       by_value=st.booleans())
def test_vector_lanes_equal_alu_lane_by_lane(fn, lanes, data, shift, post, by_value):
    a = tuple(data.draw(st.lists(WORD, min_size=lanes, max_size=lanes)))
    b = data.draw(st.lists(B_WORD, min_size=lanes, max_size=lanes))
    got = _vector_post(_VECTOR_ALU[fn.value if by_value else fn](a, b), shift, post)
    assert list(got) == _lane_by_lane(fn, a, b, shift, post)


def test_every_alu_function_has_a_vector_form():
    assert set(AluFn) <= set(_VECTOR_ALU)
    assert {fn.value for fn in AluFn} <= set(_VECTOR_ALU)
