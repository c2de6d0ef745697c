"""DeepSpeed: the trainer of ``launch/train.py`` and AutoTP's output layer.

| module | what |
|---|---|
| `trainer` | `Trainer`: one run, top to bottom, from its config sections (``launch/train.py``) |
| `engine` | the model under DeepSpeed: built, per-token CE + NTL of a micro-batch, export |
| `steps` | a step's global token counts and its exactly normalised loss (DeepSpeed's ``ga x dp`` rescale) |
| `resolved` | what the run derives (``resolved.json``), the DeepSpeed JSON's ``"auto"`` values filled |
| `checkpointer` | checkpoints, resume and ``status.json`` |
| `resume_layout` | resuming on another layout (universal checkpoints) and every rank's generators |
| `heldout` | held-out loss and perplexity, generation evaluation |
| `autotp` | AutoTP's vocabulary-parallel output layer (`launch/train.py`, `train.tensor_parallel_size > 1`) |

`autotp` finds the shard (`head_shard`), computes the loss from the hidden states on it
(`install_vocab_parallel_loss_head`), and gathers the head for generation (`full_logits`) and the
weights for export (`gathered_weights`). The DeepSpeed training step itself (ZeRO, accumulation,
normalisation) is ``trainer`` and its modules above; their framework-free parts (config, data sources,
model inputs, scoring, metrics, collectives) are ``ntl_scale.training``. The names of ``autotp`` are
importable from here; ``deepspeed`` is imported on first use.
"""

from .autotp import HeadShard, full_logits, gathered_weights, head_shard, install_vocab_parallel_loss_head

__all__ = ["HeadShard", "full_logits", "gathered_weights", "head_shard", "install_vocab_parallel_loss_head"]
