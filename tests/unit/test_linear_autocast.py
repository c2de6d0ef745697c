"""The chunked op under ``torch.autocast``: it runs as an autocast linear layer would.

Policy (``ntl_scale/linear.py``): under autocast, hidden and weight are cast to the autocast dtype
(differentiable casts, so fp32 parameters get fp32 gradients through them) and the op runs its
half-precision path with autocast off inside, forward and backward. Sections:
1. CPU autocast (bf16) with fp32 parameters, torch path, several chunkings: the loss and both
   gradients equal a float64 reference on the bf16-rounded inputs (``tests/helpers/reference.py``,
   CE + 0.3 NTL-WAS from the full softmax) within bf16 rounding; the gradients are fp32, like the
   parameters.
2. A backward called inside the autocast region gives the same bits as one called outside it.
3. fp64 inputs are not cast (autocast leaves fp64 alone): the same bits as without autocast.
4. Under autocast the op is, bit for bit, the op on inputs cast to bf16 by hand (CE-free terms too),
   and a bf16 hidden with an fp32 weight is accepted as an autocast linear layer accepts it.

The weight gradient reaches an fp32 leaf through the bf16 cast, so it carries one bf16 rounding, as
``nn.Linear``'s does under autocast.
"""

from __future__ import annotations

import pytest
import torch

import ntl_scale
from tests.helpers.reference import naive_per_token

T, V, H = 37, 211, 24


def _vocab() -> ntl_scale.NumberVocab:
    tokens = [f"w{i}" for i in range(V)]
    for digit in range(10):
        tokens[50 + digit] = str(digit)
    return ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=V)


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::3] = 50 + torch.randint(0, 10, (len(labels[::3]),), generator=g)
    labels[:2] = -100
    return hidden.to(dtype), weight.to(dtype), labels


def _run(hidden, weight, labels, vocab, chunk, *, autocast: bool, backward_inside: bool = True):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = ntl_scale.linear_ce_with_ntl(h, w, labels, vocab, ntl_weight=0.3, chunk_tokens=chunk, impl="torch")
        if backward_inside:
            out.loss.backward()
    if not backward_inside:
        out.loss.backward()
    return out.loss.detach(), h.grad, w.grad


def _reference(hidden, weight, labels, vocab):
    """float64 CE + 0.3 NTL-WAS on the bf16-rounded inputs, and its gradients."""
    h = hidden.to(torch.bfloat16).double().requires_grad_()
    w = weight.to(torch.bfloat16).double().requires_grad_()
    ce, ntl, mask = naive_per_token(h @ w.t(), labels, vocab)
    valid = labels != -100
    loss = ce[valid].mean() + 0.3 * ntl[mask].mean()
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [None, 7, 5, 1])
def test_autocast_fp32_parameters_match_the_float64_reference(chunk):
    vocab = _vocab()
    hidden, weight, labels = _inputs()
    loss, grad_h, grad_w = _run(hidden, weight, labels, vocab, chunk, autocast=True)
    ref_loss, ref_h, ref_w = _reference(hidden, weight, labels, vocab)
    assert loss.dtype == torch.float32 and grad_h.dtype == torch.float32 and grad_w.dtype == torch.float32
    assert abs(float(loss) - float(ref_loss)) <= 2.0**-8 * abs(float(ref_loss))
    for got, ref in ((grad_h, ref_h), (grad_w, ref_w)):
        # the softmax reaches the matmuls in bf16 (one rounding), the gradients are rounded to bf16 once
        assert float((got.double() - ref).abs().max()) <= 4 * 2.0**-8 * float(ref.abs().max()), chunk


@pytest.mark.parametrize("chunk", [None, 7])
def test_backward_inside_or_outside_autocast_is_the_same(chunk):
    vocab = _vocab()
    hidden, weight, labels = _inputs()
    inside = _run(hidden, weight, labels, vocab, chunk, autocast=True, backward_inside=True)
    outside = _run(hidden, weight, labels, vocab, chunk, autocast=True, backward_inside=False)
    for a, b in zip(inside, outside):
        assert torch.equal(a, b)


def test_fp64_inputs_are_left_alone():
    vocab = _vocab()
    hidden, weight, labels = _inputs(torch.float64)
    with_amp = _run(hidden, weight, labels, vocab, 7, autocast=True)
    without = _run(hidden, weight, labels, vocab, 7, autocast=False)
    for a, b in zip(with_amp, without):
        assert a.dtype == torch.float64 and torch.equal(a, b)


@pytest.mark.parametrize("need_ce", [True, False])
def test_autocast_is_the_explicit_cast(need_ce):
    """Under autocast the op equals, bit for bit, the op on inputs cast to bf16 by hand outside autocast
    (the gradients reaching the fp32 leaves through the casts); CE-free terms included."""
    vocab = _vocab()
    hidden, weight, labels = _inputs()

    def terms(amp: bool):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            a, b = (h, w) if amp else (h.bfloat16(), w.bfloat16())
            out = ntl_scale.linear_ce_ntl(a, b, labels, vocab, chunk_tokens=7, need_ce=need_ce)
            (out.ce.sum() + 0.3 * out.ntl.sum()).backward()
        return out.ce.detach(), out.ntl.detach(), h.grad, w.grad

    for a, b in zip(terms(True), terms(False)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_autocast_accepts_a_bf16_hidden_with_an_fp32_weight():
    """As an autocast linear layer does: both cast to bf16 (outside autocast the mix is refused)."""
    vocab = _vocab()
    hidden, weight, labels = _inputs()
    h = hidden.bfloat16().requires_grad_()
    w = weight.clone().requires_grad_()
    with pytest.raises(TypeError, match="must have the same dtype"):
        ntl_scale.linear_ce_with_ntl(h, w, labels, vocab)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ntl_scale.linear_ce_with_ntl(h, w, labels, vocab, ntl_weight=0.3, chunk_tokens=7, impl="torch")
    out.loss.backward()
    ref_loss, _, _ = _reference(hidden.bfloat16().double(), weight, labels, vocab)
    assert abs(float(out.loss.detach()) - float(ref_loss)) <= 2.0**-8 * abs(float(ref_loss))
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
