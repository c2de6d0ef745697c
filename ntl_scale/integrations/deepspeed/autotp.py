"""DeepSpeed AutoTP's vocabulary-parallel output layer (``vocab_parallel_lm_head``): the shard, group and
range NTL runs on, the loss from the hidden states on it, and the head and weights gathered whole.

Under ZeRO-3 each TP shard is further partitioned and gathered by ZeRO's hooks around the forward, so the
same functions apply. ``deepspeed`` is imported on first use.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from ...linear import linear_ce_ntl
from ...number_vocab import NumberVocab
from ...options import NTLOptions

__all__ = ["HeadShard", "full_logits", "gathered_weights", "head_shard", "install_vocab_parallel_loss_head"]


class HeadShard(NamedTuple):
    """This rank's part of a vocabulary-parallel output layer."""

    head: torch.nn.Module
    group: Any
    start: int
    end: int


def head_shard(model: torch.nn.Module) -> HeadShard | None:
    """The vocabulary-parallel output layer DeepSpeed installed, or None (no AutoTP, or a gathered head)."""
    heads = [m for m in model.modules() if getattr(m, "is_vocab_parallel_lm_head", False)]
    if not heads:
        return None
    if len(heads) > 1:
        raise ValueError(f"found {len(heads)} vocabulary-parallel output layers; expected one")
    head: Any = heads[0]
    return HeadShard(head, head.mp_group, int(head.vocab_start_index), int(head.vocab_end_index))


def install_vocab_parallel_loss_head(
    shard: HeadShard, vocab: NumberVocab, options: NTLOptions, chunk_tokens: int | None = None
) -> None:
    """Makes AutoTP's vocabulary-sharded output layer compute the loss: ``head(hidden, targets)`` returns
    per-token (CE, NTL, number mask, hit) from this rank's weight rows, chunk by chunk, without the logits."""
    from deepspeed.module_inject.layers import ColumnParallel

    head = shard.head

    def forward(layer: Any, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        if targets is None:
            return type(layer).forward(layer, hidden)
        hidden = ColumnParallel.apply(layer.mp_group, hidden)
        used = options if torch.is_grad_enabled() else options.for_evaluation()  # held-out: the plain CE
        terms = linear_ce_ntl(
            hidden, layer.weight, targets, vocab, used, tp_group=layer.mp_group, chunk_tokens=chunk_tokens,
            vocab_start=shard.start, proportional_grad=not options.reweigh,  # CE summed over valid targets
        )  # fmt: skip
        return tuple(terms)

    head.forward = types.MethodType(forward, head)


@contextlib.contextmanager
def full_logits(shard: HeadShard | None) -> Iterator[None]:
    """The head gathers its output to the whole vocabulary inside (generation needs every column)."""
    if shard is None:
        yield
        return
    head: Any = shard.head
    previous = head.gather_output
    head.gather_output = True
    try:
        yield
    finally:
        head.gather_output = previous


@contextlib.contextmanager
def gathered_weights(model: torch.nn.Module) -> Iterator[None]:
    """Every tensor-parallel layer holds its whole weight inside (to export a plain checkpoint)."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams, TensorParallel_Layer

    seen: set[int] = set()  # a tied embedding shares the output layer's shard: gather that weight once
    with contextlib.ExitStack() as stack:
        for module in model.modules():
            if isinstance(module, TensorParallel_Layer):
                params = [p for p in module.parameters(recurse=False) if id(p) not in seen]
                seen.update(id(p) for p in params)
                if not params:
                    continue
                if any(hasattr(p, "ds_id") and p.ds_status.name != "AVAILABLE" for p in params):
                    raise ValueError(
                        f"{type(module).__name__} holds a ZeRO-3 partitioned weight; enter "
                        "deepspeed.zero.GatheredParameters(list(model.parameters())) before gathered_weights(model)"
                    )
                stack.enter_context(GatherReplacedLayerParams(params, module))
        yield
