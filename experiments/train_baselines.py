"""launch/train.py with a competitor's loss term added to CE (+ NTL): DEL, or NTL-WAS over the digit logits.

    python experiments/train_baselines.py --config configs/train/tiny_cpu.yaml ntl.weight=0 baseline.loss=del
    python experiments/train_baselines.py --config ... ntl.weight=0 baseline.loss=digit_was baseline.weight=0.3

Runs ``launch/train.py``'s ``main`` unchanged, with its ``Trainer`` replaced by :class:`BaselineTrainer`
in this process only (without ``baseline.loss``, the run is launch/train.py's as it is, so one study
preset can train its CE and NTL arms through this entry too). Two overrides of its own, taken out
before the run config is read:

* ``baseline.loss``: a name of :data:`experiments.baselines.BASELINES` (``del``, ``digit_was``);
* ``baseline.weight``: the term's weight ``u`` (default: 0.01 for ``del``, their code's constant; 0.3
  for ``digit_was``, the NTL weight of our studies).

The step's objective, exactly normalised over the step like CE and NTL (``docs/normalization.md``)::

    L = sum CE / N  +  ntl.weight * sum NTL / K  +  u * sum term / D

``D`` = the digit targets of the step (all micro-batches and data-parallel ranks; one SUM all-reduce of
one number before the forwards). Each metrics row keeps ``ce``, ``ntl`` (the run's NTL variant; at
``ntl.weight=0`` logged only) and ``number_acc``, and adds ``baseline`` (``sum term / D``) and
``objective`` (``L``). The term needs the full logits: the chunked loss and tensor parallelism are
refused, and so is ``ntl.normalization=micro-batch``. The held-out loss and the generation evaluation
are those of launch/train.py (CE and NTL). The settings are written to ``run_dir/baseline.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from typing import Any, ClassVar

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from baselines import BASELINES, digit_mask  # noqa: E402

from ntl_scale.integrations.deepspeed.steps import global_counts, loss_from_terms  # noqa: E402
from ntl_scale.integrations.deepspeed.trainer import Trainer  # noqa: E402
from ntl_scale.normalization import objective_of_means  # noqa: E402
from ntl_scale.training.collectives import sum_over  # noqa: E402
from ntl_scale.training.metrics import STEP_SUMS, tokens_read  # noqa: E402

DEFAULT_WEIGHTS = {"del": 0.01, "digit_was": 0.3}
"""``baseline.weight`` when not given: DEL's constant (their train-qwen-deepseek.py line 576); our NTL weight."""


