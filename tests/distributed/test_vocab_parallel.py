"""Vocab-parallel CE + NTL on real gloo process groups (CPU), against single-process references.

Sections:
1. Parity: TP = 2, TP = 4 and DP x TP = 2 x 2. Every rank builds the same global logits from a seed
   (each DP replica its own batch), slices its vocab shard, and compares per-token CE, NTL, the mask
   and its local gradient slice with (a) the single-process full-logit op and (b) the naive float64
   reference. Number tokens split across shards, all on the first shard (others hold none), all on
   the last shard (labels owned by another rank); a tokenizer of 50 tokens padded to 64 columns;
   fp64 (1e-12), fp32 (1e-6), bf16 and fp16 logits (TP = 2); every NTL variant; the in-place variant.
2. CE agrees with ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` on the same shards (TP = 2).
3. Uneven splits: a 49-token vocabulary over TP = 2 and 3 in DeepSpeed-style unequal shards, placed
   with ``vocab_start``: CE, NTL, the mask and each shard's gradient equal the naive fp64 reference,
   for the logits op and for the chunked op on the output weight's row shard.
4. NTL alone beside a partner CE on the same shards (TP = 2 and 3): ``partner CE + w * number_token_loss``
   (and ``linear_number_token_loss`` on the weight's row shard) equals ``ce_with_ntl`` (``linear_ce_with_ntl``)
   in float64, loss and each shard's gradients, every variant, reweighed with the partner's ``lse`` and
   soft-capped, on the uneven split, with our CE as the partner; and with Megatron's
   ``vocab_parallel_cross_entropy`` (even shards, its split; fp32, its compute dtype, TP = 2), NTL run first. The
   same through the passthrough form (``beside_ce`` / ``linear_beside_ce``, no reweighing), each partner consuming it.

One launch per process layout: the TP = 2 processes run sections 1 to 4, the TP = 4 ones and DP x TP = 2 x 2
section 1, TP = 3 sections 3 and 4 without Megatron. The Megatron checks (where megatron-core is installed) run
at TP = 2 only: Megatron's CE and ours take the same route at every TP size (TP = 3 and 4 check ours against
the single-process op and float64), and each rank that imports megatron.core pays about 6 CPU-s.
"""

from __future__ import annotations

import importlib.util

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
        # fp32 rounding of CE = log S + m - z_y, in each implementation: a few eps of the terms' magnitudes (at
        # most max |z| and max |ce|); a fixed atol of 1e-6 was 1 ulp of a CE of 8-16, met with 5 % to spare
        eps = torch.finfo(torch.float32).eps
        atol = 4 * eps * (float(full.abs().max()) + float(ours.detach().abs().max()))
        torch.testing.assert_close(ours, theirs.transpose(0, 1), atol=atol, rtol=0)
        torch.testing.assert_close(shard.grad, megatron_in.grad, atol=8 * eps, rtol=0)  # softmax - onehot: in [-1, 1]
    finally:
        parallel_state.destroy_model_parallel()


ODD_VOCAB = 49  # a vocabulary that TP 2 and 3 do not divide (Granite's 49155 at small scale)


