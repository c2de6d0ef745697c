"""The one table of every logged number (``docs/metrics.md``) against the code and the suite.

1. Every row names at least one test, and each named test exists (its file, its function); a row whose test
   was renamed or removed fails here, so no row claims a check that is not run.
2. Every name a stack logs has a row, read from the code that logs it (not from the docs): Hugging Face's
   ``NTLCausalLMLoss.pop_means`` in training and evaluation (z-loss on), DeepSpeed's step row and held-out
   metrics, torchtitan's ``NTLLoss.metric_names``, Megatron's reporting keys; and each stack has training
   and evaluation rows.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

import ntl_scale

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "metrics.md"


def _rows() -> list[dict[str, str]]:
    rows = []
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `") and not line.startswith("| per-token"):
            continue
        cells = [c.strip() for c in line.replace("\\|", "\0").strip("|").split("|")]
        metric, stack, when, what, tests = (c.replace("\0", "|") for c in cells)
        rows.append({"metric": metric, "stack": stack, "when": when, "what": what, "tests": tests})
    return rows


def _names(cell: str) -> set[str]:
    """The metric names of a cell: each back-quoted name (``(console ce)`` asides left out)."""
    return set(re.findall(r"`([^`]+)`", cell.split(" (")[0]))


def _stack(stack: str) -> dict[str, set[str]]:
    """{"train": names, "eval": names} of the rows of ``stack`` (a prefix of the stack cell)."""
    found: dict[str, set[str]] = {"train": set(), "eval": set()}
    for row in _rows():
        if row["stack"].startswith(stack):
            for when in ("train", "eval"):
                if when in row["when"] or row["when"] == "both":
                    found[when] |= _names(row["metric"])
    return found


def test_every_row_names_tests_that_exist():
    rows = _rows()
    assert len(rows) >= 30, len(rows)
    missing = []
    for row in rows:
        ids = re.findall(r"`(tests/[^`]+?)::(\w+)`", row["tests"])
        assert ids, f"{row['metric']} ({row['stack']}): no test named"
        for path, name in ids:
            file = ROOT / path
            if not file.is_file():
                missing.append(f"{path} (no such file)")
                continue
            defined = {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}
            if name not in defined:
                missing.append(f"{path}::{name}")
    assert not missing, "docs/metrics.md names tests that do not exist: " + ", ".join(missing)
    for stack in ("Hugging Face", "DeepSpeed", "torchtitan", "Megatron-LM route", "megatron.core"):
        names = _stack(stack)
        assert names["train"] and names["eval"], f"{stack}: training and evaluation rows expected, got {names}"


def _vocab() -> ntl_scale.NumberVocab:
    return ntl_scale.NumberVocab.from_id_to_token({i: str(i) for i in range(10)}, vocab_size=16)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 16, generator=g, dtype=torch.float64)
    labels = torch.tensor([[3, 12, 5, 14, 2, -100], [11, 7, 13, 9, 15, 4]])
    return logits, labels


def test_hugging_face_logs_only_names_of_the_table():
    from ntl_scale.integrations.hf import NTLCausalLMLoss

    train: set[str] = set()
    evaluation: set[str] = set()
    for options in (
        ntl_scale.NTLOptions(z_loss_weight=1e-3, label_smoothing=0.1),
        ntl_scale.NTLOptions(ce_kernel="framework"),
    ):
        loss = NTLCausalLMLoss(_vocab(), 0.3, options=options)
        logits, labels = _batch()
        loss(logits.clone().requires_grad_(True), labels, 16)
        with torch.no_grad():
            loss(logits, labels, 16)
        train |= set(loss.pop_means())
        evaluation |= {f"eval_{k}" for k in loss.pop_means(evaluation=True)}
    table = _stack("Hugging Face")
    assert train | {"loss"} == table["train"]  # loss, eval_loss: Trainer's own
    assert evaluation | {"eval_loss"} == table["eval"]


def test_deepspeed_logs_only_names_of_the_table():
    from ntl_scale.training.scoring import HELDOUT_COLUMNS, heldout_metrics

    totals = dict.fromkeys(HELDOUT_COLUMNS, 3.0) | {"tokens": 10.0}  # text and number labels: every key present
    evaluation = {f"eval/{k}" for k in heldout_metrics(list(totals.values()), 0.3)}
    table = _stack("DeepSpeed")
    assert evaluation == table["eval"]
    assert table["train"] == {"ce", "ntl", "number_acc", "z_loss"}
    import ntl_scale.integrations.deepspeed.trainer as trainer
    import ntl_scale.training.metrics as metrics

    source = pathlib.Path(metrics.__file__).read_text() + pathlib.Path(trainer.__file__).read_text()
    logged = set(re.findall(r'row\["(\w+)"\] =', source)) | set(re.findall(r'"(\w+)": \w+_sum / ', source))
    assert {"ce", "ntl", "number_acc", "z_loss"} <= logged, logged


def test_torchtitan_logs_only_names_of_the_table(tmp_path):
    pytest.importorskip("torchtitan")
    from ntl_scale.integrations.torchtitan import NTLLoss

    path = tmp_path / "numbers.json"
    _vocab().save(path)
    loss = NTLLoss.Config(number_vocab=str(path), vocab_size=16, weight=0.3, z_loss_weight=1e-3).build()
    beside = NTLLoss.Config(number_vocab=str(path), vocab_size=16, weight=0.3, ce_kernel="framework").build()
    table = _stack("torchtitan")
    assert {*loss.metric_names, *beside.metric_names, "loss_metrics/global_avg_loss"} == table["train"]
    assert table["eval"] == {"validation_metrics/loss"}


def test_megatron_reports_only_names_of_the_table():
    for module, stack in (("core", "megatron.core"), ("lm", "Megatron-LM route")):
        path = ROOT / "ntl_scale" / "integrations" / "megatron" / f"{module}.py"
        reported = set(re.findall(r'"((?:lm|z|ntl) loss|number (?:choice )?accuracy)"', path.read_text()))
        table = _stack(stack)
        assert reported <= table["train"] | table["eval"], (stack, reported)
        assert {"lm loss", "z loss", "ntl loss", "number accuracy"} <= table["train"], stack
