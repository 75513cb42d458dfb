"""The ``rdakit`` command line: one module per command.

Each module in :data:`COMMANDS` adds its command through ``register(commands)``, ``commands``
being the top-level subparsers action; ``rdakit verilog`` and ``rdakit bench`` add their own
subcommands (``rdakit.cli.verilog``, ``rdakit.cli.bench``). A command sets ``func`` (called with
the parsed arguments, returning an exit code) through ``set_defaults``. Options shared by
several commands, each with one spelling and one parser, are in :mod:`rdakit.cli.options`.
"""

import argparse
import sys

from rdakit.cli import (
    bench,
    board,
    compile,
    docs,
    doctor,
    inspect,
    run,
    verify,
    verilog,
)
from rdakit.errors import UserError

__all__ = ["main", "build_parser", "COMMANDS", "UserError"]

#: The modules of the commands, in the order ``rdakit --help`` lists them.
COMMANDS = [verilog, bench, docs, doctor, verify, inspect, compile, run, board]


def build_parser():
    parser = argparse.ArgumentParser(
        prog="rdakit",
        description="rdakit: an open Reconfigurable Dataflow Accelerator (Amaranth RTL, "
                    "dataflow compiler, cocotb testbenches).")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.register(commands)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except UserError as e:
        print(f"rdakit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
