"""The compiler's dataflow-graph IR: integer tensor operations on a networkx ``DiGraph``.

A :class:`DataflowGraph` holds *ops* (nodes) that each produce one tensor, and *tensor edges*
from a producer to every op that reads its output. Every op kind is described once, in
:data:`OP_KINDS`: its number of inputs, how it derives its output type (shape and integer dtype)
from its inputs, its exact integer semantics in numpy (used by :meth:`DataflowGraph.evaluate` and,
later, to check the RTL bit-exactly), and how much work it does (lane operations, used by the
cost model).

Arithmetic is integer only: ``int8``/``int16``/``int32`` tensors, results of arithmetic in
``int32`` with two's-complement wraparound, arithmetic right shifts (``shr``) for fixed point and
saturation (``clip``) to narrow back to ``int8``/``int16``.

A tensor may be *dynamic*: its first dimension is a run-time size, at most ``shape[0]`` (the
bound, used for capacities) and on average ``expected_rows`` (used for costs). MoE expert inputs
(:func:`dispatch <OP_KINDS>`) are dynamic.

Graphs are built op by op and checked by :meth:`DataflowGraph.validate`, which raises
:class:`GraphError` naming the node for unknown op kinds, dangling inputs, cycles and shape or
dtype mismatches, and annotates every node with its output :class:`TensorType` and every edge with
the bytes it carries.
"""

import dataclasses
import heapq
import math
from collections.abc import Callable

import networkx as nx
import numpy as np

from rdakit.compiler import intops

__all__ = [
    "DTYPES", "TensorType", "OpSpec", "OP_KINDS", "MEMORY_KINDS", "GraphError", "DataflowGraph",
]

#: Integer element types and their sizes in bytes.
DTYPES = {"int8": 1, "int16": 2, "int32": 4}


class GraphError(ValueError):
    """A dataflow graph is malformed; the message names the node (or graph) concerned."""


@dataclasses.dataclass(frozen=True)
class TensorType:
    """Type of the tensor an op produces.

    Parameters
    ----------
    shape : tuple of int
        Dimensions (at least one). For a dynamic tensor, ``shape[0]`` is the upper bound of the
        run-time number of rows.
    dtype : str
        One of :data:`DTYPES`.
    dynamic : bool
        Whether ``shape[0]`` is only known at run time.
    expected_rows : float or None
        Average run-time rows of a dynamic tensor (``None``: the bound), used for costs.
    """

    shape: tuple
    dtype: str
    dynamic: bool = False
    expected_rows: float | None = None

    @property
    def elements(self):
        """Elements at the bound (capacity)."""
        return math.prod(self.shape)

    @property
    def nbytes(self):
        """Bytes at the bound (capacity)."""
        return self.elements * DTYPES[self.dtype]

    @property
    def expected_elements(self):
        """Elements on average (dynamic tensors count ``expected_rows`` rows)."""
        if not self.dynamic or self.expected_rows is None:
            return self.elements
        return self.expected_rows * math.prod(self.shape[1:])

    @property
    def expected_nbytes(self):
        """Bytes on average: what the cost model charges for moving the tensor."""
        return int(math.ceil(self.expected_elements * DTYPES[self.dtype]))

    def __str__(self):
        dims = ", ".join(("<=" if i == 0 and self.dynamic else "") + str(d)
                         for i, d in enumerate(self.shape))
        return f"{self.dtype}[{dims}]"


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Description of one op kind; the single place its rules are written.

    Members
    -------
    kind : str
        Name of the kind.
    arity : int or None
        Number of inputs; ``None`` for a variadic op (``min_inputs`` or more).
    infer : callable
        ``infer(node, inputs, attrs) -> TensorType``; raises :class:`GraphError`.
    evaluate : callable
        ``evaluate(arrays, attrs) -> numpy.ndarray``: the exact integer semantics.
    work : callable
        ``work(inputs, output, attrs) -> float``: lane operations (expected), for the cost model.
    memory : bool
        Whether the op is a buffer (graph input, constant, output) rather than computation.
    doc : str
        One line for the documentation.
    min_inputs : int
        Least inputs of a variadic op.
    """

    kind: str
    arity: int | None
    infer: Callable
    evaluate: Callable
    work: Callable
    memory: bool
    doc: str
    min_inputs: int = 1


# --- helpers for the op table -------------------------------------------------------------

def _wrap32(a):
    """Two's-complement wraparound of an integer array to int32."""
    return np.asarray(a).astype(np.int64).astype(np.int32)


def _fail(node, kind, message):
    raise GraphError(f"Node {node!r} ({kind}): {message}")


def _dims(t):
    return "(" + ", ".join(str(d) for d in t.shape) + ("," if len(t.shape) == 1 else "") + ")"


