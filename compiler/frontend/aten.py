"""The aten ops the torch.export importer handles: one registry, and the coverage of a program.

:data:`ATEN_OPS` names every aten op :mod:`rdakit.compiler.frontend.importer` turns into IR ops,
spelt as ``torch.export`` graphs spell their targets (``str(node.target)``:
``aten.linear.default``, ``aten.transpose.int``; Python's ``operator.getitem``, which picks one
result of a multi-result op, is ``operator.getitem``), with the IR op kinds
(:data:`rdakit.compiler.graph.OP_KINDS`) it may become. An op is *supported* when it is in the
registry and every IR kind it needs exists (so the kinds another part of the compiler has not
added yet count as missing, not as supported).

Every int32 result that is brought back to int8 is *requantized* (:data:`REQUANT`: multiply by
an integer multiplier per column, add a rounding and bias term, arithmetic shift right, clip);
the layout ops (:attr:`AtenOp.layout`) are free where the row-major data of the 2-D IR tensors
stays the same and otherwise become the explicit copies in their ``ir`` (slices, concatenations,
transposes).

:func:`op_coverage` counts the op kinds of a program, :func:`prepare` gives the graph the
importer walks (the program decomposed to core aten except for the registered ops, which are
kept whole). This module imports torch only inside :func:`prepare` (``import rdakit`` and the
compiler must work without torch installed).
"""

import dataclasses

from rdakit.compiler.graph import OP_KINDS

__all__ = ["AtenOp", "ATEN_OPS", "REQUANT", "LAYOUT_COPIES", "op_name", "supported", "prepare",
           "live_nodes", "op_coverage", "unsupported_summary"]

#: IR kinds of a requantization (int32 -> int8): ``clip((x * m + c) >> n)``.
REQUANT = ("mul", "add", "shr", "clip")

#: IR kinds a layout op becomes where the data moves (it is free where it does not).
LAYOUT_COPIES = ("slice", "concat", "transpose")


@dataclasses.dataclass(frozen=True)
class AtenOp:
    """One aten op the importer handles.

    Members
    -------
    name : str
        The op as ``str(node.target)`` spells it in a ``torch.export`` graph.
    ir : tuple of str
        IR op kinds it may become (empty: none, the op only renames or rescales its input).
    note : str
        One line for the documentation: what it becomes and under which conditions.
    layout : bool
        Whether it is a layout op (free view or explicit copy).
    routing : bool
        Whether it is imported only as part of a recognised mixture-of-experts routing
        (:mod:`rdakit.compiler.frontend.moe`); elsewhere it is refused naming the node.
    norm : bool
        Whether it is imported only as part of a recognised hand-written RMSNorm or LayerNorm
        (:mod:`rdakit.compiler.frontend.norms`); elsewhere it is unsupported.
    """

    name: str
    ir: tuple
    note: str
    layout: bool = False
    routing: bool = False
    norm: bool = False

    @property
    def pattern(self):
        """Whether it is supported only inside a recognised pattern (routing or norm)."""
        return self.routing or self.norm


def _ops(*entries):
    return {e.name: e for e in entries}


def _layout(name, note):
    return AtenOp(name, LAYOUT_COPIES, note, layout=True)


def _routing(name, ir, note):
    return AtenOp(name, ir, f"mixture-of-experts routing only (moe): {note}", routing=True)


def _norm_part(name, note):
    return AtenOp(name, ("rms_norm", "layer_norm") + REQUANT + LAYOUT_COPIES,
                  f"hand-written RMSNorm or LayerNorm only (norms): {note}", norm=True)


def _dropped(name):
    return AtenOp(name, (), "an assertion, or a check that only feeds assertions: dropped (no "
                            "data); elsewhere refused", routing=True)


_MATMUL = ("matmul",) + REQUANT

