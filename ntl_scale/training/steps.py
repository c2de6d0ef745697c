"""The pieces of a CE + NTL training step that do not depend on DeepSpeed: config resolution,
global token counts, and the per-micro-batch loss with exact global normalisation.

The counts and the normalisations are :mod:`ntl_scale.normalization`'s; what is DeepSpeed's own here is
the rescale (``scale``: the engine divides the loss by the accumulation steps and averages the
gradients over the data-parallel ranks) and the counts read on the host once per step."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from ..normalization import micro_batch_sums, objective, step_counts
from ..number_vocab import NumberVocab
from ..options import NTLOptions
from ..terms import PerTokenTerms
from .config import NTLConfig, TrainConfig

__all__ = ["global_counts", "loss_from_terms", "resolve_deepspeed_config", "shift_for_causal"]


def resolve_deepspeed_config(
    ds: dict[str, Any], train: TrainConfig, world_size: int, *, bf16_default: bool = False
) -> dict[str, Any]:
    """Fills DeepSpeed's ``"auto"`` values from the training config; a contradiction is an error.

    With ``train.tensor_parallel_size`` N > 1 the JSON gets ``"tensor_parallel": {"autotp_size": N,
    "vocab_parallel_lm_head": true}`` (with any ZeRO stage, 3 included) and the batch size counts
    data-parallel ranks only.

    Args:
        ds: the DeepSpeed JSON as a dict.
        train: the training section of the run config.
        world_size: all ranks (data x tensor parallel).
        bf16_default: what ``train.bf16: null`` (auto) means here: True on a GPU or other accelerator
            with bf16, False on the CPU.

    Returns:
        A resolved copy.
    """
    ds = copy.deepcopy(ds)
    tp = train.tensor_parallel_size
    if world_size % tp:
        raise ValueError(
            f"train.tensor_parallel_size={tp} does not divide the {world_size} ranks; launch a multiple of {tp} "
            "processes (the rest of the world is data parallel)"
        )
    section = ds.setdefault("tensor_parallel", {})
    given = section.get("autotp_size", tp)
    if given not in (tp, "auto") and not (tp == 1 and given == 0):  # DeepSpeed's own "off" is 0
        raise ValueError(
            f"DeepSpeed tensor_parallel.autotp_size={given!r} contradicts train.tensor_parallel_size={tp}; "
            'drop it from the JSON or set it to "auto"'
        )
    if tp > 1:
        # Any ZeRO stage: DeepSpeed >= 0.19.4 trains AutoTP with ZeRO-3 (its engine.py says so; tested here
        # equal to TP=1). ZeRO-3 then partitions each TP shard over the data-parallel ranks and the
        # replicated weights (norms, embeddings) over all ranks.
        if section.get("vocab_parallel_lm_head") is False:
            raise ValueError(
                "tensor_parallel.vocab_parallel_lm_head=false in the DeepSpeed JSON: ntl_scale computes CE + NTL on "
                "the vocabulary shard; remove the key"
            )
        section.update(autotp_size=tp, vocab_parallel_lm_head=True)
    elif not section:
        del ds["tensor_parallel"]  # nothing asked for: the JSON stays as it was
    world_size //= tp
    accumulation = train.accumulation_for(world_size)
    wanted = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": train.micro_batch_size * accumulation * world_size,
    }
    for key, value in wanted.items():
        given = ds.get(key, "auto")
        if given == "auto":
            ds[key] = value
        elif given != value:
            raise ValueError(
                f"DeepSpeed config sets {key}={given!r} but the run config implies {value} "
                f"(train.micro_batch_size={train.micro_batch_size}, train.gradient_accumulation_steps="
                f'{accumulation}, {world_size} ranks); set it to "auto" or make them agree'
            )
    if tp > 1:
        # DeepSpeed 0.19 checks train_batch_size against micro x accumulation x *all* ranks while AutoTP
        # is set up (its data-parallel size is known only later); let it derive the value.
        ds.pop("train_batch_size", None)
    bf16 = ds.get("bf16", {})
    if bf16.get("enabled") == "auto":
        bf16["enabled"] = bf16_default if train.bf16 is None else train.bf16
    elif train.bf16 is not None and bool(bf16.get("enabled", False)) != train.bf16:
        raise ValueError(
            f'DeepSpeed bf16.enabled={bf16.get("enabled")} contradicts train.bf16={train.bf16}; use "auto"'
        )
    params = ds.get("optimizer", {}).get("params", {})
    if params.get("lr", "auto") == "auto":
        params["lr"] = train.lr
    elif float(params["lr"]) != train.lr:
        raise ValueError(f'DeepSpeed optimizer lr={params["lr"]} contradicts train.lr={train.lr}; use "auto"')
    return ds


def shift_for_causal(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets: position ``t`` predicts ``labels[t + 1]``; the last position is ignored."""
    pad = torch.full_like(labels[:, :1], -100)
    return torch.cat([labels[:, 1:], pad], dim=1)


