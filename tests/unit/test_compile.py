"""``torch.compile`` of the loss: whole graphs (``fullgraph=True``, Inductor on CPU) equal to eager.

Sections:
1. ``ce_with_ntl`` with every NTL variant (WAS, MSE, Huber, number-level with decimals, WAS with
   reweighing and squashing) in one compiled function: no graph break, and the losses and the
   logits' gradient equal the eager ones (fp32, 1e-6).
2. The chunked op ``linear_ce_ntl`` (``proportional_grad=True``, the training setting) compiles whole
   and equals eager for the hidden states' and the weight's gradients.
3. Tensor parallelism: the fused op on a vocab shard with its two all-reduces (gloo, 2 processes)
   compiles whole, Dynamo tracing the collectives, and equals eager on every rank.

A graph break makes ``fullgraph=True`` raise, so each test fails if one comes back.
"""

from __future__ import annotations

import pytest
import torch

import ntl_scale
from tests.helpers.distributed import run_workers

VARIANTS = [
    {"loss": "was"},
    {"loss": "mse"},
    {"loss": "huber", "huber_delta": 2.0},
    {"loss": "number", "float_level": True},
    {"loss": "was", "reweigh": True, "squash_factor": 3.0},
]


def _vocab() -> ntl_scale.NumberVocab:
    tokens = {i: (str(i - 10) if 10 <= i < 20 else "." if i == 20 else f"w{i}") for i in range(61)}
    return ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=64)  # "." (id 20) is found


def _labels(generator: torch.Generator) -> torch.Tensor:
    labels = torch.randint(0, 24, (3, 20), generator=generator)  # mostly digits and the decimal point
    labels[0, :4] = -100
    return labels


def _eager_and_compiled(fn, *tensors):
    """``fn``'s outputs and the gradients of their sum, run eagerly and compiled whole."""
    results = []
    for run in (fn, torch.compile(fn, fullgraph=True)):
        inputs = [t.detach().clone().requires_grad_() for t in tensors]
        outputs = run(*inputs)
        torch.stack(outputs).sum().backward()
        results.append(([o.detach() for o in outputs], [t.grad for t in inputs]))
    return results


def test_every_variant_compiles_whole_and_equals_eager():
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    vocab, labels = _vocab(), _labels(generator)
    logits = torch.randn(3, 20, 64, generator=generator) * 3

    def losses(z):
        return [ntl_scale.ce_with_ntl(z, labels, vocab, ntl_weight=0.3, **kw).loss for kw in VARIANTS]

    (eager, eager_grad), (compiled, compiled_grad) = _eager_and_compiled(losses, logits)
    for variant, want, got in zip(VARIANTS, eager, compiled):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=str(variant))
    torch.testing.assert_close(compiled_grad[0], eager_grad[0], rtol=1e-6, atol=1e-7)
    assert eager_grad[0].abs().sum() > 0


def test_chunked_op_compiles_whole_and_equals_eager():
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(1)
    vocab, labels = _vocab(), _labels(generator)
    hidden, weight = torch.randn(3, 20, 16, generator=generator), torch.randn(64, 16, generator=generator)

    def loss(h, w):
        terms = ntl_scale.linear_ce_ntl(h, w, labels, vocab, chunk_tokens=16, proportional_grad=True)
        return [terms.ce.sum() / (labels != -100).sum() + 0.3 * terms.ntl.sum() / terms.number_mask.sum()]

    (eager, eager_grads), (compiled, compiled_grads) = _eager_and_compiled(loss, hidden, weight)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-6)
    for want, got in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _tensor_parallel_compiled(ctx):
    torch.manual_seed(2)
    vocab, labels = _vocab(), _labels(torch.Generator().manual_seed(2))
    logits = torch.randn(3, 20, 64) * 3  # the same on every rank: each takes its half of the columns
    shard = logits[..., ctx.tp_rank * 32 : (ctx.tp_rank + 1) * 32]

    def loss(z):
        ce, ntl, mask = ntl_scale.vocab_parallel_ce_ntl(z, labels, vocab, tp_group=ctx.tp_group)
        return [ce.sum() / (labels != -100).sum() + 0.3 * ntl.sum() / mask.sum()]

    (eager, eager_grad), (compiled, compiled_grad) = _eager_and_compiled(loss, shard)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled_grad[0], eager_grad[0], rtol=1e-6, atol=1e-7)
    whole = ntl_scale.ce_with_ntl(logits, labels, vocab, ntl_weight=0.3).loss  # one device, full logits
    torch.testing.assert_close(compiled[0], whole, rtol=1e-6, atol=1e-6)


@pytest.mark.distributed
def test_tensor_parallel_op_compiles_whole_with_its_collectives():
    run_workers(2, 2, _tensor_parallel_compiled)
