"""Run tracking: wandb (offline by default) and a PNG of the loss curves. Both import lazily."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from .._runtime import require

__all__ = ["Tracker", "plot_curves"]

WANDB_MODES = ("offline", "online", "disabled")


class Tracker:
    """Logs metrics to wandb on the rank that owns it; does nothing when disabled or not rank 0."""

    def __init__(self, mode: str, run_dir: str, config: dict[str, Any], project: str, active: bool) -> None:
        if mode not in WANDB_MODES:
            raise ValueError(f"tracking.wandb must be one of {WANDB_MODES}, got {mode!r}")
        self.run = None
        if active and mode == "offline" and importlib.util.find_spec("wandb") is None:
            # the default, an optional output: skipped with one line (online, asked for, still needs wandb)
            print("wandb offline log skipped: wandb is not installed (pip install 'ntl_scale[wandb]')", flush=True)
            return
        if active and mode != "disabled":
            wandb = require("wandb", "wandb", f"tracking.wandb={mode}")
            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                mode=mode, dir=run_dir, project=project, config=config, name=os.path.basename(run_dir.rstrip("/"))
            )

    def log(self, row: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log(row, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def read_metric_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``, without a last line cut short by a kill (so such a run resumes); a
    damaged row before the end is a ValueError naming the file and line."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    if lines and not lines[-1].endswith("\n"):
        lines.pop()  # torn by the crash: the step it logged is redone on resume
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{path}, line {number}: not a JSON row ({error}); expected one JSON object per line as the "
                "trainer writes them; delete that line (and the ones after it) to resume from the rows before"
            ) from None
    return rows


def plot_curves(metrics_path: str, png_path: str) -> None:
    """Plots CE and NTL per step from ``metrics.jsonl`` into a PNG (needs matplotlib)."""
    matplotlib = require("matplotlib", "wandb", "the loss-curve plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metric_rows(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("ce", "CE"), ("ntl", "NTL")):  # a step without such tokens has no value (metrics.py)
        ax.plot([r["step"] for r in rows if key in r], [r[key] for r in rows if key in r], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
