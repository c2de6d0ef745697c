"""CE + NTL from hidden states (``ntl_scale.linear``) against the naive float64 reference.

The reference materialises ``logits = hidden @ weight.T`` in float64 and takes the obvious per-token
CE and NTL (``tests/helpers/reference.py``); autograd through it gives the hidden and weight
gradients. Sections:
1. Every NTL variant, fp64 (1e-10) and fp32 (1e-5 relative): per-token terms, then gradients for a
   mean reduction (precomputed in the forward) and for arbitrary per-token upstream gradients (the
   recomputing backward); several chunk sizes, ragged last chunk.
2. Loss weights as the reduction's token weights; every label ignored; no number labels; NTL alone
   (no vocabulary pass); bf16 and fp16 inputs.
3. ``linear_ce_with_ntl`` equals ``ce_with_ntl`` on the materialised logits; bad input.
"""

from __future__ import annotations

import pytest
import torch

import ntl_scale
from ntl_scale.linear import linear_ce_ntl, linear_ce_with_ntl
from tests.helpers.reference import naive_per_token, naive_reduce
from tests.unit.test_losses import VARIANTS, _labels_with_runs, _vocab

HIDDEN = 24


def _inputs(vocab, dtype=torch.float64, seed=0, rows=4, seq=20):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, seq, HIDDEN, generator=g, dtype=torch.float64)).to(dtype)
    weight = (torch.randn(vocab.vocab_size, HIDDEN, generator=g, dtype=torch.float64) * 0.6).to(dtype)
    labels = _labels_with_runs(vocab, rows, seq, seed)
    upstream = torch.rand(2, rows, seq, generator=g, dtype=torch.float64)
    return hidden.requires_grad_(), weight.requires_grad_(), labels, upstream