def _dyn_of(inputs, shape):
    """Dynamic flag and expected rows of an output of ``shape`` derived from ``inputs``."""
    dyn = [t for t in inputs if t.dynamic and len(t.shape) == len(shape) and t.shape[0] == shape[0]]
    if not dyn:
        return False, None
    expected = [t.expected_rows for t in dyn if t.expected_rows is not None]
    return True, (min(expected) if expected else None)


def _wider(a, b):
    return a if DTYPES[a] >= DTYPES[b] else b


def _check_int_attr(node, kind, attrs, name, minimum=0, maximum=None):
    value = attrs.get(name)
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        _fail(node, kind, f"attribute {name!r} must be an integer {bound}, not {value!r}")
    return int(value)


def _axis(node, kind, attrs, ndim, default=-1):
    axis = attrs.get("axis", default)
    if not isinstance(axis, int) or not -ndim <= axis < ndim:
        _fail(node, kind, f"attribute 'axis' must be an integer in [{-ndim}, {ndim}), "
                          f"not {axis!r}")
    return axis % ndim


# input, const, output

def _infer_input(node, inputs, attrs):
    shape, dtype = attrs.get("shape"), attrs.get("dtype", "int8")
    if (not isinstance(shape, tuple | list) or not shape
            or not all(isinstance(d, int) and d >= 0 for d in shape)):
        _fail(node, "input", f"shape must be a non-empty tuple of non-negative integers, "
                             f"not {shape!r}")
    if dtype not in DTYPES:
        _fail(node, "input", f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    dynamic = bool(attrs.get("dynamic", False))
    expected = attrs.get("expected_rows")
    return TensorType(tuple(shape), dtype, dynamic, expected if dynamic else None)


def _infer_const(node, inputs, attrs):
    value = attrs.get("value")
    if not isinstance(value, np.ndarray) or value.ndim == 0:
        _fail(node, "const", f"value must be a numpy array of at least one dimension, "
                             f"not {type(value).__name__}")
    if value.dtype.name not in DTYPES:
        _fail(node, "const", f"dtype must be one of {', '.join(DTYPES)}, not "
                             f"{value.dtype.name!r}")
    return TensorType(tuple(value.shape), value.dtype.name)


def _infer_same(node, inputs, attrs):
    return inputs[0]


# elementwise

def _infer_binary(kind, result_dtype=None):
    def infer(node, inputs, attrs):
        a, b = inputs
        try:
            shape = np.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            _fail(node, kind, f"input shapes {_dims(a)} and {_dims(b)} do not broadcast")
        dynamic, expected = _dyn_of(inputs, shape)
        dtype = result_dtype or _wider(a.dtype, b.dtype)
        return TensorType(tuple(shape), dtype, dynamic, expected)
    return infer


def _infer_shift(kind):
    def infer(node, inputs, attrs):
        _check_int_attr(node, kind, attrs, "shift", 0, 31)
        t = inputs[0]
        return t if kind == "shr" else dataclasses.replace(t, dtype="int32")
    return infer


def _infer_clip(node, inputs, attrs):
    dtype = attrs.get("dtype", "int8")
    if dtype not in DTYPES:
        _fail(node, "clip", f"attribute 'dtype' must be one of {', '.join(DTYPES)}, "
                            f"not {dtype!r}")
    info = np.iinfo(dtype)
    lo, hi = attrs.get("lo", int(info.min)), attrs.get("hi", int(info.max))
    if not (isinstance(lo, int) and isinstance(hi, int) and info.min <= lo <= hi <= info.max):
        _fail(node, "clip", f"bounds must satisfy {info.min} <= lo <= hi <= {info.max}, "
                            f"not lo={lo!r}, hi={hi!r}")
    return dataclasses.replace(inputs[0], dtype=dtype)


def _eval_clip(arrays, attrs):
    dtype = attrs.get("dtype", "int8")
    info = np.iinfo(dtype)
    lo, hi = attrs.get("lo", int(info.min)), attrs.get("hi", int(info.max))
    return np.clip(arrays[0].astype(np.int64), lo, hi).astype(dtype)


def _elements(inputs, out, attrs):
    return out.expected_elements


# matmul, transpose, reductions

def _infer_matmul(node, inputs, attrs):
    a, b = inputs
    if len(a.shape) != 2 or len(b.shape) != 2:
        _fail(node, "matmul", f"inputs must be 2-D, not {_dims(a)} @ {_dims(b)}")
    if b.dynamic:
        _fail(node, "matmul", "the right operand must not have run-time rows")
    if a.shape[1] != b.shape[0]:
        _fail(node, "matmul", f"inner dimensions must match, not {_dims(a)} @ {_dims(b)}")
    return TensorType((a.shape[0], b.shape[1]), "int32", a.dynamic, a.expected_rows)


def _eval_matmul(arrays, attrs):
    a, b = arrays
    return (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32)


def _work_matmul(inputs, out, attrs):
    return out.expected_elements * inputs[0].shape[1]


def _infer_transpose(node, inputs, attrs):
    t = inputs[0]
    if len(t.shape) != 2:
        _fail(node, "transpose", f"input must be 2-D, not {_dims(t)}")
    if t.dynamic:
        _fail(node, "transpose", "input must not have run-time rows")
    return TensorType(t.shape[::-1], t.dtype)


def _infer_reduce(kind):
    def infer(node, inputs, attrs):
        t = inputs[0]
        axis = _axis(node, kind, attrs, len(t.shape))
        if axis == 0 and t.dynamic:
            _fail(node, kind, "cannot reduce over run-time rows")
        shape = t.shape[:axis] + (1,) + t.shape[axis + 1:]
        dtype = "int32" if kind == "reduce_sum" else t.dtype
        return TensorType(shape, dtype, t.dynamic, t.expected_rows)
    return infer


def _eval_reduce(kind):
    def evaluate(arrays, attrs):
        a = arrays[0]
        axis = attrs.get("axis", -1)
        if kind == "reduce_sum":
            return a.astype(np.int64).sum(axis=axis, keepdims=True).astype(np.int32)
        return a.max(axis=axis, keepdims=True)
    return evaluate


def _work_in(inputs, out, attrs):
    return inputs[0].expected_elements


# slice, concat, append

def _infer_slice(node, inputs, attrs):
    t = inputs[0]
    axis = _axis(node, "slice", attrs, len(t.shape), default=None)
    size = t.shape[axis]
    start, stop = attrs.get("start", 0), attrs.get("stop", size)
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= size):
        _fail(node, "slice", f"bounds must satisfy 0 <= start <= stop <= {size}, "
                             f"not start={start!r}, stop={stop!r}")
    if axis == 0 and t.dynamic:
        _fail(node, "slice", "cannot slice run-time rows")
    shape = t.shape[:axis] + (stop - start,) + t.shape[axis + 1:]
    return TensorType(shape, t.dtype, t.dynamic, t.expected_rows)


