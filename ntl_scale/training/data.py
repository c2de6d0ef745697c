"""The examples of a run, from its data section: generated arithmetic or local files."""

from __future__ import annotations

from ..data.arithmetic import ArithmeticConfig, Example, generate, read_deepmind_text, read_jsonl
from .config import DataConfig

__all__ = ["load_examples"]


def load_examples(cfg: DataConfig) -> tuple[list[Example], dict[str, list[Example]]]:
    """Training examples and named evaluation sets.

    ``arithmetic``: generated ``train`` examples and ``interpolate``/``extrapolate`` evaluation splits.
    ``deepmind``/``jsonl``: ``train_path`` for training and ``eval_path`` (if given) as the ``eval``
    split, the first ``eval_examples`` of it.
    """
    if cfg.source == "arithmetic":
        task = ArithmeticConfig(
            kinds=tuple(cfg.kinds), train_digits=cfg.train_digits, extrapolate_digits=cfg.extrapolate_digits
        )
        train = generate(cfg.train_examples, "train", seed=cfg.seed, config=task)
        splits = ("interpolate", "extrapolate")
        evals = {s: generate(cfg.eval_examples, s, seed=cfg.seed, config=task) for s in splits}
        return train, evals
    read = read_deepmind_text if cfg.source == "deepmind" else read_jsonl
    assert cfg.train_path is not None  # DataConfig validates this
    train = list(read(cfg.train_path))
    if not train:
        raise ValueError(f"{cfg.train_path}: no examples")
    evals = {"eval": list(read(cfg.eval_path))[: cfg.eval_examples]} if cfg.eval_path else {}
    return train, evals
