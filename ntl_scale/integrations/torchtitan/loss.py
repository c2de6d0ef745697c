"""CE + NTL as a torchtitan loss (``BaseLoss``), on full logits, plain vocabulary shards or DTensors.

torchtitan calls a loss as ``loss(pred, labels, global_valid_tokens)`` and back-propagates what it
returns; :class:`NTLLoss` returns, for the logits it is given (the whole micro-batch, or one sequence
chunk inside torchtitan's ``ChunkedLossWrapper``)::

    loss = sum_t CE_t / global_valid_tokens + weight * sum_t NTL_t / max(K, 1)

``global_valid_tokens`` is torchtitan's own count (non-ignored labels of the step's global batch,
reduced over the batch mesh once per step), so the CE part is torchtitan's ``CrossEntropyLoss``
(``sum / global_valid_tokens``). ``K`` is the step's global count of NTL positions
(:func:`ntl_scale.ntl_positions`: number-token labels; one per number for ``loss="number"``), which
:class:`~ntl_scale.integrations.torchtitan.NTLTrainer` counts from the labels before the step's first
forward and hands in with :meth:`NTLLoss.begin_step`: **one extra SUM all-reduce of one float64 per
optimizer step** over the batch mesh (torchtitan's ``dist_sum_tensor`` of the summed
:func:`ntl_scale.ntl_counts`), beside torchtitan's own
all-reduce of ``global_valid_tokens``. Summed over chunks, micro-batches and data-parallel ranks the
loss is ``CE + weight * NTL`` of the whole step, however the step is split.

The vocabulary split is found the way torchtitan's own CE finds it:

* plain local shards (``parallelism.spmd_backend="spmd_types"``, torchtitan's default): when the
  current SPMD mesh has a ``tp`` axis of size > 1, the group is ``current_spmd_mesh().get_group("tp")``
  and rank ``r`` holds columns ``[min(V, r*c), min(V, (r+1)*c))`` with ``c = ceil(V / tp)``
  (``_LossParallelCrossEntropy``'s split); ``V`` is the number table's ``vocab_size``;
* ``DTensor`` logits (``partial_dtensor``): ``Shard(-1)`` (or replicated), group and offset from the
  placement (:func:`ntl_scale.ops.shards.dtensor_vocab_shard`);
* ``DTensor`` logits and labels (``full_dtensor``): as torchtitan's ``_cross_entropy_via_local_map``, the
  labels placed like the logits with the vocabulary split replaced by ``Replicate``, each rank's tokens
  computed locally (``local_map``), the loss a DTensor ``Partial`` over the mesh dims that split tokens;
* otherwise full logits.

The fused CE + NTL adds no collective to a vocabulary-parallel CE: one MAX and one SUM all-reduce on the
TP group per call (torchtitan's own vocab-parallel CE issues three), none in the backward.

At weight 0 the loss is torchtitan's own CE op on the same inputs (bit for bit, SPMD types included) and
the NTL metrics come from a forward-only pass of the fused op (its two all-reduces under TP); at weight
> 0 the fused op's CE is within a few float32 ulps of torchtitan's, not bitwise (``docs/torchtitan.md``).
Under torchtitan's strict SPMD type checking the loss and the metrics get the types torchtitan gives its
CE's loss (:data:`LOSS_TYPE`), so ``ChunkedLossWrapper`` can add them.

Evaluation: a call with gradients disabled (``torch.is_grad_enabled()`` False: torchtitan's ``Validator.validate``
runs under ``@torch.no_grad()``, its pipeline ``schedule.eval`` inside it, and a training loss is never called
without grad, since it is back-propagated) uses :meth:`NTLOptions.for_evaluation`: the **plain** cross
entropy of the (soft-capped) logits, no label smoothing, no z-loss. The validator calls the loss without
``global_valid_tokens`` and gets the plain CE **sum**, so its logged ``validation_metrics/loss`` (the sum over
its batches / their tokens) is the held-out CE, comparable across NTL weights and CE features. A call with
grad enabled and no ``global_valid_tokens`` (torchtitan's CE protocol in its own tests) returns the sum of
the training CE term (smoothed, plus the z-loss), the one that is back-propagated.

Metrics (returned per call, named by torchtitan's rule so ``ChunkedLossWrapper`` sums them over
chunks, and accumulated over the step for :class:`NTLTrainer`'s log): ``loss_metrics/ce_mean`` (the
objective's CE term without the z-loss: label-smoothed when ``label_smoothing > 0``, as
``F.cross_entropy(..., label_smoothing=eps)`` reports it), ``loss_metrics/ntl_mean``,
``loss_metrics/number_accuracy_mean`` (the share of NTL positions whose label is the arg-max over the
whole vocabulary) and, when ``z_loss_weight > 0``, ``loss_metrics/z_loss_mean`` (``z_loss_weight * lse**2``,
mean over the CE tokens), each this call's part of the step's global value. Calls under no grad return
theirs (plain CE) but add nothing to the step's log.

``ce_kernel="framework"``: torchtitan's own CE op computes the CE at every weight, NTL of the number columns is
added beside it, and ``loss_metrics/number_choice_accuracy_mean`` (the arg-max among the number columns)
replaces ``number_accuracy_mean``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import spmd_types as spmd
import torch
import torch.distributed as dist
from torchtitan.components.loss import BaseLoss, _LossParallelCrossEntropy
from torchtitan.components.loss import cross_entropy_loss as torchtitan_cross_entropy
from torchtitan.config import CompileConfig
from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
from torchtitan.distributed.utils import get_spmd_backend
from torchtitan.tools.logging import logger

from ..._validation import check_table
from ...normalization import MicroBatchSums, means, micro_batch_sums, objective
from ...number_vocab import NumberVocab
from ...ops.shards import is_dtensor
from ...options import (
    NTLOptions,
    check_run_options,
    option_field,
    table_source,
    variant_fields,
    variant_of,
)
from ...terms import per_token_ce_ntl
from ..beside import framework_ce

__all__ = ["METRICS", "NOT_CONFIG_FIELDS", "Z_LOSS_METRIC", "NTLLoss", "number_table"]

METRICS = ("loss_metrics/ce_mean", "loss_metrics/ntl_mean", "loss_metrics/number_accuracy_mean")
"""The metric names: torchtitan's rule (a ``_mean`` suffix) makes ``ChunkedLossWrapper`` add the chunks'
parts, which are already divided by the step's global counts."""

