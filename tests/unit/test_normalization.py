"""``ntl_scale.normalization``: the step counts and the two normalisations every integration uses.

Compared with counts written out with loops and with the float64 objective over the whole global batch
computed the naive way (``tests/helpers/reference.py``), never with the module itself.

Sections:
1. Counting: :func:`step_counts` equals the tokens and NTL positions counted with loops (token-level and
   number-level variants, loss masks, context-parallel slices); an empty step; a wrong number of masks.
2. Sums: :func:`micro_batch_sums` equals the reference's sums of one micro-batch.
3. The global batch: split into micro-batches x accumulation steps x DP ranks, the ``global`` objective
   summed over the micro-batches is the float64 objective of the whole batch (value and gradient); the
   ``micro-batch`` one of a single micro-batch is too, and :func:`means` agrees with :func:`objective`;
   a framework's rescale (``scale``) and the per-token :func:`factors` give ``scale x`` the whole-batch
   objective; weight 0 is the CE mean bit for bit.
4. One all-reduce: over two gloo processes the counts are both ranks' counts, reduced by one collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ntl_scale
from ntl_scale.normalization import MicroBatchSums, factors, means, micro_batch_sums, objective, step_counts
from tests.helpers.distributed import WorkerContext, run_workers
from tests.helpers.reference import naive_per_token

WEIGHT = 0.3
V = 32
DIGIT_IDS = list(range(10, 20))  # token id 10 + d is the digit d
VARIANTS = [
    dict(loss="was"),
    dict(loss="mse", reweigh=True),
    dict(loss="huber"),
    dict(loss="number"),
]


def _name(variant: dict) -> str:
    return variant["loss"] + ("+reweigh" if variant.get("reweigh") else "")


def _vocab() -> ntl_scale.NumberVocab:
    return ntl_scale.NumberVocab.from_id_to_token({10 + d: str(d) for d in range(10)}, vocab_size=V)


def _batch(rows: int = 8, seq: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels with digit runs, words between them and a few ignored positions; float64 logits."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.where(
        torch.rand(rows, seq, generator=g) < 0.5,
        torch.randint(10, 20, (rows, seq), generator=g),
        torch.randint(20, V, (rows, seq), generator=g),
    )
    labels[:, -1] = -100
    labels[1, 2:4] = -100
    labels[rows - 1] = torch.randint(20, V, (seq,), generator=g)  # a row without numbers
    logits = torch.randn(rows, seq, V, generator=g, dtype=torch.float64) * 2
    return labels, logits


def _loop_counts(labels: torch.Tensor, loss: str, mask: torch.Tensor | None = None, pieces: int = 1) -> list[float]:
    """``[tokens, NTL positions]`` with loops: a position counts its mask weight; an NTL position is a digit
    label (token-level), or a digit whose left neighbour in its slice is not a digit (``loss="number"``)."""
    tokens = numbers = 0.0
    rows, seq = labels.shape
    for row in range(rows):
        previous = False
        for col in range(seq):
            label = int(labels[row, col])
            weight = float(label != -100) if mask is None else float(mask[row, col])
            if col % (seq // pieces) == 0:
                previous = False  # a new context-parallel slice: no number continues across its border
            digit = label in DIGIT_IDS
            tokens += weight
            numbers += weight * float(digit and (loss != "number" or not previous))
            previous = digit
    return [tokens, numbers]


# ---------------------------------------------------------------------------------- 1. counting


@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_step_counts_are_the_tokens_and_ntl_positions_counted_directly(variant):
    vocab, (labels, _) = _vocab(), _batch()
    options = ntl_scale.NTLOptions(**variant)
    parts = list(torch.split(labels, [3, 1, 4]))
    want = [sum(c) for c in zip(*[_loop_counts(p, variant["loss"]) for p in parts])]
    counts = step_counts(parts, vocab, options)
    assert counts.dtype == torch.float64 and counts.shape == (2,)
    assert counts.tolist() == want

    masks = [torch.rand(p.shape, generator=torch.Generator().manual_seed(i)).round() for i, p in enumerate(parts)]
    megatron = [p.clamp_min(0) for p in parts]  # Megatron's labels are ids everywhere; the mask drops positions
    want = [sum(c) for c in zip(*[_loop_counts(p, variant["loss"], m) for p, m in zip(megatron, masks)])]
    assert step_counts(megatron, vocab, options, loss_masks=masks).tolist() == want


def test_step_counts_cut_numbers_at_context_parallel_slices():
    vocab = _vocab()
    labels = torch.tensor([[11, 12, 13, 14, 25, 15, 16, 17]])  # 1234 x 567
    options = ntl_scale.NTLOptions(loss="number")
    assert step_counts([labels], vocab, options).tolist() == _loop_counts(labels, "number") == [8.0, 2.0]
    assert step_counts([labels], vocab, options, pieces=4).tolist() == _loop_counts(labels, "number", pieces=4)
    assert _loop_counts(labels, "number", pieces=4) == [8.0, 4.0]  # 12|34 x 5|67: four numbers


def test_an_empty_step_counts_zeros_and_masks_must_match_the_micro_batches():
    counts = step_counts([], _vocab(), device="cpu")
    assert counts.tolist() == [0.0, 0.0] and counts.dtype == torch.float64
    labels = torch.tensor([[11, 25]])
    with pytest.raises(ValueError, match="1 loss masks for 2 micro-batches; pass one per micro-batch"):
        step_counts([labels, labels], _vocab(), loss_masks=[torch.ones(1, 2)])


# ---------------------------------------------------------------------------------- 2. sums


@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_micro_batch_sums_are_the_references_sums(variant):
    vocab, (labels, logits) = _vocab(), _batch(rows=3, seed=1)
    terms = ntl_scale.per_token_ce_ntl(logits, labels, vocab, ntl_scale.NTLOptions(**variant))
    ce, ntl, positions = naive_per_token(logits, labels, vocab, **variant)
    valid = (labels != -100).double()
    hits = (logits.argmax(-1) == labels).double() * positions.double() * valid
    sums = micro_batch_sums(terms, labels != -100)
    want = MicroBatchSums(
        ce=(ce * valid).sum(),
        ntl=(ntl * positions.double() * valid).sum(),
        tokens=valid.sum(),
        numbers=(positions.double() * valid).sum(),
        hits=hits.sum(),
    )
    for name, got, expected in zip(MicroBatchSums._fields, sums, want):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10, msg=name)
    # Megatron's float loss mask: a masked-out position leaves every sum
    mask = valid.clone()
    mask[0, :4] = 0
    masked = micro_batch_sums(terms, mask)
    torch.testing.assert_close(masked.ce, (ce * mask).sum(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(masked.numbers, (positions.double() * mask).sum())


# ---------------------------------------------------------------------------------- 3. the global batch


def _reference(vocab, labels, logits, variant):
    """``sum CE / N + w sum NTL / K`` over the whole batch in float64, the naive way: value and gradient."""
    leaf = logits.clone().requires_grad_()
    ce, ntl, positions = naive_per_token(leaf, labels, vocab, **variant)
    valid = (labels != -100).double()
    value = (ce * valid).sum() / valid.sum() + WEIGHT * (ntl * valid).sum() / (positions.double() * valid).sum()
    return value.detach(), torch.autograd.grad(value, leaf)[0]


# (DP ranks, accumulation steps, micro-batches per accumulation step): 8 rows of the global batch
SPLITS = [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 4), (2, 2, 2)]


@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_global_normalisation_of_any_split_is_the_whole_batch_objective(variant):
    vocab, (labels, logits) = _vocab(), _batch()
    options = ntl_scale.NTLOptions(**variant)
    want_value, want_grad = _reference(vocab, labels, logits, variant)
    for dp, accumulation, micro in SPLITS:
        pieces = torch.chunk(torch.arange(labels.shape[0]), dp * accumulation * micro)
        ranks = [pieces[r::dp] for r in range(dp)]  # rank r: every dp-th micro-batch
        # the all-reduce over DP, written as the sum of every rank's step_counts
        counts = sum(step_counts([labels[p] for p in rank], vocab, options) for rank in ranks)
        leaf = logits.clone().requires_grad_()
        total = torch.zeros((), dtype=torch.float64)
        for rank in ranks:
            for p in rank:
                terms = ntl_scale.per_token_ce_ntl(leaf[p], labels[p], vocab, options)
                total = total + objective(micro_batch_sums(terms, labels[p] != -100), (counts[0], counts[1]), WEIGHT)
        grad = torch.autograd.grad(total, leaf)[0]
        split = f"dp {dp} x accumulation {accumulation} x {micro} micro-batches"
        torch.testing.assert_close(total.detach(), want_value, atol=1e-12, rtol=1e-10, msg=split)
        torch.testing.assert_close(grad, want_grad, atol=1e-12, rtol=1e-9, msg=split)
        # host floats (the DeepSpeed step reads the counts once) give the same objective
        host = sum(
            float(objective(micro_batch_sums(ntl_scale.per_token_ce_ntl(logits[p], labels[p], vocab, options),
                                             labels[p] != -100), (float(counts[0]), float(counts[1])), WEIGHT))
            for rank in ranks for p in rank
        )  # fmt: skip
        assert host == pytest.approx(float(want_value), rel=1e-12)


@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_micro_batch_normalisation_is_each_micro_batchs_own_mean(variant):
    vocab, (labels, logits) = _vocab(), _batch(rows=3, seed=3)  # row 2 has no numbers
    options = ntl_scale.NTLOptions(**variant)
    for rows in ([0, 1], [0], [1]):  # one micro-batch: its own mean is the objective of the whole batch
        want, _ = _reference(vocab, labels[rows], logits[rows], variant)
        terms = ntl_scale.per_token_ce_ntl(logits[rows], labels[rows], vocab, options)
        sums = micro_batch_sums(terms, labels[rows] != -100)
        torch.testing.assert_close(objective(sums, (sums.tokens, sums.numbers), WEIGHT), want, atol=1e-12, rtol=1e-10)
        ce, ntl = means(sums, (sums.tokens, sums.numbers))
        torch.testing.assert_close(ce + WEIGHT * ntl, want, atol=1e-12, rtol=1e-10)


def test_a_step_without_numbers_divides_by_one():
    vocab = _vocab()
    labels = torch.tensor([[25, 26, -100]])
    logits = torch.randn(1, 3, V, dtype=torch.float64)
    sums = micro_batch_sums(ntl_scale.per_token_ce_ntl(logits, labels, vocab), labels != -100)
    counts = step_counts([labels], vocab)
    assert counts.tolist() == [2.0, 0.0]
    value = objective(sums, (counts[0], counts[1]), WEIGHT)
    assert torch.isfinite(value) and float(sums.ntl) == 0.0
    torch.testing.assert_close(value, sums.ce / 2)


@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_a_rescale_and_the_per_token_factors_give_the_whole_batch_objective(variant):
    """A framework that divides by ``scale`` afterwards sees the float64 objective of the definitions, both
    from the sums (:func:`objective` with ``scale``) and per token (:func:`factors`), summed over micro-batches."""
    vocab, (labels, logits) = _vocab(), _batch(rows=4, seed=5)
    options = ntl_scale.NTLOptions(**variant)
    want, _ = _reference(vocab, labels, logits, variant)
    counts = step_counts([labels], vocab, options)
    scale = torch.tensor(6.0, dtype=torch.float64)  # e.g. DeepSpeed's ga x dp, Megatron's n x m x dp
    from_sums, from_factors, framework_divides = [], [], []
    for rows in ([0, 1], [2], [3]):
        terms = ntl_scale.per_token_ce_ntl(logits[rows], labels[rows], vocab, options)
        mask = labels[rows] != -100
        sums = micro_batch_sums(terms, mask)
        from_sums.append(objective(sums, (counts[0], counts[1]), WEIGHT, scale=scale) / scale)
        a, b = factors((counts[0], counts[1]), scale=scale)
        per_token = a * terms.ce + WEIGHT * b * terms.ntl * terms.number_mask
        from_factors.append((per_token * mask).sum() / scale)
        a, b = factors((counts[0], counts[1]))  # the framework divides the summed per-token loss by N itself
        framework_divides.append((a * terms.ce + WEIGHT * b * terms.ntl * terms.number_mask)[mask].sum() / counts[0])
    for parts in (from_sums, from_factors, framework_divides):
        torch.testing.assert_close(sum(parts), want, atol=1e-12, rtol=1e-10)


def test_weight_zero_is_the_ce_mean_bit_for_bit():
    vocab, (labels, logits) = _vocab(), _batch(rows=3, seed=6)
    terms = ntl_scale.per_token_ce_ntl(logits.float(), labels, vocab)
    sums = micro_batch_sums(terms, labels != -100)
    n = int((labels != -100).sum())
    want = torch.nn.functional.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), reduction="sum") / n
    assert torch.equal(objective(sums, (torch.tensor(float(n)), sums.numbers), 0.0), sums.ce / n)
    torch.testing.assert_close(objective(sums, (float(n), 1.0), 0.0), want)
    nan = sums._replace(ntl=torch.tensor(float("nan")))  # no "+ 0 * NTL": NTL off cannot reach the loss
    assert torch.isfinite(objective(nan, (float(n), 1.0), 0.0))


# ---------------------------------------------------------------------------------- 4. one all-reduce


def _two_ranks(ctx: WorkerContext, variant: dict) -> None:
    vocab, (labels, _) = _vocab(), _batch(rows=8, seed=4)
    options = ntl_scale.NTLOptions(**variant)
    mine = [labels[i : i + 2] for i in range(4 * ctx.rank, 4 * ctx.rank + 4, 2)]  # two micro-batches per rank
    calls = []
    real = dist.all_reduce

    def recording(tensor, *args, **kwargs):  # the real collective, counted
        calls.append(tensor.tolist())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        counts = step_counts(mine, vocab, options, group=ctx.dp_group)
    finally:
        dist.all_reduce = real
    assert len(calls) == 1 and len(calls[0]) == 2, calls  # tokens and NTL positions together, once
    assert counts.tolist() == _loop_counts(labels, variant["loss"])  # both ranks' micro-batches


@pytest.mark.parametrize("variant", [dict(loss="was"), dict(loss="number")], ids=_name)
def test_step_counts_sum_both_ranks_with_one_all_reduce(variant):
    run_workers(2, 1, _two_ranks, variant)
