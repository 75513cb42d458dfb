"""The compiler's commands: ``rdakit bench partition``."""

__all__ = ["register"]


def register(commands, verilog, bench):
    """Add ``bench partition`` to the ``rdakit bench`` subcommands."""
    p = bench.add_parser(
        "partition", help="partitioners: cut, balance, time and makespan",
        description="Every partitioner (multilevel KL/FM, cost-based greedy, DQN, HEFT, "
                    "round-robin, static, METIS, Mt-KaHyPar) on workloads, random layered "
                    "DAGs and 2-D grids: cut, imbalance, seconds and estimated makespan.")
    p.add_argument("--quick", action="store_true", help="small graphs only (smoke test)")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    p.add_argument("--seed", type=int, default=0, help="seed of the DQN training")
    p.set_defaults(func=_bench_partition)


def _bench_partition(args):
    from .bench import run

    run(quick=args.quick, json_path=args.json, seed=args.seed)
    return 0
