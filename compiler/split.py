"""Row splitting: one op's rows spread over several CUs.

An op is lowered on one CU, so a chain of large matmuls (an MLP, a batch of tokens through a
projection) runs on as many CUs as it has ops, however many the fabric has. :func:`split_rows`
rewrites a graph so that each such op becomes ``parts`` ops over row blocks, which the
partitioner can place on different CUs:

- a **matmul** whose left operand has at least two static rows starts a split: its left operand
  is sliced into row blocks (``slice`` on axis 0, a copy stream of the block's words), each
  block is multiplied on its own (the right operand, the weights, is read by every block: the
  lowering puts the constants each CU reads in a pool of its own, so the blocks' CUs do not
  take turns at one MU);
- the ops that work row by row continue it without a copy: the elementwise ones (``add``,
  ``sub``, ``mul``, ``max``, ``min`` with an operand of the same shape, split or sliced alike,
  or broadcast along the rows), ``relu``, ``shr``, ``shl``, ``clip``,
  ``exp``, ``gelu``, ``silu``, ``softmax`` (not a causal one: its mask depends on the row's
  index in the whole tensor), ``layer_norm`` and ``rms_norm``, a mixture of experts' router
  (``topk``, and ``take`` with its indices split alike), and a following matmul;
- every other reader, and the graph outputs, get the whole tensor back by one ``concat`` on
  axis 0, named as the op was, so outputs and error messages keep their names.

The rewritten graph computes the same values bit for bit (each op is row-wise in its left
operand). Whether it is faster depends on the fabric: :func:`~rdakit.compiler.compile.\
compile_workload` compiles both and keeps the one with fewer estimated cycles when
``split="auto"``.
"""

import numpy as np

from rdakit.compiler.graph import DataflowGraph

__all__ = ["ROW_WISE", "COLUMN_WISE", "split_rows", "split_cols", "split_graph", "row_blocks",
           "column_blocks"]

#: Op kinds that compute each output row from the same row of their first operand (the other
#: operands broadcast along the rows or have the same rows), so they continue a split.
ROW_WISE = frozenset({"matmul", "add", "sub", "mul", "max", "min", "relu", "shr", "shl", "clip",
                      "exp", "gelu", "silu", "softmax", "layer_norm", "rms_norm", "sigmoid",
                      "tanh", "topk", "take"})

#: Kinds whose every operand has the first operand's rows, each row taken with the same row of
#: the others: split alike (``take``: a row's values at that row's indices).
_ROW_ALIGNED = frozenset({"take"})

#: Kinds whose other operands have the first operand's rows (split alike) or broadcast.
_ELEMENTWISE = frozenset({"add", "sub", "mul", "max", "min"})


def _check_parts(parts):
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise ValueError(f"parts must be a positive integer, not {parts!r}")


def row_blocks(rows, parts):
    """``(start, stop)`` of ``min(parts, rows)`` row blocks covering ``rows`` rows, the first
    ones one row longer where ``rows`` does not divide evenly."""
    _check_parts(parts)
    sizes = [len(b) for b in np.array_split(np.arange(rows), min(parts, rows))]
    edges = np.concatenate([[0], np.cumsum(sizes)])
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def _static_rows(t):
    return len(t.shape) == 2 and not t.dynamic


def _continues(g, n, blocks):
    """Whether op ``n`` continues (or, for a matmul, starts) a split."""
    kind = g.kind(n)
    if kind not in ROW_WISE:
        return False
    ins = g.inputs_of(n)
    t = g.type_of(ins[0])
    if not _static_rows(t) or g.type_of(n).shape[0] != t.shape[0]:
        return False
    if kind == "softmax" and g.nx.nodes[n]["attrs"].get("causal") is not None:
        return False        # its mask depends on the row's index in the whole tensor
    if kind == "matmul":
        return t.shape[0] >= 2
    if ins[0] not in blocks:
        return False
    if kind in _ROW_ALIGNED:
        return all(_static_rows(g.type_of(o)) for o in ins[1:])
    if kind in _ELEMENTWISE:
        # The other operand: the same shape (split alike, or sliced), or broadcast along rows.
        o = g.type_of(ins[1])
        if o.shape == t.shape:
            return not o.dynamic
        return len(o.shape) < 2 or o.shape[0] == 1
    return True


