#!/usr/bin/env bash
# The GPU check in one command (no make): on the device machine, with .gpu_wheels/ carried,
#   bash scripts/gpu_check.sh --out "$OUT"            # 420 s budget by default (--budget S)
# and first, here (a git checkout with the package registry): bash scripts/gpu_prepare.sh
# Without a CUDA GPU (or with --dry-run) it does what a CPU machine can and marks the GPU rows NOT RUN.
# Steps, files and exit status: scripts/gpu_check.py (its docstring) and docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" scripts/gpu_check.py "$@"
