"""The on-chip op's half of the cost model (a model, not a measurement): its backward's HBM traffic through an
LRU simulation of its launch, and its paths beside ``benchmarks/cost_model.py``'s.

    python -m lab.on_chip.cost_model          # the tables of lab/README.md (from the repository root)

``ce_ntl_on_chip``: ``lab/on_chip/triton_linear_ce_ntl.py`` (logits on chip, CE + NTL): the forward kernel
(``z`` tile by tile, ``[T, 6]`` statistics and the ``[T, K]`` number logits out), the host's per-token work, a
backward kernel that **recomputes** ``z`` (8 ``T V H`` FLOPs in all instead of 6) and adds ``dH`` and ``dW``
into zeroed fp32 buffers with atomics, the number columns' two small GEMMs and the casts to bf16. The backward
kernel's HBM bytes come from an LRU simulation of its launch (:func:`_simulate_backward`; grouped order,
:data:`ON_CHIP_PROGRAMS_PER_SM` programs per SM in flight) at 50 MiB of L2; ``ce_ntl_on_chip_small_l2`` at
25 MiB, ``ce_ntl_on_chip_ungrouped`` in the order before grouping (all token blocks fastest),
``ce_ntl_on_chip_no_l2`` with nothing kept (every program's strip, tile and operand rows from HBM: the bound).
The atomics' own L2 traffic (:func:`on_chip_atomics_payload`) is printed, not modelled. The shared parts (the
shape, kernels, GEMMs, the H100 constants, the roofline) are ``benchmarks/cost_model.py``'s.
"""

from __future__ import annotations

import argparse
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

from benchmarks import cost_model as cm
from benchmarks.cost_model import H100_BF16_FLOPS, H100_L2, H100_SMS, L2_CAPACITIES, Kernel, Shape, _ntl_terms, gemm
from lab.on_chip import triton_linear_ce_ntl as lk

#: The on-chip backward's bf16 launch (``triton_linear_ce_ntl.BACKWARD_BLOCKS["half"]``: tiles and group).
ON_CHIP_BLOCKS = lk.launch_blocks("backward", torch.bfloat16)
#: Its programs resident per SM on an H100: 93 registers and 80 KiB of shared memory at 8 warps give 16 warps
#: per SM (``docs/kernels.md``'s ahead-of-time table, sm_90; ``tests/unit/test_triton_aot.py`` checks), so 264
#: programs are in flight.
ON_CHIP_PROGRAMS_PER_SM = 2
#: ``bench_gpu.py``'s alternative (row ``ours_linear_on_chip_t128``): 128 x 128 tiles in groups of 4, one 16-warp
#: program per SM.
ON_CHIP_T128 = {"BLOCK_T": 128, "BLOCK_V": 128, "GROUP_T": 4}
#: How the simulated programs start: ``False`` out of phase (the first wave spread over one program's life),
#: ``True`` in waves (the first wave all at once, as a launch starts it, then one as each ends: equal programs
#: end together, so the waves persist). A GPU lies between or beyond (stalls desynchronise the programs).
SCHEDULES = (False, True)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _token_blocks(s: Shape) -> int:
    """The on-chip backward's token blocks: one group of them all is the order before grouping."""
    return _cdiv(s.tokens, ON_CHIP_BLOCKS["BLOCK_T"])


def _tiles(blocks: dict[str, int] | None) -> tuple[int, int]:
    b = ON_CHIP_BLOCKS if blocks is None else blocks
    return b["BLOCK_T"], b["BLOCK_V"]


def on_chip_reuse(s: Shape, group: int, programs: int, blocks: dict[str, int] | None = None) -> tuple[float, float]:
    """Bytes the on-chip backward's programs touch between two touches of one line of a ``dH`` strip / a ``dW``
    tile, repeats counted (an upper bound of the LRU reuse distance in the steady state).

    Programs run in grouped order (``_grouped_tile``): ``group`` token blocks fastest, then the vocabulary
    tiles, so the ``programs`` in flight span ``g = min(group, token blocks)`` token blocks and ``programs /
    g`` vocabulary tiles. Over its life each program reads and adds into its ``[BLOCK_T, H]`` strip and its
    ``[BLOCK_V, H]`` tile, reading the matching hidden and weight rows: ``(BLOCK_T + BLOCK_V) H (4 + 2)``
    bytes, ``u``. A ``dH`` line is touched by the ``programs / g`` programs of its token block in flight, so
    between two touches all programs together touch ``g u`` bytes; a ``dW`` line by the ``g`` of its tile:
    ``(programs / g) u``. From twice the largest of them, for a full group and for the last one, the
    simulation gives the closed form of :func:`on_chip_backward_bytes` (at the change of group both groups
    are in flight); just above them, up to 40 % more (``tests/unit/test_cost_model.py``).
    """
    bt, bv = _tiles(blocks)
    g = min(group, _cdiv(s.tokens, bt))
    u = (bt + bv) * s.hidden * (s.f32 + s.elem)
    return float(g * u), float(min(_cdiv(s.vocab, bv), programs / g) * u)


