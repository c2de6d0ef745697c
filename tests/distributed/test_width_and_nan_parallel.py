"""Vocab shards of the wrong width are refused, and NaN reaches NTL on every rank (TP=2 over gloo; issue 23).

1. Width: a table of vocabulary 64 takes shards of 32 columns at TP=2 (the even split) or, with
   ``vocab_start``, any split into contiguous slices (30 + 34 here); a shard of 40 columns, a table
   built for 80, or a table of 63 (no even split) is a ValueError naming both numbers, on every rank
   before any collective (a shape check: all ranks refuse together, none waits). The chunked op's
   weight shard is checked the same way.
2. NaN: a NaN in a number-token column that only rank 1 holds makes NTL NaN on both ranks (the SUM
   all-reduce carries it), for the logits op and the chunked op, without ``check_finite``.
"""

from __future__ import annotations

import math

import pytest
import torch

import ntl_scale
from tests.helpers.distributed import WorkerContext, run_workers
from tests.unit.test_losses import _labels_with_runs, _vocab

pytestmark = pytest.mark.distributed


def _check_width(ctx: WorkerContext) -> None:
    vocab = _vocab()  # vocab_size 64
    labels = _labels_with_runs(vocab)
    full = torch.randn(*labels.shape, 64, generator=torch.Generator().manual_seed(0))
    own = full[..., ctx.tp_rank * 32 : (ctx.tp_rank + 1) * 32]
    ntl_scale.ce_with_ntl(own, labels, vocab, tp_group=ctx.tp_group)  # the even split
    start, stop = (0, 30) if ctx.tp_rank == 0 else (30, 64)
    uneven = ntl_scale.ce_with_ntl(full[..., start:stop], labels, vocab, tp_group=ctx.tp_group, vocab_start=start)
    torch.testing.assert_close(uneven.loss, ntl_scale.ce_with_ntl(full, labels, vocab).loss)
    wide = torch.randn(*labels.shape, 40)
    with pytest.raises(ValueError, match=r"is 40 on this rank .*vocab_size=64 over tp=2 gives 32 per rank.*N=80"):
        ntl_scale.ce_with_ntl(wide, labels, vocab, tp_group=ctx.tp_group)
    with pytest.raises(ValueError, match=r"is 32 on this rank .*vocab_size=80 over tp=2 gives 40"):
        ntl_scale.ce_with_ntl(own, labels, vocab.with_vocab_size(80), tp_group=ctx.tp_group)
    with pytest.raises(ValueError, match=r"vocab_size 63 is not divisible by tp=2.*pad_vocab_size\(63, tp_size=2\)"):
        ntl_scale.vocab_parallel_ce_ntl(own, labels, vocab.with_vocab_size(63), tp_group=ctx.tp_group)
    with pytest.raises(ValueError, match=r"reaches past the vocabulary of 64 \(the number table's vocab_size\)"):
        ntl_scale.ce_with_ntl(wide, labels, vocab, tp_group=ctx.tp_group, vocab_start=30)
    hidden = torch.randn(*labels.shape, 8)
    with pytest.raises(ValueError, match=r"output weight's first dimension is 40 on this rank"):
        ntl_scale.linear_ce_with_ntl(hidden, torch.randn(40, 8), labels, vocab, tp_group=ctx.tp_group)


def _check_nan(ctx: WorkerContext) -> None:
    vocab = _vocab()  # digits at ids 3 ... 39: rank 1 (columns 32-63) holds the digits at 36 and 39
    labels = _labels_with_runs(vocab)
    g = torch.Generator().manual_seed(1)
    full = torch.randn(*labels.shape, 64, generator=g)
    row, col = (int(i) for i in torch.nonzero(vocab.number_mask(labels))[0])
    full[row, col, 36] = float("nan")
    own = full[..., ctx.tp_rank * 32 : (ctx.tp_rank + 1) * 32]
    for loss in ("was", "mse", "number"):
        out = ntl_scale.ce_with_ntl(own, labels, vocab, loss=loss, tp_group=ctx.tp_group)
        assert math.isnan(float(out.ntl)), f"rank {ctx.rank} {loss}: ntl {float(out.ntl)}"
    hidden = torch.randn(*labels.shape, 8, generator=g)
    weight = torch.randn(64, 8, generator=g)
    weight[36, 2] = float("nan")
    shard = weight[ctx.tp_rank * 32 : (ctx.tp_rank + 1) * 32]
    out = ntl_scale.linear_ce_with_ntl(hidden, shard, labels, vocab, tp_group=ctx.tp_group, chunk_tokens=16)
    assert math.isnan(float(out.ntl)), f"rank {ctx.rank} chunked: ntl {float(out.ntl)}"


def _check_width_then_nan(ctx: WorkerContext) -> None:
    _check_width(ctx)
    _check_nan(ctx)


def test_tp2_shard_width_is_checked_and_nan_on_one_rank_reaches_ntl_on_every_rank():
    """Sections 1 and 2, one after the other in one pair of processes."""
    run_workers(2, 2, _check_width_then_nan)