#: Every aten op the importer handles, by name.
ATEN_OPS = _ops(
    AtenOp("aten.linear.default", _MATMUL,
           "x @ W^T + b: int8 weights per output channel, bias folded into the requantization"),
    AtenOp("aten.addmm.default", _MATMUL,
           "b + x @ W, constant W and b: as linear"),
    AtenOp("aten.mm.default", _MATMUL,
           "x @ y; constant or activation operands"),
    AtenOp("aten.matmul.default", _MATMUL,
           "x @ y with broadcast batch dimensions, one 2-D matmul per batch index"),
    AtenOp("aten.bmm.default", _MATMUL,
           "batched x @ y, one 2-D matmul per batch index"),
    AtenOp("aten.add.Tensor", REQUANT,
           "x + alpha * y, broadcasting; both operands rescaled to the output's scale"),
    AtenOp("aten.sub.Tensor", REQUANT,
           "x - alpha * y, broadcasting; both operands rescaled to the output's scale"),
    AtenOp("aten.rsub.Scalar", REQUANT, "c - x for a constant c"),
    AtenOp("aten.mul.Tensor", REQUANT,
           "x * y, broadcasting; by a positive constant scalar: free (a new scale)"),
    AtenOp("aten.div.Tensor", REQUANT,
           "x / c for a constant c only: by a scalar free (a new scale; x * -1 and a clip if "
           "c < 0), by a tensor an elementwise product"),
    AtenOp("aten.neg.default", ("mul", "clip"), "x * -1, saturated to [-127, 127]; same scale"),
    AtenOp("aten.relu.default", ("relu",), "max(x, 0), same scale"),
    AtenOp("aten.clamp.default", ("clip",), "clip to the quantized bounds, same scale"),
    AtenOp("aten.hardtanh.default", ("clip",), "clip to the quantized bounds, same scale"),
    AtenOp("aten.amax.default", ("reduce_max",) + LAYOUT_COPIES,
           "maximum over dimensions, same scale"),
    AtenOp("aten.sum.dim_IntList", ("reduce_sum",) + REQUANT + LAYOUT_COPIES,
           "sum over dimensions (int32), requantized"),
    AtenOp("aten.mean.dim", ("reduce_sum",) + REQUANT + LAYOUT_COPIES,
           "sum over dimensions, the 1 / count folded into the requantization"),
    AtenOp("aten._softmax.default", ("softmax",) + LAYOUT_COPIES,
           "softmax over a dimension: int8 probabilities of scale 2^-7, logits at their own "
           "scale (softmax_params)"),
    AtenOp("aten.softmax.int", ("softmax",) + LAYOUT_COPIES, "as _softmax"),
    AtenOp("aten._safe_softmax.default", ("softmax",) + LAYOUT_COPIES, "as _softmax"),
    AtenOp("aten.scaled_dot_product_attention.default",
           ("matmul", "softmax") + REQUANT + LAYOUT_COPIES,
           "per batch index (head): q @ k^T requantized (scale and finite additive mask "
           "folded in), softmax (causal for is_causal or a causal mask), p @ v requantized"),
    AtenOp("aten.gelu.default", ("gelu",) + REQUANT,
           "integer GELU (erf; the tanh approximation maps to it too), requantized"),
    AtenOp("aten.silu.default", ("silu",) + REQUANT, "integer SiLU, requantized"),
    AtenOp("aten.sigmoid.default", ("sigmoid",) + REQUANT,
           "integer sigmoid (i-exp, a polynomial reciprocal and a Newton step), requantized"),
    AtenOp("aten.tanh.default", ("tanh",) + REQUANT,
           "integer tanh (as 2 sigmoid(2x) - 1), requantized"),
    AtenOp("aten.exp.default", ("add", "exp") + REQUANT,
           "exp(x - M) * exp(M), M the largest calibrated input; integer exp, requantized"),
    AtenOp("aten.layer_norm.default", ("layer_norm",) + REQUANT + LAYOUT_COPIES,
           "integer LayerNorm over the trailing dimensions: int8 weight (one scale), the bias "
           "at the result's scale, requantized"),
    AtenOp("aten.native_layer_norm.default", ("layer_norm",) + REQUANT + LAYOUT_COPIES,
           "as layer_norm (its mean and 1/std results are refused if read)"),
    AtenOp("aten.rms_norm.default", ("rms_norm",) + REQUANT + LAYOUT_COPIES,
           "integer RMSNorm, int8 weight (one scale), requantized"),
    AtenOp("aten.embedding.default", ("embedding", "slice"),
           "rows of the int8 table (one scale) by int32 indices (a graph input, 1-D in the "
           "IR)"),
    AtenOp("aten.convolution.default", ("slice", "concat", "mul", "clip", "matmul") + REQUANT,
           "2-D, groups 1 (stride, padding, dilation): im2col in NHWC (each tap a shift of "
           "the rows, masked), int8 weights per output channel, a batch norm after it folded in"),
    AtenOp("aten._native_batch_norm_legit_no_training.default", REQUANT,
           "eval mode: folded into the convolution it follows, else a per-channel affine"),
    AtenOp("aten.max_pool2d_with_indices.default", ("slice", "concat", "min", "max", "matmul",
                                                    "clip"),
           "max of the masked taps, the output positions selected (its indices refused)"),
    AtenOp("aten.avg_pool2d.default", ("slice", "concat", "mul", "add", "matmul") + REQUANT,
           "sum of the masked taps, requantized by 1 / count"),
    AtenOp("aten._adaptive_avg_pool2d.default", ("matmul", "slice", "concat", "mul", "add")
           + REQUANT, "to 1x1: one matmul summing each image, requantized; else as avg_pool2d"),
    AtenOp("aten.adaptive_avg_pool2d.default", ("matmul", "slice", "concat", "mul", "add")
           + REQUANT, "as _adaptive_avg_pool2d"),
    _layout("aten.view.default", "free where the columns stay, else copies"),
    _layout("aten._unsafe_view.default", "as view"),
    _layout("aten.reshape.default", "as view"),
    _layout("aten.flatten.using_ints", "as view"),
    _layout("aten.unflatten.int", "as view"),
    _layout("aten.unsqueeze.default", "free"),
    _layout("aten.squeeze.dim", "free"),
    _layout("aten.squeeze.dims", "free"),
    _layout("aten.squeeze.default", "free"),
    _layout("aten.permute.default", "free for the leading dimensions, a transpose (and slices) "
                                    "where the last two swap"),
    _layout("aten.transpose.int", "as permute"),
    _layout("aten.t.default", "as permute"),
    _layout("aten.contiguous.default", "free"),
    _layout("aten.clone.default", "free"),
    _layout("aten.alias.default", "free"),
    _layout("aten.detach.default", "free"),
    _layout("aten.dropout.default", "free (the identity in inference)"),
    _layout("aten.slice.Tensor", "free along leading dimensions, a slice otherwise"),
    _layout("aten.select.int", "as slice, the dimension dropped"),
    _layout("aten.narrow.default", "as slice"),
    _layout("aten.cat.default", "free along leading dimensions, a concat otherwise; operands "
                                "rescaled to one scale"),
    _layout("aten.split.Tensor", "as slice, one per piece"),
    _layout("aten.split_with_sizes.default", "as slice, one per piece"),
    _layout("aten.chunk.default", "as slice, one per piece"),
    _layout("aten.unbind.int", "as select, one per piece"),
    _layout("aten.expand.default", "broadcast by the consumer where the IR broadcasts, else "
                                   "copies"),
    _layout("operator.getitem", "picks one result of a multi-result op (split, chunk)"),
    _routing("aten.topk.default", ("topk", "take", "softmax"),
             "top-k of the router's int8 logits; gates: softmax of the chosen logits if "
             "renormalised, else the chosen probabilities"),
    _routing("aten.nonzero.default", (), "torch.where on an expert's one-hot mask: its tokens"),
    _routing("aten.eq.Tensor", (), "the one-hot mask of the top-k indices, dropped"),
    _routing("aten.eq.Scalar", (), "the mask indices == e, dropped"),
    _routing("aten._to_copy.default", (), "the one-hot mask's dtype, dropped"),
    _routing("aten.index.Tensor", ("dispatch",),
             "x[token]: dispatch (run-time rows); gates[token, slot]: the combine's gates"),
    _routing("aten.index_put.default", ("combine",) + REQUANT,
             "accumulating the gated expert outputs at their tokens: one combine, requantized"),
    _routing("aten.index_add.default", ("combine",) + REQUANT, "as index_put"),
    _routing("aten.full_like.default", (), "the zeros the experts' outputs are added into"),
    _routing("aten.zeros_like.default", (), "as full_like"),
    _dropped("aten.logical_not.default"),
    _dropped("aten.any.dims"),
    _dropped("aten.ge.Scalar"),
    _dropped("aten.lt.Scalar"),
    _norm_part("aten.pow.Tensor_Scalar", "x ** 2 (or x * x) of the mean of squares"),
    _norm_part("aten.rsqrt.default", "x * rsqrt(mean + eps): the normalisation"),
    _norm_part("aten.sqrt.default", "x / sqrt(var + eps): the normalisation"),
    _norm_part("aten.var.correction", "var(x, -1, unbiased=False, keepdim=True) of a LayerNorm"),
    _dropped("aten._assert_async.msg"),
    _dropped("aten._assert_scalar.default"),
    _dropped("aten._assert_tensor_metadata.default"),
    _dropped("aten.sym_size.int"),
    _dropped("operator.ge"),
    _dropped("operator.le"),
)


