"""External reference partitioners: METIS (through pymetis) and Mt-KaHyPar.

Both minimize the edge cut under the balance rule of every cut-based strategy
(:func:`~rdakit.compiler.partition.balance.part_limits`, tolerance ``eps``), so their cuts
can be compared at equal balance: METIS gets the limits as target shares (``tpwgts``, each
unit's limit over their sum) with ``ufactor = 1000 * eps``; Mt-KaHyPar gets them as its
individual block weights (its maximum block weights).

pymetis does not check the length of ``vweights`` (a short array makes METIS read past its
end); :func:`metis_part_graph` checks it. METIS prints its complaints ("Cannot bisect a graph
with 0 vertices") with C's buffered ``printf``: they are flushed and captured, and raised as
:class:`~rdakit.compiler.partition.PartitionWarning` (:func:`partition` puts them in the
result). Mt-KaHyPar's weights are 32-bit: graphs whose work or bytes would overflow them
(megabyte edges of a large model) are scaled down for it, which only rounds them.
Mt-KaHyPar runs its deterministic preset by default: its default preset on two threads gives
a different partition at every call.
"""

import contextlib
import ctypes
import dataclasses
import os
import sys
import tempfile
import warnings
from typing import ClassVar

import numpy as np

from rdakit.compiler.partition import PartitionError, PartitionWarning
from rdakit.compiler.partition.balance import part_limits

__all__ = ["Metis", "MtKaHyPar", "metis_part_graph", "mtkahypar_missing"]


def metis_part_graph(nparts, indptr, adj, *, vweights=None, eweights=None, tpwgts=None,
                     ufactor=30, seed=0, recursive=None):
    """Call ``pymetis.part_graph`` on a CSR graph after checking every array's length.

    Raises
    ------
    ValueError
        If ``vweights`` does not have one entry per node, ``eweights`` one per adjacency entry,
        or ``tpwgts`` one per part.
    """
    import pymetis  # deferred: a compiled extension only the metis strategy needs

    n = len(indptr) - 1
    if vweights is not None and len(vweights) != n:
        raise ValueError(f"vweights must have one entry per node ({n}), not {len(vweights)}")
    if eweights is not None and len(eweights) != len(adj):
        raise ValueError(f"eweights must have one entry per adjacency entry ({len(adj)}), "
                         f"not {len(eweights)}")
    if tpwgts is not None and len(tpwgts) != nparts:
        raise ValueError(f"tpwgts must have one entry per part ({nparts}), not {len(tpwgts)}")
    if nparts == 1 or n == 0:
        return np.zeros(n, dtype=np.int64)
    opts = pymetis.Options(ufactor=int(ufactor), seed=int(seed))
    kw = {}
    if vweights is not None:
        kw["vweights"] = np.ascontiguousarray(vweights, dtype=np.int64).tolist()
    if eweights is not None:
        kw["eweights"] = np.ascontiguousarray(eweights, dtype=np.int64).tolist()
    if tpwgts is not None:
        kw["tpwgts"] = [float(x) for x in tpwgts]
    with _c_stdout() as said:
        result = pymetis.part_graph(nparts, pymetis.CSRAdjacency(indptr.tolist(), adj.tolist()),
                                    options=opts, recursive=recursive, **kw)
    parts = np.asarray(result.vertex_part, dtype=np.int64)
    if len(parts) != n or (n and (parts.min() < 0 or parts.max() >= nparts)):
        raise PartitionError(f"METIS failed to partition {n} nodes into {nparts} parts: "
                             f"{said()!r}")
    _warn("METIS", said())
    return parts


def _warn(backend, text):
    """Raise what a backend printed as one :class:`PartitionWarning` (nothing if silent)."""
    lines = [" ".join(line.strip(" *\t").split()) for line in text.splitlines()]
    lines = list(dict.fromkeys(line for line in lines if line))
    if lines:
        warnings.warn(f"{backend} said: {'; '.join(lines)}", PartitionWarning, stacklevel=3)


