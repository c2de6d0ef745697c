"""Adapters to training frameworks: one package per framework, one module per route.

Nothing is imported here; each module imports only torch, and its framework on first use.

| module | framework: entry |
|---|---|
| `hf.loss` | Hugging Face: CE + NTL as `model.loss_function` (`apply_ntl_to_hf_model`, `remove_ntl`) |
| `hf.chunked` | Hugging Face: the loss from the hidden states, no logits (`apply_ntl_to_hf_model(chunked=True)`) |
| `hf.trainer` | Hugging Face `Trainer` / TRL `SFTTrainer`: `ntl_trainer_class` |
| `hf.vocab` | Hugging Face checkpoints: `number_vocab_from_pretrained` |
| `megatron.args` | Megatron, both routes: the `--ntl-*` flags, `NTLSettings`, `build_number_vocab` |
| `megatron.lm` | Megatron-LM `pretrain_gpt.py` (`launch/pretrain_gpt_ntl.py`): `forward_step_from_args` |
| `megatron.core` | `megatron.core` alone, your own loop: `make_loss_func`, `make_forward_step` |
| `megatron.terms` | Megatron, both routes: per-token terms in Megatron's layouts |
| `deepspeed.trainer` | DeepSpeed (`launch/train.py`): the `Trainer` (ZeRO, accumulation, checkpoints, evaluation) |
| `deepspeed.autotp` | DeepSpeed AutoTP (`launch/train.py`, tensor parallel): the vocabulary-sharded head |
| `torchtitan` | torchtitan (0.3.0): `NTLLoss` (a `BaseLoss`), `NTLTrainer`, `config_registry` for `--module` |

``ntl_scale.integrations.hf``, ``.megatron`` and ``.deepspeed`` re-export their modules' names.
"""