def _uneven_bounds(tp_size: int) -> list[int]:
    """DeepSpeed-style uneven split: the first ``ODD_VOCAB % tp`` shards get one column more."""
    sizes = [ODD_VOCAB // tp_size + (r < ODD_VOCAB % tp_size) for r in range(tp_size)]
    return [sum(sizes[:r]) for r in range(tp_size + 1)]


def _check_uneven_split(ctx: WorkerContext) -> None:
    bounds = _uneven_bounds(ctx.tp_size)
    start, end = bounds[ctx.tp_rank], bounds[ctx.tp_rank + 1]
    assert end - start != ODD_VOCAB / ctx.tp_size  # really uneven
    tokens = [f"w{i}" for i in range(ODD_VOCAB)]
    for value, position in zip(range(10), [3, 11, 16, 17, 24, 25, 32, 33, 40, 48]):  # across every border
        tokens[position] = str(value)
    vocab = ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=ODD_VOCAB)
    labels = random_labels(vocab, (3, 16), ODD_VOCAB, seed=5, number_fraction=0.5)
    full = random_logits((*labels.shape, ODD_VOCAB), seed=6)
    upstream = torch.Generator().manual_seed(7)
    g_ce = torch.randn(labels.shape, generator=upstream, dtype=torch.float64)
    g_ntl = torch.randn(labels.shape, generator=upstream, dtype=torch.float64)
    for variant in VARIANTS[:5]:  # token-level variants; number-level is covered above
        shard = full[..., start:end].clone().requires_grad_()
        ce, ntl, mask = ntl_scale.vocab_parallel_ce_ntl(
            shard, labels, vocab, tp_group=ctx.tp_group, vocab_start=start, **variant
        )
        ((ce * g_ce).sum() + (ntl * g_ntl).sum()).backward()
        reference = full.clone().requires_grad_()
        ce_ref, ntl_ref, mask_ref = naive_per_token(reference, labels, vocab, **variant)
        ((ce_ref * g_ce).sum() + (ntl_ref * g_ntl).sum()).backward()
        what = f"uneven {variant} tp={ctx.tp_size} rank={ctx.rank}"
        assert torch.equal(mask, mask_ref), what
        _close(ce, ce_ref, 1e-12, 1e-12, f"{what} ce")
        _close(ntl, ntl_ref, 1e-12, 1e-12, f"{what} ntl")
        _close(shard.grad, reference.grad[..., start:end], 1e-12, 1e-12, f"{what} grad")
    # the chunked route (hidden states and the output weight's row shard), same split
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(*labels.shape, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(ODD_VOCAB, 6, generator=g, dtype=torch.float64)
    rows = weight[start:end].clone().requires_grad_()
    terms = ntl_scale.linear_ce_ntl(
        hidden, rows, labels, vocab, tp_group=ctx.tp_group, vocab_start=start, chunk_tokens=7
    )
    ((terms.ce * g_ce).sum() + (terms.ntl * g_ntl).sum()).backward()
    full_weight = weight.clone().requires_grad_()
    ce_ref, ntl_ref, _ = naive_per_token(hidden @ full_weight.T, labels, vocab)
    ((ce_ref * g_ce).sum() + (ntl_ref * g_ntl).sum()).backward()
    _close(terms.ce, ce_ref, 1e-12, 1e-12, f"linear ce tp={ctx.tp_size} rank={ctx.rank}")
    _close(terms.ntl, ntl_ref, 1e-12, 1e-12, f"linear ntl tp={ctx.tp_size} rank={ctx.rank}")
    _close(rows.grad, full_weight.grad[start:end], 1e-12, 1e-12, f"linear weight grad rank={ctx.rank}")
    # control: the same columns placed one id off give another loss (every rank takes part in the collectives)
    shard = full[..., start:end].clone()
    off_by_one = start - 1 if start > 0 else start + 1
    wrong, _, _ = ntl_scale.vocab_parallel_ce_ntl(shard, labels, vocab, tp_group=ctx.tp_group, vocab_start=off_by_one)
    assert not torch.allclose(wrong, naive_per_token(full, labels, vocab)[0])
    with pytest.raises(ValueError, match="reaches past the vocabulary"):
        ntl_scale.vocab_parallel_ce_ntl(shard, labels, vocab, vocab_start=ODD_VOCAB - 1)


def _check_composed(ctx: WorkerContext) -> None:
    bounds = _uneven_bounds(ctx.tp_size)
    start, end = bounds[ctx.tp_rank], bounds[ctx.tp_rank + 1]
    tokens = [f"w{i}" for i in range(ODD_VOCAB)]
    for value, position in zip(range(10), [3, 11, 16, 17, 24, 25, 32, 33, 40, 48]):
        tokens[position] = str(value)
    tokens[20] = "."
    vocab = ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=ODD_VOCAB)
    labels = random_labels(vocab, (3, 16), ODD_VOCAB, seed=9, number_fraction=0.5)
    full = random_logits((*labels.shape, ODD_VOCAB), seed=10)
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(*labels.shape, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(ODD_VOCAB, 6, generator=g, dtype=torch.float64)
    split = dict(tp_group=ctx.tp_group, vocab_start=start)
    valid = labels != -100
    for variant in VARIANTS:
        for cap in (None, 3.0):
            what = f"composed {variant} cap={cap} tp={ctx.tp_size} rank={ctx.rank}"
            reweigh = variant.get("reweigh", False)
            fused_in = full[..., start:end].clone().requires_grad_()
            fused = ntl_scale.ce_with_ntl(
                fused_in, labels, vocab, ntl_weight=0.3, logit_softcap=cap, **split, **variant
            )
            fused.loss.backward()
            shard = full[..., start:end].clone().requires_grad_()
            partner = ntl_scale.per_token_ce_ntl(shard, labels, vocab, ntl_scale.NTLOptions(logit_softcap=cap), **split)
            ntl = ntl_scale.number_token_loss(
                shard, labels, vocab, logit_softcap=cap, lse=partner.lse if reweigh else None, **split, **variant
            )
            loss = partner.ce[valid].mean() + 0.3 * ntl
            loss.backward()
            _close(loss, fused.loss, 1e-12, 1e-12, f"{what} loss")
            _close(shard.grad, fused_in.grad, 1e-12, 1e-12, f"{what} logits grad")
            if not reweigh:  # the passthrough form: our CE consumes beside_ce's logits, one autograd node
                shard = full[..., start:end].clone().requires_grad_()
                for_ce, ntl = ntl_scale.beside_ce(shard, labels, vocab, logit_softcap=cap, **split, **variant)
                partner = ntl_scale.per_token_ce_ntl(
                    for_ce, labels, vocab, ntl_scale.NTLOptions(logit_softcap=cap), **split
                )
                loss = partner.ce[valid].mean() + 0.3 * ntl
                loss.backward()
                _close(loss, fused.loss, 1e-12, 1e-12, f"{what} beside_ce loss")
                _close(shard.grad, fused_in.grad, 1e-12, 1e-12, f"{what} beside_ce logits grad")
            rows_f = weight[start:end].clone().requires_grad_()
            h_f = hidden.clone().requires_grad_()
            options = dict(logit_softcap=cap, chunk_tokens=7, **split)
            ntl_scale.linear_ce_with_ntl(h_f, rows_f, labels, vocab, **options, **variant).loss.backward()
            rows, h = weight[start:end].clone().requires_grad_(), hidden.clone().requires_grad_()
            partner = ntl_scale.linear_ce_ntl(
                h, rows, labels, vocab, ntl_scale.NTLOptions(logit_softcap=cap), chunk_tokens=7, **split
            )
            ntl = ntl_scale.linear_number_token_loss(
                h, rows, labels, vocab, lse=partner.lse if reweigh else None, **options, **variant
            )
            (partner.ce[valid].mean() + 0.3 * ntl).backward()
            _close(h.grad, h_f.grad, 1e-12, 1e-12, f"{what} hidden grad (this shard's part)")
            _close(rows.grad, rows_f.grad, 1e-12, 1e-12, f"{what} weight shard grad")
            if not reweigh:  # the passthrough form from hidden states
                rows, h = weight[start:end].clone().requires_grad_(), hidden.clone().requires_grad_()
                h_ce, w_ce, ntl = ntl_scale.linear_beside_ce(h, rows, labels, vocab, **options, **variant)
                partner = ntl_scale.linear_ce_ntl(
                    h_ce, w_ce, labels, vocab, ntl_scale.NTLOptions(logit_softcap=cap), chunk_tokens=7, **split
                )
                (partner.ce[valid].mean() + 0.3 * ntl).backward()
                _close(h.grad, h_f.grad, 1e-12, 1e-12, f"{what} linear_beside_ce hidden grad")
                _close(rows.grad, rows_f.grad, 1e-12, 1e-12, f"{what} linear_beside_ce weight shard grad")


def _check_megatron_composed(ctx: WorkerContext) -> None:
    """Megatron's vocab_parallel_cross_entropy + NTL alone on its even shards (fp32: Megatron's CE computes in
    fp32); NTL runs first, as Megatron overwrites fp32 logits in place."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=ctx.tp_size)
    try:
        columns = 48
        width = columns // ctx.tp_size
        start = ctx.tp_rank * width
        vocab = ntl_scale.NumberVocab([*range(3, 48, 5), 47], list(range(10)), columns)
        labels = random_labels(vocab, (3, 16), columns, seed=12, number_fraction=0.5)
        labels[labels == -100] = 0  # Megatron's CE has no ignore_index
        full = random_logits((*labels.shape, columns), seed=13, dtype=torch.float32)
        for variant in [v for v in VARIANTS if not v.get("reweigh")]:
            what = f"megatron {variant} tp={ctx.tp_size} rank={ctx.rank}"
            fused_in = full[..., start : start + width].clone().requires_grad_()
            fused = ntl_scale.ce_with_ntl(fused_in, labels, vocab, tp_group=ctx.tp_group, **variant)
            fused.loss.backward()
            shard = full[..., start : start + width].clone().requires_grad_()
            logits = shard * 1  # an output layer's (non-leaf) fp32 logits; per-token CE takes any token layout
            ntl = ntl_scale.number_token_loss(logits, labels, vocab, tp_group=ctx.tp_group, **variant)
            ce = vocab_parallel_cross_entropy(logits, labels).mean()  # overwrites the logits: after NTL
            loss = ce + 0.3 * ntl
            loss.backward()
            eps = torch.finfo(torch.float32).eps
            _close(loss, fused.loss, 8 * eps * float(full.abs().max()), 4 * eps, f"{what} loss")
            _close(shard.grad, fused_in.grad, 8 * eps, 4 * eps, f"{what} logits grad")
            # the passthrough form: Megatron's CE consumes (and overwrites) beside_ce's logits
            shard = full[..., start : start + width].clone().requires_grad_()
            for_ce, ntl = ntl_scale.beside_ce(shard * 1, labels, vocab, tp_group=ctx.tp_group, **variant)
            loss = vocab_parallel_cross_entropy(for_ce, labels).mean() + 0.3 * ntl
            loss.backward()
            _close(loss, fused.loss, 8 * eps * float(full.abs().max()), 4 * eps, f"{what} beside_ce loss")
            _close(shard.grad, fused_in.grad, 8 * eps, 4 * eps, f"{what} beside_ce logits grad")
    finally:
        parallel_state.destroy_model_parallel()


def _check_sections(ctx: WorkerContext, dtypes: list[torch.dtype], megatron: bool, uneven: bool) -> None:
    _check_parity(ctx, list(LAYOUTS), dtypes)
    if megatron:
        _check_megatron_ce(ctx)
    if uneven:
        _check_uneven_split(ctx)
        _check_composed(ctx)
        if megatron:
            _check_megatron_composed(ctx)


def _check_tp3(ctx: WorkerContext) -> None:
    _check_uneven_split(ctx)
    _check_composed(ctx)


@pytest.mark.parametrize("world_size,tp_size", [(2, 2), (4, 4), (4, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_parity_with_single_process(world_size, tp_size):
    """Section 1; at TP = 2 the same processes then check sections 2 (CE as Megatron's; needs megatron-core),
    3 and 4. bf16 and fp16 logits at TP = 2 only: the half dtypes take the same collectives as fp32 (the
    statistics are reduced in fp32) at every TP size."""
    dtypes = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
    if world_size == 4:
        dtypes = [torch.float64, torch.float32]
    megatron = world_size == tp_size == 2 and importlib.util.find_spec("megatron.core") is not None
    run_workers(world_size, tp_size, _check_sections, dtypes, megatron, tp_size == 2 and world_size == 2)


def test_uneven_vocabulary_split_at_tp3():
    """Sections 3 and 4 at TP = 3; Megatron's CE as the partner at TP = 2 only (test_parity_with_single_process)."""
    run_workers(3, 3, _check_tp3)
