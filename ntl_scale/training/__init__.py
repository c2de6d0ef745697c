"""Framework-free building blocks of the DeepSpeed trainer (:mod:`ntl_scale.integrations.deepspeed`):
the run config, tokenizer and model builders, data sources, model inputs, scoring, metrics, FLOPs.

Importing this package needs only torch; each piece imports its framework when called.
"""
