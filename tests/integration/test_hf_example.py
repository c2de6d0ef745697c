"""``examples/hf_trainer_ntl.py`` with a user's arguments: ``torchrun`` over gloo, DeepSpeed ZeRO-3, the chunked loss.

The script runs unchanged, as ``__main__``, under ``tests/helpers/run_then_leave.py``, which only ends its
finished processes without interpreter finalisation (``launch/finish.py``): the documented command itself
ends as a user's script does and can meet the abort at exit that module describes.

Checks that the documented command trains (the logged CE + NTL falls over 20 steps), really runs
under DeepSpeed with 2 processes, and that the TRL ``SFTTrainer`` variant logs NTL beside TRL's metrics.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import free_port, run_launch

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, processes: int, *flags: str) -> str:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
        str(free_port()), "tests/helpers/run_then_leave.py", "examples/hf_trainer_ntl.py",
        "--max-steps", "20", "--output-dir", str(tmp_path), *flags,
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = run_launch(command, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return done.stdout


def _losses(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"(?:first|last) log: step \d+, loss ([0-9.]+), ce [0-9.]+, ntl [0-9.]+", out)]


def test_example_trains_under_zero3_with_the_chunked_loss(tmp_path):
    pytest.importorskip("deepspeed")
    out = _run(tmp_path, 2, "--deepspeed", "configs/deepspeed/zero3.json", "--chunked")
    assert "(DeepSpeed, 2 processes)" in out, out
    first, last = _losses(out)
    assert last < first, out


def test_example_with_trl_sft_trainer(tmp_path):
    pytest.importorskip("trl")
    out = _run(tmp_path, 1, "--sft")
    first, last = _losses(out)
    assert last < first, out
