"""``rdakit compile``: a workload partitioned, placed and lowered to a bitstream."""

import argparse
import sys

from rdakit.cli.options import (
    AUTO,
    MAX_PLACE_STEPS,
    RUN_PROG_LEN,
    add_check,
    add_fabric_arguments,
    add_number,
    check_sizes,
    fabric_candidates,
    parse_sizes,
)
from rdakit.cli.outputs import add_input, add_output
from rdakit.cli.progress import progress_bar
from rdakit.compiler.compile import (
    ORDERS,
    PARTITIONERS,
    bitstream_for,
    compile_workload,
    load_workload,
)
from rdakit.compiler.graph import GraphError
from rdakit.compiler.lower import LoweringError
from rdakit.compiler.lower.lowerer import ProgramTooLong
from rdakit.compiler.partition import PartitionError
from rdakit.compiler.placement import PlacementError
from rdakit.errors import UserError
from rdakit.files import atomic_write
from rdakit.hdl.spec.bitstream import listing
from rdakit.hdl.spec.params import fabric_params
from rdakit.sim.runtime.events import ModelRank, cost_model

__all__ = ["register", "parse_sizes", "parse_split", "add_workload_arguments",
           "load_or_explain", "choose_fabric", "FIT_ERRORS"]

#: What the compiler raises when a workload does not fit a fabric.
FIT_ERRORS = (LoweringError, PlacementError, PartitionError)


def load_or_explain(args):
    """The :class:`~rdakit.compiler.workloads.Workload` of ``args.workload`` with the sizes of
    ``--size``, or a UserError saying why not."""
    try:
        return load_workload(args.workload, args.sizes)
    except (GraphError, FileNotFoundError) as e:
        raise UserError(str(e)) from None
    except (TypeError, ValueError) as e:
        if not args.sizes:
            raise UserError(str(e)) from None
        key = str(e).split(" ", 1)[0]
        raise UserError(f"--size {e}" if key in args.sizes else f"--size: {e}") from None
    except MemoryError:
        raise UserError(f"{args.workload} with --size {args.sizes} needs more memory than this "
                        f"machine has") from None


def _hint(error):
    """A hint after the compiler's message when a larger program memory may help."""
    return " (a larger --prog-len, fabric or another partitioner may fit)" \
        if "prog_len" in str(error) else ""


def _grid(kw):
    return f"{kw['rows']}x{kw['cols']} with {kw['mu_words']}-word MUs"


def choose_fabric(workload, candidates, *, name, partitioner, seed, place_steps, split=None,
                  streams=True, order="graph"):
    """The first fabric of ``candidates`` (keyword dicts of :func:`fabric_params`, from
    :func:`~rdakit.cli.options.fabric_candidates`) on which the compiler fits ``workload``
    (called ``name``, as the user typed it), and a sentence saying so (``None`` if there was
    no choice: one candidate, not tried here).

    A candidate with a longer program than an earlier one of the same fabric is tried only if
    that one's programs were too long (:class:`ProgramTooLong`: nothing else the compiler
    does depends on the program length) and its longest program fits the longer one.

    Raises
    ------
    UserError
        If the workload fits none; the message gives the compiler's reason on the last.
    """
    if len(candidates) == 1:
        return candidates[0], None
    tried = {}                 # the fabric without its program length -> the compiler's error
    for kw in candidates:
        same = tuple(sorted((k, v) for k, v in kw.items() if k != "prog_len"))
        before = tried.get(same)
        if before is not None and not (isinstance(before, ProgramTooLong)
                                       and before.longest <= kw["prog_len"]):
            last = before
            continue
        try:
            compile_workload(workload, params=fabric_params(**kw), partitioner=partitioner,
                             seed=seed, place_steps=place_steps, split=split, streams=streams,
                             order=order, first_fit=True)
        except FIT_ERRORS as e:
            last = tried[same] = e
            continue
        grid = f"--fabric {kw['rows']}x{kw['cols']} --mu-words {kw['mu_words']}"
        if before is None:
            return kw, (f"fabric {_grid(kw)}: the smallest that fits {workload.name} ({grid} "
                        f"gives the same)")
        return kw, (f"fabric {_grid(kw)} and prog_len {kw['prog_len']}: the smallest that "
                    f"fits {workload.name} (one CU's program is {before.longest:,} "
                    f"instructions, more than prog_len {before.prog_len}; {grid} --prog-len "
                    f"{kw['prog_len']} gives the same)")
    largest = candidates[-1]
    grids = list(dict.fromkeys(f"{kw['rows']}x{kw['cols']}" for kw in candidates))
    where = f"the {grids[0]} fabric" if len(grids) == 1 else \
        f"any fabric --fabric auto tries ({grids[0]} to {grids[-1]})"
    words = sorted({kw["mu_words"] for kw in candidates})
    lengths = sorted({kw["prog_len"] for kw in candidates})
    programs = f" and programs of {lengths[0]} to {lengths[-1]} instructions" \
        if len(lengths) > 1 else ""
    raise UserError(f"{name} does not fit {where} with MUs of {words[0]} to {words[-1]} "
                    f"words{programs}; on {_grid(largest)}: {last}{_hint(last)}")


