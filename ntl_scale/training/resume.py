"""Where a DeepSpeed run resumes: as written, or on another number of ranks through a universal checkpoint.

A run directory's ``checkpoints/layout.json`` records how its checkpoints were split (data-parallel and
tensor-parallel ranks) and the global batch. :func:`plan_resume` compares it with the restarted job:

- the same layout: DeepSpeed loads its own checkpoint;
- another number of data-parallel or tensor-parallel ranks with the same global batch: the checkpoint
  is converted once with DeepSpeed's ``ds_to_universal`` (:func:`to_universal`) and loaded with
  ``"checkpoint": {"load_universal": true}``, which re-partitions the ZeRO optimizer state and the
  AutoTP weight shards for the new layout;
- another global batch: refused before any step (the run would not continue the same curve).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

__all__ = ["Layout", "plan_resume", "read_layout", "to_universal", "write_layout"]

LAYOUT_FILE = "layout.json"


@dataclass(frozen=True)
class Layout:
    """How a run is split: data-parallel and tensor-parallel ranks, and sequences per optimizer step."""

    data_parallel: int
    tensor_parallel: int
    global_batch: int | None  # None: recorded by a version that did not write it

    def describe(self) -> str:
        batch = "" if self.global_batch is None else f", global batch {self.global_batch}"
        return f"{self.data_parallel} data-parallel x {self.tensor_parallel} tensor-parallel ranks{batch}"


def write_layout(ckpt_dir: str, layout: Layout) -> None:
    """Records ``layout`` next to the checkpoints (atomically: a crash leaves the previous record)."""
    path = os.path.join(ckpt_dir, LAYOUT_FILE)
    with open(f"{path}.tmp", "w") as f:
        json.dump(asdict(layout), f)
    os.replace(f"{path}.tmp", path)


def read_layout(ckpt_dir: str) -> Layout | None:
    """The recorded layout, or None when the checkpoints predate the record."""
    path = os.path.join(ckpt_dir, LAYOUT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        then = json.load(f)
    return Layout(then["data_parallel"], then["tensor_parallel"], then.get("global_batch"))


def plan_resume(ckpt_dir: str, now: Layout) -> str | None:
    """How the job with layout ``now`` resumes from ``ckpt_dir``.

    Returns None (no checkpoint: start from step 0), ``"same"`` (load the checkpoint as written) or
    ``"universal"`` (written on another number of ranks: convert with :func:`to_universal`, then load
    with ``load_universal``). Raises ValueError, before any step, when the change cannot continue the
    same run: another global batch, or an unrecorded one.
    """
    if not os.path.isfile(os.path.join(ckpt_dir, "latest")):
        return None
    then = read_layout(ckpt_dir)
    if then is None or then == now:
        return "same"
    where = os.path.dirname(os.path.abspath(ckpt_dir))
    if then.global_batch is None:
        raise ValueError(
            f"the checkpoints in {where} were written with {then.describe()} and no recorded global batch; this "
            f"run has {now.describe()}. Resume with {then.data_parallel * then.tensor_parallel} processes and "
            f"train.tensor_parallel_size={then.tensor_parallel}, or start a new run_dir"
        )
    if then.global_batch != now.global_batch:
        raise ValueError(
            f"the checkpoints in {where} were written with {then.describe()}; this run has {now.describe()}. "
            f"Set train.global_batch_size={then.global_batch} (the accumulation steps are then derived for "
            f"{now.data_parallel} data-parallel ranks) to continue the same run, or start a new run_dir"
        )
    return "universal"


def to_universal(ckpt_dir: str, workers: int = 1) -> str:
    """Converts the checkpoint ``latest`` names into DeepSpeed's universal format; returns its tag.

    Runs DeepSpeed's own converter (``python -m deepspeed.checkpoint.ds_to_universal``) once, into
    ``<tag>_universal`` (written under a temporary name and renamed when complete, so an interrupted
    conversion is redone, never half-read), and points ``latest_universal`` at it. Call it on one rank,
    with the others waiting. The original checkpoint is left as it is.
    """
    with open(os.path.join(ckpt_dir, "latest")) as f:
        tag = f.read().strip()
    universal = f"{tag}_universal"
    target = os.path.join(ckpt_dir, universal)
    if not os.path.isdir(target):
        partial = f"{target}.partial"
        shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted conversion
        command = [
            sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
            os.path.join(ckpt_dir, tag), "--output_folder", partial, "--inject_missing_state",
            "--num_extract_workers", str(workers), "--num_merge_workers", str(workers),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"DeepSpeed could not convert {os.path.join(ckpt_dir, tag)} into a universal checkpoint "
                f"({' '.join(command)}):\n{(done.stdout + done.stderr)[-3000:]}"
            )
        os.replace(partial, target)
    with open(os.path.join(ckpt_dir, "latest_universal.tmp"), "w") as f:
        f.write(universal)
    os.replace(os.path.join(ckpt_dir, "latest_universal.tmp"), os.path.join(ckpt_dir, "latest_universal"))
    return universal
