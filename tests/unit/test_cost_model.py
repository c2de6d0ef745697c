"""The GPU cost model's counts (``benchmarks/cost_model.py``) against independent counts on CPU.

1. FLOPs: the model's FLOPs of each path equal what ``torch.utils.flop_counter.FlopCounterMode``
   counts when the code runs forward + backward on a scaled-down shape (the materialised output layer
   with ``F.cross_entropy`` and with ``ce_with_ntl``; ``linear_ce_with_ntl`` in uneven chunks).
2. Bytes: the model's largest terms are the sizes of the tensors the code makes: the logits (whole,
   and per chunk, as many chunks as the op makes), the output weight, the fp32 ``[V, H]`` accumulator
   of the chunked op, recorded with a dispatch mode while the op runs.
3. The roofline arithmetic on hand-worked numbers (a memory-bound and a math-bound kernel); the model of
   the share of the statistics-and-softmax kernel's second walk that L2 serves, against an LRU simulation.
4. docs/benchmarks.md holds the script's tables at 8192 x 128256 x 4096 (a model change updates the docs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import ntl_scale
from ntl_scale.linear import linear_ce_with_ntl
from tests.helpers.dispatch import OpOutputs
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
cm = load_script("benchmarks/cost_model.py", "cost_model")

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


def test_bytes_are_the_sizes_of_the_tensors_the_chunked_op_makes():
    vocab, (hidden, weight, labels) = _vocab(), _inputs(torch.bfloat16)
    shape = cm.Shape(T, V, H, len(vocab.ids))
    with OpOutputs() as record:
        linear_ce_with_ntl(hidden, weight, labels, vocab, chunk_tokens=CHUNK, impl="torch").loss.backward()
    chunk_logits = [o for o in record.records if "mm" in o.op and o.shape[1:] == (V,) and o.dtype == torch.bfloat16]
    assert [o.shape[0] for o in chunk_logits] == cm.chunk_rows(shape, CHUNK) == [40, 40, 16]
    kernels = cm.ce_ntl_chunked(shape, CHUNK)
    gemms = [k for k in kernels if k.name == "chunk: z = h W^T"]
    for (_, (c, _), _, nbytes), k in zip(chunk_logits, gemms, strict=True):
        assert k.bytes == 2 * (c * H + V * H) + nbytes  # reads h rows and W, writes the chunk's logits
        assert nbytes == c * V * shape.elem
    # the fp32 accumulator: written by the first chunk's product (no zeroing pass: none in the model either;
    # on the CPU the product is copied into it), then the weight gradient written once in bf16 from it
    full = [o for o in record.records if o.shape == (V, H)]
    assert not [o for o in full if "zero" in o.op or "fill" in o.op]
    accumulators = [o for o in full if o.dtype == torch.float32 and "copy_" in o.op]
    assert len(accumulators) == 1 and not [k for k in kernels if k.name.startswith("G_W = 0")]
    first = next(k for k in kernels if k.name.startswith("chunk: G_W = "))
    assert first.bytes - 2 * (CHUNK * V + CHUNK * H) == accumulators[0].bytes  # writes it, reads no accumulator
    grads = [o for o in full if o.dtype == torch.bfloat16 and "_to_copy" in o.op]
    cast = next(k for k in kernels if "grad_W = s G_W written in bf16" in k.name)
    assert len(grads) == 1 and cast.bytes - 6 * T * H == accumulators[0].bytes + grads[0].bytes
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


def _logits_free_ce(hidden, weight, labels, tile: int, online_dh: bool, keep=lambda g: True):
    """CE's gradients without the [T, V] logits ever held, float64, vocabulary tile by tile: pass 1 the
    log-sum-exp (and, with ``online_dh``, ``dh`` accumulated online, rescaled as the running max moves, as flash
    attention accumulates its output), pass 2 the logits recomputed for ``dW`` (and ``dh``); ``keep(g)``: whether
    a tile's gradient products run (a filter)."""
    h, w = hidden.double(), weight.double()
    t = h.shape[0]
    m = torch.full((t,), -torch.inf, dtype=torch.float64)
    s = torch.zeros(t, dtype=torch.float64)
    acc = torch.zeros_like(h)
    for v0 in range(0, w.shape[0], tile):
        z = h @ w[v0 : v0 + tile].T
        m_new = torch.maximum(m, z.max(1).values)
        s = s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(1)
        if online_dh:
            acc = acc * torch.exp(m - m_new)[:, None] + torch.exp(z - m_new[:, None]) @ w[v0 : v0 + tile]
        m = m_new
    lse = m + torch.log(s)
    dh = acc / s[:, None] - w[labels] if online_dh else torch.zeros_like(h)
    dw = torch.zeros_like(w)
    for v0 in range(0, w.shape[0], tile):
        g = torch.exp(h @ w[v0 : v0 + tile].T - lse[:, None])
        rows = (labels >= v0) & (labels < v0 + tile)
        g[rows, labels[rows] - v0] -= 1.0
        if keep(g):
            if not online_dh:
                dh += g @ w[v0 : v0 + tile]
            dw[v0 : v0 + tile] = g.T @ h
    return (lse - (h * w[labels]).sum(1)).mean(), dh / t, dw / t


