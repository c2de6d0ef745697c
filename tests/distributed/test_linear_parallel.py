"""CE + NTL from hidden states on vocab shards (TP=2 over gloo) against the naive float64 reference.

Each rank holds the rows ``[r*V/tp, (r+1)*V/tp)`` of the output weight and the same hidden states.
Per-token terms equal the reference on every rank; the weight gradient of each shard equals the
reference's rows; the hidden-state gradients summed over the TP group (what Megatron's
``copy_to_tensor_model_parallel_region`` does in its backward) equal the reference. Every NTL
variant; number tokens split across ranks and all on one rank; mean reduction (gradient built in the
forward) and arbitrary upstream gradients (recomputing backward); ignored labels.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ntl_scale
from ntl_scale.linear import linear_ce_ntl, linear_ce_with_ntl
from tests.distributed.test_vocab_parallel import VARIANTS, _labels, _vocab
from tests.helpers.distributed import WorkerContext, run_workers
from tests.helpers.reference import naive_per_token, naive_reduce

pytestmark = pytest.mark.distributed
HIDDEN = 16


def _close(actual, expected, tol, what):
    scale = max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(
        actual.detach().double(), expected.detach().double(), atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}"
    )


def _check(ctx: WorkerContext, dtype: torch.dtype, tol: float) -> None:
    for layout in ("split", "first_shard"):
        vocab = _vocab(layout)
        labels = _labels(vocab, seed=len(layout))
        g = torch.Generator().manual_seed(7)
        hidden64 = torch.randn(*labels.shape, HIDDEN, generator=g, dtype=torch.float64)
        weight64 = torch.randn(vocab.vocab_size, HIDDEN, generator=g, dtype=torch.float64) * 0.6
        upstream = torch.rand(2, *labels.shape, generator=g, dtype=torch.float64)
        width = vocab.vocab_size // ctx.tp_size
        rows = slice(ctx.tp_rank * width, (ctx.tp_rank + 1) * width)
        for variant in VARIANTS:
            what = f"{layout} {variant} {dtype} rank {ctx.rank}"
            for mode in ("any", "mean"):
                h_ref = hidden64.clone().requires_grad_()
                w_ref = weight64.clone().requires_grad_()
                ce, ntl, mask = naive_per_token(h_ref @ w_ref.t(), labels, vocab, **variant)
                if mode == "any":
                    (upstream[0] * ce + upstream[1] * ntl).sum().backward()
                else:
                    valid = labels != -100
                    (naive_reduce(ce, valid, None, "mean") + 0.3 * naive_reduce(ntl, mask, None, "mean")).backward()

                hidden = hidden64.to(dtype).clone().requires_grad_()
                shard = weight64[rows].to(dtype).contiguous().requires_grad_()
                if mode == "any":
                    terms = linear_ce_ntl(
                        hidden,
                        shard,
                        labels,
                        vocab,
                        ntl_scale.NTLOptions(**variant),
                        tp_group=ctx.tp_group,
                        chunk_tokens=5,
                    )
                    _close(terms.ce, ce, tol, what + " ce")
                    _close(terms.ntl, ntl, tol, what + " ntl")
                    assert torch.equal(terms.number_mask, mask), what
                    (upstream[0].to(dtype) * terms.ce + upstream[1].to(dtype) * terms.ntl).sum().backward()
                else:
                    out = linear_ce_with_ntl(
                        hidden, shard, labels, vocab, tp_group=ctx.tp_group, chunk_tokens=5, **variant
                    )
                    out.loss.backward()
                _close(shard.grad, w_ref.grad[rows], tol, f"{what} {mode} d weight shard")
                grad_h = hidden.grad.clone()
                dist.all_reduce(grad_h, group=ctx.tp_group)
                _close(grad_h, h_ref.grad, tol, f"{what} {mode} d hidden (summed over TP)")
        if layout == "split":
            _check_z_loss(ctx, vocab, labels, hidden64, weight64, rows, dtype, tol)
        if layout == "first_shard":  # really a rank without number tokens
            assert any(len(vocab.shard(r, ctx.tp_size).table_index) == 0 for r in range(ctx.tp_size))


def _check_z_loss(ctx, vocab, labels, hidden64, weight64, rows, dtype, tol) -> None:
    """The z-loss (weight 1) on vocab shards with the logits shifted per token (a constant hidden feature over a
    weight column of ones): every lse negative, or every other one, so that the effective weights
    ``1 + 2 lse`` of the forward-built weight gradient are all negative, or of both signs (issue 51, item 3).
    Against F.cross_entropy + ``logsumexp**2`` and the naive NTL in float64."""
    valid = labels != -100
    for regime in ("negative", "mixed"):
        what = f"z-loss {regime} {dtype} rank {ctx.rank}"
        shift = torch.full(labels.shape, -10.0, dtype=torch.float64)
        if regime == "mixed":
            shift[..., 1::2] = 0.0
        h64 = torch.cat([hidden64, shift.unsqueeze(-1)], dim=-1)
        w64 = torch.cat([weight64, torch.ones(weight64.shape[0], 1, dtype=torch.float64)], dim=-1)
        h_ref, w_ref = h64.clone().requires_grad_(), w64.clone().requires_grad_()
        logits = h_ref @ w_ref.t()
        lse = torch.logsumexp(logits, dim=-1)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
        _, ntl, mask = naive_per_token(logits, labels, vocab)
        loss = (ce.view_as(lse) + lse**2)[valid].mean() + 0.3 * ntl[mask].mean()
        loss.backward()
        low, high = float((1 + 2 * lse.detach()[valid]).min()), float((1 + 2 * lse.detach()[valid]).max())
        assert high < 0 if regime == "negative" else low < 0 < high  # the effective weights' signs
        hidden = h64.to(dtype).clone().requires_grad_()
        shard = w64[rows].to(dtype).contiguous().requires_grad_()
        out = linear_ce_with_ntl(hidden, shard, labels, vocab, tp_group=ctx.tp_group, chunk_tokens=5, z_loss_weight=1.0)
        out.loss.backward()
        _close(out.loss, loss, tol, what + " loss")
        _close(shard.grad, w_ref.grad[rows], tol, what + " d weight shard")
        grad_h = hidden.grad.clone()
        dist.all_reduce(grad_h, group=ctx.tp_group)
        _close(grad_h, h_ref.grad, tol, what + " d hidden (summed over TP)")


def _check_each_dtype(ctx: WorkerContext) -> None:
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        _check(ctx, dtype, tol)


def test_tp2_matches_the_reference():
    """fp64 (1e-10), then fp32 (1e-5), in one pair of processes."""
    run_workers(2, 2, _check_each_dtype)
