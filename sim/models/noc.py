"""Reference model of the NoC: XY routes, traffic patterns, channel loads and a scoreboard.

* :func:`xy_route` / :func:`xy_path` are dimension-order routing as the router implements it.
* :func:`traffic_matrix` defines each synthetic traffic pattern once, as the probability that a
  packet from tile ``s`` goes to tile ``d``; the cocotb traffic generators sample it and the
  throughput limit is computed from it. The synthesizable harness
  (:mod:`rdakit.sim.verify.noc_harness`) implements the same distributions in hardware.
* :func:`theoretical_limit` is the saturation throughput an ideal router could reach under XY
  routing: the injection rate (flits/node/cycle) at which the most loaded channel (a link, an
  ejection port, or the injection port itself) carries one flit per cycle.
* :class:`NocScoreboard` checks delivery: exactly once, at the right tile, unchanged, and in
  order for each (source, destination) pair; and predicts every router's ``forwarded`` counters
  from the routes of the delivered packets.
"""

import functools
import random
from collections import defaultdict

import numpy as np
from amaranth.lib import data

from rdakit.hdl.spec.flit import PORT_DELTA, Port, flit_layout, pack_flit, unpack_flit
from rdakit.hdl.spec.packets import coord_layout, pack, unpack

__all__ = [
    "PATTERNS", "neighbor_table", "xy_route", "xy_path", "hops", "traffic_matrix", "channel_loads",
    "theoretical_limit", "average_hops", "zero_load_latency", "Destinations",
    "tb_payload_layout", "NocScoreboard",
]

#: Synthetic traffic patterns, in the order of the harness's ``Pattern`` encoding.
PATTERNS = ("uniform", "transpose", "bitcomp", "hotspot", "neighbor")


def neighbor_table(x, y, rows, cols):
    """The four equally likely destinations of the ``neighbor`` pattern from ``(x, y)``: east,
    west, south, north; a step off the mesh goes to the opposite neighbour instead, and to
    ``(x, y)`` itself if that does not exist either."""
    def step(ddx, ddy):
        for sx, sy in ((ddx, ddy), (-ddx, -ddy)):
            if 0 <= x + sx < cols and 0 <= y + sy < rows:
                return x + sx, y + sy
        return x, y
    return [step(1, 0), step(-1, 0), step(0, 1), step(0, -1)]


def xy_route(x, y, dx, dy):
    """The output port XY routing picks at router ``(x, y)`` for destination ``(dx, dy)``."""
    if dx > x:
        return Port.EAST
    if dx < x:
        return Port.WEST
    if dy > y:
        return Port.SOUTH
    if dy < y:
        return Port.NORTH
    return Port.LOCAL


def xy_path(src, dst):
    """The ``((x, y), port)`` hops of a packet from ``src`` to ``dst`` (coordinate pairs),
    ending with the local port of ``dst``."""
    (x, y), path = src, []
    while True:
        p = xy_route(x, y, *dst)
        path.append(((x, y), p))
        if p is Port.LOCAL:
            return path
        ddx, ddy = PORT_DELTA[p]
        x, y = x + ddx, y + ddy


def hops(src, dst):
    """Router-to-router links between ``src`` and ``dst`` under XY routing."""
    return abs(src[0] - dst[0]) + abs(src[1] - dst[1])


def _check_pattern(pattern):
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}, not {pattern!r}")


def traffic_matrix(pattern, rows, cols, *, hotspot=(0, 0), hot_fraction=0.25):
    """``P[s, d]``: probability that a packet of tile ``s`` goes to tile ``d`` (row-major tile
    numbers).

    ``uniform``
        Every tile, the source included, equally likely.
    ``transpose``
        ``(x, y) -> (y mod cols, x mod rows)`` (a true transpose on a square mesh).
    ``bitcomp``
        ``(x, y) -> (cols-1-x, rows-1-y)`` (bit complement on power-of-two sizes).
    ``hotspot``
        Tile ``hotspot`` with probability ``hot_fraction``, otherwise uniform.
    ``neighbor``
        One of east, west, south, north with probability 1/4 each; a step off the mesh is
        reflected to the opposite neighbour, and to the source itself if that does not exist
        either (a mesh one tile wide in that dimension).
    """
    _check_pattern(pattern)
    return _traffic_matrix(pattern, rows, cols, tuple(hotspot), float(hot_fraction)).copy()


