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
        (dict(logits=torch.zeros(1, 4, 12)), ValueError, r"last dimension is 12 .* built for vocab_size=16.*N=12"),
        # wider logits than the table (issue 23): columns the table never knew would enter the softmax
        (dict(logits=torch.zeros(1, 4, 116)), ValueError, r"is 116 .*vocab_size=16.*vocab_size=model.config"),
        (dict(labels=torch.tensor([[3, 16, 0, 1]])), ValueError, r"label id 16 is outside \[0, 16\)"),
        (dict(labels=torch.tensor([[3, -1, 0, 1]])), ValueError, r"label id -1 is outside .*ignore_index=-100"),
        (dict(loss_weights=torch.ones(1, 3)), ValueError, r"loss_weights shape \(1, 3\) must equal"),
        (dict(loss_weights=-torch.ones(1, 4)), ValueError, r"finite and >= 0, found -1.0"),
        (dict(loss_weights=torch.full((1, 4), float("nan"))), ValueError, "finite and >= 0, found nan"),
        (dict(loss_weights=[1, 1, 1, 1]), TypeError, "loss_weights must be a tensor"),
        (dict(loss="wasserstein"), ValueError, r"unknown NTL loss 'wasserstein'; expected one of \('was'"),
        (dict(reduction="avg"), ValueError, r"unknown reduction 'avg'; expected one of \('mean'"),
        (dict(squash_factor=1.0), ValueError, "squash_factor must be a finite number > 1"),
        (dict(squash_factor=3.0, loss="mse"), ValueError, "squash_factor applies to loss='was' only"),
        (dict(float_level=True), ValueError, "float_level applies to loss='number' only"),
        (dict(huber_delta=0.0, loss="huber"), ValueError, "huber_delta must be a finite number > 0"),
        (dict(ntl_weight=-0.3), ValueError, "ntl_weight must be a finite number >= 0 .*, got -0.3"),
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


# Every public entry that takes chunk_tokens (issue 23): a value < 1 gave CE = -inf (no chunk at all)
# or, for 0, silently the default; a fraction was truncated.
CHUNKED_ENTRIES = {
    "vocab_parallel_ce_ntl": lambda c: ntl_scale.vocab_parallel_ce_ntl(LOGITS, LABELS, VOCAB, chunk_tokens=c),
    "per_token_ce_ntl": lambda c: ntl_scale.per_token_ce_ntl(LOGITS, LABELS, VOCAB, chunk_tokens=c),
    "linear_ce_ntl": lambda c: ntl_scale.linear_ce_ntl(
        torch.zeros(1, 4, 3), torch.zeros(16, 3), LABELS, VOCAB, chunk_tokens=c
    ),
    "linear_ce_with_ntl": lambda c: ntl_scale.linear_ce_with_ntl(
        torch.zeros(1, 4, 3), torch.zeros(16, 3), LABELS, VOCAB, chunk_tokens=c
    ),
    "hf.chunked.install_linear_loss_head": lambda c: _install_linear_loss_head(c),
}


def _install_linear_loss_head(chunk_tokens):
    from ntl_scale.integrations.hf.chunked import install_linear_loss_head

    install_linear_loss_head(torch.nn.Linear(3, 16, bias=False), VOCAB, ntl_scale.NTLOptions(), chunk_tokens)


@pytest.mark.parametrize("value", [-512, -1, 0, 2.5, True, "512"])
@pytest.mark.parametrize("entry", list(CHUNKED_ENTRIES))
def test_bad_chunk_tokens_is_refused_everywhere(entry, value):
    with pytest.raises(
        ValueError, match=rf"chunk_tokens must be a whole number >= 1 .*got {value!r}.*chunk_tokens=512"
    ):
        CHUNKED_ENTRIES[entry](value)


@pytest.mark.parametrize("entry", list(CHUNKED_ENTRIES))
def test_good_chunk_tokens_is_accepted(entry):
    for value in (None, 1, 3, 10**6):
        CHUNKED_ENTRIES[entry](value)


