"""Vocab-parallel CE + NTL on real gloo process groups (CPU), against single-process references.

Sections:
1. Parity: TP = 2, TP = 4 and DP x TP = 2 x 2. Every rank builds the same global logits from a seed
   (each DP replica its own batch), slices its vocab shard, and compares per-token CE, NTL, the mask
   and its local gradient slice with (a) the single-process full-logit op and (b) the naive float64
   reference. Number tokens split across shards, all on the first shard (others hold none), all on
   the last shard (labels owned by another rank); a tokenizer of 50 tokens padded to 64 columns;
   fp64 (1e-12), fp32 (1e-6), bf16 and fp16 logits; every NTL variant; the in-place variant.
2. CE agrees with ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` on the same shards.
"""

from __future__ import annotations

import pytest
import torch

import ntl_scale
from tests.helpers.data import random_labels, random_logits
from tests.helpers.distributed import WorkerContext, run_workers
from tests.helpers.reference import naive_per_token

pytestmark = pytest.mark.distributed

VOCAB_COLUMNS = 64  # padded model vocabulary
TOKENIZER_SIZE = 50  # not divisible by 4: padding makes the shards even
LAYOUTS = {
    "split": [2, 9, 17, 20, 31, 33, 40, 41, 47, 49],
    "first_shard": [0, 1, 2, 3, 5, 7, 9, 11, 13, 15],
    "last_shard": [40, 41, 42, 43, 44, 45, 46, 47, 48, 49],
}
VARIANTS = [
    dict(loss="was"),
    dict(loss="was", squash_factor=3.0, reweigh=True),
    dict(loss="mse"),
    dict(loss="mae", reweigh=True),
    dict(loss="huber", huber_delta=2.0),
    dict(loss="number"),
    dict(loss="number", float_level=True, reweigh=True),
]
# dtype -> ((atol, rtol) vs the single-process op, (atol, rtol) vs the naive fp64 reference); atol is
# in units of the compared tensor's scale max(1, max |x|) (MSE losses reach 81, its gradients 17).
# fp32 shards differ from one device only in summation order: measured <= 6e-7 relative, so 1e-6
# absolute plus 2 ulps relative (MSE values reach 81). Against fp64 math, fp32 loses up to ~4e-5
# relative where yhat - t cancels, hence the looser naive tolerance.
TOLERANCES = {
    torch.float64: ((1e-12, 1e-12), (1e-12, 1e-12)),
    torch.float32: ((1e-6, 2e-6), (1e-4, 1e-4)),
    torch.bfloat16: ((1e-6, 2e-6), (1e-4, 1e-4)),
    torch.float16: ((1e-6, 2e-6), (1e-4, 1e-4)),
}
HALF_GRAD_TOL = 1e-2  # half-precision gradients: the same fp32 value rounded, at most an ulp apart


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    """assert_close with ``atol`` in units of the expected tensor's scale ``max(1, max |expected|)``."""
    scale = max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(
        actual.detach(), expected.detach(), atol=atol * scale, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def _vocab(layout: str) -> ntl_scale.NumberVocab:
    tokens = [f"w{i}" for i in range(TOKENIZER_SIZE)]
    for value, position in zip(range(10), LAYOUTS[layout]):
        tokens[position] = str(value)
    dot = next(i for i in range(TOKENIZER_SIZE) if tokens[i].startswith("w"))
    tokens[dot] = "."
    return ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=VOCAB_COLUMNS)


def _labels(vocab: ntl_scale.NumberVocab, seed: int) -> torch.Tensor:
    labels = random_labels(vocab, (3, 16), TOKENIZER_SIZE, seed=seed, number_fraction=0.5)
    digits = vocab.ids.tolist()
    labels[0, 1:5] = torch.tensor([digits[3], digits[1], digits[4], digits[1]])
    labels[1, 6:11] = torch.tensor([digits[5], digits[9], vocab.decimal_point_id, digits[2], digits[6]])
    return labels


