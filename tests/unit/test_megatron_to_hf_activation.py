"""launch/megatron_to_hf.py names the GeLU that Megatron's MLP runs for the run's arguments.

Megatron's default ``--bias-gelu-fusion`` (on unless ``--no-bias-gelu-fusion``, for a model with biases) runs
``bias_gelu_impl``, the tanh approximation, not ``F.gelu``; the reference here is Megatron Core's own function.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from launch.megatron_to_hf import to_gpt2


def _run(**flags: object) -> tuple[types.SimpleNamespace, dict[str, torch.Tensor]]:
    hidden, heads, ffn, vocab, positions = 8, 2, 16, 11, 6
    args = types.SimpleNamespace(
        hidden_size=hidden, num_attention_heads=heads, kv_channels=None, num_layers=1, ffn_hidden_size=ffn,
        padded_vocab_size=vocab, max_position_embeddings=positions, untie_embeddings_and_output_weights=False,
        openai_gelu=False, add_bias_linear=True, **flags,
    )  # fmt: skip
    layer = "decoder.layers."
    state = {
        "embedding.word_embeddings.weight": torch.zeros(vocab, hidden),
        "embedding.position_embeddings.weight": torch.zeros(positions, hidden),
        "decoder.final_layernorm.weight": torch.ones(hidden),
        "decoder.final_layernorm.bias": torch.zeros(hidden),
        layer + "self_attention.linear_qkv.weight": torch.zeros(1, 3 * hidden, hidden),
        layer + "self_attention.linear_qkv.bias": torch.zeros(1, 3 * hidden),
        layer + "self_attention.linear_qkv.layer_norm_weight": torch.ones(1, hidden),
        layer + "self_attention.linear_qkv.layer_norm_bias": torch.zeros(1, hidden),
        layer + "mlp.linear_fc1.layer_norm_weight": torch.ones(1, hidden),
        layer + "mlp.linear_fc1.layer_norm_bias": torch.zeros(1, hidden),
        layer + "self_attention.linear_proj.weight": torch.zeros(1, hidden, hidden),
        layer + "self_attention.linear_proj.bias": torch.zeros(1, hidden),
        layer + "mlp.linear_fc1.weight": torch.zeros(1, ffn, hidden),
        layer + "mlp.linear_fc1.bias": torch.zeros(1, ffn),
        layer + "mlp.linear_fc2.weight": torch.zeros(1, hidden, ffn),
        layer + "mlp.linear_fc2.bias": torch.zeros(1, hidden),
    }
    return args, state


@pytest.mark.parametrize("fusion", [True, False])
def test_the_named_gelu_is_the_one_megatron_ran(fusion: bool) -> None:
    pytest.importorskip("transformers")
    fused = pytest.importorskip("megatron.core.fusions.fused_bias_gelu")
    from transformers.activations import ACT2FN

    config, _ = to_gpt2(*_run(bias_gelu_fusion=fusion))
    x = torch.linspace(-4, 4, 81, dtype=torch.float32)
    # megatron/core/transformer/mlp.py: bias_activation_fusion (= args.bias_gelu_fusion) with F.gelu runs
    # bias_gelu_impl; without the fusion, F.gelu itself
    megatron = fused.bias_gelu_impl(x, torch.zeros_like(x)) if fusion else F.gelu(x)
    hf = ACT2FN[config["activation_function"]](x)
    assert (hf - megatron).abs().max() < 1e-6, config["activation_function"]


def test_zero_centered_layernorm_is_converted_or_refused() -> None:
    """``--apply-layernorm-1p`` (``layernorm_zero_centered_gamma``) stores ``gamma - 1``: Megatron's LayerNorm
    multiplies by ``1 + weight``; GPT-2's by ``weight``. Copied as it is, every gain is off by one."""
    args, state = _run(bias_gelu_fusion=False, layernorm_zero_centered_gamma=True)
    try:
        _, weights = to_gpt2(args, state)
    except ValueError:
        return  # refused: fine
    for ours, theirs in (("transformer.h.0.ln_1.weight", "decoder.layers.self_attention.linear_qkv.layer_norm_weight"),
                         ("transformer.ln_f.weight", "decoder.final_layernorm.weight")):  # fmt: skip
        stored = state[theirs][0] if theirs.startswith("decoder.layers.") else state[theirs]
        assert torch.equal(weights[ours], stored + 1), ours