def op_name(target):
    """The name of an FX node's target as :data:`ATEN_OPS` spells it."""
    module = getattr(target, "__module__", None)
    if module in ("_operator", "operator"):
        return f"operator.{target.__name__}"
    return str(target)


def supported(name):
    """Whether the aten op ``name`` is registered and every IR kind it needs exists."""
    op = ATEN_OPS.get(name)
    return op is not None and all(k in OP_KINDS for k in op.ir)


def prepare(exported_program):
    """The program the importer walks: decomposed to core aten, the registered ops kept whole.

    ``run_decompositions`` with torch's default table, from which every op of :data:`ATEN_OPS`
    is removed (so ``linear`` stays one op instead of a transpose and an ``addmm``).
    """
    # torch is optional (rdakit[torch]); only a caller holding an ExportedProgram gets here.
    import torch

    table = torch.export.default_decompositions()
    for name in ATEN_OPS:
        op = _overload(torch, name)
        if op is not None and op in table:
            del table[op]
    return exported_program.run_decompositions(table)


def _overload(torch, name):
    """The ``torch.ops`` overload a registry name spells, or None (``operator.*`` names)."""
    parts = name.split(".")
    if parts[0] != "aten" or len(parts) != 3:
        return None
    packet = getattr(torch.ops.aten, parts[1], None)
    return getattr(packet, parts[2], None) if packet is not None else None


