"""The DeepSpeed training loop of ``launch/train.py``, built from components that take their own section.

:class:`Trainer` owns one run and reads top to bottom: :meth:`~Trainer.setup` builds the components,
:meth:`~Trainer.train_step` is one optimizer step of exactly normalised CE + NTL, :meth:`~Trainer.run`
calls the steps with held-out evaluation and checkpoints on schedule (a signal checkpoints and stops)
and :meth:`~Trainer.complete` ends the run (export, generation evaluation, status).

| component | config section | what it does |
|---|---|---|
| `resolved.Resolved` | `train` and the world | DeepSpeed config, accumulation, layout, bf16: `resolved.json` |
| `checkpoint.Checkpointer` | `run_dir`, `train.save_every` | checkpoints, resume plan, `status.json` |
| `inputs.Inputs` | `data`, `model` | tokenizer, number table, micro-batches on the device |
| `engine.Engine` | `model`, `train`, `ntl` | the model under DeepSpeed, per-token terms, export |
| `evaluator.Evaluator` | `eval`, `data` | held-out loss and perplexity, generation evaluation |
| `metrics.MetricsLogger` | `tracking` | `metrics.jsonl`, wandb, the progress line, `eval.json` |

The run config is never changed (what the run derives is :class:`~.resolved.Resolved`); distributed is
initialised by ``launch/train.py``; collectives go through :mod:`~ntl_scale.training.collectives` on device tensors.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from ..._validation import check_table
from ...training.collectives import from_rank_zero, largest_over_ranks, sum_over
from ...training.config import RunConfig
from ...training.metrics import STEP_SUMS, MetricsLogger, tokens_read
from ...training.model_inputs import (
    Inputs,
    check_one_token_per_digit,
    check_position_ids,
    load_data,
    tokenizer_and_table,
)
from .checkpointer import Checkpointer
from .engine import Engine
from .heldout import Evaluator, heldout_micro_batches
from .resolved import RESOLVED_FILE, accelerator_has_bf16, resolve_run
from .steps import global_counts, loss_from_terms, ntl_options, z_loss_sum

__all__ = ["Trainer"]


class Trainer:
    """One DeepSpeed run of CE + NTL.

    Args:
        cfg: the run config (read, never changed).
        rank: this process's global rank.
        world_size: all ranks (data x tensor parallel).
        device: the accelerator device of this rank (DeepSpeed's
            ``get_accelerator().current_device_name()``); the engine's device once it is built.
    """

    def __init__(self, cfg: RunConfig, *, rank: int, world_size: int, device: torch.device | str) -> None:
        self.cfg = cfg
        self.rank, self.world = rank, world_size
        self.device = torch.device(device)
        self.options = ntl_options(cfg.ntl)
        self.stop_signal = 0
        self.start_step = 0
        self.sequences_path = os.path.join(cfg.run_dir, "heldout_sequences.jsonl")
        self.final_heldout: dict[str, float] = {}

    def request_stop(self, signum: int) -> None:
        """Checkpoint and stop after the current step (a signal handler's target)."""
        self.stop_signal = signum

    def setup(self) -> None:
        """Builds the components and loads the checkpoint to resume from."""
        cfg, rank, train = self.cfg, self.rank, self.cfg.train
        os.makedirs(cfg.run_dir, exist_ok=True)
        resolved = resolve_run(train, self.world, bf16_default=accelerator_has_bf16(self.device))
        self.checkpoints = Checkpointer(cfg.run_dir, resolved.layout, save_every=train.save_every, rank=rank,
                                        device=self.device)  # fmt: skip
        self.resolved = resolved.resuming(self.checkpoints.plan())  # an impossible change stops here, before any step

        self.tokenizer, self.vocab, vocab_size = tokenizer_and_table(cfg.model, cfg.ntl.digit_level)
        check_table(self.vocab, self.options, "yaml")  # before any data is read
        if cfg.data.position_coupling:
            check_one_token_per_digit(self.tokenizer, self.vocab, cfg.model.tokenizer)
        train_set, eval_splits = load_data(cfg.data, self.tokenizer, kind=cfg.model.kind, seq_length=train.seq_length,
                                           rank=rank)  # fmt: skip
        self.engine = engine = Engine.build(
            cfg.model,
            train,
            self.options,
            self.resolved,
            tokenizer=self.tokenizer,
            vocab=self.vocab,
            vocab_size=vocab_size,
            rank=rank,
            device=self.device,
        )
        self.device = engine.device
        if cfg.data.position_coupling:
            check_position_ids(engine.model, cfg.data)

        self.inputs = Inputs(cfg.data, train_set, self.tokenizer, self.vocab, micro_batch_size=train.micro_batch_size,
                             accumulation=self.resolved.gradient_accumulation_steps, seed=train.seed, rank=rank,
                             dp_rank=engine.dp_rank, dp=engine.dp, device=engine.device)  # fmt: skip
        heldout = heldout_micro_batches(cfg.data, self.tokenizer, eval_splits, kind=cfg.model.kind,
                                        seq_length=train.seq_length, micro_batch_size=train.micro_batch_size,
                                        dp_rank=engine.dp_rank, dp=engine.dp)  # fmt: skip
        self.evaluator = Evaluator(
            cfg.eval,
            cfg.data,
            cfg.run_dir,
            engine=engine,
            inputs=self.inputs,
            batches=heldout,
            eval_splits=eval_splits,
            weight=cfg.ntl.weight,
            rank=rank,
            world_size=self.world,
        )
        self.metrics = MetricsLogger(cfg.tracking, cfg.run_dir, steps=train.steps, log_every=train.log_every,
                                     flops=engine.flops, rank=rank, world_size=self.world)  # fmt: skip
        engine.write_partition(cfg.run_dir, rank)
        if self.resolved.resume:
            self.start_step, self.inputs.position = self.checkpoints.load(engine.ds)

    def _changes_from_record(self) -> list[str]:
        """``key: saved -> given`` for each config value that differs from the run's ``config.json`` (if any)."""
        path = os.path.join(self.cfg.run_dir, "config.json")
        if not os.path.isfile(path):
            return []
        with open(path, encoding="utf-8") as f:
            saved = _flat(json.load(f))
        given = _flat(json.loads(json.dumps(self.cfg.to_dict())))
        keys = sorted((saved.keys() | given.keys()) - {"run_dir"})  # the same folder, perhaps spelt otherwise
        return [f"{k}: {saved.get(k)!r} -> {given.get(k)!r}" for k in keys if saved.get(k) != given.get(k)]

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step over the accumulation micro-batches; returns its metrics row.

        CE and NTL are normalised by the step's global counts (one SUM all-reduce before the forwards); the
        logging sums are read once, after one SUM all-reduce over the data-parallel ranks.
        """
        cfg, engine, inputs = self.cfg, self.engine, self.inputs
        ga, dp = self.resolved.gradient_accumulation_steps, engine.dp
        step_start = time.perf_counter()
        engine.set_lr(cfg.train.lr_at(step))
        batches = [inputs.device_batch(inputs.next_micro_batch(), training=True) for _ in range(ga)]
        data_s = time.perf_counter() - step_start
        targets = [engine.targets_of(b) for b in batches]
        counts = global_counts(targets, self.vocab, None if dp == 1 else engine.dp_group, self.options)
        z_weight = self.options.z_loss_weight
        # STEP_SUMS, then the z-loss sum (logged apart from ce as z_loss)
        sums = torch.zeros(len(STEP_SUMS) + 1, dtype=torch.float64, device=self.device)
        for batch, target in zip(batches, targets):
            terms = engine.forward_terms(batch, target)
            loss, stats = loss_from_terms(terms, target, cfg.ntl, counts=counts, scale=ga * dp)
            engine.backward(loss)  # DeepSpeed steps the optimizer only at the accumulation boundary
            sums[:5] += stats
            sums[5] += tokens_read(batch, cfg.model.kind)
            sums[6] += engine.flops.of_batch(batch)
            sums[7] += z_loss_sum(terms, target, z_weight)
        totals = sum_over(sums, engine.dp_group).cpu().tolist()  # TP ranks hold the same sums: DP only
        seconds = time.perf_counter() - step_start  # data, forward, backward, optimizer, logging reduce
        row = self.metrics.step_row(step, totals[: len(STEP_SUMS)], lr=engine.lr, grad_norm=engine.grad_norm(),
                                    seconds=seconds, data_s=data_s)  # fmt: skip
        tokens = totals[STEP_SUMS.index("tokens")]
        if z_weight and tokens > 0:  # the mean z-loss per target token: ce + z_loss is the objective's CE term
            row["z_loss"] = totals[len(STEP_SUMS)] / tokens
        return row

    def stop_requested(self) -> int:
        """The largest signal any rank received (0: none); every rank agrees."""
        return largest_over_ranks(self.stop_signal, self.device)

    def run(self) -> dict[str, Any]:
        """Set-up, the steps (with held-out evaluation every ``train.eval_every`` steps and checkpoints
        every ``train.save_every``), the final checkpoint, export, evaluation. A signal checkpoints and stops."""
        from ...training.sources import PACKED_SOURCES

        cfg, steps = self.cfg, self.cfg.train.steps
        self.setup()
        packed = cfg.data.source in PACKED_SOURCES
        state = self.checkpoints.read_state() if self.start_step >= steps else "running"
        if self.start_step > steps and state != "finished":
            raise ValueError(
                f"{cfg.run_dir} has a checkpoint at step {self.start_step}, past train.steps={steps}, and was not "
                f"finished ({state}): set train.steps={self.start_step} to finish it, or more to train on"
            )
        if state == "finished":  # started again after it finished: say so, change nothing
            changes = from_rank_zero(self._changes_from_record() if self.rank == 0 else [])
            if changes:
                raise ValueError(
                    f"{cfg.run_dir} already finished at step {self.start_step} with another config "
                    f"({'; '.join(changes)}); its record (config.json, eval.json, the checkpoint) stays as it is. "
                    "Fix: give this config a new run_dir (or, to train this run on, only raise train.steps)"
                )
            if self.rank == 0:
                print(
                    f"{cfg.run_dir} already finished: its checkpoint is at step {self.start_step} of train.steps="
                    f"{steps}; nothing to do (raise train.steps to train on, or use a new run_dir)",
                    flush=True,
                )
            return {"finished_before": self.start_step, "history": []}
        if self.rank == 0:  # the record, once the run is known to train or finish: never over a finished run's
            cfg.save(os.path.join(cfg.run_dir, "config.json"))  # as given; what the run derived: resolved.json
            self.resolved.save(os.path.join(cfg.run_dir, RESOLVED_FILE))
        self.metrics.open(self.start_step, {**cfg.to_dict(), "resolved": self.resolved.to_dict()})
        if self.start_step >= steps:  # stopped by a signal after its last step: export and evaluate now
            if self.rank == 0:
                print(f"{cfg.run_dir}: every step is done (checkpoint at step {self.start_step}); exporting and "
                      "evaluating", flush=True)  # fmt: skip
            if self.evaluator.batches and cfg.eval.at_end and packed:  # the final held-out text, as at the last step
                heldout = self.evaluator.heldout(per_sequence=self.sequences_path)
                self.final_heldout = {k.removeprefix("eval/"): v for k, v in heldout.items()}
            return self.complete(self.start_step, save=False)
        self.checkpoints.write_status("running", self.start_step)  # a crash from here on leaves the run unfinished
        for step in range(self.start_step + 1, steps + 1):
            row = self.train_step(step)
            every = cfg.train.eval_every
            final = step == steps and cfg.eval.at_end
            if self.evaluator.batches and ((every and step % every == 0) or final):
                started = time.perf_counter()
                sequences = self.sequences_path if final and packed else None  # the pretraining study's pairs
                row.update(self.evaluator.heldout(per_sequence=sequences))
                row["eval_s"] = time.perf_counter() - started
                if final and packed:
                    self.final_heldout = {k.removeprefix("eval/"): v for k, v in row.items() if k.startswith("eval/")}
            self.metrics.log(row)
            signum = self.stop_requested()
            if self.checkpoints.due(step) or signum:
                self.checkpoints.save(self.engine.ds, step, self.inputs.position)
            if signum:
                if self.rank == 0:
                    print(f"signal {signum}: checkpointed at step {step}, stopping", flush=True)
                self.metrics.close()
                self.checkpoints.write_status("stopped", step)
                return {"stopped_at": step, "history": self.metrics.history}
        return self.complete(steps)

    def complete(self, step: int, *, save: bool = True) -> dict[str, Any]:
        """The end of a run: the final checkpoint (``save``), export, generation evaluation, status."""
        if save:
            self.checkpoints.save(self.engine.ds, step, self.inputs.position)
        self.engine.export(self.cfg.run_dir, self.tokenizer, self.rank)
        results = self.evaluator.generation() if self.cfg.eval.at_end else {}
        if self.final_heldout:  # a pretraining corpus's held-out text
            results["heldout"] = self.final_heldout
        self.metrics.finish(results, {split: len(examples) for split, examples in self.evaluator.eval_splits.items()})
        self.checkpoints.write_status("finished", step)
        return {"history": self.metrics.history, "eval": results}


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}`` (the override syntax of the keys)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat
