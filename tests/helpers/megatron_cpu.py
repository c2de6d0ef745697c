"""Test-only patches (and a tiny model) that let ``megatron.core`` models and pipeline schedules run on CPU over gloo.

The patches live in ``benchmarks/common.py`` (the CPU benchmark of Megatron's step needs them too; benchmarks
import nothing from ``tests/``). Never imported by the library. Apply :func:`patch_for_cpu` in each spawned
worker before building anything. What it changes, and why (found by running Megatron 0.16 here):

* ``torch.cuda.current_device`` returns the CPU device and ``torch.cuda.synchronize`` does nothing
  (the schedules and layers call them unconditionally);
* ``torch.zeros(..., device="cuda")`` and friends are redirected to CPU (the schedule allocates its
  token counter on "cuda");
* the CUDA RNG tracker is replaced by one whose ``add`` only records and whose ``fork`` does nothing
  (so the model must use dropout 0).
"""

from __future__ import annotations

import torch

from benchmarks.common import patch_for_cpu

__all__ = ["patch_for_cpu", "tiny_gpt"]


def tiny_gpt(vocab_size: int, seq_length: int, *, tp: int, pp: int, seed: int = 1234, model_class=None):
    """The example's GPTModel builder (launch/megatron_example.py), smaller: hidden 16, 2 heads."""

    from tests.helpers.scripts import load_script

    example = load_script("launch/megatron_example.py", "megatron_example")
    torch.manual_seed(seed)
    return example.build_model(
        vocab_size,
        seq_length,
        tp,
        pp,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        model_class=model_class,
    )
