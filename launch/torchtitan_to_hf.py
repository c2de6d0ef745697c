"""Completes torchtitan's last-step Hugging Face safetensors into a folder ``transformers`` loads.

    python launch/torchtitan_to_hf.py DUMP/checkpoint/step-N --module MODULE --config CONFIG [torchtitan args]

torchtitan 0.3.0 with ``--checkpoint.enable --checkpoint.last_save_model_only --checkpoint.last_save_in_hf``
writes the last step's weights as HF safetensors through the llama3 state-dict adapter (Q/K permuted
to HF's rotary layout, ``lm_head`` dropped when tied), but no ``config.json`` and no tokenizer. This
script writes them beside the weights: the ``LlamaForCausalLM`` ``config.json`` of the run's model
(the same ``--module``/``--config`` and model overrides as the training command, parsed by
torchtitan's own ``ConfigManager``) and the tokenizer files of its ``--hf_assets_path``. Then
``lm_eval --model hf --model_args pretrained=DUMP/checkpoint/step-N`` (docs/evaluation.md) or
``AutoModelForCausalLM.from_pretrained`` reads the folder. Dense llama3 models only (no MoE, no YaRN):
anything else is refused with a ValueError.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
    "number_vocab.json",
)


def llama_config(model: Any, *, dtype: str = "float32") -> dict[str, Any]:
    """The ``transformers`` ``LlamaConfig`` dict of a torchtitan llama3 ``Llama3Model.Config``."""
    layers = list(model.layers)
    attn, ffn = layers[0].attention, getattr(layers[0], "feed_forward", None)
    rope = attn.rope
    if ffn is None or any(getattr(layer, "moe", None) is not None for layer in layers):
        raise ValueError("torchtitan_to_hf: the model has MoE layers; expected a dense llama3 model (a Llama3Model)")
    scaling = getattr(rope, "scaling", "none")
    if scaling not in ("none", "llama"):
        raise ValueError(f"torchtitan_to_hf: RoPE scaling {scaling!r}; expected 'none' or 'llama' (llama3 models)")
    n_heads = attn.n_heads
    n_kv_heads = attn.n_kv_heads or n_heads
    eps = {layer.attention_norm.eps for layer in layers} | {layer.ffn_norm.eps for layer in layers} | {model.norm.eps}
    if len(eps) != 1:
        raise ValueError(f"torchtitan_to_hf: RMSNorm eps values {sorted(eps)}; HF Llama has one rms_norm_eps")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.dim,
        "intermediate_size": ffn.w1.out_features,
        "num_hidden_layers": len(layers),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": attn.head_dim or model.dim // n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": eps.pop(),
        "max_position_embeddings": rope.max_seq_len,
        "rope_theta": rope.theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": bool(getattr(model, "enable_weight_tying", False)),
        "torch_dtype": dtype,
    }
    if scaling == "llama":
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rope.scaling_factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    return config


def complete(checkpoint: str, torchtitan_args: list[str]) -> dict[str, Any]:
    """Writes ``config.json`` and the tokenizer files into ``checkpoint``; returns the config."""
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides

    if not any(name.endswith(".safetensors") for name in os.listdir(checkpoint)):
        raise ValueError(
            f"torchtitan_to_hf: no .safetensors in {checkpoint}; expected the step folder of a run with "
            "--checkpoint.enable --checkpoint.last_save_model_only --checkpoint.last_save_in_hf"
        )
    config = ConfigManager().parse_args(torchtitan_args)
    if config.override.imports:  # model overrides (reduced sizes, ...) as the trainer applies them
        apply_overrides(config.override, config)
    hf = llama_config(config.model_spec.model, dtype=config.checkpoint.export_dtype)
    assets = config.hf_assets_path
    special, added = {}, {}
    if os.path.isfile(os.path.join(assets, "tokenizer_config.json")):
        with open(os.path.join(assets, "tokenizer_config.json"), encoding="utf-8") as f:
            special = json.load(f)
    if os.path.isfile(os.path.join(assets, "tokenizer.json")):
        with open(os.path.join(assets, "tokenizer.json"), encoding="utf-8") as f:
            added = {t["content"]: t["id"] for t in json.load(f).get("added_tokens", [])}
    for name in ("bos", "eos"):  # the special tokens' ids, as HF configs carry them
        token = special.get(f"{name}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token in added:
            hf[f"{name}_token_id"] = added[token]
    with open(os.path.join(checkpoint, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=1)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(assets, name)):
            shutil.copy(os.path.join(assets, name), os.path.join(checkpoint, name))
    return hf


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        raise SystemExit(__doc__)
    complete(argv[0], argv[1:])
    print(f"lm_eval --model hf --model_args pretrained={argv[0]} (docs/evaluation.md)")


if __name__ == "__main__":
    main()
