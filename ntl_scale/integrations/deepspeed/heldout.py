"""Held-out evaluation of a run: loss and perplexity on held-out batches, answers generated and scored.

Every data-parallel rank runs the same number of batches (ZeRO-3 gathers parameters in every forward).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from typing import Any

import torch

from ...atomic import atomic_write
from ...data.arithmetic import Example
from ...data.collate import EncodedExample, collate, encode_pairs, fits
from ...training.collectives import gathered, sum_over
from ...training.config import DataConfig, EvalConfig
from ...training.model_inputs import Inputs
from .engine import Engine

__all__ = ["Evaluator", "heldout_micro_batches", "heldout_qa_batches"]


def heldout_qa_batches(
    examples: list[Example], tokenizer: Any, *, kind: str, max_length: int, micro_batch_size: int, dp_rank: int, dp: int
) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's held-out micro-batches of question/answer examples (host tensors)."""
    input_ids, labels = encode_pairs(tokenizer, [e.question for e in examples], [e.answer for e in examples], kind=kind)
    rows = [EncodedExample(i, t) for i, t in zip(input_ids, labels) if fits(i, t, kind=kind, max_length=max_length)]
    rows = rows[: len(rows) - len(rows) % dp][dp_rank::dp]
    pad = tokenizer.pad_token_id
    return [collate(rows[s : s + micro_batch_size], pad) for s in range(0, len(rows), micro_batch_size)]


def heldout_micro_batches(
    data: DataConfig,
    tokenizer: Any,
    eval_splits: dict[str, list[Example]],
    *,
    kind: str,
    seq_length: int,
    micro_batch_size: int,
    dp_rank: int,
    dp: int,
) -> list[dict[str, Any]]:
    """This rank's held-out micro-batches (host tensors): the first generation-evaluation split of the
    question/answer sources; the held-out packed sequences of a pretraining corpus (``data.eval_sequences``)."""
    from ...training.sources import PACKED_SOURCES, heldout_batches

    if data.source in PACKED_SOURCES:
        return heldout_batches(data, tokenizer, seq_length=seq_length, micro_batch_size=micro_batch_size,
                               dp_rank=dp_rank, dp=dp)  # fmt: skip
    if not eval_splits:
        return []
    examples = next(iter(eval_splits.values()))
    return heldout_qa_batches(examples, tokenizer, kind=kind, max_length=data.max_length,
                              micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp=dp)  # fmt: skip


class Evaluator:
    """Held-out loss and perplexity, and generation evaluation, of one run."""

    def __init__(self, evaluation: EvalConfig, data: DataConfig, run_dir: str, *, engine: Engine, inputs: Inputs,
                 batches: list[dict[str, torch.Tensor]], eval_splits: dict[str, list[Example]], weight: float,
                 rank: int, world_size: int) -> None:  # fmt: skip
        self.evaluation, self.data, self.run_dir = evaluation, data, run_dir
        self.engine, self.inputs, self.batches, self.eval_splits = engine, inputs, batches, eval_splits
        self.weight, self.rank, self.world = weight, rank, world_size

    @torch.no_grad()
    def heldout(
        self, batches: Iterable[dict[str, torch.Tensor]] | None = None, *, per_sequence: str | None = None
    ) -> dict[str, float]:
        """Loss, perplexity and number metrics on held-out micro-batches (this rank's share; default
        :attr:`batches`), summed over every data-parallel rank."""
        from ...training.scoring import HELDOUT_COLUMNS, heldout_metrics, sequence_stats

        engine = self.engine
        batches = self.batches if batches is None else batches
        totals = torch.zeros(len(HELDOUT_COLUMNS), dtype=torch.float64, device=engine.device)
        rows: list[torch.Tensor] = []
        fingerprints: list[int] = []
        with engine.evaluating():
            for host in batches:
                batch = self.inputs.device_batch(host, training=False)
                target = engine.targets_of(batch)
                terms, abs_error = engine.heldout_terms(batch, target)
                stats = sequence_stats(terms, target, engine.vocab, abs_error)
                totals += stats.sum(0)
                if per_sequence:
                    rows.append(stats)
                    labels = host.get("labels", host["input_ids"]).to(torch.int64).cpu().numpy()
                    fingerprints += [zlib.crc32(row.tobytes()) for row in labels]
        sum_over(totals, engine.dp_group)
        if per_sequence:
            columns = HELDOUT_COLUMNS[:-1] if engine.chunked else HELDOUT_COLUMNS  # no MAE: see above
            sums = torch.cat(rows)[:, : len(columns)].cpu().tolist() if rows else []
            self.write_sequence_stats(per_sequence, (*columns, "labels_crc32"),
                                      [[*row, crc] for row, crc in zip(sums, fingerprints)])  # fmt: skip
        metrics = heldout_metrics(totals.cpu().tolist(), self.weight, with_abs_error=not engine.chunked)
        return {f"eval/{k}": v for k, v in metrics.items()}

    def write_sequence_stats(self, path: str, columns: tuple[str, ...], rows: list[list[float]]) -> None:
        """Rank 0 writes every data-parallel rank's held-out sequence sums (named ``columns``) to ``path``, in
        held-out order (rank ``r``'s ``i``-th is sequence ``r + dp * i``)."""
        dp = self.engine.dp
        shares = gathered((self.engine.dp_rank, rows), self.engine.dp_group, dp)
        if self.rank != 0:
            return
        indexed = sorted((r + dp * i, row) for r, share in shares for i, row in enumerate(share))
        with atomic_write(path) as f:
            for index, row in indexed:
                f.write(json.dumps({"sequence": index, **dict(zip(columns, row))}) + "\n")

    def generation(self) -> dict[str, dict[str, float]]:
        """Answers generated for each held-out question split and scored (every rank generates the same)."""
        from ...training.scoring import evaluate_generation
        from .autotp import full_logits

        evaluation, data = self.evaluation, self.data
        results = {}
        for split, examples in self.eval_splits.items():
            path = os.path.join(self.run_dir, f"predictions_{split}.jsonl") if self.rank == 0 else None
            with full_logits(self.engine.shard):  # a TP head gathers its columns
                results[split] = evaluate_generation(
                    self.engine.model, self.inputs.tokenizer, examples, kind=self.engine.kind,
                    max_new_tokens=evaluation.max_new_tokens, num_beams=evaluation.num_beams,
                    synced_gpus=self.world > 1, predictions_path=path, answer_until=evaluation.answer_until,
                    reverse_answers=data.reverse_answers,
                    position_ids=self.inputs.coupled_positions if data.position_coupling else None,
                )  # fmt: skip
        return results
