#!/usr/bin/env bash
# The main job with its small default: the self-check, then `deepspeed launch/train.py` (tiny config,
# ZeRO-2, 2 processes; on a machine without GPUs they run on the CPU over gloo). Extra arguments go
# to train.py (e.g. --config configs/train/tiny_cpu.yaml train.steps=50).
# The launcher's own INFO lines (its command line, world info, one per spawned process) are dropped
# from the screen; its warnings and errors, and everything the ranks print, are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" launch/demo.py
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L | wc -l)
else
  export DS_ACCELERATOR=cpu
  gpus=2
  # one thread per rank unless asked otherwise: CPU float sums depend on the thread count, so the same
  # seed gives the same numbers on any machine with the same CPU kernels (docs/deepspeed.md, "Reproducibility")
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
echo
echo "deepspeed launch/train.py --config configs/train/tiny_cpu.yaml $* ($gpus processes)"
"$PYTHON" -m deepspeed.launcher.runner --num_gpus "$gpus" launch/train.py --config configs/train/tiny_cpu.yaml "$@" 2>&1 \
  | { grep --line-buffered -v -E '^\[[0-9-]+ [0-9:,]+\] \[INFO\] \[(runner|launch)\.py:[0-9]+:main\]' || true; }
