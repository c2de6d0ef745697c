"""Thin adapters to training frameworks. Each imports its framework lazily, on first use.

- ``ntl_scale.integrations.hf``: Hugging Face tokenizers and causal/seq2seq label conventions.
"""
