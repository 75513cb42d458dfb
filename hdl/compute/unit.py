"""The compute unit (CU): a control sequencer and a SIMD streaming datapath.

See ``docs/compute-unit.md`` for the specification (ports, messages, instructions, streams,
configuration); :mod:`rdakit.hdl.spec.isa` defines the instruction set and :mod:`rdakit.sim.models.interp`
is the functional model.

Structure
---------
Sequencer
    The program memory has a synchronous read port: while instruction ``pc`` executes, the
    address of the next one (``pc + 1`` or a branch target, computed from the register file in
    the same cycle) is presented, so every non-blocking instruction, taken branches included,
    takes one cycle. A blocking MU instruction loads its request into the request register (one
    cycle) and waits for the response (tag 0), which is captured in a register and retired the
    cycle after it arrives. ``WAIT``/``RECV`` retire in the cycle the tokens or the reference are
    there; ``SEND``/``SENDREF`` retire when the message register is free.
Stream engine
    An issue stage walks ``(o, i)`` and loads a READ (tag 1) into the request register each cycle
    while fewer than ``outstanding`` reads are unconsumed (issued and not yet popped). Read
    responses go into a response FIFO of ``outstanding + 1`` entries (``amaranth.lib.fifo``), so a
    response is always accepted. The execute pipeline has two stages: S0 pops the head of the FIFO
    and reads the local buffer (B operand and the LOCAL_ACC destination); S1 computes
    ``post(fn(a, b) >> SHIFT)`` in every lane and delivers it (local buffer write, reduction,
    ``V`` for PACK_SUM, or a write queue for MU writes and appends). The local buffer read ports are
    transparent to its write port, so step ``k`` sees the write of step ``k - 1`` (the sequential
    semantics of the spec hold whatever the strides). MU writes and appends (tag 2) leave from the
    write queue with priority over reads, so a step that writes takes two request cycles; SRUN
    retires when every step has been executed and every write acknowledged.
Timing (measured with an MU attached directly, its latency 2 cycles)
    1 cycle for every non-blocking instruction, taken branches included; 5 cycles for a blocking
    MU instruction (load the request register, the MU's 2 cycles, capture, retire), 6 for ALLOC.
    SRUN takes ``N*OUTER + 8`` cycles when its results stay in the CU (one step a cycle once the
    first response is back; this needs ``outstanding`` >= 6, the round trip in reads) and
    ``2*N*OUTER + 5`` when every result is written to an MU (two requests a step); PACK_SUM adds
    one cycle an append and the last acknowledgement.

Readings of the spec (where it leaves a choice)
-----------------------------------------------
* ``done`` is 1 whenever the CU is not running: after reset, after HALT or an error, and when
  disabled. It falls the cycle after ``start``.
* A register field selects ``r[field mod regs]``; the lane of ``READ``/``VSET`` is
  ``fn mod lanes``. ``SEND``/``WAIT`` with ``aux >= channels`` and ``SENDREF``/``RECV`` with
  ``aux >= mailbox`` halt with BAD_INSTRUCTION. An incoming token or reference for a channel or
  slot that does not exist is dropped.
* STATUS ``pc`` is the pc of the instruction that halted (HALT, or the instruction that failed,
  or the one executing when a message error arrived); for PC_OUT_OF_RANGE it is the pc that left
  the program memory (its low 16 bits). Program words never written read as 0 (NOP).
* ``SHIFT`` is taken modulo 32, like the ALU's shifts; ``POST`` bit 0 selects ReLU, the other
  bits are ignored.
* ``B_MODE`` above 2 or ``D_MODE`` above 8 is BAD_STREAM, like ``N = 0`` or ``OUTER = 0``.
* PACK_SUM clears ``V`` when the stream starts and after every append, so the unused lanes of the
  last, partial word are 0 and ``V`` is 0 when SRUN retires. SRUN leaves ``rd`` unchanged for
  D modes other than SUM, MAX and ARGMAX.
* MU indices (``READ``'s ``rb``, stream word indices) are truncated to ``index_bits``; a reference
  in a register is ``{mu, buf}`` in its low bits; a token count and a reference's weight are the
  low 32 bits of the message's ``data``.
* A token that would take a counter past 65535 is TOKEN_OVERFLOW and leaves the counter as it
  was; a reference arriving at a full slot is MAILBOX_OVERFLOW and is dropped (a slot that RECV
  empties in the same cycle is not full). Tokens and references arriving while the CU does not
  run (halted, failed, disabled) are dropped.
* MU_ERROR: a refused blocking request or stream write halts the CU when the response arrives
  (writes of later stream steps may already have been applied). A refused stream read halts it
  in order: the steps before it complete, their writes acknowledged, then the CU halts at SRUN
  (as the interpreter does).
* HALT retires once the message register is empty, so a CU that reports done has handed every
  token and reference to the network.
* A read of ``REGS + r`` returns the current value of ``r`` (the initial value until start, the
  final value after a run); a write sets the initial value and, while the CU is not running, the
  register itself. Local-buffer writes over the bus are ignored in a cycle when a stream writes
  the local buffer. Start the CU only when the network holds no response to it.
"""

from amaranth.hdl import Array, Cat, Const, Module, Mux, Signal, unsigned
from amaranth.lib import data, enum, fifo, memory, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from rdakit.hdl.spec.config import CU_MAP, CU_STATUS_BITS, TILE_COUNTERS, config_bus_signature
from rdakit.hdl.spec.flit import flit_layout
from rdakit.hdl.spec.isa import INSTR_LAYOUT, AluFn, BMode, DMode, Op, StreamField
from rdakit.hdl.spec.packets import MsgKind, MUOp, MUStatus, msg_layout, mu_request_layout
from rdakit.hdl.spec.params import FabricParams

