#!/usr/bin/env bash
# Builds the carry folder for a GPU machine without internet (the `device` tool's: Python 3.12, torch,
# Triton, transformers, accelerate, pyarrow, einops, six, regex, xxhash already there):
#   bash scripts/gpu_wheels.sh            # -> .gpu_wheels/ (git-ignored) and its manifest (committed)
# then, on the GPU machine, `bash scripts/gpu_check.sh --out DIR` installs what is missing from it (pip --no-index
# --no-deps) and runs the GPU checks, the benchmark and the training runs (docs/gpu.md; no make needed there).
#
# Contents: cp312 manylinux wheels (pip download --only-binary=:all: --no-deps) of what the GPU run
# imports and the machine lacks, a pure-Python DeepSpeed wheel built from its sdist, and a slim
# Megatron-LM core_v0.19.0 source archive (megatron/, pretrain_gpt.py and the two builders it imports)
# from ../shared/third_party. Pins: the versions tested together on the development machines.
# The budget counts the working tree too (scripts/travel_size.py: 40 MiB for tree + wheels, under the
# device tool's 64 MiB); optional groups that would push the total over it are dropped with the reason
# printed. It records the set it built (file names and byte sizes) in scripts/gpu_wheels.manifest.json,
# committed: CI checks tree + manifest against the budget (tests/unit/test_travel_size.py) and that
# every spec below has its file there, so a wheel added here must be built once and recorded.
set -euo pipefail
cd "$(dirname "$0")/.." || exit 1

PYTHON=${PYTHON:-python3}
DEST=${GPU_WHEELS_DIR:-.gpu_wheels}
MANIFEST=${GPU_WHEELS_MANIFEST:-scripts/gpu_wheels.manifest.json}
MEGATRON_TAG=core_v0.19.0
MEGATRON_ARCHIVE=${MEGATRON_LM_ARCHIVE:-../shared/third_party/megatron-lm-${MEGATRON_TAG}.tar.gz}

