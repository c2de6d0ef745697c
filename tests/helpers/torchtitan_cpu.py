"""Runs torchtitan's own trainer (``torchtitan.train``) on CPU over gloo. Test only.

    torchrun --nproc_per_node 2 tests/helpers/torchtitan_cpu.py --module ... --config ... [overrides]

torchtitan 0.3.0 picks ``"cuda"`` when no accelerator is found (``torchtitan.tools.utils``:
``_get_available_device_type() or "cuda"``) and its metrics read the accelerator's memory
statistics. Each patch below redirects one such call, in this process only, before torchtitan is
imported; nothing of this reaches ``ntl_scale/`` or ``launch/``. Found by running torchtitan 0.3.0
with torch 2.13.0 (CPU) here:

* ``torch._utils._get_available_device_type`` returns ``"cpu"``, so torchtitan's ``device_type`` is
  ``"cpu"``, its device module ``torch.cpu`` and its process-group backend gloo (torch's default map);
* ``torch.cpu`` gains the memory-statistics calls of torchtitan's ``DeviceMemoryMonitor``
  (``get_device_name``, ``get_device_properties``, ``memory_stats``, ``reset_peak_memory_stats``,
  ``empty_cache``): a name, a nominal capacity and empty statistics;
* ``torch.distributed.barrier`` drops ``device_ids`` that are not indices (torchtitan's
  ``set_pg_timeouts`` passes ``[torch.cpu.current_device()]``, which is ``"cpu"``);
* ``torch.distributed.set_timeout``, which torchtitan's ``set_pg_timeouts`` calls after the first step,
  is torch 2.13's ``_set_pg_timeout`` (torch 2.13 has no public name for it; not a CPU matter: torchtitan
  0.3.0 expects a newer torch);
* FSDP2's gradient reduce-scatter sums instead of using ``ReduceOp.PREMUL_SUM(1.0)``, which gloo lacks
  (torchtitan sets ``gradient_divide_factor=1.0``): FSDP2's own ``force_sum_reduction_for_comms`` path,
  the same numbers (a sum, then a multiplication by 1).

Runs must also pass ``--training.disable_cuda_graphs`` (CUDA graphs capture CUDA streams) and
``--override.imports tests.helpers.torchtitan_cpu.sdpa_attention``: FlexAttention, the llama3 configs'
attention, has no backward on CPU in eager mode ("FlexAttention does not support backward on CPU"),
so this torchtitan override (its own mechanism, ``torchtitan.config.override``) swaps it for
torchtitan's ``ScaledDotProductAttention`` with the math kernel (causal over the whole sequence instead
of per document: both runs of a comparison use it; the CPU flash kernel has no DTensor sharding rule).

The default ``spmd_backend="spmd_types"`` cannot shard over more than one rank with torch 2.13
(its FSDP2 refuses plain parameters with ``dp_mesh_dims``: "all parameters
must be DTensors on the full SPMD mesh"; torchtitan 0.3.0 expects a newer torch), so
multi-rank runs use ``--parallelism.spmd_backend partial_dtensor``.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
import types

# Run as a script, this folder comes first on sys.path, and its tokenizers.py would shadow the
# `tokenizers` package that torchtitan imports.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import torch
import torch._utils


class _Props:
    name = "cpu"
    total_memory = 64 * 1024**3


def patch_for_cpu() -> None:
    """Redirects torchtitan's device choice and memory statistics to the CPU (idempotent)."""
    torch._utils._get_available_device_type = lambda: "cpu"  # type: ignore[assignment]
    cpu: types.ModuleType = torch.cpu
    extra = {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: _Props(),
        "memory_stats": lambda *a, **k: {},
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
    }
    for name, fn in extra.items():
        if not hasattr(cpu, name):
            setattr(cpu, name, fn)
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    factors = collectives._get_gradient_divide_factors
    if not hasattr(factors, "_ntl_scale_cpu"):

        def sum_factors(rs_group, ar_group, dtype, device_type="", factor=None, force_sum=False):  # type: ignore[no-untyped-def]
            return factors(rs_group, ar_group, dtype, device_type, factor, True)

        sum_factors.__wrapped__ = factors  # type: ignore[attr-defined]
        sum_factors._ntl_scale_cpu = True  # type: ignore[attr-defined]
        collectives._get_gradient_divide_factors = sum_factors
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]
    barrier = torch.distributed.barrier
    if not hasattr(barrier, "_ntl_scale_cpu"):

        def cpu_barrier(*args: object, device_ids: object = None, **kwargs: object) -> object:
            if isinstance(device_ids, list) and not all(isinstance(i, int) for i in device_ids):
                device_ids = None
            return barrier(*args, device_ids=device_ids, **kwargs)

        cpu_barrier.__wrapped__ = barrier  # type: ignore[attr-defined]
        cpu_barrier._ntl_scale_cpu = True  # type: ignore[attr-defined]
        torch.distributed.barrier = cpu_barrier  # type: ignore[assignment]


