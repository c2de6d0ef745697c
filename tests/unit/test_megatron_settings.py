"""Every NTLSettings field on the ``megatron.core`` forward-step routes, and number-level NTL under CP (issue 40).

Sections:
1. ``make_loss_func`` and ``make_forward_step`` with every option at a non-default value (four variants
   covering ``loss``, ``squash_factor``, ``reweigh``, ``huber_delta``, ``float_level``, ``impl``; ``weight``
   0.5; both normalisations) equal the float64 objective written from the definitions
   (``tests/helpers/reference.py``) under Megatron's schedule arithmetic; ``chunked`` (which a loss of
   logits cannot honour) and ``chunk_tokens`` without it are refused; ``number_vocab`` is honoured by
   ``build_number_vocab``. (The model-side mixin and the Megatron-LM hook: ``tests/integration/
   test_megatron_settings.py``.)
2. Context parallelism, number-level NTL: a rank holds slices ``r`` and ``2 cp - 1 - r`` back to back; the
   documented rule cuts numbers at every slice border. With cp = 2, digits ``5 6`` ending slice 0 and
   ``7 8`` starting slice 3 are two numbers (K = 2), in ``make_loss_func`` (its NTL sum against float64
   per slice), ``GlobalCounts`` and ``make_forward_step``; over random labels and cp = 2, 4 the ranks' local
   counts add up to the whole-sequence count (the Megatron-LM route's) and both equal a plain Python count
   of digit runs per slice.
"""

from __future__ import annotations

import functools

import pytest
import torch

import ntl_scale
from ntl_scale.integrations import megatron as ntl_megatron
from ntl_scale.integrations.megatron.terms import context_parallel_pieces
from tests.helpers.data import random_logits
from tests.helpers.reference import naive_per_token

TOKENS = ["<eod>", "a", "b", "."] + [str(d) for d in range(10)] + [f"w{i}" for i in range(18)]
V = len(TOKENS)
VOCAB = ntl_scale.NumberVocab.from_id_to_token(TOKENS, vocab_size=V)
DIGIT = {str(d): TOKENS.index(str(d)) for d in range(10)}
VARIANTS = [
    dict(loss="was", squash_factor=3.0, reweigh=True),
    dict(loss="huber", huber_delta=2.0),
    dict(loss="number", float_level=True),
    dict(loss="mse", impl="torch"),
]
WEIGHT = 0.5


def _ids(variant: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in variant.items())


def _batch(seed: int, rows: int = 4, seq: int = 8):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (rows, seq), generator=g)
    digits = torch.randint(4, 14, (rows, seq), generator=g)
    labels = torch.where(torch.rand(rows, seq, generator=g) < 0.6, digits, labels)
    labels[torch.rand(rows, seq, generator=g) < 0.15] = TOKENS.index(".")
    mask = (torch.rand(rows, seq, generator=g) < 0.85).float()
    logits = random_logits((rows, seq, V), seed=seed, dtype=torch.float64)
    return labels, mask, logits


