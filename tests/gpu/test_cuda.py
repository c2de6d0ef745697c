"""On a CUDA GPU: half-precision parity, no host sync, CUDA graph capture (``make gpu-check``; skipped without a GPU).

1. bf16 and fp16 logits (fused op) and hidden states/weights (chunked op) against a float64 reference
   computed on the GPU from the same values: loss and gradients.
2. ``torch.cuda.set_sync_debug_mode("error")`` around a forward and backward of each op: any host
   synchronisation raises; with the default code (``impl="auto"``) and with the Triton kernels
   (``impl="triton"``), the fused op in place too.
3. A CUDA graph captures a forward + backward of ``ce_with_ntl`` and replays it with new values; the
   same for the chunked op ``linear_ce_with_ntl``; each with ``impl="auto"`` and ``impl="triton"``.
4. The Triton kernels (``ntl_scale/ops/triton_ce_ntl.py``, ``impl="triton"``) against the PyTorch code
   (``impl="torch"``), both ops, fp32 and bf16, at a vocabulary that spans many blocks.
"""

from __future__ import annotations

import pytest
import torch

import ntl_scale
from ntl_scale.ops import triton_ce_ntl
from tests.helpers.reference import naive_per_token

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

V, T, H = 4096, 512, 256


def _setup(dtype, seed=0):
    vocab = ntl_scale.NumberVocab.from_id_to_token({100 + d: str(d) for d in range(10)}, vocab_size=V)
    g = torch.Generator(device="cuda").manual_seed(seed)
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    numbers = torch.rand(T, device="cuda", generator=g) < 0.4
    labels = torch.where(numbers, 100 + labels % 10, labels)
    labels[:7] = -100
    logits = (2 * torch.randn(T, V, device="cuda", generator=g)).to(dtype).requires_grad_()
    hidden = torch.randn(T, H, device="cuda", generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).to(dtype).requires_grad_()
    return vocab, labels, logits, hidden, weight


def _reference(logits64, labels, vocab):
    ce, ntl, is_number = naive_per_token(logits64, labels, vocab)
    valid = (labels != -100).double()
    return (ce * valid).sum() / valid.sum() + 0.3 * (ntl * is_number).sum() / is_number.double().sum()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_float64(dtype):
    vocab, labels, logits, hidden, weight = _setup(dtype)
    x64 = logits.detach().double().requires_grad_()
    want = _reference(x64, labels, vocab)
    want.backward()
    got = ntl_scale.ce_with_ntl(logits, labels, vocab).loss
    got.backward()
    assert abs(float(got) - float(want)) < 1e-3 * float(want)
    torch.testing.assert_close(logits.grad.double(), x64.grad, atol=2e-3 * float(x64.grad.abs().max()), rtol=0)
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    want = _reference(h64 @ w64.t(), labels, vocab)
    want.backward()
    got = ntl_scale.linear_ce_with_ntl(hidden, weight, labels, vocab, chunk_tokens=128).loss
    got.backward()
    assert abs(float(got) - float(want)) < 1e-2 * float(want)
    for a, b in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        torch.testing.assert_close(a.double(), b, atol=2e-2 * float(b.abs().max()), rtol=0)


def _impl(impl):
    if impl == "triton" and not triton_ce_ntl.triton_available():
        pytest.skip("triton is not installed")
    return impl