WIDTH_ENTRIES = {
    "ce_with_ntl": lambda z, v: ntl_scale.ce_with_ntl(z, LABELS, v, reweigh=True),
    "number_token_loss": lambda z, v: ntl_scale.number_token_loss(z, LABELS, v),  # reads only number columns
    "vocab_parallel_ce_ntl": lambda z, v: ntl_scale.vocab_parallel_ce_ntl(z, LABELS, v),
    "NumberTokenLoss": lambda z, v: ntl_scale.NumberTokenLoss(v)(z, LABELS),
    "CEWithNTL": lambda z, v: ntl_scale.CEWithNTL(v)(z, LABELS),
    "predict_numbers": lambda z, v: ntl_scale.predict_numbers(z, v),
    "linear_ce_with_ntl": lambda z, v: ntl_scale.linear_ce_with_ntl(
        torch.zeros(1, 4, 3), torch.zeros(z.shape[-1], 3), LABELS, v
    ),
}


@pytest.mark.parametrize("entry", list(WIDTH_ENTRIES))
def test_logits_must_be_as_wide_as_the_table(entry):
    """Issue 23: a table for V took V + 100 columns, and a table for V + 150 took V + 100 (only "wider
    than the largest number id" was checked), so reweighed WAS changed with zero columns appended."""
    call = WIDTH_ENTRIES[entry]
    call(torch.zeros(1, 4, 16), VOCAB)  # equal: accepted
    with pytest.raises(ValueError, match=r" is 116 but the number table was built for vocab_size=16.*N=116"):
        call(torch.zeros(1, 4, 116), VOCAB)
    with pytest.raises(ValueError, match=r" is 116 but the number table was built for vocab_size=166"):
        call(torch.zeros(1, 4, 116), VOCAB.with_vocab_size(166))


def test_vocab_start_without_a_group_must_cover_the_vocabulary():
    with pytest.raises(ValueError, match=r"without a tensor-parallel group .*\[0, 16\), got \[4, 16\)"):
        ntl_scale.vocab_parallel_ce_ntl(torch.zeros(1, 4, 12), LABELS, VOCAB, vocab_start=4)
    ntl_scale.vocab_parallel_ce_ntl(LOGITS, LABELS, VOCAB, vocab_start=0)  # the whole vocabulary: fine


HIDDEN, WEIGHT = torch.zeros(1, 4, 8), torch.zeros(16, 8)


@pytest.mark.parametrize(
    "call",
    [
        lambda impl: ntl_scale.ce_with_ntl(LOGITS, LABELS, VOCAB, impl=impl),
        lambda impl: ntl_scale.vocab_parallel_ce_ntl(LOGITS, LABELS, VOCAB, impl=impl),
        lambda impl: ntl_scale.number_token_loss(LOGITS, LABELS, VOCAB, impl=impl),
        lambda impl: ntl_scale.linear_ce_with_ntl(HIDDEN, WEIGHT, LABELS, VOCAB, impl=impl),
        lambda impl: ntl_scale.linear_ce_ntl(HIDDEN, WEIGHT, LABELS, VOCAB, ntl_scale.NTLOptions(impl=impl)),
        lambda impl: ntl_scale.CEWithNTL(VOCAB, impl=impl),
        lambda impl: ntl_scale.NumberTokenLoss(VOCAB, impl=impl),
    ],
    ids=["ce_with_ntl", "vocab_parallel_ce_ntl", "number_token_loss", "linear_ce_with_ntl", "linear_ce_ntl",
         "CEWithNTL", "NumberTokenLoss"],
)  # fmt: skip
def test_impl_is_chosen_per_call_and_a_bad_one_is_named(call):
    """Issue 30: ``impl`` on every entry; a bad value names itself and the three choices."""
    with pytest.raises(ValueError, match=r"unknown impl 'cuda'; expected one of 'auto', 'torch', 'triton'"):
        call("cuda")
    for impl in ("auto", "torch"):  # the PyTorch code on the CPU, the same numbers
        call(impl)
