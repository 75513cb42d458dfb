"""``rdakit bench race``: reference-counting schemes under random link delays on a fabric's RTL
(``docs/race.md``)."""

from rdakit.sim.bench.report import Report

__all__ = ["register"]


def bench_race(args):
    from rdakit.errors import UserError
    from rdakit.sim.bench.race import SCHEMES, run_race, summarize
    from rdakit.sim.verify.runner import require_simulator_or_raise

    if args.scenarios < 1:
        raise UserError(f"--scenarios must be at least 1, not {args.scenarios}")
    schemes = tuple(args.schemes.split(",")) if args.schemes else SCHEMES
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise UserError(f"--schemes must be a comma-separated list of {', '.join(SCHEMES)}, "
                        f"not {bad[0]!r}")
    require_simulator_or_raise(args.sim)
    rows = run_race(args.scenarios, simulator=args.sim, schemes=schemes, seed=args.seed,
                    optimize=args.sim == "verilator")
    report = Report("race")
    table = summarize(rows)
    report.table(
        f"Race injection on a 2x2 fabric ({args.sim}, {args.scenarios} random scenarios a "
        f"scheme, seed {args.seed}): premature frees, leaks, messages, last use -> free",
        table,
        notes="msgs_per_scenario: reference-counting requests to the MU (each answered) plus "
              "gating tokens; extra_msgs_per_copy: the same beyond one release a holder; "
              "latency: MU cycles from the last good READ to the free; cycles: START to done.")
    by_topology = []
    for scheme in schemes:
        for topo in ("pair", "chain", "fanout"):
            rs = [r for r in rows if r["scheme"] == scheme and r["topology"] == topo]
            if rs:
                by_topology.append({"scheme": scheme, "topology": topo, "scenarios": len(rs),
                                    "premature_frees": sum(r["premature"] for r in rs)})
    report.table("Premature frees by holder tree", by_topology)
    for r in table:
        for key in ("premature_frees", "leaks", "double_frees", "extra_msgs_per_copy",
                    "latency_mean", "cycles_mean"):
            report.figure(f"{r['scheme']}_{key}", r[key])
    report.finish(args.json)
    return 0


def register(commands, verilog, bench):
    p = bench.add_parser(
        "race", help="reference counting under random NoC delays: premature frees, messages",
        description="Run random race scenarios (the seed paper's Figure 1(b)) on a 2x2 "
                    "fabric's RTL whose links stall at random: counters without gating, "
                    "counters with acknowledgement gating (copier or token), and partial-free "
                    "with 2 to 4 weight bits. Prints per scheme the premature frees, leaks, "
                    "double frees, reference-counting messages and the latency from the last "
                    "use to the free.")
    p.add_argument("--scenarios", type=int, default=1000, metavar="N",
                   help="random scenarios per scheme (default: %(default)s)")
    p.add_argument("--sim", choices=["verilator", "icarus"], default="verilator")
    p.add_argument("--schemes", metavar="LIST",
                   help="comma-separated subset of counter,gated,token,partial (default: all)")
    p.add_argument("--seed", type=int, default=0, help="scenario seed (default: 0)")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    p.set_defaults(func=bench_race)
