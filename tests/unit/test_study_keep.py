"""experiments/study.py ``--keep``: finished runs kept in a repository folder and restored from it.

1. ``keep_run`` copies exactly the files the tables, tests and plots read (``eval.json``, the config,
   the metrics, every ``predictions_*.jsonl``, the held-out sequences, the baseline settings), byte for
   byte, and nothing else (no checkpoint, no log); an unfinished run (no ``eval.json``) is refused.
2. ``run_all`` with ``keep``: a run kept there is restored into the output folder and not trained (no
   process is started); a run finished in the output folder but not yet kept is kept; the run
   directories returned are the output folder's, as without ``keep``.
3. A kept copy interrupted before its ``eval.json`` is not taken for a finished run, and ``eval.json``
   is the last file copied.
4. A run trained by ``run_all`` (a stand-in process that leaves a finished run) is kept as it ends, with
   its ``run.json``: the commit and dirty state git reports, torch's version, the wall time by the clock.
"""

from __future__ import annotations

import calendar
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
study = load_script("experiments/study.py", "study_keep_under_test")

SMALL = {
    "eval.json": '{"interpolate": {"accuracy": 0.5}}',
    "config.json": '{"train": {"seed": 0}}',
    "metrics.jsonl": '{"step": 1, "ce": 2.0, "ntl": 0.5}\n',
    "predictions_interpolate.jsonl": '{"question": "1+1", "answer": "2", "parsed": 2}\n',
    "predictions_extrapolate.jsonl": '{"question": "10+10", "answer": "20", "parsed": 21}\n',
    "heldout_sequences.jsonl": '{"sequence": 0, "labels_crc32": 7}\n',
    "baseline.json": '{"loss": "del", "weight": 0.01}',
}
LARGE = {"train.log": "step 1\n", "checkpoints/step_2/model.pt": "weights", "export/config.json": "{}"}


def _finished_run(path: Path) -> None:
    for name, text in {**SMALL, **LARGE}.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)


def _files(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def test_keep_copies_the_small_files_only(tmp_path):
    run, kept = tmp_path / "run", tmp_path / "kept"
    _finished_run(run)
    study.keep_run(str(run), str(kept))
    assert _files(kept) == SMALL
    restored = tmp_path / "restored"
    assert study.restore_run(str(kept), str(restored))
    assert _files(restored) == SMALL


def test_an_unfinished_run_is_not_kept_nor_restored(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match=r"no eval\.json"):
        study.keep_run(str(run), str(tmp_path / "kept"))
    half = tmp_path / "half"  # a copy cut before its last file, eval.json
    half.mkdir()
    (half / "metrics.jsonl").write_text("{}\n")
    assert not study.restore_run(str(half), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_run_all_restores_kept_runs_and_keeps_finished_ones(tmp_path, monkeypatch):
    preset = {"base_config": "configs/train/tiny_cpu.yaml", "seeds": [0, 1], "arms": {"CE": [], "CE + NTL": []}}
    out, keep = tmp_path / "out", tmp_path / "keep"
    # seed 0 of both arms kept from an earlier machine; seed 1 finished here but not kept yet
    for arm in ("ce", "ce_ntl"):
        _finished_run(tmp_path / "earlier" / arm)
        study.keep_run(str(tmp_path / "earlier" / arm), str(keep / arm / "seed0"))
        _finished_run(out / arm / "seed1")

    def no_training(*args, **kwargs):
        raise AssertionError(f"a run was trained: {args}")

    monkeypatch.setattr(study.subprocess, "Popen", no_training)
    runs = study.run_all(preset, str(out), str(keep))
    assert runs == {
        "CE": [str(out / "ce" / "seed0"), str(out / "ce" / "seed1")],
        "CE + NTL": [str(out / "ce_ntl" / "seed0"), str(out / "ce_ntl" / "seed1")],
    }
    for arm in ("ce", "ce_ntl"):
        assert _files(out / arm / "seed0") == SMALL  # restored
        assert _files(keep / arm / "seed1") == SMALL  # kept now
        assert _files(out / arm / "seed1") == {**SMALL, **LARGE}  # the finished run itself untouched


def test_a_run_trained_here_is_kept_as_it_ends(tmp_path, monkeypatch):
    preset = {"base_config": "configs/train/tiny_cpu.yaml", "seeds": [0], "arms": {"CE": []}}
    out, keep = tmp_path / "out", tmp_path / "keep"
    started = []

    real_popen = subprocess.Popen

    class FinishedRun:  # a "training" that leaves a finished run in its run_dir and exits 0
        def __new__(cls, command, **kwargs):  # anything else (git, for run.json) runs for real
            if any(str(a).startswith("run_dir=") for a in command):
                return super().__new__(cls)
            return real_popen(command, **kwargs)

        def __init__(self, command, **kwargs):
            run_dir = Path(next(a for a in command if a.startswith("run_dir=")).split("=", 1)[1])
            _finished_run(run_dir)
            started.append(run_dir)

        def poll(self):
            return 0

    monkeypatch.setattr(study.subprocess, "Popen", FinishedRun)
    before = time.time()
    study.run_all(preset, str(out), str(keep))
    after = time.time()
    assert started == [out / "ce" / "seed0"]
    kept = _files(keep / "ce" / "seed0")
    record = json.loads(kept.pop("run.json"))
    assert kept == SMALL
    # its run.json, against git, torch and the clock read here
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert record["commit"] == (git.stdout.strip() if git.returncode == 0 else None)
    status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True).stdout  # fmt: skip
    assert record["dirty"] == (bool(status.strip()) if git.returncode == 0 else None)
    assert record["torch"] == torch.__version__ and 0 <= record["seconds"] <= after - before + 0.1
    started_at = calendar.timegm(time.strptime(record["started_utc"], "%Y-%m-%dT%H:%M:%SZ"))
    assert before - 1 <= started_at <= after and record["runs_at_a_time"] == 1
    line = study.provenance_line(
        study.read_provenance({"CE": [str(out / "ce" / "seed0")], "CE + NTL": [str(tmp_path)]})
    )
    assert line.startswith("Provenance (1 of 2 runs have a `run.json`): commit ") and record["started_utc"][:10] in line


def test_eval_json_is_copied_last(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _finished_run(run)
    copied = []
    real_copy = shutil.copyfile

    def recording_copy(src, dst, *args, **kwargs):
        copied.append(Path(src).name)
        return real_copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", recording_copy)
    study.keep_run(str(run), str(tmp_path / "kept"))
    assert sorted(copied) == sorted(SMALL) and copied[-1] == "eval.json"
