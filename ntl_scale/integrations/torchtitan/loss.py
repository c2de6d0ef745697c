"""CE + NTL as a torchtitan loss (``BaseLoss``), on full logits, plain vocabulary shards or DTensors.

:class:`NTLLoss` ``(pred, labels, global_valid_tokens)`` returns, for the logits it is given (a micro-batch,
or one chunk inside torchtitan's ``ChunkedLossWrapper``)::

    loss = sum_t CE_t / global_valid_tokens + weight * sum_t NTL_t / max(K, 1)

``global_valid_tokens`` is torchtitan's own count; ``K``, the step's global count of NTL positions, comes from
:meth:`NTLLoss.begin_step` (:class:`~ntl_scale.integrations.torchtitan.NTLTrainer` reduces it with one SUM
all-reduce per step). The vocabulary split is found as torchtitan's CE finds it: plain shards on the SPMD
``tp`` axis, ``DTensor`` logits (``partial_dtensor``) or DTensor logits and labels (``full_dtensor``, via
``local_map``), else full logits. The fused op adds no collective to a vocabulary-parallel CE.

At weight 0 without CE features (and with ``ce_kernel="framework"``) the CE is torchtitan's own op, bit for
bit. Under no grad (torchtitan's validator) the options are :meth:`NTLOptions.for_evaluation`'s: the plain CE
sum without ``global_valid_tokens``. The ``loss_metrics/*_mean`` metrics (:data:`METRICS`, :data:`Z_LOSS_METRIC`;
``number_choice_accuracy_mean`` with the framework CE) are each call's part of the step's global value; the
loss and metrics carry torchtitan's loss SPMD types (:data:`LOSS_TYPE`). See ``docs/torchtitan.md``.
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
"""The metric names: the ``_mean`` suffix makes ``ChunkedLossWrapper`` add the chunks' parts."""

Z_LOSS_METRIC = "loss_metrics/z_loss_mean"
"""The z-loss metric after :data:`METRICS` when ``z_loss_weight > 0`` (``ce_mean`` is then without it)."""

NOT_CONFIG_FIELDS = {
    "chunked": "torchtitan's ChunkedLossWrapper is the chunked route: ChunkedLossWrapper.Config(loss_fn="
    "NTLLoss.Config(...), num_chunks=...) (the registry's configs do this)",
    "normalization": "torchtitan normalises by the step's global counts (global_valid_tokens, and K for NTL); "
    "there is no micro-batch mean in torchtitan",
}
"""Options of :func:`ntl_scale.options.option_fields` that are not fields of :class:`NTLLoss.Config`, and why."""


LOSS_TYPE = {"dp": spmd.P, "cp": spmd.P, "tp": spmd.I}
"""The SPMD type torchtitan gives a scaled loss, and so the metrics: partial over the batch axes, invariant on TP."""


