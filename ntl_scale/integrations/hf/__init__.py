"""Hugging Face ``transformers`` (and TRL): ``loss`` (CE + NTL as the model's ``loss_function``),
``chunked`` (from the hidden states), ``trainer`` (``Trainer`` with exact step normalisation) and ``vocab``.
``transformers`` is imported on first use.
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
