"""``rdakit compile``: a workload partitioned, placed and lowered to a bitstream."""

import pathlib

from rdakit.cli.options import add_fabric_arguments, fabric_from_args, parse_sizes
from rdakit.compiler.compile import bitstream_for, compile_workload, load_workload
from rdakit.compiler.graph import GraphError
from rdakit.compiler.lower import LoweringError
from rdakit.compiler.partition import STRATEGIES, PartitionError
from rdakit.compiler.placement import PlacementError
from rdakit.errors import UserError
from rdakit.hdl.spec.bitstream import listing
from rdakit.sim.runtime.events import cost_model

__all__ = ["register", "parse_sizes"]


def _compile(args):
    params = fabric_from_args(args)
    sizes = parse_sizes(args.size)
    try:
        workload = load_workload(args.workload, sizes)
        job, summary = compile_workload(workload, params=params,
                                        partitioner=args.partitioner, seed=args.seed,
                                        place_steps=args.place_steps,
                                        schedule_cost=cost_model(workload, params=params))
    except (LoweringError, PlacementError, PartitionError, GraphError, FileNotFoundError) as e:
        hint = " (a larger --prog-len, fabric or another partitioner may fit)" \
            if "prog_len" in str(e) else ""
        raise UserError(f"{e}{hint}") from None
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    for line in summary.lines():
        print(line)
    if args.output:
        data = bitstream_for(job)
        pathlib.Path(args.output).write_bytes(data)
        print(f"wrote {args.output} ({len(data)} bytes)")
    if args.listing:
        pathlib.Path(args.listing).write_text(listing(job.config) + "\n")
        print(f"wrote {args.listing}")
    return 0


def register(commands):
    c = commands.add_parser(
        "compile", help="compile a workload to a bitstream",
        description="Partition a workload (a built-in name or a Python file defining build() "
                    "or graph) onto the fabric's CUs, place it, lower it to CU programs and "
                    "write the bitstream. Prints the parts, the cut, the balance, the "
                    "estimated cycles, the instructions of every CU and the buffers of every "
                    "MU. The bitstream holds the references a freshly reset fabric gives the "
                    "host buffers (allocated in order: constant pools, inputs, outputs).")
    c.add_argument("workload", metavar="WORKLOAD",
                   help="mlp, decoder, moe, switch, mixtral, or a Python file")
    c.add_argument("--size", action="append", default=[], metavar="KEY=VALUE",
                   help="a size option of the workload builder, e.g. batch=4 or "
                        "sizes=64,128,64 (repeatable)")
    c.add_argument("--partitioner", default="multilevel", choices=sorted(STRATEGIES),
                   help="partitioning strategy (default: %(default)s)")
    c.add_argument("-o", "--output", metavar="FILE", help="write the bitstream to FILE")
    c.add_argument("--listing", metavar="FILE", help="also write a readable listing to FILE")
    c.add_argument("--seed", type=int, default=0, help="seed of the placement (default 0)")
    c.add_argument("--place-steps", type=int, default=20000,
                   help="annealing steps of the placement (default: %(default)s)")
    add_fabric_arguments(c)
    c.set_defaults(func=_compile)