def _reference_sums(logits, labels, mask, variant, pieces: int = 1):
    """float64 ``(ce_sum, ntl_sum, tokens, numbers)`` from the definitions; numbers cut into ``pieces`` slices."""
    b, s = labels.shape
    rows = (b * pieces, s // pieces)  # each slice its own sequence: the documented rule
    ce, ntl, is_number = naive_per_token(
        logits.reshape(*rows, V).double(), labels.reshape(rows), VOCAB, **_variant_only(variant)
    )
    ce, ntl, is_number = (t.reshape(b, s) for t in (ce, ntl, is_number))
    numbers = is_number.double() * mask
    return (ce * mask).sum(), (ntl * numbers).sum(), mask.sum().double(), numbers.sum()


def _variant_only(variant: dict) -> dict:
    return {k: v for k, v in variant.items() if k != "impl"}


# ------------------------------------------------------------------------------------ 1. every option


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_make_loss_func_honours_every_option_micro_batch(variant):
    settings = ntl_megatron.NTLSettings(weight=WEIGHT, **variant)
    labels, mask, logits = _batch(1)
    loss_func = ntl_megatron.make_loss_func(settings, VOCAB, tp_group=None)
    loss, num_tokens, report = loss_func(labels, mask, logits.clone())
    ce_sum, ntl_sum, tokens, numbers = _reference_sums(logits, labels, mask, variant)
    assert float(numbers) > 0 and int(num_tokens) == int(tokens)
    want = ce_sum / tokens + WEIGHT * ntl_sum / numbers  # the paper's per-micro-batch means
    torch.testing.assert_close(loss.double() / num_tokens, want, rtol=1e-10, atol=0)  # Megatron divides by it
    torch.testing.assert_close(report["ntl loss"].double(), torch.stack([ntl_sum, numbers]), rtol=1e-10, atol=0)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_make_forward_step_honours_every_option_global(variant):
    """``make_forward_step`` with a model returning logits, ``normalization='global'`` over 2 micro-batches:
    the schedule's sum of ``loss / num_tokens / m`` is the global objective of the float64 reference."""
    settings = ntl_megatron.NTLSettings(weight=WEIGHT, normalization="global", **variant)
    batches = [_batch(seed) for seed in (2, 3)]

    class Logits(torch.nn.Module):  # a model called without labels returns [b, s, V] logits, as GPTModel
        def forward(self, tokens, position_ids, attention_mask):
            return batches[int(tokens[0, 0])][2].clone()

    def get_batch(iterator):
        i = next(iterator)
        labels, mask, _ = batches[i]
        return torch.full((1, 1), i), labels, mask, None, None

    forward_step = ntl_megatron.make_forward_step(
        settings, VOCAB, get_batch, tp_group=None, num_microbatches=len(batches)
    )
    iterator = iter(range(len(batches)))
    total = torch.zeros((), dtype=torch.float64)
    for _ in batches:
        output, loss_func = forward_step(iterator, Logits())
        loss, num_tokens, _ = loss_func(output)
        total = total + loss.double() / num_tokens / len(batches)  # Megatron's schedule
    sums = [_reference_sums(logits, labels, mask, variant) for labels, mask, logits in batches]
    ce, ntl, tokens, numbers = (sum(s[i] for s in sums) for i in range(4))
    torch.testing.assert_close(total, ce / tokens + WEIGHT * ntl / numbers, rtol=1e-10, atol=0)


def test_chunked_settings_are_refused_by_the_logits_routes():
    settings = ntl_megatron.NTLSettings(weight=WEIGHT, chunked=True, chunk_tokens=3)
    with pytest.raises(ValueError, match=r"settings.chunked=True \(--ntl-chunked\) .* make_loss_func"):
        ntl_megatron.make_loss_func(settings, VOCAB, tp_group=None)
    with pytest.raises(ValueError, match=r"settings.chunked=True \(--ntl-chunked\) .* make_forward_step"):
        ntl_megatron.make_forward_step(settings, VOCAB, lambda it: None, tp_group=None)
    with pytest.raises(ValueError, match=r"--ntl-chunk-tokens=3 applies to the chunked route only"):
        ntl_megatron.NTLSettings(weight=WEIGHT, chunk_tokens=3)


def test_number_vocab_is_honoured_by_build_number_vocab():
    class Tokenizer:
        def __init__(self) -> None:
            self.inv_vocab = dict(enumerate([*TOKENS, "12", "345"]))

    digits = ntl_megatron.build_number_vocab(ntl_megatron.NTLSettings(weight=WEIGHT), Tokenizer(), 64)
    multi = ntl_megatron.build_number_vocab(
        ntl_megatron.NTLSettings(weight=WEIGHT, number_vocab="multi-digit", squash_factor=16.0), Tokenizer(), 64
    )
    assert sorted(digits.values.tolist()) == list(range(10))
    assert {12.0, 345.0} <= set(multi.values.tolist()) and len(multi) == 12


# ------------------------------------------------------------------------------------ 2. context parallelism


def _load_balanced(global_row: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Megatron's split: 2 cp slices, rank r holds slices r and 2 cp - 1 - r back to back."""
    slices = global_row.chunk(2 * cp, dim=-1)
    return torch.cat([slices[rank], slices[2 * cp - 1 - rank]], dim=-1)


def _count_by_rule(labels: torch.Tensor, cp: int) -> int:
    """The documented rule, as a plain loop: digit runs inside each of the 2 cp slices of each sequence."""
    digit_ids = set(DIGIT.values())
    count = 0
    for row in labels.tolist():
        width = len(row) // (2 * cp)
        for start in range(0, len(row), width):
            previous = False
            for token in row[start : start + width]:
                is_digit = token in digit_ids
                count += is_digit and not previous
                previous = is_digit
    return count


def test_a_number_across_the_cp_seam_is_two_numbers():
    """cp = 2, sequence 8: slices of 2; rank 0 holds global positions 0, 1, 6, 7 = ``5 6 | 7 8``."""
    text = TOKENS.index("a")
    row = torch.tensor([[DIGIT["5"], DIGIT["6"], text, text, text, text, DIGIT["7"], DIGIT["8"]]])
    local = _load_balanced(row, 2, 0)
    assert local.tolist() == [[DIGIT["5"], DIGIT["6"], DIGIT["7"], DIGIT["8"]]]
    mask = torch.ones(local.shape)
    logits = random_logits((1, 4, V), seed=4, dtype=torch.float64)
    variant = dict(loss="number")
    settings = ntl_megatron.NTLSettings(weight=WEIGHT, **variant)
    # the rule's reference on this rank's two slices, each its own sequence
    _, ntl_sum, _, numbers = _reference_sums(logits, local, mask, variant, pieces=2)
    assert float(numbers) == 2 == _count_by_rule(row, 2)

    loss_func = ntl_megatron.make_loss_func(settings, VOCAB, tp_group=None, context_parallel_size=2)
    _, _, report = loss_func(local, mask, logits.clone())
    torch.testing.assert_close(report["ntl loss"].double(), torch.stack([ntl_sum, numbers]), rtol=1e-10, atol=0)
    counts = ntl_megatron.GlobalCounts(VOCAB, None, settings.options(), context_parallel_size=2)
    counts.set_step([(local, mask)])
    assert float(counts.get()[1]) == 2

    global_settings = ntl_megatron.NTLSettings(weight=WEIGHT, normalization="global", **variant)
    forward_step = ntl_megatron.make_forward_step(
        global_settings, VOCAB, lambda it: (None, local, mask, None, None), tp_group=None, context_parallel_size=2
    )

    class Logits(torch.nn.Module):
        def forward(self, *args):
            return logits.clone()

    output, bound = forward_step(None, Logits())
    _, _, report = bound(output)
    torch.testing.assert_close(report["ntl loss"].double(), torch.stack([ntl_sum, numbers]), rtol=1e-10, atol=0)
    # a counter and a loss built for different CP sizes would disagree on K: refused
    with pytest.raises(ValueError, match="same context_parallel_size"):
        ntl_megatron.make_loss_func(global_settings, VOCAB, tp_group=None, global_counts=counts)


@pytest.mark.parametrize("cp", [2, 4])
def test_local_counts_add_up_to_the_whole_sequence_count_and_the_rule(cp):
    g = torch.Generator().manual_seed(cp)
    seq = 4 * cp * 2
    labels = torch.where(
        torch.rand(3, seq, generator=g) < 0.7, torch.randint(4, 14, (3, seq), generator=g), TOKENS.index("a")
    )
    options = ntl_scale.NTLOptions(loss="number")
    whole = ntl_scale.ntl_counts(
        labels, VOCAB, options, pieces=context_parallel_pieces(cp, options, whole_sequence=True)
    )
    local = sum(
        ntl_scale.ntl_counts(_load_balanced(labels, cp, r), VOCAB, options, pieces=context_parallel_pieces(cp, options))
        for r in range(cp)
    )
    assert float(whole[1]) == float(local[1]) == _count_by_rule(labels, cp)
    assert _count_by_rule(labels, cp) > _count_by_rule(labels, 1) / 2  # not vacuous
    assert context_parallel_pieces(cp, ntl_scale.NTLOptions(loss="was")) == 1  # token-level: no cut
    with pytest.raises(ValueError, match="context_parallel_size must be a whole number >= 1"):
        context_parallel_pieces(0, options)


def test_partial_binding_keeps_megatrons_contract():
    """``functools.partial(loss_func, labels, loss_mask)`` as ``forward_step`` binds it."""
    labels, mask, logits = _batch(5)
    loss_func = ntl_megatron.make_loss_func(ntl_megatron.NTLSettings(weight=WEIGHT), VOCAB, tp_group=None)
    loss, num_tokens, report = functools.partial(loss_func, labels, mask)(logits)
    assert (
        loss.dim() == 0 and num_tokens.dtype == torch.int and set(report) == {"lm loss", "ntl loss", "number accuracy"}
    )
