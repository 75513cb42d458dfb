"""Pieces the compute unit's sequencer and stream engine share.

The request tags, the stream destination modes that write an MU, the 32-bit ALU (the
sequencer's scalar ALU and every lane of the stream engine), lane selection in a vector word,
the request flit builder, and the check that a tile is a compute unit of the fabric.
"""

from amaranth.hdl import Mux, Signal
from amaranth.lib import data
from amaranth.utils import exact_log2

from rdakit.hdl.spec.cu import D_MU_MODES
from rdakit.hdl.spec.isa import AluFn, StreamField
from rdakit.hdl.spec.params import FabricParams

__all__ = ["TAG_BLOCKING", "TAG_READ", "TAG_WRITE", "STREAM_FIELDS", "D_MU_MODES", "alu",
           "lane", "request", "check_cu_tile", "bind_cu_tile"]

#: Request tags: the response a blocking instruction waits for, stream reads, stream writes.
TAG_BLOCKING = 0
TAG_READ = 1
TAG_WRITE = 2

#: The stream configuration registers (``StreamField``), 32 bits each, as the sequencer holds
#: them and the stream engine reads them; the field of ``StreamField.X`` is named ``x``.
STREAM_FIELDS = data.StructLayout({f.name.lower(): 32 for f in StreamField})



def check_cu_tile(fabric_params, x, y):
    """Check that ``(x, y)`` is a compute-unit tile of ``fabric_params``.

    Raises
    ------
    TypeError
        If ``fabric_params`` is not a :class:`FabricParams` or ``x``, ``y`` are not coordinates
        of the grid.
    ValueError
        If the tile at ``(x, y)`` is not a CU.
    """
    if not isinstance(fabric_params, FabricParams):
        raise TypeError(f"fabric_params must be a FabricParams, not {fabric_params!r}")
    p = fabric_params
    for name, value, size in (("x", x, p.cols), ("y", y, p.rows)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < size:
            what = "cols" if name == "x" else "rows"
            raise TypeError(f"{name} must be an integer from 0 to {size - 1} ({what} = "
                            f"{size}), not {value!r}")
    if p.kind(x, y) != "C":
        raise ValueError(f"The tile at ({x}, {y}) must be a compute unit (C), not a memory "
                         f"unit (M)")


def bind_cu_tile(component, fabric_params, x, y):
    """:func:`check_cu_tile`, then set ``component.fabric_params``, ``.x``, ``.y`` and
    ``.cu_id`` (``y << coord_bits | x``); returns ``fabric_params``. The compute unit and its
    two parts start their constructors with it."""
    check_cu_tile(fabric_params, x, y)
    component.fabric_params, component.x, component.y = fabric_params, x, y
    component.cu_id = (y << fabric_params.coord_bits) | x
    return fabric_params


def alu(m, fn, a, b, name):
    """``fn(a, b)`` on 32-bit values, as in :func:`rdakit.hdl.spec.isa.alu` (combinational)."""
    r = Signal(32, name=name)
    sa, sb = a.as_signed(), b.as_signed()
    sh = b[:5]
    with m.Switch(fn):
        with m.Case(AluFn.ADD):
            m.d.comb += r.eq(a + b)
        with m.Case(AluFn.SUB):
            m.d.comb += r.eq(a - b)
        with m.Case(AluFn.MUL):
            m.d.comb += r.eq(a * b)
        with m.Case(AluFn.AND):
            m.d.comb += r.eq(a & b)
        with m.Case(AluFn.OR):
            m.d.comb += r.eq(a | b)
        with m.Case(AluFn.XOR):
            m.d.comb += r.eq(a ^ b)
        with m.Case(AluFn.SHL):
            m.d.comb += r.eq(a << sh)
        with m.Case(AluFn.SHR):
            m.d.comb += r.eq(sa >> sh)
        with m.Case(AluFn.SHRU):
            m.d.comb += r.eq(a >> sh)
        with m.Case(AluFn.MIN):
            m.d.comb += r.eq(Mux(sa < sb, a, b))
        with m.Case(AluFn.MAX):
            m.d.comb += r.eq(Mux(sa > sb, a, b))
        with m.Case(AluFn.SLT):
            m.d.comb += r.eq(sa < sb)
        with m.Case(AluFn.SEQ):
            m.d.comb += r.eq(a == b)
        with m.Case(AluFn.RELU):
            m.d.comb += r.eq(Mux(a[31], 0, a))
        with m.Case(AluFn.PASS):
            m.d.comb += r.eq(a)
        with m.Case(AluFn.SEL):
            m.d.comb += r.eq(Mux(b != 0, a, 0))
    return r


def lane(word, index, lanes):
    """Lane ``index`` (a value, taken modulo ``lanes``) of a vector word."""
    if lanes == 1:
        return word[:32]
    return word.word_select(index[:exact_log2(lanes)], 32)


def request(m, sig, fabric_params, *, x, y, op, tag, ref, index=0, data=0):
    """Drive ``sig`` (a request flit) combinationally: a request from the CU at ``(x, y)`` to
    the MU named by the low ``mu_id_bits`` of the reference ``ref``."""
    mp = fabric_params.mu
    cb = fabric_params.coord_bits
    mu = ref[:mp.mu_id_bits]
    m.d.comb += [
        sig.dst.x.eq(mu[:cb]), sig.dst.y.eq(mu[cb:2 * cb]),
        sig.payload.op.eq(op), sig.payload.tag.eq(tag),
        sig.payload.src.x.eq(x), sig.payload.src.y.eq(y),
        sig.payload.ref.eq(ref[:mp.mu_id_bits + mp.buf_id_bits]), sig.payload.index.eq(index),
        sig.payload.data.eq(data),
    ]
