"""Megatron adapter: NTL from a few flags in an existing Megatron pretraining config.

Pieces, each usable alone (Megatron is imported lazily, only where a Megatron object is needed):

* :func:`add_ntl_args`: the ``--ntl-*`` argument group, for Megatron's ``extra_args_provider``;
* :class:`NTLSettings`: the validated settings (``NTLSettings.from_args(args)``);
* :func:`build_number_vocab`: the number table for Megatron's tokenizer (``inv_vocab``) and padded
  vocabulary, or loaded from a saved JSON table;
* :func:`make_loss_func`: a ``loss_func`` with Megatron's contract ``(loss, num_tokens, report)``
  that computes CE + NTL from the vocab-sharded logits with the fused op (no extra collective) and
  reports ``lm loss``, ``ntl loss`` and ``number accuracy`` as ``[sum, count]`` pairs;
* :class:`GlobalCounts`: the token and number-token counts of the whole global batch, computed once
  per step from the labels of all micro-batches (for ``--ntl-normalization global``).

Normalisation (``docs/megatron.md``): Megatron divides what ``loss_func`` returns by the
``num_tokens`` it returns and by the number of micro-batches (or, with
``--calculate-per-token-loss``, the gradients by the global token count). The NTL term has its own
denominator, so it is pre-scaled here:

* ``micro-batch`` (the paper's semantics): NTL is the mean over the number tokens of each
  micro-batch, added to that micro-batch's mean CE;
* ``global``: CE is ``sum / global token count`` and NTL ``sum / global number-token count`` over
  the whole global batch (all micro-batches and data/context-parallel ranks), so the split into
  micro-batches, accumulation steps and DP ranks does not change the loss or its gradient.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..linear import linear_ce_ntl
from ..losses import LOSS_KINDS, NTLOptions, PerTokenTerms, check_number_level_table, ntl_counts, per_token_ce_ntl
from ..number_vocab import NumberVocab

__all__ = [
    "NORMALIZATIONS",
    "GlobalCounts",
    "NTLLanguageModelMixin",
    "NTLSettings",
    "add_ntl_args",
    "build_number_vocab",
    "count_targets",
    "make_forward_step",
    "make_loss_func",
    "output_layer_terms",
    "plain_loss_func",
]

NORMALIZATIONS = ("micro-batch", "global")
VOCAB_RULES = ("digits", "multi-digit")


@dataclass(frozen=True)
class NTLSettings:
    """NTL settings of a Megatron run.

    Attributes:
        weight: weight of the NTL term; 0 turns NTL off (the plain Megatron loss, bit for bit).
        loss: ``was``, ``mse``, ``mae``, ``huber`` or ``number``.
        number_vocab: ``digits`` (the ten digit tokens), ``multi-digit``, or the path of a table
            saved with ``NumberVocab.save``.
        reweigh: reweigh by the probability mass on number tokens.
        squash_factor: NTL-WAS distance squashing (> 1), or None.
        huber_delta: the Huber threshold.
        normalization: ``micro-batch`` or ``global`` (see the module docstring).
        chunked: compute CE + NTL from the hidden states and the output weight in token chunks,
            never materialising the logits (``--ntl-chunked``).
        chunk_tokens: tokens per chunk of the chunked route; None = the op's default.
    """

    weight: float = 0.0
    loss: str = "was"
    number_vocab: str = "digits"
    reweigh: bool = False
    squash_factor: float | None = None
    huber_delta: float = 1.0
    normalization: str = "micro-batch"
    chunked: bool = False
    chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight) or self.weight < 0:
            raise ValueError(
                f"--ntl-weight must be a finite number >= 0 (0 = off, 0.3 in the paper), got {self.weight!r}"
            )
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"--ntl-normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        if not self.number_vocab:
            raise ValueError("--ntl-number-vocab must be 'digits', 'multi-digit' or the path of a saved table")
        if self.chunk_tokens is not None and (not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1):
            raise ValueError(f"--ntl-chunk-tokens must be a positive integer, got {self.chunk_tokens!r}")
        self.options()  # validates loss, squash factor and Huber delta with the library's own checks
        if self.loss == "number" and self.number_vocab == "multi-digit":
            raise ValueError(
                "--ntl-loss number assembles numbers from single-digit tokens and cannot read a multi-digit table "
                "(a token worth 123 would count as one digit); use --ntl-number-vocab digits (a digit table), or a "
                "token-level --ntl-loss (was, mse, mae, huber) with --ntl-number-vocab multi-digit"
            )

    @property
    def enabled(self) -> bool:
        """Whether NTL contributes to the loss."""
        return self.weight > 0

    def options(self) -> NTLOptions:
        """The library's :class:`~ntl_scale.NTLOptions` for these settings."""
        return NTLOptions(
            loss=self.loss, squash_factor=self.squash_factor, reweigh=self.reweigh, huber_delta=self.huber_delta
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NTLSettings:
        """Reads the ``--ntl-*`` arguments of a parsed Megatron namespace."""
        return cls(
            weight=args.ntl_weight,
            loss=args.ntl_loss,
            number_vocab=args.ntl_number_vocab,
            reweigh=args.ntl_reweigh,
            squash_factor=args.ntl_squash_factor,
            huber_delta=args.ntl_huber_delta,
            normalization=args.ntl_normalization,
            chunked=getattr(args, "ntl_chunked", False),
            chunk_tokens=getattr(args, "ntl_chunk_tokens", None),
        )


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _squash(text: str) -> float:
    value = _non_negative_float(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"the squash factor must be > 1, got {text!r}")
    return value


def add_ntl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the ``--ntl-*`` group; pass it as (or call it from) Megatron's ``extra_args_provider``.

    Args:
        parser: Megatron's argument parser.

    Returns:
        The same parser.
    """
    group = parser.add_argument_group("number token loss (ntl_scale)")
    group.add_argument(
        "--ntl-weight", type=_non_negative_float, default=0.0, help="weight of NTL; 0 (default) = off, 0.3 in the paper"
    )
    group.add_argument("--ntl-loss", choices=LOSS_KINDS, default="was", help="NTL variant (default: was)")
    group.add_argument(
        "--ntl-number-vocab",
        default="digits",
        help="'digits' (default), 'multi-digit', or the path of a table saved with NumberVocab.save",
    )
    group.add_argument("--ntl-reweigh", action="store_true", help="reweigh by the number-token probability mass")
    group.add_argument("--ntl-squash-factor", type=_squash, default=None, help="NTL-WAS distance squashing (> 1)")
    group.add_argument("--ntl-huber-delta", type=_non_negative_float, default=1.0, help="Huber threshold")
    group.add_argument(
        "--ntl-normalization",
        choices=NORMALIZATIONS,
        default="micro-batch",
        help="NTL mean per micro-batch (paper) or over the global batch (split-invariant)",
    )
    group.add_argument(
        "--ntl-chunked",
        action="store_true",
        help="CE + NTL from the hidden states in token chunks, never materialising the logits",
    )
    group.add_argument("--ntl-chunk-tokens", type=_positive_int, default=None, help="tokens per chunk of --ntl-chunked")
    return parser


def build_number_vocab(settings: NTLSettings, tokenizer: Any, padded_vocab_size: int) -> NumberVocab:
    """The number table for a Megatron run.

    Args:
        settings: the NTL settings.
        tokenizer: Megatron's tokenizer (anything ``NumberVocab.from_tokenizer`` accepts, e.g. one
            with ``inv_vocab``); unused when ``number_vocab`` is a path.
        padded_vocab_size: Megatron's ``args.padded_vocab_size`` (the logits' global width).

    Returns:
        The table, sized to the padded vocabulary.
    """
    vocab = _build_number_vocab(settings, tokenizer, padded_vocab_size)
    if settings.loss == "number":
        check_number_level_table(vocab)  # a saved table of other tokens, refused before the first step
    return vocab


def _build_number_vocab(settings: NTLSettings, tokenizer: Any, padded_vocab_size: int) -> NumberVocab:
    rule = settings.number_vocab
    if rule in VOCAB_RULES:
        try:
            return NumberVocab.from_tokenizer(tokenizer, vocab_size=padded_vocab_size, digit_level=rule == "digits")
        except (NotImplementedError, TypeError) as e:
            # NullTokenizer and similar raise NotImplementedError from inv_vocab.
            raise ValueError(
                f"--ntl-number-vocab {rule!r} reads the number tokens from the tokenizer, but "
                f"{type(tokenizer).__name__} has no token table ({type(e).__name__}: {e}). Pass "
                "--ntl-number-vocab PATH with a table saved by `python -m ntl_scale.save_number_vocab "
                "TOKENIZER --out PATH` or NumberVocab.from_tokenizer(...).save(PATH)"
            ) from None
    if not os.path.isfile(rule):
        raise ValueError(
            f"--ntl-number-vocab {rule!r} is neither one of {VOCAB_RULES} nor an existing file; "
            "build a table with NumberVocab.from_tokenizer(...).save(path)"
        )
    return NumberVocab.load(rule, vocab_size=padded_vocab_size)


def count_targets(
    labels: torch.Tensor, loss_mask: torch.Tensor, vocab: NumberVocab, options: NTLOptions | None = None
) -> torch.Tensor:
    """``[tokens, NTL positions]`` of one micro-batch: the loss-mask weight of all labels and of the
    positions that carry NTL (:func:`ntl_scale.ntl_positions`: number labels, or one per number for
    ``--ntl-loss number``), float64."""
    return ntl_counts(labels, vocab, options, loss_mask=loss_mask)


class GlobalCounts:
    """Token and number-token counts of one global batch, reduced once per step.

    Call :meth:`set_step` with the ``(labels, loss_mask)`` of all micro-batches of the step that
    this rank sees (before the first forward); one SUM all-reduce over ``group`` (data x context
    parallel) makes them global.

    Args:
        vocab: the number table.
        group: the data(-and-context)-parallel group, or None for one replica.
        options: the NTL variant (what NTL's denominator counts: :func:`ntl_scale.ntl_positions`).
    """

    def __init__(
        self, vocab: NumberVocab, group: dist.ProcessGroup | None = None, options: NTLOptions | None = None
    ) -> None:
        self.vocab, self.group, self.options = vocab, group, options
        self.tokens: torch.Tensor | None = None
        self.numbers: torch.Tensor | None = None

    def set_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Counts the labels of one step's micro-batches and reduces the counts across ``group``."""
        if not batches:
            raise ValueError("GlobalCounts.set_step needs the (labels, loss_mask) of at least one micro-batch")
        counts = torch.stack([count_targets(labels, mask, self.vocab, self.options) for labels, mask in batches]).sum(0)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(counts, group=self.group)
        self.tokens, self.numbers = counts[0], counts[1]

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tokens is None or self.numbers is None:
            raise RuntimeError(
                "--ntl-normalization global needs the step's global counts before the first loss: "
                "call GlobalCounts.set_step(...) with the step's micro-batches (make_forward_step does this)"
            )
        return self.tokens, self.numbers


def make_loss_func(
    settings: NTLSettings,
    vocab: NumberVocab,
    *,
    tp_group: dist.ProcessGroup | None,
    calculate_per_token_loss: bool = False,
    global_counts: GlobalCounts | None = None,
    num_microbatches: Callable[[], int] | int = 1,
    data_parallel_size: int = 1,
    inplace: bool = False,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]]:
    """A Megatron ``loss_func(labels, loss_mask, logits)`` computing CE + weight * NTL.

    Bind ``labels`` and ``loss_mask`` with ``functools.partial`` in ``forward_step``, as
    ``pretrain_gpt.py`` binds ``loss_mask``; the schedule then calls it with the model output,
    the vocab-sharded logits ``[b, s, V/tp]`` of a model called without labels.

    Args:
        settings: the NTL settings.
        vocab: the number table (global padded vocabulary).
        tp_group: the tensor-parallel group of the output layer.
        calculate_per_token_loss: Megatron's ``--calculate-per-token-loss``.
        global_counts: required for ``normalization="global"``.
        num_microbatches: micro-batches per step (a value or Megatron's ``get_num_microbatches``);
            global normalisation without per-token loss undoes the schedule's division by it.
        data_parallel_size: data-parallel size x context-parallel size (Megatron averages gradients
            over it when not computing per-token loss).
        inplace: reuse the fp32 logits buffer (the logits are not used after the loss).

    Returns:
        ``loss_func(labels, loss_mask, logits) -> (loss, num_tokens, report)``.
    """
    if settings.normalization == "global" and global_counts is None:
        raise ValueError("--ntl-normalization global needs a GlobalCounts (global_counts=...)")
    options = settings.options()

    def loss_func(labels: torch.Tensor, loss_mask: torch.Tensor, logits: torch.Tensor):
        terms = per_token_ce_ntl(logits, labels, vocab, options, tp_group=tp_group, inplace=inplace)
        mask = loss_mask.to(terms.ce.dtype)
        numbers = terms.number_mask.to(mask.dtype) * mask
        ce_sum = (terms.ce * mask).sum()
        ntl_sum = (terms.ntl * mask).sum()
        num_tokens = mask.sum()
        num_numbers = numbers.sum()
        hits = (terms.hit.to(mask.dtype) * numbers).sum()
        if settings.normalization == "micro-batch":
            # The schedule divides by num_tokens: NTL enters as this micro-batch's number-token mean.
            loss = ce_sum + settings.weight * ntl_sum / num_numbers.clamp_min(1) * num_tokens.clamp_min(1)
        else:
            tokens_global, numbers_global = global_counts.get()  # type: ignore[union-attr]
            if calculate_per_token_loss:
                # Gradients are divided by the global token count after the step.
                loss = ce_sum + settings.weight * ntl_sum * tokens_global / numbers_global.clamp_min(1)
            else:
                # Undo the schedule's division by num_tokens and micro-batches and DDP's mean over DP.
                m = num_microbatches() if callable(num_microbatches) else num_microbatches
                undo = num_tokens.clamp_min(1) * m * data_parallel_size
                loss = undo * (
                    ce_sum / tokens_global.clamp_min(1) + settings.weight * ntl_sum / numbers_global.clamp_min(1)
                )
        report = {
            "lm loss": torch.stack([ce_sum, num_tokens]).detach(),
            "ntl loss": torch.stack([ntl_sum, num_numbers]).detach(),
            "number accuracy": torch.stack([hits, num_numbers]).detach(),
        }
        return loss, num_tokens.to(torch.int), report

    return loss_func


