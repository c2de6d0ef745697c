"""Megatron route for a ``megatron.core`` training loop of your own: ``loss_func`` and ``forward_step``.

For Megatron-LM's ``pretrain_gpt.py`` use :mod:`ntl_scale.integrations.megatron.lm` (through
``launch/pretrain_gpt_ntl.py``) instead. Pieces, each usable alone (Megatron is imported lazily, only
where a Megatron object is needed); the flags and settings are in :mod:`.args`:

* :func:`make_loss_func`: a ``loss_func`` with Megatron's contract ``(loss, num_tokens, report)``
  that computes CE + NTL from the vocab-sharded logits with the fused op (no extra collective) and
  reports ``lm loss`` (the cross entropy; in evaluation the plain one), ``ntl loss``, ``number accuracy``
  and, in training with a z-loss, ``z loss`` as ``[sum, count]`` pairs;
* :class:`GlobalCounts`: the token and number-token counts of the whole global batch, computed once
  per step from the labels of all micro-batches (for ``--ntl-normalization global``);
* :func:`make_forward_step`: a ``forward_step(data_iterator, model)`` with both;
* :class:`NTLLanguageModelMixin`: NTL inside the model's ``compute_language_model_loss`` (MTP heads).

With ``ce_kernel="framework"`` both take Megatron's CE (:func:`~.terms.megatron_cross_entropy`; the mixin its
own method) and add NTL of the number columns beside it.

Normalisation (``docs/normalization.md``; the counts, sums and ``L`` are :mod:`ntl_scale.normalization`'s):
Megatron divides what ``loss_func`` returns by the whole ``num_tokens`` it returns and by the number of
micro-batches (or, with ``--calculate-per-token-loss``, the gradients by the sum of those ``num_tokens``).
The loss is pre-scaled here so that after those divisions it is the objective, for any non-negative
loss mask (``num_tokens`` is the mask's sum truncated, :func:`~.terms.megatron_num_tokens`, which differs
from the sum for weights such as 0.5 and 1.5):

* ``micro-batch`` (the paper's semantics): NTL is the mean over the number tokens of each
  micro-batch, added to that micro-batch's mean CE;
* ``global``: CE is ``sum / global token count`` and NTL ``sum / global number-token count`` over
  the whole global batch (all micro-batches and data/context-parallel ranks), so the split into
  micro-batches, accumulation steps and DP ranks does not change the loss or its gradient.
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
    """``[tokens, NTL positions]`` of one micro-batch: the loss-mask weight of all labels and of the
    positions that carry NTL (:func:`ntl_scale.ntl_positions`: number labels, or one per number for
    ``--ntl-loss number``), float64."""
    return ntl_counts(labels, vocab, options, loss_mask=loss_mask)


def _from_parallel_state(name: str) -> int | None:
    """``megatron.core.parallel_state``'s context-parallel size (``name="cp"``) or data x context parallel size
    (``"dp_cp"``), when its groups are initialised in this process; None otherwise (it is not imported here)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not (dist.is_available() and dist.is_initialized()) or not ps.model_parallel_is_initialized():
        return None
    if name == "cp":
        return int(ps.get_context_parallel_world_size())
    return int(ps.get_data_parallel_world_size(with_context_parallel=True))


def _parallel_size(given: int | None, name: str, argument: str, where: str, needed: bool) -> int:
    """A parallel size of the run: the argument when given (it must agree with an initialised
    ``parallel_state``), else ``parallel_state``'s, else 1 in a single process; where it matters (``needed``)
    and none of these can tell, a ValueError asking for the argument."""
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


def _context_parallel_size(given: int | None, options: NTLOptions, where: str) -> int:
    """The context-parallel size (:func:`_parallel_size`); it matters to number-level NTL only."""
    return _parallel_size(given, "cp", "context_parallel_size", where, needed=options.loss == "number")