__all__ = ["ComputeUnit", "COUNTER_WIDTH", "TAG_BLOCKING", "TAG_READ", "TAG_WRITE"]

#: Width of the performance counters.
COUNTER_WIDTH = 32

#: Request tags: the response a blocking instruction waits for, stream reads, stream writes.
TAG_BLOCKING = 0
TAG_READ = 1
TAG_WRITE = 2

_TOKEN_MAX = 0xffff

#: Depth of the queue of stream results waiting to be written to an MU.
_WQ_DEPTH = 4

_MAX_BMODE = max(m.value for m in BMode)
_MAX_DMODE = max(m.value for m in DMode)

#: Stream destination modes that send D_REF requests (the others stay in the CU).
_D_REF_MODES = (DMode.WRITE.value, DMode.APPEND.value, DMode.PACK_SUM.value)


def _tile_mask(params, kind):
    """Bit ``y << coord_bits | x`` set for every tile of ``kind`` ("C" or "M") of the grid."""
    return sum(1 << (y << params.coord_bits | x) for x, y in params.tiles(kind))


_MU_OP = {
    Op.ALLOC: MUOp.ALLOC, Op.READ: MUOp.READ, Op.VREAD: MUOp.READ, Op.VWRITE: MUOp.WRITE,
    Op.VAPPEND: MUOp.APPEND, Op.LEN: MUOp.LEN, Op.RET: MUOp.RETURN, Op.RETI: MUOp.RETURN,
    Op.ADDW: MUOp.ADD_WEIGHT, Op.INCREF: MUOp.INCREF, Op.DECREF: MUOp.DECREF,
    Op.FADD: MUOp.FETCH_ADD, Op.UNLOCK: MUOp.UNLOCK,
}


class _State(enum.Enum, shape=2):
    IDLE = 0     # not running: done
    RUN = 1      # executing the instruction on the program read port
    WAIT = 2     # a blocking MU request is out; waiting for its response
    STREAM = 3   # SRUN in progress


def _alu(m, fn, a, b, name):
    """``fn(a, b)`` on 32-bit values, as in :func:`rdakit.hdl.spec.isa.alu`."""
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


def _lane(word, index, lanes):
    """Lane ``index`` (a value, taken modulo ``lanes``) of a vector word."""
    if lanes == 1:
        return word[:32]
    return word.word_select(index[:exact_log2(lanes)], 32)


