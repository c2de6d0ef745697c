"""The chunked op (``ntl_scale.linear``) does only the work the requested gradients need (issue 29, item 8).

Under ``torch.no_grad()`` (evaluation with ``train.chunked_loss`` or Megatron's ``--ntl-chunked``) a
chunk is its logits matmul and the softmax statistics: the matmul FLOPs, counted by
``torch.utils.flop_counter.FlopCounterMode`` (with the in-place ``addmm_`` added), are exactly the
forward's ``2 T V H`` (arithmetic written out here), and no ``[V, H]``-sized buffer (the
weight-gradient accumulator, the half-precision product buffer) nor any ``[T, V]`` one is allocated
(a test-only dispatch mode records the shape of every new tensor). Before the fix it did the
backward's two matmuls as well (3.00x) and allocated both buffers. The loss equals the float64
full-logit reference (``tests/helpers/reference.py``) and, bit for bit, the loss of the same call
with gradients. With gradients for only one of ``hidden`` and ``weight`` (a frozen output layer, as
with LoRA) the other's matmul and buffer are skipped too, and the gradients still equal float64
autograd. Under tensor parallelism (two ranks in threads, an in-memory all-reduce) the collectives
are the same with and without gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

import ntl_scale
from ntl_scale.linear import linear_ce_with_ntl
from tests.helpers.distributed import run_ranks_in_threads
from tests.helpers.reference import naive_per_token, naive_reduce

TOKENS, VOCAB, HIDDEN, CHUNK = 24, 202, 48, 8  # TOKENS < HIDDEN: a [T, V] buffer is flagged as well
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _addmm_flops(self_shape, a_shape, b_shape, *_, **__) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]  # [n, k] @ [k, m]: n m multiply-adds over k


def _flops() -> FlopCounterMode:
    """torch's matmul FLOP counter, which leaves out the in-place ``addmm_`` (the op accumulates with it)."""
    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_flops})


class AllocationShapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns in new storage (views, in-place and ``out=``
    results share an argument's storage and are left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.shapes.append((str(func), tuple(t.shape)))
        return out

    def at_least(self, elements: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(f, s) for f, s in self.shapes if torch.Size(s).numel() >= elements]


def _problem(dtype: torch.dtype, seed: int = 0):
    vocab = ntl_scale.NumberVocab.from_id_to_token({60 + d: str(d) for d in range(10)}, vocab_size=VOCAB)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    labels = torch.where(torch.arange(TOKENS) % 3 == 0, 60 + labels % 10, labels)
    labels[5] = -100
    return vocab, hidden, weight, labels


def _reference(hidden, weight, labels, vocab, **options):
    """Float64 loss of the full logits ``h W^T`` (mean CE + 0.3 mean NTL) and its gradients."""
    h, w = (t.detach().double().requires_grad_() for t in (hidden, weight))
    ce, ntl, mask = naive_per_token(h @ w.t(), labels, vocab, **options)
    loss = naive_reduce(ce, labels != -100, None, "mean") + 0.3 * naive_reduce(ntl, mask, None, "mean")
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _close(actual, expected, dtype, what):
    tol = TOL[dtype]
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(
        actual.detach().double(), expected, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "inputs_without_grad"])
@pytest.mark.parametrize("options", [{}, {"loss": "mse", "reweigh": True}], ids=["was", "mse-reweigh"])
def test_without_gradients_only_the_forward_runs(dtype, mode, options):
    vocab, hidden, weight, labels = _problem(dtype)
    requires = mode != "inputs_without_grad"
    h, w = (t.clone().requires_grad_(requires) for t in (hidden, weight))
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, torch.enable_grad)
    with context(), _flops() as flops, AllocationShapes() as allocations:
        loss = linear_ce_with_ntl(h, w, labels, vocab, chunk_tokens=CHUNK, **options).loss
    assert not loss.requires_grad
    forward = 2 * TOKENS * VOCAB * HIDDEN  # z = h W^T, chunk by chunk
    assert flops.get_total_flops() == forward, f"{flops.get_total_flops() / forward:.2f}x the forward's matmul"
    assert allocations.at_least(VOCAB * HIDDEN) == []  # no weight-gradient accumulator, no product, no [T, V]
    assert allocations.at_least(CHUNK * VOCAB) != []  # (the mode sees the chunk's logits)

    want, _, _ = _reference(hidden, weight, labels, vocab, **options)
    _close(loss, want, dtype, "loss without gradients")
    # the same call with gradients: the same loss, bit for bit, and gradients equal to float64 autograd
    h, w = (t.clone().requires_grad_() for t in (hidden, weight))
    with _flops() as flops:
        out = linear_ce_with_ntl(h, w, labels, vocab, chunk_tokens=CHUNK, **options).loss
    assert flops.get_total_flops() == 3 * forward  # h W^T, pi W and (w pi)^T h, as before
    assert torch.equal(out.detach(), loss)
    out.backward()
    _, gh, gw = _reference(hidden, weight, labels, vocab, **options)
    _close(h.grad, gh, dtype, "d hidden")
    _close(w.grad, gw, dtype, "d weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trained", ["hidden", "weight"])
