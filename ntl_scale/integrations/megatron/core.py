"""Megatron route for a ``megatron.core`` training loop of your own: ``loss_func`` and ``forward_step``.

For Megatron-LM's ``pretrain_gpt.py`` use :mod:`ntl_scale.integrations.megatron.lm`. Each piece works alone
(Megatron is imported lazily); the flags are in :mod:`.args`:

* :func:`make_loss_func`: a ``loss_func`` ``(loss, num_tokens, report)`` of CE + NTL from vocab-sharded logits;
* :class:`GlobalCounts`: the step's token and number-token counts (``--ntl-normalization global``);
* :func:`make_forward_step`: a ``forward_step(data_iterator, model)`` with both;
* :class:`NTLLanguageModelMixin`: NTL inside the model's ``compute_language_model_loss`` (MTP heads).

The loss is pre-scaled so that after Megatron's divisions (by ``num_tokens``, the mask's truncated sum, and
the micro-batches; or by the step's summed ``num_tokens`` with per-token loss) it is the objective, for any
non-negative loss mask: per micro-batch means (``micro-batch``) or sums over the global batch divided by its
counts (``global``; ``docs/normalization.md``). ``ce_kernel="framework"`` takes Megatron's CE and adds NTL beside it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...normalization import apply_factors, micro_batch_sums, objective, step_counts
from ...number_vocab import NumberVocab
from ...options import NTLOptions, check_chunk_route, check_option
from ...terms import PerTokenTerms, ntl_counts
from ..beside import beside, framework_ce
from .args import NTLSettings
from .lm import MicroBatchScale, head_loss, micro_batch_weights
from .terms import (
    batch_first_terms,
    context_parallel_pieces,
    is_evaluation,
    megatron_cross_entropy,
    megatron_num_tokens,
    output_layer_terms,
    sequence_first_terms,
    without_z_loss,
)

__all__ = [
    "GlobalCounts",
    "NTLLanguageModelMixin",
    "count_targets",
    "make_forward_step",
    "make_loss_func",
    "plain_loss_func",
]


def count_targets(
    labels: torch.Tensor, loss_mask: torch.Tensor, vocab: NumberVocab, options: NTLOptions | None = None
) -> torch.Tensor:
    """``[tokens, NTL positions]`` of one micro-batch under its loss mask, float64."""
    return ntl_counts(labels, vocab, options, loss_mask=loss_mask)


def _from_parallel_state(name: str) -> int | None:
    """``parallel_state``'s CP (``"cp"``) or DP x CP (``"dp_cp"``) size when initialised, else None."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not (dist.is_available() and dist.is_initialized()) or not ps.model_parallel_is_initialized():
        return None
    if name == "cp":
        return int(ps.get_context_parallel_world_size())
    return int(ps.get_data_parallel_world_size(with_context_parallel=True))


def _parallel_size(given: int | None, name: str, where: str, needed: bool) -> int:
    """The argument (agreeing with ``parallel_state``), else ``parallel_state``'s, else 1 in one process."""
    argument = "context_parallel_size" if name == "cp" else "data_parallel_size"
    known = _from_parallel_state(name)
    if given is not None:
        if known is not None and given != known:
            raise ValueError(
                f"{where}({argument}={given!r}) contradicts megatron.core.parallel_state, whose "
                f"{'context' if name == 'cp' else 'data x context'}-parallel size is {known}: leave {argument} out "
                "(it is read from parallel_state) or pass that value"
            )
        return given
    if known is not None:
        return known
    if not needed or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 1
    what = "--context-parallel-size" if name == "cp" else "data x context-parallel size"
    raise ValueError(
        f"{where} needs {argument}= (Megatron's {what}): "
        "torch.distributed runs several processes but megatron.core.parallel_state is not initialised, so it "
        f"cannot be read; pass {argument} explicitly"
    )