def plain_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Megatron-LM's own GPT ``loss_func`` arithmetic for the per-token CE the model returns.

    Used when ``--ntl-weight`` is 0, so the run is the plain Megatron run.
    """
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


Batch = tuple[Any, Any, Any, Any, Any]  # tokens, labels, loss_mask, attention_mask, position_ids


def make_forward_step(
    settings: NTLSettings,
    vocab: NumberVocab | None,
    get_batch: Callable[[Iterator | None], Batch],
    *,
    tp_group: dist.ProcessGroup | None,
    count_group: dist.ProcessGroup | None = None,
    num_microbatches: Callable[[], int] | int = 1,
    calculate_per_token_loss: bool = False,
    data_parallel_size: int = 1,
) -> Callable:
    """A Megatron ``forward_step(data_iterator, model)`` with CE + NTL.

    With NTL on, the model is called without labels and returns the vocab-sharded logits on the
    last pipeline stage; the loss is computed by :func:`make_loss_func`. Other stages are unchanged
    (the schedule never calls their ``loss_func``). With ``--ntl-weight 0`` the model computes its
    own CE and :func:`plain_loss_func` reduces it: the plain Megatron run.

    For ``normalization="global"`` the first call of every step pulls all ``num_microbatches``
    micro-batches, counts their (number) tokens and reduces the counts over ``count_group`` (data x
    context parallel) once; later calls of the step are served from that buffer.

    Args:
        settings: the NTL settings.
        vocab: the number table (may be None on stages other than the last).
        get_batch: returns ``(tokens, labels, loss_mask, attention_mask, position_ids)`` for one
            micro-batch (labels and loss mask may be None on stages that do not need them).
        tp_group: tensor-parallel group of the output layer.
        count_group: data x context parallel group for the global counts.
        num_microbatches: micro-batches per step, or Megatron's ``get_num_microbatches``.
        calculate_per_token_loss: Megatron's ``--calculate-per-token-loss``.
        data_parallel_size: data-parallel x context-parallel size.

    Returns:
        ``forward_step(data_iterator, model) -> (output_tensor, loss_func)``.
    """
    counts = None
    loss_func = None
    if settings.enabled:
        if vocab is None:
            raise ValueError("NTL is on (--ntl-weight > 0) but no number table was given")
        if settings.normalization == "global":
            counts = GlobalCounts(vocab, count_group, settings.options())
        loss_func = make_loss_func(
            settings,
            vocab,
            tp_group=tp_group,
            calculate_per_token_loss=calculate_per_token_loss,
            global_counts=counts,
            num_microbatches=num_microbatches,
            data_parallel_size=data_parallel_size,
        )
    pending: list[Batch] = []

    def next_batch(data_iterator: Iterator | None) -> Batch:
        if counts is None:
            return get_batch(data_iterator)
        if not pending:
            m = num_microbatches() if callable(num_microbatches) else num_microbatches
            pending.extend(get_batch(data_iterator) for _ in range(m))
            with_labels = [(b[1], b[2]) for b in pending if b[1] is not None]
            if with_labels:
                counts.set_step(with_labels)
        return pending.pop(0)

    def forward_step(data_iterator: Iterator | None, model: torch.nn.Module):
        tokens, labels, loss_mask, attention_mask, position_ids = next_batch(data_iterator)
        if loss_func is None:
            output = model(tokens, position_ids, attention_mask, labels=labels)
            return output, functools.partial(plain_loss_func, loss_mask)
        output = model(tokens, position_ids, attention_mask)
        return output, functools.partial(loss_func, labels, loss_mask)

    return forward_step


class NTLLanguageModelMixin:
    """Adds NTL to Megatron's ``compute_language_model_loss`` (the model-side route).

    Use it where the model computes its own loss, e.g. with multi-token-prediction heads, which
    call ``compute_language_model_loss`` for every head::

        class NTLGPTModel(NTLLanguageModelMixin, GPTModel): ...
        model = NTLGPTModel(config=..., ...)
        model.configure_ntl(settings, vocab, tp_group)

    The per-token loss becomes ``ce_t + weight * ntl_t * T / K`` with ``T`` label positions and
    ``K`` number positions of the micro-batch, so that Megatron's token mean of it is the mean CE
    plus ``weight`` times the mean NTL over number tokens (exact when the loss mask keeps every
    position, as in pretraining without padding).
    """

    def configure_ntl(
        self,
        settings: NTLSettings,
        vocab: NumberVocab,
        tp_group: dist.ProcessGroup | None,
        *,
        chunked: bool = False,
        chunk_tokens: int | None = None,
    ) -> None:
        """Turns NTL on for this model (a no-op loss change when ``settings.weight`` is 0).

        ``chunked=True`` computes CE + NTL from the final hidden states and the output layer's
        (vocab-parallel) weight with :func:`ntl_scale.linear_ce_ntl`, never materialising the logits,
        whenever the model is called with labels; without labels it returns logits as before.
        """
        self._ntl = (settings, vocab, tp_group)
        self._ntl_chunked = (chunked, chunk_tokens)
        if chunked and not getattr(self, "_ntl_head_patched", False):
            layer = self.output_layer  # type: ignore[attr-defined]
            original = layer.forward
            model = self

            def forward(hidden_states, weight=None, runtime_gather_output=None, **kwargs):
                if not getattr(model, "_ntl_hidden_mode", False):
                    return original(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output, **kwargs)
                model._ntl_weight = weight  # the shared embedding, when the model ties them
                return hidden_states, None  # the loss below applies the layer, chunk by chunk

            layer.forward = forward
            self._ntl_head_patched = True

    def forward(self, *args, **kwargs):
        """The model's forward; with ``chunked=True`` and labels the output layer hands over hidden states."""
        labels = kwargs.get("labels", args[4] if len(args) > 4 else None)
        chunked = getattr(self, "_ntl_chunked", (False, None))[0]
        self._ntl_hidden_mode = bool(chunked and labels is not None and getattr(self, "_ntl", (None,))[0] is not None)
        try:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._ntl_hidden_mode = False

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        settings, vocab, tp_group = getattr(self, "_ntl", (None, None, None))
        if getattr(self, "_ntl_hidden_mode", False):
            return self._chunked_loss(labels, logits, settings, vocab, tp_group)
        if settings is None or vocab is None or not settings.enabled:
            return super().compute_language_model_loss(labels, logits)  # type: ignore[misc]
        terms = sequence_first_terms(logits, labels, vocab, settings.options(), tp_group=tp_group)
        scale = labels.numel() / terms.number_mask.sum().clamp_min(1)
        return terms.ce + settings.weight * terms.ntl * scale

    def _chunked_loss(self, labels, hidden, settings, vocab, tp_group) -> torch.Tensor:
        """Per-token ``ce + weight * ntl * T / K`` from hidden states ``[s(/tp), b, H]``, no logits."""
        layer = self.output_layer  # type: ignore[attr-defined]
        shared = getattr(self, "_ntl_weight", None)
        weight = shared if shared is not None else layer.weight
        terms = output_layer_terms(
            layer, hidden, weight, labels, vocab, settings.options(), tp_group, chunk_tokens=self._ntl_chunked[1]
        )
        if not settings.enabled:
            return terms.ce
        scale = labels.numel() / terms.number_mask.sum().clamp_min(1)
        return terms.ce + settings.weight * terms.ntl * scale