def _eval_slice(arrays, attrs):
    a = arrays[0]
    index = [slice(None)] * a.ndim
    index[attrs["axis"]] = slice(attrs.get("start", 0), attrs.get("stop", a.shape[attrs["axis"]]))
    return a[tuple(index)]


def _infer_concat(kind):
    def infer(node, inputs, attrs):
        first = inputs[0]
        axis = 0 if kind == "append" else _axis(node, kind, attrs, len(first.shape))
        for t in inputs[1:]:
            if (len(t.shape) != len(first.shape) or t.dtype != first.dtype
                    or t.shape[:axis] + t.shape[axis + 1:]
                    != first.shape[:axis] + first.shape[axis + 1:]):
                _fail(node, kind, f"inputs must agree in dtype and in every dimension but "
                                  f"{axis}, not {first} and {t}")
        if any(t.dynamic for t in inputs):
            _fail(node, kind, "inputs must not have run-time rows")
        shape = list(first.shape)
        shape[axis] = sum(t.shape[axis] for t in inputs)
        return TensorType(tuple(shape), first.dtype)
    return infer


def _eval_concat(arrays, attrs):
    return np.concatenate(arrays, axis=attrs.get("axis", -1))


def _eval_append(arrays, attrs):
    return np.concatenate(arrays, axis=0)


# MoE: topk, take, dispatch, combine

def _infer_topk(node, inputs, attrs):
    t = inputs[0]
    if len(t.shape) != 2:
        _fail(node, "topk", f"input must be 2-D (tokens, experts), not {_dims(t)}")
    k = _check_int_attr(node, "topk", attrs, "k", 1, t.shape[1])
    return TensorType((t.shape[0], k), "int32", t.dynamic, t.expected_rows)


def _eval_topk(arrays, attrs):
    # Largest first; equal values in ascending index order (a stable sort of the negation).
    order = np.argsort(-arrays[0].astype(np.int64), axis=1, kind="stable")
    return order[:, :attrs["k"]].astype(np.int32)


def _work_topk(inputs, out, attrs):
    return inputs[0].expected_elements * attrs["k"]


def _infer_take(node, inputs, attrs):
    x, idx = inputs
    if len(x.shape) != 2 or len(idx.shape) != 2 or x.shape[0] != idx.shape[0]:
        _fail(node, "take", f"inputs must be (rows, n) and (rows, k), not {_dims(x)} and "
                            f"{_dims(idx)}")
    if idx.dtype != "int32":
        _fail(node, "take", f"indices must be int32, not {idx.dtype}")
    return TensorType(idx.shape, x.dtype, x.dynamic, x.expected_rows)


