"""``benchmarks/bench_gpu.py`` where CI runs (no GPU), so that the GPU minutes are never lost to a typo.

1. The dry run (``--dry-run``, and without CUDA): the JSON and Markdown layout, every planned row
   ``not run (dry run)`` with the cost model's prediction, the row order (ours first, 16k after the 8k eager
   rows, compiled last), the ceilings file read or its absence stated, under 20 s.
2. The verdicts on synthetic timings, against the rules worked by hand: a 1.06x fused row fails, 1.05x
   passes, a missing peer gives "not measured", memory counts, a wrong value fails.
3. The time budget: a row whose estimate exceeds what is left is not started and says why (the dry run's
   schedule and a real run with no budget). Sections 1 and 3 read the same dry run (60 s budget, both sizes).
4. Writing: atomic (a failed write leaves the old file and no temporary one; a reader polling a running
   benchmark only ever reads valid JSON), and a run killed mid-way keeps its finished rows.
5. ``--smoke``: every row's code runs on the CPU at tiny size (Triton rows under the interpreter),
   each partner CE with and without NTL alone beside it; no row fails, and every value agrees with the CE
   and NTL-WAS computed from the definitions and with ntloss.
   A chunked peer that warns it took another path (torch's, with label smoothing) is not counted as chunked.
6. Arguments: bad ones are refused with the reason (exit 2).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_gpu.py"
bg = load_script("benchmarks/bench_gpu.py", "bench_gpu")


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)  # fmt: skip


def _table(markdown: str) -> list[list[str]]:
    """The Markdown's row table: cells of the lines that start with a row number."""
    rows = []
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0].isdigit():
            rows.append(cells)
    return rows