def parse_split(text):
    """``--split``: ``None`` (not given), ``"auto"`` or a positive integer; a UserError naming
    what was typed otherwise."""
    if text is None or text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or str(value) != text.strip():
        raise UserError(f"--split takes auto or a positive number of row blocks, not {text!r}")
    return value


def _check(args):
    args.partitioner = args.partitioner or "fastest"
    args.order = args.order or "auto"
    args.split = parse_split(args.split)
    args.sizes = parse_sizes(args.size)
    check_sizes(args.workload, args.sizes, fabric_candidates(args))


def _compile(args):
    workload = load_or_explain(args)
    kw, chosen = choose_fabric(workload, fabric_candidates(args), name=args.workload,
                               partitioner=args.partitioner, seed=args.seed,
                               place_steps=args.place_steps, split=args.split,
                               streams=args.streams, order=args.order)
    params = fabric_params(**kw)
    try:
        with progress_bar(sys.stderr.isatty()) as progress:
            job, summary = compile_workload(
                workload, params=params, partitioner=args.partitioner, seed=args.seed,
                place_steps=args.place_steps, progress=progress, split=args.split,
                streams=args.streams, order=args.order, rank=ModelRank(),
                schedule_cost=cost_model(workload, params=params, progress=progress))
    except FIT_ERRORS as e:
        raise UserError(f"{e}{_hint(e)}") from None
    for line in (*workload.options.get("import_summary", ()), *summary.lines()):
        print(line)
    if chosen:
        print(chosen)
    if args.output:
        data = bitstream_for(job)
        atomic_write(args.output, data)
        print(f"wrote {args.output} ({len(data)} bytes)")
    if args.listing:
        atomic_write(args.listing, listing(job.config) + "\n")
        print(f"wrote {args.listing}")
    return 0


def add_workload_arguments(p):
    """The workload and compilation options of ``rdakit compile`` and ``rdakit run``: the
    workload (an input: no output may overwrite a graph file), ``--size``, ``--partitioner``,
    ``--seed``, ``--place-steps`` and the fabric with ``--fabric auto``."""
    p.add_argument("workload", metavar="WORKLOAD",
                   help="mlp, decoder, moe, switch, mixtral, a Python graph file, or a "
                        "torch.export program (.pt2, docs/import.md)")
    add_input(p, "workload", "WORKLOAD")
    p.add_argument("--size", action="append", default=[], metavar="KEY=VALUE",
                   help="a size option of the workload builder, e.g. batch=4 or "
                        "sizes=64,128,64 (repeatable)")
    p.add_argument("--partitioner", default=None, choices=sorted(PARTITIONERS),
                   help="partitioning strategy; fastest (the default on one fabric) compiles "
                        "with several and keeps the job with the fewest estimated cycles; "
                        "across clusters the default is multilevel")
    p.add_argument("--split", default=None, metavar="auto|N",
                   help="row blocks of the graph's row-wise chains (matmuls and what follows "
                        "them row by row), spread over the CUs: N blocks, 1 for none, or auto "
                        "(the default with --partitioner fastest, else 1): compiled unsplit, "
                        "split over the CUs and over half of them, keeping the fastest "
                        "(docs/compiler.md)")
    p.add_argument("--streams", action=argparse.BooleanOptionalAction, default=True,
                   help="lower the edges between CUs that qualify as streams between CUs "
                        "(the default; --no-streams: every edge through an MU buffer; "
                        "docs/compiler.md, Streams between CUs)")
    p.add_argument("--order", default=None, choices=ORDERS,
                   help="the order of each CU's ops: the graph's, the list schedule's, or auto "
                        "(the default): compiled both ways, keeping the faster "
                        "(docs/compiler.md)")
    add_number(p, "--seed", low=0, default=0, help="seed of the placement (default 0)")
    add_number(p, "--place-steps", low=0, high=MAX_PLACE_STEPS,
               reason="about 10 us a step: a million take tens of seconds", default=20000,
               help=f"annealing steps of the placement, at most {MAX_PLACE_STEPS} "
                    f"(default: %(default)s)")
    add_fabric_arguments(p, auto=True)
    p.set_defaults(prog_len=RUN_PROG_LEN)


def register(commands):
    c = commands.add_parser(
        "compile", help="compile a workload to a bitstream",
        description="Partition a workload (a built-in name or a Python file defining build() "
                    "or graph) onto the fabric's CUs, place it, lower it to CU programs and "
                    "write the bitstream. Prints the parts, the cut, the balance, the "
                    "estimated cycles, the instructions of every CU and the buffers of every "
                    "MU. The bitstream holds the references a freshly reset fabric gives the "
                    "host buffers (allocated in order: constant pools, inputs, outputs). With "
                    f"--fabric {AUTO} (the default) the smallest fabric on which the workload "
                    "fits is chosen and named. CU program length defaults to "
                    f"{RUN_PROG_LEN} here, as in rdakit run and rdakit inspect.")
    add_workload_arguments(c)
    add_output(c, "-o", "--output", metavar="FILE", help="write the bitstream to FILE")
    add_output(c, "--listing", metavar="FILE", help="also write a readable listing to FILE")
    add_check(c, _check)
    c.set_defaults(func=_compile)