def _eval_take(arrays, attrs):
    return np.take_along_axis(arrays[0], arrays[1].astype(np.int64), axis=1)


def _check_routing(node, kind, idx, experts):
    if len(idx.shape) != 2 or idx.dtype != "int32":
        _fail(node, kind, f"routing indices must be int32 (tokens, k), not {idx}")
    if not 1 <= idx.shape[1] <= experts:
        _fail(node, kind, f"routing k must be between 1 and {experts} experts, "
                          f"not {idx.shape[1]}")


def _infer_dispatch(node, inputs, attrs):
    x, idx = inputs
    experts = _check_int_attr(node, "dispatch", attrs, "experts", 1)
    _check_int_attr(node, "dispatch", attrs, "expert", 0, experts - 1)
    _check_routing(node, "dispatch", idx, experts)
    if len(x.shape) != 2 or x.shape[0] != idx.shape[0] or x.dynamic:
        _fail(node, "dispatch", f"tokens must be a static (tokens, d) tensor with as many rows "
                                f"as the routing indices {_dims(idx)}, not {x}")
    tokens, k = idx.shape
    return TensorType(x.shape, x.dtype, True, tokens * k / experts)


def _routed_tokens(idx, expert):
    """Tokens (ascending) routed to ``expert`` and the routing slot of each."""
    hit = idx == expert
    tokens = np.flatnonzero(hit.any(axis=1))
    return tokens, hit[tokens].argmax(axis=1)


def _eval_dispatch(arrays, attrs):
    x, idx = arrays
    tokens, _ = _routed_tokens(idx, attrs["expert"])
    return x[tokens]


def _infer_combine(node, inputs, attrs):
    idx, gate, *ys = inputs
    _check_int_attr(node, "combine", attrs, "shift", 0, 31)
    _check_routing(node, "combine", idx, len(ys))
    if gate.shape != idx.shape:
        _fail(node, "combine", f"gates must have the shape of the routing indices "
                               f"{_dims(idx)}, not {_dims(gate)}")
    tokens = idx.shape[0]
    d = ys[0].shape[1] if len(ys[0].shape) == 2 else None
    for e, y in enumerate(ys):
        if len(y.shape) != 2 or y.shape[1] != d or y.shape[0] > tokens:
            _fail(node, "combine", f"expert output {e} must be (<= {tokens}, {d}), not {y}")
    return TensorType((tokens, d), "int32")


def _eval_combine(arrays, attrs):
    idx, gate, *ys = arrays
    out = np.zeros((idx.shape[0], ys[0].shape[1]), dtype=np.int32)
    for e, y in enumerate(ys):
        tokens, slot = _routed_tokens(idx, e)
        if len(tokens) != len(y):
            raise GraphError(f"expert output {e} has {len(y)} rows but {len(tokens)} tokens "
                             f"were routed to it")
        g = gate[tokens, slot].astype(np.int64)[:, None]
        term = _wrap32(g * y.astype(np.int64)) >> attrs["shift"]
        out[tokens] = _wrap32(out[tokens].astype(np.int64) + term)
    return out


def _work_combine(inputs, out, attrs):
    return out.expected_elements * inputs[0].shape[1]


# integer non-linear ops (I-BERT style; the algorithms are rdakit.compiler.intops)

def _intop_check(node, kind, check, *args):
    try:
        return check(*args)
    except ValueError as e:
        _fail(node, kind, str(e))


def _infer_exp(node, inputs, attrs):
    _intop_check(node, "exp", intops.check_exp, attrs)
    return dataclasses.replace(inputs[0], dtype="int32")


def _infer_softmax(node, inputs, attrs):
    t = inputs[0]
    _intop_check(node, "softmax", intops.check_softmax, attrs, t.shape)
    return dataclasses.replace(t, dtype=intops.softmax_dtype(attrs["out_bits"]))


def _infer_act(kind):
    def infer(node, inputs, attrs):
        _intop_check(node, kind, intops.check_act, kind, attrs)
        return dataclasses.replace(inputs[0], dtype="int32")
    return infer


def _infer_logistic(kind):
    def infer(node, inputs, attrs):
        _intop_check(node, kind, intops.check_logistic, attrs)
        return dataclasses.replace(inputs[0], dtype="int32")
    return infer


def _infer_norm(kind):
    def infer(node, inputs, attrs):
        x, *params = inputs
        c = x.shape[-1]
        for what, t in zip(("weight", "bias")[:len(params)], params, strict=True):
            if t.shape != (c,) or t.dynamic:
                _fail(node, kind, f"{what} must have the shape ({c},) of a row, not {_dims(t)}")
        _intop_check(node, kind, intops.check_norm, kind, attrs, c, params[0].dtype)
        return dataclasses.replace(x, dtype="int32")
    return infer


