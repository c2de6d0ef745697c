"""``python launch/train.py`` without a launcher: a one-rank world that opens no port.

A port picked by binding port 0 and closing it, then listened on seconds later by a ``TCPStore``,
can be taken meanwhile by another process's outgoing connection: ``experiments/study.py`` running
two single-process runs at a time failed with ``EADDRINUSE``. The run here goes through
``tests/helpers/rendezvous_probe.py``, which records the process group's store, the ports bound from
Python and the ports listened on; the run must have met on an in-process ``HashStore``, listened on
no port picked ahead of its use, and trained (checked to fail on the code that picked a port).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_one_process_without_a_launcher_opens_no_port(tmp_path):
    run, report = tmp_path / "run", tmp_path / "rendezvous.json"
    cmd = [sys.executable, str(HELPERS / "rendezvous_probe.py"), str(HELPERS / "ds_launch.py"),
           str(ROOT / "launch" / "train.py"), f"run_dir={run}", "train.steps=2", "train.log_every=1",
           "train.micro_batch_size=4", "data.train_examples=64", "eval.at_end=false",
           "tracking.wandb=disabled"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", NTL_RENDEZVOUS_REPORT=str(report))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"train.py failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    recorded = json.loads(report.read_text())
    assert len(recorded["stores"]) == 1 and recorded["stores"][0][-1] == "HashStore", recorded
    assert "TCPStore" not in recorded["stores"][0]
    picked = set(recorded["bound"]) & set(recorded["listening"][0])
    assert not picked, f"port(s) {picked} picked ahead of their use: another process can take them meanwhile"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["ce"]) and math.isfinite(r["ntl"]) for r in rows)
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
