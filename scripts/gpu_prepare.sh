#!/usr/bin/env bash
# Before a device call, here (a git checkout with the package registry):
#   bash scripts/gpu_prepare.sh [--rebuild]
# 1. builds .gpu_wheels/ with scripts/gpu_wheels.sh when it holds no wheels (or with --rebuild);
# 2. measures what travels with scripts/travel_size.py (when present; "not available" otherwise);
# 3. writes .gpu_wheels/COMMIT (JSON: git rev-parse HEAD, whether the tree is dirty, the size check), which
#    scripts/gpu_check.sh reports, since .git does not travel.
# Then, on the device: run(command="bash scripts/gpu_check.sh --out $OUT", carry=[".gpu_wheels"], timeout_s=500).
set -euo pipefail
cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
DEST=${GPU_WHEELS_DIR:-.gpu_wheels}
rebuild=0
for arg in "$@"; do
  case $arg in
    --rebuild) rebuild=1 ;;
    -h | --help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_prepare: unknown argument $arg (expected --rebuild)" >&2; exit 2 ;;
  esac
done
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "gpu_prepare: not a git checkout: the commit cannot be recorded; run it in the checkout you send" >&2
  exit 2
fi

if ((rebuild)) || ! compgen -G "$DEST/*.whl" >/dev/null; then
  if [[ -z ${MEGATRON_LM_ARCHIVE:-} && ! -f ../shared/third_party/megatron-lm-core_v0.19.0.tar.gz ]]; then
    # a worktree: the shared sources sit beside the main checkout (git's common directory is <main>/.git)
    common=$(cd "$(git rev-parse --git-common-dir)/.." && pwd)
    candidate=$common/../shared/third_party/megatron-lm-core_v0.19.0.tar.gz
    [[ -f $candidate ]] && export MEGATRON_LM_ARCHIVE=$candidate
  fi
  echo "gpu_prepare: building $DEST (scripts/gpu_wheels.sh)"
  # its own carry-limit check may fail while the tree is large; the size check below is the one that counts
  GPU_WHEELS_DIR=$DEST PYTHON=$PYTHON bash scripts/gpu_wheels.sh || echo "gpu_prepare: gpu_wheels.sh exited $?"
fi
compgen -G "$DEST/*.whl" >/dev/null || { echo "gpu_prepare: no wheels in $DEST" >&2; exit 1; }

size_status="NOT RUN"
size_detail="not available (no scripts/travel_size.py)"
size_rc=0
if [[ -f scripts/travel_size.py ]]; then
  set +e
  size_detail=$("$PYTHON" scripts/travel_size.py --json 2>&1)
  size_rc=$?
  set -e
  size_status=$([[ $size_rc == 0 ]] && echo ok || echo FAILED)
fi
dirty=false
[[ -n $(git status --porcelain --untracked-files=normal 2>/dev/null) ]] && dirty=true
COMMIT_SHA=$(git rev-parse HEAD) DIRTY=$dirty SIZE_STATUS=$size_status SIZE_DETAIL=$size_detail "$PYTHON" - "$DEST/COMMIT" <<'PY'
import json, os, sys
from datetime import datetime, timezone
record = {
    "commit": os.environ["COMMIT_SHA"],
    "dirty": os.environ["DIRTY"] == "true",
    "written_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "travel_size": {"status": os.environ["SIZE_STATUS"], "detail": os.environ["SIZE_DETAIL"][-2000:]},
}
with open(sys.argv[1], "w") as f:
    json.dump(record, f, indent=1)
print(f"gpu_prepare: {sys.argv[1]}: commit {record['commit'][:12]}{' (dirty)' if record['dirty'] else ''}, "
      f"travel size {record['travel_size']['status']}")
PY
echo "gpu_prepare: $(du -sh "$DEST" | cut -f1) in $DEST"
echo "gpu_prepare: now run(command=\"bash scripts/gpu_check.sh --out \$OUT\", carry=[\"$DEST\"], timeout_s=500)"
exit $size_rc