def _eval_layer_norm(arrays, attrs):
    return intops.layer_norm_ref(*arrays, attrs)


def _eval_rms_norm(arrays, attrs):
    return intops.rms_norm_ref(*arrays, attrs)


def _infer_embedding(node, inputs, attrs):
    table, idx = inputs
    if len(table.shape) != 2 or table.dynamic:
        _fail(node, "embedding", f"the table must be a static (rows, columns) tensor, not "
                                 f"{table}")
    if idx.dtype != "int32":
        _fail(node, "embedding", f"indices must be int32, not {idx.dtype}")
    return TensorType(idx.shape + table.shape[1:], table.dtype, idx.dynamic, idx.expected_rows)


def _work_passes(passes, per_row=0):
    """Lane operations of a kernel of ``passes`` streams over the tensor and ``per_row``
    scalar instructions a row (a scalar instruction counted as one lane operation)."""
    def work(inputs, out, attrs):
        rows = out.expected_elements / max(1, out.shape[-1])
        return out.expected_elements * passes + rows * per_row
    return work


def _binop(fn):
    return lambda arrays, attrs: _wrap32(fn(arrays[0].astype(np.int64),
                                            arrays[1].astype(np.int64)))


def _keep(fn):
    return lambda arrays, attrs: fn(arrays[0], arrays[1]).astype(
        np.result_type(arrays[0].dtype, arrays[1].dtype))


def _no_work(inputs, out, attrs):
    return 0


def _spec(kind, arity, infer, evaluate, work, doc, *, memory=False, min_inputs=1):
    return kind, OpSpec(kind, arity, infer, evaluate, work, memory, doc, min_inputs)


