"""Multilevel Kernighan-Lin / Fiduccia-Mattheyses partitioning.

The classic three phases (Hendrickson and Leland; Karypis and Kumar's METIS):

1. **Coarsening** by heavy-edge matching: every node is matched with the free neighbour of the
   best rating ``w(u, v) / (c(u) c(v))`` (edge weight over the product of node weights, which
   keeps coarse nodes even), and each matched pair is contracted into one node. Matching is a
   vectorized handshake (a pair is matched when each end is the other's best choice; a few
   rounds) followed by a sequential sweep over the nodes left free. Coarse nodes never exceed
   ``1.5 W / N_coarsest`` so that balance stays reachable. Coarsening stops at about
   ``coarsen_to * k`` nodes or when it stalls.
2. **Initial partition** of the coarsest graph by recursive bisection: greedy graph growing
   (a region grown from a random node, always adding the node of best cut gain, until it has its
   share of the work), refined by 2-way FM; the best of ``init_tries`` attempts.
3. **Uncoarsening**: the partition is projected level by level back to the original graph and
   refined at each level by k-way FM under the balance constraint. A pass keeps the boundary
   nodes in a heap keyed by their best move's gain (the part they are most connected to among
   those with room), moves the best one, locks it, updates its neighbours' gains, allows
   moves of negative gain (hill climbing) until ``stall`` moves pass without a new best cut,
   then rolls back to the best cut seen. Passes repeat while they improve. Parts that are over
   their limit (from coarse granularity) are first relieved by moving their boundary nodes of
   best gain to neighbours with room.

Balance: the work of unit ``p`` may not exceed its limit under the balance rule of every
cut-based strategy (:func:`~rdakit.compiler.partition.balance.part_limits`): ``(1 + eps)``
times an even share (loads included), capped by capacity, with a unit of its own for a node
heavier than that share.
Everything is deterministic from ``seed``.
"""

import dataclasses
import heapq
from typing import ClassVar

import numpy as np

from rdakit.compiler.partition.balance import part_limits, part_shares

__all__ = ["MultilevelKL", "coarsen", "refine_kway"]


@dataclasses.dataclass(frozen=True)
class MultilevelKL:
    """Multilevel KL/FM partitioner (see the module documentation).

    Parameters
    ----------
    eps : float
        Balance tolerance.
    seed : int
        Seed of the random choices (tie-breaks, growing seeds).
    coarsen_to : int
        Coarsening stops at about ``coarsen_to * k`` nodes (at least 120).
    max_passes : int
        Most FM passes per level.
    init_tries : int
        Initial bisections tried; the best cut is kept.
    stall : int
        Moves without a new best cut before an FM pass stops.
    """

    name: ClassVar[str] = "multilevel"
    eps: float = 0.03
    seed: int = 0
    coarsen_to: int = 30
    max_passes: int = 8
    init_tries: int = 4
    stall: int = 500

    def __post_init__(self):
        if not isinstance(self.eps, int | float) or not 0 <= self.eps < 10:
            raise TypeError(f"eps must be a number in [0, 10), not {self.eps!r}")
        for field in ("coarsen_to", "max_passes", "init_tries", "stall"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise TypeError(f"{field} must be a positive integer, not {value!r}")

    def partition(self, graph, targets):
        k, n = targets.count, graph.n
        if k == 1 or n == 0:
            return np.zeros(n, dtype=np.int64)
        rng = np.random.default_rng(self.seed)
        indptr, adj, ew = graph.csr
        vw = graph.node_weight
        share = part_shares(graph, targets, self.eps)
        maxw = part_limits(graph, targets, self.eps)
        # METIS's rule: coarsen less for few parts, so coarse nodes stay small against parts.
        goal = max(n // (20 * max(1, int(np.log2(k)))), self.coarsen_to * k, 120)
        levels, maps = coarsen(indptr, adj, ew, vw, goal, rng)
        parts = _initial(levels[-1], share, maxw, self.eps, rng, self.init_tries, self.stall)
        for depth in range(len(levels) - 1, -1, -1):
            if depth < len(levels) - 1:
                parts = parts[maps[depth]]
            level = levels[depth]
            refine_kway(*level, parts, maxw, k, rng, self.max_passes, self.stall,
                        relax=_relax(level, levels[0]))
        return parts


# --- coarsening ----------------------------------------------------------------------------

def _sources(indptr):
    return np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))