# ------------------------------------------------------------------ 1. the dry run


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One dry run at both sizes and a 60 s budget (read, never written, by sections 1 and 3): its folder."""
    out = tmp_path_factory.mktemp("dry_run") / "out"
    done = _run(["--dry-run", "--time-budget", "60", "--json", str(out / "bench.json"), "--markdown",
                 str(out / "bench.md"), "--ceilings", str(out.parent / "absent.json"),
                 "--tokens", "8192,16384"])  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr  # (its speed is no test's business: a loaded machine)
    return out


def test_dry_run_layout_and_order(dry_run):
    out_json, out_md = dry_run / "bench.json", dry_run / "bench.md"
    report = json.loads(out_json.read_text())
    assert report["schema"] == "ntl_scale.bench_gpu/1" and report["mode"] == "dry run"
    assert report["ceilings"] is None and "absent" in report["ceilings_source"]
    rows = report["rows"]
    assert {r["status"] for r in rows} == {"not run (dry run)"}
    # the order: at each T ours, then the peers; both sizes' eager rows before any compiled row, the late rows last
    groups = [(r["group"], r["T"]) for r in rows]
    eager = [g for g in groups if g[0] not in ("compiled", "late")]
    assert eager == sorted(eager, key=lambda g: (g[1], g[0] != "ours")), eager
    late = [g for g in groups if g[0] == "late"]
    assert groups[: len(eager)] == eager and groups[len(groups) - len(late) :] == late and late
    assert {g[0] for g in groups[len(eager) : len(groups) - len(late)]} == {"compiled"}
    assert rows[0]["key"] == "ours_logits_triton" and rows[0]["T"] == 8192
    # a compile is charged at every T (a new shape compiles again); our kernels' compile once, first
    compiled = [r for r in rows if r["group"] == "compiled" and "not installed" not in r["reason"]]
    assert compiled and all(r["estimate_s"] >= 45 for r in compiled), compiled
    assert rows[0]["estimate_s"] > 15 > rows[1]["estimate_s"]
    keys8k = [r["key"] for r in rows if r["T"] == 8192]
    by_key = {r["key"]: r for r in rows if r["T"] == 8192}
    for key in ("ours_logits_triton", "ours_logits_triton_inplace", "ours_logits_torch", "ours_chunked_triton",
                "ours_chunked_torch", "liger", "cce", "cce_exact", "torch_linear_ce", "megatron", "ce", "ce_ntloss",
                "megatron_jit", "compiled_ce", "cce_autotune", "kernel_stats", "kernel_grad"):  # fmt: skip
        assert key in keys8k, key
    # each partner CE with and without NTL alone beside it (issue 54), the add-on row right after its partner
    for partner in ("liger", "cce_exact", "torch_linear_ce", "megatron", "ce"):
        at = keys8k.index(partner + "_ntl")
        assert keys8k[at - 1] == partner and by_key[partner + "_ntl"]["ntl_weight"] == 0.3, partner
        assert by_key[partner]["ntl_weight"] is None and by_key[partner + "_ntl"]["family"] == "addon"
    for key in ("ours_logits_triton", "ours_logits_torch", "ours_chunked_triton", "ours_chunked_torch"):
        weights = {r["ntl_weight"] for r in rows if r["key"] in (key, key + "_w0")}
        assert weights == {0.3, 0.0}, key  # each of ours also at NTL weight 0
    # the cost model beside the rows it models, for the GPU shape (bf16 logits of 8192 x 128256: the
    # statistics kernel reads them once, 2.1 GB; CE alone on materialised logits costs 15.96 GB, 27.99 ms)
    by = {(r["key"], r["T"]): r for r in rows}
    assert by["kernel_stats", 8192]["model"]["bytes"] >= 2 * 8192 * 128256
    assert by["ce", 8192]["model"]["floor"] and by["ce", 8192]["model"]["bytes"] == pytest.approx(15.96e9, rel=1e-3)
    assert by["ce", 16384]["model"]["ms_h100_datasheet"] > by["ce", 8192]["model"]["ms_h100_datasheet"]
    assert by["ours_logits_torch", 8192]["model"] is None
    # the on-chip fused linear CE + NTL (issue 43): its own model, not the floor: the backward recomputes the
    # logits (8 T V H FLOPs and the number columns' 6 T K H)
    on_chip = by["ours_linear_on_chip", 8192]["model"]
    assert on_chip["path"] == "ce_ntl_on_chip" and not on_chip["floor"]
    assert on_chip["flops"] == 8 * 8192 * 128256 * 4096 + 6 * 8192 * 10 * 4096
    # CCE beside the floor of its design: exact (filter_eps=None) the recompute's 8 T V H, ours' less its number
    # columns; its default filter beside the 4 T V H of every gradient tile skipped (a floor: it keeps some)
    exact, filtered = by["cce_exact", 8192]["model"], by["cce", 8192]["model"]
    assert exact["path"] == "linear_ce_recompute" and exact["floor"] and filtered["floor"]
    assert exact["flops"] == on_chip["flops"] - 6 * 8192 * 10 * 4096 == 2 * filtered["flops"]
    assert by["cce_autotune", 8192]["model"]["path"] == filtered["path"] == "linear_ce_filtered"
    # its backward in the order before grouping: its own row and model, several times the bytes
    ungrouped = by["ours_linear_on_chip_ungrouped", 8192]["model"]
    assert ungrouped["path"] == "ce_ntl_on_chip_ungrouped" and ungrouped["flops"] == on_chip["flops"]
    assert ungrouped["bytes"] > 5 * on_chip["bytes"]
    # a row per chunked design (issue 43), each beside the model of its own chunk: the GPU's default chunk
    # (2**28 // V = 2092 tokens, math-bound), 2048 tokens (math-bound as well: the same time), the CPU's 523
    # (memory-bound)
    ce_ms = by["ce", 8192]["model"]["ms_h100_datasheet"]
    ratios = {k: by[k, 8192]["model"]["ms_h100_datasheet"] / ce_ms
              for k in ("ours_chunked_triton", "ours_chunked_triton_c523", "ours_chunked_triton_c2048")}  # fmt: skip
    shape = bg.cost_model.Shape(8192, 128256, 4096, 10)
    for key, chunk in (("ours_chunked_triton", None), ("ours_chunked_triton_c523", 523),
                       ("ours_chunked_triton_c2048", 2048)):  # fmt: skip
        want = bg.cost_model.cost(bg.cost_model.ce_ntl_chunked(shape, chunk)).seconds * 1e3 / ce_ms
        assert ratios[key] == pytest.approx(want, rel=1e-9), (key, ratios)
    assert bg.cost_model.chunk_rows(shape) == [2**28 // 128256] * 3 + [8192 - 3 * 2092]  # the GPU's chunk
    assert ratios["ours_chunked_triton"] == pytest.approx(ratios["ours_chunked_triton_c2048"], rel=1e-9)
    assert ratios["ours_chunked_triton_c2048"] < ratios["ours_chunked_triton_c523"]
    # every verdict says not measured, for both sizes
    assert {(v["key"], v["T"]) for v in report["verdicts"]} == {
        (k, t) for k in ("fused_vs_megatron", "chunked_vs_peers", "compiled_chunked_roofline") for t in (8192, 16384)
    }
    assert {v["result"] for v in report["verdicts"]} == {"not measured"}
    # the Markdown: the same rows in the same order, the verdicts, the missing ceilings said
    md = out_md.read_text()
    table = _table(md)
    assert [c[1] for c in table] == [r["name"] for r in rows]
    assert all("not run (dry run)" in c[-1] for c in table)
    assert "dry run" in md.splitlines()[0] and "achieved-fraction columns are empty" in md
    assert md.count("**not measured**") == 6
    assert not [p for p in out_json.parent.iterdir() if p.name.endswith(".tmp")]


def test_without_cuda_it_dry_runs_and_reads_the_ceilings(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the behaviour without a GPU")
    ceilings = tmp_path / "ceilings.json"
    ceilings.write_text(json.dumps({"copy_tbps": 3.0, "matmul_tflops": 700.0, "device": "test card"}))
    out = tmp_path / "bench.json"
    done = _run(["--json", str(out), "--ceilings", str(ceilings), "--tokens", "8192", "--rows", "ce,kernel_stats"])
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["mode"] == "dry run" and "no CUDA GPU" in report["device"]
    assert report["ceilings"] == {"copy_tbps": 3.0, "matmul_tflops": 700.0, "device": "test card"}
    ce = next(r for r in report["rows"] if r["key"] == "ce")
    # at 3.0 TB/s and 700 TFLOP/s instead of 3.35 and 989 the same kernels take longer
    assert ce["model"]["ms_at_ceilings"] > ce["model"]["ms_h100_datasheet"]
    # an unreadable file: the function the run above read the ceilings with (no process of its own)
    bad = tmp_path / "bad.json"
    bad.write_text('{"copy_tbps": 3.0}')
    ceilings_read, source = bg.read_ceilings(str(bad))
    assert ceilings_read is None and "unreadable" in source, source


# ------------------------------------------------------------------ 2. verdicts on synthetic timings


def _row(key: str, ms: float | None, peak: float = 1000.0, t: int = 8192, **over) -> dict:
    row = bg.ROW_BY_KEY[key]
    record = {"key": key, "family": row.family, "group": row.group, "T": t, "T_run": t, "H": 4096, "V": 128256,
              "ntl_weight": row.ntl_weight, "chunked": row.chunked, "approximate": row.approximate,
              "status": "measured" if ms else "skipped",
              "ms": ms, "peak_mib": peak, "check_ok": True}  # fmt: skip
    return {**record, **over}


def _verdict(rows: list[dict], key: str, ceilings: dict | None = None, t: int = 8192) -> dict:
    return next(v for v in bg.verdicts(rows, ceilings) if v["key"] == key and v["T"] == t)


def test_fused_verdict():
    peers = [_row("megatron", 40.0), _row("megatron_jit", 30.0), _row("ce", 20.0)]  # F.cross_entropy is no reference
    v = _verdict([_row("ours_logits_triton", 31.8), _row("ours_logits_torch", 50.0), *peers], "fused_vs_megatron")
    assert v["result"] == "fail" and v["ratio"] == pytest.approx(1.06)  # 31.8 / 30 (the fastest Megatron row)
    assert v["reference"]["row"] == "megatron_jit" and v["ours"]["row"] == "ours_logits_triton"
    v = _verdict([_row("ours_logits_triton", 31.5), *peers], "fused_vs_megatron")
    assert v["result"] == "pass" and v["ratio"] == pytest.approx(1.05)
    # NTL weight 0 is not the product: a fast weight-0 row does not pass it
    v = _verdict([_row("ours_logits_triton_w0", 20.0), _row("ours_logits_triton", 33.0), *peers], "fused_vs_megatron")
    assert v["result"] == "fail" and v["ours"]["row"] == "ours_logits_triton"
    # missing Megatron, missing ours, a Megatron row with a wrong value: not measured
    for rows in ([_row("ours_logits_triton", 10.0), _row("ce", 20.0), _row("megatron", None)],
                 [_row("ours_logits_triton", None), *peers],
                 [_row("ours_logits_triton", 10.0), _row("megatron", 30.0, check_ok=False)]):  # fmt: skip
        assert _verdict(rows, "fused_vs_megatron")["result"] == "not measured"
    # ours fast but wrong: fail
    v = _verdict([_row("ours_logits_triton", 10.0, check_ok=False), *peers], "fused_vs_megatron")
    assert v["result"] == "fail" and "wrong values" in v["reason"]
    # another size's rows do not count
    assert _verdict([_row("ours_logits_triton", 10.0, t=16384), *peers], "fused_vs_megatron")["result"] == (
        "not measured"
    )


def test_chunked_verdict():
    torch_materialised = _row("torch_linear_ce", 10.0, peak=9000.0, chunked=False)  # not a chunked peer
    peers = [_row("liger", 60.0, peak=4000.0), _row("cce_exact", 40.0, peak=1200.0), torch_materialised]
    v = _verdict([_row("ours_chunked_triton", 43.6, peak=1200.0), *peers], "chunked_vs_peers")
    assert v["result"] == "pass" and v["ratio"] == pytest.approx(1.09) and v["reference"]["row"] == "cce_exact"
    v = _verdict([_row("ours_chunked_triton", 44.4, peak=1000.0), *peers], "chunked_vs_peers")
    assert v["result"] == "fail" and v["ratio"] == pytest.approx(1.11)
    v = _verdict([_row("ours_chunked_triton", 30.0, peak=1300.0), *peers], "chunked_vs_peers")  # faster, heavier
    assert v["result"] == "fail" and v["memory_ratio"] == pytest.approx(1300 / 1200)
    # one of our rows meeting both limits passes, and is the one named
    ours = [_row("ours_chunked_triton", 30.0, peak=1300.0), _row("ours_chunked_triton_c2048", 42.0, peak=1100.0)]
    v = _verdict([*ours, *peers], "chunked_vs_peers")
    assert v["result"] == "pass" and v["ours"]["row"] == "ours_chunked_triton_c2048"
    # no chunked peer measured (the materialised torch row does not count): not measured
    v = _verdict([_row("ours_chunked_triton", 1.0, peak=1.0), torch_materialised, _row("liger", None)],
                 "chunked_vs_peers")  # fmt: skip
    assert v["result"] == "not measured" and "peer" in v["reason"]
    # a peer's peak unknown: not measured, never passed
    v = _verdict([_row("ours_chunked_triton", 1.0, peak=1.0), _row("cce_exact", 40.0, peak=None)], "chunked_vs_peers")
    assert v["result"] == "not measured"
    # CCE with its default filter skips gradient tiles: shown beside, never the reference of our exact rows
    exact = [_row("cce_exact", 40.0, peak=1200.0), _row("liger", 60.0, peak=4000.0)]
    v = _verdict([_row("ours_chunked_triton", 43.6, peak=1200.0), _row("cce", 20.0, peak=900.0), *exact],
                 "chunked_vs_peers")  # fmt: skip
    assert v["result"] == "pass" and v["reference"]["row"] == "cce_exact" and v["ratio"] == pytest.approx(1.09)
    assert [p["row"] for p in v["approximate_peers"]] == ["cce"]
    v = _verdict([_row("ours_chunked_triton", 1.0, peak=1.0), _row("cce", 20.0, peak=900.0),
                  _row("cce_autotune", 15.0, peak=900.0)], "chunked_vs_peers")  # fmt: skip
    assert v["result"] == "not measured" and "exact gradients" in v["reason"] and len(v["approximate_peers"]) == 2


def test_roofline_verdict_and_nothing_measured():
    ceilings = {"copy_tbps": 3.0, "matmul_tflops": 800.0, "device": "x"}
    roofline_ms = 6 * 16384 * 4096 * 128256 / 800e12 * 1e3  # 64.6 ms
    rows = [_row("ours_chunked_compiled", 1.25 * roofline_ms, t=16384)]
    assert _verdict(rows, "compiled_chunked_roofline", None, 16384)["result"] == "not measured"  # no ceiling
    v = _verdict(rows, "compiled_chunked_roofline", ceilings, 16384)
    assert v["result"] == "pass" and v["ratio"] == pytest.approx(1.25)
    rows = [_row("ours_chunked_compiled", 1.35 * roofline_ms, t=16384)]
    assert _verdict(rows, "compiled_chunked_roofline", ceilings, 16384)["result"] == "fail"
    # the eager chunked rows are not the compiled one
    rows = [_row("ours_chunked_triton", 1.0 * roofline_ms, t=16384)]
    assert _verdict(rows, "compiled_chunked_roofline", ceilings, 16384)["result"] == "not measured"
    # a run that measured nothing (dry or smoke) passes nothing
    rows = [_row("ours_logits_triton", 1.0), _row("megatron", 30.0)]
    assert {v["result"] for v in bg.verdicts(rows, ceilings, "dry run")} == {"not measured"}


def test_value_check():
    refs = {"ce": 12.0, "ntl": 2.0}
    good = {"ce": 12.05, "loss": 12.65, "ntl_weight": 0.3}  # 12 + 0.3 * 2 = 12.6
    bg.check_values(good, refs)
    assert good["check_ok"] is True
    for wrong in ({"ce": 12.5, "loss": 13.1, "ntl_weight": 0.3}, {"ce": 12.0, "loss": 12.0, "ntl_weight": 0.3},
                  {"ce": float("nan"), "loss": float("nan"), "ntl_weight": None}):  # fmt: skip
        bg.check_values(wrong, refs)
        assert wrong["check_ok"] is False, wrong


def test_a_measured_report_renders(tmp_path):
    """The GPU-only paths of the report (rates, ratios, verdict numbers) on a dry run's plan filled with
    synthetic measurements, so that a typo there cannot cost a GPU run."""
    ceilings = tmp_path / "ceilings.json"
    ceilings.write_text(json.dumps({"copy_tbps": 3.0, "matmul_tflops": 800.0, "device": "test card"}))
    out = tmp_path / "bench.json"
    assert bg.main(["--dry-run", "--json", str(out), "--ceilings", str(ceilings), "--tokens", "8192"]) == 0
    report = json.loads(out.read_text())
    for r in report["rows"]:
        r.update(status="measured", ms=50.0, peak_mib=1000.0, ce=11.0, loss=11.6, check_ok=True, check="ok",
                 reason="")  # fmt: skip
        if r["key"] == "megatron":
            r["ms"] = 40.0
        if r["key"] == "cce":  # the fastest, with its filter's approximate gradients: no one's reference
            r["ms"] = 10.0
        bg.add_rates(r, report["ceilings"])
    by = {r["key"]: r for r in report["rows"]}
    stats = by["kernel_stats"]
    # bytes / time: the statistics kernel reads the bf16 logits once (2 x 8192 x 128256 B) and a little more
    assert stats["tbps"] == pytest.approx(stats["model"]["bytes"] / 0.05 / 1e12)
    assert 2 * 8192 * 128256 / 0.05 / 1e12 < stats["tbps"] < 1.1 * 2 * 8192 * 128256 / 0.05 / 1e12
    assert stats["copy_fraction"] == pytest.approx(stats["tbps"] / 3.0)
    assert by["ce"]["matmul_fraction"] == pytest.approx(6 * 8192 * 4096 * 128256 / 0.05 / 800e12)
    assert by["ce"]["measured_over_model"] == pytest.approx(50.0 / by["ce"]["model"]["ms_at_ceilings"])
    report["verdicts"] = bg.verdicts(report["rows"], report["ceilings"])
    results = {v["key"]: v for v in report["verdicts"]}
    assert results["fused_vs_megatron"]["result"] == "fail"  # 50 / 40 = 1.25x
    assert results["chunked_vs_peers"]["result"] == "pass"  # 50 / 50 at the same peak
    report["mode"] = "gpu"
    md = bg.markdown(report)
    cells = {c[1]: c for c in _table(md)}
    assert cells["F.cross_entropy on logits"][4] == "1.250"  # 50 ms against Megatron's 40, the fastest CE-only
    assert cells["Cut Cross-Entropy"][4] == "0.250"  # shown against it, not made the reference
    assert [p["row"] for p in results["chunked_vs_peers"]["approximate_peers"]] == ["cce", "cce_autotune"]
    assert "TB/s (" in md and "% of copy" in md and "% of matmul" in md
    assert "| fused_vs_megatron | 8192 | **fail** | 1.250x (limit 1.05x)" in md
    assert "beside, approximate gradients: cce 10.00 ms, cce_autotune 50.00 ms" in md
    assert len(_table(md)) == len(report["rows"])


# ------------------------------------------------------------------ 3. the time budget


def test_budget_reason():
    assert bg.budget_reason(10.0, 10.0, 100.0) is None
    reason = bg.budget_reason(25.0, 12.4, 100.0)
    assert reason == "time budget: 12 s of 100 s left, this row needs about 25 s (estimate)"


def test_a_small_budget_skips_rows_with_the_reason(dry_run, tmp_path):
    rows = json.loads((dry_run / "bench.json").read_text())["rows"]
    started = [r for r in rows if r["planned_start_s"] is not None]
    assert started and started[0]["key"] == "ours_logits_triton" and started[0]["planned_start_s"] == 0
    assert all(r["planned_start_s"] + r["estimate_s"] <= 60 for r in started)
    skipped = [r for r in rows if "time budget" in r["reason"]]
    assert skipped and all(r["reason"].startswith("would be skipped: time budget: ") for r in skipped)
    compiled = {r["key"] for r in rows if r["group"] == "compiled" and "not installed" not in r["reason"]}
    assert compiled and compiled <= {r["key"] for r in skipped}  # 60 s and each compile
    # a real run (the smoke run) with nothing left: no row starts, each says why, the verdicts say not measured
    out = tmp_path / "bench.json"
    done = _run(["--smoke", "--time-budget", "0", "--json", str(out), "--tokens", "8192", "--warmup", "1",
                 "--iters", "1"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["status"] == "finished"
    for r in report["rows"]:
        assert r["status"] in ("not run (time budget)", "skipped"), r
        assert r["reason"].startswith("time budget: 0 s of 0 s left") or "not installed" in r["reason"], r
    assert {v["result"] for v in report["verdicts"]} == {"not measured"}


# ------------------------------------------------------------------ 4. writing


def test_write_atomic_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "bench.json"
    bg.write_atomic(str(path), '{"rows": [1]}\n')
    assert json.loads(path.read_text()) == {"rows": [1]}
    with pytest.raises(TypeError):
        bg.write_atomic(str(path), b"not text")  # fails while writing the temporary file
    assert json.loads(path.read_text()) == {"rows": [1]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]


def test_a_killed_run_keeps_valid_json_and_its_finished_rows(tmp_path):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    rows = "ours_logits_torch,ours_chunked_triton,kernel_stats,kernel_grad,ce"  # the first fast, then interpreted
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(BENCH), "--smoke", "--rows", rows, "--tokens", "16384", "--warmup", "2", "--iters",
           "3", "--json", str(out), "--markdown", str(md)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reads, report = 0, None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists():
                report = json.loads(out.read_text())  # every read is a whole file: never a part
                reads += 1
                if any(r["status"] == "measured" for r in report["rows"]):
                    break
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert report is not None and reads >= 1
    report = json.loads(out.read_text())
    statuses = [r["status"] for r in report["rows"]]
    assert statuses[0] == "measured", statuses
    assert report["status"] == "running" and "not reached" in statuses, statuses  # cut before the end
    assert [c[1] for c in _table(md.read_text())] == [r["name"] for r in report["rows"]]


# ------------------------------------------------------------------ 5. the smoke run: every row's code


def test_smoke_runs_every_row_and_the_values_agree(tmp_path):
    out = tmp_path / "bench.json"
    done = _run(["--smoke", "--tokens", "8192", "--warmup", "1", "--iters", "1", "--json", str(out), "--markdown",
                 str(tmp_path / "bench.md")], timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "smoke" and report["status"] == "finished"
    by = {r["key"]: r for r in report["rows"]}
    assert len(by) == len(bg.ROWS)
    failed = {k: r["reason"] for k, r in by.items() if r["status"] not in ("measured", "skipped")}
    assert not failed, failed
    for key, r in by.items():
        if r["status"] == "skipped":
            reason = r["reason"]
            assert "not installed" in reason or "GPU only" in reason or "needs a CUDA GPU" in reason, (key, reason)
    must_run = [r.key for r in bg.ROWS if r.group == "ours"]  # the on-chip fused linear CE + NTL included
    must_run += ["ce", "ce_ntloss", "megatron", "torch_linear_ce"]  # their packages are in the dev install
    must_run += ["ce_ntl", "megatron_ntl", "torch_linear_ce_ntl"]  # each + NTL alone (number columns / rows)
    for key in must_run:
        assert by[key]["status"] == "measured", (key, by[key]["reason"])
    # every value agrees with the references from the definitions (CE; CE + 0.3 NTL-WAS), ntloss's included
    for key, r in by.items():
        if r["status"] == "measured" and key != "kernel_grad":
            assert r["check_ok"] is True, (key, r["check"])
            assert math.isfinite(r["ms"]) and r["ms"] > 0
            assert "measured_over_model" not in r and "tbps" not in r  # CPU timings set against no GPU model
    assert by["ce_ntloss"]["loss"] == pytest.approx(by["ours_logits_triton"]["loss"], rel=5e-3)
    assert by["ours_chunked_torch"]["loss"] > by["ours_chunked_torch"]["ce"]  # NTL adds a positive term
    assert by["ours_logits_torch_w0"]["loss"] == pytest.approx(by["ours_logits_torch_w0"]["ce"])
    assert {v["result"] for v in report["verdicts"]} == {"not measured"}  # CPU timings decide nothing


@pytest.mark.filterwarnings("ignore:linear_cross_entropy")  # the timed steps after the first warn again
def test_a_chunked_peer_that_falls_back_is_not_counted_as_chunked():
    """torch's chunked mode warns and takes its reference path with label smoothing: the row records it."""
    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        pytest.skip("this torch has no chunked F.linear_cross_entropy")

    def smoothed(x):
        options = torch.nn.LinearCrossEntropyOptions()
        fn = torch.nn.functional.linear_cross_entropy
        return bg.Built(bg._on_hidden(x, lambda: bg._same(fn(x.hidden, x.weight, x.labels, options=options,
                                                                label_smoothing=0.1))), chunked=True)  # fmt: skip

    row = bg.Row("torch_smoothed", "torch F.linear_cross_entropy, label smoothing", "peer", "ce_peer", smoothed,
                 chunked=True)  # fmt: skip
    x = bg.make_inputs(64, 32, 512, "cpu", None, False)
    args = bg.parse_args(["--smoke", "--json", "unused", "--warmup", "1", "--iters", "1"])
    record = bg.run_row(row, x, args, 100.0)
    assert record["status"] == "measured" and record["chunked"] is False, record
    assert "not chunked, it warned" in record["note"] and "ignored" in record["note"]
    plain = bg.run_row(bg.ROW_BY_KEY["torch_linear_ce"], x, args, 100.0)
    assert plain["chunked"] is True and not plain["warnings"], plain


# ------------------------------------------------------------------ 6. arguments


def test_arguments(capsys):
    assert bg.main(["--list-rows"]) == 0
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert keys == [p.row.key for p in bg.plan_rows([8192])] and keys[0] == "ours_logits_triton"
    for args, message in ((["--rows", "nonsense", "--json", "x"], "unknown rows"),
                          (["--iters", "3", "--json", "x"], "at least 5"),
                          (["--time-budget", "-1", "--json", "x"], "non-negative"),
                          (["--tokens", "8192,x", "--json", "x"], "positive integers"),
                          (["--dry-run", "--smoke", "--json", "x"], "exclude each other"),
                          (["--dry-run"], "nothing to write")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            bg.parse_args(args)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, args
