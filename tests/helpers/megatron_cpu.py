"""Test-only patches (and a tiny model) that let ``megatron.core`` models and pipeline schedules run on CPU over gloo.

Never imported by the library. Apply :func:`patch_for_cpu` in each spawned worker before building
anything. What it changes, and why (found by running Megatron 0.16 here):

* ``torch.cuda.current_device`` returns the CPU device and ``torch.cuda.synchronize`` does nothing
  (the schedules and layers call them unconditionally);
* ``torch.zeros(..., device="cuda")`` and friends are redirected to CPU (the schedule allocates its
  token counter on "cuda");
* the CUDA RNG tracker is replaced by one whose ``add`` only records and whose ``fork`` does nothing
  (so the model must use dropout 0).
"""

from __future__ import annotations

import contextlib

import torch


class _CPURNGTracker:
    def __init__(self, *args, **kwargs):
        self.states_ = {}

    def reset(self):
        self.states_ = {}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def add(self, name, seed):
        self.states_[name] = seed

    def is_initialized(self):
        return True

    @contextlib.contextmanager
    def fork(self, name=None):
        yield


def _redirect(factory):
    def wrapped(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and "cuda" in str(device):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapped


def patch_for_cpu() -> None:
    """Applies the CPU patches in this process (idempotent)."""
    if getattr(torch, "_ntl_scale_cpu_patched", False):
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    for name in ("zeros", "ones", "empty", "full", "tensor"):
        setattr(torch, name, _redirect(getattr(torch, name)))
    from megatron.core.tensor_parallel import random as mp_random

    # get_cuda_rng_tracker() is re-exported under several names; it returns this module global once
    # the "initialized" flag is set, so replacing the global reaches every caller.
    mp_random._CUDA_RNG_STATE_TRACKER = _CPURNGTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch._ntl_scale_cpu_patched = True


def tiny_gpt(vocab_size: int, seq_length: int, *, tp: int, pp: int, seed: int = 1234, model_class=None):
    """The example's GPTModel builder (launch/megatron_example.py), smaller: hidden 16, 2 heads."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "launch" / "megatron_example.py"
    spec = importlib.util.spec_from_file_location("megatron_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
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