def _flush_c_stdio():
    """Flush C's stdio buffers (a ``printf`` stays there until then, so it would be written
    after the capture ended)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _c_stdout():
    """Capture what C code prints on file descriptor 1 (METIS prints its complaints, such as
    "Cannot bisect a graph with 0 vertices", there). Yields a function returning the text.

    The descriptor is 1 itself, C's stdout, whatever Python's ``sys.stdout`` is (under pytest
    or a notebook it has no descriptor, and the capture was skipped, the text lost)."""
    text = []
    fd = 1
    try:
        sys.stdout.flush()
        os.fstat(fd)
    except (AttributeError, OSError, ValueError):
        yield lambda: ""
        return
    _flush_c_stdio()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield lambda: "".join(text)
        finally:
            _flush_c_stdio()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            text.append(tmp.read().decode(errors="replace").strip())


def _limits(graph, targets, eps):
    """The balance rule's limits (work only), or ``None`` when they are ``(1 + eps)`` times
    the average, with no load (the backends' own ``eps`` is then the same rule)."""
    limits = part_limits(graph, targets, eps)
    if np.allclose(limits, (1 + eps) * graph.total_weight / targets.count) \
            and not targets.loads.any():
        return None
    return limits


def _scale(values, budget=2 ** 30):
    """A divisor that brings the sum of ``values`` within ``budget`` (1 if it is already)."""
    return max(1.0, float(np.sum(values)) / budget)


@dataclasses.dataclass(frozen=True)
class Metis:
    """METIS k-way (or recursive bisection for ``k <= 8``, pymetis's default) via pymetis.

    Parameters
    ----------
    eps : float
        Balance tolerance (``ufactor = 1000 * eps``).
    seed : int
        METIS's seed.
    recursive : bool or None
        Force recursive bisection (``True``) or k-way (``False``); ``None``: pymetis's choice.
    """

    name: ClassVar[str] = "metis"
    eps: float = 0.03
    seed: int = 0
    recursive: bool | None = None

    def partition(self, graph, targets):
        indptr, adj, ew = graph.csr
        vw = graph.node_weight if graph.total_weight > 0 else None
        limits = _limits(graph, targets, self.eps) if vw is not None else None
        shares, ufactor = None, self.eps
        if limits is not None:
            # METIS allows part i (1 + ufactor / 1000) * tpwgts[i] * W: the limit itself.
            limits = np.maximum(limits, 1e-9)
            shares = limits / limits.sum()
            ufactor = max(self.eps, limits.sum() / max(graph.total_weight, 1) - 1)
        return metis_part_graph(targets.count, indptr, adj, vweights=vw, eweights=ew,
                                tpwgts=shares, ufactor=max(1, round(1000 * ufactor)),
                                seed=self.seed, recursive=self.recursive)


_MTKAHYPAR = {}


def mtkahypar_missing():
    """Why Mt-KaHyPar cannot be imported, or ``None`` when it can."""
    try:
        import mtkahypar  # noqa: F401  (deferred: it may not import; this probes it)
    except ImportError as e:
        return f"mtkahypar cannot be imported: {e}"
    return None


def _mtkahypar(threads):
    reason = mtkahypar_missing()
    if reason is not None:
        raise PartitionError(f"The Mt-KaHyPar partitioner is unavailable: {reason} "
                             f"(install the 'mtkahypar' package)")
    import mtkahypar  # deferred: it may not import (probed just above)

    if "init" not in _MTKAHYPAR:
        # Mt-KaHyPar's thread pool can be initialized once per process.
        _MTKAHYPAR["init"] = mtkahypar.initialize(threads, False)
    return mtkahypar, _MTKAHYPAR["init"]


#: Mt-KaHyPar presets by the names :class:`MtKaHyPar` takes.
PRESETS = ("deterministic", "default", "quality", "highest_quality")


@dataclasses.dataclass(frozen=True)
class MtKaHyPar:
    """Mt-KaHyPar (cut objective) on the graph.

    Parameters
    ----------
    eps : float
        Balance tolerance.
    seed : int
        Mt-KaHyPar's seed.
    threads : int
        Threads of Mt-KaHyPar's pool (fixed by the first call in a process).
    preset : str
        One of :data:`PRESETS`; only ``deterministic`` gives the same partition at every call
        (the others race between threads).
    """

    name: ClassVar[str] = "mtkahypar"
    eps: float = 0.03
    seed: int = 0
    threads: int = 2
    preset: str = "deterministic"

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"Mt-KaHyPar preset must be one of {', '.join(PRESETS)}, not "
                             f"{self.preset!r}")

    def partition(self, graph, targets):
        mtk, init = _mtkahypar(self.threads)
        k, n = targets.count, graph.n
        if k == 1 or n == 0:
            return np.zeros(n, dtype=np.int64)
        ctx = init.context_from_preset(getattr(mtk.PresetType, self.preset.upper()))
        ctx.set_partitioning_parameters(k, float(self.eps), mtk.Objective.CUT)
        ctx.logging = False
        limits = _limits(graph, targets, self.eps)
        # 32-bit weights: node weights and limits share one divisor, edge weights another.
        node_div = _scale(np.maximum(part_limits(graph, targets, self.eps), 0))
        vw = np.round(graph.node_weight / node_div).astype(np.int64)
        if limits is not None:
            caps = np.floor(limits / node_div).astype(np.int64)
            # Rounding may leave the limits short of the rounded work; give it back.
            caps[np.argmax(caps)] += max(0, int(vw.sum() - caps.sum()))
            ctx.set_individual_target_block_weights(caps.tolist())
        ew = np.maximum(np.round(graph.edge_weight / _scale(graph.edge_weight)), 1)
        mtk.set_seed(int(self.seed))
        edges = np.stack([graph.src, graph.dst], axis=1).tolist()
        with _c_stdout() as said:
            try:
                g = init.create_graph(ctx, n, graph.m, edges, vw.tolist(),
                                      ew.astype(np.int64).tolist())
                parts = np.asarray(g.partition(ctx).get_partition(), dtype=np.int64)
            except (mtk.InvalidInputError, mtk.InvalidParameterError,
                    mtk.UnsupportedOperationError, mtk.SystemError) as e:
                raise PartitionError(f"Mt-KaHyPar failed to partition graph {graph.name!r} "
                                     f"into {k} parts: {e}") from None
        _warn("Mt-KaHyPar", said())
        return parts
