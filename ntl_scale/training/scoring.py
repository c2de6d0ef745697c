"""Generation-based evaluation: answers from the model, numbers from the answers, metrics."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..atomic import atomic_write
from ..data.arithmetic import Example, reverse_digits
from ..eval.numbers import extract_number, number_metrics
from ..normalization import objective_of_means

__all__ = ["HELDOUT_COLUMNS", "evaluate_generation", "heldout_metrics", "sequence_stats"]

HELDOUT_COLUMNS = (
    "ce_sum", "ntl_sum", "tokens", "ntl_positions", "ntl_hits",
    "number_tokens", "number_ce_sum", "number_hits", "number_abs_error_sum",
)  # fmt: skip
"""The per-sequence sums of :func:`sequence_stats`, in column order."""


def sequence_stats(
    terms: Any, targets: torch.Tensor, vocab: Any, abs_error: torch.Tensor | None = None
) -> torch.Tensor:
    """Held-out sums per sequence, float64 ``[sequences, len(HELDOUT_COLUMNS)]``, on the terms' device."""
    valid = targets != -100
    numbers = valid & vocab.number_mask(targets)
    per_token = [
        terms.ce * valid, terms.ntl, valid, terms.number_mask, terms.hit & terms.number_mask,
        numbers, terms.ce * numbers, terms.hit & numbers,
        abs_error * numbers if abs_error is not None else torch.zeros_like(terms.ce),
    ]  # fmt: skip
    flat = [t.reshape(t.shape[0], -1).double().sum(-1) for t in per_token]
    return torch.stack(flat, dim=-1)


def heldout_metrics(totals: list[float], weight: float, *, with_abs_error: bool = True) -> dict[str, float]:
    """The held-out metrics of summed :func:`sequence_stats` columns (``{}`` without tokens)."""
    col = dict(zip(HELDOUT_COLUMNS, totals))
    tokens, numbers = col["tokens"], col["number_tokens"]
    if tokens == 0:
        return {}
    ce, ntl = col["ce_sum"] / tokens, col["ntl_sum"] / max(col["ntl_positions"], 1)
    text_tokens = tokens - numbers
    text_ce = (col["ce_sum"] - col["number_ce_sum"]) / max(text_tokens, 1)
    number_ce = col["number_ce_sum"] / max(numbers, 1)
    out = {
        "loss": objective_of_means({"ce": ce, "ntl": ntl}, weight),
        "ce": ce,
        "ppl": math.exp(min(ce, 700.0)),
        "ntl": ntl,
        "number_acc": col["ntl_hits"] / max(col["ntl_positions"], 1),
        "tokens": int(tokens),
        "number_tokens": int(numbers),
    }
    if text_tokens > 0:  # a kind without labels has no metrics (not a perfect 0 error or ppl 1)
        out.update(text_ce=text_ce, text_ppl=math.exp(min(text_ce, 700.0)))
    if numbers > 0:
        out.update(number_token_ce=number_ce, number_token_ppl=math.exp(min(number_ce, 700.0)),
                   number_token_acc=col["number_hits"] / numbers)  # fmt: skip
        if with_abs_error:
            out["number_token_mae"] = col["number_abs_error_sum"] / numbers
    return out


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
    answer_until: str | None = None,
    reverse_answers: bool = False,
    position_ids: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Generates an answer per question and scores the numbers in them."""
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
            if position_ids is not None:  # with a cache: without one Hugging Face may read them as packed documents
                enc["position_ids"], enc["use_cache"] = position_ids(enc["input_ids"]), True
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
                answer = text.split(answer_until, 1)[0] if answer_until else text
                rows.append((example, text, extract_number(reverse_digits(answer) if reverse_answers else answer)))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    truths = [reverse_digits(e.answer) if reverse_answers else e.answer for e in examples]
    targets = [extract_number(t) for t in truths]
    metrics = number_metrics([p for _, _, p in rows], [t if t is not None else float("nan") for t in targets])
    if predictions_path is not None:
        with atomic_write(predictions_path) as f:
            for (example, text, parsed), truth in zip(rows, truths):
                record = {"question": example.question, "answer": truth, "generated": text, "parsed": parsed}
                f.write(json.dumps(record) + "\n")
    return metrics
