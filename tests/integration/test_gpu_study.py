"""The GPU study end to end at CPU size: launch/slurm/gpu_study.sbatch as a Slurm array on a local cluster.

configs/gpu_study/ci.yaml (one tiny Llama-style size, CE and CE + 0.3 NTL-WAS, one seed, 5 iterations)
on data built offline (tests/helpers/gpu_study_data.py: a Llama-3-style BPE, Megatron indexed corpora
of prose, number documents and code), trained and evaluated by the real Megatron-LM core_v0.19.0
``pretrain_gpt.py`` under ``launch/pretrain_gpt_ntl.py`` (CUDA-only calls redirected by
tests/helpers/megatron_lm_cpu.py, through ``--entry``), then tabulated by ``gpu_study.py collect``
(experiments/size_sweep.py's analysis).

Sections:
1. Dry run (no cluster): both phases' commands, the run folder of the task.
2. The array (2 tasks): each trains to the planned iteration, Megatron's own parameter count equals
   gpu_study.parameters', each evaluation has every held-out set with the number metrics (CE's too).
3. The tables: every difference in sweep.json equals the one computed here from the Megatron logs.
4. Resubmitting the finished array trains and evaluates nothing (checkpoints and eval.json untouched).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import gpu_study_data
from tests.helpers import megatron_lm as mlm
from tests.integration.test_slurm import FINISHED, slurm_env  # noqa: F401  (the module's local cluster)

pytestmark = [pytest.mark.distributed, pytest.mark.slurm]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "slurm" / "gpu_study.sbatch"
CONFIG = "configs/gpu_study/ci.yaml"
ENTRY = "tests/helpers/megatron_lm_cpu.py launch/pretrain_gpt_ntl.py"  # test-only CUDA redirections
sys.path.insert(0, str(ROOT / "experiments"))

import gpu_study  # noqa: E402


def test_dry_run_prints_both_phases_for_the_task(tmp_path):
    data = tmp_path / "data.yaml"
    data.write_text((ROOT / "configs" / "gpu_study" / "data.example.yaml").read_text())
    env = {**os.environ, "NTL_STUDY_DATA": str(data), "NTL_RUNS": str(tmp_path / "runs"), "NTL_TASK": "4",
           "NTL_PYTHON": sys.executable}  # fmt: skip
    for key in [k for k in env if k.startswith("SLURM_")]:
        env.pop(key)
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.count("srun --kill-on-bad-exit=1") == 2 and "# phase train" in text and "# phase eval" in text
    run_dir = tmp_path / "runs" / "gpu-study" / "25m" / "ce-ntl-was-0.1" / "seed1"  # task 4: 25M, second arm, seed 1
    assert f"--save {run_dir}/checkpoints" in text and "--exit-signal-handler" in text
    train, evaluation = text.split("# phase eval")
    assert "--skip-train" in evaluation and "--skip-train" not in train and "--ntl-weight 0.1" in train
    env.pop("NTL_STUDY_DATA")
    failed = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert failed.returncode == 2 and "NTL_STUDY_DATA='' is not a file" in failed.stderr


def _submit(env: dict, tmp: Path) -> str:
    cmd = ["sbatch", "--parsable", "--array=0-1", f"--output={tmp}/%x-%A_%a.out", "--gpus-per-node=0",
           "--ntasks-per-node=1", "--cpus-per-task=1", str(SCRIPT), "--config", CONFIG, "--entry", ENTRY]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _wait_array(env: dict, job: str, timeout: float = 600) -> dict[str, str]:
    """Waits until every task of array ``job`` has finished; each task's state."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True)
        states = {}
        for line in out.stdout.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            states[fields.get("ArrayTaskId", "?")] = fields.get("JobState", "?")
        if states and "?" not in states and all(s in FINISHED for s in states.values()):
            return states
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env, check=False)
    raise AssertionError(f"array {job} not finished after {timeout} s")


# Megatron's own lines, read here with patterns of this test (not gpu_study.py's)
SET_LOSS = re.compile(r"validation-(\w+) loss at .*? lm loss value: (\S+) ")
NTL = re.compile(r"validation \(ntl_scale\) \| ntl loss: (\S+) \| number accuracy: (\S+) ")
PARAMS = re.compile(r"number of parameters on \(tensor, .*?\): (\d+)")