@functools.cache
def _traffic_matrix(pattern, rows, cols, hotspot, hot_fraction):
    n = rows * cols
    P = np.zeros((n, n))
    for s in range(n):
        x, y = s % cols, s // cols
        if pattern == "uniform":
            P[s, :] = 1 / n
        elif pattern == "transpose":
            P[s, (x % rows) * cols + (y % cols)] = 1
        elif pattern == "bitcomp":
            P[s, (rows - 1 - y) * cols + (cols - 1 - x)] = 1
        elif pattern == "hotspot":
            hx, hy = hotspot
            if not (0 <= hx < cols and 0 <= hy < rows):
                raise ValueError(f"hotspot must be a tile of the {rows}x{cols} mesh, "
                                 f"not {hotspot!r}")
            if not 0 <= hot_fraction <= 1:
                raise ValueError(f"hot_fraction must be between 0 and 1, not {hot_fraction!r}")
            P[s, :] = (1 - hot_fraction) / n
            P[s, hy * cols + hx] += hot_fraction
        else:  # neighbor
            for d in neighbor_table(x, y, rows, cols):
                P[s, d[1] * cols + d[0]] += 0.25
    return P


def channel_loads(matrix, rows, cols):
    """Flits per cycle on every output channel ``(x, y, port)`` when every tile injects one
    flit per cycle with destinations drawn from ``matrix`` (``LOCAL`` channels are ejection
    ports)."""
    loads = defaultdict(float)
    n = rows * cols
    for s in range(n):
        src = (s % cols, s // cols)
        for d in np.nonzero(matrix[s])[0]:
            dst = (int(d) % cols, int(d) // cols)
            for (x, y), p in xy_path(src, dst):
                loads[x, y, p] += matrix[s, d]
    return dict(loads)


def theoretical_limit(pattern, rows, cols, **kwargs):
    """``(limit, channel)``: the largest injection rate (flits/node/cycle, at most 1) that no
    channel exceeds under XY routing, and the most loaded channel ``(x, y, port)`` (``None``
    when the injection ports are the limit). For uniform traffic on a k×k mesh this is
    ``min(1, 4/k)``."""
    loads = channel_loads(traffic_matrix(pattern, rows, cols, **kwargs), rows, cols)
    channel, worst = max(loads.items(), key=lambda kv: kv[1])
    if worst <= 1 + 1e-12:
        return 1.0, None
    return float(1 / worst), channel


def average_hops(matrix, rows, cols):
    """Mean router-to-router links per packet when every tile injects at the same rate."""
    n = rows * cols
    total = 0.0
    for s in range(n):
        for d in np.nonzero(matrix[s])[0]:
            total += matrix[s, d] * hops((s % cols, s // cols), (int(d) % cols, int(d) // cols))
    return float(total / n)


def zero_load_latency(pattern, rows, cols, **kwargs):
    """Latency without contention, from the injection handshake to the ejection offer:
    one cycle per hop plus two (the source router's queue and the ejection buffer)."""
    return average_hops(traffic_matrix(pattern, rows, cols, **kwargs), rows, cols) + 2


class Destinations:
    """Draws destinations of ``pattern`` for each source tile (seeded, reproducible)."""

    def __init__(self, pattern, rows, cols, *, seed=0, **kwargs):
        self.matrix = traffic_matrix(pattern, rows, cols, **kwargs)
        self.rows, self.cols = rows, cols
        self.rng = random.Random(seed)
        self._cum = [np.cumsum(row) for row in self.matrix]

    def draw(self, src):
        """A destination ``(x, y)`` for source tile number ``src``."""
        cum = self._cum[src]
        d = int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right"))
        d = min(d, len(cum) - 1)
        return d % self.cols, d // self.cols


@functools.cache
def tb_payload_layout(coord_bits, *, seq_bits=16, uid_bits=20):
    """Payload of the testbenches' packets: source tile, sequence number of the (source,
    destination) pair, and a unique packet ID."""
    return data.StructLayout({"src": coord_layout(coord_bits), "seq": seq_bits,
                              "uid": uid_bits})


class NocScoreboard:
    """Expected deliveries of a mesh and their checks.

    :meth:`make` builds the flit of a new packet (a :func:`tb_payload_layout` payload) and
    records what must happen to it: delivery at its destination, or rejection at its source if
    the destination is outside the mesh. :meth:`eject` checks a delivered flit. Any violation
    raises ``AssertionError`` naming the packet.
    """

    def __init__(self, rows, cols, coord_bits):
        self.rows, self.cols = rows, cols
        self.payload = tb_payload_layout(coord_bits)
        self.flit = flit_layout(coord_bits, self.payload)
        self._seq_mask = (1 << self.payload["seq"].width) - 1
        self._uid_mask = (1 << self.payload["uid"].width) - 1
        self._next_uid = 0
        self._assign = defaultdict(int)    # (src, dst) -> next sequence number to hand out
        self._expect = defaultdict(int)    # (src, dst) -> next sequence number to deliver
        self.pending = {}                  # uid -> (src tile, dst tile, flit)
        self.delivered = 0
        self.rejects = defaultdict(int)    # src tile -> flits that must be rejected
        self.forwarded = np.zeros((rows * cols, len(Port)), dtype=np.int64)
        self.latencies = []

    @property
    def n_tiles(self):
        return self.rows * self.cols

    def make(self, src, dst):
        """Flit integer of a new packet from tile number ``src`` to coordinates ``dst``."""
        uid = self._next_uid
        self._next_uid = (uid + 1) & self._uid_mask
        if uid in self.pending:
            raise RuntimeError(f"more than {self._uid_mask + 1} packets in flight")
        sx, sy = src % self.cols, src // self.cols
        dx, dy = dst
        inside = dx < self.cols and dy < self.rows
        seq = 0
        if inside:
            d = dy * self.cols + dx
            seq = self._assign[src, d]
            self._assign[src, d] = (seq + 1) & self._seq_mask
        payload = pack(self.payload, {"src": {"x": sx, "y": sy}, "seq": seq, "uid": uid})
        flit = pack_flit(self.flit, dx, dy, payload)
        if inside:
            self.pending[uid] = (src, d, flit)
        else:
            self.rejects[src] += 1
        return flit

    def eject(self, tile, flit, *, latency=None):
        """Check the flit ``flit`` delivered at tile number ``tile``."""
        dx, dy, payload = unpack_flit(self.flit, flit)
        fields = unpack(self.payload, payload)
        uid = fields["uid"]
        if uid not in self.pending:
            raise AssertionError(f"tile {tile}: packet uid {uid} delivered but not in flight "
                                 f"(duplicate or corrupted): flit {flit:#x}")
        src, d, expected = self.pending.pop(uid)
        if flit != expected:
            raise AssertionError(f"tile {tile}: packet uid {uid} corrupted: got {flit:#x}, "
                                 f"sent {expected:#x}")
        if tile != d:
            raise AssertionError(f"packet uid {uid} from tile {src} for tile {d} delivered "
                                 f"at tile {tile}")
        want = self._expect[src, d]
        if fields["seq"] != want:
            raise AssertionError(f"tile {tile}: packet uid {uid} from tile {src} has sequence "
                                 f"number {fields['seq']}, expected {want} (out of order or "
                                 f"a packet lost)")
        self._expect[src, d] = (want + 1) & self._seq_mask
        self.delivered += 1
        if latency is not None:
            self.latencies.append(latency)
        sxy = (src % self.cols, src // self.cols)
        for (x, y), p in xy_path(sxy, (dx, dy)):
            self.forwarded[y * self.cols + x, p.value] += 1

    @property
    def outstanding(self):
        """Packets injected (inside the mesh) and not delivered yet."""
        return len(self.pending)

    def check_complete(self):
        """Raise ``AssertionError`` if any packet was not delivered."""
        if self.pending:
            some = sorted(self.pending.items())[:5]
            desc = ", ".join(f"uid {u} from tile {s} to tile {d}" for u, (s, d, _f) in some)
            raise AssertionError(f"{len(self.pending)} packets never delivered: {desc}")