class GlobalCounts:
    """Token and number-token counts of one global batch, reduced once per step.

    Call :meth:`set_step` with the ``(labels, loss_mask)`` of the step's micro-batches on this rank before the
    first forward; one SUM all-reduce over ``group`` makes them global.

    Args:
        vocab: the number table.
        group: the data(-and-context)-parallel group, or None for one replica.
        options: the NTL variant (what NTL's denominator counts: :func:`ntl_scale.ntl_positions`).
        context_parallel_size: Megatron's context-parallel size (None: ``parallel_state``'s, else 1 in one process).

    Attributes:
        tokens: ``T``, the loss-mask weight of the step (float64, after :meth:`set_step`).
        numbers: ``K``, that of its NTL positions.
        divisor: ``D``, the summed Megatron ``num_tokens`` (``--calculate-per-token-loss``'s divisor).
    """

    def __init__(
        self,
        vocab: NumberVocab,
        group: dist.ProcessGroup | None = None,
        options: NTLOptions | None = None,
        *,
        context_parallel_size: int | None = None,
    ) -> None:
        self.vocab, self.group, self.options = vocab, group, options
        options = options or NTLOptions()
        cp = _parallel_size(context_parallel_size, "cp", "GlobalCounts", options.loss == "number")
        self.pieces = context_parallel_pieces(cp, options)
        self.tokens: torch.Tensor | None = None
        self.numbers: torch.Tensor | None = None
        self.divisor: torch.Tensor | None = None

    def set_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Counts the labels of one step's micro-batches and reduces the counts across ``group``."""
        if not batches:
            raise ValueError("GlobalCounts.set_step needs the (labels, loss_mask) of at least one micro-batch")
        labels, masks = [b[0] for b in batches], [b[1] for b in batches]
        local = step_counts(labels, self.vocab, self.options, loss_masks=masks, pieces=self.pieces)
        divisor = torch.stack([megatron_num_tokens(m).to(local.device, torch.float64) for m in masks]).sum()
        counts = torch.cat([local, divisor.view(1)])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(counts, group=self.group)  # one collective for the three
        self.tokens, self.numbers, self.divisor = counts[0], counts[1], counts[2]

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
    data_parallel_size: int | None = None,
    inplace: bool = False,
    context_parallel_size: int | None = None,
    cross_entropy_fusion_impl: str | None = None,
) -> Callable[..., tuple[torch.Tensor, torch.Tensor, dict]]:
    """A Megatron ``loss_func(labels, loss_mask, logits)`` computing CE + weight * NTL.

    Bind ``labels`` and ``loss_mask`` with ``functools.partial`` in ``forward_step``; the schedule calls it with
    the vocab-sharded logits ``[b, s, V/tp]`` of a model called without labels. ``settings.chunked`` is refused
    (use :class:`NTLLanguageModelMixin`). Reported as ``[sum, count]``: ``lm loss`` (the cross entropy, plain in
    evaluation), ``ntl loss``, ``number accuracy`` and, in training with a z-loss, ``z loss``.

    Args:
        settings: the NTL settings.
        vocab: the number table (global padded vocabulary).
        tp_group: the tensor-parallel group of the output layer.
        calculate_per_token_loss: Megatron's ``--calculate-per-token-loss``.
        global_counts: required for ``normalization="global"``.
        num_microbatches: micro-batches per step (a value or Megatron's ``get_num_microbatches``).
        data_parallel_size: data x context parallel size (None: ``parallel_state``'s, else 1 in one process).
        inplace: reuse the fp32 logits buffer.
        context_parallel_size: Megatron's context-parallel size (None: as ``data_parallel_size``).
        cross_entropy_fusion_impl: with ``--ntl-ce-kernel framework``, Megatron's CE
            (:func:`~.terms.megatron_cross_entropy`: None plain, ``native`` or ``te``).

    Returns:
        ``loss_func(labels, loss_mask, logits, *, evaluation=None) -> (loss, num_tokens, report)``;
        ``evaluation`` None: no gradient.
    """
    _refuse_chunked(settings, "make_loss_func / make_forward_step")
    if settings.normalization == "global" and global_counts is None:
        raise ValueError("--ntl-normalization global needs a GlobalCounts (global_counts=...)")
    options = settings.options()
    eval_options = options.for_evaluation()
    cp = _parallel_size(context_parallel_size, "cp", "make_loss_func", options.loss == "number")
    pieces = context_parallel_pieces(cp, options)
    if global_counts is not None and global_counts.pieces != pieces:
        raise ValueError(
            f"the GlobalCounts cut numbers into {global_counts.pieces} piece(s) per sequence but this loss into "
            f"{pieces}; build both with the same context_parallel_size"
        )
    needs_dp = settings.normalization == "global" and not calculate_per_token_loss
    dp_cp = _parallel_size(data_parallel_size, "dp_cp", "make_loss_func", needed=needs_dp)

    def loss_func(
        labels: torch.Tensor, loss_mask: torch.Tensor, logits: torch.Tensor, *, evaluation: bool | None = None
    ):
        evaluation = is_evaluation() if evaluation is None else evaluation
        run_options = eval_options if evaluation else options
        if framework_ce(run_options):  # NTL first: Megatron's CE overwrites fp32 logits
            through: list[torch.Tensor] = []  # the logits Megatron's CE reads; NTL's columns join its gradient
            terms = batch_first_terms(
                logits, labels, vocab, run_options, pieces=pieces, tp_group=tp_group, need_ce=False, passthrough=through
            )
            ce = megatron_cross_entropy(through[0].reshape(logits.shape), labels, tp_group, cross_entropy_fusion_impl)
            terms = beside(ce, terms)
        else:
            terms = batch_first_terms(
                logits, labels, vocab, run_options, pieces=pieces, tp_group=tp_group, inplace=inplace
            )
        sums = micro_batch_sums(terms, loss_mask)
        ce_sum, ntl_sum, num_tokens, num_numbers, hits = sums
        n = megatron_num_tokens(loss_mask).to(ce_sum.device)  # what Megatron divides by: a whole number
        if settings.normalization == "global" and not evaluation:
            counts = global_counts.get()  # type: ignore[union-attr]
            step = MicroBatchScale(
                tokens=counts[0],
                numbers=counts[1],
                microbatches=num_microbatches() if callable(num_microbatches) else num_microbatches,
                dp_cp_size=dp_cp,
                per_token_loss=calculate_per_token_loss,
                divisor=global_counts.divisor,  # type: ignore[union-attr]
            )
            if calculate_per_token_loss:
                loss = apply_factors(step.weights(n.to(ce_sum.dtype)), ce_sum, ntl_sum, settings.weight)
            else:
                loss = objective(sums, counts, settings.weight, scale=step.rescale(n.to(ce_sum.dtype)))
        else:
            ab = micro_batch_weights(num_tokens, num_numbers, n, calculate_per_token_loss)
            loss = apply_factors(ab, ce_sum, ntl_sum, settings.weight)
        ce, z_sum = without_z_loss(terms, labels, run_options, loss_mask)
        report = {
            "lm loss": torch.stack([(ce * loss_mask.to(ce.dtype)).sum(), num_tokens]).detach(),
            "ntl loss": torch.stack([ntl_sum, num_numbers]).detach(),
        }
        # beside Megatron's own CE the full arg-max is inside its kernel: the arg-max among the number columns
        accuracy = "number choice accuracy" if framework_ce(run_options) else "number accuracy"
        report[accuracy] = torch.stack([hits, num_numbers]).detach()
        if run_options.z_loss_weight:
            report["z loss"] = torch.stack([z_sum, num_tokens]).detach()
        return loss, n, report

    return loss_func


