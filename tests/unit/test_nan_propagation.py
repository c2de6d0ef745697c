"""NTL is NaN when its inputs are (issue 23, defect 6), on the logits path and the chunked path.

A NaN in a number-token column used to leave the returned ``ntl`` finite (the number statistics of
that position were read as "no number tokens", NTL 0 there) and all-NaN logits gave ``ntl = 0``, so
the logged NTL hid a fault that made the total loss NaN. Without ``check_finite`` (the default: no
host sync) the NaN must reach NTL arithmetically. Sections:
1. Logits path (``ce_with_ntl``, ``number_token_loss``, ``vocab_parallel_ce_ntl``): a NaN or +inf in a
   number-token column at a number label, and all-NaN logits, give a NaN NTL for every variant; the
   per-token NTL is NaN at that position.
2. What must stay finite: a NaN in a number column at a position whose label is not a number (NTL
   does not read that position's logits unless it reweighs); number logits at -inf (no number
   token possible) still give 0 there.
3. Chunked path (``linear_ce_with_ntl``, ``linear_ce_ntl``): a NaN in a number token's weight row or
   in the hidden states gives a NaN NTL, with and without the vocabulary pass.
"""

from __future__ import annotations

import math

import pytest
import torch

import ntl_scale
from tests.helpers.data import random_logits
from tests.unit.test_losses import VARIANTS, _labels_with_runs, _vocab

IDS = lambda v: "-".join(f"{k}={x}" for k, x in v.items())  # noqa: E731


def _number_position(vocab, labels):
    """(row, col) of the first label that is a number token, and that token's id."""
    row, col = (int(i) for i in torch.nonzero(vocab.number_mask(labels))[0])
    return row, col, int(labels[row, col])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_a_bad_number_logit_makes_ntl_nan(variant, bad):
    vocab = _vocab()
    labels = _labels_with_runs(vocab)
    logits = random_logits((*labels.shape, 64), seed=3)
    row, col, _ = _number_position(vocab, labels)
    logits[row, col, int(vocab.ids[4])] = bad  # one number-token column at one number label
    out = ntl_scale.ce_with_ntl(logits, labels, vocab, **variant)
    assert math.isnan(float(out.ntl)), f"ntl {float(out.ntl)} is finite"
    assert not torch.isfinite(out.loss)
    assert math.isnan(float(ntl_scale.number_token_loss(logits, labels, vocab, **variant)))
    _, ntl, mask = ntl_scale.vocab_parallel_ce_ntl(logits, labels, vocab, **variant)
    assert torch.isnan(ntl[mask]).any()
    if variant.get("loss") != "number":  # number-level charges the number at its first digit
        assert torch.isnan(ntl[row, col])


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_all_nan_logits_make_ntl_nan(variant):
    vocab = _vocab()
    labels = _labels_with_runs(vocab)
    logits = torch.full((*labels.shape, 64), float("nan"))
    out = ntl_scale.ce_with_ntl(logits, labels, vocab, **variant)
    assert math.isnan(float(out.ntl)) and math.isnan(float(out.ce))
    assert math.isnan(float(ntl_scale.number_token_loss(logits, labels, vocab, **variant)))


@pytest.mark.parametrize("variant", [v for v in VARIANTS if not v.get("reweigh")], ids=IDS)
def test_what_ntl_does_not_read_stays_finite(variant):
    vocab = _vocab()
    labels = _labels_with_runs(vocab)
    logits = random_logits((*labels.shape, 64), seed=4)
    clean = ntl_scale.number_token_loss(logits, labels, vocab, **variant)
    not_number = torch.nonzero(~vocab.number_mask(labels) & (labels != -100))[0]
    logits[not_number[0], not_number[1], int(vocab.ids[2])] = float("nan")
    assert torch.equal(ntl_scale.number_token_loss(logits, labels, vocab, **variant), clean)
    # every number logit -inf at a number label: no number token is possible there, NTL 0 (not NaN)
    row, col, _ = _number_position(vocab, labels)
    logits[row, col, vocab.ids] = float("-inf")
    _, ntl, _ = ntl_scale.vocab_parallel_ce_ntl(logits, labels, vocab, **variant)
    assert torch.isfinite(ntl).all()


@pytest.mark.parametrize("need_ce", [True, False], ids=["with_ce", "ntl_only"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_chunked_path_propagates_nan(variant, need_ce):
    vocab = _vocab()
    labels = _labels_with_runs(vocab)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(*labels.shape, 8, generator=g)
    weight = torch.randn(64, 8, generator=g)
    options = ntl_scale.NTLOptions(**variant)
    bad_row = weight.clone()
    bad_row[int(vocab.ids[4]), 3] = float("nan")  # a number token's output row: every number logit NaN
    bad_hidden = hidden.clone()
    row, col, _ = _number_position(vocab, labels)
    bad_hidden[row, col, 0] = float("nan")  # one position's hidden state
    for h, w, what in ((hidden, bad_row, "weight row"), (bad_hidden, weight, "hidden state")):
        terms = ntl_scale.linear_ce_ntl(h, w, labels, vocab, options, need_ce=need_ce, chunk_tokens=7)
        assert torch.isnan(terms.ntl[terms.number_mask]).any(), f"NaN {what}: per-token NTL finite"
        if need_ce:
            out = ntl_scale.linear_ce_with_ntl(h, w, labels, vocab, chunk_tokens=7, **variant)
            assert math.isnan(float(out.ntl)), f"NaN {what}: ntl {float(out.ntl)} is finite"
