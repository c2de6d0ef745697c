"""Deprecated alias of :mod:`ntl_scale.integrations.deepspeed.autotp` (kept for one release).

Moved to ``ntl_scale.integrations.deepspeed.autotp`` (also importable from
``ntl_scale.integrations.deepspeed``): ``HeadShard``, ``head_shard``, ``full_logits``,
``gathered_weights``; renamed there: ``install_chunked_head`` is ``install_vocab_parallel_loss_head``.
"""

import warnings

from .deepspeed.autotp import HeadShard, full_logits, gathered_weights, head_shard
from .deepspeed.autotp import install_vocab_parallel_loss_head as install_chunked_head

__all__ = ["HeadShard", "full_logits", "gathered_weights", "head_shard", "install_chunked_head"]

warnings.warn(
    "ntl_scale.integrations.deepspeed_tp is deprecated; import from ntl_scale.integrations.deepspeed "
    "(install_chunked_head is now install_vocab_parallel_loss_head)",
    DeprecationWarning,
    stacklevel=2,
)
