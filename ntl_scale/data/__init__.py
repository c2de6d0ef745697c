"""Data for NTL training: a seeded arithmetic generator and question/answer files through Hugging Face ``datasets``."""

from .arithmetic import ArithmeticConfig, Example, generate, reverse_digits
from .collate import IGNORE_INDEX, EncodedExample, ShardedOrder, collate, encode
from .hf_datasets import StreamingOrder, load_qa, tokenize_qa

__all__ = [
    "IGNORE_INDEX",
    "ArithmeticConfig",
    "EncodedExample",
    "Example",
    "ShardedOrder",
    "StreamingOrder",
    "collate",
    "encode",
    "generate",
    "load_qa",
    "reverse_digits",
    "tokenize_qa",
]
