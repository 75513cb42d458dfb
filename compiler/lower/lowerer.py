"""Code generation: every CU's program at once, walking the plan's ops in one global order.

:class:`Lowerer` places the host buffers (inputs, constant pools, outputs), decides who holds
a share of which buffer and how references and tokens travel (mailbox slots, token channels),
then runs each op's template (:mod:`rdakit.compiler.lower.templates`) on the program of its CU
(:class:`CUGen`), inserting the messages, allocations and returns around it, and checks MU
capacity at each allocation (:class:`~rdakit.compiler.lower.capacity.Account`).
:meth:`Lowerer.run` gives the :class:`~rdakit.compiler.lower.result.CompiledJob`.
"""

import collections

import numpy as np

from rdakit.compiler.job import HostBuffer, Ref
from rdakit.compiler.lower.asm import Assembler
from rdakit.compiler.lower.capacity import Account
from rdakit.compiler.lower.chains import chain_zero
from rdakit.compiler.lower.layout import INT_MAX, LoweringError, layout_of
from rdakit.compiler.lower.registers import ARG, PEER, REF_REGS, TABLE, TEMPS, RefFile
from rdakit.compiler.lower.result import CompiledJob, ProgramInfo
from rdakit.compiler.lower.streams import stream_edges
from rdakit.compiler.lower.templates import TEMPLATES, ew_one_pass, lrow_fits
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.isa import AluFn, DMode, Instr, Op
from rdakit.hdl.spec.params import RefcountMode

__all__ = ["CUGen", "Lowerer", "ProgramTooLong", "StreamsRefused"]


class StreamsRefused(Exception):
    """Edges the walk cannot lower as streams (``edges``, tensor names): instructions were
    added to a producer's program between its stream and the end of the consumer's op
    (``docs/compiler.md``, Streams between CUs), or an ALLOC found no room once streams took
    the place of the RECVs that told its CU what the producers freed. :func:`lower` lowers
    again without them."""

    def __init__(self, edges):
        super().__init__(f"streams refused by the walk: {sorted(edges)}")
        self.edges = frozenset(edges)


class ProgramTooLong(LoweringError):
    """A CU's program is longer than the fabric's ``prog_len`` (the message names the first
    such CU); nothing else of the lowering depends on ``prog_len``.

    Members
    -------
    longest : int
        Instructions of the longest program of every CU.
    prog_len : int
        The fabric's program length.
    """

    def __init__(self, message, *, longest, prog_len):
        super().__init__(message)
        self.longest = longest
        self.prog_len = prog_len


#: Host buffer references a CU's initial registers pass: r8..r14, then r0..r6 (r7 holds
#: the table's MU ID in the prologue that copies them into the reference table).
MAX_REGISTER_REFS = len(REF_REGS) + TEMPS - 1


def table_name(xy):
    """The name of the host buffer holding the references of CU ``xy`` beyond its registers."""
    return f"refs@{xy[0]},{xy[1]}"


class CUGen:
    """The program of one CU under construction: its assembler, its reference registers, the
    buffers it holds and its local-buffer constants.

    The references of the host buffers it uses are passed in its initial registers: r8..r14
    first, then r0..r6 (copied into the reference table by the prologue; r7 holds the table's
    MU ID there). Beyond :data:`MAX_REGISTER_REFS` the host passes the rest in a reference
    table of its own (:attr:`host_table`, a host buffer in r15 whose word ``i`` holds the
    ``i``-th reference after r8..r14), which the CU's spills then append to.
    """

    def __init__(self, xy, params, host_keys):
        self.xy = tuple(xy)
        self.id = params.mu_id(*xy)
        self.asm = Assembler()
        self.refs = RefFile(self.asm, f"CU {self.xy}")
        self.init_regs = {}
        self.extras = []
        #: The host buffers whose references the host passes in a table (r15), in slot order.
        self.host_table = ()
        if len(host_keys) > MAX_REGISTER_REFS:
            self.host_table = tuple(host_keys[len(REF_REGS):])
            self.init_regs[int(TABLE)] = table_name(self.xy)
        for i, key in enumerate(host_keys):
            if i < len(REF_REGS):
                r = REF_REGS[i]
                self.refs.preload(key, r)
            elif self.host_table:
                self.refs.preload_slot(key, i - len(REF_REGS))
                continue
            else:
                r = i - len(REF_REGS)
                self.refs.preload_slot(key, r)
                self.extras.append(r)
            self.init_regs[r] = key
        self.held = set(host_keys)
        self.received = set()
        self.waited = set()
        self.op_ranges = []
        self.local = {}          # local constant key -> word offset
        self.local_words = {}    # word offset -> lanes values
        self.local_top = params.cu.local_words
        self.out = None
        self.table_mu = None


