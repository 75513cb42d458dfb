"""Compile a workload for a system of clusters: two-level partition, placement, lowering.

A :class:`~rdakit.hdl.cluster.system.System` is N fabrics (clusters) with one MU address space
in which CUs message each other across clusters too (``docs/clusters.md``). The compiler:

1. partitions the graph across clusters and then onto each cluster's available CUs
   (:func:`~rdakit.compiler.partition.clusters.partition_system`: link crossings against
   balance, each cluster's available CUs and known load as input);
2. lays the clusters side by side as one wide fabric (:class:`SystemView`, cluster ``c``'s tile
   ``(x, y)`` at ``(c * cols + x, y)``), fixes every partition to its cluster's CU and places
   the buffers on that wide grid, so a buffer goes to an MU of the cluster of its producer and
   readers unless they lie in different clusters (a tile of another cluster is at least one
   column further away than every tile of the own one);
3. lowers the placed graph once for the wide fabric with :func:`~rdakit.compiler.lower.lower`:
   :meth:`SystemView.mu_id` gives every tile its real ID (cluster bits included), so the
   programs' MU and CU IDs, and the references the host gets, are the system's; an edge
   between clusters becomes the same references and tokens (``SENDREF``, ``SEND``) as an edge
   inside one, crossing the bridges;
4. splits the result into one bitstream configuration per cluster and host buffers named by
   ``(x, y, cluster)`` (:class:`~rdakit.compiler.job.SystemJob`).
"""

import dataclasses

import numpy as np

from rdakit.compiler.compile import load_workload, placement_fabric
from rdakit.compiler.cost import CostModel
from rdakit.compiler.job import SystemJob
from rdakit.compiler.lower import lower
from rdakit.compiler.partition.clusters import ClusterSpec, LinkModel, partition_system
from rdakit.compiler.placement import place
from rdakit.hdl.spec.bitstream import FabricConfig
from rdakit.hdl.spec.params import FabricParams

__all__ = ["SystemView", "system_view", "compile_system", "CompiledSystem"]


@dataclasses.dataclass(frozen=True)
class SystemView(FabricParams):
    """The clusters of a system side by side, as one fabric ``rows x clusters * cluster_cols``
    for the placement and the lowering; :meth:`mu_id` maps a tile of it to its real ID."""

    cluster_cols: int = 1

    def mu_id(self, x, y, cluster=0):
        c, x = divmod(x, self.cluster_cols)
        return super().mu_id(x, y, cluster + c)

    def split(self, x, y):
        """``(x, y, cluster)`` of the wide grid's tile ``(x, y)``."""
        c, x = divmod(x, self.cluster_cols)
        return x, y, c


def system_view(system_params):
    """The :class:`SystemView` of a :class:`~rdakit.hdl.cluster.system.SystemParams`.

    Raises
    ------
    ValueError
        If the wide grid is too wide (16 columns at most) or the fabric's ``coord_bits`` cannot
        hold its columns (build the fabric with ``coord_bits`` for ``clusters * cols``)."""
    fp, n = system_params.fabric, system_params.clusters
    cols = fp.cols * n
    if cols > 16 or cols > 1 << fp.coord_bits:
        raise ValueError(f"{n} clusters of {fp.cols} columns need coordinates for {cols} "
                         f"columns (at most 16; the fabric's coord_bits = {fp.coord_bits} "
                         f"hold {1 << fp.coord_bits})")
    layout = "/".join("".join(row) * n for row in fp.grid)
    fields = {f.name: getattr(fp, f.name) for f in dataclasses.fields(FabricParams)}
    fields.update(cols=cols, layout=layout)
    return SystemView(**fields, cluster_cols=fp.cols)


@dataclasses.dataclass(eq=False)
class CompiledSystem:
    """A workload compiled for a system.

    Members
    -------
    job : CompiledJob
        The lowering on the :class:`SystemView` (tile coordinates of the wide grid); its
        ``decode`` and ``expected`` apply to the system's outputs.
    system_job : SystemJob
        One configuration per cluster, host buffers at ``(x, y, cluster)``.
    partition : SystemPartition
        The two-level partition and its estimate.
    clusters : tuple of ClusterSpec
    cut_edges : int
        Edges of the lowered graph between nodes of different clusters.
    """

    job: object
    system_job: object
    partition: object
    clusters: tuple
    cut_edges: int

    def row(self):
        """Figures of the compilation for reports."""
        p = self.partition
        return {"partitioner": p.strategy, "estimated_cycles": p.makespan,
                "crossing_bytes": p.crossing_bytes, "cut_edges": self.cut_edges,
                "work": [int(w) for w in p.work],
                "cus_used": [len(set(p.cu[(p.cluster == c) & (p.graph.node_weight > 0)].tolist()))
                             for c in range(len(self.clusters))],
                "loads": [round(float(s.load), 1) for s in self.clusters]}


