"""The GPU cost model's counts (``benchmarks/cost_model.py``) against independent counts on CPU.

1. FLOPs: the model's FLOPs of each path equal what ``torch.utils.flop_counter.FlopCounterMode``
   counts when the code runs forward + backward on a scaled-down shape (the materialised output layer
   with ``F.cross_entropy`` and with ``ce_with_ntl``; ``linear_ce_with_ntl`` in uneven chunks).
2. Bytes: the model's largest terms are the sizes of the tensors the code makes: the logits (whole,
   and per chunk, as many chunks as the op makes), the output weight, the fp32 ``[V, H]`` accumulator
   of the chunked op, recorded with a dispatch mode while the op runs.
3. The roofline arithmetic on hand-worked numbers (a memory-bound and a math-bound kernel).
4. docs/benchmarks.md holds the script's tables at 8192 x 128256 x 4096 (a model change updates the docs).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import ntl_scale
from ntl_scale.linear import linear_ce_with_ntl

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("cost_model", ROOT / "benchmarks" / "cost_model.py")
assert _spec is not None and _spec.loader is not None
cm = sys.modules["cost_model"] = importlib.util.module_from_spec(_spec)  # dataclasses look their module up
_spec.loader.exec_module(cm)

T, V, H, CHUNK = 96, 640, 32, 40  # 3 chunks, the last one shorter


def _vocab() -> ntl_scale.NumberVocab:
    tokens = [f"w{i}" for i in range(V)]
    for digit in range(10):
        tokens[100 + digit] = str(digit)
    return ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=V)


def _inputs(dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.1).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::3] = 100 + torch.randint(0, 10, (len(labels[::3]),), generator=g)
    return hidden, weight, labels


def _counted_flops(step) -> int:
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


# ------------------------------------------------------------------ 1. FLOPs


def test_flops_of_the_materialised_paths_match_the_flop_counter():
    vocab, (hidden, weight, labels) = _vocab(), _inputs()
    shape = cm.Shape(T, V, H, len(vocab.ids))

    def ce():
        F.cross_entropy(F.linear(hidden, weight), labels).backward()

    def ce_ntl():
        ntl_scale.ce_with_ntl(F.linear(hidden, weight), labels, vocab, impl="torch").loss.backward()

    assert _counted_flops(ce) == cm.cost(cm.ce_logits(shape)).flops == 6 * T * V * H
    assert _counted_flops(ce_ntl) == cm.cost(cm.ce_ntl_logits(shape)).flops


def test_flops_of_the_chunked_path_match_the_flop_counter():
    # bf16: the weight-gradient product is an ``mm`` into a buffer (fp32 on CPU runs ``addmm_``, an
    # in-place op FlopCounterMode does not count)
    vocab, (hidden, weight, labels) = _vocab(), _inputs(torch.bfloat16)
    shape = cm.Shape(T, V, H, len(vocab.ids))

    def chunked():
        linear_ce_with_ntl(hidden, weight, labels, vocab, chunk_tokens=CHUNK, impl="torch").loss.backward()

    counted = _counted_flops(chunked)
    assert counted == cm.cost(cm.ce_ntl_chunked(shape, CHUNK)).flops
    assert counted == 6 * T * V * H + 4 * T * shape.numbers * H  # the output layer + NTL's number columns


# ------------------------------------------------------------------ 2. bytes against the tensors made


class _Record(TorchDispatchMode):
    """Every op's tensor outputs: (op name, shape, dtype, bytes)."""

    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[str, tuple[int, ...], torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return out


def test_bytes_are_the_sizes_of_the_tensors_the_chunked_op_makes():
    vocab, (hidden, weight, labels) = _vocab(), _inputs(torch.bfloat16)
    shape = cm.Shape(T, V, H, len(vocab.ids))
    with _Record() as record:
        linear_ce_with_ntl(hidden, weight, labels, vocab, chunk_tokens=CHUNK, impl="torch").loss.backward()
    chunk_logits = [o for o in record.outputs if "mm" in o[0] and o[1][1:] == (V,) and o[2] == torch.bfloat16]
    assert [o[1][0] for o in chunk_logits] == cm.chunk_rows(shape, CHUNK) == [40, 40, 16]
    kernels = cm.ce_ntl_chunked(shape, CHUNK)
    gemms = [k for k in kernels if k.name == "chunk: z = h W^T"]
    for (_, (c, _), _, nbytes), k in zip(chunk_logits, gemms, strict=True):
        assert k.bytes == 2 * (c * H + V * H) + nbytes  # reads h rows and W, writes the chunk's logits
        assert nbytes == c * V * shape.elem
    # the fp32 accumulator: written by the first chunk's product (no zeroing pass: none in the model either;
    # on the CPU the product is copied into it), then the weight gradient written once in bf16 from it
    full = [o for o in record.outputs if o[1] == (V, H)]
    assert not [o for o in full if "zero" in o[0] or "fill" in o[0]]
    accumulators = [o for o in full if o[2] == torch.float32 and "copy_" in o[0]]
    assert len(accumulators) == 1 and not [k for k in kernels if k.name.startswith("G_W = 0")]
    first = next(k for k in kernels if k.name.startswith("chunk: G_W = "))
    assert first.bytes - 2 * (CHUNK * V + CHUNK * H) == accumulators[0][3]  # writes it, reads no accumulator
    grads = [o for o in full if o[2] == torch.bfloat16 and "_to_copy" in o[0]]
    cast = next(k for k in kernels if "grad_W = s G_W written in bf16" in k.name)
    assert len(grads) == 1 and cast.bytes - 6 * T * H == accumulators[0][3] + grads[0][3]
    assert weight.numel() * weight.element_size() == V * H * shape.elem


def test_bytes_of_the_logits_paths_are_the_logits_sizes():
    vocab, (hidden, weight, _) = _vocab(), _inputs(torch.bfloat16)
    shape = cm.Shape(T, V, H, len(vocab.ids))
    logits = F.linear(hidden, weight)
    nbytes = logits.numel() * logits.element_size()
    ce = {k.name: k.bytes for k in cm.ce_logits(shape)}
    assert ce["CE forward: read logits"] - 12 * T == nbytes  # one read, plus 3 fp32 scalars per token
    assert ce["CE backward: read logits, write gradient in place"] - 12 * T == 2 * nbytes
    # CE + NTL reads and writes the logits as often as CE alone: the difference is O(T K), not O(T V)
    extra = cm.cost(cm.ce_ntl_logits(shape)).bytes - cm.cost(cm.ce_logits(shape)).bytes
    assert 0 < extra < 100 * T * shape.numbers


def test_on_chip_path_counts_its_recompute_and_atomics():
    """The fused linear CE + NTL (logits on chip) row: 8 T V H FLOPs (the backward recomputes the logits) plus
    the number columns' 6 T K H; no [T, V] term in its bytes; the tiles of its atomics are the launcher's."""
    from ntl_scale.kernels import triton_linear_ce_ntl as lk

    shape = cm.Shape(T, V, H, 10)
    got = cm.cost(cm.ce_ntl_on_chip(shape))
    assert got.flops == 8 * T * V * H + 6 * T * shape.numbers * H
    # never the logits: no T x V term in the bytes (their mixed second difference in T and V is 0)
    size = {(t, v): cm.cost(cm.ce_ntl_on_chip(cm.Shape(t, v, H, 10))).bytes for t in (T, 2 * T) for v in (V, 2 * V)}
    assert size[2 * T, 2 * V] - size[2 * T, V] - size[T, 2 * V] + size[T, V] == 0
    chunked = {
        (t, v): cm.cost(cm.ce_ntl_chunked(cm.Shape(t, v, H, 10), 40)).bytes for t in (T, 2 * T) for v in (V, 2 * V)
    }
    assert chunked[2 * T, 2 * V] - chunked[2 * T, V] - chunked[T, 2 * V] + chunked[T, V] > 0  # it writes them
    blocks = lk.launch_blocks("backward", torch.bfloat16)
    assert (cm.ON_CHIP_BLOCK_T, cm.ON_CHIP_BLOCK_V) == (blocks["BLOCK_T"], blocks["BLOCK_V"])
    worst = cm.cost(cm.ce_ntl_on_chip_hbm_atomics(shape)).bytes - got.bytes
    tiles_t, tiles_v = -(-T // blocks["BLOCK_T"]), -(-V // blocks["BLOCK_V"])
    assert worst == 2 * 4 * (T * H * tiles_v + V * H * tiles_t) - 2 * 4 * (T * H + V * H)


# ------------------------------------------------------------------ 3. the roofline


def test_roofline_per_kernel():
    memory_bound = cm.Kernel("copy", bytes=3.35e9)  # 1 ms at 3.35 TB/s
    math_bound = cm.Kernel("gemm", bytes=1.0, flops=989e9)  # 1 ms at 989 TFLOP/s
    assert abs(memory_bound.seconds() - 1e-3) < 1e-12 and abs(math_bound.seconds() - 1e-3) < 1e-12
    both = cm.cost([memory_bound, math_bound])
    assert abs(both.seconds - 2e-3) < 1e-12 and abs(both.overlapped - 1e-3) < 1e-9


# ------------------------------------------------------------------ 4. the docs hold the model's output


def test_docs_hold_the_model_output():
    """docs/benchmarks.md's cost-model tables are this script's output at the documented shape."""
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    shape = cm.Shape(8192, 128256, 4096, 10)
    tables = [cm.markdown(shape), cm.chunk_table(cm.Shape(8192, 128256, 4096, 1110))]
    tables.append(cm.breakdown(cm.ce_ntl_chunked(cm.Shape(8192, 128256, 4096, 1110))))
    for line in "\n".join(tables).splitlines():
        if line.startswith("|"):
            assert line in docs, f"docs/benchmarks.md lacks (run benchmarks/cost_model.py --markdown): {line}"
