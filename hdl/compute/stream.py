"""The compute unit's stream engine: the SIMD datapath that runs the streams SRUN hands over.

It holds two streams: one executing and one waiting behind it (the sequencer hands the next over
while one runs). An issue stage walks ``(o, i)`` and offers a READ (tag 1) on ``mu_req`` each
cycle while fewer than ``outstanding`` reads are unconsumed (issued and not yet popped); once
the executing stream's reads are out it walks the waiting stream's (a prefetch) if that stream
does not read the buffer the executing one writes and its responses cannot overtake the
executing one's (it reads the same MU, or none of the executing stream's reads is still
unanswered); otherwise its reads start when it starts executing. Read responses go into a
response FIFO of ``outstanding + 1`` entries, so a response is always accepted. The execute
pipeline has three stages (S0, then ``EXEC_STAGES``): S0 pops the head of the FIFO and reads
operand B from the local buffer; S1 computes ``fn(a, b)`` in every lane (the multiplier) and
reads the LOCAL_ACC or OUTER_SUM destination; S2 computes ``post(f >> SHIFT)`` and delivers it
(local buffer write, reduction, ``V`` for PACK_SUM, or a write queue for MU writes and appends).
Every step sees the local buffer as the steps before it left it: the read ports are transparent
to the write port, which covers the destination read in S1 (the step ahead writes in that cycle)
and a B read two steps behind a write; a step whose B is the word the step just ahead of it (in
S1) writes waits one cycle in S0. The write queue takes a result only when it has room for every
result in S1 and S2 too. MU writes and appends (tag 2) leave from the write queue with priority
over reads, so a step that writes takes two request cycles; the stream is ``done`` when every
step has been executed and every write issued (writes are posted: ``writes_pending`` counts
their acknowledgements across streams). Streams between CUs (``docs/compute-unit.md``): a stream
whose ``A_REF`` names this CU pops its input queue instead of the response FIFO, and a QUEUE
stream's results leave the write queue through ``msg_out`` with a credit each
(:mod:`rdakit.hdl.compute.credits`). See :mod:`rdakit.hdl.compute.unit` for the timing and the
readings of the spec.
"""

from amaranth.hdl import Cat, Const, Module, Mux, ResetInserter, Signal, unsigned
from amaranth.lib import data, fifo, memory, stream, wiring
from amaranth.lib.wiring import In, Out
from amaranth.utils import exact_log2

from rdakit.hdl.compute.common import (
    D_MU_MODES,
    STREAM_FIELDS,
    TAG_READ,
    TAG_WRITE,
    alu,
    bind_cu_tile,
    lane,
    request,
)
from rdakit.hdl.compute.credits import CreditCounter, CreditReturn
from rdakit.hdl.spec.config import CU_MAP, config_bus_signature
from rdakit.hdl.spec.cu import B_LOCAL_MODES, D_LOCAL_WRITES, EXEC_STAGES, WQ_DEPTH
from rdakit.hdl.spec.flit import flit_layout
from rdakit.hdl.spec.isa import INSTR_LAYOUT, SAT8_MAX, SAT8_MIN, BMode, DMode, Post
from rdakit.hdl.spec.packets import (
    STREAM_CREDIT,
    STREAM_LAST,
    MsgKind,
    MUOp,
    msg_layout,
    mu_request_layout,
)

__all__ = ["EXEC_STAGES", "StreamEngine", "WQ_DEPTH", "read_response_layout",
           "queue_word_layout"]




def read_response_layout(fabric_params):
    """A read response as the stream engine takes it: the vector word and whether the MU
    refused the read."""
    return data.StructLayout({"data": fabric_params.cu.data_bits, "refused": 1})


def queue_word_layout(fabric_params):
    """A word another CU's stream sent into the input queue (``MsgKind.STREAM``): the vector
    word, whether it is its stream's last, and the producer's CU ID (credits go back to it)."""
    return data.StructLayout({"data": fabric_params.cu.data_bits, "last": 1,
                              "src": fabric_params.mu.mu_id_bits})