def compile_system(workload, system_params, *, sizes=None, clusters=None, strategy="greedy",
                   inner="multilevel", seed=0, place_steps=20000, cost=None, inputs=None):
    """Compile ``workload`` for the system ``system_params``.

    Parameters
    ----------
    workload : str, path, Workload or DataflowGraph
        As :func:`~rdakit.compiler.compile.load_workload` takes it.
    system_params : SystemParams
    clusters : sequence of ClusterSpec, optional
        What each cluster offers (default: every CU of every cluster, no load); a cluster's
        ``cus`` is at most its fabric's CUs (the first ``cus`` CU tiles are used).
    strategy, inner : str
        The cross-cluster strategy
        (:data:`~rdakit.compiler.partition.clusters.CLUSTER_STRATEGIES`) and the strategy
        within each cluster (:mod:`~rdakit.compiler.partition`).
    seed, place_steps :
        The buffer placement's annealing.
    cost : CostModel, optional
    inputs : dict, optional
        Input values (default: the workload's sample inputs).

    Returns
    -------
    CompiledSystem

    Raises
    ------
    ValueError
        For bad cluster specs; LoweringError, PlacementError, PartitionError if the workload
        does not fit.
    """
    view = system_view(system_params)
    fp, n = system_params.fabric, system_params.clusters
    cu_tiles = fp.tiles("C")
    if clusters is None:
        clusters = tuple(ClusterSpec(len(cu_tiles)) for _ in range(n))
    clusters = tuple(clusters)
    if len(clusters) != n:
        raise ValueError(f"clusters must give one ClusterSpec per cluster ({n}), "
                         f"not {len(clusters)}")
    for c, spec in enumerate(clusters):
        if not isinstance(spec, ClusterSpec):
            raise TypeError(f"clusters[{c}] must be a ClusterSpec, not {spec!r}")
        if spec.cus > len(cu_tiles):
            raise ValueError(f"cluster {c} offers {spec.cus} CUs but its {fp.rows}x{fp.cols} "
                             f"fabric has {len(cu_tiles)}")
    wl = load_workload(workload, sizes)
    graph = wl.graph
    cost = cost or CostModel(lanes=fp.cu.lanes)
    sp = partition_system(graph, clusters, strategy, inner=inner,
                          link=LinkModel.of_system(system_params), cost=cost)
    names = sp.graph.names or tuple(graph.order())
    base = np.concatenate([[0], np.cumsum([s.cus for s in clusters])]).astype(int)
    part = base[sp.cluster] + sp.cu
    parts = {name: int(p) for name, p in zip(names, part.tolist(), strict=True)}
    cu_of = {}
    for c, spec in enumerate(clusters):
        for i in range(spec.cus):
            x, y = cu_tiles[i]
            cu_of[int(base[c] + i)] = (c * fp.cols + x, y)
    fabric = dataclasses.replace(
        placement_fabric(view, cu_program=max(len(graph), fp.cu.prog_len)),
        cluster_cols=fp.cols)
    placement = place(graph, parts, fabric, seed=seed, steps=place_steps, cu_of=cu_of)
    job = lower(graph, parts, placement, view,
                inputs=wl.inputs if inputs is None else inputs)
    job.workload = wl
    cluster_of = dict(zip(names, sp.cluster.tolist(), strict=True))
    cut_edges = sum(1 for a, b in graph.nx.edges if cluster_of[a] != cluster_of[b])
    return CompiledSystem(job, split_job(job, system_params), sp, clusters, cut_edges)


def split_job(job, system_params):
    """The :class:`~rdakit.compiler.job.SystemJob` of a job lowered on the
    :class:`SystemView` of ``system_params``: each cluster's tiles in a configuration of its
    own, host buffers at ``(x, y, cluster)``."""
    view = job.params
    fp = system_params.fabric
    tiles = [{} for _ in range(system_params.clusters)]
    for xy, tile in job.config.tiles.items():
        x, y, c = view.split(*xy)
        tiles[c][(x, y)] = tile
    buffers = [dataclasses.replace(b, mu=view.split(*b.mu)) for b in job.buffers]
    configs = [FabricConfig(fp, t) if t else None for t in tiles]
    return SystemJob(configs, buffers, list(job.outputs), dict(job.expected),
                     description=job.description)
