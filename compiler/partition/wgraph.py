"""The graph that partitioners see: a weighted DAG in compact numpy arrays.

A :class:`WeightedGraph` has ``n`` nodes numbered in a topological order (every edge goes from a
lower to a higher index), a weight per node (cycles of work) and a weight per directed edge
(bytes). It keeps the undirected adjacency in CSR form (what cut-based partitioners refine) and
the predecessor and successor lists (what schedulers walk). It is built from a
:class:`~rdakit.compiler.graph.DataflowGraph` through a cost model, or by the synthetic
generators used by the benchmark: 2-D grids, paths, layered chains and random layered DAGs.

Generators that have a known optimal (or reference) cut record it; :meth:`WeightedGraph.known_cut`
returns it. :meth:`WeightedGraph.transformer` builds graphs shaped like an exported transformer
(a few heavy matmuls, megabyte weight edges).

A user's graph comes in through :meth:`WeightedGraph.from_networkx` or a JSON node-link file
(:func:`load`, the format of ``networkx.node_link_data``). The cost convention: every node has a
``work`` attribute, its work in cycles of one unit (lane operations divided by the unit's
lanes; any one unit for every node will do for the cut and the balance, which are relative,
but the estimated makespan adds transfer cycles of ``bytes / link_bytes``), and every edge a
``bytes`` attribute, the bytes it carries per input. The graph must be acyclic (a dataflow
graph); nodes are renumbered in a topological order (ties by the order they are listed).
"""

import dataclasses
import functools
import json
import math
import pathlib

import networkx as nx
import numpy as np

from rdakit.compiler.cost import CostModel
from rdakit.errors import UserError

__all__ = ["WeightedGraph", "GraphFileError", "load"]


class GraphFileError(UserError, ValueError):
    """A graph (a networkx graph or a JSON node-link file) that does not follow the cost
    convention: the message names the file or graph, and the node or edge."""


