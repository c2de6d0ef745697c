"""The DeepMind mathematics data from DeepMind's own generator (``mathematics-dataset`` 1.0.1 in its own
environment, built by ``scripts/setup.sh --dev``), and ``launch/train.py`` training on it.

1. ``python launch/deepmind_data.py`` writes the released layout (train-easy/medium/hard,
   interpolate, extrapolate; one file per module, question/answer lines) and the arithmetic subset;
   the same seed gives the same bytes, another seed other questions; a rerun is a no-op and other
   settings for the same folder are refused.
2. ``launch/train.py`` trains on the folder and evaluates on its interpolate/extrapolate files; read as
   a stream, a run stopped at a checkpoint and resumed in a new process continues the uninterrupted run's
   curve. Its ``main()`` once per run (test_train_deepspeed.py's ``_mains``): the map-style run, the whole and
   the stopped stream in one process, the resumed run in a second; no ``FutureWarning`` on stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("deepspeed")

from launch.deepmind_data import ARITHMETIC_MODULES, default_venv, generate_deepmind
from ntl_scale.training.sources import SPLIT_FILES
from tests.integration.test_train_deepspeed import _mains

ROOT = Path(__file__).resolve().parents[2]
PER_MODULE, PER_TEST = 4, 3


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.txt"))}


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    if os.environ.get("CI") and not os.path.isfile(os.path.join(default_venv(), "bin", "python")):
        pytest.fail("the generator's environment is missing: scripts/setup.sh --dev builds it")
    out = tmp_path_factory.mktemp("deepmind") / "mathematics_dataset-v1.0"
    command = [sys.executable, "launch/deepmind_data.py", "--out", str(out), "--per-module", str(PER_MODULE),
               "--per-test-module", str(PER_TEST), "--seed", "7"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return out


def test_generator_writes_the_released_layout_deterministically(generated, tmp_path):
    out = generated
    for level in ("train-easy", "train-medium", "train-hard", "interpolate"):
        names = sorted(p.stem for p in (out / level).glob("*.txt"))
        assert names == sorted(ARITHMETIC_MODULES), level
    extrapolate = sorted(p.stem for p in (out / "extrapolate").glob("*.txt"))
    assert extrapolate == [
        "arithmetic__add_or_sub_big", "arithmetic__add_sub_multiple_longer", "arithmetic__div_big",
        "arithmetic__mixed_longer", "arithmetic__mul_big", "arithmetic__mul_div_multiple_longer",
    ]  # fmt: skip
    for path in out.rglob("*/*.txt"):
        lines = path.read_text().splitlines()
        count = PER_TEST if path.parent.name in ("interpolate", "extrapolate") else PER_MODULE
        assert len(lines) == 2 * count, path
        assert all(line.strip() for line in lines), path
    # the arithmetic subset holds exactly the generated arithmetic pairs
    train = (out / SPLIT_FILES["train"]).read_text().splitlines() + (out / SPLIT_FILES["val"]).read_text().splitlines()
    generated_pairs = []
    for level in ("train-easy", "train-medium", "train-hard"):
        for path in sorted((out / level).glob("arithmetic__*.txt")):
            lines = path.read_text().splitlines()
            generated_pairs += list(zip(lines[0::2], lines[1::2]))
    assert sorted(zip(train[0::2], train[1::2])) == sorted(generated_pairs)
    interpolate = (out / SPLIT_FILES["interpolate"]).read_text().splitlines()
    assert len(interpolate) == 2 * PER_TEST * len(ARITHMETIC_MODULES)
    # same seed: same bytes; another seed: other questions; rerun: no-op; other settings: refused
    same = generate_deepmind(str(tmp_path / "same"), per_module=PER_MODULE, per_test_module=PER_TEST, seed=7)
    assert _files(tmp_path / "same") == _files(out)
    assert generate_deepmind(str(out), per_module=PER_MODULE, per_test_module=PER_TEST, seed=7) == same
    generate_deepmind(str(tmp_path / "other"), per_module=PER_MODULE, per_test_module=PER_TEST, seed=8)
    assert _files(tmp_path / "other") != _files(out)
    with pytest.raises(ValueError, match="already exists with other settings"):
        generate_deepmind(str(out), per_module=PER_MODULE + 1, per_test_module=PER_TEST, seed=7)
    with pytest.raises(ValueError, match=r"unknown module\(s\) \['arithmetic__nope'\]"):
        generate_deepmind(str(tmp_path / "bad"), modules=["arithmetic__nope"], per_module=1)
    assert not (tmp_path / "bad").exists()


def _run(run_dir: Path, data: Path, *overrides: str) -> list[str]:
    """``launch/train.py``'s overrides for a run of the tiny GPT-2 on the folder ``data``."""
    return [
        f"run_dir={run_dir}", "data.source=deepmind", f"data.train_path={data}", f"data.cache_dir={run_dir / 'hf'}",
        "data.max_length=200", "train.micro_batch_size=4", "tracking.wandb=disabled", "tracking.plot=false",
        "model.architecture={model_type: gpt2, n_embd: 32, n_layer: 1, n_head: 2, n_positions: 256, resid_pdrop: 0, "
        "embd_pdrop: 0, attn_pdrop: 0}", *overrides,
    ]  # fmt: skip


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_reads_the_layout_and_a_stream_resumes_exactly(generated, tmp_path):
    run, parted = tmp_path / "map", tmp_path / "parted"
    # streaming: 6 steps straight vs 3 steps, a checkpoint, and 3 more in a new process
    stream = ("data.streaming=true", "data.shuffle_buffer=8", "eval.at_end=false")
    ran = _mains(tmp_path, {
        "map": _run(run, generated, "train.steps=2", "data.eval_examples=3", "eval.max_new_tokens=4"),
        "whole": _run(tmp_path / "whole", generated, *stream, "train.steps=6"),
        "parted": _run(parted, generated, *stream, "train.steps=3"),
    })  # fmt: skip
    assert all(case["error"] is None for case in ran.values()), ran
    evals = json.loads((run / "eval.json").read_text())
    assert set(evals) == {"interpolate", "extrapolate"}
    asked = [json.loads(line)["question"] for line in (run / "predictions_interpolate.jsonl").read_text().splitlines()]
    assert asked == (generated / SPLIT_FILES["interpolate"]).read_text().splitlines()[0:6:2]
    assert "held-out questions" in ran["map"]["stdout"] and "FutureWarning" not in ran["map"]["stderr"]
    resumed = _mains(tmp_path, {"resumed": _run(parted, generated, *stream, "train.steps=6")})["resumed"]
    assert resumed["error"] is None, resumed
    assert "resumed from step 3" in resumed["stdout"]
    whole, parts = _metrics(tmp_path / "whole"), _metrics(parted)
    assert [r["step"] for r in parts] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(whole, parts):
        assert x["tokens"] == y["tokens"]  # the same rows ...
        for key in ("ce", "ntl", "grad_norm"):  # ... and the same training
            assert abs(x[key] - y[key]) <= 1e-6 * max(1.0, abs(x[key])), (key, x, y)
