"""The GPU study end to end at CPU size: launch/slurm/gpu_study.sbatch as a Slurm array on a local cluster.

configs/gpu_study/ci.yaml (one tiny Llama-style size, CE and CE + 0.3 NTL-WAS, 2 seeds, 5 iterations)
on data built offline (tests/helpers/gpu_study_data.py: a Llama-3-style BPE, Megatron indexed corpora
of prose, number documents and code), trained and evaluated by the real Megatron-LM core_v0.19.0
``pretrain_gpt.py`` under ``launch/pretrain_gpt_ntl.py`` (CUDA-only calls redirected by
tests/helpers/megatron_lm_cpu.py, through ``--entry``), each last checkpoint scored by
lm-evaluation-harness's own Megatron-LM backend (the same redirections, through ``NTL_HARNESS_ENTRY``),
then the pilot's power step, the main stage and ``gpu_study.py collect`` (experiments/size_sweep.py's
analysis and the verdict rule).

Sections:
1. Dry run (no cluster): the three phases' commands, the run folder of the task.
2. The pilot array (4 tasks): each trains to the planned iteration, Megatron's own parameter count equals
   gpu_study.parameters', each evaluation has every held-out set with the number metrics (CE's too), each
   run has the harness's results.
3. The power step: the main stage's seeds from the pilot's sd, written to a study file.
4. The main stage's array is the pilot's runs: it trains, evaluates and scores nothing (files untouched).
5. The tables: every difference in sweep.json, the harness's too, equals the one computed here from the
   Megatron logs and the harness's results files; the verdict rule's table is there.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
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
    env = {**os.environ, "NTL_STUDY_DATA": str(data), "NTL_RUNS": str(tmp_path / "runs"), "NTL_TASK": "9",
           "NTL_PYTHON": sys.executable}  # fmt: skip
    for key in [k for k in env if k.startswith("SLURM_")]:
        env.pop(key)
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.count("srun --kill-on-bad-exit=1") == 3 and "# phase train" in text and "# phase eval" in text
    run_dir = tmp_path / "runs" / "gpu-study" / "25m" / "ce-ntl-was-1.0" / "seed1"  # pilot task 9: 25M, NTL, seed 1
    assert f"--save {run_dir}/checkpoints" in text and "--exit-signal-handler" in text
    train, evaluation = text.split("# phase eval")
    evaluation, harness = evaluation.split("# phase harness")
    assert "--skip-train" in evaluation and "--skip-train" not in train and "--ntl-weight 1.0" in train
    assert "-m lm_eval --model megatron_lm" in harness and f"load={run_dir}/checkpoints" in harness
    env.pop("NTL_STUDY_DATA")
    failed = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert failed.returncode == 2 and "NTL_STUDY_DATA='' is not a file" in failed.stderr


def _submit(env: dict, tmp: Path, config: str = CONFIG) -> str:
    cmd = ["sbatch", "--parsable", "--array=0-3", f"--output={tmp}/%x-%A_%a.out", "--gpus-per-node=0",
           "--ntasks-per-node=1", "--cpus-per-task=1", str(SCRIPT), "--config", config, "--entry", ENTRY]  # fmt: skip
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


def _harness_metrics(run: Path) -> dict[str, float]:
    """The harness's results file of a run, read here: the arithmetic mean relative error and exact match, the
    per-byte perplexity of the held-out sets' text and number spans."""
    (report,) = run.glob("harness/**/results_*.json")
    found = json.loads(report.read_text())["results"]
    out = {
        "arith_rel_error": statistics.fmean(found[f"ntl_arith_{op}"]["rel_error,none"] for op in ("add", "sub", "mul")),
        "arith_exact_match": statistics.fmean(
            found[f"ntl_arith_{op}"]["exact_match,none"] for op in ("add", "sub", "mul", "cmp")
        ),
    }
    for name in ("prose", "code", "math"):
        for kind in ("text", "number"):
            bits = found[f"ntl_study_{name}_split"].get(f"{kind}_bits_per_byte,none")
            if bits is not None:
                out[f"{name}_{kind}_byte_ppl"] = 2.0**bits
    return out


