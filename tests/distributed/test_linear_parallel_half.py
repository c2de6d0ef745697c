"""Half-precision chunked gradients on vocab shards (TP=2 over gloo) at 8192 tokens (issue 23, defect 3).

The inputs of ``tests/unit/test_linear_half.py`` (a frequent token with ``p ~ 0.7`` and a hidden
channel of 12), the output weight split in two row shards: each shard's weight gradient and the hidden
gradient summed over the TP group (in float64, as a check of the op, not of the reduction) are finite
and equal the materialised half-precision path on the full logits within the rounding of one product,
for the mean reduction (gradient built in the forward) and arbitrary upstream gradients (recomputed).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ntl_scale.linear import linear_ce_ntl, linear_ce_with_ntl
from tests.helpers.distributed import WorkerContext, run_workers
from tests.unit.test_linear_half import TOKENS, _check, _inputs, _materialised, _vocab

pytestmark = pytest.mark.distributed


def _shard_grads(ctx, hidden, weight, labels, vocab, rows, chunk_tokens, upstream):
    h = hidden.clone().requires_grad_()
    w = weight[rows].contiguous().requires_grad_()
    if upstream is None:
        linear_ce_with_ntl(h, w, labels, vocab, tp_group=ctx.tp_group, chunk_tokens=chunk_tokens).loss.backward()
    else:
        terms = linear_ce_ntl(h, w, labels, vocab, tp_group=ctx.tp_group, chunk_tokens=chunk_tokens)
        (upstream[0] * terms.ce + upstream[1] * terms.ntl).sum().backward()
    grad_h = h.grad.double()
    dist.all_reduce(grad_h, group=ctx.tp_group)
    return grad_h, w.grad.double()


def _check_tp(ctx: WorkerContext, dtype: torch.dtype) -> None:
    vocab = _vocab()
    hidden64, weight64, labels = _inputs()
    hidden, weight = hidden64.to(dtype), weight64.to(dtype)
    width = vocab.vocab_size // ctx.tp_size
    rows = slice(ctx.tp_rank * width, (ctx.tp_rank + 1) * width)
    upstream = torch.rand(2, TOKENS, generator=torch.Generator().manual_seed(2), dtype=torch.float64) / TOKENS
    for mode, up in (("mean", None), ("any", upstream)):
        reference = _materialised(hidden.double(), weight.double(), labels, vocab, up)
        materialised = _materialised(hidden, weight, labels, vocab, None if up is None else up.float())
        for chunk_tokens in (None, 256):
            chunked = _shard_grads(ctx, hidden, weight, labels, vocab, rows, chunk_tokens, up)
            _check(
                dtype,
                chunked,
                (materialised[0], materialised[1][rows]),
                (reference[0], reference[1][rows]),
                f"{dtype} rank {ctx.rank} {mode} chunk_tokens={chunk_tokens}",
            )


def _check_each_dtype(ctx: WorkerContext) -> None:
    for dtype in (torch.float16, torch.bfloat16):
        _check_tp(ctx, dtype)


def test_tp2_half_precision_matches_the_materialised_half_path():
    """fp16, then bf16, in one pair of processes."""
    run_workers(2, 2, _check_each_dtype)
