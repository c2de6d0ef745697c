"""The op layer: the autograd Functions and the per-shard math under the functional API.

* :mod:`~ntl_scale.ops.shards`: which vocabulary columns a rank holds and in which group (DTensor
  inputs resolved to their local shard); no math, no collective.
* :mod:`~ntl_scale.ops.shard_math`: the per-shard steps of the PyTorch path; no collective.
* :mod:`~ntl_scale.ops.triton_ce_ntl`: the same steps as Triton kernels (Triton imported on first use);
  no collective.
* :mod:`~ntl_scale.ops.logits`: the op on logits and the two TP collectives of the loss
  (``all_reduce_max``, ``all_reduce_sums``), the only place they are written.
* :mod:`~ntl_scale.ops.chunked_linear`: the chunked op from hidden states (the logits never whole).

Called by the functional layer (:mod:`ntl_scale.losses`, :mod:`ntl_scale.linear`, :mod:`ntl_scale.terms`).
"""