def split_rows(graph, parts, *, min_rows=2):
    """A copy of ``graph`` (validated) with its row-wise chains split into ``parts`` row
    blocks (see the module's description); ``graph`` itself is unchanged.

    Parameters
    ----------
    graph : DataflowGraph
    parts : int
        Row blocks per split op (at most the op's rows).
    min_rows : int
        A matmul starts a split only when its left operand has at least this many rows.

    Returns
    -------
    DataflowGraph
        Named ``graph.name``; equal to ``graph`` (same nodes) when nothing splits.
    """
    graph.validate()
    g = graph
    _check_parts(parts)
    new = DataflowGraph(g.name)
    blocks = {}         # node -> [(block node, start, stop)]
    whole = {}          # node -> its whole tensor in ``new`` (itself, or a concat)

    def whole_of(x):
        if x not in whole:
            parts_of = [b for b, _, _ in blocks[x]]
            whole[x] = new.add("concat", *parts_of, name=x, axis=0)
        return whole[x]

    slices = {}         # (node, ranges) -> its slices, made once

    def sliced(x, ranges):
        """Blocks of ``x`` over ``ranges``: its own if split alike, else slices."""
        if x in blocks and [(a, b) for _, a, b in blocks[x]] == ranges:
            return [b for b, _, _ in blocks[x]]
        key = (x, tuple(ranges))
        if key not in slices:
            src = whole_of(x) if x in blocks else x
            slices[key] = [new.add("slice", src, name=_fresh(new, f"{x}@rows{a}"), axis=0,
                                   start=a, stop=b) for a, b in ranges]
        return slices[key]

    for n in g.order():
        kind, ins = g.kind(n), g.inputs_of(n)
        attrs = dict(g.nx.nodes[n]["attrs"])
        rows = g.type_of(ins[0]).shape[0] if ins else 0
        if not (_continues(g, n, blocks) and (ins[0] in blocks or rows >= min_rows)):
            new.add(kind, *[whole_of(i) if i in blocks else i for i in ins], name=n, **attrs)
            whole[n] = n
            continue
        ranges = ([(a, b) for _, a, b in blocks[ins[0]]] if ins[0] in blocks
                  else row_blocks(rows, parts))
        if len(ranges) < 2:
            new.add(kind, *[whole_of(i) if i in blocks else i for i in ins], name=n, **attrs)
            whole[n] = n
            continue
        first = sliced(ins[0], ranges)
        shape = g.type_of(ins[0]).shape
        others = []
        for o in ins[1:]:
            t = g.type_of(o)
            if kind in _ELEMENTWISE and t.shape == shape or kind in _ROW_ALIGNED:
                others.append(sliced(o, ranges))
            else:
                w = whole_of(o) if o in blocks else o
                others.append([w] * len(ranges))
        blocks[n] = [(new.add(kind, first[i], *[o[i] for o in others],
                              name=_fresh(new, f"{n}@{i}"), **attrs), a, b)
                     for i, (a, b) in enumerate(ranges)]
    return new.validate()


def _fresh(g, name):
    """``name``, or ``name`` with a numeric suffix if the graph has it already."""
    out, k = name, 1
    while out in g:
        out, k = f"{name}_{k}", k + 1
    return out


#: Op kinds that compute each output column from the same column of their first operand
#: (the other operand, if any, split alike or broadcast), so they continue a column split.
COLUMN_WISE = frozenset({"add", "sub", "mul", "max", "min", "relu", "shr", "shl", "clip", "exp",
                         "gelu", "silu", "sigmoid", "tanh"})


#: Binary kinds whose operands may be swapped (integer add and product, max, min): a split
#: operand second is taken as the first.
_COMMUTATIVE = frozenset({"add", "mul", "max", "min"})


