"""The compiler pipeline: workload -> partition -> placement -> lowering -> job and bitstream.

:func:`compile_workload` is what ``rdakit compile`` (and later ``rdakit run``) calls::

    workload (a built-in name with size options, a Python file, a Workload or a graph)
        -> partition onto the fabric's CUs (any strategy of compiler.partition.STRATEGIES)
        -> place (partitions on CU tiles, buffers on MU tiles)
        -> lower (CU programs, host buffers, reference and weight passing)
        -> CompiledJob + CompileSummary

:func:`bitstream_for` writes the bitstream of a job with the references its host buffers get
on a freshly reset fabric (:func:`~rdakit.compiler.lower.replay_refs`).
"""

import dataclasses
import pathlib

import numpy as np

from rdakit.compiler.cost import CostModel
from rdakit.compiler.graph import OP_KINDS, DataflowGraph
from rdakit.compiler.lower import LoweringError, lower, replay_refs, sample_inputs
from rdakit.compiler.lower.passes import PIPELINE
from rdakit.compiler.partition import (
    STRATEGIES,
    PartitionError,
    Targets,
    as_weighted,
    check_strategy,
    measure,
    partition,
)
from rdakit.compiler.placement import Fabric, PlacementError, check_host_fit, check_steps, place
from rdakit.compiler.split import split_graph
from rdakit.compiler.workloads import WORKLOADS, Workload, build, load_graph
from rdakit.hdl.spec.bitstream import write_bitstream

__all__ = ["CompileSummary", "compile_workload", "placement_fabric", "bitstream_for",
           "load_workload", "unused", "check_split", "FASTEST", "PARTITIONERS", "ORDERS"]

#: ``partitioner="fastest"``: the job is compiled with each of these strategies and the one
#: with the fewest cycles is kept (the first on ties): cycles of :func:`compile_workload`'s
#: ``rank`` when it is given, else estimated cycles. A cut is not a makespan:
#: on the README main job the multilevel partition cuts the fewest bytes and greedy's runs the
#: fastest (docs/compiler.md). Mt-KaHyPar is left out: its answers differ from run to run, and
#: a compile should not.
FASTEST = ("multilevel", "greedy", "metis", "heft")

#: What :func:`compile_workload` accepts as ``order``: each CU's ops in the graph's order, in
#: the list schedule's, or candidates in both.
ORDERS = ("graph", "schedule", "auto")

#: What :func:`compile_workload` accepts as ``partitioner``: a strategy, or ``"fastest"``.
PARTITIONERS = (*STRATEGIES, "fastest")