#: The simulation's grain: each strip and tile in this many slices of the hidden size, and the fewest vocabulary
#: tiles it runs (this many, or as many as twice the cache, then twice that, extrapolated linearly: past them
#: each further tile adds the same bytes; a vocabulary up to twice that is simulated whole).
SIM_SLICES, SIM_TILES = 8, 40


@functools.lru_cache(maxsize=64)
def _simulate_backward(
    blocks_t: int,
    tiles_v: int,
    slices: int,
    programs: int,
    group: int,
    capacity: float,
    strip: float,
    tile: float,
    waves: bool = False,
) -> float:
    """HBM bytes of the on-chip backward's program sequence through an LRU cache of ``capacity`` bytes.

    Programs ``(t, v)`` in grouped order (``group`` token blocks fastest, then the vocabulary tiles), at most
    ``programs`` in flight, the first of them started over one program's life (``programs / (6 slices)`` a
    round; ``waves``: all in the first round) and then one whenever one ends; each advances one access per
    round (:data:`SCHEDULES`). A
    program reads its hidden rows and weight rows slice by slice (the logits recomputed), then per slice reads
    both again and adds into its fp32 ``dH`` strip and ``dW`` tile. ``strip`` and ``tile``: rows of a token
    block and a vocabulary tile times the slice's columns. A miss reads the line from HBM, an evicted line
    that was added into is written back, and so are the dirty lines left at the end.
    """
    order = [
        (t, v)
        for first in range(0, blocks_t, group)
        for v in range(tiles_v)
        for t in range(first, min(first + group, blocks_t))
    ]
    h_bytes, w_bytes, dh_bytes, dw_bytes = 2 * strip, 2 * tile, 4 * strip, 4 * tile

    def accesses(t: int, v: int) -> Iterator[tuple[tuple[int, int, int], int, bool]]:
        for k in range(slices):
            yield (0, t, k), h_bytes, False
            yield (1, v, k), w_bytes, False
        for k in range(slices):
            yield (1, v, k), w_bytes, False
            yield (2, t, k), dh_bytes, True
            yield (0, t, k), h_bytes, False
            yield (3, v, k), dw_bytes, True

    cache: OrderedDict[tuple[int, int, int], list] = OrderedDict()
    used = moved = 0.0
    live: list[Iterator[tuple[tuple[int, int, int], int, bool]]] = []
    started, per_round = 0, programs if waves else _cdiv(programs, 6 * slices)
    while started < len(order) or live:
        for _ in range(per_round):
            if started < len(order) and len(live) < programs:
                live.append(accesses(*order[started]))
                started += 1
        for program in list(live):
            step = next(program, None)
            if step is None:
                live.remove(program)
                continue
            key, size, write = step
            line = cache.get(key)
            if line is not None:
                cache.move_to_end(key)
                line[1] = line[1] or write
                continue
            moved += size
            cache[key] = [size, write]
            used += size
            while used > capacity:
                _, (size_out, dirty) = cache.popitem(last=False)
                used -= size_out
                moved += size_out if dirty else 0
    return moved + sum(size for size, dirty in cache.values() if dirty)


def on_chip_backward_bytes(
    s: Shape,
    group: int,
    programs: int,
    capacity: float,
    waves: bool = False,
    blocks: dict[str, int] | None = None,
) -> float:
    """HBM bytes of the on-chip backward kernel (operand rows read, fp32 ``dH``/``dW`` accumulators read and
    written) in grouped order with ``capacity`` bytes of L2: :func:`_simulate_backward` at this shape's token
    blocks, ``programs``, ``capacity`` and schedule (``waves``), at the launch's tiles or ``blocks`` (whole
    tiles; the hidden size in :data:`SIM_SLICES` slices), over enough vocabulary tiles and twice as many,
    extrapolated linearly to the vocabulary's.

    From twice the bounds of :func:`on_chip_reuse` (while the vocabulary's tiles outgrow the cache) it gives the
    closed form: each ``dH`` strip and its hidden rows once, each ``dW`` tile and its weight rows once per
    group; with no L2, every program's strip and tile, read twice and added into once
    (``tests/unit/test_cost_model.py`` checks both).
    """
    bt, bv = _tiles(blocks)
    blocks_t, tiles_v = _cdiv(s.tokens, bt), _cdiv(s.vocab, bv)
    cols = s.hidden / SIM_SLICES
    args = (SIM_SLICES, programs, min(group, blocks_t), float(capacity), bt * cols, bv * cols, waves)
    # past the point where a sweep's dW tiles (and weight rows) outgrow twice the cache, nothing of one sweep
    # is left for the next, and each further tile adds the same bytes
    tiles = max(SIM_TILES, _cdiv(int(2 * capacity), bv * s.hidden * (s.f32 + s.elem)))
    if tiles_v <= 2 * tiles:
        return _simulate_backward(blocks_t, tiles_v, *args)  # type: ignore[arg-type]
    low = _simulate_backward(blocks_t, tiles, *args)  # type: ignore[arg-type]
    high = _simulate_backward(blocks_t, 2 * tiles, *args)  # type: ignore[arg-type]
    return low + (high - low) / tiles * (tiles_v - tiles)


