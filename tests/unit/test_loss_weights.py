"""Loss weights: the weighted mean and every metric under the loss's own mask and weights (issue 40, items 5-6).

1. Scale invariance: a weighted mean with weights x 1e-8 (or x 1e-30, x 1e8) equals the float64 mean
   ``sum(l * w) / sum(w)`` written from the definition (the old ``clamp_min(eps)`` divided a tiny total by
   eps: CE 1.735 instead of 2.586), for every public loss that takes weights; gradients finite and equal
   to the reference's.
2. An empty selection (every weight 0, or no number label) is still exactly 0 with a zero, finite gradient.
3. ``number_accuracy`` under the loss's weights: the weighted share of hits over the NTL positions
   (``reduce_loss`` of the hits), computed here from the arg-max of float64 logits; a weight-0 position
   (a masked prompt) does not count; it is ``hits / num_number_tokens`` of the same call, and the
   integrations' ``[sum, count]`` accuracy (``micro_batch_sums``) agrees with it.
"""

from __future__ import annotations

import pytest
import torch

import ntl_scale
from ntl_scale.normalization import micro_batch_sums
from tests.helpers.data import random_labels, random_logits
from tests.helpers.reference import naive_per_token

V = 16
VOCAB = ntl_scale.NumberVocab.from_id_to_token({i + 3: str(i) for i in range(10)}, vocab_size=V)
VARIANTS = [dict(loss="was"), dict(loss="mse"), dict(loss="number"), dict(loss="was", reweigh=True)]


