"""Op templates: the code of each lowered op kind on its CU.

A template is a function ``(lowerer, cu, op)`` registered in :data:`TEMPLATES` under the op
kind it lowers. It finds its inputs with :meth:`~rdakit.compiler.lower.lowerer.Lowerer.ref`
(which receives a reference or waits for a token first when needed), writes its output
through ``cu.out`` (the register of the output buffer, allocated or held before it runs) and
emits its code on ``cu.asm``. Registers r0..r7 (:mod:`rdakit.compiler.lower.registers`) are
its temporaries; ``docs/compiler.md`` describes each template.
"""

import math

import numpy as np

from rdakit.compiler import intops
from rdakit.compiler.lower.layout import INT_MAX, INT_MIN, MASK32
from rdakit.compiler.lower.registers import (
    COUNT,
    R0,
    R1,
    R2,
    R3,
    R4,
    R5,
    R6,
    R7,
    SINK,
    Reg,
)
from rdakit.hdl.spec.isa import AluFn, BMode, DMode, Op, StreamField

__all__ = ["TEMPLATES", "template", "words_of", "rows_of", "row_loop"]

#: Op kind -> its template.
TEMPLATES = {}


def template(kind):
    """Register the decorated function as the template of op kind ``kind``."""
    def register(fn):
        TEMPLATES[kind] = fn
        return fn
    return register


# Helpers.

def words_of(lw, g, name, r_ref, rd):
    """Static words of a tensor (an int), or LEN into ``rd`` (a register) if dynamic."""
    lay = lw.tensors[name].layout
    if not lay.dynamic:
        return lay.words
    g.asm.length(name, rd, r_ref)
    return rd

def rows_of(g, r_words, cw, rd, tmp):
    """``rd = r_words / cw`` (words of whole rows)."""
    asm = g.asm
    if cw == 1:
        asm.alui(AluFn.ADD, rd, r_words, 0)
    elif cw & (cw - 1) == 0:
        asm.alui(AluFn.SHRU, rd, r_words, cw.bit_length() - 1)
    else:
        asm.li(rd, 0)
        asm.li(tmp, 0)

        def body(head):
            asm.alui(AluFn.ADD, tmp, tmp, cw)
            asm.alui(AluFn.ADD, rd, rd, 1)
            asm.branch(Op.BLT, head, ra=tmp, rb=r_words)
        asm.loop(body)
    return rd

def row_loop(lw, g, name, r_ref, offsets, body):
    """Run ``body()`` once per row of tensor ``name``; ``offsets`` are ``(reg, start,
    step)`` advanced after each row (the first walks ``name``). Counts rows in :data:`COUNT`
    (r2), which the body must leave alone."""
    asm = g.asm
    lay = lw.tensors[name].layout
    for reg, start, _ in offsets:
        asm.li(reg, start)

    def advance():
        for reg, _, step in offsets:
            asm.alui(AluFn.ADD, reg, reg, step)

    if not lay.dynamic:
        if lay.rows == 0:
            return
        if lay.rows == 1:
            body()
            return
        asm.li(COUNT, lay.rows)

        def loop(head):
            body()
            advance()
            asm.branch(Op.LOOP, head, ra=COUNT)
        asm.loop(loop)
        return
    asm.length(name, COUNT, r_ref)
    end = asm.label()
    asm.branch(Op.BZ, end, ra=COUNT)

    def loop(head):
        body()
        advance()
        asm.branch(Op.BLT, head, ra=offsets[0][0], rb=COUNT)
    asm.loop(loop)
    asm.place(end)


# Templates.

def epilogue_fields(epilogue):
    """The stream fields of an output stage folded into a product (``attrs["epilogue"]``, a
    :class:`~rdakit.compiler.lower.chains.Stage`, passes.FuseEpilogue; None: none), as
    keyword arguments of ``asm.stream``."""
    if epilogue is None:
        return {}
    return dict(shift=epilogue.shift, relu=epilogue.relu, sat=epilogue.sat)


def pack_row(asm, out, rb, base_b, kw, rows, stride, local, epilogue=None):
    """One PACK_SUM stream appending a row of the product to ``out``: the row of A of ``kw``
    words at word ``local`` of the local buffer against each of ``rows`` rows of Bᵀ (buffer
    ``rb`` from word ``base_b``, ``stride`` words apart); each sum through the output stage
    ``epilogue`` if given (:func:`epilogue_fields`)."""
    asm.stream(AluFn.MUL, a=rb, a_base=base_b, n=kw, outer=rows, a_ostride=stride,
               b_mode=BMode.LOCAL, b_val=local, b_stride=1, b_ostride=0,
               d_mode=DMode.PACK_SUM, d_ref=out, **epilogue_fields(epilogue))


@template("matmul_nt")
def matmul_nt(lw, g, op):
    """Per row of A: copy it to the local buffer, then one PACK_SUM stream over the rows of
    Bᵀ appends the row of the product. When every row of A fits the local buffer, one stream
    copies them all first (a run-time number of rows: LEN words). Bᵀ's rows may be columns
    of a wider tensor read in place (``b_off``, ``b_stride``: passes._column_view)."""
    a, b = op.ins[:2]
    la, lb = lw.tensors[a].layout, lw.tensors[b].layout
    ra, base_a = lw.ref(g, a)
    rb, base_b = lw.ref(g, b)
    kw = la.cw
    epilogue = op.attrs.get("epilogue")
    if kw > g.local_top and epilogue is None:
        matmul_long(lw, g, op)
        return
    lw.need_local(g, op, kw, "a row of A (its product's output stage fused: "
                  "passes.FuseEpilogue)" if epilogue is not None else "")
    asm, out = g.asm, g.out
    base_b += op.attrs.get("b_off", 0)
    stride = op.attrs.get("b_stride", kw)

    def product(row):
        pack_row(asm, out, rb, base_b, kw, lb.rows, stride, row, epilogue)

    if la.rows > 1 and la.words <= g.local_top:
        # Every row of A fits: one stream stages them all, then one PACK_SUM stream a row.
        end = asm.label()
        words = la.words
        if la.dynamic:
            asm.length(a, COUNT, ra)
            asm.branch(Op.BZ, end, ra=COUNT)
            words = COUNT
        asm.stream(AluFn.PASS, a=ra, a_base=base_a, n=words, d_mode=DMode.LOCAL, d_base=0)
        asm.li(R1, 0)
        if not la.dynamic:
            asm.li(COUNT, la.rows)

        def loop(head):
            product(R1)
            asm.alui(AluFn.ADD, R1, R1, kw)
            if la.dynamic:
                asm.branch(Op.BLT, head, ra=R1, rb=COUNT)
            else:
                asm.branch(Op.LOOP, head, ra=COUNT)
        asm.loop(loop)
        asm.place(end)
    else:
        def body():
            asm.stream(AluFn.PASS, a=ra, a_base=R1, n=kw, d_mode=DMode.LOCAL, d_base=0)
            product(0)
        row_loop(lw, g, a, ra, [(R1, base_a, kw)], body)
    if la.dynamic:
        rows_length(g, op.out, COUNT, kw, lw.tensors[op.out].layout.cw)


#: The most rows of a run-time right operand :func:`matmul_axpy` multiplies whatever the
#: local buffer holds (where A's row does not fit, its code is unrolled over them).
AXPY_MAX_ROWS = 64


def axpy_form(rows, a_words, nw, local_words):
    """Whether one row of A (``a_words`` words) times a run-time B of ``rows`` rows and
    ``nw`` words a row is lowered as :func:`matmul_axpy` (else B is transposed for
    ``matmul_nt``, which needs no row of the product in the local buffer): when a row of the
    product fits the local buffer, up to :data:`AXPY_MAX_ROWS` rows in any case and beyond
    them when A's row fits beside it (one stream, a decoder's ``p @ V`` over a long KV cache;
    unrolled over the rows if the CU's constants leave too little)."""
    return nw < local_words and (rows <= AXPY_MAX_ROWS or a_words + nw <= local_words)


@template("matmul_axpy")
def matmul_axpy(lw, g, op):
    """One row of A times a right operand B computed at run time (attention's ``p @ V``),
    without transposing B: ``out = sum_k a[k] * B row k``. A's row is staged in the local
    buffer after the ``nw`` words of a row of the product, and one stream walks B's rows,
    each times its scalar of A (``B_MODE ELEM``), adding them up in those words and appending
    the sums through the output stage (``D_MODE OUTER_SUM``; a folded epilogue's shift, ReLU
    and saturation, passes.FuseEpilogue). When A's row does not fit (READ), ``a[0] * B row
    0`` is appended to the output, each later row times its scalar goes into a local
    accumulator (the first overwriting it, the rest LOCAL_ACC), the scalars loaded four at a
    time so that their four streams follow each other, and one stream adds the accumulator to
    the output. Sums wrap like the reference's. B may be columns of a wider tensor read in
    place (``b_off``, ``b_stride``: passes._column_view). (A transposed B, per column a
    PACK_SUM stream over B's rows, then per row of A a dot product: about twice the cycles of
    one row.)"""
    a, b = op.ins[:2]
    lb = lw.tensors[b].layout
    asm, out = g.asm, g.out
    nw, rows = lw.tensors[op.out].layout.cw, lb.rows
    lw.need_local(g, op, nw, "the accumulator of a row of the product")
    (ta,) = stage(lw, g, op, nw, [a])
    rb, base_b = lw.ref(g, b)
    base_b += op.attrs.get("b_off", 0)                  # B's columns of a wider tensor
    stride = op.attrs.get("b_stride", nw)
    epilogue = op.attrs.get("epilogue")
    if ta.at is not None:
        asm.stream(AluFn.MUL, a=rb, a_base=base_b, n=nw, outer=rows, a_ostride=stride,
                   b_mode=BMode.ELEM, b_val=ta.start, b_stride=0, b_ostride=1,
                   d_mode=DMode.OUTER_SUM, d_ref=out, d_base=0, d_stride=1,
                   **epilogue_fields(epilogue))
        return
    if epilogue is not None:
        raise AssertionError(f"{op.name}: an epilogue folded where A's row is not staged")
    asm.li(R1, ta.start)
    regs = (R4, R5, R6, R7)
    for first in range(0, rows, len(regs)):
        group = range(first, min(first + len(regs), rows))
        for k, r in zip(group, regs, strict=False):
            ta.load(asm, r, R1, k, R0)
        for k, r in zip(group, regs, strict=False):
            dst = (dict(d_mode=DMode.APPEND, d_ref=out) if k == 0 else
                   dict(d_mode=DMode.LOCAL if k == 1 else DMode.LOCAL_ACC, d_base=0,
                        d_stride=1))
            asm.stream(AluFn.MUL, a=rb, a_base=base_b + k * stride, n=nw,
                       b_mode=BMode.SCALAR, b_val=r, **dst)
    if rows > 1:
        asm.stream(AluFn.ADD, a=out, a_base=0, n=nw, b_mode=BMode.LOCAL, b_val=0, b_stride=1,
                   d_mode=DMode.WRITE, d_ref=out, d_base=0, d_stride=1)


#: Up to this many lanes a long-K matmul adds up an accumulator word's lanes in straight-line
#: code (an LGET and an ADD each), beyond it in a loop (the program stays short).
UNROLL_LANES = 8


