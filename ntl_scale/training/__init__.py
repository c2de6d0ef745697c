"""Training building blocks for ``launch/train.py``: config, tokenizer, step arithmetic, evaluation.

Importing this package needs only torch; each piece imports its framework when called.
"""
