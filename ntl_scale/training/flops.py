"""Model FLOPs per token, achieved TFLOP/s and model FLOPs utilisation (MFU).

FLOPs per trained token (forward + backward), the formula of PaLM (Chowdhery et al. 2022, appendix B)
and Megatron-LM (Narayanan et al. 2021, eq. 3, per token)::

    6 * N + 12 * n_layer * hidden * seq_len

``N`` counts the parameters that take part in a matrix multiply: every parameter except the input
embedding tables (token and position lookups cost no FLOPs); a tied output layer is counted once,
as the output layer. The second term is the attention scores and their weighted sum
(``Q K^T`` and ``A V``: 2 x 2 x seq_len x hidden per layer per token forward, x 3 for the backward),
at the batch's padded sequence length. Activation recomputation is not counted (model FLOPs, not
hardware FLOPs). For encoder-decoder models (T5) only ``6 * N`` is counted.

MFU = achieved model FLOP/s per device / the device's peak dense bf16 FLOP/s (:data:`PEAK_TFLOPS`, or
``train.peak_tflops``). On a CPU without a configured peak it is not reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PEAK_TFLOPS", "FlopsCounter", "peak_tflops_of"]

# Dense bf16 tensor-core peak per device in TFLOP/s (vendor data sheets; no sparsity). The first name
# that occurs in the device name wins, so the more specific ones come first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("L4", 121.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
)


def peak_tflops_of(device: torch.device) -> float | None:
    """The table's peak for a CUDA/ROCm device, or None (CPU, or a device not in the table)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def _count(param: Any) -> int:
    return int(getattr(param, "ds_numel", param.numel()))  # ZeRO-3: the whole parameter, not this rank's part


@dataclass
class FlopsCounter:
    """Model FLOPs of a trained token, and the rates of a stretch of training.

    Attributes:
        matmul_params: ``N`` of the formula above.
        layers, hidden: for the attention term (0 = left out).
        peak_tflops: per-device peak, or None (MFU not reported).
    """

    matmul_params: int
    layers: int
    hidden: int
    peak_tflops: float | None

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, *, kind: str = "causal", device: torch.device, peak_tflops: float | None = None
    ) -> FlopsCounter:
        """Counts a Hugging Face model's parameters (ZeRO-3-partitioned ones whole)."""
        params = {id(p): p for p in model.parameters()}
        total = sum(_count(p) for p in params.values())
        lookups = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        getter: Any = getattr(model, "get_output_embeddings", None)
        output = getter() if callable(getter) else None
        if output is not None and getattr(output, "weight", None) is not None:
            lookups.pop(id(output.weight), None)  # tied: the table is also the output layer's matmul
        matmul = total - sum(_count(p) for k, p in lookups.items() if k in params)
        config = getattr(model, "config", None)
        layers = int(getattr(config, "num_hidden_layers", 0) or 0) if kind == "causal" else 0
        hidden = int(getattr(config, "hidden_size", 0) or 0) if kind == "causal" else 0
        peak = peak_tflops if peak_tflops is not None else peak_tflops_of(device)
        return cls(matmul, layers, hidden, peak)

    def per_token(self, seq_len: int) -> float:
        """Forward + backward model FLOPs of one token in a sequence of ``seq_len``."""
        return 6.0 * self.matmul_params + 12.0 * self.layers * self.hidden * seq_len

    def rates(self, tokens: int, seconds: float, devices: int, *, seq_len: int | None) -> dict[str, Any]:
        """``tokens_per_s_per_device``, ``tflops`` (model TFLOP/s per device) and ``mfu`` (None without a peak).

        ``tokens`` is every token of the stretch over all ranks; ``seq_len`` None reuses the last one given.
        """
        if seq_len is not None:
            self._seq_len = seq_len
        seconds = max(seconds, 1e-9)
        per_device = tokens / seconds / devices
        tflops = per_device * self.per_token(getattr(self, "_seq_len", 0)) / 1e12
        mfu = tflops / self.peak_tflops if self.peak_tflops else None
        return {"tokens_per_s_per_device": per_device, "tflops": tflops, "mfu": mfu}