Z_LOSS_METRIC = "loss_metrics/z_loss_mean"
"""The z-loss ``z_loss_weight * lse**2`` (mean over the CE tokens), a metric after :data:`METRICS` when
``z_loss_weight > 0`` (:attr:`NTLLoss.metric_names`); ``ce_mean`` is then the CE without it."""

NOT_CONFIG_FIELDS = {
    "chunked": "torchtitan's ChunkedLossWrapper is the chunked route: ChunkedLossWrapper.Config(loss_fn="
    "NTLLoss.Config(...), num_chunks=...) (the registry's configs do this)",
    "normalization": "torchtitan normalises by the step's global counts (global_valid_tokens, and K for NTL); "
    "there is no micro-batch mean in torchtitan",
}
"""Options of :func:`ntl_scale.options.option_fields` that are not fields of :class:`NTLLoss.Config`, and why."""


LOSS_TYPE = {"dp": spmd.P, "cp": spmd.P, "tp": spmd.I}
"""The SPMD type torchtitan gives a scaled loss (``CrossEntropyLoss``): a partial sum over the batch axes, the
same on every TP rank; the metrics get it too, so ``ChunkedLossWrapper`` may add them under strict checking."""


def _sum_type(logits: torch.Tensor, tp_group: dist.ProcessGroup | None) -> dict[Any, Any]:
    """The SPMD type of a CE sum without ``global_valid_tokens``, as torchtitan's ``_LossParallelCrossEntropy``
    gives it: the logits' own types, invariant on the vocabulary split's group."""
    types: dict[Any, Any] = dict(spmd.get_local_type(logits))
    if tp_group is not None:
        types[tp_group] = spmd.I
    return types


def _default(name: str) -> Any:
    return option_field(name).default


