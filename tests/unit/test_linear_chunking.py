"""The chunked op's default chunk length (``ntl_scale.linear_op.choose_chunk_tokens``, issue 43 item 1) and
its weight gradient's fixed [V, H] passes, folded (item 1, second bullet).

A pure function of (device kind, free bytes, T, V, H, dtype), so its CUDA branch is checked here on the
CPU with synthetic inputs. References, each independent of the code under test:

* math-boundness: the GPU cost model's own roofline of the weight-gradient GEMM
  (``benchmarks/cost_model.py``'s ``gemm`` with its bytes written out there), at H100 numbers;
* memory: the bytes of the chunk's logits and their fp32 copy, counted from the shape here;
* the CPU: ``2**26 // V``, the chunk ``docs/benchmarks.md`` measured best;
* the op itself: ``linear_ce_ntl`` with ``chunk_tokens=None`` makes the chunks the chooser gives (its
  logits matmuls counted with a dispatch mode).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ntl_scale
from ntl_scale.linear_op import choose_chunk_tokens
from tests.helpers.dispatch import OpOutputs
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
cm = load_script("benchmarks/cost_model.py", "cost_model")

GiB = 2**30
H100 = {"bandwidth": 3.35e12, "peak": 989e12}  # the datasheet numbers, written out here


def _gw_gemm_math_bound(c: int, v: int, h: int, elem: int, acc: int) -> bool:
    # the cost model's G_W kernel: bf16 operands read, the fp32 accumulator read and written
    k = cm.gemm("G_W", v, h, c, read=elem * (c * v + c * h) + acc * v * h, write=acc * v * h)
    return k.flops / H100["peak"] >= k.bytes / H100["bandwidth"]


@pytest.mark.parametrize("t", [8192, 20000, 1 << 20])
@pytest.mark.parametrize(
    ("v", "h", "dtype"),
    [(128256, 4096, torch.bfloat16), (128256, 2048, torch.bfloat16), (151936, 3584, torch.float16),
     (32000, 4096, torch.bfloat16), (128256, 4096, torch.float32)],
)  # fmt: skip
def test_cuda_chunks_are_all_math_bound_and_no_longer_than_needed(t: int, v: int, h: int, dtype: torch.dtype) -> None:
    elem = torch.empty((), dtype=dtype).element_size()
    c = choose_chunk_tokens("cuda", 80 * GiB, t, v, h, dtype)
    lengths = [min(c, t - i) for i in range(0, t, c)]
    # every chunk's weight-gradient GEMM math-bound in the cost model, the last (shorter) one included while
    # there are few chunks (with hundreds, the rounding to 8 tokens may leave the last one short)
    tail = lengths if len(lengths) <= 32 else lengths[:-1]
    assert all(_gw_gemm_math_bound(n, v, h, elem, 4) for n in tail), lengths
    assert c % 8 == 0
    # no longer than needed (the least memory): the fewest math-bound tokens by the cost model, found by a
    # scan here (or the CPU's element budget where that is longer: it is never undercut), spread evenly over
    # as many chunks as fit, or one fewer (where the rounding to multiples of 8 left the last one short)
    least = max(next(n for n in range(1, t + 1) if _gw_gemm_math_bound(n, v, h, elem, 4)), 2**26 // v)
    assert c <= -(-t // max(1, t // least - 1)) + 8, (c, least, lengths)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("free", [1 * GiB, 3 * GiB, 512 * 2**20])
def test_cuda_chunk_is_capped_by_a_quarter_of_free_memory(free: int, dtype: torch.dtype) -> None:
    v, h = 128256, 4096
    c = choose_chunk_tokens("cuda", free, 8192, v, h, dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    logits_and_fp32_copy = c * v * (elem + (4 if elem < 4 else 0))
    assert 1 <= c and logits_and_fp32_copy <= free / 4
    # one more token would not have fitted, unless the chunk is already the math-bound length
    if c < choose_chunk_tokens("cuda", 80 * GiB, 8192, v, h, dtype):
        assert (c + 1) * v * (elem + (4 if elem < 4 else 0)) > free / 4


def test_cuda_chunk_bounds() -> None:
    assert choose_chunk_tokens("cuda", 80 * GiB, 300, 128256, 4096, torch.bfloat16) == 300  # at most T
    assert choose_chunk_tokens("cuda", 80 * GiB, 0, 128256, 4096, torch.bfloat16) == 1  # no tokens: still 1
    assert choose_chunk_tokens("cuda", 1000, 8192, 128256, 4096, torch.bfloat16) == 1  # no memory: 1
    # a TP shard of 1/8 of the vocabulary: the CPU's element budget (4185 tokens) is the floor, already
    # math-bound; 8192 tokens hold one such chunk, not two (the second would be shorter): one of 8192
    c = choose_chunk_tokens("cuda", 80 * GiB, 8192, 128256 // 8, 4096, torch.bfloat16)
    assert c == 8192 and 2**26 // (128256 // 8) == 4185
    c = choose_chunk_tokens("cuda", 80 * GiB, 32768, 128256 // 8, 4096, torch.bfloat16)
    assert c == 4688 and -(-32768 // c) == 7 and 32768 - 6 * c >= 4185  # 7 equal chunks, the last one too
    # a hidden size too small for any chunk to be math-bound: the memory cap or T
    assert choose_chunk_tokens("cuda", 80 * GiB, 8192, 128256, 64, torch.bfloat16) == 8192


@pytest.mark.parametrize("v", [32768, 131072, 640])
def test_cpu_chunk_is_the_measured_element_budget(v: int) -> None:
    for device, free in (("cpu", None), ("cpu", 80 * GiB), ("cuda", None)):
        assert choose_chunk_tokens(device, free, 1 << 20, v, 512, torch.float32) == 2**26 // v
    assert choose_chunk_tokens("cpu", None, 8192, 131072, 2048, torch.float32) == 512  # docs/benchmarks.md
    assert choose_chunk_tokens("cpu", None, 100, 131072, 2048, torch.float32) == 100


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"tokens": -1}, "tokens"), ({"vocab": 2.5}, "vocab"), ({"memory_fraction": 0.0}, "memory_fraction"),
     ({"flops_per_byte": -3.0}, "flops_per_byte")],
)  # fmt: skip
def test_bad_arguments_are_refused(kwargs: dict, match: str) -> None:
    args = {"tokens": 8, "vocab": 64, "hidden": 16}
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k in ("memory_fraction", "flops_per_byte")}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        choose_chunk_tokens("cuda", GiB, dtype=torch.bfloat16, **args, **extra)


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
    """``_scaled_cast``'s CUDA form (``mul``/``addcmul`` writing bf16 from fp32) run here on CPU tensors against
    the CPU form (scale in place, then cast) and against float64 written out: the same one rounding."""
    from ntl_scale.linear_op import _scaled_cast

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
    one = _scaled_cast(acc.clone(), scale, number_rows, cols, torch.bfloat16, hidden, uniform, 0.1, fused=True)
    two = _scaled_cast(acc.clone(), scale, number_rows, cols, torch.bfloat16, hidden, uniform, 0.1, fused=False)
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
    from ntl_scale import linear_op

    g = torch.Generator().manual_seed(0)
    chunks = [(torch.rand(40, 640, generator=g), torch.randn(40, 32, generator=g)) for _ in range(3)]
    acc = torch.empty(640, 32)
    buffer = linear_op._product_buffer(torch.empty(640, 32, dtype=torch.bfloat16), torch.float32)
    assert buffer is not None and buffer._buffer is None  # nothing allocated before the first product
    seen = set()
    for i, (coef, rows) in enumerate(chunks):
        linear_op._accumulate(acc, coef.bfloat16(), rows.bfloat16(), buffer, 64, first=i == 0)
        seen.add(buffer._buffer.data_ptr())
    assert len(seen) == 1  # one buffer, reused
    want = sum(64 * c.bfloat16().double().t() @ r.bfloat16().double() for c, r in chunks)
    torch.testing.assert_close(acc.double(), want, rtol=2e-2, atol=1e-2 * float(want.abs().max()))

    monkeypatch.setattr(linear_op, "_fp32_output_gemm", lambda a: a.device.type == "meta" and a.dtype == torch.float32)
    meta = torch.empty(640, 32, device="meta")
    buffer = linear_op._product_buffer(torch.empty(640, 32, dtype=torch.bfloat16, device="meta"), torch.float32)
    for i in range(3):
        coef = torch.empty(40, 640, dtype=torch.bfloat16, device="meta")
        linear_op._accumulate(
            meta, coef, torch.empty(40, 32, dtype=torch.bfloat16, device="meta"), buffer, 64, first=i == 0
        )
    assert buffer is not None and buffer._buffer is None


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
