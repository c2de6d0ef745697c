"""The op layer under the functional API: ``shards`` (which columns a rank holds), ``shard_math`` and
``triton_ce_ntl`` (per-shard math, no collective), ``logits`` (the op on logits and its two TP collectives)
and ``chunked_linear`` (the op from hidden states).
"""
