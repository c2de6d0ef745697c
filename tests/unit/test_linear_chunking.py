"""The chunked op's default chunk length (``ntl_scale.ops.chunked_linear.choose_chunk_tokens``) and its weight
gradient's fixed [V, H] passes, folded.

The default is a fixed budget of logits per chunk, checked here against its one-line definition written out
independently: ``min(max(T, 1), max(1, budget // V))`` with ``budget = 2**28`` on CUDA and ``2**26`` elsewhere
(the CPU's, the chunk ``docs/benchmarks.md`` measured best there); and the op itself: ``linear_ce_ntl`` with
``chunk_tokens=None`` makes the chunks the chooser gives (its logits matmuls counted with a dispatch mode).
"""

from __future__ import annotations

import pytest
import torch

import ntl_scale
from ntl_scale.ops.chunked_linear import choose_chunk_tokens
from tests.helpers.dispatch import OpOutputs


def test_chunk_at_the_documented_shapes() -> None:
    assert choose_chunk_tokens("cuda", 8192, 128256) == 2092  # docs/benchmarks.md, benchmarks/cost_model.py
    assert choose_chunk_tokens("cuda", 8192, 128256 // 8) == 8192  # a TP shard of 1/8: one chunk
    assert choose_chunk_tokens("cpu", 8192, 131072) == 512  # docs/benchmarks.md (measured on CPU)
    assert choose_chunk_tokens("cpu", 100, 131072) == 100  # at most T
    assert choose_chunk_tokens("cuda", 0, 128256) == 1  # no tokens: still 1


@pytest.mark.parametrize(("kwargs", "match"), [({"tokens": -1}, "tokens"), ({"vocab": 2.5}, "vocab")])
def test_bad_arguments_are_refused(kwargs: dict, match: str) -> None:
    args = {"tokens": 8, "vocab": 64, **kwargs}
    with pytest.raises(ValueError, match=match):
        choose_chunk_tokens("cuda", **args)


def test_the_op_uses_the_chosen_chunk_on_cpu() -> None:
    t, v, h = 1100, 2**17, 4  # 2**26 // 2**17 = 512 tokens a chunk: 512, 512, 76
    tokens = [f"w{i}" for i in range(v)]
    for d in range(10):
        tokens[100 + d] = str(d)
    vocab = ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=v)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (t,), generator=g)
    with OpOutputs() as made, torch.no_grad():  # the statistics only: the same chunks, a third of the work
        ntl_scale.linear_ce_with_ntl(hidden, weight, labels, vocab, impl="torch")
    assert [r.shape[0] for r in made.records if r.op == "mm" and r.shape[1:] == (v,)] == [512, 512, 76]


# ------------------------------------------------------------------ the fixed [V, H] passes, folded (issue 43 item 2)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_has_no_zeroing_scaling_or_cast_pass(dtype: torch.dtype, smoothing: float) -> None:
    """Forward: the first chunk's product writes the fp32 accumulator (no zero fill); backward of a mean: the
    label rows join the accumulator in its units, so the scale, the smoothing row and the cast are the only
    [V, H] passes (fp32: one ``mul``/``addcmul`` with ``out=``; bf16 on the CPU: in place, then the cast),
    only sparse row updates besides (the label rows, the number rows). The values: tests/unit/test_linear*.py,
    test_ce_features.py against float64 references."""
    v, h, t = 640, 24, 50
    tokens = [f"w{i}" for i in range(v)]
    for d in range(10):
        tokens[100 + d] = str(d)
    vocab = ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=v)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, h, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (t,), generator=g)
    with OpOutputs() as forward:
        out = ntl_scale.linear_ce_with_ntl(
            hidden, weight, labels, vocab, chunk_tokens=16, impl="torch", label_smoothing=smoothing
        )
    with OpOutputs() as backward:
        out.loss.backward()

    def full_passes(made: OpOutputs) -> list[str]:  # the ops writing a whole [V, H] tensor (no other is as big)
        return [r.op for r in made.records if r.shape and r.bytes == v * h * r.dtype.itemsize]

    assert not {"zeros", "zero_", "fill_", "zeros_like"} & set(full_passes(forward)), full_passes(forward)
    dense = [op for op in full_passes(backward) if op not in ("index_add_", "index_copy_", "empty", "detach")]
    if dtype == torch.float32:  # one pass: the scale (and smoothing's row) written over the accumulator
        assert dense == ["addcmul" if smoothing else "mul"], full_passes(backward)
    else:  # the CPU's bf16 path: the scale in place (and the row), then the one cast; on CUDA one fused op
        assert dense == (["mul_", "add_", "_to_copy"] if smoothing else ["mul_", "_to_copy"]), full_passes(backward)
    assert weight.grad is not None and weight.grad.dtype == dtype


