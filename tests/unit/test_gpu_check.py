"""``bash scripts/gpu_check.sh`` on the CPU, so that GPU minutes are never lost to a typo (issue 39, item 3).

1. The dry run end to end (``--dry-run``; the same without CUDA): the output folder's layout (at most 8 files,
   each under 16 MiB), one JSON of every row with steps 0, A, B, C, D in order, the parity rows run on the CPU
   and passing, the GPU-only rows NOT RUN, the Markdown table, the log, and the summary last on standard output
   (under 10 kB, also in ``summary.txt``).
2. Budget cuts: a budget too small for any step marks every step NOT RUN (valid JSON, exit 1); a job over its
   limit is killed with its whole process group and reported TIMED OUT; the benchmark's share of the time.
3. The comparisons step D and A make, against inputs built here: the CPU record (equal, off by 2e-3, NaN,
   missing steps), finite-and-falling, Megatron's and the HF example's log lines, pytest's JUnit XML (a skip is
   a failure), the dense float64 reference against the naive one, and a parity case that must fail on a wrong op.
4. ``scripts/megatron_prebuilt_helpers.py`` stands in for Megatron's ``compile_helpers`` without running ``make``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
OUT_FILES = {"gpu_check.log", "gpu_check.json", "gpu_check.md", "summary.txt", "ceilings.json"}
OUT_FILES |= {"bench.json", "bench.md"}


def _module(name: str, path: Path):
    return load_script(str(path.relative_to(ROOT)), name)


gpu_check = _module("gpu_check_script", ROOT / "scripts" / "gpu_check.py")


def _run(args: list[str], work: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DIR": str(work), "PYTHONWARNINGS": "ignore"}
    cmd = ["bash", str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _rows(out: Path) -> tuple[dict, list[dict]]:
    data = json.loads((out / "gpu_check.json").read_text())
    return data["meta"], data["rows"]


def test_dry_run_layout_rows_and_summary(tmp_path):
    out = tmp_path / "out"
    started = time.monotonic()
    done = _run(["--out", str(out), "--dry-run"], tmp_path / "work")
    seconds = time.monotonic() - started
    names = {p.name for p in out.iterdir()}
    assert names <= OUT_FILES and {"gpu_check.log", "gpu_check.json", "gpu_check.md", "summary.txt"} <= names, names
    assert len(names) <= 8 and all((out / n).stat().st_size < 16 << 20 for n in names)
    meta, rows = _rows(out)
    assert meta["dry_run"] and meta["complete"] and meta["budget_s"] == 420
    steps = [r for r in rows if r["kind"] == "step"]
    assert [s["step"] for s in steps] == ["0", "A", "B", "C", "D"], steps
    order = [r["step"] for r in rows]
    assert order == sorted(order, key="0ABCD".index), order  # rows appear in step order
    by_name = {r["name"]: r for r in rows}
    # step 0: the probe ran here (versions, tools, a CPU ceiling labelled as such, the file the bench reads)
    assert "torch" in by_name["versions"]["detail"] and "make:" in by_name["command -v make g++ nvcc ninja"]["detail"]
    ceilings = json.loads((out / "ceilings.json").read_text())
    assert ceilings["device"].startswith("cpu (dry run") and ceilings["copy_tbps"] > 0 and ceilings["matmul_tflops"] > 0
    # step A: the parity script ran on the CPU, both ops, both impls where Triton's interpreter exists, all passing
    parity = [r for r in rows if r["step"] == "A" and "loss_err" in r]
    assert len(parity) >= 14 and all(r["status"] == "ok" for r in parity), [r for r in parity if r["status"] != "ok"]
    assert {"ce_with_ntl", "linear_ce_with_ntl"} == {r["name"].split()[0] for r in parity}
    assert any("in place" in r["name"] for r in parity) and any("mse+reweigh" in r["name"] for r in parity)
    for name in ("GPU tests (pytest -m gpu tests/gpu)", "compiled kernel tests (TRITON_INTERPRET=0)"):
        assert by_name[name]["status"] == "NOT RUN"
    assert [r["status"] for r in rows if r["step"] == "D" and r["kind"] == "check"][1:] == ["NOT RUN"] * 4
    assert by_name["CPU record (tests/gpu/reference/train_tiny_fp32.json)"]["status"] == "ok"
    # the table has every row; the log has every step; the summary is last on stdout, short, and saved
    table = (out / "gpu_check.md").read_text()
    assert all(r["name"].replace("|", "/")[:80] in table for r in rows)
    log = (out / "gpu_check.log").read_text()
    assert all(f"==== step {s}" in log for s in "0ABCD")
    summary = (out / "summary.txt").read_text()
    assert done.stdout.endswith(summary) and summary.startswith("==== gpu-check summary")
    assert len(summary.encode()) < 10_000
    assert done.returncode == 0, summary
    assert {"bench.json", "bench.md"} <= names
    bench = json.loads((out / "bench.json").read_text())
    bench_rows = [r for r in rows if r["kind"] == "bench"]
    assert len(bench_rows) == len(bench["rows"]) > 0  # every planned row, in the bench's order
    assert [r["bench"]["key"] for r in bench_rows] == [r["key"] for r in bench["rows"]]
    assert bench_rows[0]["bench"]["group"] == "ours"  # ours first: a cut run loses the peers, not ours
    assert all(r["status"] == "NOT RUN" and "dry run" in r["detail"] for r in bench_rows)
    verdicts = [r for r in rows if r["kind"] == "verdict"]
    assert len(verdicts) == len(bench["verdicts"]) > 0
    assert all(r["status"] == "NOT RUN" and r["detail"].startswith("not measured") for r in verdicts)  # never passed
    assert f"bench rows not run: {len(bench_rows)} not run (dry run)" in summary
    assert seconds < 120


def test_a_budget_too_small_runs_no_step_and_still_writes_everything(tmp_path):
    out = tmp_path / "out"
    done = _run(["--out", str(out), "--dry-run", "--budget", "5"], tmp_path / "work", timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    meta, rows = _rows(out)
    steps = {r["step"]: r for r in rows if r["kind"] == "step"}
    assert list(steps) == ["0", "A", "B", "C", "D"]
    assert all(s["status"] == "NOT RUN" for s in steps.values()), steps
    assert all(steps[s]["detail"].startswith("budget") for s in "0ABD") and meta["complete"]
    assert done.stdout.endswith((out / "summary.txt").read_text()) and "NOT RUN" in done.stdout


def test_arguments_are_checked(tmp_path):
    done = _run(["--out", str(tmp_path), "--budget", "-1"], tmp_path / "work", timeout=60)
    assert done.returncode == 2 and "--budget -1" in done.stderr
    done = _run(["--out", str(tmp_path), "--no-such-flag"], tmp_path / "work", timeout=60)
    assert done.returncode == 2 and "unrecognized arguments: --no-such-flag" in done.stderr


def test_a_job_over_its_limit_is_killed_with_its_children_and_reported(tmp_path):
    check = gpu_check.Check(tmp_path, tmp_path, budget=60, dry_run=True, argv=[])
    pid_file = tmp_path / "child.pid"
    job = gpu_check.Job("sleeper", ["bash", "-c", f"sleep 30 & echo $! > {pid_file}; echo started; wait"])
    started = time.monotonic()
    check.run([job], limit=1.5)
    assert time.monotonic() - started < 10
    assert job.timed_out and gpu_check.job_status(job) == "TIMED OUT" and "started" in job.output
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    check.add("A", "check", "sleeper", gpu_check.job_status(job), detail="x | y")
    check.save()
    assert json.loads((tmp_path / "gpu_check.json").read_text())["rows"][0]["status"] == "TIMED OUT"
    assert not list(tmp_path.glob(".*.part")) and "x / y" in (tmp_path / "gpu_check.md").read_text()


def test_limits_are_cut_to_what_is_left():
    assert gpu_check.bench_budget(330) == 210  # leaves D its reserve
    assert gpu_check.bench_budget(200) == 150  # but takes at least 150 s where there is
    assert gpu_check.bench_budget(90) == 90 and gpu_check.bench_budget(-5) == 0
    check = gpu_check.Check.__new__(gpu_check.Check)
    check.budget, check.start, check.step_deadline = 100.0, time.monotonic() - 40, math.inf
    assert 59 < check.limit(75) <= 60 and check.limit(10) == 10
    check.step_deadline = time.monotonic() + 5
    assert 4 < check.limit(75) <= 5


def _record(values):
    return {"steps": [{"step": i + 1, "ce": ce, "ntl": ntl} for i, (ce, ntl) in enumerate(values)]}


def test_the_fp32_run_is_compared_with_the_cpu_record():
    record = json.loads(gpu_check.REFERENCE.read_text())
    steps = record["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5] and all(math.isfinite(s["ce"]) for s in steps)
    assert record["command"].startswith("python launch/train.py " + " ".join(gpu_check.TRAIN_ARGS))
    same = [dict(s) for s in steps]
    assert gpu_check.compare_with_record(same, record)[0] == "ok"
    off = [dict(s) for s in steps]
    off[3]["ntl"] *= 1 + 2e-3
    status, detail, worst = gpu_check.compare_with_record(off, record)
    assert status == "FAILED" and worst == pytest.approx(2e-3, rel=1e-6) and "tol 1e-03" in detail
    nan = [dict(s) for s in steps]
    nan[0]["ce"] = float("nan")
    assert gpu_check.compare_with_record(nan, record)[0] == "FAILED"
    assert gpu_check.compare_with_record(same[:4], record)[0] == "FAILED"


def test_finite_and_falling():
    assert gpu_check.finite_and_falling([5.0, 4.0, 4.5, 3.0, 2.0, 2.5])[0]
    assert not gpu_check.finite_and_falling([5.0, 4.0, float("nan"), 3.0])[0]
    assert not gpu_check.finite_and_falling([3.0, 3.5, 4.0, 4.5])[0]
    assert not gpu_check.finite_and_falling([3.0])[0]


def test_log_lines_are_parsed():
    # a line of Megatron-LM core_v0.19.0's own log (scripts/megatron_prebuilt_helpers.py under
    # tests/helpers/megatron_lm_cpu.py with the step's arguments), then one with a NaN NTL
    megatron = (
        " [2026-11-27 08:09:59.340864] iteration        2/      20 | consumed samples:           16 | elapsed"
        " time per iteration (ms): 3013.5 | learning rate: 1.000000E-03 | global batch size:     8 | lm loss:"
        " 4.806580E+00 | ntl loss: 3.020799E+00 | number accuracy: 0.000000E+00 | loss scale: 1.0 | grad norm:"
        " 1.712 | number of skipped iterations:   0 | number of nan iterations:   0 |"
        "\n [2026-11-27 08:10:00] iteration        4/      20 | lm loss: 4.1E+00 | ntl loss: nan |\n"
    )
    first, second = gpu_check.megatron_losses(megatron)
    assert first == (2, 4.80658, 3.020799) and second[:2] == (4, 4.1) and math.isnan(second[2])
    hf = "first log: step 5, loss 4.1000, ce 3.2000, ntl 2.9000\nlast log: step 20, loss 2.0, ce 1.5, ntl 1.6\n"
    assert gpu_check.hf_losses(hf) == [(5, 4.1, 3.2, 2.9), (20, 2.0, 1.5, 1.6)]


def test_junit_rows_count_a_skip_as_a_failure(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\ndef test_pass():\n    pass\ndef test_skip():\n    pytest.skip('no gpu')\n"
        "def test_fail():\n    assert 0\n"
    )
    xml = tmp_path / "r.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_three.py"),
                    "--junitxml", str(xml)], cwd=tmp_path, capture_output=True)  # fmt: skip
    rows = {r["name"].split("::")[1]: r for r in gpu_check.junit_rows(xml)}
    assert rows["test_pass"]["status"] == "ok"
    assert rows["test_skip"]["status"] == "FAILED" and rows["test_skip"]["detail"].startswith("SKIPPED")
    assert rows["test_fail"]["status"] == "FAILED"


def test_dense_reference_equals_the_naive_one():
    import ntl_scale
    from tests.helpers.reference import dense_per_token, naive_per_token

    vocab = ntl_scale.NumberVocab.from_id_to_token({20 + d: str(d) for d in range(10)}, vocab_size=57)
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 57, (23,), generator=g)
    labels = torch.where(torch.rand(23, generator=g) < 0.5, 20 + labels % 10, labels)
    labels[[0, 5]] = -100
    logits = 3 * torch.randn(23, 57, generator=g, dtype=torch.float64)
    for options in ({}, {"loss": "mse"}, {"reweigh": True}, {"loss": "mse", "reweigh": True}):
        got = dense_per_token(logits, labels, vocab.ids, vocab.values, **options)
        want = naive_per_token(logits, labels, vocab, **options)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ulps", [0, 1, -1])
def test_a_parity_case_fails_when_the_op_is_wrong(monkeypatch, ulps):
    """A loss 1e-4 off is FAILED, and its loss_err is 1e-4 within what fp32 rounding allows: the case's own error
    against float64 ``e0`` (measured on the unperturbed loss) plus the two roundings of the perturbation (the
    factor and the product, eps each at most). ``ulps``: the op's fp32 loss moved by that many units first, as
    another machine's summation order moves it (issue 51, item 6: ``pytest.approx(1e-4, rel=1e-3)``, +-1e-7,
    failed on every run where the fp32 loss was 1e-7 off float64)."""
    parity = _module("check_parity_script", ROOT / "tests" / "gpu" / "check_parity.py")
    rows = parity.check_case("tiny", "fp32", "fused", "mse+reweigh", False, impls=["torch"], device="cpu")
    assert [r["status"] for r in rows] == ["ok"] and rows[0]["loss_err"] < 1e-6
    real = parity.ntl_scale.ce_with_ntl
    eps, delta = torch.finfo(torch.float32).eps, 1e-4
    factor = {"by": 1.0}

    def off(*args, **kwargs):  # the loss times (1 + ulps eps), then times factor: a 1e-4 error, its gradient too
        out = real(*args, **kwargs)
        return out._replace(loss=out.loss * (1 + ulps * eps) * factor["by"])

    monkeypatch.setattr(parity.ntl_scale, "ce_with_ntl", off)
    (clean,) = parity.check_case("tiny", "fp32", "fused", "was", False, impls=["torch"], device="cpu")
    assert clean["status"] == "ok"
    e0 = clean["loss_err"]
    factor["by"] = 1 + delta
    rows = parity.check_case("tiny", "fp32", "fused", "was", False, impls=["torch"], device="cpu")
    assert rows[0]["status"] == "FAILED"
    assert abs(rows[0]["loss_err"] - delta) <= (e0 + eps) * (1 + 2 * delta), (rows[0]["loss_err"], e0)


def test_megatron_helpers_come_prebuilt_without_make(monkeypatch):
    pytest.importorskip("megatron.core")
    wrapper = _module("megatron_prebuilt_helpers", ROOT / "scripts" / "megatron_prebuilt_helpers.py")
    import megatron.core.datasets.utils as utils

    def no_make(*args, **kwargs):
        raise AssertionError(f"make was run: {args}")

    monkeypatch.setattr(subprocess, "run", no_make)
    monkeypatch.setattr(utils, "compile_helpers", wrapper.import_prebuilt_helpers)
    from megatron.core.datasets.utils import compile_helpers  # as initialize._compile_dependencies looks it up

    compile_helpers()  # imports the prebuilt helpers_cpp of the installed megatron-core
    import megatron.core.datasets.helpers_cpp as helpers

    assert hasattr(helpers, "build_sample_idx_int32")


def test_the_benchmark_s_rows_and_verdicts_are_read_in_its_own_terms(tmp_path):
    """bench_gpu.py's schema: a row's status ``measured`` with a wrong value, a verdict's ``result``."""
    (tmp_path / "out").mkdir()
    (tmp_path / "work").mkdir()
    c = gpu_check.Check(tmp_path / "out", tmp_path / "work", 100.0, False, [])
    measured = {"key": "ce", "name": "F.cross_entropy", "T": 8192, "status": "measured", "ms": 3.25, "peak_mib": 900.0}
    wrong = {**measured, "key": "ours", "name": "ours", "check_ok": False, "check": "loss 1% off"}
    skipped = {"key": "liger", "name": "Liger", "T": 8192, "status": "skipped", "reason": "not installed"}
    assert gpu_check.bench_row_status(measured) == "ok" and "3.25 ms, 900 MiB" in gpu_check.bench_row_detail(measured)
    assert gpu_check.bench_row_status(wrong) == "FAILED" and "WRONG VALUE" in gpu_check.bench_row_detail(wrong)
    assert gpu_check.bench_row_status(skipped) == "NOT RUN" and "not installed" in gpu_check.bench_row_detail(skipped)
    verdicts = [
        {"key": "fused_vs_megatron", "T": 8192, "result": "pass", "ratio": 1.01, "limit": 1.05},
        {"key": "chunked_vs_peers", "T": 8192, "result": "not measured", "reason": "no chunked peer ran"},
    ]
    (c.out / "bench.json").write_text(json.dumps({"rows": [measured], "verdicts": verdicts}))
    assert gpu_check.step_verdicts(c) == "NOT RUN"  # a verdict not measured is never a pass
    verdicts.append({"key": "fused_vs_megatron", "T": 16384, "result": "fail", "ratio": 1.2, "limit": 1.05})
    (c.out / "bench.json").write_text(json.dumps({"rows": [measured], "verdicts": verdicts}))
    assert gpu_check.step_verdicts(c) == "FAILED"
    rows = [r for r in c.rows if r["kind"] == "verdict"]
    assert [r["status"] for r in rows[-3:]] == ["ok", "NOT RUN", "FAILED"]
    assert rows[-1]["name"] == "fused_vs_megatron @ T=16384" and "1.200x (limit 1.05x)" in rows[-1]["detail"]