#: Every op kind of the IR, by name. The single definition of their rules.
OP_KINDS = dict([
    _spec("input", 0, _infer_input, None, _no_work,
          "graph input written by the host; attrs shape, dtype, dynamic, expected_rows",
          memory=True),
    _spec("const", 0, _infer_const, lambda a, attrs: attrs["value"], _no_work,
          "constant (weights); attr value (an int8/int16/int32 numpy array)", memory=True),
    _spec("output", 1, _infer_same, lambda a, attrs: a[0], _no_work,
          "graph output read by the host (identity)", memory=True),
    _spec("matmul", 2, _infer_matmul, _eval_matmul, _work_matmul,
          "(M, K) @ (K, N) -> int32 (M, N), accumulated with wraparound"),
    _spec("add", 2, _infer_binary("add", "int32"), _binop(np.add), _elements,
          "elementwise sum, broadcasting, int32 wraparound"),
    _spec("sub", 2, _infer_binary("sub", "int32"), _binop(np.subtract), _elements,
          "elementwise difference, broadcasting, int32 wraparound"),
    _spec("mul", 2, _infer_binary("mul", "int32"), _binop(np.multiply), _elements,
          "elementwise product, broadcasting, int32 wraparound"),
    _spec("max", 2, _infer_binary("max"), _keep(np.maximum), _elements,
          "elementwise maximum, broadcasting"),
    _spec("min", 2, _infer_binary("min"), _keep(np.minimum), _elements,
          "elementwise minimum, broadcasting"),
    _spec("relu", 1, _infer_same, lambda a, attrs: np.maximum(a[0], 0).astype(a[0].dtype),
          _elements, "max(x, 0)"),
    _spec("shr", 1, _infer_shift("shr"), lambda a, attrs: a[0] >> attrs["shift"], _elements,
          "arithmetic right shift by attr shift (fixed-point rescale)"),
    _spec("shl", 1, _infer_shift("shl"),
          lambda a, attrs: _wrap32(a[0].astype(np.int64) << attrs["shift"]), _elements,
          "left shift by attr shift, int32 wraparound"),
    _spec("clip", 1, _infer_clip, _eval_clip, _elements,
          "saturate to [lo, hi] and narrow to attr dtype (default int8 range)"),
    _spec("transpose", 1, _infer_transpose, lambda a, attrs: np.ascontiguousarray(a[0].T),
          _elements, "2-D transpose"),
    _spec("reduce_sum", 1, _infer_reduce("reduce_sum"), _eval_reduce("reduce_sum"), _work_in,
          "sum over attr axis (default -1), kept as size 1, int32 wraparound"),
    _spec("reduce_max", 1, _infer_reduce("reduce_max"), _eval_reduce("reduce_max"), _work_in,
          "maximum over attr axis (default -1), kept as size 1"),
    _spec("slice", 1, _infer_slice, _eval_slice, _elements,
          "x[start:stop] along attr axis"),
    _spec("concat", None, _infer_concat("concat"), _eval_concat, _elements,
          "concatenation along attr axis (default -1)"),
    _spec("append", 2, _infer_concat("append"), _eval_append, _elements,
          "append rows to a growing buffer (KV cache): (T, d), (R, d) -> (T + R, d)"),
    _spec("topk", 1, _infer_topk, _eval_topk, _work_topk,
          "indices of the attr k largest per row, ties to the lower index -> int32"),
    _spec("take", 2, _infer_take, _eval_take, _elements,
          "x[t, idx[t, j]] (take along the last axis)"),
    _spec("dispatch", 2, _infer_dispatch, _eval_dispatch, _elements,
          "rows of x routed to attr expert (of attr experts) by top-k indices; run-time rows"),
    _spec("combine", None, _infer_combine, _eval_combine, _work_combine,
          "out[t] = sum_j (gate[t, j] * y_e[row of t]) >> shift over the experts e = idx[t, j]",
          min_inputs=3),
    _spec("exp", 1, _infer_exp, lambda a, attrs: intops.exp_ref(a[0], attrs),
          _work_passes(10),
          "integer exp of x <= 0 (I-BERT i-exp), int32; attrs mult, shift, clip (exp_params)"),
    _spec("softmax", 1, _infer_softmax, lambda a, attrs: intops.softmax_ref(a[0], attrs),
          _work_passes(16, 300),
          "integer softmax over the last axis (i-exp, one reciprocal a row); attrs mult, "
          "shift, clip, out_bits, causal (softmax_params)"),
    _spec("gelu", 1, _infer_act("gelu"), lambda a, attrs: intops.gelu_ref(a[0], attrs),
          _work_passes(12),
          "integer GELU (I-BERT i-GELU), int32; attrs mult, shift, clip (gelu_params)"),
    _spec("silu", 1, _infer_act("silu"), lambda a, attrs: intops.silu_ref(a[0], attrs),
          _work_passes(12),
          "integer SiLU (x times a polynomial sigmoid), int32; attrs mult, shift, clip "
          "(silu_params)"),
    _spec("sigmoid", 1, _infer_logistic("sigmoid"),
          lambda a, attrs: intops.sigmoid_ref(a[0], attrs), _work_passes(24),
          "integer sigmoid (i-exp of -abs(x), a polynomial reciprocal and a Newton step), "
          "int32 of scale 2^-15; attrs mult, shift, clip (sigmoid_params)"),
    _spec("tanh", 1, _infer_logistic("tanh"), lambda a, attrs: intops.tanh_ref(a[0], attrs),
          _work_passes(23),
          "integer tanh (as sigmoid of 2 abs(x), signed), int32 of scale 2^-14; attrs mult, "
          "shift, clip (tanh_params)"),
    _spec("layer_norm", 3, _infer_norm("layer_norm"), _eval_layer_norm, _work_passes(10, 700),
          "integer LayerNorm over the last axis of x with weight, bias (C,), int32; attrs "
          "shift, frac, eps (layer_norm_params)"),
    _spec("rms_norm", 2, _infer_norm("rms_norm"), _eval_rms_norm, _work_passes(8, 400),
          "integer RMSNorm over the last axis of x with weight (C,), int32; attrs shift, "
          "frac, eps (rms_norm_params)"),
    _spec("embedding", 2, _infer_embedding, lambda a, attrs: intops.embedding_ref(*a),
          _elements,
          "rows of table (V, D) chosen by int32 indices (clamped to [0, V - 1]): "
          "idx.shape + (D,)"),
])

#: Op kinds that are buffers (no computation).
MEMORY_KINDS = frozenset(k for k, s in OP_KINDS.items() if s.memory)