class StreamEngine(wiring.Component):
    """The SIMD streaming datapath of a compute unit.

    Parameters
    ----------
    fabric_params : FabricParams
        The fabric; its ``cu`` parameters size the engine (lanes, local buffer, outstanding
        reads) and its ``mu`` parameters the requests.
    x, y : int
        The CU tile the engine belongs to (the ``src`` of its requests).

    Members
    -------
    fields : In(STREAM_FIELDS)
        The stream configuration (``StreamField``), taken at ``start``: the sequencer may
        configure the next stream while this one runs.
    fn : In(4)
        The lanes' ALU function (SRUN's ``fn``), taken at ``start``.
    start : In(1)
        One-cycle pulse: the sequencer hands over a stream (only while ``queued`` is low). It
        executes at once if the engine is idle (or its stream is ``done`` in this cycle), else
        after the running one; its reads may be issued before (see the module docstring).
        Executing a stream resets the walk, the reductions and, for PACK_SUM, ``V``.
    active : In(1)
        The CU runs. While it is low the engine drops its streams, stale read responses and
        queued writes, and issues nothing.
    busy, queued : Out(1)
        A stream executes; a second one waits behind it.
    reads_issued : Out(2)
        Bit 0: every read of the executing stream has been issued; bit 1: every read of the
        waiting one (the sequencer's request for a buffer they read may then follow them).
    clear : In(1)
        One-cycle pulse (the CU's start): forget outstanding reads and unacknowledged writes.
    mu_req : Out(stream.Signature(flit_layout(coord_bits, mu_request_layout(mu))))
        READ, WRITE and APPEND requests; ``valid`` does not depend on ``ready``.
    resp : In(stream.Signature(read_response_layout(fabric_params)))
        Responses to the engine's reads (tag 1), in order; ``ready`` is constant 1 (the
        response FIFO has room for every read the engine has outstanding).
    ack : In(1)
        A response to one of the engine's writes (tag 2) arrives.
    v : In(data_bits)
        The staging vector ``V`` (held by the sequencer).
    v_we : Out(1), v_next : Out(data_bits)
        Load ``V`` with ``v_next`` at the next clock edge (PACK_SUM).
    step : Out(1)
        A step enters the pipeline this cycle (a response is popped).
    done : Out(1)
        The executing stream has finished (one cycle): every step ran and every write was
        issued. Writes are *posted*: their acknowledgements may still be on their way.
    writes_pending : Out(1)
        Some write of this or an earlier stream, or a posted request of the sequencer, is not
        yet acknowledged (the sequencer's fences wait for it to fall).
    posted : In(1)
        The sequencer handed over a posted request this cycle: one more acknowledgement owed.
    error : Out(1)
        A read was refused and the steps before it have completed (MU_ERROR).
    acc, index : Out(32)
        The reduction (SUM, MAX, ARGMAX's value) and ARGMAX's index, final when ``done``.
    count : Out(32)
        The steps the executing stream has run (final when ``done``: what a stream reading
        the input queue reports).
    q_in : In(stream.Signature(queue_word_layout(fabric_params)))
        A word for the input queue (``ready`` is constant 1: the producer held a credit for
        it). Dropped while the CU does not run.
    credit_in : In(1), credit_count : In(32)
        Credits returned by the consumer of this CU's QUEUE streams.
    q_error : Out(1)
        A word arrived at a full input queue, or returned credits would pass ``queue_words``
        (QUEUE_OVERFLOW; the word or the credits are dropped).
    msg_out : Out(stream.Signature(flit_layout(coord_bits, msg_layout(mu))))
        STREAM messages: the words of a QUEUE stream and the credits this CU returns; ``valid``
        comes from a register. Credits go first.
    l_addr : In(32)
        The local element the sequencer's LGET or LSET names: lane ``l_addr mod lanes`` of word
        ``l_addr / lanes`` (modulo ``local_words``).
    l_re : In(1), l_rdata : Out(32)
        LGET: read element ``l_addr``; ``l_rdata`` holds it the next cycle.
    l_we : In(1), l_wdata : In(32)
        LSET: element ``l_addr`` = ``l_wdata``. The sequencer issues LGET and LSET only while
        no stream runs.
    cfg : In(config_bus_signature())
        The local buffer's part of the configuration space (``CU_MAP.LOCAL``); ``rdata`` is 0
        the cycle after a read of any other address. Writes are ignored in a cycle when the
        stream or LSET writes the local buffer.

    Streams between CUs: the input queue is a FIFO of ``queue_words`` words (cleared by
    ``clear``); a stream whose ``A_REF`` is this CU's ID pops it instead of the response FIFO
    and issues no reads, and ends after a word marked last. A QUEUE stream's results leave
    from the write queue through ``msg_out``, one a cycle while the engine holds a credit (it
    starts with ``queue_words``). Credits for popped words are returned to the sender of the
    last word received, gathered while the queue is popped every cycle (``credit_batch``) and
    at once in a cycle without a pop.

    Latency: the first READ is offered the cycle after ``start``; a response popped in cycle
    ``t`` is delivered in ``t + EXEC_STAGES`` (``t + 2``); one step a cycle, but a step whose B
    is the word the step before it writes waits a cycle; ``done`` follows the last delivery by
    at least one cycle (and the last write's issue), ``error`` also the last acknowledgement.

    Raises
    ------
    TypeError, ValueError
        As :class:`rdakit.hdl.compute.unit.ComputeUnit` for ``fabric_params``, ``x`` and ``y``.
    """

    def __init__(self, fabric_params, *, x, y):
        p = bind_cu_tile(self, fabric_params, x, y)
        L = p.cu.lanes
        req_flit = flit_layout(p.coord_bits, mu_request_layout(p.mu))
        super().__init__({
            "fields": In(STREAM_FIELDS),
            "fn": In(INSTR_LAYOUT["fn"].shape),
            "start": In(1),
            "active": In(1),
            "busy": Out(1),
            "queued": Out(1),
            "reads_issued": Out(2),
            "clear": In(1),
            "mu_req": Out(stream.Signature(req_flit)),
            "resp": In(stream.Signature(read_response_layout(p))),
            "ack": In(1),
            "v": In(32 * L),
            "v_we": Out(1),
            "v_next": Out(32 * L),
            "step": Out(1),
            "done": Out(1),
            "writes_pending": Out(1),
            "posted": In(1),
            "error": Out(1),
            "acc": Out(32),
            "index": Out(32),
            "l_addr": In(32),
            "l_re": In(1),
            "l_rdata": Out(32),
            "l_we": In(1),
            "l_wdata": In(32),
            "cfg": In(config_bus_signature()),
            "count": Out(32),
            "q_in": In(stream.Signature(queue_word_layout(p))),
            "credit_in": In(1),
            "credit_count": In(32),
            "q_error": Out(1),
            "msg_out": Out(stream.Signature(flit_layout(p.coord_bits, msg_layout(p.mu)))),
        })

    def elaborate(self, platform):
        p = self.fabric_params
        cp, mp = p.cu, p.mu
        L = cp.lanes
        lbits = exact_log2(L)
        wbits = exact_log2(cp.local_words)
        m = Module()
        refw = mp.mu_id_bits + mp.buf_id_bits
        # Two stream slots: A executes (its steps and writes; ``sf``, ``fn``), B waits behind
        # it (``b_sf``, ``b_fn``). Configurations are taken when the sequencer hands a stream
        # over (``start``).
        a_valid, b_valid = Signal(), Signal()
        sf, b_sf = Signal(STREAM_FIELDS), Signal(STREAM_FIELDS)
        fn, b_fn = Signal.like(self.fn), Signal.like(self.fn)
        in_stream = a_valid
        running = self.active
        m.d.comb += [self.busy.eq(a_valid), self.queued.eq(b_valid)]

        # --- Storage ------------------------------------------------------------------------
        m.submodules.local = local = memory.Memory(shape=unsigned(32 * L),
                                                   depth=cp.local_words, init=[])
        loc_w = local.write_port(granularity=32)
        loc_b = local.read_port(transparent_for=(loc_w,))   # stream operand B
        loc_d = local.read_port(transparent_for=(loc_w,))   # LOCAL_ACC destination
        loc_c = local.read_port()                           # configuration reads
        loc_s = local.read_port()                           # the sequencer's LGET
        l_word = self.l_addr[lbits:lbits + wbits] if wbits else Const(0, 0)
        l_lane = self.l_addr[:lbits] if lbits else Const(0, 1)
        s_lane = Signal.like(l_lane)
        with m.If(self.l_re):
            m.d.sync += s_lane.eq(l_lane)
        m.d.comb += [loc_s.addr.eq(l_word), loc_s.en.eq(self.l_re),
                     self.l_rdata.eq(lane(loc_s.data, s_lane, L))]
        # A read response and whether the MU refused it.
        m.submodules.rfifo = rfifo = fifo.SyncFIFOBuffered(width=32 * L + 1,
                                                           depth=cp.outstanding + 1)
        wq_layout = data.StructLayout({"data": 32 * L, "index": mp.index_bits, "last": 1})
        m.submodules.wq = wq = fifo.SyncFIFOBuffered(width=wq_layout.size, depth=WQ_DEPTH + 1)
        m.d.comb += [self.resp.ready.eq(1), rfifo.w_en.eq(self.resp.valid),
                     rfifo.w_data.eq(Cat(self.resp.payload.data, self.resp.payload.refused))]

        # The input queue (streams between CUs): ``queue_words`` words, each with its mark
        # (its stream's last). One entry more than the credits allow, so that the buffered
        # FIFO never refuses a word the credits made room for (its inner FIFO holds
        # ``queue_words``); emptied by ``clear``. A word that finds ``queue_words`` words there
        # broke the protocol.
        Q = cp.queue_words
        cb = p.coord_bits
        qfifo = fifo.SyncFIFOBuffered(width=32 * L + 1, depth=Q + 1)
        m.submodules.qfifo = ResetInserter(self.clear)(qfifo)
        q_arrive = self.q_in.valid & running
        q_full = qfifo.level >= Q
        q_src = Signal(mp.mu_id_bits)                  # where credits go back
        m.d.comb += [self.q_in.ready.eq(1), qfifo.w_en.eq(q_arrive & ~q_full),
                     qfifo.w_data.eq(Cat(self.q_in.payload.data, self.q_in.payload.last))]
        with m.If(q_arrive):
            m.d.sync += q_src.eq(self.q_in.payload.src)

        def pops_queue(f):
            # A stream whose A_REF names this CU reads the input queue.
            return f.a_ref[:2 * cb] == self.cu_id

        # --- Issue --------------------------------------------------------------------------
        # One walker issues A's reads, then B's: early (a prefetch, while A still executes) when
        # B's responses cannot overtake A's (same MU, or none of A's reads still in the
        # network) and B does not read the buffer A writes; otherwise when B starts executing.
        credits = Signal(range(cp.outstanding + 1))   # reads issued and not yet popped
        inflight = Signal(range(cp.outstanding + 2))  # reads issued and not yet answered
        iss_o, iss_i = Signal(32), Signal(32)
        iss_row, iss_idx = Signal(32), Signal(32)
        iss_done = Signal(init=1)
        iss_b = Signal()                               # the walker works for B
        m.d.comb += self.reads_issued.eq(Cat(iss_b | iss_done, iss_b & iss_done))
        isf = Signal(STREAM_FIELDS)
        m.d.comb += isf.eq(Mux(iss_b, b_sf, sf))
        wr_pending = Signal(16)                        # writes issued and not acknowledged
        pop = Signal()
        n_val, outer_val = sf.n, sf.outer
        d_mode = sf.d_mode

        d_queue = d_mode == DMode.QUEUE.value
        a_queue = pops_queue(sf)
        data_go = Signal()                             # a QUEUE result leaves the write queue
        wreq = Signal(self.mu_req.payload.shape())
        wq_head = wq_layout(wq.r_data)
        request(m, wreq, p, x=self.x, y=self.y,
                op=Mux(d_mode == DMode.WRITE.value, MUOp.WRITE, MUOp.APPEND),
                tag=TAG_WRITE, ref=sf.d_ref, index=wq_head.index, data=wq_head.data)
        rreq = Signal(self.mu_req.payload.shape())
        request(m, rreq, p, x=self.x, y=self.y, op=MUOp.READ, tag=TAG_READ, ref=isf.a_ref,
                index=iss_idx)

        # A queued write goes first; a read only when no write waits. (A QUEUE stream's
        # results leave through ``msg_out``.)
        wq_mu = wq.r_rdy & ~d_queue
        m.d.comb += [
            self.mu_req.valid.eq(in_stream & Mux(wq_mu, wr_pending != (1 << 16) - 1,
                                              ~iss_done & (credits != cp.outstanding))),
            self.mu_req.payload.eq(Mux(wq_mu, wreq, rreq)),
        ]
        go = self.mu_req.valid & self.mu_req.ready
        wr_go = go & wq_mu
        rd_go = go & ~wq_mu
        # Results queued for an MU are dropped when no stream runs (after an error).
        m.d.comb += wq.r_en.eq(wr_go | data_go | ~in_stream)

        with m.If(rd_go):
            with m.If(iss_i + 1 == isf.n):
                m.d.sync += [iss_i.eq(0), iss_row.eq(iss_row + isf.a_ostride),
                             iss_idx.eq(iss_row + isf.a_ostride)]
                with m.If(iss_o + 1 == isf.outer):
                    m.d.sync += iss_done.eq(1)
                with m.Else():
                    m.d.sync += iss_o.eq(iss_o + 1)
            with m.Else():
                m.d.sync += [iss_i.eq(iss_i + 1), iss_idx.eq(iss_idx + isf.a_stride)]
        # Only a pop of a read response gives a read back: a stream reading the input queue
        # pops no response while the walker prefetches the next stream's reads.
        rpop = Signal()
        with m.If(rd_go & ~rpop):
            m.d.sync += credits.eq(credits + 1)
        with m.Elif(rpop & ~rd_go):
            m.d.sync += credits.eq(credits - 1)
        with m.If(rd_go & ~self.resp.valid):
            m.d.sync += inflight.eq(inflight + 1)
        with m.Elif(self.resp.valid & ~rd_go & (inflight != 0)):
            m.d.sync += inflight.eq(inflight - 1)

        # --- S0: pop a response, read operand B ---------------------------------------------
        # What a step carries down the pipeline besides its data: its number ``k`` over the
        # stream (ARGMAX), its destination word, whether it ends an inner loop (PACK_SUM) or
        # the stream, and the lane of ``V`` its inner loop fills (PACK_SUM).
        tag_layout = data.StructLayout({"k": 32, "didx": 32, "last_inner": 1, "last": 1,
                                        "lane": max(lbits, 1), "b_lane": max(lbits, 1),
                                        "first_outer": 1, "last_outer": 1})
        c_o, c_i, c_k = Signal(32), Signal(32), Signal(32)
        b_row, b_idx, d_idx = Signal(32), Signal(32), Signal(32)
        c_done = Signal()
        s1_valid, s2_valid = Signal(), Signal()
        s1, s2 = Signal(tag_layout), Signal(tag_layout)
        s1_a = Signal(32 * L)                       # operand A (the read response)
        s2_f = Signal(32 * L)                       # fn(a, b) in every lane

        # A refused read halts the stream in order: the steps before it complete (their
        # writes are acknowledged), then ``error`` rises.
        fault = Signal()
        head_bad = ~a_queue & rfifo.r_data[32 * L]
        # Room in the write queue for every result still in the pipeline and this one.
        wq_room = wq.level + s1_valid + s2_valid <= WQ_DEPTH
        # Step k reads B in S0 while step k - 1, in S1, has not written its result yet (it
        # writes in S2; the read port is transparent to that write one cycle later): when
        # step k - 1 writes the word B reads, step k waits a cycle. (The LOCAL_ACC
        # destination is read in S1, where the transparency covers step k - 1's write.)
        local_dest = d_mode.matches(*D_LOCAL_WRITES)
        # B's word: ``b_idx`` counts words, or elements for ELEM (a lane of a word).
        b_elem = sf.b_mode == BMode.ELEM.value
        b_addr = Signal(max(wbits, 1))
        m.d.comb += b_addr.eq(Mux(b_elem, b_idx[lbits:lbits + wbits], b_idx[:wbits])
                              if wbits else 0)
        b_hazard = (s1_valid & local_dest & sf.b_mode.matches(*B_LOCAL_MODES)
                    & (s1.didx[:wbits] == b_addr[:wbits]))
        src_rdy = Mux(a_queue, qfifo.r_rdy, rfifo.r_rdy)
        can_pop = in_stream & ~c_done & ~fault & src_rdy & wq_room & ~b_hazard
        with m.If(can_pop & head_bad):
            m.d.sync += fault.eq(1)
        m.d.comb += self.error.eq(in_stream & fault & ~s1_valid & ~s2_valid & (wq.level == 0)
                                  & (wr_pending == 0))
        m.d.comb += [
            pop.eq(can_pop & ~head_bad),
            rpop.eq(pop & ~a_queue),
            self.step.eq(pop),
            # stale responses are dropped between streams; the input queue keeps its words
            rfifo.r_en.eq(rpop | ~in_stream),
            qfifo.r_en.eq(pop & a_queue),
            loc_b.addr.eq(b_addr[:wbits]), loc_b.en.eq(pop),
            self.count.eq(c_k),
        ]
        last_inner = c_i + 1 == n_val
        # A word marked last ends a stream reading the queue: its step ends the inner and the
        # outer loop.
        eos = a_queue & qfifo.r_data[32 * L]
        m.d.sync += [s1_valid.eq(pop), s2_valid.eq(s1_valid & in_stream)]
        with m.If(pop):
            m.d.sync += [
                s1_a.eq(Mux(a_queue, qfifo.r_data[:32 * L], rfifo.r_data[:32 * L])),
                s1.k.eq(c_k), s1.didx.eq(d_idx), s1.last_inner.eq(last_inner | eos),
                s1.last.eq((last_inner & (c_o + 1 == outer_val)) | eos),
                s1.lane.eq(c_o[:max(lbits, 1)] if lbits else 0),
                s1.b_lane.eq(b_idx[:lbits] if lbits else 0), s1.first_outer.eq(c_o == 0),
                s1.last_outer.eq(c_o + 1 == outer_val),
                c_k.eq(c_k + 1), d_idx.eq(d_idx + sf.d_stride),
            ]
            with m.If(last_inner):
                m.d.sync += [c_i.eq(0), b_row.eq(b_row + sf.b_ostride),
                             b_idx.eq(b_row + sf.b_ostride)]
                with m.If(d_mode == DMode.OUTER_SUM.value):
                    # Each outer iteration adds into the same words.
                    m.d.sync += d_idx.eq(sf.d_base)
                with m.If(c_o + 1 == outer_val):
                    m.d.sync += c_done.eq(1)
                with m.Else():
                    m.d.sync += c_o.eq(c_o + 1)
            with m.Else():
                m.d.sync += [c_i.eq(c_i + 1), b_idx.eq(b_idx + sf.b_stride)]
            with m.If(eos):
                m.d.sync += c_done.eq(1)

        # --- S1: fn(a, b) in every lane; read the LOCAL_ACC destination -----------------------
        b_mode = sf.b_mode
        b_word = Signal(32 * L)
        b_elem_word = Cat([lane(loc_b.data, s1.b_lane, L)] * L)
        with m.Switch(b_mode):
            with m.Case(BMode.LOCAL.value):
                m.d.comb += b_word.eq(loc_b.data)
            with m.Case(BMode.SCALAR.value):
                m.d.comb += b_word.eq(Cat([sf.b_val] * L))
            with m.Case(BMode.ELEM.value):
                m.d.comb += b_word.eq(b_elem_word)
        f_lanes = [alu(m, fn, s1_a.word_select(i, 32), b_word.word_select(i, 32),
                       f"lane{i}_alu") for i in range(L)]
        with m.If(s1_valid):
            m.d.sync += [s2_f.eq(Cat(f_lanes)), s2.eq(s1)]
        m.d.comb += [loc_d.addr.eq(s1.didx[:wbits]), loc_d.en.eq(s1_valid)]

        # --- S2: shift, ReLU, saturation and deliver ---------------------------------------------
        # PACK_SUM applies SHIFT and POST to each inner loop's sum, not to each step: its sum
        # adds the lanes of fn(a, b) (a tree of its own, so that the output stage of a step
        # and that of a sum are never in one path).
        def output_stage(v, name):
            """``v >> SHIFT``, then ReLU and saturation to int8 as POST says (isa.post)."""
            sh = Signal(32, name=f"{name}_shifted")
            m.d.comb += sh.eq(v.as_signed() >> sf.shift[:5])
            rl = Signal(32, name=f"{name}_relu")
            m.d.comb += rl.eq(Mux(sf.post[Post.RELU.bit_length() - 1] & sh[31], 0, sh))
            r = Signal(32, name=f"{name}_result")
            sat = sf.post[Post.SAT8.bit_length() - 1]
            with m.If(sat & (rl.as_signed() > SAT8_MAX)):
                m.d.comb += r.eq(SAT8_MAX)
            with m.Elif(sat & (rl.as_signed() < SAT8_MIN)):
                m.d.comb += r.eq(SAT8_MIN)
            with m.Else():
                m.d.comb += r.eq(rl)
            return r

        f_words = [s2_f.word_select(i, 32) for i in range(L)]
        r_lanes = [output_stage(f, f"lane{i}") for i, f in enumerate(f_words)]
        # OUTER_SUM: the sum over the outer loop so far (the first outer iteration starts it),
        # through output stages of their own in the last outer iteration (so that no path
        # holds this sum's adder and LOCAL_ACC's after one output stage).
        outer_sum = d_mode == DMode.OUTER_SUM.value
        sums = [Mux(s2.first_outer, f, (f + loc_d.data.word_select(i, 32))[:32])
                for i, f in enumerate(f_words)]
        sum_word = Cat(output_stage(v, f"outer{i}") for i, v in enumerate(sums))
        r_word = Cat(r_lanes)

        # Reductions over the lanes of one result: the sum, and the largest (first on ties).
        lane_sum = Signal(32)
        m.d.comb += lane_sum.eq(sum(r_lanes[1:], r_lanes[0]))
        f_sum = Signal(32)
        m.d.comb += f_sum.eq(sum(f_words[1:], f_words[0]))
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
        m.d.comb += [self.acc.eq(red_acc), self.index.eq(red_idx)]
        total = Signal(32)                  # PACK_SUM: the inner loop's sum so far
        m.d.comb += total.eq(pack_acc + f_sum)
        sum_out = output_stage(total, "sum")
        s2_go = s2_valid & in_stream
        stream_local_we = s2_go & local_dest & ~(outer_sum & s2.last_outer)
        with m.If(s2_go):
            with m.Switch(d_mode):
                with m.Case(DMode.WRITE.value, DMode.APPEND.value):
                    m.d.comb += [wq.w_en.eq(1),
                                 wq.w_data.eq(Cat(r_word, s2.didx[:mp.index_bits]))]
                with m.Case(DMode.QUEUE.value):
                    m.d.comb += [wq.w_en.eq(1),
                                 wq.w_data.eq(Cat(r_word, Const(0, mp.index_bits), s2.last))]
                with m.Case(DMode.LOCAL.value, DMode.LOCAL_ACC.value):
                    acc_word = Cat((r + loc_d.data.word_select(i, 32))[:32]
                                   for i, r in enumerate(r_lanes))
                    m.d.comb += [
                        loc_w.addr.eq(s2.didx[:wbits]), loc_w.en.eq((1 << L) - 1),
                        loc_w.data.eq(Mux(d_mode == DMode.LOCAL.value, r_word, acc_word)),
                    ]
                with m.Case(DMode.OUTER_SUM.value):
                    with m.If(s2.last_outer):
                        m.d.comb += [wq.w_en.eq(1), wq.w_data.eq(sum_word)]
                    with m.Else():
                        m.d.comb += [loc_w.addr.eq(s2.didx[:wbits]),
                                     loc_w.en.eq((1 << L) - 1), loc_w.data.eq(Cat(sums))]
                with m.Case(DMode.SUM.value):
                    m.d.sync += red_acc.eq(red_acc + lane_sum)
                with m.Case(DMode.MAX.value, DMode.ARGMAX.value):
                    with m.If(word_max.as_signed() > red_acc.as_signed()):
                        m.d.sync += [red_acc.eq(word_max),
                                     red_idx.eq(Cat(word_max_lane[:lbits], s2.k))]
                with m.Case(DMode.PACK_SUM.value):
                    with m.If(s2.last_inner):
                        v_new = Signal(32 * L)
                        m.d.comb += v_new.eq(self.v)
                        if L == 1:
                            m.d.comb += v_new.eq(sum_out)
                        else:
                            m.d.comb += v_new.word_select(s2.lane[:lbits], 32).eq(sum_out)
                        m.d.sync += pack_acc.eq(0)
                        m.d.comb += self.v_we.eq(1)
                        with m.If((s2.lane == L - 1) | s2.last):
                            m.d.comb += [wq.w_en.eq(1), wq.w_data.eq(v_new)]
                            m.d.comb += self.v_next.eq(0)
                        with m.Else():
                            m.d.comb += self.v_next.eq(v_new)
                    with m.Else():
                        m.d.sync += pack_acc.eq(total)

        # --- The slots ----------------------------------------------------------------------
        a_done = self.done
        take_a = self.start & (~a_valid | (a_done & ~b_valid))   # a new stream executes next
        take_b = self.start & ~take_a                            # it waits behind A
        promote = a_done & b_valid                               # B executes next
        new_a = Signal(STREAM_FIELDS)                            # what executes next
        m.d.comb += new_a.eq(Mux(promote, b_sf, self.fields))

        def begin_issue(f, for_b):
            # (A stream reading the input queue issues no reads.)
            m.d.sync += [iss_o.eq(0), iss_i.eq(0), iss_row.eq(f.a_base), iss_idx.eq(f.a_base),
                         iss_done.eq(pops_queue(f)), iss_b.eq(for_b)]

        a_writes_mu = sf.d_mode.matches(*D_MU_MODES)
        b_early = (b_valid & ~iss_b & iss_done & ~promote
                   & ~(a_writes_mu & (sf.d_ref[:refw] == b_sf.a_ref[:refw]))
                   & ((sf.a_ref[:mp.mu_id_bits] == b_sf.a_ref[:mp.mu_id_bits])
                      | (inflight == 0)))
        with m.If(b_early):
            begin_issue(b_sf, 1)
        with m.If(take_b):
            m.d.sync += [b_valid.eq(1), b_sf.eq(self.fields), b_fn.eq(self.fn)]
        with m.If(take_a | promote):
            # Reset the execution (and V for PACK_SUM); start issuing unless B's reads are
            # already out.
            is_max = new_a.d_mode.matches(DMode.MAX.value, DMode.ARGMAX.value)
            m.d.sync += [
                a_valid.eq(1), sf.eq(new_a), fn.eq(Mux(promote, b_fn, self.fn)),
                fault.eq(0), c_o.eq(0), c_i.eq(0), c_k.eq(0), c_done.eq(0),
                b_row.eq(new_a.b_val), b_idx.eq(new_a.b_val), d_idx.eq(new_a.d_base),
                red_acc.eq(Mux(is_max, 1 << 31, 0)), red_idx.eq(0), pack_acc.eq(0),
            ]
            with m.If(promote):
                m.d.sync += b_valid.eq(0)
            with m.If(promote & iss_b):
                m.d.sync += iss_b.eq(0)
            with m.Else():
                begin_issue(new_a, 0)
            with m.If(new_a.d_mode == DMode.PACK_SUM.value):
                m.d.comb += [self.v_we.eq(1), self.v_next.eq(0)]
        with m.Elif(a_done):
            m.d.sync += a_valid.eq(0)
        with m.If(~running):
            # The CU stopped (an error): drop both streams.
            m.d.sync += [a_valid.eq(0), b_valid.eq(0), iss_done.eq(1), iss_b.eq(0),
                         credits.eq(0), inflight.eq(0), s1_valid.eq(0), s2_valid.eq(0)]

        # --- Streams between CUs: words out, credits in and back ------------------------------
        # One message register: the credits this CU owes go first, then a QUEUE stream's next
        # result while the engine holds a credit for it.
        eo_valid = Signal()
        eo = Signal(self.msg_out.payload.shape())
        m.d.comb += [self.msg_out.valid.eq(eo_valid), self.msg_out.payload.eq(eo)]
        eo_free = ~eo_valid | self.msg_out.ready
        m.submodules.credits = credits_held = CreditCounter(Q)   # as a producer
        m.submodules.owed = owed = CreditReturn(Q)               # as a consumer
        send_credit = owed.send
        m.d.comb += [
            owed.pop.eq(pop & a_queue), owed.free.eq(running & eo_free),
            owed.clear.eq(self.clear),
            data_go.eq(in_stream & d_queue & wq.r_rdy & (credits_held.credits != 0) & eo_free
                       & ~send_credit),
            credits_held.spend.eq(data_go), credits_held.clear.eq(self.clear),
            credits_held.back.eq(self.credit_in & running),
            credits_held.back_count.eq(self.credit_count),
        ]

        # The ID credits go back to: this CU's coordinates, with the cluster of the CU the words
        # go to above them (a CU does not know its cluster; a stream stays in one cluster, and
        # programs name its CUs with it, docs/clusters.md).
        src_id = Signal(mp.mu_id_bits)
        m.d.comb += [src_id.eq(sf.d_ref[:mp.mu_id_bits]), src_id[:2 * cb].eq(self.cu_id)]

        def load(dst, tag, word):
            m.d.sync += [
                eo_valid.eq(1), eo.dst.x.eq(dst[:cb]), eo.dst.y.eq(dst[cb:2 * cb]),
                eo.payload.kind.eq(MsgKind.STREAM), eo.payload.body.tag.eq(tag),
                eo.payload.body.data.eq(word), eo.payload.body.ref.eq(src_id),
                eo.payload.body.dst.as_value().eq(dst[:mp.mu_id_bits]),
            ]

        with m.If(send_credit):
            load(q_src, STREAM_CREDIT, owed.count)
        with m.Elif(data_go):
            load(sf.d_ref, Mux(wq_head.last, STREAM_LAST, 0), wq_head.data)
        with m.Elif(self.msg_out.ready):
            m.d.sync += eo_valid.eq(0)
        m.d.comb += self.q_error.eq((q_arrive & q_full) | credits_held.over)

        # Every step ran and every write was issued (a QUEUE stream's last word has left the
        # message register); the acknowledgements are counted on across streams (posted
        # writes) and fenced by the sequencer.
        m.d.comb += [self.done.eq(in_stream & c_done & ~s1_valid & ~s2_valid
                                  & (wq.level == 0) & ~(d_queue & eo_valid)),
                     self.writes_pending.eq(wr_pending != 0)]

        # Acknowledgements of the writes.
        # The sequencer's posted requests are counted too (they never share a cycle with a
        # stream write: the CU's request register takes one request a cycle).
        issued = wr_go | self.posted
        with m.If(issued & ~self.ack):
            m.d.sync += wr_pending.eq(wr_pending + 1)
        with m.Elif(self.ack & ~issued & (wr_pending != 0)):
            m.d.sync += wr_pending.eq(wr_pending - 1)

        with m.If(self.clear):
            m.d.sync += [wr_pending.eq(0), credits.eq(0), inflight.eq(0)]

        # --- Configuration space: the local buffer --------------------------------------------
        cfg = self.cfg
        cfg_we = cfg.sel & cfg.we
        cfg_re = cfg.sel & cfg.re
        addr = cfg.addr
        loc_off = addr - CU_MAP.LOCAL
        at_local = (addr >= CU_MAP.LOCAL) & (loc_off < cp.local_words * L)
        loc_word = loc_off[lbits:lbits + wbits] if wbits else Const(0, 0)
        loc_lane = loc_off[:lbits] if lbits else Const(0, 1)
        m.d.comb += [loc_c.addr.eq(loc_word), loc_c.en.eq(cfg_re & at_local)]
        seq_local_we = self.l_we & ~stream_local_we
        with m.If(seq_local_we):
            m.d.comb += [loc_w.addr.eq(l_word), loc_w.data.eq(Cat([self.l_wdata] * L)),
                         loc_w.en.eq(Const(1, L) << l_lane)]
        with m.Elif(cfg_we & at_local & ~stream_local_we):
            m.d.comb += [loc_w.addr.eq(loc_word), loc_w.data.eq(Cat([cfg.wdata] * L)),
                         loc_w.en.eq(Const(1, L) << loc_lane)]
        r_local = Signal()
        r_lane = Signal(max(lbits, 1))
        with m.If(cfg_re):
            m.d.sync += [r_local.eq(at_local), r_lane.eq(loc_lane)]
        m.d.comb += cfg.rdata.eq(Mux(r_local, lane(loc_c.data, r_lane, L), 0))
        return m