class ComputeUnit(wiring.Component):
    """A compute unit: runs its configured program on ``start`` until HALT or an error.

    Parameters
    ----------
    fabric_params : FabricParams
        The fabric; its ``cu`` parameters size this CU and its ``mu`` parameters the packets.
    x, y : int
        The tile's column and row; the tile must be a CU (``"C"``) of the fabric's layout. The
        CU's ID, the ``src`` of its requests, is ``y << coord_bits | x``.

    Members
    -------
    req : Out(stream.Signature(flit_layout(coord_bits, mu_request_layout(mu))))
        Requests to MUs. ``valid`` comes from a register (it never depends on ``ready``).
    msg_out : Out(stream.Signature(flit_layout(coord_bits, msg_layout(mu))))
        Tokens and references to other CUs (registered like ``req``).
    msg_in : In(stream.Signature(flit_layout(coord_bits, msg_layout(mu))))
        MU responses, tokens and references; ``ready`` is constant 1.
    cfg : In(config_bus_signature())
        Configuration space (``CU_MAP`` and ``TILE_COUNTERS``); ``rdata`` the cycle after ``re``.
    start : In(1)
        One-cycle pulse: load the initial registers, clear tokens, mailbox, ``V`` and the stream
        fields (``OUTER`` = 1), the counters and the status, and run from pc 0 if enabled.
    done, error : Out(1)
        Not running (halted, failed or disabled); halted on an error (code in STATUS).
    busy_cycles, stall_cycles, flits_out, flits_in, wait_cycles : Out(32)
        Cycles running; running cycles in which no instruction retired and no stream step was
        executed; flits sent on ``req`` and ``msg_out``; flits received; stalled cycles spent
        in WAIT or RECV (waiting for another CU). Reset by ``start``.

    Raises
    ------
    TypeError
        If ``fabric_params`` is not a :class:`FabricParams` or ``x``, ``y`` are not coordinates
        of the grid.
    ValueError
        If the tile at ``(x, y)`` is not a CU.
    """

    def __init__(self, fabric_params, *, x, y):
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
        self.fabric_params = p
        self.x = x
        self.y = y
        self.cu_id = (y << p.coord_bits) | x
        cb = p.coord_bits
        req_flit = flit_layout(cb, mu_request_layout(p.mu))
        msg_flit = flit_layout(cb, msg_layout(p.mu))
        super().__init__({
            "req": Out(stream.Signature(req_flit)),
            "msg_out": Out(stream.Signature(msg_flit)),
            "msg_in": In(stream.Signature(msg_flit)),
            "cfg": In(config_bus_signature()),
            "start": In(1),
            "done": Out(1),
            "error": Out(1),
            "busy_cycles": Out(COUNTER_WIDTH),
            "stall_cycles": Out(COUNTER_WIDTH),
            "flits_out": Out(COUNTER_WIDTH),
            "flits_in": Out(COUNTER_WIDTH),
            "wait_cycles": Out(COUNTER_WIDTH),
        })
        #: The staging vector ``V`` (not a port; for testbenches).
        self.v = Signal(p.cu.data_bits, name="v")

    def elaborate(self, platform):
        p = self.fabric_params
        cp, mp = p.cu, p.mu
        cb = p.coord_bits
        L = cp.lanes
        lbits = exact_log2(L)
        R = cp.regs
        rbits = exact_log2(R)
        wbits = exact_log2(cp.local_words)
        refw = mp.mu_id_bits + mp.buf_id_bits
        S = StreamField
        m = Module()

        # --- Storage ------------------------------------------------------------------------
        m.submodules.program = prog = memory.Memory(shape=unsigned(64), depth=cp.prog_len,
                                                    init=[])
        prog_w = prog.write_port(granularity=32)
        prog_r = prog.read_port()       # the sequencer's fetch
        m.d.comb += prog_r.en.eq(0)     # (a read port's en is 1 unless driven)
        prog_c = prog.read_port()       # configuration reads
        m.submodules.local = local = memory.Memory(shape=unsigned(32 * L),
                                                   depth=cp.local_words, init=[])
        loc_w = local.write_port(granularity=32)
        loc_b = local.read_port(transparent_for=(loc_w,))   # stream operand B
        loc_d = local.read_port(transparent_for=(loc_w,))   # LOCAL_ACC destination
        loc_c = local.read_port()                           # configuration reads
        # A read response and whether the MU refused it.
        m.submodules.rfifo = rfifo = fifo.SyncFIFOBuffered(width=32 * L + 1,
                                                           depth=cp.outstanding + 1)
        wq_layout = data.StructLayout({"data": 32 * L, "index": mp.index_bits})
        m.submodules.wq = wq = fifo.SyncFIFOBuffered(width=wq_layout.size,
                                                     depth=_WQ_DEPTH + 1)

        regs = [Signal(32, name=f"r{i}") for i in range(R)]
        regs_a = Array(regs)
        init_regs = [Signal(32, name=f"init_r{i}") for i in range(R)]
        V = self.v
        sf = {f: Signal(32, name=f"s_{f.name.lower()}", init=int(f is S.OUTER)) for f in S}
        tokens = [Signal(16, name=f"tokens{c}") for c in range(cp.channels)]
        tokens_a = Array(tokens)
        mb_full = [Signal(name=f"mb_full{s}") for s in range(cp.mailbox)]
        mb_ref = [Signal(refw, name=f"mb_ref{s}") for s in range(cp.mailbox)]
        mb_weight = [Signal(32, name=f"mb_weight{s}") for s in range(cp.mailbox)]
        mb_full_a, mb_ref_a, mb_weight_a = Array(mb_full), Array(mb_ref), Array(mb_weight)

        state = Signal(_State)
        running = state != _State.IDLE
        in_run = state == _State.RUN
        in_stream = state == _State.STREAM
        enabled = Signal()
        pc = Signal(16)
        err = Signal()
        code = Signal(8)
        m.d.comb += [self.done.eq(~running), self.error.eq(err)]

        # Output registers: valid never depends on ready.
        req_flit = self.req.payload.shape()
        rq_valid = Signal()
        rq = Signal(req_flit)
        rq_free = ~rq_valid | self.req.ready
        rq_load = Signal()
        rq_next = Signal(req_flit)
        m.d.comb += [self.req.valid.eq(rq_valid), self.req.payload.eq(rq)]
        with m.If(rq_load):
            m.d.sync += [rq_valid.eq(1), rq.eq(rq_next)]
        with m.Elif(self.req.ready):
            m.d.sync += rq_valid.eq(0)

        msg_flit = self.msg_out.payload.shape()
        out_valid = Signal()
        out = Signal(msg_flit)
        out_free = ~out_valid | self.msg_out.ready
        out_load = Signal()
        out_next = Signal(msg_flit)
        m.d.comb += [self.msg_out.valid.eq(out_valid), self.msg_out.payload.eq(out)]
        with m.If(out_load):
            m.d.sync += [out_valid.eq(1), out.eq(out_next)]
        with m.Elif(self.msg_out.ready):
            m.d.sync += out_valid.eq(0)

        def request(sig, *, op, tag, ref, index=0, data=0):
            # A request flit to the MU named by the reference's low mu_id_bits.
            mu = ref[:mp.mu_id_bits]
            m.d.comb += [
                sig.dst.x.eq(mu[:cb]), sig.dst.y.eq(mu[cb:2 * cb]),
                sig.payload.op.eq(op), sig.payload.tag.eq(tag),
                sig.payload.src.x.eq(self.x), sig.payload.src.y.eq(self.y),
                sig.payload.ref.eq(ref[:refw]), sig.payload.index.eq(index),
                sig.payload.data.eq(data),
            ]

        # --- Sequencer: decode ----------------------------------------------------------------
        ir = INSTR_LAYOUT(prog_r.data)
        op = ir.op
        rd_i, ra_i, rb_i = ir.rd[:rbits], ir.ra[:rbits], ir.rb[:rbits]
        rd1_i = Signal(rbits)
        m.d.comb += rd1_i.eq(rd_i + 1)
        ra_v, rb_v, rd_v = regs_a[ra_i], regs_a[rb_i], regs_a[rd_i]
        imm = ir.imm
        salu = _alu(m, ir.fn, ra_v, Mux(op == Op.ALUI, imm, rb_v), "salu")

        # Register file write ports (rd and rd + 1) and sequencer outcomes.
        wa_en, wa_idx, wa_data = Signal(), Signal(rbits), Signal(32)
        wb_en, wb_idx, wb_data = Signal(), Signal(rbits), Signal(32)
        npc = Signal(33)
        adv = Signal()        # the instruction retires; fetch npc
        halt = Signal()
        seq_err = Signal(8)   # an error code raised by the instruction
        bq_go = Signal()      # a blocking MU request wants the request register
        wait_take = Signal()
        recv_take = Signal()
        srun_go = Signal()
        m.d.comb += npc.eq(pc + 1)

        def write_a(idx, value):
            m.d.comb += [wa_en.eq(1), wa_idx.eq(idx), wa_data.eq(value)]

        def write_b(idx, value):
            m.d.comb += [wb_en.eq(1), wb_idx.eq(idx), wb_data.eq(value)]

        codes = CU_STATUS_BITS

        def fail(name):
            m.d.comb += seq_err.eq(codes[name])

        # Blocking request of the instruction on the read port.
        bq = Signal(req_flit)
        bq_op = Signal(MUOp)
        bq_data = Signal(32 * L)
        with m.Switch(op):
            for o, mo in _MU_OP.items():
                with m.Case(o):
                    m.d.comb += bq_op.eq(mo)
        with m.Switch(op):
            with m.Case(Op.ALLOC, Op.RETI, Op.ADDW):
                m.d.comb += bq_data.eq(imm)
            with m.Case(Op.RET):
                m.d.comb += bq_data.eq(rb_v)
            with m.Case(Op.VWRITE, Op.VAPPEND):
                m.d.comb += bq_data.eq(V)
            with m.Case(Op.FADD):
                m.d.comb += bq_data.eq(imm.as_signed())
            with m.Case(Op.UNLOCK):
                m.d.comb += bq_data.eq(rd_v)
        indexed = ((op == Op.READ) | (op == Op.VREAD) | (op == Op.VWRITE) | (op == Op.FADD)
                   | (op == Op.UNLOCK))
        request(bq, op=bq_op, tag=TAG_BLOCKING,
                ref=Mux(op == Op.ALLOC, ra_v[:mp.mu_id_bits], ra_v),
                index=Mux(indexed, rb_v, 0), data=bq_data)

        # Messages of SEND / SENDREF.
        to = Mux(op == Op.SEND, ra_v, rd_v)
        m.d.comb += [
            out_next.dst.x.eq(to[:cb]), out_next.dst.y.eq(to[cb:2 * cb]),
            out_next.payload.kind.eq(Mux(op == Op.SEND, MsgKind.TOKEN, MsgKind.REF)),
            out_next.payload.body.tag.eq(ir.aux),
            out_next.payload.body.data.eq(Mux(op == Op.SEND, imm, rb_v)),
            out_next.payload.body.ref.eq(Mux(op == Op.SEND, 0, ra_v[:refw])),
            # The whole CU ID, cluster included: a message for another cluster's CU leaves
            # through the bridges like a response (``docs/clusters.md``).
            out_next.payload.body.dst.as_value().eq(to[:mp.mu_id_bits]),
        ]

        # Destinations, checked before anything is sent: a request's reference must name an MU
        # tile of the grid and a message's ID a CU tile (a cluster's bits, above 2 * coord_bits,
        # are the bridges' business). Otherwise the flit would be dropped as misrouted and the
        # CU would wait forever for its answer.
        mu_tiles = Const(_tile_mask(p, "M"), 1 << 2 * cb)
        cu_tiles = Const(_tile_mask(p, "C"), 1 << 2 * cb)
        ra_is_mu = mu_tiles.bit_select(ra_v[:2 * cb], 1)
        to_is_cu = cu_tiles.bit_select(to[:2 * cb], 1)
        stream_to_mu = (mu_tiles.bit_select(sf[S.A_REF][:2 * cb], 1)
                        & (~sf[S.D_MODE].matches(*_D_REF_MODES)
                           | mu_tiles.bit_select(sf[S.D_REF][:2 * cb], 1)))

        channel_ok = ir.aux < cp.channels
        slot_ok = ir.aux < cp.mailbox
        n_val, outer_val = sf[S.N], sf[S.OUTER]
        bad_stream = ((n_val == 0) | (outer_val == 0) | (sf[S.B_MODE] > _MAX_BMODE)
                      | (sf[S.D_MODE] > _MAX_DMODE))

        # --- Sequencer: execute -----------------------------------------------------------------
        waiting = Signal()     # stalled in WAIT / RECV on another CU (the wait_cycles counter)
        with m.If(in_run):
            with m.Switch(op):
                with m.Case(Op.NOP):
                    m.d.comb += adv.eq(1)
                with m.Case(Op.HALT):
                    m.d.comb += halt.eq(~out_valid)
                with m.Case(Op.LI):
                    write_a(rd_i, imm)
                    m.d.comb += adv.eq(1)
                with m.Case(Op.ALU, Op.ALUI):
                    write_a(rd_i, salu)
                    m.d.comb += adv.eq(1)
                with m.Case(Op.JMP):
                    m.d.comb += [npc.eq(imm), adv.eq(1)]
                with m.Case(Op.BNZ, Op.BZ, Op.BLT):
                    taken = Mux(op == Op.BNZ, ra_v != 0,
                                Mux(op == Op.BZ, ra_v == 0, ra_v.as_signed() < rb_v.as_signed()))
                    with m.If(taken):
                        m.d.comb += npc.eq(imm)
                    m.d.comb += adv.eq(1)
                with m.Case(Op.LOOP):
                    write_a(ra_i, ra_v - 1)
                    with m.If(ra_v != 1):
                        m.d.comb += npc.eq(imm)
                    m.d.comb += adv.eq(1)
                with m.Case(*_MU_OP):
                    with m.If(~ra_is_mu):
                        fail("BAD_DESTINATION")
                    with m.Else():
                        m.d.comb += bq_go.eq(1)
                with m.Case(Op.VSET):
                    if L == 1:
                        m.d.sync += V.eq(ra_v)
                    else:
                        m.d.sync += V.word_select(ir.fn[:lbits], 32).eq(ra_v)
                    m.d.comb += adv.eq(1)
                with m.Case(Op.VCLR):
                    m.d.sync += V.eq(0)
                    m.d.comb += adv.eq(1)
                with m.Case(Op.SEND):
                    with m.If(~channel_ok):
                        fail("BAD_INSTRUCTION")
                    with m.Elif(~to_is_cu):
                        fail("BAD_DESTINATION")
                    with m.Elif(out_free):
                        m.d.comb += [out_load.eq(1), adv.eq(1)]
                with m.Case(Op.SENDREF):
                    with m.If(~slot_ok):
                        fail("BAD_INSTRUCTION")
                    with m.Elif(~to_is_cu):
                        fail("BAD_DESTINATION")
                    with m.Elif(out_free):
                        m.d.comb += [out_load.eq(1), adv.eq(1)]
                with m.Case(Op.WAIT):
                    with m.If(~channel_ok):
                        fail("BAD_INSTRUCTION")
                    with m.Elif(tokens_a[ir.aux] >= imm):
                        m.d.comb += [wait_take.eq(1), adv.eq(1)]
                    with m.Else():
                        m.d.comb += waiting.eq(1)
                with m.Case(Op.RECV):
                    with m.If(~slot_ok):
                        fail("BAD_INSTRUCTION")
                    with m.Elif(mb_full_a[ir.aux]):
                        write_a(rd_i, mb_ref_a[ir.aux])
                        write_b(rd1_i, mb_weight_a[ir.aux])
                        m.d.comb += [recv_take.eq(1), adv.eq(1)]
                    with m.Else():
                        m.d.comb += waiting.eq(1)
                with m.Case(Op.SCFG, Op.SCFGI):
                    value = Mux(op == Op.SCFG, ra_v, imm)
                    for f in S:
                        with m.If(ir.fn == f.value):
                            m.d.sync += sf[f].eq(value)
                    m.d.comb += adv.eq(1)
                with m.Case(Op.SRUN):
                    with m.If(bad_stream):
                        fail("BAD_STREAM")
                    with m.Elif(~stream_to_mu):
                        fail("BAD_DESTINATION")
                    with m.Else():
                        m.d.comb += srun_go.eq(1)
                        m.d.sync += state.eq(_State.STREAM)
                with m.Case(Op.SELF):
                    write_a(rd_i, self.cu_id)
                    m.d.comb += adv.eq(1)
                with m.Default():
                    fail("BAD_INSTRUCTION")

        with m.If(halt):
            m.d.sync += state.eq(_State.IDLE)

        # Blocking MU instructions: the response (tag 0) is captured, then retired.
        r0_valid = Signal()
        r0_data = Signal(32 * L)
        r0_ref = Signal(refw)
        with m.If(state == _State.WAIT):
            with m.If(r0_valid):
                m.d.sync += r0_valid.eq(0)
                m.d.comb += adv.eq(1)
                with m.Switch(op):
                    with m.Case(Op.ALLOC):
                        write_a(rd_i, r0_ref)
                    with m.Case(Op.READ):
                        write_a(rd_i, _lane(r0_data, ir.fn, L))
                    with m.Case(Op.VAPPEND, Op.LEN, Op.FADD):
                        write_a(rd_i, r0_data[:32])
                    with m.Case(Op.VREAD):
                        m.d.sync += V.eq(r0_data)

        # Fetch: the next instruction is read while this one retires.
        with m.If(adv):
            with m.If(npc < cp.prog_len):
                m.d.comb += [prog_r.addr.eq(npc), prog_r.en.eq(1)]
                m.d.sync += [pc.eq(npc), state.eq(_State.RUN)]
            with m.Else():
                fail("PC_OUT_OF_RANGE")

        # --- Stream engine: issue -----------------------------------------------------------
        credits = Signal(range(cp.outstanding + 1))   # reads issued and not yet popped
        iss_o, iss_i = Signal(32), Signal(32)
        iss_row, iss_idx = Signal(32), Signal(32)
        iss_done = Signal()
        wr_pending = Signal(16)                        # writes issued and not acknowledged
        pop = Signal()

        wreq = Signal(req_flit)
        wq_head = wq_layout(wq.r_data)
        d_mode = sf[S.D_MODE]
        request(wreq, op=Mux(d_mode == DMode.WRITE.value, MUOp.WRITE, MUOp.APPEND),
                tag=TAG_WRITE, ref=sf[S.D_REF], index=wq_head.index, data=wq_head.data)
        rreq = Signal(req_flit)
        request(rreq, op=MUOp.READ, tag=TAG_READ, ref=sf[S.A_REF], index=iss_idx)

        wr_go = in_stream & wq.r_rdy & rq_free & (wr_pending != (1 << 16) - 1)
        rd_go = (in_stream & ~wq.r_rdy & rq_free & ~iss_done
                 & (credits != cp.outstanding))
        with m.If(bq_go & rq_free):
            m.d.comb += [rq_load.eq(1), rq_next.eq(bq)]
            m.d.sync += state.eq(_State.WAIT)
        with m.Elif(wr_go):
            m.d.comb += [rq_load.eq(1), rq_next.eq(wreq)]
        with m.Elif(rd_go):
            m.d.comb += [rq_load.eq(1), rq_next.eq(rreq)]
        # Results queued for an MU are dropped when no stream runs (after an error).
        m.d.comb += wq.r_en.eq(wr_go | ~in_stream)

        with m.If(rd_go):
            with m.If(iss_i + 1 == n_val):
                m.d.sync += [iss_i.eq(0), iss_row.eq(iss_row + sf[S.A_OSTRIDE]),
                             iss_idx.eq(iss_row + sf[S.A_OSTRIDE])]
                with m.If(iss_o + 1 == outer_val):
                    m.d.sync += iss_done.eq(1)
                with m.Else():
                    m.d.sync += iss_o.eq(iss_o + 1)
            with m.Else():
                m.d.sync += [iss_i.eq(iss_i + 1), iss_idx.eq(iss_idx + sf[S.A_STRIDE])]
        with m.If(rd_go & ~pop):
            m.d.sync += credits.eq(credits + 1)
        with m.Elif(pop & ~rd_go):
            m.d.sync += credits.eq(credits - 1)

        # --- Stream engine: S0 (pop a response, read the local buffer) ------------------------
        c_o, c_i, c_k = Signal(32), Signal(32), Signal(32)
        b_row, b_idx, d_idx = Signal(32), Signal(32), Signal(32)
        c_done = Signal()
        s1_valid = Signal()
        s1_a = Signal(32 * L)
        s1_k = Signal(32)
        s1_last_inner = Signal()
        s1_last = Signal()
        s1_lane = Signal(max(lbits, 1))
        s1_didx = Signal(32)

        # A refused read halts the stream in order: the steps before it complete (their
        # writes are acknowledged), then the CU halts with MU_ERROR at SRUN.
        fault = Signal()
        head_bad = rfifo.r_data[32 * L]
        can_pop = in_stream & ~c_done & ~fault & rfifo.r_rdy & (wq.level <= _WQ_DEPTH - 2)
        with m.If(can_pop & head_bad):
            m.d.sync += fault.eq(1)
        with m.If(in_stream & fault & ~s1_valid & (wq.level == 0) & (wr_pending == 0)):
            fail("MU_ERROR")
        m.d.comb += [
            pop.eq(can_pop & ~head_bad),
            rfifo.r_en.eq(pop | ~in_stream),   # stale responses are dropped between streams
            loc_b.addr.eq(b_idx[:wbits]), loc_b.en.eq(pop),
            loc_d.addr.eq(d_idx[:wbits]), loc_d.en.eq(pop),
        ]
        last_inner = c_i + 1 == n_val
        m.d.sync += s1_valid.eq(pop)
        with m.If(pop):
            m.d.sync += [
                s1_a.eq(rfifo.r_data[:32 * L]), s1_k.eq(c_k), s1_didx.eq(d_idx),
                s1_last_inner.eq(last_inner), s1_last.eq(last_inner & (c_o + 1 == outer_val)),
                s1_lane.eq(c_o[:max(lbits, 1)] if lbits else 0),
                c_k.eq(c_k + 1), d_idx.eq(d_idx + sf[S.D_STRIDE]),
            ]
            with m.If(last_inner):
                m.d.sync += [c_i.eq(0), b_row.eq(b_row + sf[S.B_OSTRIDE]),
                             b_idx.eq(b_row + sf[S.B_OSTRIDE])]
                with m.If(c_o + 1 == outer_val):
                    m.d.sync += c_done.eq(1)
                with m.Else():
                    m.d.sync += c_o.eq(c_o + 1)
            with m.Else():
                m.d.sync += [c_i.eq(c_i + 1), b_idx.eq(b_idx + sf[S.B_STRIDE])]

        # --- Stream engine: S1 (compute and deliver) -------------------------------------------
        b_mode = sf[S.B_MODE]
        b_word = Mux(b_mode == BMode.LOCAL.value, loc_b.data,
                     Mux(b_mode == BMode.SCALAR.value, Cat([sf[S.B_VAL]] * L), 0))
        shift = sf[S.SHIFT][:5]
        relu = sf[S.POST][0]
        r_lanes = []
        for lane in range(L):
            a = s1_a.word_select(lane, 32)
            b = b_word.word_select(lane, 32)
            f = _alu(m, ir.fn, a, b, f"lane{lane}_alu")
            sh = Signal(32, name=f"lane{lane}_shifted")
            m.d.comb += sh.eq(f.as_signed() >> shift)
            r = Signal(32, name=f"lane{lane}_result")
            m.d.comb += r.eq(Mux(relu & sh[31], 0, sh))
            r_lanes.append(r)
        r_word = Cat(r_lanes)

        # Reductions over the lanes of one result: the sum, and the largest (first on ties).
        lane_sum = Signal(32)
        m.d.comb += lane_sum.eq(sum(r_lanes[1:], r_lanes[0]))
        level = [(r, Const(i, max(lbits, 1))) for i, r in enumerate(r_lanes)]
        while len(level) > 1:
            nxt = []
            for (lv, li), (rv, ri) in zip(level[::2], level[1::2], strict=True):
                right = rv.as_signed() > lv.as_signed()
                nxt.append((Mux(right, rv, lv), Mux(right, ri, li)))
            level = nxt
        word_max = Signal(32)
        word_max_lane = Signal(max(lbits, 1))
        m.d.comb += [word_max.eq(level[0][0]), word_max_lane.eq(level[0][1])]

        red_acc = Signal(32)
        red_idx = Signal(32)
        pack_acc = Signal(32)
        s1_go = s1_valid & in_stream
        stream_local_we = s1_go & ((d_mode == DMode.LOCAL.value)
                                   | (d_mode == DMode.LOCAL_ACC.value))
        with m.If(s1_go):
            with m.Switch(d_mode):
                with m.Case(DMode.WRITE.value, DMode.APPEND.value):
                    m.d.comb += [wq.w_en.eq(1), wq.w_data.eq(Cat(r_word, s1_didx))]
                with m.Case(DMode.LOCAL.value, DMode.LOCAL_ACC.value):
                    acc_word = Cat((r + loc_d.data.word_select(lane, 32))[:32]
                                   for lane, r in enumerate(r_lanes))
                    m.d.comb += [
                        loc_w.addr.eq(s1_didx[:wbits]), loc_w.en.eq((1 << L) - 1),
                        loc_w.data.eq(Mux(d_mode == DMode.LOCAL.value, r_word, acc_word)),
                    ]
                with m.Case(DMode.SUM.value):
                    m.d.sync += red_acc.eq(red_acc + lane_sum)
                with m.Case(DMode.MAX.value, DMode.ARGMAX.value):
                    with m.If(word_max.as_signed() > red_acc.as_signed()):
                        m.d.sync += [red_acc.eq(word_max),
                                     red_idx.eq(Cat(word_max_lane[:lbits], s1_k))]
                with m.Case(DMode.PACK_SUM.value):
                    total = Signal(32)
                    m.d.comb += total.eq(pack_acc + lane_sum)
                    with m.If(s1_last_inner):
                        v_new = Signal(32 * L)
                        m.d.comb += v_new.eq(V)
                        if L == 1:
                            m.d.comb += v_new.eq(total)
                        else:
                            m.d.comb += v_new.word_select(s1_lane[:lbits], 32).eq(total)
                        m.d.sync += pack_acc.eq(0)
                        with m.If((s1_lane == L - 1) | s1_last):
                            m.d.comb += [wq.w_en.eq(1), wq.w_data.eq(v_new)]
                            m.d.sync += V.eq(0)
                        with m.Else():
                            m.d.sync += V.eq(v_new)
                    with m.Else():
                        m.d.sync += pack_acc.eq(total)

        # SRUN starts: reset the walk, the reductions (and V for PACK_SUM).
        with m.If(srun_go):
            is_max = (d_mode == DMode.MAX.value) | (d_mode == DMode.ARGMAX.value)
            m.d.sync += [
                iss_o.eq(0), iss_i.eq(0), iss_row.eq(sf[S.A_BASE]), iss_idx.eq(sf[S.A_BASE]),
                iss_done.eq(0), credits.eq(0), fault.eq(0),
                c_o.eq(0), c_i.eq(0), c_k.eq(0), c_done.eq(0),
                b_row.eq(sf[S.B_VAL]), b_idx.eq(sf[S.B_VAL]), d_idx.eq(sf[S.D_BASE]),
                red_acc.eq(Mux(is_max, 1 << 31, 0)), red_idx.eq(0), pack_acc.eq(0),
            ]
            with m.If(d_mode == DMode.PACK_SUM.value):
                m.d.sync += V.eq(0)

        # SRUN retires when every step ran and every write was acknowledged.
        stream_done = in_stream & c_done & ~s1_valid & (wq.level == 0) & (wr_pending == 0)
        with m.If(stream_done):
            m.d.comb += adv.eq(1)
            with m.Switch(d_mode):
                with m.Case(DMode.SUM.value, DMode.MAX.value):
                    write_a(rd_i, red_acc)
                with m.Case(DMode.ARGMAX.value):
                    write_a(rd_i, red_acc)
                    write_b(rd1_i, red_idx)

        # --- Incoming messages ----------------------------------------------------------------
        fin = self.msg_in.payload
        kind = fin.payload.kind
        body = fin.payload.body
        tag = body.tag
        inv = self.msg_in.valid
        m.d.comb += self.msg_in.ready.eq(1)
        msg_err = Signal(8)
        is_resp = inv & (kind == MsgKind.RESPONSE)
        refused = body.status != MUStatus.OK
        with m.If(is_resp & ((tag == TAG_BLOCKING) | (tag == TAG_WRITE)) & refused):
            m.d.comb += msg_err.eq(codes["MU_ERROR"])
        with m.If(is_resp & (tag == TAG_BLOCKING)):
            m.d.sync += [r0_valid.eq(1), r0_data.eq(body.data), r0_ref.eq(body.ref)]
        m.d.comb += [rfifo.w_en.eq(is_resp & (tag == TAG_READ)),
                     rfifo.w_data.eq(Cat(body.data, refused))]
        ack = is_resp & (tag == TAG_WRITE)
        with m.If(wr_go & ~ack):
            m.d.sync += wr_pending.eq(wr_pending + 1)
        with m.Elif(ack & ~wr_go & (wr_pending != 0)):
            m.d.sync += wr_pending.eq(wr_pending - 1)

        # Tokens and references for a CU that does not run are dropped.
        is_tok = inv & (kind == MsgKind.TOKEN) & running
        for c, cnt in enumerate(tokens):
            arrive = is_tok & (tag == c)
            take = Mux(wait_take & (ir.aux == c), imm, 0)
            total = cnt + Mux(arrive, body.data[:32], 0)
            with m.If(total > _TOKEN_MAX):
                m.d.comb += msg_err.eq(codes["TOKEN_OVERFLOW"])
                m.d.sync += cnt.eq(cnt - take)
            with m.Else():
                m.d.sync += cnt.eq(total - take)

        is_ref = inv & (kind == MsgKind.REF) & running
        for s in range(cp.mailbox):
            take = recv_take & (ir.aux == s)
            with m.If(take):
                m.d.sync += mb_full[s].eq(0)
            with m.If(is_ref & (tag == s)):
                with m.If(mb_full[s] & ~take):
                    m.d.comb += msg_err.eq(codes["MAILBOX_OVERFLOW"])
                with m.Else():
                    m.d.sync += [mb_full[s].eq(1), mb_ref[s].eq(body.ref),
                                 mb_weight[s].eq(body.data[:32])]

        # --- Register file ------------------------------------------------------------------
        cfg = self.cfg
        cfg_we = cfg.sel & cfg.we
        cfg_re = cfg.sel & cfg.re
        addr = cfg.addr
        at_regs = (addr >= CU_MAP.REGS) & (addr < CU_MAP.REGS + R)
        cfg_reg = (addr - CU_MAP.REGS)[:rbits]
        for i, r in enumerate(regs):
            with m.If(cfg_we & at_regs & (cfg_reg == i)):
                m.d.sync += init_regs[i].eq(cfg.wdata)
                with m.If(~running):
                    m.d.sync += r.eq(cfg.wdata)
            with m.If(wa_en & (wa_idx == i)):
                m.d.sync += r.eq(wa_data)
            with m.If(wb_en & (wb_idx == i)):
                m.d.sync += r.eq(wb_data)

        # --- Errors ---------------------------------------------------------------------------
        with m.If(running & ((seq_err != 0) | (msg_err != 0))):
            m.d.sync += [state.eq(_State.IDLE), err.eq(1),
                         code.eq(Mux(seq_err != 0, seq_err, msg_err))]
            with m.If(seq_err == codes["PC_OUT_OF_RANGE"]):
                m.d.sync += pc.eq(npc)

        # --- Counters -----------------------------------------------------------------------
        sent = ((self.req.valid & self.req.ready).as_unsigned()
                + (self.msg_out.valid & self.msg_out.ready))
        m.d.sync += [
            self.busy_cycles.eq(self.busy_cycles + running),
            self.stall_cycles.eq(self.stall_cycles + (running & ~adv & ~halt & ~pop)),
            self.wait_cycles.eq(self.wait_cycles + (running & waiting)),
            self.flits_out.eq(self.flits_out + sent),
            self.flits_in.eq(self.flits_in + inv),
        ]

        # --- Start (overrides everything above) -----------------------------------------------
        with m.If(self.start):
            m.d.sync += [
                *[r.eq(i) for r, i in zip(regs, init_regs, strict=True)],
                *[t.eq(0) for t in tokens], *[f.eq(0) for f in mb_full],
                *[s.eq(int(f is S.OUTER)) for f, s in sf.items()],
                V.eq(0), r0_valid.eq(0), wr_pending.eq(0), credits.eq(0),
                err.eq(0), code.eq(0), pc.eq(0),
                self.busy_cycles.eq(0), self.stall_cycles.eq(0), self.wait_cycles.eq(0),
                self.flits_out.eq(0), self.flits_in.eq(0),
            ]
            m.d.comb += [prog_r.addr.eq(0), prog_r.en.eq(1)]
            with m.If(enabled):
                m.d.sync += state.eq(_State.RUN)
            with m.Else():
                m.d.sync += state.eq(_State.IDLE)

        # --- Configuration space ------------------------------------------------------------
        at_prog = addr < CU_MAP.PROGRAM + 2 * cp.prog_len
        prog_word = (addr - CU_MAP.PROGRAM)[1:]
        m.d.comb += [
            prog_w.addr.eq(prog_word), prog_w.data.eq(Cat(cfg.wdata, cfg.wdata)),
            prog_w.en.eq(Mux(cfg_we & at_prog, Mux(addr[0], 0b10, 0b01), 0)),
            prog_c.addr.eq(prog_word), prog_c.en.eq(cfg_re & at_prog),
        ]
        with m.If(cfg_we & (addr == CU_MAP.CONTROL)):
            m.d.sync += enabled.eq(cfg.wdata[0])

        loc_off = addr - CU_MAP.LOCAL
        at_local = (addr >= CU_MAP.LOCAL) & (loc_off < cp.local_words * L)
        loc_word = loc_off[lbits:lbits + wbits] if wbits else Const(0, 0)
        loc_lane = loc_off[:lbits] if lbits else Const(0, 1)
        m.d.comb += [loc_c.addr.eq(loc_word), loc_c.en.eq(cfg_re & at_local)]
        with m.If(cfg_we & at_local & ~stream_local_we):
            m.d.comb += [loc_w.addr.eq(loc_word), loc_w.data.eq(Cat([cfg.wdata] * L)),
                         loc_w.en.eq(Const(1, L) << loc_lane)]

        status = Cat(~running, err, Const(0, 6), code, pc)
        value = Signal(32)
        with m.If(at_regs):
            m.d.comb += value.eq(regs_a[cfg_reg])
        with m.Elif(addr == CU_MAP.CONTROL):
            m.d.comb += value.eq(enabled)
        with m.Elif(addr == CU_MAP.STATUS):
            m.d.comb += value.eq(status)
        with m.Elif(addr == CU_MAP.WAIT_CYCLES):
            m.d.comb += value.eq(self.wait_cycles)
        for name, where in TILE_COUNTERS.items():
            with m.Elif(addr == where):
                m.d.comb += value.eq(getattr(self, name))
        r_sel = Signal(2)     # 0: value register, 1: program, 2: local buffer
        r_half = Signal()
        r_lane = Signal(max(lbits, 1))
        r_value = Signal(32)
        with m.If(cfg_re):
            m.d.sync += [r_sel.eq(Mux(at_prog, 1, Mux(at_local, 2, 0))), r_half.eq(addr[0]),
                         r_lane.eq(loc_lane), r_value.eq(value)]
        m.d.comb += cfg.rdata.eq(Mux(r_sel == 1, Mux(r_half, prog_c.data[32:], prog_c.data[:32]),
                                     Mux(r_sel == 2, _lane(loc_c.data, r_lane, L), r_value)))
        return m
