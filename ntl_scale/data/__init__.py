"""Data for NTL training: a seeded arithmetic generator and readers of local question/answer files."""

from .arithmetic import ArithmeticConfig, Example, generate, read_deepmind_text, read_jsonl

__all__ = ["ArithmeticConfig", "Example", "generate", "read_deepmind_text", "read_jsonl"]
