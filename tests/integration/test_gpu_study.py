"""The GPU study end to end at CPU size: one `gpu_study_submit.py` on a local Slurm cluster.

configs/gpu_study/ci.yaml (one tiny Llama-style size, CE and CE + 0.3 NTL-WAS, 2 seeds, 5 iterations)
on data built offline (tests/helpers/gpu_study_data.py: a Llama-3-style BPE, Megatron indexed corpora
of prose, number documents and code), trained and evaluated by the real Megatron-LM core_v0.19.0
``pretrain_gpt.py`` under ``launch/pretrain_gpt_ntl.py`` (CUDA-only calls redirected by
tests/helpers/megatron_lm_cpu.py, through ``--entry``), each last checkpoint scored by
lm-evaluation-harness's own Megatron-LM backend (the same redirections, through ``NTL_HARNESS_ENTRY``).
One command submits the pilot array (launch/slurm/gpu_study.sbatch) and the job after it
(launch/slurm/gpu_study_next.sbatch): the power step, the main stage (its runs are the pilot's: nothing
new to run in CI), ``collect`` (experiments/size_sweep.py's analysis and the verdict rule).

Sections:
1. Dry run (no cluster): the three phases' commands, the run folder of the task.
2. The one command: the next job waits for the whole array (its dependency); the command again submits
   nothing while the chain is queued; a task whose evaluation fails stops the chain, named. It fails before
   its launch (the script cannot clear its eval.log), so every phase of every task launches once: 12
   Megatron-LM starts (4 trainings, 4 evaluations, 4 harness runs), the least the tables need.
3. The same command as one driver job after the fix: that task alone, from its evaluation; each pilot
   task trained to the planned iteration, Megatron's own parameter count equals gpu_study.parameters',
   each evaluation has every held-out set with the number metrics (CE's too), each run has the
   harness's results.
4. The power step after the pilot: the sd it prints is the one computed here from the pilot's logs.
5. The tables: every difference in sweep.json, the harness's too, equals the one computed here from the
   Megatron logs and the harness's results files; the verdict rule's table is there.
6. The command once more: done, nothing submitted, nothing rewritten.
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
import yaml

from tests.helpers import gpu_study_data
from tests.helpers import megatron_lm as mlm
from tests.integration.test_slurm import _job_state, slurm_env  # noqa: F401  (the module's local cluster)

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


def _wait_chain(env: dict, runs: Path, timeout: float, jobs: int = 0) -> dict:
    """Waits until the chain's record (RUNS/submit.json) lists more than ``jobs`` jobs and says done or stopped,
    and no job is left on the cluster (this module's own); fails early once none is left while it says neither."""
    deadline, idle = time.time() + timeout, 0
    while time.time() < deadline:
        state = json.loads((runs / "submit.json").read_text())
        queue = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip()
        if state.get("status") in ("done", "stopped") and len(state["jobs"]) > jobs and not queue:
            return state  # and the job that said so has ended
        idle = 0 if queue else idle + 1
        if idle > 10:  # 5 s without a job
            logs = "\n".join(p.read_text()[-3000:] for p in sorted((runs / "logs").glob("*next*.out")))
            raise AssertionError(f"no job queued and the chain says {state.get('status')!r}:\n{logs}")
        time.sleep(0.5)
    subprocess.run(["scancel", *(j["id"] for j in state["jobs"])], env=env, check=False)
    raise AssertionError(f"the chain not finished after {timeout} s: {state}")


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


def test_one_command_runs_pilot_power_main_and_tables_through_slurm_dependencies(slurm_env, tmp_path):  # noqa: F811
    checkout = mlm.checkout(mlm.RELEASES[-1])
    data = gpu_study_data.build(tmp_path / "data")
    site = yaml.safe_load(data.read_text())  # the site's sbatch options: one CPU per task on the test cluster
    site["slurm"] = {"array": ["--gpus-per-node=0", "--ntasks-per-node=1", "--cpus-per-task=1"],
                     "step": ["--cpus-per-task=1"]}  # fmt: skip
    data.write_text(yaml.safe_dump(site))
    runs = tmp_path / "runs"
    lm_eval_main = subprocess.run([sys.executable, "-c", "import lm_eval.__main__ as m; print(m.__file__)"],
                                  capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    env = {**slurm_env, **mlm._env(), "SLURM_CONF": slurm_env["SLURM_CONF"], "MEGATRON_LM_PATH": str(checkout),
           "NTL_PYTHON": sys.executable, "NTL_HARNESS_ENTRY": f"tests/helpers/megatron_lm_cpu.py {lm_eval_main}",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    args = ["--config", CONFIG, "--data", str(data), "--runs", str(runs), "--entry", ENTRY]
    submit = [sys.executable, "experiments/gpu_study_submit.py", *args]
    arm, seeds = "CE + NTL-WAS 0.3", (0, 1)
    runs_of = {(a, s): runs / "tiny" / gpu_study.slug(a) / f"seed{s}" for a in ("CE", arm) for s in seeds}
    broken = runs_of[arm, 1]  # task 3: its evaluation fails (eval.log is a folder: the script cannot clear it)
    (broken / "eval.log").mkdir(parents=True)
    first = subprocess.run(submit, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    pilot_job = re.search(r"stage pilot: array job (\d+), tasks 0-3 \(4 of 4 to run\)", first.stdout)
    next_job = re.search(r"then job (\d+), after array (\d+) ends", first.stdout)
    assert pilot_job and next_job and next_job.group(2) == pilot_job.group(1), first.stdout
    assert f"{runs}/tables/main/sweep.md" in first.stdout  # where the verdicts land
    # 2. the job after the pilot waits for every task of the array; the same command again submits nothing
    waiting = _job_state(env, next_job.group(1))
    assert waiting["Dependency"].startswith(f"afterany:{pilot_job.group(1)}_*"), waiting
    again = subprocess.run(submit, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already submitted, nothing submitted" in again.stdout, again.stdout + again.stderr
    recorded = [j["id"] for j in json.loads((runs / "submit.json").read_text())["jobs"]]
    assert recorded == [pilot_job.group(1), next_job.group(1)]
    # the job after the pilot finds task 3 unfinished: the chain stops and says which task, and why to look
    state = _wait_chain(env, runs, timeout=3000)
    logs = runs / "logs"
    assert state["status"] == "stopped", state
    assert "stage pilot: tasks 3 did not finish (tiny/ce-ntl-was-0.3/seed1)" in state["message"], state["message"]
    assert state["message"] in (logs / f"ntl-gpu-study-next-{next_job.group(1)}.out").read_text()
    assert not (runs / "study.seeds.yaml").exists() and not (runs / "tables").exists()

    # 3. fixed, the same command as one driver job (sbatch of the next job's script): task 3 alone, from its
    # evaluation (its training is kept); the job after it runs the power step, finds the main stage (the
    # pilot's runs) with nothing new to run, and writes its tables
    (broken / "eval.log").rmdir()
    trained = {p: p.stat().st_mtime_ns for p in (broken / "checkpoints").rglob("*") if p.is_file()}
    driver = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/driver-%j.out", "--cpus-per-task=1",
                             str(ROOT / "launch" / "slurm" / "gpu_study_next.sbatch"), *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert driver.returncode == 0, driver.stderr
    state = _wait_chain(env, runs, timeout=1500, jobs=2)
    assert state["status"] == "done", state.get("message")
    rerun = state["jobs"][2:]
    assert [(j["kind"], j.get("stage") or j["after"], j.get("tasks")) for j in rerun] == [
        ("array", "pilot", "3"), ("next", "pilot", None)]  # fmt: skip
    assert sorted(p.name for p in logs.glob(f"ntl-gpu-study-pilot-{rerun[0]['id']}_*.out")) == [
        f"ntl-gpu-study-pilot-{rerun[0]['id']}_3.out"]  # fmt: skip
    text = (logs / f"ntl-gpu-study-pilot-{rerun[0]['id']}_3.out").read_text()
    assert "task 3: trained" in text and "not training again" in text and "task 3: harness: " in text, text[-3000:]
    assert {p: p.stat().st_mtime_ns for p in trained} == trained and trained

    # every pilot run trained to the planned iteration, was evaluated on every held-out set, was scored
    study = gpu_study.load(str(ROOT / CONFIG))
    plan = gpu_study.budget(study, "tiny")
    total = gpu_study.parameters(study["sizes"]["tiny"], gpu_study.padded_vocab(study))["total"]
    measured: dict[tuple[str, int], dict] = {}
    scored: dict[tuple[str, int], dict] = {}
    for t in gpu_study.tasks(study, "pilot"):
        run = runs_of[t.arm, t.seed]
        assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(
            plan["iterations"]
        )
        eval_log = (run / "eval.log").read_text()
        assert [int(n) for n in PARAMS.findall(eval_log)] == [total]  # Megatron's count of the model it built
        text = (logs / f"ntl-gpu-study-pilot-{pilot_job.group(1)}_{t.index}.out").read_text()
        assert f"iteration {plan['iterations']:>8}/" in text
        measured[t.arm, t.seed] = _megatron_metrics(eval_log)
        for loss, ntl, accuracy in measured[t.arm, t.seed].values():
            assert math.isfinite(loss) and ntl > 0 and 0 <= accuracy <= 1  # CE's number metrics exist too
        scored[t.arm, t.seed] = _harness_metrics(run)
        assert 0 <= scored[t.arm, t.seed]["arith_exact_match"] <= 1 and "math_number_byte_ppl" in scored[t.arm, t.seed]
    assert measured["CE", 0] != measured[arm, 0] and measured["CE", 0] != measured["CE", 1]

    # 4. the power step ran after every pilot task had finished, on their files: the sd of the pilot's two
    # seed pairs computed here from the Megatron logs; the main stage (the pilot's runs) had nothing to run
    text = (logs / f"ntl-gpu-study-next-{rerun[1]['id']}.out").read_text()
    ce_prose = [math.exp(measured["CE", s]["prose"][0]) for s in seeds]
    diffs = [100 * (math.exp(measured[arm, s]["prose"][0]) - ce_prose[s]) / statistics.fmean(ce_prose) for s in seeds]
    printed = re.search(r"pilot tiny prose_ppl: sd (\S+) over 2 seed pairs", text)
    assert printed and float(printed.group(1)) == pytest.approx(statistics.stdev(diffs), rel=1e-3), text[-3000:]
    written = runs / "study.seeds.yaml"
    assert gpu_study.load(str(written))["stages"]["main"]["seeds"] == {"tiny": 2}  # CI caps them at the pilot's 2
    pilot_files = [run / n for run in runs_of.values() for n in ("eval.json", "harness.json")]
    assert max(p.stat().st_mtime for p in pilot_files) <= written.stat().st_mtime
    assert "stage main: finished; tables and verdicts" in text and "Verdict rule" in text

    # 5. the tables: size_sweep's differences, recomputed here from the Megatron lines and the harness's files
    sweep = json.loads((runs / "tables" / "main" / "sweep.json").read_text())
    cells = sweep["sizes"][0]["differences"][arm]

    def relative(values: dict, key) -> list[float]:
        base = statistics.fmean(key(values["CE", s]) for s in seeds)
        return [100 * (key(values[arm, s]) - key(values["CE", s])) / base for s in seeds]

    expected = {
        "prose_ppl": relative(measured, lambda m: math.exp(m["prose"][0])),
        "code_ppl": relative(measured, lambda m: math.exp(m["code"][0])),
        "math_number_token_was": relative(measured, lambda m: m["math"][1]),
        "math_number_token_acc": [100 * (measured[arm, s]["math"][2] - measured["CE", s]["math"][2]) for s in seeds],
        "prose_text_byte_ppl": relative(scored, lambda m: m["prose_text_byte_ppl"]),
        "code_text_byte_ppl": relative(scored, lambda m: m["code_text_byte_ppl"]),
        "math_number_byte_ppl": relative(scored, lambda m: m["math_number_byte_ppl"]),
        "arith_exact_match": [100 * (scored[arm, s]["arith_exact_match"] - scored["CE", s]["arith_exact_match"])
                              for s in seeds],
    }  # fmt: skip
    if all(math.isfinite(scored[k]["arith_rel_error"]) for k in scored):  # NaN where no answer parsed
        expected["arith_rel_error"] = relative(scored, lambda m: m["arith_rel_error"])
    for key, value in expected.items():
        assert cells[key]["seeds"] == pytest.approx(value, rel=1e-9, abs=1e-9), key
    assert sweep["sizes"][0]["parameters"] == total
    assert [v["size"] for v in sweep["verdicts"]] == ["tiny"]
    assert sweep["verdicts"][0]["verdict"] in ("adopt", "do not adopt", "trade-off", "not decided at this scale")
    table = (runs / "tables" / "main" / "sweep.md").read_text()
    assert "prose perplexity" in table and "Verdict rule" in table
    assert (runs / "tables" / "main" / "size_sweep.png").stat().st_size > 0

    # 6. the command once more: every stage is finished and tabulated; nothing is submitted or rewritten
    stamps = {p: p.stat().st_mtime_ns for p in runs.rglob("*") if p.is_file() and p.name != "submit.json"}
    done = subprocess.run(submit, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "the study is done" in done.stdout, done.stdout + done.stderr
    assert len(json.loads((runs / "submit.json").read_text())["jobs"]) == 4
    assert subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip() == ""
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
