#!/usr/bin/env bash
# make gpu-check: the GPU suite and the GPU benchmark on a machine with a CUDA GPU; says so and exits 0 without one.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
cd "$(dirname "$0")/.."
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: no CUDA GPU visible to torch here; nothing to run (CI runs the CPU suite)."
  exit 0
fi
"$PYTHON" -c "import torch; print('gpu-check:', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| CUDA', torch.version.cuda)"
"$PYTHON" -m pytest -m gpu tests/gpu -q -p no:cacheprovider
"$PYTHON" benchmarks/bench_gpu.py "$@"
