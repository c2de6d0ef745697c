"""The GPU study on a Slurm cluster in one command: each stage's array, chained by dependent jobs.

    python experiments/gpu_study_submit.py --data DATA.yaml [--config STUDY.yaml] [--runs RUNS] [--entry E]

:func:`advance` reads the study's runs folder and does what comes next, in the order of the study file's
stages: a stage whose seeds are left to power first gets them from the power stage's runs
(:func:`gpu_study.seeds_from_pilot`, written to ``RUNS/study.seeds.yaml``); a stage with unfinished tasks
(no ``eval.json``, or no ``harness.json`` where the harness runs) is submitted as one Slurm array of those
tasks only (``launch/slurm/gpu_study.sbatch``), followed by a small job that runs after the array has ended
(``--dependency=afterany``: ``launch/slurm/gpu_study_next.sbatch``, which runs this command again with
``--after STAGE``), and nothing else is done; a finished stage other than the power stage is tabulated with
its verdicts (:func:`gpu_study.collect` into ``RUNS/tables/<stage>``) unless its tables are newer than its
runs. So the command a team types submits the pilot and the job after it; that job sets the seeds and
submits the main stage with its own next job; that one writes the main stage's verdicts and submits the
secondary arm; and so on until every stage is tabulated.

Re-running the command never redoes work: finished tasks are left out of the arrays (and a task skips the
phases it has done), a written seeds file or up-to-date table is kept, and while a job listed in
``RUNS/submit.json`` is still queued or running (``squeue -j``, whoever submitted it) it submits nothing but
the next job of an array whose own submission failed. A failed submission, or a job after a stage that finds
tasks of that stage unfinished, stops the chain (``stopped`` in the record, with the reason; the job fails,
naming the tasks and their logs): fix the cause and run the command again.

Sbatch options for the cluster come from the site's data file, ``slurm.array`` (every training array: a
partition, an account, a time limit; the script's header asks for one 8-GPU node), ``slurm.step`` (the
small CPU jobs) and ``slurm.max_running`` (tasks of an array at once). The stage, data file and runs folder
go to the array with ``--export=ALL,...``, whatever the site's default export.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import gpu_study

ROOT = gpu_study.ROOT
ARRAY_SCRIPT = os.path.join(ROOT, "launch", "slurm", "gpu_study.sbatch")
NEXT_SCRIPT = os.path.join(ROOT, "launch", "slurm", "gpu_study_next.sbatch")
STATE = "submit.json"
"""The chain's record in the runs folder: the study and data files, every job submitted, the status."""
SEEDS = "study.seeds.yaml"
"""The study file with the power-set seeds filled in (written by the power step, then used by every stage)."""
ARRAY_NAME, NEXT_NAME = "ntl-gpu-study-{stage}", "ntl-gpu-study-next"
LIVE = ("PENDING", "RUNNING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED",
        "STOPPED", "SIGNALING")  # fmt: skip
"""squeue states of a job whose work has not ended (a requeued array task is pending again; a completing one
has ended it)."""
REFUSED = {"--array": "the unfinished tasks (throttle them with slurm: {max_running: N})",
           "--dependency": "the chain's order", "--output": "the logs in RUNS/logs", "--error": "the logs in RUNS/logs",
           "--job-name": "the names of the logs", "--export": "ALL plus the stage, data and runs folder",
           "--parsable": "to read the job id"}  # fmt: skip
"""sbatch options ``submit`` sets itself (and what it sets them to): refused in the data file's ``slurm``."""
SHORT = {"-a": "--array", "-d": "--dependency", "-o": "--output", "-e": "--error", "-J": "--job-name"}
RETRIES, RETRY_S, LOCK_WAIT_S = 3, 10.0, 3600.0
"""squeue tries before its failure stops the command, seconds between them; seconds to wait for a held lock."""


def log(message: str) -> None:
    print(f"[gpu-study] {message}", flush=True)


def tool(name: str) -> str:
    """The path of Slurm's ``name``; a ValueError naming the fix where it is not on PATH."""
    found = shutil.which(name)
    if not found:
        raise ValueError(
            f"{name} is not on PATH: run `gpu_study_submit.py` on a Slurm login node (load Slurm's module first); "
            "without Slurm a task runs by hand: bash launch/slurm/gpu_study.sbatch --dry-run prints its commands"
        )
    return found