def on_chip_atomics_payload(s: Shape, blocks: dict[str, int] | None = None) -> float:
    """Bytes of fp32 atomic adds the on-chip backward sends to L2: a ``[BLOCK_T, H]`` and a ``[BLOCK_V, H]``
    product per program, ``4 T H V / BLOCK_V + 4 V H T / BLOCK_T`` whatever the order."""
    bt, bv = _tiles(blocks)
    return float(s.f32 * s.hidden * (s.tokens * _cdiv(s.vocab, bv) + s.vocab * _cdiv(s.tokens, bt)))


def on_chip_order_table(s: Shape, groups: tuple[int, ...] = (4, 8, 12, 16)) -> str:
    """The on-chip backward kernel's HBM traffic (:func:`on_chip_backward_bytes`) per launch order, L2 size and
    schedule (out of phase / in waves), and at ``bench_gpu.py``'s 128 x 128 tiles."""
    programs, blocks_t = H100_SMS * ON_CHIP_PROGRAMS_PER_SM, _token_blocks(s)
    capacities = (15 * 2**20, *L2_CAPACITIES)
    lines = [
        "| backward launch order | "
        + " | ".join(f"{c / 2**20:.0f} MiB of L2: out of phase / in waves (GB)" for c in capacities)
        + " |",
        "|---|" + "---:|" * len(capacities),
    ]
    rows: list[tuple[str, int, int, dict[str, int] | None]] = []
    for group in (*groups, blocks_t):
        name = f"groups of {group} token blocks" if group < blocks_t else "all token blocks fastest (before)"
        rows.append((name + (" (the launch)" if group == ON_CHIP_BLOCKS["GROUP_T"] else ""), group, programs, None))
    t128 = ON_CHIP_T128
    rows.append((f"128 x 128 tiles, groups of {t128['GROUP_T']} (one program per SM)", t128["GROUP_T"], H100_SMS, t128))
    for name, group, inflight, blocks in rows:
        cells = " | ".join(
            " / ".join(f"{on_chip_backward_bytes(s, group, inflight, c, w, blocks) / 1e9:.0f}" for w in SCHEDULES)
            for c in capacities
        )
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def on_chip_atomics_line(s: Shape, peak: float = H100_BF16_FLOPS) -> str:
    """What the on-chip backward's atomics ask of L2 (not in the roofline): their bytes and the rate that hides
    them behind the backward kernel's math."""
    payload, math_s = on_chip_atomics_payload(s), 6.0 * s.tokens * s.vocab * s.hidden / peak
    return (
        f"The on-chip backward's fp32 atomics send {payload / 1e9:.0f} GB to L2 in any order; hidden behind its "
        f"{math_s * 1e3:.1f} ms of math only if L2 absorbs them at {payload / math_s / 1e12:.1f} TB/s (not modelled)."
    )


