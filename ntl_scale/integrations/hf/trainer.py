"""A ``Trainer`` (or TRL ``SFTTrainer``) subclass with NTL and exact step normalisation."""

from __future__ import annotations

from typing import Any

import torch

from ..._runtime import require
from ...normalization import step_counts
from ...number_vocab import NumberVocab
from ...options import NTLOptions

__all__ = ["count_step_numbers", "ntl_trainer_class"]


def count_step_numbers(loss: Any, samples: list[dict]) -> torch.Tensor:
    """The NTL positions of one optimizer step's micro-batches on this process (float64 0-d, CPU)."""
    options = loss.options
    targets = []
    for batch in samples:
        shifted = batch.get("shift_labels")
        targets.append(shifted if shifted is not None else loss.targets(batch["labels"], options.ignore_index))
    return step_counts([t.cpu() for t in targets], loss.vocab, options, device="cpu")[1]


def ntl_trainer_class(base: Any = None) -> Any:
    """A ``transformers.Trainer`` (or TRL ``SFTTrainer``, ...) subclass that trains with ``CE + weight * NTL``.

    The Trainer's step token count goes to the loss with the step's NTL positions beside it, so CE is
    ``sum / step tokens`` and NTL ``sum / step NTL positions`` whatever the accumulation x device split.

    Usage::

        NTLTrainer = ntl_trainer_class()            # or ntl_trainer_class(trl.SFTTrainer)
        trainer = NTLTrainer(model=model, args=args, train_dataset=ds, number_vocab=vocab, ntl_weight=0.3)

    The constructor takes ``number_vocab``, ``ntl_weight`` (0.3), ``ntl_options`` and ``causal`` (True: labels
    shifted inside; False for encoder-decoders) besides the Trainer's arguments. Logs gain ``ce``, ``ntl``,
    ``number_accuracy`` (and ``z_loss``); ``evaluate()`` adds ``eval_ce``, ``eval_ntl``, ``eval_number_accuracy``.
    With ``ntl_options.ce_kernel="framework"`` the model's own loss function computes CE and
    ``number_choice_accuracy`` replaces ``number_accuracy``.
    """
    transformers = require("transformers", "hf", "ntl_scale.integrations.hf.ntl_trainer_class")
    from .chunked import head_options
    from .loss import NTLCausalLMLoss, installed_loss, is_chunked

    parent = base or transformers.Trainer

    class NTLTrainer(parent):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            *args: Any,
            number_vocab: NumberVocab,
            ntl_weight: float = 0.3,
            ntl_options: NTLOptions | None = None,
            causal: bool = True,
            **kwargs: Any,
        ) -> None:
            super().__init__(*args, **kwargs)
            if getattr(self.args, "label_smoothing_factor", 0):
                # Trainer skips its LabelSmoother when a compute_loss_func is given or the model computes the
                # loss: the factor would be silently ignored
                raise ValueError(
                    f"TrainingArguments.label_smoothing_factor={self.args.label_smoothing_factor} is not applied "
                    "with the NTL loss (Trainer's LabelSmoother does not run beside a loss function); set it to 0 "
                    "and pass ntl_options=NTLOptions(label_smoothing=...) (smoothing over the whole vocabulary; "
                    "NTL keeps the hard number target)"
                )
            self._shift_labels: torch.Tensor | None = None
            installed = installed_loss(self.model) if is_chunked(self.model) else None
            if installed is not None:
                # apply_ntl_to_hf_model(model, chunked=True): the model computes the loss from its hidden states with
                # the labels and the step's [tokens, numbers] (Trainer passes num_items_in_batch to a
                # model whose forward takes **kwargs); the logits are never built.
                same = installed.vocab == number_vocab and installed.ntl_weight == float(ntl_weight)
                if not same or installed.options != (ntl_options or NTLOptions()) or not causal:
                    raise ValueError(
                        "the model has apply_ntl_to_hf_model(chunked=True) with other settings than "
                        "number_vocab/ntl_weight/ntl_options given to the trainer (or causal=False); pass the same ones"
                    )
                self.ntl_loss = installed
                self.model_accepts_loss_kwargs = True
                return
            # a model that soft-caps its logits itself (Gemma 2/3) with ntl_options.logit_softcap: refused, as
            # apply_ntl_to_hf_model refuses it (the logits would be capped twice)
            framework = ntl_options is not None and ntl_options.ce_kernel == "framework"
            if not framework:  # the framework's CE reads the model's own (capped) logits, as NTL does then
                head_options(self.model, ntl_options or NTLOptions())
            own = self.model.loss_function if framework else None  # the model's CE (ce_kernel="framework")
            self.ntl_loss = NTLCausalLMLoss(number_vocab, ntl_weight, ntl_options, causal=causal, framework_loss=own)
            # Trainer's own hook for a loss computed from the model's outputs: Trainer (and TRL) then
            # count the step's tokens, call the model without labels, treat the loss as normalised over
            # the whole step and scale it for the gradient average across devices themselves.
            self.compute_loss_func = self._ntl_compute_loss

        def _ntl_compute_loss(self, outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> Any:
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
            shifted, self._shift_labels = self._shift_labels, None
            return self.ntl_loss(logits, labels, num_items_in_batch=num_items_in_batch, shift_labels=shifted)

        def _divisor(self) -> int:
            """Ranks that see the same batch (Trainer divides its token count by this)."""
            size = 1
            for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
                size *= int(getattr(self, name)()) if hasattr(self, name) else 1
            return size

        def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
            if num_items is None or not samples or "labels" not in samples[0]:
                return samples, num_items
            numbers = count_step_numbers(self.ntl_loss, samples).to(device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                numbers = self.accelerator.gather(numbers.reshape(1)).sum()
            numbers = numbers / self._divisor()
            tokens = torch.as_tensor(num_items, device=device).to(torch.float64).reshape(())
            return samples, torch.stack([tokens, numbers.reshape(())])

        def compute_loss(
            self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            # A collator's shift_labels (padding-free, sequence parallel) are the targets; the model sees them
            # only when it computes the loss itself (the chunked route).
            if self.compute_loss_func is not None:
                self._shift_labels = inputs.pop("shift_labels", None)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def _reduce(self) -> Any:
            """Sums the loss's running totals over the processes (a collective), or None in one process."""
            if self.args.world_size <= 1:
                return None
            return lambda totals: self.accelerator.reduce(totals, "sum")

        def evaluation_loop(
            self,
            dataloader: Any,
            description: str,
            prediction_loss_only: bool | None = None,
            ignore_keys: list[str] | None = None,
            metric_key_prefix: str = "eval",
        ) -> Any:
            # The loop's calls run under no_grad: the loss keeps their sums apart from training's (and computes
            # the plain CE); they are this loop's metrics, never the next training log's.
            self.ntl_loss.eval_totals.zero_()  # a no-grad call outside a loop is not this loop's
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)  # fmt: skip
            means = self.ntl_loss.pop_means(self._reduce(), evaluation=True)  # every process runs the loop
            output.metrics.update({f"{metric_key_prefix}_{name}": value for name, value in means.items()})
            return output

        def log(self, logs: dict, *args: Any, **kwargs: Any) -> None:
            if "loss" in logs:  # every process logs a training step (Trainer gathers the loss there too)
                logs = {**logs, **self.ntl_loss.pop_means(self._reduce())}
            super().log(logs, *args, **kwargs)

    return NTLTrainer
