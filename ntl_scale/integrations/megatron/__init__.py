"""Megatron: the ``--ntl-*`` flags and one module per route.

| module | route |
|---|---|
| `args` | both routes: `add_ntl_args` (the `--ntl-*` flags), `NTLSettings`, `build_number_vocab` |
| `lm` | Megatron-LM's `pretrain_gpt.py` (`pretrain_gpt_ntl.py`): `apply_ntl_to_megatron_model`, `NTLForwardStep` |
| `core` | a `megatron.core` loop of your own: `make_loss_func`, `make_forward_step`, `GlobalCounts` |
| `terms` | per-token CE + NTL in Megatron's layouts (logits or hidden states), for both routes |

The names of `args`, `core` and `terms` are importable from here (what
`ntl_scale.integrations.megatron` exported as one module); those of the Megatron-LM route from
`ntl_scale.integrations.megatron.lm`. Megatron is imported on first use.
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