class NTLLoss(BaseLoss):
    """``CE + weight * NTL`` for torchtitan (see the module docstring for the normalisation and the split).

    Build it from :class:`NTLLoss.Config` (``config.build()``), as torchtitan builds ``Trainer.Config.loss``.
    """

    @dataclass(kw_only=True, slots=True)
    @variant_fields
    class Config(BaseLoss.Config):
        """The NTL options of :mod:`ntl_scale.options`: the run-level ones below (defaults the spec's), then the
        variant fields of :class:`~ntl_scale.NTLOptions` (``loss``, ``squash_factor``, ``reweigh``,
        ``huber_delta``, ``float_level``, ``impl``, ``z_loss_weight``, ``label_smoothing``, ``logit_softcap``:
        added by :func:`~ntl_scale.options.variant_fields`, documented there once); the number table's source
        and the model's vocabulary size."""

        weight: float = _default("weight")
        """Weight of NTL in ``CE + weight * NTL`` (0.3 in the paper); 0 trains with CE alone."""
        digit_level: bool = _default("digit_level")
        """Number table of the ten digits (True) or of multi-digit tokens such as Llama 3's ``123`` (False);
        not read when ``number_vocab`` is given (``number_vocab="digits"`` beside ``digit_level=False`` is refused)."""
        chunk_tokens: int | None = _default("chunk_tokens")
        """Tokens per chunk of the loss's temporaries (None: about 64 MiB of fp32 per chunk)."""
        number_vocab: str | None = None
        """As Megatron's ``--ntl-number-vocab`` (:func:`~ntl_scale.options.table_source`): ``digits``,
        ``multi-digit`` (the rule, built from the tokenizer) or a number table saved with ``NumberVocab.save`` /
        ``python launch/save_number_vocab.py`` (JSON); None: the rule of ``digit_level``."""
        tokenizer_path: str | None = None
        """Without ``number_vocab``: a tokenizer directory (``tokenizer.json``) to build the table from; None
        under :class:`NTLTrainer`: the run's ``hf_assets_path``."""
        vocab_size: int | None = None
        """The model's (padded) vocabulary size, the logits' global width; None under :class:`NTLTrainer`: the
        model's."""

        def __post_init__(self) -> None:
            check_run_options(self, "torchtitan")

        def options(self) -> NTLOptions:
            """The :class:`~ntl_scale.NTLOptions` of this config (the variant and ``impl``)."""
            return variant_of(self)

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None) -> None:
        if compile_config is not None and compile_config.enable and "loss" in compile_config.components:
            logger.warning("NTLLoss is not compiled: 'loss' in compile.components is ignored for it")
        self.config = config
        self.options = config.options()
        self.eval_options = self.options.for_evaluation()
        """The options of a call under no grad (torchtitan's validator): plain CE, no smoothing, no z-loss."""
        self.framework = framework_ce(self.options)
        """``ce_kernel="framework"``: torchtitan's own CE computes the loss's CE, NTL is added beside it (the
        number columns only, with gradient); no ``number_accuracy`` (the full arg-max is not seen)."""
        choice = "loss_metrics/number_choice_accuracy_mean"  # the arg-max among the number columns
        metrics = tuple(choice if self.framework and m == METRICS[2] else m for m in METRICS)
        self.metric_names = metrics + ((Z_LOSS_METRIC,) if self.options.z_loss_weight else ())
        """The names of the training metrics (:meth:`step_metrics`): :data:`METRICS`, then the z-loss if on."""
        self.vocab = number_table(config)
        check_table(self.vocab, self.options, "torchtitan")
        self.weight = float(config.weight)
        # torchtitan's own CE op computes the loss (bit for bit) only where ours adds nothing to it: NTL at
        # weight 0 and none of the CE features (z-loss, label smoothing, soft-capping), which it lacks
        self._torchtitan_ce = self.framework or (self.weight == 0 and not self.options.ce_features)
        self._torchtitan_eval_ce = self.framework or (self.weight == 0 and not self.eval_options.ce_features)
        self._numbers: torch.Tensor | None = None
        self._metrics: torch.Tensor | None = None

    # ---------------------------------------------------------------------------- the step

    def begin_step(self, ntl_positions: torch.Tensor | float) -> None:
        """Starts an optimizer step: ``ntl_positions`` is the step's global count ``K`` of NTL positions.

        :class:`NTLTrainer` calls this with the sum of ``ntl_counts(labels, ...)[1]`` over the step's
        micro-batches, all-reduced over the batch mesh (one SUM all-reduce); a custom loop must do the
        same before the step's first forward. Resets the step's metrics.
        """
        self._numbers = torch.as_tensor(ntl_positions, dtype=torch.float64)
        self._metrics = None

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """This rank's parts of the step's metrics (:attr:`metric_names`), summed over the step's training calls.

        Sum them over the loss mesh (data x context parallel) for the global values; 0 before any call.
        Calls under no grad (evaluation) are not in them.
        """
        names = self.metric_names
        values = torch.zeros(len(names), dtype=torch.float64) if self._metrics is None else self._metrics
        return dict(zip(names, values.unbind()))

    def _mode(self) -> tuple[NTLOptions, bool]:
        """The options of this call and whether torchtitan's own CE op computes its loss: the training ones,
        or under no grad (torchtitan's validator, any evaluation) :meth:`NTLOptions.for_evaluation`'s."""
        if torch.is_grad_enabled():
            return self.options, self._torchtitan_ce
        return self.eval_options, self._torchtitan_eval_ce

    # ---------------------------------------------------------------------------- the call

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The scaled loss of these logits and its metrics (torchtitan's loss protocol).

        Args:
            pred: logits ``[batch, seq, V]``: full, this rank's plain vocabulary shard (under the
                ``spmd_types`` tp mesh) or a DTensor (``Shard(-1)`` or replicated on the vocabulary; with
                DTensor labels, any batch and sequence placements).
            labels: ``[batch, seq]`` token ids: plain, the same on every TP rank, or (``full_dtensor``) a
                DTensor placed like ``pred`` with the vocabulary split replaced by ``Replicate``; -100 is
                ignored.
            global_valid_tokens: torchtitan's count of the step's non-ignored labels; None (validation):
                return the CE sum (under no grad, as torchtitan's validator calls it: the plain CE).
            **kwargs: torchtitan's extra loss inputs (``positions``), unused.
        """
        del kwargs
        if is_dtensor(labels):
            return self._call_full_dtensor(pred, labels, global_valid_tokens)
        logits, tp_group, vocab_start = self._vocab_shard(pred, labels)
        vocab_size = self.vocab.vocab_size

        def torchtitan_ce() -> torch.Tensor:
            return torchtitan_cross_entropy(pred, labels, global_vocab_size=vocab_size)

        return self._call(logits, labels, global_valid_tokens, tp_group, vocab_start, torchtitan_ce)

    def on_shard(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        *,
        tp_group: dist.ProcessGroup | None,
        vocab_start: int | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:meth:`__call__` on an explicit plain vocabulary shard: ``logits [..., V_local]`` holding the columns
        from ``vocab_start`` of the split over ``tp_group`` (torchtitan's ``_LossParallelCrossEntropy``
        inputs), for callers that hold the group themselves; ``tp_group`` None: the full vocabulary."""
        vocab_size = self.vocab.vocab_size

        def torchtitan_ce() -> torch.Tensor:
            if tp_group is None or dist.get_world_size(tp_group) == 1:
                return torchtitan_cross_entropy(logits, labels)
            return _LossParallelCrossEntropy.apply(logits, labels, tp_group, vocab_size, "sum")

        return self._call(logits, labels, global_valid_tokens, tp_group, vocab_start, torchtitan_ce)

    def _call(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None,
        tp_group: dist.ProcessGroup | None,
        vocab_start: int | None,
        torchtitan_ce: Callable[[], torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and metrics from the shard ``__call__`` or :meth:`on_shard` found.

        At weight 0 without CE features the loss is torchtitan's own CE (``torchtitan_ce``: the same op, so
        the same bits and SPMD types), and the NTL metrics come from a forward-only pass of the fused op.
        Under no grad the CE features are those of :meth:`NTLOptions.for_evaluation` (:meth:`_mode`).
        """
        options, use_torchtitan_ce = self._mode()
        is_type_checking = spmd.is_type_checking()
        ce_sum = torchtitan_ce() if use_torchtitan_ce else None
        ntl_grad = ce_sum is None or (self.framework and self.weight > 0)  # framework: NTL's gradient, beside it
        with spmd.no_typecheck(), torch.set_grad_enabled(torch.is_grad_enabled() and ntl_grad):
            sums, z_sum = self._sums(logits, labels, tp_group, vocab_start, options)
        if ce_sum is None:
            ce_sum = sums.ce
            if global_valid_tokens is None and is_type_checking:
                spmd.assert_type(ce_sum, _sum_type(logits, tp_group))
        if global_valid_tokens is None:
            return ce_sum, {}
        with spmd.no_typecheck():
            loss, metrics = self._scaled(ce_sum, sums, z_sum, global_valid_tokens, options)
            if is_type_checking:
                for value in (loss, *metrics.values()):
                    spmd.assert_type(value, LOSS_TYPE)
        return loss, metrics

    def _sums(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        vocab_start: int | None,
        options: NTLOptions,
    ) -> tuple[MicroBatchSums, torch.Tensor | None]:
        """The call's sums under ``options``, and its z-loss sum ``z_loss_weight * sum lse**2`` over the CE
        tokens (detached, for the log; None without z-loss): ``sums.ce`` includes it, as the objective does."""
        terms = per_token_ce_ntl(
            logits,
            labels,
            self.vocab,
            options,
            tp_group=tp_group,
            vocab_start=vocab_start,
            chunk_tokens=self.config.chunk_tokens,
            need_ce=not self.framework,
        )
        if self.framework:  # the arg-max among the number columns (the full one is torchtitan's CE's)
            terms = terms._replace(hit=terms.number_choice_hit)
        mask = labels != options.ignore_index
        z_sum = None
        if options.z_loss_weight:
            lse = terms.lse.detach()
            z_sum = options.z_loss_weight * (lse.square() * mask.to(lse.dtype)).sum()
        return micro_batch_sums(terms, mask), z_sum

    def _scaled(
        self,
        ce_sum: torch.Tensor,
        sums: MicroBatchSums,
        z_sum: torch.Tensor | None,
        global_valid_tokens: torch.Tensor | int,
        options: NTLOptions,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``CE / global_valid_tokens + weight * NTL / K`` and this call's metrics (accumulated for the step's
        log when ``options`` are the training ones; a call under no grad adds nothing to it).

        The logged ``ce_mean`` is the objective's CE term without the z-loss (``ce_sum - z_sum``); the z-loss
        is ``z_loss_mean``."""
        # N is torchtitan's global_valid_tokens (no rescale: torchtitan divides by nothing else); K the step's
        sums = sums._replace(ce=ce_sum)
        counts = (global_valid_tokens, self._step_numbers().to(device=sums.ntl.device, dtype=sums.ntl.dtype))
        loss = objective(sums, counts, self.weight)  # weight 0: torchtitan's CE / global_valid_tokens, bit for bit
        logged_ce = ce_sum.detach() if z_sum is None else ce_sum.detach() - z_sum
        ce, ntl = means(sums._replace(ce=logged_ce), counts)
        values = [ce, ntl.detach(), means(sums._replace(ntl=sums.hits), counts)[1].detach()]
        if z_sum is not None:
            values.append(means(sums._replace(ce=z_sum), counts)[0])
        names = self.metric_names
        if options is self.options:
            metrics = torch.stack([v.to(torch.float64) for v in values])
            self._metrics = metrics if self._metrics is None else self._metrics + metrics
        return loss, dict(zip(names, values))

    def _call_full_dtensor(
        self, pred: torch.Tensor, labels: Any, global_valid_tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """torchtitan's ``full_dtensor`` backend: DTensor logits and labels on one mesh.

        As torchtitan's CE (``_cross_entropy_via_local_map``): the labels are placed like the logits with
        the vocabulary split replaced by ``Replicate``; each rank computes its local tokens' terms (the
        vocabulary split's group and offset from the logits' placement) and the loss is a DTensor,
        ``Partial`` on the mesh dims that split the tokens. The metrics are this rank's parts (plain).
        """
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        from torch.distributed.tensor.experimental import local_map

        if not isinstance(pred, DTensor):
            raise ValueError(
                f"NTLLoss got DTensor labels (placements {tuple(labels.placements)}) but plain logits of shape "
                f"{tuple(pred.shape)}; pass both as DTensors on one mesh (parallelism.spmd_backend='full_dtensor') "
                "or both plain"
            )
        vocab_dim = pred.ndim - 1
        placements = tuple(pred.placements)
        expected = tuple(Replicate() if isinstance(p, Shard) and p.dim == vocab_dim else p for p in placements)
        if tuple(labels.placements) != expected or any(isinstance(p, Partial) for p in placements):
            raise ValueError(
                f"NTLLoss: DTensor logits placed {placements} need labels placed {expected} (the logits' "
                f"placements with the vocabulary split replaced by Replicate, no Partial), got "
                f"{tuple(labels.placements)}; redistribute the labels (labels.redistribute(placements={expected}))"
            )
        vocab_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == vocab_dim]
        if len(vocab_dims) > 1 or any(type(placements[i]) is not Shard for i in vocab_dims):
            raise ValueError(
                f"NTLLoss: DTensor logits placed {placements} split the vocabulary over mesh dims {vocab_dims} "
                "or in strided pieces; split it over one mesh dim (Shard(-1)) or replicate it"
            )
        if pred.shape[-1] != self.vocab.vocab_size:
            raise ValueError(self._width_error(pred.shape[-1], f"the full vocabulary of {self.vocab.vocab_size}"))
        mesh = pred.device_mesh
        tp_group = mesh.get_group(vocab_dims[0]) if vocab_dims else None
        vocab_start = None
        if tp_group is not None:
            vocab_start = int(compute_local_shape_and_global_offset(pred.shape, mesh, placements)[1][vocab_dim])
        if is_dtensor(global_valid_tokens):
            global_valid_tokens = global_valid_tokens.full_tensor()  # type: ignore[union-attr]
        options, use_torchtitan_ce = self._mode()  # under no grad (the validator): plain CE
        if self.framework and self.weight > 0 and torch.is_grad_enabled():
            raise ValueError(
                "NTLLoss: loss.ce_kernel='framework' is not supported with spmd_backend='full_dtensor' (DTensor "
                "labels): use spmd_backend 'spmd_types' or 'partial_dtensor', or loss.ce_kernel='ntl_scale'"
            )
        if use_torchtitan_ce:
            loss = torchtitan_cross_entropy(pred, labels)  # torchtitan's own CE, bit for bit
            if global_valid_tokens is None:
                return loss, {}
            with torch.no_grad():
                sums, z_sum = self._sums(pred.to_local(), labels.to_local(), tp_group, vocab_start, options)
            return loss / global_valid_tokens, self._scaled(sums.ce, sums, z_sum, global_valid_tokens, options)[1]
        found: dict[str, dict[str, torch.Tensor]] = {}

        def local_loss(pred_local: torch.Tensor, labels_local: torch.Tensor) -> torch.Tensor:
            sums, z_sum = self._sums(pred_local, labels_local, tp_group, vocab_start, options)
            if global_valid_tokens is None:
                return sums.ce
            loss, found["metrics"] = self._scaled(sums.ce, sums, z_sum, global_valid_tokens, options)
            return loss

        loss = local_map(
            local_loss,
            out_placements=[
                Partial() if isinstance(p, Shard) and p.dim != vocab_dim else Replicate() for p in placements
            ],
            in_placements=(placements, expected),
            in_grad_placements=(placements, expected),
            device_mesh=mesh,
        )(pred, labels)
        return loss, found.get("metrics", {})

    def _step_numbers(self) -> torch.Tensor:
        if self._numbers is None:
            raise ValueError(
                "NTLLoss got global_valid_tokens but no step count of NTL positions: NTL is normalised by the "
                "step's global count K, which NTLTrainer sets before each step. Use "
                "ntl_scale.integrations.torchtitan.NTLTrainer.Config as the trainer config (every config of "
                "ntl_scale.integrations.torchtitan.config_registry does), or call loss.begin_step(K) in your loop"
            )
        return self._numbers

    def _vocab_shard(
        self, pred: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dist.ProcessGroup | None, int | None]:
        """``(logits, tp_group, vocab_start)`` as torchtitan's CE finds them (see the module docstring)."""
        from torch.distributed.tensor import DTensor

        if isinstance(pred, DTensor):
            return pred, None, None  # the group and offset come from the placement (per_token_ce_ntl)
        vocab_size = self.vocab.vocab_size
        width = pred.shape[-1]
        if get_spmd_backend() == "spmd_types" and spmd_mesh_size("tp") > 1:
            mesh = current_spmd_mesh()
            assert mesh is not None  # spmd_mesh_size > 1 implies a mesh
            group = mesh.get_group("tp")
            tp, rank = dist.get_world_size(group), dist.get_rank(group)
            chunk = -(-vocab_size // tp)
            start = min(vocab_size, chunk * rank)
            expected = min(vocab_size, start + chunk) - start
            if width != expected:
                raise ValueError(self._width_error(width, f"this rank's shard of {expected} (rank {rank} of tp {tp})"))
            return pred, group, start
        if width != vocab_size:
            raise ValueError(self._width_error(width, f"the full vocabulary of {vocab_size} (no tensor parallelism)"))
        return pred, None, None

    def _width_error(self, width: int, expected: str) -> str:
        return (
            f"NTLLoss: the logits have {width} vocabulary columns, but the number table (vocab_size "
            f"{self.vocab.vocab_size}) expects {expected}; the table must describe the model's whole (padded) "
            "vocabulary, not a shard: set loss.vocab_size to the model's vocabulary size (NTLTrainer fills it "
            "from the model) or save the table with that vocab_size"
        )


def number_table(config: NTLLoss.Config) -> NumberVocab:
    """The number table of ``config``: its saved JSON (``number_vocab``) or its tokenizer (``tokenizer_path``).

    The table's ``vocab_size`` is the model's (``config.vocab_size``); a saved table of another size is a
    ValueError naming both sizes and the fix.
    """
    source = table_source(config.number_vocab, config.digit_level)
    if isinstance(source, str):
        table = NumberVocab.load(source)
        if config.vocab_size is not None and table.vocab_size != config.vocab_size:
            raise ValueError(
                f"loss.number_vocab {config.number_vocab!r} was saved for a vocabulary of {table.vocab_size}, but "
                f"the model's is {config.vocab_size} (loss.vocab_size); save the table for the model's padded size "
                f"(NumberVocab.from_tokenizer(tok, vocab_size={config.vocab_size}).save(path)) or use "
                "loss.tokenizer_path"
            )
        return table
    if config.tokenizer_path is None:
        raise ValueError(
            "NTLLoss needs a number table: set loss.number_vocab (a saved NumberVocab JSON) or "
            "loss.tokenizer_path (a tokenizer directory with tokenizer.json; NTLTrainer uses hf_assets_path)"
        )
    from tokenizers import Tokenizer

    path = config.tokenizer_path
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(
            f"loss.tokenizer_path {path!r} has no tokenizer.json (ntl_scale never downloads); point it at the "
            "directory torchtitan loads the tokenizer from (hf_assets_path), or set loss.number_vocab"
        )
    tokenizer = Tokenizer.from_file(file)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if config.vocab_size is not None and size > config.vocab_size:
        raise ValueError(
            f"the tokenizer {file!r} has {size} tokens, more than the model's vocabulary of {config.vocab_size} "
            "(loss.vocab_size); use the model's tokenizer or a model with a larger vocabulary"
        )
    return NumberVocab.from_tokenizer(_VocabView(tokenizer), vocab_size=config.vocab_size or size, digit_level=source)


@dataclasses.dataclass
class _VocabView:
    """``get_vocab()`` of a ``tokenizers.Tokenizer`` with its added tokens (what ``NumberVocab`` reads)."""

    tokenizer: Any

    def get_vocab(self) -> dict[str, int]:
        return dict(self.tokenizer.get_vocab(with_added_tokens=True))
