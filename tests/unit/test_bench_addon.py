"""``benchmarks/bench_addon.py``'s count of NTL alone beside a CE, against the formulas it stands for.

FLOPs (``FlopCounterMode`` on meta tensors): the CE from hidden states is the output layer's ``6 T V H``, the add-on
``z_N = h W_N^T`` and its two gradient products, ``6 T K H``; on logits the add-on has no matmul. Bytes: the
add-on on logits writes one zero-filled ``[T, V]`` gradient and autograd sums it with the CE's (the dense gradient
the count reports); through the passthrough neither is there.
"""

from __future__ import annotations

from tests.helpers.scripts import load_script

bench = load_script("benchmarks/bench_addon.py", "bench_addon")


def test_count_matches_the_formulas():
    t, v, h, k = 64, 512, 32, 10
    counted = bench.count(t, v, h, k)
    assert counted["hidden"]["ce_flops"] == 6 * t * v * h
    assert counted["hidden"]["addon_flops"] == 6 * t * k * h
    assert counted["logits"]["addon_flops"] == 0
    logits_bytes = t * v * 2  # bf16
    assert counted["logits"]["addon_bytes"] >= 4 * logits_bytes  # the zero fill, then read, read, write in the sum
    assert counted["logits"]["addon_bytes"] < 0.5 * counted["logits"]["ce_bytes"]


def test_passthrough_addon_is_o_of_t_k_bytes():
    """Through ``beside_ce`` / ``linear_beside_ce`` no ``[T, V]`` or ``[V, H]`` buffer is filled or summed: on
    logits the add-on moves less than one pass over the bf16 logits, from hidden states less than the weight."""
    t, v, h, k = 64, 4096, 32, 10
    counted = bench.count(t, v, h, k)
    assert counted["logits, beside_ce"]["addon_bytes"] < t * v * 2
    assert counted["logits, beside_ce"]["addon_bytes"] < 0.2 * counted["logits"]["addon_bytes"]
    assert counted["hidden, linear_beside_ce"]["addon_bytes"] < v * h * 2
    assert counted["hidden, linear_beside_ce"]["addon_flops"] == 6 * t * k * h
