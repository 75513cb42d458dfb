"""The ``rdakit`` command line: one module per command.

Each module in :data:`COMMANDS` adds its command through ``register(commands)``, ``commands``
being the top-level subparsers action; ``rdakit verilog`` and ``rdakit bench`` add their own
subcommands (``rdakit.cli.verilog``, ``rdakit.cli.bench``). A command sets ``func`` (called with
the parsed arguments, returning an exit code) through ``set_defaults``. Options shared by
several commands, each with one spelling and one parser, are in :mod:`rdakit.cli.options`.

:func:`main` checks everything the user typed before the command does any work: argparse the
syntax and the ranges of numbers, then the checks the command registered
(:func:`~rdakit.cli.options.add_check`: fabric and MU parameters, sizes, ...), then the output
paths (:func:`~rdakit.cli.outputs.check_outputs`). A refusal prints ``rdakit: error: ...``
naming the option, with no traceback, and exits 2; exit 1 is kept for a mismatch, a hardware
error or a failed benchmark run.
"""

import argparse
import sys

from rdakit.cli import (
    bench,
    board,
    compile,
    docs,
    doctor,
    importcmd,
    inspect,
    run,
    sweep,
    verify,
    verilog,
)
from rdakit.cli.options import run_checks
from rdakit.cli.outputs import check_outputs
from rdakit.errors import UserError

__all__ = ["main", "build_parser", "COMMANDS", "UserError"]

#: The modules of the commands, in the order ``rdakit --help`` lists them.
COMMANDS = [verilog, bench, docs, doctor, verify, inspect, importcmd, compile, run, board,
            sweep]


def build_parser():
    parser = argparse.ArgumentParser(
        prog="rdakit",
        description="rdakit: an open Reconfigurable Dataflow Accelerator (Amaranth RTL, "
                    "dataflow compiler, cocotb testbenches).")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.register(commands)
    return parser


def _refuse_empty_values(argv):
    """argparse reads ``--x=--`` as an empty list, a value of no option's type: refused."""
    for item in argv:
        option, sep, value = item.partition("=")
        if item.startswith("-") and sep and value == "--":
            raise UserError(f"{option} needs a value, not '--'")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser()
    try:
        _refuse_empty_values(argv)
        args = parser.parse_args(argv)
        run_checks(args)
        check_outputs(args)
        return args.func(args) or 0
    except UserError as e:
        print(f"rdakit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
