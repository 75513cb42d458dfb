"""Op templates: the code of each lowered op kind on its CU.

A template is a function ``(lowerer, cu, op)`` registered in :data:`TEMPLATES` under the op
kind it lowers. It finds its inputs with :meth:`~rdakit.compiler.lower.lowerer.Lowerer.ref`
(which receives a reference or waits for a token first when needed), writes its output
through ``cu.out`` (the register of the output buffer, allocated or held before it runs) and
emits its code on ``cu.asm``. Registers r0..r7 (:mod:`rdakit.compiler.lower.registers`) are
its temporaries; ``docs/compiler.md`` describes each template.
"""

from rdakit.compiler.lower.layout import INT_MIN
from rdakit.compiler.lower.registers import (
    COUNT,
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
from rdakit.hdl.spec.isa import AluFn, BMode, DMode, Op

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
    g.asm.emit(Op.LEN, rd=rd, ra=r_ref)
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
    asm.emit(Op.LEN, rd=COUNT, ra=r_ref)
    end = asm.label()
    asm.branch(Op.BZ, end, ra=COUNT)

    def loop(head):
        body()
        advance()
        asm.branch(Op.BLT, head, ra=offsets[0][0], rb=COUNT)
    asm.loop(loop)
    asm.place(end)


# Templates.

@template("matmul_nt")
def matmul_nt(lw, g, op):
    """Per row of A: copy it to the local buffer, then one PACK_SUM stream over the rows of
    Bᵀ appends the row of the product. When every row of A fits the local buffer, one stream
    copies them all first (a run-time number of rows: LEN words)."""
    a, b = op.ins[:2]
    la, lb = lw.tensors[a].layout, lw.tensors[b].layout
    ra, base_a = lw.ref(g, a)
    rb, base_b = lw.ref(g, b)
    kw = la.cw
    lw.need_local(g, op, kw)
    asm, out = g.asm, g.out

    def product(row):
        asm.stream(AluFn.MUL, a=rb, a_base=base_b, n=kw, outer=lb.rows, a_ostride=kw,
                   b_mode=BMode.LOCAL, b_val=row, b_stride=1, b_ostride=0,
                   d_mode=DMode.PACK_SUM, d_ref=out)

    if la.rows > 1 and la.words <= g.local_top:
        # Every row of A fits: one stream stages them all, then one PACK_SUM stream a row.
        end = asm.label()
        words = la.words
        if la.dynamic:
            asm.emit(Op.LEN, rd=COUNT, ra=ra)
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
        return

    def body():
        asm.stream(AluFn.PASS, a=ra, a_base=R1, n=kw, d_mode=DMode.LOCAL, d_base=0)
        product(0)
    row_loop(lw, g, a, ra, [(R1, base_a, kw)], body)

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

@template("ew")
def ew(lw, g, op):
    """An elementwise chain: the first stage streams the input (and its second operand:
    local buffer, scalar or per-row scalar) into the output, later stages rewrite the
    output in place, and a last pass masks padding lanes if the chain makes them
    nonzero."""
    asm, out = g.asm, g.out
    stages, mode = op.attrs["stages"], op.attrs["mode"]
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

    kw = dict(shift=s0.shift, relu=s0.relu, d_mode=DMode.APPEND, d_ref=out)
    if mode is None:
        bm = BMode.ZERO if s0.imm is None else BMode.SCALAR
        asm.stream(s0.fn, a=rx, a_base=bx, n=n, b_mode=bm, b_val=s0.imm or 0, **kw)
    elif mode == "scalar":
        asm.li(R5, bb)
        asm.emit(Op.READ, fn=0, rd=R5, ra=rb, rb=R5)
        asm.stream(s0.fn, a=rx, a_base=bx, n=n, b_mode=BMode.SCALAR, b_val=R5, **kw)
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
    for s in stages[1:]:
        bm = BMode.ZERO if s.imm is None else BMode.SCALAR
        asm.stream(s.fn, a=out, a_base=0, n=n, b_mode=bm, b_val=s.imm or 0, shift=s.shift,
                   relu=s.relu, d_mode=DMode.WRITE, d_ref=out, d_base=0, d_stride=1)
    if lw.ew_needs_mask(op):
        mask = g.local[f"mask{lo.cols}"]
        asm.stream(AluFn.AND, a=out, a_base=0, n=cw, outer=rows(), a_ostride=cw,
                   b_mode=BMode.LOCAL, b_val=mask, b_stride=1, b_ostride=0,
                   d_mode=DMode.WRITE, d_ref=out, d_base=0, d_stride=1)
    asm.place(end)

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
        # One SUM (or MAX, padding lanes forced to INT_MIN) stream per row.
        def body():
            if is_max:
                asm.stream(AluFn.MIN, a=rx, a_base=R1, n=cw, b_mode=BMode.LOCAL,
                           b_val=g.local[f"lrow{lx.cols}"], b_stride=1,
                           d_mode=DMode.MAX, rd=R5)
            else:
                asm.stream(AluFn.PASS, a=rx, a_base=R1, n=cw, d_mode=DMode.SUM, rd=R5)
            asm.emit(Op.VCLR)
            asm.emit(Op.VSET, fn=0, ra=R5)
            asm.emit(Op.VAPPEND, rd=SINK, ra=out)
        row_loop(lw, g, x, rx, [(R1, base, cw)], body)
        return
    # Over rows: accumulate rows 1.. in the local buffer, add row 0 on the way out.
    fn = AluFn.MAX if is_max else AluFn.ADD
    rows = lx.rows
    if rows == 0:
        return
    if rows == 1:
        asm.stream(AluFn.PASS, a=rx, a_base=base, n=cw, d_mode=DMode.APPEND, d_ref=out)
        return
    lw.need_local(g, op, cw)
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

@template("take")
def take(lw, g, op):
    """x[t, idx[t, j]]: the row of x is copied to the local buffer, and each element at a
    run-time position is an LGET of it (the indices staged in the local buffer too)."""
    x, idx = op.ins
    lx, li = lw.tensors[x].layout, lw.tensors[idx].layout
    rx, bx = lw.ref(g, x)
    k = li.cols
    lanes = lw.lanes
    asm, out = g.asm, g.out
    (ti,) = stage(lw, g, op, lx.cw, [idx])

    def body():
        asm.stream(AluFn.PASS, a=rx, a_base=R1, n=lx.cw, d_mode=DMode.LOCAL, d_base=0)
        asm.emit(Op.VCLR)
        for j in range(k):
            ti.load(asm, R5, R3, j, R4)
            asm.emit(Op.LGET, rd=R5, rb=R5, imm=0)
            asm.emit(Op.VSET, fn=j % lanes, ra=R5)
            if j % lanes == lanes - 1 or j == k - 1:
                asm.emit(Op.VAPPEND, rd=SINK, ra=out)
                asm.emit(Op.VCLR)
    row_loop(lw, g, x, rx, [(R1, bx, lx.cw), ti.offsets(R3)], body)

def route_test(asm, table, r_row, k, expert, targets):
    """Branch to ``targets[j]`` at the first slot j of the row whose index is ``expert``;
    fall through if none is."""
    for j in range(k):
        table.load(asm, R5, r_row, j, R6)
        asm.alui(AluFn.XOR, R5, R5, expert)
        asm.branch(Op.BZ, targets[j], ra=R5)

@template("dispatch")
def dispatch(lw, g, op):
    """Rows routed to the expert are appended, in token order (a run-time count)."""
    x, idx = op.ins
    lx, li = lw.tensors[x].layout, lw.tensors[idx].layout
    rx, bx = lw.ref(g, x)
    asm, out = g.asm, g.out
    (ti,) = stage(lw, g, op, 0, [idx])

    def body():
        hit, nxt = asm.label(), asm.label()
        route_test(asm, ti, R3, li.cols, op.attrs["expert"], [hit] * li.cols)
        asm.branch(Op.JMP, nxt)
        asm.place(hit)
        asm.stream(AluFn.PASS, a=rx, a_base=R1, n=lx.cw, d_mode=DMode.APPEND, d_ref=out)
        asm.place(nxt)
    row_loop(lw, g, x, rx, [(R1, bx, lx.cw), ti.offsets(R3)], body)

@template("combine")
def combine(lw, g, op):
    """out = 0; then expert by expert, each token routed to it (in order, so its rows are
    taken in order): ``(gate * y_e row) >> shift`` added to the token's output row. When the
    whole output fits the local buffer beside the staged indices and gates, it is accumulated
    there (one LOCAL_ACC stream a routed token) and added to the zeroed output by one stream at
    the end; otherwise each routed token is two streams: the product into the local buffer,
    then ``out row += local`` in place. The indices and gates are staged in the local buffer
    when they fit."""
    idx, gate, *ys = op.ins
    li, lg, lo = (lw.tensors[t].layout for t in (idx, gate, op.out))
    asm, out = g.asm, g.out
    dw, k = lo.cw, li.cols
    if lo.rows == 0:
        for y in ys:
            lw.ref(g, y)
        return
    local_sum = not (li.dynamic or lg.dynamic) and lo.words + li.words + lg.words <= g.local_top
    ti, tg = stage(lw, g, op, lo.words if local_sum else dw, [idx, gate])
    base_i = lw.key_of(idx, g.xy)[1]
    asm.stream(AluFn.AND, a=ti.ref, a_base=base_i, a_stride=0, n=lo.words,
               d_mode=DMode.APPEND, d_ref=out)
    if local_sum:
        asm.stream(AluFn.AND, a=ti.ref, a_base=base_i, a_stride=0, n=lo.words,
                   d_mode=DMode.LOCAL, d_base=0)
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
            if local_sum:
                asm.stream(AluFn.MUL, a=ry, a_base=R7, n=dw, b_mode=BMode.SCALAR, b_val=R6,
                           shift=op.attrs["shift"], d_mode=DMode.LOCAL_ACC, d_base=R4)
            else:
                asm.stream(AluFn.MUL, a=ry, a_base=R7, n=dw, b_mode=BMode.SCALAR, b_val=R6,
                           shift=op.attrs["shift"], d_mode=DMode.LOCAL, d_base=0)
                asm.stream(AluFn.ADD, a=out, a_base=R4, n=dw, b_mode=BMode.LOCAL, b_val=0,
                           b_stride=1, d_mode=DMode.WRITE, d_ref=out, d_base=R4, d_stride=1)
            asm.alui(AluFn.ADD, R7, R7, dw)
            asm.place(nxt)
        row_loop(lw, g, idx, ti.ref, [ti.offsets(R1), tg.offsets(R3), (R4, 0, dw)], body)
        g.refs.unpin(lw.key_of(y, g.xy)[0])
    if local_sum:
        asm.stream(AluFn.ADD, a=out, a_base=0, n=lo.words, b_mode=BMode.LOCAL, b_val=0,
                   b_stride=1, d_mode=DMode.WRITE, d_ref=out, d_base=0, d_stride=1)
