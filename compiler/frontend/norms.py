"""Hand-written RMSNorm and LayerNorm in an exported graph, recognised as the IR's norms.

Llama, Mistral and T5 write RMSNorm by hand rather than with ``torch.nn.RMSNorm``::

    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return self.weight * h.to(x.dtype)

``torch.export`` keeps the arithmetic: ``pow`` (or ``x * x``), ``mean``, ``add`` of ``eps``,
``rsqrt``, ``mul`` and the weight's ``mul`` (the ``.to`` casts of a float32 model leave only
``_assert_tensor_metadata`` checks, dropped like every assertion). A hand-written LayerNorm
is ``(x - mean) / sqrt(var + eps) * w + b`` with the variance ``var(unbiased=False)`` or
the mean of the squared deviations, or ``* rsqrt(...)`` instead of ``/ sqrt(...)``.
:func:`recognise` finds each such chain, starting from its ``rsqrt`` or ``sqrt``, and the
importer emits one ``rms_norm`` or ``layer_norm`` (:mod:`rdakit.compiler.intops`) for it.

The match is strict; anything else is left alone, so its ``pow``, ``rsqrt``, ``sqrt`` or
``var`` stays unsupported and is listed in the importer's one error:

* one input ``x``: the squares are of ``x`` itself (``pow(x, 2)`` or ``mul(x, x)``), or for
  LayerNorm of ``x - mean(x)``, and the numerator is that same ``x`` (or ``x - mean(x)``);
* the reduction is over the last dimension only, with ``keepdim=True``; a variance with
  ``correction=0`` (``unbiased=False``);
* ``eps`` a constant number added to the mean (``+ eps``), before the square root;
* every node between ``x`` and the result read by the pattern only (assertions aside): a
  mean or a reciprocal read elsewhere keeps its value, and then nothing is matched;
* a weight (``mul``, either order) and for LayerNorm a bias (``add``, either order) after the
  normalisation are folded in when they are constants of the row's shape ``(C,)`` and the
  normalised value is read by them only; otherwise the norm ends before them.

This module reads FX nodes only; it imports no torch.
"""

import dataclasses

from rdakit.compiler.frontend.aten import op_name

__all__ = ["Norm", "recognise", "matched_nodes", "NORM_OPS"]

#: The op kinds that only a recognised norm makes supported (:data:`~rdakit.compiler.frontend.
#: aten.ATEN_OPS` marks them ``norm``).
NORM_OPS = ("aten.pow.Tensor_Scalar", "aten.rsqrt.default", "aten.sqrt.default",
            "aten.var.correction")

_MEAN = "aten.mean.dim"
_MUL = "aten.mul.Tensor"
_ADD = "aten.add.Tensor"
_SUB = "aten.sub.Tensor"
_DIV = "aten.div.Tensor"


@dataclasses.dataclass(frozen=True)
class Norm:
    """One recognised hand-written norm.

    Members
    -------
    kind : str
        ``"rms_norm"`` or ``"layer_norm"``.
    x : torch.fx.Node
        The normalised input.
    out : torch.fx.Node
        The node whose value is the norm's result (the bias's ``add``, the weight's ``mul``,
        or the normalisation itself).
    weight, bias : torch.fx.Node or None
        The constant weight and bias folded in.
    eps : float
        The constant added to the mean of the squares.
    nodes : frozenset of str
        Names of the pattern's other nodes: they have no value of their own.
    """

    kind: str
    x: object
    out: object
    weight: object
    bias: object
    eps: float
    nodes: frozenset


def _is(node, *names):
    return getattr(node, "op", None) == "call_function" and op_name(node.target) in names


