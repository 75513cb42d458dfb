"""The lowering's entry point :func:`lower`, and :func:`sample_inputs`."""

import numpy as np

from rdakit.compiler.graph import GraphError
from rdakit.compiler.lower.layout import LoweringError
from rdakit.compiler.lower.lowerer import Lowerer, ProgramTooLong, StreamsRefused
from rdakit.compiler.lower.passes import PIPELINE
from rdakit.compiler.lower.plan import Plan

__all__ = ["lower", "sample_inputs"]


def sample_inputs(graph, seed=0):
    """Deterministic sample inputs for a graph without a workload (small values; a dynamic
    input gets its bound of rows)."""
    rng = np.random.default_rng(seed)
    out = {}
    for n in graph.inputs:
        t = graph.type_of(n)
        out[n] = rng.integers(-8, 8, size=t.shape, dtype=np.int64).astype(t.dtype)
    return out


def _parts_by_name(graph, parts):
    if hasattr(parts, "assignment"):
        return parts.assignment()
    if isinstance(parts, dict):
        return {n: int(p) for n, p in parts.items()}
    order = graph.order()
    parts = np.asarray(parts)
    if len(parts) != len(order):
        raise LoweringError(f"An assignment of graph {graph.name!r} must have {len(order)} "
                            f"entries, not {len(parts)}")
    return {n: int(p) for n, p in zip(order, parts.tolist(), strict=True)}


def lower(graph, parts, placement, params, *, inputs=None, streams=False, passes=PIPELINE):
    """Lower a placed dataflow graph to a job for the fabric ``params`` describes.

    Parameters
    ----------
    graph : DataflowGraph
        The graph (validated here).
    parts : PartitionResult, dict or array
        Partition of every node (as :func:`~rdakit.compiler.placement.place` takes it).
    placement : Placement
        Where the partitions and buffers went; its fabric must have the grid of ``params``.
    params : FabricParams
        The fabric.
    inputs : dict, optional
        Values of the graph inputs (default :func:`sample_inputs`): written into the host
        buffers, and evaluated in numpy for the job's expected outputs.
    streams : bool
        Lower the edges that qualify (:mod:`rdakit.compiler.lower.streams`) as streams
        between CUs instead of buffers in MUs.
    passes : sequence of LoweringPass
        The passes run on the plan, in order (default
        :data:`~rdakit.compiler.lower.passes.PIPELINE`).

    Returns
    -------
    CompiledJob

    Raises
    ------
    LoweringError
        If something does not fit or cannot be lowered; the message names it.
    """
    graph.validate()
    fab = placement.fabric
    if (fab.rows, fab.cols) != (params.rows, params.cols) or tuple(
            "".join(r) for r in params.grid) != tuple(fab.layout):
        raise LoweringError(f"The placement is for a {fab.rows}x{fab.cols} fabric of layout "
                            f"{'/'.join(fab.layout)}, not the {params.rows}x{params.cols} "
                            f"fabric of layout {'/'.join(''.join(r) for r in params.grid)}")
    if params.cu.regs != 16:
        raise LoweringError(f"The lowering needs CUs with 16 registers, not {params.cu.regs}")
    if inputs is None:
        inputs = sample_inputs(graph)
    try:
        graph.evaluate(inputs)
    except GraphError as e:
        raise LoweringError(str(e)) from None
    part_of = _parts_by_name(graph, parts)
    plan = Plan(graph, part_of, placement, params)
    if getattr(parts, "start", None) is not None:
        plan.start = {parts.graph.label(i): float(s) for i, s in enumerate(parts.start)}
    for lowering_pass in passes:
        lowering_pass.apply(plan)
    # Constant pools in each CU's home MU first; when that leaves no MU room for a run-time
    # buffer, where the placement put the constants (they pile up in fewer MUs).
    for pools in ("home", "placement"):
        try:
            return _lower_streams(plan, params, pools, streams, inputs, graph)
        except ProgramTooLong:
            raise
        except LoweringError:
            if pools == "placement":
                raise


#: Lowerings :func:`_lower_tables` may run to size the CUs' reference tables.
MAX_TABLE_PASSES = 8


def _lower_tables(plan, params, pools, streams, refused, inputs, graph):
    """Lower ``plan``, lowering again with room reserved while some CU needs a larger reference
    table than the last lowering reserved. Reserving the room can change what else fits (the
    local buffer's room decides which edges stream and which forms templates take, and so how
    many references a CU holds), so the reservations only grow, each to the largest need
    seen, until a lowering fits in them."""
    tables = {}
    for _ in range(MAX_TABLE_PASSES):
        job = Lowerer(plan, params, tables=tables or None, pools=pools, streams=streams,
                      refused=refused).run(inputs, graph)
        if not isinstance(job, dict):
            return job
        tables = {cu: max(n, tables.get(cu, 0)) for cu, n in {**tables, **job}.items()}
    raise LoweringError(f"The CUs' reference tables did not settle in {MAX_TABLE_PASSES} "
                        f"lowerings (entries last needed: "
                        f"{', '.join(f'CU {cu} {n}' for cu, n in sorted(job.items()))})")


def _lower_streams(plan, params, pools, streams, inputs, graph):
    """Lower ``plan``; the edges between CUs the walk refuses as streams (:class:`StreamsRefused`)
    go through MUs in the next try, until the walk refuses none (each try refuses at least one
    edge more, so there are at most as many tries as edges); a program too long with streams
    is lowered again without any."""
    refused = frozenset()
    while True:
        try:
            return _lower_tables(plan, params, pools, streams, refused, inputs, graph)
        except StreamsRefused as e:
            refused |= e.edges
        except ProgramTooLong:
            if not streams:
                raise
            # A stream's pass can lengthen a program past prog_len: without streams then (and
            # the error, if it comes, is the one without them).
            streams = False
