"""Hugging Face with Liger-Kernel's fused linear CE kept (``ce_kernel="framework"``), under Triton's CPU interpreter.

A tiny Llama patched by ``apply_liger_kernel_to_llama(fused_linear_cross_entropy=True)`` first, then
``apply_ntl_to_hf_model(..., options=NTLOptions(ce_kernel="framework"), chunked=True)``: Liger's forward computes
the CE from the hidden states (no logits are returned), NTL comes from the number rows of the output weight; the
loss and every parameter's gradient equal the plain model with ntl_scale's fused op, for the step counts
``ntl_trainer_class`` hands in, and NTL's gradients are added into Liger's in place (the backward allocates what
Liger's alone does, plus NTL's ``[T, H]`` product).
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
liger = pytest.importorskip("liger_kernel.transformers", reason="liger-kernel (dev extra)")
transformers = pytest.importorskip("transformers")

import ntl_scale  # noqa: E402
from ntl_scale.integrations.hf import apply_ntl_to_hf_model  # noqa: E402
from tests.helpers.dispatch import OpOutputs, allocated  # noqa: E402


@pytest.fixture(autouse=True)
def _in_own_process(request):
    skip_unless_own_process(request, OWN_PROCESS)


def _step(with_liger: bool, kernel: str | None):
    """Loss, gradients, logged means and the backward's tensors; ``kernel=None``: the model's own loss."""
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    config = transformers.LlamaConfig(**sizes, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    vocab = ntl_scale.NumberVocab.from_id_to_token({i: str(i) for i in range(10)}, vocab_size=64)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    ids = torch.where(torch.rand(2, 12, generator=g) < 0.5, torch.randint(0, 10, (2, 12), generator=g), ids)
    labels = ids.clone()
    labels[0, :2] = -100
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    if with_liger:
        liger.apply_liger_kernel_to_llama(model=model, fused_linear_cross_entropy=True, rope=False, rms_norm=False,
                                          swiglu=False)  # fmt: skip
    options = ntl_scale.NTLOptions(ce_kernel=kernel or "ntl_scale")
    loss = apply_ntl_to_hf_model(model, vocab, ntl_weight=0.3, options=options, chunked=with_liger) if kernel else None
    out = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor([20.0, 9.0]) if loss else None)
    with OpOutputs() as made:
        out.loss.backward()
    means = loss.pop_means() if loss else {}
    return out, {name: p.grad for name, p in model.named_parameters()}, means, made.records


def test_liger_fused_linear_ce_beside_ntl_is_the_fused_op():
    want, want_grads, want_means, _ = _step(False, "ntl_scale")
    got, grads, means, made = _step(True, "framework")
    assert got.logits is None  # Liger's fused linear CE ran: the logits were never built
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert means["ce"] == pytest.approx(want_means["ce"], rel=1e-6)
    assert means["ntl"] == pytest.approx(want_means["ntl"], rel=1e-6)
    assert set(means) == {"ce", "ntl", "number_choice_accuracy"}
    # NTL's gradients are added into Liger's in place: the backward makes what Liger's alone makes, plus NTL's
    # [T, H] product (no [V, H] fill, no [V, H] or [T, H] sum)
    plain = _step(True, None)[-1]
    assert allocated(made, 64 * 32) == allocated(plain, 64 * 32), allocated(made, 64 * 32)
    assert allocated(made, 24 * 32) == sorted([*allocated(plain, 24 * 32), "mm"]), allocated(made, 24 * 32)
