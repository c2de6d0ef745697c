"""Megatron-LM's own GPT forward on a ``torch_dist`` checkpoint, in one CPU process. Test only.

    python tests/helpers/megatron_forward.py CKPT/iter_N TOKENS.pt OUT.pt

Builds Megatron Core's ``GPTModel`` with its local layer spec from the run's saved arguments,
loads the checkpoint with Megatron's own ``dist_checkpointing.load`` (``MEGATRON_LM_PATH``: the release
that wrote it; the CPU patches of ``tests/helpers/megatron_lm_cpu.py``) and writes the logits of the
tokens (``[batch, seq]``, positions ``0..seq-1``, causal): the reference the HF conversion
(``launch/megatron_to_hf.py``) is compared with.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.helpers.megatron_lm_cpu import patch_megatron, patch_torch


def main(checkpoint: str, tokens_path: str, out: str) -> None:
    if os.environ.get("MEGATRON_LM_PATH"):  # the release that wrote the checkpoint
        sys.path.insert(0, os.environ["MEGATRON_LM_PATH"])
    patch_torch()
    patch_megatron()  # its CPU RNG tracker (dropout is 0)
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", sys.argv[4] if len(sys.argv) > 4 else "29511")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    from launch.megatron_to_hf import read_args

    args = read_args(checkpoint)  # the run's sizes (the weights: Megatron's own loader below)
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=args.add_bias_linear,
        bias_activation_fusion=bool(getattr(args, "bias_gelu_fusion", False)),  # the MLP the run ran
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )
    state = dist_checkpointing.load(model.sharded_state_dict(prefix=""), checkpoint)
    model.load_state_dict(state, strict=False)
    model.eval()
    tokens = torch.load(tokens_path)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    mask = torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(1)  # True = masked
    with torch.no_grad():
        logits = model(tokens, positions, mask)
    torch.save(logits.float(), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