@dataclasses.dataclass
class CompileSummary:
    """What ``rdakit compile`` prints.

    Members
    -------
    graph : str
        Graph name.
    nodes : int
        Nodes of the graph.
    partitioner : str
        Strategy name.
    parts : int
        Partitions holding computation (= CUs with a program).
    cut : int
        Bytes on edges between partitions.
    imbalance : float
        Heaviest partition over the average, minus 1.
    estimated_cycles : int
        The cost model's makespan with the placement's hop distances.
    lower_bound : float
        The cost model's lower bound on the makespan.
    instructions : dict
        ``(x, y)`` of each CU -> program length.
    mu_buffers : dict
        ``(x, y)`` of each MU -> ``(host buffers, bound words, bound slots)``.
    unused : tuple of str
        Nodes of the workload's graph no output reads (in graph order): they are left out of
        the programs (an unread input gets no buffer), and :meth:`lines` says so. A split
        graph's own leftovers (the constants it replaced by their column blocks) are left out
        too, without a word: the user's graph reads them.
    partition_warnings : tuple of str
        What the partitioner's backend said (:attr:`PartitionResult.warnings`), printed as
        warnings.
    split : int
        Row blocks of the split ops (1: none; :func:`~rdakit.compiler.split.split_rows`).
    split_nodes : int
        Nodes of the graph after splitting (``nodes`` is the graph's own).
    order : str
        The order of each CU's ops (``"graph"`` or ``"schedule"``, :func:`compile_workload`).
    ranked : tuple
        When several candidates were compiled (``partitioner="fastest"``, ``split="auto"`` or
        ``order="auto"``) and ranked by a run (:func:`compile_workload`'s ``rank``): ``(how,
        cycles, candidates, by_estimate)``, what ranked them, the kept job's cycles there, how
        many were ranked, and the cycles there of the one the estimate would have kept; else
        ``()``.
    """

    graph: str
    nodes: int
    partitioner: str
    parts: int
    cut: int
    imbalance: float
    estimated_cycles: int
    lower_bound: float
    instructions: dict
    mu_buffers: dict
    unused: tuple = ()
    partition_warnings: tuple = ()
    split: int = 1
    split_nodes: int = 0
    ranked: tuple = ()
    order: str = "graph"

    def how(self):
        """How the job was compiled: ``partitioner X`` and the row split and op order when they
        are not the default."""
        rows = f", rows split {self.split} ways ({self.split_nodes} nodes)" if self.split > 1 \
            else ""
        order = ", ops in schedule order" if self.order == "schedule" else ""
        return f"partitioner {self.partitioner}{rows}{order}"

    def lines(self):
        """The summary as text lines."""
        out = [f"graph {self.graph}: {self.nodes} nodes, {self.how()}",
               f"parts {self.parts}, cut {self.cut} bytes, imbalance {self.imbalance:.3f}, "
               f"estimated cycles {self.estimated_cycles} (lower bound "
               f"{self.lower_bound:.0f})"]
        out += self.ranked_lines()
        for cu, n in sorted(self.instructions.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            out.append(f"  CU {cu}: {n} instructions")
        for mu, (host, words, slots) in sorted(self.mu_buffers.items(),
                                               key=lambda kv: (kv[0][1], kv[0][0])):
            names = ", ".join(host) if host else "-"
            out.append(f"  MU {mu}: host buffers {names}; at most {words} words in {slots} "
                       f"buffers")
        return out + self.warnings()

    def ranked_lines(self):
        """How the job was kept among several candidates, when a run ranked them: a line."""
        if not self.ranked:
            return []
        how, cycles, n, by_estimate = self.ranked
        other = "the same" if by_estimate == cycles else f"{by_estimate} cycles there"
        return [f"kept by {how}: {cycles} cycles, the fewest of {n} candidates (the fewest "
                f"estimated cycles: {other})"]

    def warnings(self):
        """The lines of the summary that warn (``warning: ...``): what a command prints even
        when it prints nothing else of the summary."""
        out = [f"warning: partitioner {self.partitioner}: {w}" for w in self.partition_warnings]
        if not self.unused:
            return out
        shown = ", ".join(repr(n) for n in self.unused[:8])
        more = f" and {len(self.unused) - 8} more" if len(self.unused) > 8 else ""
        return out + [f"warning: {len(self.unused)} nodes read by no output are left out: "
                      f"{shown}{more}"]


def unused(graph):
    """The nodes of ``graph`` that no output reads, directly or not (in graph order)."""
    seen = set(graph.outputs)
    todo = list(seen)
    while todo:
        for p in graph.nx.predecessors(todo.pop()):
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return tuple(n for n in graph.order() if n not in seen)


def placement_fabric(params, cu_program=None):
    """The :class:`~rdakit.compiler.placement.Fabric` of a :class:`FabricParams`: its grid,
    MU words of ``4 * lanes`` bytes (placement's sizes are estimates; the lowering checks the
    exact ones)."""
    return Fabric(params.rows, params.cols, tuple("".join(r) for r in params.grid),
                  mu_words=params.mu.words, word_bytes=4 * params.cu.lanes,
                  cu_program=cu_program or params.cu.prog_len)


def load_workload(workload, sizes=None):
    """A :class:`Workload` from a built-in name (with ``sizes`` options), a Python file, a
    saved torch.export program (``.pt2``: the imported graph with its quantized example inputs),
    a Workload or a DataflowGraph (sample inputs from
    :func:`~rdakit.compiler.lower.sample_inputs`). The sample inputs are made when first used
    (:attr:`Workload.inputs`), so a size no fabric holds is refused before they exist."""
    sizes = dict(sizes or {})
    if isinstance(workload, Workload):
        return workload
    if isinstance(workload, DataflowGraph):
        graph = workload.validate()
    elif isinstance(workload, str | pathlib.Path) and str(workload).lower().endswith(".pt2"):
        # deferred: the torch.export front end (its sample inputs are the quantized examples)
        from rdakit.compiler.frontend.importer import load_workload as load_program_workload

        if sizes:
            raise ValueError("size options apply to built-in workloads, not to .pt2 programs")
        return load_program_workload(workload)
    elif isinstance(workload, str | pathlib.Path) and str(workload) in WORKLOADS:
        return build(str(workload), **sizes)
    elif isinstance(workload, str | pathlib.Path) and (
            str(workload).endswith(".py") or pathlib.Path(workload).exists()):
        if sizes:
            raise ValueError("size options apply to built-in workloads, not to graph files")
        graph = load_graph(workload)
    else:
        raise ValueError(f"Workload must be one of {', '.join(sorted(WORKLOADS))} or a Python "
                         f"file, not {str(workload)!r}")
    return Workload(graph.name, graph, lambda: sample_inputs(graph),
                    lambda i: graph.evaluate(i), {})


def compile_workload(workload, *, sizes=None, params, partitioner="multilevel", seed=0,
                     place_steps=20000, inputs=None, cost=None, schedule_cost=None,
                     order="graph", progress=None, split=None, streams=True, rank=None,
                     first_fit=False, passes=None):
    """Compile a workload for a fabric.

    Parameters
    ----------
    workload : str, path, Workload or DataflowGraph
        See :func:`load_workload`.
    sizes : dict, optional
        Options of a built-in workload builder (``batch``, ``d_model``, ``tokens``, ...).
    params : FabricParams
        The fabric.
    partitioner : str
        A name of :data:`~rdakit.compiler.partition.STRATEGIES`, or ``"fastest"``: each of
        :data:`FASTEST`, keeping the job with the fewest estimated cycles.
    seed : int
        Seed of the placement's annealing.
    place_steps : int
        Annealing steps of the placement, from 0 to
        :data:`~rdakit.compiler.placement.MAX_STEPS`.
    inputs : dict, optional
        Input values (default: the workload's sample inputs).
    cost : CostModel, optional
        What the partitioner balances. Default: ``CostModel(lanes=params.cu.lanes)``.
    schedule_cost : CostModel, optional
        What the placed assignment is list-scheduled with (default ``cost``) for the summary's
        estimated cycles.
    order : str
        The order of each CU's ops: ``"graph"`` (the graph's topological order; the estimate
        schedules in that order too), ``"schedule"`` (by start cycle in the list schedule by
        upward rank, :class:`~rdakit.compiler.lower.passes.ScheduleOrder`) or ``"auto"``
        (candidates in both orders, kept as ``partitioner="fastest"`` keeps them).
    progress : callable, optional
        ``progress(stage, done=None, total=None)``, called at each stage (``"partitioning"``,
        ``"placing"``, ``"lowering"``) and as the placement's annealing goes (``done`` of
        ``total`` steps), for a command line to show.
    split : int or "auto", optional
        Row blocks of the graph's row-wise chains (:func:`~rdakit.compiler.split.split_rows`;
        1: none), or ``"auto"``: compiled unsplit and split over the fabric's CUs and over
        half of them, keeping the job with the fewest cycles (``rank``'s, else the estimates;
        the unsplit one on ties). Default: ``"auto"``
        with ``partitioner="fastest"``, else 1.
    streams : bool
        Lower the edges between CUs that qualify as streams between CUs (a producer's words
        straight into the consumer's input queue; :mod:`rdakit.compiler.lower.streams`);
        ``False``: every edge through an MU buffer.
    rank : callable, optional
        How candidates are ranked when there are several (``partitioner="fastest"``,
        ``split="auto"`` or ``order="auto"``): ``rank(job)`` gives a candidate's cycles, or
        ``None`` when it cannot tell (then the estimates rank them all); ``rank.name`` says
        what it is for the summary. A rank with ``bounded = True`` is called ``rank(job,
        bound=cycles)`` and may return any figure above ``bound`` (not ``None``) for a job it
        finds slower than that, without finishing its run. Default: the estimates (a few
        tens of % off on real graphs, where a run of the performance model, which only a
        layer above the compiler has, is within a few %:
        ``rdakit.sim.runtime.events.ModelRank``).
    first_fit : bool
        With several candidates, compile them in order only until one compiles, and return
        it unranked: whether the workload fits the fabric at all (``--fabric auto``), which
        the full compilation answers alike (it passes over the candidates that do not fit).
    passes : sequence of LoweringPass, optional
        The lowering's passes (default :data:`~rdakit.compiler.lower.passes.PIPELINE`).

    Returns
    -------
    (CompiledJob, CompileSummary)

    Raises
    ------
    ValueError
        If an option is not one of its values (the message names it), before any work.
    LoweringError, PlacementError, PartitionError
        If the workload does not fit; the message names what does not. The host buffers
        (inputs, constants, outputs) are checked against the MUs before any partition is
        searched (:func:`~rdakit.compiler.placement.check_host_fit`), and the sample inputs
        are made only once the graph has been placed.
    """
    if split is None:
        split = "auto" if partitioner == "fastest" else 1
    check_split(split)
    if not isinstance(streams, bool):
        raise ValueError(f"streams must be True or False, not {streams!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(map(repr, ORDERS))}, not {order!r}")
    if partitioner == "fastest" or split == "auto" or order == "auto":
        return _fastest(workload, sizes=sizes, params=params, seed=seed,
                        place_steps=place_steps, inputs=inputs, cost=cost,
                        schedule_cost=schedule_cost, order=order, progress=progress,
                        strategies=FASTEST if partitioner == "fastest" else (partitioner,),
                        split=split, streams=streams, rank=rank, first_fit=first_fit,
                        passes=passes)
    check_strategy(partitioner)
    check_steps("place_steps", place_steps)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, not {seed!r}")
    progress = progress or (lambda stage, done=None, total=None: None)
    wl = load_workload(workload, sizes)
    graph = wl.graph if split == 1 else split_graph(wl.graph, split, lanes=params.cu.lanes)
    fabric = placement_fabric(params, cu_program=max(len(graph), params.cu.prog_len))
    check_host_fit(graph, fabric)
    cost = cost or CostModel(lanes=params.cu.lanes)
    schedule_cost = schedule_cost or cost
    cus = params.tiles("C")
    progress("partitioning")
    result = fuse_chains(graph, partition(graph, Targets(len(cus)), partitioner, cost=cost),
                         cost)
    progress("placing")
    placement = place(graph, result, fabric, seed=seed, steps=place_steps, progress=progress)
    progress("lowering")
    # The placed assignment's list schedule: the estimate, in the order the CUs will run.
    wg = result.graph if schedule_cost is cost else as_weighted(graph, schedule_cost)
    placed = measure(wg, result.targets, result.parts, schedule_cost,
                     strategy=result.strategy, hops=placement.hops(len(cus)),
                     order=np.arange(wg.n) if order == "graph" else None)
    job = lower(graph, placed if order == "schedule" else result.parts, placement, params,
                inputs=wl.inputs if inputs is None else inputs, streams=streams,
                passes=PIPELINE if passes is None else passes)
    if job.streamed:
        # The edges the lowering sent as streams overlap their two ends: the estimate again.
        placed = measure(wg, result.targets, result.parts, schedule_cost,
                         strategy=result.strategy, hops=placement.hops(len(cus)),
                         order=np.arange(wg.n) if order == "graph" else None,
                         streamed=[wg.names[u] in job.streamed for u in wg.src.tolist()])
    summary = CompileSummary(
        graph=graph.name, nodes=len(wl.graph), partitioner=result.strategy,
        parts=len(job.programs), cut=int(result.cut), imbalance=float(result.imbalance),
        estimated_cycles=schedule_cost.estimate(placed.makespan),
        lower_bound=float(result.lower_bound),
        instructions={cu: p.instructions for cu, p in job.programs.items()},
        mu_buffers={mu: (u["host_buffers"], u["bound_words"], u["bound_slots"])
                    for mu, u in job.mu_usage.items()},
        unused=unused(wl.graph), partition_warnings=result.warnings,
        split=split if len(graph) != len(wl.graph) else 1, split_nodes=len(graph), order=order)
    job.workload = wl
    return job, summary


#: Unary elementwise kinds the lowering folds into the op producing what they read when both
#: are on one CU (passes.FuseElementwise, passes.FuseEpilogue): a requantization's shift,
#: ReLU and clip are one bit each of that op's last stream.
FUSED_KINDS = frozenset({"relu", "shr", "shl", "clip"})


def fuse_chains(graph, result, cost):
    """``result`` with every node of :data:`FUSED_KINDS` whose input is computed by an op
    read by it alone moved to that op's unit (measured again), so that the lowering can fold
    it. A partitioner sees such a node's own few cycles (its share of the fused op's); on a
    unit of its own it costs a whole pass and a hand-over (the MLP's clip cut from its
    chain: 215 cycles on the model where the estimate said 176)."""
    index = {n: i for i, n in enumerate(result.graph.names)}
    parts = result.parts.copy()
    for n in graph.order():
        if graph.kind(n) not in FUSED_KINDS:
            continue
        (src,) = graph.inputs_of(n)
        if (OP_KINDS[graph.kind(src)].memory or src not in index
                or list(graph.nx.successors(src)) != [n]):
            continue
        parts[index[n]] = parts[index[src]]
    if (parts == result.parts).all():
        return result
    return measure(result.graph, result.targets, parts, cost, strategy=result.strategy,
                   seconds=result.seconds, warnings=result.warnings)


def check_split(split):
    """Raise ``ValueError`` naming ``split`` unless it is a positive integer or ``"auto"``."""
    if split == "auto":
        return
    if not isinstance(split, int) or isinstance(split, bool) or split < 1:
        raise ValueError(f"split must be a positive integer or 'auto', not {split!r}")


def _fastest(workload, *, strategies, split, rank, order, first_fit, **options):
    """The job with the fewest cycles of each strategy in ``strategies`` and, with
    ``split="auto"``, each also with the rows split over the fabric's CUs and over half of
    them (the unsplit job first: it is kept on ties), and with ``order="auto"`` each in both
    orders (the graph's first). Cycles are ``rank``'s when it gives every candidate's (see
    :func:`compile_workload`), else the estimates. Its summary's ``partitioner`` says
    ``fastest: <strategy>`` when several strategies were tried. A candidate that cannot compile
    the workload is passed over, and when none can, the first one's error is raised; with
    ``first_fit`` the first that can is returned, the others not compiled."""
    candidates, first_error = [], None
    wl = load_workload(workload, options.pop("sizes"))
    cus = len(options["params"].tiles("C"))
    if split == "auto":
        # Over every CU, and over half of them: fewer, longer blocks gather in fewer events
        # (the 4x4 decoder step's one-row matmuls: 5,163 cycles 4 ways, 5,939 8 ways).
        splits = [1] + [ways for ways in dict.fromkeys((cus, cus // 2)) if ways > 1 and len(
            split_graph(wl.graph, ways, lanes=options["params"].cu.lanes)) != len(wl.graph)]
    else:
        splits = [split]
    for ways in splits:
        for name in strategies:
            for each in ("graph", "schedule") if order == "auto" else (order,):
                try:
                    candidates.append(compile_workload(wl, partitioner=name, split=ways,
                                                       order=each, **options))
                except (LoweringError, PlacementError, PartitionError) as e:
                    first_error = first_error or e
                    continue
                if first_fit:
                    return candidates[0]
    if not candidates:
        raise first_error
    by_estimate = min(range(len(candidates)),
                      key=lambda i: candidates[i][1].estimated_cycles)   # the first on ties
    best, ranked = by_estimate, ()
    if rank is not None and len(candidates) > 1:
        # A rank that takes a bound (``rank.bounded``) may stop a run once it is known to
        # take longer than the fewest cycles so far (and say so with any larger figure): the
        # estimate's choice is run first, to the end, so that the bound is low early.
        bounded = getattr(rank, "bounded", False)
        turn = range(len(candidates))
        if bounded:
            turn = [by_estimate, *(i for i in turn if i != by_estimate)]
        cycles, fewest = [None] * len(candidates), None
        for i in turn:
            c = rank(candidates[i][0], bound=fewest) if bounded else rank(candidates[i][0])
            if c is None:
                break
            cycles[i] = c
            fewest = c if fewest is None else min(fewest, c)
        else:
            best = min(range(len(candidates)), key=cycles.__getitem__)
            ranked = (rank.name, cycles[best], len(candidates), cycles[by_estimate])
    job, summary = candidates[best]
    summary = dataclasses.replace(summary, ranked=ranked)
    if len(strategies) > 1:
        summary = dataclasses.replace(summary, partitioner=f"fastest: {summary.partitioner}")
    return job, summary


def bitstream_for(job):
    """The bitstream of ``job`` with the references a freshly reset fabric gives its host
    buffers (allocated in ``job.buffers`` order)."""
    return write_bitstream(job.bind(replay_refs(job)))