def split_overrides(argv: list[str]) -> tuple[list[str], dict[str, Any] | None]:
    """``argv`` without the ``baseline.*`` overrides, and the baseline settings ``{loss, weight}`` (None
    without ``baseline.loss``: the run is launch/train.py's as it is)."""
    rest, given = [], {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key.startswith("baseline."):
            given[key.removeprefix("baseline.")] = value
        else:
            rest.append(arg)
    unknown = set(given) - {"loss", "weight"}
    if unknown:
        raise ValueError(f"unknown override(s) baseline.{sorted(unknown)}: expected baseline.loss and baseline.weight")
    loss = given.get("loss")
    if loss is None and "weight" not in given:
        return rest, None
    if loss not in BASELINES:
        raise ValueError(f"baseline.loss={loss!r}: expected one of {sorted(BASELINES)} (e.g. baseline.loss=del)")
    try:
        weight = float(given.get("weight", DEFAULT_WEIGHTS[loss]))
    except ValueError:
        raise ValueError(f"baseline.weight={given['weight']!r}: expected a number such as 0.01") from None
    if not weight >= 0 or weight == float("inf"):
        raise ValueError(f"baseline.weight={weight}: expected a finite number >= 0")
    return rest, {"loss": loss, "weight": weight}


class BaselineTrainer(Trainer):
    """:class:`~ntl_scale.integrations.deepspeed.trainer.Trainer` whose step adds ``weight * term``
    (set :attr:`baseline`)."""

    baseline: ClassVar[dict[str, Any]] = {}

    def setup(self) -> None:
        if self.cfg.ntl.normalization != "global":
            raise ValueError(
                f"baseline.loss={self.baseline['loss']} normalises its term over the step's digit targets: set "
                f"ntl.normalization=global (got {self.cfg.ntl.normalization!r}) so that CE and NTL are too"
            )
        super().setup()
        if self.engine.chunked or self.engine.tp > 1:
            raise ValueError(
                f"baseline.loss={self.baseline['loss']} needs the full logits: set train.chunked_loss=false and "
                "train.tensor_parallel_size=1"
            )
        if self.rank == 0:
            with open(os.path.join(self.cfg.run_dir, "baseline.json"), "w", encoding="utf-8") as f:
                json.dump(self.baseline, f, indent=2)

    def train_step(self, step: int) -> dict[str, Any]:
        """:meth:`Trainer.train_step` (same order of operations, same sums) plus the baseline term."""
        cfg, engine, inputs = self.cfg, self.engine, self.inputs
        term_of, weight = BASELINES[self.baseline["loss"]], self.baseline["weight"]
        ga, dp = self.resolved.gradient_accumulation_steps, engine.dp
        group = None if dp == 1 else engine.dp_group
        step_start = time.perf_counter()
        engine.set_lr(cfg.train.lr_at(step))
        batches = [inputs.device_batch(inputs.next_micro_batch(), training=True) for _ in range(ga)]
        data_s = time.perf_counter() - step_start
        targets = [engine.targets_of(b) for b in batches]
        counts = global_counts(targets, self.vocab, group, self.options)
        digits = sum((digit_mask(t, self.vocab).sum() for t in targets), torch.zeros((), device=self.device))
        digits = digits.double().reshape(1)  # D: one SUM all-reduce over the data-parallel ranks
        digits_global = float((digits if group is None else sum_over(digits, group)).item())
        sums = torch.zeros(len(STEP_SUMS) + 1, dtype=torch.float64, device=self.device)
        for batch, target in zip(batches, targets):
            logits = engine.ds(**engine.model_inputs(batch, target)).logits
            terms = engine.terms_of_logits(logits, target)
            loss, stats = loss_from_terms(terms, target, cfg.ntl, counts=counts, scale=ga * dp)
            term = term_of(logits, target, self.vocab).value.sum()
            loss = loss + weight * term / max(digits_global, 1.0) * (ga * dp)
            engine.backward(loss)
            sums[:5] += stats
            sums[5] += tokens_read(batch, cfg.model.kind)
            sums[6] += engine.flops.of_batch(batch)
            sums[7] += term.detach().double()
        totals = sum_over(sums, engine.dp_group).cpu().tolist()
        seconds = time.perf_counter() - step_start
        row = self.metrics.step_row(step, totals[:7], lr=engine.lr, grad_norm=engine.grad_norm(), seconds=seconds,
                                    data_s=data_s)  # fmt: skip
        row["baseline"] = totals[7] / max(digits_global, 1.0)
        # a mean the row leaves out (its count 0, metrics.py) counts as 0, as in normalization.objective
        row["objective"] = objective_of_means(row, cfg.ntl.weight) + weight * row["baseline"]
        return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """launch/train.py's ``main`` with :class:`BaselineTrainer` (``baseline.*`` overrides as above)."""
    rest, settings = split_overrides(sys.argv[1:] if argv is None else argv)
    spec = importlib.util.spec_from_file_location("ntl_launch_train", os.path.join(ROOT, "launch", "train.py"))
    assert spec is not None and spec.loader is not None  # the repository's own file
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    if settings is not None:  # this module's copy of launch/train.py only: the file and its users are unchanged
        launch.Trainer = type("BaselineTrainer", (BaselineTrainer,), {"baseline": settings})  # type: ignore[attr-defined]
    return launch.main(rest)


if __name__ == "__main__":
    from launch.finish import run_then_leave  # the checkout is on sys.path (above)

    run_then_leave(main)  # ends as launch/train.py's script does