def sdpa_attention(cfg: object) -> object:
    """torchtitan override (``--override.imports``): FlexAttention -> causal SDPA on each rank's heads."""
    return _local_sdpa().Config()


@functools.cache
def _local_sdpa() -> type:
    """torchtitan's ``ScaledDotProductAttention`` run on the local heads of DTensor inputs (tensor parallel
    shards the heads; attention is per head), with the math kernel (no DTensor rule for the CPU kernels)."""
    from dataclasses import dataclass
    from typing import ClassVar

    from torch.distributed.tensor import DTensor
    from torch.nn.attention import SDPBackend
    from torchtitan.models.common.attention import ScaledDotProductAttention

    class LocalSDPA(ScaledDotProductAttention):
        sdpa_backends: ClassVar[list[SDPBackend]] = [SDPBackend.MATH]

        @dataclass(kw_only=True, slots=True)
        class Config(ScaledDotProductAttention.Config):
            pass

        def forward(self, q, k, v, **kwargs):  # type: ignore[no-untyped-def, override]
            if not isinstance(q, DTensor):
                return super().forward(q, k, v, **kwargs)
            out = super().forward(q.to_local(), k.to_local(), v.to_local(), **kwargs)
            return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)

    return LocalSDPA


def small_llama3(cfg: object, dim: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2) -> object:
    """torchtitan override (``--override.imports``): a llama3 model config at reduced width and depth.

    Only sizes shrink (width, depth, heads, FFN); the vocabulary, weight tying, RoPE (theta, Llama 3
    scaling) and the initialisation scheme stay, as ``tests/integration/test_pretrain_configs.py`` shrinks
    the DeepSpeed 2B-3B configs. The attention is :func:`sdpa_attention`'s (built here: one override).
    """
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim

    vocab = cfg.vocab_size  # type: ignore[attr-defined]
    layers = llama3._build_llama3_layers(
        fuse_qkv=True,
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64, ffn_dim_multiplier=1.0),
        rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = _local_sdpa().Config()
    # In place: torchtitan's Trainer holds the model config object before it applies overrides.
    for name, value in {
        "dim": dim,
        "tok_embeddings": Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        "norm": RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        "lm_head": Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        "layers": layers,
    }.items():
        setattr(cfg, name, value)
    return cfg


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    patch_for_cpu()
    sys.argv = ["torchtitan.train", *sys.argv[1:]]
    runpy.run_module("torchtitan.train", run_name="__main__")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from launch.finish import run_then_leave

    run_then_leave(main)


if __name__ != "__main__":  # imported by torchtitan's --override.imports, or by torchtitan_step.py
    patch_for_cpu()  # before torchtitan is imported: it reads the device type at import
    from torchtitan.config.override import override as _override
    from torchtitan.models.common.attention import FlexAttention as _FlexAttention

    sdpa_attention = _override(target=_FlexAttention.Config, description="CPU tests: SDPA instead of Flex")(
        sdpa_attention
    )
    from torchtitan.models.llama3.model import Llama3Model as _Llama3Model

    small_llama3 = _override(target=_Llama3Model.Config, description="CPU tests: reduced width and depth")(small_llama3)
