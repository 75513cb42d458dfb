"""The compiler's commands: ``rdakit compile``, ``rdakit bench partition`` and
``rdakit bench calibrate``."""

import pathlib

__all__ = ["register", "parse_sizes"]


def register(commands, verilog, bench):
    """Add ``compile`` to the commands and ``partition`` and ``calibrate`` to ``rdakit bench``."""
    from rdakit.cli.options import add_fabric_arguments
    from rdakit.compiler.partition import STRATEGIES

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

    p = bench.add_parser(
        "partition", help="partitioners: cut, balance, time and makespan",
        description="Every partitioner (multilevel KL/FM, cost-based greedy, DQN, HEFT, "
                    "round-robin, static, METIS, Mt-KaHyPar) on workloads, random layered "
                    "DAGs and 2-D grids: cut, imbalance, seconds and estimated makespan.")
    p.add_argument("--quick", action="store_true", help="small graphs only (smoke test)")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    p.add_argument("--seed", type=int, default=0, help="seed of the DQN training")
    p.set_defaults(func=_bench_partition)

    k = bench.add_parser(
        "calibrate", help="the cost model against the interpreter and the RTL",
        description="Compile workloads, run them on the functional interpreter (steps per "
                    "lowered op) and one small job on the RTL in Amaranth's simulator "
                    "(cycles), and report the cost model's relative error before and after "
                    "fitting its two constants.")
    k.add_argument("--quick", action="store_true", help="fewer workloads (smoke test)")
    k.add_argument("--no-rtl", action="store_true", help="skip the RTL run")
    k.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    k.set_defaults(func=_bench_calibrate)


def parse_sizes(items):
    """``["batch=4", "sizes=8,16,8"]`` -> ``{"batch": 4, "sizes": (8, 16, 8)}``."""
    from rdakit.errors import UserError

    sizes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--size must be KEY=VALUE, not {item!r}")
        try:
            parts = [int(v) for v in value.split(",")]
        except ValueError:
            raise UserError(f"--size {key} must be an integer or integers separated by commas, "
                            f"not {value!r}") from None
        sizes[key] = tuple(parts) if "," in value else parts[0]
    return sizes


def _compile(args):
    from rdakit.cli.options import fabric_from_args
    from rdakit.compiler.compile import bitstream_for, compile_workload
    from rdakit.compiler.graph import GraphError
    from rdakit.compiler.lower import LoweringError
    from rdakit.compiler.partition import PartitionError
    from rdakit.compiler.placement import PlacementError
    from rdakit.errors import UserError
    from rdakit.hdl.spec.bitstream import listing

    params = fabric_from_args(args)
    sizes = parse_sizes(args.size)
    try:
        job, summary = compile_workload(args.workload, sizes=sizes, params=params,
                                        partitioner=args.partitioner, seed=args.seed,
                                        place_steps=args.place_steps)
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


def _bench_partition(args):
    from rdakit.sim.bench.partition import run

    run(quick=args.quick, json_path=args.json, seed=args.seed)
    return 0


def _bench_calibrate(args):
    from rdakit.sim.bench.calibrate import run

    run(quick=args.quick, rtl=not args.no_rtl, json_path=args.json)
    return 0