def _inputs(seed: int = 0):
    labels = random_labels(VOCAB, (2, 9), V, seed=seed, number_fraction=0.7)
    logits = random_logits((2, 9, V), seed=seed, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    weights = torch.rand(2, 9, generator=g) + 0.25
    weights[0, :3] = 0  # a masked prompt
    return logits, labels, weights


def _reference(logits, labels, weights, **variant):
    """float64 means from the definitions: ``sum(l w) / sum(w)`` over valid tokens (CE) and NTL positions."""
    ce, ntl, mask = naive_per_token(logits.double(), labels, VOCAB, **variant)
    w = weights.double()
    valid = (labels != -100).double() * w
    numbers = mask.double() * w
    return (ce * valid).sum() / valid.sum(), (ntl * numbers).sum() / numbers.sum()


def _routes(logits, labels, weights, **variant):
    """Every public loss that takes weights, as ``(name, ce, ntl)`` (NTL-only routes: ``ce`` None)."""
    hidden = logits.detach().clone()  # hidden @ eye = the logits: the chunked op on the same numbers
    eye = torch.eye(V)
    out = ntl_scale.ce_with_ntl(logits, labels, VOCAB, loss_weights=weights, **variant)
    lin = ntl_scale.linear_ce_with_ntl(hidden, eye, labels, VOCAB, loss_weights=weights, chunk_tokens=4, **variant)
    module = ntl_scale.CEWithNTL(VOCAB, **variant)(logits, labels, weights)
    ntl = ntl_scale.number_token_loss(logits, labels, VOCAB, loss_weights=weights, **variant)
    ntl_module = ntl_scale.NumberTokenLoss(VOCAB, **variant)(logits, labels, weights)
    return [
        ("ce_with_ntl", out.ce, out.ntl),
        ("linear_ce_with_ntl", lin.ce, lin.ntl),
        ("CEWithNTL", module.ce, module.ntl),
        ("number_token_loss", None, ntl),
        ("NumberTokenLoss", None, ntl_module),
    ]


# ------------------------------------------------------------------------------------ 1. scale invariance


@pytest.mark.parametrize("scale", [1e-8, 1e-30, 1e8])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_weighted_mean_is_scale_invariant_against_float64(scale, variant):
    logits, labels, weights = _inputs()
    ce_ref, ntl_ref = _reference(logits, labels, weights, **variant)
    for name, ce, ntl in _routes(logits, labels, weights * scale, **variant):
        if ce is not None:
            torch.testing.assert_close(ce.double(), ce_ref, rtol=2e-5, atol=0, msg=f"{name} CE x{scale}")
        torch.testing.assert_close(ntl.double(), ntl_ref, rtol=2e-5, atol=0, msg=f"{name} NTL x{scale}")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_gradients_of_tiny_weights_equal_the_reference(variant):
    logits, labels, weights = _inputs(3)
    z = logits.double().requires_grad_()
    ce_ref, ntl_ref = _reference(z, labels, weights, **variant)
    (ce_ref + 0.3 * ntl_ref).backward()
    ours = logits.clone().requires_grad_()
    out = ntl_scale.ce_with_ntl(ours, labels, VOCAB, loss_weights=weights * 1e-8, ntl_weight=0.3, **variant)
    out.loss.backward()
    assert torch.isfinite(ours.grad).all()
    torch.testing.assert_close(ours.grad.double(), z.grad, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------ 2. empty selections


@pytest.mark.parametrize("scale", [0.0, 1e-30])
def test_an_empty_selection_is_zero_with_a_zero_gradient(scale):
    logits, labels, _ = _inputs(5)
    logits = logits.clone().requires_grad_()
    zero = torch.zeros(labels.shape)
    out = ntl_scale.ce_with_ntl(logits, labels, VOCAB, loss_weights=zero)
    assert float(out.loss.detach()) == 0 and float(out.number_accuracy) == 0
    out.loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    # no number label at all: NTL (and the accuracy) 0, CE the weighted mean, nothing NaN
    text = torch.where(VOCAB.number_mask(labels), torch.full_like(labels, 0), labels)
    weights = torch.full(labels.shape, scale if scale else 1.0)
    logits.grad = None
    out = ntl_scale.ce_with_ntl(logits, text, VOCAB, loss_weights=weights)
    assert float(out.ntl.detach()) == 0 and float(out.number_accuracy) == 0 and float(out.num_number_tokens) == 0
    out.loss.backward()
    assert torch.isfinite(logits.grad).all() and bool(logits.grad.abs().sum() > 0)


# ------------------------------------------------------------------------------------ 3. the accuracy


def _accuracy_reference(logits, labels, weights, **variant):
    """Weighted share of arg-max hits over the NTL positions, from float64 logits."""
    _, _, mask = naive_per_token(logits.double(), labels, VOCAB, **variant)
    hit = logits.double().argmax(-1) == labels
    w = weights.double() * mask.double()
    return (w * hit.double()).sum() / w.sum()


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v.values())))
def test_number_accuracy_is_under_the_loss_weights(variant):
    logits, labels, weights = _inputs(7)
    # make the masked prompt's number positions hits and the rest misses: the old accuracy counted them
    numbers = VOCAB.number_mask(labels)
    logits = logits.clone()
    for b, t in zip(*torch.nonzero(numbers, as_tuple=True)):
        label = int(labels[b, t])
        logits[b, t, label] = 20.0 if t < 3 and b == 0 else -20.0
    want = _accuracy_reference(logits, labels, weights, **variant)
    mask_only = (weights > 0).to(torch.float32)  # 0/1: an answer-only mask counts positions
    for w, what in ((weights, "weights"), (mask_only, "0/1 mask"), (weights * 1e-8, "tiny weights")):
        expected = _accuracy_reference(logits, labels, w, **variant)
        out = ntl_scale.ce_with_ntl(logits, labels, VOCAB, loss_weights=w, **variant)
        torch.testing.assert_close(out.number_accuracy.double(), expected, rtol=1e-6, atol=1e-12, msg=what)
        lin = ntl_scale.linear_ce_with_ntl(logits, torch.eye(V), labels, VOCAB, loss_weights=w, **variant)
        torch.testing.assert_close(lin.number_accuracy.double(), expected, rtol=1e-6, atol=1e-12, msg=what)
        module = ntl_scale.CEWithNTL(VOCAB, **variant)(logits, labels, w)
        torch.testing.assert_close(module.number_accuracy.double(), expected, rtol=1e-6, atol=1e-12, msg=what)
    assert float(want) == 0.0  # every position that counts is a miss; the prompt's hits do not count
    unweighted = ntl_scale.ce_with_ntl(logits, labels, VOCAB, **variant).number_accuracy
    assert float(unweighted) > 0  # without weights the prompt counts: the case is not trivial

    # the integrations' [sum, count] pairs (Megatron, torchtitan, DeepSpeed: micro_batch_sums) agree
    terms = ntl_scale.per_token_ce_ntl(logits, labels, VOCAB, ntl_scale.NTLOptions(**variant))
    sums = micro_batch_sums(terms, weights)
    torch.testing.assert_close((sums.hits / sums.numbers).double(), want, rtol=1e-6, atol=1e-12)
    out = ntl_scale.ce_with_ntl(logits, labels, VOCAB, loss_weights=weights, **variant)
    torch.testing.assert_close(out.num_number_tokens, sums.numbers)
