"""Losses on full logits against the naive float64 reference in ``tests/helpers/reference.py``.

Sections:
1. Per-token CE / NTL / mask of every variant, fp64 (1e-12), fp32, bf16 and fp16 logits (math in fp32),
   forward and backward, with arbitrary upstream gradients.
2. CE agrees with ``torch.nn.functional.cross_entropy``; ``ce_with_ntl`` and the modules agree with
   the functional forms.
3. float64 ``gradcheck`` of every variant.
4. Edge cases: no number labels, every label ignored, padded vocabulary, leading dims, chunking,
   the in-place variant, a no-grad call, NaN/Inf logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ntl_scale
from tests.helpers.data import random_labels, random_logits
from tests.helpers.reference import naive_per_token, naive_reduce

VARIANTS = [
    dict(loss="was"),
    dict(loss="was", squash_factor=4.0),
    dict(loss="was", reweigh=True),
    dict(loss="mse"),
    dict(loss="mae"),
    dict(loss="huber", huber_delta=0.7),
    dict(loss="huber", reweigh=True),
    dict(loss="number"),
    dict(loss="number", float_level=True),
    dict(loss="number", reweigh=True),
]
# (dtype, atol, rtol) together, compared against the float64 reference of the same (rounded) logits.
DTYPES = [
    (torch.float64, 1e-12, 1e-12),
    (torch.float32, 1e-5, 1e-5),
    (torch.bfloat16, 1e-5, 1e-4),
    (torch.float16, 1e-5, 1e-4),
]


def _vocab() -> ntl_scale.NumberVocab:
    # Digits at scattered ids, a decimal point, words; padded model vocab (tokenizer 40, model 64).
    tokens = [f"w{i}" for i in range(40)]
    for value, position in zip(range(10), [3, 7, 8, 15, 21, 22, 30, 31, 36, 39]):
        tokens[position] = str(value)
    tokens[5] = "."
    return ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=64)


def _labels_with_runs(vocab, rows=4, seq=20, seed=0):
    """Random labels plus explicit digit runs and d.d patterns so number-level has work to do."""
    labels = random_labels(vocab, (rows, seq), 40, seed=seed, number_fraction=0.5)
    digits = vocab.ids.tolist()
    labels[0, 2:6] = torch.tensor([digits[1], digits[2], digits[3], digits[0]])
    labels[1, 4:9] = torch.tensor([digits[4], digits[5], vocab.decimal_point_id, digits[6], digits[7]])
    return labels


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES, ids=lambda x: str(x).replace("torch.", ""))
def test_per_token_matches_naive_reference(variant, dtype, atol, rtol):
    vocab = _vocab()
    labels = _labels_with_runs(vocab)
    logits = random_logits((*labels.shape, 64), seed=1, dtype=dtype).requires_grad_()
    ce, ntl, mask = ntl_scale.vocab_parallel_ce_ntl(logits, labels, vocab, **variant)
    reference_in = logits.detach().to(torch.float64).requires_grad_()
    ce_ref, ntl_ref, mask_ref = naive_per_token(reference_in, labels, vocab, **variant)
    assert ce.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(mask, mask_ref)
    assert mask.any() and (~mask).any()
    torch.testing.assert_close(ce.double(), ce_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(ntl.double(), ntl_ref, atol=atol, rtol=rtol)
    g = torch.Generator().manual_seed(2)
    g_ce, g_ntl = torch.randn(ce.shape, generator=g), torch.randn(ntl.shape, generator=g)
    (ce * g_ce.to(ce.dtype) + ntl * g_ntl.to(ntl.dtype)).sum().backward()
    (ce_ref * g_ce.double() + ntl_ref * g_ntl.double()).sum().backward()
    assert logits.grad.dtype == dtype
    grad_tol = max(atol, {torch.bfloat16: 1e-2, torch.float16: 2e-3}.get(dtype, atol))
    torch.testing.assert_close(logits.grad.double(), reference_in.grad, atol=grad_tol, rtol=grad_tol)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ce_matches_torch_cross_entropy(reduction):
    vocab = _vocab()
    labels = random_labels(vocab, (5, 13), 64, seed=4)
    logits = random_logits((5, 13, 64), seed=4).requires_grad_()
    reference_in = logits.detach().clone().requires_grad_()
    out = ntl_scale.ce_with_ntl(logits, labels, vocab, ntl_weight=0.0, reduction=reduction)
    want = F.cross_entropy(reference_in.transpose(1, 2), labels, reduction=reduction)
    torch.testing.assert_close(out.ce, want, atol=1e-12, rtol=1e-12)
    (out.loss * 1.3).sum().backward()
    (want * 1.3).sum().backward()
    torch.testing.assert_close(logits.grad, reference_in.grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_ce_with_ntl_reduces_both_terms(reduction, weighted):
    vocab = _vocab()
    labels = _labels_with_runs(vocab, seed=3)
    logits = random_logits((*labels.shape, 64), seed=3)
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights = weights if weighted else None
    out = ntl_scale.ce_with_ntl(
        logits, labels, vocab, ntl_weight=0.3, loss="mse", reweigh=True, loss_weights=weights, reduction=reduction
    )
    ce_ref, ntl_ref, mask = naive_per_token(logits, labels, vocab, loss="mse", reweigh=True)
    want_ce = naive_reduce(ce_ref, labels != -100, weights, reduction)
    want_ntl = naive_reduce(ntl_ref, mask, weights, reduction)
    torch.testing.assert_close(out.ce, want_ce, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out.ntl, want_ntl, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out.loss, want_ce + 0.3 * want_ntl, atol=1e-12, rtol=1e-12)
    expect_count = (mask.double() if weights is None else torch.where(mask, weights, 0.0)).sum()
    torch.testing.assert_close(out.num_number_tokens, expect_count)


def test_modules_equal_functions():
    vocab = _vocab()
    labels = _labels_with_runs(vocab, seed=5)
    logits = random_logits((*labels.shape, 64), seed=5)
    module = ntl_scale.NumberTokenLoss(vocab, loss="huber", huber_delta=0.5, reduction="sum")
    fn = ntl_scale.number_token_loss(logits, labels, vocab, loss="huber", huber_delta=0.5, reduction="sum")
    assert torch.equal(module(logits, labels), fn)
    both = ntl_scale.CEWithNTL(vocab, ntl_weight=0.5, loss="number")(logits, labels)
    direct = ntl_scale.ce_with_ntl(logits, labels, vocab, ntl_weight=0.5, loss="number")
    assert all(torch.equal(a, b) for a, b in zip(both, direct))
    assert "huber" in repr(module)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_gradcheck(variant):
    vocab = _vocab()
    labels = _labels_with_runs(vocab, rows=2, seq=10, seed=6)
    logits = random_logits((*labels.shape, 64), seed=6, scale=1.0).requires_grad_()

    def both_terms(x):
        ce, ntl, _ = ntl_scale.vocab_parallel_ce_ntl(x, labels, vocab, **variant)
        return ce, ntl

    assert torch.autograd.gradcheck(both_terms, (logits,), atol=1e-8, rtol=1e-6, fast_mode=True)

    def ntl_only(x):
        return ntl_scale.number_token_loss(x, labels, vocab, reduction="mean", **variant)

    # Central differences of a loss of size ~10 carry ~1e-9 rounding noise at eps=1e-6.
    assert torch.autograd.gradcheck(ntl_only, (logits,), atol=1e-7, rtol=1e-6, fast_mode=True)


@pytest.mark.parametrize("loss", ntl_scale.LOSS_KINDS)
@pytest.mark.parametrize("reweigh", [False, True])
def test_no_number_labels_give_exact_zero_and_zero_gradient(loss, reweigh):
    vocab = _vocab()
    labels = torch.tensor([[0, 1, 2, 4, -100], [-100, -100, 6, 9, 10]])  # words and ignored only
    logits = random_logits((2, 5, 64), seed=8, dtype=torch.float32).requires_grad_()
    for reduction in ("mean", "sum"):
        value = ntl_scale.number_token_loss(logits, labels, vocab, loss=loss, reweigh=reweigh, reduction=reduction)
        value.backward()
        assert value.item() == 0.0 and torch.isfinite(value)
        assert torch.count_nonzero(logits.grad) == 0
        logits.grad = None


@pytest.mark.parametrize("loss", ntl_scale.LOSS_KINDS)
def test_every_label_ignored_gives_zero_not_nan(loss):
    vocab = _vocab()
    labels = torch.full((3, 4), -100)
    logits = random_logits((3, 4, 64), seed=9, dtype=torch.bfloat16).requires_grad_()
    out = ntl_scale.ce_with_ntl(logits, labels, vocab, loss=loss)
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.ce.item() == 0.0 and out.ntl.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0


def test_zero_loss_weights_give_zero():
    vocab = _vocab()
    labels = _labels_with_runs(vocab)
    logits = random_logits((*labels.shape, 64), seed=2).requires_grad_()
    value = ntl_scale.number_token_loss(logits, labels, vocab, loss_weights=torch.zeros(labels.shape))
    value.backward()
    assert value.item() == 0.0 and torch.count_nonzero(logits.grad) == 0


def test_padded_vocabulary_and_wider_logits():
    vocab = _vocab()  # tokenizer of 40 tokens, table for a model of 64
    labels = _labels_with_runs(vocab)
    logits = random_logits((*labels.shape, 64), seed=3)
    base = ntl_scale.ce_with_ntl(logits, labels, vocab)
    # Megatron pads further (multiple of 128): extra columns at -inf leave every term unchanged.
    wide = torch.cat([logits, torch.full((*labels.shape, 64), float("-inf"), dtype=logits.dtype)], dim=-1)
    padded = ntl_scale.ce_with_ntl(wide, labels, vocab.with_vocab_size(ntl_scale.pad_vocab_size(64)))
    assert all(torch.equal(a, b) for a, b in zip(base, padded))


def test_leading_dims_and_chunking_do_not_change_results():
    vocab = _vocab()
    labels = _labels_with_runs(vocab, rows=6, seq=10)
    logits = random_logits((*labels.shape, 64), seed=4).requires_grad_()
    ce, ntl, mask = ntl_scale.vocab_parallel_ce_ntl(logits, labels, vocab, loss="was", reweigh=True)
    (ce.sum() + ntl.sum()).backward()
    flat = logits.detach().reshape(60, 64).requires_grad_()
    ce2, ntl2, mask2 = ntl_scale.vocab_parallel_ce_ntl(
        flat, labels.reshape(60), vocab, loss="was", reweigh=True, chunk_tokens=7
    )
    (ce2.sum() + ntl2.sum()).backward()
    torch.testing.assert_close(ce2.view(6, 10), ce, atol=1e-13, rtol=0)
    torch.testing.assert_close(ntl2.view(6, 10), ntl, atol=1e-13, rtol=0)
    torch.testing.assert_close(flat.grad.view(6, 10, 64), logits.grad, atol=1e-13, rtol=0)
    assert torch.equal(mask2.view(6, 10), mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inplace_variant_matches_and_reuses_the_buffer(dtype):
    vocab = _vocab()
    labels = _labels_with_runs(vocab)
    source = random_logits((*labels.shape, 64), seed=5, dtype=dtype)
    a = source.clone().requires_grad_()
    b = source.clone().requires_grad_()
    out_a = ntl_scale.ce_with_ntl(a * 1.0, labels, vocab, loss="mae", reweigh=True)
    hidden = b * 1.0  # the "logits buffer" of an output layer
    out_b = ntl_scale.ce_with_ntl(hidden, labels, vocab, loss="mae", reweigh=True, inplace=True)
    assert not torch.equal(hidden.detach(), source)  # the buffer was reused
    out_a.loss.backward()
    out_b.loss.backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(out_b.loss, out_a.loss, atol=tol, rtol=tol)
    torch.testing.assert_close(b.grad, a.grad, atol=tol, rtol=tol)


def test_no_grad_call():
    vocab = _vocab()
    labels = _labels_with_runs(vocab)
    logits = random_logits((*labels.shape, 64), seed=6)
    with torch.no_grad():
        out = ntl_scale.ce_with_ntl(logits, labels, vocab)
    assert not out.loss.requires_grad and torch.isfinite(out.loss)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["number_position", "ignored_position"])
def test_non_finite_logits_are_reported(bad, where):
    vocab = _vocab()
    labels = _labels_with_runs(vocab)
    labels[2, 3] = -100
    logits = random_logits((*labels.shape, 64), seed=7)
    row, col = (0, 2) if where == "number_position" else (2, 3)
    logits[row, col, 0] = bad  # a non-number column: NTL alone would never see it
    with pytest.raises(ValueError, match="NaN or Inf"):
        ntl_scale.ce_with_ntl(logits, labels, vocab, check_finite=True)
    with pytest.raises(ValueError, match="NaN or Inf"):
        ntl_scale.number_token_loss(logits, labels, vocab, reweigh=True, check_finite=True)
    unchecked = ntl_scale.ce_with_ntl(logits, labels, vocab)  # the default: NaN reaches the loss, no host sync
    if where == "number_position":
        assert not torch.isfinite(unchecked.loss)


def test_number_accuracy_is_the_argmax_hit_rate_where_ntl_is_charged():
    """One definition (issue 23): the hit rate over the positions NTL divides by, as the training loops log it:
    every number label for token-level NTL, the first digit of each number for loss="number"."""
    vocab = _vocab()
    labels = _labels_with_runs(vocab, seed=7)
    logits = random_logits((*labels.shape, 64), seed=7)
    is_number = torch.isin(labels, vocab.ids)
    rows = is_number.nonzero()[::2]
    logits[rows[:, 0], rows[:, 1], labels[rows[:, 0], rows[:, 1]]] = 20.0  # every second number label wins
    first_digit = is_number.clone()
    first_digit[:, 1:] &= ~is_number[:, :-1]  # written out here, independently of ntl_positions
    hit = logits.argmax(-1) == labels
    for loss, where in (("was", is_number), ("number", first_digit)):
        out = ntl_scale.ce_with_ntl(logits, labels, vocab, loss=loss)
        want = hit[where].double().mean()
        torch.testing.assert_close(out.number_accuracy, want)
        torch.testing.assert_close(out.num_number_tokens, where.sum().to(out.num_number_tokens.dtype))
        assert 0 < float(want) < 1