# Required: each is imported by a step of scripts/gpu_check.sh.
REQUIRED=(
  ntloss==0.3.2 loguru==0.7.3                                  # the reference loss (CE + ntloss row, parity)
  liger-kernel==0.8.5 cut-cross-entropy==25.1.1                # baselines (Triton; pure Python)
  megatron-core==0.19.0                                        # Megatron's fused CE row (matches the LM source)
  hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4          # DeepSpeed's own dependencies that the
  annotated-types==0.7.0 typing-inspection==0.4.2              #   machine lacks (msgpack, ninja, psutil... are there)
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19            # launch/train.py data (pyarrow, xxhash are there)
)
DEEPSPEED=deepspeed==0.19.8 # an sdist: built here into a pure-Python wheel
# Optional groups, in order of value per byte; a group that does not fit is dropped whole.
# QuACK and Liger's CuTe-DSL backend need NVIDIA's CuTe DSL, whose CUDA 13 library wheel alone is
# about 92 MB (63.5 MB as tar.xz -9e, measured): over the limit, so it is tried last and reported.
OPTIONAL_NAMES=("QuACK + CuTe DSL (quack-kernels, Liger LIGER_KERNEL_IMPL=cutedsl)")
OPTIONAL_SPECS=(
  "quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1"
)

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() { # download DIR SPEC...
  local dir=$1
  shift
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d "$dir" "$@" 2>&1 | grep -v '^WARNING: Location' || true
  for spec in "$@"; do # pip download may print nothing on failure through the filter above
    local name=${spec%%==*}
    name=${name//-/_}
    if ! compgen -G "$dir/${name}-*" >/dev/null; then
      echo "gpu_wheels: could not download ${spec} for cp312 manylinux" >&2
      return 1
    fi
  done
}
bytes_of() { du -sb "$1" | cut -f1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
travel() { # travel KEY: a field of scripts/travel_size.py's measure of the tree and the folder built so far
  { "$PYTHON" scripts/travel_size.py --json --wheels "$DEST" || (($? == 1)); } | # 1: over, still measured
    "$PYTHON" -c "import json, sys; print(json.loads(sys.stdin.read())['$1'])"
}

rm -rf "$DEST"
mkdir -p "$DEST"
echo "gpu_wheels: cp312 manylinux wheels into $DEST"
download "$DEST" "${REQUIRED[@]}"

echo "gpu_wheels: $DEEPSPEED (an sdist: a pure-Python wheel, its ops compile just in time there)"
# --no-build-isolation: the build imports the torch installed here instead of fetching another one
"$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  -w "$DEST" "$DEEPSPEED" 2>&1 | grep -v '^WARNING: Location' || true
ls "$DEST/deepspeed-${DEEPSPEED#*==}-py3-none-any.whl" >/dev/null

if [[ -f "$MEGATRON_ARCHIVE" ]]; then
  echo "gpu_wheels: Megatron-LM ${MEGATRON_TAG} (megatron/, pretrain_gpt.py, gpt_builders.py, model_provider.py)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  top=Megatron-LM-${MEGATRON_TAG}
  tar xzf "$MEGATRON_ARCHIVE" -C "$work" --exclude='*/tests/*' \
    "$top/megatron" "$top/pretrain_gpt.py" "$top/gpt_builders.py" "$top/model_provider.py" "$top/LICENSE"
  # Megatron's dataset helpers, prebuilt for cp312 in the megatron-core wheel of the same release, newer
  # than helpers.cpp: its `make` finds nothing to do (the machine may lack python3-config)
  "$PYTHON" - "$DEST" "$work/$top/megatron/core/datasets" <<'EOF'
import os, pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("megatron_core-*.whl"))
datasets = pathlib.Path(sys.argv[2])
newer = (datasets / "helpers.cpp").stat().st_mtime + 1  # fixed: the archive's bytes do not depend on today
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("megatron/core/datasets/helpers_cpp") and name.endswith(".so"):
            (datasets / pathlib.Path(name).name).write_bytes(z.read(name))
            os.utime(datasets / pathlib.Path(name).name, (newer, newer))
for folder in (datasets, datasets.parents[2]):  # the files' folder, and the top one tar created today
    os.utime(folder, (newer, newer))
EOF
  # the same bytes on every build (names sorted, owners and the gzip time dropped): a stable manifest
  tar cf - --sort=name --owner=0 --group=0 --numeric-owner -C "$work" "$top" |
    gzip -n >"$DEST/megatron-lm-${MEGATRON_TAG}.tar.gz"
else
  echo "gpu_wheels: no $MEGATRON_ARCHIVE: the Megatron-LM smoke run will be skipped there"
fi

tree=$(travel tree_bytes)
budget=$(($(travel limit_bytes) - tree))
for i in "${!OPTIONAL_NAMES[@]}"; do
  staging=$(mktemp -d)
  read -r -a specs <<<"${OPTIONAL_SPECS[$i]}"
  if ! download "$staging" "${specs[@]}"; then
    echo "gpu_wheels: dropped ${OPTIONAL_NAMES[$i]}: not downloadable for cp312 manylinux"
  else
    extra=$(bytes_of "$staging")
    have=$(bytes_of "$DEST")
    if ((have + extra > budget)); then
      echo "gpu_wheels: dropped ${OPTIONAL_NAMES[$i]}: $(mib "$extra") MiB would make $(mib $((have + extra + tree))) MiB" \
        "with the working tree, over the budget of scripts/travel_size.py (largest: $(ls -S "$staging" | head -1))"
    else
      mv "$staging"/* "$DEST"/
    fi
  fi
  rm -rf "$staging"
done

echo "gpu_wheels: contents"
ls -l "$DEST" | awk 'NR > 1 { printf "  %8.2f MiB  %s\n", $5 / 1048576, $9 }'
# the manifest of the set (committed): what CI counts without downloading anything
"$PYTHON" - "$DEST" "$MANIFEST" <<'EOF'
import json, os, sys
dest, manifest = sys.argv[1:]
files = [{"name": n, "bytes": os.path.getsize(os.path.join(dest, n))} for n in sorted(os.listdir(dest))]
record = {"written_by": "bash scripts/gpu_wheels.sh", "files": files, "total_bytes": sum(f["bytes"] for f in files)}
with open(manifest + ".tmp", "w") as f:
    f.write(json.dumps(record, indent=1) + "\n")
os.replace(manifest + ".tmp", manifest)
EOF
echo "gpu_wheels: recorded $MANIFEST (commit it); what travels with $DEST:"
if ! "$PYTHON" scripts/travel_size.py --wheels "$DEST"; then
  echo "gpu_wheels: over the budget; remove the largest files above" >&2
  exit 1
fi
echo "gpu_wheels: carry it with the device tool: run(command='bash scripts/gpu_check.sh --out \$OUT', carry=['$DEST'], timeout_s=500)"
