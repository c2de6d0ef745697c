#!/usr/bin/env bash
# Sets up ntl_scale on a fresh machine with nothing but Python, into the Python it is given
# (PYTHON, default python3: the active environment).
#   bash scripts/setup.sh          # the package and every stack of the README's table: DeepSpeed, Hugging
#                                  # Face, megatron.core (+ Megatron-LM's own imports), torchtitan 0.3.0
#   bash scripts/setup.sh --dev    # plus everything the test suite needs (Slurm too, as root with apt;
#                                  # the DeepMind data generator's own environment)
# torch: installs the pin torch==2.13.0 (a local CPU wheel on the project's machines) when no torch is
# present, and pins whatever torch is installed as a constraint so no later install can upgrade it.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
extras="hf,deepspeed,megatron,wandb,eval"
[[ "${1:-}" == "--dev" ]] && extras="hf,deepspeed,megatron,wandb,eval,dev"

if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] no torch found: installing torch==2.13.0"
  "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
torch_version=$("$PYTHON" -c "import torch; print(torch.__version__)")
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==${torch_version}" >"$constraints"

# An editable install of another checkout in this Python is re-pointed here: said, never silent (one
# environment per checkout keeps them apart: python3 -m venv .venv && PYTHON=.venv/bin/python make run)
other=$("$PYTHON" -c '
import importlib.metadata as m, json, os, sys
try:
    url = json.loads(m.distribution("ntl_scale").read_text("direct_url.json") or "{}").get("url", "")
except Exception:
    url = ""
path = url.removeprefix("file://")
print(path if path and os.path.realpath(path) != os.path.realpath(sys.argv[1]) else "")
' "$PWD")
if [[ -n "$other" ]]; then
  echo "[setup] WARNING: $PYTHON has ntl_scale installed from another checkout ($other); this set-up re-points" \
    "it to $PWD. Use one environment per checkout: python3 -m venv .venv && PYTHON=.venv/bin/python make run" >&2
fi

echo "[setup] installing ntl_scale[${extras}] (torch ${torch_version} kept as is)"
"$PYTHON" -m pip install --quiet --constraint "$constraints" -e ".[${extras}]"
# what a Megatron-LM checkout's pretrain_gpt.py imports beyond megatron-core
"$PYTHON" -m pip install --quiet --constraint "$constraints" six einops regex

# torchtitan 0.3.0 (ntl_scale.integrations.torchtitan): its wheel pins datasets<4.8 (the hf extra has a
# newer one that its text loader reads as well), so it goes in without its dependency list, followed by
# the ones it imports, all under the torch constraint.
echo "[setup] torchtitan 0.3.0 (torch ${torch_version} kept as is)"
"$PYTHON" -m pip install --quiet --no-deps "torchtitan==0.3.0"
"$PYTHON" -m pip install --quiet --constraint "$constraints" "tyro>=0.9" "spmd_types==0.2.3" "torchdata==0.11.0" \
  "torch_checkpointing==0.1.1" "tensorboard>=2.15" "triton>=3.0"

if [[ "${1:-}" == "--dev" ]]; then
  # expecttest: torch's test utilities need it for torchtitan's own loss tests (test_torchtitan_upstream.py).
  "$PYTHON" -m pip install --quiet --constraint "$constraints" "expecttest==0.3.0"
  bash scripts/setup_slurm.sh
  # DeepMind's generator pins sympy 1.5.1 and numpy<1.24: its own venv (~/.cache/ntl_scale), built once
  echo "[setup] the DeepMind mathematics generator's environment"
  "$PYTHON" launch/deepmind_data.py --setup-only
fi
