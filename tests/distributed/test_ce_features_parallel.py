"""The CE features (z-loss, label smoothing, soft-capping) under tensor parallelism, on real gloo groups.

Sections:
1. Uneven vocabulary shards (49 columns over TP = 2 and 3, placed with ``vocab_start``): per-token CE
   term, log-sum-exp and each shard's gradient of the logits op, and of the chunked op (the weight's row
   shard's gradient, the hidden gradient summed over the ranks; soft-capping there without smoothing),
   against the float64 full-vocabulary
   reference (torch's ``F.cross_entropy(label_smoothing=)``, the z-loss and ``c * tanh(z / c)`` written
   from their definitions), with arbitrary upstream gradients. Label smoothing needs the sum of the logits
   over the whole vocabulary: a smoothing over the local shard would fail these checks.
2. Megatron's ``vocab_parallel_cross_entropy(label_smoothing=)`` (where megatron-core is installed, TP = 2):
   at TP = 1 it equals ours (its smoothing spreads ``alpha`` over the ``V - 1`` other tokens: ours with
   ``eps = alpha V / (V - 1)``); at TP = 2 it smooths over the local shard and departs from the whole-
   vocabulary value, which ours keeps at TP = 2.

One launch per TP size: TP = 2 runs both sections, TP = 3 section 1.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

import ntl_scale
from ntl_scale.options import NTLOptions
from tests.helpers.data import random_labels, random_logits
from tests.helpers.distributed import WorkerContext, run_workers
from tests.helpers.reference import reference_ce_features

pytestmark = pytest.mark.distributed

ODD_VOCAB = 49
FEATURES = [
    dict(label_smoothing=0.1),
    dict(z_loss_weight=1e-2),
    dict(label_smoothing=0.2, z_loss_weight=3e-2),
    dict(logit_softcap=4.0, z_loss_weight=1e-2),
    dict(logit_softcap=4.0, label_smoothing=0.1, z_loss_weight=1e-2),
]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = 1e-12) -> None:
    torch.testing.assert_close(actual.detach(), expected.detach(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


def _vocab() -> ntl_scale.NumberVocab:
    tokens = [f"w{i}" for i in range(ODD_VOCAB)]
    for value, position in zip(range(10), [3, 11, 16, 17, 24, 25, 32, 33, 40, 48]):  # across every border
        tokens[position] = str(value)
    return ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=ODD_VOCAB)


def _bounds(tp_size: int) -> list[int]:
    """DeepSpeed-style uneven split: the first ``ODD_VOCAB % tp`` shards get one column more."""
    sizes = [ODD_VOCAB // tp_size + (r < ODD_VOCAB % tp_size) for r in range(tp_size)]
    return [sum(sizes[:r]) for r in range(tp_size + 1)]


def _check_uneven(ctx: WorkerContext) -> None:
    bounds = _bounds(ctx.tp_size)
    start, end = bounds[ctx.tp_rank], bounds[ctx.tp_rank + 1]
    vocab = _vocab()
    labels = random_labels(vocab, (3, 8), ODD_VOCAB, seed=5, number_fraction=0.5)
    flat = labels.reshape(-1)
    full = random_logits((*labels.shape, ODD_VOCAB), seed=6)
    g = torch.Generator().manual_seed(7)
    g_ce = torch.randn(labels.shape, generator=g, dtype=torch.float64)
    g_ntl = torch.randn(labels.shape, generator=g, dtype=torch.float64)
    hidden = torch.randn(*labels.shape, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(ODD_VOCAB, 6, generator=g, dtype=torch.float64)
    for features in FEATURES:
        what = f"{features} tp={ctx.tp_size} rank={ctx.rank}"
        options = NTLOptions(**features)
        # the logits op
        shard = full[..., start:end].clone().requires_grad_()
        terms = ntl_scale.per_token_ce_ntl(shard, labels, vocab, options, tp_group=ctx.tp_group, vocab_start=start)
        ((terms.ce * g_ce).sum() + (terms.ntl * g_ntl).sum()).backward()
        reference = full.clone().requires_grad_()
        ce_ref, lse_ref = reference_ce_features(reference.reshape(-1, ODD_VOCAB), flat, **features)
        capped = reference
        if options.logit_softcap is not None:
            capped = options.logit_softcap * torch.tanh(reference / options.logit_softcap)
        ntl_ref = ntl_scale.number_token_loss(capped, labels, vocab, reduction="none")  # the hard target
        ((ce_ref.view(labels.shape) * g_ce).sum() + (ntl_ref * g_ntl).sum()).backward()
        _close(terms.ce, ce_ref.view(labels.shape), f"logits ce {what}")
        _close(terms.lse, lse_ref.view(labels.shape), f"logits lse {what}")
        _close(terms.ntl, ntl_ref, f"logits ntl {what}")
        _close(shard.grad, reference.grad[..., start:end], f"logits grad {what}")
        # the chunked op on the weight's row shard
        rows = weight[start:end].clone().requires_grad_()
        h = hidden.clone().requires_grad_()
        terms = ntl_scale.linear_ce_ntl(
            h, rows, labels, vocab, options, tp_group=ctx.tp_group, vocab_start=start, chunk_tokens=7
        )
        ((terms.ce * g_ce).sum() + (terms.ntl * g_ntl).sum()).backward()
        h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = h_ref @ w_ref.T
        ce_ref, lse_ref = reference_ce_features(logits.reshape(-1, ODD_VOCAB), flat, **features)
        if options.logit_softcap is not None:
            logits = options.logit_softcap * torch.tanh(logits / options.logit_softcap)
        ntl_ref = ntl_scale.number_token_loss(logits, labels, vocab, reduction="none")
        ((ce_ref.view(labels.shape) * g_ce).sum() + (ntl_ref * g_ntl).sum()).backward()
        _close(terms.ce, ce_ref.view(labels.shape), f"linear ce {what}")
        _close(terms.lse, lse_ref.view(labels.shape), f"linear lse {what}")
        _close(rows.grad, w_ref.grad[start:end], f"linear weight grad {what}")
        grad_h = h.grad.clone()
        dist.all_reduce(grad_h, group=ctx.tp_group)  # each shard's part, summed as the output layer's backward does
        _close(grad_h, h_ref.grad, f"linear hidden grad {what}")


def _check_megatron_smoothing(ctx: WorkerContext) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    columns = 50  # Megatron splits evenly
    vocab = ntl_scale.NumberVocab(list(range(10)), list(range(10)), columns)
    labels = torch.randint(0, columns, (4, 6), generator=torch.Generator().manual_seed(3))
    full = random_logits((*labels.shape, columns), seed=4)
    eps = 0.1
    alpha = eps * (columns - 1) / columns  # Megatron's alpha over the V - 1 other tokens
    ours_full = ntl_scale.per_token_ce_ntl(full, labels, vocab, NTLOptions(label_smoothing=eps)).ce
    width = columns // ctx.tp_size
    start = ctx.tp_rank * width
    ours_tp = ntl_scale.per_token_ce_ntl(
        full[..., start : start + width], labels, vocab, NTLOptions(label_smoothing=eps), tp_group=ctx.tp_group
    ).ce
    _close(ours_tp, ours_full, "ours at TP=2 vs ours at TP=1")
    results = {}
    for tp in (1, ctx.tp_size):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            part = full if tp == 1 else full[..., start : start + width]
            # Megatron expects [sequence, batch, vocab/tp] and overwrites its input: a copy
            theirs = vocab_parallel_cross_entropy(part.transpose(0, 1).contiguous(), labels.t().contiguous(), alpha)
            results[tp] = theirs.t().double()  # Megatron's CE returns fp32 for fp64 logits
        finally:
            parallel_state.destroy_model_parallel()
    _close(ours_full, results[1], "Megatron at TP=1 (alpha over V - 1 tokens) vs ours", tol=1e-6)
    # the peer's per-shard smoothing: its TP=2 value is not the whole vocabulary's (ours at TP=2 is)
    assert (results[ctx.tp_size] - results[1]).abs().max() > 1e-3, "Megatron's TP smoothing matched the full value"


def _check(ctx: WorkerContext, megatron: bool) -> None:
    _check_uneven(ctx)
    if megatron:
        _check_megatron_smoothing(ctx)


@pytest.mark.parametrize("tp_size", [2, 3])
def test_ce_features_on_uneven_vocabulary_shards(tp_size):
    megatron = tp_size == 2 and importlib.util.find_spec("megatron.core") is not None
    run_workers(tp_size, tp_size, _check, megatron)