def matmul_long(lw, g, op):
    """A row of A longer than the free local buffer: K in chunks, the product's columns in
    blocks of ``nb``: all of them when they fit half the free local buffer, else a multiple of
    ``lanes`` (a loop of blocks), else a power of two (each word of the product is a few blocks
    in a row). Per block, ``nb`` local words accumulate one column each, lane by lane: they are
    zeroed by one stream, then per chunk of K the chunk of A's row is staged at word 0 and per
    column one stream ``Bᵀ[j, chunk] * chunk`` adds into the column's word (LOCAL_ACC,
    D_STRIDE 0: the streams follow each other with nothing between them to wait for); then
    each word's lanes are added up (LGET) and set in ``V``, appended a word of the product at a
    time. Sums wrap like the reference's. Bᵀ's rows may be columns of a wider tensor read in
    place (``b_off``, ``b_stride``: passes._column_view)."""
    a, b = op.ins[:2]
    la, lb = lw.tensors[a].layout, lw.tensors[b].layout
    ra, base_a = lw.ref(g, a)
    rb, base_b = lw.ref(g, b)
    asm, out = g.asm, g.out
    kw, lanes = la.cw, lw.lanes
    stride = op.attrs.get("b_stride", kw)       # from one row of Bᵀ to the next
    base_b += op.attrs.get("b_off", 0)
    ncols = lb.rows
    free = g.local_top
    half = max(free // 2, 1)
    if ncols <= half:
        nb = ncols
    elif half >= lanes:
        nb = half // lanes * lanes
    else:
        nb = 1 << (half.bit_length() - 1)        # divides lanes
    lw.need_local(g, op, nb + 1,
                  f"a row of A of {kw} words is longer than it: a word of A and {nb} "
                  f"accumulating columns of the product")
    chunk = chunk_words(kw, free - nb)
    moved = chunk * (kw // chunk if kw // chunk > 1 or kw % chunk else 0)

    def accumulate(nbb):
        """The block's ``nbb`` columns into local words ``chunk ..``. R7: the block's first
        row of Bᵀ (put back after each walk); R6: A's chunk; R0: the column's accumulator
        word; R4 counts the columns, R3 the chunks; R5 is the blocks'."""
        asm.stream(AluFn.AND, a=ra, a_base=R1, a_stride=0, n=nbb, d_mode=DMode.LOCAL,
                   d_base=chunk)

        def columns(n):
            asm.stream(AluFn.PASS, a=ra, a_base=R6, n=n, d_mode=DMode.LOCAL, d_base=0)
            asm.li(R0, chunk)

            def col():
                asm.stream(AluFn.MUL, a=rb, a_base=R7, n=n, b_mode=BMode.LOCAL, b_val=0,
                           b_stride=1, d_mode=DMode.LOCAL_ACC, d_base=R0, d_stride=0)
            if nbb == 1:
                col()
            else:
                asm.li(R4, nbb)

                def loop(head):
                    col()
                    asm.alui(AluFn.ADD, R7, R7, stride)
                    asm.alui(AluFn.ADD, R0, R0, 1)
                    asm.branch(Op.LOOP, head, ra=R4)
                asm.loop(loop)
                asm.alui(AluFn.ADD, R7, R7, -nbb * stride)
        column_chunks(asm, kw, chunk, [(R7, R7), (R6, R1)], R3, columns)
        asm.alui(AluFn.ADD, R7, R7, nbb * stride - moved)
        asm.li(R6, chunk * lanes)

    def put(first, n, close):
        """Lanes ``first .. first + n`` of ``V``: the sums of the next ``n`` accumulator words
        (R6 walks their elements, R3 sums, R4 counts the lanes); ``V`` cleared before lane 0
        and appended if ``close``."""
        if first == 0:
            asm.emit(Op.VCLR)
        for lane in range(first, first + n):
            if lanes <= UNROLL_LANES:
                # Unrolled: an LGET and an ADD a lane.
                asm.emit(Op.LGET, rd=R3, rb=R6, imm=0)
                for j in range(1, lanes):
                    asm.emit(Op.LGET, rd=R0, rb=R6, imm=j)
                    asm.alu(AluFn.ADD, R3, R3, R0)
                asm.alui(AluFn.ADD, R6, R6, lanes)
            else:
                asm.li(R3, 0)
                asm.li(R4, lanes)

                def lane_sum(head):
                    asm.emit(Op.LGET, rd=R0, rb=R6, imm=0)
                    asm.alu(AluFn.ADD, R3, R3, R0)
                    asm.alui(AluFn.ADD, R6, R6, 1)
                    asm.branch(Op.LOOP, head, ra=R4)
                asm.loop(lane_sum)
            asm.emit(Op.VSET, fn=lane, ra=R3)
        if close:
            asm.emit(Op.VAPPEND, rd=SINK, ra=out)

    def block(nbb):
        """A block of ``nbb`` columns starting a word of the product (the last block may end
        inside one)."""
        accumulate(nbb)
        words, rest = divmod(nbb, lanes)
        if words > 1:
            def loop(head):
                put(0, lanes, True)
                asm.alui(AluFn.SLT, R0, R6, (chunk + words * lanes) * lanes)
                asm.branch(Op.BNZ, head, ra=R0)
            asm.loop(loop)
        elif words:
            put(0, lanes, True)
        if rest:
            put(0, rest, True)

    def word(ncw):
        """A word of ``ncw`` columns in blocks of ``nb`` (``nb < lanes``)."""
        for first in range(0, ncw, nb):
            n = min(nb, ncw - first)
            accumulate(n)
            put(first, n, first + n == ncw)

    def repeat(count, fn, arg):
        if count > 1:
            asm.li(R5, count)

            def loop(head):
                fn(arg)
                asm.branch(Op.LOOP, head, ra=R5)
            asm.loop(loop)
        elif count:
            fn(arg)

    def body():
        asm.li(R7, base_b)
        if nb >= lanes or nb == ncols:
            full, tail = divmod(ncols, nb)
            repeat(full, block, nb)
            if tail:
                block(tail)
        else:
            full, tail = divmod(ncols, lanes)
            repeat(full, word, lanes)
            if tail:
                word(tail)
    row_loop(lw, g, a, ra, [(R1, base_a, kw)], body)
    if la.dynamic:
        rows_length(g, op.out, COUNT, kw, lw.tensors[op.out].layout.cw)


def rows_length(g, out, reg, cw_in, cw_out):
    """After an op whose output ``out`` has a row for each row of its input, which ``reg``
    holds the length of (``cw_in`` words a row): ``out``'s length (``cw_out`` words a row) is
    put in ``reg`` and recorded, so its consumers on this CU need no LEN (that would wait for
    the op's last stream: ``Assembler.length``)."""
    asm = g.asm
    if cw_out == cw_in:
        asm.set_length(out, reg)
    elif cw_out % cw_in == 0:
        asm.alui(AluFn.MUL, reg, reg, cw_out // cw_in)
        asm.set_length(out, reg)
    elif cw_in % cw_out == 0 and (cw_in // cw_out) & (cw_in // cw_out - 1) == 0:
        asm.alui(AluFn.SHRU, reg, reg, (cw_in // cw_out).bit_length() - 1)
        asm.set_length(out, reg)

@template("transpose")
def transpose(lw, g, op):
    """Per column c: a PACK_SUM stream of one step per row picks lane c % lanes of each
    row's word (times a one-hot local word) into the lanes of the output row."""
    (x,) = op.ins
    lx = lw.tensors[x].layout
    rx, base = lw.ref(g, x)
    ident = g.local["identity"]
    asm, out = g.asm, g.out
    if lx.rows == 0:
        return
    asm.li(R1, 0)
    asm.li(R2, lx.cols)

    def body(head):
        asm.alui(AluFn.SHRU, R3, R1, lw.lb)
        asm.alui(AluFn.ADD, R3, R3, base)
        asm.alui(AluFn.AND, R4, R1, lw.lanes - 1)
        asm.alui(AluFn.ADD, R4, R4, ident)
        asm.stream(AluFn.MUL, a=rx, a_base=R3, n=1, outer=lx.rows, a_ostride=lx.cw,
                   b_mode=BMode.LOCAL, b_val=R4, b_stride=0, b_ostride=0,
                   d_mode=DMode.PACK_SUM, d_ref=out)
        asm.alui(AluFn.ADD, R1, R1, 1)
        asm.branch(Op.LOOP, head, ra=R2)
    asm.loop(body)

@template("expand")
def expand(lw, g, op):
    (x,) = op.ins
    lx, lo = lw.tensors[x].layout, lw.tensors[op.out].layout
    rx, base = lw.ref(g, x)
    if lo.rows:
        g.asm.stream(AluFn.PASS, a=rx, a_base=base, n=lx.cw, outer=lo.rows, a_ostride=0,
                     d_mode=DMode.APPEND, d_ref=g.out)

@template("copy")
def copy(lw, g, op):
    (x,) = op.ins
    rx, base = lw.ref(g, x)
    asm = g.asm
    n = words_of(lw, g, x, rx, R2)
    if n == 0:
        return
    end = asm.label()
    if isinstance(n, Reg):
        asm.branch(Op.BZ, end, ra=R2)
    asm.stream(AluFn.PASS, a=rx, a_base=base, n=n, d_mode=DMode.APPEND, d_ref=g.out)
    asm.place(end)

def ew_one_pass(lw, op, free):
    """Whether elementwise chain ``op`` is one stream from its input to its output (one stage,
    no padding mask, the second operand staged whole or none), with ``free`` local words."""
    lo = lw.tensors[op.out].layout
    if len(op.attrs["stages"]) != 1 or lw.ew_needs_mask(op) or lo.dynamic:
        return False
    mode = op.attrs["mode"]
    return mode in (None, "scalar") or (mode == "row" and lo.cw <= free) or (
        mode == "same" and lo.words <= free)


@template("ew")
def ew(lw, g, op):
    """An elementwise chain: the first stage streams the input (and its second operand:
    local buffer, scalar or per-row scalar) into the output, later stages rewrite the
    output in place, and a last pass masks padding lanes if the chain makes them
    nonzero. An output streamed to another CU (``lw.queue_dst``) leaves by the last pass."""
    asm, out = g.asm, g.out
    stages, mode = op.attrs["stages"], op.attrs["mode"]
    masked = lw.ew_needs_mask(op)
    x = op.ins[0]
    lo = lw.tensors[op.out].layout
    rx, bx = lw.ref(g, x)
    if mode is not None:
        rb, bb = lw.ref(g, op.ins[1])
        lbt = lw.tensors[op.ins[1]].layout
    n = words_of(lw, g, x, rx, R2)
    if n == 0:
        return
    end = asm.label()
    if isinstance(n, Reg):
        asm.branch(Op.BZ, end, ra=R2)
    s0 = stages[0]
    cw = lo.cw

    def rows():
        return lo.rows if not lo.dynamic else rows_of(g, R2, cw, R3, R4)

    kw = dict(shift=s0.shift, relu=s0.relu, sat=s0.sat, d_mode=DMode.APPEND, d_ref=out)
    if ew_one_pass(lw, op, g.local_top):
        kw.update(lw.queue_dst(g, op) or {})
    if mode is None:
        bm = BMode.ZERO if s0.imm is None else BMode.SCALAR
        asm.stream(s0.fn, a=rx, a_base=bx, n=n, b_mode=bm, b_val=s0.imm or 0, **kw)
    elif mode == "scalar":
        asm.li(R5, bb)
        asm.emit(Op.READ, fn=0, rd=R5, ra=rb, rb=R5)
        asm.stream(s0.fn, a=rx, a_base=bx, n=n, b_mode=BMode.SCALAR, b_val=R5, **kw)
    elif mode == "row" and cw > g.local_top:
        # A row longer than the free local buffer: x copied to the output, then per chunk of
        # columns the row's chunk staged in the local buffer and one stream a row rewrites
        # that chunk of the output in place.
        lw.need_local(g, op, 1)
        chunk = chunk_words(cw, g.local_top)
        asm.stream(AluFn.PASS, a=rx, a_base=bx, n=n, d_mode=DMode.APPEND, d_ref=out)
        nrows = rows()

        def columns(c):
            asm.stream(AluFn.PASS, a=rb, a_base=R6, n=c, d_mode=DMode.LOCAL, d_base=0)
            asm.alui(AluFn.ADD, R1, R7, 0)
            if isinstance(nrows, Reg):
                asm.alui(AluFn.ADD, R5, nrows, 0)
            else:
                asm.li(R5, nrows)

            def row(head):
                asm.stream(s0.fn, a=out, a_base=R1, n=c, b_mode=BMode.LOCAL, b_val=0,
                           b_stride=1, shift=s0.shift, relu=s0.relu, sat=s0.sat,
                           d_mode=DMode.WRITE,
                           d_ref=out, d_base=R1, d_stride=1)
                asm.alui(AluFn.ADD, R1, R1, cw)
                asm.branch(Op.LOOP, head, ra=R5)
            asm.loop(row)
        column_chunks(asm, cw, chunk, [(R7, 0), (R6, bb)], R0, columns)
    elif mode == "row":
        lw.need_local(g, op, cw)
        asm.stream(AluFn.PASS, a=rb, a_base=bb, n=cw, d_mode=DMode.LOCAL, d_base=0)
        asm.stream(s0.fn, a=rx, a_base=bx, n=cw, outer=rows(), a_ostride=cw,
                   b_mode=BMode.LOCAL, b_val=0, b_stride=1, b_ostride=0, **kw)
    elif mode == "col":
        def body():
            asm.emit(Op.READ, fn=0, rd=R5, ra=rb, rb=R3)
            asm.stream(s0.fn, a=rx, a_base=R1, n=cw, b_mode=BMode.SCALAR, b_val=R5, **kw)
        # row_loop uses r2 itself: keep the word count for the later stages in r7.
        if isinstance(n, Reg):
            asm.alui(AluFn.ADD, R7, R2, 0)
        row_loop(lw, g, x, rx, [(R1, bx, cw), (R3, bb, lbt.cw)], body)
        if isinstance(n, Reg):
            asm.alui(AluFn.ADD, R2, R7, 0)
    else:  # same shape: the second operand goes through the local buffer in chunks
        budget = g.local_top
        lw.need_local(g, op, 1)
        if not isinstance(n, Reg) and n <= budget:
            asm.stream(AluFn.PASS, a=rb, a_base=bb, n=n, d_mode=DMode.LOCAL, d_base=0)
            asm.stream(s0.fn, a=rx, a_base=bx, n=n, b_mode=BMode.LOCAL, b_val=0,
                       b_stride=1, **kw)
        else:
            if not isinstance(n, Reg):
                asm.li(R2, n)
            asm.li(R1, 0)

            def body(head):
                asm.alu(AluFn.SUB, R3, R2, R1)
                asm.alui(AluFn.MIN, R3, R3, budget)
                asm.alui(AluFn.ADD, R4, R1, bb)
                asm.stream(AluFn.PASS, a=rb, a_base=R4, n=R3, d_mode=DMode.LOCAL,
                           d_base=0)
                asm.alui(AluFn.ADD, R4, R1, bx)
                asm.stream(s0.fn, a=rx, a_base=R4, n=R3, b_mode=BMode.LOCAL, b_val=0,
                           b_stride=1, **kw)
                asm.alu(AluFn.ADD, R1, R1, R3)
                asm.branch(Op.BLT, head, ra=R1, rb=R2)
            asm.loop(body)
            if not isinstance(n, Reg):
                n = lo.words
    for i, s in enumerate(stages[1:], 2):
        bm = BMode.ZERO if s.imm is None else BMode.SCALAR
        dst = dict(d_mode=DMode.WRITE, d_ref=out, d_base=0, d_stride=1)
        if i == len(stages) and not masked:
            dst.update(lw.queue_dst(g, op) or {})
        asm.stream(s.fn, a=out, a_base=0, n=n, b_mode=bm, b_val=s.imm or 0, shift=s.shift,
                   relu=s.relu, sat=s.sat, **dst)
    if masked:
        mask = g.local[f"mask{lo.cols}"]
        dst = dict(d_mode=DMode.WRITE, d_ref=out, d_base=0, d_stride=1)
        dst.update(lw.queue_dst(g, op) or {})
        asm.stream(AluFn.AND, a=out, a_base=0, n=cw, outer=rows(), a_ostride=cw,
                   b_mode=BMode.LOCAL, b_val=mask, b_stride=1, b_ostride=0, **dst)
    asm.place(end)
    if isinstance(n, Reg):
        asm.set_length(op.out, R2)      # the output has the input's words

@template("slice_rows")
def slice_rows(lw, g, op):
    (x,) = op.ins
    lx = lw.tensors[x].layout
    rx, base = lw.ref(g, x)
    start, stop = op.attrs["start"], op.attrs["stop"]
    if stop > start:
        g.asm.stream(AluFn.PASS, a=rx, a_base=base + start * lx.cw,
                     n=(stop - start) * lx.cw, d_mode=DMode.APPEND, d_ref=g.out)

@template("slice_cols")
def slice_cols(lw, g, op):
    """Whole words of each row (the slice starts at a word boundary), ANDed with a mask
    when the last word would keep lanes past the slice."""
    (x,) = op.ins
    lx, lo = lw.tensors[x].layout, lw.tensors[op.out].layout
    rx, base = lw.ref(g, x)
    asm = g.asm
    rows = lo.rows
    end = asm.label()
    if lx.dynamic:
        asm.emit(Op.LEN, rd=R2, ra=rx)
        asm.branch(Op.BZ, end, ra=R2)
        rows = rows_of(g, R2, lx.cw, R3, R4)
    elif rows == 0:
        return
    kw = dict(a=rx, a_base=base + op.attrs["start"] // lw.lanes, n=lo.cw, outer=rows,
              a_ostride=lx.cw, d_mode=DMode.APPEND, d_ref=g.out)
    if op.attrs["mask"]:
        asm.stream(AluFn.AND, b_mode=BMode.LOCAL, b_val=g.local[f"mask{lo.cols}"],
                   b_stride=1, b_ostride=0, **kw)
    else:
        asm.stream(AluFn.PASS, **kw)
    asm.place(end)

@template("concat_rows")
def concat_rows(lw, g, op):
    for x in op.ins:
        lx = lw.tensors[x].layout
        rx, base = lw.ref(g, x)
        if lx.words:
            g.asm.stream(AluFn.PASS, a=rx, a_base=base, n=lx.words, d_mode=DMode.APPEND,
                         d_ref=g.out)
        g.refs.unpin(lw.key_of(x, g.xy)[0])

@template("concat_cols")
def concat_cols(lw, g, op):
    """Each input's rows written at their word offset in the output rows."""
    lo = lw.tensors[op.out].layout
    asm, out = g.asm, g.out
    off = 0
    for x in op.ins:
        lx = lw.tensors[x].layout
        rx, base = lw.ref(g, x)

        def body(rx=rx, lx=lx):
            asm.stream(AluFn.PASS, a=rx, a_base=R1, n=lx.cw, d_mode=DMode.WRITE,
                       d_ref=out, d_base=R3, d_stride=1)
        row_loop(lw, g, x, rx, [(R1, base, lx.cw), (R3, off, lo.cw)], body)
        off += lx.cw
        g.refs.unpin(lw.key_of(x, g.xy)[0])

@template("append_inplace")
def append_inplace(lw, g, op):
    """APPEND the new rows to the cache's own buffer (the KV cache grows in place)."""
    _, x = op.ins
    lx = lw.tensors[x].layout
    rx, base = lw.ref(g, x)
    g.asm.forget_lengths()      # the cache's length changes
    if lx.words:
        g.asm.stream(AluFn.PASS, a=rx, a_base=base, n=lx.words, d_mode=DMode.APPEND,
                     d_ref=g.out)

@template("reduce")
def reduce(lw, g, op):
    (x,) = op.ins
    lx = lw.tensors[x].layout
    rx, base = lw.ref(g, x)
    asm, out = g.asm, g.out
    cw = lx.cw
    is_max = op.attrs["op"] == "max"
    if op.attrs["axis"] == "row" or lx.ndim == 1:
        # One SUM (or MAX, padding lanes forced to INT_MIN) stream per row; a row too long
        # for the lrow constant: a MAX stream of all but the last word, one of the last word
        # with the ltail constant, the larger of the two.
        def body():
            if is_max and f"lrow{lx.cols}" in g.local:
                asm.stream(AluFn.MIN, a=rx, a_base=R1, n=cw, b_mode=BMode.LOCAL,
                           b_val=g.local[f"lrow{lx.cols}"], b_stride=1,
                           d_mode=DMode.MAX, rd=R5)
            elif is_max and lx.cols % lw.lanes:
                if cw > 1:
                    asm.stream(AluFn.PASS, a=rx, a_base=R1, n=cw - 1, d_mode=DMode.MAX,
                               rd=R5)
                else:
                    asm.li(R5, INT_MIN)
                asm.alui(AluFn.ADD, R0, R1, cw - 1)
                asm.stream(AluFn.MIN, a=rx, a_base=R0, n=1, b_mode=BMode.LOCAL,
                           b_val=g.local[f"ltail{lx.cols}"], b_stride=1,
                           d_mode=DMode.MAX, rd=R0)
                asm.alu(AluFn.MAX, R5, R5, R0)
            elif is_max:
                asm.stream(AluFn.PASS, a=rx, a_base=R1, n=cw, d_mode=DMode.MAX, rd=R5)
            else:
                asm.stream(AluFn.PASS, a=rx, a_base=R1, n=cw, d_mode=DMode.SUM, rd=R5)
            asm.emit(Op.VCLR)
            asm.emit(Op.VSET, fn=0, ra=R5)
            asm.emit(Op.VAPPEND, rd=SINK, ra=out)
        row_loop(lw, g, x, rx, [(R1, base, cw)], body)
        return
    # Over rows: a sum is one OUTER_SUM stream; a max accumulates rows 1.. in the local
    # buffer and takes row 0 on the way out.
    fn = AluFn.MAX if is_max else AluFn.ADD
    rows = lx.rows
    if rows == 0:
        return
    if rows == 1:
        asm.stream(AluFn.PASS, a=rx, a_base=base, n=cw, d_mode=DMode.APPEND, d_ref=out)
        return
    if cw > g.local_top:
        reduce_cols_long(lw, g, op, fn, rx, base)
        return
    lw.need_local(g, op, cw)
    if not is_max:
        # A sum: one stream adds the rows up in the local buffer and appends the sums.
        asm.stream(AluFn.PASS, a=rx, a_base=base, n=cw, outer=rows, a_ostride=cw,
                   d_mode=DMode.OUTER_SUM, d_ref=out, d_base=0, d_stride=1)
        return
    asm.stream(AluFn.PASS, a=rx, a_base=base + cw, n=cw, d_mode=DMode.LOCAL, d_base=0)
    if rows > 2:
        asm.li(R1, base + 2 * cw)
        asm.li(R2, rows - 2)

        def body(head):
            asm.stream(fn, a=rx, a_base=R1, n=cw, b_mode=BMode.LOCAL, b_val=0, b_stride=1,
                       d_mode=DMode.LOCAL, d_base=0)
            asm.alui(AluFn.ADD, R1, R1, cw)
            asm.branch(Op.LOOP, head, ra=R2)
        asm.loop(body)
    asm.stream(fn, a=rx, a_base=base, n=cw, b_mode=BMode.LOCAL, b_val=0, b_stride=1,
               d_mode=DMode.APPEND, d_ref=out)

def reduce_cols_long(lw, g, op, fn, rx, base):
    """A reduction over rows whose rows are longer than the free local buffer: the same
    streams as the row form, chunk of columns by chunk (R3 walks the chunks), each chunk's
    result appended in order."""
    lx = lw.tensors[op.ins[0]].layout
    asm, out = g.asm, g.out
    cw, rows = lx.cw, lx.rows
    lw.need_local(g, op, 1)
    chunk = chunk_words(cw, g.local_top)

    def columns(n):
        asm.alui(AluFn.ADD, R1, R3, cw)
        asm.stream(AluFn.PASS, a=rx, a_base=R1, n=n, d_mode=DMode.LOCAL, d_base=0)
        if rows > 2:
            asm.li(R2, rows - 2)

            def body(head):
                asm.alui(AluFn.ADD, R1, R1, cw)
                asm.stream(fn, a=rx, a_base=R1, n=n, b_mode=BMode.LOCAL, b_val=0,
                           b_stride=1, d_mode=DMode.LOCAL, d_base=0)
                asm.branch(Op.LOOP, head, ra=R2)
            asm.loop(body)
        asm.stream(fn, a=rx, a_base=R3, n=n, b_mode=BMode.LOCAL, b_val=0, b_stride=1,
                   d_mode=DMode.APPEND, d_ref=out)
    column_chunks(asm, cw, chunk, [(R3, base)], R0, columns)


class RowTable:
    """The scalars of a small static tensor a template reads by run-time position, row by row
    (routing indices, gates): copied into the local buffer at word ``at`` by one stream and read
    with LGET (two cycles) when ``at`` is given, else READ from its MU buffer (a round trip
    each). A row loop walks it with ``(reg, start, step)``: element offsets in the local buffer,
    or word indices in the MU buffer."""

    def __init__(self, lw, g, name, at=None):
        self.lanes = lw.lanes
        self.lay = lw.tensors[name].layout
        self.ref, base = lw.ref(g, name)
        self.at = at
        if at is None:
            self.start, self.step = base, self.lay.cw
        else:
            g.asm.stream(AluFn.PASS, a=self.ref, a_base=base, n=self.lay.words,
                         d_mode=DMode.LOCAL, d_base=at)
            self.start, self.step = at * self.lanes, self.lay.cw * self.lanes

    def offsets(self, reg):
        return (reg, self.start, self.step)

    def load(self, asm, rd, row, j, tmp):
        """``rd`` = element ``j`` of the row at ``row`` (a row-loop register; ``tmp`` may be
        clobbered)."""
        if self.at is not None:
            asm.emit(Op.LGET, rd=rd, rb=row, imm=j)
            return
        word = row
        if j // self.lanes:
            asm.alui(AluFn.ADD, tmp, row, j // self.lanes)
            word = tmp
        asm.emit(Op.READ, fn=j % self.lanes, rd=rd, ra=self.ref, rb=word)


def stage(lw, g, op, scratch, names):
    """Row tables for tensors ``names``, staged in the local buffer after ``scratch`` words of
    the op's own when all of them fit (one stream each), else read from their MU buffers."""
    lays = [lw.tensors[n].layout for n in names]
    lw.need_local(g, op, scratch)
    if any(lay.dynamic for lay in lays) or scratch + sum(lay.words for lay in lays) > g.local_top:
        return [RowTable(lw, g, n) for n in names]
    tables, at = [], scratch
    for n, lay in zip(names, lays, strict=True):
        tables.append(RowTable(lw, g, n, at))
        at += lay.words
    return tables


@template("topk")
def topk(lw, g, op):
    """Per row: L (local) = INT_MAX on real lanes, INT_MIN on padding; k times: ARGMAX of
    min(row, L), then L at the chosen element = INT_MIN (LSET). If the maximum found is
    INT_MIN, every element left equals INT_MIN and the answer is the first one not chosen: the
    first INT_MAX of L (an ARGMAX of L)."""
    x, lrow, maxw = op.ins
    lx = lw.tensors[x].layout
    rx, bx = lw.ref(g, x)
    rp, b_l = lw.ref(g, lrow)
    rm, b_m = lw.ref(g, maxw)
    k = op.attrs["k"]
    ew = lx.cw
    lanes = lw.lanes
    if ew > g.local_top:
        topk_long(lw, g, op, rx, bx)
        return
    lo = lw.tensors[op.out].layout
    if not lx.dynamic and 2 * ew + lo.words <= g.local_top:
        topk_pairs(lw, g, op, rx, bx)
        return
    lw.need_local(g, op, ew)
    asm, out = g.asm, g.out

    def body():
        asm.stream(AluFn.PASS, a=rp, a_base=b_l, n=ew, d_mode=DMode.LOCAL, d_base=0)
        asm.emit(Op.VCLR)
        for j in range(k):
            asm.stream(AluFn.MIN, a=rx, a_base=R1, n=ew, b_mode=BMode.LOCAL, b_val=0,
                       b_stride=1, d_mode=DMode.ARGMAX, rd=R4)
            if j:
                ok = asm.label()
                asm.alui(AluFn.XOR, R6, R4, INT_MIN)
                asm.branch(Op.BNZ, ok, ra=R6)
                asm.stream(AluFn.MIN, a=rm, a_base=b_m, a_stride=0, n=ew,
                           b_mode=BMode.LOCAL, b_val=0, b_stride=1, d_mode=DMode.ARGMAX,
                           rd=R6)
                asm.alui(AluFn.ADD, R5, R7, 0)
                asm.place(ok)
            asm.emit(Op.VSET, fn=j % lanes, ra=R5)
            if j % lanes == lanes - 1 or j == k - 1:
                asm.emit(Op.VAPPEND, rd=SINK, ra=out)
                if j < k - 1:
                    asm.emit(Op.VCLR)
            if j < k - 1:
                asm.li(R6, INT_MIN)
                asm.emit(Op.LSET, ra=R6, rb=R5, imm=0)
    row_loop(lw, g, x, rx, [(R1, bx, ew)], body)

def topk_pairs(lw, g, op, rx, bx):
    """Top-k of a static tensor whose rows' two ``L`` rows and the whole result fit the free
    local buffer: the rows two at a time, so that the second row's ARGMAX stream runs while
    the first's result comes back (the engine holds two streams). ``L`` rows at local words
    ``0`` and ``ew``, copied once (an element chosen is set back to INT_MAX after its row),
    the result built in the local buffer after them (LSET of each index; zeroed first, so its
    padding lanes stay 0) and appended by one stream at the end (``min(INT_MAX, local)``)."""
    x, lrow, maxw = op.ins
    lx, lo = lw.tensors[x].layout, lw.tensors[op.out].layout
    rp, b_l = lw.ref(g, lrow)
    rm, b_m = lw.ref(g, maxw)
    k, ew, lanes, ow = op.attrs["k"], lx.cw, lw.lanes, lo.cw
    asm, out = g.asm, g.out
    table = 2 * ew
    for at in (0, ew):
        asm.stream(AluFn.PASS, a=rp, a_base=b_l, n=ew, d_mode=DMode.LOCAL, d_base=at)
    asm.stream(AluFn.AND, a=rm, a_base=b_m, a_stride=0, n=lo.words, d_mode=DMode.LOCAL,
               d_base=table)
    F = StreamField
    res = [(R4, R5), (R6, R7)]       # each row's ARGMAX: its value and index

    def rows(n):
        """The k rounds of rows R1 (and R1 + ew when ``n`` is 2); results at element R3."""
        for j in range(k):
            for r in range(n):
                base = R1
                if r:
                    asm.alui(AluFn.ADD, R0, R1, ew)
                    base = R0
                asm.stream(AluFn.MIN, a=rx, a_base=base, n=ew, b_mode=BMode.LOCAL,
                           b_val=r * ew, b_stride=1, d_mode=DMode.ARGMAX, rd=res[r][0])
            for r in range(n):
                val, ix = res[r]
                if j:
                    # Every element left is INT_MIN: the first one not chosen.
                    ok = asm.label()
                    asm.alui(AluFn.XOR, R0, val, INT_MIN)
                    saved = {f: asm.known.get(f) for f in (F.A_REF, F.A_BASE, F.A_STRIDE,
                                                           F.B_VAL)}
                    asm.branch(Op.BNZ, ok, ra=R0)
                    asm.stream(AluFn.MIN, a=rm, a_base=b_m, a_stride=0, n=ew,
                               b_mode=BMode.LOCAL, b_val=r * ew, b_stride=1,
                               d_mode=DMode.ARGMAX, rd=val)
                    for f, v in saved.items():
                        if v is not None:
                            asm.field(f, Reg(v[1]) if isinstance(v, tuple) else v)
                    asm.place(ok)
                asm.emit(Op.LSET, ra=ix, rb=R3, imm=r * ow * lanes + j)
                if j < k - 1:
                    asm.li(R0, INT_MIN)
                    asm.emit(Op.LSET, ra=R0, rb=ix, imm=r * ew * lanes)
        if k > 1:
            asm.li(R4, INT_MAX)
            for r in range(n):
                for j in range(k - 1):
                    asm.emit(Op.LGET, rd=R0, rb=R3, imm=r * ow * lanes + j)
                    asm.emit(Op.LSET, ra=R4, rb=R0, imm=r * ew * lanes)

    pairs, odd = divmod(lx.rows, 2)
    asm.li(R1, bx)
    asm.li(R3, table * lanes)
    if pairs:
        asm.li(COUNT, pairs)

        def loop(head):
            rows(2)
            asm.alui(AluFn.ADD, R1, R1, 2 * ew)
            asm.alui(AluFn.ADD, R3, R3, 2 * ow * lanes)
            asm.branch(Op.LOOP, head, ra=COUNT)
        asm.loop(loop)
    if odd:
        rows(1)
    asm.stream(AluFn.MIN, a=rm, a_base=b_m, a_stride=0, n=lo.words, b_mode=BMode.LOCAL,
               b_val=table, b_stride=1, d_mode=DMode.APPEND, d_ref=out)

def topk_long(lw, g, op, rx, bx):
    """Top-k of rows longer than the free local buffer, with no copy of the row: each round
    finds the next element in the reference's order (largest first, the lower index on ties)
    after the previous one, ``(v, i)``. The candidates are the elements below ``v`` and those
    equal to it after ``i``; an ARGMAX stream over the whole words up to ``i`` of ``x - c``
    (``c = v XOR INT_MIN``, wrapping: every element ``>= v`` ranks below every element
    ``< v``, which keep their order) and one over the whole words after ``i`` with ``c + 1``
    (``<= v`` above ``> v``; the first round, ``v = INT_MAX`` and ``c + 1 = 0``: the plain
    ARGMAX) give each part's first largest candidate, checked against ``v``; the word holding
    ``i + 1`` (when it starts inside a word) and the last word (padding lanes) are staged in one
    local word and scanned element by element. The rounds' indices and values are kept in the
    local buffer (two words of it per ``lanes`` of ``k``, so a ``k`` the local buffer cannot
    hold is refused) and appended at the end of the row."""
    lx = lw.tensors[op.ins[0]].layout
    asm, out = g.asm, g.out
    k, lanes, lb, cols = op.attrs["k"], lw.lanes, lw.lb, lx.cols
    full = cols // lanes                   # whole words (the last word has padding after)
    first = lanes + 1                      # element of index 0 (index -1: the sentinel)
    voff = k + 1                           # from an index to its value
    lw.need_local(g, op, -(-(first + 2 * k + 1) // lanes),
                  f"a row of {cols} elements is longer than it: one word and the k = {k} "
                  f"indices and values found")
    ok = asm.label

    def prev_index(rd):
        asm.emit(Op.LGET, rd=rd, rb=R3, imm=-1)

    def prev_value(rd):
        asm.emit(Op.LGET, rd=rd, rb=R3, imm=voff - 1)

    def word(el):
        """Scan the word whose first element is ``el`` (in R5), to its end or to ``cols``."""
        asm.alui(AluFn.SHRU, R4, R5, lb)
        asm.alu(AluFn.ADD, R4, R4, R1)
        asm.stream(AluFn.PASS, a=rx, a_base=R4, n=1, d_mode=DMode.LOCAL, d_base=0)

        def scan(head):
            cand, take, nxt, end = ok(), ok(), ok(), ok()
            asm.alui(AluFn.AND, R4, R5, lanes - 1)
            asm.emit(Op.LGET, rd=R4, rb=R4, imm=0)
            prev_value(R0)
            asm.branch(Op.BLT, cand, ra=R4, rb=R0)
            asm.alu(AluFn.XOR, R0, R4, R0)
            asm.branch(Op.BNZ, nxt, ra=R0)
            prev_index(R0)
            asm.branch(Op.BLT, cand, ra=R0, rb=R5)
            asm.branch(Op.JMP, nxt)
            asm.place(cand)
            asm.alui(AluFn.SLT, R0, R7, 0)
            asm.branch(Op.BNZ, take, ra=R0)
            asm.branch(Op.BLT, take, ra=R6, rb=R4)
            asm.branch(Op.JMP, nxt)
            asm.place(take)
            asm.alui(AluFn.ADD, R6, R4, 0)
            asm.alui(AluFn.ADD, R7, R5, 0)
            asm.place(nxt)
            asm.alui(AluFn.ADD, R5, R5, 1)
            asm.alui(AluFn.AND, R0, R5, lanes - 1)
            asm.branch(Op.BZ, end, ra=R0)
            asm.alui(AluFn.SLT, R0, R5, cols)
            asm.branch(Op.BNZ, head, ra=R0)
            asm.place(end)
        asm.loop(scan)

    def rnd(head):
        # R6, R7: the best candidate's value and index (R7 < 0: none yet).
        asm.li(R7, -1)
        # The whole words before the word holding i + 1: candidates below v.
        skip = ok()
        prev_index(R0)
        asm.alui(AluFn.ADD, R0, R0, 1)
        asm.alui(AluFn.SHRU, R5, R0, lb)
        asm.branch(Op.BZ, skip, ra=R5)
        prev_value(R0)
        asm.alui(AluFn.XOR, R0, R0, INT_MIN)
        asm.stream(AluFn.SUB, a=rx, a_base=R1, n=R5, b_mode=BMode.SCALAR, b_val=R0,
                   d_mode=DMode.ARGMAX, rd=R4)
        asm.alu(AluFn.ADD, R4, R4, R0)
        prev_value(R0)
        valid = ok()
        asm.branch(Op.BLT, valid, ra=R4, rb=R0)
        asm.branch(Op.JMP, skip)
        asm.place(valid)
        asm.alui(AluFn.ADD, R6, R4, 0)
        asm.alui(AluFn.ADD, R7, R5, 0)
        asm.place(skip)
        if lanes > 1:
            # The word holding i + 1 when i + 1 is not its first element.
            skip = ok()
            prev_index(R0)
            asm.alui(AluFn.ADD, R0, R0, 1)
            asm.alui(AluFn.AND, R4, R0, lanes - 1)
            asm.branch(Op.BZ, skip, ra=R4)
            asm.alui(AluFn.AND, R5, R0, -lanes)
            word(R5)
            asm.place(skip)
        # The whole words from the first after i: candidates up to v.
        skip = ok()
        prev_index(R0)
        asm.alui(AluFn.ADD, R0, R0, lanes)
        asm.alui(AluFn.SHRU, R0, R0, lb)
        asm.li(R5, full)
        asm.alu(AluFn.SUB, R5, R5, R0)
        asm.alui(AluFn.SLT, R4, R5, 1)
        asm.branch(Op.BNZ, skip, ra=R4)
        asm.alu(AluFn.ADD, R4, R0, R1)
        prev_value(R0)
        asm.alui(AluFn.XOR, R0, R0, INT_MIN)
        asm.alui(AluFn.ADD, R0, R0, 1)
        asm.stream(AluFn.SUB, a=rx, a_base=R4, n=R5, b_mode=BMode.SCALAR, b_val=R0,
                   d_mode=DMode.ARGMAX, rd=R4)
        asm.alu(AluFn.ADD, R4, R4, R0)
        prev_value(R0)
        asm.branch(Op.BLT, skip, ra=R0, rb=R4)
        take = ok()
        asm.alui(AluFn.SLT, R0, R7, 0)
        asm.branch(Op.BNZ, take, ra=R0)
        asm.branch(Op.BLT, take, ra=R6, rb=R4)
        asm.branch(Op.JMP, skip)
        asm.place(take)
        asm.alui(AluFn.ADD, R6, R4, 0)
        prev_index(R0)
        asm.alui(AluFn.ADD, R0, R0, lanes)
        asm.alui(AluFn.AND, R0, R0, -lanes)
        asm.alu(AluFn.ADD, R7, R5, R0)
        asm.place(skip)
        if cols % lanes:
            # The last word (its padding lanes left out), unless scanned above already.
            skip = ok()
            prev_index(R0)
            asm.alui(AluFn.ADD, R0, R0, lanes)
            asm.alui(AluFn.SHRU, R0, R0, lb)
            asm.alui(AluFn.SLT, R0, R0, full + 1)
            asm.branch(Op.BZ, skip, ra=R0)
            asm.li(R5, full * lanes)
            word(R5)
            asm.place(skip)
        asm.emit(Op.LSET, ra=R7, rb=R3, imm=0)
        asm.emit(Op.LSET, ra=R6, rb=R3, imm=voff)
        asm.alui(AluFn.ADD, R3, R3, 1)
        asm.alui(AluFn.SLT, R0, R3, first + k)
        asm.branch(Op.BNZ, head, ra=R0)

    def body():
        asm.li(R3, first)
        asm.li(R0, -1)
        asm.emit(Op.LSET, ra=R0, rb=R3, imm=-1)
        asm.li(R0, INT_MAX)
        asm.emit(Op.LSET, ra=R0, rb=R3, imm=voff - 1)
        asm.loop(rnd)
        # The indices out, a word of lanes at a time (R3 walks them, R4 counts).
        asm.li(R3, first)
        whole, rest = divmod(k, lanes)

        def put(n):
            asm.emit(Op.VCLR)
            for lane in range(n):
                asm.emit(Op.LGET, rd=R5, rb=R3, imm=lane)
                asm.emit(Op.VSET, fn=lane, ra=R5)
            asm.emit(Op.VAPPEND, rd=SINK, ra=out)

        if whole:
            asm.li(R4, whole)

            def words(head):
                put(lanes)
                asm.alui(AluFn.ADD, R3, R3, lanes)
                asm.branch(Op.LOOP, head, ra=R4)
            asm.loop(words)
        if rest:
            put(rest)
    row_loop(lw, g, op.ins[0], rx, [(R1, bx, lx.cw)], body)


@template("take")
def take(lw, g, op):
    """x[t, idx[t, j]]. When all of x and the indices fit the free local buffer
    (:func:`take_local`), no stream a row. Otherwise per row the row of x is copied to the
    local buffer, and each element at a run-time position is an LGET of it (the indices staged
    in the local buffer too)."""
    x, idx = op.ins
    lx, li = lw.tensors[x].layout, lw.tensors[idx].layout
    rx, bx = lw.ref(g, x)
    k = li.cols
    lanes = lw.lanes
    asm, out = g.asm, g.out
    if not (lx.dynamic or li.dynamic) and lx.words + li.words <= g.local_top:
        take_local(lw, g, op, rx, bx)
        return
    # A row longer than the free local buffer: the word of each element is copied alone.
    long = lx.cw > g.local_top
    (ti,) = stage(lw, g, op, 1 if long else lx.cw, [idx])

    def body():
        if not long:
            asm.stream(AluFn.PASS, a=rx, a_base=R1, n=lx.cw, d_mode=DMode.LOCAL, d_base=0)
        asm.emit(Op.VCLR)
        for j in range(k):
            ti.load(asm, R5, R3, j, R4)
            if long:
                take_word(asm, rx, lw.lb, lanes)
            asm.emit(Op.LGET, rd=R5, rb=R5, imm=0)
            asm.emit(Op.VSET, fn=j % lanes, ra=R5)
            if j % lanes == lanes - 1 or j == k - 1:
                asm.emit(Op.VAPPEND, rd=SINK, ra=out)
                asm.emit(Op.VCLR)
    row_loop(lw, g, x, rx, [(R1, bx, lx.cw), ti.offsets(R3)], body)

def take_local(lw, g, op, rx, bx):
    """Take with every row of x copied to the local buffer (words ``0 ..``) by one stream and
    the indices staged after it: each index is replaced in place by the element it names (LGET
    of the index, LGET of the element, LSET), so the staged table becomes the result, padding
    lanes still 0; the output is appended as zeros and the table added to it by one stream
    each (a stream's A comes from an MU)."""
    x, idx = op.ins
    lx, li = lw.tensors[x].layout, lw.tensors[idx].layout
    asm, out = g.asm, g.out
    lanes = lw.lanes
    asm.stream(AluFn.PASS, a=rx, a_base=bx, n=lx.words, d_mode=DMode.LOCAL, d_base=0)
    (ti,) = stage(lw, g, op, lx.words, [idx])
    at = ti.start // lanes
    asm.stream(AluFn.AND, a=rx, a_base=bx, a_stride=0, n=li.words, d_mode=DMode.APPEND,
               d_ref=out)

    def body():
        for j in range(li.cols):
            asm.emit(Op.LGET, rd=R5, rb=R3, imm=j)
            asm.alu(AluFn.ADD, R5, R5, R1)
            asm.emit(Op.LGET, rd=R5, rb=R5, imm=0)
            asm.emit(Op.LSET, ra=R5, rb=R3, imm=j)
    row_loop(lw, g, x, rx, [(R1, 0, lx.cw * lanes), ti.offsets(R3)], body)
    asm.stream(AluFn.ADD, a=out, a_base=0, n=li.words, b_mode=BMode.LOCAL, b_val=at,
               b_stride=1, d_mode=DMode.WRITE, d_ref=out, d_base=0, d_stride=1)

def take_word(asm, rx, lb, lanes):
    """The word of row R1 holding element R5 copied to local word 0, R5 its lane there."""
    asm.alui(AluFn.SHRU, R4, R5, lb)
    asm.alu(AluFn.ADD, R4, R4, R1)
    asm.stream(AluFn.PASS, a=rx, a_base=R4, n=1, d_mode=DMode.LOCAL, d_base=0)
    asm.alui(AluFn.AND, R5, R5, lanes - 1)


#: Tokens up to which a dispatch's scan is unrolled (each is about ``2 k + 3`` instructions).
UNROLL_TOKENS = 8


def route_test(asm, table, r_row, k, expert, targets):
    """Branch to ``targets[j]`` at the first slot j of the row whose index is ``expert``;
    fall through if none is."""
    for j in range(k):
        table.load(asm, R5, r_row, j, R6)
        asm.alui(AluFn.XOR, R5, R5, expert)
        asm.branch(Op.BZ, targets[j], ra=R5)

@template("dispatch")
def dispatch(lw, g, op):
    """Rows routed to the expert are appended, in token order (a run-time count): see
    :func:`routed_rows`."""
    x = op.ins[0]
    rx, _ = lw.ref(g, x)
    cw = lw.tensors[x].layout.cw
    routed_rows(lw, g, op, 0, lambda word: g.asm.stream(
        AluFn.PASS, a=rx, a_base=word, n=cw, d_mode=DMode.APPEND, d_ref=g.out),
        unroll=UNROLL_TOKENS)


def routed_rows(lw, g, op, scratch, row, unroll=1):
    """``row(word)`` for each token the indices (``op``'s last input) route to ``op.attrs
    ["expert"]``, in token order, ``word`` (an immediate or a register) the word of its row
    of ``x`` (``op.ins[0]``) in x's buffer. When the indices fit the local buffer after the
    op's ``scratch`` words they are staged XORed with the expert (one stream), so a slot
    naming it is one LGET and a BZ, and up to ``unroll`` tokens are unrolled (no loop
    counter, the row's word offset an immediate); else each slot is read and tested."""
    x, idx = op.ins[0], op.ins[-1]
    lx, li = lw.tensors[x].layout, lw.tensors[idx].layout
    rx, bx = lw.ref(g, x)
    asm = g.asm
    expert, lanes = op.attrs["expert"], lw.lanes
    if not li.dynamic and scratch + li.words <= g.local_top:
        ri, base = lw.ref(g, idx)
        asm.stream(AluFn.XOR, a=ri, a_base=base, n=li.words, b_mode=BMode.SCALAR,
                   b_val=expert, d_mode=DMode.LOCAL, d_base=scratch)
        at = scratch * lanes

        def token(reg, el, word):
            """The token whose indices start at element ``reg + el``, its row at ``word``."""
            hit, nxt = asm.label(), asm.label()
            for j in range(li.cols):
                asm.emit(Op.LGET, rd=R5, rb=reg, imm=at + el + j)
                asm.branch(Op.BZ, hit, ra=R5)
            asm.branch(Op.JMP, nxt)
            asm.place(hit)
            row(word)
            asm.place(nxt)

        if lx.rows <= unroll:
            asm.li(R3, 0)
            for t in range(lx.rows):
                token(R3, t * li.cw * lanes, bx + t * lx.cw)
        else:
            row_loop(lw, g, x, rx, [(R1, bx, lx.cw), (R3, 0, li.cw * lanes)],
                     lambda: token(R3, 0, R1))
        return
    (ti,) = stage(lw, g, op, scratch, [idx])

    def body():
        hit, nxt = asm.label(), asm.label()
        route_test(asm, ti, R3, li.cols, expert, [hit] * li.cols)
        asm.branch(Op.JMP, nxt)
        asm.place(hit)
        row(R1)
        asm.place(nxt)
    row_loop(lw, g, x, rx, [(R1, bx, lx.cw), ti.offsets(R3)], body)


@template("matmul_routed")
def matmul_routed(lw, g, op):
    """The rows of ``x`` routed to an expert times ``Bᵀ`` (a dispatch folded into the matmul
    that reads its rows: passes.FuseDispatch): per routed token (:func:`routed_rows`, the
    indices staged after the row), its row of ``x`` is copied to the local buffer and one
    PACK_SUM stream over the rows of ``Bᵀ`` appends its row of the product. The expert's rows
    are never copied through an MU buffer, and the tokens' reads of ``x`` are spread over the
    matmul instead of all taken at once by every expert's dispatch."""
    x, bt, _ = op.ins
    lx, lb = lw.tensors[x].layout, lw.tensors[bt].layout
    rx, _ = lw.ref(g, x)
    rb, base_b = lw.ref(g, bt)
    kw, asm, out = lx.cw, g.asm, g.out
    lw.need_local(g, op, kw, "a routed token's row")

    def row(word):
        asm.stream(AluFn.PASS, a=rx, a_base=word, n=kw, d_mode=DMode.LOCAL, d_base=0)
        pack_row(asm, out, rb, base_b, kw, lb.rows, kw, 0, op.attrs.get("epilogue"))
    routed_rows(lw, g, op, kw, row)

def routing_checked(lw, idx, experts):
    """Whether the routing indices ``idx`` need no check at run time: a ``topk`` over
    ``experts`` columns made them (or made every row block of them), so every row names
    distinct experts, all in range."""
    p = lw.tensors[idx].producer
    op = lw.ops.get(p) if p is not None else None
    if op is not None and op.kind == "concat_rows" and op.out == idx:
        # A router split by rows (rdakit.compiler.split): its blocks' indices concatenated.
        return all(routing_checked(lw, i, experts) for i in op.ins)
    return (op is not None and op.kind == "topk" and op.out == idx
            and lw.tensors[op.ins[0]].layout.cols == experts)


@template("combine")
def combine(lw, g, op):
    """out = sum over each token's routing slots of ``(gate * y_e row) >> shift``, ``e`` the
    expert the slot names and the row that expert's next one (the rows are in token order).
    When the staged indices and gates and the per-expert tables fit the local buffer (with the
    whole output or one row of it), the slots are walked in token order
    (:func:`combine_slots`: one or two streams a slot, no scan of every expert for every
    token). When only a few output rows fit, and the indices need no check, the slots are
    walked the same way a chunk of rows at a time (:func:`combine_chunks`). Otherwise out = 0,
    then expert by expert,
    each token routed to it is two streams: the product into the local buffer, then ``out row
    += local`` in place (the indices and gates staged in the local buffer when they fit)."""
    idx, gate, *ys = op.ins
    li, lg, lo = (lw.tensors[t].layout for t in (idx, gate, op.out))
    asm, out = g.asm, g.out
    dw, k = lo.cw, li.cols
    if lo.rows == 0:
        for y in ys:
            lw.ref(g, y)
        return
    check = not routing_checked(lw, idx, len(ys))
    # The per-expert tables: references, next rows, and the last token (duplicate slots).
    tables = -(-len(ys) * (3 if check and k > 1 else 2) // lw.lanes)
    fixed = tables + li.words + lg.words
    if not (li.dynamic or lg.dynamic):
        if lo.words + fixed <= g.local_top:
            combine_slots(lw, g, op, tables, check)
            return
        if lo.words + li.words + lg.words <= g.local_top:
            combine_experts(lw, g, op, acc=True)
            return
        if not check and dw + fixed <= g.local_top:
            combine_chunks(lw, g, op, tables)
            return
        if dw + li.words + lg.words <= g.local_top:
            combine_experts(lw, g, op, acc=False)
            return
    ti, tg = stage(lw, g, op, dw, [idx, gate])
    base_i = lw.key_of(idx, g.xy)[1]
    asm.stream(AluFn.AND, a=ti.ref, a_base=base_i, a_stride=0, n=lo.words,
               d_mode=DMode.APPEND, d_ref=out)
    for e, y in enumerate(ys):
        ry, by = lw.ref(g, y)
        asm.li(R7, by)

        def body(ry=ry, e=e):
            hits = [asm.label() for _ in range(k)]
            do, nxt = asm.label(), asm.label()
            route_test(asm, ti, R1, k, e, hits)
            asm.branch(Op.JMP, nxt)
            for j in range(k):
                asm.place(hits[j])
                tg.load(asm, R6, R3, j, R6)
                if j < k - 1:
                    asm.branch(Op.JMP, do)
            asm.place(do)
            asm.stream(AluFn.MUL, a=ry, a_base=R7, n=dw, b_mode=BMode.SCALAR, b_val=R6,
                       shift=op.attrs["shift"], d_mode=DMode.LOCAL, d_base=0)
            asm.stream(AluFn.ADD, a=out, a_base=R4, n=dw, b_mode=BMode.LOCAL, b_val=0,
                       b_stride=1, d_mode=DMode.WRITE, d_ref=out, d_base=R4, d_stride=1)
            asm.alui(AluFn.ADD, R7, R7, dw)
            asm.place(nxt)
        row_loop(lw, g, idx, ti.ref, [ti.offsets(R1), tg.offsets(R3), (R4, 0, dw)], body)
        g.refs.unpin(lw.key_of(y, g.xy)[0])

def combine_experts(lw, g, op, acc):
    """Combine expert by expert (each expert's rows as soon as they arrive, while the other
    experts may still be computing), when the slot walk's tables do not fit: local words
    ``0 ..`` the output's rows (``acc``) or one row of products, then the indices XORed with
    the expert (restaged by one stream for each expert, so a slot naming it is an LGET and a
    BZ), then the gates. The output is zeroed by one stream; per token routed to the expert
    (its first slot naming it, as the reference takes): with ``acc`` one stream accumulating
    the product into the token's local row (LOCAL_ACC; one stream at the end adds them to the
    output), else the product into the local row, then ``out row += local`` in place."""
    idx, gate, *ys = op.ins
    li, lo = lw.tensors[idx].layout, lw.tensors[op.out].layout
    asm, out = g.asm, g.out
    dw, k, lanes = lo.cw, li.cols, lw.lanes
    rows = lo.words if acc else dw
    lw.need_local(g, op, rows + 2 * li.words)
    ri, base_i = lw.ref(g, idx)
    asm.stream(AluFn.AND, a=ri, a_base=base_i, a_stride=0, n=lo.words,
               d_mode=DMode.APPEND, d_ref=out)
    if acc:
        asm.stream(AluFn.AND, a=ri, a_base=base_i, a_stride=0, n=lo.words,
                   d_mode=DMode.LOCAL, d_base=0)
    tg = RowTable(lw, g, gate, rows + li.words)
    gd = li.words * lanes                  # from an index's element to its gate's
    for e, y in enumerate(ys):
        ri, base_i = lw.ref(g, idx)
        asm.stream(AluFn.XOR, a=ri, a_base=base_i, n=li.words, b_mode=BMode.SCALAR, b_val=e,
                   d_mode=DMode.LOCAL, d_base=rows)
        ry, by = lw.ref(g, y)
        asm.li(R7, by)

        def body(ry=ry):
            hits = [asm.label() for _ in range(k)]
            do, nxt = asm.label(), asm.label()
            for j in range(k):
                asm.emit(Op.LGET, rd=R5, rb=R1, imm=j)
                asm.branch(Op.BZ, hits[j], ra=R5)
            asm.branch(Op.JMP, nxt)
            for j in range(k):
                asm.place(hits[j])
                asm.emit(Op.LGET, rd=R6, rb=R1, imm=j + gd)
                if j < k - 1:
                    asm.branch(Op.JMP, do)
            asm.place(do)
            if acc:
                asm.stream(AluFn.MUL, a=ry, a_base=R7, n=dw, b_mode=BMode.SCALAR, b_val=R6,
                           shift=op.attrs["shift"], d_mode=DMode.LOCAL_ACC, d_base=R4)
            else:
                asm.stream(AluFn.MUL, a=ry, a_base=R7, n=dw, b_mode=BMode.SCALAR, b_val=R6,
                           shift=op.attrs["shift"], d_mode=DMode.LOCAL, d_base=0)
                asm.stream(AluFn.ADD, a=out, a_base=R4, n=dw, b_mode=BMode.LOCAL, b_val=0,
                           b_stride=1, d_mode=DMode.WRITE, d_ref=out, d_base=R4, d_stride=1)
            asm.alui(AluFn.ADD, R7, R7, dw)
            asm.place(nxt)
        row_loop(lw, g, idx, ri, [(R1, rows * lanes, li.cw * lanes), (R4, 0, dw)], body)
        g.refs.unpin(lw.key_of(y, g.xy)[0])
    del tg
    if acc:
        asm.stream(AluFn.ADD, a=out, a_base=0, n=lo.words, b_mode=BMode.LOCAL, b_val=0,
                   b_stride=1, d_mode=DMode.WRITE, d_ref=out, d_base=0, d_stride=1)

def expert_tables(lw, g, ys, refs, rows):
    """The per-expert tables of a walk over the routing slots (:func:`combine_slots`,
    :func:`combine_chunks`): expert ``e``'s reference at element ``refs + e`` of the local
    buffer and the word of its next row at ``rows + e``."""
    asm = g.asm
    for e, y in enumerate(ys):
        ry, by = lw.ref(g, y)
        asm.li(R1, 0)
        asm.emit(Op.LSET, ra=ry, rb=R1, imm=refs + e)
        asm.li(R0, by)
        asm.emit(Op.LSET, ra=R0, rb=R1, imm=rows + e)
        g.refs.unpin(lw.key_of(y, g.xy)[0])


def slot_operands(asm, gate, refs, rows, dw):
    """With R4 a slot's expert (:func:`expert_tables`) and the slot's gate at element R1 +
    ``gate``: R5 the expert's reference, R6 its next row, R7 the gate; the expert's next row
    moved on by ``dw`` words."""
    asm.emit(Op.LGET, rd=R5, rb=R4, imm=refs)
    asm.emit(Op.LGET, rd=R6, rb=R4, imm=rows)
    asm.emit(Op.LGET, rd=R7, rb=R1, imm=gate)
    asm.alui(AluFn.ADD, R0, R6, dw)
    asm.emit(Op.LSET, ra=R0, rb=R4, imm=rows)


#: Output rows :func:`combine_chunks` accumulates in the local buffer at most (its code is
#: unrolled over them).
CHUNK_ROWS = 4


def combine_chunks(lw, g, op, tables):
    """Combine walking the routing slots in token order, :data:`CHUNK_ROWS` output rows at a
    time at most, when the whole output does not fit the local buffer beside the per-expert
    tables and the staged indices and gates (:func:`combine_slots`) but a few rows do, and the
    indices need no check (every slot names a distinct expert in range, so every slot runs).
    Local words ``0 ..`` hold the chunk's rows, then the tables (each expert's reference and
    the word of its next row), then the indices and gates. A token's slot 0 is appended to the
    output (the rows are built in token order: no pass zeroes it first), its other slots go
    into the token's local row (the first overwriting what the last chunk left, the rest
    accumulated), and one stream per chunk adds the chunk's local rows to its output rows."""
    idx, gate, *ys = op.ins
    li, lg, lo = (lw.tensors[t].layout for t in (idx, gate, op.out))
    asm, out = g.asm, g.out
    dw, k, lanes, experts = lo.cw, li.cols, lw.lanes, len(ys)
    chunk = max(1, min(CHUNK_ROWS, lo.rows,
                       (g.local_top - tables - li.words - lg.words) // dw))
    ti, tg = stage(lw, g, op, chunk * dw + tables, [idx, gate])
    refs = chunk * dw * lanes              # element offsets of the tables
    rows = refs + experts
    expert_tables(lw, g, ys, refs, rows)
    gd = tg.start - ti.start
    step = li.cw * lanes
    shift = op.attrs["shift"]

    def scalars(j, at):
        """R5-R7 of slot ``j`` of the token at element R1 + ``at``."""
        asm.emit(Op.LGET, rd=R4, rb=R1, imm=at + j)
        slot_operands(asm, at + j + gd, refs, rows, dw)

    def product(j, row, run=True):
        """Slot ``j``'s product into local row ``row`` (slot 0: appended to the output)."""
        dst = (dict(d_mode=DMode.APPEND, d_ref=out) if j == 0 else
               dict(d_mode=DMode.LOCAL if j == 1 else DMode.LOCAL_ACC, d_base=row * dw,
                    d_stride=1))
        return asm.stream(AluFn.MUL, a=R5, a_base=R6, n=dw, b_mode=BMode.SCALAR, b_val=R7,
                          shift=shift, run=run, **dst)

    def rows_of(count, more):
        """``count`` tokens from the one at R1 (output word R3; its slot 0's scalars read
        already), then their local rows added to their output rows. An LGET waits for a
        stream writing the local buffer, so the next token's slot 0 (with ``more``, also
        the one after the last: R1 + ``count * step``) is read after the token's last stream
        is configured and before it starts."""
        for t in range(count):
            for j in range(k):
                if j:
                    scalars(j, t * step)
                if j < k - 1 or not (t < count - 1 or more):
                    product(j, t)
                    continue
                srun = product(j, t, run=False)
                scalars(0, (t + 1) * step)
                srun()
        if k > 1:
            asm.stream(AluFn.ADD, a=out, a_base=R3, n=count * dw, b_mode=BMode.LOCAL,
                       b_val=0, b_stride=1, d_mode=DMode.WRITE, d_ref=out, d_base=R3,
                       d_stride=1)

    def advance():
        asm.alui(AluFn.ADD, R1, R1, chunk * step)
        asm.alui(AluFn.ADD, R3, R3, chunk * dw)

    full, rest = divmod(lo.rows, chunk)
    asm.li(R1, ti.start)
    asm.li(R3, 0)
    scalars(0, 0)
    # The chunks that read the next one's first token: all but the last.
    ahead = full if rest else full - 1
    if ahead > 1:
        asm.li(COUNT, ahead)

        def loop(head):
            rows_of(chunk, True)
            advance()
            asm.branch(Op.LOOP, head, ra=COUNT)
        asm.loop(loop)
    elif ahead:
        rows_of(chunk, True)
        advance()
    if rest:
        rows_of(rest, False)
    else:
        rows_of(chunk, False)


def combine_slots(lw, g, op, tables, check):
    """Combine walking the routing slots in token order. The local buffer holds the output's
    rows (words ``0 ..``), then the per-expert tables (``tables`` words: each expert's
    reference, the word of its next row, and with ``check`` the last token that named it),
    then the staged indices and gates. The output is zeroed by one stream; a token's slot 0 is
    written straight into its row (no local write, so the next slot's LGETs need not wait for
    the stream), the other slots accumulated into the token's local row (LOCAL_ACC), and one
    stream at the end adds the local rows to the output. An LGET waits for a stream writing
    the local buffer, so without ``check`` the next token's slot 0 is read before the last
    slot's stream is started (its fields configured first), and that stream runs while the
    next token's slot 0 starts. With ``check``, a slot whose index is out of range or names an
    expert an earlier slot of the token named is skipped, as the reference does."""
    idx, gate, *ys = op.ins
    li, lo = lw.tensors[idx].layout, lw.tensors[op.out].layout
    asm, out = g.asm, g.out
    dw, k, lanes, experts = lo.cw, li.cols, lw.lanes, len(ys)
    ti, tg = stage(lw, g, op, lo.words + tables, [idx, gate])
    refs = lo.words * lanes                # element offsets of the tables
    rows = refs + experts
    last = rows + experts
    base_i = lw.key_of(idx, g.xy)[1]
    asm.stream(AluFn.AND, a=ti.ref, a_base=base_i, a_stride=0, n=lo.words,
               d_mode=DMode.APPEND, d_ref=out)
    if k > 1:
        asm.stream(AluFn.AND, a=ti.ref, a_base=base_i, a_stride=0, n=lo.words,
                   d_mode=DMode.LOCAL, d_base=0)
    expert_tables(lw, g, ys, refs, rows)
    if check and k > 1:
        asm.li(R1, 0)
        asm.li(R0, -1)
        for e in range(experts):
            asm.emit(Op.LSET, ra=R0, rb=R1, imm=last + e)
    gd = tg.start - ti.start
    step = li.cw * lanes
    shift = op.attrs["shift"]

    def scalars(j, at=0):
        """Slot ``j`` of the token at element R1 + ``at``: R4 the expert, R5 its reference,
        R6 its row, R7 the gate; its next row counted. With ``check``, branches to the label
        returned when the slot is skipped."""
        skip = asm.label()
        asm.emit(Op.LGET, rd=R4, rb=R1, imm=at + j)
        if check:
            asm.alui(AluFn.SLT, R0, R4, 0)
            asm.branch(Op.BNZ, skip, ra=R0)
            asm.alui(AluFn.SLT, R0, R4, experts)
            asm.branch(Op.BZ, skip, ra=R0)
            if j:
                asm.emit(Op.LGET, rd=R0, rb=R4, imm=last)
                asm.alu(AluFn.XOR, R0, R0, R1)
                asm.branch(Op.BZ, skip, ra=R0)
            if k > 1 and j < k - 1:
                asm.emit(Op.LSET, ra=R1, rb=R4, imm=last)
        slot_operands(asm, at + j + gd, refs, rows, dw)
        return skip

    def fields(j):
        dst = (dict(d_mode=DMode.WRITE, d_ref=out) if j == 0
               else dict(d_mode=DMode.LOCAL_ACC))
        return dict(a=R5, a_base=R6, n=dw, b_mode=BMode.SCALAR, b_val=R7, shift=shift,
                    d_base=R3, d_stride=1, **dst)

    def run(j):
        asm.stream(AluFn.MUL, **fields(j))

    def body():
        # R1: the token's first index (element of the local buffer, unique to the token),
        # R3: its output row.
        for j in range(k):
            skip = scalars(j)
            run(j)
            asm.place(skip)

    if check or k == 1 or lo.rows == 1:
        row_loop(lw, g, idx, ti.ref, [ti.offsets(R1), (R3, 0, dw)], body)
    else:
        def token(last):
            """A token whose slot 0 is in R4..R7; unless ``last``, the next one's read before
            the last slot's stream starts."""
            run(0)
            for j in range(1, k):
                scalars(j)
                if j < k - 1 or last:
                    run(j)
                    continue
                srun = asm.stream(AluFn.MUL, run=False, **fields(j))
                scalars(0, step)
                srun()

        def advance():
            asm.alui(AluFn.ADD, R1, R1, step)
            asm.alui(AluFn.ADD, R3, R3, dw)

        asm.li(R1, ti.start)
        asm.li(R3, 0)
        scalars(0)
        if lo.rows > 2:
            asm.li(COUNT, lo.rows - 1)

            def loop(head):
                token(False)
                advance()
                asm.branch(Op.LOOP, head, ra=COUNT)
            asm.loop(loop)
        else:
            token(False)
            advance()
        token(True)
    if k > 1:
        asm.stream(AluFn.ADD, a=out, a_base=0, n=lo.words, b_mode=BMode.LOCAL, b_val=0,
                   b_stride=1, d_mode=DMode.WRITE, d_ref=out, d_base=0, d_stride=1)


# The integer non-linear ops (rdakit.compiler.intops): each is a sequence of stream passes over
# a stretch of the output (its first pass reads the input and appends), with per-lane operands
# kept in the op's slots of the local buffer and per-row scalars (a row's maximum, sum,
# reciprocal, mean, square root) computed by short scalar loops: the ALU has no divide and no
# square root. Each reproduces its reference in intops bit for bit.

class Local(int):
    """A word offset in the local buffer, as a pass's second operand or destination."""


class Passes:
    """Stream passes over ``n`` words of the output at word ``base`` (an int or a register):
    ``run(fn, b=..., dst=...)`` is one pass ``post(fn(a, b) >> shift)`` reading ``a`` from the
    output (or ``src = (ref, base)``) and writing it back (``dst`` None), appending it
    (``"append"``), into the local buffer (a :class:`Local`) or reducing it into a register
    (``("sum", r)``, ``("max", r)``); ``b`` is None (zero), an immediate, a register (a scalar
    in every lane) or a :class:`Local` (a vector of ``n`` words)."""

    def __init__(self, asm, out, base, n):
        self.asm, self.out, self.base, self.n = asm, out, base, n

    def run(self, fn, b=None, dst=None, *, src=None, shift=0, relu=False):
        a, a_base = src if src is not None else (self.out, self.base)
        kw = dict(a=a, a_base=a_base, n=self.n, shift=shift, relu=relu)
        if isinstance(b, Local):
            kw.update(b_mode=BMode.LOCAL, b_val=int(b), b_stride=1)
        elif b is not None:
            kw.update(b_mode=BMode.SCALAR, b_val=b if isinstance(b, Reg) else int(b) & MASK32)
        if dst is None:
            kw.update(d_mode=DMode.WRITE, d_ref=self.out, d_base=self.base)
        elif dst == "append":
            kw.update(d_mode=DMode.APPEND, d_ref=self.out)
        elif isinstance(dst, Local):
            kw.update(d_mode=DMode.LOCAL, d_base=int(dst))
        else:
            mode, rd = dst
            kw.update(d_mode=DMode.SUM if mode == "sum" else DMode.MAX, rd=rd)
        self.asm.stream(fn, **kw)

    def chain(self, src, stages):
        """The stages ``(fn, b, shift)`` of a pass chain: the first reads ``src`` and appends,
        the others rewrite the output; with no stage, a copy."""
        stages = stages or [(AluFn.PASS, None, 0)]
        for i, (fn, b, shift) in enumerate(stages):
            if i == 0:
                self.run(fn, b, "append", src=src, shift=shift)
            else:
                self.run(fn, b, shift=shift)


def clip_stages(dtype, lo, hi):
    """MAX/MIN stages saturating a ``dtype`` tensor to ``[lo, hi]`` (none where its range is
    inside already)."""
    info = np.iinfo(dtype)
    return ([(AluFn.MAX, lo, 0)] if info.min < lo else []) + (
        [(AluFn.MIN, hi, 0)] if info.max > hi else [])


def div_loop(asm, rem, ds, q, bit, qbits):
    """``q = rem // d`` for a quotient below ``2**qbits``, by restoring division: ``ds`` holds
    ``d`` and must be able to hold ``d << (qbits - 1)`` (``rem`` and ``ds`` are clobbered)."""
    asm.alui(AluFn.SHL, ds, ds, qbits - 1)
    asm.li(bit, 1 << (qbits - 1))
    asm.li(q, 0)

    def body(head):
        skip = asm.label()
        asm.branch(Op.BLT, skip, ra=rem, rb=ds)
        asm.alu(AluFn.SUB, rem, rem, ds)
        asm.alu(AluFn.OR, q, q, bit)
        asm.place(skip)
        asm.alui(AluFn.SHRU, ds, ds, 1)
        asm.alui(AluFn.SHRU, bit, bit, 1)
        asm.branch(Op.BNZ, head, ra=bit)
    asm.loop(body)


def elementwise(lw, g, op, slots, first, rest, after=None):
    """An elementwise op over the whole tensor in chunks of words: ``first`` stages read the
    input and append, ``rest(p, slot)`` emits the later passes (``slot(k)`` is the k-th local
    slot of the chunk's size), ``after(n)`` (``n`` the words, an int or R2) what follows the
    whole tensor; nothing runs for an empty dynamic input."""
    (x,) = op.ins[:1]
    asm, out = g.asm, g.out
    rx, bx = lw.ref(g, x)
    n = words_of(lw, g, x, rx, R2)
    if n == 0:
        return
    lw.need_local(g, op, slots)
    chunk = g.local_top // slots
    end = asm.label()
    if isinstance(n, Reg):
        asm.branch(Op.BZ, end, ra=R2)

    def slot(k):
        return Local(k * chunk)

    if not isinstance(n, Reg) and n <= chunk:
        p = Passes(asm, out, 0, n)
        p.chain((rx, bx), first)
        rest(p, lambda k: Local(k * n))
    else:
        if not isinstance(n, Reg):
            asm.li(R2, n)
        asm.li(R1, 0)

        def body(head):
            asm.alu(AluFn.SUB, R3, R2, R1)
            asm.alui(AluFn.MIN, R3, R3, chunk)
            asm.alui(AluFn.ADD, R4, R1, bx)
            p = Passes(asm, out, R1, R3)
            p.chain((rx, R4), first)
            rest(p, slot)
            asm.alu(AluFn.ADD, R1, R1, R3)
            asm.branch(Op.BLT, head, ra=R1, rb=R2)
        asm.loop(body)
    if after is not None:
        after(n)
    asm.place(end)


def chunk_words(words, budget):
    """The chunk of a row of ``words`` walked in ``budget``-word chunks: as even as the
    fewest chunks allow, so that most rows need no shorter last chunk."""
    count = -(-words // max(budget, 1))
    return -(-words // count)


def row_chunks(asm, out, words, chunk, regs, count, body):
    """``body(p)`` over a row of ``words`` words in chunks of ``chunk`` (the last may be
    shorter): ``p`` is the :class:`Passes` of the chunk at word ``regs[0]`` of the output;
    each ``(reg, start)`` of ``regs`` (``start`` a register or an int) starts at ``start``
    and advances by ``chunk``. The whole chunks run in a loop counted in ``count``, a
    shorter last one after it."""
    column_chunks(asm, words, chunk, regs, count,
                  lambda n: body(Passes(asm, out, regs[0][0], n)))


def column_chunks(asm, words, chunk, regs, count, body):
    """``body(n)`` for each chunk of ``n`` words of ``words`` (chunks of ``chunk``, the last
    may be shorter), as :func:`row_chunks`: each ``(reg, start)`` of ``regs`` starts at
    ``start`` and advances by ``chunk``."""
    full, tail = divmod(words, chunk)

    def advance():
        for reg, _ in regs:
            asm.alui(AluFn.ADD, reg, reg, chunk)

    for reg, start in regs:
        if isinstance(start, Reg):
            if start != reg:
                asm.alui(AluFn.ADD, reg, start, 0)
        else:
            asm.li(reg, start)
    if full == 1:
        body(chunk)
        if tail:
            advance()
    elif full > 1:
        asm.li(count, full)

        def loop(head):
            body(chunk)
            advance()
            asm.branch(Op.LOOP, head, ra=count)
        asm.loop(loop)
    if tail:
        body(tail)


def iexp_passes(p, slot, extra_shift=0):
    """i-exp of ``u`` (the output holds it): ``z = u >> E`` into ``slot(0)``, ``r = u & (2**E -
    1)``, ``r * (r - 2 q_b) + q_b^2 + q_c`` (= ``(r - q_b)^2 + q_c``), then ``>> z`` (and
    ``>> extra_shift``)."""
    qb, qc, _, _ = intops.exp_consts()
    p.run(AluFn.PASS, dst=slot(0), shift=intops.EXP_BITS)
    p.run(AluFn.AND, (1 << intops.EXP_BITS) - 1)
    p.run(AluFn.SUB, 2 * qb, slot(1))
    p.run(AluFn.MUL, slot(1))
    p.run(AluFn.ADD, qb * qb + qc)
    p.run(AluFn.SHR, slot(0), shift=extra_shift)


@template("exp")
def exp(lw, g, op):
    """``u = (clip(x, -clip, 0) * -mult) >> shift``, then i-exp (:func:`iexp_passes`); padding
    lanes masked at the end."""
    a = op.attrs
    first = clip_stages(op.attrs["dtype"], -a["clip"], 0) + [
        (AluFn.MUL, -a["mult"], a["shift"])]
    elementwise(lw, g, op, 2, first, iexp_passes, padding_mask(lw, g, op))


def padding_mask(lw, g, op):
    """The ``after`` of :func:`elementwise` for an op whose 0 is not 0 (exp, sigmoid): one
    AND stream of every row with the ``mask{cols}`` constant zeroes the padding lanes; None
    when the rows have none."""
    lo = lw.tensors[op.out].layout
    if not lo.cols % lw.lanes:
        return None

    def mask(n):
        rows = lo.rows if not isinstance(n, Reg) else rows_of(g, R2, lo.cw, R3, R4)
        g.asm.stream(AluFn.AND, a=g.out, a_base=0, n=lo.cw, outer=rows, a_ostride=lo.cw,
                     b_mode=BMode.LOCAL, b_val=g.local[f"mask{lo.cols}"], b_stride=1,
                     b_ostride=0, d_mode=DMode.WRITE, d_ref=g.out, d_base=0, d_stride=1)
    return mask


def act(kind):
    @template(kind)
    def lower_act(lw, g, op):
        """``t`` (rounded requantization), then ``t * q + |t| * ((q_half - v^2) >> 14)`` with
        ``v = relu(q_c - |t|)``: slots hold ``t`` (then ``-v``), ``t * q`` and ``|t|``."""
        a = op.attrs
        q_c, q_half, q, _ = intops.act_consts(kind)
        h = (1 << a["shift"]) >> 1
        first = clip_stages(a["dtype"], -a["clip"], a["clip"])
        first += ([(AluFn.MUL, a["mult"], 0), (AluFn.ADD, h, a["shift"])] if h
                  else [(AluFn.MUL, a["mult"], a["shift"])])

        def rest(p, slot):
            p.run(AluFn.PASS, dst=slot(0))                     # t
            p.run(AluFn.MUL, q, slot(1))                       # t * q
            p.run(AluFn.MUL, -1)                               # -t
            p.run(AluFn.MAX, slot(0), slot(2))                 # |t|
            p.run(AluFn.MIN, slot(0))                          # -|t|
            p.run(AluFn.ADD, q_c, relu=True)                   # v
            p.run(AluFn.MUL, -1, slot(0))                      # -v
            p.run(AluFn.MUL, slot(0))                          # -v^2
            p.run(AluFn.ADD, q_half, shift=intops.ACT_G_SHIFT)  # G
            p.run(AluFn.MUL, slot(2))                          # |t| G
            p.run(AluFn.ADD, slot(1))                          # + t q
        elementwise(lw, g, op, 3, first, rest)
    return lower_act


act("gelu")
act("silu")


def logistic(kind):
    @template(kind)
    def lower_logistic(lw, g, op):
        """``t = x * mult``, its sign ``m = t >> 31`` kept in slot 0, ``u = ((t ^ m) - m) >>
        shift``, i-exp (slots 1 and 2) shifted right by 8, ``n = -e`` in Q15, ``D = n - 2**15``
        (``-d``) into slot 1, the quadratic ``y0`` (Horner), one Newton step (``y0`` in slot
        2), ``w = relu(y - 2**14)``, ``(w ^ m) - m`` (+ ``2**14`` for sigmoid); padding lanes
        masked at the end for sigmoid (its 0 is 2**14). No division: about 24 stream passes
        (:func:`rdakit.compiler.intops.logistic_ref`)."""
        a = op.attrs
        m_e, beta, alpha, gamma = intops.logistic_consts()
        one = 1 << intops.SIG_BITS
        first = clip_stages(a["dtype"], -a["clip"], a["clip"]) + [(AluFn.MUL, a["mult"], 0)]
        d_slot, y_slot = 1, 2

        def rest(p, slot):
            p.run(AluFn.PASS, dst=slot(0), shift=31)                # m
            p.run(AluFn.XOR, slot(0))
            p.run(AluFn.SUB, slot(0), shift=a["shift"])             # u = |t| >> shift
            iexp_passes(p, lambda k: slot(1 + k), intops.SIG_E_SHIFT)
            p.run(AluFn.MUL, -m_e, shift=intops.SIG_BITS)           # n = -e
            p.run(AluFn.ADD, -one, slot(d_slot))                    # D = -d
            p.run(AluFn.MUL, beta, shift=intops.SIG_BITS)
            p.run(AluFn.ADD, alpha)
            p.run(AluFn.MUL, slot(d_slot), shift=intops.SIG_BITS)
            p.run(AluFn.ADD, gamma)                                 # y0
            p.run(AluFn.PASS, dst=slot(y_slot))
            p.run(AluFn.MUL, slot(d_slot), shift=intops.SIG_BITS)
            p.run(AluFn.ADD, 2 * one)                               # 2 - d y0
            p.run(AluFn.MUL, slot(y_slot), shift=intops.SIG_BITS)   # y
            p.run(AluFn.ADD, -(one >> 1), relu=True)                # w
            p.run(AluFn.XOR, slot(0))
            p.run(AluFn.SUB, slot(0))                               # sgn(x) w
            if kind == "sigmoid":
                p.run(AluFn.ADD, one >> 1)
        after = padding_mask(lw, g, op) if kind == "sigmoid" else None
        elementwise(lw, g, op, 3, first, rest, after)
    return lower_logistic


logistic("sigmoid")
logistic("tanh")


@template("softmax")
def softmax(lw, g, op):
    """Per row: the maximum of the kept lanes (a MAX stream of ``min(x, L)``, ``L`` INT_MAX on
    kept lanes and INT_MIN on masked and padding lanes: a constant row, or built from the
    column positions for a causal row), ``u`` from ``max(min(x - m, L), -clip)``, i-exp shifted
    by the row's sum shift, a SUM stream, ``f = 2**30 // sum`` by a scalar loop (one bit a
    step), then ``min((e * f + 2**(29 - B)) >> (30 - B), 2**B - 1)``."""
    x = op.ins[0]
    a = op.attrs
    lx = lw.tensors[x].layout
    rx, bx = lw.ref(g, x)
    asm, out = g.asm, g.out
    cw, bits = lx.cw, a["out_bits"]
    causal = "causal" in a
    if 3 * cw > g.local_top or not (causal or lrow_fits(cw, lw.cp.local_words)):
        softmax_long(lw, g, op)
        return
    lw.need_local(g, op, 3 * cw)
    if causal:
        rp, bp = lw.ref(g, op.ins[1])
        mask = Local(2 * cw)
    elif lx.cols % lw.lanes:
        mask = Local(g.local[f"lrow{lx.cols}"])
    else:
        mask = None     # every lane kept: min(x, L) is x
    wide = a["dtype"] == "int32"
    shift_sum = intops.softmax_sum_shift(lx.cols)

    def slot(k):
        return Local(k * cw)

    def body():
        p = Passes(asm, out, R3, cw)
        appended = False
        if causal:
            # -1 on kept lanes (position - (i + k + 1) < 0), 0 elsewhere; XOR INT_MIN: L.
            p.run(AluFn.SUB, R4, "append", src=(rp, bp), shift=31)
            p.run(AluFn.XOR, INT_MIN, mask)
            appended = True
        src = (rx, R1)
        if wide:
            stages = [(AluFn.MAX, -(1 << 30), 0), (AluFn.MIN, (1 << 30) - 1, 0)]
            if appended:
                p.run(stages[0][0], stages[0][1], src=src)
                p.run(stages[1][0], stages[1][1])
            else:
                p.chain(src, stages)
                appended = True
            src = None
        if mask is None:
            p.run(AluFn.PASS, dst=("max", R5), src=src)
        else:
            p.run(AluFn.MIN, mask, ("max", R5), src=src)
        p.run(AluFn.SUB, R5, None if appended else "append", src=src)
        if mask is not None:
            p.run(AluFn.MIN, mask)
        p.run(AluFn.MAX, -a["clip"])
        p.run(AluFn.MUL, -a["mult"], shift=a["shift"])
        iexp_passes(p, slot, shift_sum)
        p.run(AluFn.PASS, dst=("sum", R5))
        softmax_scale(asm, p, bits)

    offsets = [(R1, bx, cw), (R3, 0, cw)] + ([(R4, a["causal"] + 1, 1)] if causal else [])
    row_loop(lw, g, x, rx, offsets, body)


def lrow_fits(cw, local_words):
    """Whether the ``lrow`` constant of a row of ``cw`` words (INT_MAX on its lanes, INT_MIN
    on padding) is kept in the local buffer for ``reduce_max`` and a softmax without a causal
    mask: when it and three slots of the row (a softmax's) fit. A longer row has the
    one-word ``ltail`` (its last word) instead, when it has padding lanes; the lowerer asks
    for the constant the templates use."""
    return 4 * cw <= local_words


def softmax_scale(asm, p, bits):
    """``f = 2**30 // sum`` (the sum in r5) by a scalar loop, then the passes of ``p`` to the
    probabilities of ``bits`` bits."""
    # The remainder starts at bit 30 of the numerator (its only one).
    asm.li(R6, 1)
    asm.li(R7, 0)
    asm.li(R0, 1 << intops.RECIP_BITS)

    def div(head):
        skip = asm.label()
        asm.branch(Op.BLT, skip, ra=R6, rb=R5)
        asm.alu(AluFn.SUB, R6, R6, R5)
        asm.alu(AluFn.OR, R7, R7, R0)
        asm.place(skip)
        asm.alui(AluFn.SHL, R6, R6, 1)
        asm.alui(AluFn.SHRU, R0, R0, 1)
        asm.branch(Op.BNZ, head, ra=R0)
    asm.loop(div)
    p.run(AluFn.MUL, R7)
    p.run(AluFn.ADD, 1 << (intops.RECIP_BITS - 1 - bits), shift=intops.RECIP_BITS - bits)
    p.run(AluFn.MIN, (1 << bits) - 1)


def softmax_long(lw, g, op):
    """Softmax of rows longer than the local buffer allows: the same passes, but the ones
    with a per-lane operand go over the row in chunks of two local slots. Per row: the
    maximum (a causal row: per chunk, ``L`` built in slot 0 and a MAX stream of ``min(x,
    L)``; otherwise one MAX stream, the last word's padding lanes forced to INT_MIN by the
    one-word ``ltail`` constant); ``u`` (a causal row: per chunk, ``d = x - m`` saved in slot
    0, ``L`` rebuilt in the output's chunk and ``min(L, d)``); per chunk i-exp and a SUM
    stream added up; the reciprocal and the last passes over the whole row."""
    x = op.ins[0]
    a = op.attrs
    lx = lw.tensors[x].layout
    rx, bx = lw.ref(g, x)
    asm, out = g.asm, g.out
    cw, bits = lx.cw, a["out_bits"]
    causal = "causal" in a
    lw.need_local(g, op, 2)
    chunk = chunk_words(cw, g.local_top // 2)
    if causal:
        rp, bp = lw.ref(g, op.ins[1])
    elif lx.cols % lw.lanes:
        tail = Local(g.local[f"lrow{lx.cols}"] + cw - 1 if f"lrow{lx.cols}" in g.local
                     else g.local[f"ltail{lx.cols}"])
    wide = a["dtype"] == "int32"
    clip = [(AluFn.MAX, -(1 << 30), 0), (AluFn.MIN, (1 << 30) - 1, 0)]
    shift_sum = intops.softmax_sum_shift(lx.cols)
    L, d = Local(0), Local(0)

    def walk(body, regs):
        """``body(p)`` per chunk, R1 (x) and R3 (the output) advanced chunk by chunk and put
        back after; R7 counts."""
        full, rest = divmod(cw, chunk)
        column_chunks(asm, cw, chunk, [(R1, R1), (R3, R3)] + regs, R7,
                      lambda n: body(Passes(asm, out, R3, n)))
        moved = chunk * (full if full > 1 or rest else 0)
        if moved:
            asm.alui(AluFn.ADD, R1, R1, -moved)
            asm.alui(AluFn.ADD, R3, R3, -moved)

    def body():
        p = Passes(asm, out, R3, cw)
        asm.li(R5, INT_MIN)
        if causal:
            def top(q):
                q.run(AluFn.SUB, R4, "append", src=(rp, R6), shift=31)
                q.run(AluFn.XOR, INT_MIN, L)
                src = (rx, R1)
                if wide:
                    for fn, b, _ in clip:
                        q.run(fn, b, src=src)
                        src = None
                q.run(AluFn.MIN, L, ("max", R0), src=src)
                asm.alu(AluFn.MAX, R5, R5, R0)
            walk(top, [(R6, bp)])
        else:
            src = (rx, R1)
            if wide:
                p.chain(src, clip)
                src = None
            if lx.cols % lw.lanes:
                q = Passes(asm, out, R3, cw - 1)
                if cw > 1:
                    q.run(AluFn.PASS, dst=("max", R5), src=src)
                asm.alui(AluFn.ADD, R0, R1 if src else R3, cw - 1)
                q = Passes(asm, out, R0, 1)
                q.run(AluFn.MIN, tail, ("max", R0), src=(rx, R0) if src else (out, R0))
                asm.alu(AluFn.MAX, R5, R5, R0)
            else:
                p.run(AluFn.PASS, dst=("max", R5), src=src)
        # u, from d = x - m (masked and padding lanes to INT_MIN, then -clip).
        if causal:
            def mid(q):
                q.run(AluFn.SUB, R5, src=None if wide else (rx, R1))
                q.run(AluFn.PASS, dst=d)
                q.run(AluFn.SUB, R4, src=(rp, R6), shift=31)
                q.run(AluFn.XOR, INT_MIN)
                q.run(AluFn.MIN, d)
            walk(mid, [(R6, bp)])
        else:
            p.run(AluFn.SUB, R5, None if wide else "append", src=None if wide else (rx, R1))
            if lx.cols % lw.lanes:
                asm.alui(AluFn.ADD, R0, R3, cw - 1)
                Passes(asm, out, R0, 1).run(AluFn.MIN, tail)
        p.run(AluFn.MAX, -a["clip"])
        p.run(AluFn.MUL, -a["mult"], shift=a["shift"])
        asm.li(R5, 0)

        def expsum(q):
            iexp_passes(q, lambda k: Local(k * chunk), shift_sum)
            q.run(AluFn.PASS, dst=("sum", R0))
            asm.alu(AluFn.ADD, R5, R5, R0)
        walk(expsum, [])
        softmax_scale(asm, p, bits)

    offsets = [(R1, bx, cw), (R3, 0, cw)] + ([(R4, a["causal"] + 1, 1)] if causal else [])
    row_loop(lw, g, x, rx, offsets, body)


def norm(kind):
    @template(kind)
    def lower_norm(lw, g, op):
        """Per row: ``x'`` (shifted, saturated), for layer_norm the mean (a SUM stream, a
        division loop) and ``d = x' - mu``; ``Q``, a SUM stream of ``(d * d) >> v`` (for
        layer_norm less what the padding lanes, which hold ``-mu``, added); ``T`` brought to
        [2**28, 2**30) by a branch-free loop, its square root (one bit a step), ``R = N_C //
        root`` (a division loop); then ``z = clip((d * R) >> (29 - frac - e))`` (SHIFT from a
        register), ``z * w`` (+ ``b``), the weight and bias rows staged in the local buffer."""
        x, w = op.ins[:2]
        a = op.attrs
        lx = lw.tensors[x].layout
        rx, bx = lw.ref(g, x)
        asm, out = g.asm, g.out
        cw, c = lx.cw, lx.cols
        lo, hi, v, n_c = intops.norm_consts(kind, c)
        frac, eps = a["frac"], a.get("eps", 0)
        zm = (math.isqrt(c - 1) + 1) << frac
        layer = kind == "layer_norm"
        # A row whose slots (d, w, b; and the constants) do not fit the local buffer: the
        # passes with a per-lane operand go over it in chunks of one slot (see row_chunks).
        long = (4 if layer else 3) * cw > g.local_top
        lw.need_local(g, op, 1 if long else (4 if layer else 3) * cw)
        chunk = chunk_words(cw, g.local_top)
        d_slot, w_slot, b_slot = Local(0), Local(cw), Local(2 * cw)
        params = [lw.ref(g, name) for name in op.ins[1:]]
        if not long:
            for (r, base), at in zip(params, (w_slot, b_slot), strict=False):
                asm.stream(AluFn.PASS, a=r, a_base=base, n=cw, d_mode=DMode.LOCAL,
                           d_base=int(at))
        shift = a["shift"]
        if shift >= 0:
            first = [(AluFn.PASS, None, shift)] + clip_stages_after(a["dtype"], shift, lo, hi)
        else:
            k = -shift
            first = clip_stages(a["dtype"], lo >> k, hi >> k) + [(AluFn.MUL, 1 << k, 0)]

        def body():
            p = Passes(asm, out, R3, cw)
            p.chain((rx, R1), first)
            if layer:
                p.run(AluFn.PASS, dst=("sum", R5))
                asm.alui(AluFn.ADD, R5, R5, c << intops.NORM_BITS)
                asm.li(R4, c)
                div_loop(asm, R5, R4, R6, R7, intops.NORM_BITS + 1)
                asm.alui(AluFn.SUB, R6, R6, 1 << intops.NORM_BITS)       # mu
                p.run(AluFn.SUB, R6)                                        # d
                asm.alu(AluFn.MUL, R4, R6, R6)
                asm.alui(AluFn.SHR, R4, R4, v)
                asm.alui(AluFn.MUL, R4, R4, cw * lw.lanes - c)              # padding's share
            if long:
                # R5 = the sum of (d * d) >> v, chunk by chunk (R4, the padding's share, is
                # kept in R7 meanwhile; the loop counts in R6 once mu is no longer needed).
                if layer:
                    asm.alui(AluFn.ADD, R7, R4, 0)
                asm.li(R5, 0)

                def square(q):
                    q.run(AluFn.PASS, dst=d_slot)
                    q.run(AluFn.MUL, d_slot, ("sum", R4), shift=v)
                    asm.alu(AluFn.ADD, R5, R5, R4)
                row_chunks(asm, out, cw, chunk, [(R0, R3)], R6, square)
                if layer:
                    asm.alui(AluFn.ADD, R4, R7, 0)
            else:
                p.run(AluFn.PASS, dst=d_slot)
                p.run(AluFn.MUL, d_slot, ("sum", R5), shift=v)
            if layer:
                asm.alu(AluFn.SUB, R5, R5, R4)
            asm.alui(AluFn.MIN, R5, R5, intops.INT32_MAX - eps)
            asm.alui(AluFn.ADD, R5, R5, eps)
            asm.alui(AluFn.MAX, R5, R5, 1)                                  # T
            # (T, e) to [2**28, 2**30): one step down if T >= 2**30, up to 14 steps up.
            asm.alui(AluFn.SLT, R0, R5, intops.NORM_HI)
            asm.alui(AluFn.XOR, R6, R0, 1)
            asm.alui(AluFn.SHL, R0, R6, 1)
            asm.alu(AluFn.SHR, R5, R5, R0)
            asm.alui(AluFn.MUL, R6, R6, -1)                                 # e
            asm.li(R7, 14)

            def up(head):
                asm.alui(AluFn.SLT, R0, R5, intops.NORM_LO)
                asm.alu(AluFn.ADD, R6, R6, R0)
                asm.alui(AluFn.SHL, R0, R0, 1)
                asm.alu(AluFn.SHL, R5, R5, R0)
                asm.branch(Op.LOOP, head, ra=R7)
            asm.loop(up)
            # Square root: one bit a step, from bit 14.
            asm.li(R4, 0)
            asm.li(R7, 1 << (intops.NORM_BITS))

            def root(head):
                skip = asm.label()
                asm.alu(AluFn.OR, R0, R4, R7)
                asm.alu(AluFn.MUL, R0, R0, R0)
                asm.branch(Op.BLT, skip, ra=R5, rb=R0)
                asm.alu(AluFn.OR, R4, R4, R7)
                asm.place(skip)
                asm.alui(AluFn.SHRU, R7, R7, 1)
                asm.branch(Op.BNZ, head, ra=R7)
            asm.loop(root)
            asm.li(R5, n_c)
            div_loop(asm, R5, R4, R7, R0, 16)                               # R
            asm.li(R4, intops.NORM_ONE - frac)
            asm.alu(AluFn.SUB, R4, R4, R6)                                  # the shift
            p.run(AluFn.MUL, R7, shift=R4)
            p.run(AluFn.MAX, -zm)
            p.run(AluFn.MIN, zm)
            if long:
                # * w (+ b) chunk by chunk, each chunk of w (b) streamed into the one slot.
                def scale(q):
                    for (r, _), reg, fn in zip(params, (R5, R6), (AluFn.MUL, AluFn.ADD),
                                               strict=False):
                        q.run(AluFn.PASS, dst=d_slot, src=(r, reg))
                        q.run(fn, d_slot)
                regs = [(R0, R3)] + [(reg, base) for (_, base), reg in zip(params, (R5, R6),
                                                                           strict=False)]
                row_chunks(asm, out, cw, chunk, regs, R7, scale)
            else:
                p.run(AluFn.MUL, w_slot)
                if layer:
                    p.run(AluFn.ADD, b_slot)
        row_loop(lw, g, x, rx, [(R1, bx, cw), (R3, 0, cw)], body)
    return lower_norm


def clip_stages_after(dtype, shift, lo, hi):
    """The saturation stages of a ``dtype`` tensor shifted right by ``shift``."""
    info = np.iinfo(dtype)
    return ([(AluFn.MAX, lo, 0)] if info.min >> shift < lo else []) + (
        [(AluFn.MIN, hi, 0)] if info.max >> shift > hi else [])


norm("layer_norm")
norm("rms_norm")


@template("embedding")
def embedding(lw, g, op):
    """The indices staged in the local buffer (a chunk at a time when they do not fit); per
    index: LGET it, clamp it to the table's rows, and one stream appends that row of the
    table."""
    table, idx = op.ins
    lt, li = lw.tensors[table].layout, lw.tensors[idx].layout
    rt, bt = lw.ref(g, table)
    ri, bi = lw.ref(g, idx)
    asm, out = g.asm, g.out
    lw.need_local(g, op, 1)
    # More indices than the local buffer holds: staged and looked up a chunk at a time.
    chunk = chunk_words(li.words, g.local_top)
    total = li.rows * li.cols
    for start in range(0, li.words, chunk):
        n = min(chunk, li.words - start)
        asm.stream(AluFn.PASS, a=ri, a_base=bi + start, n=n, d_mode=DMode.LOCAL, d_base=0)
        asm.li(R1, 0)
        asm.li(COUNT, min(n * lw.lanes, total - start * lw.lanes))

        def body(head):
            asm.emit(Op.LGET, rd=R5, rb=R1, imm=0)
            asm.alui(AluFn.MAX, R5, R5, 0)
            asm.alui(AluFn.MIN, R5, R5, lt.rows - 1)
            asm.alui(AluFn.MUL, R5, R5, lt.cw)
            asm.alui(AluFn.ADD, R5, R5, bt)
            asm.stream(AluFn.PASS, a=rt, a_base=R5, n=lt.cw, d_mode=DMode.APPEND, d_ref=out)
            asm.alui(AluFn.ADD, R1, R1, 1)
            asm.branch(Op.LOOP, head, ra=COUNT)
        asm.loop(body)
