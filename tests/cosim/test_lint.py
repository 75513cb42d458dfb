"""`rdakit verilog fabric` writes Verilog that `verilator --lint-only -Wall` accepts: every
warning Amaranth/Yosys output raises is waived in the file with its reason."""

import os
import subprocess

import pytest

from rdakit.cli import main
from rdakit.sim.verify.runner import VERILATOR_WAIVERS, require_simulator

pytestmark = pytest.mark.cosim


def test_fabric_verilog_passes_verilator_lint_wall(tmp_path):
    info = require_simulator("verilator")
    out = tmp_path / "fabric.v"
    assert main(["verilog", "fabric", "--fabric", "2x2", "--lanes", "2", "-o", str(out)]) == 0
    text = out.read_text()
    for rule, reason in VERILATOR_WAIVERS.items():
        assert f"/* verilator lint_off {rule} */" in text and reason in text
    r = subprocess.run([info.path, "--lint-only", "-Wall", "--top-module", "top", str(out)],
                       capture_output=True, text=True, env={**os.environ, **info.env},
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