def _megatron_metrics(log: str) -> dict[str, tuple[float, float, float]]:
    """{set: (lm loss, ntl loss, number accuracy)}: the NTL line precedes its set's loss line."""
    ntl = NTL.findall(log)
    sets = SET_LOSS.findall(log)
    assert len(ntl) == len(sets) == 3, log[-3000:]
    return {name: (float(loss), float(n), float(a)) for (name, loss), (n, a) in zip(sets, ntl)}


def test_array_trains_evaluates_and_tabulates_through_the_size_sweep_analysis(slurm_env, tmp_path):  # noqa: F811
    checkout = mlm.checkout(mlm.RELEASES[-1])
    data = gpu_study_data.build(tmp_path / "data")
    runs = tmp_path / "runs"
    env = {**slurm_env, **mlm._env(), "SLURM_CONF": slurm_env["SLURM_CONF"], "MEGATRON_LM_PATH": str(checkout),
           "NTL_PYTHON": sys.executable, "NTL_RUNS": str(runs), "NTL_STUDY_DATA": str(data)}  # fmt: skip
    job = _submit(env, tmp_path)
    states = _wait_array(env, job)
    logs = {task: (tmp_path / f"ntl-gpu-study-{job}_{task}.out") for task in ("0", "1")}
    for task, state in states.items():
        assert state == "COMPLETED", logs[task].read_text()[-5000:] if logs[task].exists() else state

    # 2. every task trained to the planned iteration and was evaluated on every held-out set
    study = gpu_study.load(str(ROOT / CONFIG))
    plan = gpu_study.budget(study, "tiny")
    total = gpu_study.parameters(study["sizes"]["tiny"], gpu_study.padded_vocab(study))["total"]
    measured = {}
    for t in gpu_study.tasks(study):
        run = runs / "gpu-study" / t.run_name
        assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(
            plan["iterations"]
        )
        eval_log = (run / "eval.log").read_text()
        assert [int(n) for n in PARAMS.findall(eval_log)] == [total]  # Megatron's count of the model it built
        assert f"iteration {plan['iterations']:>8}/" in logs[str(t.index)].read_text()
        measured[t.arm] = _megatron_metrics(eval_log)
        for loss, ntl, accuracy in measured[t.arm].values():
            assert math.isfinite(loss) and ntl > 0 and 0 <= accuracy <= 1  # CE's number metrics exist too
    assert measured["CE"] != measured["CE + NTL-WAS 0.3"]

    # 3. the tables: size_sweep's differences, recomputed here from the Megatron lines
    out = tmp_path / "tables"
    command = [sys.executable, "experiments/gpu_study.py", "collect", "--config", CONFIG, "--runs",
               str(runs / "gpu-study"), "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = json.loads((out / "sweep.json").read_text())
    cells = sweep["sizes"][0]["differences"]["CE + NTL-WAS 0.3"]
    ce, ntl = measured["CE"], measured["CE + NTL-WAS 0.3"]
    expected = {
        "prose_ppl": 100 * (math.exp(ntl["prose"][0]) - math.exp(ce["prose"][0])) / math.exp(ce["prose"][0]),
        "code_ppl": 100 * (math.exp(ntl["code"][0]) - math.exp(ce["code"][0])) / math.exp(ce["code"][0]),
        "numeric_ppl": 100 * (math.exp(ntl["numeric"][0]) - math.exp(ce["numeric"][0])) / math.exp(ce["numeric"][0]),
        "numeric_number_token_was": 100 * (ntl["numeric"][1] - ce["numeric"][1]) / ce["numeric"][1],
        "numeric_number_token_acc": 100 * (ntl["numeric"][2] - ce["numeric"][2]),
    }
    assert set(cells) == set(expected)
    for key, value in expected.items():
        assert cells[key]["seeds"] == [pytest.approx(value, rel=1e-9, abs=1e-9)], key
    assert sweep["sizes"][0]["parameters"] == plan["non_embedding"]
    assert (out / "size_sweep.png").stat().st_size > 0 and "prose perplexity" in (out / "sweep.md").read_text()

    # 4. resubmitted: nothing is trained or evaluated again
    stamps = {
        p: p.stat().st_mtime_ns for p in runs.rglob("*") if p.name in ("eval.json", "latest_checkpointed_iteration.txt")
    }
    again = _submit(env, tmp_path)
    assert set(_wait_array(env, again).values()) == {"COMPLETED"}
    for task in ("0", "1"):
        text = (tmp_path / f"ntl-gpu-study-{again}_{task}.out").read_text()
        assert "not training again" in text and "nothing to do" in text and "srun" not in text, text[-3000:]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps and len(stamps) == 4