def _cost(value, *, positive=False):
    """``value`` as a non-negative (positive) integer, rounded up, or ``None`` if it is not."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        return None
    if not math.isfinite(value) or value < 0 or (positive and value <= 0) or value > 2 ** 62:
        return None
    return int(math.ceil(value))


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
    def from_networkx(cls, g, work="work", bytes="bytes", *, name=None):
        """A weighted graph from a networkx directed acyclic graph (see the module
        documentation for the cost convention).

        Parameters
        ----------
        g : networkx.DiGraph
            The graph; parallel edges of a multigraph are merged (their bytes summed).
        work, bytes : str
            The node attribute holding each node's work (cycles, a number >= 0) and the edge
            attribute holding each edge's bytes (a number > 0); numbers are rounded up.
        name : str, optional
            The graph's name (default ``g.graph["name"]``, else ``"graph"``).

        Raises
        ------
        GraphFileError
            If ``g`` is not directed, has no node, a cycle or a self-loop, or a node or edge
            lacks its attribute or has one that is not such a number.
        """
        name = name or str(g.graph.get("name") or "graph")
        if not isinstance(g, nx.DiGraph):
            raise GraphFileError(f"Graph {name!r} must be a directed graph (networkx "
                                 f"DiGraph), not {type(g).__name__}")
        if g.number_of_nodes() == 0:
            raise GraphFileError(f"Graph {name!r} has no node")
        loops = list(nx.selfloop_edges(g))
        if loops:
            raise GraphFileError(f"Graph {name!r} must be acyclic, but node {loops[0][0]!r} "
                                 f"has an edge to itself")
        listed = {n: i for i, n in enumerate(g.nodes)}
        try:
            order = list(nx.lexicographical_topological_sort(g, key=listed.__getitem__))
        except nx.NetworkXUnfeasible:
            cycle = " -> ".join(repr(u) for u, _ in nx.find_cycle(g))
            raise GraphFileError(f"Graph {name!r} must be acyclic, but has the cycle "
                                 f"{cycle} -> {nx.find_cycle(g)[0][0]!r}") from None
        index = {n: i for i, n in enumerate(order)}
        vw = []
        for n in order:
            value = g.nodes[n].get(work)
            c = _cost(value)
            if c is None:
                got = "no such attribute" if work not in g.nodes[n] else repr(value)
                raise GraphFileError(f"Node {n!r} of graph {name!r} must have a {work!r} "
                                     f"attribute, its work in cycles (a number >= 0), not "
                                     f"{got}")
            vw.append(c)
        edges = []
        for u, v, d in g.edges(data=True):
            value = d.get(bytes)
            c = _cost(value, positive=True)
            if c is None:
                got = "no such attribute" if bytes not in d else repr(value)
                raise GraphFileError(f"Edge {u!r} -> {v!r} of graph {name!r} must have a "
                                     f"{bytes!r} attribute, the bytes it carries (a number "
                                     f"> 0), not {got}")
            edges.append((index[u], index[v], c))
        e = np.array(edges, dtype=np.int64).reshape(-1, 3)
        return cls(name, np.array(vw, dtype=np.int64), e[:, 0], e[:, 1], e[:, 2],
                   names=tuple(str(n) for n in order), family={"kind": "user"})

    @classmethod
    def transformer(cls, layers=2, d_model=768, seq=128, heads=12, *, d_ff=None, experts=0,
                    top_k=2, vocab=8192, lanes=16):
        """An op graph shaped like an exported decoder (GPT-2 style, or Mixtral style with
        ``experts``), one node per op with heads unrolled: a few heavy matmuls (QKV,
        projection, MLP or experts, the LM head), weights as zero-work nodes whose edges carry
        int8 weight matrices (megabytes at ``d_model`` 768), int8 activations, int32 scores.
        Work is lane operations over ``lanes`` (multiply-accumulates for a matmul).
        """
        w, names, e = [], [], []

        def node(name, work, *inputs):
            w.append(int(math.ceil(work / lanes)))
            names.append(name)
            e.extend((src, len(w) - 1, int(nb)) for src, nb in inputs)
            return len(w) - 1

        S, D, dh = seq, d_model, d_model // heads
        d_ff = d_ff or 4 * D

        def linear(name, x, din, dout, rows=S):
            weight = node(f"{name}.weight", 0)
            return node(name, rows * din * dout, (x, rows * din), (weight, din * dout))

        def norm(name, x):
            return node(name, 4 * S * D, (x, S * D), (node(f"{name}.weight", 0), 2 * D))

        x = node("embed", S * D, (node("tokens", 0), 4 * S), (node("embed.weight", 0),
                                                                vocab * D))
        x = node("add_pos", S * D, (x, S * D), (node("pos.weight", 0), S * D))
        for layer in range(layers):
            p = f"l{layer}"
            qkv = linear(f"{p}.qkv", norm(f"{p}.ln1", x), D, 3 * D)
            outs = []
            for h in range(heads):
                q = node(f"{p}.h{h}.q", 0, (qkv, S * dh))
                k = node(f"{p}.h{h}.kT", S * dh, (qkv, S * dh))
                v = node(f"{p}.h{h}.v", 0, (qkv, S * dh))
                s = node(f"{p}.h{h}.qk", S * S * dh, (q, S * dh), (k, S * dh))
                a = node(f"{p}.h{h}.softmax", 4 * S * S, (s, 4 * S * S))
                outs.append(node(f"{p}.h{h}.av", S * S * dh, (a, S * S), (v, S * dh)))
            cat = node(f"{p}.heads", S * D, *[(o, S * dh) for o in outs])
            x = node(f"{p}.res1", S * D, (x, S * D), (linear(f"{p}.out", cat, D, D), S * D))
            h2 = norm(f"{p}.ln2", x)
            if experts:
                gate = node(f"{p}.topk", 4 * S * experts,
                            (linear(f"{p}.router", h2, D, experts), 4 * S * experts))
                rows = max(1, S * top_k // experts)
                ys = []
                for j in range(experts):
                    xe = node(f"{p}.e{j}.dispatch", rows * D, (h2, S * D), (gate, 4 * S * top_k))
                    a1 = linear(f"{p}.e{j}.w1", xe, D, d_ff, rows)
                    a3 = linear(f"{p}.e{j}.w3", xe, D, d_ff, rows)
                    s1 = node(f"{p}.e{j}.silu", 3 * rows * d_ff, (a1, rows * d_ff))
                    m = node(f"{p}.e{j}.mul", rows * d_ff, (s1, rows * d_ff), (a3, rows * d_ff))
                    y = linear(f"{p}.e{j}.w2", m, d_ff, D, rows)
                    ys.append(node(f"{p}.e{j}.gate", rows * D, (y, rows * D),
                                   (gate, 4 * S * top_k)))
                y = node(f"{p}.combine", S * D * top_k, *[(q, rows * D) for q in ys])
            else:
                f1 = linear(f"{p}.fc1", h2, D, d_ff)
                y = linear(f"{p}.fc2", node(f"{p}.gelu", 8 * S * d_ff, (f1, S * d_ff)),
                           d_ff, D)
            x = node(f"{p}.res2", S * D, (x, S * D), (y, S * D))
        linear("head", norm("lnf", x), D, vocab)
        a = np.array(e, dtype=np.int64)
        kind = "moe" if experts else "gpt"
        return cls(f"{kind}_l{layers}_d{D}_s{S}" + (f"_e{experts}" if experts else ""),
                   np.array(w, dtype=np.int64), a[:, 0], a[:, 1], a[:, 2], names=tuple(names),
                   family={"kind": "transformer"})

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


def load(path):
    """A :class:`WeightedGraph` from a JSON node-link file (``networkx.node_link_data`` of a
    directed graph: ``{"directed": true, "nodes": [{"id": ..., "work": ...}], "edges" (or
    "links"): [{"source": ..., "target": ..., "bytes": ...}]}``; see the module documentation
    for the cost convention). Its name is the file's stem unless ``"graph": {"name": ...}``
    gives one.

    Raises
    ------
    GraphFileError
        Naming the file and what is wrong: it cannot be read, is not JSON, is not a directed
        node-link graph (``directed`` false, no ``nodes``, an edge naming a node that is not
        listed, a node listed twice) or breaks the cost convention.
    """
    path = pathlib.Path(path)
    where = f"Graph file {str(path)!r}"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise GraphFileError(f"{where} cannot be read: {getattr(e, 'strerror', None) or e}") \
            from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise GraphFileError(f"{where} is not JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise GraphFileError(f"{where} must hold a JSON object with a 'nodes' list (networkx "
                             f"node-link data)")
    links = "edges" if "edges" in data else "links"
    if not isinstance(data.get(links, []), list):
        raise GraphFileError(f"{where}: {links!r} must be a list")
    if data.get("directed") is not True:
        raise GraphFileError(f"{where} must hold a directed graph (\"directed\": true), a "
                             f"dataflow graph")
    ids = []
    for i, nd in enumerate(data["nodes"]):
        if not isinstance(nd, dict) or "id" not in nd:
            raise GraphFileError(f"{where}: node {i} must be an object with an 'id'")
        try:
            hash(nd["id"])
        except TypeError:
            raise GraphFileError(f"{where}: node {i} has the id {nd['id']!r}, which is not a "
                                 f"string or a number") from None
        ids.append(nd["id"])
    seen = set()
    for n in ids:
        if n in seen:
            raise GraphFileError(f"{where}: node {n!r} is listed twice")
        seen.add(n)
    for j, ed in enumerate(data.get(links, [])):
        if not isinstance(ed, dict) or "source" not in ed or "target" not in ed:
            raise GraphFileError(f"{where}: edge {j} must be an object with a 'source' and a "
                                 f"'target'")
        for end in ("source", "target"):
            try:
                known = ed[end] in seen
            except TypeError:
                known = False
            if not known:
                raise GraphFileError(f"{where}: edge {j} has the {end} {ed[end]!r}, which is "
                                     f"not a node of the file")
    name = (data.get("graph") or {}).get("name") if isinstance(data.get("graph"), dict) \
        else None
    g = nx.MultiDiGraph() if data.get("multigraph") else nx.DiGraph()
    for nd in data["nodes"]:
        g.add_node(nd["id"], **{k: v for k, v in nd.items() if k != "id"})
    for ed in data.get(links, []):
        attrs = {k: v for k, v in ed.items() if k not in ("source", "target", "key")}
        if not g.is_multigraph() and g.has_edge(ed["source"], ed["target"]):
            raise GraphFileError(f"{where}: the edge {ed['source']!r} -> {ed['target']!r} is "
                                 f"listed twice (give one edge its total bytes)")
        g.add_edge(ed["source"], ed["target"], **attrs)
    if g.is_multigraph():
        merged = nx.DiGraph()
        merged.add_nodes_from(g.nodes(data=True))
        for u, v, d in g.edges(data=True):
            b = _cost(d.get("bytes"), positive=True)
            if b is None:
                raise GraphFileError(f"{where}: edge {u!r} -> {v!r} must have a 'bytes' "
                                     f"attribute, the bytes it carries (a number > 0), not "
                                     f"{d.get('bytes', 'no such attribute')!r}")
            old = merged.edges[u, v]["bytes"] if merged.has_edge(u, v) else 0
            merged.add_edge(u, v, bytes=old + b)
        g = merged
    try:
        return WeightedGraph.from_networkx(g, name=str(name or path.stem))
    except GraphFileError as e:
        raise GraphFileError(f"{where}: {e}") from None