class GlobalCounts:
    """Token and number-token counts of one global batch, reduced once per step.

    Call :meth:`set_step` with the ``(labels, loss_mask)`` of all micro-batches of the step that
    this rank sees (before the first forward); one SUM all-reduce over ``group`` (data x context
    parallel) makes them global (the counts of :func:`ntl_scale.normalization.step_counts`, and beside them
    :attr:`divisor`).

    Args:
        vocab: the number table.
        group: the data(-and-context)-parallel group, or None for one replica.
        options: the NTL variant (what NTL's denominator counts: :func:`ntl_scale.ntl_positions`).
        context_parallel_size: Megatron's context-parallel size; the labels are this rank's local
            sequences (two load-balanced slices), whose numbers number-level NTL cuts at the slice borders
            (:func:`~ntl_scale.integrations.megatron.terms.context_parallel_pieces`), as the loss does. None
            (default): read from ``megatron.core.parallel_state`` when its groups are initialised, else 1 in
            a single process; number-level NTL in several processes without either is refused.

    Attributes:
        tokens: ``T``, the loss-mask weight of the step (float64, after :meth:`set_step`).
        numbers: ``K``, that of its NTL positions.
        divisor: ``D``, the sum of the micro-batches' Megatron ``num_tokens``
            (:func:`~ntl_scale.integrations.megatron.terms.megatron_num_tokens`, the truncated mask sums):
            what Megatron divides the step's gradients by with ``--calculate-per-token-loss``. ``D = T`` for a
            0/1 loss mask.
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
        cp = _context_parallel_size(context_parallel_size, options, "GlobalCounts")
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
            over it when not computing per-token loss). None (default): read from
            ``megatron.core.parallel_state`` when its groups are initialised, else 1 in a single process;
            refused (global normalisation in several processes) when neither can tell.
        inplace: reuse the fp32 logits buffer (the logits are not used after the loss).
        context_parallel_size: Megatron's context-parallel size: the labels and logits are this rank's two
            load-balanced slices of each sequence, and number-level NTL cuts numbers at the slice borders
            (:func:`~ntl_scale.integrations.megatron.terms.context_parallel_pieces`; ``global_counts`` counts so
            too). None (default): read from ``megatron.core.parallel_state`` as ``data_parallel_size``; a
            value that contradicts it is refused.
        cross_entropy_fusion_impl: with ``--ntl-ce-kernel framework``, which Megatron CE runs
            (:func:`~.terms.megatron_cross_entropy`: None plain, ``native`` or ``te`` fused); NTL is added beside it
            and ``number accuracy`` is not reported.

    Every field of ``settings`` is read: the variant and ``impl``, ``weight``, ``normalization``;
    ``chunked`` (``--ntl-chunked``) is refused, since a ``loss_func`` of logits never sees the hidden
    states (use :class:`NTLLanguageModelMixin` or the Megatron-LM route for it); ``number_vocab`` is how
    ``vocab`` was built (:func:`~ntl_scale.integrations.megatron.build_number_vocab`).

    The loss is exact for any non-negative ``loss_mask``: ``num_tokens`` is Megatron's whole
    :func:`~ntl_scale.integrations.megatron.terms.megatron_num_tokens` and the loss is scaled so that after
    Megatron's divisions its gradient is that of ``sum m CE / N + w sum m NTL / K`` (``N``, ``K`` the mask's
    weights; the step's under ``global``, the micro-batch's otherwise).

    Reported (``[sum, count]`` pairs, which Megatron sums over micro-batches and ranks and divides):
    ``lm loss`` the cross entropy under the mask (in training label-smoothed with ``label_smoothing``, without
    the z-loss; in evaluation, i.e. without gradient as in Megatron's ``evaluate``, the plain cross entropy of
    :meth:`~ntl_scale.NTLOptions.for_evaluation`), ``ntl loss`` and ``number accuracy`` over the NTL positions,
    and in training with ``z_loss_weight`` ``z loss``, the z-loss ``z_loss_weight * lse**2`` over the CE tokens.

    Returns:
        ``loss_func(labels, loss_mask, logits, *, evaluation=None) -> (loss, num_tokens, report)``;
        ``evaluation`` None: no gradient (:func:`~ntl_scale.integrations.megatron.terms.is_evaluation`).
    """
    _refuse_chunked(settings, "make_loss_func / make_forward_step")
    if settings.normalization == "global" and global_counts is None:
        raise ValueError("--ntl-normalization global needs a GlobalCounts (global_counts=...)")
    options = settings.options()
    eval_options = options.for_evaluation()
    pieces = context_parallel_pieces(_context_parallel_size(context_parallel_size, options, "make_loss_func"), options)
    if global_counts is not None and global_counts.pieces != pieces:
        raise ValueError(
            f"the GlobalCounts cut numbers into {global_counts.pieces} piece(s) per sequence but this loss into "
            f"{pieces}; build both with the same context_parallel_size"
        )
    needs_dp = settings.normalization == "global" and not calculate_per_token_loss
    dp_cp = _parallel_size(data_parallel_size, "dp_cp", "data_parallel_size", "make_loss_func", needed=needs_dp)

    def loss_func(
        labels: torch.Tensor, loss_mask: torch.Tensor, logits: torch.Tensor, *, evaluation: bool | None = None
    ):
        evaluation = is_evaluation() if evaluation is None else evaluation
        run_options = eval_options if evaluation else options
        if framework_ce(run_options):  # NTL first: Megatron's CE overwrites fp32 logits
            terms = batch_first_terms(
                logits, labels, vocab, run_options, pieces=pieces, tp_group=tp_group, need_ce=False
            )
            terms = beside(megatron_cross_entropy(logits, labels, tp_group, cross_entropy_fusion_impl), terms)
        else:
            terms = batch_first_terms(
                logits, labels, vocab, run_options, pieces=pieces, tp_group=tp_group, inplace=inplace
            )
        sums = micro_batch_sums(terms, loss_mask)
        ce_sum, ntl_sum, num_tokens, num_numbers, hits = sums
        n = megatron_num_tokens(loss_mask).to(ce_sum.device)  # what Megatron divides by: a whole number
        if settings.normalization == "global" and not evaluation:
            counts = global_counts.get()  # type: ignore[union-attr]
            # Megatron's rescale: the schedule divides what loss_func returns by num_tokens and by the micro-batches
            # m, and DDP averages over the data x context parallel ranks (with per-token loss: by the step's D).
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
            # The micro-batch's own means (evaluation too: no step counts there), after Megatron's division by n.
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
    """Refuses ``settings.chunked`` on a route that computes the loss from the logits (it would be ignored)."""
    if settings.chunked:
        raise ValueError(
            f"settings.chunked=True (--ntl-chunked) computes the loss from the hidden states, which {route} never "
            "sees (the model returns logits to it); use NTLLanguageModelMixin.configure_ntl (chunked from the "
            "settings) or the Megatron-LM route (apply_ntl_to_megatron_model / launch/pretrain_gpt_ntl.py), "
            "or drop --ntl-chunked"
        )


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
    data_parallel_size: int | None = None,
    context_parallel_size: int | None = None,
) -> Callable:
    """A Megatron ``forward_step(data_iterator, model)`` with CE + NTL.

    With NTL on, the model is called without labels and returns the vocab-sharded logits on the
    last pipeline stage; the loss is computed by :func:`make_loss_func`. Other stages are unchanged
    (the schedule never calls their ``loss_func``). With ``--ntl-weight 0`` the model computes its
    own CE and :func:`plain_loss_func` reduces it: the plain Megatron run.

    For ``normalization="global"`` the first call of every training step pulls all ``num_microbatches``
    micro-batches, counts their (number) tokens and reduces the counts over ``count_group`` (data x
    context parallel) once; later calls of the step are served from that buffer. Evaluation (no gradient or
    ``model.eval()``, as in Megatron's ``evaluate``) pulls one micro-batch per call and counts nothing: its
    ``lm loss`` is the plain cross entropy (:func:`make_loss_func`).

    Args:
        settings: the NTL settings.
        vocab: the number table (may be None on stages other than the last).
        get_batch: returns ``(tokens, labels, loss_mask, attention_mask, position_ids)`` for one
            micro-batch (labels and loss mask may be None on stages that do not need them).
        tp_group: tensor-parallel group of the output layer.
        count_group: data x context parallel group for the global counts.
        num_microbatches: micro-batches per step, or Megatron's ``get_num_microbatches``.
        calculate_per_token_loss: Megatron's ``--calculate-per-token-loss``.
        data_parallel_size: data-parallel x context-parallel size (None: read from ``parallel_state``, as
            :func:`make_loss_func` reads it).
        context_parallel_size: Megatron's context-parallel size (``get_batch`` returns this rank's slices;
            number-level NTL cuts numbers at their borders, in the loss and the counts alike). None: read
            from ``megatron.core.parallel_state`` (:func:`make_loss_func`).

    Every field of ``settings`` is read, as by :func:`make_loss_func` (``chunked`` is refused there).

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
    """A keyword argument and the settings' field of one option: the keyword when the settings keep their
    default, the setting when the keyword is not given; a ValueError when both are set and differ."""
    if given is None:
        return setting
    if setting != default and given != setting:
        raise ValueError(
            f"configure_ntl({name}={given!r}) contradicts settings.{name}={setting!r}; pass one of them (the settings' "
            "value is used when the keyword is left out)"
        )
    return given


class NTLLanguageModelMixin:
    """Adds NTL to Megatron's ``compute_language_model_loss`` (the model-side route).

    Use it where the model computes its own loss, e.g. with multi-token-prediction heads, which
    call ``compute_language_model_loss`` for every head::

        class NTLGPTModel(NTLLanguageModelMixin, GPTModel): ...
        model = NTLGPTModel(config=..., ...)
        model.configure_ntl(settings, vocab, tp_group)

    The per-token loss becomes ``a ce_t + weight * ntl_t * b`` with ``(a, b) = (n / T, n / K)``: ``T`` the
    loss-mask weight of the micro-batch's label positions, ``K`` that of its NTL positions and ``n`` Megatron's
    ``num_tokens`` (the mask's sum truncated, :func:`~ntl_scale.integrations.megatron.terms.megatron_num_tokens`;
    ``n = T`` and ``a = 1`` for a 0/1 mask), so that Megatron's ``loss_func`` (the masked sum divided by ``n``)
    gives the mean CE plus ``weight`` times the mean NTL over the number tokens the loss mask keeps, for any
    mask weights. ``ce_t`` is the objective's CE term (label-smoothed, plus the z-loss, with those options);
    in evaluation (no gradient, or ``model.eval()``: Megatron's ``evaluate``) it is the plain cross entropy
    (:meth:`~ntl_scale.NTLOptions.for_evaluation`). The model sees the loss mask when it is passed to its
    call (``model(..., labels=labels, loss_mask=loss_mask)``, which ``GPTModel.forward`` takes); without it
    every position counts (exact when the loss mask keeps every position, as in pretraining without
    padding). MTP heads, whose labels Megatron rolls, count every position of their labels.

    The context-parallel size (number-level NTL cuts numbers at the slice borders) is the model's
    ``TransformerConfig.context_parallel_size``.

    ``normalization="global"`` uses the Megatron-LM route's mechanism: before each training forward the
    caller sets :attr:`ntl_scale` to the step's :class:`~ntl_scale.integrations.megatron.lm.MicroBatchScale`
    (the step's ``T``, ``K`` and, for ``--calculate-per-token-loss``, Megatron's divisor ``D`` from
    :class:`GlobalCounts`, the micro-batch count ``m``, the data x context parallel size ``r``), as
    ``NTLForwardStep`` sets ``hook.scale``. The main head's per-token loss is then ``a ce + b w ntl`` with
    ``(a, b) = ntl_scale.weights(n)``, so that after Megatron's division by ``n``, ``m`` and ``r`` (or by ``D``
    with per-token loss) the summed gradient is that of ``CE_sum / T + w NTL_sum / K`` over the whole step. A
    training forward under ``global`` without :attr:`ntl_scale` raises; evaluation and MTP heads use the
    micro-batch mean. Under ``micro-batch`` :attr:`ntl_scale` is ignored.
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

        With ``chunked`` (``settings.chunked``, or the keyword) CE + NTL come from the final hidden states
        and the output layer's (vocab-parallel) weight with :func:`ntl_scale.linear_ce_ntl`, never
        materialising the logits, whenever the model is called with labels; without labels it returns
        logits as before.

        Every field of ``settings`` is read: the variant and ``impl``, ``weight``, ``chunked`` and
        ``chunk_tokens`` (the keywords, when given, replace a default of the settings and must agree with a
        value set there), and ``normalization``: ``micro-batch``, or ``global`` with the step's counts set
        in :attr:`ntl_scale` before each training forward (see the class docstring). ``number_vocab`` is how
        ``vocab`` was built (``build_number_vocab``).

        Args:
            settings: the NTL settings.
            vocab: the number table over the padded vocabulary.
            tp_group: the output layer's tensor-parallel group.
            chunked: the hidden-state route (None: ``settings.chunked``).
            chunk_tokens: tokens per chunk of it (None: ``settings.chunk_tokens``).
            context_parallel_size: Megatron's context-parallel size: the labels are this rank's two
                load-balanced slices, and number-level NTL cuts numbers at the slice borders
                (:func:`~ntl_scale.integrations.megatron.terms.context_parallel_pieces`). None (default): the
                model's ``TransformerConfig.context_parallel_size``; a value that contradicts it is refused.
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
        """``a ce + weight * ntl * b``: the micro-batch's means under the loss mask the model was called with
        (main head: after Megatron's division by its whole ``num_tokens``), or under ``global`` the step's
        :attr:`ntl_scale` weights."""
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
        """The settings' options; in evaluation (:func:`~.terms.is_evaluation`) without label smoothing and z-loss."""
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