def _check_parity(ctx: WorkerContext, layouts: list[str], dtypes: list[torch.dtype]) -> None:
    width = VOCAB_COLUMNS // ctx.tp_size
    columns = slice(ctx.tp_rank * width, (ctx.tp_rank + 1) * width)
    for layout in layouts:
        vocab = _vocab(layout)
        seed = 100 * ctx.dp_rank + len(layout)  # each DP replica has its own batch
        labels = _labels(vocab, seed)
        full64 = random_logits((*labels.shape, VOCAB_COLUMNS), seed=seed)
        full64[..., TOKENIZER_SIZE:] -= 30.0  # padding columns: tiny but nonzero probability
        upstream = torch.Generator().manual_seed(seed + 1)
        g_ce = torch.randn(labels.shape, generator=upstream, dtype=torch.float64)
        g_ntl = torch.randn(labels.shape, generator=upstream, dtype=torch.float64)
        for dtype in dtypes:
            (atol, rtol), (naive_atol, naive_rtol) = TOLERANCES[dtype]
            full = full64.to(dtype)
            for variant in VARIANTS:
                for inplace in [False, True] if dtype in (torch.float32, torch.float64) else [False]:
                    what = f"{layout} {dtype} {variant} inplace={inplace} tp={ctx.tp_size} rank={ctx.rank}"
                    leaf = full[..., columns].clone().requires_grad_()
                    shard = leaf * 1 if inplace else leaf  # in place needs a non-leaf activation
                    ce, ntl, mask = ntl_scale.vocab_parallel_ce_ntl(
                        shard, labels, vocab, tp_group=ctx.tp_group, inplace=inplace, **variant
                    )
                    (ce * g_ce.to(ce.dtype) + ntl * g_ntl.to(ntl.dtype)).sum().backward()

                    single = full.clone().requires_grad_()
                    ce1, ntl1, mask1 = ntl_scale.vocab_parallel_ce_ntl(single, labels, vocab, **variant)
                    (ce1 * g_ce.to(ce1.dtype) + ntl1 * g_ntl.to(ntl1.dtype)).sum().backward()
                    assert torch.equal(mask, mask1), what
                    _close(ce, ce1, atol, rtol, what)
                    _close(ntl, ntl1, atol, rtol, what)
                    full_precision = dtype in (torch.float32, torch.float64)
                    g_atol, g_rtol = (atol, rtol) if full_precision else (HALF_GRAD_TOL, HALF_GRAD_TOL)
                    _close(leaf.grad.double(), single.grad[..., columns].double(), g_atol, g_rtol, what)

                    naive_in = full.double().clone().requires_grad_()
                    ce2, ntl2, mask2 = naive_per_token(naive_in, labels, vocab, **variant)
                    (ce2 * g_ce + ntl2 * g_ntl).sum().backward()
                    assert torch.equal(mask, mask2), what
                    _close(ce.double(), ce2, naive_atol, naive_rtol, what)
                    _close(ntl.double(), ntl2, naive_atol, naive_rtol, what)
                    if full_precision:
                        _close(leaf.grad.double(), naive_in.grad[..., columns], naive_atol, naive_rtol, what)
        # The arg-max hit (token accuracy) needs no extra collective: z_y >= global max.
        boosted = full64.clone()
        rows = (labels != -100).nonzero()[::3]
        boosted[rows[:, 0], rows[:, 1], labels[rows[:, 0], rows[:, 1]]] += 12.0
        terms = ntl_scale.per_token_ce_ntl(boosted[..., columns], labels, vocab, tp_group=ctx.tp_group)
        want = (boosted.argmax(-1) == labels) & (labels != -100)
        assert torch.equal(terms.hit, want) and want.any() and not want.all(), layout
        if ctx.tp_size > 1 and layout != "split":
            # the layout really exercised ranks without number tokens
            assert any(len(vocab.shard(r, ctx.tp_size).table_index) == 0 for r in range(ctx.tp_size))


@pytest.mark.parametrize("world_size,tp_size", [(2, 2), (4, 4), (4, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_parity_with_single_process(world_size, tp_size):
    dtypes = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
    if world_size == 4 and tp_size == 2:
        dtypes = [torch.float64, torch.float32]
    run_workers(world_size, tp_size, _check_parity, list(LAYOUTS), dtypes)


def _check_megatron_ce(ctx: WorkerContext) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=ctx.tp_size)
    try:
        width = VOCAB_COLUMNS // ctx.tp_size
        columns = slice(ctx.tp_rank * width, (ctx.tp_rank + 1) * width)
        vocab = _vocab("split")
        labels = _labels(vocab, seed=5)
        labels[labels == -100] = 0  # Megatron's CE has no ignore_index: masking happens later
        full = random_logits((*labels.shape, VOCAB_COLUMNS), seed=5, dtype=torch.float32)
        shard = full[..., columns].clone().requires_grad_()
        ours, _, _ = ntl_scale.vocab_parallel_ce_ntl(shard, labels, vocab, tp_group=ctx.tp_group)
        ours.sum().backward()
        megatron_in = full[..., columns].clone().requires_grad_()
        # Megatron expects [sequence, batch, vocab/tp] and modifies its input: give it a copy.
        theirs = vocab_parallel_cross_entropy(
            megatron_in.transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous()
        )
        theirs.sum().backward()
        torch.testing.assert_close(ours, theirs.transpose(0, 1), atol=1e-6, rtol=0)
        torch.testing.assert_close(shard.grad, megatron_in.grad, atol=1e-6, rtol=0)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp_size", [2, 4])
def test_ce_matches_megatron(tp_size):
    pytest.importorskip("megatron.core")
    run_workers(tp_size, tp_size, _check_megatron_ce)
