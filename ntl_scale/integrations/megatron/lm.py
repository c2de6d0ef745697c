"""Megatron-LM route (``pretrain_gpt.py``, via ``launch/pretrain_gpt_ntl.py``): NTL inside its ``GPTModel``.

:func:`apply_ntl_to_megatron_model` replaces ``compute_language_model_loss(labels, logits)`` (main and MTP
heads) on one model instance (idempotent, undone by :func:`remove_ntl`); :class:`NTLForwardStep` wraps
Megatron-LM's own ``forward_step``, so ``get_batch``, ``loss_func`` and its NaN/Inf checks, MTP and the
schedules stay Megatron's. For a ``megatron.core`` loop of your own see :mod:`ntl_scale.integrations.megatron.core`.

The per-token loss has the value of the cross entropy (so ``lm loss`` logs it; in evaluation the plain one,
:meth:`~ntl_scale.NTLOptions.for_evaluation`) and the gradient of ``a * CE + weight * b * NTL``
(:class:`MicroBatchScale`, :func:`head_loss`): ``(ce - z) + (x - x.detach())``, which is NaN where ``x`` is
not finite, so Megatron's checks still see a non-finite NTL. ``ntl loss``, ``number accuracy`` and
``z loss`` are reported beside it. With ``--ntl-ce-kernel framework`` the CE is Megatron's own method, run
after NTL of the number columns (it overwrites fp32 logits). With ``chunked=True`` the loss comes from the
hidden states and the output weight (:func:`ntl_scale.linear_ce_ntl`), exact under MuP output scaling.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...normalization import MicroBatchSums, apply_factors, factors, micro_batch_sums, step_counts
from ...number_vocab import NumberVocab
from ...options import NTLOptions, check_chunk_route
from ...terms import PerTokenTerms
from ..beside import beside, framework_ce
from .args import NTLSettings
from .terms import (
    context_parallel_pieces,
    is_evaluation,
    megatron_num_tokens,
    output_layer_terms,
    sequence_first_terms,
    without_z_loss,
)

__all__ = [
    "GPTModelNTL",
    "MicroBatchScale",
    "NTLForwardStep",
    "NTLStats",
    "StepGroups",
    "apply_ntl_to_megatron_model",
    "find_language_model",
    "forward_step_from_args",
    "remove_ntl",
]

_ATTR = "_ntl_scale_hook"


@dataclass(frozen=True)
class MicroBatchScale:
    """The main head's gradient weights under global normalisation (``docs/normalization.md``).

    For ``CE_sum / T + weight * NTL_sum / K`` over the global batch after Megatron divides by ``num_tokens``
    ``n`` (:func:`~.terms.megatron_num_tokens`), the micro-batches ``m`` and the DP x CP ranks ``r``:
    ``a = n m r / T``, ``b = n m r / K``; with ``--calculate-per-token-loss`` ``a = D / T``, ``b = D / K``
    (``D`` the step's summed ``num_tokens``; ``D = T`` for a 0/1 mask). :meth:`weights` finishes them with ``n``.

    Attributes:
        tokens: ``T``, the loss-mask weight of the global batch.
        numbers: ``K``, that of its NTL positions (:func:`ntl_scale.ntl_positions`).
        microbatches: ``m``.
        dp_cp_size: ``r``.
        per_token_loss: Megatron's ``--calculate-per-token-loss``.
        divisor: ``D`` for ``per_token_loss``; None: ``T``.
    """

    tokens: torch.Tensor
    numbers: torch.Tensor
    microbatches: int
    dp_cp_size: int
    per_token_loss: bool
    divisor: torch.Tensor | None = None

    def rescale(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """``n m r``, or ``D`` with per-token loss, in the dtype of ``num_tokens`` (float)."""
        if not num_tokens.is_floating_point():
            num_tokens = num_tokens.to(self.tokens.dtype)
        if self.per_token_loss:  # Megatron divides the summed gradients by the step's divisor D itself
            return (self.tokens if self.divisor is None else self.divisor).to(num_tokens.dtype)
        return num_tokens.clamp_min(1) * (self.microbatches * self.dp_cp_size)

    def weights(self, num_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, b)`` for a micro-batch of Megatron ``num_tokens`` (a float of the loss's dtype)."""
        return factors((self.tokens, self.numbers), scale=self.rescale(num_tokens))


def micro_batch_weights(
    sums_tokens: torch.Tensor, sums_numbers: torch.Tensor, num_tokens: torch.Tensor, per_token_loss: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b) = (n / N, n / K)``: the micro-batch's means after Megatron divides by ``num_tokens`` ``n``
    (clamped to 1 as the schedule does, except with per-token loss)."""
    n = num_tokens if per_token_loss else num_tokens.clamp_min(1)
    return factors((sums_tokens, sums_numbers), scale=n.to(sums_tokens.dtype))


def head_loss(
    terms: PerTokenTerms,
    mask: torch.Tensor,
    weight: float,
    *,
    main: bool,
    evaluation: bool,
    scale: MicroBatchScale | None,
    needs_scale: bool,
    per_token_loss: bool,
    remedy: str,
) -> tuple[torch.Tensor, MicroBatchSums]:
    """Per-token ``a CE_t + weight b NTL_t`` of one head and its sums under ``mask``, for both routes.

    ``(a, b)``: main head in training, ``scale.weights`` (a RuntimeError saying ``remedy`` when missing and
    ``needs_scale``), else :func:`micro_batch_weights`; MTP heads, the micro-batch's means.
    """
    sums = micro_batch_sums(terms, mask)
    if main and not evaluation and scale is None and needs_scale:
        raise RuntimeError(
            "--ntl-normalization global needs the step's global counts before each training forward: "
            f"{remedy}, or use normalization='micro-batch'"
        )
    if main and not evaluation and scale is not None:
        ab = scale.weights(megatron_num_tokens(mask).to(sums.tokens.dtype))
    elif main:
        ab = micro_batch_weights(sums.tokens, sums.numbers, megatron_num_tokens(mask), per_token_loss)
    else:
        ab = factors((sums.tokens, sums.numbers))
    return apply_factors(ab, terms.ce, terms.ntl, weight), sums


@dataclass(frozen=True)
class NTLStats:
    """The main head's detached sums of one micro-batch; ``z_sum``, ``tokens`` only in training with a z-loss."""

    ntl_sum: torch.Tensor
    numbers: torch.Tensor
    hits: torch.Tensor
    choice: bool = False
    z_sum: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


def find_language_model(model: Any) -> Any:
    """The ``GPTModel`` inside Megatron's wrappers (DDP, Float16Module, ...)."""
    seen = model
    for _ in range(16):
        if hasattr(seen, "compute_language_model_loss"):
            return seen
        if not hasattr(seen, "module"):
            break
        seen = seen.module
    raise TypeError(
        f"NTL needs a Megatron model with compute_language_model_loss (megatron.core GPTModel), found "
        f"{type(model).__name__} without one; --use-legacy-models and custom models are not supported"
    )


class GPTModelNTL:
    """NTL installed on one ``GPTModel``: set :attr:`scale` before a forward (global), :meth:`pop_stats` after."""

    def __init__(
        self,
        model: Any,
        settings: NTLSettings,
        vocab: NumberVocab,
        tp_group: dist.ProcessGroup | None,
        cp_group: dist.ProcessGroup | None,
        chunk_tokens: int | None,
    ) -> None:
        self.model: Any = model  # a megatron.core GPTModel (typed loosely: Megatron is imported lazily)
        self.settings, self.vocab = settings, vocab
        self.tp_group, self.cp_group = tp_group, cp_group
        self.chunked, self.chunk_tokens = settings.chunked, chunk_tokens
        self.options = settings.options()
        self.scale: MicroBatchScale | None = None
        self._stats: NTLStats | None = None
        self._call: dict | None = None  # labels, loss mask, packed-seq params and MTP count of one forward
        self._originals: dict[str, Any] = {}
        self._megatron_ce: Any = None

    def install(self) -> None:
        model = self.model
        for name in ("forward", "compute_language_model_loss"):
            self._originals[name] = model.__dict__.get(name)
        original_forward = model.forward
        original_loss = model.compute_language_model_loss
        self._megatron_ce = original_loss  # Megatron's CE, with its fusion flags (--ntl-ce-kernel framework)

        def forward(*args, **kwargs):
            labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
            packed = kwargs.get("packed_seq_params", args[6] if len(args) > 6 else None)
            self._call = {"labels": labels, "loss_mask": kwargs.get("loss_mask"), "packed": packed, "mtp": 0}
            try:
                return original_forward(*args, **kwargs)
            finally:
                self._call = None

        def compute_language_model_loss(_model, labels, logits):
            if self._call is None or labels is None:
                return original_loss(labels, logits)
            return self._loss(labels, logits)

        model.forward = forward
        model.compute_language_model_loss = types.MethodType(compute_language_model_loss, model)
        if self.chunked:
            layer = model.output_layer
            self._originals["output_layer.forward"] = layer.__dict__.get("forward")
            original_head = layer.forward

            def head(hidden_states, weight=None, runtime_gather_output=None, **kwargs):
                if self._call is None or self._call["labels"] is None:
                    return original_head(
                        hidden_states, weight=weight, runtime_gather_output=runtime_gather_output, **kwargs
                    )
                self._call["weight"] = weight  # the shared embedding when the model ties them
                return hidden_states, None  # compute_language_model_loss applies the layer, chunk by chunk

            layer.forward = head
        setattr(model, _ATTR, self)

    def uninstall(self) -> None:
        model = self.model
        for key, original in self._originals.items():  # instance attributes: None where the class's ran
            target = model.output_layer if key == "output_layer.forward" else model
            name = key.split(".")[-1]
            if original is None:
                target.__dict__.pop(name, None)
            else:
                target.__dict__[name] = original
        model.__dict__.pop(_ATTR, None)

    def pop_stats(self) -> NTLStats | None:
        """The main head's sums of the last forward (None when it computed no loss)."""
        stats, self._stats = self._stats, None
        return stats

    def _mask_of_head(self, labels: torch.Tensor, mtp_index: int) -> torch.Tensor:
        """The loss mask of the main head (0) or of MTP head ``mtp_index``, rolled as Megatron rolls it."""
        call = self._call
        assert call is not None
        mask = call["loss_mask"]
        mask = torch.ones_like(labels, dtype=torch.float32) if mask is None else mask.to(torch.float32)
        if mtp_index:
            from megatron.core.transformer.multi_token_prediction import roll_tensor

            for _ in range(mtp_index):
                mask, _ = roll_tensor(
                    mask, shifts=-1, dims=-1, cp_group=self.cp_group, packed_seq_params=call["packed"]
                )
        return mask

    def _pieces(self) -> int:
        """Pieces per local sequence: 2 non-adjacent slices under CP for number-level NTL."""
        cp = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        pieces = context_parallel_pieces(cp, self.options)
        if pieces == 1:
            return 1
        if self._call is not None and self._call.get("packed") is not None:
            raise ValueError(
                "--ntl-loss number with context parallelism and packed sequences is not supported: each rank's "
                "slices of a packed sequence follow its documents, which NTL's step counts cannot see. Use a "
                "token-level --ntl-loss, or unpacked sequences, or --context-parallel-size 1"
            )
        return pieces

    def _terms(
        self,
        labels: torch.Tensor,
        logits_or_hidden: torch.Tensor,
        options: NTLOptions,
        through: list[torch.Tensor] | None = None,
    ) -> PerTokenTerms:
        # check_finite=False: non-finite logits reach Megatron's NaN/Inf checks as a NaN loss
        pieces = self._pieces()
        need_ce = not framework_ce(options)  # with Megatron's CE: NTL from the number columns alone
        if not self.chunked:
            width = logits_or_hidden.shape[-1]
            tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
            if width * tp < self.vocab.vocab_size:
                raise ValueError(
                    f"the output layer returned {width} columns x TP {tp}, fewer than the padded vocabulary "
                    f"{self.vocab.vocab_size}: NTL needs vocab-sharded logits (parallel_output=True)"
                )
            return sequence_first_terms(
                logits_or_hidden,
                labels,
                self.vocab,
                options,
                tp_group=self.tp_group,
                check_finite=False,
                pieces=pieces,
                need_ce=need_ce,
                passthrough=through,
            )
        # hidden states [s(/tp), b, H] and the output weight (the shared embedding when tied), no logits
        layer = self.model.output_layer
        shared = self._call.get("weight") if self._call else None
        return output_layer_terms(
            layer,
            logits_or_hidden,
            shared if shared is not None else layer.weight,
            labels,
            self.vocab,
            options,
            self.tp_group,
            chunk_tokens=self.chunk_tokens,
            check_finite=False,
            pieces=pieces,
        )

    def _loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        call = self._call
        assert call is not None
        main = labels is call["labels"] or not getattr(self.model.config, "mtp_num_layers", None)
        if not main:
            call["mtp"] += 1  # MTP heads run before the main head, in order (both supported releases)
        evaluation = is_evaluation(self.model)
        options = self.options.for_evaluation() if evaluation else self.options
        through: list[torch.Tensor] | None = [] if framework_ce(options) and not self.chunked else None
        terms = self._terms(labels, logits, options, through)
        if framework_ce(options):  # after NTL (Megatron's CE overwrites fp32 logits); NTL's columns join its gradient
            terms = beside(self._megatron_ce(labels, logits if not through else through[0]), terms)
        mask = self._mask_of_head(labels, 0 if main else call["mtp"])
        loss, sums = head_loss(
            terms,
            mask,
            self.settings.weight,
            main=main,
            evaluation=evaluation,
            scale=self.scale,
            needs_scale=self.settings.normalization == "global",
            # the micro-batch mean: Megatron's division as the schedule reads the model config
            per_token_loss=bool(getattr(self.model.config, "calculate_per_token_loss", False)),
            remedy="NTLForwardStep sets them (hook.scale); wrap forward_step in it (launch/pretrain_gpt_ntl.py does)",
        )
        ce, z_sum = without_z_loss(terms, labels, options, mask)
        if main:
            with_z = bool(options.z_loss_weight)
            self._stats = NTLStats(
                ntl_sum=sums.ntl.detach(),
                numbers=sums.numbers.detach(),
                hits=sums.hits.detach(),
                choice=framework_ce(options),
                z_sum=z_sum if with_z else None,
                tokens=sums.tokens.detach() if with_z else None,
            )
        # The value of the cross entropy, the gradient of the loss (see the module docstring).
        return ce + (loss - loss.detach())


def apply_ntl_to_megatron_model(
    model: Any,
    settings: NTLSettings,
    vocab: NumberVocab,
    *,
    tp_group: dist.ProcessGroup | None,
    cp_group: dist.ProcessGroup | None = None,
    chunk_tokens: int | None = None,
) -> GPTModelNTL:
    """Makes one Megatron ``GPTModel`` (or a wrapper of it) compute CE + NTL; idempotent.

    Args:
        model: the ``GPTModel`` or a Megatron wrapper around it (DDP, Float16Module).
        settings: the NTL settings (``settings.chunked`` selects the hidden-state route).
        vocab: the number table over the padded vocabulary.
        tp_group: the tensor-parallel group of the output layer.
        cp_group: the context-parallel group (MTP masks roll across it; number-level NTL cuts at its slices).
        chunk_tokens: tokens per chunk of the chunked route; None: ``settings.chunk_tokens``.

    Returns:
        The installed :class:`GPTModelNTL` (the same object on a second call).
    """
    if chunk_tokens is None:
        chunk_tokens = settings.chunk_tokens
    elif settings.chunk_tokens is not None and chunk_tokens != settings.chunk_tokens:
        raise ValueError(
            f"apply_ntl_to_megatron_model(chunk_tokens={chunk_tokens!r}) contradicts "
            f"settings.chunk_tokens={settings.chunk_tokens!r} "
            "(--ntl-chunk-tokens); pass one of them"
        )
    check_chunk_route(settings.chunked, chunk_tokens, "megatron")
    core = find_language_model(model)
    existing = getattr(core, _ATTR, None)
    if existing is not None:
        return existing
    config = getattr(core, "config", None)
    if settings.chunked and getattr(config, "mtp_num_layers", None):
        from megatron.core.transformer import multi_token_prediction as mtp

        if hasattr(mtp, "_compute_mtp_acceptance_counts"):
            raise ValueError(
                "--ntl-chunked with multi-token prediction is not supported on this Megatron release: its MTP "
                "heads compute acceptance metrics from full logits, which the chunked route never builds. "
                "Drop --ntl-chunked (MTP heads then get NTL from their logits) or --mtp-num-layers."
            )
    hook = GPTModelNTL(core, settings, vocab, tp_group, cp_group, chunk_tokens)
    hook.install()
    return hook


def remove_ntl(model: Any) -> bool:
    """Undoes :func:`apply_ntl_to_megatron_model` on a model; returns whether anything was installed."""
    core = find_language_model(model)
    hook = getattr(core, _ATTR, None)
    if hook is None:
        return False
    hook.uninstall()
    return True


class _Replay:
    """The data iterator of one rank with the step's prefetched micro-batches in front."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.buffer: list[Any] = []

    def __iter__(self):
        return self

    def __next__(self):
        if self.buffer:
            return self.buffer.pop(0)
        return next(self.source)


@dataclass
class StepGroups:
    """Megatron's parallel state as :class:`NTLForwardStep` needs it.

    Attributes:
        tp_group: tensor-parallel group of the output layer.
        cp_group: context-parallel group.
        count_group: the ranks sharing one step's counts (``get_tensor_and_data_parallel_group(True)``).
        dp_cp_size: data x context parallel size.
        reads_data: this rank pulls micro-batches (TP rank 0).
        counts_data: this rank's micro-batches enter the counts (TP and CP rank 0).
        device: where the counts are reduced (the GPU with NCCL, the CPU with gloo).
    """

    tp_group: dist.ProcessGroup | None
    cp_group: dist.ProcessGroup | None
    count_group: dist.ProcessGroup | None
    dp_cp_size: int
    reads_data: bool
    counts_data: bool
    device: torch.device | str = "cpu"


class NTLForwardStep:
    """Wraps a Megatron ``forward_step(data_iterator, model, *args, **kwargs)`` to train with NTL.

    Installs :func:`apply_ntl_to_megatron_model` on each model chunk; on the last pipeline stage, at each
    training step's first micro-batch, prefetches the step's micro-batches, counts ``T``, ``K`` (and ``D`` with
    per-token loss) from their ``labels`` and ``loss_mask`` with one SUM all-reduce over ``groups.count_group``,
    and replays them to ``get_batch``. Evaluation counts nothing. Adds ``ntl loss``, ``number accuracy`` and
    (training with a z-loss) ``z loss`` to ``loss_func``'s report as ``[sum, count]`` pairs.

    Args:
        forward_step: Megatron's ``forward_step``.
        settings: the NTL settings (enabled).
        vocab: the number table over the padded vocabulary.
        groups: the parallel layout (:class:`StepGroups`).
        num_microbatches: the training step's micro-batch count, read at each step's start
            (Megatron's ``get_num_microbatches``, which follows batch-size ramp-up).
        per_token_loss: Megatron's ``--calculate-per-token-loss``.
    """

    def __init__(
        self,
        forward_step: Any,
        settings: NTLSettings,
        vocab: NumberVocab,
        groups: StepGroups,
        num_microbatches: Any,
        per_token_loss: bool,
    ) -> None:
        if not settings.enabled:
            raise ValueError("NTLForwardStep needs NTL on (--ntl-weight > 0); call forward_step itself otherwise")
        self.forward_step, self.settings, self.vocab, self.groups = forward_step, settings, vocab, groups
        self.num_microbatches, self.per_token_loss = num_microbatches, per_token_loss
        self._replays: dict[int, _Replay] = {}
        self._left: dict[int, int] = {}  # micro-batches left in the current step, per model chunk
        self._scale: dict[int, MicroBatchScale] = {}  # the current step's counts, per model chunk

    def __call__(self, data_iterator: Any, model: Any, *args: Any, **kwargs: Any):
        if kwargs.get("return_schedule_plan"):
            raise ValueError(
                "NTL does not support schedule plans (--overlap-moe-expert-parallel-comm): the model's "
                "forward runs outside forward_step there. Turn that option off to train with NTL."
            )
        hook = apply_ntl_to_megatron_model(
            model,
            self.settings,
            self.vocab,
            tp_group=self.groups.tp_group,
            cp_group=self.groups.cp_group,
            chunk_tokens=self.settings.chunk_tokens,
        )
        key = id(hook)
        step: MicroBatchScale | None = None
        if getattr(hook.model, "post_process", True) and not is_evaluation(hook.model):
            data_iterator, step = self._step(key, data_iterator)
        elif self._left.get(key):
            raise RuntimeError(
                f"an evaluation pass started while {self._left[key]} micro-batches of a training step were "
                "still pending; NTL's step bookkeeping would mix them"
            )
        hook.scale = step if self.settings.normalization == "global" else None
        output, loss_func = self.forward_step(data_iterator, model, *args, **kwargs)
        stats = hook.pop_stats()
        if stats is None or loss_func is None:
            return output, loss_func
        return output, _ReportNTL(loss_func, stats, step.numbers if step is not None else None)

    def _step(self, key: int, data_iterator: Any) -> tuple[Any, MicroBatchScale]:
        """The iterator for ``get_batch`` and the step's counts (counted on its first micro-batch)."""
        replay = self._replays.get(key)
        if replay is None or (data_iterator is not None and replay.source is not data_iterator):
            if self._left.get(key):
                raise RuntimeError("the data iterator changed in the middle of a training step")
            replay = self._replays[key] = _Replay(data_iterator)
        if not self._left.get(key):
            if replay.buffer:
                raise RuntimeError(
                    f"{len(replay.buffer)} prefetched micro-batches were not consumed by the last step: "
                    "this Megatron release reads its data differently from what NTL's step bookkeeping expects"
                )
            m = self.num_microbatches() if callable(self.num_microbatches) else int(self.num_microbatches)
            counted: list[dict] = []
            if self.groups.reads_data and data_iterator is not None:
                replay.buffer = [next(data_iterator) for _ in range(m)]
                if self.groups.counts_data:
                    counted = [self._checked(item) for item in replay.buffer]
            # whole sequences, cut at the 2 x CP slice borders as the loss cuts them (GPTModelNTL._pieces)
            cp = dist.get_world_size(self.groups.cp_group) if self.groups.cp_group is not None else 1
            options = self.settings.options()
            masks = [item["loss_mask"] for item in counted]
            group = self.groups.count_group
            counts = step_counts(
                [item["labels"] for item in counted],
                self.vocab,
                options,
                loss_masks=masks,
                pieces=context_parallel_pieces(cp, options, whole_sequence=True),
                group=None if self.per_token_loss else group,  # the step's one collective
                device=self.groups.device,
            )
            divisor = None
            if self.per_token_loss:  # Megatron's divisor D too, in the same collective
                counts = torch.cat([counts, self._divisor_counts(masks, counts)])
                if group is not None and dist.get_world_size(group) > 1:
                    dist.all_reduce(counts, group=group)
                if cp > 1 and float(counts[3]) > 0:  # a host read only in this configuration
                    raise ValueError(
                        f"--calculate-per-token-loss with --context-parallel-size {cp} and a loss_mask whose "
                        f"values are not all 0 or 1 ({int(counts[3])} positions of this step): Megatron divides "
                        "the gradients by the sum over the context-parallel ranks of each rank's truncated mask "
                        "sum, which NTL cannot count from the whole sequences, so global normalisation would be "
                        "off. Use a 0/1 loss_mask, or drop --calculate-per-token-loss, or --context-parallel-size 1"
                    )
                divisor = counts[2].float()
            self._left[key] = m
            self._scale[key] = MicroBatchScale(
                tokens=counts[0].float(),
                numbers=counts[1].float(),
                microbatches=m,
                dp_cp_size=self.groups.dp_cp_size,
                per_token_loss=self.per_token_loss,
                divisor=divisor,
            )
        self._left[key] -= 1
        return (replay if replay.source is not None else data_iterator), self._scale[key]

    def _divisor_counts(self, masks: list[torch.Tensor], local: torch.Tensor) -> torch.Tensor:
        """``[D, B]``: the summed Megatron ``num_tokens`` and the count of mask values other than 0 and 1."""
        extra = torch.zeros(2, dtype=torch.float64, device=local.device)
        for mask in masks:
            mask = mask.to(local.device)
            extra[0] += megatron_num_tokens(mask).to(torch.float64)
            extra[1] += ((mask != 0) & (mask != 1)).sum().to(torch.float64)
        return extra

    @staticmethod
    def _checked(item: Any) -> dict:
        """The micro-batch, refused without ``labels`` and ``loss_mask``."""
        if not isinstance(item, dict) or "labels" not in item or "loss_mask" not in item:
            kind = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise ValueError(
                f"NTL counts each step's tokens from the 'labels' and 'loss_mask' of the data iterator's "
                f"micro-batches, which here are {kind}; use a Megatron GPT dataset (GPTDataset, MockGPTDataset, "
                "SFTDataset) or one that yields those keys"
            )
        return item


class _ReportNTL:
    """``loss_func`` plus ``ntl loss``, ``number accuracy`` (and ``z loss``) in its report."""

    def __init__(self, loss_func: Any, stats: NTLStats, numbers_in_step: torch.Tensor | None) -> None:
        self.loss_func, self.stats, self.numbers_in_step = loss_func, stats, numbers_in_step

    def __call__(self, output_tensor: Any, *args: Any, **kwargs: Any):
        outputs = self.loss_func(output_tensor, *args, **kwargs)
        if kwargs.get("non_loss_data") or not (isinstance(outputs, tuple) and len(outputs) == 3):
            return outputs
        loss, num_tokens, report = outputs
        s = self.stats
        ntl = torch.stack([s.ntl_sum, s.numbers])
        hits = torch.stack([s.hits, s.numbers])
        if self.numbers_in_step is not None:
            # a step without number tokens reports [0, 1], not a 0 / 0 NaN; a device-side select
            empty = (self.numbers_in_step == 0).to(ntl.device)
            zero_one = torch.stack([torch.zeros_like(s.ntl_sum), torch.ones_like(s.numbers)])
            ntl, hits = torch.where(empty, zero_one, ntl), torch.where(empty, zero_one, hits)
        report = dict(report)
        report["ntl loss"] = ntl.float()
        # beside Megatron's own CE the full arg-max is inside its kernel: the arg-max among the number columns
        report["number choice accuracy" if s.choice else "number accuracy"] = hits.float()
        if s.z_sum is not None and s.tokens is not None:  # training with a z-loss: its mean over the CE tokens
            report["z loss"] = torch.stack([s.z_sum, s.tokens]).float()
        return loss, num_tokens, report


def forward_step_from_args(forward_step: Any, args: Any, parallel_state: Any, *, tokenizer: Any = None) -> Any:
    """Megatron-LM's ``forward_step`` with NTL, from the run's parsed arguments (after Megatron's initialisation).

    Args:
        forward_step: the release's own ``forward_step(data_iterator, model, ...)``.
        args: Megatron's parsed arguments with the ``--ntl-*`` flags (:func:`add_ntl_args`).
        parallel_state: ``megatron.core.parallel_state``.
        tokenizer: the run's tokenizer; None: Megatron's global one, else built from ``args``.

    Returns:
        ``forward_step`` itself when ``--ntl-weight`` is 0, else an :class:`NTLForwardStep` around it.
    """
    import warnings

    from .args import build_number_vocab, ignored_megatron_flags

    settings = NTLSettings.from_args(args)
    if not settings.enabled:
        return forward_step
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        raise ValueError(
            "--ntl-weight > 0 does not support --overlap-moe-expert-parallel-comm (the model's forward runs "
            "in schedule plans outside forward_step); turn one of them off"
        )
    if getattr(args, "use_legacy_models", False):
        raise ValueError("--ntl-weight > 0 needs megatron.core models; drop --use-legacy-models")
    _check_te_cross_entropy(settings, args)
    if tokenizer is None:
        tokenizer = _megatron_tokenizer(args)
    vocab = build_number_vocab(settings, tokenizer, args.padded_vocab_size)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for note in ignored_megatron_flags(args) if rank == 0 else []:  # each flag this run sets that NTL does not use
        warnings.warn(f"ntl_scale: {note}", stacklevel=2)
    ps = parallel_state
    groups = StepGroups(
        tp_group=ps.get_tensor_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(),
        count_group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
        dp_cp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
        reads_data=ps.get_tensor_model_parallel_rank() == 0,
        counts_data=ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0,
        device=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu",
    )
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return NTLForwardStep(
        forward_step,
        settings,
        vocab,
        groups,
        num_microbatches=get_num_microbatches,
        per_token_loss=bool(args.calculate_per_token_loss),
    )


def _check_te_cross_entropy(settings: NTLSettings, args: Any) -> None:
    """Refuses ``--cross-entropy-fusion-impl te`` beside NTL without Transformer Engine."""
    import importlib.util

    te = getattr(args, "cross_entropy_loss_fusion", False) and getattr(args, "cross_entropy_fusion_impl", None) == "te"
    if settings.options().ce_kernel == "framework" and te and importlib.util.find_spec("transformer_engine") is None:
        raise ValueError(
            "--ntl-ce-kernel framework with --cross-entropy-loss-fusion --cross-entropy-fusion-impl te runs "
            "Transformer Engine's CE, which is not installed: install transformer_engine, or use "
            "--cross-entropy-fusion-impl native"
        )


def _megatron_tokenizer(args: Any) -> Any:
    """Megatron's global tokenizer where the release keeps it, else built from the args."""
    try:
        from megatron.training import get_tokenizer

        tokenizer = get_tokenizer()
        if tokenizer is not None:
            return tokenizer
    except (ImportError, AssertionError):
        pass
    try:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    except ImportError:
        from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer
    return build_tokenizer(args)
