#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default test suite: unit tests in Amaranth's simulator,
# co-simulation on Icarus and Verilator, compiler tests (pyproject's addopts deselect the
# `slow` and `formal` marks). Extra arguments go to pytest, e.g. `-m slow` for the long runs
# or `-k mu`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n 2 "$@"
