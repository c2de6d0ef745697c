"""Half-precision chunked gradients at scale (issue 23, defect 3).

The chunked op's weight gradient is a sum over every token, ``sum_t w_t pi_t h_t^T``. Built in the
weight's half dtype it overflowed fp16 (a frequent token with ``p ~ 0.7`` and a hidden channel of 12
over 8192 tokens: ``grad_W = inf`` where the materialised path gives 8.2) and lost bf16 precision with
the chunk count. Sections:
1. The issue's repro, fp16 and bf16, several chunk sizes: ``grad_W`` and ``grad_h`` finite, equal to
   the materialised half-precision path (``ce_with_ntl`` on ``hidden @ W^T`` in the same dtype) within
   the rounding of one product, and as close to the float64 reference as that path.
2. The recomputing backward (arbitrary per-token upstream gradients) at the same scale.

8192 tokens, a 64-column vocabulary and 16 hidden units: cheap on two CPU cores.
"""

from __future__ import annotations

import pytest
import torch

import ntl_scale
from ntl_scale.linear import linear_ce_ntl, linear_ce_with_ntl

TOKENS, HIDDEN, FREQUENT = 8192, 16, 7
# Relative rounding of one half-precision number (unit roundoff).
ROUNDING = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
SUBNORMAL_STEP = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}


def _vocab() -> ntl_scale.NumberVocab:
    tokens = [f"w{i}" for i in range(64)]
    for digit in range(10):
        tokens[20 + digit] = str(digit)
    return ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=64)


def _inputs(seed: int = 0):
    """Token ``FREQUENT`` has p ~ 0.7 at every position; hidden channel 0 is 12 everywhere."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    hidden[:, 0] = 12.0
    weight = torch.randn(64, HIDDEN, generator=g, dtype=torch.float64) * 0.05
    weight[:, 0] = 0.0
    weight[FREQUENT, 0] = 0.42  # z = 5.0 against about 0 for the other 63 columns: p ~ 0.7
    labels = torch.randint(0, 64, (TOKENS,), generator=g)
    labels[labels == FREQUENT] = 20  # never the label: its gradient is the pure sum of pi_t h_t
    labels[::3] = 20 + torch.randint(0, 10, (len(labels[::3]),), generator=g)  # number tokens for NTL
    return hidden, weight, labels


def _materialised(hidden, weight, labels, vocab, upstream=None):
    """``ce_with_ntl`` (or per-token terms) on ``hidden @ W^T``: autograd through the logits."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = h @ w.t()
    if upstream is None:
        ntl_scale.ce_with_ntl(logits, labels, vocab).loss.backward()
    else:
        terms = ntl_scale.per_token_ce_ntl(logits, labels, vocab)
        (upstream[0] * terms.ce + upstream[1] * terms.ntl).sum().backward()
    return h.grad.double(), w.grad.double()


def _chunked(hidden, weight, labels, vocab, chunk_tokens, upstream=None):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if upstream is None:
        linear_ce_with_ntl(h, w, labels, vocab, chunk_tokens=chunk_tokens).loss.backward()
    else:
        terms = linear_ce_ntl(h, w, labels, vocab, chunk_tokens=chunk_tokens)
        (upstream[0] * terms.ce + upstream[1] * terms.ntl).sum().backward()
    assert h.grad.dtype == hidden.dtype and w.grad.dtype == weight.dtype
    return h.grad.double(), w.grad.double()


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def _check(dtype, chunked, materialised, reference, what):
    for name, c, m, r in zip(("d hidden", "d weight"), chunked, materialised, reference):
        assert torch.isfinite(m).all(), f"{what} {name}: the materialised half path itself is not finite"
        assert torch.isfinite(c).all(), f"{what} {name}: chunked gradient is not finite"
        # equal to the materialised half path within the rounding of one product (a few units of
        # the dtype's rounding of the gradient's largest entry), element by element; plus a few steps
        # of fp16's subnormal spacing: hidden gradients of a mean over 8192 tokens are about 1e-5
        bound = 4 * ROUNDING[dtype] * float(r.abs().max()) + 4 * SUBNORMAL_STEP[dtype]
        worst = float((c - m).abs().max())
        assert worst <= bound, f"{what} {name}: chunked differs from materialised by {worst:.3g} > {bound:.3g}"
        # and no further from the float64 truth than the materialised half path (plus one rounding)
        err_c, err_m = _relative(c, r), _relative(m, r)
        assert err_c <= 1.5 * err_m + ROUNDING[dtype], f"{what} {name}: error {err_c:.3g} vs materialised {err_m:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_issue_repro_frequent_token_matches_the_materialised_half_path(dtype):
    vocab = _vocab()
    hidden64, weight64, labels = _inputs()
    hidden, weight = hidden64.to(dtype), weight64.to(dtype)
    reference = _materialised(hidden.double(), weight.double(), labels, vocab)  # fp64 of the same inputs
    materialised = _materialised(hidden, weight, labels, vocab)
    # the issue's figure: the true gradient of the frequent token's row is about 8.2
    assert 7.5 < float(reference[1][FREQUENT, 0]) < 9.0
    for chunk_tokens in (None, 512, 64):
        chunked = _chunked(hidden, weight, labels, vocab, chunk_tokens)
        _check(dtype, chunked, materialised, reference, f"{dtype} chunk_tokens={chunk_tokens}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_recomputing_backward_at_scale(dtype):
    vocab = _vocab()
    hidden64, weight64, labels = _inputs(seed=1)
    hidden, weight = hidden64.to(dtype), weight64.to(dtype)
    g = torch.Generator().manual_seed(2)
    # per-token upstream gradients of a mean: not one scale times the token weights
    upstream = torch.rand(2, TOKENS, generator=g, dtype=torch.float64) / TOKENS
    reference = _materialised(hidden.double(), weight.double(), labels, vocab, upstream)
    materialised = _materialised(hidden, weight, labels, vocab, upstream.float())
    chunked = _chunked(hidden, weight, labels, vocab, 64, upstream.float())
    _check(dtype, chunked, materialised, reference, f"{dtype} recomputed")
