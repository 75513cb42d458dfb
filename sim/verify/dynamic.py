"""Workloads with memory dynamism (issue 22): jobs whose buffers are allocated, grow and are
freed by the CUs at run time, with sizes the compiler never sees.

:func:`generation` is autoregressive decoding with continuous batching: every CU runs a loop
over decode rounds and, in each round, over its batch slots. A slot takes the next waiting
sequence from a shared queue (an atomic ``FADD`` on a counter, so which CU decodes which
sequence is decided at run time), reads its length and first token from an input buffer the
host filled from a seeded RNG (``READ``), allocates an empty KV cache in its CU's MU
(``ALLOC``) and decodes one token a round: a one-step stream appends the new K row
(``emb[t mod vocab] + t`` in every lane) to the cache, which grows in the MU block by block,
and a stream over the whole cache reduces ``k * q`` to the attention score (``SUM``). The
score folds into a running checksum and picks the next token. A finished sequence writes its
result word (checksum, final length, last score, sequence number) to the output, returns its
cache (``RETI``, or ``DECREF`` with counter-based reference counting), which frees it, and the
slot takes the next sequence. Nothing about the sizes is in the programs but the vocabulary;
the CU loops until no slot is live and the queue is empty.

The numpy reference (:func:`generation_reference`) decodes the same sequences in Python
integers modulo 2**32.
"""

import dataclasses

import numpy as np

from rdakit.compiler.compile import placement_fabric
from rdakit.compiler.job import HostBuffer, Job, Ref
from rdakit.hdl.spec.bitstream import FabricConfig, TileConfig
from rdakit.hdl.spec.isa import assemble
from rdakit.hdl.spec.params import RefcountMode

__all__ = ["DynamicJob", "generation", "generation_program", "generation_reference",
           "SLOT_FIELDS", "QUERY_XOR", "moe_dispatch", "moe_reference", "SPLITS",
           "static_copies", "speculative", "speculative_reference", "DRAFT_DEPTH"]

_M = 0xffffffff

#: Elements of the local buffer that hold one batch slot's state, in this order from the
#: slot's base element: the cache reference, the sequence number, steps remaining, the current
#: token, the checksum, whether the slot is live, the cache length.
SLOT_FIELDS = ("ref", "seq", "remaining", "token", "checksum", "live", "length")
_SLOT = 8                              # elements per slot in the local buffer (a power of two)
_F = {name: i for i, name in enumerate(SLOT_FIELDS)}

#: The query of a step is the token XOR this.
QUERY_XOR = 0x55


@dataclasses.dataclass
class DynamicJob(Job):
    """A :class:`~rdakit.compiler.job.Job` of a dynamic workload, with what the benchmarks
    count: ``tokens`` decoded (one KV entry each) and ``lengths`` of the sequences."""

    tokens: int = 0
    lengths: tuple = ()
    #: References sent that are not new copies of a buffer: stop messages, and weight handed
    #: back to the holder it came from.
    control_refs: int = 0
    #: How to build the job again in another process (a cocotb simulator's): JSON-able, set by
    #: :func:`rdakit.sim.bench.memory.build`.
    recipe: dict | None = None


def _check_positive(name, value, minimum=1):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer of at least {minimum}, not {value!r}")


def _check_length(what, program, params):
    """Raise ``ValueError`` if ``program`` (``what``'s, e.g. "generation's") is longer than the
    fabric's CU program memory."""
    if len(program) > params.cu.prog_len:
        raise ValueError(f"{what} program has {len(program)} instructions; prog_len is "
                         f"{params.cu.prog_len}")