def ce_ntl_on_chip(s: Shape, group: int | None = None, capacity: float = H100_L2, waves: bool = False) -> list[Kernel]:
    """Ours, logits on chip: the forward, the host's work, the backward kernel (z recomputed, both gradients'
    atomics) with :func:`on_chip_backward_bytes` at ``capacity`` bytes of L2 in grouped order (``group`` token
    blocks per group; default the launch's), its programs out of phase or in ``waves``."""
    t, v, h, e, f, k = s.tokens, s.vocab, s.hidden, s.elem, s.f32, s.numbers
    group = ON_CHIP_BLOCKS["GROUP_T"] if group is None else group
    backward = on_chip_backward_bytes(s, group, H100_SMS * ON_CHIP_PROGRAMS_PER_SM, capacity, waves)
    return [
        gemm("forward kernel: z = h W^T on chip, online LSE, z_y", t, v, h, read=e * (t * h + v * h), write=f * t * 6),
        gemm(
            "forward kernel: number logits h W_N^T, their statistics",
            t,
            k,
            h,
            read=e * k * h + f * t * k,
            write=f * t * k,
        ),
        Kernel("host: all-reduce operands, finalize, u / S, label coefficients", f * t * 20),
        *_ntl_terms(s, t),
        Kernel("backward: dH, dW fp32 buffers zeroed", f * (t * h + v * h)),
        # one kernel: z recomputed (2 T V H), dH += dz W and dW += dz^T h (4 T V H), the atomics' HBM traffic
        Kernel("backward kernel: z recomputed, dH and dW added atomically", backward, 6.0 * t * v * h),
        gemm("backward: number columns dh += c_N W_N", t, h, k, read=f * (t * k + k * h), write=f * t * h),
        gemm("backward: number columns dW_N += c_N^T h", k, h, t, read=f * t * k + e * t * h, write=f * k * h),
        Kernel("backward: to bf16 (grad_h, grad_W)", f * t * h + e * t * h + f * v * h + e * v * h),
    ]


def ce_ntl_on_chip_waves(s: Shape) -> list[Kernel]:
    return ce_ntl_on_chip(s, waves=True)


def ce_ntl_on_chip_small_l2(s: Shape) -> list[Kernel]:
    return ce_ntl_on_chip(s, capacity=L2_CAPACITIES[0])


def ce_ntl_on_chip_small_l2_waves(s: Shape) -> list[Kernel]:
    return ce_ntl_on_chip(s, capacity=L2_CAPACITIES[0], waves=True)


def ce_ntl_on_chip_ungrouped(s: Shape) -> list[Kernel]:
    return ce_ntl_on_chip(s, group=_token_blocks(s))


def ce_ntl_on_chip_ungrouped_waves(s: Shape) -> list[Kernel]:
    return ce_ntl_on_chip(s, group=_token_blocks(s), waves=True)


def ce_ntl_on_chip_no_l2(s: Shape) -> list[Kernel]:
    return ce_ntl_on_chip(s, capacity=0)


PATHS: dict[str, tuple[str, Callable[[Shape], list[Kernel]]]] = {
    "ce_ntl_on_chip": (
        "CE + NTL fused linear, logits on chip (ours, Triton; grouped order; its atomics through an LRU "
        "simulation of 50 MiB of L2, programs out of phase)",
        ce_ntl_on_chip,
    ),
    "ce_ntl_on_chip_waves": ("the same, programs in waves", ce_ntl_on_chip_waves),
    "ce_ntl_on_chip_small_l2": ("the same at 25 MiB of effective L2, out of phase", ce_ntl_on_chip_small_l2),
    "ce_ntl_on_chip_small_l2_waves": ("the same at 25 MiB, in waves", ce_ntl_on_chip_small_l2_waves),
    "ce_ntl_on_chip_ungrouped": (
        "the same launched in the order before (all token blocks fastest), 50 MiB, out of phase",
        ce_ntl_on_chip_ungrouped,
    ),
    "ce_ntl_on_chip_ungrouped_waves": ("the order before, 50 MiB, in waves", ce_ntl_on_chip_ungrouped_waves),
    "ce_ntl_on_chip_no_l2": (
        "the same if L2 kept nothing (every program's strip, tile and rows from HBM: the bound)",
        ce_ntl_on_chip_no_l2,
    ),
}
"""The on-chip paths, keyed as ``benchmarks/bench_gpu.py``'s rows name their model."""


def markdown(s: Shape) -> str:
    """The on-chip paths' table (as ``benchmarks/cost_model.py``'s, against CE alone on logits), the backward's
    traffic per launch order and the atomics' line."""
    base = cm.cost(cm.ce_logits(s))
    lines = [
        "| path (model) | kernels | HBM bytes (GB) | FLOPs (TFLOP) | per-kernel roofline (ms) | x CE alone (logits) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, fn in PATHS.values():
        c = cm.cost(fn(s))
        lines.append(
            f"| {label} | {c.kernels} | {c.bytes / 1e9:.2f} | {c.flops / 1e12:.2f} | {c.seconds * 1e3:.2f} "
            f"| {c.seconds / base.seconds:.3f} |"
        )
    order = (
        f"The on-chip backward kernel's HBM bytes by launch order ({H100_SMS * ON_CHIP_PROGRAMS_PER_SM} programs "
        "in flight; LRU simulation):"
    )
    return "\n".join([*lines, "", order, "", on_chip_order_table(s), "", on_chip_atomics_line(s)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--numbers", type=int, default=10)
    args = parser.parse_args(argv)
    print(markdown(Shape(args.tokens, args.vocab, args.hidden, args.numbers)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