def global_counts(
    targets: list[torch.Tensor],
    vocab: NumberVocab,
    group: dist.ProcessGroup | None,
    options: NTLOptions | None = None,
) -> tuple[float, float]:
    """Target tokens and NTL positions of a whole step: all micro-batches, all DP ranks (``group``).

    :func:`ntl_scale.normalization.step_counts` (NTL positions of ``options``, the run's
    :func:`ntl_options`; None counts number-token targets), read on the host: one SUM all-reduce of two
    numbers over ``group``, computed from the labels before the forward, on the labels' device (NCCL
    reduces device tensors only).
    """
    counts = step_counts(targets, vocab, options, group=group)
    return float(counts[0]), float(counts[1])


def ntl_options(ntl: NTLConfig) -> NTLOptions:
    """The loss variant of a run config, and its ``impl`` (:meth:`ntl_scale.options.NTLRunOptions.options`)."""
    return ntl.options()


def loss_from_terms(
    terms: PerTokenTerms,
    targets: torch.Tensor,
    ntl: NTLConfig,
    *,
    counts: tuple[float, float] | None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss to back-propagate for one micro-batch, and its logging sums, from its per-token terms (of
    the logits, of a vocabulary shard, or of the chunked loss: :meth:`ntl_scale.training.engine.Engine.forward_terms`).

    ``global`` normalisation: ``(sum CE / N + w * sum NTL / K) * scale`` with ``N``, ``K`` the step's
    global counts; ``scale`` undoes the engine's own averaging (gradient-accumulation steps x DP
    size), so the optimizer sees exactly ``sum over the global batch / global count``.
    ``micro-batch``: ``mean CE + w * mean NTL`` of this micro-batch (the engine averages those).

    :func:`ntl_scale.normalization.objective` of the micro-batch's sums, over the step's ``counts``
    (``global``, times ``scale``) or the micro-batch's own (``micro-batch``).

    Returns the loss and its logging sums ``[ce_sum, ntl_sum, tokens, numbers, hits]`` as one float64
    tensor on the loss's device: nothing is read on the host here, so a training step queues its
    micro-batches without waiting for the device; the caller adds them up and reads them once per step.
    """
    sums = micro_batch_sums(terms, targets != -100)
    if ntl.normalization == "global":
        if counts is None:
            raise ValueError("ntl.normalization=global needs the step's global counts")
        loss = objective(sums, counts, ntl.weight, scale=scale)  # scale: the engine's ga x dp, undone by it
    else:
        loss = objective(sums, (sums.tokens, sums.numbers), ntl.weight)
    stats = torch.stack([sums.ce.detach().double(), sums.ntl.detach().double(), sums.tokens.double(),
                         sums.numbers.double(), sums.hits.double()])  # fmt: skip
    return loss, stats
