"""The megatron.core example (launch/megatron_example.py) end to end at TP = 2 x PP = 2 on CPU.

A real indexed dataset of arithmetic text, a character tokenizer's digit table, Megatron's pipeline
schedule; CE + 0.3 * NTL-WAS must decrease. CPU patches come from tests/helpers/megatron_cpu.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.helpers.distributed import WorkerContext, run_workers

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed

EXAMPLE = Path(__file__).resolve().parents[2] / "launch" / "megatron_example.py"


def _worker(ctx: WorkerContext, workdir: str) -> None:
    from tests.helpers.megatron_cpu import patch_for_cpu

    patch_for_cpu()
    spec = importlib.util.spec_from_file_location("megatron_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse_args(
        f"--tp 2 --pp 2 --steps 30 --micro-batches 2 --ntl-weight 0.3 --workdir {workdir}".split()
    )
    history = example.train(args)
    if history:
        with open(os.path.join(workdir, f"history{ctx.rank}.json"), "w") as f:
            json.dump(history, f)


def test_example_trains_at_tp2_pp2(tmp_path):
    run_workers(4, 4, _worker, str(tmp_path))
    files = sorted(tmp_path.glob("history*.json"))
    assert files, "the last pipeline stage reports losses"
    history = json.loads(files[0].read_text())
    assert len(history) == 30
    assert set(history[0]) == {"lm loss", "ntl loss", "number accuracy"}

    def mean(key, rows):
        return sum(r[key] for r in rows) / len(rows)

    first, last = history[:3], history[-3:]
    assert mean("lm loss", last) < 0.9 * mean("lm loss", first)
    assert mean("ntl loss", last) < mean("ntl loss", first)  # digits are learnt later; it must not rise
