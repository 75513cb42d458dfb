"""The compute unit's sequencer: program memory, pc, register file, decode and execute.

The program memory has a synchronous read port: while instruction ``pc`` executes, the address
of the next one (``pc + 1`` or a branch target, computed from the register file in the same
cycle) is presented, so every non-blocking instruction, taken branches included, takes one
cycle. A blocking MU instruction offers its request on ``mu_req`` (the CU loads it into its request
register) and waits for the response (tag 0), which is captured in a register and retired the
cycle after it arrives; ALLOC, READ and LEN (:data:`NONBLOCKING`) retire at once and their
response writes ``rd`` later. ``WAIT``/``RECV`` retire in the cycle the tokens or the reference are
there; ``SEND``/``SENDREF`` retire when the message register is free. ``SRUN`` hands the stream
to the stream engine (:mod:`rdakit.hdl.compute.stream`) and retires at once: the instructions
after it run while the stream does, except those that need what a stream the engine holds may
still change (:data:`STREAM_HAZARDS`: an MU request naming a buffer the stream writes, or
changing one it reads; LGET and LSET against the local buffer; V; the fences), any instruction
naming a register a stream's reduction will write, and an instruction that fails; these wait
until the stream is done. See :mod:`rdakit.hdl.compute.unit` for the timing and the
readings of the spec.
"""

from amaranth.hdl import Array, Cat, Const, Module, Mux, Signal, unsigned
from amaranth.lib import enum, memory, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from rdakit.hdl.compute.common import (
    D_MU_MODES,
    STREAM_FIELDS,
    TAG_BLOCKING,
    TAG_WRITE,
    alu,
    bind_cu_tile,
    lane,
    request,
)
from rdakit.hdl.spec.config import CU_MAP, CU_STATUS, CU_STATUS_BITS, config_bus_signature
from rdakit.hdl.spec.cu import (  # noqa: F401 (AFTER_STREAM and the rest: named here too)
    AFTER_STREAM,
    B_LOCAL_MODES,
    D_LOCAL_READS,
    D_LOCAL_WRITES,
    FENCED,
    MU_INSTRUCTIONS,
    MU_OP,
    NONBLOCKING,
    POSTED,
    STREAM_HAZARDS,
    STREAM_TOUCH_DOC,
    STREAM_TOUCHES,
)
from rdakit.hdl.spec.flit import flit_layout
from rdakit.hdl.spec.isa import INSTR_LAYOUT, BMode, DMode, Op, StreamField
from rdakit.hdl.spec.packets import MsgKind, MUOp, MUStatus, msg_layout, mu_request_layout

__all__ = ["Sequencer"]

_TOKEN_MAX = 0xffff

_MAX_BMODE = max(m.value for m in BMode)
_MAX_DMODE = max(m.value for m in DMode)

class _State(enum.Enum, shape=2):
    IDLE = 0     # not running: done
    RUN = 1      # executing the instruction on the program read port
    WAIT = 2     # a blocking MU request is out; waiting for its response
    LGET = 3     # LGET's local word is being read