class Lowerer:
    """Generates every CU's program at once, walking the ops in one global order.

    Parameters
    ----------
    plan : Plan
        The ops, after :data:`~rdakit.compiler.lower.passes.PIPELINE`.
    params : FabricParams
        The fabric.
    tables : dict, optional
        ``(x, y)`` of a CU -> words to reserve for its reference table (the second run, once
        the first has found which CUs need one).
    pools : str
        Where a CU's constant pool goes: ``"home"``, the CU's home MU (every CU streams its
        weights from its own MU), or ``"placement"``, the MU where the placement put most of
        its constants (pools pile up there, leaving other MUs free for large run-time
        buffers); else the nearest MU with room.
    streams : bool
        Lower the edges :func:`~rdakit.compiler.lower.streams.stream_edges` accepts as
        streams between CUs (else every edge goes through an MU buffer).
    refused : frozenset
        Tensors not to stream (refused by an earlier walk: :class:`StreamsRefused`).
    """

    def __init__(self, plan, params, tables=None, pools="home", streams=False,
                 refused=frozenset()):
        self.plan = plan
        self.streams = streams
        self.refused = frozenset(refused)
        self.tables = tables or {}
        self.pools_at = pools
        self.params = params
        self.cp = params.cu
        self.mp = params.mu
        self.lanes = params.cu.lanes
        self.lb = self.lanes.bit_length() - 1
        self.tensors = plan.tensors
        self.lops = plan.lops
        self.ops = {op.name: op for op in self.lops}
        self.acct = Account(params, params.tiles("C"))

    # --- buffers and who holds what ----------------------------------------------------------

    def prod_cu(self, t):
        return self.ops[t.producer].cu if t.producer is not None else None

    def key_of(self, name, cu):
        """``(buffer key, word offset)`` of tensor ``name`` as CU ``cu`` reads it (a constant
        is in the pool of each CU that reads it)."""
        t = self.tensors[name]
        if t.kind == "const":
            return self.const_at[(name, cu)]
        return t.buffer, t.base

    def place_host(self):
        """Host buffers: inputs, one constant pool per CU (the constants it reads, in creation
        order), outputs; exact sizes, each in the MU the placement chose (for a pool: see
        ``pools``) when it has room, else the nearest MU with room."""
        acct, plan = self.acct, self.plan
        out_words = collections.Counter()
        for t in self.tensors.values():
            if t.kind == "output":
                out_words[t.buffer] = max(out_words[t.buffer], t.layout.words)
        self.pool_of = collections.defaultdict(dict)          # cu -> constants (a set)
        for op in self.lops:
            for i in op.ins:
                if self.tensors[i].kind == "const":
                    self.pool_of[op.cu][i] = None
        items = []
        for name, t in self.tensors.items():
            if t.kind in ("input", "aliased"):
                items.append((name, t.buffer, max(t.layout.words, out_words[t.buffer]),
                              t.mu_hint))
        # A CU's constants, in creation order, in pools of at most max_buffer_words.
        self.pools = {}                                        # key -> (cu, constants)
        created = {name: i for i, name in enumerate(self.tensors)}
        for cu in sorted(self.pool_of, key=lambda c: (c[1], c[0])):
            chunks, used = [[]], 0
            for c in sorted(self.pool_of[cu], key=created.__getitem__):
                words = self.tensors[c].layout.words
                if words > self.mp.max_buffer_words:
                    shown = f"{c[:-2]!r} (transposed)" if c.endswith("^T") else repr(c)
                    raise LoweringError(f"Constant {shown} needs {words} words but an MU buffer "
                                        f"holds at most {self.mp.max_buffer_words} "
                                        f"(max_buffer_words)")
                if used + words > self.mp.max_buffer_words:
                    chunks.append([])
                    used = 0
                chunks[-1].append(c)
                used += words
            for i, names in enumerate(chunks):
                key = f"const@{cu[0]},{cu[1]}" + (f"#{i}" if i else "")
                self.pools[key] = (cu, names)
                hint = cu
                if self.pools_at == "placement":
                    votes = collections.Counter()
                    for c in names:
                        if self.tensors[c].mu_hint is not None:
                            votes[tuple(self.tensors[c].mu_hint)] += \
                                self.tensors[c].layout.words
                    hint = min(votes, key=lambda m: (-votes[m], m[1], m[0])) if votes else cu
                items.append((f"the constant pool {key!r} of CU {cu}", key,
                              sum(self.tensors[c].layout.words for c in names), hint))
        for out, buf in plan.output_map.items():
            if buf == out:
                items.append((out, buf, out_words[buf], plan.placement.mu_of.get(out)))
        for name, _, words, _ in items:
            if words > self.mp.max_buffer_words:
                raise LoweringError(f"Buffer {name!r} needs {words} words but an MU buffer "
                                    f"holds at most {self.mp.max_buffer_words} "
                                    f"(max_buffer_words)")
        total = sum(it[2] for it in items)
        capacity = len(acct.mus) * self.mp.words
        if total > capacity:
            raise LoweringError(f"Host buffers (inputs, constants, outputs) need {total} words "
                                f"but the {len(acct.mus)} MUs of the {self.params.rows}x"
                                f"{self.params.cols} fabric hold {capacity} ({self.mp.words} "
                                f"each)")
        self.mu_of = {}
        for i in sorted(range(len(items)), key=lambda i: (-items[i][2], i)):
            name, key, words, hint = items[i]
            for m in plan.nearest_mus(tuple(hint) if hint else acct.mus[0]):
                du = acct.units(words)
                u, s = acct.host[m]
                if u + du <= acct.cap and s + 1 <= acct.cap_slots:
                    acct.host[m][0] += du
                    acct.host[m][1] += 1
                    self.mu_of[key] = m
                    break
            else:
                left = max(acct.unit_words(acct.cap - acct.host[m][0]) for m in acct.mus)
                what = name if name.startswith("the constant") else f"buffer {name!r}"
                raise LoweringError(f"{what[0].upper() + what[1:]} ({words} words) fits in no "
                                    f"MU: the most room left in one is {left} words")
        self.const_at = {}
        for key, (cu, names) in self.pools.items():
            base = 0
            for c in names:
                self.const_at[(c, cu)] = (key, base)
                base += self.tensors[c].layout.words
        self.host_fixed = []
        kept = set(plan.output_map.values())
        for t in self.tensors.values():
            if t.kind == "aliased" and t.buffer in kept:
                self.host_fixed.append((t.buffer, out_words[t.buffer], self.mu_of[t.buffer]))
        for out, buf in plan.output_map.items():
            if buf == out:
                self.host_fixed.append((buf, out_words[buf], self.mu_of[buf]))

    def plan_uses(self):
        """Uses, shares and weights of every buffer on every CU; host keys per CU; mailboxes
        and token channels."""
        self.uses = collections.Counter()
        self.share = {}
        self.touch = collections.defaultdict(dict)      # cu -> ordered host keys
        host_kinds = ("input", "aliased", "const", "output")
        kept = set(self.plan.output_map.values())
        for op in self.lops:
            out = self.tensors[op.out]
            keys = list(dict.fromkeys(self.key_of(i, op.cu)[0] for i in op.ins))
            for key in keys:
                self.uses[(op.cu, key)] += 1
            for i in op.ins:
                t = self.tensors[i]
                key = self.key_of(i, op.cu)[0]
                if t.kind in host_kinds:
                    self.touch[op.cu].setdefault(key, None)
                    # Host buffers the host does not read back are shared by the CUs reading
                    # them (a cache grown in place that is not an output: its readers wait for
                    # the append's token, so they return their shares after it).
                    if t.kind in ("input", "const") or (t.kind in ("aliased", "output")
                                                        and key not in kept):
                        self.share[(op.cu, key)] = 1
            if out.kind == "output":
                self.touch[op.cu].setdefault(out.buffer, None)
        self.readers = collections.defaultdict(list)    # tensor -> CUs reading it, sorted
        for op in self.lops:
            for i in dict.fromkeys(op.ins):
                if op.cu not in self.readers[i]:
                    self.readers[i].append(op.cu)
        self.weight = collections.Counter()
        self.remote = {}
        self.pending = collections.Counter()
        for name, t in self.tensors.items():
            if t.kind == "runtime":
                p = self.prod_cu(t)
                remote = sorted(c for c in self.readers[name] if c != p)
                if name in self.streamed:
                    # Its buffer (if any) is the producer's own: the stream sends it, then it
                    # is freed.
                    remote = []
                    if name not in self.bufferless:
                        self.share[(p, name)] = 1
                self.remote[name] = remote
                if self.uses[(p, name)]:
                    self.share[(p, name)] = 1
                for c in remote:
                    self.share[(c, name)] = 1
                self.pending[(p, name)] = len(remote)
        for (_, key), w in self.share.items():
            self.weight[key] += w
        for name, w in self.weight.items():
            if w > self.mp.max_weight:
                raise LoweringError(f"Buffer {name!r} is read by {w} CUs but a weight holds at "
                                    f"most {self.mp.max_weight} (weight_bits = "
                                    f"{self.mp.weight_bits})")
        # Mailboxes: runtime references each CU receives, in the order it first uses them.
        self.inbox = collections.defaultdict(list)
        for op in self.lops:
            for i in dict.fromkeys(op.ins):
                t = self.tensors[i]
                if t.kind == "runtime" and self.prod_cu(t) != op.cu \
                        and i not in self.inbox[op.cu] and i not in self.streamed:
                    self.inbox[op.cu].append(i)
        mb = self.cp.mailbox
        self.slot = {}
        self.pred = {}
        for c, keys in self.inbox.items():
            for i, key in enumerate(keys):
                self.slot[(c, key)] = i % mb
                self.pred[(c, key)] = keys[i - mb] if i >= mb else None
        # Token channels: per receiving CU, one per CU that sends it tokens.
        senders = collections.defaultdict(set)
        for name, t in self.tensors.items():
            if t.kind == "output" and t.producer is not None:
                p = self.prod_cu(t)
                for c in self.readers[name]:
                    if c != p:
                        senders[c].add(p)
        for c, keys in self.inbox.items():
            for i, key in enumerate(keys):
                if i >= mb:
                    senders[self.prod_cu(self.tensors[key])].add(c)
        # A second stream into a CU waits for the consumer's token that it has read the first.
        self.gate, last = {}, {}
        for op in self.lops:
            for i in dict.fromkeys(op.ins):
                if i in self.streamed:
                    if op.cu in last:
                        self.gate[i] = last[op.cu]
                    last[op.cu] = i
        gated = collections.defaultdict(set)
        for i in self.gate:
            p = self.prod_cu(self.tensors[i])
            if self.readers[i][0] not in senders[p]:
                gated[p].add(i)
            senders[p].add(self.readers[i][0])
        over = {i for r, ss in senders.items() if len(ss) > self.cp.channels for i in gated[r]}
        if over:
            raise StreamsRefused(over)
        self.chan = {}
        for r, ss in senders.items():
            if len(ss) > self.cp.channels:
                raise LoweringError(f"CU {r} receives tokens from {len(ss)} CUs but has "
                                    f"{self.cp.channels} token channels")
            for j, s in enumerate(sorted(ss)):
                self.chan[(r, s)] = j

    def register_host(self):
        """The host buffers and reference tables in the capacity accounting: allocated before
        the start; inputs and pools freed when every reading CU has returned its share."""
        acct = self.acct
        for key, (_, names) in self.pools.items():
            words = sum(self.tensors[c].layout.words for c in names)
            acct.add(self.mu_of[key], key, acct.units(words), self.weight[key] or None)
        kept = set(self.plan.output_map.values())
        for t in self.tensors.values():
            if t.kind == "input" or (t.kind == "aliased" and t.buffer not in kept):
                words = max([x.layout.words for x in self.tensors.values()
                             if x.buffer == t.buffer and x.kind in ("aliased", "output")]
                            + [t.layout.words])
                acct.add(self.mu_of[t.buffer], t.buffer, acct.units(words),
                         self.weight[t.buffer] or None)
        for buf, words, m in self.host_fixed:
            acct.add(m, buf, acct.units(words), None)
        self.table_mu = {}
        for cu in sorted(self.tables, key=lambda c: (c[1], c[0])):
            words = self.tables[cu]
            units = max(1, acct.units(words))
            for m in self.plan.nearest_mus(cu):
                hu, hs = acct.host[m]
                if hu + units <= acct.cap and hs + 1 <= acct.cap_slots:
                    acct.host[m][0] += units
                    acct.host[m][1] += 1
                    acct.add(m, ("table", cu), units, None)
                    self.table_mu[cu] = m
                    break
            else:
                left = max(acct.unit_words(acct.cap - acct.host[m][0]) for m in acct.mus)
                raise LoweringError(f"The reference table of CU {cu} ({words} words) fits in "
                                    f"no MU: the most room left in one is {left} words")

    def make_gens(self):
        self.gens = {}
        for op in self.lops:
            if op.cu not in self.gens:
                self.gens[op.cu] = None
        for cu in sorted(self.gens, key=lambda c: (c[1], c[0])):
            self.gens[cu] = CUGen(cu, self.params, list(self.touch[cu]))

    # --- local buffer ------------------------------------------------------------------------

    def local_needs(self, op):
        """Constants op wants in its CU's local buffer: ``(key, words)``."""
        lanes = self.lanes
        if op.kind == "transpose":
            return [("identity", np.eye(lanes, dtype=np.int64))]
        if op.kind == "slice_cols" and op.attrs["mask"]:
            return [self._mask_row(self.tensors[op.out].layout.cols)]
        if op.kind == "ew" and self.ew_needs_mask(op):
            return [self._mask_row(self.tensors[op.out].layout.cols)]
        if (op.kind == "reduce" and op.attrs["op"] == "max" and op.attrs["axis"] == "row") or (
                op.kind == "softmax" and "causal" not in op.attrs):
            lay = self.tensors[op.ins[0]].layout
            row = np.full(lay.cw * lanes, INT_MAX, dtype=np.int64)
            row[lay.cols:] = -(1 << 31)
            if op.kind == "softmax" and not lay.cols % lanes:
                return []       # no padding lane to mask
            if not lrow_fits(lay.cw, self.cp.local_words):
                # A long row masks only its last word's padding lanes: one word.
                return [(f"ltail{lay.cols}", row[-lanes:].reshape(1, lanes))] if (
                    lay.cols % lanes) else []
            return [(f"lrow{lay.cols}", row.reshape(-1, lanes))]
        if op.kind in ("exp", "sigmoid") and self.tensors[op.out].layout.cols % lanes:
            return [self._mask_row(self.tensors[op.out].layout.cols)]
        return []

    def local_free(self):
        """``(x, y)`` of each CU -> the local words its constants leave free (what
        :meth:`prepare_local` will leave in ``local_top``)."""
        free, seen = {}, collections.defaultdict(set)
        for op in self.lops:
            free.setdefault(op.cu, self.cp.local_words)
            for key, words in self.local_needs(op):
                if key not in seen[op.cu]:
                    seen[op.cu].add(key)
                    free[op.cu] -= len(words)
        return free

    def _mask_row(self, cols):
        cw = -(-cols // self.lanes)
        row = np.zeros(cw * self.lanes, dtype=np.int64)
        row[:cols] = -1
        return (f"mask{cols}", row.reshape(-1, self.lanes))

    def ew_needs_mask(self, op):
        lay = self.tensors[op.out].layout
        if lay.cols % self.lanes == 0:
            return False
        mode = op.attrs["mode"]
        zero = chain_zero(op.attrs["stages"], mode in (None, "same", "row"))
        return zero != 0

    def prepare_local(self):
        for op in self.lops:
            g = self.gens[op.cu]
            for key, words in self.local_needs(op):
                if key in g.local:
                    continue
                g.local_top -= len(words)
                if g.local_top < 0:
                    raise LoweringError(f"CU {g.xy}: the local buffer ({self.cp.local_words} "
                                        f"words) cannot hold its constants")
                g.local[key] = g.local_top
                for w, row in enumerate(words):
                    g.local_words[g.local_top + w] = [int(v) for v in row]

    def need_local(self, g, op, words, why=None):
        """Refuse op if it needs more than ``words`` of the free local buffer (``why``: what
        they hold, said in the message)."""
        if words > g.local_top:
            consts = self.cp.local_words - g.local_top
            kind = self.plan.g.kind(op.node)
            what = f" ({why})" if why else ""
            raise LoweringError(f"Node {op.node!r} ({kind}) needs {words} words of the local "
                                f"buffer{what} but CU {g.xy} has {g.local_top} (local_words = "
                                f"{self.cp.local_words}, {consts} taken by constants)")

    # --- references, tokens, messages --------------------------------------------------------

    def ref(self, g, name):
        """The register holding the buffer of tensor ``name`` on CU ``g`` and the tensor's word
        offset in it, receiving the reference or waiting for the data first if needed."""
        t = self.tensors[name]
        key, base = self.key_of(name, g.xy)
        if name in self.streamed and self.prod_cu(t) != g.xy:
            # A stream from its producer: operand A from this CU's own input queue.
            q = ("queue", name)
            if q in g.refs.reg:  # pragma: no cover - the predicate admits one read
                raise AssertionError(f"CU {g.xy} reads stream {name!r} twice")
            r = g.refs.new(q)
            g.asm.emit(Op.SELF, rd=r)
            return r, 0
        if t.kind == "runtime":
            if self.prod_cu(t) != g.xy and key not in g.received:
                self.receive(g, key)
        elif t.kind == "output" and t.producer is not None:
            p = self.prod_cu(t)
            if p != g.xy and name not in g.waited:
                self.wait_token(g, p, self.data_tok[(name, g.xy)])
                g.waited.add(name)
        return g.refs.get(key), base

    def send_token(self, g, dst):
        self.tok_sent[(g.xy, dst)] += 1
        seq = self.tok_sent[(g.xy, dst)]
        g.asm.li(PEER, self.params.mu_id(*dst))
        g.asm.emit(Op.SEND, aux=self.chan[(dst, g.xy)], ra=PEER, imm=1)
        self.stamps[("token", g.xy, dst, seq)] = self.acct.tick(g.xy)
        return seq

    def wait_token(self, g, src, seq):
        used = self.tok_used[(g.xy, src)]
        if seq > used:
            g.asm.emit(Op.WAIT, aux=self.chan[(g.xy, src)], imm=seq - used)
            self.tok_used[(g.xy, src)] = seq
            self.acct.merge(g.xy, self.stamps[("token", src, g.xy, seq)])
            self.acct.tick(g.xy)

    def send_ref(self, g, key, dst):
        if self.pred[(dst, key)] is not None:
            self.wait_token(g, dst, self.credit_tok[(dst, key)])
        r = g.refs.get(key)
        g.asm.li(PEER, self.params.mu_id(*dst))
        g.asm.li(ARG, 1)
        g.asm.emit(Op.SENDREF, aux=self.slot[(dst, key)], rd=PEER, ra=r, rb=ARG)
        self.stamps[("ref", key, dst)] = self.acct.tick(g.xy)
        g.refs.unpin(key)
        self.sent.add((key, dst))
        self.pending[(g.xy, key)] -= 1
        self.check_release(g, key)

    def receive(self, g, key):
        i = self.inbox_pos[g.xy]
        keys = self.inbox[g.xy]
        if keys[i] != key:  # pragma: no cover - templates take inputs in order
            raise AssertionError(f"CU {g.xy} receives {key!r} out of order (expected "
                                 f"{keys[i]!r})")
        self.inbox_pos[g.xy] = i + 1
        g.asm.emit(Op.RECV, aux=self.slot[(g.xy, key)], rd=PEER)
        self.acct.merge(g.xy, self.stamps[("ref", key, g.xy)])
        self.acct.tick(g.xy)
        r = g.refs.new(key)
        g.asm.alui(AluFn.ADD, r, PEER, 0)
        g.held.add(key)
        g.received.add(key)
        j = i + self.cp.mailbox
        if j < len(keys):
            succ = keys[j]
            sender = self.prod_cu(self.tensors[succ])
            self.credit_tok[(g.xy, succ)] = self.send_token(g, sender)
            self.credits.add((g.xy, succ))
            if succ in self.produced and (succ, g.xy) not in self.sent:
                self.send_ref(self.gens[sender], succ, g.xy)

    def check_release(self, g, key):
        """Return the CU's share of ``key`` and forget the reference after its last use."""
        if key not in g.held or self.uses[(g.xy, key)] > 0 or self.pending[(g.xy, key)] > 0:
            return
        share = self.share.get((g.xy, key), 0)
        if share:
            self.give_back(g.asm, g.refs.get(key), share)
            self.acct.ret(key, self.acct.tick(g.xy))
        g.refs.drop(key)
        g.held.discard(key)

    def give_back(self, asm, r, share):
        """Return a share: RETI (partial-free) or DECREF (counter baseline: every share is
        one count)."""
        if self.mp.refcount is RefcountMode.COUNTER:
            asm.emit(Op.DECREF, ra=r)
        else:
            asm.emit(Op.RETI, ra=r, imm=share)

    def take_inputs(self, g, op):
        """Before op's output is ALLOCated: RECV the references of its inputs produced on other
        CUs and WAIT for the tokens of its inputs other CUs write to host buffers.

        The ALLOC's vector clock then includes every return of a share the producers made
        before sending, so the capacity bound counts the buffers they freed as free (ALLOCed
        first, the op counted them live). No cycle of waits can form: each RECV and WAIT waits
        for an event emitted earlier in the walk, wherever in the op it stands (see
        ``docs/compiler.md``, Dependencies between CUs). References are received in the
        order of the CU's mailbox, pinned as the template would pin them, and only as many as
        the reference registers hold beside the op's other references and its output (an op
        with more inputs, a concatenation of many heads, receives the rest as its template
        reaches them, without spilling a reference it has just received)."""
        names = list(dict.fromkeys(op.ins))
        fresh = []
        for name in names:
            t = self.tensors[name]
            if t.kind == "runtime" and self.prod_cu(t) != g.xy \
                    and self.key_of(name, g.xy)[0] not in g.received \
                    and name not in self.streamed:
                fresh.append(name)
            elif t.kind == "output" and t.producer is not None \
                    and self.prod_cu(t) != g.xy and name not in g.waited:
                self.wait_token(g, self.prod_cu(t), self.data_tok[(name, g.xy)])
                g.waited.add(name)
        others = {self.key_of(name, g.xy)[0] for name in names if name not in fresh}
        room = len(REF_REGS) - 1 - len(others)
        for name in fresh[:max(0, room)]:
            self.ref(g, name)

    def alloc_prefs(self, g, t):
        """``(units, MUs)``: what the buffer of run-time tensor ``t`` takes, and the MUs CU
        ``g`` may ALLOC it in, best first (the placement's choice, then the nearest)."""
        words = t.layout.words
        units = max(1, self.acct.units(words)) if words else 0
        hint = self.plan.placement.mu_of.get(t.name)
        prefs = self.plan.nearest_mus(g.xy)
        if hint is not None and tuple(hint) in prefs:
            prefs.remove(tuple(hint))
            prefs.insert(0, tuple(hint))
        return units, prefs

    def fits_first(self, g, t):
        """Whether the MU of choice for ``t``'s buffer has room for it at CU ``g``'s next
        event, before the op's inputs are received."""
        units, prefs = self.alloc_prefs(g, t)
        return self.acct.fits(prefs[0], units, self.acct.next_stamp(g.xy))

    def alloc(self, g, t):
        """ALLOC the buffer of run-time tensor ``t`` in an MU with room near the CU."""
        words = t.layout.words
        if words > self.mp.max_buffer_words:
            raise LoweringError(f"Tensor {t.name!r} needs {words} words but an MU buffer holds "
                                f"at most {self.mp.max_buffer_words} (max_buffer_words)")
        units, prefs = self.alloc_prefs(g, t)
        stamp = self.acct.tick(g.xy)
        for m in prefs:
            if self.acct.fits(m, units, stamp):
                break
        else:
            if self.streamed:
                # A stream gives its consumer no RECV to learn what its producer freed: lower
                # again without the streams into this CU (without any, if none comes here).
                into = {n for n in self.streamed if self.readers[n] == [g.xy]}
                raise StreamsRefused(into or self.streamed)
            words_left, slots_left = self.acct.room(stamp)
            raise LoweringError(f"Tensor {t.name!r} ({words} words, allocated by CU {g.xy}) "
                                f"fits in no MU: the buffers that may still be live there leave "
                                f"at most {words_left} words and {slots_left} buffer slots free "
                                f"in any MU")
        w = self.weight[t.name]
        self.acct.alloc(m, t.name, units, w, stamp)
        r = g.refs.new(t.name)
        g.asm.li(PEER, self.params.mu_id(*m))
        g.asm.emit(Op.ALLOC, rd=r, ra=PEER, imm=w)
        g.held.add(t.name)
        return r

    # --- the walk ----------------------------------------------------------------------------

    def generate(self):
        self.tok_sent = collections.Counter()
        self.tok_used = collections.Counter()
        self.stamps = {}
        self.data_tok = {}
        self.credit_tok = {}
        self.credits = set()
        self.sent = set()
        self.produced = set()
        self.inbox_pos = collections.Counter()
        self.stream_end = {}
        self.walk_refused = set()
        self.sent_direct = set()
        self.gate_tok = {}
        for op in self.lops:
            g = self.gens[op.cu]
            start = len(g.asm)
            t = self.tensors[op.out]
            if op.out in self.bufferless:
                g.out = None
            elif t.kind == "runtime":
                # ALLOC first when the MU of choice has room for the output even counting
                # what the producers of the op's inputs may not have freed yet (its answer
                # then comes while the CU waits for them); else receive the inputs first.
                if not self.fits_first(g, t):
                    self.take_inputs(g, op)
                g.out = self.alloc(g, t)
            else:
                g.out = g.refs.get(t.buffer)
            TEMPLATES[op.kind](self, g, op)
            if op.out in self.direct and op.out not in self.sent_direct:  # pragma: no cover
                raise AssertionError(f"template {op.kind} did not send stream {op.out!r}")
            for i in op.ins:
                ti = self.tensors[i]
                if i in self.streamed:
                    if ("queue", i) not in g.refs.reg:  # pragma: no cover
                        raise AssertionError(f"template {op.kind} did not read stream {i!r}")
                    g.refs.drop(("queue", i))
                    # No merge of the producer's clock: its posted returns before the stream
                    # are not acknowledged when its words leave (a SEND or SENDREF waits for
                    # them; a stream does not), so this CU does not know they are done.
                    for e, before in self.gate.items():
                        if before == i:     # the next producer into this CU may send now
                            self.gate_tok[e] = self.send_token(g, self.prod_cu(self.tensors[e]))
                    # The walk's condition: nothing added to the producer's program since its
                    # stream (else what this CU waited for may come after it: refused).
                    p = self.gens[self.prod_cu(ti)]
                    if len(p.asm) != self.stream_end[i]:
                        self.walk_refused.add(i)
                elif ti.kind == "runtime" and self.prod_cu(ti) != g.xy \
                        and ti.buffer not in g.received:  # pragma: no cover
                    raise AssertionError(f"template {op.kind} did not take input {i!r}")
            g.op_ranges.append((op.name, start, len(g.asm)))
            g.refs.unpin()
            for key in dict.fromkeys(self.key_of(i, g.xy)[0] for i in op.ins):
                self.uses[(g.xy, key)] -= 1
                self.check_release(g, key)
            self.after_production(g, op)
        for g in self.gens.values():
            for key in sorted(g.held):
                self.check_release(g, key)
            if any(self.share.get((g.xy, k), 0) for k in g.held):  # pragma: no cover
                raise AssertionError(f"CU {g.xy} still holds shares of {sorted(g.held)}")
        if self.walk_refused:
            raise StreamsRefused(self.walk_refused)

    def after_production(self, g, op):
        t = self.tensors[op.out]
        key = t.buffer
        if t.kind == "runtime":
            self.produced.add(key)
            for c in self.remote[key]:
                if self.pred[(c, key)] is None or (c, key) in self.credits:
                    self.send_ref(g, key, c)
        else:
            for c in self.readers[t.name]:
                if c != g.xy:
                    self.data_tok[(t.name, c)] = self.send_token(g, c)
        g.refs.unpin()
        self.check_release(g, key)
        if key in self.streamed:
            self.stream_end[key] = len(g.asm)

    def queue_dst(self, g, op):
        """For the template of ``op`` about to emit its last pass: if its output streams to
        another CU from that pass, the destination fields of a pass into that CU's queue
        (its ID put in PEER); else None."""
        name = op.out
        if name not in self.direct:
            return None
        (c,) = self.readers[name]
        self.wait_gate(g, name)
        g.asm.li(PEER, self.params.mu_id(*c))
        self.sent_direct.add(name)
        self.acct.tick(g.xy)
        return dict(d_mode=DMode.QUEUE, d_ref=PEER)

    def wait_gate(self, g, name):
        """Before the stream of ``name``: WAIT for its consumer's token that it has read the
        stream before it (one producer per queue), which the walk must have emitted already
        (else the edge is refused: the WAIT would wait for a later event)."""
        if name not in self.gate:
            return
        c = self.readers[name][0]
        if name not in self.gate_tok:
            self.walk_refused.add(name)
            return
        self.wait_token(g, c, self.gate_tok[name])

    # --- assembling the job ------------------------------------------------------------------

    def last_pass(self, op, free):
        """How op ``op`` can send its output to a queue from its last pass: ``"only"`` (an
        elementwise chain of one pass: no buffer), ``"last"`` (its last pass, in place or the
        padding mask, reads its buffer whole) or None (no such pass: the edge stays in an
        MU)."""
        if op.kind != "ew":
            return None
        if ew_one_pass(self, op, free[op.cu]):
            return "only"
        if len(op.attrs["stages"]) > 1 or self.ew_needs_mask(op):
            return "last"
        return None

    def run(self, inputs, graph):
        free = self.local_free()
        self.streamed = set(stream_edges(self.plan, free, self.refused,
                                         lambda op: self.last_pass(op, free))) \
            if self.streams else set()
        # Every stream leaves from its producer's last pass; from its only one, no buffer.
        self.direct = set(self.streamed)
        self.bufferless = {n for n in self.streamed
                           if self.last_pass(self.ops[self.tensors[n].producer], free) == "only"}
        self.place_host()
        self.plan_uses()
        self.register_host()
        self.make_gens()
        self.prepare_local()
        self.generate()
        need = {cu: g.refs.n_slots for cu, g in self.gens.items() if g.refs.table}
        if any(need[cu] > self.tables.get(cu, -1) for cu in need):
            return need
        return self.finish(inputs, graph)

    def finish(self, inputs, graph):
        params, cp = self.params, self.cp
        tiles, programs = {}, {}
        longest, too_long = 0, None
        for cu, g in self.gens.items():
            prologue = []
            if g.refs.table:
                m = g.table_mu = self.table_mu[cu]
            if g.refs.table and not g.host_table:
                prologue += [Instr(Op.LI, rd=int(ARG), imm=params.mu_id(*m)),
                             Instr(Op.ALLOC, rd=int(TABLE), ra=int(ARG), imm=1)]
                for r in g.extras:
                    prologue += [Instr(Op.VSET, fn=0, ra=r),
                                 Instr(Op.VAPPEND, rd=r, ra=int(TABLE))]
            body = g.asm.assemble(len(prologue))
            epilogue = []
            if g.refs.table:
                if self.mp.refcount is RefcountMode.COUNTER:
                    epilogue.append(Instr(Op.DECREF, ra=int(TABLE)))
                else:
                    epilogue.append(Instr(Op.RETI, ra=int(TABLE), imm=1))
            epilogue.append(Instr(Op.HALT))
            program = prologue + body + epilogue
            ops = [(name, self.ops[name].kind, self.ops[name].node, a + len(prologue),
                    b + len(prologue)) for name, a, b in g.op_ranges]
            longest = max(longest, len(program))
            if len(program) > cp.prog_len and too_long is None:
                names = ", ".join(repr(o[2]) for o in ops[:4]) + (", ..." if len(ops) > 4
                                                                  else "")
                too_long = (f"The program of CU {cu} ({len(ops)} ops: {names}) is "
                            f"{len(program)} instructions long but prog_len is {cp.prog_len}")
            tiles[cu] = TileConfig(program=program,
                                   regs={r: Ref(key) for r, key in sorted(g.init_regs.items())},
                                   local=dict(sorted(g.local_words.items())))
            programs[cu] = ProgramInfo(cu, len(program), ops, list(g.init_regs.values()),
                                       g.table_mu, cp.local_words - g.local_top)
        if too_long:
            raise ProgramTooLong(too_long, longest=longest, prog_len=cp.prog_len)
        # Host buffers: constant pools, inputs, outputs (allocated by the host in this order).
        lanes = self.lanes
        buffers = []
        for key, (_, names) in self.pools.items():
            data = np.concatenate([self.tensors[c].layout.encode(self.tensors[c].value)
                                   for c in names])
            buffers.append(HostBuffer(key, self.mu_of[key], data, max(1, self.weight[key]),
                                      cu_returns=self.weight[key]))
        input_layouts = {}
        for name in graph.inputs:
            t = self.tensors.get(name)
            if t is None:
                continue
            input_layouts[name] = (t.buffer, t.layout)
            buffers.append(HostBuffer(t.buffer, self.mu_of[t.buffer],
                                      t.layout.encode(inputs[name]),
                                      max(1, self.weight[t.buffer]),
                                      cu_returns=self.weight[t.buffer]))
        output_layouts = {}
        for name, buf in self.plan.output_map.items():
            lay = layout_of(graph.type_of(name), lanes, name)
            output_layouts[name] = (buf, lay)
            if buf == name:
                buffers.append(HostBuffer(buf, self.mu_of[buf], None, 1))
        # The reference tables the host fills, after the buffers they name; the CU returns
        # its weight at its end.
        buffers += [HostBuffer(table_name(cu), self.table_mu[cu], None, 1, cu_returns=1,
                               refs=g.host_table)
                    for cu, g in self.gens.items() if g.host_table]
        outputs = list(dict.fromkeys(buf for buf, _ in output_layouts.values()))
        mu_usage = {}
        for m in self.acct.mus:
            host = [b.name for b in buffers if tuple(b.mu) == m]
            u = max(self.acct.host[m][0], self.acct.peak[m][0])
            s = max(self.acct.host[m][1], self.acct.peak[m][1])
            mu_usage[m] = {"host_buffers": host,
                           "host_words": sum(b.words for b in buffers if tuple(b.mu) == m),
                           "bound_words": self.acct.unit_words(u), "bound_slots": s}
        # Multiply-accumulates of the matmuls at the sizes these inputs give (an expert's
        # rows are the tokens routed to it, not the bound of its dynamic tensor).
        macs = 0
        values = graph.values(inputs)
        for n in graph.order():
            if graph.kind(n) == "matmul":
                a, b = (values[i].shape for i in graph.inputs_of(n))
                macs += a[0] * a[1] * b[1]
        lowered = [(op.name, op.kind, op.cu, tuple(op.nodes)) for op in self.lops]
        job = CompiledJob(FabricConfig(params, tiles), buffers, outputs, {}, macs=macs,
                          cus_used=len(tiles), description=f"{graph.name} lowered onto "
                          f"{len(tiles)} CUs", graph=graph, input_layouts=input_layouts,
                          output_layouts=output_layouts, programs=programs, mu_usage=mu_usage,
                          lowered=lowered, streamed=frozenset(self.streamed))
        job.expected = job.expected_outputs(inputs)
        return job
