"""ntl_scale: Number Token Loss for large-scale training (Megatron, DeepSpeed, torchtitan, Hugging Face, Slurm).

``import ntl_scale`` needs only torch; framework integrations live in ``ntl_scale.integrations``
and import their framework lazily.
"""

from ._runtime import set_debug_checks
from .linear import linear_beside_ce, linear_ce_ntl, linear_ce_with_ntl, linear_number_token_loss
from .losses import CEWithNTL, NumberTokenLoss, beside_ce, ce_with_ntl, number_token_loss, vocab_parallel_ce_ntl
from .number_vocab import (
    NumberVocab,
    VocabShard,
    add_digit_tokens,
    check_number_level_table,
    pad_vocab_size,
    parse_number_token,
)
from .options import LOSS_KINDS, REDUCTIONS, NTLOptions
from .reductions import CENTLOutput, reduce_loss
from .terms import NumberPrediction, PerTokenTerms, ntl_counts, ntl_positions, per_token_ce_ntl, predict_numbers

__version__ = "0.1.0"

__all__ = [
    "LOSS_KINDS",
    "REDUCTIONS",
    "CENTLOutput",
    "CEWithNTL",
    "NTLOptions",
    "NumberPrediction",
    "NumberTokenLoss",
    "NumberVocab",
    "PerTokenTerms",
    "VocabShard",
    "add_digit_tokens",
    "beside_ce",
    "ce_with_ntl",
    "check_number_level_table",
    "linear_beside_ce",
    "linear_ce_ntl",
    "linear_ce_with_ntl",
    "linear_number_token_loss",
    "ntl_counts",
    "ntl_positions",
    "number_token_loss",
    "pad_vocab_size",
    "parse_number_token",
    "per_token_ce_ntl",
    "predict_numbers",
    "reduce_loss",
    "set_debug_checks",
    "vocab_parallel_ce_ntl",
]
