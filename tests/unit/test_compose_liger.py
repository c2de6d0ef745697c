"""Liger-Kernel's cross entropy as the partner of NTL alone, under Triton's CPU interpreter (tiny shapes).

``liger_cross_entropy + w * number_token_loss`` on logits and ``liger_fused_linear_cross_entropy + w *
linear_number_token_loss`` from hidden states, and the same partners consuming ``beside_ce`` /
``linear_beside_ce``'s tensors (the passthrough form), equal ``ce_with_ntl`` / ``linear_ce_with_ntl``: loss and
gradients (logits; hidden states and weight), every variant, at fp32 rounding (Liger computes in fp32). Liger's
``softcap`` fails under the interpreter (``AttributeError: 'float' object has no attribute 'to'`` in its kernel),
so soft-capping beside it is left to the GPU check. Liger writes its gradient into the logits during its
forward, so NTL runs first; it returns no log-sum-exp, so reweighing is not composed with it. Cut
Cross-Entropy 25.1.1 is not a partner here: its kernel fails under the interpreter (``docs/kernels.md``).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.triton_interpreter import own_process, run_in_own_process, skip_unless_own_process

OWN_PROCESS = own_process()


def test_interpreter_tests_in_their_own_process():
    """Runs this file again in a fresh process with ``TRITON_INTERPRET=1`` when Triton was imported first."""
    if OWN_PROCESS:
        pytest.skip("this process runs the tests itself")
    run_in_own_process(__file__)


pytest.importorskip("triton", reason="triton is not installed (dev extra)")
liger = pytest.importorskip("liger_kernel.transformers.functional", reason="liger-kernel (dev extra)")

import ntl_scale  # noqa: E402
from tests.unit.test_compose import VARIANTS, WEIGHT, _id, _labels, _vocab  # noqa: E402

V, H = 64, 16
TOL = dict(atol=2e-6, rtol=2e-5)


@pytest.fixture(autouse=True)
def _in_own_process(request):
    skip_unless_own_process(request, OWN_PROCESS)


@pytest.mark.parametrize("form", ["number_token_loss", "beside_ce"])
@pytest.mark.parametrize("cap", [None])  # Liger's softcap fails under the interpreter (a float .to())
@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_liger_cross_entropy_plus_ntl_is_the_fused_op(variant, cap, form):
    vocab = _vocab()
    labels = _labels(vocab)
    base = torch.randn(*labels.shape, V, generator=torch.Generator().manual_seed(8)) * 3
    fused_in = base.clone().requires_grad_()
    fused = ntl_scale.ce_with_ntl(fused_in, labels, vocab, ntl_weight=WEIGHT, logit_softcap=cap, **variant)
    fused.loss.backward()
    z = base.clone().requires_grad_()
    if form == "beside_ce":  # one node: NTL's columns go into Liger's gradient (its logits buffer) in place
        for_ce, ntl = ntl_scale.beside_ce(z, labels, vocab, logit_softcap=cap, **variant)
    else:
        for_ce, ntl = z, ntl_scale.number_token_loss(z, labels, vocab, logit_softcap=cap, **variant)
    # NTL before Liger's in-place CE in both forms
    loss = liger.liger_cross_entropy(for_ce.flatten(0, 1), labels.flatten(), softcap=cap) + WEIGHT * ntl
    loss.backward()
    torch.testing.assert_close(loss, fused.loss, **TOL)
    torch.testing.assert_close(z.grad, fused_in.grad, **TOL)


@pytest.mark.parametrize("form", ["number_token_loss", "beside_ce"])
@pytest.mark.parametrize("cap", [None])  # Liger's softcap fails under the interpreter (a float .to())
@pytest.mark.parametrize("variant", [dict(loss="was"), dict(loss="mse"), dict(loss="number")], ids=_id)
def test_liger_fused_linear_cross_entropy_plus_ntl_is_the_fused_op(variant, cap, form):
    vocab = _vocab()
    labels = _labels(vocab)
    gen = torch.Generator().manual_seed(9)
    h, w = torch.randn(*labels.shape, H, generator=gen), torch.randn(V, H, generator=gen) / 2
    hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
    fused = ntl_scale.linear_ce_with_ntl(hf, wf, labels, vocab, ntl_weight=WEIGHT, logit_softcap=cap, **variant)
    fused.loss.backward()
    hidden, weight = h.clone().requires_grad_(), w.clone().requires_grad_()
    if form == "beside_ce":
        h_ce, w_ce, ntl = ntl_scale.linear_beside_ce(hidden, weight, labels, vocab, logit_softcap=cap, **variant)
    else:
        h_ce, w_ce = hidden, weight
        ntl = ntl_scale.linear_number_token_loss(hidden, weight, labels, vocab, logit_softcap=cap, **variant)
    ce = liger.liger_fused_linear_cross_entropy(h_ce.flatten(0, 1), w_ce, labels.flatten(), softcap=cap)
    loss = ce + WEIGHT * ntl
    loss.backward()
    torch.testing.assert_close(loss, fused.loss, **TOL)
    torch.testing.assert_close(hidden.grad, hf.grad, **TOL)
    torch.testing.assert_close(weight.grad, wf.grad, **TOL)
