"""experiments/study.py with ``data_seed: with_seed``: the data varies with the seed (issue 42).

A preset whose corpus is built per seed: each seed's corpus (experiments/pretrain_corpus.py, tiny) must
hold other training text and other held-out questions, each run's command must train on its own seed's
corpus in the order of ``data.seed=<seed>``, and the held-out groups are read from each run's own
manifest. Checked against the corpus files themselves, not against the study's bookkeeping.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.scripts import load_script

study = load_script("experiments/study.py", "study_data_seed_under_test")


def _preset(tmp_path: Path, **extra) -> Path:
    corpus = tmp_path / "corpus_d{data_seed}"
    preset = {
        "base_config": "configs/train/pretrain_study_cpu.yaml",
        "seeds": [0, 1, 2],
        "arms": {"CE": ["ntl.weight=0"], "CE + NTL-WAS": ["ntl.weight=0.3"]},
        "data_seed": "with_seed",
        "heldout_groups": f"{corpus}/manifest.json",
        "prepare": [
            f"python experiments/pretrain_corpus.py --seed {{data_seed}} --out {corpus} --number-documents 40 "
            "--prose-chars 20000 --questions 30 --heldout-sequences 8 --heldout-prose-sequences 4 "
            "--seq-length 64"
        ],
        "overrides": [f"data.train_path={corpus}/train.jsonl", f"data.eval_path={corpus}/questions.jsonl"],
        **extra,
    }
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump(preset))
    return path


def test_each_seed_trains_on_its_own_corpus_in_its_own_order(tmp_path):
    preset = study.load_preset(str(_preset(tmp_path)))
    assert len(study.prepare(preset)) == 3
    train, questions = [], []
    for seed in (0, 1, 2):
        folder = tmp_path / f"corpus_d{seed}"
        train.append(hashlib.sha256((folder / "train.jsonl").read_bytes()).hexdigest())
        questions.append(set((folder / "questions.jsonl").read_text().splitlines()))
        command = study.train_command(preset, str(tmp_path / "run"), ["ntl.weight=0"], seed)
        assert f"data.train_path={folder}/train.jsonl" in command
        assert f"data.eval_path={folder}/questions.jsonl" in command
        assert f"data.seed={seed}" in command and f"train.seed={seed}" in command
        assert not any("{data_seed}" in part for part in command)
    assert len(set(train)) == 3  # other training text at each seed
    assert all(len(questions[a] & questions[b]) < len(questions[a]) / 2 for a, b in ((0, 1), (0, 2), (1, 2)))
    # the held-out groups come from each run's own manifest (and must agree across the corpora)
    runs = {}
    for seed in (0, 1, 2):
        run = tmp_path / "runs" / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"data": {"seed": seed, "eval_sequences": 8},
                                                     "train": {"seq_length": 64}}))  # fmt: skip
        runs.setdefault("CE", []).append(str(run))
    manifest = json.loads((tmp_path / "corpus_d1" / "manifest.json").read_text())
    assert study._groups(preset, runs) == {k: tuple(v) for k, v in manifest["heldout"]["groups"].items()}
    manifest["heldout"]["groups"] = {"prose": [0, 3], "numbers": [3, 8]}
    (tmp_path / "corpus_d1" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit, match="place different groups"):
        study._groups(preset, runs)


def test_a_fixed_data_preset_keeps_the_base_data_seed(tmp_path):
    path = _preset(tmp_path, data_seed="fixed", prepare=[], overrides=[], heldout_groups={})
    command = study.train_command(study.load_preset(str(path)), "/tmp/run", [], 2)
    assert not any(part.startswith("data.seed=") for part in command)


@pytest.mark.parametrize(
    ("extra", "message"),
    [({"data_seed": "per_run"}, "data_seed must be 'fixed'"), ({"data_seed": "fixed"}, r"needs data_seed: with_seed")],
)
def test_bad_data_seed_settings_are_refused(tmp_path, extra, message):
    with pytest.raises(SystemExit, match=message):
        study.load_preset(str(_preset(tmp_path, **extra)))


def test_start_until_takes_a_clock_time_at_its_next_occurrence():
    with pytest.raises(SystemExit, match="expected HH:MM"):
        study._utc_next("25:00")
    assert study._utc_next("10:05") % 86400 == 10 * 3600 + 5 * 60
    now = calendar.timegm((2026, 11, 27, 23, 40, 0, 0, 0, 0))  # a study started at 23:40 UTC
    assert study._utc_next("23:50", now) == now + 10 * 60  # later today
    assert study._utc_next("00:30", now) == now + 50 * 60  # past midnight: tomorrow's, not today's (passed)
    assert study._utc_next("23:40", now) == now + 86400  # now counts as passed
    for text in ("00:00", "12:00", "23:39", "23:41"):
        assert 0 < study._utc_next(text, now) - now <= 86400, text
    # a moment is that moment, passed or not (size_sweep.py resolves HH:MM once and passes each size the moment)
    assert study._utc_next("2026-11-28T00:30", now) == now + 50 * 60
    assert study._utc_next("2026-11-27T23:00", now) == now - 40 * 60
    for bad in ("24:00", "12:60", "1200", "2026-11-27 23:00", "2026-11-27T"):
        with pytest.raises(SystemExit, match="expected HH:MM"):
            study._utc_next(bad, now)
    for bad in ("2026-13-01T10:00", "2026-02-30T10:00"):  # no such date: refused, never normalised to March
        with pytest.raises(SystemExit, match="no such date"):
            study._utc_next(bad, now)
    # the printed line says why a deadline is tomorrow's only when it is; and a passed moment starts nothing
    assert "tomorrow's was taken" in study._deadline_line("00:30", study._utc_next("00:30", now), now)
    morning = calendar.timegm((2026, 11, 28, 1, 0, 0, 0, 0, 0))
    line = study._deadline_line("23:00", study._utc_next("23:00", morning), morning)
    assert "in 22.0 h" in line and "tomorrow" not in line  # today's 23:00, 22 h away: no false reason
    assert "tomorrow" not in study._deadline_line("2026-11-28T00:30", now + 50 * 60, now)
    assert "no run will start" in study._deadline_line("2026-11-27T23:00", now - 40 * 60, now)


def test_no_run_tabulates_only_the_seeds_every_arm_finished(tmp_path):
    """A study under way: seed 0 done by both arms (one kept in the repository folder, one in the output),
    seed 1 by CE only; --no-run's runs are seed 0's, the kept one restored, and nothing is trained."""
    preset = {"seeds": [0, 1], "arms": {"CE": [], "CE + NTL-WAS": []}}
    keep, out = tmp_path / "keep", tmp_path / "out"
    for folder, arm, seed in ((keep, "ce", 0), (out, "ce_ntl_was", 0), (keep, "ce", 1)):
        run = folder / arm / f"seed{seed}"
        run.mkdir(parents=True)
        (run / "eval.json").write_text(json.dumps({"questions": {"accuracy": 0.5}}))
    runs = study.finished_runs(preset, str(out), str(keep))
    assert runs == {"CE": [str(out / "ce" / "seed0")], "CE + NTL-WAS": [str(out / "ce_ntl_was" / "seed0")]}
    assert (out / "ce" / "seed0" / "eval.json").is_file()  # restored from the kept folder
    with pytest.raises(SystemExit, match="no seed"):
        study.finished_runs({"seeds": [1], "arms": {"CE": [], "CE + NTL-WAS": []}}, str(tmp_path / "x"), str(keep))


def test_a_sweep_passes_every_size_the_one_deadline_it_resolved(tmp_path, monkeypatch):
    """size_sweep.py resolves ``--start-until HH:MM`` once and passes each size's study that moment, so a size
    started after the deadline does not read the same HH:MM as tomorrow's (it would run for up to a day)."""
    sweep_script = load_script("experiments/size_sweep.py", "size_sweep_deadline_under_test")
    preset = "configs/study/pretrain_ci.yaml"
    sweep = {
        "baseline": "CE",
        "arms": ["CE + NTL-WAS"],
        "sizes": [{"label": f"size {i}", "preset": preset, "out": str(tmp_path / f"s{i}")} for i in range(2)],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    calls: list[list[str]] = []

    class Stop(Exception):
        pass

    def fake_study(argv: list[str]) -> None:  # a size's study: its argv recorded, its results written
        calls.append(argv)
        if len(calls) == 2:
            raise Stop
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"results": {"CE": {}, "CE + NTL-WAS": {}}}))

    monkeypatch.setattr(sweep_script.study, "main", fake_study)
    clock = time.strftime("%H:%M", time.gmtime(time.time() + 3600))
    want = study._utc_next(clock)
    with pytest.raises(Stop):
        sweep_script.main(["--sweep", str(path), "--out", str(tmp_path / "out"), "--start-until", clock])
    moments = [argv[argv.index("--start-until") + 1] for argv in calls]
    assert len(moments) == 2 and moments[0] == moments[1], moments
    # read by the second size's study a minute after the deadline: still that deadline, not tomorrow's
    assert study._utc_next(moments[1], now=want + 60) == want