def generation_program(params, *, slots, vocab):
    """The CU program of :func:`generation` for ``slots`` batch slots and a vocabulary of
    ``vocab`` (a power of two) K rows. Initial registers: r1 the host's buffer (words 0 to
    ``vocab - 1`` the embedding table), r2 the index of its first sequence word (word ``r2 +
    s``: length, first token of sequence s), r3 the index of the queue counter, r4 the index
    of the first output word, r5 the MU ID of this CU's caches, r6 the number of
    sequences."""
    counter = params.mu.refcount is RefcountMode.COUNTER
    release = "DECREF r9" if counter else "RETI r9, 1"
    f = _F
    return assemble(f"""
        SCFGI A_STRIDE, 1
        SCFGI B_MODE, 2              # SCALAR
        LI r14, 0                    # the queue is empty (it gave a number >= r6)
    round:
        LI r8, 0                     # a slot was live this round
        LI r7, 0                     # this slot's base element in the local buffer
    slot:
        LGET r9, r7, {f['live']}
        BNZ r9, step
        BNZ r14, next
        FADD r11, r1, r3, 1          # r11 = the next waiting sequence
        BLT r11, r6, start
        LI r14, 1
        JMP next
    start:
        ALU ADD, r10, r2, r11
        READ 0, r12, r1, r10         # its length, drawn by the host
        READ 1, r13, r1, r10         # its first token
        ALLOC r9, r5, 1              # its KV cache, empty, in this CU's MU
        LSET r11, r7, {f['seq']}
        LSET r12, r7, {f['remaining']}
        LSET r13, r7, {f['token']}
        LI r10, 0
        LSET r10, r7, {f['checksum']}
        LSET r10, r7, {f['length']}
        LSET r9, r7, {f['ref']}
        LI r10, 1
        LSET r10, r7, {f['live']}
    step:
        LGET r9, r7, {f['ref']}
        LGET r13, r7, {f['token']}
        ALUI AND, r10, r13, {vocab - 1}
        SCFG A_REF, r1
        SCFG A_BASE, r10
        SCFGI N, 1
        SCFG B_VAL, r13
        SCFGI D_MODE, 2              # APPEND the new K row emb[t] + t to the cache
        SCFG D_REF, r9
        SRUN ADD, r0
        LGET r12, r7, {f['length']}
        ALUI ADD, r12, r12, 1
        LSET r12, r7, {f['length']}
        ALUI XOR, r10, r13, {QUERY_XOR}
        SCFG A_REF, r9
        SCFGI A_BASE, 0
        SCFG N, r12
        SCFG B_VAL, r10
        SCFGI D_MODE, 5              # SUM over the whole cache: the attention score
        SRUN MUL, r11
        LGET r10, r7, {f['checksum']}
        ALUI MUL, r10, r10, 31
        ALU ADD, r10, r10, r11
        LSET r10, r7, {f['checksum']}
        ALUI SHRU, r15, r11, 7
        ALU XOR, r13, r13, r15
        ALUI AND, r13, r13, 0xffff   # the next token
        LSET r13, r7, {f['token']}
        LI r8, 1
        LGET r15, r7, {f['remaining']}
        ALUI SUB, r15, r15, 1
        LSET r15, r7, {f['remaining']}
        BNZ r15, next
        VSET 0, r10                  # finished: its result word
        VSET 1, r12
        VSET 2, r11
        LGET r15, r7, {f['seq']}
        VSET 3, r15
        ALU ADD, r15, r15, r4
        VWRITE r1, r15
        {release}                    # the cache is freed
        LI r10, 0
        LSET r10, r7, {f['live']}
    next:
        ALUI ADD, r7, r7, {_SLOT}
        LI r10, {slots * _SLOT}
        BLT r7, r10, slot
        BNZ r8, round
        HALT
    """)


def generation_reference(emb, seqs):
    """The output of :func:`generation`: one word per sequence (checksum, length, last
    score, sequence number), decoded in Python integers modulo 2**32 from the embedding
    table ``emb`` (vocab × lanes) and ``seqs`` (word s: length, first token)."""
    table = emb.astype(np.int64) & _M
    vocab = len(table)
    out = np.zeros((len(seqs), emb.shape[1]), np.int64)
    for s, (length, t, *_) in enumerate(seqs.astype(np.int64)):
        cache = np.zeros((0, emb.shape[1]), np.int64)
        acc = score = 0
        for _ in range(int(length)):
            k = (table[t & (vocab - 1)] + t) & _M
            cache = np.vstack([cache, k])
            score = int((cache * (t ^ QUERY_XOR)).sum()) & _M
            acc = (acc * 31 + score) & _M
            t = (t ^ (score >> 7)) & 0xffff
        out[s, :4] = (acc, length, score, s)
    return out.astype(np.uint32).astype(np.int32)


