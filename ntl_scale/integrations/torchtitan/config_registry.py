"""torchtitan configs with CE + NTL (``--module ntl_scale.integrations.torchtitan --config <function>``):
torchtitan's llama3 config of the same name with the loss replaced by ``ChunkedLossWrapper(NTLLoss)`` (or
:class:`NTLLoss` alone for ``*_ntl_logits``). docs/torchtitan.md has the commands.
"""

from __future__ import annotations

import dataclasses

from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import config_registry as llama3
from torchtitan.trainer import Trainer

from .loss import NTLLoss
from .trainer import NTLTrainer

__all__ = ["llama3_3b_ntl", "llama3_debugmodel_ntl", "llama3_debugmodel_ntl_logits", "with_ntl"]


def with_ntl(config: Trainer.Config, ntl: NTLLoss.Config | None = None, *, chunked: bool = True) -> NTLTrainer.Config:
    """``config`` (any torchtitan ``Trainer.Config``) as an :class:`NTLTrainer.Config` whose loss is CE + NTL."""
    ntl = NTLLoss.Config() if ntl is None else ntl
    if ntl.vocab_size is None and config.model_spec is not None:
        ntl.vocab_size = decoder_vocab_size(config.model_spec)
    loss: NTLLoss.Config | ChunkedLossWrapper.Config = ntl
    if chunked:
        num_chunks = config.loss.num_chunks if isinstance(config.loss, ChunkedLossWrapper.Config) else 8
        loss = ChunkedLossWrapper.Config(num_chunks=num_chunks, loss_fn=ntl)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init and f.name != "loss"}
    return NTLTrainer.Config(**fields, loss=loss)


def llama3_debugmodel_ntl() -> NTLTrainer.Config:
    """torchtitan's ``llama3_debugmodel`` with ``ChunkedLossWrapper(NTLLoss)``: NTL-WAS, weight 0.3, digits."""
    return with_ntl(llama3.llama3_debugmodel())


def llama3_debugmodel_ntl_logits() -> NTLTrainer.Config:
    """``llama3_debugmodel_ntl`` with the loss on the model's full logits (no ``ChunkedLossWrapper``)."""
    return with_ntl(llama3.llama3_debugmodel(), chunked=False)


def llama3_3b_ntl() -> NTLTrainer.Config:
    """The Llama-3.2-3B shape (torchtitan's llama3 ``3B``) with CE + NTL for Llama 3's tokenizer."""
    config = llama3.llama3_debugmodel()
    config.model_spec = llama3.model_registry("3B")
    return with_ntl(config, NTLLoss.Config(digit_level=False, squash_factor=8.0))