def live_nodes(program):
    """Names of the nodes of ``program`` that depend on a user input; the others read only
    weights and constants, and the importer folds them to constants whatever their op."""
    users = set(program.graph_signature.user_inputs)
    live = set()
    for n in program.graph.nodes:
        if n.op == "placeholder":
            if n.name in users:
                live.add(n.name)
        elif any(a.name in live for a in n.all_input_nodes):
            live.add(n.name)
    return live


def op_coverage(exported_program, *, decompose=True, routed=None):
    """Count the op kinds of a program and say which the importer handles.

    Parameters
    ----------
    exported_program : torch.export.ExportedProgram
        The program.
    decompose : bool
        Count the graph the importer walks (:func:`prepare`), the default, or, if False, the
        program's graph as given.
    routed : set of str, optional
        Names of the nodes of the recognised patterns: mixture-of-experts routings
        (:func:`rdakit.compiler.frontend.moe.recognise`) and hand-written norms
        (:func:`rdakit.compiler.frontend.norms.recognise`); default: recognised here.

    Returns
    -------
    dict of str to dict
        By op name (:func:`op_name`), sorted: ``{"count": nodes, "folded": nodes that read no
        graph input (folded to constants at import), "supported": bool, "ir": list of IR
        kinds}``. A kind is supported if the importer handles it (:func:`supported`) or if
        every node of it is folded; a routing kind (:attr:`AtenOp.routing`) only if every node
        of it that is not folded is part of a recognised routing, a norm kind
        (:attr:`AtenOp.norm`) of a recognised norm. Only ``call_function``
        nodes are ops (inputs, parameters and the output are not).
    """
    program = prepare(exported_program) if decompose else exported_program
    live = live_nodes(program)
    if routed is None:
        # moe and norms import this module (the registry): imported here, not at the top.
        from rdakit.compiler.frontend import moe, norms
        routed = moe.routed_nodes(program, live) | norms.matched_nodes(
            norms.recognise(program, live))
    counts, folded, stray = {}, {}, {}
    for node in program.graph.nodes:
        if node.op == "call_function":
            name = op_name(node.target)
            counts[name] = counts.get(name, 0) + 1
            folded[name] = folded.get(name, 0) + (node.name not in live)
            op = ATEN_OPS.get(name)
            stray[name] = stray.get(name, 0) + (
                op is not None and op.pattern and node.name in live and node.name not in routed)
    return {name: {"count": counts[name], "folded": folded[name],
                   "supported": (supported(name) and not stray[name])
                   or folded[name] == counts[name],
                   "ir": list(ATEN_OPS[name].ir) if supported(name) else []}
            for name in sorted(counts)}


def unsupported_summary(coverage, what):
    """The one-line summary of the unsupported ops of ``coverage`` (:func:`op_coverage`), or
    None if every op is supported: ``{what} has 3 unsupported op kinds (12 nodes):
    aten.embedding.default x2, ...`` (most nodes first, then by name)."""
    missing = sorted(((n, c["count"] - c.get("folded", 0)) for n, c in coverage.items()
                      if not c["supported"]),
                     key=lambda item: (-item[1], item[0]))
    if not missing:
        return None
    nodes = sum(c for _, c in missing)
    kinds = len(missing)
    listed = ", ".join(f"{n} x{c}" for n, c in missing)
    return (f"{what} has {kinds} unsupported op kind{'s' if kinds != 1 else ''} "
            f"({nodes} node{'s' if nodes != 1 else ''}): {listed}")
