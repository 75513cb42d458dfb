"""The ``rdakit`` command line.

Each area of the project adds its commands through a ``register(commands, verilog, bench)``
function in the modules listed in :data:`PLUGINS`: ``commands`` is the top-level subparsers
action, ``verilog`` and ``bench`` the subparsers of ``rdakit verilog`` and ``rdakit bench``.
A command sets ``func`` (called with the parsed arguments, returning an exit code) through
``set_defaults``.
"""

import argparse
import importlib
import sys

from rdakit.errors import UserError

__all__ = ["main", "build_parser", "PLUGINS", "UserError"]

#: Modules that add commands. Each has ``register(commands, verilog, bench)``.
PLUGINS = [
    "rdakit.cli.docs",
    "rdakit.cli.verilog",
    "rdakit.cli.doctor",
    "rdakit.cli.noc",
    "rdakit.cli.race",
    "rdakit.cli.verify",
    "rdakit.cli.inspect",
    "rdakit.cli.clusters",
    "rdakit.cli.compile",
    "rdakit.cli.run",
    "rdakit.cli.board",
]


def build_parser():
    parser = argparse.ArgumentParser(
        prog="rdakit",
        description="rdakit: an open Reconfigurable Dataflow Accelerator (Amaranth RTL, "
                    "dataflow compiler, cocotb testbenches).")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    verilog = commands.add_parser(
        "verilog", help="generate Verilog for a component",
        description="Generate Verilog for a component with its parameters.")
    verilog_sub = verilog.add_subparsers(dest="component", metavar="COMPONENT", required=True)
    bench = commands.add_parser(
        "bench", help="run a benchmark and print measured figures",
        description="Run a benchmark: prints tables of measured figures (simulated cycles "
                    "first) and, with --json FILE, writes the same figures to a JSON file.")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in PLUGINS:
        importlib.import_module(name).register(commands, verilog_sub, bench_sub)
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
