"""Streams between CUs (issue 18): which edges of a plan the lowering sends through a CU's input
queue instead of an MU buffer.

An edge ``P -> C`` (tensor ``t`` produced by op ``p`` on CU ``P``, read by op ``c`` on CU
``C``) becomes a stream when :func:`stream_refusal` finds nothing against it; the producer's
last pass then sends ``t``'s words in order to ``C``'s queue (``D_MODE QUEUE``, the last word
marked) instead of writing them to an MU, and ``c`` reads ``t`` with ``A_REF`` = its own ID
(``SELF``) where it would have streamed the buffer. ``docs/compiler.md`` ("Streams between
CUs") says why each condition is needed; in short:

* ``t`` is a run-time tensor (not an input, constant or output: those are kept, or the host
  reads them) with a static, non-empty layout (a dynamic tensor may be empty, and an empty
  producer sends no word marked last for the consumer's stream to end at).
* ``p`` ends with one pass over the whole of ``t``, in order (``last_pass``: an elementwise
  chain; another producer would need a copy pass from its buffer to the queue, which costs it
  more than the hand-over it saves), and if that pass is its only one, it does not read a
  stream itself (it would wait for its consumer's credits while its own producer waits for it
  to take words: two CUs streaming to each other deadlock).
* ``t`` has exactly one reading op, on another CU, which names it once (a queue is read once:
  a second reader, a second use, or a reader on the producer's CU needs the stored words).
* ``c`` reads ``t`` by streams only, once, in order, as their ``A`` operand: ``ew``'s ``x``,
  ``copy``, ``concat_rows`` and ``concat_cols`` (any input: each is read whole, in order, by one
  stream or one a row), ``matmul_nt``'s ``A``
  when a row fits the consumer's free local buffer (else the long form reads words out of
  order).
* One stream into ``c`` at most, and when another stream into ``C`` follows, ``c`` writes no
  stream itself: one producer per queue at a time (each holds the queue's depth in credits, two
  at once overflow it), so the next producer into ``C`` WAITs for a token ``C`` sends after
  ``c`` (a fenced SEND: after ``c``'s streams, so after a stream ``c`` writes, which would wait
  for its own consumer).

The conditions on the walk itself (no instruction added to ``P``'s program between its stream
and the end of ``c``; a gating token emitted before the next producer's stream) are checked by
the :class:`~rdakit.compiler.lower.lowerer.Lowerer` as it goes, and
:func:`~rdakit.compiler.lower.lower` lowers again without the edges that fail them. Systems of
clusters do not stream.
"""

__all__ = ["QUEUE_READERS", "stream_refusal", "stream_edges"]

#: Op kinds whose template reads the input at these positions (``None``: any) by streams only,
#: once, in order, as the A operand, so the input may come from the CU's queue.
QUEUE_READERS = {"ew": (0,), "copy": (0,), "concat_rows": None, "concat_cols": None,
                 "matmul_nt": (0,)}


def stream_refusal(plan, name, readers, local_free=None, last_pass=None):
    """Why tensor ``name`` of ``plan`` cannot be a stream between CUs (a short reason), or
    ``None`` when it can (the walk's own conditions and the streams read by the producer
    aside; see the module's docstring and :func:`stream_edges`).

    ``readers`` is :meth:`Plan.readers`; ``local_free``, if given, maps a CU to its local
    words left after its constants (a ``matmul_nt`` whose row does not fit reads ``A`` by
    words, not in one pass); ``last_pass(op)``, if given, says how op ``op`` could send its
    output from its last pass: ``"only"`` (its one pass, reading its input), ``"last"`` (a
    later pass) or ``None`` (it cannot)."""
    t = plan.tensors[name]
    if t.kind != "runtime" or t.producer is None:
        return f"in a host buffer ({t.kind})"
    if t.layout.dynamic:
        return "dynamic (may be empty: no last word to end the consumer's stream)"
    if t.layout.words == 0:
        return "empty"
    ops = readers.get(name, [])
    if len(ops) != 1:
        return f"read by {len(ops)} ops"
    (c,) = ops
    p = plan.lop_of(name)
    if c.cu == p.cu:
        return "read on its producer's CU"
    if last_pass is not None and last_pass(p) is None:
        return f"its producer ({p.kind}) has no last pass over the whole tensor"
    if c.ins.count(name) != 1:
        return "read twice by its op"
    where = QUEUE_READERS.get(c.kind, ())
    if where is not None and c.ins.index(name) not in where:
        return f"not the streamed operand of {c.kind}"
    if c.kind == "matmul_nt" and local_free is not None \
            and t.layout.cw > local_free.get(c.cu, 0):
        return "a row longer than the consumer's local buffer"
    return None


def stream_edges(plan, local_free=None, exclude=(), last_pass=None):
    """The tensors of ``plan`` to lower as streams between CUs, in the order their consumers
    read them: every one :func:`stream_refusal` accepts, none in ``exclude`` (edges the walk
    refused), none whose producer's only pass reads a stream, at most one into each op, and
    into an op that writes no stream itself when another stream into the same CU follows (its
    consumer gates the next producer with a token sent after the op, and a token after a
    stream would wait for that stream's consumer)."""
    readers = plan.readers()
    ok = {op.out for op in plan.lops if op.out not in exclude
          and stream_refusal(plan, op.out, readers, local_free, last_pass) is None}
    out, last = [], {}
    for op in plan.lops:
        ins = [i for i in dict.fromkeys(op.ins) if i in ok]
        prev = last.get(op.cu)
        if ins and (prev is None or prev[1].out not in ok):
            out.append(ins[0])
            last[op.cu] = (ins[0], op)
            if last_pass is not None and last_pass(op) == "only":
                ok.discard(op.out)      # its only pass reads a stream: it sends none
    return out
