#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: compile a small mixture-of-experts layer, run it
# on a 2x2 fabric in Amaranth's built-in simulator, check it bit for bit against numpy and the
# interpreter, and report cycles, tile utilization, NoC flits and MU memory (the full report in
# out/moe.json, a utilization heatmap in out/moe.png). Extra arguments go to `rdakit run`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/rdakit run moe --size tokens=4 --size d_model=8 --size d_ff=8 --size experts=4 \
    --report out/moe.json --plot out/moe.png "$@"
