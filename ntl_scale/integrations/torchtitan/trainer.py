"""torchtitan's ``Trainer`` with the step's global NTL count and the CE / NTL / accuracy log.

Before each step :class:`NTLTrainer` reads the step's micro-batches, counts their NTL positions (one SUM
all-reduce over the batch mesh, as torchtitan's ``global_valid_tokens``) and hands the count to the loss;
on logging steps it logs the loss's metrics, which torchtitan 0.3.0's ``Trainer`` drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from ...options import table_source
from ...terms import ntl_counts
from .loss import Z_LOSS_METRIC, NTLLoss

__all__ = ["NTLTrainer"]


class NTLTrainer(Trainer):
    """torchtitan's ``Trainer`` for a loss that is (or wraps) :class:`NTLLoss` (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """torchtitan's ``Trainer.Config``; ``loss`` must be ``NTLLoss.Config`` or a ``ChunkedLossWrapper.Config``
        around one."""

    def __init__(self, config: Config) -> None:
        ntl_config = _ntl_config(config.loss)
        if config.parallelism.context_parallel_degree > 1 and ntl_config.options().loss == "number":
            raise ValueError(
                "loss.loss=number assembles whole numbers along the sequence, which context parallelism splits "
                f"(context_parallel_degree={config.parallelism.context_parallel_degree}); use a token-level loss "
                "(was, mse, mae, huber) or context_parallel_degree 1"
            )
        _check_chunks(config)
        if ntl_config.tokenizer_path is None and not isinstance(table_source(ntl_config.number_vocab), str):
            ntl_config.tokenizer_path = config.hf_assets_path
        if ntl_config.vocab_size is None and config.model_spec is not None:
            ntl_config.vocab_size = decoder_vocab_size(config.model_spec)
        super().__init__(config)
        loss = self.loss_fn.loss_fn if isinstance(self.loss_fn, ChunkedLossWrapper) else self.loss_fn
        assert isinstance(loss, NTLLoss)  # _ntl_config checked the config it was built from
        self.ntl_loss = loss
        self.ntl_pieces = ntl_pieces(config)

    def train_step(self, data_iterator: Any) -> None:
        """torchtitan's step, after counting the step's NTL positions; logs ce / ntl / accuracy (/ z_loss)."""
        micro_batches = self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches
        batches = [next(data_iterator) for _ in range(micro_batches)]
        self.ntl_loss.begin_step(self._step_ntl_positions([labels for _, labels in batches]))
        super().train_step(iter(batches))
        if self.metrics_processor.should_log(self.step):
            self._log_ntl_metrics()

    def _step_ntl_positions(self, labels: list[torch.Tensor]) -> torch.Tensor:
        """``K``: the NTL positions of the step's global batch (one all-reduce over the batch mesh)."""
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for targets in labels:
            counts = ntl_counts(
                targets.to(self.device), self.ntl_loss.vocab, self.ntl_loss.options, pieces=self.ntl_pieces
            )
            local = local + counts[1]
        if self.parallel_dims.dp_enabled:
            return dist_utils.dist_sum_tensor(local, self.parallel_dims.get_mesh("batch"))
        return local

    def _log_ntl_metrics(self) -> None:
        values = torch.stack(list(self.ntl_loss.step_metrics().values())).to(self.device)
        if self.parallel_dims.dp_cp_enabled:
            values = dist_utils.dist_sum_tensor(values, self.parallel_dims.get_optional_mesh("loss"))
        metrics = dict(zip(self.ntl_loss.metric_names, values.tolist()))
        self.metrics_processor.logger.log(metrics, self.step)
        ce, ntl, accuracy = list(metrics.values())[:3]
        line = f"step: {self.step:2}  ce: {ce:8.5f}  ntl: {ntl:8.5f}  number accuracy: {accuracy:.4f}"
        if Z_LOSS_METRIC in metrics:
            line += f"  z_loss: {metrics[Z_LOSS_METRIC]:8.5f}"
        logger.info(line)


def ntl_pieces(config: Trainer.Config) -> int:
    """The equal pieces ``ChunkedLossWrapper`` cuts each sequence into (1 without it): ``loss="number"`` counts a
    number across a cut as two, in the loss and in ``K`` alike (as under context parallelism)."""
    return config.loss.num_chunks if isinstance(config.loss, ChunkedLossWrapper.Config) else 1


def _check_chunks(config: Trainer.Config) -> None:
    """ChunkedLossWrapper splits each rank's sequence into equal chunks: refuse a count that does not divide it."""
    if not isinstance(config.loss, ChunkedLossWrapper.Config):
        return
    chunks, cp = config.loss.num_chunks, max(config.parallelism.context_parallel_degree, 1)
    local = config.training.seq_len // cp
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1 or local % chunks:
        divisors = [d for d in range(1, min(local, 64) + 1) if local % d == 0]
        raise ValueError(
            f"loss.num_chunks={chunks!r} does not divide the sequence each rank holds ({local} tokens: "
            f"training.seq_len {config.training.seq_len} / context parallel {cp}); ChunkedLossWrapper needs equal "
            f"chunks: set --loss.num_chunks to a divisor such as {divisors[-3:]} or change training.seq_len"
        )


def _ntl_config(loss: Any) -> NTLLoss.Config:
    """The ``NTLLoss.Config`` of a loss config (itself, or the ``loss_fn`` of a ``ChunkedLossWrapper.Config``)."""
    inner = loss.loss_fn if isinstance(loss, ChunkedLossWrapper.Config) else loss
    if not isinstance(inner, NTLLoss.Config):
        raise ValueError(
            f"NTLTrainer needs loss=NTLLoss.Config(...) or ChunkedLossWrapper.Config(loss_fn=NTLLoss.Config(...)), "
            f"got {type(loss).__qualname__}"
            + (f" around {type(inner).__qualname__}" if inner is not loss else "")
            + "; use torchtitan's Trainer.Config for other losses"
        )
    return inner
