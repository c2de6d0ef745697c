"""The Slurm batch scripts on a real one-node Slurm cluster (slurmctld + slurmd + munge on loopback).

Sections:
1. Static: shellcheck, --help, dry runs for 1 and 4 nodes (no cluster needed).
2. ``sbatch launch/slurm/deepspeed.sbatch``: tiny ZeRO-3 run, 2 processes, warned mid-run (section 5);
   checkpoints, logs, resolved config, command and environment end up in the run directory.
3. ``sbatch launch/slurm/megatron.sbatch``: the megatron.core example at TP=2 with NTL (checkpoints of
   both tensor-parallel ranks), and its default entry, launch/pretrain_gpt_ntl.py, on Megatron-LM
   core_v0.19.0 in one task (2 iterations).
4. Two nodes: a second local cluster whose two slurmd run in their own network and UTS namespaces;
   the DeepSpeed job runs the tensor-parallel config with 2 ranks on each (TP 2 inside a node, DP 2
   across nodes) and they rendezvous over that network.
5. Preemption: the time-limit warning (USR1 to the batch shell, as ``--signal=B:USR1@300`` sends it)
   mid-run in section 2's job: it checkpoints, requeues itself, resumes and finishes, each step logged
   once. (A resumed run's curve equals the uninterrupted one's: tests/integration/test_train_deepspeed.py.)
6. Bad input fails fast with a clear message in the job log: missing config, missing venv, zero
   nodes, port in use.

The cluster comes from launch/slurm/local_cluster.sh (root, Debian's slurm-wlm and munge; the dev
set-up installs them). Without them these tests skip, except under CI, where they fail. Each run of
this module starts clusters of its own (a fresh state directory under /var/tmp, free ports, its own
job-id range, so the batch scripts' rendezvous ports differ too) and stops them at the end, so two
suites on one machine do not touch each other's daemons or slurm.conf; the two-node cluster's network
namespaces are one per machine, so its users take turns (a file lock).

The tests wait for a job by reading its state every half second, not with ``sbatch --wait``: that
polls after 2, 10 and 42 s (Slurm 22.05), so a 12-second job took 42.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slurm]

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "launch" / "slurm"
CLUSTER = SLURM / "local_cluster.sh"
DS_ENTRY = "tests/helpers/ds_launch.py launch/train.py"  # skips DeepSpeed's CPU shm-op compile
MEGATRON_ENTRY = "tests/helpers/megatron_cpu_launch.py launch/megatron_example.py"  # CPU patches
CPU_JOB = ["--gpus-per-node=0", "--ntasks-per-node=2", "--cpus-per-task=1"]
TINY = ["eval.at_end=false", "tracking.wandb=disabled", "train.save_every=0"]
ZERO3 = "train.deepspeed_config=configs/deepspeed/zero3.json"  # the tiny default is ZeRO-2; these jobs test 3


def _missing(what: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{what}: CI must run the Slurm tests (scripts/setup.sh --dev installs Slurm as root)")
    pytest.skip(what)


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _cluster_settings(nodes: int) -> dict[str, str]:
    """A state directory of this run's own, two free ports (slurmctld, slurmd) and a job-id range of its own."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port < 65000 and _free(port + 1):
            break
    else:
        raise RuntimeError("no two consecutive free ports for a test Slurm cluster")
    state = tempfile.mkdtemp(prefix=f"ntl-slurm-{nodes}n-", dir="/var/tmp")  # short: slurmd's sockets live there
    return {
        "NTL_SLURM_NODES": str(nodes),
        "NTL_SLURM_STATE": state,
        "NTL_SLURMCTLD_PORT": str(port),
        "NTL_SLURMD_PORT": str(port + 1),
        # The batch scripts' rendezvous port is 20000 + job id mod 12000: ranges of 50 job ids per cluster.
        "NTL_SLURM_FIRST_JOB_ID": str(1 + 50 * (port % 240)),
    }


