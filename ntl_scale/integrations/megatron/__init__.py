"""Megatron: ``args`` (the ``--ntl-*`` flags), ``lm`` (Megatron-LM's ``pretrain_gpt.py``), ``core``
(a ``megatron.core`` loop of your own) and ``terms`` (per-token terms in Megatron's layouts). The names of
``args``, ``core`` and ``terms`` are importable from here; Megatron is imported on first use.
"""

from ...options import NORMALIZATIONS, VOCAB_RULES
from .args import NTLSettings, add_ntl_args, build_number_vocab
from .core import (
    GlobalCounts,
    NTLLanguageModelMixin,
    count_targets,
    make_forward_step,
    make_loss_func,
    plain_loss_func,
)
from .terms import output_layer_terms, sequence_first_terms

__all__ = [
    "NORMALIZATIONS",
    "VOCAB_RULES",
    "GlobalCounts",
    "NTLLanguageModelMixin",
    "NTLSettings",
    "add_ntl_args",
    "build_number_vocab",
    "count_targets",
    "make_forward_step",
    "make_loss_func",
    "output_layer_terms",
    "plain_loss_func",
    "sequence_first_terms",
]
