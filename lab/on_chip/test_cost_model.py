"""The on-chip op's half of the cost model (``lab/on_chip/cost_model.py``) against counts written here.

1. Its path: 8 T V H FLOPs (the backward recomputes the logits; the exact floor of
   ``benchmarks/cost_model.py``'s ``linear_ce_recompute``) plus the number columns' 6 T K H; no [T, V] term in
   its bytes.
2. The LRU simulation of its backward's atomics at its limits (everything fits, nothing does), its
   extrapolation over the vocabulary, and the grouped launch order against the order before.
3. lab/README.md holds the model's tables at 8192 x 128256 x 4096.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the on-chip kernel's launch table imports triton")

from benchmarks import cost_model as base
from lab.on_chip import cost_model as cm

ROOT = Path(__file__).resolve().parents[2]
T, V, H = 96, 640, 32


def test_on_chip_does_what_the_exact_floor_does_plus_the_number_columns():
    shape = cm.Shape(T, V, H, 10)
    assert (
        base.cost(cm.ce_ntl_on_chip(shape)).flops - 6 * T * 10 * H == base.cost(base.linear_ce_recompute(shape)).flops
    )


def test_on_chip_path_counts_its_recompute_and_atomics():
    """The fused linear CE + NTL (logits on chip) row: 8 T V H FLOPs (the backward recomputes the logits) plus
    the number columns' 6 T K H; no [T, V] term in its bytes while its atomics stay in L2."""
    shape = cm.Shape(T, V, H, 10)
    got = base.cost(cm.ce_ntl_on_chip(shape))
    assert got.flops == 8 * T * V * H + 6 * T * shape.numbers * H
    # never the logits: no T x V term in the bytes (their mixed second difference in T and V is 0)
    size = {(t, v): base.cost(cm.ce_ntl_on_chip(cm.Shape(t, v, H, 10))).bytes for t in (T, 2 * T) for v in (V, 2 * V)}
    assert size[2 * T, 2 * V] - size[2 * T, V] - size[T, 2 * V] + size[T, V] == 0
    chunked = {
        (t, v): base.cost(base.ce_ntl_chunked(cm.Shape(t, v, H, 10), 40)).bytes for t in (T, 2 * T) for v in (V, 2 * V)
    }
    assert chunked[2 * T, 2 * V] - chunked[2 * T, V] - chunked[T, 2 * V] + chunked[T, V] > 0  # it writes them


@pytest.mark.parametrize("waves", [False, True], ids=["out-of-phase", "waves"])
@pytest.mark.parametrize(("blocks", "tiles", "group", "programs"), [(10, 30, 4, 12), (7, 60, 3, 9), (5, 9, 8, 40)])
def test_on_chip_backward_simulation_meets_its_limits(blocks, tiles, group, programs, waves):
    """The LRU simulation of the on-chip backward's atomics against two counts written here from the launch:

    * L2 twice the reuse bounds (``on_chip_reuse``) of a full and of the last group (the change from one group to
      the next holds both): each ``dH`` strip and its hidden rows once, each ``dW`` tile and its weight rows once
      per group of token blocks (the last group shorter; the vocabulary's tiles outgrow the cache); 10 bytes per
      element (fp32 read and written, the bf16 operand read);
    * no L2: every program reads its hidden and weight rows twice (the recompute, the gradients) and reads and
      writes its strip and its tile: ``(BLOCK_T + BLOCK_V) H (2 + 2 + 4 + 4)`` bytes a program.
    """
    bt, bv = cm.ON_CHIP_BLOCKS["BLOCK_T"], cm.ON_CHIP_BLOCKS["BLOCK_V"]
    s = cm.Shape(blocks * bt, tiles * bv, 8 * 16, 10)
    t, v = s.tokens, s.vocab  # whole tiles
    last = blocks - (-(-blocks // group) - 1) * group  # the last group's token blocks
    reuse = max(*cm.on_chip_reuse(s, group, programs), *cm.on_chip_reuse(s, last, programs))
    sweeps = -(-blocks // group)
    fits = cm.on_chip_backward_bytes(s, group, programs, 2 * reuse, waves)  # room for the change of group
    assert fits == t * s.hidden * 10 + sweeps * v * s.hidden * 10
    nothing = cm.on_chip_backward_bytes(s, group, programs, 0, waves)
    assert nothing == blocks * tiles * (bt + bv) * s.hidden * 12
    assert fits < cm.on_chip_backward_bytes(s, group, programs, reuse / 4, waves) < nothing


def test_on_chip_backward_extrapolation_and_the_launch_order():
    """Past 2 SIM_TILES vocabulary tiles the bytes are extrapolated from SIM_TILES and twice as many: within 1 %
    of simulating the whole vocabulary; and at the GPU model's shape the grouped order moves several times fewer
    bytes than the order before (all token blocks fastest)."""
    bt, bv = cm.ON_CHIP_BLOCKS["BLOCK_T"], cm.ON_CHIP_BLOCKS["BLOCK_V"]
    s = cm.Shape(24 * bt, 5 * cm.SIM_TILES * bv, 8 * 32, 10)
    args = (cm.ON_CHIP_BLOCKS["GROUP_T"], 24, 0.5 * max(cm.on_chip_reuse(s, cm.ON_CHIP_BLOCKS["GROUP_T"], 24)))
    cols = s.hidden / cm.SIM_SLICES
    whole = cm._simulate_backward(24, 5 * cm.SIM_TILES, cm.SIM_SLICES, 24, args[0], args[2], bt * cols, bv * cols)
    assert abs(cm.on_chip_backward_bytes(s, *args) / whole - 1) < 0.01
    gpu = cm.Shape(8192, 128256, 4096, 10)
    programs = cm.H100_SMS * cm.ON_CHIP_PROGRAMS_PER_SM
    grouped = cm.on_chip_backward_bytes(gpu, cm.ON_CHIP_BLOCKS["GROUP_T"], programs, cm.H100_L2)
    before = cm.on_chip_backward_bytes(gpu, 8192 // bt, programs, cm.H100_L2)
    assert before > 5 * grouped


def test_lab_readme_holds_the_model_output():
    """lab/README.md's tables are ``python -m lab.on_chip.cost_model``'s output at the documented shape."""
    readme = (ROOT / "lab" / "README.md").read_text()
    for line in cm.markdown(cm.Shape(8192, 128256, 4096, 10)).splitlines():
        if line.startswith(("|", "The on-chip")):
            assert line in readme, f"lab/README.md lacks (run python -m lab.on_chip.cost_model): {line}"