def _start_cluster(settings: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **settings}
    subprocess.run([str(CLUSTER), "start"], check=True, timeout=120, env=env)
    return {**env, "SLURM_CONF": f"{settings['NTL_SLURM_STATE']}/slurm.conf"}


def _stop_cluster(env: dict[str, str]) -> None:
    subprocess.run([str(CLUSTER), "stop"], check=False, timeout=120, env=env)
    shutil.rmtree(env["NTL_SLURM_STATE"], ignore_errors=True)


@pytest.fixture(scope="module")
def slurm_env():
    """Starts a one-node cluster of this run's own and yields the environment for sbatch/scontrol."""
    for tool in ("sbatch", "slurmctld", "slurmd", "munged"):
        if shutil.which(tool) is None:
            _missing(f"{tool} not installed")
    if os.geteuid() != 0:
        _missing("the local Slurm cluster needs root")
    env = _start_cluster(_cluster_settings(1))
    try:
        yield {**env, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    finally:
        _stop_cluster(env)


def _sbatch(env: dict, tmp: Path, script: str, *args: str, sbatch_opts=(), wait=True, extra_env=None):
    """Submits from the checkout; the job log goes to tmp. Returns (exit code, job id, log path, sbatch's
    output); the exit code is sbatch's, and once the job is submitted with ``wait`` (the default) the job's."""
    runs = tmp / "runs"
    runs.mkdir(exist_ok=True)
    cmd = ["sbatch", "--parsable", f"--output={tmp}/%x-%j.out", *CPU_JOB, *sbatch_opts, str(SLURM / script), *args]
    job_env = {**env, "NTL_RUNS": str(runs), **(extra_env or {})}
    out = subprocess.run(cmd, cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=120)
    job = out.stdout.strip().split(";")[0]
    name = "ntl-deepspeed" if script.startswith("deepspeed") else "ntl-megatron"
    rc = out.returncode
    if wait and rc == 0:
        rc = _wait_for(env, job)
    return rc, job, tmp / f"{name}-{job}.out", out


FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _wait_for(env: dict, job: str, timeout: float = 600) -> int:
    """Waits until the job has finished, as ``sbatch --wait`` does; its exit code (0 only if COMPLETED)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = _job_state(env, job)
        if state.get("JobState") in FINISHED:
            if state["JobState"] == "COMPLETED":
                return 0
            code, _, signal = state.get("ExitCode", "1:0").partition(":")
            return int(code) or 128 + int(signal or 0)
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env, check=False)
    raise AssertionError(f"job {job} still not finished after {timeout} s: {_job_state(env, job)}")


@pytest.fixture(scope="module")
def two_node_env(slurm_env):
    """A second cluster: two slurmd in their own network and UTS namespaces (hosts ntl-n1, ntl-n2)."""
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        _missing("the two-node cluster needs iproute2 and util-linux (ip, nsenter)")
    # The namespaces ntl-n1/ntl-n2 and the bridge are one per machine: another suite's two-node cluster waits.
    with open("/var/tmp/ntl-slurm-2n.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        env = _start_cluster(_cluster_settings(2))
        try:
            yield {**slurm_env, **{k: v for k, v in env.items() if k.startswith(("NTL_SLURM", "SLURM_CONF"))}}
        finally:
            _stop_cluster(env)


def _job_state(env: dict, job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# 1. Static ------------------------------------------------------------------------------------------


def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        _missing("shellcheck not installed")
    scripts = sorted(str(p) for p in SLURM.iterdir() if p.suffix in (".sh", ".sbatch"))
    out = subprocess.run(["shellcheck", "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def _dry_run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(
        ["bash", str(SLURM / script), "--dry-run", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


@pytest.mark.parametrize("nodes", [1, 4])
def test_dry_run_plans_n_nodes(nodes):
    out = _dry_run("deepspeed.sbatch", "--nodes", str(nodes), "--", "train.steps=5")
    assert out.returncode == 0, out.stderr
    srun = next(line for line in out.stdout.splitlines() if line.startswith("srun "))
    assert f"--nodes={nodes}" in srun and "--ntasks-per-node=8" in srun  # 8 from the #SBATCH header
    assert srun.rstrip().endswith("train.steps=5") and "launch/train.py --config" in srun
    assert f"{nodes * 8} ranks" in out.stdout


def test_megatron_dry_run_turns_the_config_into_flags_and_points_checkpoints_at_the_run_dir():
    import yaml

    config = ROOT / "configs" / "megatron" / "llama-3.2-3b_ntl.yaml"
    out = _dry_run(
        "megatron.sbatch", "--config", str(config), "--procs-per-node", "4", "--run-dir", "/r", "--", "--x", "1"
    )
    assert out.returncode == 0, out.stderr
    srun = next(line for line in out.stdout.splitlines() if line.startswith("srun "))
    flags = yaml.safe_load(config.read_text())["megatron_args"]
    assert f"--train-iters {flags['train-iters']}" in srun and "--ntl-weight" in srun
    assert "--save /r/checkpoints --load /r/checkpoints --exit-signal-handler --x 1" in srun
    assert "--ntasks-per-node=4" in srun


def test_megatron_dry_run_fails_on_a_config_it_cannot_read(tmp_path):
    """A config file that exists but is no Megatron config stops the job, not a run without its flags."""
    config = tmp_path / "not_megatron.yaml"
    config.write_text("train:\n  steps: 5\n")
    out = _dry_run("megatron.sbatch", "--config", str(config), "--run-dir", "/r")
    assert out.returncode != 0 and "srun " not in out.stdout, out.stdout
    assert "could not read" in out.stderr and "expected a mapping 'megatron_args:" in out.stderr, out.stderr


def test_torchtitan_dry_run_runs_torchtitan_train_with_a_registry_config_and_checkpoints_in_the_run_dir():
    out = _dry_run(
        "torchtitan.sbatch", "--config", "llama3_3b_ntl", "--nodes", "2", "--run-dir", "/r", "--", "--x", "1"
    )
    assert out.returncode == 0, out.stderr
    srun = next(line for line in out.stdout.splitlines() if line.startswith("srun "))
    assert "-m torchtitan.train --module ntl_scale.integrations.torchtitan --config llama3_3b_ntl" in srun
    assert "--parallelism.spmd_backend partial_dtensor --dump_folder /r --checkpoint.enable" in srun
    assert srun.rstrip().endswith("--x 1") and "--nodes=2" in srun and "16 ranks" in out.stdout


def test_help_names_the_options():
    for script in ("deepspeed.sbatch", "megatron.sbatch", "torchtitan.sbatch"):
        out = subprocess.run(["bash", str(SLURM / script), "--help"], capture_output=True, text=True)
        assert out.returncode == 0
        for word in ("--dry-run", "--config", "--entry", "NTL_VENV", "requeue"):
            assert word in out.stdout


def test_dry_run_with_zero_nodes_fails_with_a_clear_message():
    out = _dry_run("deepspeed.sbatch", "--nodes", "0")
    assert out.returncode != 0 and "nodes = '0'" in out.stderr and ">= 1" in out.stderr


# 2-5. Jobs on the clusters ---------------------------------------------------------------------------

STEPS = 20  # the preemption test signals once 3 steps are logged: 17 steps left to checkpoint at


def test_megatron_job_runs_and_leaves_checkpoints_and_logs(slurm_env, tmp_path):
    rc, job, log, out = _sbatch(
        slurm_env, tmp_path, "megatron.sbatch", "--config", "", "--entry", MEGATRON_ENTRY,
        "--", "--tp", "2", "--train-iters", "4", "--save-interval", "2", "--ntl-weight", "0.3",
    )  # fmt: skip
    text = log.read_text() if log.exists() else out.stderr
    assert rc == 0, text
    ckpt = tmp_path / "runs" / f"ntl-megatron-{job}" / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    for it in (2, 4):
        for tp in (0, 1):
            assert (ckpt / f"iter_{it:07d}" / f"mp_rank_{tp:02d}" / "model_optim_rng.pt").exists()
    assert "step   4/4" in text and "ntl loss" in text


def test_megatron_job_runs_the_drop_in_on_real_megatron_lm(slurm_env, tmp_path):
    """megatron.sbatch with its default entry, launch/pretrain_gpt_ntl.py, on Megatron-LM core_v0.19.0, one task:
    the script's entry arguments (``--save``/``--load``/``--exit-signal-handler``) and its end-of-run check.
    One process, not TP=2: megatron.sbatch's two-rank rendezvous is the megatron.core job's above, the drop-in
    at TP=2 is tests/integration/test_megatron_lm.py's."""
    from ntl_scale import NumberVocab
    from tests.helpers import megatron_lm as mlm

    checkout = mlm.checkout(mlm.RELEASES[-1])
    table = tmp_path / "numbers.json"
    NumberVocab.from_id_to_token({i: (str(i - 48) if 48 <= i < 58 else f"w{i}") for i in range(127)},
                                vocab_size=128).save(table)  # fmt: skip
    env = {**slurm_env, **mlm._env(), "SLURM_CONF": slurm_env["SLURM_CONF"], "MEGATRON_LM_PATH": str(checkout),
           "NTL_PYTHON": sys.executable}  # fmt: skip
    rc, job, log, out = _sbatch(
        env, tmp_path, "megatron.sbatch", "--config", "",
        "--entry", "tests/helpers/megatron_lm_cpu.py launch/pretrain_gpt_ntl.py",  # test-only CUDA redirections
        "--", *mlm.tiny_args(iters=2), "--mock-data", "--tokenizer-type", "NullTokenizer", "--split", "100,0,0",
        "--eval-iters", "0", "--eval-interval", "1000", "--save-interval", "2",
        "--ntl-weight", "0.3", "--ntl-number-vocab", str(table), sbatch_opts=["--ntasks-per-node=1"],
    )  # fmt: skip
    text = log.read_text() if log.exists() else out.stderr
    assert rc == 0, text[-5000:]
    ckpt = tmp_path / "runs" / f"ntl-megatron-{job}" / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (ckpt / "iter_0000002").is_dir()
    assert "iteration        2/       2" in text and " ntl loss: " in text


def test_deepspeed_job_warned_checkpoints_requeues_resumes_and_leaves_checkpoints_and_logs(slurm_env, tmp_path):
    """The tiny ZeRO-3 job on 2 Slurm tasks, warned mid-run: it checkpoints, requeues itself, resumes, logs every
    step once and ends finished, with checkpoints, ZeRO-3 shards, logs, resolved config, command and environment
    in its run directory. (That a resumed run continues the uninterrupted run's curve is
    tests/integration/test_train_deepspeed.py's: resumed under ZeRO-3 and ZeRO-2, after a stop signal too.)"""
    rc, job, log, out = _sbatch(
        slurm_env, tmp_path, "deepspeed.sbatch", "--entry", DS_ENTRY, "--", f"train.steps={STEPS}", *TINY, ZERO3,
        wait=False,
    )  # fmt: skip
    assert rc == 0, out.stderr
    run = tmp_path / "runs" / f"ntl-deepspeed-{job}"
    deadline = time.time() + 300
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and len(_metrics(run)) >= 3):
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm_env, check=True)
    state, pending_since = {}, None
    while time.time() < deadline:
        state = _job_state(slurm_env, job)
        if state.get("JobState") == "PENDING" and state.get("Reason") == "BeginTime":
            # Slurm holds a requeued job for a while; a test need not wait for that. But a start in the
            # same second as the node revoked the first run's credential is refused ("Killing
            # non-startable batch job: Job credential revoked", seen here once), so let a few seconds pass.
            pending_since = pending_since or time.time()
            if time.time() - pending_since >= 3:
                subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], env=slurm_env, check=True)
        if state.get("JobState") in FINISHED:
            break
        time.sleep(0.5)
    text = log.read_text()
    assert state.get("JobState") == "COMPLETED" and state.get("Restarts") == "1", (state, text)
    assert "requeueing" in text and "checkpointed at step" in text and "resumed from step" in text
    assert f"step {STEPS}/{STEPS}" in text
    assert [r["step"] for r in _metrics(run)] == list(range(1, STEPS + 1))  # nothing lost, nothing twice
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step{STEPS}"
    assert json.loads((run / "status.json").read_text()) == {"state": "finished", "step": STEPS}
    for rank in (0, 1):  # ZeRO-3 over the two Slurm tasks: each holds about half
        part = json.loads((run / f"zero_rank{rank}.json").read_text())
        assert 0.4 < part["held"] / part["total"] < 0.6
    command = (run / "command.sh").read_text()
    assert command.count(f"# job {job} attempt ") == 2 and "srun" in command and (run / "tiny_cpu.yaml").exists()
    assert sorted(p.name for p in (run / "logs").glob("env-*.txt")) == [f"env-{job}-0.txt", f"env-{job}-1.txt"]
    assert (run / "logs" / log.name).resolve() == log.resolve()


