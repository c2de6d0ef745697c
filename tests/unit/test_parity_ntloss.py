"""Parity with the reference package ``ntloss`` (float64, 1e-10 relative, loss and gradient).

Sections:
1. Tables: our digit-level / multi-digit tables select the same ids as ntloss on each tokenizer.
2. Losses: every option both packages have (WAS with and without squash factor, MSE/MAE/Huber,
   number-level with and without float_level, reweigh on and off, loss weights, all reductions),
   on random labels and on labels of real tokenized text, over several tokenizer layouts.
3. ``predict_numbers``: the expected number value and number-token mass per position.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import ntl_scale
from tests.helpers import tokenizers as tk
from tests.helpers.data import random_labels, random_logits, text_labels

ntloss = pytest.importorskip("ntloss")

RTOL = 1e-10
LAYOUTS = {
    "t5_sentencepiece": (tk.t5_fast, True),
    "byte_level_bpe": (tk.byte_level_bpe, True),
    "wordpiece": (tk.wordpiece_fast, True),
    "llama3_multi_digit": (tk.llama3_style_bpe, False),
}


def _huber(pred, target, reduction="mean"):
    # ntloss passes float32 targets next to float64 predictions; F.huber_loss does not promote.
    return F.huber_loss(pred, target.to(pred.dtype), reduction=reduction, delta=1.0)


def _reference(kind: str, tokenizer, digit_level: bool, reweigh: bool, squash=None, float_level=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "was":
            return ntloss.NTLoss(tokenizer, digit_level=digit_level, reweigh=reweigh, squash_factor=squash)
        if kind == "number":
            return ntloss.NumberLevelLoss(tokenizer, reweigh=reweigh, float_level=float_level)
        fn = {"mse": F.mse_loss, "mae": F.l1_loss, "huber": _huber}[kind]
        return ntloss.NTLossDotProduct(tokenizer, digit_level=digit_level, reweigh=reweigh, loss_function=fn)


def _break_long_numbers(labels: torch.Tensor, vocab, max_digits: int = 7) -> torch.Tensor:
    """Ignores every 8th digit of a run: ntloss sums number targets in float32, exact only below 2**24."""
    labels = labels.clone()
    is_digit = torch.isin(labels, vocab.ids)
    is_dot = labels == vocab.decimal_point_id  # with float_level a dot continues a number
    for row in range(labels.shape[0]):
        run = 0
        for col in range(labels.shape[1]):
            run = run + int(is_digit[row, col]) if is_digit[row, col] or is_dot[row, col] else 0
            if run > max_digits:
                labels[row, col] = -100
                run = 0
    return labels


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tables_match_reference(layout):
    build, digit_level = LAYOUTS[layout]
    tokenizer = build()
    ours = ntl_scale.NumberVocab.from_tokenizer(tokenizer, digit_level=digit_level)
    ref = _reference("was", tokenizer, digit_level, reweigh=False)
    assert torch.equal(ours.ids, ref.number_token_ids)
    assert torch.equal(ours.values, ref.number_values_dense)
    assert len(tokenizer) == ours.vocab_size  # neither package grew the tokenizer (digits were present)


CASES = [
    ("was", None, False),
    ("was", 3.0, False),
    ("was", 9.0, True),
    ("mse", None, False),
    ("mae", None, False),
    ("huber", None, False),
    ("mse", None, True),
    ("number", None, False),
    ("number", None, True),
    ("number-float", None, False),
    ("number-float", None, True),
]


@pytest.mark.parametrize(
    "layout,kind,squash,reweigh",
    # number-level NTL is digit-level by definition: no multi-digit layout for it
    [(lay, *case) for lay in sorted(LAYOUTS) for case in CASES if LAYOUTS[lay][1] or not case[0].startswith("number")],
)
@pytest.mark.parametrize("labels_from", ["random", "text"])
def test_loss_and_gradient_match_reference(layout, kind, squash, reweigh, labels_from):
    build, digit_level = LAYOUTS[layout]
    tokenizer = build()
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer, digit_level=digit_level)
    float_level = kind == "number-float"
    loss = "number" if float_level else kind
    ref = _reference(loss, tokenizer, digit_level, reweigh, squash, float_level)
    size = vocab.vocab_size
    if labels_from == "text":
        labels = text_labels(tokenizer, rows=3, seq=48, seed=len(layout))
        if loss == "number":
            labels = _break_long_numbers(labels, vocab)
    else:
        labels = random_labels(vocab, (3, 24), size, seed=7)
    logits = random_logits((*labels.shape, size), seed=11)
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for reduction in ("mean", "sum", "none"):
        for loss_weights in (None, weights):
            ours_in = logits.clone().requires_grad_()
            ref_in = logits.clone().requires_grad_()
            got = ntl_scale.number_token_loss(
                ours_in,
                labels,
                vocab,
                loss=loss,
                squash_factor=squash,
                reweigh=reweigh,
                float_level=float_level,
                loss_weights=loss_weights,
                reduction=reduction,
            )
            want = ref(ref_in, labels, loss_weights=loss_weights, reduction=reduction)
            assert got.shape == want.shape
            assert float(want.detach().abs().max()) > 0, "the case must exercise a nonzero loss"
            assert _rel(got, want) < RTOL, f"{reduction} weights={loss_weights is not None}"
            upstream = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
            (got * upstream).sum().backward()
            (want * upstream).sum().backward()
            assert _rel(ours_in.grad, ref_in.grad) < RTOL, f"grad {reduction} weights={loss_weights is not None}"


def test_float_level_changes_the_result():
    """Guards the number-level parity above: the text labels really contain d.d, so float_level matters."""
    tokenizer = tk.t5_fast()
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer)
    labels = text_labels(tokenizer, rows=3, seq=48)
    logits = random_logits((*labels.shape, vocab.vocab_size), seed=1)
    a = ntl_scale.number_token_loss(logits, labels, vocab, loss="number")
    b = ntl_scale.number_token_loss(logits, labels, vocab, loss="number", float_level=True)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_predict_numbers_matches_reference(layout):
    """predict_numbers: the expected value and number-token mass of ntloss's predict_numbers (float64)."""
    build, digit_level = LAYOUTS[layout]
    tokenizer = build()
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer, digit_level=digit_level)
    logits = random_logits((2, 9, vocab.vocab_size), seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = ntloss.NTLossDotProduct(tokenizer, digit_level=digit_level, reweigh=False)
    want_value, want_mass = reference.predict_numbers(logits)
    got = ntl_scale.predict_numbers(logits, vocab)
    assert _rel(got.value, want_value) < RTOL and _rel(got.mass, want_mass) < RTOL