@pytest.mark.parametrize("online_dh", [False, True], ids=["dh-in-pass-2", "dh-online-in-pass-1"])
def test_logits_free_floor_counts_the_recompute(online_dh):
    """The floor of a design whose logits never reach HBM: an independent float64 two-pass CE (above) gives
    autograd's gradients, and FlopCounterMode counts 8 T V H for it (``linear_ce_recompute``), with ``dh`` in
    either pass; with every gradient tile filtered 4 T V H (``linear_ce_filtered``); the 6 T V H bound row is
    below both passes' count."""
    _, (hidden, weight, labels) = _vocab(), _inputs()
    shape = cm.Shape(T, V, H, 10)
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    F.cross_entropy(h @ w.T, labels).backward()
    got = {}
    with FlopCounterMode(display=False) as counter:
        got["loss"], got["dh"], got["dw"] = _logits_free_ce(hidden.detach(), weight.detach(), labels, 64, online_dh)
    torch.testing.assert_close(got["loss"], F.cross_entropy(h.detach() @ w.detach().T, labels))
    torch.testing.assert_close(got["dh"], h.grad)
    torch.testing.assert_close(got["dw"], w.grad)
    assert counter.get_total_flops() == cm.cost(cm.linear_ce_recompute(shape)).flops == 8 * T * V * H
    with FlopCounterMode(display=False) as counter:
        _logits_free_ce(hidden.detach(), weight.detach(), labels, 64, False, keep=lambda g: False)
    assert counter.get_total_flops() == cm.cost(cm.linear_ce_filtered(shape)).flops == 4 * T * V * H
    assert cm.cost(cm.linear_ce_no_recompute(shape)).flops == 6 * T * V * H


# ------------------------------------------------------------------ 3. the roofline


def test_roofline_per_kernel():
    memory_bound = cm.Kernel("copy", bytes=3.35e9)  # 1 ms at 3.35 TB/s
    math_bound = cm.Kernel("gemm", bytes=1.0, flops=989e9)  # 1 ms at 989 TFLOP/s
    assert abs(memory_bound.seconds() - 1e-3) < 1e-12 and abs(math_bound.seconds() - 1e-3) < 1e-12
    both = cm.cost([memory_bound, math_bound])
    assert abs(both.seconds - 2e-3) < 1e-12 and abs(both.overlapped - 1e-3) < 1e-9


def _lru_second_walk_hits(programs: int, blocks: int, capacity: int, rows_each: int = 6, seed: int = 0) -> float:
    """An LRU cache of ``capacity`` blocks under ``programs`` programs, each walking ``rows_each`` rows of
    ``blocks`` blocks forwards then backwards (the statistics-and-softmax kernel), one block per step in
    turn, started at random offsets (programs drift out of phase on a GPU); the share of second-walk reads
    that hit, after the first rows' warm-up."""
    import random
    from collections import OrderedDict

    rnd = random.Random(seed)
    streams = []
    for p in range(programs):
        walk = []
        for r in range(rows_each):
            row = p * rows_each + r
            walk += [(row, b, 0) for b in range(blocks)] + [(row, b, 1) for b in reversed(range(blocks))]
        streams.append([None] * rnd.randrange(2 * blocks) + walk)
    cache: OrderedDict = OrderedDict()
    hits = reads = 0
    for step in range(max(map(len, streams))):
        for walk in streams:
            if step >= len(walk) or walk[step] is None:
                continue
            row, block, second = walk[step]
            hit = (row, block) in cache
            if hit:
                cache.move_to_end((row, block))
            else:
                cache[(row, block)] = True
                if len(cache) > capacity:
                    cache.popitem(last=False)
            if second and step >= 2 * blocks:
                hits, reads = hits + hit, reads + 1
    return hits / reads


def test_l2_hit_model_against_an_lru_simulation():
    """The closed form the chunked rows use for the share of the second walk served by L2 is within 0.1 of
    an LRU simulation of the kernel's access pattern, from rows that all fit to rows five times L2; and the
    persistent launch the op makes on an H100 beats one program per row in both."""
    blocks = 32
    for programs, capacity in ((60, 3200), (125, 3200), (125, 6400), (250, 3200), (528, 3200), (528, 6400)):
        simulated = _lru_second_walk_hits(programs, blocks, capacity)
        model = cm.l2_hit_share(programs, blocks, capacity)
        assert abs(model - simulated) <= 0.1, (programs, capacity, model, simulated)
    shape = cm.Shape(8192, 128256, 4096, 10)
    chunk = cm.chunk_rows(shape)[0]
    persistent, per_row = cm.rows_in_flight(shape, chunk), cm.rows_in_flight(shape, chunk, persistent=False)
    assert persistent <= cm.H100_SMS < per_row
    row_blocks = 32  # a 250 KiB row in 8 KiB blocks; L2 at 25 MiB = 3200 such blocks
    assert _lru_second_walk_hits(persistent, row_blocks, 3200) > 2 * _lru_second_walk_hits(per_row, row_blocks, 3200)
    assert cm.modelled_hits(shape, True)[0] > 2 * cm.modelled_hits(shape, False)[0]


# ------------------------------------------------------------------ 4. the docs hold the model's output


def test_docs_hold_the_model_output():
    """docs/benchmarks.md's cost-model tables are this script's output at the documented shape."""
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    shape = cm.Shape(8192, 128256, 4096, 10)
    tables = [cm.markdown(shape), cm.chunk_table(cm.Shape(8192, 128256, 4096, 1110))]
    tables.append(cm.breakdown(cm.ce_ntl_chunked(cm.Shape(8192, 128256, 4096, 1110))))
    for line in "\n".join(tables).splitlines():
        if line.startswith(("|", "The on-chip")):
            assert line in docs, f"docs/benchmarks.md lacks (run benchmarks/cost_model.py --markdown): {line}"
