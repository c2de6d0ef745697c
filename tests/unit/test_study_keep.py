"""experiments/study.py ``--keep``: finished runs kept in a repository folder and restored from it.

1. ``keep_run`` copies exactly the files the tables, tests and plots read (``eval.json``, the config,
   every ``predictions_*.jsonl``, the held-out sequences, the baseline settings), every ``*.jsonl`` as
   ``*.jsonl.xz`` (read back by the ``xz`` program, smaller than the text), the metrics compacted (the
   loss curves' columns at every 10th step, the first and the last, as logged; each column's mean over
   every step and each loss term's mean share of the objective in ``metrics_summary.json``), and nothing
   else (no checkpoint, no log); ``restore_run`` gives back those files byte for byte, also from a folder
   kept before the JSON lines were compressed; a restored run kept again gives the same kept files (its
   summary copied, not recomputed from the compacted rows); an unfinished run (no ``eval.json``) is
   refused. Every run kept in the repository is in the compact form.
2. ``run_all`` with ``keep``: a run kept there is restored into the output folder and not trained (no
   process is started); a run finished in the output folder but not yet kept is kept; the run
   directories returned are the output folder's, as without ``keep``.
3. A kept copy interrupted before its ``eval.json`` is not taken for a finished run, and ``eval.json``
   is the last file copied.
4. A run trained by ``run_all`` (a stand-in process that leaves a finished run) is kept as it ends, with
   its ``run.json``: the checkout read once as it started, torch's version, the wall time by the clock,
   the threads and runs at a time; ``checkout`` against a real git repository (clean, untracked files,
   a tracked change, a folder inside another repository, no repository, a failing ``git status``); a
   record that cannot be read is left out with a warning.
"""

from __future__ import annotations

import calendar
import json
import lzma
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
SUMMARY = '{\n "steps": 1,\n "kept_every": 10,\n "mean": {\n  "ce": 2.0,\n  "ntl": 0.5\n }\n}\n'
KEPT = {**SMALL, "metrics_summary.json": SUMMARY}
"""What keeping SMALL's run keeps, as restored (its one metrics row as it is, and the summary of it)."""


def _finished_run(path: Path) -> None:
    for name, text in {**SMALL, **LARGE}.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)


