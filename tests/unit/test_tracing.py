"""The fused CE + NTL under graph tracing (``make_fx``, as torchtitan's graph trainer traces its chunked loss).

1. A chunk loss traced symbolically with its backward inside (what ``ChunkedLossWrapper`` does per chunk)
   replays with gradients: loss and hidden-state gradient equal the float64 reference (the fused op's forward
   wrote into a work buffer with ``aten.sub.out``, which the replay refuses once autograd records it).
2. The first use of a number table inside a trace leaves none of the trace's (fake) tensors in its
   caches: eager calls afterwards still equal the reference (they were off by the NTL term).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ntl_scale import NTLOptions, NumberVocab, per_token_ce_ntl
from tests.helpers import reference

V = 24


def _chunk_loss(vocab: NumberVocab, weight: torch.Tensor):  # type: ignore[no-untyped-def]
    """One chunk as ``ChunkedLossWrapper`` runs it: a leaf of the hidden states, the head, the loss, its backward."""

    def step(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = hidden.detach().requires_grad_(True)
        terms = per_token_ce_ntl(leaf @ weight.T, labels, vocab, NTLOptions())  # the vocabulary: the head's
        loss = terms.ce.sum() + 0.3 * terms.ntl.sum()
        (grad,) = torch.autograd.grad(loss, leaf)
        return loss.detach(), grad

    return step


def _expected(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab: NumberVocab
) -> tuple[torch.Tensor, torch.Tensor]:
    h = hidden.double().requires_grad_(True)
    ce, ntl, _ = reference.naive_per_token(h @ weight.detach().double().T, labels, vocab)
    loss = ce.sum() + 0.3 * ntl.sum()
    loss.backward()
    return loss.detach().float(), h.grad.float()


def test_traced_chunk_loss_replays_with_gradients_and_keeps_no_traced_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 8, 6, generator=g)
    weight = torch.nn.Parameter(torch.randn(V, 6, generator=g))  # lm_head's: the replayed logits need grad
    labels = torch.randint(0, V, (2, 8), generator=g)
    labels[:, ::2] = torch.randint(2, 12, (2, 4), generator=g)  # number tokens 2..11 carry NTL
    labels[0, 1] = -100
    vocab = NumberVocab(list(range(2, 12)), list(range(10)), V)  # first used inside the trace
    step = _chunk_loss(vocab, weight)
    traced = make_fx(step, tracing_mode="symbolic", _allow_non_fake_inputs=True)(hidden, labels)
    loss, grad = _expected(hidden, weight, labels, vocab)
    for name, run in (("traced", traced), ("eager after the trace", step)):
        got_loss, got_grad = run(hidden, labels)
        torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(got_grad, grad, rtol=1e-5, atol=1e-6, msg=name)
