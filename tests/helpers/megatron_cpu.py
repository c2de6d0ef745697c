"""Test-only patches that let ``megatron.core`` models and pipeline schedules run on CPU over gloo.

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


def tiny_gpt(vocab_size: int, seq_length: int, *, tp: int, pp: int, pp_rank: int, seed: int = 1234, model_class=None):
    """A 2-layer GPTModel on CPU (local layer spec, fp32, no fusions, dropout 0)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    torch.manual_seed(seed)
    return (model_class or GPTModel)(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )
