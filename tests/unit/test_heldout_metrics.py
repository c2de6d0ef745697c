"""Held-out metrics of pretraining runs (ntl_scale/training/scoring.py: ``sequence_stats``,
``heldout_metrics``) against a plain float64 computation from full logits.

What the pretraining study reads: CE split by label kind (text labels, number-token labels), arg-max
accuracy on number tokens, and the absolute error of the expected value over the number tokens; per
sequence, the same for every NTL variant (the variant's own NTL positions are counted apart).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ntl_scale
from ntl_scale.training.scoring import HELDOUT_COLUMNS, heldout_metrics, sequence_stats

V = 40
DIGIT_IDS = {10 + d: d for d in range(10)}


def _vocab() -> ntl_scale.NumberVocab:
    return ntl_scale.NumberVocab.from_id_to_token({i: str(d) for i, d in DIGIT_IDS.items()}, vocab_size=V)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 17, V, generator=g) * 3
    labels = torch.randint(0, V, (3, 17), generator=g)
    digits = torch.randint(10, 20, (3, 17), generator=g)
    labels = torch.where(torch.rand(3, 17, generator=g) < 0.4, digits, labels)  # runs of digits
    labels[0, :3] = -100
    labels[2, 5] = -100
    if seed == 2:  # a sequence without any label
        labels[1] = -100
    return logits, labels


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> list[dict[str, float]]:
    """Per sequence: every sum the study uses, the obvious way in float64 (lists, no masks)."""
    out = []
    for row_logits, row_labels in zip(logits.double(), labels):
        sums = dict.fromkeys(("ce", "tokens", "number_tokens", "number_ce", "number_hits", "abs_error"), 0.0)
        for z, label in zip(row_logits, row_labels.tolist()):
            if label == -100:
                continue
            ce = float(-F.log_softmax(z, -1)[label])
            sums["ce"] += ce
            sums["tokens"] += 1
            if label in DIGIT_IDS:
                ids = sorted(DIGIT_IDS)
                p = F.softmax(z[ids], -1)
                expected = sum(float(p[k]) * DIGIT_IDS[i] for k, i in enumerate(ids))
                sums["number_tokens"] += 1
                sums["number_ce"] += ce
                sums["number_hits"] += float(int(z.argmax()) == label)
                sums["abs_error"] += abs(expected - DIGIT_IDS[label])
        out.append(sums)
    return out


def _stats(logits, labels, loss):
    vocab = _vocab()
    terms = ntl_scale.per_token_ce_ntl(logits, labels, vocab, ntl_scale.NTLOptions(loss=loss))
    mae = ntl_scale.per_token_ce_ntl(logits, labels, vocab, ntl_scale.NTLOptions(loss="mae"), need_ce=False).ntl
    return terms, sequence_stats(terms, labels, vocab, mae)


@pytest.mark.parametrize("loss", ["was", "mse", "mae", "huber", "number"])
def test_per_sequence_sums_equal_the_float64_reference(loss):
    logits, labels = _batch(0)
    terms, stats = _stats(logits, labels, loss)
    assert stats.dtype == torch.float64 and stats.shape == (3, len(HELDOUT_COLUMNS))
    for got, want in zip(stats.tolist(), _reference(logits, labels)):
        col = dict(zip(HELDOUT_COLUMNS, got))
        assert col["tokens"] == want["tokens"] and col["number_tokens"] == want["number_tokens"]
        assert col["number_hits"] == want["number_hits"]
        for key, ref in (("ce_sum", "ce"), ("number_ce_sum", "number_ce"), ("number_abs_error_sum", "abs_error")):
            assert col[key] == pytest.approx(want[ref], rel=1e-5, abs=1e-5), key
    # the variant's own positions: all number tokens, or first digits for the number-level loss
    positions = stats[:, HELDOUT_COLUMNS.index("ntl_positions")]
    numbers = stats[:, HELDOUT_COLUMNS.index("number_tokens")]
    assert torch.equal(positions, terms.number_mask.double().sum(-1))
    assert (positions < numbers).any() if loss == "number" else torch.equal(positions, numbers)


def test_metrics_of_summed_columns():
    logits, labels = _batch(1)
    _, stats = _stats(logits, labels, "was")
    metrics = heldout_metrics(stats.sum(0).tolist(), weight=0.3)
    ref = _reference(logits, labels)
    tokens = sum(r["tokens"] for r in ref)
    numbers = sum(r["number_tokens"] for r in ref)
    number_ce = sum(r["number_ce"] for r in ref)
    text_ce = (sum(r["ce"] for r in ref) - number_ce) / (tokens - numbers)
    assert metrics["tokens"] == tokens and metrics["number_tokens"] == numbers
    assert metrics["ppl"] == pytest.approx(math.exp(sum(r["ce"] for r in ref) / tokens), rel=1e-5)
    assert metrics["text_ppl"] == pytest.approx(math.exp(text_ce), rel=1e-5)
    assert metrics["number_token_ppl"] == pytest.approx(math.exp(number_ce / numbers), rel=1e-5)
    assert metrics["number_token_acc"] == pytest.approx(sum(r["number_hits"] for r in ref) / numbers)
    assert metrics["number_token_mae"] == pytest.approx(sum(r["abs_error"] for r in ref) / numbers, rel=1e-5)
    assert metrics["loss"] == pytest.approx(metrics["ce"] + 0.3 * metrics["ntl"])
    # without the expected value (the chunked loss), the MAE is left out rather than reported as 0
    assert "number_token_mae" not in heldout_metrics(stats.sum(0).tolist(), weight=0.3, with_abs_error=False)
    assert heldout_metrics([0.0] * len(HELDOUT_COLUMNS), weight=0.3) == {}


def test_a_label_kind_that_does_not_occur_has_no_metrics():
    logits, labels = _batch(2)
    assert (labels[1] == -100).all()
    _, stats = _stats(logits, labels, "was")
    assert stats[1].abs().sum() == 0  # the sequence without labels adds nothing
    text_only = torch.where(torch.isin(labels, torch.tensor(list(DIGIT_IDS))), torch.full_like(labels, 3), labels)
    _, stats = _stats(logits, text_only, "was")
    metrics = heldout_metrics(stats.sum(0).tolist(), weight=0.3)
    assert metrics["number_tokens"] == 0 and "text_ppl" in metrics
    assert not [k for k in metrics if k.startswith("number_token_")]  # not a perfect 0 error or ppl 1
