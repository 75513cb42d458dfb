"""The compute unit (CU): a control sequencer and a SIMD streaming datapath.

See ``docs/compute-unit.md`` for the specification (ports, messages, instructions, streams,
configuration); :mod:`rdakit.hdl.spec.isa` defines the instruction set and
:mod:`rdakit.sim.models.interp` is the functional model. This module assembles the two parts and
holds what they share: the request register (a blocking request has priority over the stream's;
in practice they never compete), the routing of incoming messages, the performance counters and
the configuration space (each part answers its own addresses).

Structure
---------
Sequencer (:class:`rdakit.hdl.compute.sequencer.Sequencer`)
    The program memory has a synchronous read port: while instruction ``pc`` executes, the
    address of the next one (``pc + 1`` or a branch target, computed from the register file in
    the same cycle) is presented, so every non-blocking instruction, taken branches included,
    takes one cycle. A blocking MU instruction loads its request into the request register (one
    cycle) and waits for the response (tag 0), which is captured in a register and retired the
    cycle after it arrives. ``WAIT``/``RECV`` retire in the cycle the tokens or the reference are
    there; ``SEND``/``SENDREF`` retire when the message register is free.
Stream engine (:class:`rdakit.hdl.compute.stream.StreamEngine`)
    Two stream slots: the executing stream and one waiting behind it, which SRUN fills while the
    other runs. An issue stage walks ``(o, i)`` and loads a READ (tag 1) into the request
    register each cycle while fewer than ``outstanding`` reads are unconsumed (issued and not
    yet popped); once the executing stream's reads are out it walks the waiting stream's (a
    prefetch) if the waiting stream does not read the buffer the executing one writes and its
    responses cannot overtake the executing one's (same MU, or none of its reads unanswered). Read
    responses go into a response FIFO of ``outstanding + 1`` entries (``amaranth.lib.fifo``), so a
    response is always accepted. The execute pipeline has three stages: S0 pops the head of the
    FIFO and reads operand B from the local buffer; S1 computes ``fn(a, b)`` in every lane and
    reads the LOCAL_ACC or OUTER_SUM destination; S2 computes ``post(f >> SHIFT)`` and delivers
    it (local buffer write, reduction, ``V`` for PACK_SUM, or a write queue for MU writes and
    appends).
    The local buffer read ports are transparent to its write port and a step whose B is the word
    the step just ahead of it writes waits a cycle in S0, so every step sees the writes of the
    steps before it (the sequential semantics of the spec hold whatever the strides). MU writes
    and appends (tag 2) leave from the write queue with priority over reads, so a step that
    writes takes two request cycles; the
    stream is done when every step has been executed and every write issued. Writes are posted: the
    engine counts their acknowledgements across streams, and the instructions another CU or the
    host could observe (SEND, SENDREF, HALT, FADD, UNLOCK: ``sequencer.FENCED``) wait until
    every one is back. RET, RETI, DECREF and VWRITE are posted too (``sequencer.POSTED``). The
    CU's other requests reach an MU over the same path as its writes and are served in order
    after them.
Timing (measured with an MU attached directly, its latency 2 cycles)
    1 cycle for every non-blocking instruction, taken branches included; 5 cycles for a blocking
    MU instruction (load the request register, the MU's 2 cycles, capture, retire); 1 for a
    posted one (RET, RETI, DECREF, VWRITE) and for ALLOC, READ and LEN while the request
    register is free, whose result reaches ``rd`` 5 (ALLOC 6) cycles after they were issued
    (``sequencer.NONBLOCKING``).
    SRUN itself takes 1 cycle: the stream runs beside the instructions after it, and takes
    ``N*OUTER + 8`` cycles when its results stay in the CU (one step a cycle once the first
    response is back; this needs ``outstanding`` >= 6, the round trip in reads; a step whose B
    is the word the step before it writes adds a cycle) and about ``2*N*OUTER + 6`` when every
    result is written to an MU (two requests a step; 32 more steps cost 68 cycles); the last
    acknowledgement's round trip (3 cycles here) overlaps what follows too (posted writes; a
    fence or HALT waits for it); PACK_SUM adds one cycle an append. A stream handed over while
    another runs starts its steps the cycle after that one is done when its reads could be
    prefetched. An instruction waits for a stream the engine holds when the stream touches what
    it names (``sequencer.STREAM_HAZARDS``), an SRUN while a stream already waits in the
    engine, one naming a register of a stream's reduction for that stream, and one that fails
    for the engine to be idle.

Readings of the spec (where it leaves a choice)
-----------------------------------------------
* ``done`` is 1 whenever the CU is not running: after reset, after HALT or an error, and when
  disabled. It falls the cycle after ``start``.
* A register field selects ``r[field mod regs]``; the lane of ``READ``/``VSET`` is
  ``fn mod lanes``. ``SEND``/``WAIT`` with ``aux >= channels`` and ``SENDREF``/``RECV`` with
  ``aux >= mailbox`` halt with BAD_INSTRUCTION. An incoming token or reference for a channel or
  slot that does not exist is dropped.
* STATUS ``pc`` is the pc of the instruction that halted (HALT, or the instruction that failed,
  the SRUN of a stream whose read was refused, or the one executing when a message error
  arrived); for PC_OUT_OF_RANGE it is the pc that left
  the program memory (its low 16 bits). Program words never written read as 0 (NOP).
* ``SHIFT`` is taken modulo 32, like the ALU's shifts; ``POST`` bit 0 selects ReLU, the other
  bits are ignored.
* A ``B_MODE`` that is not a ``BMode`` or a ``D_MODE`` that is not a ``DMode`` (above 3 and
  above 10) is BAD_STREAM, like ``N = 0`` or ``OUTER = 0``.
* PACK_SUM clears ``V`` when the stream starts and after every append, so the unused lanes of the
  last, partial word are 0 and ``V`` is 0 when the stream is done. SRUN leaves ``rd`` unchanged for
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
  in order: the steps before it complete, their writes acknowledged, then the CU halts with
  STATUS pc at the SRUN (as the interpreter does; the instructions after SRUN that did not wait
  for the stream have run).
* Streams between CUs (``DMode.QUEUE``, an ``A_REF`` naming this CU): STREAM messages are
  taken from ``msg_in`` by the stream engine (a word into the input queue, credits into the
  credit counter), and the engine's message register (credits first, then words) shares
  ``msg_out`` with the sequencer's, the sequencer first unless the engine's flit waits from
  the cycle before. A word at a full queue, or credits past ``queue_words``, halt the CU with
  QUEUE_OVERFLOW (dropped). ``start`` empties the queue and resets the credits. A QUEUE stream
  is done once its last word has left the engine's message register.
* HALT retires once the message register is empty and every posted write is acknowledged, so
  a CU that reports done has handed every token and reference to the network and its writes
  have landed. A refused posted write halts the CU when its acknowledgement arrives, at
  whatever pc it has reached (compare only the code).
* A read of ``REGS + r`` returns the current value of ``r`` (the initial value until start, the
  final value after a run); a write sets the initial value and, while the CU is not running, the
  register itself. Local-buffer writes over the bus are ignored in a cycle when a stream writes
  the local buffer. Start the CU only when the network holds no response to it.
"""