def column_blocks(cols, parts, lanes):
    """``(start, stop)`` column ranges of at most ``parts`` blocks covering ``cols`` columns,
    each starting at a word boundary (a multiple of ``lanes``), the first ones a word longer
    where the words do not divide evenly."""
    words = -(-cols // lanes)
    k = min(parts, words)
    sizes = [len(b) for b in np.array_split(np.arange(words), k)]
    edges = np.concatenate([[0], np.cumsum(sizes)]) * lanes
    return [(int(a), int(min(b, cols))) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def split_cols(graph, parts, *, lanes, max_rows=1):
    """A copy of ``graph`` (validated) whose matmuls of at most ``max_rows`` static rows (a
    decoder step's one token) by a constant are split by the constant's columns into ``parts``
    blocks of whole words (the left operand is read whole by each), continued through the
    column-wise ops after them (:data:`COLUMN_WISE`, a constant operand broadcast along the
    rows sliced alike, a same-shape operand split alike or sliced at word boundaries), and
    concatenated along the last axis, named as the op was, where a reader needs whole rows.
    ``graph`` itself is unchanged."""
    graph.validate()
    g = graph
    _check_parts(parts)
    new = DataflowGraph(g.name)
    blocks = {}         # node -> [(block node, first column, past the last)]
    whole = {}

    def whole_of(x):
        if x not in whole:
            whole[x] = new.add("concat", *[b for b, _, _ in blocks[x]], name=x, axis=-1)
        return whole[x]

    def other_blocks(o, shape, ranges):
        """Blocks of the second operand ``o`` over the column ``ranges``, or None."""
        t = g.type_of(o)
        if o in blocks and [(a, b) for _, a, b in blocks[o]] == ranges:
            return [b for b, _, _ in blocks[o]]
        if g.kind(o) == "const" and t.shape[-1] == shape[-1] and (
                len(t.shape) == 1 or t.shape[0] == 1):
            value = g.nx.nodes[o]["attrs"]["value"]
            return [new.const(_fresh(new, f"{o}@cols{a}"), value[..., a:b]) for a, b in ranges]
        if t.shape == shape and not t.dynamic:
            src = whole_of(o) if o in blocks else o
            return [new.add("slice", src, name=_fresh(new, f"{o}@cols{a}"), axis=1, start=a,
                            stop=b) for a, b in ranges]
        return None

    for n in g.order():
        kind, ins = g.kind(n), g.inputs_of(n)
        attrs = dict(g.nx.nodes[n]["attrs"])
        if kind == "matmul" and g.kind(ins[1]) == "const":
            a_t = g.type_of(ins[0])
            w = g.nx.nodes[ins[1]]["attrs"]["value"]
            if _static_rows(a_t) and a_t.shape[0] <= max_rows:
                ranges = column_blocks(w.shape[1], parts, lanes)
                if len(ranges) >= 2:
                    left = whole_of(ins[0]) if ins[0] in blocks else ins[0]
                    blocks[n] = [(new.add("matmul", left, new.const(
                        _fresh(new, f"{ins[1]}@cols{a}"), w[:, a:b]),
                        name=_fresh(new, f"{n}@c{i}"), **attrs), a, b)
                        for i, (a, b) in enumerate(ranges)]
                    continue
        if (kind in _COMMUTATIVE and len(ins) == 2 and ins[0] not in blocks
                and ins[1] in blocks):
            ins = (ins[1], ins[0])      # a residual add's split operand comes second
        if ins and ins[0] in blocks and kind in COLUMN_WISE:
            ranges = [(a, b) for _, a, b in blocks[ins[0]]]
            shape = g.type_of(ins[0]).shape
            others = [other_blocks(o, shape, ranges) for o in ins[1:]]
            if g.type_of(n).shape == shape and all(o is not None for o in others):
                blocks[n] = [(new.add(kind, blk, *[o[i] for o in others],
                                      name=_fresh(new, f"{n}@c{i}"), **attrs), a, b)
                             for i, (blk, a, b) in enumerate(blocks[ins[0]])]
                continue
            ins = g.inputs_of(n)
        new.add(kind, *[whole_of(i) if i in blocks else i for i in ins], name=n, **attrs)
        whole[n] = n
    return new.validate()


def split_graph(graph, parts, *, lanes):
    """:func:`split_cols` (one-row matmuls by constants) then :func:`split_rows` (the rest)
    of ``graph`` into ``parts`` blocks: what ``compile_workload(split=parts)`` compiles."""
    return split_rows(split_cols(graph, parts, lanes=lanes), parts)
