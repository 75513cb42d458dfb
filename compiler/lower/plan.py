"""The plan: the lowered ops and the tensors they read and write, which the passes rewrite.

A :class:`Plan` starts empty; :class:`~rdakit.compiler.lower.passes.Legalize` fills it from
the graph (one :class:`LOp` per graph node, or a few for a node the CUs do not run directly),
and the later passes of :data:`~rdakit.compiler.lower.passes.PIPELINE` fuse, add and drop ops.
The code generator (:mod:`rdakit.compiler.lower.lowerer`) then walks :attr:`Plan.lops` in
order.
"""

import collections
import dataclasses
import functools

import numpy as np

from rdakit.compiler.lower.layout import LoweringError, TensorLayout, as2d

__all__ = ["Tensor", "LOp", "Plan"]


@dataclasses.dataclass
class Tensor:
    """A tensor of the lowered program and where it lives.

    ``kind`` is ``input`` (host buffer written by the host), ``const`` (in a constant pool),
    ``runtime`` (allocated by its producer) or ``output`` (a host buffer written by a CU, a
    graph output or a KV cache grown in place). ``buffer`` names the buffer (its key)."""

    name: str
    layout: TensorLayout
    kind: str
    buffer: str | None = None
    base: int = 0
    value: np.ndarray | None = None
    producer: str | None = None
    mu_hint: tuple | None = None


@dataclasses.dataclass
class LOp:
    """A lowered op: what one CU runs as one template (``kind``) of the code generator.

    Members
    -------
    name : str
        Its name (a graph node's, or the node's with a suffix such as ``/expand``).
    kind : str
        The template (``matmul_nt``, ``ew``, ``copy``, ...).
    ins : list
        Names of the tensors it reads, in the template's order.
    out : str
        Name of the tensor it writes.
    attrs : dict
        The template's options (``stages`` of an ``ew``, ``start`` of a slice, ...).
    cu : tuple
        ``(x, y)`` of the CU that runs it.
    node : str
        The graph node it implements (the first one, for a fused chain).
    nodes : list
        Every graph node it implements.
    """

    name: str
    kind: str
    ins: list
    out: str
    attrs: dict
    cu: tuple
    node: str
    nodes: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.nodes = self.nodes or [self.node]


class Plan:
    """The lowered ops (:class:`LOp`) of a graph and their tensors, as the passes leave them.

    Members
    -------
    g : DataflowGraph
        The graph.
    part_of : dict
        Node -> partition.
    placement : Placement
        Where partitions and buffers went.
    params : FabricParams
        The fabric.
    tensors : dict
        Name -> :class:`Tensor`, in creation order.
    lops : list
        The ops in a topological order.
    outputs : list
        ``(graph output, tensor it outputs)``.
    output_map : dict
        Graph output -> the host buffer that holds it.
    """

    def __init__(self, graph, part_of, placement, params):
        self.g = graph
        self.part_of = part_of
        self.placement = placement
        self.params = params
        self.lanes = params.cu.lanes
        self.tensors = {}
        self.lops = []
        self.start = {}            # graph node -> start cycle in the partitioner's schedule
        self.outputs = []          # (output name, source tensor)
        self.output_map = {}       # output name -> buffer name
        self.synth = {}            # synthetic constants by name
        cus = params.tiles("C")
        self.mus = params.tiles("M")
        self.first_cu = cus[0]

    def cu_of(self, node):
        """``(x, y)`` of the CU that runs ``node``."""
        part = self.part_of.get(node)
        cu = self.placement.cu_of.get(part)
        if cu is None:
            raise LoweringError(f"Node {node!r} is in partition {part!r}, which the placement "
                                f"did not put on a CU")
        return tuple(cu)

    @functools.cached_property
    def home_mu(self):
        """Each used CU's own MU (:meth:`~rdakit.compiler.placement.Fabric.spread`): near it,
        and no MU the home of more CUs than it must be."""
        cus = sorted({tuple(c) for c in self.placement.cu_of.values()},
                     key=lambda c: (c[1], c[0]))
        return self.placement.fabric.spread(cus) if cus else {}

    def nearest_mus(self, xy):
        """Every MU, nearest to tile ``xy`` first; among MUs at the same distance a CU's
        :attr:`home_mu` first (several CUs that tie between the same MUs then work from
        different ones), then by row, then column."""
        dist = self.placement.fabric.distance
        home = self.home_mu.get(tuple(xy))
        return sorted(self.mus, key=lambda m: (dist(m, xy), m != home, m[1], m[0]))

    def layout(self, name):
        """The :class:`TensorLayout` of tensor ``name``."""
        return self.tensors[name].layout

    def new_tensor(self, name, layout, kind="runtime", **kw):
        """Add tensor ``name`` (see :class:`Tensor` for ``kind`` and ``kw``)."""
        if name in self.tensors:
            raise AssertionError(f"tensor {name!r} defined twice")
        t = Tensor(name, layout, kind, **kw)
        self.tensors[name] = t
        return name

    def const(self, name, value, mu_hint, dtype=None):
        """A synthetic constant (deduplicated by name)."""
        if name in self.synth:
            return name
        v = as2d(value)
        lay = TensorLayout(v.shape[0], v.shape[1], self.lanes, dtype or "int32", False, 2)
        self.new_tensor(name, lay, "const", value=v.astype(np.int64), mu_hint=mu_hint)
        self.synth[name] = True
        return name

    def add_op(self, name, kind, ins, out_layout, node, cu, **attrs):
        """Append an op writing a new run-time tensor of the same name."""
        self.new_tensor(name, out_layout, "runtime", buffer=name, producer=name)
        self.lops.append(LOp(name, kind, list(ins), name, attrs, cu, node))
        return name

    def fail(self, node, kind, message):
        """Raise :class:`LoweringError` for ``node`` of op kind ``kind``."""
        raise LoweringError(f"Node {node!r} ({kind}): {message}")

    def lop_of(self, tensor):
        """The op producing ``tensor`` (None: an input or a constant)."""
        p = self.tensors[tensor].producer
        if p is None:
            return None
        return next(op for op in self.lops if op.name == p)

    def readers(self):
        """Tensor -> the ops reading it, in order."""
        out = collections.defaultdict(list)
        for op in self.lops:
            for i in dict.fromkeys(op.ins):
                out[i].append(op)
        return out
