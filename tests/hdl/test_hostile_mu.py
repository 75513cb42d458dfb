"""Hostile input to the memory unit's RTL (issue 19): any request word, in any mode, is answered
as the golden model answers it, in the cycles the docs give, and leaves the counter ports
reading what the docs define."""

from conftest import hostile
from hypothesis import given
from hypothesis import strategies as st
from test_memory_unit import run_isolated

from rdakit.hdl.spec.packets import MUOp, mu_request_layout, unpack
from rdakit.hdl.spec.params import AllocMode, MUParams, RefcountMode
from rdakit.sim.models.mu import MUModel

#: Tiny, so that raw words name live buffers, indices in range and weights that fit: 2 slots
#: of 1 generation bit, 8-word blocks, 2-bit weights, 8-bit words (a 25-bit request).
TINY = MUParams(words=64, block_words=8, max_buffers=2, max_buffer_words=32, weight_bits=2,
                mu_id_bits=1, buf_id_bits=2, index_bits=6, data_bits=8, tag_bits=2,
                coord_bits=1, reserve_words=8)
WIDTH = mu_request_layout(TINY).size
OP_BITS = 4                      # the op field is the low bits of a request word


def words():
    """Raw request words, half of them with a known opcode and half an ALLOC or APPEND (so
    that buffers live and grow), the rest anything."""
    anything = st.integers(0, (1 << WIDTH) - 1)
    known = st.builds(lambda w, op: w & ~((1 << OP_BITS) - 1) | op, anything,
                      st.sampled_from([op.value for op in MUOp]))
    building = st.builds(lambda w, op: w & ~((1 << OP_BITS) - 1) | op, anything,
                         st.sampled_from([MUOp.ALLOC.value, MUOp.APPEND.value]))
    return st.lists(st.one_of(anything, known, building), min_size=1, max_size=40)


@hostile(10)
@given(alloc_mode=st.sampled_from(AllocMode), refcount=st.sampled_from(RefcountMode),
       values=words())
def test_any_request_words_take_the_documented_cycles(alloc_mode, refcount, values):
    p = TINY.replace(alloc_mode=alloc_mode, refcount=refcount)
    layout = mu_request_layout(p)
    model = MUModel(p)
    expected, cycles = [], []
    for value in values:
        expected.append(model.request_int(value))
        cycles.append(model.exec_cycles + 1)
    rtl = run_isolated(p, [unpack(layout, v) for v in values], mu_id=0)
    assert rtl.responses == expected
    assert rtl.latencies == cycles
    assert rtl.counters == model.counters()
    assert rtl.ready_after == p.max_buffers + 1
