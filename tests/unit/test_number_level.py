"""Number-level NTL (``loss="number"``): which tables it reads, and float64 numbers (issue 23).

Sections:
1. Tables that are not the single digits 0-9 (multi-digit, signed, fractional, prefixed tokens) are
   refused with a ValueError naming the fix: from the Megatron flags and the train config at config
   time, and from every direct entry (functional, chunked, Hugging Face loss).
2. Numbers are assembled in float64 whatever the logits' dtype: 123456789 is exact with fp32 and bf16
   logits, and a prediction one unit off is charged, as the float64 reference charges it.
"""

from __future__ import annotations

import argparse

import pytest
import torch

import ntl_scale
from ntl_scale.integrations import megatron as ntl_megatron
from ntl_scale.terms import assemble_numbers
from tests.helpers.reference import naive_per_token

V = 64


def _llama3_like() -> ntl_scale.NumberVocab:
    """Numbers of up to three digits as single tokens, as Llama 3 splits them."""
    tokens = {i: f"w{i}" for i in range(V - 8)}
    tokens.update({40: "123", 41: "45", 42: "12", 43: "345", 44: "7", 45: "-3", 46: "0.5"})
    return ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=V, digit_level=False)


def _digits() -> ntl_scale.NumberVocab:
    return ntl_scale.NumberVocab.from_id_to_token({10 + d: str(d) for d in range(10)}, vocab_size=V)


# ---------------------------------------------------------------------------------- 1. tables


BAD_TABLES = {
    "multi-digit": _llama3_like,
    "prefixed": lambda: ntl_scale.NumberVocab.from_id_to_token(
        {10 + d: f"▁{d}" for d in range(10)}, vocab_size=V, prefixed=True
    ),
    "duplicate digit": lambda: ntl_scale.NumberVocab([10, 11, 12], [1.0, 2.0, 1.0], V),
    "fraction": lambda: ntl_scale.NumberVocab([10, 11], [1.0, 2.5], V),
}


@pytest.mark.parametrize("table", sorted(BAD_TABLES))
def test_direct_calls_refuse_a_table_of_other_tokens(table):
    vocab = BAD_TABLES[table]()
    labels = vocab.ids[:2].unsqueeze(0)
    logits = torch.randn(1, 2, V)
    match = r"digit_level=True"
    with pytest.raises(ValueError, match=match):
        ntl_scale.number_token_loss(logits, labels, vocab, loss="number")
    with pytest.raises(ValueError, match=match):
        ntl_scale.ce_with_ntl(logits, labels, vocab, loss="number")
    with pytest.raises(ValueError, match=match):
        ntl_scale.linear_ce_with_ntl(torch.randn(1, 2, 8), torch.randn(V, 8), labels, vocab, loss="number")
    with pytest.raises(ValueError, match=match):
        ntl_scale.ntl_positions(labels, vocab, ntl_scale.NTLOptions(loss="number"))
    from ntl_scale.integrations.hf import NTLCausalLMLoss

    with pytest.raises(ValueError, match=match):
        NTLCausalLMLoss(vocab, 0.3, ntl_scale.NTLOptions(loss="number"))
    ntl_scale.ce_with_ntl(logits, labels, vocab, loss="was")  # token-level NTL reads any table


def test_the_review_case_is_refused_not_assembled_as_1275():
    vocab = _llama3_like()
    labels = torch.tensor([[40, 41]])  # '123', '45': 12345
    with pytest.raises(ValueError, match=r"'123' \(value 123\) is not a single digit"):
        ntl_scale.number_token_loss(torch.randn(1, 2, V), labels, vocab, loss="number")


def test_a_digit_table_is_accepted_also_with_fewer_digits():
    ntl_scale.check_number_level_table(_digits())
    ntl_scale.check_number_level_table(ntl_scale.NumberVocab([10, 11, 12], [0.0, 1.0, 2.0], V))


def test_megatron_flags_refuse_multi_digit_number_level_at_config_time():
    parser = ntl_megatron.add_ntl_args(argparse.ArgumentParser(exit_on_error=False))
    args = parser.parse_args(["--ntl-weight", "0.3", "--ntl-number-vocab", "multi-digit", "--ntl-loss", "number"])
    with pytest.raises(ValueError, match="--ntl-number-vocab digits"):
        ntl_megatron.NTLSettings.from_args(args)


def test_megatron_refuses_a_saved_table_of_other_tokens_when_building_it(tmp_path):
    path = tmp_path / "table.json"
    _llama3_like().save(path)
    settings = ntl_megatron.NTLSettings(weight=0.3, loss="number", number_vocab=str(path))
    with pytest.raises(ValueError, match="digit_level=True"):
        ntl_megatron.build_number_vocab(settings, None, V)
    was = ntl_megatron.NTLSettings(weight=0.3, loss="was", squash_factor=9.0, number_vocab=str(path))
    assert len(ntl_megatron.build_number_vocab(was, None, V)) == 7


def test_train_config_refuses_number_level_with_the_multi_digit_table(tmp_path):
    from ntl_scale.training.config import NTLConfig, load_config

    with pytest.raises(ValueError, match=r"ntl\.digit_level=true"):
        NTLConfig(loss="number", digit_level=False)
    path = tmp_path / "run.yaml"
    path.write_text("ntl:\n  loss: number\n  digit_level: false\n")
    with pytest.raises(ValueError, match=r"ntl\.digit_level=true"):
        load_config(str(path))


# ---------------------------------------------------------------------------------- 2. float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_targets_are_exact_in_float64_whatever_the_logits_dtype(dtype):
    digits = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]], dtype=dtype)
    is_digit = torch.ones_like(digits, dtype=torch.bool)
    pred, target, starts = assemble_numbers(digits, digits, is_digit)
    assert target.dtype == pred.dtype == torch.float64
    assert float(target[0, 0]) == 123456789.0 and float(pred[0, 0]) == 123456789.0
    assert starts.tolist() == [[True] + [False] * 8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prediction_one_unit_off_is_charged_as_the_float64_reference_does(dtype):
    vocab = _digits()
    target = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    predicted = [1, 2, 3, 4, 5, 6, 7, 8, 8]  # 123456788: fp32 rounds both numbers to 123456792
    labels = torch.tensor([[10 + d for d in target]])
    logits = torch.full((1, 9, V), -30.0)
    logits[0, torch.arange(9), torch.tensor([10 + d for d in predicted])] = 30.0
    logits = logits.to(dtype)
    ntl = ntl_scale.number_token_loss(logits, labels, vocab, loss="number", reduction="none")
    assert ntl.dtype == torch.float32
    _, want, _ = naive_per_token(logits, labels, vocab, loss="number")
    assert float(want[0, 0]) == pytest.approx(1 / (123456788 + 123456789), rel=1e-6)
    torch.testing.assert_close(ntl.double(), want, rtol=1e-5, atol=0)
