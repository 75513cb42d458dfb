"""The fast performance model (``rdakit run --sim model``): the interpreter's CU and MU
semantics with the RTL's timing, event by event.

:class:`PerfInterpreter` is the functional interpreter (:mod:`rdakit.sim.models.interp`: the
same CU programs, the same :class:`~rdakit.sim.models.mu.MUModel`), driven not round-robin
but in the order of simulated time: a heap of timestamped events (a CU ready to execute its
next instruction, a token or reference arriving) is processed in time order, and each
instruction's functional effect happens in the cycle the RTL executes it, so results are the
interpreter's. Around it sits a timing model of

* the **sequencer**: one instruction a cycle; what an instruction waits for, and in which
  profile category (``CU_PROFILE``, in the hardware's order of priority) the cycles count:
  the stream engine (``AFTER_STREAM``, a second queued SRUN, a reduction's register), a
  non-blocking ALLOC/READ/LEN's response (one at a time, its register), the fences on posted
  writes, WAIT/RECV, a blocking MU instruction's round trip, LGET's second cycle;
* the **stream engine**, cycle by cycle per stream: the two slots (the next stream handed over
  while one executes, its reads prefetched under the RTL's conditions), reads issued while
  fewer than ``outstanding`` are unconsumed, the response FIFO, the execute pipeline, the write
  queue with priority over reads and its depth, posted writes and their acknowledgements;
* the **MU**: one request accepted a cycle, each taking its execute cycles
  (``MUModel.exec_cycles``: 2 for ALLOC, a free's block walk, ...) before the next;
* the **NoC**: XY routes, a cycle a hop, every link and every ejection port one flit a cycle
  (a flit that finds its cycle taken waits for the next free one, in the order flits are
  sent).

:class:`ModelTransport` answers the host port's commands (``docs/fabric.md``) as the RTL's
host port does, so :class:`~rdakit.sim.runtime.host.HostDriver`, ``run_job`` and the whole
report path run on it unchanged; its counters are the RTL's (busy, stall, the profile,
flits, the MUs' occupancy). The constants are :data:`~rdakit.sim.models.timing.TIMING`.
What the model leaves out: ``docs/performance-model.md``.
"""

import bisect
import collections
import heapq
import math
import struct

from rdakit.hdl.spec.bitstream import BitstreamError, LoadStatus, read_bitstream
from rdakit.hdl.spec.config import (
    CU_MAP,
    CU_PROFILE,
    MU_MAP,
    STATUS_BITS,
    TILE_COUNTERS,
    cu_status_word,
)
from rdakit.hdl.spec.cu import (
    AFTER_STREAM,
    B_LOCAL_MODES,
    D_LOCAL_READS,
    D_LOCAL_WRITES,
    D_MU_MODES,
    FENCED,
    MU_INSTRUCTIONS,
    NONBLOCKING,
    POSTED,
    STREAM_HAZARDS,
    credit_batch,
)
from rdakit.hdl.spec.isa import DMode, Op, StreamField
from rdakit.hdl.spec.packets import (
    HostCmd,
    MUStatus,
    host_cmd_layout,
    host_reply_layout,
    host_tag_bit,
    pack,
    unpack,
)
from rdakit.sim.models.interp import Interpreter
from rdakit.sim.models.mu import MUModel
from rdakit.sim.models.noc import xy_path
from rdakit.sim.models.timing import TIMING, WQ_DEPTH

__all__ = ["PerfInterpreter", "ModelTransport", "Network", "PROFILE_NAMES"]

#: The profile categories the model counts, in the hardware's order of priority.
PROFILE_NAMES = tuple(CU_PROFILE)

_STEP, _WAIT, _FENCE, _MU, _IDLE, _INSTR, _OTHER = range(7)

_BLOCKING = frozenset(MU_INSTRUCTIONS) - frozenset(POSTED) - frozenset(NONBLOCKING)
_AFTER_STREAM = frozenset(AFTER_STREAM)
#: The instructions the MU applies in the order their requests arrive (the blocking ones:
#: the CU waits for their response, so nothing it does depends on when they are applied).
_DEFERRED = _BLOCKING
_FENCED = frozenset(FENCED)
_POSTED = frozenset(POSTED)
_NONBLOCKING = frozenset(NONBLOCKING)
_MU_OR_FENCE = frozenset(MU_INSTRUCTIONS) | _FENCED
_REDUCING = {DMode.SUM.value: 1, DMode.MAX.value: 1, DMode.ARGMAX.value: 2}
_D_MU = frozenset(D_MU_MODES)
_SF = StreamField
_MU_INSTR = frozenset(MU_INSTRUCTIONS)
#: What ends the look ahead of :meth:`PerfInterpreter._sequencer_requests`.
_NOT_STRAIGHT = frozenset((Op.JMP, Op.BNZ, Op.BZ, Op.BLT, Op.LOOP, Op.WAIT, Op.RECV, Op.SRUN,
                           *FENCED))
#: How many instructions after an SRUN it looks at.
_LOOKAHEAD = 8
_D_LOCAL = frozenset(D_LOCAL_WRITES)
_D_LOCAL_READS = frozenset(D_LOCAL_READS)
_B_LOCAL = frozenset(B_LOCAL_MODES)
#: What each instruction of AFTER_STREAM waits for (the sequencer's table).
_HAZARDS = {op: frozenset(touches) for op, touches in STREAM_HAZARDS.items()}


def pend_rd_named(ins, rd, rmask):
    """Whether ``ins`` names register ``rd`` (a non-blocking MU instruction's, not yet
    written)."""
    return rd in (ins.rd & rmask, (ins.rd + 1) & rmask, ins.ra & rmask, ins.rb & rmask)