def generation(params, *, sequences=8, slots=2, min_len=2, max_len=8, vocab=16, cus=None,
               host_mu=None, cache_mus=None, seed=0):
    """Autoregressive generation with continuous batching (the module docstring): a
    :class:`DynamicJob`.

    Parameters
    ----------
    params : FabricParams
        The fabric; its CUs need ``lanes >= 4`` and a program of about 80 instructions.
    sequences : int
        Sequences to decode; their lengths are drawn uniformly from ``min_len..max_len`` and
        their first tokens from ``0..65535`` by ``numpy.random.default_rng(seed)``.
    slots : int
        Batch slots per CU (sequences a CU decodes at once).
    vocab : int
        Rows of the embedding table (a power of two).
    cus : list of (x, y)
        The CUs that decode (default: every CU).
    host_mu : (x, y)
        The MU of the host's buffers (default: the first MU).
    cache_mus : dict
        CU -> the MU of its caches (default: each CU its own MU, spread over the MUs).
    """
    for name, value in (("sequences", sequences), ("slots", slots), ("min_len", min_len),
                        ("max_len", max_len), ("vocab", vocab)):
        _check_positive(name, value)
    if max_len < min_len:
        raise ValueError(f"max_len must be at least min_len ({min_len}), not {max_len}")
    if vocab & (vocab - 1):
        raise ValueError(f"vocab must be a power of two, not {vocab}")
    lanes = params.cu.lanes
    if lanes < 4:
        raise ValueError(f"generation needs at least 4 lanes, not {lanes}")
    if slots * _SLOT > params.cu.local_words * lanes:
        raise ValueError(f"slots must be at most {params.cu.local_words * lanes // _SLOT} "
                         f"(the local buffer holds {_SLOT} elements a slot), not {slots}")
    cus = list(cus or params.tiles("C"))
    host_mu = host_mu or params.tiles("M")[0]
    cache_mus = cache_mus or placement_fabric(params).spread(cus)
    rng = np.random.default_rng(seed)
    emb = rng.integers(-2**31, 2**31, size=(vocab, lanes), dtype=np.int64).astype(np.int32)
    lengths = rng.integers(min_len, max_len + 1, size=sequences)
    seqs = np.zeros((sequences, lanes), np.int32)
    seqs[:, 0] = lengths
    seqs[:, 1] = rng.integers(0, 1 << 16, size=sequences)
    # One host buffer (an MU in single mode holds one): the embedding table, the sequences,
    # the queue counter, the outputs.
    seqs_at, queue_at = vocab, vocab + sequences
    out_at = queue_at + 1
    io = np.concatenate([emb, seqs, np.zeros((1 + sequences, lanes), np.int32)])
    buffers = [HostBuffer("io", host_mu, io)]
    want = io.copy()
    # Each CU takes one number past the last sequence from the queue, then stops asking.
    want[queue_at, 0] = sequences + len(cus)
    want[out_at:] = generation_reference(emb, seqs)
    program = generation_program(params, slots=slots, vocab=vocab)
    _check_length("generation's", program, params)
    tiles = {cu: TileConfig(program=program, regs={
        1: Ref("io"), 2: seqs_at, 3: queue_at, 4: out_at,
        5: params.mu_id(*cache_mus[cu]), 6: sequences}) for cu in cus}
    return DynamicJob(FabricConfig(params, tiles), buffers, ["io"], {"io": want},
                      cus_used=len(cus),
                      description=f"generation of {sequences} sequences of {min_len}.."
                                  f"{max_len} tokens, {slots} slots on each of {len(cus)} CUs",
                      tokens=int(lengths.sum()), lengths=tuple(int(n) for n in lengths))


# --- MoE with run-time dispatch -----------------------------------------------------------------

#: How the router splits a token buffer's weight over the copies it sends (partial-free):
#: ``halving`` (allocate half the weight range, give half of what it holds to each copy, and
#: ADD_WEIGHT when it holds 1), ``fanout`` (allocate one per expert plus its own, the largest
#: fan-out, known when the program is written), ``static`` (allocate one per SENDREF of the
#: buffer's register in the router's program, counted by :func:`static_copies`, plus its own).
SPLITS = ("halving", "fanout", "static")

_TOKEN_REG = 3                      # the router's register holding the token buffer


def static_copies(program, reg=_TOKEN_REG):
    """The copies of the reference in register ``reg`` that ``program`` can make: its SENDREF
    instructions that send ``reg`` (a static analysis of the program, as a compiler would
    make it; each such instruction runs at most once per buffer in the router's loop)."""
    from rdakit.hdl.spec.isa import Op
    return sum(1 for ins in program if ins.op is Op.SENDREF and ins.ra == reg)