def _arg(node, i, name, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _ndim(node):
    val = node.meta.get("val") if hasattr(node, "meta") else None
    return len(val.shape) if val is not None and hasattr(val, "shape") else None


def _shape(node):
    val = node.meta.get("val") if hasattr(node, "meta") else None
    return tuple(int(d) for d in val.shape) if val is not None and hasattr(val, "shape") else None


def _last_dim(dims, ndim):
    """Whether ``dims`` (a reduction's) is the last dimension alone."""
    if ndim is None or not isinstance(dims, list | tuple) or len(dims) != 1:
        return False
    d = dims[0]
    return isinstance(d, int) and not isinstance(d, bool) and d in (-1, ndim - 1)


def _mean_last(node, of=None):
    """``node`` is ``mean(of, [-1], keepdim=True)`` (any operand if ``of`` is None)."""
    if not _is(node, _MEAN) or _arg(node, 3, "dtype") is not None:
        return False
    src = node.args[0]
    return (of is None or src is of) and _last_dim(_arg(node, 1, "dim"), _ndim(src)) \
        and _arg(node, 2, "keepdim", False) is True


def _square_of(node):
    """The operand ``a`` of ``pow(a, 2)`` or ``mul(a, a)``, or None."""
    if _is(node, "aten.pow.Tensor_Scalar"):
        e = _arg(node, 1, "exponent")
        return node.args[0] if isinstance(e, int | float) and not isinstance(e, bool) \
            and e == 2 else None
    if _is(node, _MUL) and len(node.args) == 2 and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _centered(node):
    """``x`` and ``mean(x)`` of ``node = x - mean(x, [-1], keepdim=True)``, or None."""
    if not _is(node, _SUB) or _arg(node, 2, "alpha", 1) != 1 or len(node.args) < 2:
        return None
    x, mu = node.args[0], node.args[1]
    return (x, mu) if _mean_last(mu, x) else None


def _number(v):
    return isinstance(v, int | float) and not isinstance(v, bool)


def _data_users(node):
    """The users of ``node`` that read its data (assertions on its metadata left out)."""
    return [u for u in node.users if not op_name(u.target).startswith("aten._assert")]


def _match(root, live):
    """The :class:`Norm` whose ``rsqrt`` or ``sqrt`` is ``root``, or None."""
    inner = root.args[0]
    if not (_is(inner, _ADD) and len(inner.args) == 2 and _number(inner.args[1])
            and _arg(inner, 2, "alpha", 1) == 1 and inner.args[1] >= 0):
        return None
    eps, var = float(inner.args[1]), inner.args[0]
    # The variance: mean of squares (of x: RMSNorm; of x - mean(x): LayerNorm) or var.
    kind, x, mu, nodes = None, None, None, [inner, var]
    if _is(var, "aten.var.correction"):
        x = var.args[0]
        if not (_last_dim(_arg(var, 1, "dim"), _ndim(x)) and _arg(var, 2, "correction") == 0
                and _arg(var, 3, "keepdim", False) is True):
            return None
        kind = "layer_norm"
    elif _mean_last(var):
        sq = var.args[0]
        a = _square_of(sq)
        if a is None:
            return None
        nodes.append(sq)
        centered = _centered(a)
        if centered is not None:
            kind, (x, mu) = "layer_norm", centered
            nodes += [a, mu]
        else:
            kind, x = "rms_norm", a
    else:
        return None
    # The normalisation: num * rsqrt(...) or num / sqrt(...), num x or x - mean(x).
    users = _data_users(root)
    if len(users) != 1:
        return None
    norm = users[0]
    if op_name(root.target) == "aten.rsqrt.default":
        if not (_is(norm, _MUL) and len(norm.args) == 2 and root in norm.args):
            return None
        num = norm.args[1] if norm.args[0] is root else norm.args[0]
    else:
        if not (_is(norm, _DIV) and len(norm.args) == 2 and norm.args[1] is root
                and _arg(norm, 2, "rounding_mode") is None):
            return None
        num = norm.args[0]
    if kind == "rms_norm":
        if num is not x:
            return None
    else:
        centered = _centered(num)
        if centered is None or centered[0] is not x:
            return None
        if mu is None:
            mu = centered[1]
        elif centered[1] is not mu and not _mean_last(centered[1], x):
            return None
        nodes += [num] + ([centered[1]] if centered[1] is not mu else []) + [mu]
    if x.name not in live or _ndim(x) is None:
        return None
    c = _shape(x)[-1]
    nodes += [root]
    # The affine part: * weight, then + bias (LayerNorm), constants of shape (C,).
    out, weight, bias = norm, None, None
    for role, op in (("weight", _MUL), ("bias", _ADD)):
        if role == "bias" and kind != "layer_norm":
            break
        users = _data_users(out)
        if len(users) != 1 or not _is(users[0], op) or len(users[0].args) != 2 \
                or _arg(users[0], 2, "alpha", 1) != 1:
            break
        nxt = users[0]
        const = nxt.args[1] if nxt.args[0] is out else nxt.args[0]
        if not hasattr(const, "name") or const.name in live or _shape(const) != (c,) \
                or _shape(nxt) != _shape(out):
            break
        nodes.append(out)
        out = nxt
        if role == "weight":
            weight = const
        else:
            bias = const
    names = {n.name for n in nodes}
    # Every node of the pattern read by the pattern only (its last node aside).
    inside = names | {out.name}
    for n in nodes:
        if any(u.name not in inside for u in _data_users(n)):
            return None
    return Norm(kind, x, out, weight, bias, eps, frozenset(names))


def recognise(program, live):
    """Every hand-written norm of ``program`` (its graph as the importer walks it; ``live``
    the nodes that depend on a user input), by the name of its result node."""
    found = {}
    claimed = set()
    for node in program.graph.nodes:
        if node.name in live and _is(node, "aten.rsqrt.default", "aten.sqrt.default"):
            norm = _match(node, live)
            if norm is not None and not (norm.nodes | {norm.out.name}) & claimed:
                found[norm.out.name] = norm
                claimed |= norm.nodes | {norm.out.name}
    return found


def matched_nodes(norms):
    """Names of every node of the recognised norms ``norms`` (:func:`recognise`), results
    included: the nodes whose norm-only op kinds count as supported."""
    return set().union(*(n.nodes | {n.out.name} for n in norms.values()))