def _match(indptr, adj, ew, vw, maxvw, rng):
    """Heavy-edge matching; returns ``mate`` (``mate[u] == u`` for an unmatched node)."""
    n = len(vw)
    src = _sources(indptr)
    vwf = np.maximum(vw, 1).astype(float)
    rating = ew / np.sqrt(vwf[src] * vwf[adj])
    rating = rating * (1 + 1e-6 * rng.random(len(adj)))  # random tie-break
    fits = vw[src] + vw[adj] <= maxvw
    mate = np.full(n, -1, dtype=np.int64)
    for _ in range(8):
        free = mate < 0
        e = fits & free[src] & free[adj]
        if not e.any():
            break
        s, d, r = src[e], adj[e], rating[e]
        order = np.lexsort((-r, s))
        s, d = s[order], d[order]
        first = np.ones(len(s), dtype=bool)
        first[1:] = s[1:] != s[:-1]
        best = np.full(n, -1, dtype=np.int64)
        best[s[first]] = d[first]
        u = np.flatnonzero(best >= 0)
        mutual = u[best[best[u]] == u]
        if len(mutual) == 0:
            break
        mate[mutual] = best[mutual]
    # Sequential sweep over the nodes still free, in random order.
    free_nodes = np.flatnonzero(mate < 0)
    if len(free_nodes):
        rng.shuffle(free_nodes)
        ip, ad, rt, vwl = indptr.tolist(), adj.tolist(), rating.tolist(), vw.tolist()
        m = mate.tolist()
        lonely = []
        for u in free_nodes.tolist():
            if m[u] >= 0:
                continue
            best_v, best_r = -1, -1.0
            for j in range(ip[u], ip[u + 1]):
                v = ad[j]
                if m[v] < 0 and v != u and rt[j] > best_r and vwl[u] + vwl[v] <= maxvw:
                    best_v, best_r = v, rt[j]
            if best_v >= 0:
                m[u], m[best_v] = best_v, u
            elif ip[u] == ip[u + 1]:
                lonely.append(u)
        # Isolated nodes pair with each other (they share no edge, so the cut is unaffected).
        lonely.sort()
        for a, b in zip(lonely[::2], lonely[1::2], strict=False):
            if vwl[a] + vwl[b] <= maxvw:
                m[a], m[b] = b, a
        mate = np.array(m, dtype=np.int64)
    unmatched = mate < 0
    mate[unmatched] = np.flatnonzero(unmatched)
    return mate


