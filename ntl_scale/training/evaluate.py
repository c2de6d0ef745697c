"""Generation-based evaluation: answers from the model, numbers from the answers, metrics."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch

from ..data.arithmetic import Example
from ..eval.numbers import extract_number, number_metrics

__all__ = ["evaluate_generation"]


@torch.no_grad()
def evaluate_generation(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    kind: str = "causal",
    max_new_tokens: int = 12,
    num_beams: int = 1,
    batch_size: int = 32,
    synced_gpus: bool = False,
    predictions_path: str | None = None,
) -> dict[str, float]:
    """Generates an answer per question and scores the numbers in them.

    Args:
        model: a Hugging Face causal or seq2seq model (under ZeRO-3 pass ``synced_gpus=True`` and
            call on every rank with the same examples).
        tokenizer: its tokenizer.
        examples: questions with their true answers.
        kind: ``causal`` (prompt = question + " ") or ``seq2seq``.
        max_new_tokens: tokens generated per answer.
        num_beams: 1 = greedy, more = beam search.
        batch_size: questions per generate call.
        synced_gpus: keep ZeRO-3 ranks in step during generation.
        predictions_path: where to write one JSON line per example (question, answer, generated, parsed).

    Returns:
        :func:`ntl_scale.eval.number_metrics` of the parsed answers.
    """
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left" if kind == "causal" else "right"
    rows = []
    try:
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            prompts = [e.question + " " if kind == "causal" else e.question for e in chunk]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(next(model.parameters()).device) for k, v in enc.items()}
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                num_beams=num_beams,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                synced_gpus=synced_gpus,
            )
            if kind == "causal":
                out = out[:, enc["input_ids"].shape[1] :]
            for example, ids in zip(chunk, out):
                text = tokenizer.decode(ids, skip_special_tokens=True)
                rows.append((example, text, extract_number(text)))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    targets = [extract_number(e.answer) for e in examples]
    metrics = number_metrics([p for _, _, p in rows], [t if t is not None else float("nan") for t in targets])
    if predictions_path is not None:
        tmp = f"{predictions_path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            for example, text, parsed in rows:
                record = {"question": example.question, "answer": example.answer, "generated": text, "parsed": parsed}
                f.write(json.dumps(record) + "\n")
        os.replace(tmp, predictions_path)
    return metrics