def _clear_of(s, touches, ref, c):
    """The first cycle from ``c`` in which stream ``s`` no longer holds back an instruction
    that waits for ``touches`` (``STREAM_TOUCHES`` names, or ``"any"``) and names the
    reference ``ref``, as the sequencer's scoreboard decides: a stream that reads ``ref``
    holds it until its reads have all been issued (``reads_issued``), any other touch until
    the stream is done."""
    if s.done <= c:
        return c
    if ("any" in touches or ("d_ref" in touches and s.writes_mu and s.d_ref == ref)
            or ("local_r" in touches and s.local_r) or ("local_w" in touches and s.local_w)
            or ("v" in touches and s.v)):
        return s.done
    if "a_ref" in touches and s.a_ref == ref and s.last_issue >= c:
        return s.last_issue + 1
    return c


def _first_free(busy, c):
    while c in busy:
        c += 1
    busy.add(c)
    return c


class Network:
    """The two meshes and the MUs' request ports as reservations of cycles.

    Each link, each ejection port and each MU holds the set of cycles it is taken; a flit sent
    takes the first free cycle of each link of its XY route in turn, in the order flits are
    sent (:meth:`send`), and an MU request the first run of ``exec_cycles`` free cycles of its
    MU (:meth:`mu_accept`). Counts the flits each tile sent and received."""

    def __init__(self, timing=TIMING):
        self.timing = timing
        self._busy = {}
        self._routes = {}
        self.flits_out = {}
        self.flits_in = {}

    def _slots(self, key):
        s = self._busy.get(key)
        if s is None:
            s = self._busy[key] = set()
        return s

    def _route(self, net, src, dst):
        """``(offset, links, eject, port)`` of a flit from ``src`` to ``dst`` on ``net``: the
        cycles to its first link, the reservation set of each link of its XY route, the cycles
        from the last link to the destination's port, the port's set (responses) or None."""
        tm = self.timing
        offset = tm.inject + (tm.host_merge if net == "req" and src == (0, 0) else 0)
        links = [self._slots((net, hop)) for hop in list(xy_path(src, dst))[:-1]]
        port = self._slots(("eject", dst)) if net == "resp" else None
        r = self._routes[(net, src, dst)] = (offset, links, tm.eject, port)
        return r

    def send(self, net, src, dst, g):
        """A flit taken by ``src``'s output register in cycle ``g``: the cycle it is offered
        on ``dst``'s port (that port's cycle reserved), on network ``net`` (``"req"`` or
        ``"resp"``)."""
        offset, links, eject, port = (self._routes.get((net, src, dst))
                                      or self._route(net, src, dst))
        out, inn = self.flits_out, self.flits_in
        out[src] = out.get(src, 0) + 1
        inn[dst] = inn.get(dst, 0) + 1
        c = g + offset
        hop = self.timing.hop
        for busy in links:
            while c in busy:
                c += 1
            busy.add(c)
            c += hop
        c += eject
        if port is not None:
            while c in port:
                c += 1
            port.add(c)
        return c

    def mu_accept(self, mu, c, cycles):
        """The cycle the MU at ``mu`` accepts a request offered in cycle ``c`` that takes
        ``cycles`` execute cycles (those cycles reserved)."""
        busy = self._slots(("mu", mu))
        if cycles == 1:
            while c in busy:
                c += 1
            busy.add(c)
            return c
        while any(c + k in busy for k in range(cycles)):
            c += 1
        busy.update(range(c, c + cycles))
        return c

    def request(self, cu, mu, g, cycles):
        """A request of ``cu`` to ``mu`` taken by the CU's request register in cycle ``g``,
        taking ``cycles`` execute cycles: the cycle its response is on the CU's ``msg_in``."""
        a = self.mu_accept(mu, self.send("req", cu, mu, g), cycles)
        return self.send("resp", mu, cu, a + cycles - 1 + self.timing.mu_response)


class _Stream:
    """One stream's timing in the engine."""

    __slots__ = ("steps", "writes", "a_mu", "a_ref", "d_ref", "writes_mu", "reduces", "rd",
                 "count_reg", "local_r", "local_w", "v",
                 "pops", "issues", "resps", "write_cycles", "done", "last_ack", "last_issue",
                 "last_resp", "exec_start")


class _QueueStream:
    """A stream that reads the input queue or sends to another CU's (``DMode.QUEUE``), timed
    a step at a time as the interpreter runs it (its words and credits couple it to another
    CU's stream): the SRUN's cycle, the stream's timing so far and its :class:`_Stream`."""

    __slots__ = ("t", "s", "issue_start", "exec_start", "issues", "pops", "sends", "last_ack",
                 "cells")

    def __init__(self, t, s, issue_start, exec_start):
        self.t, self.s = t, s
        self.issue_start, self.exec_start = issue_start, exec_start
        self.issues, self.pops, self.sends = [], [], []
        self.last_ack = None


class _CU:
    """A CU's timing state."""

    def __init__(self, machine):
        self.m = machine
        self.t = 0                 # the cycle the sequencer may execute the current instruction
        self.streams = []          # the engine's streams not yet known to be done, oldest first
        self.last_done = -1        # the last stream's done cycle
        self.last_ack = -1         # the last posted write's acknowledgement
        self.pend_rd = None        # a non-blocking MU instruction's register...
        self.pend_ready = -1       # ...and the first cycle an instruction may use it
        self.msg_free = 0          # the message register is free from this cycle
        self.intervals = []        # (first, end, category) of the sequencer's cycles
        self.retires = []          # cycles in which an instruction retired
        self.instr = []            # retire cycles no other category counts
        self.pops = []             # cycles in which the engine executed a step
        self.halt_at = None
        self.sleeping = None       # (since, category) while blocked in WAIT/RECV
        self.deferred = None       # a blocking MU instruction's cycle, held back until its
        #                            request reaches the MU (then executed)
        self.qs = None             # a stream between CUs under way (_QueueStream)
        self.q_blocked = False     # ... waiting for a word or a credit


