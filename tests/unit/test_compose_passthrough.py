"""NTL beside a partner CE through one autograd node (``beside_ce`` / ``linear_beside_ce``), on one device.

Sections:
1. Logits: ``F.cross_entropy`` and our CE consume ``beside_ce``'s logits; the loss and the logits' gradient
   equal ``ce_with_ntl``'s in float64, every variant, soft-capped or not.
2. Hidden states: ``F.linear_cross_entropy`` and our chunked CE consume ``linear_beside_ce``'s hidden and
   weight; loss and both gradients equal ``linear_ce_with_ntl``'s.
3. In place: the backward writes NTL's columns into the partner's gradient buffer (data_ptr identity), also
   one that requires grad (a saved input, as Megatron's) and the weight's from hidden states; an expanded
   (zero-stride) partner gradient is copied first, and the sum is still exact.
4. Errors: reweighing in the passthrough form names ``number_token_loss(..., lse=)``.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

import ntl_scale
from tests.helpers.data import random_logits
from tests.unit.test_compose import CAPS, VARIANTS, WEIGHT, H, V, _capped, _close, _id, _labels, _vocab


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_logits_passthrough_is_the_fused_op(variant, cap):
    vocab = _vocab()
    labels = _labels(vocab)
    base = random_logits((*labels.shape, V), seed=3)
    fused_in = base.clone().requires_grad_()
    fused = ntl_scale.ce_with_ntl(fused_in, labels, vocab, ntl_weight=WEIGHT, logit_softcap=cap, **variant)
    fused.loss.backward()
    for partner in ("torch", "ours"):
        z = base.clone().requires_grad_()
        for_ce, ntl = ntl_scale.beside_ce(z, labels, vocab, logit_softcap=cap, **variant)
        assert for_ce.shape == z.shape and for_ce.data_ptr() == z.data_ptr()
        if partner == "torch":
            ce = F.cross_entropy(_capped(for_ce, cap).flatten(0, 1), labels.flatten())
        else:
            terms = ntl_scale.per_token_ce_ntl(for_ce, labels, vocab, ntl_scale.NTLOptions(logit_softcap=cap))
            ce = terms.ce[labels != -100].mean()
        loss = ce + WEIGHT * ntl
        loss.backward()
        _close(loss, fused.loss, f"loss, partner {partner}")
        _close(z.grad, fused_in.grad, f"logits grad, partner {partner}")


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_linear_passthrough_is_the_fused_op(variant, cap):
    vocab = _vocab()
    labels = _labels(vocab)
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(*labels.shape, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64)
    hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
    fused = ntl_scale.linear_ce_with_ntl(hf, wf, labels, vocab, ntl_weight=WEIGHT, logit_softcap=cap, **variant)
    fused.loss.backward()
    for partner in ["ours"] if cap is not None else ["torch", "ours"]:  # torch's linear CE has no soft-cap
        hidden, weight = h.clone().requires_grad_(), w.clone().requires_grad_()
        h_ce, w_ce, ntl = ntl_scale.linear_beside_ce(
            hidden, weight, labels, vocab, logit_softcap=cap, chunk_tokens=8, **variant
        )
        if partner == "torch":
            ce = F.linear_cross_entropy(h_ce.flatten(0, 1), w_ce, labels.flatten())
        else:
            options = ntl_scale.NTLOptions(logit_softcap=cap)
            ce = ntl_scale.linear_ce_ntl(h_ce, w_ce, labels, vocab, options, chunk_tokens=8).ce[labels != -100].mean()
        loss = ce + WEIGHT * ntl
        loss.backward()
        _close(loss, fused.loss, f"loss, partner {partner}")
        _close(hidden.grad, hf.grad, f"hidden grad, partner {partner}")
        _close(weight.grad, wf.grad, f"weight grad, partner {partner}")


class _ProbeCE(torch.autograd.Function):
    """A mean CE whose backward hands back its own gradient buffer (or an expanded one), noting its address."""

    seen: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx, z, labels, kind):
        loss = F.cross_entropy(z.flatten(0, 1), labels.flatten())
        if kind == "saved input":  # Megatron's way: the softmax written over its input, handed back as the gradient
            torch.softmax(z, dim=-1, out=z)
        ctx.save_for_backward(z, labels)
        ctx.kind = kind
        return loss

    @staticmethod
    def backward(ctx, g):
        z, labels = ctx.saved_tensors
        if ctx.kind == "expanded":  # a zero-stride gradient: the same row for every token
            grad = torch.full((1, 1, z.shape[-1]), 0.01, dtype=z.dtype).expand_as(z)
        else:  # (a saved input requires grad: still the partner's own buffer, written in place)
            grad = z if ctx.kind == "saved input" else torch.softmax(z, dim=-1)
            grad.view(-1, z.shape[-1])[torch.arange(labels.numel()), labels.flatten()] -= 1
            grad = grad.mul_(g / labels.numel())
        _ProbeCE.seen.append(grad.data_ptr())
        return grad, None, None


@pytest.mark.parametrize("kind", ["new", "saved input", "expanded"])
def test_backward_writes_into_the_partners_gradient(kind):
    vocab = _vocab()
    labels = _labels(vocab).clamp_min(0)
    z = random_logits((*labels.shape, V), seed=6).requires_grad_()
    arrived: list[int] = []
    logits = z * 1  # (the "saved input" partner overwrites it; z stays for the reference)
    logits.register_hook(lambda g: arrived.append(g.data_ptr()))
    _ProbeCE.seen.clear()
    for_ce, ntl = ntl_scale.beside_ce(logits, labels, vocab)
    (_ProbeCE.apply(for_ce, labels, kind) + WEIGHT * ntl).backward()
    expanded = kind == "expanded"
    assert (arrived[0] == _ProbeCE.seen[0]) is not expanded
    # the sum is exact either way: the partner's gradient plus NTL's (number_token_loss's own)
    zr = z.detach().clone().requires_grad_()
    ntl_scale.number_token_loss(zr, labels, vocab).backward()
    if expanded:
        partner = torch.full_like(zr, 0.01)
    else:
        partner = torch.softmax(zr.detach(), -1)
        partner.view(-1, V)[torch.arange(labels.numel()), labels.flatten()] -= 1
        partner /= labels.numel()
    _close(z.grad, partner + WEIGHT * zr.grad, "partner + NTL")


def test_reweigh_is_refused_with_the_alternative():
    vocab = _vocab()
    labels = _labels(vocab)
    z = random_logits((*labels.shape, V), seed=7)
    with pytest.raises(ValueError, match=r"number_token_loss\(\.\.\., reweigh=True, lse=\)"):
        ntl_scale.beside_ce(z, labels, vocab, reweigh=True)
    with pytest.raises(ValueError, match="linear_number_token_loss"):
        ntl_scale.linear_beside_ce(z[..., :H], torch.zeros(V, H, dtype=z.dtype), labels, vocab, reweigh=True)


def test_linear_backward_writes_into_the_partners_weight_gradient():
    """From hidden states: the weight's K number rows go into the partner's ``[V, H]`` gradient (a matmul's,
    handed back as it came) in place, and the sum equals the partner's plus ``linear_number_token_loss``'s."""
    vocab = _vocab()
    labels = _labels(vocab).clamp_min(0)
    gen = torch.Generator().manual_seed(10)
    h0 = torch.randn(*labels.shape, H, generator=gen, dtype=torch.float64)
    w0 = torch.randn(V, H, generator=gen, dtype=torch.float64).requires_grad_()
    weight = w0 * 1
    returned: list[int] = []
    weight.register_hook(lambda g: returned.append(g.data_ptr()))  # what the node hands back
    h_ce, w_ce, ntl = ntl_scale.linear_beside_ce(h0, weight, labels, vocab)
    partner_buffer: list[int] = []
    w_ce.register_hook(lambda g: partner_buffer.append(g.data_ptr()))  # the partner's gradient, as it arrives
    (F.cross_entropy((h_ce @ w_ce.t()).flatten(0, 1), labels.flatten()) + WEIGHT * ntl).backward()
    assert returned == partner_buffer
    w_ref = w0.detach().clone().requires_grad_()
    partner = torch.autograd.grad(F.cross_entropy((h0 @ w_ref.t()).flatten(0, 1), labels.flatten()), w_ref)[0]
    ntl_scale.linear_number_token_loss(h0, w_ref, labels, vocab).backward()
    _close(w0.grad, partner + WEIGHT * w_ref.grad, "partner + NTL, weight")


def test_partner_gradient_in_another_layout():
    """A partner that runs on the sequence-first transpose (``[S, B, V]``, Megatron's layout) hands back a dense
    gradient whose ``[B, S]`` dims do not merge: NTL's columns must still go in (the dense form as reference)."""
    vocab = _vocab()
    labels = _labels(vocab).clamp_min(0)
    z = random_logits((*labels.shape, V), seed=7).requires_grad_()
    for_ce, ntl = ntl_scale.beside_ce(z, labels, vocab)
    ce = F.cross_entropy(for_ce.transpose(0, 1).reshape(-1, V), labels.t().reshape(-1))
    (ce + WEIGHT * ntl).backward()
    zr = z.detach().clone().requires_grad_()
    ce_r = F.cross_entropy(zr.transpose(0, 1).reshape(-1, V), labels.t().reshape(-1))
    (ce_r + WEIGHT * ntl_scale.number_token_loss(zr, labels, vocab)).backward()
    _close(z.grad, zr.grad, "transposed partner")


@pytest.mark.parametrize("option", [dict(label_smoothing=0.1), dict(z_loss_weight=1e-4)])
def test_ce_options_the_partner_never_sees_are_refused(option):
    """``beside_ce`` computes NTL alone: a CE option passed to it would change nothing (the partner CE runs
    without it), so it must be refused, not dropped."""
    vocab = _vocab()
    labels = _labels(vocab)
    z = random_logits((*labels.shape, V), seed=8)
    with pytest.raises(ValueError):
        ntl_scale.beside_ce(z, labels, vocab, **option)
