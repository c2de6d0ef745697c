"""The GPU tooling runs where CI runs (no GPU), so that it cannot rot before a GPU is lent.

1. ``scripts/gpu_check.sh`` itself: ``tests/unit/test_gpu_check.py``.
2. ``benchmarks/bench_gpu.py --help`` and ``--list-rows``; without a GPU and without ``--dry-run`` it
   measures nothing and says so.
3. ``bench_gpu.py --dry-run`` at tiny size on the CPU: every row appears in the final Markdown table,
   rows needing CUDA say so, and the rows that ran agree on the loss (ours and CE + ntloss on CE + NTL,
   the CE-only rows on CE), so a broken row cannot pass.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_gpu.py"
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


def _run(cmd: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_bench_gpu_help_and_rows():
    done = _run([sys.executable, str(BENCH), "--help"])
    assert done.returncode == 0 and "--dry-run" in done.stdout and "--vocab" in done.stdout, done.stderr
    done = _run([sys.executable, str(BENCH), "--list-rows"])
    assert done.returncode == 0
    for key in ("liger", "liger_cutedsl", "quack", "cce", "megatron", "compiled_ce", "ce_ntloss", "ours_chunked"):
        assert re.search(rf"^{key}\s", done.stdout, re.M), done.stdout
    done = _run([sys.executable, str(BENCH), "--rows", "nonsense"])
    assert done.returncode == 2 and "unknown rows" in done.stderr


@no_gpu
def test_bench_gpu_without_a_gpu_measures_nothing():
    done = _run([sys.executable, str(BENCH)])
    assert done.returncode == 0 and "nothing measured" in done.stdout, done.stdout + done.stderr


def test_bench_gpu_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "table.md"
    done = _run(
        [sys.executable, str(BENCH), "--dry-run", "--warmup", "0", "--iters", "1", "--markdown", str(out)],
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = out.read_text()
    assert "dry run: timings are not measurements" in table
    assert done.stdout.rstrip().endswith(table.strip().splitlines()[-1])  # the output ends with the table
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 12 and cells[0].isdigit():
            rows[cells[3].replace(" (best CE)", "")] = cells
    assert len(rows) == 15, rows.keys()
    for name in ("Liger fused linear CE (Triton)", "Cut Cross Entropy (cce)", "QuACK chunked_linear_cross_entropy"):
        assert "needs a CUDA GPU" in rows[name][5]
    ours = ["ours: ce_with_ntl on logits", "ours: linear_ce_with_ntl (chunked)"]
    ran = {name: (float(c[10]), float(c[11])) for name, c in rows.items() if not c[5].startswith("not run")}
    assert set(ours) <= set(ran), ran
    ce = ran["F.cross_entropy on logits"][1]
    for name, (loss, row_ce) in ran.items():
        assert row_ce == pytest.approx(ce, rel=5e-3), (name, row_ce, ce)  # bf16-level agreement
        if name.startswith("ours") or "ntloss" in name:
            assert loss == pytest.approx(ran[ours[0]][0], rel=5e-3), (name, loss)
            assert loss > row_ce  # NTL adds a positive term