def _router_program(params, *, tokens, d, experts, split, weight):
    """The router: for each token, a buffer allocated and filled at run time, its gate read
    back, its reference sent to the experts the gate picks (lane e of its first word > 0),
    the router's own weight returned, and each chosen expert's acknowledgement awaited."""
    counter = params.mu.refcount is RefcountMode.COUNTER
    half = (params.mu.max_weight + 1) // 2
    sends = []
    for e in range(experts):
        if counter:
            copy = f"""
        INCREF r3                    # counted and acknowledged before the copy is sent
        SENDREF 0, r{7 + e}, r3, r15"""
        elif split == "halving":
            copy = f"""
        ALUI SEQ, r12, r4, 1
        BZ r12, give{e}
        ADDW r3, {half - 1}          # the router holds 1: raise the total
        ALUI ADD, r4, r4, {half - 1}
    give{e}:
        ALUI SHRU, r6, r4, 1
        ALU SUB, r4, r4, r6
        SENDREF 0, r{7 + e}, r3, r6"""
        else:
            copy = f"""
        SENDREF 0, r{7 + e}, r3, r15"""
        if not counter and split != "halving":
            copy += """
        ALUI SUB, r4, r4, 1"""
        sends.append(f"""
        READ {e}, r11, r3, r14       # gate of expert {e}
        BLT r11, r15, skip{e}
        {copy.strip()}
        ALUI ADD, r13, r13, 1
    skip{e}:""")
    release = "DECREF r3" if counter else "RET r3, r4"
    stops = "\n".join(f"        SENDREF 0, r{7 + e}, r0, r0" for e in range(experts))
    return assemble(f"""
        LI r10, 0                    # token
        LI r14, 0
        LI r15, 1
    token:
        ALLOC r3, r5, {weight}
        ALUI MUL, r11, r10, {d}
        SCFG A_REF, r1
        SCFG A_BASE, r11
        SCFGI A_STRIDE, 1
        SCFGI N, {d}
        SCFGI D_MODE, 2              # APPEND the token's words to its buffer
        SCFG D_REF, r3
        SRUN PASS, r0
        VCLR
        VSET 0, r10
        VAPPEND r11, r3              # its number, after them
        LI r4, {weight}              # the weight the router holds
        LI r13, 0                    # copies sent
        {"".join(sends)}
        {release}
        BZ r13, next
    ack:
        WAIT 0, 1
        LOOP r13, ack
    next:
        ALUI ADD, r10, r10, 1
        LI r11, {tokens}
        BLT r10, r11, token
{stops}
        HALT
    """)


def _expert_program(params, *, d, experts, e):
    """Expert ``e``: receive a token's reference, acknowledge it (the mailbox slot is free),
    reduce the token's words times ``e + 2``, write (sum, token, e, 1) to output word
    ``token * experts + e``, return the reference; stop on a reference of weight 0."""
    release = "DECREF r1" if params.mu.refcount is RefcountMode.COUNTER else "RET r1, r2"
    return assemble(f"""
        SCFGI A_STRIDE, 1
        SCFGI B_MODE, 2              # SCALAR
        SCFGI B_VAL, {e + 2}
        SCFGI N, {d}
        SCFGI D_MODE, 5              # SUM
        LI r14, {d}
    loop:
        RECV 0, r1                   # r1 = the token's reference, r2 = its weight
        BZ r2, done
        SEND 0, r5, 1                # acknowledge: the router may send again
        SCFG A_REF, r1
        SRUN MUL, r3
        READ 0, r4, r1, r14          # the token's number
        {release}
        ALUI MUL, r6, r4, {experts}
        ALUI ADD, r6, r6, {e}
        VSET 0, r3
        VSET 1, r4
        LI r7, {e}
        VSET 2, r7
        LI r7, 1
        VSET 3, r7
        ALU ADD, r6, r6, r12
        VWRITE r11, r6
        JMP loop
    done:
        HALT
    """)


def moe_reference(x, d, experts):
    """Output words of :func:`moe_dispatch`: word ``t * experts + e`` is (sum of token t's
    words times e + 2 modulo 2**32, t, e, 1) if lane e of its first word is positive, else
    0."""
    lanes = x.shape[1]
    tokens = len(x) // d
    out = np.zeros((tokens * experts, lanes), np.int64)
    for t in range(tokens):
        words = x[t * d:(t + 1) * d].astype(np.int64)
        for e in range(experts):
            if words[0, e] > 0:
                out[t * experts + e, :4] = (int(words.sum()) * (e + 2) & _M, t, e, 1)
    return out.astype(np.uint32).astype(np.int32)


