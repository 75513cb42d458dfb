"""External reference partitioners: METIS (through pymetis) and Mt-KaHyPar.

Both minimize the edge cut under the same balance tolerance ``eps`` as
:class:`~rdakit.compiler.partition.multilevel.MultilevelKL` (METIS's ``ufactor`` is
``1000 * eps``), so their cuts can be compared at equal balance. Unit shares follow
:meth:`Targets.target_weights` (METIS ``tpwgts``; Mt-KaHyPar individual block weights) when
they are not all equal.

pymetis does not check the length of ``vweights`` (a short array makes METIS read past its
end); :func:`metis_part_graph` checks it.
"""

import contextlib
import dataclasses
import os
import sys
import tempfile
from typing import ClassVar

import numpy as np

from rdakit.compiler.partition import PartitionError

__all__ = ["Metis", "MtKaHyPar", "metis_part_graph", "mtkahypar_available"]


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
    return parts


@contextlib.contextmanager
def _c_stdout():
    """Capture what C code prints on file descriptor 1 (METIS prints its complaints, such as
    "Cannot bisect a graph with 0 vertices", there). Yields a function returning the text."""
    text = []
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        yield lambda: ""
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield lambda: "".join(text)
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            text.append(tmp.read().decode(errors="replace").strip())


def _shares(graph, targets):
    """Relative shares of the units, or ``None`` when they are all equal."""
    total = max(graph.total_weight, 1)
    share = targets.target_weights(total) / total
    if np.allclose(share, share[0]):
        return None
    share = np.maximum(share, 1e-6)
    return share / share.sum()


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
        return metis_part_graph(targets.count, indptr, adj, vweights=vw, eweights=ew,
                                tpwgts=_shares(graph, targets),
                                ufactor=max(1, round(1000 * self.eps)), seed=self.seed,
                                recursive=self.recursive)


_MTKAHYPAR = {}


def mtkahypar_available():
    """``None`` if Mt-KaHyPar can be imported, else the reason it cannot."""
    try:
        import mtkahypar  # noqa: F401  (deferred: it may not import; this probes it)
    except ImportError as e:
        return f"mtkahypar cannot be imported: {e}"
    return None


def _mtkahypar(threads):
    reason = mtkahypar_available()
    if reason is not None:
        raise PartitionError(f"The Mt-KaHyPar partitioner is unavailable: {reason} "
                             f"(install the 'mtkahypar' package)")
    import mtkahypar  # deferred: it may not import (probed just above)

    if "init" not in _MTKAHYPAR:
        # Mt-KaHyPar's thread pool can be initialized once per process.
        _MTKAHYPAR["init"] = mtkahypar.initialize(threads, False)
    return mtkahypar, _MTKAHYPAR["init"]


@dataclasses.dataclass(frozen=True)
class MtKaHyPar:
    """Mt-KaHyPar (default preset, cut objective) on the graph.

    Parameters
    ----------
    eps : float
        Balance tolerance.
    seed : int
        Mt-KaHyPar's seed.
    threads : int
        Threads of Mt-KaHyPar's pool (fixed by the first call in a process).
    """

    name: ClassVar[str] = "mtkahypar"
    eps: float = 0.03
    seed: int = 0
    threads: int = 2

    def partition(self, graph, targets):
        mtk, init = _mtkahypar(self.threads)
        k, n = targets.count, graph.n
        if k == 1 or n == 0:
            return np.zeros(n, dtype=np.int64)
        ctx = init.context_from_preset(mtk.PresetType.DEFAULT)
        ctx.set_partitioning_parameters(k, float(self.eps), mtk.Objective.CUT)
        ctx.logging = False
        shares = _shares(graph, targets)
        if shares is not None:
            total = graph.total_weight
            ctx.set_individual_target_block_weights(
                [int(np.ceil((1 + self.eps) * s * total)) for s in shares])
        mtk.set_seed(int(self.seed))
        edges = np.stack([graph.src, graph.dst], axis=1).tolist()
        g = init.create_graph(ctx, n, graph.m, edges, graph.node_weight.tolist(),
                              graph.edge_weight.tolist())
        ph = g.partition(ctx)
        return np.asarray(ph.get_partition(), dtype=np.int64)
