#!/usr/bin/env bash
# The main job with its small default: the self-check, then `deepspeed launch/train.py` (tiny config,
# ZeRO-2, 2 processes; on a machine without GPUs they run on the CPU over gloo). Extra arguments go
# to train.py (e.g. --config configs/train/tiny_cpu.yaml train.steps=50). It ends with
# lm-evaluation-harness on the exported model: the run's held-out questions as the tasks ntl_run_<split>
# (docs/evaluation.md), printed beside the run's own scorer (NTL_SKIP_HARNESS=1 skips it).
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

# the harness on the model it trained, offline: its exact match must equal the run's own accuracy
run_dir=runs/tiny
for arg in "$@"; do [[ "$arg" == run_dir=* ]] && run_dir=${arg#run_dir=}; done
if [[ -z "${NTL_SKIP_HARNESS:-}" && -d "$run_dir/hf_model" ]]; then
  echo
  echo "lm_eval --model hf --model_args pretrained=$run_dir/hf_model --tasks ntl_run (docs/evaluation.md)"
  export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
  device=$([[ -n "${DS_ACCELERATOR:-}" ]] && echo cpu || echo cuda)
  "$PYTHON" launch/eval_tasks.py prepare --out "$run_dir/lm_eval_tasks" --run-dir "$run_dir" --examples 20 --texts 10 2>/dev/null >/dev/null
  "$PYTHON" -m lm_eval --model hf --model_args "pretrained=$run_dir/hf_model" --device "$device" --batch_size 32 \
    --include_path "$run_dir/lm_eval_tasks" --tasks ntl_run --output_path "$run_dir/lm_eval" 2>/dev/null \
    | grep -E '^(\||hf \()' || true
  "$PYTHON" launch/eval_tasks.py compare --run-dir "$run_dir" --results "$run_dir/lm_eval" \
    || echo "the harness and the run's scorer disagree on some split (above)"
fi