def test_a_frozen_input_gets_no_gradient_work(dtype, trained):
    """Only ``hidden`` needs a gradient (a frozen output layer) or only ``weight``: the forward builds
    only that one's dense part (two matmuls, not three); the backward adds the sparse terms."""
    vocab, hidden, weight, labels = _problem(dtype)
    h, w = hidden.clone().requires_grad_(trained == "hidden"), weight.clone().requires_grad_(trained == "weight")
    with _flops() as flops, AllocationShapes() as allocations:
        out = linear_ce_with_ntl(h, w, labels, vocab, chunk_tokens=CHUNK).loss
    forward = 2 * TOKENS * VOCAB * HIDDEN
    assert flops.get_total_flops() == 2 * forward
    big = allocations.at_least(VOCAB * HIDDEN)
    assert (big == []) == (trained == "hidden"), big  # the [V, H] accumulator only for the weight's gradient
    out.backward()
    want, gh, gw = _reference(hidden, weight, labels, vocab)
    _close(out, want, dtype, "loss")
    if trained == "hidden":
        assert w.grad is None
        _close(h.grad, gh, dtype, "d hidden")
    else:
        assert h.grad is None
        _close(w.grad, gw, dtype, "d weight")


def test_a_frozen_input_with_a_per_token_upstream_gradient():
    """The recomputing backward (an upstream gradient not proportional to the token weights) for the
    weight alone, and none of it for the hidden states alone: against float64 autograd."""
    vocab, hidden, weight, labels = _problem(torch.float64)
    upstream = torch.rand(TOKENS, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ce, ntl, _ = naive_per_token(h64 @ w64.t(), labels, vocab)
    (upstream * (ce + ntl)).sum().backward()
    for trained in ("hidden", "weight"):
        h, w = hidden.clone().requires_grad_(trained == "hidden"), weight.clone().requires_grad_(trained == "weight")
        terms = ntl_scale.linear_ce_ntl(h, w, labels, vocab, chunk_tokens=CHUNK)
        with _flops() as flops:
            (upstream * (terms.ce + terms.ntl)).sum().backward()
        recompute = 2 * (2 * TOKENS * VOCAB * HIDDEN)  # h W^T again and (u pi)^T h: only for the weight
        assert (flops.get_total_flops() >= recompute) == (trained == "weight")
        got, want = (h.grad, h64.grad) if trained == "hidden" else (w.grad, w64.grad)
        _close(got, want, torch.float64, f"d {trained}")


# --------------------------------------------------------------------------- tensor parallelism


def test_tensor_parallel_keeps_the_collectives():
    """Two vocab shards: the same all-reduces (operation and shape, per chunk) with and without
    gradients; the loss equals the float64 full-logit reference and the with-gradient loss."""
    vocab, hidden, weight, labels = _problem(torch.float32)
    rows = VOCAB // 2
    group = object()  # a stand-in: every dist call is patched

    def rank_loss(rank, grad):
        h, w = hidden.clone().requires_grad_(), weight[rank * rows : (rank + 1) * rows].clone().requires_grad_()
        with torch.set_grad_enabled(grad):
            loss = linear_ce_with_ntl(h, w, labels, vocab, tp_group=group, chunk_tokens=CHUNK).loss
        return loss.detach()

    without, calls_without = run_ranks_in_threads(lambda r: rank_loss(r, False), 2)
    with_grad, calls_with = run_ranks_in_threads(lambda r: rank_loss(r, True), 2)
    want, _, _ = _reference(hidden, weight, labels, vocab)
    for rank in range(2):
        assert calls_without[rank] == calls_with[rank] and len(calls_with[rank]) == 2 * (TOKENS // CHUNK)
        assert torch.equal(without[rank], with_grad[rank])
        _close(without[rank], want, torch.float32, f"rank {rank} loss without gradients")
