"""The Trainer's DeepSpeed-independent parts (ntl_scale/training/{build,trainer}.py, steps.py's bf16).

Model FLOPs, rates and MFU are tested in tests/unit/test_flops.py.

Sections:
1. bf16 default: ``train.bf16: null`` follows the accelerator; an explicit value must agree with the JSON.
2. Model settings: attention implementation and activation checkpointing reach the model; a
   missing ``flash_attn`` is a clear error.
3. Held-out batches: every data-parallel rank gets the same number, no example twice; ``to_device``.
"""

from __future__ import annotations

import pytest
import torch

from ntl_scale.integrations.deepspeed.resolved import resolve_deepspeed_config
from ntl_scale.training.config import ModelConfig, TrainConfig

transformers = pytest.importorskip("transformers")


# ---- 1. bf16 default --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("json_value", "train_value", "accelerator", "want"),
    [("auto", None, True, True), ("auto", None, False, False), ("auto", False, True, False),
     ("auto", True, False, True), (True, None, False, True), (False, None, True, False)],
)  # fmt: skip
def test_bf16_auto_follows_the_accelerator(json_value, train_value, accelerator, want):
    ds = {"bf16": {"enabled": json_value}}
    out = resolve_deepspeed_config(ds, TrainConfig(bf16=train_value), 1, bf16_default=accelerator)
    assert out["bf16"]["enabled"] is want


def test_bf16_contradiction_is_an_error():
    with pytest.raises(ValueError, match=r"contradicts train\.bf16=False"):
        resolve_deepspeed_config({"bf16": {"enabled": True}}, TrainConfig(bf16=False), 1)


# ---- 2. model settings ------------------------------------------------------------------------------------


def test_attention_and_checkpointing_reach_the_model():
    from ntl_scale.training.build import build_model, build_tokenizer

    cfg = ModelConfig(attn_implementation="eager", gradient_checkpointing=True)
    tokenizer = build_tokenizer(cfg)
    model, _ = build_model(cfg, 80, {"train_micro_batch_size_per_gpu": 1}, tokenizer)

    def checkpointing(m):
        return (
            m.is_activation_checkpointing if hasattr(m, "is_activation_checkpointing") else m.is_gradient_checkpointing
        )

    assert model.config._attn_implementation == "eager" and checkpointing(model)
    default, _ = build_model(ModelConfig(), 80, {"train_micro_batch_size_per_gpu": 1}, tokenizer)
    assert default.config._attn_implementation == "sdpa" and not checkpointing(default)
    with pytest.raises(ValueError, match=r"model\.attn_implementation must be one of"):
        ModelConfig(attn_implementation="flash")


def test_flash_attention_without_the_package_is_a_clear_error(monkeypatch):
    import importlib.util

    from ntl_scale.training import build

    real = importlib.util.find_spec
    monkeypatch.setattr(build.importlib.util, "find_spec", lambda name: None if name == "flash_attn" else real(name))
    with pytest.raises(ValueError, match="needs the flash_attn package"):
        build.check_attn_implementation("flash_attention_2")


# ---- 3. held-out batches ----------------------------------------------------------------------------------


def test_heldout_batches_are_dealt_evenly_over_ranks():
    from ntl_scale.data.arithmetic import generate
    from ntl_scale.integrations.deepspeed.heldout import heldout_qa_batches
    from ntl_scale.training.model_inputs import to_device
    from ntl_scale.training.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    examples = generate(11, "interpolate", seed=0)
    parts = [heldout_qa_batches(examples, tokenizer, kind="causal", max_length=64, micro_batch_size=2, dp_rank=r, dp=2)
             for r in range(2)]  # fmt: skip
    assert [len(p) for p in parts] == [3, 3]  # 10 of 11 examples, 5 per rank, in micro-batches of 2
    rows = [tuple(row.tolist()) for p in parts for b in p for row in b["input_ids"]]
    assert len(rows) == len(set(rows)) == 10
    moved = to_device(parts[0][0], torch.device("cpu"))
    assert set(moved) == {"input_ids", "attention_mask", "labels"}


def test_architecture_may_name_its_vocabulary_and_token_ids():
    from ntl_scale.training.build import build_model, build_tokenizer, model_vocab_size

    arch = {"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": 96, "bos_token_id": 5}
    cfg = ModelConfig(architecture=arch)
    assert model_vocab_size(cfg) == 96
    model, _ = build_model(cfg, 96, {"train_micro_batch_size_per_gpu": 1}, build_tokenizer(cfg))
    assert model.config.vocab_size == 96 and model.config.bos_token_id == 5