class DataflowGraph:
    """A dataflow graph of integer tensor ops, stored in a networkx ``DiGraph``.

    Each node is an op with attributes ``kind``, ``inputs`` (names of the producers, in operand
    order), ``attrs`` (a dict) and ``index`` (insertion order). After :meth:`validate`, each node
    also has ``type`` (its output :class:`TensorType`) and each edge ``bytes`` (the expected
    bytes of the producer's tensor, counted once even if the consumer reads it twice),
    ``capacity_bytes`` (bytes at the bound) and ``type``.

    Parameters
    ----------
    name : str
        Name of the graph, used in error messages.

    Members
    -------
    nx : networkx.DiGraph
        The graph itself. Edit it only through the methods, which keep ``inputs`` and the edges
        consistent.
    """

    def __init__(self, name="graph"):
        if not isinstance(name, str) or not name:
            raise TypeError(f"Graph name must be a non-empty string, not {name!r}")
        self.name = name
        self.nx = nx.DiGraph(name=name)
        self._counter = 0
        self._validated = False

    def __repr__(self):
        return f"DataflowGraph({self.name!r}, {self.nx.number_of_nodes()} ops)"

    def __len__(self):
        return self.nx.number_of_nodes()

    def __contains__(self, node):
        return node in self.nx

    # --- building -----------------------------------------------------------------------

    def add(self, kind, *inputs, name=None, **attrs):
        """Add an op and return its name.

        Inputs may name ops that do not exist yet (they are checked by :meth:`validate`).

        Raises
        ------
        TypeError
            If ``kind`` or a name is not a string.
        ValueError
            If ``name`` is already used.
        """
        if not isinstance(kind, str):
            raise TypeError(f"Op kind must be a string, not {kind!r}")
        if name is None:
            name = f"{kind}_{self._counter}"
            while name in self.nx and self.nx.nodes[name].get("kind") is not None:
                self._counter += 1
                name = f"{kind}_{self._counter}"
        if not isinstance(name, str) or not name:
            raise TypeError(f"Node name must be a non-empty string, not {name!r}")
        for i in inputs:
            if not isinstance(i, str):
                raise TypeError(f"Inputs of node {name!r} must be node names, not {i!r}")
        if name in self.nx and self.nx.nodes[name].get("kind") is not None:
            raise ValueError(f"Node name {name!r} is already used in graph {self.name!r}")
        self._counter += 1
        self.nx.add_node(name, kind=kind, inputs=tuple(inputs), attrs=dict(attrs),
                         index=self._counter)
        for i in dict.fromkeys(inputs):
            self.nx.add_edge(i, name)
        self._validated = False
        return name

    def input(self, name, shape, dtype="int8", *, dynamic=False, expected_rows=None):
        """Add a graph input (a buffer the host writes)."""
        return self.add("input", name=name, shape=tuple(shape), dtype=dtype, dynamic=dynamic,
                        expected_rows=expected_rows)

    def const(self, name, value):
        """Add a constant tensor (weights)."""
        return self.add("const", name=name, value=np.asarray(value))

    def output(self, name, source):
        """Mark the tensor of ``source`` as a graph output called ``name``."""
        return self.add("output", source, name=name)

    # --- queries ------------------------------------------------------------------------

    def kind(self, node):
        """Op kind of ``node``."""
        return self.nx.nodes[node]["kind"]

    def type_of(self, node):
        """Output :class:`TensorType` of ``node`` (after :meth:`validate`)."""
        self._require_valid()
        return self.nx.nodes[node]["type"]

    def inputs_of(self, node):
        """Names of the producers ``node`` reads, in operand order."""
        return self.nx.nodes[node]["inputs"]

    @property
    def inputs(self):
        """Names of the graph inputs, in insertion order."""
        return [n for n in self.order() if self.kind(n) == "input"]

    @property
    def outputs(self):
        """Names of the graph outputs, in insertion order."""
        return [n for n in self.order() if self.kind(n) == "output"]

    def order(self):
        """Nodes in a topological order that follows insertion order where it can.

        Deterministic (it never depends on hashing): Kahn's algorithm taking the ready node
        inserted first.
        """
        self._require_valid()
        return list(self._order)

    # --- validation ---------------------------------------------------------------------

    def validate(self):
        """Check the graph and annotate types and edge bytes; return ``self``.

        A graph is checked once: a second call returns at once unless an op was added since
        (edit the graph through its methods only).

        Raises
        ------
        GraphError
            For a dangling input (a node reading a name that is not in the graph), an unknown
            op kind, a wrong number of inputs, a cycle, a shape or dtype mismatch or a bad
            attribute. The message names the node (or, for a cycle, the nodes on it).
        """
        if self._validated:
            return self
        g = self.nx
        nodes = dict(g.nodes(data=True))          # name -> its attribute dict
        if not nodes:
            raise GraphError(f"Graph {self.name!r} has no nodes: there is nothing to compute")
        key = {n: (d.get("index", 0), n) for n, d in nodes.items()}
        by_index = sorted(nodes, key=key.__getitem__)
        for n in by_index:
            if nodes[n].get("kind") is None:
                reader = min(g.successors(n), key=key.__getitem__)
                raise GraphError(f"Node {reader!r} reads from {n!r}, which is not a node of "
                                 f"graph {self.name!r}")
        for n in by_index:
            data = nodes[n]
            spec = OP_KINDS.get(data["kind"])
            if spec is None:
                raise GraphError(f"Op kind of node {n!r} must be one of "
                                 f"{', '.join(sorted(OP_KINDS))}, not {data['kind']!r}")
            count = len(data["inputs"])
            if spec.arity is not None and count != spec.arity:
                plural = "s" if spec.arity != 1 else ""
                raise GraphError(f"Node {n!r} ({data['kind']}) must have {spec.arity} "
                                 f"input{plural}, not {count}")
            if spec.arity is None and count < spec.min_inputs:
                raise GraphError(f"Node {n!r} ({data['kind']}) must have at least "
                                 f"{spec.min_inputs} inputs, not {count}")
        order = self._topological_order(key)
        if len(order) < len(nodes):
            cycle = [u for u, _ in nx.find_cycle(g, source=by_index)]
            start = min(range(len(cycle)), key=lambda i: cycle[i])
            cycle = cycle[start:] + cycle[:start] + [cycle[start]]
            raise GraphError(f"Graph {self.name!r} must be acyclic, but has the cycle "
                             f"{' -> '.join(cycle)}")
        for n in order:
            data = nodes[n]
            kind, ins = data["kind"], data["inputs"]
            in_types = [nodes[i]["type"] for i in ins]
            t = OP_KINDS[kind].infer(n, in_types, data["attrs"])
            if not t.elements and kind != "input":
                raise GraphError(f"Node {n!r} ({kind}) has an empty result {_dims(t)}: only a "
                                 f"graph input may have no elements")
            empty = next((i for i, u in zip(ins, in_types, strict=True) if not u.elements),
                         None)
            rows = len(t.shape) == 2 and (kind == "append" or kind == "concat" and data[
                "attrs"].get("axis", -1) % 2 == 0)           # the rows of 2-D tensors
            if empty is not None and not rows:
                raise GraphError(f"Node {n!r} ({kind}) reads {empty!r}, which is empty "
                                 f"{_dims(nodes[empty]['type'])}: only the rows appended or "
                                 f"concatenated to a 2-D tensor may be empty")
            data["type"] = t
        if not any(nodes[n]["kind"] == "output" for n in order):
            raise GraphError(f"Graph {self.name!r} has no output: there is nothing to compute "
                             f"(mark the results with output())")
        for u, _, e in g.edges(data=True):
            t = nodes[u]["type"]
            e["type"] = t
            e["bytes"] = t.expected_nbytes
            e["capacity_bytes"] = t.nbytes
        self._order = order
        self._validated = True
        return self

    def _topological_order(self, key):
        """Kahn's algorithm taking the ready node inserted first (``key``: node -> (index,
        name)), the order networkx's ``lexicographical_topological_sort`` gives, in a fraction
        of its time; shorter than the graph if there is a cycle."""
        g = self.nx
        waiting = dict(g.in_degree())
        ready = [key[n] for n, d in waiting.items() if not d]
        heapq.heapify(ready)
        order = []
        while ready:
            n = heapq.heappop(ready)[1]
            order.append(n)
            for s in g.successors(n):
                waiting[s] -= 1
                if not waiting[s]:
                    heapq.heappush(ready, key[s])
        return order

    def _require_valid(self):
        if not self._validated:
            self.validate()

    # --- semantics ----------------------------------------------------------------------

    def work(self, node):
        """Lane operations ``node`` performs (expected, for dynamic tensors)."""
        self._require_valid()
        data = self.nx.nodes[node]
        spec = OP_KINDS[data["kind"]]
        in_types = [self.nx.nodes[i]["type"] for i in data["inputs"]]
        return spec.work(in_types, data["type"], data["attrs"])

    def evaluate(self, inputs):
        """Run the graph in numpy with its exact integer semantics.

        Parameters
        ----------
        inputs : dict of str to numpy.ndarray
            A value for every graph input, of its dtype and shape (a dynamic input may have
            fewer rows than its bound).

        Returns
        -------
        dict of str to numpy.ndarray
            The value of every output, by output name.

        Raises
        ------
        GraphError
            If an input is missing, unexpected, or of the wrong dtype or shape.
        """
        values = self.values(inputs)
        return {n: values[n] for n in self.outputs}

    def values(self, inputs):
        """Like :meth:`evaluate`, the value of every node (inputs, constants and ops
        included), by node name: a run-time size is the one these inputs give it."""
        self._require_valid()
        values = {}
        expected = set(self.inputs)
        for name in sorted(set(inputs) - expected):
            raise GraphError(f"Graph {self.name!r} has no input {name!r}")
        for n in self._order:
            data = self.nx.nodes[n]
            if data["kind"] == "input":
                if n not in inputs:
                    raise GraphError(f"Input {n!r} of graph {self.name!r} has no value")
                values[n] = self._check_value(n, np.asarray(inputs[n]), data["type"])
                continue
            spec = OP_KINDS[data["kind"]]
            values[n] = spec.evaluate([values[i] for i in data["inputs"]], data["attrs"])
        return values

    def _check_value(self, n, value, t):
        if value.dtype.name != t.dtype:
            raise GraphError(f"Input {n!r} must have dtype {t.dtype}, not {value.dtype.name}")
        ok = value.ndim == len(t.shape) and value.shape[1:] == t.shape[1:] and (
            value.shape[0] <= t.shape[0] if t.dynamic else value.shape[0] == t.shape[0])
        if not ok:
            raise GraphError(f"Input {n!r} must have shape {t}, not {value.shape}")
        return value
