"""Thin adapters to training frameworks. Each imports its framework lazily, on first use.

- ``ntl_scale.integrations.hf``: Hugging Face tokenizers and the causal-LM label convention.
- ``ntl_scale.integrations.megatron``: ``--ntl-*`` flags, ``loss_func`` / ``forward_step``, the
  model-side mixin and global normalisation for Megatron.
"""