def test_two_nodes_rendezvous_over_their_own_network(two_node_env, tmp_path):
    """The tensor-parallel config on 2 nodes x 2 tasks: TP 2 inside each node, DP 2 across the nodes."""
    rc, job, log, out = _sbatch(
        two_node_env, tmp_path, "deepspeed.sbatch", "--config", "configs/train/tiny_cpu_tp2.yaml", "--entry",
        DS_ENTRY, "--", "train.steps=4", "train.micro_batch_size=4", *TINY,
        sbatch_opts=["--nodes=2", "--ntasks-per-node=2"],
    )  # fmt: skip
    text = log.read_text() if log.exists() else out.stderr
    assert rc == 0, text
    assert "2 node(s) x 2 process(es)" in text and "rendezvous ntl-n1:" in text
    run = tmp_path / "runs" / f"ntl-deepspeed-{job}"
    ranks = [json.loads((run / f"zero_rank{r}.json").read_text()) for r in range(4)]
    placed = [(r["host"], r["tp"], r["dp_rank"], r["vocab_shard"]) for r in ranks]
    assert placed == [  # each node holds one tensor-parallel group, in its own network namespace
        ("ntl-n1", 2, 0, [0, 40]), ("ntl-n1", 2, 0, [40, 80]), ("ntl-n2", 2, 1, [0, 40]), ("ntl-n2", 2, 1, [40, 80])
    ]  # fmt: skip
    assert (run / "checkpoints" / "latest").read_text().strip() == "step4"
    assert json.loads((run / "checkpoints" / "layout.json").read_text()) == {
        "data_parallel": 2, "tensor_parallel": 2, "global_batch": 8
    }  # fmt: skip