class Sequencer(wiring.Component):
    """The control of a compute unit: runs its program on ``start`` until HALT or an error.

    Parameters
    ----------
    fabric_params : FabricParams
        The fabric; its ``cu`` parameters size the sequencer and its ``mu`` parameters the
        packets.
    x, y : int
        The CU tile (its ID, ``y << coord_bits | x``, is what ``SELF`` returns and the ``src``
        of its requests).

    Members
    -------
    cfg : In(config_bus_signature())
        The program, ``REGS``, ``CONTROL`` and ``STATUS`` part of the configuration space;
        ``rdata`` the cycle after ``re`` (0 for any other address).
    start : In(1)
        One-cycle pulse: load the initial registers, clear tokens, mailbox, ``V`` and the stream
        fields (``OUTER`` = 1) and the status, and run from pc 0 if enabled.
    done, error : Out(1)
        Not running (halted, failed or disabled); halted on an error (code in STATUS).
    retire : Out(1)
        An instruction retires (or HALT halts) this cycle.
    waiting : Out(1)
        Stalled in WAIT or RECV on another CU's token or reference.
    fenced : Out(1)
        A fence (:data:`FENCED`) stalled on posted writes not yet acknowledged.
    mu_waiting : Out(1)
        A blocking MU instruction waits for its response, or an instruction for a
        non-blocking one's (:data:`NONBLOCKING`).
    stream_wait : Out(1)
        The instruction waits for the running stream (:data:`AFTER_STREAM`, a second SRUN, or
        a register the stream's reduction will write).
    mu_req : Out(stream.Signature(flit_layout(coord_bits, mu_request_layout(mu))))
        The blocking MU request of the instruction being executed (not registered: the CU's
        request register takes it); the sequencer waits for its response once it is taken.
    msg_out : Out(stream.Signature(flit_layout(coord_bits, msg_layout(mu))))
        Tokens and references to other CUs; ``valid`` comes from a register.
    msg_in : In(stream.Signature(flit_layout(coord_bits, msg_layout(mu))))
        Everything the CU receives; ``ready`` is constant 1. The sequencer takes tokens,
        references and the responses of tags 0 (blocking) and 2 (stream writes, for MU_ERROR).
    fields : Out(STREAM_FIELDS)
        The stream configuration registers (SCFG, SCFGI).
    fn : Out(4)
        The ``fn`` field of the instruction being executed (SRUN's lane function).
    v : Out(data_bits)
        The staging vector ``V``.
    stream_start, stream_active : Out(1)
        SRUN hands a stream to the engine (one cycle; SRUN retires); the CU runs (the engine
        drops its streams when it stops).
    stream_busy, stream_queued : In(1)
        The engine executes a stream; a second one waits behind it (SRUN waits while it does).
    reads_issued : In(2)
        Every read of the executing (bit 0) and of the waiting stream (bit 1) has been issued:
        a request for a buffer it reads follows them to the MU and may leave.
    stream_done, stream_error : In(1)
        The executing stream has finished; a stream read was refused (MU_ERROR, reported at the
        SRUN's pc).
    writes_pending : In(1)
        A posted write is not yet acknowledged: the fences (:data:`FENCED`) wait.
    posted : Out(1)
        A posted instruction (:data:`POSTED`) handed its request over this cycle (the stream
        engine counts its acknowledgement with the stream's writes).
    stream_acc, stream_index : In(32)
        The stream's reduction and ARGMAX index, written to SRUN's ``rd`` (and ``rd + 1``) when
        the stream is done.
    stream_count : In(32)
        The steps the stream ran, written when it is done to the register after those of its
        reduction if it read the input queue.
    queue_error : In(1)
        A stream word found the input queue full, or credits passed its depth
        (QUEUE_OVERFLOW).
    v_we : In(1), v_next : In(data_bits)
        Load ``V`` with ``v_next`` (the stream engine's PACK_SUM).
    l_addr, l_re, l_rdata, l_we, l_wdata
        LGET and LSET's access to the stream engine's local buffer (see
        :class:`~rdakit.hdl.compute.stream.StreamEngine`).

    Raises
    ------
    TypeError, ValueError
        As :class:`rdakit.hdl.compute.unit.ComputeUnit` for ``fabric_params``, ``x`` and ``y``.
    """

    def __init__(self, fabric_params, *, x, y):
        p = bind_cu_tile(self, fabric_params, x, y)
        L = p.cu.lanes
        cb = p.coord_bits
        req_flit = flit_layout(cb, mu_request_layout(p.mu))
        msg_flit = flit_layout(cb, msg_layout(p.mu))
        super().__init__({
            "cfg": In(config_bus_signature()),
            "start": In(1),
            "done": Out(1),
            "error": Out(1),
            "retire": Out(1),
            "waiting": Out(1),
            "fenced": Out(1),
            "mu_waiting": Out(1),
            "stream_wait": Out(1),
            "mu_req": Out(stream.Signature(req_flit)),
            "msg_out": Out(stream.Signature(msg_flit)),
            "msg_in": In(stream.Signature(msg_flit)),
            "fields": Out(STREAM_FIELDS, init={"outer": 1}),
            "fn": Out(INSTR_LAYOUT["fn"].shape),
            "v": Out(32 * L),
            "stream_start": Out(1),
            "stream_active": Out(1),
            "stream_done": In(1),
            "stream_busy": In(1),
            "stream_queued": In(1),
            "reads_issued": In(2),
            "stream_error": In(1),
            "writes_pending": In(1),
            "posted": Out(1),
            "stream_acc": In(32),
            "stream_index": In(32),
            "stream_count": In(32),
            "queue_error": In(1),
            "v_we": In(1),
            "v_next": In(32 * L),
            "l_addr": Out(32),
            "l_re": Out(1),
            "l_rdata": In(32),
            "l_we": Out(1),
            "l_wdata": Out(32),
        })

    def elaborate(self, platform):
        p = self.fabric_params
        cp, mp = p.cu, p.mu
        cb = p.coord_bits
        L = cp.lanes
        lbits = exact_log2(L)
        R = cp.regs
        rbits = exact_log2(R)
        refw = mp.mu_id_bits + mp.buf_id_bits
        S = StreamField
        m = Module()

        # --- Storage ------------------------------------------------------------------------
        m.submodules.program = prog = memory.Memory(shape=unsigned(64), depth=cp.prog_len,
                                                    init=[])
        prog_w = prog.write_port(granularity=32)
        prog_r = prog.read_port()       # fetch
        m.d.comb += prog_r.en.eq(0)     # (a read port's en is 1 unless driven)
        prog_c = prog.read_port()       # configuration reads

        regs = [Signal(32, name=f"r{i}") for i in range(R)]
        regs_a = Array(regs)
        init_regs = [Signal(32, name=f"init_r{i}") for i in range(R)]
        V = self.v
        sf = {f: getattr(self.fields, f.name.lower()) for f in S}
        tokens = [Signal(16, name=f"tokens{c}") for c in range(cp.channels)]
        tokens_a = Array(tokens)
        mb_full = [Signal(name=f"mb_full{s}") for s in range(cp.mailbox)]
        mb_ref = [Signal(refw, name=f"mb_ref{s}") for s in range(cp.mailbox)]
        mb_weight = [Signal(32, name=f"mb_weight{s}") for s in range(cp.mailbox)]
        mb_full_a, mb_ref_a, mb_weight_a = Array(mb_full), Array(mb_ref), Array(mb_weight)

        state = Signal(_State)
        running = state != _State.IDLE
        in_run = state == _State.RUN
        enabled = Signal()
        pc = Signal(16)
        err = Signal()
        code = Signal(8)
        # The scoreboard: per stream in the engine (0: executing, 1: waiting behind it), the
        # register(s) its reduction writes when it is done and its SRUN's pc (where a refused
        # read is reported).
        s_rd = [Signal(rbits, name=f"s{i}_rd") for i in range(2)]
        # bit 0: rd, 1: rd + 1 (the reduction), 2: s_cnt (the step count of a stream reading
        # the input queue: the register after the reduction's)
        s_writes = [Signal(3, name=f"s{i}_writes") for i in range(2)]
        s_cnt = [Signal(rbits, name=f"s{i}_cnt") for i in range(2)]
        s_pc = [Signal(16, name=f"s{i}_pc") for i in range(2)]
        # ... and what it touches (STREAM_TOUCHES): the buffers it reads and writes, and one bit
        # per touch.
        s_aref = [Signal(refw, name=f"s{i}_aref") for i in range(2)]
        s_dref = [Signal(refw, name=f"s{i}_dref") for i in range(2)]
        s_touch = [Signal(len(STREAM_TOUCHES), name=f"s{i}_touch") for i in range(2)]
        m.d.comb += [self.done.eq(~running), self.error.eq(err),
                     self.stream_active.eq(running)]

        # The message register: valid never depends on ready.
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

        # --- Decode -------------------------------------------------------------------------
        ir = INSTR_LAYOUT(prog_r.data)
        op = ir.op
        m.d.comb += self.fn.eq(ir.fn)
        rd_i, ra_i, rb_i = ir.rd[:rbits], ir.ra[:rbits], ir.rb[:rbits]
        rd1_i = Signal(rbits)
        m.d.comb += rd1_i.eq(rd_i + 1)
        ra_v, rb_v, rd_v = regs_a[ra_i], regs_a[rb_i], regs_a[rd_i]
        imm = ir.imm
        salu = alu(m, ir.fn, ra_v, Mux(op == Op.ALUI, imm, rb_v), "salu")

        # Register file write ports (rd and rd + 1) and sequencer outcomes.
        wa_en, wa_idx, wa_data = Signal(), Signal(rbits), Signal(32)
        wb_en, wb_idx, wb_data = Signal(), Signal(rbits), Signal(32)
        wc_en, wd_en = Signal(), Signal()     # the stream's reduction: rd, rd + 1
        wf_en = Signal()                      # the step count of a stream reading the queue
        we_en, we_data = Signal(), Signal(32)  # a non-blocking MU instruction's result
        npc = Signal(33)
        adv = Signal()        # the instruction retires; fetch npc
        halt = Signal()
        seq_err = Signal(8)   # an error code raised by the instruction
        bq_go = Signal()      # a blocking MU request wants the request register
        wait_take = Signal()
        recv_take = Signal()
        srun_go = Signal()
        m.d.comb += [npc.eq(pc + 1), self.stream_start.eq(srun_go),
                     self.retire.eq(adv | halt)]

        def write_a(idx, value):
            m.d.comb += [wa_en.eq(1), wa_idx.eq(idx), wa_data.eq(value)]

        def write_b(idx, value):
            m.d.comb += [wb_en.eq(1), wb_idx.eq(idx), wb_data.eq(value)]

        codes = CU_STATUS_BITS

        def fail(name):
            m.d.comb += seq_err.eq(codes[name])

        # Blocking request of the instruction on the read port.
        bq = self.mu_req.payload
        bq_op = Signal(MUOp)
        bq_data = Signal(32 * L)
        with m.Switch(op):
            for o, mo in MU_OP.items():
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
        is_posted = op.matches(*POSTED)
        request(m, bq, p, x=self.x, y=self.y, op=bq_op,
                tag=Mux(is_posted, TAG_WRITE, TAG_BLOCKING),
                ref=Mux(op == Op.ALLOC, ra_v[:mp.mu_id_bits], ra_v),
                index=Mux(indexed, rb_v, 0), data=bq_data)
        m.d.comb += self.mu_req.valid.eq(bq_go)

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
        mu_tiles = Const(p.tile_mask("M"), 1 << 2 * cb)
        cu_tiles = Const(p.tile_mask("C"), 1 << 2 * cb)
        ra_is_mu = mu_tiles.bit_select(ra_v[:2 * cb], 1)
        to_is_cu = cu_tiles.bit_select(to[:2 * cb], 1)
        # A stream reads an MU or (A_REF naming this CU) the input queue; a QUEUE stream
        # sends to a CU.
        a_queue = sf[S.A_REF][:2 * cb] == self.cu_id
        stream_to_mu = ((mu_tiles.bit_select(sf[S.A_REF][:2 * cb], 1) | a_queue)
                        & (~sf[S.D_MODE].matches(*D_MU_MODES)
                           | mu_tiles.bit_select(sf[S.D_REF][:2 * cb], 1))
                        & ((sf[S.D_MODE] != DMode.QUEUE.value)
                           | cu_tiles.bit_select(sf[S.D_REF][:2 * cb], 1)))

        channel_ok = ir.aux < cp.channels
        slot_ok = ir.aux < cp.mailbox
        n_val, outer_val = sf[S.N], sf[S.OUTER]
        bad_stream = ((n_val == 0) | (outer_val == 0) | (sf[S.B_MODE] > _MAX_BMODE)
                      | (sf[S.D_MODE] > _MAX_DMODE))

        # --- Execute --------------------------------------------------------------------------
        with m.If(self.stream_done):
            m.d.sync += [s_rd[0].eq(s_rd[1]), s_writes[0].eq(s_writes[1]), s_cnt[0].eq(s_cnt[1]),
                         s_pc[0].eq(s_pc[1]), s_writes[1].eq(0), s_aref[0].eq(s_aref[1]),
                         s_dref[0].eq(s_dref[1]), s_touch[0].eq(s_touch[1])]
        fence = op.matches(*FENCED) & self.writes_pending   # a fence waits for posted writes
        waiting = self.waiting     # stalled in WAIT / RECV on another CU
        # The running stream: in the cycle it is done its writes have all been issued and V is
        # final, but its reduction reaches the registers only at the end of that cycle.
        s_rd1 = [Signal(rbits, name=f"s{i}_rd1") for i in range(2)]
        m.d.comb += [s_rd1[i].eq(s_rd[i] + 1) for i in range(2)]
        names = [rd_i, rd1_i, ra_i, rb_i]
        reg_hazard = Cat(
            (s_writes[i][0] & Cat(r == s_rd[i] for r in names).any())
            | (s_writes[i][1] & Cat(r == s_rd1[i] for r in names).any())
            | (s_writes[i][2] & Cat(r == s_cnt[i] for r in names).any())
            for i in range(2)).any()
        # The engine is idle, or will be at the end of this cycle.
        idle = ~self.stream_busy | (self.stream_done & ~self.stream_queued)
        # The streams the engine still holds at the end of this cycle (one done in this cycle has
        # issued every write and delivered every result), and whether the instruction must wait
        # for one of them (STREAM_HAZARDS).
        live = [self.stream_busy & ~self.stream_done, self.stream_queued]
        ref_i = ra_v[:refw]
        slot_hazards = []
        for i in range(2):
            t = dict(zip(STREAM_TOUCHES, s_touch[i], strict=True))
            hit = {"a_ref": (s_aref[i] == ref_i) & ~self.reads_issued[i],
                   "d_ref": t["d_ref"] & (s_dref[i] == ref_i),
                   "local_r": t["local_r"], "local_w": t["local_w"], "v": t["v"],
                   "any": Const(1)}
            waits = Const(0)
            for o, touches in STREAM_HAZARDS.items():
                if touches:
                    waits = waits | ((op == o) & Cat(hit[k] for k in touches).any())
            slot_hazards.append(live[i] & waits)
        # An instruction that fails (below) waits for the engine to be idle first: the streams
        # before it complete, their writes and reductions included, as in the interpreter.
        taken = Mux(op == Op.BNZ, ra_v != 0, Mux(op == Op.BZ, ra_v == 0, Mux(
            op == Op.BLT, ra_v.as_signed() < rb_v.as_signed(),
            Mux(op == Op.LOOP, ra_v != 1, op == Op.JMP))))
        off_end = Mux(taken, imm >= cp.prog_len, pc + 1 >= cp.prog_len) & (op != Op.HALT)
        fails = (~op.matches(*Op) | off_end
                 | op.matches(*MU_INSTRUCTIONS) & ~ra_is_mu
                 | (op == Op.WAIT) & ~channel_ok | (op == Op.RECV) & ~slot_ok
                 | (op == Op.SRUN) & (bad_stream | ~stream_to_mu))
        after_stream = (Mux(op == Op.SRUN, self.stream_queued,
                            Cat(slot_hazards).any() | reg_hazard)
                        | fails & ~idle)
        # The non-blocking MU instruction in flight (NONBLOCKING): its register, its pc (where
        # a refusal is reported) and how its response becomes the register's value.
        m_pend = Signal()
        m_rd = Signal(rbits)
        m_pc = Signal(16)
        m_op = Signal(2)          # 0: ALLOC (the reference), 1: READ (a lane), 2: LEN
        m_lane = Signal(4)
        after_mu = m_pend & (op.matches(*MU_INSTRUCTIONS, *FENCED)
                             | Cat(r == m_rd for r in names).any())
        m.d.comb += [self.stream_wait.eq(in_run & after_stream),
                     self.mu_waiting.eq((state == _State.WAIT)
                                        | (in_run & after_mu & ~after_stream))]
        with m.If(in_run & ~after_stream & ~after_mu):
            with m.Switch(op):
                with m.Case(Op.NOP):
                    m.d.comb += adv.eq(1)
                with m.Case(Op.HALT):
                    m.d.comb += [halt.eq(~out_valid & ~fence), self.fenced.eq(fence)]
                with m.Case(Op.LI):
                    write_a(rd_i, imm)
                    m.d.comb += adv.eq(1)
                with m.Case(Op.ALU, Op.ALUI):
                    write_a(rd_i, salu)
                    m.d.comb += adv.eq(1)
                with m.Case(Op.JMP):
                    m.d.comb += [npc.eq(imm), adv.eq(1)]
                with m.Case(Op.BNZ, Op.BZ, Op.BLT):
                    with m.If(taken):
                        m.d.comb += npc.eq(imm)
                    m.d.comb += adv.eq(1)
                with m.Case(Op.LOOP):
                    write_a(ra_i, ra_v - 1)
                    with m.If(taken):
                        m.d.comb += npc.eq(imm)
                    m.d.comb += adv.eq(1)
                with m.Case(*MU_INSTRUCTIONS):
                    with m.If(~ra_is_mu):
                        fail("BAD_DESTINATION")
                    with m.Elif(~fence):
                        m.d.comb += bq_go.eq(1)
                    with m.Else():
                        m.d.comb += self.fenced.eq(1)
                with m.Case(Op.VSET):
                    if L == 1:
                        m.d.sync += V.eq(ra_v)
                    else:
                        m.d.sync += V.word_select(ir.fn[:lbits], 32).eq(ra_v)
                    m.d.comb += adv.eq(1)
                with m.Case(Op.VCLR):
                    m.d.sync += V.eq(0)
                    m.d.comb += adv.eq(1)
                with m.Case(Op.SEND, Op.SENDREF):
                    # a channel (SEND) or a mailbox slot (SENDREF) that exists
                    with m.If(~Mux(op == Op.SEND, channel_ok, slot_ok)):
                        fail("BAD_INSTRUCTION")
                    with m.Elif(~to_is_cu):
                        fail("BAD_DESTINATION")
                    with m.Elif(out_free & ~fence):
                        m.d.comb += [out_load.eq(1), adv.eq(1)]
                    with m.Elif(fence):
                        m.d.comb += self.fenced.eq(1)
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
                        m.d.comb += [srun_go.eq(1), adv.eq(1)]
                        reduces = sf[S.D_MODE].matches(DMode.SUM.value, DMode.MAX.value,
                                                       DMode.ARGMAX.value)
                        # The stream executes next (entry 0) or waits behind the running one.
                        d_mode = sf[S.D_MODE]
                        touches = {
                            "a_ref": Const(1),   # (A_REF is always read; its bit is unused)
                            "d_ref": d_mode.matches(*D_MU_MODES),
                            "local_r": (sf[S.B_MODE].matches(*B_LOCAL_MODES)
                                        | d_mode.matches(*D_LOCAL_READS)),
                            "local_w": d_mode.matches(*D_LOCAL_WRITES),
                            "v": d_mode == DMode.PACK_SUM.value,
                        }
                        for i, cond in enumerate((idle, ~idle)):
                            with m.If(cond):
                                m.d.sync += [
                                    s_rd[i].eq(rd_i), s_pc[i].eq(pc),
                                    s_writes[i].eq(Cat(reduces,
                                                       d_mode == DMode.ARGMAX.value,
                                                       a_queue)),
                                    s_cnt[i].eq(rd_i + reduces
                                                + (d_mode == DMode.ARGMAX.value)),
                                    s_aref[i].eq(sf[S.A_REF][:refw]),
                                    s_dref[i].eq(sf[S.D_REF][:refw]),
                                    s_touch[i].eq(Cat(touches[k] for k in STREAM_TOUCHES)),
                                ]
                with m.Case(Op.SELF):
                    write_a(rd_i, self.cu_id)
                    m.d.comb += adv.eq(1)
                with m.Case(Op.LGET):
                    m.d.comb += self.l_re.eq(1)
                    m.d.sync += state.eq(_State.LGET)
                with m.Case(Op.LSET):
                    m.d.comb += [self.l_we.eq(1), adv.eq(1)]
                with m.Default():
                    fail("BAD_INSTRUCTION")

        with m.If(halt):
            m.d.sync += state.eq(_State.IDLE)

        # LGET's local word, read the cycle before.
        m.d.comb += [self.l_addr.eq(rb_v + imm), self.l_wdata.eq(ra_v)]
        with m.If(state == _State.LGET):
            write_a(rd_i, self.l_rdata)
            m.d.comb += adv.eq(1)

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
                        write_a(rd_i, lane(r0_data, ir.fn, L))
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

        # The CU's request register took the blocking request: wait for its response; a
        # posted one retires at once.
        with m.If(self.mu_req.valid & self.mu_req.ready):
            with m.If(is_posted):
                m.d.comb += [adv.eq(1), self.posted.eq(1)]
            with m.Elif(op.matches(*NONBLOCKING)):
                m.d.comb += adv.eq(1)
                m.d.sync += [m_pend.eq(1), m_rd.eq(rd_i), m_pc.eq(pc), m_lane.eq(ir.fn),
                             m_op.eq(Mux(op == Op.ALLOC, 0, Mux(op == Op.READ, 1, 2)))]
            with m.Else():
                m.d.sync += state.eq(_State.WAIT)
        # Its response: the register is written the cycle after it is captured.
        with m.If(m_pend & r0_valid):
            m.d.sync += [m_pend.eq(0), r0_valid.eq(0)]
            m.d.comb += [we_en.eq(1), we_data.eq(Mux(m_op == 0, r0_ref, Mux(
                m_op == 1, lane(r0_data, m_lane, L), r0_data[:32])))]

        # --- The stream engine: V for PACK_SUM, a refused read, SRUN retiring -----------------
        with m.If(self.v_we):
            m.d.sync += V.eq(self.v_next)
        with m.If(self.stream_error):
            fail("MU_ERROR")
        # (A stream's end comes before the execute block's SRUN, which may start the next.)
        m.d.comb += [wc_en.eq(self.stream_done & s_writes[0][0]),
                     wd_en.eq(self.stream_done & s_writes[0][1]),
                     wf_en.eq(self.stream_done & s_writes[0][2])]

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
        with m.If(self.queue_error):
            m.d.comb += msg_err.eq(codes["QUEUE_OVERFLOW"])
        with m.If(is_resp & (tag == TAG_BLOCKING)):
            m.d.sync += [r0_valid.eq(1), r0_data.eq(body.data), r0_ref.eq(body.ref)]

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
            # (an instruction naming the stream's registers waits, so these never collide)
            with m.If(wc_en & (s_rd[0] == i)):
                m.d.sync += r.eq(self.stream_acc)
            with m.If(wd_en & (s_rd1[0] == i)):
                m.d.sync += r.eq(self.stream_index)
            with m.If(wf_en & (s_cnt[0] == i)):
                m.d.sync += r.eq(self.stream_count)
            with m.If(we_en & (m_rd == i)):
                m.d.sync += r.eq(we_data)

        # --- Errors ---------------------------------------------------------------------------
        with m.If(running & ((seq_err != 0) | (msg_err != 0))):
            m.d.sync += [state.eq(_State.IDLE), err.eq(1), s_writes[0].eq(0), s_writes[1].eq(0),
                         m_pend.eq(0),
                         code.eq(Mux(seq_err != 0, seq_err, msg_err))]
            with m.If(self.stream_error):
                m.d.sync += pc.eq(s_pc[0])
            with m.Elif(m_pend & (msg_err != 0) & (seq_err == 0) & is_resp
                        & (tag == TAG_BLOCKING)):
                m.d.sync += pc.eq(m_pc)
            with m.Elif(seq_err == codes["PC_OUT_OF_RANGE"]):
                m.d.sync += pc.eq(npc)

        # --- Start (overrides everything above) -----------------------------------------------
        with m.If(self.start):
            m.d.sync += [
                *[r.eq(i) for r, i in zip(regs, init_regs, strict=True)],
                *[t.eq(0) for t in tokens], *[f.eq(0) for f in mb_full],
                *[s.eq(int(f is S.OUTER)) for f, s in sf.items()],
                V.eq(0), r0_valid.eq(0), err.eq(0), code.eq(0), pc.eq(0), m_pend.eq(0),
                s_writes[0].eq(0), s_writes[1].eq(0),
            ]
            m.d.comb += [prog_r.addr.eq(0), prog_r.en.eq(1)]
            with m.If(enabled):
                m.d.sync += state.eq(_State.RUN)
            with m.Else():
                m.d.sync += state.eq(_State.IDLE)

        # --- Configuration space: program, registers, CONTROL, STATUS -----------------------
        at_prog = addr < CU_MAP.PROGRAM + 2 * cp.prog_len
        prog_word = (addr - CU_MAP.PROGRAM)[1:]
        m.d.comb += [
            prog_w.addr.eq(prog_word), prog_w.data.eq(Cat(cfg.wdata, cfg.wdata)),
            prog_w.en.eq(Mux(cfg_we & at_prog, Mux(addr[0], 0b10, 0b01), 0)),
            prog_c.addr.eq(prog_word), prog_c.en.eq(cfg_re & at_prog),
        ]
        with m.If(cfg_we & (addr == CU_MAP.CONTROL)):
            m.d.sync += enabled.eq(cfg.wdata[0])
            # Disabling (every load begins so) forgets the initial registers: a bitstream that
            # sets none starts from zeros, as the reader and the interpreter say, not from the
            # last job's values (docs/bitstream.md).
            with m.If(~cfg.wdata[0]):
                m.d.sync += [r.eq(0) for r in init_regs]

        status = Signal(CU_STATUS)
        m.d.comb += [status.done.eq(~running), status.error.eq(err), status.code.eq(code),
                     status.pc.eq(pc)]
        value = Signal(32)
        with m.If(at_regs):
            m.d.comb += value.eq(regs_a[cfg_reg])
        with m.Elif(addr == CU_MAP.CONTROL):
            m.d.comb += value.eq(enabled)
        with m.Elif(addr == CU_MAP.STATUS):
            m.d.comb += value.eq(status)
        r_prog = Signal()
        r_half = Signal()
        r_value = Signal(32)
        with m.If(cfg_re):
            m.d.sync += [r_prog.eq(at_prog), r_half.eq(addr[0]), r_value.eq(value)]
        m.d.comb += cfg.rdata.eq(Mux(r_prog, Mux(r_half, prog_c.data[32:], prog_c.data[:32]),
                                     r_value))
        return m
