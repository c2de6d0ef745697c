"""The README's first command after set-up: ``bash scripts/run.sh`` (what ``make run`` runs), shortened to 4 steps.

Its output is what a newcomer reads: the self-check, one progress line per log interval, and the
final table with held-out accuracy and example answers; the libraries' repeated notices (DeepSpeed's
launcher INFO lines and "op built successfully", torch's deprecation warnings for the collectives
DeepSpeed calls, progress bars) do not reach the screen. The full-length run's accuracy is measured,
not tested (docs/deepspeed.md: 93.5 % in about 3 minutes of training on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.helpers.distributed import run_launch

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def test_main_job_output_is_readable(tmp_path):
    run = tmp_path / "tiny"
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", "python"), "PYTHONUNBUFFERED": "1"}
    args = ["train.steps=4", "train.log_every=2", "data.train_examples=400", "data.eval_examples=8", f"run_dir={run}",
            "tracking.wandb=disabled"]  # fmt: skip
    out = run_launch(["bash", "scripts/run.sh", *args], cwd=ROOT, env=env, timeout=900)  # 2 DeepSpeed ranks
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "self-check (fused vs plain PyTorch)" in text and ": OK" in text
    assert re.findall(r"^step (\d+)/4 ", text, flags=re.M) == ["2", "4"]  # one line per interval
    assert re.search(r"^step 4/4 .* \d+ tok/s", text, flags=re.M)
    for noise in ("[INFO]", "FutureWarning", "built successfully", "Map:", "Filter:", "Writing model shards"):
        assert noise not in text, f"{noise!r} reached the screen:\n{text[-3000:]}"
    # the final table: both held-out splits, and example questions with the model's answers
    evals = json.loads((run / "eval.json").read_text())
    table = text[text.index("held-out questions") :]
    for split in ("interpolate", "extrapolate"):
        assert re.search(rf"^{split} +8 +{evals[split]['accuracy'] * 100:.1f}%", table, flags=re.M), table
    first = json.loads((run / "predictions_interpolate.jsonl").read_text().splitlines()[0])
    # the questions are padded to the longest of those shown, which need not be the first
    assert re.search(rf"^  {re.escape(first['question'])} +true {first['answer']:>8}  model ", table, flags=re.M), table
    # tokens/s counts every token read: the metrics log the tokens of each step (prompts included)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tokens"] > 32 * 8 for r in rows)  # 32 questions of at least 8 characters each