def _contract(indptr, adj, ew, vw, mate):
    """Contract matched pairs; return the coarse graph and the map fine -> coarse."""
    n = len(vw)
    ids = np.arange(n)
    rep = np.minimum(ids, mate)
    is_rep = rep == ids
    cid = np.cumsum(is_rep) - 1
    cmap = cid[rep]
    nc = int(is_rep.sum())
    cvw = np.bincount(cmap, weights=vw, minlength=nc).astype(np.int64)
    src = _sources(indptr)
    cs, cd = cmap[src], cmap[adj]
    keep = cs != cd
    key = cs[keep] * nc + cd[keep]
    key, inverse = np.unique(key, return_inverse=True)
    cew = np.bincount(inverse, weights=ew[keep]).astype(np.int64)
    cadj = key % nc
    cindptr = np.zeros(nc + 1, dtype=np.int64)
    np.cumsum(np.bincount(key // nc, minlength=nc), out=cindptr[1:])
    return (cindptr, cadj, cew, cvw), cmap


def coarsen(indptr, adj, ew, vw, goal, rng):
    """Coarsen by heavy-edge matching to about ``goal`` nodes.

    Returns
    -------
    levels : list of tuple
        ``(indptr, adj, edge_weight, node_weight)`` of each level, the original first.
    maps : list of numpy.ndarray
        ``maps[i]`` maps the nodes of level ``i`` to those of level ``i + 1``.
    """
    levels = [(indptr, adj, ew, np.asarray(vw, dtype=np.int64))]
    maps = []
    total = int(np.sum(vw))
    maxvw = max(int(1.5 * total / goal), int(np.max(vw, initial=0)), 1)
    while len(levels[-1][3]) > goal:
        cur = levels[-1]
        mate = _match(*cur, maxvw, rng)
        coarse, cmap = _contract(*cur, mate)
        if len(coarse[3]) > 0.95 * len(cur[3]):
            break
        levels.append(coarse)
        maps.append(cmap)
    return levels, maps


# --- refinement ----------------------------------------------------------------------------

def _boundary(indptr, adj, parts):
    src = _sources(indptr)
    return np.unique(src[parts[src] != parts[adj]])


def _rebalance(indptr, adj, ew, vw, parts, pw, mx, k, rng):
    """Move nodes out of parts above their limit ``mx`` until none is, best gain first.

    A node may go to any part with room: a neighbouring part (gain: its connection there minus
    its connection at home) or else the part with the most room (gain: minus its connection at
    home). Nodes without work never move (that would not help).
    """
    ip, ad, w, vwl = indptr.tolist(), adj.tolist(), ew.tolist(), vw.tolist()
    part = parts.tolist()

    def best(v):
        pv, wv = part[v], vwl[v]
        own, conn = 0, {}
        for u, wj in zip(ad[ip[v]:ip[v + 1]], w[ip[v]:ip[v + 1]], strict=True):
            if part[u] == pv:
                own += wj
            else:
                conn[part[u]] = conn.get(part[u], 0) + wj
        roomiest = min(range(k), key=lambda r: (pw[r] - mx[r], r))
        choices = [(c, -pw[q], q) for q, c in conn.items() if pw[q] + wv <= mx[q]]
        if roomiest != pv and pw[roomiest] + wv <= mx[roomiest]:
            choices.append((conn.get(roomiest, 0), -pw[roomiest], roomiest))
        if not choices:
            return None
        c, _, q = max(choices)
        return c - own, q

    for _ in range(k):
        over = {p for p in range(k) if pw[p] > mx[p]}
        if not over:
            break
        heap = []
        for v in range(len(part)):
            if part[v] in over and vwl[v] > 0:
                m = best(v)
                if m is not None:
                    heap.append((-m[0], v, m[1]))
        heapq.heapify(heap)
        moved = False
        while heap:
            ng, v, q = heapq.heappop(heap)
            pv = part[v]
            if pw[pv] <= mx[pv]:
                continue
            m = best(v)
            if m is None:
                continue
            if m[1] != q or m[0] != -ng:
                heapq.heappush(heap, (-m[0], v, m[1]))
                continue
            part[v] = q
            pw[pv] -= vwl[v]
            pw[q] += vwl[v]
            moved = True
            for u in ad[ip[v]:ip[v + 1]]:
                if part[u] == pv and vwl[u] > 0:
                    m = best(u)
                    if m is not None:
                        heapq.heappush(heap, (-m[0], u, m[1]))
        if not moved:
            break
    parts[:] = part


def _initial_moves(indptr, adj, ew, vw, parts, pw, lim, k):
    """Best move of every boundary node, vectorized: ``(gain, node, target)`` arrays."""
    src = _sources(indptr)
    ps, pa = parts[src], parts[adj]
    cross = ps != pa
    isb = np.zeros(len(vw), dtype=bool)
    isb[src[cross]] = True
    e = isb[src]
    s, q, w = src[e], pa[e], ew[e]
    own = np.bincount(s[q == parts[s]], weights=w[q == parts[s]], minlength=len(vw))
    other = q != parts[s]
    key, inverse = np.unique(s[other] * k + q[other], return_inverse=True)
    conn = np.bincount(inverse, weights=w[other])
    node, target = key // k, key % k
    pwa, lima = np.asarray(pw), np.asarray(lim)
    room = pwa[target] + vw[node] <= lima[target]
    node, target, conn = node[room], target[room], conn[room]
    order = np.lexsort((pwa[target], -conn, node))
    node, target, conn = node[order], target[order], conn[order]
    first = np.ones(len(node), dtype=bool)
    first[1:] = node[1:] != node[:-1]
    node, target, conn = node[first], target[first], conn[first]
    return (conn - own[node]).astype(np.int64), node, target


def refine_kway(indptr, adj, ew, vw, parts, maxw, k, rng, max_passes=8, stall=100, *,
                slack=False, relax=0.0):
    """k-way FM refinement of ``parts`` in place under the limits ``maxw`` (see the module
    documentation). Returns the cut improvement.

    Each node's connection to every adjacent part is kept in a dict, built on first use and
    updated on every move of a neighbour, so a move costs the neighbours' degree times their
    number of adjacent parts rather than the square of the degree.

    With ``slack`` (used for bisections), a move may overfill its target by up to the heaviest
    node's weight, so that heavy coarse nodes can still trade places as in KL's swaps; only
    states where every part is within its limit are kept as the pass's best. Without it, every
    move respects the limits. ``relax`` raises every limit (coarse levels are refined with
    limits raised by how much heavier their nodes are than the original ones, since exact
    balance may be out of reach of heavy nodes; the original graph gets the exact limits).
    """
    pw = np.bincount(parts, weights=vw, minlength=k).tolist()
    mx = [float(x) + relax + 1e-9 for x in maxw]
    if any(pw[p] > mx[p] for p in range(k)):
        _rebalance(indptr, adj, ew, vw, parts, pw, mx, k, rng)
    ip, ad, w, vwl = indptr.tolist(), adj.tolist(), ew.tolist(), vw.tolist()
    n = len(vwl)
    extra = float(max(vwl, default=0)) if slack else 0.0
    lim = [m + extra for m in mx]
    part = parts.tolist()
    conn = [None] * n

    def connections(u):
        c = conn[u]
        if c is None:
            c = {}
            a, b = ip[u], ip[u + 1]
            for x, wj in zip(ad[a:b], w[a:b], strict=True):
                q = part[x]
                c[q] = c.get(q, 0) + wj
            conn[u] = c
        return c

    def best(u):
        c = connections(u)
        pu, wu = part[u], vwl[u]
        best_q, best_c = -1, 0
        for q, cq in c.items():
            if q != pu and cq > 0 and pw[q] + wu <= lim[q] and (
                    cq > best_c or (cq == best_c and pw[q] < pw[best_q])):
                best_q, best_c = q, cq
        return best_c - c.get(pu, 0), best_q

    def move(v, b):
        a = part[v]
        part[v] = b
        pw[a] -= vwl[v]
        pw[b] += vwl[v]
        i, j = ip[v], ip[v + 1]
        for x, wj in zip(ad[i:j], w[i:j], strict=True):
            c = conn[x]
            if c is not None:
                c[a] -= wj
                c[b] = c.get(b, 0) + wj
        return a

    improved = 0
    for _ in range(max_passes):
        gains, nodes, targets = _initial_moves(indptr, adj, ew, vw, parts, pw, lim, k)
        if len(nodes) == 0:
            break
        # Equal gains are taken in a random order.
        tie = rng.permutation(len(nodes))
        heap = list(zip((-gains).tolist(), tie.tolist(), nodes.tolist(), targets.tolist(),
                        [0] * len(nodes), strict=True))
        heapq.heapify(heap)
        tick = len(nodes)
        over = sum(pw[p] > mx[p] for p in range(k))
        allowed = over
        version = [0] * n
        locked = bytearray(n)
        moves = []
        cum = best_cum = 0
        best_len = 0
        while heap:
            ng, _, v, q, ver = heapq.heappop(heap)
            if locked[v] or ver != version[v]:
                continue
            if pw[q] + vwl[v] > lim[q]:
                g, q = best(v)
                if q >= 0:
                    heapq.heappush(heap, (-g, tick, v, q, ver))
                    tick += 1
                continue
            locked[v] = 1
            before = (pw[part[v]] > mx[part[v]]) + (pw[q] > mx[q])
            pv = move(v, q)
            over += (pw[pv] > mx[pv]) + (pw[q] > mx[q]) - before
            cum -= ng
            moves.append((v, pv))
            if over <= allowed and cum > best_cum:
                best_cum, best_len = cum, len(moves)
            elif len(moves) - best_len > stall:
                break
            for u in ad[ip[v]:ip[v + 1]]:
                if not locked[u]:
                    version[u] += 1
                    g2, q3 = best(u)
                    if q3 >= 0:
                        heapq.heappush(heap, (-g2, tick, u, q3, version[u]))
                        tick += 1
        for v, pv in reversed(moves[best_len:]):
            move(v, pv)
        parts[:] = part
        improved += best_cum
        if best_cum <= 0:
            break
    return improved


# --- initial partition ---------------------------------------------------------------------

def _subgraph(indptr, adj, ew, vw, nodes):
    """The subgraph induced by ``nodes`` (sorted), renumbered 0..len(nodes)-1."""
    n = len(vw)
    new = np.full(n, -1, dtype=np.int64)
    new[nodes] = np.arange(len(nodes))
    src = _sources(indptr)
    keep = (new[src] >= 0) & (new[adj] >= 0)
    s, d, w = new[src[keep]], new[adj[keep]], ew[keep]
    sindptr = np.zeros(len(nodes) + 1, dtype=np.int64)
    np.cumsum(np.bincount(s, minlength=len(nodes)), out=sindptr[1:])
    return sindptr, d, w, vw[nodes]


def _peripheral(indptr, adj, start):
    """A node far from ``start``: the last one a breadth-first search reaches, twice."""
    ip, ad = indptr.tolist(), adj.tolist()
    far = start
    for _ in range(2):
        seen = {far}
        frontier = [far]
        while frontier:
            far = frontier[0]
            nxt = []
            for v in frontier:
                for u in ad[ip[v]:ip[v + 1]]:
                    if u not in seen:
                        seen.add(u)
                        nxt.append(u)
            frontier = sorted(nxt)
            if frontier:
                far = frontier[-1]
    return far


def _grow(indptr, adj, ew, vw, target0, rng, start=None):
    """Greedy graph growing: part 0 grown from ``start`` (default: a random node) up to
    ``target0`` work."""
    n = len(vw)
    ip, ad, w, vwl = indptr.tolist(), adj.tolist(), ew.tolist(), vw.tolist()
    deg = np.bincount(_sources(indptr), weights=ew, minlength=n).astype(np.int64).tolist()
    conn = [0] * n
    inside = bytearray(n)
    order = rng.permutation(n).tolist()
    if start is not None:
        order.remove(start)
        order.insert(0, start)
    nxt = 0
    heap = []
    w0 = 0
    while w0 < target0:
        while heap and inside[heap[0][2]]:
            heapq.heappop(heap)
        if not heap:
            while nxt < n and inside[order[nxt]]:
                nxt += 1
            if nxt == n:
                break
            heap.append((0, 0, order[nxt]))
        ng, _, v = heapq.heappop(heap)
        if inside[v]:
            continue
        if -ng != 2 * conn[v] - deg[v]:
            heapq.heappush(heap, (-(2 * conn[v] - deg[v]), v, v))
            continue
        if w0 > 0 and w0 + vwl[v] - target0 > target0 - w0:
            break
        inside[v] = 1
        w0 += vwl[v]
        for j in range(ip[v], ip[v + 1]):
            u = ad[j]
            if not inside[u]:
                conn[u] += w[j]
                heapq.heappush(heap, (-(2 * conn[u] - deg[u]), u, u))
    return np.frombuffer(bytes(inside), dtype=np.uint8).astype(np.int64) ^ 1


def _bisect(graph, frac, eps, rng, tries, stall, floor=(0.0, 0.0)):
    """Multilevel bisection: ``frac`` of the work to side 0, within ``1 + eps`` per side (or
    ``floor``, when larger: what the side's heaviest part may hold)."""
    indptr, adj, ew, vw = graph
    total = float(vw.sum())
    target0 = frac * total
    maxw = np.maximum([(1 + eps) * target0, (1 + eps) * (total - target0)], floor)
    levels, maps = coarsen(indptr, adj, ew, vw, 40, rng)
    top = levels[-1]
    relax = [_relax(level, levels[0]) for level in levels]
    best, best_key = None, None
    for t in range(tries):
        # The first try grows from a peripheral node (best for elongated graphs such as paths),
        # the others from random nodes.
        start = _peripheral(top[0], top[1], int(rng.integers(len(top[3])))) if t == 0 else None
        parts = _grow(*top, target0, rng, start)
        refine_kway(*top, parts, maxw, 2, rng, 6, stall, slack=True, relax=relax[-1])
        pw = np.bincount(parts, weights=top[3], minlength=2)
        over = float(np.maximum(pw - maxw - relax[-1], 0).sum())
        src = _sources(top[0])
        cut = int(top[2][parts[src] != parts[top[1]]].sum())
        key = (0, cut) if over <= 1e-9 else (1, over)
        if best_key is None or key < best_key:
            best, best_key = parts, key
    parts = best
    for depth in range(len(levels) - 2, -1, -1):
        parts = parts[maps[depth]]
        refine_kway(*levels[depth], parts, maxw, 2, rng, 4, stall, slack=True,
                    relax=relax[depth])
    return parts


def _relax(level, finest):
    """How much heavier the nodes of ``level`` are than those of the graph it coarsens."""
    return float(max(0, level[3].max(initial=0) - finest[3].max(initial=0)))


def _initial(graph, share, maxw, eps, rng, tries, stall):
    """Recursive bisection of the coarsest graph into ``len(share)`` parts."""
    k = len(share)
    n = len(graph[3])
    parts = np.zeros(n, dtype=np.int64)
    # Each bisection gets an equal factor of the tolerance: (1 + e)^depth = 1 + eps.
    eps = (1 + eps) ** (1 / max(1, int(np.ceil(np.log2(k))))) - 1
    stack = [(np.arange(n), 0, k)]
    while stack:
        nodes, lo, hi = stack.pop()
        if hi - lo == 1 or len(nodes) == 0:
            parts[nodes] = lo
            continue
        mid = lo + (hi - lo) // 2
        want = share[lo:hi].sum()
        frac = share[lo:mid].sum() / want if want > 0 else (mid - lo) / (hi - lo)
        sub = _subgraph(*graph, nodes)
        side = _bisect(sub, frac, eps, rng, tries, stall,
                       (maxw[lo:mid].max(), maxw[mid:hi].max()))
        stack.append((nodes[side == 0], lo, mid))
        stack.append((nodes[side == 1], mid, hi))
    return parts