# 6. Bad input ---------------------------------------------------------------------------------------


def _fails_fast(env, tmp, *args, extra_env=None, sbatch_opts=()):
    start = time.time()
    rc, _, log, out = _sbatch(env, tmp, "deepspeed.sbatch", *args, extra_env=extra_env, sbatch_opts=sbatch_opts)
    assert rc != 0
    assert time.time() - start < 60
    return (log.read_text() if log.exists() else "") + out.stderr


def test_missing_config_fails_fast(slurm_env, tmp_path):
    text = _fails_fast(slurm_env, tmp_path, "--config", "configs/train/nope.yaml")
    assert "config" in text and "nope.yaml' does not exist" in text


def test_missing_venv_fails_fast(slurm_env, tmp_path):
    text = _fails_fast(slurm_env, tmp_path, extra_env={"NTL_VENV": "/nonexistent/venv"})
    assert "NTL_VENV=/nonexistent/venv has no bin/activate" in text


def test_zero_nodes_is_refused_at_submission(slurm_env, tmp_path):
    text = _fails_fast(slurm_env, tmp_path, sbatch_opts=["--nodes=0"])
    assert "Node count specification invalid" in text


def test_port_in_use_fails_fast(slurm_env, tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        text = _fails_fast(slurm_env, tmp_path, extra_env={"NTL_MASTER_PORT": str(port)})
    assert f"port {port} is in use" in text and "NTL_MASTER_PORT" in text
