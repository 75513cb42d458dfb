"""Placement of partitions on CU tiles and of buffers on MU tiles of the fabric.

The fabric (:class:`Fabric`) is an ``rows x cols`` grid of tiles at ``(x, y)`` (``x`` the
column, ``y`` the row); by default CUs and MUs alternate in a checkerboard, ``(x + y) % 2 == 0``
being a CU, and any layout can be given instead.

Every partition that holds computation needs its own CU, and no more ops than a CU program
holds. Every *buffer* needs room in one MU: a buffer is a tensor stored in memory, namely each
graph input, constant and output, and each op output read by another partition (inside a
partition, a tensor streams from op to op without a buffer). A buffer's words are those of its
bound (a dynamic tensor reserves its largest size). All traffic goes through buffers: the
producer's CU writes the buffer, each consumer's CU reads it, and a byte moved over ``h`` hops
costs ``h``; the host's writes of inputs and reads of outputs are not counted. The objective is
the hop-weighted traffic
``sum over buffers of bytes * (hops(producer CU, MU) + sum over consumers hops(MU, consumer CU))``
(Manhattan distances: XY routing).

:func:`place` makes a greedy initial placement (partitions by decreasing traffic, each on the
free CU nearest, by traffic, to those already placed, the first in the middle; then buffers by
decreasing traffic, each on the MU with room where it costs least), then improves it by
simulated annealing (moving or swapping partitions between CUs, moving buffers between MUs
or swapping two buffers, under the capacities), deterministic from ``seed``. What cannot fit
raises :class:`PlacementError` naming it: more partitions than CUs, a partition with more ops
than a CU program, an op kind the CUs do not support, a buffer larger than an MU, buffers
beyond the MUs' total capacity, or buffers that cannot be packed into the MUs.
"""

import dataclasses
import math
import random

import networkx as nx
import numpy as np

from rdakit.compiler.graph import MEMORY_KINDS, OP_KINDS, DataflowGraph

__all__ = ["PlacementError", "Fabric", "Buffer", "Placement", "buffers_of", "place",
           "check_placement", "check_host_fit", "check_steps", "MAX_STEPS"]

#: The annealing steps :func:`place` takes at most (``steps``; ``rdakit compile
#: --place-steps``): a step costs O(MUs), about 10-20 us, so a million take tens of seconds
#: (reported through ``progress``), while 20000 (the default) settle the fabrics rdakit builds.
MAX_STEPS = 1_000_000


class PlacementError(ValueError):
    """Something does not fit on the fabric; the message names it."""