class PerfInterpreter(Interpreter):
    """The functional interpreter run in the order of simulated time, with the RTL's timing.

    Takes the arguments of :class:`~rdakit.sim.models.interp.Interpreter` and ``mus``, the
    :class:`~rdakit.sim.models.mu.MUModel` of each MU tile to use (the host's fabric keeps
    them from run to run), ``network`` (a :class:`Network`) and ``timing``.
    :meth:`run_timed` runs the job and returns the cycle the last CU halted (``None`` if some
    CU never does: a deadlock); :meth:`counters` gives each CU tile's counters."""

    def __init__(self, params, config, *, mus=None, network=None, timing=TIMING, **kw):
        super().__init__(params, config, **kw)
        if mus is not None:
            self._mus = mus
            self._mu_routes = {}
            self._mu_ops = {xy: self._mu_ops[xy].__class__() for xy in mus}
            self._mu_errors = dict.fromkeys(mus, 0)
        self.timing = timing
        self.net = network or Network(timing)
        self._log = []
        self._outbox = []
        self._heap = []
        self._seq = 0
        self._timed = {cu.xy: _CU(cu) for cu in self._order}
        self._outstanding = params.cu.outstanding
        # Streams between CUs: the arrival cycle (a cell) of every word in each CU's input
        # queue, and the cycles from which each CU's credits may be spent (a producer starts
        # with queue_words); what the current step popped and pushed.
        self._q_times = {cu.xy: collections.deque() for cu in self._order}
        self._credit_times = {cu.xy: collections.deque([0] * params.cu.queue_words)
                              for cu in self._order}
        self._step_pop = self._step_push = None
        # What each consumer owes: the cycles of its pops whose credits are not yet sent, the
        # producer they go to, its last pop (credits go back as the RTL batches them).
        self._owed = {cu.xy: [] for cu in self._order}
        self._owed_to = {}
        self._last_pop = {}
        self._batch = credit_batch(params.cu.queue_words)
        #: The cycle of the instruction being executed (its MU requests are made then; a
        #: stream's are all made in its SRUN's cycle): a clock for traces of MU occupancy.
        self.now = 0

    # --- hooks on the interpreter --------------------------------------------------------------

    def _request(self, cu, op, ref, *, index=0, data=0, tag=0):
        resp = super()._request(cu, op, ref, index=index, data=data, tag=tag)
        x, y = self.params.mu_coords(ref & self._mu_mask)
        self._log.append(((x, y), tag, self._mus[(x, y)].exec_cycles))
        return resp

    def _send(self, cu, pc, dst_id, kind, tag, ref, data):
        self._outbox.append((cu, pc, dst_id, kind, tag, ref, data))

    def _push_word(self, cu, dst, word, last):
        # The word's arrival cycle is known once its step is timed: a cell filled then.
        n = len(dst.queue)
        super()._push_word(cu, dst, word, last)
        if len(dst.queue) > n:
            cell = [0]
            self._q_times[dst.xy].append(cell)
            self._step_push = (cell, dst.xy)

    def _pop_word(self, cu, *args):
        src = cu.q_src
        out = super()._pop_word(cu, *args)
        self._step_pop = (self._q_times[cu.xy].popleft(), src.xy)
        return out

    # --- the event loop ------------------------------------------------------------------------

    def _push(self, t, kind, obj):
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, obj))

    def run_timed(self, until=None):
        """Run every enabled CU from cycle 0 to its halt; return the cycle the last one halted,
        or ``None`` if one never halts. With ``until``, stop as soon as a CU is still running
        past cycle ``until`` and return ``math.inf`` (a run known to take longer)."""
        start = self.timing.run_start
        for tc in self._timed.values():
            if not tc.m.halted:
                tc.t = start
                self._push(start, 1, tc)
        heap = self._heap
        while heap:
            t, kind, _, obj = heapq.heappop(heap)
            if until is not None and t > until and any(
                    tc.halt_at is None or tc.halt_at > until
                    for tc in self._timed.values() if tc.m.enabled):
                return math.inf
            if kind == 0:
                self._deliver(t, obj)
            else:
                self._advance(obj, t)
        ends = [tc.halt_at for tc in self._timed.values() if tc.m.enabled]
        if any(e is None for e in ends):
            return None
        return max(ends, default=start)

    def _deliver(self, t, msg):
        cu, pc, dst_id, kind, tag, ref, data = msg
        Interpreter._send(self, cu, pc, dst_id, kind, tag, ref, data)
        x, y = self.params.mu_coords(dst_id & self._id_mask)
        tc = self._timed.get((x, y))
        if tc is not None and tc.sleeping is not None and not tc.m.halted:
            if self._blocked(tc.m) is None:
                since = tc.sleeping
                tc.sleeping = None
                wake = t + self.timing.token
                tc.intervals.append((since, wake, _WAIT))
                tc.t = wake
                self._push(wake, 1, tc)
        elif tc is not None and tc.m.halted and tc.halt_at is None:
            tc.halt_at = t                      # an overflow halted it

    # --- the sequencer -------------------------------------------------------------------------

    def _advance(self, tc, t):
        """Execute CU ``tc``'s instructions from cycle ``t`` until it must wait for a later
        event (then it is pushed back) or halts."""
        cu = tc.m
        program = cu.program
        rmask = self._regs - 1
        heap = self._heap
        deferred = tc.deferred
        if deferred is not None:
            # A blocking MU instruction held back until its request reaches the MU: execute
            # it now, timed in the cycle it was due (nothing this CU does has moved since).
            tc.deferred = None
            t = deferred
        if tc.qs is not None:
            # A stream between CUs went on waiting for a word or a credit: go on with it.
            qs = tc.qs
            if not self._run_queue_stream(tc):
                return
            t = qs.t + 1
        while True:
            if cu.halted:
                if tc.halt_at is None:
                    tc.halt_at = t
                return
            pc = cu.pc
            ins = program[pc] if pc < self._prog_len else None
            if ins is None:
                self._step(cu)               # PC_OUT_OF_RANGE or BAD_INSTRUCTION
                tc.halt_at = self._idle(tc, t)
                return
            op = ins.op
            # The stream engine (AFTER_STREAM, a second SRUN, a reduction's registers).
            e = t
            streams = tc.streams
            if streams:
                while streams and streams[0].done < t:
                    streams.pop(0)
                if streams:
                    if op is Op.SRUN:
                        if len(streams) > 1:
                            e = streams[0].done + 1
                    elif op in _AFTER_STREAM:
                        # Each stream the engine holds beyond this cycle that touches what
                        # the instruction names (STREAM_HAZARDS).
                        touches = _HAZARDS[op]
                        if touches:
                            ref = cu.regs[ins.ra & rmask] & self._ref_mask
                            for s in streams:
                                e = _clear_of(s, touches, ref, e)
                    names = (ins.rd & rmask, (ins.rd + 1) & rmask, ins.ra & rmask,
                             ins.rb & rmask)
                    for s in streams:
                        if s.reduces and (s.rd in names or (s.reduces == 2 and
                                                            (s.rd + 1) & rmask in names)):
                            e = max(e, s.done + 1)
                        if s.count_reg is not None and s.count_reg in names:
                            e = max(e, s.done + 1)
                if e > t:
                    tc.intervals.append((t, e, _IDLE))
            # A non-blocking MU instruction's response.
            if tc.pend_rd is not None:
                if tc.pend_ready <= e:
                    tc.pend_rd = None
                elif op in _MU_OR_FENCE or tc.pend_rd in (ins.rd & rmask, (ins.rd + 1) & rmask,
                                                          ins.ra & rmask, ins.rb & rmask):
                    tc.intervals.append((e, tc.pend_ready, _MU))
                    e = tc.pend_ready
                    tc.pend_rd = None
            # The fences.
            if op in _FENCED and tc.last_ack >= e:
                tc.intervals.append((e, tc.last_ack + 1, _FENCE))
                e = tc.last_ack + 1
            if (op is Op.SEND or op is Op.SENDREF or op is Op.HALT) and tc.msg_free > e:
                tc.intervals.append((e, tc.msg_free, _OTHER))
                e = tc.msg_free
            if heap and heap[0][0] < e and deferred is None:
                # Something happens before this CU acts: let it happen first.
                self._push(e, 1, tc)
                tc.t = e
                return
            t = e
            if op is Op.WAIT or op is Op.RECV:
                if self._blocked(cu) is not None:
                    tc.sleeping = t
                    return
            if op in _DEFERRED and deferred is None:
                # The MU applies a request when it arrives, not when the CU executes it: what
                # happens before its arrival (another CU's FADD on the same counter that gets
                # there first) happens first. The CU waits for the response meanwhile, so
                # nothing it does depends on when its request is applied.
                arrive = t + self._latency(cu, ins)
                if heap and heap[0][0] < arrive:
                    tc.deferred = t
                    self._push(arrive, 1, tc)
                    tc.t = t
                    return
            deferred = None
            # Execute (functionally) in cycle t.
            self.now = t
            self._log.clear()
            if op is Op.SRUN and self._queue_stream(cu):
                if not self._start_queue_stream(tc, t, ins):
                    return
                t += 1
                continue
            if op is Op.SRUN:
                self._step(cu)
                if cu.stream is not None and not cu.halted:
                    steps = [len(self._log)]
                    while cu.stream is not None:
                        self._step(cu)
                        steps.append(len(self._log))
                else:
                    steps = [len(self._log)]
                if cu.halted and cu.code:
                    tc.halt_at = self._idle(tc, t)
                    return
                self._schedule_stream(tc, t, ins, steps)
                tc.retires.append(t)
                tc.instr.append(t)
                t += 1
                continue
            self._step(cu)
            if cu.halted:
                if cu.code:                  # it failed: after the engine is idle
                    tc.halt_at = self._idle(tc, t)
                    return
                tc.retires.append(t)
                tc.instr.append(t)
                tc.halt_at = t
                return
            e = t
            if op in _BLOCKING:
                mu, _, cycles = self._log[0]
                r = self.net.request(cu.xy, mu, t, cycles) + self.timing.capture
                tc.intervals.append((t, t + 1, _OTHER))
                tc.intervals.append((t + 1, r + 1, _MU))
                tc.retires.append(r)
                t = r + 1
            else:
                if op in _POSTED:
                    mu, _, cycles = self._log[0]
                    tc.last_ack = max(tc.last_ack, self.net.request(cu.xy, mu, t, cycles))
                elif op in _NONBLOCKING:
                    mu, _, cycles = self._log[0]
                    tc.pend_rd = ins.rd & rmask
                    tc.pend_ready = (self.net.request(cu.xy, mu, t, cycles)
                                     + self.timing.capture + 1)
                elif op is Op.LGET:
                    tc.intervals.append((t, t + 1, _OTHER))
                    t += 1
                tc.retires.append(t)
                tc.instr.append(t)
                t += 1
            if self._outbox:
                for msg in self._outbox:
                    dst = self.params.mu_coords(msg[2] & self._id_mask)
                    self._push(self.net.send("resp", cu.xy, dst, e), 0, msg)
                self._outbox.clear()
                tc.msg_free = e + 1
            if heap and heap[0][0] < t:
                self._push(t, 1, tc)
                tc.t = t
                return

    def _latency(self, cu, ins):
        """Cycles from a CU executing MU instruction ``ins`` to its request reaching the MU at
        zero load (the NoC's hops, the host merge of tile (0, 0))."""
        ref = cu.regs[ins.ra & (self._regs - 1)] & self._ref_mask
        x, y = self.params.mu_coords(ref & self._mu_mask)
        tm = self.timing
        return (tm.inject + (tm.host_merge if cu.xy == (0, 0) else 0) + tm.eject
                + tm.hop * (abs(x - cu.xy[0]) + abs(y - cu.xy[1])))

    @staticmethod
    def _idle(tc, t):
        """The first cycle from ``t`` in which CU ``tc``'s engine is idle (an instruction that
        fails waits for it)."""
        return max([t, *(s.done for s in tc.streams)])

    # --- the stream engine ---------------------------------------------------------------------

    def _schedule_stream(self, tc, t, ins, steps):
        """Time the stream SRUN handed to the engine in cycle ``t``; ``steps`` are the
        boundaries in the request log of its steps (every step's read, then its writes)."""
        cu = tc.m
        log = self._log
        s = self._stream_info(cu, ins)          # (not a stream between CUs: no count_reg)
        n = len(steps)
        s.steps = n
        # Per step: its read (MU, exec cycles) and its writes.
        reads, writes = [], []
        lo = 0
        for hi in steps:
            rd = None
            ws = []
            for mu, tag, cycles in log[lo:hi]:
                if tag == 1 and rd is None:
                    rd = (mu, cycles)
                else:
                    ws.append((mu, cycles))
            reads.append(rd)
            writes.append(ws)
            lo = hi
        prev = tc.streams[-1] if tc.streams and tc.streams[-1].done >= t else None
        tm = self.timing
        if prev is None or prev.done == t:
            exec_start = t + 1
            issue_start = t + tm.start_issue
            prev = None
        else:
            exec_start = prev.done + 1
            issue_start = exec_start
            early = max(t + 1, prev.last_issue + 1)
            if not (prev.writes_mu and prev.d_ref == s.a_ref):
                if prev.a_mu != s.a_mu:
                    early = max(early, prev.last_resp + 1)
                if early < prev.done:
                    issue_start = early + 1
        taken = self._sequencer_requests(tc, t, s)
        self._run_engine(tc, s, reads, writes, issue_start, exec_start, prev, taken)
        tc.streams.append(s)
        tc.last_done = s.done
        if s.last_ack is not None:
            tc.last_ack = max(tc.last_ack, s.last_ack)

    # --- streams between CUs -------------------------------------------------------------------

    def _queue_stream(self, cu):
        """Whether the stream SRUN would run reads the input queue or sends to a CU's."""
        f = cu.fields
        return ((f[_SF.A_REF.value] & self._id_mask) == cu.id
                or f[_SF.D_MODE.value] == DMode.QUEUE.value)

    def _start_queue_stream(self, tc, t, ins):
        """SRUN of a stream between CUs in cycle ``t``: time it a step at a time as it runs
        (:meth:`_run_queue_stream`). Returns whether the sequencer goes on (the stream ran to
        its end); otherwise the CU waits for a word or a credit, or halted."""
        cu = tc.m
        s = self._stream_info(cu, ins)
        prev = tc.streams[-1] if tc.streams and tc.streams[-1].done >= t else None
        tm = self.timing
        if prev is None or prev.done == t:
            exec_start, issue_start = t + 1, t + tm.start_issue
        else:
            exec_start = issue_start = prev.done + 1
        tc.qs = _QueueStream(t, s, issue_start, exec_start)
        return self._run_queue_stream(tc)

    def _run_queue_stream(self, tc):
        """Run the stream of ``tc.qs`` as far as its words and credits allow, timing each step;
        returns True when it has ended (the SRUN retires in its cycle)."""
        cu, qs = tc.m, tc.qs
        while True:
            if cu.stream is not None and self._blocked(cu) is not None:
                tc.q_blocked = True
                return False
            steps = cu.stream_steps
            self._log.clear()
            self._step_pop = self._step_push = None
            self._step(cu)
            if cu.stream_steps > steps:
                self._time_queue_step(tc, qs)
            if cu.halted and cu.code:
                tc.qs = None
                tc.halt_at = self._idle(tc, max(qs.t, *qs.pops, *qs.sends))
                return False
            if cu.stream is None:
                break
        tc.qs = None
        tc.q_blocked = False
        tm = self.timing
        s = qs.s
        end = max([qs.exec_start, *(p + tm.exec_stages + 1 for p in qs.pops),
                   *(w + 1 for w in qs.sends)])
        s.issues, s.pops, s.write_cycles = qs.issues, qs.pops, qs.sends
        s.resps = []
        s.done = end
        s.last_ack = qs.last_ack
        s.last_issue = qs.issues[-1] if qs.issues else qs.exec_start
        s.last_resp = s.last_issue
        s.exec_start = qs.exec_start
        tc.pops.extend(qs.pops)
        tc.streams.append(s)
        tc.last_done = s.done
        if s.last_ack is not None:
            tc.last_ack = max(tc.last_ack, s.last_ack)
        tc.retires.append(qs.t)
        tc.instr.append(qs.t)
        return True

    def _time_queue_step(self, tc, qs):
        """The cycles of the step the interpreter just ran: its operand (a read, or a word of
        the queue), its pop, its result (MU writes, or a word sent with a credit), and the
        credit it gives back; wakes the CU a word or a credit lets go on."""
        tm, net, xy = self.timing, self.net, tc.m.xy
        k = len(qs.pops)
        reads = [(mu, cycles) for mu, tag, cycles in self._log if tag == 1]
        writes = [(mu, cycles) for mu, tag, cycles in self._log if tag != 1]
        ready = qs.exec_start
        if self._step_pop is not None:                 # A from the input queue
            ready = self._step_pop[0][0] + tm.fifo
        elif reads:
            # One read a cycle while fewer than `outstanding` are not yet popped.
            i = max(qs.issue_start, qs.issues[-1] + 1 if qs.issues else 0)
            if k >= self._outstanding:
                i = max(i, qs.pops[k - self._outstanding] + 1)
            qs.issues.append(i)
            ready = net.request(xy, reads[0][0], i, reads[0][1]) + tm.fifo
        pop = max(ready, qs.exec_start, qs.pops[-1] + 1 if qs.pops else 0)
        if len(qs.sends) >= WQ_DEPTH:                  # the write queue has room
            pop = max(pop, qs.sends[-WQ_DEPTH] - tm.exec_stages - tm.write_queue + 1)
        qs.pops.append(pop)
        out = pop + tm.exec_stages + tm.write_queue    # the first cycle a result may leave
        for mu, cycles in writes:
            w = max(out, qs.sends[-1] + 1 if qs.sends else 0)
            qs.sends.append(w)
            ack = net.request(xy, mu, w, cycles)
            qs.last_ack = ack if qs.last_ack is None else max(qs.last_ack, ack)
        if self._step_push is not None:                # a word to a CU's queue, with a credit
            cell, dst = self._step_push
            if not self._credit_times[xy]:
                # The credit is owed by a consumer that has stopped popping: it has sent it
                # the cycle after its last pop.
                for c, owed in self._owed.items():
                    if owed and self._owed_to[c] == xy:
                        self._send_credits(c, self._last_pop[c] + 1)
            w = max(out, qs.sends[-1] + 1 if qs.sends else 0,
                    self._credit_times[xy].popleft())
            qs.sends.append(w)
            cell[0] = net.send("resp", xy, dst, w)
            self._wake(dst)
        if self._step_pop is not None:                 # its credit goes back
            src = self._step_pop[1]
            owed = self._owed[xy]
            if owed and (self._owed_to[xy] != src or pop > self._last_pop[xy] + 1):
                self._send_credits(xy, self._last_pop[xy] + 1)    # a cycle without a pop
            elif len(owed) >= self._batch:
                self._send_credits(xy, pop)                       # a batch while popping
            owed.append(pop)
            self._owed_to[xy], self._last_pop[xy] = src, pop
            self._wake(src)

    def _send_credits(self, xy, c):
        """The consumer at ``xy`` sends what it owes in cycle ``c`` (one message)."""
        owed, src = self._owed[xy], self._owed_to[xy]
        back = self.net.send("resp", xy, src, c) + self.timing.credit
        self._credit_times[src].extend([back] * len(owed))
        owed.clear()

    def _wake(self, xy):
        """Let the CU at ``xy`` go on with its stream between CUs if a word or a credit was
        what it waited for."""
        tc = self._timed.get(xy)
        if tc is not None and tc.q_blocked and not tc.m.halted and self._blocked(tc.m) is None:
            tc.q_blocked = False
            self._push(self.now, 1, tc)

    def _stream_info(self, cu, ins):
        """A :class:`_Stream` with what the sequencer's scoreboard keeps of the stream SRUN
        ``ins`` is about to run (its timing is filled in later)."""
        f = cu.fields
        s = _Stream()
        s.steps = 0
        s.a_ref = f[_SF.A_REF.value] & self._ref_mask
        s.a_mu = s.a_ref & self._mu_mask
        s.d_ref = f[_SF.D_REF.value] & self._ref_mask
        d_mode = f[_SF.D_MODE.value]
        s.writes_mu = d_mode in _D_MU
        s.reduces = _REDUCING.get(d_mode, 0)
        s.local_r = f[_SF.B_MODE.value] in _B_LOCAL or d_mode in _D_LOCAL_READS
        s.local_w = d_mode in _D_LOCAL
        s.v = d_mode == DMode.PACK_SUM.value
        s.rd = ins.rd & (self._regs - 1)
        # A stream reading the queue writes its step count after the reduction's registers.
        s.count_reg = ((s.rd + s.reduces) & (self._regs - 1)
                       if (f[_SF.A_REF.value] & self._id_mask) == cu.id else None)
        return s

    def _sequencer_requests(self, tc, t, s):
        """The cycles in which the MU instructions right after the SRUN of stream ``s`` (SRUN
        in cycle ``t``) take the request register, where the sequencer has priority over the
        engine: the straight-line instructions that follow, up to the first that waits (a
        branch, WAIT/RECV, SRUN, a fence, a stream it must wait for, a blocking MU
        instruction's response, a non-blocking one's register). A short look ahead: the
        registers the instructions name are taken as they are now."""
        cu = tc.m
        program = cu.program
        rmask = self._regs - 1
        taken = set()
        c = t + 1
        pc = cu.pc
        pend = tc.pend_ready if tc.pend_rd is not None else -1
        for _ in range(_LOOKAHEAD):
            ins = program[pc] if pc < self._prog_len else None
            if ins is None or ins.op in _NOT_STRAIGHT:
                break
            op = ins.op
            if op in _MU_INSTR:
                if pend > c:
                    break
                touches = _HAZARDS[op]
                if touches:
                    ref = cu.regs[ins.ra & rmask] & self._ref_mask
                    # (Stream s's own reads are not timed yet: it holds back what it
                    # touches in the look ahead's few cycles.)
                    s.done = s.last_issue = c + 1
                    if any(_clear_of(x, touches, ref, c) > c for x in (*tc.streams, s)):
                        break
                taken.add(c)
                if op in _BLOCKING or op in _NONBLOCKING:
                    break
            elif pend > c and pend_rd_named(ins, tc.pend_rd, rmask):
                break
            c += 2 if op is Op.LGET else 1
            pc += 1
        return taken

    def _run_engine(self, tc, s, reads, writes, issue_start, exec_start, prev, taken=()):
        """The engine's cycles for stream ``s``: reads issued from ``issue_start`` (credits
        shared with ``prev``'s unpopped reads), steps from ``exec_start``; the request register
        is not the engine's in the cycles of ``taken`` (the sequencer's requests)."""
        tm = self.timing
        net = self.net
        xy = tc.m.xy
        n = len(reads)
        outstanding = self._outstanding
        issues, resps, pops = [], [], []
        wq = []                        # ready cycles of queued writes (FIFO)
        wq_items = []                  # (mu, cycles) of each queued write
        write_cycles = []
        last_ack = None
        prev_pops = prev.pops if prev is not None else ()
        prev_n = len(prev_pops)
        prev_writes = set(prev.write_cycles) if prev is not None else set()
        prev_writes.update(taken)
        k_pop = 0
        c = min(issue_start, exec_start)
        last_s1 = -1
        while True:
            # The request register: a queued write first, else a read.
            took = wrote = False
            if wq and wq[0] <= c and c not in taken:
                wrote = True
                wq.pop(0)
                mu, cycles = wq_items.pop(0)
                ack = net.request(xy, mu, c, cycles)
                last_ack = ack if last_ack is None else max(last_ack, ack)
                write_cycles.append(c)
                took = True
            elif len(issues) < n and c >= issue_start and c not in prev_writes:
                popped = bisect.bisect_left(pops, c)
                credits = len(issues) - popped
                if prev_n:
                    credits += prev_n - bisect.bisect_left(prev_pops, c)
                if credits < outstanding:
                    rd = reads[len(issues)]
                    if rd is None:              # a step without a read cannot be
                        resps.append(c)
                    else:
                        resps.append(net.request(xy, rd[0], c, rd[1]))
                    issues.append(c)
                    took = True
            # S0: pop the next response.
            popped_now = False
            # S0 pops while at most WQ_DEPTH results are popped and not yet written (the RTL's
            # room: the queue's level, S1 and S2; one whose write leaves the queue this cycle
            # still counts), the queue holding WQ_DEPTH + 1.
            if k_pop < n and c >= exec_start and len(wq) + wrote <= WQ_DEPTH \
                    and len(resps) > k_pop and resps[k_pop] + tm.fifo <= c:
                pops.append(c)
                last_s1 = c + tm.exec_stages
                for w in writes[k_pop]:
                    wq.append(last_s1 + tm.write_queue)
                    wq_items.append(w)
                k_pop += 1
                popped_now = True
            if k_pop == n and not wq and c > last_s1 and not (write_cycles
                                                              and write_cycles[-1] >= c):
                done = c
                break
            c += 1
            if not took and not popped_now and not wq and k_pop < n \
                    and (len(issues) == n or c < issue_start):
                # Nothing moves until the next response is poppable (or issue starts).
                if len(issues) == n:
                    c = max(c, resps[k_pop] + tm.fifo, exec_start)
                elif len(resps) > k_pop:
                    c = max(c, min(issue_start, resps[k_pop] + tm.fifo))
                else:
                    c = max(c, issue_start)
        s.issues, s.resps, s.pops = issues, resps, pops
        s.write_cycles = write_cycles
        s.done = done
        s.last_ack = last_ack
        s.last_issue = issues[-1] if issues else exec_start
        s.last_resp = max(resps) if resps else exec_start
        s.exec_start = exec_start
        tc.pops.extend(pops)

    # --- counters ------------------------------------------------------------------------------

    def cu_counters(self, xy):
        """The counters of the CU at ``xy`` after :meth:`run_timed`: ``busy_cycles``,
        ``stall_cycles``, ``flits_out``, ``flits_in`` and the ``CU_PROFILE`` categories."""
        tc = self._timed[xy]
        names = ("busy_cycles", "stall_cycles", "flits_out", "flits_in", *PROFILE_NAMES)
        if not tc.m.enabled or tc.halt_at is None and not tc.retires:
            return dict.fromkeys(names, 0)
        start = self.timing.run_start
        end = tc.halt_at + 1 if tc.halt_at is not None else max(tc.retires, default=start) + 1
        pops = sorted(tc.pops)
        cats = [0] * 7
        cats[_STEP] = len(pops)
        for a, b, cat in tc.intervals:
            if b <= a:
                continue
            k = b - a - (bisect.bisect_left(pops, b) - bisect.bisect_left(pops, a))
            cats[cat] += k
        pop_set = set(pops)
        cats[_INSTR] = sum(1 for r in tc.instr if r not in pop_set)
        busy = end - start
        stall = busy - len(pop_set | set(tc.retires))
        return {"busy_cycles": busy, "stall_cycles": stall,
                "flits_out": self.net.flits_out.get(xy, 0),
                "flits_in": self.net.flits_in.get(xy, 0),
                **dict(zip(PROFILE_NAMES, cats[:6], strict=True))}


