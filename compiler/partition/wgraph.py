"""The graph that partitioners see: a weighted DAG in compact numpy arrays.

A :class:`WeightedGraph` has ``n`` nodes numbered in a topological order (every edge goes from a
lower to a higher index), a weight per node (cycles of work) and a weight per directed edge
(bytes). It keeps the undirected adjacency in CSR form (what cut-based partitioners refine) and
the predecessor and successor lists (what schedulers walk). It is built from a
:class:`~rdakit.compiler.graph.DataflowGraph` through a cost model, or by the synthetic
generators used by the benchmark: 2-D grids, paths, layered chains and random layered DAGs.

Generators that have a known optimal (or reference) cut record it; :meth:`WeightedGraph.known_cut`
returns it.
"""

import dataclasses
import functools
import math

import numpy as np

from rdakit.compiler.cost import CostModel

__all__ = ["WeightedGraph"]


def _as_int_array(name, value, length=None):
    a = np.asarray(value)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"{name} must be a 1-D integer array, not {a.dtype} of shape {a.shape}")
    if length is not None and len(a) != length:
        raise ValueError(f"{name} must have {length} entries, not {len(a)}")
    return a.astype(np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class WeightedGraph:
    """A weighted DAG with nodes in topological order.

    Parameters
    ----------
    name : str
        Name (for tables and error messages).
    node_weight : array of int
        Work of each node (cycles), non-negative.
    src, dst : array of int
        Directed edges ``src[i] -> dst[i]`` with ``src[i] < dst[i]``. Parallel edges are merged
        (their weights summed).
    edge_weight : array of int
        Weight of each edge (bytes), positive.
    names : tuple of str, optional
        Node names (default: the indices).
    family : dict, optional
        How a generator built the graph (``{"kind": "grid", "rows": ..., "cols": ...}``), used
        by :meth:`known_cut`.

    Raises
    ------
    TypeError
        If an array is not a 1-D integer array.
    ValueError
        If lengths disagree, an index is out of range, an edge does not go forward, or a
        weight is negative (node) or not positive (edge).
    """

    name: str
    node_weight: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    edge_weight: np.ndarray
    names: tuple | None = None
    family: dict | None = None

    def __post_init__(self):
        vw = _as_int_array("node_weight", self.node_weight)
        n = len(vw)
        src = _as_int_array("src", self.src)
        dst = _as_int_array("dst", self.dst, len(src))
        ew = _as_int_array("edge_weight", self.edge_weight, len(src))
        if (vw < 0).any():
            i = int(np.flatnonzero(vw < 0)[0])
            raise ValueError(f"Weight of node {self._label(i)!r} must be non-negative, "
                             f"not {vw[i]}")
        if len(src):
            if src.min() < 0 or dst.max() >= n:
                raise ValueError(f"Edge endpoints of graph {self.name!r} must be node indices "
                                 f"0..{n - 1}")
            bad = np.flatnonzero(src >= dst)
            if len(bad):
                i = int(bad[0])
                raise ValueError(f"Edge {src[i]} -> {dst[i]} of graph {self.name!r} must go "
                                 f"from a lower to a higher index (nodes in topological order)")
            if (ew <= 0).any():
                i = int(np.flatnonzero(ew <= 0)[0])
                raise ValueError(f"Weight of edge {src[i]} -> {dst[i]} must be positive, "
                                 f"not {ew[i]}")
            key = src * n + dst
            if len(np.unique(key)) != len(key):
                key, inverse = np.unique(key, return_inverse=True)
                ew = np.bincount(inverse, weights=ew).astype(np.int64)
                src, dst = key // n, key % n
            else:
                order = np.argsort(key, kind="stable")
                src, dst, ew = src[order], dst[order], ew[order]
        if self.names is not None and len(self.names) != n:
            raise ValueError(f"names must have {n} entries, not {len(self.names)}")
        for field, value in (("node_weight", vw), ("src", src), ("dst", dst),
                             ("edge_weight", ew)):
            value.flags.writeable = False
            object.__setattr__(self, field, value)

    def _label(self, i):
        return self.names[i] if self.names is not None else i

    def __repr__(self):
        return f"WeightedGraph({self.name!r}, n={self.n}, m={self.m})"

    @property
    def n(self):
        """Number of nodes."""
        return len(self.node_weight)

    @property
    def m(self):
        """Number of (merged) directed edges."""
        return len(self.src)

    @property
    def total_weight(self):
        """Sum of node weights."""
        return int(self.node_weight.sum())

    def label(self, i):
        """Name of node ``i``."""
        return self._label(int(i))

    # --- adjacency ------------------------------------------------------------------------

    @functools.cached_property
    def csr(self):
        """Undirected adjacency ``(indptr, adj, weight)``; each edge appears in both rows."""
        n = self.n
        s = np.concatenate([self.src, self.dst])
        d = np.concatenate([self.dst, self.src])
        w = np.concatenate([self.edge_weight, self.edge_weight])
        order = np.lexsort((d, s))
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(s, minlength=n), out=indptr[1:])
        return indptr, d[order], w[order]

    @functools.cached_property
    def preds(self):
        """Predecessors ``(indptr, node, edge)``: edges into each node, by edge index."""
        order = np.lexsort((self.src, self.dst))
        indptr = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.dst, minlength=self.n), out=indptr[1:])
        return indptr, self.src[order], order

    @functools.cached_property
    def succs(self):
        """Successors ``(indptr, node, edge)``: edges out of each node, by edge index."""
        indptr = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.src, minlength=self.n), out=indptr[1:])
        return indptr, self.dst, np.arange(self.m)

    # --- measures of an assignment ----------------------------------------------------------

    def cut(self, parts):
        """Sum of the weights of edges whose ends are in different parts."""
        parts = np.asarray(parts)
        return int(self.edge_weight[parts[self.src] != parts[self.dst]].sum())

    def part_weights(self, parts, k):
        """Work in each of ``k`` parts."""
        return np.bincount(np.asarray(parts), weights=self.node_weight, minlength=k)

    def quotient_edges(self, parts):
        """Sorted distinct ``(part_u, part_v)`` pairs of the edges crossing parts."""
        parts = np.asarray(parts)
        pu, pv = parts[self.src], parts[self.dst]
        cross = pu != pv
        pairs = np.unique(np.stack([pu[cross], pv[cross]], axis=1), axis=0)
        return [tuple(int(x) for x in p) for p in pairs]

    def quotient_acyclic(self, parts):
        """Whether the graph of parts (an edge where any edge crosses) has no cycle."""
        edges = self.quotient_edges(parts)
        k = int(np.max(parts)) + 1 if len(parts) else 0
        indeg = [0] * k
        out = [[] for _ in range(k)]
        for a, b in edges:
            out[a].append(b)
            indeg[b] += 1
        ready = [p for p in range(k) if indeg[p] == 0]
        seen = 0
        while ready:
            p = ready.pop()
            seen += 1
            for q in out[p]:
                indeg[q] -= 1
                if indeg[q] == 0:
                    ready.append(q)
        return seen == k

    def critical_path(self):
        """Longest path by node weights (transfers free): a lower bound on any makespan."""
        if self.n == 0:
            return 0
        finish = self.node_weight.astype(np.int64).tolist()
        ip, pn, _ = self.preds
        ip, pn = ip.tolist(), pn.tolist()
        w = self.node_weight.tolist()
        for v in range(self.n):
            a, b = ip[v], ip[v + 1]
            if a != b:
                finish[v] = w[v] + max(finish[u] for u in pn[a:b])
        return int(max(finish))

    # --- known cuts -----------------------------------------------------------------------

    def known_cut(self, k):
        """Known optimal or reference cut into ``k`` balanced parts, or ``None``.

        - path of ``n >= k`` unit edges: ``k - 1`` (optimal: each part boundary cuts an edge).
        - ``rows x cols`` grid: the best block tiling ``a x b = k``, ``(a - 1) * cols +
          (b - 1) * rows`` (optimal for ``k <= 2``: a bisection cuts ``min(rows, cols)``).
        - layered chain of ``layers >= k`` layers of ``width`` nodes, complete between
          consecutive layers: contiguous groups of layers, ``(k - 1) * width**2``.
        """
        fam = self.family or {}
        if k == 1:
            return 0
        if fam.get("kind") == "path" and fam["n"] >= k:
            return k - 1
        if fam.get("kind") == "grid":
            r, c = fam["rows"], fam["cols"]
            best = None
            for a in range(1, k + 1):
                if k % a == 0 and a <= r and k // a <= c:
                    cut = (a - 1) * c + (k // a - 1) * r
                    best = cut if best is None else min(best, cut)
            return best
        if fam.get("kind") == "layered_chain" and fam["layers"] >= k:
            return (k - 1) * fam["width"] ** 2
        return None

    # --- constructors -----------------------------------------------------------------------

    @classmethod
    def from_dataflow(cls, graph, cost=None):
        """Weigh a validated dataflow graph: node weights are op cycles, edge weights bytes.

        Nodes are numbered in :meth:`DataflowGraph.order`; edges that carry 0 bytes (an empty
        cache) weigh 1.
        """
        cost = CostModel() if cost is None else cost
        order = graph.validate().order()
        index = {n: i for i, n in enumerate(order)}
        vw = np.array([cost.op_cycles(graph, n) for n in order], dtype=np.int64)
        edges = sorted((index[u], index[v], max(1, int(d["bytes"])))
                       for u, v, d in graph.nx.edges(data=True))
        e = np.array(edges, dtype=np.int64).reshape(-1, 3)
        return cls(graph.name, vw, e[:, 0], e[:, 1], e[:, 2], names=tuple(order),
                   family={"kind": "dataflow"})

    @classmethod
    def grid(cls, rows, cols):
        """A ``rows x cols`` grid with unit weights, edges rightwards and downwards."""
        idx = np.arange(rows * cols).reshape(rows, cols)
        src = np.concatenate([idx[:, :-1].ravel(), idx[:-1, :].ravel()])
        dst = np.concatenate([idx[:, 1:].ravel(), idx[1:, :].ravel()])
        return cls(f"grid_{rows}x{cols}", np.ones(rows * cols, dtype=np.int64), src, dst,
                   np.ones(len(src), dtype=np.int64),
                   family={"kind": "grid", "rows": rows, "cols": cols})

    @classmethod
    def path(cls, n):
        """A chain of ``n`` nodes with unit weights."""
        return cls(f"path_{n}", np.ones(n, dtype=np.int64), np.arange(n - 1),
                   np.arange(1, n), np.ones(n - 1, dtype=np.int64),
                   family={"kind": "path", "n": n})

    @classmethod
    def layered_chain(cls, layers, width):
        """``layers`` layers of ``width`` nodes, each complete to the next; unit weights."""
        idx = np.arange(layers * width).reshape(layers, width)
        src = np.repeat(idx[:-1], width, axis=1).ravel()
        dst = np.tile(idx[1:], (1, width)).ravel()
        return cls(f"chain_{layers}x{width}", np.ones(layers * width, dtype=np.int64), src, dst,
                   np.ones(len(src), dtype=np.int64),
                   family={"kind": "layered_chain", "layers": layers, "width": width})

    @classmethod
    def random_layered(cls, layers, width, *, degree=3, window=None, seed=0):
        """A random layered DAG: each node reads ``degree`` nodes of the previous layer.

        Predecessors are drawn within ``window`` positions of the node's own position (default
        ``max(degree, width // 8)``), so the graph has locality like real dataflow. Node weights
        are random in 1..16 cycles, edge weights in 1..64 bytes, all from ``seed``.
        """
        rng = np.random.default_rng(seed)
        window = max(degree, width // 8) if window is None else window
        n = layers * width
        pos = np.arange(width)
        src, dst = [], []
        for layer in range(1, layers):
            for _ in range(degree):
                off = rng.integers(-window, window + 1, size=width)
                p = np.clip(pos + off, 0, width - 1)
                src.append((layer - 1) * width + p)
                dst.append(layer * width + pos)
        src = np.concatenate(src) if src else np.zeros(0, dtype=np.int64)
        dst = np.concatenate(dst) if dst else np.zeros(0, dtype=np.int64)
        key = np.unique(src * n + dst)
        src, dst = key // n, key % n
        return cls(f"dag_{layers}x{width}_s{seed}", rng.integers(1, 17, size=n), src, dst,
                   rng.integers(1, 65, size=len(src)),
                   family={"kind": "random_layered", "layers": layers, "width": width})

    @classmethod
    def grid_of_size(cls, nodes):
        """A nearly square grid with about ``nodes`` nodes."""
        rows = max(1, int(round(math.sqrt(nodes))))
        return cls.grid(rows, max(1, int(round(nodes / rows))))
