"""DeepSpeed: one module per route.

| module | route |
|---|---|
| `autotp` | AutoTP's vocabulary-parallel output layer (`launch/train.py`, `train.tensor_parallel_size > 1`) |

`autotp` finds the shard (`head_shard`), computes the loss from the hidden states on it
(`install_vocab_parallel_loss_head`), and gathers the head for generation (`full_logits`) and the
weights for export (`gathered_weights`). The DeepSpeed training step itself (ZeRO, accumulation,
normalisation) is ``ntl_scale.training``. ``deepspeed`` is imported on first use.
"""

from .autotp import HeadShard, full_logits, gathered_weights, head_shard, install_vocab_parallel_loss_head

__all__ = ["HeadShard", "full_logits", "gathered_weights", "head_shard", "install_vocab_parallel_loss_head"]