def _reference(hidden, weight, labels, vocab, variant, upstream=None, weights=None):
    """Naive per-token terms of the float64 logits, and (loss, d hidden, d weight)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    ce, ntl, mask = naive_per_token(h @ w.t(), labels, vocab, **variant)
    if upstream is None:
        valid = labels != -100
        loss = naive_reduce(ce, valid, weights, "mean") + 0.3 * naive_reduce(ntl, mask, weights, "mean")
    else:
        loss = (upstream[0] * ce + upstream[1] * ntl).sum()
    loss.backward()
    return ce.detach(), ntl.detach(), mask, loss.detach(), h.grad, w.grad


def _close(actual, expected, tol, what):
    scale = max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(
        actual.detach().double(), expected.double(), atol=tol * scale, rtol=tol, msg=lambda m: f"{what}: {m}"
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("chunk_tokens", [None, 7])
def test_terms_and_gradients_match_the_materialised_reference(variant, dtype, tol, chunk_tokens):
    vocab = _vocab()
    hidden, weight, labels, upstream = _inputs(vocab, dtype)
    options = ntl_scale.NTLOptions(**variant)
    ref_ce, ref_ntl, ref_mask, _, gh, gw = _reference(hidden, weight, labels, vocab, variant, upstream)
    terms = linear_ce_ntl(hidden, weight, labels, vocab, options, chunk_tokens=chunk_tokens)
    _close(terms.ce, ref_ce, tol, "ce")
    _close(terms.ntl, ref_ntl, tol, "ntl")
    assert torch.equal(terms.number_mask, ref_mask)
    # arbitrary per-token upstream gradients: the recomputing backward
    (upstream[0].to(terms.ce.dtype) * terms.ce + upstream[1].to(terms.ce.dtype) * terms.ntl).sum().backward()
    _close(hidden.grad, gh, tol, "d hidden (any upstream)")
    _close(weight.grad, gw, tol, "d weight (any upstream)")
    # the mean reduction: the gradient built in the forward
    hidden.grad = weight.grad = None
    _, _, _, ref_loss, gh, gw = _reference(hidden, weight, labels, vocab, variant)
    out = linear_ce_with_ntl(hidden, weight, labels, vocab, chunk_tokens=chunk_tokens, **variant)
    _close(out.loss, ref_loss, tol, "loss")
    out.loss.backward()
    _close(hidden.grad, gh, tol, "d hidden (mean)")
    _close(weight.grad, gw, tol, "d weight (mean)")


def test_loss_weights_are_the_token_weights_of_the_precomputed_gradient():
    vocab = _vocab()
    hidden, weight, labels, _ = _inputs(vocab, torch.float64, seed=3)
    weights = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weights[0] = 0  # a masked row
    _, _, _, ref_loss, gh, gw = _reference(hidden, weight, labels, vocab, {}, weights=weights)
    out = linear_ce_with_ntl(hidden, weight, labels, vocab, loss_weights=weights, chunk_tokens=16)
    out.loss.backward()
    _close(out.loss, ref_loss, 1e-10, "loss")
    _close(hidden.grad, gh, 1e-10, "d hidden")
    _close(weight.grad, gw, 1e-10, "d weight")


@pytest.mark.parametrize("case", ["all_ignored", "no_numbers", "ntl_only"])
def test_edge_cases(case):
    vocab = _vocab()
    hidden, weight, labels, upstream = _inputs(vocab, torch.float64, seed=5)
    if case == "all_ignored":
        labels[:] = -100
    if case == "no_numbers":
        labels = torch.where(vocab.number_mask(labels), torch.full_like(labels, 1), labels)
    ref_ce, ref_ntl, _, _, gh, gw = _reference(
        hidden, weight, labels, vocab, {}, torch.stack([upstream[0] * 0, upstream[1]])
    )
    terms = linear_ce_ntl(hidden, weight, labels, vocab, need_ce=case != "ntl_only", chunk_tokens=9)
    (upstream[1] * terms.ntl).sum().backward()
    _close(terms.ntl, ref_ntl, 1e-10, "ntl")
    if case != "ntl_only":
        _close(terms.ce, ref_ce, 1e-10, "ce")
    _close(hidden.grad, gh, 1e-10, "d hidden")
    _close(weight.grad, gw, 1e-10, "d weight")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    vocab = _vocab()
    hidden, weight, labels, _ = _inputs(vocab, dtype, seed=7)
    logits = (hidden.detach() @ weight.detach().t()).requires_grad_()  # the materialised path, same dtype
    expected = ntl_scale.ce_with_ntl(logits, labels, vocab)
    expected.loss.backward()
    out = linear_ce_with_ntl(hidden, weight, labels, vocab, chunk_tokens=13)
    out.loss.backward()
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    _close(out.loss, expected.loss, 1e-3, "loss")
    _close(hidden.grad, logits.grad.double() @ weight.detach().double(), 2e-2, "d hidden")
    _close(weight.grad, logits.grad.double().flatten(0, 1).t() @ hidden.detach().double().flatten(0, 1), 2e-2, "d w")


def test_matches_ce_with_ntl_on_the_logits():
    vocab = _vocab()
    hidden, weight, labels, _ = _inputs(vocab, torch.float32, seed=11)
    logits = hidden.detach() @ weight.detach().t()
    expected = ntl_scale.ce_with_ntl(logits, labels, vocab, loss="mse", reduction="sum")
    out = linear_ce_with_ntl(hidden, weight, labels, vocab, loss="mse", reduction="sum")
    for name in ("loss", "ce", "ntl", "num_tokens", "num_number_tokens", "number_accuracy"):
        _close(getattr(out, name), getattr(expected, name), 1e-5, name)


def test_bad_input_is_named():
    vocab = _vocab()
    hidden, weight, labels, _ = _inputs(vocab, torch.float32)
    with pytest.raises(ValueError, match="hidden's last dim"):
        linear_ce_ntl(hidden[..., :5], weight, labels, vocab)
    with pytest.raises(ValueError, match=r"\[vocab, hidden\]"):
        linear_ce_ntl(hidden, weight[0], labels, vocab)
    with pytest.raises(TypeError, match="same dtype"):
        linear_ce_ntl(hidden, weight.double(), labels, vocab)
    with pytest.raises(ValueError, match="labels shape"):
        linear_ce_ntl(hidden, weight, labels[:, :3], vocab)
    with pytest.raises(ValueError, match=r"output weight's first dimension is 10 .* vocab_size=64"):
        linear_ce_ntl(hidden, weight[:10], labels, vocab)
    with pytest.raises(ValueError, match=r"output weight's first dimension is 164 .* vocab_size=64"):
        linear_ce_ntl(hidden, torch.cat([weight, weight, weight[:36]]), labels, vocab)
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_ce_ntl(hidden, weight, labels, vocab, chunk_tokens=0)
