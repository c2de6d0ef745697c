"""Tokenizer and Hugging Face model of a run, from its model section (``transformers`` imported on use)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from .config import ModelConfig

__all__ = ["build_model", "build_tokenizer", "model_vocab_size"]


def build_tokenizer(model: ModelConfig) -> Any:
    """``builtin:char`` (built offline) or a local tokenizer directory; ntl_scale never downloads."""
    if model.tokenizer == "builtin:char":
        from .tokenizer import build_char_tokenizer

        return build_char_tokenizer()
    from transformers import AutoTokenizer

    if not os.path.isdir(model.tokenizer):
        raise ValueError(
            f"model.tokenizer={model.tokenizer!r} is not a directory (looked in the working directory, next to the "
            "config file and in the repository); ntl_scale never downloads. Save the tokenizer first "
            "(tokenizer.save_pretrained(DIR)) and pass DIR, or use model.tokenizer=builtin:char"
        )
    return AutoTokenizer.from_pretrained(model.tokenizer)


def model_vocab_size(model: ModelConfig) -> int | None:
    """The vocabulary size the config fixes (a pretrained model's, or ``architecture.vocab_size``), else None."""
    if model.path:
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(model.path).vocab_size)
    size = model.architecture.get("vocab_size")
    return int(size) if size else None


def check_attn_implementation(name: str) -> None:
    """``flash_attention_2`` needs the ``flash_attn`` package (and a CUDA GPU); say so before building."""
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError(
            "model.attn_implementation=flash_attention_2 needs the flash_attn package, which is not installed "
            "(pip install flash-attn --no-build-isolation, on a CUDA machine); use model.attn_implementation=sdpa "
            "(PyTorch's fused attention, the default)"
        )


def build_model(model: ModelConfig, vocab_size: int, ds_config: dict[str, Any], tokenizer: Any) -> tuple[Any, Any]:
    """The Hugging Face model: ``from_pretrained(model.path)`` or a random init from ``model.architecture``."""
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    check_attn_implementation(model.attn_implementation)
    keep_alive = HfDeepSpeedConfig(ds_config)  # ZeRO-3 partitions the weights as they are created
    auto = transformers.AutoModelForCausalLM if model.kind == "causal" else transformers.AutoModelForSeq2SeqLM
    if model.path:
        built = auto.from_pretrained(model.path, attn_implementation=model.attn_implementation)
    else:
        arch = dict(model.architecture)
        ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
        ids["bos_token_id"] = ids["bos_token_id"] if ids["bos_token_id"] is not None else ids["eos_token_id"]
        if model.kind == "seq2seq":
            ids["decoder_start_token_id"] = ids["pad_token_id"]  # T5's convention
        arch.pop("vocab_size", None)  # model_vocab_size already read it into vocab_size
        ids = {k: v for k, v in ids.items() if k not in arch}  # token ids the architecture names win
        config = transformers.AutoConfig.for_model(arch.pop("model_type"), vocab_size=vocab_size, **ids, **arch)
        built = auto.from_config(config, attn_implementation=model.attn_implementation)
    if model.gradient_checkpointing:
        if not getattr(built, "supports_gradient_checkpointing", False):
            raise ValueError(
                f"model.gradient_checkpointing=true: {type(built).__name__} does not support activation checkpointing "
                "in transformers; set it to false"
            )
        kwargs = {"use_reentrant": False}  # re-entrant checkpointing breaks ZeRO-3's parameter hooks
        if hasattr(built, "activation_checkpointing_enable"):  # transformers >= 5.2x names it so
            built.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            built.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return built, keep_alive
