"""CE + NTL from hidden states with the logits kept on chip: the op around the Triton kernels.

The kernels and their design (an online log-sum-exp over vocabulary tiles in the forward, a backward that
recomputes the logits per tile and adds ``dH``/``dW`` with fp32 atomics) are in
:mod:`lab.on_chip.triton_linear_ce_ntl`, which imports nothing of the package but its CE + NTL kernel.
This module is the host side, one layer up, as :mod:`ntl_scale.ops.chunked_linear` is for the chunked op: the
autograd Function, the two all-reduces between the launches under tensor parallelism
(:func:`ntl_scale.ops.logits.combine_kernel_stats`), the NTL terms formed from the statistics, and the
refusals. :func:`fused_linear_ce_ntl` takes :func:`ntl_scale.linear_ce_ntl`'s arguments and returns its
:class:`ntl_scale.PerTokenTerms`; it is not behind ``impl=`` and lives in ``lab/``, outside the package,
until a GPU measures it (``lab/README.md``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ntl_scale._validation import check_float_level, check_inputs, check_weights
from ntl_scale.number_vocab import NumberVocab
from ntl_scale.ops import triton_ce_ntl
from ntl_scale.ops.logits import combine_kernel_stats, raise_if_not_finite
from ntl_scale.ops.shard_math import ShardInputs, ShardMath
from ntl_scale.ops.shards import group_rank, group_size, is_dtensor
from ntl_scale.options import NTLOptions, check_option
from ntl_scale.terms import PerTokenTerms, check_plain_labels, shard_inputs, shard_start, terms_from_stats

from .triton_linear_ce_ntl import DTYPES, backward_grads, forward_stats

__all__ = ["fused_linear_ce_ntl"]


class _OnChipLinearCENTL(torch.autograd.Function):
    """``hidden [T, H]``, ``weight [V_local, H]`` -> per-token ``ce, expect, mass, hit, lse``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        inputs: ShardInputs,
        tp_group: dist.ProcessGroup | None,
        check_finite: bool,
        needs: tuple[bool, bool],
        blocks: tuple[dict[str, int] | None, dict[str, int] | None],
    ) -> tuple[torch.Tensor, ...]:
        width = weight.shape[0]
        target = inputs.local_target(width)
        local, number_logits = forward_stats(
            hidden, weight, target, inputs.number_cols, inputs.a_table.float(), blocks=blocks[0]
        )
        # the two all-reduces of every other path: MAX of [m, mN], then SUM of [S, z_y, SN, A]
        max_all, number_max_raw, sums = combine_kernel_stats(local, tp_group)
        if check_finite:
            raise_if_not_finite(torch.stack((max_all, number_max_raw), 1), sums, True)
        number_max = ShardMath.safe_number_max(number_max_raw)
        ce, expect, mass, hit, lse = ShardMath.finalize(max_all, sums, number_max, inputs.valid, True)
        number_exp = torch.exp(number_logits - number_max.unsqueeze(1))
        ctx.mark_non_differentiable(hit)
        ctx.set_materialize_grads(False)
        ctx.inputs, ctx.needs, ctx.blocks = inputs, needs, blocks[1]
        ctx.save_for_backward(hidden, weight, max_all, number_max, sums[:, 0], number_exp, sums[:, 2], expect, mass)
        return ce, expect, mass, hit, lse

    @staticmethod
    def backward(ctx: Any, g_ce, g_expect, g_mass, _g_hit, g_lse):  # type: ignore[override]
        hidden, weight, max_all, number_max, total, number_exp, number_total, expect, mass = ctx.saved_tensors
        inputs: ShardInputs = ctx.inputs
        zeros = torch.zeros_like(expect)
        g_ce, g_expect, g_mass, g_lse = (
            zeros if g is None else g.float() for g in (g_ce, g_expect, g_mass, g_lse)
        )  # fmt: skip
        g_ce = torch.where(inputs.valid, g_ce, zeros)
        width = weight.shape[0]
        target = inputs.local_target(width)
        u = g_ce - g_mass * mass + g_lse  # the coefficient of the full softmax pi (d lse/dz = pi)
        label_coef = torch.where(target >= 0, g_ce, zeros)
        grad_h, grad_w = backward_grads(
            hidden, weight, max_all, u / total, label_coef, target, ctx.needs, blocks=ctx.blocks
        )
        # the number columns' own term, g_mass pi_N + g_expect p (a - expect): [T, K], two small GEMMs
        cols = inputs.number_cols
        if cols.numel():
            saved = {"number_exp": number_exp, "number_total": number_total, "expect": expect}
            coef = ShardMath.number_grad(slice(None), saved, inputs, g_expect)
            coef = coef + g_mass.unsqueeze(1) * number_exp * (torch.exp(number_max - max_all) / total).unsqueeze(1)
            if grad_h is not None:
                grad_h.addmm_(coef, weight.index_select(0, cols).float())
            if grad_w is not None:
                grad_w.index_add_(0, cols, coef.t() @ hidden.float())
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None, None, None, None, None,
        )  # fmt: skip