def moe_dispatch(params, *, tokens=8, d=4, split="fanout", router=None, experts=None,
                 host_mu=None, token_mu=None, seed=0):
    """MoE with run-time dispatch: a :class:`DynamicJob`. The router allocates a buffer per
    token in ``token_mu`` and fills it; the gate (lane e of the token's first word, drawn by
    the host) picks at run time which experts get the token's reference, so a buffer's
    holders are decided by data. Partial-free splits the router's weight as ``split`` (one of
    :data:`SPLITS`) says; counter-based counting sends an INCREF and waits for its
    acknowledgement before each copy. Each expert returns its copy after reading the token;
    the buffer is freed by the last return, whoever sends it."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    for name, value in (("tokens", tokens), ("d", d)):
        _check_positive(name, value)
    cus = params.tiles("C")
    router = router or cus[0]
    experts = list(experts or [c for c in cus if c != router])
    lanes = params.cu.lanes
    if not 1 <= len(experts) <= min(lanes, 3):
        raise ValueError(f"moe_dispatch needs 1 to {min(lanes, 3)} experts (a gate lane and "
                         f"one of the router's registers r7 to r9 each), not {len(experts)}")
    host_mu = host_mu or params.tiles("M")[0]
    token_mu = token_mu or host_mu
    rng = np.random.default_rng(seed)
    x = rng.integers(-1000, 1000, size=(tokens * d, lanes), dtype=np.int64).astype(np.int32)
    io = np.concatenate([x, np.zeros((tokens * len(experts), lanes), np.int32)])
    want = io.copy()
    want[tokens * d:] = moe_reference(x, d, len(experts))
    n = len(experts)
    if split == "halving":
        weight = (params.mu.max_weight + 1) // 2
    else:
        weight = n + 1
    if split == "static":
        probe = _router_program(params, tokens=tokens, d=d, experts=n, split=split, weight=1)
        weight = static_copies(probe) + 1
    if params.mu.refcount is RefcountMode.COUNTER:
        weight = 1
    router_prog = _router_program(params, tokens=tokens, d=d, experts=n, split=split,
                                  weight=weight)
    regs = {1: Ref("io"), 5: params.mu_id(*token_mu)}
    regs.update({7 + k: params.mu_id(*c) for k, c in enumerate(experts)})
    tiles = {router: TileConfig(program=router_prog, regs=regs)}
    for k, c in enumerate(experts):
        tiles[c] = TileConfig(program=_expert_program(params, d=d, experts=n, e=k),
                              regs={5: params.mu_id(*router), 11: Ref("io"),
                                    12: tokens * d})
    for xy, tile in tiles.items():
        _check_length(f"moe_dispatch's {'router' if xy == router else 'expert'}", tile.program,
                      params)
    return DynamicJob(FabricConfig(params, tiles), [HostBuffer("io", host_mu, io)], ["io"],
                      {"io": want}, cus_used=1 + n,
                      description=f"MoE dispatch of {tokens} tokens of {d} words to {n} "
                                  f"experts ({split})", tokens=tokens, control_refs=n)


# --- Speculative decoding -----------------------------------------------------------------------

#: Candidate tokens of a draft branch (an accepted prefix is 0 to this many).
DRAFT_DEPTH = 3


def _branch_rows(table, t, b, vocab):
    base = (t + 5 * b) & (vocab - 4)
    return (table[base:base + DRAFT_DEPTH] + t) & _M


def speculative_reference(emb, t0, rounds, branches):
    """The output word of :func:`speculative` (sum of the prefix cache's elements, its
    length, the last token, rounds; modulo 2**32) and the last round's accepted lengths."""
    table = emb.astype(np.int64) & _M
    vocab = len(table)
    t = int(t0)
    prefix = [(table[t & (vocab - 1)] + t) & _M]
    for _ in range(rounds):
        cache = np.array(prefix)
        accepted = []
        for b in range(branches):
            rows = _branch_rows(table, t, b, vocab)
            score = (int((cache * (b + 3)).sum()) + int((rows * (b + 3)).sum())) & _M
            accepted.append((score >> 5) & DRAFT_DEPTH)
        best = int(np.argmax(accepted))
        prefix.extend(_branch_rows(table, t, best, vocab)[:accepted[best]])
        t = (t * 3 + accepted[best] + 1) & 0xffff
    total = int(np.array(prefix).sum()) & _M
    return np.array([total, len(prefix), t, rounds], np.uint32).astype(np.int32), accepted


