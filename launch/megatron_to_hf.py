"""Converts a Megatron-LM GPT ``torch_dist`` checkpoint of the GPT-2 architecture into a Hugging Face folder.

    python launch/megatron_to_hf.py CKPT/iter_0000N OUT [--tokenizer HF_TOKENIZER_DIR]

Reads the checkpoint with torch's own ``torch.distributed.checkpoint`` (one process, no Megatron-LM, no
GPU; any tensor/pipeline layout, since ``torch_dist`` stores whole tensors) and the run's arguments
(``common.pt`` up to core_v0.16, inside the files in core_v0.19), and writes a ``GPT2LMHeadModel``
(``config.json``, ``model.safetensors``) and, with ``--tokenizer``, that tokenizer's files, for
``lm_eval --model hf --model_args pretrained=OUT`` (docs/evaluation.md). Megatron's default GPT only:
learned absolute positions, LayerNorm before each block, GeLU, biases, multi-head attention. Anything
else (RoPE, RMSNorm, SwiGLU, grouped-query attention) is refused with a ValueError: those models are
Llama-style and need Megatron-Bridge.
"""

from __future__ import annotations

import argparse
import os
import pickle
import types
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

PREFIX = "decoder.layers."


class _Unpickler(pickle.Unpickler):
    """Reads the run's arguments without the Megatron-LM release that pickled them: a class it cannot import
    (a Megatron enum in an argument this converter does not read) becomes an empty stand-in."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (), {"__init__": lambda self, *a, **k: None, "__setstate__": lambda self, s: None})


_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pickle")


class _RawBytes(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__()
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()


def _load(source: Any) -> Any:
    return torch.load(source, map_location="cpu", weights_only=False, pickle_module=_PICKLE)


def _check(args: Any) -> None:
    """Refuses what GPT-2 cannot hold (``num_query_groups``: no grouped-query attention)."""
    gpt2 = {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "swiglu": False,
            "squared_relu": False, "add_bias_linear": True, "add_qkv_bias": True, "qk_layernorm": False,
            "apply_residual_connection_post_layernorm": False, "apply_layernorm_1p": False,
            "layernorm_zero_centered_gamma": False,
            "num_query_groups": args.num_attention_heads}  # fmt: skip
    for name, value in gpt2.items():
        if getattr(args, name, value) not in (value, None):
            raise ValueError(
                f"megatron_to_hf: the run has {name}={getattr(args, name)!r}; this converter takes Megatron's "
                f"GPT-2 architecture ({name}={value!r}); convert other models with Megatron-Bridge"
            )


def read_args(checkpoint: str) -> Any:
    """The run's arguments (Megatron's ``args`` namespace) saved in ``checkpoint``."""
    import io

    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    if os.path.isfile(os.path.join(checkpoint, "common.pt")):  # core_v0.16: the arguments beside the tensors
        common = _load(os.path.join(checkpoint, "common.pt"))
    else:  # core_v0.19: inside the checkpoint, as bytes
        key = next((k for k in meta if k.startswith("common_state")), None)
        if key is None:
            raise ValueError(f"megatron_to_hf: {checkpoint} has neither common.pt nor common_state (the arguments)")
        planner = _RawBytes()  # DCP's own planner would unpickle them without _Unpickler
        dcp.load({key: io.BytesIO()}, storage_reader=dcp.FileSystemReader(checkpoint), planner=planner, no_dist=True)
        common = _load(io.BytesIO(planner.raw[key]))[0]  # a one-item list of the common dict
    return common["args"]


def read(checkpoint: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The run's arguments and the model's tensors (layers stacked on a first dimension) of ``checkpoint``."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(checkpoint)
    meta = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.items()
        if isinstance(m, dcp.metadata.TensorStorageMetadata)
        and not key.startswith(("optimizer", "rng_state"))
        and "_extra_state" not in key
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return read_args(checkpoint), state


def to_gpt2(args: Any, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The ``GPT2Config`` dict and the ``GPT2LMHeadModel`` state dict of a Megatron GPT."""
    _check(args)
    hidden, heads = args.hidden_size, args.num_attention_heads
    head_dim = args.kv_channels or hidden // heads
    if head_dim * heads != hidden:
        raise ValueError(f"megatron_to_hf: kv_channels={head_dim} x {heads} heads != hidden_size={hidden}")
    tied = not args.untie_embeddings_and_output_weights
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": args.padded_vocab_size,
        "n_positions": args.max_position_embeddings, "n_embd": hidden, "n_layer": args.num_layers,
        "n_head": heads, "n_inner": args.ffn_hidden_size,
        # tanh GeLU for --openai-gelu and for the default --bias-gelu-fusion (bias_gelu_impl); erf GeLU without
        "activation_function": "gelu_new" if args.openai_gelu or getattr(args, "bias_gelu_fusion", False) else "gelu",
        "layer_norm_epsilon": getattr(args, "layernorm_epsilon", getattr(args, "norm_epsilon", 1e-5)),
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "tie_word_embeddings": tied, "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32",
    }  # fmt: skip
    layer = {name[len(PREFIX) :]: t for name, t in state.items() if name.startswith(PREFIX)}
    out = {
        "transformer.wte.weight": state["embedding.word_embeddings.weight"],
        "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": state["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": state["decoder.final_layernorm.bias"],
    }
    if not tied:
        out["lm_head.weight"] = state["output_layer.weight"]
    for i in range(args.num_layers):
        h = f"transformer.h.{i}."
        # Megatron's fused QKV rows are [head][q, k, v][head_dim]; GPT-2's c_attn columns are [q, k, v][head][head_dim]
        qkv_w = layer["self_attention.linear_qkv.weight"][i].view(heads, 3, head_dim, hidden)
        qkv_b = layer["self_attention.linear_qkv.bias"][i].view(heads, 3, head_dim)
        out[h + "attn.c_attn.weight"] = qkv_w.transpose(0, 1).reshape(3 * hidden, hidden).T
        out[h + "attn.c_attn.bias"] = qkv_b.transpose(0, 1).reshape(3 * hidden)
        for ours, theirs in (("ln_1", "self_attention.linear_qkv.layer_norm"), ("ln_2", "mlp.linear_fc1.layer_norm")):
            out[h + ours + ".weight"] = layer[theirs + "_weight"][i]
            out[h + ours + ".bias"] = layer[theirs + "_bias"][i]
        # GPT-2's Conv1D holds weights as (in, out): the transpose of Megatron's Linear
        for ours, theirs in (("attn.c_proj", "self_attention.linear_proj"), ("mlp.c_fc", "mlp.linear_fc1"),
                             ("mlp.c_proj", "mlp.linear_fc2")):  # fmt: skip
            out[h + ours + ".weight"] = layer[theirs + ".weight"][i].T
            out[h + ours + ".bias"] = layer[theirs + ".bias"][i]
    return config, {k: v.float().contiguous() for k, v in out.items()}


def convert(checkpoint: str, out: str, tokenizer: str | None = None) -> dict[str, Any]:
    """Writes the HF folder ``out`` from the Megatron ``checkpoint`` (an ``iter_N`` folder); returns the config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if not os.path.isfile(os.path.join(checkpoint, ".metadata")):
        raise ValueError(
            f"megatron_to_hf: no .metadata in {checkpoint}; expected an iter_N folder of a torch_dist checkpoint"
        )
    args, state = read(checkpoint)
    config, weights = to_gpt2(args, state)
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        config["bos_token_id"], config["eos_token_id"] = tok.bos_token_id, tok.eos_token_id
    model = GPT2LMHeadModel(GPT2Config(**config))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not (config["tie_word_embeddings"] and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"megatron_to_hf: weights missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out)
    if tok is not None:
        tok.save_pretrained(out)
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="an iter_N folder of Megatron's --save (torch_dist)")
    parser.add_argument("out", help="the Hugging Face folder to write")
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer folder to copy beside the weights")
    args = parser.parse_args(argv)
    convert(args.checkpoint, args.out, args.tokenizer)
    print(f"lm_eval --model hf --model_args pretrained={args.out} (docs/evaluation.md)")


if __name__ == "__main__":
    main()
