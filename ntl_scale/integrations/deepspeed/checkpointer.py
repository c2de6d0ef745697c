"""Checkpoints, resume and the run's status: ``run_dir/checkpoints`` and ``run_dir/status.json``.

``latest`` moves last, after a barrier, so a crash leaves it at the previous complete checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ...atomic import atomic_write, write_atomically
from ...training.collectives import barrier, from_rank_zero, on_rank_zero
from .resume_layout import Layout, load_rng, plan_resume, read_layout, save_rng, to_universal, write_layout

__all__ = ["Checkpointer"]


def _accelerator() -> Any:
    import deepspeed

    return deepspeed.get_accelerator()


class Checkpointer:
    """The checkpoints and status of one run directory."""

    def __init__(self, run_dir: str, layout: Layout, *, save_every: int, rank: int, device: torch.device) -> None:
        self.run_dir = run_dir
        self.dir = os.path.join(run_dir, "checkpoints")
        self.status_path = os.path.join(run_dir, "status.json")
        self.layout, self.save_every = layout, save_every
        self.rank, self.device = rank, device
        self.resume: str | None = None

    def plan(self) -> str | None:
        """How this run starts: None, ``"same"`` or ``"universal"`` (rank 0 converts the checkpoint now, the others
        wait); another global batch is a ValueError here, before any step."""
        self.resume = plan_resume(self.dir, self.layout)
        if self.resume == "universal":  # written on another number of ranks: DeepSpeed re-partitions a universal copy
            if self.rank == 0:
                print(
                    f"resuming {self.run_dir} (written with {read_layout(self.dir).describe()}) on "  # type: ignore[union-attr]
                    f"{self.layout.describe()}: converting its checkpoint to DeepSpeed's universal format",
                    flush=True,
                )
            on_rank_zero(self.rank, self.device, lambda: to_universal(self.dir), "preparing the checkpoint")
        return self.resume

    def due(self, step: int) -> bool:
        """Whether ``train.save_every`` asks for a checkpoint after ``step``."""
        return bool(self.save_every) and step % self.save_every == 0

    def save(self, engine: Any, step: int, data_position: int) -> None:
        """DeepSpeed checkpoint ``step{step}`` of ``engine`` with the data position and the RNG (each rank's
        generators in ``rng_rank{rank}.pt``); ``latest`` moves last."""
        client = {"step": step, "examples_consumed": data_position, "rng": torch.get_rng_state()}
        save_rng(os.path.join(self.dir, f"step{step}"), self.rank, _accelerator())
        engine.save_checkpoint(self.dir, tag=f"step{step}", client_state=client, save_latest=False)
        barrier()  # every rank's shard is on disk before "latest" points at it
        if self.rank == 0:  # a crash before this line leaves "latest" at the previous, complete checkpoint
            write_layout(self.dir, self.layout)
            write_atomically(os.path.join(self.dir, "latest"), f"step{step}")
        barrier()

    def load(self, engine: Any) -> tuple[int, int]:
        """Loads the checkpoint ``latest`` names into ``engine`` (weights, optimizer) and this rank's
        generators; returns ``(step, data position)``."""
        _, client = engine.load_checkpoint(self.dir)
        if "examples_consumed" not in client:
            raise ValueError(
                f"{self.dir} was written by an older launch/train.py (its data position counts micro-batches); "
                "finish it with that version or start a new run_dir"
            )
        step, position = client["step"], client["examples_consumed"]
        note = load_rng(os.path.join(self.dir, f"step{step}"), self.rank, _accelerator(), cpu_state=client["rng"],
                        same_layout=self.resume == "same")  # fmt: skip
        if self.rank == 0:
            print(f"resumed from step {step}" + (f" ({note})" if note else ""), flush=True)
        return step, position

    def read_state(self) -> str:
        """The ``state`` of ``status.json`` (``running``, ``stopped``, ``finished``; none: ``finished``) as rank 0
        reads it; every rank gets the same answer, or the same error."""
        state, error = "finished", None
        if self.rank == 0 and os.path.isfile(self.status_path):
            try:
                with open(self.status_path, encoding="utf-8") as f:
                    state = json.load(f)["state"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                error = f"{self.status_path} is unreadable ({exc!r}); delete it to let the run finish or train on"
        state, error = from_rank_zero((state, error))
        if error is not None:
            raise ValueError(error)
        return str(state)

    def write_status(self, state: str, step: int) -> None:
        """``status.json``: ``running``, ``stopped`` (checkpointed early on a signal) or ``finished``; batch
        scripts read it, and a run started again after its last step finishes only an unfinished one."""
        if self.rank == 0:
            with atomic_write(self.status_path) as f:
                json.dump({"state": state, "step": step}, f)