def _files(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def _kept(path: Path) -> dict[str, str]:
    """A kept folder's files as the run wrote them (``X.jsonl.xz`` read back as ``X.jsonl``); a plain
    ``*.jsonl`` there fails (not the kept form)."""
    files = {str(p.relative_to(path)): p for p in sorted(path.rglob("*")) if p.is_file()}
    assert not [n for n in files if n.endswith(".jsonl")], f"plain JSON lines kept: {sorted(files)}"
    return {n.removesuffix(".xz"): lzma.decompress(p.read_bytes()).decode() if n.endswith(".xz") else p.read_text()
            for n, p in files.items()}  # fmt: skip


def test_keep_copies_the_small_files_only_with_json_lines_compressed_and_metrics_compacted(tmp_path):
    run, kept = tmp_path / "run", tmp_path / "kept"
    _finished_run(run)
    logged = [{"step": i, "ce": 1 / i, "ntl": 0.5 / i, "lr": 1e-3, "mfu": None, "baseline": 2 / i, "objective": 4 / i}
              for i in range(1, 2001)]  # fmt: skip
    logged[-1] |= {"eval/ce": 9.0}  # an evaluation row: not a training column, left out of the means
    full = "".join(json.dumps(r) + "\n" for r in logged)
    (run / "metrics.jsonl").write_text(full)  # a real run's length
    study.keep_run(str(run), str(kept))
    names = sorted(p.name for p in kept.iterdir())
    assert names == sorted(n + ".xz" if n.endswith(".jsonl") else n for n in KEPT)
    curve = "".join(
        json.dumps({k: r[k] for k in ("step", "ce", "ntl")}) + "\n"
        for r in logged
        if r["step"] == 1 or r["step"] % 10 == 0
    )  # the last, 2000, among them
    small = {**SMALL, "metrics.jsonl": curve}
    for name in (n for n in names if n.endswith(".xz")):  # read back by the xz program, not by lzma
        text = subprocess.run(["xz", "-dc", str(kept / name)], capture_output=True, check=True).stdout.decode()
        assert text == small[name.removesuffix(".xz")]
    summary = json.loads((kept / "metrics_summary.json").read_text())
    means = {k: sum(r[k] for r in logged) / 2000 for k in ("ce", "ntl", "lr", "baseline", "objective")}
    assert summary["steps"] == 2000 and summary["kept_every"] == 10 and summary["mean"] == pytest.approx(means)
    assert list(summary["mean"]) == list(means)  # numbers only (no mfu), no eval/ column
    assert summary["mean_over_objective"] == pytest.approx({"ce": 0.25, "ntl": 0.125, "baseline": 0.5})
    assert (kept / "metrics.jsonl.xz").stat().st_size * 50 < len(full)
    restored = tmp_path / "restored"
    assert study.restore_run(str(kept), str(restored))
    assert _files(restored) == {**small, "metrics_summary.json": (kept / "metrics_summary.json").read_text()}
    again = tmp_path / "again"  # a restored run kept again: the same files (the summary of every step, copied)
    study.keep_run(str(restored), str(again))
    assert {p.name: p.read_bytes() for p in again.iterdir()} == {p.name: p.read_bytes() for p in kept.iterdir()}


def test_a_run_kept_before_compression_is_restored_as_it_is(tmp_path):
    old = tmp_path / "old"  # a kept folder of the plain layout (before 2026-11-27)
    old.mkdir()
    for name, text in SMALL.items():
        (old / name).write_text(text)
    assert study.restore_run(str(old), str(tmp_path / "restored"))
    assert _files(tmp_path / "restored") == SMALL


def test_the_runs_kept_in_the_repository_are_compressed_and_compact():
    runs = sorted(p.parent for p in (ROOT / "experiments" / "finished_runs").glob("*/*/seed*/eval.json"))
    assert len(runs) >= 136
    for run in runs:
        names = {p.name for p in run.iterdir()}
        assert not any(n.endswith(".jsonl") for n in names), f"{run}: plain JSON lines ({sorted(names)})"
        assert {"config.json", "metrics.jsonl.xz", "metrics_summary.json"} <= names, run
        steps = json.loads((run / "config.json").read_text())["train"]["steps"]
        rows = [json.loads(line) for line in lzma.decompress((run / "metrics.jsonl.xz").read_bytes()).splitlines()]
        assert [r["step"] for r in rows] == sorted({1, steps, *range(10, steps + 1, 10)}), run
        assert all(set(r) <= {"step", "ce", "ntl"} for r in rows), run
        assert json.loads((run / "metrics_summary.json").read_text())["steps"] == steps, run


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
        assert _files(out / arm / "seed0") == KEPT  # restored
        assert _kept(keep / arm / "seed1") == KEPT  # kept now
        assert _files(out / arm / "seed1") == {**SMALL, **LARGE}  # the finished run itself untouched


def test_a_run_trained_here_is_kept_as_it_ends(tmp_path, monkeypatch):
    preset = {"base_config": "configs/train/tiny_cpu.yaml", "seeds": [0], "arms": {"CE": []}}
    out, keep = tmp_path / "out", tmp_path / "keep"
    started = []
    checkouts = []  # the checkout is read once, as the run starts: a commit made during the run is not its own
    monkeypatch.setattr(study, "checkout", lambda: checkouts.append(1) or {"commit": f"read{len(checkouts)}",
                                                                              "dirty": False})  # fmt: skip
    monkeypatch.setenv("OMP_NUM_THREADS", "3")

    class FinishedRun:  # a "training" that runs for one poll, leaves a finished run in its run_dir, exits 0
        def __init__(self, command, **kwargs):
            run_dir = Path(next(a for a in command if a.startswith("run_dir=")).split("=", 1)[1])
            _finished_run(run_dir)
            started.append(run_dir)
            self.polls = 0

        def poll(self):
            self.polls += 1
            return None if self.polls == 1 else 0  # the reaper waits a second in between

    monkeypatch.setattr(study.subprocess, "Popen", FinishedRun)
    before = time.time()
    study.run_all(preset, str(out), str(keep))
    after = time.time()
    assert started == [out / "ce" / "seed0"]
    kept = _kept(keep / "ce" / "seed0")
    record = json.loads(kept.pop("run.json"))
    assert kept == KEPT and not (out / "ce" / "seed0" / "run.json.tmp").exists()
    # its run.json, against torch and the clock read here
    assert (record["commit"], record["dirty"], len(checkouts)) == ("read1", False, 1)
    assert record["torch"] == torch.__version__ and (record["threads_per_run"], record["runs_at_a_time"]) == (3, 1)
    begun, ended = (
        calendar.timegm(time.strptime(record[k], "%Y-%m-%dT%H:%M:%SZ")) for k in ("started_utc", "ended_utc")
    )
    assert before - 1 <= begun <= ended <= after and 1.0 <= record["seconds"] <= after - before + 0.1
    assert abs((ended - begun) - record["seconds"]) <= 1.0
    line = study.provenance_line(
        study.read_provenance({"CE": [str(out / "ce" / "seed0")], "CE + NTL": [str(tmp_path)]})
    )
    assert line.startswith("Provenance (1 of 2 runs have a `run.json`): commit read1; torch ")
    assert record["started_utc"][:10] in line


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_checkout_reads_commit_and_tracked_changes_of_this_checkout_only(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "tracked.py").write_text("a = 1\n")
    _git(repo, "add", "tracked.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(study, "ROOT", str(repo))
    assert study.checkout() == {"commit": head, "dirty": False}
    (repo / "untracked.txt").write_text("new kept runs\n")  # untracked files (new runs) are not changes
    assert study.checkout() == {"commit": head, "dirty": False}
    (repo / "tracked.py").write_text("a = 2\n")
    assert study.checkout() == {"commit": head, "dirty": True}
    monkeypatch.setattr(study, "ROOT", str(repo / "sub"))  # a folder inside someone else's repository
    assert study.checkout() == {"commit": None, "dirty": None}
    monkeypatch.setattr(study, "ROOT", str(tmp_path / "plain"))
    (tmp_path / "plain").mkdir()
    assert study.checkout() == {"commit": None, "dirty": None}
    monkeypatch.setattr(study, "ROOT", str(repo))
    real_run = subprocess.run

    def status_fails(command, **kwargs):
        if "status" in command:
            return subprocess.CompletedProcess(command, 128, "", "fatal: index.lock")
        return real_run(command, **kwargs)

    monkeypatch.setattr(study.subprocess, "run", status_fails)
    assert study.checkout() == {"commit": head, "dirty": None}  # unknown, not clean


def test_an_unreadable_run_record_is_left_out_with_a_warning(tmp_path, capsys):
    runs = {}
    for name, text in (("truncated", '{"commit": "ab'), ("partial", '{"commit": "abc"}'), ("none", None)):
        (tmp_path / name).mkdir()
        if text is not None:
            (tmp_path / name / "run.json").write_text(text)
        runs[name] = [str(tmp_path / name)]
    assert study.read_provenance(runs) == {"truncated": [None], "partial": [None], "none": [None]}
    warned = capsys.readouterr().out
    assert warned.count("is not a run record") == 2 and "no dirty, started_utc" in warned
    assert study.provenance_line(study.read_provenance(runs)).startswith("Provenance: none of the 3 runs")


def test_eval_json_is_copied_last(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _finished_run(run)
    written = []  # every file that appears under its final name, in order (copied, or renamed into place)
    real_copy, real_replace = shutil.copyfile, study.os.replace

    def recording_copy(src, dst, *args, **kwargs):
        written.append(Path(dst).name)
        return real_copy(src, dst, *args, **kwargs)

    def recording_replace(src, dst):
        written.append(Path(dst).name)
        return real_replace(src, dst)

    monkeypatch.setattr(shutil, "copyfile", recording_copy)
    monkeypatch.setattr(study.os, "replace", recording_replace)
    study.keep_run(str(run), str(tmp_path / "kept"))
    assert sorted(written) == sorted(n + ".xz" if n.endswith(".jsonl") else n for n in KEPT)
    assert written[-1] == "eval.json"
    written.clear()
    study.restore_run(str(tmp_path / "kept"), str(tmp_path / "restored"))
    assert sorted(written) == sorted(KEPT) and written[-1] == "eval.json"
