"""Runs torchtitan trainers on CPU over gloo and records what the tests compare. Test only.

    torchrun --nproc_per_node 2 tests/helpers/torchtitan_step.py OUT_DIR TAG <torchtitan.train arguments>

The run is built with torchtitan's own ``ConfigManager`` and ``config.build()`` (torchtitan's ``Trainer``
or ntl_scale's ``NTLTrainer``) and trained with its own ``train_step`` for ``--training.steps`` steps.
One run per launch: a second trainer in the same processes (after ``destroy_process_group``) hangs in
its first collective. Each rank writes ``OUT_DIR/<TAG>.rank<r>.pt`` with:

* ``losses``: the ``global_avg_loss`` torchtitan logs at every step;
* ``logged``: every metrics dict given to torchtitan's metric loggers (NTLTrainer's ce / ntl / accuracy);
* at step 1: ``hidden`` (the input of ``lm_head``, the chunks in order), ``labels`` (this rank's
  micro-batch), and, gathered from their DTensor shards, the ``lm_head`` weight and its gradient as the
  optimizer receives it (after torchtitan's clipping: runs pass a large ``--training.max_norm``).
* with ``--validator.enable``: torchtitan's own ``Validator.validate`` runs after each step it asks for
  (``should_validate``), as torchtitan's ``Trainer.train`` runs it; ``validation`` is a list, one entry
  per validation, of ``{"step", "logits", "labels"}``: the (gathered) ``lm_head`` outputs of this rank's
  validation batches and their labels, the chunks and batches in order along the sequence (token ``t``
  of ``logits`` predicts ``labels[..., t]``). Its logged ``validation_metrics/loss`` is in ``logged``.
* with ``--checkpoint.enable``: torchtitan's ``checkpointer.save`` after each step, as ``Trainer.train``
  calls it (``last_step`` at the last), and ``final``: ``{"tokens", "logits"}``, this rank's step-1 inputs
  and the trained model's (gathered) logits on them after the last step.

The CPU patches of :mod:`tests.helpers.torchtitan_cpu` are applied first.
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # this folder's tokenizers.py would shadow the tokenizers package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from tests.helpers.torchtitan_cpu import patch_for_cpu


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run(tag: str, args: list[str], out: str) -> None:
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(args)
    trainer = config.build()
    record: dict = {"losses": [], "logged": [], "hidden": [], "validation": []}
    lm_head = trainer.model_parts[0].lm_head
    validating: list[dict] = []  # the validation under way, if any

    def keep_hidden(module, inputs):  # type: ignore[no-untyped-def]
        if trainer.step == 1 and not validating:
            record["hidden"].append(_full(inputs[0]))

    def keep_logits(module, inputs, output):  # type: ignore[no-untyped-def]
        if validating:
            validating[0]["logits"].append(_full(output))

    hooks = [lm_head.register_forward_pre_hook(keep_hidden), lm_head.register_forward_hook(keep_logits)]
    log, metric_log, optimizer_step = (
        trainer.metrics_processor.log,
        trainer.metrics_processor.logger.log,
        trainer.optimizers.step,
    )

    def log_loss(step, global_avg_loss, *a, **k):  # type: ignore[no-untyped-def]
        record["losses"].append(float(global_avg_loss))
        return log(step, global_avg_loss, *a, **k)

    def log_metrics(metrics, step):  # type: ignore[no-untyped-def]
        record["logged"].append({k: float(v) for k, v in metrics.items() if "loss" in k})
        return metric_log(metrics, step)

    def step_optimizer(*a, **k):  # type: ignore[no-untyped-def]
        if trainer.step == 1:
            record["weight"] = _full(lm_head.weight)
            record["grad"] = _full(lm_head.weight.grad)
        return optimizer_step(*a, **k)

    trainer.metrics_processor.log = log_loss
    trainer.metrics_processor.logger.log = log_metrics
    trainer.optimizers.step = step_optimizer

    def labels_of(batches):  # type: ignore[no-untyped-def]
        for inputs, labels in batches:
            if trainer.step == 1:
                record.setdefault("labels", []).append(labels.clone())
                record.setdefault("inputs", []).append(inputs["input"].clone())
            yield inputs, labels

    if config.validator.enable:
        prepare = trainer.validator.post_dataloading_process

        def keep_labels(input_dict, labels, model_parts):  # type: ignore[no-untyped-def]
            validating[0]["labels"].append(labels.clone())
            return prepare(input_dict, labels, model_parts)

        trainer.validator.post_dataloading_process = keep_labels

    data = labels_of(trainer.batch_generator(trainer.dataloader))
    while trainer.step < config.training.steps:
        trainer.step += 1
        trainer.train_step(data)
        if config.checkpoint.enable:
            trainer.checkpointer.save(trainer.step, last_step=trainer.step == config.training.steps)
        if config.validator.enable and trainer.validator.should_validate(trainer.step):  # as Trainer.train
            validating.append({"step": trainer.step, "logits": [], "labels": []})
            trainer.validator.validate(trainer.model_parts, trainer.step)
            done = validating.pop()
            record["validation"].append(
                {
                    "step": done["step"],
                    "logits": torch.cat(done["logits"], dim=1),
                    "labels": torch.cat(done["labels"], dim=1),
                }
            )
    for hook in hooks:
        hook.remove()
    if config.checkpoint.enable:
        model = trainer.model_parts[0]
        tokens = record["inputs"][0]
        with torch.no_grad():
            result = model(tokens)
            logits = result if result.shape[-1] == lm_head.weight.shape[0] else lm_head(result)  # skipped lm_head
        record["final"] = {"tokens": tokens, "logits": _full(logits)}
    record["hidden"] = torch.cat(record["hidden"], dim=1)
    record["labels"] = torch.cat(record["labels"], dim=0)
    rank = torch.distributed.get_rank()
    torch.save(record, os.path.join(out, f"{tag}.rank{rank}.pt"))
    trainer.close()
    torch.distributed.destroy_process_group()


def main() -> None:
    patch_for_cpu()
    run(sys.argv[2], sys.argv[3:], sys.argv[1])


if __name__ == "__main__":
    from launch.finish import run_then_leave

    run_then_leave(main)