@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_no_host_sync_on_the_gpu(impl):
    impl = _impl(impl)
    vocab, labels, logits, hidden, weight = _setup(torch.bfloat16)
    logits32 = logits.detach().float().requires_grad_()
    calls = [
        lambda: ntl_scale.ce_with_ntl(logits, labels, vocab, impl=impl).loss,
        lambda: ntl_scale.ce_with_ntl(logits, labels, vocab, loss="mse", reweigh=True, impl=impl).loss,
        lambda: ntl_scale.ce_with_ntl(logits32 * 1, labels, vocab, inplace=True, impl=impl).loss,
        lambda: ntl_scale.linear_ce_with_ntl(hidden, weight, labels, vocab, chunk_tokens=100, impl=impl).loss,
    ]
    for call in calls:
        call().backward()  # warm-up: per-table caches on the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_cuda_graph_captures_a_step_with_the_loss(impl):
    impl = _impl(impl)
    vocab, labels, logits, _, _ = _setup(torch.float32)
    static_logits = logits.detach().clone().requires_grad_()
    static_labels = labels.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
        for _ in range(2):
            static_logits.grad = None
            ntl_scale.ce_with_ntl(static_logits, static_labels, vocab, impl=impl).loss.backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    static_logits.grad = None
    with torch.cuda.graph(graph):
        static_loss = ntl_scale.ce_with_ntl(static_logits, static_labels, vocab, impl=impl).loss
        static_loss.backward()
    _, new_labels, new_logits, _, _ = _setup(torch.float32, seed=5)
    with torch.no_grad():
        static_logits.copy_(new_logits)
    static_labels.copy_(new_labels)
    graph.replay()
    x64 = new_logits.detach().double().requires_grad_()
    want = _reference(x64, new_labels, vocab)
    want.backward()
    assert abs(float(static_loss) - float(want)) < 1e-5 * float(want)
    torch.testing.assert_close(static_logits.grad.double(), x64.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_cuda_graph_captures_the_chunked_op(impl):
    impl = _impl(impl)
    vocab, labels, _, hidden, weight = _setup(torch.float32)
    static_h, static_w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    static_labels = labels.clone()

    def step():
        static_h.grad = static_w.grad = None
        loss = ntl_scale.linear_ce_with_ntl(static_h, static_w, static_labels, vocab, chunk_tokens=128, impl=impl).loss
        loss.backward()
        return loss

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    static_h.grad = static_w.grad = None
    with torch.cuda.graph(graph):
        static_loss = ntl_scale.linear_ce_with_ntl(
            static_h, static_w, static_labels, vocab, chunk_tokens=128, impl=impl
        ).loss
        static_loss.backward()
    _, new_labels, _, new_h, new_w = _setup(torch.float32, seed=7)
    with torch.no_grad():
        static_h.copy_(new_h)
        static_w.copy_(new_w)
    static_labels.copy_(new_labels)
    graph.replay()
    h64, w64 = (t.detach().double().requires_grad_() for t in (new_h, new_w))
    want = _reference(h64 @ w64.t(), new_labels, vocab)
    want.backward()
    assert abs(float(static_loss) - float(want)) < 1e-5 * float(want)
    torch.testing.assert_close(static_h.grad.double(), h64.grad, atol=1e-5 * float(h64.grad.abs().max()), rtol=1e-4)
    torch.testing.assert_close(static_w.grad.double(), w64.grad, atol=1e-5 * float(w64.grad.abs().max()), rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_the_pytorch_code(dtype):
    if not triton_ce_ntl.triton_available():
        pytest.skip("triton is not installed")
    vocab = ntl_scale.NumberVocab.from_id_to_token({7000 + d: str(d) for d in range(10)}, vocab_size=20011)
    g = torch.Generator(device="cuda").manual_seed(1)
    T, V = 300, 20011  # several 4096-column blocks, the last one partial
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    labels = torch.where(torch.rand(T, device="cuda", generator=g) < 0.4, 7000 + labels % 10, labels)
    labels[:5] = -100
    logits = (2 * torch.randn(T, V, device="cuda", generator=g)).to(dtype)
    hidden = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).to(dtype)
    results = {}
    for use_kernels in (True, False):
        impl = "triton" if use_kernels else "torch"
        z, h, w = (t.detach().clone().requires_grad_() for t in (logits, hidden, weight))
        fused = ntl_scale.ce_with_ntl(z, labels, vocab, loss="mse", reweigh=True, impl=impl).loss
        fused.backward()
        chunked = ntl_scale.linear_ce_with_ntl(h, w, labels, vocab, chunk_tokens=96, impl=impl).loss
        chunked.backward()
        results[use_kernels] = (fused.detach(), z.grad, chunked.detach(), h.grad, w.grad)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(results[True], results[False]):
        scale = float(want.double().abs().max()) or 1.0
        torch.testing.assert_close(got.double(), want.double(), atol=tol * scale, rtol=tol)