def _refuse(hidden: Any, weight: Any, options: NTLOptions, need_ce: bool) -> None:
    if is_dtensor(hidden) or is_dtensor(weight):
        raise TypeError(
            "fused_linear_ce_ntl takes plain tensors; for a vocabulary-parallel DTensor weight pass "
            "weight.to_local() with tp_group and vocab_start (or use ntl_scale.linear_ce_ntl, which takes DTensors)"
        )
    for name, value in (("hidden", hidden), ("weight", weight)):
        if not isinstance(value, torch.Tensor) or value.dtype not in DTYPES:
            kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(
                f"fused_linear_ce_ntl takes fp32, bf16 or fp16 {name}, got {kind}; for fp64 (or other inputs) use "
                "ntl_scale.linear_ce_ntl (the chunked op)"
            )
    if options.label_smoothing or options.logit_softcap is not None:
        raise ValueError(
            f"fused_linear_ce_ntl does not compute label_smoothing={options.label_smoothing!r} or "
            f"logit_softcap={options.logit_softcap!r}; use ntl_scale.linear_ce_ntl (the chunked op), which does, "
            "or switch them off"
        )
    if not need_ce and not options.reweigh:
        raise ValueError(
            "fused_linear_ce_ntl with need_ce=False (and no reweigh) has nothing to fuse: NTL alone reads only the "
            "number columns; use ntl_scale.linear_ce_ntl(..., need_ce=False), or pass need_ce=True"
        )
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"weight must be [vocab, hidden] and hidden [..., hidden] with the same hidden size; got hidden "
            f"{tuple(hidden.shape)} and weight {tuple(weight.shape)} (nn.Linear's [out, in] layout)"
        )
    if hidden.dtype != weight.dtype or hidden.device != weight.device:
        raise TypeError(
            f"hidden ({hidden.dtype}, {hidden.device}) and weight ({weight.dtype}, {weight.device}) must have one "
            "dtype and one device; cast one of them"
        )
    if not triton_ce_ntl.runs_on(hidden):
        raise ValueError(
            f"fused_linear_ce_ntl runs Triton kernels, which need CUDA tensors (or Triton's interpreter, "
            f"TRITON_INTERPRET=1 before triton is imported), but hidden is on {hidden.device}; use "
            "ntl_scale.linear_ce_ntl on this device"
        )


def fused_linear_ce_ntl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab: NumberVocab,
    options: NTLOptions | None = None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    check_finite: bool = False,
    chunk_tokens: int | None = None,
    need_ce: bool = True,
    token_weights: torch.Tensor | None = None,
    vocab_start: int | None = None,
    proportional_grad: bool = False,
    blocks: tuple[dict[str, int] | None, dict[str, int] | None] = (None, None),
) -> PerTokenTerms:
    """:func:`ntl_scale.linear_ce_ntl` with the logits kept on chip (Triton; see the module docs).

    The same arguments and the same :class:`ntl_scale.PerTokenTerms`. ``chunk_tokens`` is checked and
    otherwise unused (no chunk of logits is ever stored); ``token_weights`` is checked and unused (the
    backward recomputes the logits for whatever upstream gradient comes, so nothing is prebuilt for
    them), and so is ``proportional_grad``. ``blocks``: overrides of the kernels' ``FORWARD_BLOCKS`` and
    ``BACKWARD_BLOCKS`` (:mod:`lab.on_chip.triton_linear_ce_ntl`; tests and benchmarks), each a key of
    those tables set to a positive int (else a ``ValueError``). Refused: see that module's docs.
    """
    options = NTLOptions() if options is None else options
    if not isinstance(options, NTLOptions):
        raise TypeError(f"options must be an ntl_scale.NTLOptions, got {type(options).__name__}")
    if isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor):
        device = hidden.device.type
        if torch.is_autocast_enabled(device):  # as an autocast linear layer: both cast, the op runs without it
            amp = torch.get_autocast_dtype(device)
            with torch.autocast(device, enabled=False):
                return fused_linear_ce_ntl(
                    hidden.to(amp), weight.to(amp), labels, vocab, options, tp_group=tp_group,
                    check_finite=check_finite, chunk_tokens=chunk_tokens, need_ce=need_ce,
                    token_weights=token_weights, vocab_start=vocab_start, proportional_grad=proportional_grad,
                    blocks=blocks,
                )  # fmt: skip
    _refuse(hidden, weight, options, need_ce)
    check_plain_labels(labels)
    tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
    stand_in = torch.empty(*hidden.shape[:-1], weight.shape[0], dtype=hidden.dtype, device="meta")
    check_inputs(stand_in, labels, vocab, options, tp_size, vocab_start, source="the output weight's first dimension")
    check_float_level(vocab, options)
    check_option("chunk_tokens", chunk_tokens)
    width = weight.shape[0]
    flat_labels = labels.reshape(-1)
    start = shard_start(vocab_start, tp_rank, width)
    inputs, row = shard_inputs(flat_labels, vocab, options, start, width, torch.float32)
    check_weights(token_weights, labels, torch.float32)
    needs = (torch.is_grad_enabled() and hidden.requires_grad, torch.is_grad_enabled() and weight.requires_grad)
    ce, expect, mass, hit, lse = _OnChipLinearCENTL.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, inputs, tp_group, check_finite, needs, blocks
    )
    return terms_from_stats(ce, expect, mass, hit, inputs, row, labels.shape, vocab, options, lse)
