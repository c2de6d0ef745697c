"""Bad input to the losses: each raises a ValueError/TypeError that names the value and the fix."""

from __future__ import annotations

import pytest
import torch

import ntl_scale

VOCAB = ntl_scale.NumberVocab.from_id_to_token(["a", "b", "."] + [str(d) for d in range(10)], vocab_size=16)
LABELS = torch.tensor([[3, 4, 0, -100]])
LOGITS = torch.zeros(1, 4, 16)


def _call(**overrides):
    kwargs = dict(logits=LOGITS, labels=LABELS, vocab=VOCAB)
    kwargs.update(overrides)
    return ntl_scale.ce_with_ntl(kwargs.pop("logits"), kwargs.pop("labels"), kwargs.pop("vocab"), **kwargs)


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(logits=torch.zeros(1, 4, 16, dtype=torch.long)), TypeError, "floating-point tensor.*int64"),
        (dict(logits=[[0.0] * 16]), TypeError, "floating-point tensor.*list"),
        (dict(labels=LABELS.float()), TypeError, "integer tensor of token ids.*float32"),
        (dict(labels=LABELS.bool()), TypeError, "integer tensor of token ids.*bool"),
        (dict(logits=torch.zeros(16)), ValueError, r"at least 2 dims, got \(16,\)"),
        (dict(labels=LABELS[:, :3]), ValueError, r"labels shape \(1, 3\) must equal .* \(1, 4\)"),
        (dict(logits=torch.zeros(1, 4, 12)), ValueError, "vocabulary of 12 .* smaller than the number-token id 12"),
        (dict(labels=torch.tensor([[3, 16, 0, 1]])), ValueError, r"label id 16 is outside \[0, 16\)"),
        (dict(labels=torch.tensor([[3, -1, 0, 1]])), ValueError, r"label id -1 is outside .*ignore_index=-100"),
        (dict(loss_weights=torch.ones(1, 3)), ValueError, r"loss_weights shape \(1, 3\) must equal"),
        (dict(loss_weights=-torch.ones(1, 4)), ValueError, r"finite and >= 0, found -1.0"),
        (dict(loss_weights=torch.full((1, 4), float("nan"))), ValueError, "finite and >= 0, found nan"),
        (dict(loss_weights=[1, 1, 1, 1]), TypeError, "loss_weights must be a tensor"),
        (dict(loss="wasserstein"), ValueError, r"unknown NTL loss 'wasserstein'; expected one of \('was'"),
        (dict(reduction="avg"), ValueError, r"unknown reduction 'avg'; expected one of \('mean'"),
        (dict(squash_factor=1.0), ValueError, "squash_factor must be > 1"),
        (dict(squash_factor=3.0, loss="mse"), ValueError, "squash_factor applies to loss='was' only"),
        (dict(float_level=True), ValueError, "float_level applies to loss='number' only"),
        (dict(huber_delta=0.0, loss="huber"), ValueError, "huber_delta must be a number > 0"),
        (dict(ntl_weight=-0.3), ValueError, "ntl_weight must be a number >= 0, got -0.3"),
        (dict(vocab={"3": 3}), TypeError, "vocab must be an ntl_scale.NumberVocab"),
        (dict(logits=torch.zeros(1, 4, 16, dtype=torch.bfloat16), inplace=True), ValueError, "inplace=True .*bfloat16"),
    ],
)
def test_bad_input_is_reported(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)


def test_float_level_needs_a_decimal_point():
    vocab = ntl_scale.NumberVocab.from_id_to_token(["a"] + [str(d) for d in range(10)])
    with pytest.raises(ValueError, match="decimal_point_id"):
        ntl_scale.number_token_loss(
            torch.zeros(1, 2, 11), torch.tensor([[1, 2]]), vocab, loss="number", float_level=True
        )


def test_module_validates_at_construction():
    with pytest.raises(ValueError, match="unknown reduction"):
        ntl_scale.NumberTokenLoss(VOCAB, reduction="avg")
    with pytest.raises(ValueError, match="unknown NTL loss"):
        ntl_scale.CEWithNTL(VOCAB, loss="l2")
