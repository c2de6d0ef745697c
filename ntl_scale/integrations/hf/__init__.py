"""Hugging Face ``transformers`` (and TRL): one module per route.

| module | route |
|---|---|
| `loss` | CE + NTL as the model's `loss_function`: `apply_ntl_to_hf_model`, `remove_ntl`, `NTLCausalLMLoss` |
| `chunked` | the loss from the hidden states, no logits: `apply_ntl_to_hf_model(chunked=True)`, `ChunkedLossCausalLM` |
| `trainer` | `Trainer` / TRL `SFTTrainer` with exact step normalisation: `ntl_trainer_class` |
| `vocab` | number tables of local checkpoints: `number_vocab_from_pretrained` |

Everything is importable from here (``from ntl_scale.integrations.hf import apply_ntl_to_hf_model``);
``causal_lm_ce_with_ntl`` is CE + NTL on the logits of a custom loop. These modules need only
torch to import; ``transformers`` is imported on first use.
"""

from .chunked import ChunkedLossCausalLM
from .loss import NTLCausalLMLoss, apply_ntl_to_hf_model, causal_lm_ce_with_ntl, remove_ntl, shift_labels
from .trainer import count_step_numbers, ntl_trainer_class
from .vocab import number_vocab_from_pretrained

__all__ = [
    "ChunkedLossCausalLM",
    "NTLCausalLMLoss",
    "apply_ntl_to_hf_model",
    "causal_lm_ce_with_ntl",
    "count_step_numbers",
    "ntl_trainer_class",
    "number_vocab_from_pretrained",
    "remove_ntl",
    "shift_labels",
]
