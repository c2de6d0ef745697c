"""Adapters to training frameworks: one package per framework (``hf``, ``megatron``, ``deepspeed``,
``torchtitan``), one module per route; each imports only torch, and its framework on first use.
"""