def test_array_trains_evaluates_and_tabulates_through_the_size_sweep_analysis(slurm_env, tmp_path):  # noqa: F811
    checkout = mlm.checkout(mlm.RELEASES[-1])
    data = gpu_study_data.build(tmp_path / "data")
    runs = tmp_path / "runs"
    lm_eval_main = subprocess.run([sys.executable, "-c", "import lm_eval.__main__ as m; print(m.__file__)"],
                                  capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    env = {**slurm_env, **mlm._env(), "SLURM_CONF": slurm_env["SLURM_CONF"], "MEGATRON_LM_PATH": str(checkout),
           "NTL_PYTHON": sys.executable, "NTL_RUNS": str(runs), "NTL_STUDY_DATA": str(data),
           "NTL_HARNESS_ENTRY": f"tests/helpers/megatron_lm_cpu.py {lm_eval_main}",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    job = _submit(env, tmp_path)
    states = _wait_array(env, job, timeout=3000)
    logs = {task: (tmp_path / f"ntl-gpu-study-{job}_{task}.out") for task in ("0", "1", "2", "3")}
    for task, state in states.items():
        assert state == "COMPLETED", logs[task].read_text()[-5000:] if logs[task].exists() else state

    # 2. every pilot task trained to the planned iteration, was evaluated on every held-out set, was scored
    study = gpu_study.load(str(ROOT / CONFIG))
    plan = gpu_study.budget(study, "tiny")
    total = gpu_study.parameters(study["sizes"]["tiny"], gpu_study.padded_vocab(study))["total"]
    measured: dict[tuple[str, int], dict] = {}
    scored: dict[tuple[str, int], dict] = {}
    for t in gpu_study.tasks(study, "pilot"):
        run = runs / "gpu-study" / t.run_name
        assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(
            plan["iterations"]
        )
        eval_log = (run / "eval.log").read_text()
        assert [int(n) for n in PARAMS.findall(eval_log)] == [total]  # Megatron's count of the model it built
        assert f"iteration {plan['iterations']:>8}/" in logs[str(t.index)].read_text()
        measured[t.arm, t.seed] = _megatron_metrics(eval_log)
        for loss, ntl, accuracy in measured[t.arm, t.seed].values():
            assert math.isfinite(loss) and ntl > 0 and 0 <= accuracy <= 1  # CE's number metrics exist too
        scored[t.arm, t.seed] = _harness_metrics(run)
        assert 0 <= scored[t.arm, t.seed]["arith_exact_match"] <= 1 and "math_number_byte_ppl" in scored[t.arm, t.seed]
    arm = "CE + NTL-WAS 0.3"
    assert measured["CE", 0] != measured[arm, 0] and measured["CE", 0] != measured["CE", 1]

    # 3. the power step: seeds for the main stage from the pilot's sd (CI caps them at the pilot's 2)
    main = tmp_path / "main.yaml"
    command = [sys.executable, "experiments/gpu_study.py", "seeds", "--config", CONFIG, "--runs",
               str(runs / "gpu-study"), "--write", str(main)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ce_prose = [math.exp(measured["CE", s]["prose"][0]) for s in (0, 1)]
    diffs = [100 * (math.exp(measured[arm, s]["prose"][0]) - ce_prose[s]) / statistics.fmean(ce_prose) for s in (0, 1)]
    printed = re.search(r"pilot tiny prose_ppl: sd (\S+) over 2 seed pairs", done.stdout)
    assert printed and float(printed.group(1)) == pytest.approx(statistics.stdev(diffs), rel=1e-3), done.stdout
    assert gpu_study.load(str(main))["stages"]["main"]["seeds"] == {"tiny": 2}

    # 4. the main stage's runs are the pilot's: nothing is trained, evaluated or scored again
    stamps = {
        p: p.stat().st_mtime_ns
        for p in runs.rglob("*")
        if p.name in ("eval.json", "harness.json", "latest_checkpointed_iteration.txt")
    }
    again = _submit({**env, "NTL_STAGE": "main"}, tmp_path, str(main))
    assert set(_wait_array(env, again).values()) == {"COMPLETED"}
    for task in ("0", "1", "2", "3"):
        text = (tmp_path / f"ntl-gpu-study-{again}_{task}.out").read_text()
        assert "not training again" in text and "nothing to do" in text and "srun" not in text, text[-3000:]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps and len(stamps) == 12

    # 5. the tables: size_sweep's differences, recomputed here from the Megatron lines and the harness's files
    out = tmp_path / "tables"
    command = [sys.executable, "experiments/gpu_study.py", "collect", "--config", str(main), "--stage", "main",
               "--runs", str(runs / "gpu-study"), "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = json.loads((out / "sweep.json").read_text())
    cells = sweep["sizes"][0]["differences"][arm]

    def relative(values: dict, key) -> list[float]:
        base = statistics.fmean(key(values["CE", s]) for s in (0, 1))
        return [100 * (key(values[arm, s]) - key(values["CE", s])) / base for s in (0, 1)]

    expected = {
        "prose_ppl": relative(measured, lambda m: math.exp(m["prose"][0])),
        "code_ppl": relative(measured, lambda m: math.exp(m["code"][0])),
        "math_number_token_was": relative(measured, lambda m: m["math"][1]),
        "math_number_token_acc": [100 * (measured[arm, s]["math"][2] - measured["CE", s]["math"][2]) for s in (0, 1)],
        "prose_text_byte_ppl": relative(scored, lambda m: m["prose_text_byte_ppl"]),
        "code_text_byte_ppl": relative(scored, lambda m: m["code_text_byte_ppl"]),
        "math_number_byte_ppl": relative(scored, lambda m: m["math_number_byte_ppl"]),
        "arith_exact_match": [100 * (scored[arm, s]["arith_exact_match"] - scored["CE", s]["arith_exact_match"])
                              for s in (0, 1)],
    }  # fmt: skip
    if all(math.isfinite(scored[k]["arith_rel_error"]) for k in scored):  # NaN where no answer parsed
        expected["arith_rel_error"] = relative(scored, lambda m: m["arith_rel_error"])
    for key, value in expected.items():
        assert cells[key]["seeds"] == pytest.approx(value, rel=1e-9, abs=1e-9), key
    assert sweep["sizes"][0]["parameters"] == total
    assert [v["size"] for v in sweep["verdicts"]] == ["tiny"]
    assert sweep["verdicts"][0]["verdict"] in ("adopt", "do not adopt", "trade-off", "not decided at this scale")
    text = (out / "sweep.md").read_text()
    assert (out / "size_sweep.png").stat().st_size > 0 and "prose perplexity" in text and "Verdict rule" in text
