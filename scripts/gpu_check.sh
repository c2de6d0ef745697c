#!/usr/bin/env bash
# make gpu-check: everything that needs a CUDA GPU, in one command under 10 minutes (each step has its
# own time limit, cut to what is left of GPU_CHECK_BUDGET, 570 s by default); says so and exits 0
# without a GPU.
#   bash scripts/gpu_wheels.sh     # once, on a machine with the package registry: .gpu_wheels/ (< 64 MiB)
#   make gpu-check                 # on the GPU machine, with .gpu_wheels/ beside this checkout
# Steps: install what the machine lacks from .gpu_wheels/ (pip --no-index --no-deps, into a separate
# folder on PYTHONPATH; nothing already installed is replaced), then
#   1. the GPU tests (tests/gpu: half precision, no host sync, CUDA graphs; the Triton kernels compiled
#      for the GPU: tests/unit/test_triton_kernel.py with TRITON_INTERPRET=0),
#   2. deepspeed launch/train.py on one GPU (the tiny config, a few steps),
#   3. Megatron-LM core_v0.19.0 pretrain_gpt.py through launch/pretrain_gpt_ntl.py (TP=1, local
#      transformer, fusions off: no Transformer Engine or Apex there; mock data),
#   4. a Hugging Face Trainer run with apply_ntl (examples/hf_trainer_ntl.py --chunked --bf16),
#   5. benchmarks/bench_gpu.py (arguments of this script go to it; it rewrites its table after each
#      configuration, so a run cut by the time limit still leaves the configurations it finished),
# then a summary, and the benchmark's Markdown table last. Exit status: 1 if a step failed.
set -uo pipefail
PYTHON="${PYTHON:-python3}"
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: no CUDA GPU visible to torch here; nothing to run (CI runs the CPU suite)."
  exit 0
fi

WHEELS=${GPU_WHEELS_DIR:-$ROOT/.gpu_wheels}
WORK=${GPU_CHECK_DIR:-/tmp/ntl_scale_gpu_check}
SITE=$WORK/site
mkdir -p "$WORK"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled HF_HUB_OFFLINE=1

if [[ -d "$WHEELS" ]]; then
  # wheels of distributions not installed here (the machine's own versions win)
  mapfile -t missing < <("$PYTHON" - "$WHEELS" <<'EOF'
import importlib.metadata as md, pathlib, re, sys
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(wheel)
EOF
  )
  if ((${#missing[@]})); then
    echo "gpu-check: installing ${#missing[@]} carried wheels into $SITE"
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
      --target "$SITE" "${missing[@]}" || echo "gpu-check: some carried wheels did not install"
  fi
  for archive in "$WHEELS"/megatron-lm-*.tar.gz; do
    [[ -f "$archive" ]] && tar xzf "$archive" -C "$WORK"
  done
else
  echo "gpu-check: no $WHEELS (bash scripts/gpu_wheels.sh makes it); steps whose packages are missing fail"
fi
"$PYTHON" - <<'EOF'
import importlib.metadata as md, torch
names = ["torch", "triton", "transformers", "accelerate", "deepspeed", "megatron-core", "ntloss", "liger-kernel",
         "cut-cross-entropy", "quack-kernels", "datasets"]
versions = []
for n in names:
    try:
        versions.append(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        versions.append(f"{n} -")
print("gpu-check:", torch.cuda.get_device_name(0), "| CUDA", torch.version.cuda, "|", ", ".join(versions))
EOF

declare -a SUMMARY=()
FAILED=0
BUDGET=${GPU_CHECK_BUDGET:-570}
step() { # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  local left=$((BUDGET - SECONDS))
  ((limit > left)) && limit=$left
  if ((limit < 20)); then
    SUMMARY+=("$(printf '%-44s %-16s' "$name" "NOT RUN (budget)")")
    FAILED=1
    return
  fi
  echo
  echo "==== gpu-check: $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  local status=ok
  if ((rc == 124 || rc == 137)); then
    status="TIMED OUT"
  elif ((rc != 0)); then
    status="FAILED (rc $rc)"
  fi
  [[ $status == ok ]] || FAILED=1
  SUMMARY+=("$(printf '%-44s %-16s %4ds' "$name" "$status" $((SECONDS - start)))")
}

step "GPU tests (tests/gpu)" 120 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/gpu
step "Triton kernels on the GPU" 90 env TRITON_INTERPRET=0 "$PYTHON" -m pytest -q -p no:cacheprovider \
  tests/unit/test_triton_kernel.py

step "deepspeed launch/train.py (1 GPU)" 120 deepspeed --num_gpus 1 launch/train.py \
  --config configs/train/tiny_cpu.yaml "run_dir=$WORK/ds_run" train.steps=20 train.log_every=5 \
  data.train_examples=800 data.eval_examples=20 tracking.wandb=disabled tracking.plot=false

MEGATRON=$(ls -d "$WORK"/Megatron-LM-* 2>/dev/null | head -1)
megatron_smoke() {
  [[ -n "$MEGATRON" ]] || {
    echo "no Megatron-LM checkout (carry .gpu_wheels/ with megatron-lm-core_v0.19.0.tar.gz)"
    return 1
  }
  "$PYTHON" -c "
from ntl_scale import NumberVocab
table = {i: (str(i - 48) if 48 <= i < 58 else f'w{i}') for i in range(127)}  # NullTokenizer: digits at 48-57
NumberVocab.from_id_to_token(table, vocab_size=128).save('$WORK/numbers.json')" || return 1
  cd "$MEGATRON" || return 1
  MEGATRON_LM_PATH="$MEGATRON" CUDA_DEVICE_MAX_CONNECTIONS=1 "$PYTHON" -m torch.distributed.run --nproc_per_node 1 \
    "$ROOT/launch/pretrain_gpt_ntl.py" \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
    --micro-batch-size 4 --global-batch-size 8 --train-iters 10 --lr 1e-3 --lr-decay-style constant \
    --vocab-size 127 --make-vocab-size-divisible-by 64 --transformer-impl local --tensor-model-parallel-size 1 \
    --no-gradient-accumulation-fusion --no-bias-gelu-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion \
    --no-rope-fusion --no-persist-layer-norm --attention-dropout 0 --hidden-dropout 0 --log-interval 2 --seed 1234 \
    --mock-data --tokenizer-type NullTokenizer --split 100,0,0 --eval-iters 0 --eval-interval 1000 \
    --ntl-weight 0.3 --ntl-number-vocab "$WORK/numbers.json"
}
step "Megatron-LM pretrain_gpt.py + NTL (TP=1)" 120 bash -c "$(declare -f megatron_smoke); \
  MEGATRON='$MEGATRON' WORK='$WORK' ROOT='$ROOT' PYTHON='$PYTHON' megatron_smoke"

step "HF Trainer + apply_ntl (examples/hf_trainer_ntl.py)" 90 "$PYTHON" examples/hf_trainer_ntl.py \
  --chunked --bf16 --max-steps 10 --examples 128 --output-dir "$WORK/hf_trainer"

step "benchmarks/bench_gpu.py" 300 "$PYTHON" benchmarks/bench_gpu.py --time-budget 120 \
  --markdown "$WORK/bench_gpu.md" "$@"

echo
echo "==== gpu-check summary"
printf '%s\n' "${SUMMARY[@]}"
if [[ -f "$WORK/bench_gpu.md" ]]; then
  echo
  echo "==== benchmark table (for docs/benchmarks.md)"
  cat "$WORK/bench_gpu.md"
fi
exit $FAILED
