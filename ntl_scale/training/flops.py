"""Model FLOPs of a trained micro-batch, achieved TFLOP/s and MFU.

Per trained token (PaLM appendix B; Megatron-LM eq. 3)::

    6 * N + 12 * n_layer * width * seq_len

``N``: the parameters in a matrix multiply (not the embedding lookups), of the whole model, counted before
AutoTP splits it. Encoder-decoders count the encoder's parameters (and the cross-attention K/V projections)
on the encoder tokens, the rest on the decoder tokens. MFU needs a peak (:data:`PEAK_TFLOPS` or
``train.peak_tflops``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PEAK_TFLOPS", "FlopsCounter", "peak_tflops_for_name", "peak_tflops_of"]

# Dense bf16 peak per device in TFLOP/s, from the vendors' data sheets (NVIDIA prints BF16 "with sparsity":
# twice these). A key matches when each of its words is a whole word of torch.cuda.get_device_name() ("L4"
# is not "NVIDIA L40"); the first match wins, so a form factor (PCIe, NVL) comes before the plain SXM name.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # SXM
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H800 PCIe", 756.0),
    ("H800", 989.0),  # SXM
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
)

_WORD = re.compile(r"[A-Z0-9]+")

# The cross-attention block of an encoder-decoder model (T5's ``EncDecAttention``, the ``encoder_attn``
# of BART, mBART, Marian, Pegasus) and its key and value projections, which read the encoder's output.
_CROSS_ATTENTION = {"EncDecAttention", "encoder_attn"}
_KEY_VALUE = {"k", "v", "k_proj", "v_proj"}


def peak_tflops_for_name(name: str) -> float | None:
    """The table's peak for a device name as ``torch.cuda.get_device_name`` reports it, or None."""
    words = set(_WORD.findall(name.upper()))
    return next((peak for key, peak in PEAK_TFLOPS if set(key.upper().split()) <= words), None)


def peak_tflops_of(device: torch.device) -> float | None:
    """The table's peak for a CUDA/ROCm device, or None (CPU, or a device not in the table)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_tflops_for_name(torch.cuda.get_device_name(device))


def _count(param: Any) -> int:
    return int(getattr(param, "ds_numel", param.numel()))  # ZeRO-3: the whole parameter, not this rank's part


def _output_weight(model: torch.nn.Module) -> Any:
    getter: Any = getattr(model, "get_output_embeddings", None)
    output = getter() if callable(getter) else None
    return getattr(output, "weight", None) if output is not None else None


def _matmul_params(model: torch.nn.Module) -> dict[int, Any]:
    """The parameters that enter a matrix multiply, by id: all but the input lookup tables."""
    params = {id(p): p for p in model.parameters()}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    lookups.discard(id(_output_weight(model)))  # tied: the table is also the output layer's matmul
    return {k: p for k, p in params.items() if k not in lookups}


def _attention_width(config: Any, hidden: int) -> int:
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or getattr(config, "d_kv", None)  # T5: d_kv
    if isinstance(heads, int) and isinstance(head_dim, int) and heads > 0 and head_dim > 0:
        return heads * head_dim
    return hidden


@dataclass
class FlopsCounter:
    """Model FLOPs of trained micro-batches, and the rates of a stretch of training."""

    matmul_params: int
    layers: int
    width: int
    peak_tflops: float | None
    encoder_params: int = 0
    encoder_layers: int = 0
    kind: str = "causal"

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, *, kind: str = "causal", device: torch.device, peak_tflops: float | None = None
    ) -> FlopsCounter:
        """Counts a Hugging Face model's parameters (ZeRO-3-partitioned ones whole)."""
        if kind not in ("causal", "seq2seq"):
            raise ValueError(f"FlopsCounter kind={kind!r}: expected 'causal' or 'seq2seq'; pass the run's model.kind")
        matmul = _matmul_params(model)
        total = sum(_count(p) for p in matmul.values())
        config = getattr(model, "config", None)
        hidden = int(getattr(config, "hidden_size", 0) or 0)
        width = _attention_width(config, hidden)
        peak = peak_tflops if peak_tflops is not None else peak_tflops_of(device)
        if kind == "causal":
            return cls(total, int(getattr(config, "num_hidden_layers", 0) or 0), width, peak)
        get_encoder: Any = getattr(model, "get_encoder", None)
        encoder = get_encoder() if callable(get_encoder) and getattr(config, "is_encoder_decoder", False) else None
        if (
            not isinstance(encoder, torch.nn.Module)
            or encoder is model
            or encoder is getattr(model, "base_model", None)
        ):
            raise ValueError(
                f"{type(model).__name__} is not an encoder-decoder model: kind='seq2seq' expects one (T5, BART); "
                "use kind='causal' for a decoder-only model"
            )
        on_encoder = {id(p) for p in encoder.parameters()}
        for name, module in model.named_modules():
            parts = name.split(".")
            if parts[-1] in _KEY_VALUE and _CROSS_ATTENTION & set(parts[:-1]):
                on_encoder.update(id(p) for p in module.parameters())
        on_encoder.discard(id(_output_weight(model)))  # a table tied to the output layer: on decoder tokens
        encoder_params = sum(_count(p) for k, p in matmul.items() if k in on_encoder)
        encoder_layers = int(getattr(config, "num_layers", 0) or getattr(config, "encoder_layers", 0) or 0)
        decoder_layers = int(getattr(config, "num_decoder_layers", 0) or getattr(config, "decoder_layers", 0) or 0)
        return cls(total, decoder_layers or encoder_layers, width, peak, encoder_params, encoder_layers, "seq2seq")

    def flops(self, tokens: Any, seq_len: int, *, encoder_tokens: Any = 0, encoder_len: int = 0) -> Any:
        """Forward + backward model FLOPs of ``tokens`` tokens in sequences padded to ``seq_len``."""
        decoder = 6.0 * (self.matmul_params - self.encoder_params) + 12.0 * self.layers * self.width * (
            seq_len + encoder_len
        )
        encoder = 6.0 * self.encoder_params + 12.0 * self.encoder_layers * self.width * encoder_len
        return tokens * decoder + encoder_tokens * encoder

    def of_batch(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Model FLOPs of training on one device micro-batch (its tokens, not its padding), a device tensor."""
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        read = mask.sum() if mask is not None else torch.tensor(ids.numel(), device=ids.device)
        if self.kind == "causal":
            return self.flops(read.double(), ids.shape[-1])
        labels = batch["labels"]
        decoded = (labels != -100).sum().double()
        return self.flops(decoded, labels.shape[-1], encoder_tokens=read.double(), encoder_len=ids.shape[-1])

    def rates(self, tokens: int, flops: float, seconds: float, devices: int) -> dict[str, Any]:
        """``tokens_per_s_per_device``, ``tflops`` (model TFLOP/s per device) and ``mfu`` (None without a peak)."""
        seconds = max(seconds, 1e-9)
        tflops = flops / seconds / devices / 1e12
        mfu = tflops / self.peak_tflops if self.peak_tflops else None
        return {"tokens_per_s_per_device": tokens / seconds / devices, "tflops": tflops, "mfu": mfu}
