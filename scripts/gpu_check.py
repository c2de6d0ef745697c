"""The GPU check in one command: ``bash scripts/gpu_check.sh --out DIR [--dry-run] [--budget S]``.

Steps, in this order, each with its own time limit cut to what is left of ``--budget`` (420 s by default), each
written to ``DIR`` as it finishes (so a cut run still returns what it did):

- 0, environment: the commit (``.gpu_wheels/COMMIT``, written by ``scripts/gpu_prepare.sh`` before the copy),
  the travelling tree's size, the carried wheels installed where the machine lacks them, versions, ``command -v
  make g++``, an import of every carried wheel, the card's measured ceilings (``DIR/ceilings.json``);
- A, correctness: ``tests/gpu/check_parity.py`` (both ops, Triton and PyTorch against float64, at the test shape
  and at 8192 x 128256 x 4096 bf16), the GPU tests (``pytest -m gpu tests/gpu``: no host sync and CUDA-graph
  capture with ``impl="triton"``), the compiled kernel tests (``tests/unit/test_triton_kernel.py`` with
  ``TRITON_INTERPRET=0``; a skip counts as a failure), run side by side;
- B, speed: ``benchmarks/bench_gpu.py`` with the time left (at least 150 s where there is), writing
  ``DIR/bench.json`` and ``DIR/bench.md`` row by row;
- C, verdicts: read from the benchmark's JSON;
- D, training, each with a compared number, side by side: ``launch/train.py`` tiny in fp32 for 5 steps against
  the CPU record ``tests/gpu/reference/train_tiny_fp32.json`` (relative difference <= 1e-3), 20 bf16 steps
  finite and falling, the Hugging Face ``Trainer`` example chunked in bf16, Megatron-LM TP 1 on mock data.

``--dry-run`` (and any run without a CUDA GPU) does what this machine can: the argument handling, the size check,
the wheel imports of what is installed, the probe and the parity script on the CPU at a tiny shape (Triton's
interpreter), the benchmark's dry run, the budget arithmetic and every writer; the GPU-only rows say NOT RUN.

``DIR`` gets ``gpu_check.log`` (everything), ``gpu_check.json`` (every row: steps, checks, benchmark rows,
verdicts), ``gpu_check.md`` (the table), ``summary.txt``, ``ceilings.json``, ``bench.json``, ``bench.md``;
standard output ends with the summary (under 10 kB). Exit status 1 when a row failed, timed out, or was not run
for lack of time. ``--record-cpu-reference`` writes the CPU record of step D (run it on a CPU machine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DEFAULT_BUDGET = 420.0
MIN_STEP = 10.0  # a step with less left than this is not started
LIMITS = {"0": 75.0, "A": 150.0, "D": 150.0}  # nominal per-step limits, cut to what is left
BENCH_MIN, D_RESERVE = 150.0, 120.0  # the benchmark gets at least 150 s where there is; it leaves D 120 s
BENCH_GRACE = 25.0  # the benchmark's process limit over its --time-budget (start-up, writing its files)
LOG_CAP, JOB_LOG_CAP = 15 << 20, 3 << 20  # each file that comes back stays under 16 MiB
SUMMARY_CAP = 9000
REFERENCE = ROOT / "tests" / "gpu" / "reference" / "train_tiny_fp32.json"
TRAIN_ARGS = [  # launch/train.py, one process: the tiny config, 5 fp32 steps (the CPU record's command)
    "--config",
    "configs/train/tiny_cpu.yaml",
    "train.steps=5",
    "train.log_every=1",
    "train.bf16=false",
    "data.train_examples=200",
    "data.eval_examples=8",
    "eval.at_end=false",
    "tracking.wandb=disabled",
    "tracking.plot=false",
]
RELATIVE_TOLERANCE = 1e-3
STATUS_OK, FAILED, TIMED_OUT, NOT_RUN = "ok", "FAILED", "TIMED OUT", "NOT RUN"


def utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Job:
    """One command of a step, run in its own process group (killed whole at its limit)."""

    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = ROOT
    rc: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    output: str = ""


class Check:
    """Budget, rows and the writers of one run."""

    def __init__(self, out: Path, work: Path, budget: float, dry_run: bool, argv: list[str]):
        self.out, self.work, self.budget, self.dry_run = out, work, budget, dry_run
        self.start = time.monotonic()
        self.step_deadline = math.inf  # set by each step: its sub-jobs end by then
        self.rows: list[dict] = []
        self.meta: dict = {
            "command": "bash scripts/gpu_check.sh " + shlex.join(argv),
            "started_utc": utc(),
            "dry_run": dry_run,
            "budget_s": budget,
            "root": str(ROOT),
        }
        self.log_path = out / "gpu_check.log"
        self.log_path.write_text("")

    # time ------------------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()

    def limit(self, nominal: float) -> float:
        """A limit: ``nominal`` cut to what is left of the budget and of the current step's limit."""
        return max(0.0, min(nominal, self.left(), self.step_deadline - time.monotonic()))

    # output ----------------------------------------------------------------------------------------------
    def log(self, text: str, echo: bool = True) -> None:
        if echo:
            print(text, flush=True)
        size = self.log_path.stat().st_size
        if size >= LOG_CAP:
            return
        if size + len(text) > LOG_CAP:
            text = text[: LOG_CAP - size - 100] + "\n[log cut: 15 MiB cap]\n"
        with self.log_path.open("a", errors="replace") as f:
            f.write(text + "\n")

    def add(self, step: str, kind: str, name: str, status: str, **extra) -> dict:
        row = {"step": step, "kind": kind, "name": name, "status": status, **extra}
        self.rows.append(row)
        return row

    def save(self) -> None:
        """Rewrites gpu_check.json and gpu_check.md whole, each through a temporary file and a rename."""
        self.meta["elapsed_s"] = round(self.elapsed(), 1)
        self.meta["updated_utc"] = utc()
        data = {"meta": self.meta, "rows": self.rows}
        _atomic_write(self.out / "gpu_check.json", json.dumps(data, indent=1, default=str) + "\n")
        _atomic_write(self.out / "gpu_check.md", markdown(self.meta, self.rows))

    # processes -------------------------------------------------------------------------------------------
    def run(self, jobs: list[Job], limit: float) -> None:
        """Runs the jobs side by side, each stopped (its whole process group) at ``limit`` seconds."""
        env_base = child_env(self.work)
        procs = []
        for job in jobs:
            path = self.work / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', job.name)}.out"
            handle = path.open("w")
            self.log(f"---- {job.name}: {shlex.join(job.cmd)} (limit {limit:.0f} s)", echo=False)
            started = time.monotonic()
            proc = subprocess.Popen(
                job.cmd,
                cwd=job.cwd,
                env={**env_base, **job.env},
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            procs.append((job, proc, handle, path, started))
        deadline = time.monotonic() + limit
        running = list(procs)
        while running:  # each job's time is its own, also when they run side by side
            for entry in list(running):
                job, proc, _, _, started = entry
                if proc.poll() is not None:
                    job.rc, job.seconds = proc.returncode, time.monotonic() - started
                    running.remove(entry)
            if running and time.monotonic() >= deadline:
                for job, proc, _, _, started in running:
                    job.timed_out = True
                    _kill_group(proc)
                    job.rc, job.seconds = proc.returncode, time.monotonic() - started
                running = []
            time.sleep(0.1 if running else 0)
        for job, proc, handle, path, _ in procs:
            _kill_group(proc, signal.SIGKILL)  # what a finished job left running in its group (GPU memory)
            handle.close()
            job.output = path.read_text(errors="replace")
            text = job.output
            if len(text) > JOB_LOG_CAP:
                text = text[: JOB_LOG_CAP // 4] + "\n[... cut ...]\n" + text[-(JOB_LOG_CAP * 3 // 4) :]
            self.log(
                f"---- {job.name} output (rc {job.rc}{', timed out' if job.timed_out else ''}, "
                f"{job.seconds:.1f} s)\n{text}",
                echo=False,
            )


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_text(text)
    os.replace(tmp, path)


def _kill_group(proc: subprocess.Popen, first: int = signal.SIGTERM) -> None:
    """Signals the job's whole process group (``first``, then SIGKILL after 5 s) and reaps the job."""
    for sig in (first, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=5)
            if sig == signal.SIGKILL or first == signal.SIGKILL:
                break
            time.sleep(0.5)  # the group's other processes may still be stopping: SIGKILL them next
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        proc.wait()


def child_env(work: Path) -> dict[str, str]:
    site = work / "site"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(site), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = f"{site / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONWARNINGS="ignore",
    )
    return env


def job_status(job: Job) -> str:
    if job.timed_out:
        return TIMED_OUT
    return STATUS_OK if job.rc == 0 else FAILED


# ---------------------------------------------------------------------------------------------------------
# the table and the summary


def _cell(value: object, width: int = 160) -> str:
    text = str(value).replace("|", "/").replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."


def _row_detail(row: dict) -> str:
    if "detail" in row:
        return str(row["detail"])
    if "loss_err" in row:
        tol = row["tolerance"]
        vs = row.get("vs_torch")
        extra = f"; vs torch: loss {vs['loss']:.1e}, grad {vs['grad']:.1e}" if vs else ""
        return (
            f"loss err {row['loss_err']:.1e} (tol {tol['loss']:.0e}), grad err {row['grad_err']:.1e} "
            f"(tol {tol['grad']:.0e}){extra}"
        )
    skip = {"step", "kind", "name", "status", "seconds"}
    return ", ".join(f"{k} {_fmt(v)}" for k, v in row.items() if k not in skip and not isinstance(v, (dict, list)))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(meta: dict, rows: list[dict]) -> str:
    commit = meta.get("commit", {})
    lines = [
        f"GPU check: {meta.get('device', 'device unknown')}; commit {commit.get('commit', 'unknown')}"
        f"{' (dirty)' if commit.get('dirty') else ''}; started {meta['started_utc']}; "
        f"{meta.get('elapsed_s', 0):.0f} s of a {meta['budget_s']:.0f} s budget; `{meta['command']}`"
        + ("; **dry run: no GPU numbers**" if meta["dry_run"] else ""),
        "",
        "| step | kind | check | status | s | detail |",
        "|---|---|---|---|---:|---|",
    ]
    for row in rows:
        seconds = row.get("seconds")
        lines.append(
            f"| {row['step']} | {row['kind']} | {_cell(row['name'], 90)} | {row['status']} | "
            f"{'' if seconds is None else f'{seconds:.1f}'} | {_cell(_row_detail(row))} |"
        )
    return "\n".join(lines) + "\n"


def summary(meta: dict, rows: list[dict]) -> str:
    """A compact text for the end of standard output: each step, then every row that is not ok (with
    its detail), then the key numbers; cut to stay under 10 kB."""
    steps = [r for r in rows if r["kind"] == "step"]
    counts: dict[str, int] = {}
    for r in rows:
        if r["kind"] != "step":
            counts[r["status"]] = counts.get(r["status"], 0) + 1
    commit = meta.get("commit", {})
    out = [
        "==== gpu-check summary",
        f"device {meta.get('device', 'unknown')}; commit {commit.get('commit', 'unknown')}"
        f"{' (dirty)' if commit.get('dirty') else ''}; {meta.get('elapsed_s', 0):.0f} s of {meta['budget_s']:.0f} s"
        + ("; DRY RUN" if meta["dry_run"] else ""),
    ]
    for s in steps:
        out.append(
            f"step {s['step']:2} {s['status']:9} {s.get('seconds', 0):6.1f} s  {_cell(s.get('detail', ''), 110)}"
        )
    out.append("rows: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    key = [r for r in rows if r["kind"] in ("verdict",) or r.get("key")]
    for r in key:
        if r["name"] == "versions":
            out.append(f"  versions: {_cell(_row_detail(r), 700)}")
            continue
        out.append(f"  {r['status']:9} {r['step']} {_cell(r['name'], 60)}: {_cell(_row_detail(r), 140)}")
    for r in rows:  # the benchmark's measured and failed rows, one line each
        if r["kind"] == "bench" and r["status"] != NOT_RUN:
            out.append(f"  {r['status']:9} {r['step']} {_cell(r['name'], 60)}: {_cell(_row_detail(r), 140)}")
    not_run: dict[str, int] = {}  # the benchmark's rows not run, counted by the benchmark's own status
    for r in rows:
        if r["kind"] == "bench" and r["status"] == NOT_RUN:
            why = str(r.get("bench", {}).get("status", "not run"))
            not_run[why] = not_run.get(why, 0) + 1
    if not_run:
        out.append("  bench rows not run: " + ", ".join(f"{n} {why}" for why, n in sorted(not_run.items())))
    bad = [r for r in rows if r["kind"] not in ("step", "bench") and r["status"] not in (STATUS_OK,) and r not in key]
    for r in bad:
        out.append(f"  {r['status']:9} {r['step']} {_cell(r['name'], 60)}: {_cell(_row_detail(r), 140)}")
    out.append(f"files: {meta.get('out', '')}/gpu_check.{{json,md,log}}, summary.txt, ceilings.json, bench.{{json,md}}")
    text = "\n".join(out)
    if len(text) > SUMMARY_CAP:
        text = text[: SUMMARY_CAP - 80] + "\n[summary cut at 9 kB: the rest is in gpu_check.json]"
    return text + "\n"


# ---------------------------------------------------------------------------------------------------------
# step 0


def read_commit(wheels: Path) -> dict:
    """The checkout's commit: from git where ``.git`` is here (the dry run), else the record that
    ``scripts/gpu_prepare.sh`` wrote before the copy (``.git`` does not travel), else unknown."""
    path = wheels / "COMMIT"
    recorded: dict = {}
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
        if head.returncode == 0 and status.returncode == 0:
            return {**recorded, "commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()), "source": "git"}
    if recorded:
        return {**recorded, "source": str(path)}
    return {"commit": "unknown", "dirty": None, "detail": f"no readable {path} (bash scripts/gpu_prepare.sh writes it)"}


def step_environment(c: Check, wheels: Path) -> None:
    commit = read_commit(wheels)
    c.meta["commit"] = commit
    c.add(
        "0",
        "check",
        "commit",
        STATUS_OK if commit.get("commit") != "unknown" else NOT_RUN if c.dry_run else FAILED,
        detail=f"{commit.get('commit')} dirty={commit.get('dirty')} from {commit.get('source', 'nowhere')}"
        + (f" ({commit['detail']})" if "detail" in commit else ""),
    )
    travel = ROOT / "scripts" / "travel_size.py"
    if travel.is_file() and (ROOT / ".git").exists():
        job = Job("0 travel size", [PY, str(travel), "--json"])
        c.run([job], c.limit(60))
        c.add(
            "0",
            "check",
            "travel size (scripts/travel_size.py)",
            job_status(job),
            seconds=round(job.seconds, 1),
            detail=_cell(_compact(job.output), 300),
        )
    elif "travel_size" in commit:
        recorded = commit["travel_size"]
        c.add(
            "0",
            "check",
            "travel size (recorded by gpu_prepare.sh)",
            recorded.get("status", FAILED),
            detail=_cell(_compact(recorded.get("detail", "")), 300),
        )
    else:
        c.add("0", "check", "travel size", NOT_RUN, detail="not available (no scripts/travel_size.py or no record)")
    c.save()
    if c.dry_run:
        missing = missing_wheels(wheels)
        c.add(
            "0",
            "check",
            "install carried wheels",
            NOT_RUN,
            detail="dry run installs nothing; missing here: "
            + (", ".join(p.name.split("-")[0] for p in missing) or "none"),
        )
    else:
        started = time.monotonic()
        status, detail = install_wheels(c, wheels)
        c.add(
            "0", "check", "install carried wheels", status, seconds=round(time.monotonic() - started, 1), detail=detail
        )
    c.save()
    probe_json = c.work / "probe.json"
    cmd = [
        PY,
        str(ROOT / "scripts" / "gpu_probe.py"),
        "--wheels",
        str(wheels),
        "--ceilings",
        str(c.out / "ceilings.json"),
        "--json",
        str(probe_json),
    ] + (["--cpu"] if c.dry_run else [])
    job = Job("0 probe", cmd)
    c.run([job], c.limit(LIMITS["0"]))
    try:
        probe = json.loads(probe_json.read_text())
    except (OSError, ValueError):
        c.add(
            "0",
            "check",
            "probe (scripts/gpu_probe.py)",
            job_status(job) if job.rc else FAILED,
            seconds=round(job.seconds, 1),
            detail=_cell(job.output.strip()[-300:], 300),
        )
        return
    c.meta["versions"] = probe["versions"]
    c.meta["device"] = probe["versions"].get("gpu", "no GPU (dry run)")
    for row in probe["rows"]:
        name, status = row.pop("name"), row.pop("status")
        c.add("0", "check", name, status, key=name in ("ceilings", "versions", "command -v make g++ nvcc ninja"), **row)


def _compact(output: str) -> str:
    """A JSON document printed by a tool, on one line; else its last line."""
    text = output.strip()
    try:
        return json.dumps(json.loads(text), separators=(",", ":"))
    except ValueError:
        return text.splitlines()[-1] if text else "no output"


def missing_wheels(wheels: Path) -> list[Path]:
    import importlib.metadata as md

    missing = []
    for wheel in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
        try:
            md.version(name)
        except md.PackageNotFoundError:
            missing.append(wheel)
    return missing


def install_wheels(c: Check, wheels: Path) -> tuple[str, str]:
    """Wheels of distributions the machine lacks go into WORK/site (its own versions win); the Megatron-LM
    archive is unpacked into WORK."""
    if not wheels.is_dir():
        return FAILED, f"no {wheels} (bash scripts/gpu_prepare.sh builds it; carry it with the device call)"
    missing = missing_wheels(wheels)
    notes = []
    if missing:
        job = Job(
            "0 pip install",
            [
                PY,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                "--disable-pip-version-check",
                "--target",
                str(c.work / "site"),
                *map(str, missing),
            ],
        )
        c.run([job], c.limit(60))
        if job_status(job) != STATUS_OK:
            return job_status(job), _cell(job.output.strip()[-300:], 300)
        notes.append(f"installed {len(missing)}: {', '.join(p.name.split('-')[0] for p in missing)}")
    else:
        notes.append("none missing")
    for archive in sorted(wheels.glob("megatron-lm-*.tar.gz")):
        with tarfile.open(archive) as tar:
            tar.extractall(c.work, filter="data")
        notes.append(f"unpacked {archive.name}")
    return STATUS_OK, "; ".join(notes)


# ---------------------------------------------------------------------------------------------------------
# step A


def junit_rows(path: Path) -> list[dict]:
    """One row per test case of a pytest JUnit XML file; a skipped test is a failed row."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        status, detail = STATUS_OK, ""
        for tag, label in (("failure", FAILED), ("error", FAILED), ("skipped", "SKIPPED")):
            found = case.find(tag)
            if found is not None:
                status, detail = (FAILED, f"{label}: {found.get('message', '')}")
                break
        rows.append({"name": name, "status": status, "seconds": round(float(case.get("time", 0)), 2), "detail": detail})
    return rows


def step_correctness(c: Check, limit: float) -> None:
    parity_json = c.work / "parity.jsonl"
    if c.dry_run:
        parity = Job(
            "A parity",
            [PY, "-m", "tests.gpu.check_parity", "--device", "cpu", "--shapes", "tiny", "--json", str(parity_json)],
            env={"TRITON_INTERPRET": "1"},
        )
        jobs = [parity]
    else:
        parity = Job("A parity", [PY, "-m", "tests.gpu.check_parity", "--json", str(parity_json)])
        tests = Job(
            "A gpu tests",
            [
                PY,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-m",
                "gpu",
                "tests/gpu",
                "--junitxml",
                str(c.work / "gpu_tests.xml"),
            ],
        )
        kernel_file = "tests/unit/test_triton_kernel.py"
        kernels = Job(
            "A compiled kernels",
            [
                PY,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                kernel_file,
                "--deselect",
                f"{kernel_file}::test_interpreter_tests_in_their_own_process",
                "--junitxml",
                str(c.work / "kernels.xml"),
            ],
            env={"TRITON_INTERPRET": "0", "NTL_TRITON_TESTS": "1"},
        )
        jobs = [parity, tests, kernels]
    c.run(jobs, limit)
    rows = [json.loads(line) for line in parity_json.read_text().splitlines()] if parity_json.is_file() else []
    for row in rows:
        name, status = row.pop("name"), row.pop("status")
        c.add("A", "check", name, status, key=name.split(" impl=")[0].endswith(" large"), **row)
    c.add(
        "A",
        "check",
        "parity script (tests/gpu/check_parity.py)",
        job_status(parity) if rows else FAILED,
        seconds=round(parity.seconds, 1),
        detail=f"{len(rows)} rows; rc {parity.rc}" + (" (cut at the limit)" if parity.timed_out else ""),
    )
    if c.dry_run:
        for name in ("GPU tests (pytest -m gpu tests/gpu)", "compiled kernel tests (TRITON_INTERPRET=0)"):
            c.add("A", "check", name, NOT_RUN, detail="dry run: needs a CUDA GPU")
        return
    xml = c.work / "gpu_tests.xml"
    if xml.is_file():
        for row in junit_rows(xml):
            c.add("A", "check", f"gpu test {row.pop('name')}", row.pop("status"), **row)
    else:
        c.add(
            "A",
            "check",
            "GPU tests (pytest -m gpu tests/gpu)",
            job_status(tests) if tests.rc else FAILED,
            seconds=round(tests.seconds, 1),
            detail=_cell(tests.output.strip()[-300:], 300),
        )
    xml = c.work / "kernels.xml"
    if xml.is_file():
        cases = junit_rows(xml)
        passed = sum(r["status"] == STATUS_OK for r in cases)
        skipped = sum(r["detail"].startswith("SKIPPED") for r in cases)
        failed = len(cases) - passed - skipped
        c.add(
            "A",
            "check",
            "compiled kernel tests (TRITON_INTERPRET=0)",
            STATUS_OK if passed and not (failed or skipped) else FAILED,
            seconds=round(kernels.seconds, 1),
            passed=passed,
            skipped=skipped,
            failed=failed,
            key=True,
            detail=f"{passed} passed, {skipped} skipped, {failed} failed (a skip counts as a failure)",
        )
        for row in cases:
            if row["status"] != STATUS_OK:
                c.add("A", "check", f"kernel test {row.pop('name')}", row.pop("status"), **row)
    else:
        c.add(
            "A",
            "check",
            "compiled kernel tests (TRITON_INTERPRET=0)",
            job_status(kernels) if kernels.rc else FAILED,
            seconds=round(kernels.seconds, 1),
            detail=_cell(kernels.output.strip()[-300:], 300),
        )


# ---------------------------------------------------------------------------------------------------------
# steps B and C


def bench_budget(left: float) -> float:
    """The benchmark's process limit: the time left less what D needs, but at least BENCH_MIN where there is."""
    return max(0.0, min(left, max(BENCH_MIN, left - D_RESERVE)))


def step_bench(c: Check, limit: float) -> Job:
    cmd = [
        PY,
        "benchmarks/bench_gpu.py",
        "--time-budget",
        f"{max(1.0, limit - BENCH_GRACE):.0f}",
        "--json",
        str(c.out / "bench.json"),
        "--markdown",
        str(c.out / "bench.md"),
    ]
    if (c.out / "ceilings.json").is_file():
        cmd += ["--ceilings", str(c.out / "ceilings.json")]
    if c.dry_run:
        cmd.append("--dry-run")
    job = Job("B bench", cmd)
    c.run([job], limit)
    data = _read_json(c.out / "bench.json")
    rows = data.get("rows", []) if isinstance(data, dict) else data if isinstance(data, list) else []
    for row in rows:
        if isinstance(row, dict):
            name = row.get("name") or row.get("key") or "bench row"
            if row.get("T"):
                name = f"{name} @ T={row['T']}"
            c.add("B", "bench", str(name), bench_row_status(row), detail=bench_row_detail(row), bench=row)
    detail = f"{len(rows)} rows in bench.json; rc {job.rc}" + (" (cut at the limit)" if job.timed_out else "")
    if job.rc and not job.timed_out:
        detail += "; " + _cell(job.output.strip()[-300:], 300)
    c.add(
        "B",
        "check",
        "benchmarks/bench_gpu.py",
        job_status(job) if rows or job.rc else FAILED,
        seconds=round(job.seconds, 1),
        detail=detail,
    )
    return job


def step_verdicts(c: Check) -> str:
    data = _read_json(c.out / "bench.json")
    verdicts = data.get("verdicts", []) if isinstance(data, dict) else []
    if not verdicts:
        c.add("C", "verdict", "verdicts", NOT_RUN if c.dry_run else FAILED, detail="bench.json holds no 'verdicts'")
        return FAILED
    worst = STATUS_OK
    for v in verdicts:
        if not isinstance(v, dict):
            continue
        name = str(v.get("key") or "verdict") + (f" @ T={v['T']}" if v.get("T") else "")
        status = VERDICT_STATUS.get(str(v.get("result")), FAILED)
        if status != STATUS_OK:
            worst = FAILED if status == FAILED else worst if worst == FAILED else status
        ratio = v.get("ratio")
        numbers = f"{ratio:.3f}x (limit {v.get('limit')}x)" if isinstance(ratio, (int, float)) else ""
        detail = "; ".join(x for x in (str(v.get("result", "")), numbers, str(v.get("reason") or "")) if x)
        c.add("C", "verdict", name, status, detail=detail, verdict=v)
    return worst


# bench_gpu.py's schema (ntl_scale.bench_gpu/1): a verdict's "result" and a row's "status"
VERDICT_STATUS = {"pass": STATUS_OK, "fail": FAILED, "not measured": NOT_RUN}


def bench_row_detail(row: dict) -> str:
    """One short line of a bench row: its numbers where measured, else the bench's status and reason."""
    if row.get("status") == "measured":
        parts = [f"{row['ms']:.2f} ms" if isinstance(row.get("ms"), (int, float)) else "no time"]
        for key, fmt in (("peak_mib", "{:.0f} MiB"), ("measured_over_model", "{:.2f}x model"), ("tbps", "{:.2f} TB/s")):
            if isinstance(row.get(key), (int, float)):
                parts.append(fmt.format(row[key]))
        if row.get("check_ok") is False:
            parts.append(f"WRONG VALUE: {row.get('check', '')}")
        return ", ".join(parts)
    return f"{row.get('status', '')}: {row.get('reason', '')}".rstrip(": ")


def bench_row_status(row: dict) -> str:
    """A bench row's status in this check's terms: measured and checked -> ok, a failed row or a wrong value ->
    FAILED, anything else (skipped, time budget, dry run, not reached) NOT RUN (the bench's own word is kept
    beside it as ``bench_status``)."""
    status = str(row.get("status", ""))
    if status == "measured":
        return STATUS_OK if row.get("check_ok", True) else FAILED
    if status == "failed":
        return FAILED
    return NOT_RUN


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------------------------------------------------
# step D


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def compare_with_record(rows: list[dict], record: dict) -> tuple[str, str, float]:
    """Each recorded step's ce and ntl against this run's: the largest relative difference."""
    want = {r["step"]: r for r in record["steps"]}
    got = {r["step"]: r for r in rows}
    if set(want) - set(got):
        return FAILED, f"steps {sorted(set(want) - set(got))} missing (got {sorted(got)})", math.inf
    worst = 0.0
    for step, w in want.items():
        for key in ("ce", "ntl"):
            diff = abs(got[step][key] - w[key]) / abs(w[key])
            worst = max(worst, diff) if math.isfinite(diff) else math.inf  # max() would drop a NaN
    ok = worst <= RELATIVE_TOLERANCE  # a NaN compares False
    pairs = "; ".join(f"{s}: ce {got[s]['ce']:.5f}/{want[s]['ce']:.5f}" for s in sorted(want))
    return (
        (STATUS_OK if ok else FAILED),
        f"max rel diff {worst:.2e} (tol {RELATIVE_TOLERANCE:.0e}); GPU/CPU {pairs}",
        worst,
    )


def finite_and_falling(values: list[float]) -> tuple[bool, str]:
    """All finite, and the mean of the last third below the mean of the first third."""
    if len(values) < 2:
        return False, f"{len(values)} values"
    if not all(math.isfinite(v) for v in values):
        return False, f"not finite: {values}"
    third = max(1, len(values) // 3)
    first, last = sum(values[:third]) / third, sum(values[-third:]) / third
    return last < first, f"{first:.4f} -> {last:.4f} (first/last third of {len(values)} values)"


NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"


def megatron_losses(output: str) -> list[tuple[int, float, float | None]]:
    """(iteration, lm loss, ntl loss) from Megatron's training log lines."""
    found = []
    for line in output.splitlines():
        it = re.search(r"iteration\s+(\d+)/", line)
        lm = re.search(rf"lm loss: {NUMBER}", line)
        if it and lm:
            ntl = re.search(rf"ntl loss: {NUMBER}", line)
            found.append((int(it.group(1)), float(lm.group(1)), float(ntl.group(1)) if ntl else None))
    return found


def hf_losses(output: str) -> list[tuple[int, float, float, float]]:
    """(step, loss, ce, ntl) of the example's 'first log' and 'last log' lines."""
    pattern = rf"(?:first|last) log: step (\d+), loss {NUMBER}, ce {NUMBER}, ntl {NUMBER}"
    return [(int(m[0]), float(m[1]), float(m[2]), float(m[3])) for m in re.findall(pattern, output)]


def train_job(name: str, run_dir: Path, overrides: list[str]) -> Job:
    return Job(name, [PY, "launch/train.py", *TRAIN_ARGS, f"run_dir={run_dir}", *overrides])


def megatron_job(c: Check) -> Job | None:
    checkout = next(iter(sorted(c.work.glob("Megatron-LM-*"))), None)
    if checkout is None:
        return None
    numbers = c.work / "numbers.json"
    sys.path.insert(0, str(ROOT))
    from ntl_scale import NumberVocab  # the NullTokenizer's digits are ids 48-57

    table = {i: (str(i - 48) if 48 <= i < 58 else f"w{i}") for i in range(127)}
    NumberVocab.from_id_to_token(table, vocab_size=128).save(str(numbers))
    args = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 4 --global-batch-size 8 --train-iters 20 --lr 1e-3 --lr-decay-style constant "
        "--vocab-size 127 --make-vocab-size-divisible-by 64 --transformer-impl local --tensor-model-parallel-size 1 "
        "--no-gradient-accumulation-fusion --no-bias-gelu-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion "
        "--no-rope-fusion --no-persist-layer-norm --attention-dropout 0 --hidden-dropout 0 --log-interval 2 "
        "--seed 1234 --mock-data --tokenizer-type NullTokenizer --split 100,0,0 --eval-iters 0 --eval-interval 1000 "
        f"--ntl-weight 0.3 --ntl-number-vocab {numbers}"
    ).split()
    cmd = [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        str(ROOT / "scripts" / "megatron_prebuilt_helpers.py"),
        *args,
    ]
    return Job(
        "D megatron", cmd, env={"MEGATRON_LM_PATH": str(checkout), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}, cwd=checkout
    )


def step_training(c: Check, limit: float) -> None:
    record = _read_json(REFERENCE)
    if not isinstance(record, dict) or len(record.get("steps", [])) != 5:
        c.add(
            "D",
            "check",
            "CPU record (tests/gpu/reference/train_tiny_fp32.json)",
            FAILED,
            detail="missing or not 5 steps",
        )
        record = None
    else:
        finite = all(math.isfinite(s["ce"]) and math.isfinite(s["ntl"]) for s in record["steps"])
        c.add(
            "D",
            "check",
            "CPU record (tests/gpu/reference/train_tiny_fp32.json)",
            STATUS_OK if finite else FAILED,
            detail=f"5 steps recorded {record.get('recorded_utc')} on {record.get('machine')}, "
            f"torch {record.get('torch')}",
        )
    names = (
        "train.py fp32 5 steps vs CPU record",
        "train.py bf16 20 steps",
        "HF Trainer chunked bf16",
        "Megatron-LM TP 1 mock data",
    )
    if c.dry_run:
        for name in names:
            c.add("D", "check", name, NOT_RUN, detail="dry run: needs a CUDA GPU")
        return
    fp32_dir, bf16_dir = c.work / "train_fp32", c.work / "train_bf16"
    jobs = [
        train_job("D train fp32", fp32_dir, []),
        train_job("D train bf16", bf16_dir, ["train.steps=20", "train.bf16=true", "train.log_every=5"]),
        Job(
            "D hf trainer",
            [
                PY,
                "examples/hf_trainer_ntl.py",
                "--chunked",
                "--bf16",
                "--max-steps",
                "20",
                "--examples",
                "256",
                "--output-dir",
                str(c.work / "hf_trainer"),
            ],
        ),
    ]
    mlm = megatron_job(c)
    c.run(jobs + ([mlm] if mlm else []), limit)
    fp32, bf16, hf = jobs
    if record is not None:
        status, detail, worst = compare_with_record(metrics(fp32_dir), record)
        c.add(
            "D",
            "check",
            names[0],
            status if fp32.rc == 0 or status == FAILED else job_status(fp32),
            seconds=round(fp32.seconds, 1),
            max_rel_diff=worst,
            key=True,
            detail=_tail_if(fp32, detail),
        )
    sys.path.insert(0, str(ROOT))
    from ntl_scale.normalization import objective_of_means  # a row leaves out a mean of no tokens

    rows = metrics(bf16_dir)
    ok, detail = finite_and_falling([objective_of_means(r, 0.3) for r in rows])
    c.add(
        "D",
        "check",
        names[1],
        STATUS_OK if ok and len(rows) == 20 else (job_status(bf16) if bf16.rc else FAILED),
        seconds=round(bf16.seconds, 1),
        key=True,
        detail=_tail_if(bf16, f"{len(rows)} steps; ce + 0.3 ntl {detail}"),
    )
    logged = hf_losses(hf.output)
    ok, detail = finite_and_falling([loss for _, loss, _, _ in logged])
    c.add(
        "D",
        "check",
        names[2],
        STATUS_OK if ok and hf.rc == 0 else (job_status(hf) if hf.rc else FAILED),
        seconds=round(hf.seconds, 1),
        key=True,
        detail=_tail_if(hf, f"loss {detail}; logged {logged}"),
    )
    if mlm is None:
        c.add(
            "D", "check", names[3], FAILED, detail="no Megatron-LM tree (carry .gpu_wheels with megatron-lm-*.tar.gz)"
        )
        return
    losses = megatron_losses(mlm.output)
    ok, detail = finite_and_falling([lm for _, lm, _ in losses])
    ntl = [n for _, _, n in losses if n is not None]
    reported = bool(ntl) and all(math.isfinite(n) for n in ntl)
    c.add(
        "D",
        "check",
        names[3],
        STATUS_OK if ok and reported and mlm.rc == 0 else (job_status(mlm) if mlm.rc else FAILED),
        seconds=round(mlm.seconds, 1),
        key=True,
        detail=_tail_if(
            mlm,
            f"lm loss {detail}; ntl loss "
            + ("reported: " + ", ".join(f"{n:.3f}" for n in ntl[:10]) if ntl else "NOT reported"),
        ),
    )


def _tail_if(job: Job, detail: str) -> str:
    if job.rc == 0 and not job.timed_out:
        return detail
    return f"{detail}; rc {job.rc}{' (timed out)' if job.timed_out else ''}: " + _cell(job.output.strip()[-240:], 240)


# ---------------------------------------------------------------------------------------------------------


def record_cpu_reference(work: Path) -> int:
    """Runs step D's fp32 command on this CPU and writes tests/gpu/reference/train_tiny_fp32.json."""
    import platform

    import torch

    run_dir = work / "record_cpu"
    job = train_job("record", run_dir, [])
    env = {**child_env(work), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(job.cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:])
        return done.returncode
    steps = [{k: r[k] for k in ("step", "ce", "ntl", "grad_norm", "lr", "tokens")} for r in metrics(run_dir)]
    record = {
        "what": "launch/train.py, one process, the tiny config in fp32 for 5 steps: step D of scripts/gpu_check.py "
        "runs the same arguments on the GPU and compares ce and ntl per step (relative difference <= 1e-3)",
        "command": f"python launch/train.py {shlex.join(TRAIN_ARGS)} run_dir=RUN_DIR",
        "recorded_with": "python scripts/gpu_check.py --record-cpu-reference",
        "recorded_utc": utc(),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "steps": steps,
    }
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    REFERENCE.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {REFERENCE.relative_to(ROOT)}: {len(steps)} steps")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bash scripts/gpu_check.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="output folder (created; at most 7 files come back from it)")
    parser.add_argument("--dry-run", action="store_true", help="what a CPU machine can do (automatic without CUDA)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds for all steps (default 420)")
    parser.add_argument(
        "--wheels",
        default=os.environ.get("GPU_WHEELS_DIR", str(ROOT / ".gpu_wheels")),
        help="the carried wheel folder (default .gpu_wheels)",
    )
    parser.add_argument(
        "--work",
        default=os.environ.get("GPU_CHECK_DIR", "/tmp/ntl_scale_gpu_check"),
        help="scratch folder (runs, installed wheels), not returned",
    )
    parser.add_argument("--record-cpu-reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.record_cpu_reference:
        return args
    if not args.out:
        parser.error("--out DIR is required (on the device: --out $OUT)")
    if not (0 < args.budget <= 3600):
        parser.error(f"--budget {args.budget:g}: expected seconds in (0, 3600], e.g. --budget 420")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.record_cpu_reference:
        return record_cpu_reference(work)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in (
        "gpu_check.json",
        "gpu_check.md",
        "gpu_check.log",
        "summary.txt",
        "ceilings.json",
        "bench.json",
        "bench.md",
    ):
        (out / stale).unlink(missing_ok=True)
    steps_dir = work / "steps"
    if steps_dir.exists():
        subprocess.run(["rm", "-rf", str(steps_dir)], check=False)
    steps_dir.mkdir(parents=True)
    import torch

    dry_run = args.dry_run or not torch.cuda.is_available()
    c = Check(out, steps_dir, args.budget, dry_run, argv)
    c.meta["out"] = str(out)
    if dry_run and not args.dry_run:
        c.log("gpu-check: no CUDA GPU visible to torch here: a dry run (GPU-only rows say NOT RUN)")
    c.log(f"gpu-check: budget {args.budget:.0f} s; out {out}; work {steps_dir}; dry run {dry_run}")
    wheels = Path(args.wheels).resolve()
    (steps_dir / "site").mkdir(exist_ok=True)
    c.work = steps_dir

    def step(name: str, nominal: float, body) -> None:
        limit = c.limit(nominal)
        if limit < MIN_STEP:
            c.add(
                name,
                "step",
                f"step {name}",
                NOT_RUN,
                seconds=0.0,
                detail=f"budget: {max(0.0, c.left()):.0f} s left of {c.budget:.0f} s, a step needs {MIN_STEP:.0f} s",
            )
            c.save()
            c.log(f"==== step {name}: NOT RUN (budget)")
            return
        c.log(f"==== step {name} (limit {limit:.0f} s, {c.left():.0f} s left)")
        started, first = time.monotonic(), len(c.rows)
        c.step_deadline = started + limit
        try:
            body(limit)
            statuses = {r["status"] for r in c.rows[first:]}
            status = next((s for s in (TIMED_OUT, FAILED, "SKIPPED") if s in statuses), STATUS_OK)
            detail = f"{len(c.rows) - first} rows" + (
                f", {sum(r['status'] == NOT_RUN for r in c.rows[first:])} not run" if NOT_RUN in statuses else ""
            )
        except Exception as e:  # the orchestrator's own error: the step fails, the next runs
            status, detail = FAILED, f"gpu_check error: {type(e).__name__}: {e}"[:300]
        seconds = time.monotonic() - started
        c.step_deadline = math.inf
        c.add(name, "step", f"step {name}", status, seconds=round(seconds, 1), limit_s=round(limit), detail=detail)
        c.save()
        c.log(f"==== step {name}: {status} in {seconds:.1f} s ({detail})")

    step("0", LIMITS["0"], lambda limit: step_environment(c, wheels))
    step("A", LIMITS["A"], lambda limit: step_correctness(c, limit))
    bench_ran = {"job": None}
    step("B", bench_budget(c.left()), lambda limit: bench_ran.update(job=step_bench(c, limit)))
    if bench_ran["job"] is None:
        c.add("C", "step", "step C", NOT_RUN, seconds=0.0, detail="the benchmark did not run")
        c.save()
    else:
        step("C", MIN_STEP, lambda limit: step_verdicts(c))
    step("D", LIMITS["D"], lambda limit: step_training(c, limit))
    c.meta["finished_utc"] = utc()
    c.meta["complete"] = True
    c.save()
    text = summary(c.meta, c.rows)
    _atomic_write(out / "summary.txt", text)
    c.log(text, echo=False)
    print(text, end="", flush=True)
    budget_cut = any(r["status"] == NOT_RUN and str(r.get("detail", "")).startswith("budget") for r in c.rows)
    bad = any(r["status"] in (FAILED, TIMED_OUT) for r in c.rows)
    return 1 if bad or budget_cut else 0


if __name__ == "__main__":
    sys.exit(main())