@pytest.mark.parametrize("smoothing", [False, True])
def test_the_cuda_one_pass_cast_equals_the_cpu_two_pass_one(smoothing: bool) -> None:
    """``scaled_cast``'s CUDA form (``mul``/``addcmul`` writing bf16 from fp32) run here on CPU tensors against
    the CPU form (scale in place, then cast) and against float64 written out: the same one rounding."""
    from ntl_scale.ops.chunked_linear import scaled_cast

    g = torch.Generator().manual_seed(3)
    v, h, t = 300, 40, 25
    acc = torch.randn(v, h, generator=g) * 1000
    scale = torch.tensor(1 / 777.0)
    cols = torch.tensor([3, 50, 299])
    number_rows = torch.randn(3, h, generator=g)
    hidden = torch.randn(t, h, generator=g)
    uniform = torch.rand(t, generator=g) * 1e-3 if smoothing else None
    want = acc.double() * scale.double()
    if uniform is not None:
        want -= (uniform.double().unsqueeze(1) * hidden.double()).sum(0)
    want[cols] += number_rows.double()
    one = scaled_cast(acc.clone(), scale, number_rows, cols, torch.bfloat16, hidden, uniform, 0.1, fused=True)
    two = scaled_cast(acc.clone(), scale, number_rows, cols, torch.bfloat16, hidden, uniform, 0.1, fused=False)
    assert one.dtype == two.dtype == torch.bfloat16
    torch.testing.assert_close(one.double(), want, rtol=2**-8, atol=1e-6)  # one bf16 rounding of the fp64 value
    torch.testing.assert_close(two.double(), want, rtol=2**-8, atol=1e-6)
    if not smoothing:
        assert torch.equal(one, two)


def test_the_product_buffer_is_allocated_only_where_the_two_step_product_runs(monkeypatch) -> None:
    """Issue 43, memory at the chunked peers' level: the ``[V, H]`` half-precision product buffer exists only
    where the chunk's weight-gradient product is a half matmul then an fp32 add (the CPU). Where the
    fp32-output GEMM adds into the accumulator (CUDA), it is never allocated: shown on meta tensors, which
    have that GEMM, with the predicate patched here (the library takes it on CUDA only). On the CPU it is
    allocated once and reused, and the accumulator is the float64 sum of the chunks' products."""
    from ntl_scale.ops import chunked_linear

    g = torch.Generator().manual_seed(0)
    chunks = [(torch.rand(40, 640, generator=g), torch.randn(40, 32, generator=g)) for _ in range(3)]
    acc = torch.empty(640, 32)
    buffer = chunked_linear.product_buffer(torch.empty(640, 32, dtype=torch.bfloat16), torch.float32)
    assert buffer is not None and buffer.buffer is None  # nothing allocated before the first product
    seen = set()
    for i, (coef, rows) in enumerate(chunks):
        chunked_linear.accumulate(acc, coef.bfloat16(), rows.bfloat16(), buffer, 64, first=i == 0)
        seen.add(buffer.buffer.data_ptr())
    assert len(seen) == 1  # one buffer, reused
    want = sum(64 * c.bfloat16().double().t() @ r.bfloat16().double() for c, r in chunks)
    torch.testing.assert_close(acc.double(), want, rtol=2e-2, atol=1e-2 * float(want.abs().max()))

    meta_gemm = lambda a: a.device.type == "meta" and a.dtype == torch.float32  # noqa: E731
    monkeypatch.setattr(chunked_linear, "fp32_output_gemm", meta_gemm)
    meta = torch.empty(640, 32, device="meta")
    buffer = chunked_linear.product_buffer(torch.empty(640, 32, dtype=torch.bfloat16, device="meta"), torch.float32)
    for i in range(3):
        coef = torch.empty(40, 640, dtype=torch.bfloat16, device="meta")
        chunked_linear.accumulate(
            meta, coef, torch.empty(40, 32, dtype=torch.bfloat16, device="meta"), buffer, 64, first=i == 0
        )
    assert buffer is not None and buffer.buffer is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_op_holds_no_fp32_token_by_hidden_buffer(dtype: torch.dtype) -> None:
    """Issue 43, memory at the chunked peers' level: for half-precision parameters ``P_h = pi W`` is kept in the
    dtype its matmul writes (its values are those), and the backward completes each chunk's rows in fp32 and
    rounds them once into the same buffer, which is returned as the input gradient: no ``[T, H]`` fp32 tensor
    (``T H 4`` bytes; 128 MiB at 8192 x 4096) and no second ``[T, H]`` buffer for the gradient. The gradients
    are the float64 reference's within the half dtype's rounding."""
    torch.manual_seed(0)
    t, v, h = 96, 640, 32
    tokens = [f"w{i}" for i in range(v)]
    for digit in range(10):
        tokens[100 + digit] = str(digit)
    vocab = ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=v)
    hidden = torch.randn(t, h).to(dtype).requires_grad_()
    weight = (torch.randn(v, h) * 0.1).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (t,))
    labels[::3] = 100 + torch.randint(0, 10, (len(labels[::3]),))

    with OpOutputs() as record:
        out = ntl_scale.linear_ce_with_ntl(hidden, weight, labels, vocab, chunk_tokens=40, impl="torch")
        out.loss.backward()
    made = [(r.shape, r.dtype) for r in record.records if r.op not in ("view", "detach")]  # memory of their own
    assert ((t, h), torch.float32) not in made
    assert made.count(((t, h), dtype)) == 1  # P_h, which becomes the input gradient
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ntl_scale.linear_ce_with_ntl(h64, w64, labels, vocab, chunk_tokens=40, impl="torch").loss.backward()
    for got, want in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2 * float(want.abs().max()))
