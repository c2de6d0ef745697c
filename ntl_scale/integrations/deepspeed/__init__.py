"""DeepSpeed: the trainer of ``launch/train.py`` (``trainer`` and its components ``engine``, ``steps``,
``resolved``, ``checkpointer``, ``resume_layout``, ``heldout``) and AutoTP's output layer (``autotp``,
whose names are importable from here). ``deepspeed`` is imported on first use.
"""

from .autotp import HeadShard, full_logits, gathered_weights, head_shard, install_vocab_parallel_loss_head

__all__ = ["HeadShard", "full_logits", "gathered_weights", "head_shard", "install_vocab_parallel_loss_head"]
