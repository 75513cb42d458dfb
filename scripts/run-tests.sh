#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the tests on two workers. With no arguments: the default
# suite, what CI runs (unit tests in Amaranth's simulator, compiler tests, co-simulation of the
# small designs on Icarus and Verilator; pyproject's addopts deselect `slow` and `formal`).
# `--quick` first: the inner loop only (not cosim, slow, long or formal; see tests/conftest.py).
# Other arguments go to pytest, e.g. `-m slow` for the long runs or `-k mu`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
if [[ "${1:-}" == "--quick" ]]; then
    shift
    set -- -m "not cosim and not slow and not long and not formal" "$@"
fi
exec .venv/bin/python -m pytest -n 2 "$@"