def site_options(data: dict[str, Any], path: str) -> dict[str, Any]:
    """The data file's ``slurm.array`` and ``slurm.step`` (sbatch options, a list or one string each) and
    ``slurm.max_running`` (at most this many tasks of an array at once; ``None``: no limit)."""
    spec = data.get("slurm") or {}
    if not isinstance(spec, dict) or set(spec) - {"array", "step", "max_running"}:
        raise ValueError(
            f"{path}: slurm = {spec!r}: expected a mapping with 'array', 'step' (sbatch options), 'max_running', "
            "e.g. slurm: {array: [--partition=gpu, --account=ml], step: [--partition=cpu], max_running: 8}"
        )
    out: dict[str, Any] = {}
    for key in ("array", "step"):
        value = spec.get(key) or []
        words = shlex.split(value) if isinstance(value, str) else value
        if not isinstance(words, list) or not all(isinstance(w, str) and w.startswith("-") for w in words):
            raise ValueError(
                f"{path}: slurm.{key} = {value!r}: expected sbatch options such as [--partition=gpu, --time=48:00:00]"
            )
        for word in words:
            name = word.split("=")[0] if word.startswith("--") else SHORT.get(word[:2], "")
            if name in REFUSED:
                raise ValueError(
                    f"{path}: slurm.{key} holds {word!r}: `submit` sets {name} itself ({REFUSED[name]}): remove it"
                )
        out[key] = list(words)
    limit = spec.get("max_running")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"{path}: slurm.max_running = {limit!r}: expected a whole number >= 1 (tasks at once)")
    out["max_running"] = limit
    return out