def _refuse_chunked(settings: NTLSettings, route: str) -> None:
    """Refuses ``settings.chunked`` on a route of logits."""
    if settings.chunked:
        raise ValueError(
            f"settings.chunked=True (--ntl-chunked) computes the loss from the hidden states, which {route} never "
            "sees (the model returns logits to it); use NTLLanguageModelMixin.configure_ntl (chunked from the "
            "settings) or the Megatron-LM route (apply_ntl_to_megatron_model / launch/pretrain_gpt_ntl.py), "
            "or drop --ntl-chunked"
        )


def plain_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Megatron-LM's own GPT ``loss_func`` of the per-token CE the model returns (``--ntl-weight 0``)."""
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
    data_parallel_size: int | None = None,
    context_parallel_size: int | None = None,
) -> Callable:
    """A Megatron ``forward_step(data_iterator, model)`` with CE + NTL (:func:`make_loss_func`).

    At ``--ntl-weight 0`` the model computes its own CE (:func:`plain_loss_func`). Under ``global`` the first
    call of a training step pulls its ``num_microbatches`` micro-batches and counts them once; evaluation
    pulls one per call and counts nothing.

    Args:
        settings: the NTL settings.
        vocab: the number table (may be None on stages other than the last).
        get_batch: returns ``(tokens, labels, loss_mask, attention_mask, position_ids)`` for one micro-batch.
        tp_group: tensor-parallel group of the output layer.
        count_group: data x context parallel group for the global counts.
        num_microbatches: micro-batches per step, or Megatron's ``get_num_microbatches``.
        calculate_per_token_loss: Megatron's ``--calculate-per-token-loss``.
        data_parallel_size: data x context parallel size (None: as :func:`make_loss_func`).
        context_parallel_size: Megatron's context-parallel size (None: as :func:`make_loss_func`).

    Returns:
        ``forward_step(data_iterator, model) -> (output_tensor, loss_func)``.
    """
    counts = None
    loss_func = None
    _refuse_chunked(settings, "make_forward_step")
    if settings.enabled:
        if vocab is None:
            raise ValueError("NTL is on (--ntl-weight > 0) but no number table was given")
        if settings.normalization == "global":
            counts = GlobalCounts(vocab, count_group, settings.options(), context_parallel_size=context_parallel_size)
        loss_func = make_loss_func(
            settings,
            vocab,
            tp_group=tp_group,
            calculate_per_token_loss=calculate_per_token_loss,
            global_counts=counts,
            num_microbatches=num_microbatches,
            data_parallel_size=data_parallel_size,
            context_parallel_size=context_parallel_size,
        )
    pending: list[Batch] = []

    def next_batch(data_iterator: Iterator | None, evaluation: bool) -> Batch:
        if counts is None:
            return get_batch(data_iterator)
        if evaluation:  # Megatron's evaluate: its own data and micro-batch count, never mixed into a step
            if pending:
                raise RuntimeError(
                    f"an evaluation pass started while {len(pending)} micro-batches of a training step were still "
                    "pending; NTL's step bookkeeping would mix them"
                )
            return get_batch(data_iterator)
        if not pending:
            m = num_microbatches() if callable(num_microbatches) else num_microbatches
            pending.extend(get_batch(data_iterator) for _ in range(m))
            with_labels = [(b[1], b[2]) for b in pending if b[1] is not None]
            if with_labels:
                counts.set_step(with_labels)
        return pending.pop(0)

    def forward_step(data_iterator: Iterator | None, model: torch.nn.Module):
        evaluation = is_evaluation(model)
        tokens, labels, loss_mask, attention_mask, position_ids = next_batch(data_iterator, evaluation)
        if loss_func is None:
            output = model(tokens, position_ids, attention_mask, labels=labels)
            return output, functools.partial(plain_loss_func, loss_mask)
        output = model(tokens, position_ids, attention_mask)
        return output, functools.partial(loss_func, labels, loss_mask, evaluation=evaluation)

    return forward_step