def _pieces(seq: int, pieces: int) -> tuple[int, int]:
    """The ``[pieces, seq / pieces]`` split of a local sequence (context-parallel slices)."""
    if pieces > 1 and seq % pieces:
        raise ValueError(
            f"the local sequence of {seq} tokens does not split into {pieces} context-parallel slices; "
            "the sequence length must be divisible by 2 x the context-parallel size, as Megatron requires"
        )
    return (pieces, seq // pieces)


def sequence_first_terms(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions,
    *,
    pieces: int = 1,
    **kwargs: Any,
) -> PerTokenTerms:
    """:func:`per_token_ce_ntl` of Megatron's ``[s, b, V/tp]`` logits for ``[b, s]`` labels; terms ``[b, s]``.

    Costs what Megatron's own ``vocab_parallel_cross_entropy`` costs in ``compute_language_model_loss``:

    - the logits are read in the layout the output layer wrote them (a ``[b, s]`` view of them would
      be copied whole by the op's flattening); the labels and the per-token terms are transposed
      instead. Number-level NTL assembles numbers along each sequence and so takes the ``[b, s]``
      layout (that copy included);
    - fp32/fp64 logits are overwritten with the softmax and then the gradient (``inplace``), as
      Megatron's CE overwrites them in the same place: they are not read after the loss. Half-precision
      logits go through the op's fp32 chunk buffer instead.

    ``pieces``: number-level NTL only: the local sequence is this many slices of the global one that are
    not neighbours (context parallelism: Megatron's load-balanced split gives each rank 2), so no number
    is assembled across their seam (:func:`ntl_scale.ntl_positions` counts the same way).
    """
    inplace = logits.dtype in (torch.float32, torch.float64)
    if options.loss == "number":
        b, s = labels.shape
        split = _pieces(s, pieces)
        terms = per_token_ce_ntl(
            logits.transpose(0, 1).unflatten(1, split), labels.unflatten(1, split), vocab, options,
            inplace=inplace, **kwargs,
        )  # fmt: skip
        return PerTokenTerms(*(t.reshape(b, s) for t in terms))
    terms = per_token_ce_ntl(logits, labels.t(), vocab, options, inplace=inplace, **kwargs)
    return PerTokenTerms(*(t.t().contiguous() for t in terms))  # Megatron's loss_func views them flat


def output_layer_terms(
    layer: Any,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions,
    tp_group: dist.ProcessGroup | None,
    *,
    chunk_tokens: int | None = None,
    check_finite: bool = False,
    pieces: int = 1,
) -> PerTokenTerms:
    """Per-token CE + NTL of Megatron's (column-parallel) output layer applied to ``hidden``, without the logits.

    Args:
        layer: the model's ``output_layer`` (its ``sequence_parallel`` flag decides the input path).
        hidden: final hidden states ``[s(/tp), b, H]`` (sequence-split under sequence parallel).
        weight: the layer's weight shard ``[V/tp, H]`` (or the shared embedding when tied).
        labels: ``[b, s]``.
        vocab: the number table; options: the NTL variant; tp_group: the output layer's TP group.
        chunk_tokens: tokens per chunk; check_finite: raise on non-finite logits.
        pieces: number-level NTL: slices of the local sequence that are not neighbours (see
            :func:`sequence_first_terms`).

    Returns:
        :class:`~ntl_scale.PerTokenTerms` shaped ``[b, s]``.
    """
    from megatron.core import tensor_parallel

    # What ColumnParallelLinear does with its input: all-reduce (or reduce-scatter under sequence
    # parallel) of the input gradient over the TP group in the backward. Megatron's reductions need a
    # contiguous gradient, so the [s, b] -> [b, s] transpose happens before them.
    sequence_parallel = getattr(layer, "sequence_parallel", False)
    if sequence_parallel:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, group=tp_group)
    hidden = hidden.transpose(0, 1).contiguous()
    if not sequence_parallel and tp_group is not None and dist.get_world_size(tp_group) > 1:
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    b, s = labels.shape
    split = _pieces(s, pieces if options.loss == "number" else 1)
    terms = linear_ce_ntl(
        hidden.unflatten(1, split),
        weight,
        labels.unflatten(1, split),
        vocab,
        options,
        tp_group=tp_group,
        check_finite=check_finite,
        chunk_tokens=chunk_tokens,
    )
    return PerTokenTerms(*(t.reshape(b, s) for t in terms))
