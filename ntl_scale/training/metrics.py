"""The metrics of a run: ``metrics.jsonl``, wandb, the progress line and the end-of-run report (rank 0;
the totals come already summed over the data-parallel ranks).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from typing import Any

import torch

from ..atomic import atomic_write
from ..eval.numbers import extract_number
from .config import TrackingConfig
from .flops import FlopsCounter
from .tracking import Tracker, plot_curves, read_metric_rows

__all__ = ["STEP_SUMS", "MetricsLogger", "print_summary", "tokens_read"]

STEP_SUMS = ("ce_sum", "ntl_sum", "tokens", "numbers", "hits", "read", "flops")
"""The logging sums of a training step, in the order of :meth:`MetricsLogger.step_row`'s ``sums``:
the first five are :func:`~ntl_scale.integrations.deepspeed.steps.loss_from_terms`'s, then the tokens the model read
(:func:`tokens_read`) and the model FLOPs."""


def tokens_read(batch: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
    """Every token the model reads (prompts and answers, not padding; seq2seq: the decoder's too)."""
    mask = batch.get("attention_mask")
    read = (
        mask.sum() if mask is not None else torch.tensor(batch["input_ids"].numel(), device=batch["input_ids"].device)
    )
    return read if kind == "causal" else read + (batch["labels"] != -100).sum()


class MetricsLogger:
    """Rows of ``metrics.jsonl``, wandb and the progress line of one run."""

    def __init__(self, tracking: TrackingConfig, run_dir: str, *, steps: int, log_every: int, flops: FlopsCounter,
                 rank: int, world_size: int) -> None:  # fmt: skip
        self.tracking, self.run_dir, self.steps, self.log_every = tracking, run_dir, steps, log_every
        self.flops, self.rank, self.world = flops, rank, world_size
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.history: list[dict[str, Any]] = []
        self.start_step = 0
        self.tracker = Tracker("disabled", run_dir, {}, tracking.project, active=False)  # until open()

    def open(self, start_step: int, config: dict[str, Any]) -> None:
        """wandb (rank 0; ``config`` stored with the run) and ``metrics.jsonl``, cut back to the resumed
        step (steps about to be redone go)."""
        self.start_step = start_step
        tracking = self.tracking
        self.tracker = Tracker(tracking.wandb, self.run_dir, config, tracking.project, active=self.rank == 0)
        if self.rank == 0:
            kept = []
            if os.path.isfile(self.path):  # a row torn by a crash mid-append is left out (read_metric_rows)
                kept = [row for row in read_metric_rows(self.path) if row["step"] <= start_step]
            with atomic_write(self.path) as f:  # a crash here keeps the rows the run had
                f.writelines(json.dumps(row) + "\n" for row in kept)
        self._interval = {"start": time.time(), "tokens": 0, "seconds": 0.0, "steps": 0, "flops": 0.0}
        self._clock = time.time()

    def step_row(self, step: int, sums: list[float], *, lr: float, grad_norm: float, seconds: float,
                 data_s: float) -> dict[str, Any]:  # fmt: skip
        """The metrics row of optimizer step ``step`` from its :data:`STEP_SUMS` (all data-parallel ranks).

        A mean over no positions (``ce``, ``ntl``, ``number_acc``) is left out of the row, not written as a number.
        """
        ce_sum, ntl_sum, tokens, numbers, hits, read, flops = sums
        row: dict[str, Any] = {"step": step}
        if tokens > 0:
            row["ce"] = ce_sum / tokens
        if numbers > 0:
            row["ntl"] = ntl_sum / numbers
            row["number_acc"] = hits / numbers
        row.update({"lr": lr, "grad_norm": grad_norm, "tokens": int(read), "time_s": seconds, "data_s": data_s})
        row["flops"] = flops  # model FLOPs of the step, all ranks (each token once)
        row.update(self.flops.rates(int(read), flops, seconds, self.world))
        return row

    def log(self, row: dict[str, Any]) -> None:
        """One row per step into metrics.jsonl and wandb; a progress line every ``train.log_every`` steps."""
        self.history.append(row)
        interval = self._interval
        interval["tokens"] += row["tokens"]
        interval["seconds"] += row["time_s"]
        interval["flops"] += row["flops"]
        interval["steps"] += 1
        if self.rank != 0:
            return
        self.tracker.log(row, row["step"])
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        step, steps = row["step"], self.steps
        if step % self.log_every == 0 or step == steps:
            elapsed = time.time() - self._clock
            eta = (steps - step) * elapsed / (step - self.start_step)
            rates = self.flops.rates(int(interval["tokens"]), float(interval["flops"]), float(interval["seconds"]),
                                     self.world)  # fmt: skip
            mfu = f"MFU {rates['mfu']:.1%}" if rates.get("mfu") is not None else "MFU n/a"
            evals = f"  eval ppl {row['eval/ppl']:.3f}" if "eval/ppl" in row else ""
            shown = "  ".join(
                f"{name} {row[key]:.{digits}f}" if key in row else f"{name} n/a"
                for name, key, digits in (("ce", "ce", 4), ("ntl", "ntl", 4), ("number acc", "number_acc", 3))
            )
            print(
                f"step {step}/{steps}  {shown}"
                f"{evals}  {interval['tokens'] / max(interval['seconds'], 1e-9):.0f} tok/s "
                f"({rates['tokens_per_s_per_device']:.0f}/device)  {rates['tflops']:.3g} TFLOP/s/device  {mfu}  "
                f"eta {eta:.0f}s",
                flush=True,
            )
            self._interval = {"start": time.time(), "tokens": 0, "seconds": 0.0, "steps": 0, "flops": 0.0}

    def close(self) -> None:
        """Ends the wandb run (a run stopped by a signal)."""
        self.tracker.finish()

    def finish(self, results: dict[str, dict[str, float]], sizes: dict[str, int]) -> None:
        """Rank 0: generation results into wandb and ``eval.json``, the loss plot, the summary tables
        (``sizes``: questions per generation split)."""
        if self.rank != 0:
            return
        flat = {f"eval/{split}/{k}": v for split, m in results.items() for k, v in m.items()}
        self.tracker.log(flat, self.steps)
        self.tracker.finish()
        if self.tracking.plot:
            if importlib.util.find_spec("matplotlib") is None:
                print("loss_curves.png skipped: matplotlib is not installed (pip install 'ntl_scale[wandb]')")
            else:
                plot_curves(self.path, os.path.join(self.run_dir, "loss_curves.png"))
        if results:
            with atomic_write(os.path.join(self.run_dir, "eval.json")) as f:
                json.dump(results, f, indent=2)
            print_summary(self.run_dir, results, sizes)
            if "heldout" in results:
                m = results["heldout"]
                names = ("ppl", "text_ppl", "number_token_ppl", "number_token_acc", "number_token_mae")
                shown = "  ".join(f"{key} {m[key]:.3f}" for key in names if key in m)
                print(f"\nheld-out text ({m['tokens']} tokens): {shown}  ({self.run_dir}/heldout_sequences.jsonl)")


def print_summary(run_dir: str, results: dict, sizes: dict, shown: int = 6) -> None:
    """The end of a run: accuracy and error per held-out split, then a few questions with the model's answers."""
    results = {split: m for split, m in results.items() if split in sizes}  # generation splits only
    if not results:
        return
    print(f"\nheld-out questions, answered by greedy generation ({run_dir}/eval.json)")
    print(f"{'split':<13} {'questions':>9} {'accuracy':>9} {'MAE':>10} {'unparseable':>12}")
    for split, m in results.items():
        print(f"{split:<13} {sizes[split]:>9} {m['accuracy']:>9.1%} {m['mae']:>10.3g} {m['unparseable']:>12.1%}")
    split = next(iter(results))
    with open(os.path.join(run_dir, f"predictions_{split}.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line, _ in zip(f, range(shown))]
    width = max(len(r["question"]) for r in rows)
    print(f"\nexamples ({split}; all in {run_dir}/predictions_{split}.jsonl)")
    for r in rows:
        mark = "right" if r["parsed"] is not None and r["parsed"] == extract_number(r["answer"]) else "wrong"
        generated = r["generated"].strip().replace("\n", "\\n")  # one line per example
        if r["parsed"] is not None and extract_number(r["generated"]) != r["parsed"]:  # cut or reversed answers
            generated += f" (read {r['parsed']:g})"
        print(f"  {r['question']:<{width}}  true {r['answer']:>8}  model {generated:>8}  {mark}")
