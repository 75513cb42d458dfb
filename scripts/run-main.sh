#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: generate the memory unit's Verilog and run its
# benchmark on the built-in simulator (tables on the terminal, figures in out/bench-mu.json).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/rdakit verilog mu -o out/mu.v
exec .venv/bin/rdakit bench mu --json out/bench-mu.json "$@"
