"""NTL alone beside another cross entropy: ``partner CE + w * NTL`` is the fused op, on one device.

Sections:
1. Logits: ``F.cross_entropy`` and torchtitan's ``cross_entropy_loss`` as partners of
   ``number_token_loss``; the loss and the logits' gradient equal ``ce_with_ntl``'s in float64 for every
   variant, soft-capped or not, reweighed with the partner's log-sum-exp (``torch.logsumexp``, or ours).
2. Hidden states: ``F.linear_cross_entropy`` as partner of ``linear_number_token_loss`` (reweighed with
   ``torch.logsumexp`` of the logits, or the ``lse`` of ``linear_ce_ntl``); the loss and the gradients of the
   hidden states and the weight equal ``linear_ce_with_ntl``'s; the weight gradient of NTL alone is 0 off
   the number rows.
3. The per-token form: ``number_choice_hit`` is the arg-max among the number columns (written out), ``hit``
   and ``ce`` are 0; with ``lse`` and reweighing the logits' other columns are not read (op by op).
4. Errors: reweighing from hidden states without ``lse``, ``lse`` beside CE, an ``lse`` of the wrong shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ntl_scale
from tests.helpers.data import random_labels, random_logits

V, H, WEIGHT = 64, 8, 0.3
VARIANTS = [
    dict(loss="was"),
    dict(loss="was", squash_factor=4.0),
    dict(loss="mse"),
    dict(loss="mae"),
    dict(loss="huber", huber_delta=0.7),
    dict(loss="number"),
    dict(loss="number", float_level=True),
]
CAPS = [None, 3.0]


def _id(v: dict) -> str:
    return "-".join(f"{k}={x}" for k, x in v.items())


def _vocab() -> ntl_scale.NumberVocab:
    tokens = [f"w{i}" for i in range(40)]
    for value, position in zip(range(10), [3, 7, 8, 15, 21, 22, 30, 31, 36, 39]):
        tokens[position] = str(value)
    tokens[5] = "."
    return ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=V)


def _labels(vocab: ntl_scale.NumberVocab) -> torch.Tensor:
    labels = random_labels(vocab, (3, 12), 40, seed=2, number_fraction=0.5)
    digits = vocab.ids.tolist()
    labels[0, 2:6] = torch.tensor([digits[1], digits[2], digits[3], digits[0]])
    labels[1, 4:9] = torch.tensor([digits[4], digits[5], vocab.decimal_point_id, digits[6], digits[7]])
    return labels


def _capped(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-12, rtol=1e-12, msg=what)


def _titan_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from torchtitan.components.loss import cross_entropy_loss

    # torchtitan computes in fp32 (``pred.float()``): compare it in fp32 at fp32 rounding, as its own tests do
    return cross_entropy_loss(logits, labels) / (labels != -100).sum()


# -------------------------------------------------------------------------------------------------- 1. logits


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("reweigh", [False, True])
@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_logits_partner_plus_ntl_is_the_fused_op(variant, reweigh, cap):
    vocab = _vocab()
    labels = _labels(vocab)
    base = random_logits((*labels.shape, V), seed=3)
    fused_in = base.clone().requires_grad_()
    options = dict(ntl_weight=WEIGHT, reweigh=reweigh, logit_softcap=cap)
    fused = ntl_scale.ce_with_ntl(fused_in, labels, vocab, **options, **variant)
    fused.loss.backward()
    for partner in ("torch", "ours"):
        z = base.clone().requires_grad_()
        capped = _capped(z, cap)
        if partner == "torch":
            ce = F.cross_entropy(capped.flatten(0, 1), labels.flatten())
            lse = torch.logsumexp(capped, dim=-1)
        else:  # our fused CE as the partner: its lse, with the cap applied by it
            terms = ntl_scale.per_token_ce_ntl(z, labels, vocab, ntl_scale.NTLOptions(logit_softcap=cap))
            ce, lse = terms.ce[labels != -100].mean(), terms.lse
        ntl = ntl_scale.number_token_loss(
            z, labels, vocab, reweigh=reweigh, logit_softcap=cap, lse=lse if reweigh else None, **variant
        )
        loss = ce + WEIGHT * ntl
        loss.backward()
        _close(loss, fused.loss, f"loss, partner {partner}")
        _close(ntl, fused.ntl, f"ntl, partner {partner}")
        _close(z.grad, fused_in.grad, f"logits grad, partner {partner}")


@pytest.mark.parametrize("variant", [dict(loss="was"), dict(loss="number")], ids=_id)
def test_torchtitan_cross_entropy_as_partner(variant):
    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 (scripts/setup.sh --dev)")
    vocab = _vocab()
    labels = _labels(vocab)
    base = random_logits((*labels.shape, V), seed=4, dtype=torch.float32)
    fused_in = base.clone().requires_grad_()
    fused = ntl_scale.ce_with_ntl(fused_in, labels, vocab, ntl_weight=WEIGHT, **variant)
    fused.loss.backward()
    z = base.clone().requires_grad_()
    loss = _titan_ce(z, labels) + WEIGHT * ntl_scale.number_token_loss(z, labels, vocab, **variant)
    loss.backward()
    torch.testing.assert_close(loss, fused.loss, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(z.grad, fused_in.grad, atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------------------------------------- 2. hidden states


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("reweigh", [False, True])
@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_linear_partner_plus_ntl_is_the_fused_op(variant, reweigh, cap):
    vocab = _vocab()
    labels = _labels(vocab)
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(*labels.shape, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64)
    hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
    fused = ntl_scale.linear_ce_with_ntl(
        hf, wf, labels, vocab, ntl_weight=WEIGHT, reweigh=reweigh, logit_softcap=cap, chunk_tokens=8, **variant
    )
    fused.loss.backward()
    # torch's chunked linear CE has no soft-cap: that partner runs uncapped, ours with the cap
    partners = ["ours"] if cap is not None else ["torch", "ours"]
    for partner in partners:
        hidden, weight = h.clone().requires_grad_(), w.clone().requires_grad_()
        if partner == "torch":
            ce = F.linear_cross_entropy(hidden.flatten(0, 1), weight, labels.flatten(), ignore_index=-100)
            lse = torch.logsumexp(hidden @ weight.T, dim=-1) if reweigh else None
        else:
            options = ntl_scale.NTLOptions(logit_softcap=cap)
            terms = ntl_scale.linear_ce_ntl(hidden, weight, labels, vocab, options, chunk_tokens=8)
            ce, lse = terms.ce[labels != -100].mean(), terms.lse
        ntl = ntl_scale.linear_number_token_loss(
            hidden, weight, labels, vocab, reweigh=reweigh, logit_softcap=cap, lse=lse if reweigh else None,
            chunk_tokens=8, **variant,
        )  # fmt: skip
        loss = ce + WEIGHT * ntl
        loss.backward()
        _close(loss, fused.loss, f"loss, partner {partner}")
        _close(hidden.grad, hf.grad, f"hidden grad, partner {partner}")
        _close(weight.grad, wf.grad, f"weight grad, partner {partner}")


def test_linear_ntl_alone_touches_only_the_number_rows():
    vocab = _vocab()
    labels = _labels(vocab)
    hidden = torch.randn(*labels.shape, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    ntl_scale.linear_number_token_loss(hidden, weight, labels, vocab, logit_softcap=2.0).backward()
    others = torch.ones(V, dtype=torch.bool)
    others[vocab.ids] = False
    assert weight.grad is not None and hidden.grad is not None
    assert torch.equal(weight.grad[others], torch.zeros_like(weight.grad[others]))
    assert weight.grad[vocab.ids].abs().sum() > 0


# ------------------------------------------------------------------------------------------ 3. per-token form


def test_number_choice_hit_is_the_arg_max_among_the_number_columns():
    vocab = _vocab()
    labels = _labels(vocab)
    logits = random_logits((*labels.shape, V), seed=6)
    logits[..., 50] += 100.0  # a non-number column wins every full arg-max: number accuracy would be 0
    for linear in (False, True):
        options = ntl_scale.NTLOptions()
        if linear:
            eye = torch.eye(V, dtype=torch.float64)
            terms = ntl_scale.linear_ce_ntl(logits, eye, labels, vocab, options, need_ce=False)
        else:
            terms = ntl_scale.per_token_ce_ntl(logits, labels, vocab, options, need_ce=False)
        ids = vocab.ids
        choice = ids[logits[..., ids].argmax(dim=-1)]
        want = (choice == labels) & terms.number_mask
        assert torch.equal(terms.number_choice_hit, want) and want.any() and not want.all()
        assert not terms.hit.any() and not terms.ce.any()
    full = ntl_scale.per_token_ce_ntl(logits, labels, vocab)
    assert not full.number_choice_hit.any() and not full.hit.any()  # the full arg-max is column 50


def test_reweigh_with_lse_reads_only_the_number_columns():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for a in args:
                if isinstance(a, torch.Tensor) and a.shape[-1:] == (V,) and a.dim() > 1:
                    self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    vocab = _vocab()
    labels = _labels(vocab)
    logits = random_logits((*labels.shape, V), seed=7).requires_grad_()
    lse = torch.logsumexp(logits, dim=-1).detach()
    with Reads() as mode:
        ntl_scale.number_token_loss(logits, labels, vocab, reweigh=True, lse=lse, logit_softcap=3.0).backward()
    assert set(mode.ops) <= {"index_select", "view", "zeros", "index_add_", "_to_copy", "reshape", "detach"}, mode.ops
    assert "exp" not in mode.ops and "amax" not in mode.ops and "logsumexp" not in mode.ops


# ---------------------------------------------------------------------------------------------------- 4. errors


def test_errors_name_the_value_and_the_fix():
    vocab = _vocab()
    labels = _labels(vocab)
    hidden, weight = torch.randn(*labels.shape, H), torch.randn(V, H)
    with pytest.raises(ValueError, match=r"lse=.*linear_ce_ntl"):
        ntl_scale.linear_number_token_loss(hidden, weight, labels, vocab, reweigh=True)
    logits = torch.randn(*labels.shape, V)
    with pytest.raises(ValueError, match="need_ce=False"):
        ntl_scale.per_token_ce_ntl(logits, labels, vocab, lse=torch.zeros(labels.shape))
    with pytest.raises(ValueError, match=r"shaped like the labels \(3, 12\), got \(36,\)"):
        ntl_scale.number_token_loss(logits, labels, vocab, reweigh=True, lse=torch.zeros(36))