def array_spec(indices: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``: sbatch's ``--array`` for these task indices."""
    parts: list[str] = []
    for i in sorted(indices):
        if parts and i == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{i}"
        else:
            parts.append(str(i))
    return ",".join(parts)


def task_done(study: dict[str, Any], run_dir: str) -> bool:
    """A task is done once its evaluation (``eval.json``) and, where the study runs the harness, its
    ``harness.json`` are written (the array script writes each last, whole)."""
    names = ["eval.json", *(["harness.json"] if study["eval"].get("harness") else [])]
    return all(os.path.isfile(os.path.join(run_dir, n)) for n in names)


def unfinished(study: dict[str, Any], runs: str, stage: str) -> list[int]:
    """The array indices of ``stage``'s tasks that are not done (a run an earlier stage finished is done)."""
    return [t.index for t in gpu_study.tasks(study, stage) if not task_done(study, os.path.join(runs, t.run_name))]


def needs_power(study: dict[str, Any], stage: str) -> bool:
    seeds = study["stages"][stage]["seeds"]
    return isinstance(seeds, dict) and "power" in seeds.values()


def tables_current(study: dict[str, Any], runs: str, stage: str, out: str) -> bool:
    """Whether ``OUT/sweep.json`` is newer than every evaluation and harness file of ``stage``'s runs."""
    sweep = os.path.join(out, "sweep.json")
    if not os.path.isfile(sweep):
        return False
    files = [os.path.join(runs, t.run_name, n) for t in gpu_study.tasks(study, stage) for n in ("eval.json",
             "harness.json")]  # fmt: skip
    newest = max((os.path.getmtime(f) for f in files if os.path.isfile(f)), default=0.0)
    return os.path.getmtime(sweep) >= newest


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_state(runs: str) -> dict[str, Any]:
    path = os.path.join(runs, STATE)
    if not os.path.isfile(path):
        return {"jobs": []}
    with open(path) as f:
        return json.load(f)


def write_state(runs: str, state: dict[str, Any]) -> None:
    from ntl_scale.atomic import write_json_atomically

    write_json_atomically(state, os.path.join(runs, STATE), indent=2)


def queued(ids: list[str]) -> dict[str, str]:
    """The jobs among ``ids`` (anyone's) that squeue lists in a state that has not ended: ``{id: "STATE
    (reason)"}`` (an array is listed while any task of it is; a job Slurm no longer knows has ended)."""
    if not ids:
        return {}
    command = [tool("squeue"), "-h", "-o", "%F|%A|%T|%r", "-j", ",".join(ids)]
    for attempt in range(RETRIES):
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if not done.returncode or "Invalid job id" in done.stderr:
            break
        if attempt < RETRIES - 1:
            time.sleep(RETRY_S)
    else:
        raise ValueError(
            f"squeue failed {RETRIES} times ({done.stderr.strip()}): {shlex.join(command)}; is the Slurm controller "
            "reachable from here? Run the command again once squeue answers"
        )
    if done.returncode:  # one id unknown: where squeue refuses the whole list for it, ask for each alone
        return {} if len(ids) == 1 else {k: v for i in ids for k, v in queued([i]).items()}
    out: dict[str, str] = {}
    for line in done.stdout.splitlines():
        array_id, job_id, state, reason = [*line.split("|"), "", "", ""][:4]
        for found in (array_id, job_id):
            if found in ids and state in LIVE:
                out.setdefault(found, f"{state} ({reason})")
    return out


def sbatch(options: list[str], script: str, args: list[str], env: dict[str, str]) -> str:
    """Submits ``script`` from the checkout with the environment and ``env`` (``--export=ALL,...``, whatever the
    site's SBATCH_EXPORT); the job id. The submitting job's own SLURM_* variables are left out."""
    for key, value in env.items():
        if "," in value:
            raise ValueError(f"{key}={value!r}: sbatch --export cannot pass a comma: use a path without one")
    export = ",".join(["--export=ALL", *(f"{k}={v}" for k, v in env.items())])
    command = [tool("sbatch"), "--parsable", export, *options, script, *args]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    done = subprocess.run(command, cwd=ROOT, env=clean, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise ValueError(f"sbatch failed ({done.stderr.strip()}): {shlex.join(command)}")
    return done.stdout.strip().split(";")[0]


def advance(config: str, data_path: str, runs: str, entry: str | None = None, after: str | None = None) -> str:
    """:func:`advance_locked` holding ``RUNS/submit.lock``: two submissions at once (a second driver job, a
    command typed while a next job runs) take turns, and the second sees the first's jobs. Where the file
    system has no flock (Lustre mounted ``noflock``), the lock is the file ``RUNS/submit.held``, created
    exclusively, naming its holder."""
    import fcntl

    os.makedirs(runs, exist_ok=True)
    with open(os.path.join(runs, "submit.lock"), "a") as lock:
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log(f"waiting for another submission of {runs} (it holds {lock.name})")
                fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            return advance_held(config, data_path, runs, entry, after)
        return advance_locked(config, data_path, runs, entry, after)


def advance_held(config: str, data_path: str, runs: str, entry: str | None, after: str | None) -> str:
    """:func:`advance_locked` holding ``RUNS/submit.held`` (created with O_EXCL, removed after)."""
    held = os.path.join(runs, "submit.held")
    start, told = time.monotonic(), False
    while True:
        try:
            fd = os.open(held, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            try:
                with open(held) as f:
                    holder = f.read().strip()
            except FileNotFoundError:  # released meanwhile
                continue
            if not told:
                log(f"waiting for another submission of {runs}: {held} is held by {holder} (stale if that process "
                    "has ended: then delete the file)")  # fmt: skip
                told = True
            if time.monotonic() - start >= LOCK_WAIT_S:
                raise ValueError(
                    f"{held} is held by {holder} (waited {LOCK_WAIT_S:.0f} s): if that process has ended "
                    f"(killed), delete {held} and run the command again"
                ) from None
            time.sleep(min(5.0, LOCK_WAIT_S))
    with os.fdopen(fd, "w") as f:
        f.write(f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    try:
        return advance_locked(config, data_path, runs, entry, after)
    finally:
        os.remove(held)


def advance_locked(config: str, data_path: str, runs: str, entry: str | None = None, after: str | None = None) -> str:
    """Does the study's next step (module docstring); returns ``submitted``, ``waiting`` (jobs of an earlier
    submission are still queued: nothing submitted) or ``done``. A ValueError where the chain stops (tasks of
    ``after`` unfinished, a failed submission, a bad file, no Slurm), naming the fix; once the runs folder's
    record is checked, the record says ``stopped`` and why."""
    config, data_path, runs = (os.path.abspath(p) for p in (config, data_path, runs))
    study = gpu_study.load(config)
    data = gpu_study.load_data(data_path)
    options = site_options(data, data_path)
    state = read_state(runs)
    digests = {"config": sha256(config), "data": data_digest(data)}
    for key, path in (("config", config), ("data", data_path)):
        if state.get(f"{key}_sha256", digests[key]) != digests[key]:
            what = "study file" if key == "config" else "data file"
            raise ValueError(
                f"{runs} holds a study submitted from {state.get(key)} (another content than the {what} {path}): "
                f"submit the same {what} (its slurm section may change), choose another --runs, or delete "
                f"{os.path.join(runs, STATE)} to go on with this one (finished runs are kept)"
            )
    tool("sbatch")
    state.update({"config": config, "config_sha256": digests["config"], "data": data_path,
                  "data_sha256": digests["data"], "entry": entry})  # fmt: skip
    os.makedirs(os.path.join(runs, "logs"), exist_ok=True)
    try:
        return next_step(study, options, state, config, data_path, runs, entry, after)
    except ValueError as e:
        state["status"], state["message"] = "stopped", str(e)
        write_state(runs, state)
        raise


def data_digest(data: dict[str, Any]) -> str:
    """The data file's identity: its content without the ``slurm`` section (the site's options may change)."""
    kept = {k: v for k, v in data.items() if k != "slurm"}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def next_step(study: dict[str, Any], options: dict[str, Any], state: dict[str, Any], config: str, data_path: str,
              runs: str, entry: str | None, after: str | None) -> str:  # fmt: skip
    """:func:`advance_locked` once the record is checked."""
    own = os.environ.get("SLURM_JOB_ID")
    live = queued([j["id"] for j in state["jobs"] if j["id"] != own])
    args = ["--config", config, "--data", data_path, "--runs", runs, *(["--entry", entry] if entry else [])]
    step_options = [f"--output={os.path.join(runs, 'logs', '%x-%j.out')}", *options["step"]]
    if live:
        listed = ", ".join(f"job {j} {s}" for j, s in live.items())
        waited = {w for j in state["jobs"] if j["kind"] == "next" and j["id"] in live for w in j["waits_for"]}
        alone = [j for j in state["jobs"] if j["kind"] == "array" and j["id"] in live and j["id"] not in waited]
        if after is None and not alone:
            log(f"already submitted, nothing submitted: {listed} (state: {os.path.join(runs, STATE)}; "
                "scancel them to submit again)")  # fmt: skip
            return "waiting"
        # a job after a stage whose jobs are queued again (a requeued task) waits for them once more; a command
        # that finds an array without its next job (that submission failed) submits the next job alone
        waits = list(live) if after else [j["id"] for j in alone]
        stage = after or alone[-1]["stage"]
        step = sbatch([*step_options, f"--dependency=afterany:{':'.join(waits)}"], NEXT_SCRIPT,
                      [*args, "--after", stage], {})  # fmt: skip
        state["jobs"].append({"id": step, "kind": "next", "after": stage, "waits_for": waits,
                              "log": os.path.join(runs, "logs", f"{NEXT_NAME}-{step}.out")})  # fmt: skip
        state["status"], state["message"] = "submitted", f"job {step} after {', '.join(waits)}"
        write_state(runs, state)
        log(f"{listed} not ended: job {step} runs after {', '.join(waits)}")
        return "submitted"

    current, current_path = study, config
    power_stage = study.get("power", {}).get("stage")
    seeds_path = os.path.join(runs, SEEDS)
    for stage in study["stages"]:
        if needs_power(current, stage):
            if not os.path.isfile(seeds_path):
                log(f"stage {stage}: seeds from the {power_stage} stage's runs (experiments/power.py)")
                got = gpu_study.seeds_from_pilot(current, runs)
                gpu_study.print_seeds(current, got)
                gpu_study.write_seeds(config, got["seeds"], seeds_path)
                log(f"wrote {seeds_path}")
            current_path = seeds_path
            current = gpu_study.load(current_path)
        todo = unfinished(current, runs, stage)
        if todo:
            every = len(gpu_study.tasks(current, stage))
            if after == stage:
                names = [gpu_study.task(current, i, stage).run_name for i in todo]
                message = (f"stage {stage}: tasks {array_spec(todo)} did not finish ({', '.join(names)}): read their "
                           f"logs in {os.path.join(runs, 'logs')}, fix the cause, then run the same "
                           "`gpu_study_submit.py` command again (it submits only the unfinished tasks)")  # fmt: skip
                raise ValueError(message)
            name = ARRAY_NAME.format(stage=stage)
            throttle = f"%{options['max_running']}" if options["max_running"] else ""
            array = sbatch(
                [f"--array={array_spec(todo)}{throttle}", f"--job-name={name}",
                 f"--output={os.path.join(runs, 'logs', '%x-%A_%a.out')}", *options["array"]],
                ARRAY_SCRIPT, ["--config", current_path, *(["--entry", entry] if entry else [])],
                {"NTL_STAGE": stage, "NTL_STUDY_DATA": data_path, "NTL_STUDY_RUNS": runs},
            )  # fmt: skip
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
            logs = os.path.join(runs, "logs", f"{name}-{array}_<task>.out")
            state["jobs"].append({"id": array, "kind": "array", "stage": stage, "tasks": array_spec(todo),
                                  "submitted": stamp, "logs": logs})  # fmt: skip
            write_state(runs, state)  # recorded before the next sbatch: a failure there leaves no unlisted array
            step = sbatch([*step_options, f"--dependency=afterany:{array}"], NEXT_SCRIPT, [*args, "--after", stage], {})
            state["jobs"].append({"id": step, "kind": "next", "after": stage, "waits_for": [array], "submitted": stamp,
                                  "log": os.path.join(runs, "logs", f"{NEXT_NAME}-{step}.out")})  # fmt: skip
            state["status"], state["message"] = "submitted", f"stage {stage}: array {array}, then job {step}"
            write_state(runs, state)
            log(f"stage {stage}: array job {array}, tasks {array_spec(todo)} ({len(todo)} of {every} to run); "
                f"logs {logs}")  # fmt: skip
            log(f"then job {step}, after array {array} ends: {what_next(study, stage)}; "
                f"log {os.path.join(runs, 'logs', f'{NEXT_NAME}-{step}.out')}")  # fmt: skip
            log(f"verdicts: {verdict_files(study, runs)}; progress: {os.path.join(runs, STATE)}")
            return "submitted"
        if stage != power_stage:
            out = os.path.join(runs, "tables", stage)
            if tables_current(current, runs, stage, out):
                log(f"stage {stage}: finished, tables in {out}")
            else:
                log(f"stage {stage}: finished; tables and verdicts into {out}")
                gpu_study.collect(current, runs, out, stage)
        else:
            log(f"stage {stage}: finished")
    state["status"], state["message"] = "done", f"every stage finished; verdicts: {verdict_files(study, runs)}"
    write_state(runs, state)
    log(f"the study is done: {verdict_files(study, runs)}")
    return "done"


def what_next(study: dict[str, Any], stage: str) -> str:
    """What the job after ``stage``'s array does, in words."""
    order = list(study["stages"])
    later = order[order.index(stage) + 1 :]
    power_stage = study.get("power", {}).get("stage")
    steps = [] if stage == power_stage else [f"{stage}'s tables and verdicts"]
    powered = [s for s in later if needs_power(study, s)]
    if stage == power_stage and powered:
        steps.append(f"the seeds of {', '.join(powered)} by power ({SEEDS})")
    if later:
        steps.append(f"{later[0]}'s unfinished tasks as an array, with a job after it")
    return ", then ".join(steps) or "nothing left"


def verdict_files(study: dict[str, Any], runs: str) -> str:
    power_stage = study.get("power", {}).get("stage")
    stages = [s for s in study["stages"] if s != power_stage]
    return ", ".join(os.path.join(runs, "tables", s, "sweep.md") + " (sweep.json)" for s in stages)


def main(argv: list[str] | None = None) -> None:
    """:func:`advance` with the command line's files; exits 1 when the chain stopped."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpu_study/study.yaml", help="the study file")
    parser.add_argument("--data", default=None, help="the site's data file (default: NTL_STUDY_DATA)")
    parser.add_argument("--runs", default=None, help="the study's runs folder (default: $NTL_RUNS/gpu-study)")
    parser.add_argument("--entry", default=None, help="gpu_study.sbatch's --entry (default: its own)")
    parser.add_argument("--after", default=None, help="in the chain's own jobs: the stage whose array ended")
    args = parser.parse_args(argv)
    data = args.data or os.environ.get("NTL_STUDY_DATA") or ""
    runs = args.runs or os.path.join(os.environ.get("NTL_RUNS") or os.path.join(ROOT, "runs"), "gpu-study")
    try:
        advance(args.config, data, runs, args.entry, args.after)
    except ValueError as e:
        if args.after and os.path.isfile(os.path.join(runs, STATE)):  # a job of the chain: the record says why
            state = read_state(runs)
            state["status"], state["message"] = "stopped", str(e)
            write_state(runs, state)
        raise SystemExit(f"gpu_study_submit.py: {e}") from None
    sys.stdout.flush()


if __name__ == "__main__":
    main()
