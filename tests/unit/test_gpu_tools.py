"""The GPU tooling runs where CI runs (no GPU), so that it cannot rot before a GPU is lent.

1. ``make gpu-check`` / ``scripts/gpu_check.sh`` without a GPU: says so and exits 0.

The benchmark it runs, ``benchmarks/bench_gpu.py``, is tested in ``tests/unit/test_bench_gpu.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


def _run(cmd: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@no_gpu
def test_gpu_check_without_a_gpu_says_so_and_exits_0():
    done = _run(["bash", "scripts/gpu_check.sh"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no CUDA GPU" in done.stdout
    done = _run(["make", "--no-print-directory", "gpu-check", f"PYTHON={sys.executable}"])
    assert done.returncode == 0 and "no CUDA GPU" in done.stdout, done.stdout + done.stderr