def speculative(params, *, rounds=4, vocab=16, drafter=None, verifiers=None, host_mu=None,
                cache_mu=None, seed=0):
    """Speculative decoding: a :class:`DynamicJob`. The drafter keeps the sequence's prefix
    KV cache (one buffer, one entry per accepted token) and, every round, drafts a tree of
    ``len(verifiers)`` branches of :data:`DRAFT_DEPTH` candidate entries, each in a buffer of
    its own, all sharing the prefix: each verifier gets a copy of the prefix's reference and
    its branch's. A verifier reads the whole prefix and its branch and accepts a prefix of
    the branch (0 to 3 entries, decided by the data); the drafter appends the longest accepted
    prefix to the cache and releases every branch, so the rejected entries are reclaimed and
    the accepted ones live on in the cache.

    Partial-free: the prefix is allocated with one weight per verifier plus the drafter's
    own (the fan-out is known when the program is written); a verifier hands its weight back
    to the drafter with the reference (SENDREF: no MU message), so the prefix is copied every
    round without a message and freed by one RETURN at the end. Counters: every copy of the
    prefix is an INCREF acknowledged before it is sent and a DECREF when the verifier is done.
    The branches have two holders from their allocation (weight or count 2)."""
    _check_positive("rounds", rounds)
    if vocab & (vocab - 1) or vocab < 8:
        raise ValueError(f"vocab must be a power of two of at least 8, not {vocab}")
    cus = params.tiles("C")
    drafter = drafter or cus[0]
    verifiers = list(verifiers or [c for c in cus if c != drafter])
    n = len(verifiers)
    if not 1 <= n <= 3 or params.cu.lanes < 4:
        raise ValueError(f"speculative needs 1 to 3 verifiers and 4 lanes, not {n} and "
                         f"{params.cu.lanes}")
    counter = params.mu.refcount is RefcountMode.COUNTER
    host_mu = host_mu or params.tiles("M")[0]
    cache_mu = cache_mu or host_mu
    lanes = params.cu.lanes
    rng = np.random.default_rng(seed)
    emb = rng.integers(-2**31, 2**31, size=(vocab, lanes), dtype=np.int64).astype(np.int32)
    t0 = int(rng.integers(0, 1 << 16))
    res_at, out_at = vocab, vocab + n
    io = np.concatenate([emb, np.zeros((n + 1, lanes), np.int32)])
    want = io.copy()
    want[out_at] = 0
    want[out_at, :4], accepted = speculative_reference(emb, t0, rounds, n)
    want[res_at:out_at, 0] = accepted        # the verdicts of the last round
    weight = 1 if counter else n + 1
    drafts = []
    for b in range(n):
        share = "INCREF r2\n" if counter else ""
        drafts.append(f"""
        ALLOC r{7 + b}, r5, 2        # branch {b}: the drafter's and its verifier's
        ALUI ADD, r13, r4, {5 * b}
        ALUI AND, r13, r13, {vocab - 4}
        SCFG A_BASE, r13
        SCFG D_REF, r{7 + b}
        SRUN ADD, r0                 # its candidate entries
        {share}LI r13, {params.mu_id(*verifiers[b])}
        SENDREF 0, r13, r2, r15      # the prefix, shared
        SENDREF 1, r13, r{7 + b}, r15""")
    returns = "" if counter else "\n".join(f"        RECV {b}, r13" for b in range(n))
    reads = []
    for b in range(n):
        reads.append(f"""
        READ 0, r{10 + b}, r1, r13
        ALUI ADD, r13, r13, 1""")
    pick = []
    for b in range(1, n):
        pick.append(f"""
        BLT r{10 + b}, r13, keep{b}
        BLT r13, r{10 + b}, take{b}
        JMP keep{b}
    take{b}:
        ALU ADD, r13, r{10 + b}, r0
        ALU ADD, r14, r{7 + b}, r0
    keep{b}:""")
    release_branches = "\n".join(
        f"        {'DECREF' if counter else 'RETI'} r{7 + b}{'' if counter else ', 1'}"
        for b in range(n))
    stops = "\n".join(f"        LI r13, {params.mu_id(*v)}\n        SENDREF 0, r13, r0, r0"
                       for v in verifiers)
    release_prefix = "DECREF r2" if counter else f"RETI r2, {weight}"
    drafter_prog = assemble(f"""
        LI r15, 1
        SCFG A_REF, r1
        SCFGI A_STRIDE, 1
        SCFGI B_MODE, 2              # SCALAR
        SCFG B_VAL, r4
        SCFGI D_MODE, 2              # APPEND
        ALLOC r2, r5, {weight}       # the prefix cache
        ALUI AND, r13, r4, {vocab - 1}
        SCFG A_BASE, r13
        SCFGI N, 1
        SCFG D_REF, r2
        SRUN ADD, r0                 # its first entry
        LI r3, 1                     # its length
        SCFGI N, {DRAFT_DEPTH}
    round:
        SCFG A_REF, r1
        SCFG B_VAL, r4
        {"".join(drafts)}
        WAIT 0, {n}                  # every verifier has written its verdict
{returns}
        LI r13, {res_at}
        {"".join(reads)}
        ALU ADD, r13, r10, r0        # the longest accepted prefix, the first on ties
        ALU ADD, r14, r7, r0
        {"".join(pick)}
        BZ r13, none
        SCFG A_REF, r14
        SCFGI A_BASE, 0
        SCFG N, r13
        SCFG D_REF, r2
        SRUN PASS, r0                # the accepted entries live on in the cache
        ALU ADD, r3, r3, r13
        SCFGI N, {DRAFT_DEPTH}
    none:
{release_branches}
        ALUI MUL, r4, r4, 3
        ALU ADD, r4, r4, r13
        ALUI ADD, r4, r4, 1
        ALUI AND, r4, r4, 0xffff
        LOOP r6, round
        SCFG A_REF, r2
        SCFGI A_BASE, 0
        SCFG N, r3
        SCFGI B_VAL, 1
        SCFGI D_MODE, 5              # SUM
        SRUN MUL, r13
        VSET 0, r13
        VSET 1, r3
        VSET 2, r4
        LI r13, {rounds}
        VSET 3, r13
        LI r13, {out_at}
        VWRITE r1, r13
        {release_prefix}
{stops}
        HALT
    """)
    tiles = {drafter: TileConfig(program=drafter_prog, regs={
        1: Ref("io"), 4: t0, 5: params.mu_id(*cache_mu), 6: rounds})}
    for b, v in enumerate(verifiers):
        if counter:
            done = "DECREF r3\n        DECREF r1"
        else:
            done = f"RET r3, r4\n        SENDREF {b}, r5, r1, r2    # the prefix's weight back"
        prog = assemble(f"""
            SCFGI A_STRIDE, 1
            SCFGI B_MODE, 2
            SCFGI B_VAL, {b + 3}
            SCFGI D_MODE, 5          # SUM
        loop:
            RECV 0, r1               # the prefix (r2: its weight; 0 stops)
            BZ r2, stop
            RECV 1, r3               # the branch
            LEN r6, r1
            SCFG A_REF, r1
            SCFG N, r6
            SRUN MUL, r7
            SCFG A_REF, r3
            SCFGI N, {DRAFT_DEPTH}
            SRUN MUL, r8
            ALU ADD, r7, r7, r8
            ALUI SHRU, r7, r7, 5
            ALUI AND, r7, r7, {DRAFT_DEPTH}
            VCLR
            VSET 0, r7
            VWRITE r11, r12
            {done}
            SEND 0, r5, 1
            JMP loop
        stop:
            HALT
        """)
        tiles[v] = TileConfig(program=prog, regs={5: params.mu_id(*drafter), 11: Ref("io"),
                                                   12: res_at + b})
    for xy, tile in tiles.items():
        _check_length(f"speculative's {'drafter' if xy == drafter else 'verifier'}",
                      tile.program, params)
    return DynamicJob(FabricConfig(params, tiles), [HostBuffer("io", host_mu, io)], ["io"],
                      {"io": want}, cus_used=1 + n,
                      description=f"speculative decoding, {rounds} rounds of {n} branches",
                      tokens=rounds, control_refs=n + (0 if counter else rounds * n))