from amaranth.hdl import Const, Module, Mux, Signal
from amaranth.lib import stream, wiring
from amaranth.lib.wiring import In, Out

from rdakit.hdl.compute.common import TAG_BLOCKING, TAG_READ, TAG_WRITE, bind_cu_tile
from rdakit.hdl.compute.sequencer import Sequencer
from rdakit.hdl.compute.stream import StreamEngine
from rdakit.hdl.spec.config import CU_PROFILE, TILE_COUNTERS, config_bus_signature
from rdakit.hdl.spec.flit import flit_layout
from rdakit.hdl.spec.packets import (
    STREAM_CREDIT,
    STREAM_LAST,
    MsgKind,
    MUStatus,
    msg_layout,
    mu_request_layout,
)

__all__ = ["ComputeUnit", "COUNTER_WIDTH", "TAG_BLOCKING", "TAG_READ", "TAG_WRITE"]

#: Width of the performance counters.
COUNTER_WIDTH = 32


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
        Configuration space (``CU_MAP``, ``TILE_COUNTERS`` and ``CU_PROFILE``); ``rdata`` the
        cycle after ``re``.
    start : In(1)
        One-cycle pulse: load the initial registers, clear tokens, mailbox, ``V`` and the stream
        fields (``OUTER`` = 1), the counters and the status, and run from pc 0 if enabled.
    done, error : Out(1)
        Not running (halted, failed or disabled); halted on an error (code in STATUS).
    busy_cycles, stall_cycles, flits_out, flits_in : Out(32)
        Cycles running; running cycles in which no instruction retired and no stream step was
        executed; flits sent on ``req`` and ``msg_out``; flits received. Reset by ``start``.
    step_cycles, wait_cycles, fence_cycles, mu_cycles, stream_idle_cycles, instr_cycles : Out(32)
        The profile (:data:`~rdakit.hdl.spec.config.CU_PROFILE`): each running cycle in the
        first of these categories that applies; ``busy_cycles`` minus their sum is the rest
        (a full message or request register). Reset by ``start``.

    Raises
    ------
    TypeError
        If ``fabric_params`` is not a :class:`FabricParams` or ``x``, ``y`` are not coordinates
        of the grid.
    ValueError
        If the tile at ``(x, y)`` is not a CU.
    """

    def __init__(self, fabric_params, *, x, y):
        p = bind_cu_tile(self, fabric_params, x, y)
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
            **{name: Out(COUNTER_WIDTH) for name in CU_PROFILE},
        })
        #: The staging vector ``V`` (not a port; for testbenches).
        self.v = Signal(p.cu.data_bits, name="v")

    def elaborate(self, platform):
        m = Module()
        m.submodules.sequencer = seq = Sequencer(self.fabric_params, x=self.x, y=self.y)
        m.submodules.stream = eng = StreamEngine(self.fabric_params, x=self.x, y=self.y)
        running = ~seq.done
        m.d.comb += [
            self.done.eq(seq.done), self.error.eq(seq.error), self.v.eq(seq.v),
            seq.start.eq(self.start), eng.clear.eq(self.start),
            eng.fields.eq(seq.fields), eng.fn.eq(seq.fn), eng.v.eq(seq.v),
            eng.start.eq(seq.stream_start), eng.active.eq(seq.stream_active),
            seq.stream_done.eq(eng.done), seq.stream_error.eq(eng.error),
            seq.stream_busy.eq(eng.busy), seq.stream_queued.eq(eng.queued),
            seq.reads_issued.eq(eng.reads_issued),
            seq.writes_pending.eq(eng.writes_pending), eng.posted.eq(seq.posted),
            seq.stream_acc.eq(eng.acc), seq.stream_index.eq(eng.index),
            seq.stream_count.eq(eng.count), seq.queue_error.eq(eng.q_error),
            seq.v_we.eq(eng.v_we), seq.v_next.eq(eng.v_next),
            eng.l_addr.eq(seq.l_addr), eng.l_re.eq(seq.l_re), seq.l_rdata.eq(eng.l_rdata),
            eng.l_we.eq(seq.l_we), eng.l_wdata.eq(seq.l_wdata),
        ]
        # The message port: the sequencer's register (SEND, SENDREF) and the stream engine's
        # (a QUEUE stream's words, credits returned) share it. The sequencer goes first, unless
        # the engine's flit was offered and not taken in the cycle before (an offer is held
        # until taken).
        eng_held = Signal()
        eng_sel = Signal()
        m.d.comb += [
            eng_sel.eq(eng_held | (eng.msg_out.valid & ~seq.msg_out.valid)),
            self.msg_out.valid.eq(seq.msg_out.valid | eng.msg_out.valid),
            self.msg_out.payload.eq(Mux(eng_sel, eng.msg_out.payload, seq.msg_out.payload)),
            seq.msg_out.ready.eq(self.msg_out.ready & ~eng_sel),
            eng.msg_out.ready.eq(self.msg_out.ready & eng_sel),
        ]
        m.d.sync += eng_held.eq(eng_sel & eng.msg_out.valid & ~self.msg_out.ready)

        # The request register: valid never depends on ready. The sequencer's request wins: it
        # may be offered while a stream runs (when the stream touches nothing it names,
        # ``sequencer.STREAM_HAZARDS``), and the engine's waits a cycle.
        req_flit = self.req.payload.shape()
        rq_valid = Signal()
        rq = Signal(req_flit)
        rq_free = ~rq_valid | self.req.ready
        m.d.comb += [self.req.valid.eq(rq_valid), self.req.payload.eq(rq),
                     seq.mu_req.ready.eq(rq_free),
                     eng.mu_req.ready.eq(rq_free & ~seq.mu_req.valid)]
        with m.If(seq.mu_req.valid & rq_free):
            m.d.sync += [rq_valid.eq(1), rq.eq(seq.mu_req.payload)]
        with m.Elif(eng.mu_req.valid & rq_free):
            m.d.sync += [rq_valid.eq(1), rq.eq(eng.mu_req.payload)]
        with m.Elif(self.req.ready):
            m.d.sync += rq_valid.eq(0)

        # Incoming messages: the sequencer sees them all; read responses (tag 1) and write
        # acknowledgements (tag 2) also go to the stream engine.
        wiring.connect(m, wiring.flipped(self.msg_in), seq.msg_in)
        body = self.msg_in.payload.payload.body
        is_resp = self.msg_in.valid & (self.msg_in.payload.payload.kind == MsgKind.RESPONSE)
        m.d.comb += [
            eng.resp.valid.eq(is_resp & (body.tag == TAG_READ)),
            eng.resp.payload.data.eq(body.data),
            eng.resp.payload.refused.eq(body.status != MUStatus.OK),
            eng.ack.eq(is_resp & (body.tag == TAG_WRITE)),
        ]
        # STREAM messages: a word for the input queue, or credits for this CU's QUEUE streams.
        is_stream = self.msg_in.valid & (self.msg_in.payload.payload.kind == MsgKind.STREAM)
        credit = (body.tag & STREAM_CREDIT) != 0
        m.d.comb += [
            eng.q_in.valid.eq(is_stream & ~credit),
            eng.q_in.payload.data.eq(body.data),
            eng.q_in.payload.last.eq((body.tag & STREAM_LAST) != 0),
            eng.q_in.payload.src.eq(body.ref.mu),
            eng.credit_in.eq(is_stream & credit),
            eng.credit_count.eq(body.data[:32]),
        ]

        # --- Counters -----------------------------------------------------------------------
        sent = ((self.req.valid & self.req.ready).as_unsigned()
                + (self.msg_out.valid & self.msg_out.ready))
        m.d.sync += [
            self.busy_cycles.eq(self.busy_cycles + running),
            self.stall_cycles.eq(self.stall_cycles + (running & ~seq.retire & ~eng.step)),
            self.flits_out.eq(self.flits_out + sent),
            self.flits_in.eq(self.flits_in + self.msg_in.valid),
        ]
        # The profile (CU_PROFILE): each running cycle in the first category that applies.
        category = {
            "step_cycles": eng.step,
            "wait_cycles": seq.waiting,
            "fence_cycles": seq.fenced,
            "mu_cycles": seq.mu_waiting,
            "stream_idle_cycles": seq.stream_wait,
            "instr_cycles": seq.retire,
        }
        assert list(category) == list(CU_PROFILE)
        taken = Const(0)
        for name, cond in category.items():
            counter = getattr(self, name)
            m.d.sync += counter.eq(counter + (running & cond & ~taken))
            taken = taken | cond
        with m.If(self.start):
            m.d.sync += [
                self.busy_cycles.eq(0), self.stall_cycles.eq(0), self.flits_out.eq(0),
                self.flits_in.eq(0), *(getattr(self, n).eq(0) for n in CU_PROFILE),
            ]

        # --- Configuration space: each part answers its addresses, 0 for the others ----------
        cfg = self.cfg
        for part in (seq.cfg, eng.cfg):
            m.d.comb += [part.sel.eq(cfg.sel), part.we.eq(cfg.we), part.re.eq(cfg.re),
                         part.addr.eq(cfg.addr), part.wdata.eq(cfg.wdata)]
        count = Signal(32)
        with m.Switch(cfg.addr):
            for name, where in {**TILE_COUNTERS, **CU_PROFILE}.items():
                with m.Case(where):
                    m.d.comb += count.eq(getattr(self, name))
        r_count = Signal(32)
        with m.If(cfg.sel & cfg.re):
            m.d.sync += r_count.eq(count)
        m.d.comb += cfg.rdata.eq(seq.cfg.rdata | eng.cfg.rdata | r_count)
        return m
