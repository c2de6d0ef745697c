"""Where a DeepSpeed run resumes: as written, or on another number of ranks through a universal checkpoint
(the same global batch only), and every rank's random generators.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ...atomic import atomic_write, write_atomically

__all__ = [
    "Layout", "load_rng", "plan_resume", "read_layout", "restore_rng", "rng_state", "save_rng", "to_universal",
    "write_layout",
]  # fmt: skip

LAYOUT_FILE = "layout.json"
RNG_FILE = "rng_rank{rank}.pt"


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
    with atomic_write(path) as f:
        json.dump(asdict(layout), f)


def read_layout(ckpt_dir: str) -> Layout | None:
    """The recorded layout, or None when the checkpoints predate the record."""
    path = os.path.join(ckpt_dir, LAYOUT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        then = json.load(f)
    return Layout(then["data_parallel"], then["tensor_parallel"], then.get("global_batch"))


def plan_resume(ckpt_dir: str, now: Layout) -> str | None:
    """How the job with layout ``now`` resumes from ``ckpt_dir``: None (from step 0), ``"same"`` or ``"universal"``.

    Another global batch, or an unrecorded one, is a ValueError before any step.
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
    """Converts the checkpoint ``latest`` names into DeepSpeed's universal format; returns its tag."""
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
    write_atomically(os.path.join(ckpt_dir, "latest_universal"), universal)
    return universal


def _device_generators(accelerator: Any) -> int:
    """How many device generators ``accelerator`` has of its own (DeepSpeed's CPU accelerator: none, its
    generator is the CPU generator)."""
    return 0 if accelerator.device_name() == "cpu" else int(accelerator.device_count())


def rng_state(accelerator: Any) -> dict[str, Any]:
    """This process's random generators (CPU, each device of ``accelerator``, Python's and NumPy's), as plain
    types and tensors (``torch.load(weights_only=True)`` reads them back)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "cpu": torch.get_rng_state(),
        "device_name": accelerator.device_name(),
        "device": [accelerator.get_rng_state(i).cpu() for i in range(_device_generators(accelerator))],
        "python": random.getstate(),
        "numpy": [kind, np.asarray(keys, dtype=np.uint32).tolist(), int(pos), int(has_gauss), float(cached)],
    }


def restore_rng(state: dict[str, Any], accelerator: Any) -> str | None:
    """Sets every generator :func:`rng_state` recorded. Returns a note for the log when the device
    generators do not match (another kind or number of devices: those present and saved are set)."""
    torch.set_rng_state(state["cpu"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    saved, now = state["device"], _device_generators(accelerator)
    for index in range(min(len(saved), now)):
        accelerator.set_rng_state(saved[index], index)
    if len(saved) == now and (now == 0 or state["device_name"] == accelerator.device_name()):
        return None
    return (
        f"the checkpoint holds {len(saved)} {state['device_name']} generator state(s), this process has {now} "
        f"{accelerator.device_name()} device generator(s): the first {min(len(saved), now)} were restored, "
        "dropout there, if the model has it, does not continue the interrupted run's masks"
    )


def save_rng(tag_dir: str, rank: int, accelerator: Any) -> None:
    """Writes this rank's :func:`rng_state` to ``tag_dir/rng_rank{rank}.pt`` (atomically: a crash leaves
    no partial file under that name). Call it before the checkpoint is named ``latest``."""
    os.makedirs(tag_dir, exist_ok=True)
    path = os.path.join(tag_dir, RNG_FILE.format(rank=rank))
    with atomic_write(path, "wb") as f:
        torch.save(rng_state(accelerator), f)


def load_rng(tag_dir: str, rank: int, accelerator: Any, *, cpu_state: torch.Tensor, same_layout: bool) -> str | None:
    """Restores this rank's generators from the checkpoint in ``tag_dir``; returns a note for the log
    when the resumed run's random draws are not exactly the interrupted run's."""
    path = os.path.join(tag_dir, RNG_FILE.format(rank=rank))
    if same_layout and os.path.isfile(path):
        return restore_rng(torch.load(path, weights_only=True), accelerator)
    torch.set_rng_state(cpu_state)
    why = "has no per-rank generator states (an older version wrote it)" if same_layout else "is of another layout"
    return (
        f"{tag_dir} {why}: the CPU generator takes the client state's and the device generators restart "
        "from train.seed: dropout, if the model has it, draws other masks than the interrupted run would have "
        "(the data order is exact)"
    )
