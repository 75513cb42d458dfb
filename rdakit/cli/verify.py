"""``rdakit verify``: run the formal proofs and print a table of their results."""

from rdakit.cli.options import add_check
from rdakit.cli.outputs import add_output
from rdakit.errors import UserError
from rdakit.sim.bench.report import Report
from rdakit.sim.verify.formal import FormalError, formal_root, sby_available
from rdakit.sim.verify.formal_harness import PROPERTIES, get_property, prove

__all__ = ["register", "run_properties"]


def run_properties(props, *, faults=False, report=None):
    """Run ``props`` (and, with ``faults``, each broken variant); return the result rows."""
    rows = []
    for prop in props:
        for fault in (None, *prop.faults) if faults else (None,):
            r = prove(prop, fault=fault)
            expected = prop.expect if fault is None else "FAIL"
            rows.append({
                "property": prop.name, "variant": fault or "-", "status": r.status,
                "expected": expected, "ok": r.status == expected, "mode": r.mode,
                "depth": r.depth, "seconds": round(r.seconds, 1),
                "failed": "; ".join(r.failed), "trace": str(r.trace) if r.trace else "",
            })
    return rows


def _check(args):
    try:
        args.props = [get_property(n) for n in args.property] if args.property else [
            p for p in PROPERTIES if p.ci or args.all]
    except ValueError as e:
        raise UserError(str(e)) from None
    if not args.list:
        formal_root()       # where the proofs go: refused before any harness is built


def _verify(args):
    if args.list:
        for prop in PROPERTIES:
            print(f"{prop.name:23} {'ci ' if prop.ci else '   '}{prop.statement}")
        return 0
    props = args.props
    missing = sby_available()
    if missing:
        raise UserError(missing)
    try:
        rows = run_properties(props, faults=args.faults)
    except FormalError as e:
        raise UserError(str(e)) from None
    report = Report("verify")
    report.table("formal proofs", rows, key="proofs",
                 columns=["property", "variant", "status", "expected", "mode", "depth",
                          "seconds", "failed"])
    report.figure("properties", len(props))
    report.figure("all as expected", all(r["ok"] for r in rows))
    report.figure("seconds", round(sum(r["seconds"] for r in rows), 1))
    report.finish(args.json)
    return 0 if all(r["ok"] for r in rows) else 1


def register(commands):
    p = commands.add_parser(
        "verify", help="run the formal proofs (SymbiYosys, k-induction)",
        description="Prove the properties of the memory unit and its free list with "
                    "SymbiYosys (k-induction with z3) and print property, status, depth and "
                    "seconds. See docs/verification.md.")
    p.add_argument("property", nargs="*", help="properties to run (default: the CI subset)")
    p.add_argument("--all", action="store_true", help="run every property, not only the CI "
                                                       "subset")
    p.add_argument("--faults", action="store_true",
                   help="also run each broken variant, which must fail with a counterexample")
    p.add_argument("--list", action="store_true", help="list the properties and exit")
    add_output(p, "--json", metavar="FILE", help="also write the results to a JSON file")
    add_check(p, _check)
    p.set_defaults(func=_verify)
