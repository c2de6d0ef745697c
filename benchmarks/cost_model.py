"""A GPU cost model (a model, not a measurement) of CE and CE + NTL, forward + backward, per code path.

    python benchmarks/cost_model.py --markdown                  # the tables of docs/benchmarks.md
    python benchmarks/cost_model.py --tokens 8192 --vocab 128256 --hidden 4096 --numbers 1110

Counts the bytes each kernel of a path reads and writes in HBM and its FLOPs, from what the code
does (``ntl_scale/ops/triton_ce_ntl.py``, ``ntl_scale/ops/logits.py``, ``ntl_scale/linear.py``
with ``impl="triton"``), and turns them into H100 SXM times with a roofline per kernel:
``time = sum over kernels of max(bytes / bandwidth, FLOPs / matmul peak)`` (kernels run one after
the other; within one, memory and math overlap). Also given: the whole path's
``max(sum bytes / bandwidth, sum FLOPs / peak)``, the bound if everything overlapped. Assumptions,
each a lower bound on traffic: a GEMM reads each operand once and writes its output once (tiles
re-read from L2, not HBM); a kernel's per-token scalars count; launch latency, the all-reduces
(tensor parallelism) and the caches are not modelled. Paths, the output layer ``[V, H]`` included in
each so that they compare with the fused linear-CE kernels:

* ``ce_logits``: CE alone on materialised logits, the floor of any CE-only logits kernel (Liger's
  and QuACK's CE, Megatron's in place): the logits GEMM, one read of the logits in the forward, one
  read and one in-place write in the backward, the two gradient GEMMs.
* ``ce_ntl_logits``: ``ce_with_ntl(..., impl="triton")`` on bf16 logits: the statistics kernel reads
  the logits once, the gradient kernel reads them once and writes the gradient once (into a new buffer:
  ``inplace=True`` takes fp32 logits only; the traffic is the same either way); NTL adds the
  ``K`` number columns (their gather, ``exp(z_N - mN)``, the ``[T, K]`` gradient terms).
* ``ce_chunked`` / ``ce_ntl_chunked``: ``linear_ce_with_ntl(..., impl="triton")`` without / with the
  NTL terms, as the code runs on a GPU: per chunk of ``C`` tokens (the op's GPU default,
  ``ntl_scale.ops.chunked_linear.choose_chunk_tokens``: ``2**28 // V``, chunks of 2092 at 8192 x 128256 x
  4096) the logits GEMM, one kernel for the statistics and the softmax written in place (the row read
  twice, the second time from L2: the model's best case, Liger's cross-entropy kernel's design;
  ``ce_ntl_chunked_persistent`` the launch the op makes on an H100, a persistent
  grid of one program per SM (``softmax_launch``), with the share of second reads L2 serves from
  :func:`l2_hit_share`, a reuse-distance model at 25 MiB of effective L2; ``ce_ntl_chunked_per_row`` the
  same model for one program per row, four per SM: 528 rows of 250 KiB in flight; the GPU measures where
  they land). Under tensor parallelism the
  kernel writes the shard's softmax over its local statistics and a per-token factor from the all-reduces,
  folded into ``P_h``'s rows and the weight gradient's hidden rows, makes it global: ``[C, H]`` work, not
  modelled; the model is of one device),
  ``P_h = pi W`` (bf16 out, kept in bf16), and ``G_W += (w pi)^T h`` with the fp32 ``[V, H]`` accumulator
  read and written in the GEMM's epilogue (the first chunk's GEMM writes it: no zeroing pass); the backward
  completes ``P_h``'s rows in fp32 (times ``u``, the label and number columns, ``O(T K H)``), rounds them
  once into ``P_h``'s buffer, the input gradient, and writes the weight gradient in
  bf16 from the accumulator with the scale applied in that one pass (the folded passes).
* ``ce_ntl_chunked_cpu_chunk``: the same with the CPU's chunk, ``C = 2**26 // V`` (523 tokens at 128256).
* ``linear_ce_recompute``: a fused linear CE that never writes the logits (Cut Cross-Entropy's design, exact:
  ``filter_eps=None``): a forward kernel (the log-sum-exp) and a backward kernel that recomputes each logits
  tile before its two gradient products, ``8 T V H`` FLOPs, operands read once and gradients written once: the
  floor of an exact design whose logits never reach HBM. ``linear_ce_filtered``: the same with every gradient
  tile skipped (CCE's default ``filter_eps`` skips a tile whose every entry of ``softmax - onehot`` is below
  bf16's eps / 32; how many it skips depends on the logits): ``4 T V H``, the floor of CCE's filtering design,
  which recomputes every tile before deciding (a design that kept per-tile maxima from the forward could skip
  the recompute too: ``(2 + 6 k) T V H`` at a share ``k`` of tiles kept; not modelled).
  ``linear_ce_no_recompute``: the three GEMMs of the materialised path with the logits neither stored nor
  recomputed, ``6 T V H``: a bound no design reaches at this table's shapes (a vocabulary row's weight gradient
  sums over the tokens each divided by its normaliser, known only once that token's whole row of logits is: a
  second pass over the logits, ``2 T V H`` more, whether ``dh`` is accumulated online in the first or not; a
  token block's whole row fits on chip only at vocabularies far below these, and with a frozen output layer
  one pass with ``dh`` online suffices, ``4 T V H``), which this table called "the floor of every path"
  before it had the recompute row.
* the on-chip op's paths (logits on chip, ``lab/on_chip/``): ``lab/on_chip/cost_model.py``, built on this one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's ntl_scale, run as a script
from ntl_scale.ops import chunked_linear, triton_ce_ntl

#: H100 SXM5 (80 GB HBM3): memory bandwidth and dense bf16 tensor-core throughput (no sparsity).
#: Source: NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column: 3.35 TB/s; 1,979 TFLOPS bf16 with
#: sparsity, so 989 TFLOP/s dense).
H100_BANDWIDTH = 3.35e12  # bytes / s
H100_BF16_FLOPS = 989e12  # FLOP / s

CHUNK_ELEMENTS = chunked_linear.CPU_CHUNK_ELEMENTS  # logits elements per chunk on the CPU (2**26)


#: H100 SXM: 132 SMs and 50 MiB of L2 (what ``torch.cuda.get_device_properties`` reports: 52428800 bytes),
#: in two partitions. The effective L2 of one row's data is modelled between one partition and the whole.
H100_SMS = 132
H100_L2 = 50 * 2**20
L2_CAPACITIES = (H100_L2 // 2, H100_L2)


def l2_hit_share(rows_in_flight: int, row_bytes: int, capacity: int) -> float:
    """The share of the statistics-and-softmax kernel's second walk that L2 serves (a reuse-distance model).

    Each program walks its row forwards, then backwards from the block it read last: the block ``x`` bytes
    from the row's end is re-read after the program's own ``2 x`` bytes of walking, during which the other
    programs in flight bring new lines in at the rate of their misses: all of their first walk, ``1 - h``
    of their second. With LRU, a block hits when those ``rows x (2 - h) x`` bytes fit in ``capacity``:
    ``h (2 - h) = min(1, capacity / (rows x row_bytes))``, so ``h = 1 - sqrt(1 - that)``. In place (the
    chunked op's case), the writes land on the lines read, adding none.
    """
    ratio = min(1.0, capacity / max(1, rows_in_flight * row_bytes))
    return 1.0 - (1.0 - ratio) ** 0.5


def rows_in_flight(s: Shape, chunk: int, persistent: bool = True) -> int:
    """Rows the statistics-and-softmax launch keeps in flight on an H100 at chunk ``chunk``: its persistent
    grid (``triton_ce_ntl.softmax_launch``, a row per program), or one program per row (four 16-warp
    programs per SM, ``docs/kernels.md``)."""
    if persistent:
        return triton_ce_ntl.softmax_launch(chunk, s.vocab, s.elem * s.vocab, s.elem, H100_SMS, H100_L2)[0]
    return triton_ce_ntl.per_row_in_flight(chunk, H100_SMS)


def modelled_hits(s: Shape, persistent: bool = True) -> tuple[float, float]:
    """:func:`l2_hit_share` of the default chunk's launch at the two :data:`L2_CAPACITIES`."""
    rows = rows_in_flight(s, chunk_rows(s)[0], persistent)
    return tuple(l2_hit_share(rows, s.elem * s.vocab, c) for c in L2_CAPACITIES)  # type: ignore[return-value]


@dataclass(frozen=True)
class Shape:
    """Tokens ``T``, vocabulary ``V``, hidden ``H``, number tokens ``K``; element size of the logits
    and parameters (bf16: 2); fp32 (4) for per-token statistics, accumulators and the NTL terms."""

    tokens: int
    vocab: int
    hidden: int
    numbers: int
    elem: int = 2
    f32: int = 4


@dataclass(frozen=True)
class Kernel:
    name: str
    bytes: float
    flops: float = 0.0

    def seconds(self, bandwidth: float = H100_BANDWIDTH, peak: float = H100_BF16_FLOPS) -> float:
        return max(self.bytes / bandwidth, self.flops / peak)


def gemm(name: str, m: int, n: int, k: int, read: float, write: float) -> Kernel:
    """A ``[m, k] x [k, n]`` GEMM: ``2 m n k`` FLOPs; ``read`` and ``write`` in bytes."""
    return Kernel(name, read + write, 2.0 * m * n * k)


def _output_layer(s: Shape, grad_in_place: bool = True) -> list[Kernel]:
    """The materialised paths' three GEMMs: z = h W^T, dh = dz W, dW = dz^T h (bf16 in and out)."""
    t, v, h, e = s.tokens, s.vocab, s.hidden, s.elem
    return [
        gemm("logits = h W^T", t, v, h, read=e * (t * h + v * h), write=e * t * v),
        gemm("dh = dz W", t, h, v, read=e * (t * v + v * h), write=e * t * h),
        gemm("dW = dz^T h", v, h, t, read=e * (t * v + t * h), write=e * v * h),
    ]


def _ntl_terms(s: Shape, tokens: int) -> list[Kernel]:
    """What NTL adds over ``tokens`` tokens besides the passes it shares with CE (``[T, K]`` work)."""
    t, k, e, f = tokens, s.numbers, s.elem, s.f32
    return [
        # a_table (|v_k - t| per token, fp32) built and read by the statistics kernel; the number
        # columns gathered (index_select) and exp(z_N - mN) kept for the backward
        Kernel("NTL: a_table, number columns, exp(z_N - mN)", f * t * k * 3 + e * t * k + f * t * k * 2),
        # backward: p, pi_N, (a - expect), the [T, K] gradient, each read/written once in fp32
        Kernel("NTL: [T, K] gradient terms", f * t * k * 8),
    ]


def ce_logits(s: Shape) -> list[Kernel]:
    t, v, e, f = s.tokens, s.vocab, s.elem, s.f32
    return [
        *_output_layer(s)[:1],
        Kernel("CE forward: read logits", e * t * v + f * t * 3),
        Kernel("CE backward: read logits, write gradient in place", 2 * e * t * v + f * t * 3),
        *_output_layer(s)[1:],
    ]


def ce_ntl_logits(s: Shape) -> list[Kernel]:
    t, v, e, f, k = s.tokens, s.vocab, s.elem, s.f32, s.numbers
    return [
        *_output_layer(s)[:1],
        # stats_kernel: the row once, the label logit, the K number columns and a_k; [T, 6] out
        Kernel("stats kernel: read logits (+ K columns, a_k)", e * t * v + e * t * k + f * t * k + f * t * 7),
        *_ntl_terms(s, t),
        # grad_kernel: the row read once, the gradient written once; K columns stored from fp32
        Kernel("grad kernel: read logits, write gradient", 2 * e * t * v + f * t * (5 + k) + e * t * k),
        *_output_layer(s)[1:],
    ]


def device_chunk(s: Shape) -> int:
    """The chunk the op chooses on a GPU (``choose_chunk_tokens``: ``2**28 // V`` tokens, at most ``T``)."""
    return chunked_linear.choose_chunk_tokens("cuda", s.tokens, s.vocab)


def cpu_chunk(s: Shape) -> int:
    """The CPU's chunk, ``2**26 // V`` tokens (the op's default on every device before issue 43)."""
    return max(1, CHUNK_ELEMENTS // max(s.vocab, 1))


def chunk_rows(s: Shape, chunk_tokens: int | None = None) -> list[int]:
    """Chunk lengths as ``ShardMath.chunk_rows`` makes them (default: the device-chosen chunk)."""
    step = chunk_tokens or device_chunk(s)
    return [min(step, s.tokens - i) for i in range(0, s.tokens, step)]


def _chunked(
    s: Shape,
    ntl: bool,
    chunk_tokens: int | None = None,
    folded: bool = True,
    one_kernel: bool = True,
    l2_hits: float = 1.0,
) -> list[Kernel]:
    v, h, e, f, k = s.vocab, s.hidden, s.elem, s.f32, s.numbers
    out = [] if folded else [Kernel("G_W = 0 (fp32 [V, H])", f * v * h)]
    for i, c in enumerate(chunk_rows(s, chunk_tokens)):
        first = folded and i == 0  # the first chunk's GEMM writes the accumulator without reading it
        numbers = e * c * k + f * c * k if ntl else 0
        if one_kernel:  # the statistics kernel writes the softmax too; l2_hits of the row's second read from L2
            second = (1.0 - l2_hits) * e * c * v
            softmax = [
                Kernel("chunk: statistics and softmax, one kernel", 2 * e * c * v + second + numbers + f * c * 7)
            ]
        else:  # the logits read twice from HBM (two kernels, or one whose second reads all miss L2)
            softmax = [
                Kernel("chunk: stats kernel", e * c * v + numbers + f * c * 7),
                Kernel("chunk: softmax written in place", 2 * e * c * v + f * c * 3),
            ]
        out += [
            gemm("chunk: z = h W^T", c, v, h, read=e * (c * h + v * h), write=e * c * v),
            *softmax,
            # P_h[sl] = pi W: bf16 GEMM, its output copied into the fp32 P_h
            gemm("chunk: P_h = pi W", c, h, v, read=e * (c * v + v * h), write=e * c * h),
            # the weight gradient's hidden rows; before issue 43 also P_h's copy into an fp32 buffer
            Kernel("chunk: w h rows (the weight gradient's hidden rows)", 2 * e * c * h)
            if folded
            else Kernel("chunk: P_h rows to fp32; w h rows", e * c * h + f * c * h + 2 * e * c * h),
            # fp32-output GEMM adding into the accumulator in its epilogue: G_W read and written
            gemm(
                "chunk: G_W = (w pi)^T h (first chunk, beta=0)" if first else "chunk: G_W += (w pi)^T h",
                v, h, c, read=e * (c * v + c * h) + (0 if first else f * v * h), write=f * v * h,
            ),
        ]  # fmt: skip
    t = s.tokens
    if folded:
        out += [
            Kernel("backward: grad_h rows: P_h to fp32, times u", e * t * h + 3 * f * t * h),
            Kernel("backward: label column rows (index_select, index_add)", e * t * h + 2 * f * t * h * 2),
            Kernel("backward: grad_h to bf16; grad_W = s G_W written in bf16", f * t * h + e * t * h + (f + e) * v * h),
        ]
    else:
        out += [
            Kernel("backward: grad_h = u P_h; grad_W = s G_W", 2 * f * t * h + 2 * f * v * h),
            Kernel("backward: label column rows (index_select, index_add)", e * t * h + 2 * f * t * h * 2),
            Kernel("backward: to bf16 (grad_h, grad_W)", f * t * h + e * t * h + f * v * h + e * v * h),
        ]
    if ntl:
        out += _ntl_terms(s, t)
        out += [
            gemm("backward: number columns dh += c_N W_N", t, h, k, read=f * (t * k + k * h), write=f * t * h),
            gemm("backward: number columns dW_N += c_N^T h", k, h, t, read=f * t * k + e * t * h, write=f * k * h),
        ]
    return out


def ce_chunked(s: Shape, chunk_tokens: int | None = None) -> list[Kernel]:
    return _chunked(s, False, chunk_tokens)


def ce_ntl_chunked(s: Shape, chunk_tokens: int | None = None) -> list[Kernel]:
    return _chunked(s, True, chunk_tokens)


def ce_ntl_chunked_persistent(s: Shape) -> list[Kernel]:
    return _chunked(s, True, None, l2_hits=modelled_hits(s, persistent=True)[0])


def ce_ntl_chunked_per_row(s: Shape) -> list[Kernel]:
    return _chunked(s, True, None, l2_hits=modelled_hits(s, persistent=False)[0])


def ce_ntl_chunked_cpu_chunk(s: Shape) -> list[Kernel]:
    return _chunked(s, True, cpu_chunk(s))


def _lse_forward(s: Shape) -> Kernel:
    """A fused linear CE's forward kernel: ``z`` tile by tile on chip, the log-sum-exp out."""
    t, v, h, e = s.tokens, s.vocab, s.hidden, s.elem
    return gemm("forward: z = h W^T on chip, LSE", t, v, h, read=e * (t * h + v * h), write=4 * t)


def linear_ce_no_recompute(s: Shape) -> list[Kernel]:
    t, v, h, e = s.tokens, s.vocab, s.hidden, s.elem
    return [
        _lse_forward(s),
        gemm("backward: dh (z at hand: no design has it)", t, h, v, read=e * (t * h + v * h), write=e * t * h),
        gemm("backward: dW (z at hand: no design has it)", v, h, t, read=e * (t * h + v * h), write=e * v * h),
    ]


def linear_ce_recompute(s: Shape, kept: float = 1.0) -> list[Kernel]:
    """A fused linear CE whose logits never reach HBM, as Cut Cross-Entropy runs it: a forward kernel (``z``
    tile by tile, the log-sum-exp out) and one backward kernel that recomputes each ``z`` tile and, for the
    share ``kept`` of the tiles its filter keeps, adds the tile's ``dh`` and ``dW`` products. Operands read once
    and gradients written once: the bound of that design (its read-modify-write gradient traffic left out)."""
    t, v, h, e = s.tokens, s.vocab, s.hidden, s.elem
    tvh = 2.0 * t * v * h
    return [
        _lse_forward(s),
        Kernel(f"backward: z recomputed; dh, dW on {kept:.0%} of the tiles", 2 * e * (t * h + v * h),
               tvh * (1 + 2 * kept)),
    ]  # fmt: skip


def linear_ce_filtered(s: Shape) -> list[Kernel]:
    return linear_ce_recompute(s, kept=0.0)


PATHS: dict[str, tuple[str, Callable[[Shape], list[Kernel]]]] = {
    "ce_logits": ("CE alone, logits materialised (floor of CE-only logits kernels)", ce_logits),
    "ce_ntl_logits": ("CE + NTL fused on logits (ours, Triton)", ce_ntl_logits),
    "ce_chunked": ("CE alone, chunked from hidden states (our chunking, no NTL)", ce_chunked),
    "ce_ntl_chunked": (
        "CE + NTL chunked from hidden states (ours, Triton: statistics and softmax in one kernel, its second "
        "walk all from L2, the best case; device-chosen chunk, folded passes)",
        ce_ntl_chunked,
    ),
    "ce_ntl_chunked_persistent": (
        "the same as launched on an H100: a persistent grid, one program per SM (rows in flight: a program each; "
        "reuse-distance model of the second walk's L2 hits at 25 MiB effective L2)",
        ce_ntl_chunked_persistent,
    ),
    "ce_ntl_chunked_per_row": (
        "the same launched with one program per row (the launch before: four per SM; the same model)",
        ce_ntl_chunked_per_row,
    ),
    "ce_ntl_chunked_cpu_chunk": ("the same at the CPU's 2**26/V-token chunk", ce_ntl_chunked_cpu_chunk),
    "linear_ce_recompute": (
        "fused linear CE, logits never in HBM, recomputed in the backward (CCE's design, exact: no tile "
        "filtered; the floor of an exact design without the logits in HBM)",
        linear_ce_recompute,
    ),
    "linear_ce_filtered": (
        "the same with every gradient tile filtered (CCE's default filter at its limit: the forward and the "
        "recompute alone; the floor of CCE's filtering design)",
        linear_ce_filtered,
    ),
    "linear_ce_no_recompute": (
        "fused linear CE with the logits neither in HBM nor recomputed (6 T V H: a bound no design reaches; "
        "this table's 'floor' before the correction)",
        linear_ce_no_recompute,
    ),
}


@dataclass(frozen=True)
class Cost:
    bytes: float
    flops: float
    seconds: float  #: sum over kernels of each kernel's roofline
    overlapped: float  #: max(total bytes / bandwidth, total FLOPs / peak)
    kernels: int


def cost(kernels: list[Kernel], bandwidth: float = H100_BANDWIDTH, peak: float = H100_BF16_FLOPS) -> Cost:
    total_bytes = sum(k.bytes for k in kernels)
    total_flops = sum(k.flops for k in kernels)
    return Cost(
        total_bytes,
        total_flops,
        sum(k.seconds(bandwidth, peak) for k in kernels),
        max(total_bytes / bandwidth, total_flops / peak),
        len(kernels),
    )


def chunk_table(s: Shape) -> str:
    """The chunked CE + NTL's modelled time against the chunk length, as a ratio to CE alone on logits."""
    base = cost(ce_logits(s)).seconds
    default, cpu = chunk_rows(s)[0], cpu_chunk(s)
    lines = [
        "| chunk tokens | logits per chunk (MiB) | H100 time, folded (ms) | x CE alone (logits) "
        "| not folded, two kernels (ms) | x CE alone |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for c in sorted({default, cpu, 1024, 2048, 4096, s.tokens}):
        seconds = cost(ce_ntl_chunked(s, c)).seconds
        before = cost(_chunked(s, True, c, folded=False, one_kernel=False)).seconds
        mark = " (GPU default)" if c == default else " (CPU default)" if c == cpu else ""
        lines.append(
            f"| {c}{mark} | {c * s.vocab * s.elem / 2**20:.0f} | {seconds * 1e3:.2f} | {seconds / base:.3f} "
            f"| {before * 1e3:.2f} | {before / base:.3f} |"
        )
    return "\n".join(lines)


def bandwidth_needed(s: Shape, ratio: float = 1.1, reference: float = H100_BANDWIDTH) -> float:
    """The HBM bandwidth (bytes/s) the fused CE + NTL's two kernels on logits must sustain for the path to
    be within ``ratio`` of CE alone on logits whose CE passes run at ``reference`` (all GEMMs as modelled)."""
    ce = ce_logits(s)
    budget = ratio * cost(ce, reference).seconds
    ours = ce_ntl_logits(s)
    kernels = [k for k in ours if "kernel" in k.name]
    rest = cost([k for k in ours if "kernel" not in k.name]).seconds
    return sum(k.bytes for k in kernels) / (budget - rest)


def markdown(s: Shape, bandwidth: float = H100_BANDWIDTH, peak: float = H100_BF16_FLOPS) -> str:
    base = cost(ce_logits(s), bandwidth, peak)
    lines = [
        f"T x V x H = {s.tokens} x {s.vocab} x {s.hidden}, K = {s.numbers} number tokens, {s.elem}-byte "
        "(bf16) logits and parameters; forward + backward, the output layer included",
        "",
        f"| path (model) | kernels | HBM bytes (GB) | FLOPs (TFLOP) | time at {bandwidth / 1e12:.2f} TB/s and "
        f"{peak / 1e12:.0f} TFLOP/s, per-kernel roofline (ms) "
        "| all overlapped (ms) | x CE alone (logits) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for _key, (label, fn) in PATHS.items():
        c = cost(fn(s), bandwidth, peak)
        lines.append(
            f"| {label} | {c.kernels} | {c.bytes / 1e9:.2f} | {c.flops / 1e12:.2f} | {c.seconds * 1e3:.2f} "
            f"| {c.overlapped * 1e3:.2f} | {c.seconds / base.seconds:.3f} |"
        )
    return "\n".join(lines)


def breakdown(kernels: list[Kernel]) -> str:
    """Per-kernel-name sums: bytes, FLOPs and roofline time."""
    sums: dict[str, list[float]] = {}
    for k in kernels:
        row = sums.setdefault(k.name, [0.0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += k.bytes
        row[2] += k.flops
        row[3] += k.seconds()
    lines = ["| kernel | count | GB | TFLOP | ms | bound |", "|---|---:|---:|---:|---:|---|"]
    for name, (n, b, fl, sec) in sums.items():
        bound = "memory" if b / H100_BANDWIDTH >= fl / H100_BF16_FLOPS else "math"
        lines.append(f"| {name} | {n:.0f} | {b / 1e9:.3f} | {fl / 1e12:.2f} | {sec * 1e3:.3f} | {bound} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--numbers", type=int, nargs="+", default=[10, 1110], help="number tokens K (10: digits)")
    parser.add_argument("--markdown", action="store_true", help="also the per-kernel breakdown of the chunked path")
    parser.add_argument("--bandwidth", type=float, default=H100_BANDWIDTH, help="bytes/s (default: H100 SXM)")
    parser.add_argument("--peak", type=float, default=H100_BF16_FLOPS, help="dense bf16 FLOP/s (default: H100 SXM)")
    args = parser.parse_args(argv)
    for k in args.numbers:
        s = Shape(args.tokens, args.vocab, args.hidden, k)
        print(markdown(s, args.bandwidth, args.peak))
        print()
        if (args.bandwidth, args.peak) == (H100_BANDWIDTH, H100_BF16_FLOPS):
            for reference in (H100_BANDWIDTH, 3.0e12):
                need = bandwidth_needed(s, 1.1, reference)
                print(
                    f"Within 1.1x of CE alone whose logits passes run at {reference / 1e12:.2f} TB/s: our two "
                    f"kernels on logits must sustain {need / 1e12:.2f} TB/s ({need / H100_BANDWIDTH:.0%} of 3.35 TB/s)."
                )
            print()
    s = Shape(args.tokens, args.vocab, args.hidden, args.numbers[-1])
    print(f"Chunked CE + NTL against the chunk length, K = {s.numbers}:\n")
    print(chunk_table(s))
    print()
    if args.markdown:
        print(f"Chunked CE + NTL, K = {s.numbers}, default chunks, per kernel:\n")
        print(breakdown(ce_ntl_chunked(s)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