class NTLLoss(BaseLoss):
    """``CE + weight * NTL`` for torchtitan, built from :class:`NTLLoss.Config` (``config.build()``)."""

    @dataclass(kw_only=True, slots=True)
    @variant_fields
    class Config(BaseLoss.Config):
        """The run-level NTL options below, the variant fields of :class:`~ntl_scale.NTLOptions`
        (:func:`~ntl_scale.options.variant_fields`), the number table's source and the model's vocabulary size."""

        weight: float = option_field("weight").default
        """Weight of NTL in ``CE + weight * NTL`` (0.3 in the paper); 0 trains with CE alone."""
        digit_level: bool = option_field("digit_level").default
        """Number table of the ten digits (True) or of multi-digit tokens such as Llama 3's ``123`` (False);
        not read when ``number_vocab`` is given (``number_vocab="digits"`` beside ``digit_level=False`` is refused)."""
        chunk_tokens: int | None = option_field("chunk_tokens").default
        """Tokens per chunk of the loss's temporaries (None: about 64 MiB of fp32 per chunk)."""
        number_vocab: str | None = None
        """``digits``, ``multi-digit`` or a saved number table (JSON) (:func:`~ntl_scale.options.table_source`);
        None: the rule of ``digit_level``."""
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
        self.framework = framework_ce(self.options)
        choice = "loss_metrics/number_choice_accuracy_mean"  # the arg-max among the number columns
        metrics = tuple(choice if self.framework and m == METRICS[2] else m for m in METRICS)
        self.metric_names = metrics + ((Z_LOSS_METRIC,) if self.options.z_loss_weight else ())
        """The names of the training metrics (:meth:`step_metrics`): :data:`METRICS`, then the z-loss if on."""
        self.vocab = number_table(config)
        check_table(self.vocab, self.options, "torchtitan")
        self.weight = float(config.weight)
        # torchtitan's CE op (bit for bit) where ours adds nothing: weight 0 without CE features, which it lacks
        self._torchtitan_ce = self.framework or (self.weight == 0 and not self.options.ce_features)
        self._torchtitan_eval_ce = self.framework or (self.weight == 0 and not self.eval_options.ce_features)
        self._numbers: torch.Tensor | None = None
        self._metrics: torch.Tensor | None = None

    def begin_step(self, ntl_positions: torch.Tensor | float) -> None:
        """Starts an optimizer step with its global count ``K`` of NTL positions; resets the step's metrics.

        :class:`NTLTrainer` calls it with the all-reduced sum of ``ntl_counts(labels, ...)[1]`` over the step;
        a loop of your own does the same before the step's first forward.
        """
        self._numbers = torch.as_tensor(ntl_positions, dtype=torch.float64)
        self._metrics = None

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """This rank's parts of the step's training metrics; summed over the loss mesh they are the global values."""
        names = self.metric_names
        values = torch.zeros(len(names), dtype=torch.float64) if self._metrics is None else self._metrics
        return dict(zip(names, values.unbind()))

    def _mode(self) -> tuple[NTLOptions, bool]:
        """This call's options (for evaluation under no grad) and whether torchtitan's CE op computes its loss."""
        if torch.is_grad_enabled():
            return self.options, self._torchtitan_ce
        return self.eval_options, self._torchtitan_eval_ce

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The scaled loss of these logits and its metrics (torchtitan's loss protocol).

        Args:
            pred: logits ``[batch, seq, V]``: full, this rank's plain vocabulary shard or a DTensor.
            labels: ``[batch, seq]`` token ids (a DTensor placed like ``pred``, the vocabulary replicated, under
                ``full_dtensor``); -100 is ignored.
            global_valid_tokens: torchtitan's count of the step's non-ignored labels; None: the CE sum.
            **kwargs: torchtitan's extra loss inputs (``positions``), unused.
        """
        del kwargs
        if is_dtensor(labels):
            return self._call_full_dtensor(pred, labels, global_valid_tokens)
        logits, tp_group, vocab_start = self._vocab_shard(pred, labels)
        vocab_size = self.vocab.vocab_size

        def torchtitan_ce(logits: torch.Tensor) -> torch.Tensor:
            return torchtitan_cross_entropy(logits, labels, global_vocab_size=vocab_size)

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
        """:meth:`__call__` on a plain shard, the columns from ``vocab_start`` of the split over ``tp_group``."""
        vocab_size = self.vocab.vocab_size

        def torchtitan_ce(logits: torch.Tensor) -> torch.Tensor:
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
        torchtitan_ce: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and metrics of a shard; ``torchtitan_ce`` where :meth:`_mode` says (metrics forward-only), in
        training with the framework CE on NTL's passthrough (:func:`~ntl_scale.beside_ce`: no dense NTL gradient)."""
        options, use_torchtitan_ce = self._mode()
        is_type_checking = spmd.is_type_checking()
        beside, through = self.framework and self.weight > 0 and torch.is_grad_enabled(), list[torch.Tensor]()
        grad = beside or (torch.is_grad_enabled() and not use_torchtitan_ce)
        with spmd.no_typecheck(), torch.set_grad_enabled(grad):
            sums, z_sum = self._sums(logits, labels, tp_group, vocab_start, options, through if beside else None)
        if through and is_type_checking:
            spmd.assert_type_like(through[0], logits)
        if use_torchtitan_ce:
            ce_sum = torchtitan_ce(through[0] if through else logits)
        else:
            ce_sum = sums.ce
            if global_valid_tokens is None and is_type_checking:  # _LossParallelCrossEntropy's: invariant on TP
                spmd.assert_type(
                    ce_sum, {**spmd.get_local_type(logits), **({tp_group: spmd.I} if tp_group is not None else {})}
                )
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
        through: list[torch.Tensor] | None = None,
    ) -> tuple[MicroBatchSums, torch.Tensor | None]:
        """The call's sums (``sums.ce`` with the z-loss), its detached z-loss sum (None without), the passthrough."""
        terms = per_token_ce_ntl(
            logits,
            labels,
            self.vocab,
            options,
            tp_group=tp_group,
            vocab_start=vocab_start,
            chunk_tokens=self.config.chunk_tokens,
            need_ce=not self.framework,
            passthrough=through,
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
        """``CE / global_valid_tokens + weight * NTL / K`` and this call's metrics (training calls accumulate them)."""
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
        """``full_dtensor``: as torchtitan's ``_cross_entropy_via_local_map``, local terms, a ``Partial`` loss."""
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
        if use_torchtitan_ce and not self.framework:
            loss = torchtitan_cross_entropy(pred, labels)  # torchtitan's own CE, bit for bit
            if global_valid_tokens is None:
                return loss, {}
            with torch.no_grad():
                sums, z_sum = self._sums(pred.to_local(), labels.to_local(), tp_group, vocab_start, options)
            return loss / global_valid_tokens, self._scaled(sums.ce, sums, z_sum, global_valid_tokens, options)[1]
        found: dict[str, dict[str, torch.Tensor]] = {}

        def local_loss(pred_local: torch.Tensor, labels_local: torch.Tensor) -> torch.Tensor:
            # framework: torchtitan's local CE (its local_map's) on NTL's passthrough
            loss, found["metrics"] = self.on_shard(
                pred_local, labels_local, global_valid_tokens, tp_group=tp_group, vocab_start=vocab_start
            )
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
        return loss, found["metrics"]

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
        """``(logits, tp_group, vocab_start)`` as torchtitan's CE finds them."""
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
    """The number table of ``config`` (``number_vocab`` or ``tokenizer_path``) over ``config.vocab_size``."""
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
    """``get_vocab()`` of a ``tokenizers.Tokenizer`` with its added tokens."""

    tokenizer: Any

    def get_vocab(self) -> dict[str, int]:
        return dict(self.tokenizer.get_vocab(with_added_tokens=True))