def _agree(name: str, given: Any, setting: Any, default: Any) -> Any:
    """The keyword, else the setting; a ValueError when both are set and differ."""
    if given is None:
        return setting
    if setting != default and given != setting:
        raise ValueError(
            f"configure_ntl({name}={given!r}) contradicts settings.{name}={setting!r}; pass one of them (the settings' "
            "value is used when the keyword is left out)"
        )
    return given


class NTLLanguageModelMixin:
    """Adds NTL to Megatron's ``compute_language_model_loss`` (the model-side route, MTP heads included)::

        class NTLGPTModel(NTLLanguageModelMixin, GPTModel): ...
        model = NTLGPTModel(config=..., ...)
        model.configure_ntl(settings, vocab, tp_group)

    The per-token loss is ``a ce_t + weight b ntl_t`` (:func:`~.lm.head_loss`): after Megatron's ``loss_func``
    the micro-batch's mean CE plus ``weight`` times its mean NTL under the loss mask passed to the model's call
    (``model(..., labels=labels, loss_mask=loss_mask)``; without it every position counts; MTP heads count every
    position). Evaluation uses the plain CE. Under ``normalization="global"`` set :attr:`ntl_scale` to the
    step's :class:`~.lm.MicroBatchScale` before each training forward (a forward without it raises).
    """

    ntl_scale: MicroBatchScale | None = None
    """The step's counts and Megatron's rescale for ``normalization="global"``; set before each training forward."""

    def configure_ntl(
        self,
        settings: NTLSettings,
        vocab: NumberVocab,
        tp_group: dist.ProcessGroup | None,
        *,
        chunked: bool | None = None,
        chunk_tokens: int | None = None,
        context_parallel_size: int | None = None,
    ) -> None:
        """Turns NTL on for this model (a no-op loss change when ``settings.weight`` is 0).

        With ``chunked`` CE + NTL come from the hidden states and the output weight
        (:func:`ntl_scale.linear_ce_ntl`) whenever the model is called with labels.

        Args:
            settings: the NTL settings.
            vocab: the number table over the padded vocabulary.
            tp_group: the output layer's tensor-parallel group.
            chunked: the hidden-state route (None: ``settings.chunked``).
            chunk_tokens: tokens per chunk of it (None: ``settings.chunk_tokens``).
            context_parallel_size: Megatron's context-parallel size (None: the model's ``TransformerConfig``'s).
        """
        chunked = bool(_agree("chunked", chunked, settings.chunked, False))
        chunk_tokens = _agree("chunk_tokens", chunk_tokens, settings.chunk_tokens, None)
        check_option("chunk_tokens", chunk_tokens)
        check_chunk_route(chunked, chunk_tokens, "megatron")
        configured = getattr(getattr(self, "config", None), "context_parallel_size", None)
        if context_parallel_size is None:
            context_parallel_size = 1 if configured is None else configured
        elif configured is not None and context_parallel_size != configured:
            raise ValueError(
                f"configure_ntl(context_parallel_size={context_parallel_size!r}) contradicts the model's "
                f"TransformerConfig.context_parallel_size={configured!r}; leave the keyword out (the config's value "
                "is used)"
            )
        pieces = context_parallel_pieces(context_parallel_size, settings.options())
        self._ntl = (settings, vocab, tp_group)
        self._ntl_chunked = (chunked, chunk_tokens)
        self._ntl_pieces = pieces
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
        self._ntl_call = (labels, kwargs.get("loss_mask"))  # the main head's labels and the loss mask, if given
        try:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._ntl_hidden_mode = False
            self._ntl_call = (None, None)

    def _ntl_scaled(self, terms: PerTokenTerms, labels: torch.Tensor, settings: NTLSettings) -> torch.Tensor:
        """``a ce + weight b ntl`` under the loss mask the model was called with (:func:`~.lm.head_loss`)."""
        main_labels, mask = getattr(self, "_ntl_call", (None, None))
        if mask is None or labels is not main_labels:
            weight = torch.ones_like(terms.ce)
        else:
            weight = mask.to(device=terms.ce.device, dtype=terms.ce.dtype).reshape(terms.ce.shape)
        config = getattr(self, "config", None)
        global_step = settings.normalization == "global"
        loss, _ = head_loss(
            terms,
            weight,
            settings.weight,
            main=labels is main_labels or not getattr(config, "mtp_num_layers", None),
            evaluation=is_evaluation(self),
            scale=self.ntl_scale if global_step else None,  # ignored under micro-batch normalisation
            needs_scale=global_step,
            per_token_loss=bool(getattr(config, "calculate_per_token_loss", False)),
            remedy="set model.ntl_scale = MicroBatchScale(tokens=T, numbers=K, microbatches=m, dp_cp_size=r, "
            "per_token_loss=..., divisor=D) from GlobalCounts / step_counts of the step's micro-batches",
        )
        return loss

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        settings, vocab, tp_group = getattr(self, "_ntl", (None, None, None))
        if getattr(self, "_ntl_hidden_mode", False):
            return self._chunked_loss(labels, logits, settings, vocab, tp_group)
        if settings is None or vocab is None or not settings.enabled:
            return super().compute_language_model_loss(labels, logits)  # type: ignore[misc]
        pieces = getattr(self, "_ntl_pieces", 1)
        options = self._ntl_options(settings)
        framework = framework_ce(options)
        terms = sequence_first_terms(
            logits, labels, vocab, options, tp_group=tp_group, pieces=pieces, need_ce=not framework
        )
        if framework:  # Megatron's own CE, with its config's fusion, after NTL (it overwrites fp32 logits)
            terms = beside(super().compute_language_model_loss(labels, logits), terms)  # type: ignore[misc]
        return self._ntl_scaled(terms, labels, settings)

    def _ntl_options(self, settings: NTLSettings) -> NTLOptions:
        """The settings' options, :meth:`~ntl_scale.NTLOptions.for_evaluation` in evaluation."""
        options = settings.options()
        return options.for_evaluation() if is_evaluation(self) else options

    def _chunked_loss(self, labels, hidden, settings, vocab, tp_group) -> torch.Tensor:
        """Per-token ``ce + weight * ntl * T / K`` from hidden states ``[s(/tp), b, H]``, no logits."""
        layer = self.output_layer  # type: ignore[attr-defined]
        shared = getattr(self, "_ntl_weight", None)
        weight = shared if shared is not None else layer.weight
        terms = output_layer_terms(
            layer, hidden, weight, labels, vocab, self._ntl_options(settings), tp_group,
            chunk_tokens=self._ntl_chunked[1],
            pieces=getattr(self, "_ntl_pieces", 1),
        )  # fmt: skip
        if not settings.enabled:
            return terms.ce
        return self._ntl_scaled(terms, labels, settings)
