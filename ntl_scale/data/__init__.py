"""Data for NTL training: a seeded arithmetic generator and readers of local question/answer files."""

from .arithmetic import ArithmeticConfig, Example, generate, read_deepmind_text, read_jsonl
from .collate import IGNORE_INDEX, EncodedExample, ShardedOrder, collate, encode

__all__ = [
    "IGNORE_INDEX",
    "ArithmeticConfig",
    "EncodedExample",
    "Example",
    "ShardedOrder",
    "collate",
    "encode",
    "generate",
    "read_deepmind_text",
    "read_jsonl",
]