class ModelTransport:
    """The host port of a fabric simulated by the performance model: ``send``, ``recv``,
    ``burst`` and ``tick`` as the simulator transports have them
    (:mod:`rdakit.sim.runtime.host`), answering every host command as the RTL does.

    A START runs the whole job on a :class:`PerfInterpreter` at once; the host sees it running
    until as many cycles have passed (``tick``, one a command) as the model says it took."""

    def __init__(self, params, *, timing=TIMING):
        self.params = params
        self.timing = timing
        self._cmd = host_cmd_layout(params.mu)
        self._reply = host_reply_layout(params.mu)
        self._host_tag = 1 << host_tag_bit(params.mu)
        self.mus = {xy: MUModel(params.mu, params.mu_id(*xy)) for xy in params.tiles("M")}
        self._mu_base = {xy: {"flits_in": 0, "flits_out": 0} for xy in self.mus}
        self._replies = []
        self._words = None
        self.config = None
        self.load_status = LoadStatus.OK
        self.load_cycles = 0
        self.now = 0
        self._done_at = None
        self._start_at = None
        self.cycles = 0
        self.interp = None
        self._cu_counters = {}
        self._regs = {}
        self.wall_events = 0

    # --- the transport ---------------------------------------------------------------------

    async def send(self, value):
        self.now += 1
        self._command(unpack(self._cmd, value))

    async def recv(self):
        self.now += 1
        if not self._replies:
            raise TimeoutError("no reply: the command has none")
        return self._replies.pop(0)

    async def burst(self, values):
        out = []
        for v in values:
            self.now += 1
            self._command(unpack(self._cmd, v))
            out.append(self._replies.pop(0))
        return out

    async def tick(self, n=1):
        self.now += n

    # --- the host port ---------------------------------------------------------------------

    def _reply_with(self, kind, **fields):
        self._replies.append(pack(self._reply, {"kind": kind, **fields}))

    def _running(self):
        return self._start_at is not None and (self._done_at is None or self.now < self._done_at)

    def _command(self, c):
        kind = c["kind"]
        if kind is HostCmd.LOAD_BEGIN:
            self._stop()
            self._words = []
            self.config = None
        elif kind is HostCmd.LOAD_WORD:
            if self._words is not None:
                self._words.append(c["word"])
        elif kind is HostCmd.LOAD_STATUS:
            if self._words is not None:
                self._load()
            self._reply_with(kind, word=self.load_status.value | self.load_cycles << 8)
        elif kind is HostCmd.MU_REQUEST:
            self._reply_with(kind, resp=self._mu_request(c["req"]))
        elif kind is HostCmd.CFG_READ:
            self._reply_with(kind, word=self._cfg_read(c["x"], c["y"], c["addr"]) & 0xffffffff)
        elif kind is HostCmd.START:
            ok = self.config is not None and not self._running()
            if ok:
                self._start()
            self._reply_with(kind, ok=ok)
        elif kind is HostCmd.STATUS:
            self._reply_with(kind, word=self._status())
        elif kind is HostCmd.CYCLES:
            self._reply_with(kind, word=self.cycles if not self._running()
                             else self.now - self._start_at)

    def _load(self):
        words, self._words = self._words, None
        self.load_cycles = len(words) + 4
        try:
            self.config = read_bitstream(struct.pack(f"<{len(words)}I", *words), self.params)
            self.load_status = LoadStatus.OK
        except BitstreamError as e:
            self.config = None
            self.load_status = e.status or LoadStatus.BAD_MAGIC

    def _stop(self):
        if self._running():
            self._done_at = self.now
            self.cycles = self.now - self._start_at
        self._regs = {}

    def _mu_request(self, req):
        mu = req["ref"]["mu"]
        xy = self.params.mu_coords(mu)
        model = self.mus.get(xy) if mu >> 2 * self.params.coord_bits == 0 else None
        if model is None:
            return {"op": req["op"], "status": MUStatus.BAD_DESTINATION, "dst": req["src"],
                    "tag": req["tag"], "ref": req["ref"], "data": 0}
        r = dict(req)
        r["src"] = {"x": 0, "y": 0}
        r["tag"] = req["tag"] | self._host_tag
        resp = model.request(r)
        resp["tag"] = req["tag"]
        self._mu_base[xy]["flits_in"] += 1
        self._mu_base[xy]["flits_out"] += 1
        return resp

    def _start(self):
        interp = PerfInterpreter(self.params, self.config, mus=self.mus, timing=self.timing)
        self.interp = interp
        for m in self.mus.values():
            m.peak_held_words = m.held_words
        end = interp.run_timed()
        self.wall_events = interp._seq
        self._start_at = self.now
        if end is None:
            self._done_at = None
            self.cycles = 0
        else:
            self.cycles = end + self.timing.run_end
            self._done_at = self.now + self.cycles
        self._cu_counters = {xy: interp.cu_counters(xy) for xy in self.params.tiles("C")}
        for xy in self.mus:
            self._mu_base[xy]["flits_in"] += interp.net.flits_in.get(xy, 0)
            self._mu_base[xy]["flits_out"] += interp.net.flits_out.get(xy, 0)

    def _status(self):
        st = {"configured": self.config is not None, "running": self._running(),
              "done": self._start_at is not None and not self._running(),
              "error": self._error(), "load_error": self.load_status is not LoadStatus.OK,
              "misrouted": False}
        return sum(1 << STATUS_BITS[k] for k, v in st.items() if v)

    def _error(self):
        if self.interp is None or self._running():
            return False
        return any(cu.code for cu in self.interp._order)

    def _cfg_read(self, x, y, addr):
        p = self.params
        if p.kind(x, y) == "M":
            m = self.mus[(x, y)].counters()
            table = {MU_MAP.HELD_WORDS: m["held_words"], MU_MAP.PEAK_HELD_WORDS:
                     m["peak_held_words"], MU_MAP.LIVE_BUFFERS: m["live_buffers"],
                     MU_MAP.ALLOCS: m["allocs"], MU_MAP.FREES: m["frees"],
                     MU_MAP.COPY_CYCLES: m["copy_cycles"], MU_MAP.BUSY_CYCLES: m["busy_cycles"],
                     MU_MAP.FREE_BLOCKS: m["free_blocks"],
                     TILE_COUNTERS["busy_cycles"]: m["busy_cycles"],
                     TILE_COUNTERS["stall_cycles"]: 0,
                     TILE_COUNTERS["flits_in"]: self._mu_base[(x, y)]["flits_in"],
                     TILE_COUNTERS["flits_out"]: self._mu_base[(x, y)]["flits_out"]}
            return table.get(addr, 0)
        counters = self._cu_counters.get((x, y), {})
        if addr in TILE_COUNTERS.values() or addr in CU_PROFILE.values():
            name = next(n for n, a in {**TILE_COUNTERS, **CU_PROFILE}.items() if a == addr)
            return counters.get(name, 0)
        running = self._running()
        interp = self.interp
        if addr == CU_MAP.STATUS:
            if interp is None:
                return cu_status_word(done=True, error=False, code=0, pc=0)
            cu = interp._cus[(x, y)]
            return cu_status_word(done=not running or cu.halted, error=bool(cu.code),
                                  code=cu.code, pc=cu.pc & 0xffff)
        if CU_MAP.REGS <= addr < CU_MAP.REGS + p.cu.regs:
            r = addr - CU_MAP.REGS
            if interp is not None:
                return interp._cus[(x, y)].regs[r]
            tile = self.config.tiles.get((x, y)) if self.config else None
            return int(tile.regs.get(r, 0)) & 0xffffffff if tile else 0
        if addr == CU_MAP.CONTROL:
            tile = self.config.tiles.get((x, y)) if self.config else None
            return int(bool(tile and tile.enabled))
        return 0