def _positive(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TypeError(f"{name} must be a positive integer, not {value!r}")


@dataclasses.dataclass(frozen=True)
class Fabric:
    """The grid of tiles placement targets.

    Parameters
    ----------
    rows, cols : int
        Grid size.
    layout : tuple of str, optional
        One string per row (``y``), one character per column (``x``): ``"C"`` for a CU, ``"M"``
        for an MU. Default: checkerboard with a CU where ``(x + y) % 2 == 0``.
    mu_words : int
        Words of one MU scratchpad.
    word_bytes : int
        Bytes of one word.
    cu_program : int
        Most ops one CU program holds.
    cu_ops : frozenset of str, optional
        Op kinds a CU can run (default: every compute kind of the op table).

    Raises
    ------
    TypeError
        If a size is not a positive integer, or the layout has other characters than C and M.
    ValueError
        If the layout's shape is not ``rows x cols``.
    """

    rows: int = 4
    cols: int = 4
    layout: tuple | None = None
    mu_words: int = 65536
    word_bytes: int = 4
    cu_program: int = 64
    cu_ops: frozenset | None = None
    cluster_cols: int | None = None
    cluster_hops: int = 16

    def __post_init__(self):
        for name in ("rows", "cols", "mu_words", "word_bytes", "cu_program"):
            _positive(name, getattr(self, name))
        if self.layout is None:
            layout = tuple("".join("C" if (x + y) % 2 == 0 else "M" for x in range(self.cols))
                           for y in range(self.rows))
            object.__setattr__(self, "layout", layout)
        else:
            layout = tuple(self.layout)
            if len(layout) != self.rows or any(len(r) != self.cols for r in layout):
                raise ValueError(f"Fabric layout must be {self.rows} rows of {self.cols} tiles, "
                                 f"not {layout!r}")
            if any(c not in "CM" for r in layout for c in r):
                raise TypeError(f"Fabric layout tiles must be 'C' or 'M', not {layout!r}")
            object.__setattr__(self, "layout", layout)
        if self.cu_ops is None:
            object.__setattr__(self, "cu_ops", frozenset(k for k, s in OP_KINDS.items()
                                                         if not s.memory))
        else:
            object.__setattr__(self, "cu_ops", frozenset(self.cu_ops))

    def kind(self, x, y):
        """``"C"`` or ``"M"``: the unit at tile ``(x, y)``."""
        return self.layout[y][x]

    def distance(self, a, b):
        """Hops between tiles ``a`` and ``b``; with ``cluster_cols`` (the clusters of a system
        side by side, ``cluster_cols`` columns each) a pair in different clusters costs
        ``cluster_hops`` more, for the link between them."""
        d = abs(a[0] - b[0]) + abs(a[1] - b[1])
        if self.cluster_cols and a[0] // self.cluster_cols != b[0] // self.cluster_cols:
            d += self.cluster_hops
        return d

    @property
    def cu_tiles(self):
        """CU tiles ``(x, y)``, row by row."""
        return tuple((x, y) for y in range(self.rows) for x in range(self.cols)
                     if self.layout[y][x] == "C")

    @property
    def mu_tiles(self):
        """MU tiles ``(x, y)``, row by row."""
        return tuple((x, y) for y in range(self.rows) for x in range(self.cols)
                     if self.layout[y][x] == "M")

    def spread(self, tiles):
        """Give each tile of ``tiles`` one MU to work from: no MU serves more than
        ``ceil(len(tiles) / MUs)`` of them, and the total of distances plus ``k`` for the
        ``k``-th tile an MU already serves is least (a minimum-cost flow): sharing an MU costs
        as much as one more hop. Picking each tile's nearest MU alone sends several CUs to one
        MU where distances tie (on a 4x4 checkerboard three of eight CUs to one MU, two MUs to
        none) and that MU's one request a cycle then bounds them all. Returns ``{tile: mu}``;
        deterministic."""
        tiles, mus = list(dict.fromkeys(tiles)), self.mu_tiles
        if not mus:
            raise PlacementError(f"The {self} has no MU tile")
        per = -(-len(tiles) // len(mus))
        g = nx.DiGraph()
        g.add_node("s", demand=-len(tiles))
        g.add_node("t", demand=len(tiles))
        for i, t in enumerate(tiles):
            g.add_edge("s", ("tile", i), capacity=1, weight=0)
            for m in mus:
                g.add_edge(("tile", i), ("mu", m), capacity=1, weight=self.distance(t, m))
        for m in mus:            # the k-th tile an MU serves costs k hops more: spread first
            for k in range(per):
                g.add_edge(("mu", m), ("load", m, k), capacity=1, weight=k)
                g.add_edge(("load", m, k), "t", capacity=1, weight=0)
        flow = nx.min_cost_flow(g)
        return {t: next(m for m in mus if flow[("tile", i)][("mu", m)])
                for i, t in enumerate(tiles)}

    def __str__(self):
        return f"{self.rows}x{self.cols} fabric"


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A tensor stored in an MU.

    Members
    -------
    name : str
        The node whose tensor it holds (for an output, the output node).
    words : int
        Words reserved (at the tensor's bound).
    nbytes : int
        Bytes moved per write or read (expected, for dynamic tensors).
    producer : int or None
        Partition writing it (``None``: written by the host).
    consumers : tuple of int
        Partitions reading it.
    """

    name: str
    words: int
    nbytes: int
    producer: int | None
    consumers: tuple


def buffers_of(graph, part_of, word_bytes=4):
    """The buffers of a dataflow graph partitioned by ``part_of`` (node name -> partition)."""
    graph.validate()
    buffers = []
    for n in graph.order():
        kind = graph.kind(n)
        t = graph.type_of(n)
        words = max(1, math.ceil(t.nbytes / word_bytes))
        readers = sorted({part_of[s] for s in graph.nx.successors(n)
                          if graph.kind(s) != "output"})
        if kind in ("input", "const"):
            if readers:
                buffers.append(Buffer(n, words, t.expected_nbytes, None, tuple(readers)))
        elif kind == "output":
            src = graph.inputs_of(n)[0]
            producer = None if graph.kind(src) in MEMORY_KINDS else part_of[src]
            buffers.append(Buffer(n, words, t.expected_nbytes, producer, ()))
        else:
            others = [p for p in readers if p != part_of[n]]
            if others:
                buffers.append(Buffer(n, words, t.expected_nbytes, part_of[n], tuple(others)))
    return buffers


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Where every partition and buffer went.

    Members
    -------
    fabric : Fabric
        The fabric.
    cu_of : dict of int to tuple
        CU tile ``(x, y)`` of each partition that holds computation.
    mu_of : dict of str to tuple
        MU tile of each buffer, by buffer name.
    buffers : tuple of Buffer
        The buffers.
    cost : int
        Hop-weighted traffic (bytes x hops) of this placement.
    initial_cost : int
        The same for the greedy initial placement.
    """

    fabric: Fabric
    cu_of: dict
    mu_of: dict
    buffers: tuple
    cost: int
    initial_cost: int

    def mu_words(self):
        """Words used in each MU tile."""
        used = {t: 0 for t in self.fabric.mu_tiles}
        for b in self.buffers:
            used[self.mu_of[b.name]] += b.words
        return used

    def hops(self, k):
        """Hop distances between the CUs of partitions ``0..k-1`` (partitions without a CU are
        at distance 0 from all), for :func:`~rdakit.compiler.cost.list_schedule`."""
        h = np.zeros((k, k))
        for p, (x1, y1) in self.cu_of.items():
            for q, (x2, y2) in self.cu_of.items():
                if p < k and q < k:
                    h[p, q] = abs(x1 - x2) + abs(y1 - y2)
        return h


def _parts_by_name(graph, parts):
    if hasattr(parts, "assignment"):
        return parts.assignment()
    if isinstance(parts, dict):
        return {n: int(p) for n, p in parts.items()}
    order = graph.validate().order()
    parts = np.asarray(parts)
    if len(parts) != len(order):
        raise PlacementError(f"An assignment of graph {graph.name!r} must have {len(order)} "
                             f"entries, not {len(parts)}")
    return {n: int(p) for n, p in zip(order, parts.tolist(), strict=True)}


def _check_fit(graph, part_of, fabric, buffers):
    ops = {}
    for n in graph.order():
        kind = graph.kind(n)
        if kind in MEMORY_KINDS:
            continue
        if kind not in fabric.cu_ops:
            raise PlacementError(f"Node {n!r} has op kind {kind!r}, which the CUs of the "
                                 f"{fabric} do not support (they run "
                                 f"{', '.join(sorted(fabric.cu_ops))})")
        ops[part_of[n]] = ops.get(part_of[n], 0) + 1
    for p in sorted(ops):
        if ops[p] > fabric.cu_program:
            raise PlacementError(f"Partition {p} has {ops[p]} ops but a CU program holds at "
                                 f"most {fabric.cu_program}")
    cus = fabric.cu_tiles
    if len(ops) > len(cus):
        raise PlacementError(f"{len(ops)} partitions need a CU each but the {fabric} has "
                             f"{len(cus)} CUs")
    _check_words([(b.name, b.words) for b in buffers], fabric)
    return sorted(ops)


def _check_words(words, fabric):
    """Raise :class:`PlacementError` unless buffers of ``words`` (``(name, words)``) can fit
    the MUs of ``fabric``, each in one MU and all together."""
    mus = fabric.mu_tiles
    if words and not mus:
        raise PlacementError(f"{len(words)} buffers need MUs but the {fabric} has none")
    for name, w in words:
        if w > fabric.mu_words:
            raise PlacementError(f"Buffer {name!r} needs {w} words but an MU holds "
                                 f"{fabric.mu_words}")
    total = sum(w for _, w in words)
    if total > len(mus) * fabric.mu_words:
        raise PlacementError(f"Buffers need {total} words in total but the {len(mus)} MUs of "
                             f"the {fabric} hold {len(mus) * fabric.mu_words}")


def check_host_fit(graph, fabric):
    """Refuse, before any partition is searched, a graph whose host buffers alone cannot fit
    the fabric's MUs: the buffers :func:`buffers_of` gives any partition (every graph input and
    constant some op reads, every output), with :func:`place`'s messages. A necessary
    condition, in time linear in the graph.

    Raises
    ------
    PlacementError
        ``Buffers need N words in total but the M MUs of the RxC fabric hold W``, or a buffer
        larger than an MU.
    """
    graph.validate()
    words = []
    for n in graph.order():
        kind = graph.kind(n)
        if kind == "output" or kind in ("input", "const") and any(
                graph.kind(s) != "output" for s in graph.nx.successors(n)):
            words.append((n, max(1, math.ceil(graph.type_of(n).nbytes / fabric.word_bytes))))
    _check_words(words, fabric)


class _State:
    """Placement state with incremental costs (tile indices into the CU and MU lists)."""

    def __init__(self, buffers, cus, mus, parts, mu_words, dist):
        self.buffers, self.cus, self.mus = buffers, cus, mus
        self.dist = dist
        self.index = {p: i for i, p in enumerate(parts)}
        self.parts = parts
        self.mu_words = mu_words
        self.pos = [None] * len(parts)   # CU tile index of each partition
        self.mu = [None] * len(buffers)  # MU tile index of each buffer
        self.free = [mu_words] * len(mus)
        self.fixed = None                # CU tile index of each partition, when fixed

    def buffer_cost(self, j, m=None):
        b = self.buffers[j]
        tile = self.mus[self.mu[j] if m is None else m]
        hops = 0
        if b.producer is not None:
            hops += self.dist(self.cus[self.pos[self.index[b.producer]]], tile)
        for c in b.consumers:
            hops += self.dist(tile, self.cus[self.pos[self.index[c]]])
        return b.nbytes * hops

    def total(self):
        return sum(self.buffer_cost(j) for j in range(len(self.buffers)))


def _greedy(state, rng_order):
    """Greedy initial placement; returns False if a buffer found no MU with room."""
    buffers, cus, mus = state.buffers, state.cus, state.mus
    k = len(state.parts)
    traffic = np.zeros((k, k))
    for b in buffers:
        ends = ([b.producer] if b.producer is not None else []) + list(b.consumers)
        for p in ends:
            for q in ends:
                if p != q:
                    traffic[state.index[p], state.index[q]] += b.nbytes
    volume = traffic.sum(axis=1)
    cx = sum(t[0] for t in cus) / len(cus)
    cy = sum(t[1] for t in cus) / len(cus)
    central = sorted(range(len(cus)), key=lambda i: (abs(cus[i][0] - cx) + abs(cus[i][1] - cy),
                                                       cus[i][1], cus[i][0]))
    used = set()
    placed = []
    for p in sorted(range(k), key=lambda i: (-volume[i], i)):
        if state.fixed is not None:
            state.pos[p] = state.fixed[p]
            placed.append(p)
            continue

        def score(t, p=p):
            return sum(traffic[p, q] * state.dist(cus[t], cus[state.pos[q]]) for q in placed)
        free = [t for t in central if t not in used]
        best = min(free, key=lambda t: (score(t), central.index(t)))
        state.pos[p] = best
        used.add(best)
        placed.append(p)
    order = sorted(range(len(buffers)),
                   key=lambda j: (-buffers[j].nbytes * (len(buffers[j].consumers) + 1),
                                  -buffers[j].words, rng_order[j]))
    for j in order:
        w = buffers[j].words
        options = [m for m in range(len(mus)) if state.free[m] >= w]
        if not options:
            return False
        m = min(options, key=lambda m: (state.buffer_cost(j, m), m))
        state.mu[j] = m
        state.free[m] -= w
    return True


def _first_fit(state):
    """First-fit decreasing packing of the buffers (ignoring traffic)."""
    state.free = [state.mu_words] * len(state.mus)
    for j in sorted(range(len(state.buffers)), key=lambda j: (-state.buffers[j].words, j)):
        w = state.buffers[j].words
        m = next((m for m in range(len(state.mus)) if state.free[m] >= w), None)
        if m is None:
            b = state.buffers[j]
            raise PlacementError(f"Buffer {b.name!r} ({w} words) fits in no MU: the largest "
                                 f"free space left is {max(state.free)} words")
        state.mu[j] = m
        state.free[m] -= w


def _anneal(state, steps, rng, progress=None):
    """Simulated annealing over partition and buffer moves; keeps the best state.
    ``progress("placing", done, steps)`` is called every 1/100 of the steps."""
    nb, k, ncu, nmu = len(state.buffers), len(state.parts), len(state.cus), len(state.mus)
    if steps <= 0 or (nb == 0 and k <= 1):
        return
    occupant = {t: i for i, t in enumerate(state.pos)}
    current = state.total()
    best, best_pos, best_mu = current, list(state.pos), list(state.mu)

    # The cost is a sum over the ends of the buffers (producer and consumers) of bytes times
    # the hops between the end's CU and the buffer's MU, so moving a partition changes it by
    # its per-MU bytes times the change of its hops to each MU: O(MUs) a move instead of a
    # walk over every buffer the partition touches (steps times buffers in all).
    to_mu = np.array([[state.dist(c, m) for m in state.mus] for c in state.cus], np.int64)
    from_mu = np.array([[state.dist(m, c) for m in state.mus] for c in state.cus], np.int64)
    wprod = np.zeros((k, nmu), np.int64)   # bytes partition p writes to buffers in MU m
    wcons = np.zeros((k, nmu), np.int64)   # bytes partition p reads from buffers in MU m

    def account(j, m, sign):
        b = state.buffers[j]
        if b.producer is not None:
            wprod[state.index[b.producer], m] += sign * b.nbytes
        for c in b.consumers:
            wcons[state.index[c], m] += sign * b.nbytes

    for j in range(nb):
        account(j, state.mu[j], 1)

    def moved(p, a, t):
        """Cost change of partition p's ends when it moves from CU a to CU t."""
        return int(wprod[p] @ (to_mu[t] - to_mu[a]) + wcons[p] @ (from_mu[t] - from_mu[a]))

    def propose():
        # Returns (delta, apply) or None.
        r = rng.random()
        if r < 0.4 and k and state.fixed is None:
            p = rng.randrange(k)
            t = rng.randrange(ncu)
            if t == state.pos[p]:
                return None
            q = occupant.get(t)
            old = state.pos[p]
            delta = moved(p, old, t) + (moved(q, t, old) if q is not None else 0)

            def apply():
                state.pos[p] = t
                occupant[t] = p
                if q is not None:
                    state.pos[q] = old
                    occupant[old] = q
                else:
                    del occupant[old]
            return delta, apply
        if nb == 0:
            return None
        j = rng.randrange(nb)
        if r < 0.75 or nb == 1:
            m = rng.randrange(nmu)
            w = state.buffers[j].words
            if m == state.mu[j] or state.free[m] < w:
                return None
            delta = state.buffer_cost(j, m) - state.buffer_cost(j)

            def apply():
                state.free[state.mu[j]] += w
                state.free[m] -= w
                account(j, state.mu[j], -1)
                account(j, m, 1)
                state.mu[j] = m
            return delta, apply
        i = rng.randrange(nb)
        mi, mj = state.mu[i], state.mu[j]
        wi, wj = state.buffers[i].words, state.buffers[j].words
        if mi == mj or state.free[mi] + wi < wj or state.free[mj] + wj < wi:
            return None
        delta = (state.buffer_cost(i, mj) + state.buffer_cost(j, mi)
                 - state.buffer_cost(i) - state.buffer_cost(j))

        def apply():
            state.free[mi] += wi - wj
            state.free[mj] += wj - wi
            account(i, mi, -1)
            account(j, mj, -1)
            account(i, mj, 1)
            account(j, mi, 1)
            state.mu[i], state.mu[j] = mj, mi
        return delta, apply

    # Initial temperature: the mean cost increase of a sample of proposals.
    sample = [d for d, _ in filter(None, (propose() for _ in range(200))) if d > 0]
    t0 = (sum(sample) / len(sample)) if sample else 1.0
    t_end = t0 * 1e-3
    every = max(1, steps // 100)
    for step in range(steps):
        if progress is not None and step % every == 0:
            progress("placing", step, steps)
        temp = t0 * (t_end / t0) ** (step / steps)
        move = propose()
        if move is None:
            continue
        delta, apply = move
        if delta <= 0 or rng.random() < math.exp(-delta / temp):
            apply()
            current += delta
            if current < best:
                best, best_pos, best_mu = current, list(state.pos), list(state.mu)
    state.pos, state.mu = best_pos, best_mu
    state.free = [state.mu_words] * nmu
    for j, m in enumerate(state.mu):
        state.free[m] -= state.buffers[j].words


def _fixed_positions(cu_of, parts_used, fabric):
    """CU tile index of every partition in ``parts_used`` from ``cu_of``; raises
    :class:`PlacementError` naming a partition without a CU tile, or two on one tile."""
    tiles = list(fabric.cu_tiles)
    out = []
    for p in parts_used:
        t = cu_of.get(p)
        if t is None or tuple(t) not in tiles:
            raise PlacementError(f"Partition {p} must be fixed to a CU tile of the {fabric}, "
                                 f"not {t!r}")
        out.append(tiles.index(tuple(t)))
    if len(set(out)) != len(out):
        raise PlacementError("Two partitions are fixed to one CU tile")
    return out


def check_steps(name, steps):
    """Raise ``ValueError`` naming the parameter ``name`` unless ``steps`` is an integer from 0
    to :data:`MAX_STEPS`."""
    if not isinstance(steps, int | np.integer) or isinstance(steps, bool) or not (
            0 <= steps <= MAX_STEPS):
        raise ValueError(f"{name} must be an integer from 0 to {MAX_STEPS}, not {steps!r}")


def place(graph, parts, fabric=None, *, seed=0, steps=20000, cu_of=None, progress=None):
    """Place the partitions of ``graph`` on CUs and its buffers on MUs.

    Parameters
    ----------
    graph : DataflowGraph
        The graph.
    parts : PartitionResult, dict or array
        Partition of every node (a result of :func:`~rdakit.compiler.partition.partition`, a
        dict by node name, or an array in :meth:`DataflowGraph.order`).
    fabric : Fabric, optional
        The fabric (default: 4 x 4 checkerboard).
    seed : int
        Seed of the annealing.
    steps : int
        Annealing steps (0: greedy placement only), at most :data:`MAX_STEPS`.
    cu_of : dict, optional
        Partition -> CU tile ``(x, y)`` for partitions whose CU is fixed (the two-level
        partition of a system of clusters fixes them all); only the buffers move then.
    progress : callable, optional
        ``progress("placing", done, steps)``, called as the annealing goes (100 times).

    Returns
    -------
    Placement

    Raises
    ------
    TypeError
        If ``graph`` is not a :class:`DataflowGraph` (a ``WeightedGraph`` has no buffers to
        place).
    ValueError
        If ``steps`` is not an integer from 0 to :data:`MAX_STEPS`.
    PlacementError
        If something does not fit (see the module documentation).
    """
    check_steps("steps", steps)
    if not isinstance(graph, DataflowGraph):
        raise TypeError(f"place needs a DataflowGraph (its op kinds and buffer sizes decide the "
                        f"CUs and MUs), not a {type(graph).__name__}"
                        + (f" ({graph.name!r} has only weights: partition it, and place the "
                           f"DataflowGraph it was weighed from)"
                           if hasattr(graph, "node_weight") else ""))
    fabric = Fabric() if fabric is None else fabric
    part_of = _parts_by_name(graph, parts)
    buffers = buffers_of(graph, part_of, fabric.word_bytes)
    compute_parts = _check_fit(graph, part_of, fabric, buffers)
    # Host-only buffers (an input read by nobody is skipped) may name partitions without ops.
    ends = {p for b in buffers for p in ([b.producer] if b.producer is not None else [])
            + list(b.consumers)}
    parts_used = sorted(set(compute_parts) | ends)
    if len(parts_used) > len(fabric.cu_tiles):
        raise PlacementError(f"{len(parts_used)} partitions need a CU each but the {fabric} "
                             f"has {len(fabric.cu_tiles)} CUs")
    rng = random.Random(seed)
    state = _State(buffers, fabric.cu_tiles, fabric.mu_tiles, parts_used, fabric.mu_words,
                   fabric.distance)
    if cu_of is not None:
        state.fixed = _fixed_positions(cu_of, parts_used, fabric)
    tie = list(range(len(buffers)))
    if not _greedy(state, tie):
        _first_fit(state)
    initial = state.total()
    _anneal(state, steps, rng, progress)
    cost = state.total()
    return Placement(fabric, {p: state.cus[state.pos[i]] for i, p in enumerate(parts_used)},
                     {b.name: state.mus[state.mu[j]] for j, b in enumerate(buffers)},
                     tuple(buffers), int(cost), int(initial))


def check_placement(placement):
    """Raise :class:`PlacementError` unless every partition is on its own CU tile and every
    buffer on an MU tile of the grid, within the MUs' capacity."""
    fabric = placement.fabric
    tiles = set(placement.cu_of.values())
    if len(tiles) != len(placement.cu_of):
        raise PlacementError("Two partitions share a CU tile")
    for p, (x, y) in sorted(placement.cu_of.items()):
        if not (0 <= x < fabric.cols and 0 <= y < fabric.rows) or fabric.kind(x, y) != "C":
            raise PlacementError(f"Partition {p} is on tile {(x, y)}, which is not a CU")
    for b in placement.buffers:
        x, y = placement.mu_of[b.name]
        if not (0 <= x < fabric.cols and 0 <= y < fabric.rows) or fabric.kind(x, y) != "M":
            raise PlacementError(f"Buffer {b.name!r} is on tile {(x, y)}, which is not an MU")
    for tile, used in sorted(placement.mu_words().items()):
        if used > fabric.mu_words:
            raise PlacementError(f"MU {tile} holds {used} words, more than its "
                                 f"{fabric.mu_words}")
