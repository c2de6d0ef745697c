"""The Triton kernels compiled ahead of time for sm_80, sm_90 and sm_100 with no GPU (``benchmarks/triton_aot.py``).

One process of its own (``TRITON_INTERPRET`` unset, a fresh cache directory) compiles, through the
``ptxas`` bundled in the triton wheel, CI's pairwise set (``--pairwise``): every kernel and every block
configuration the launchers can pick, for the three architectures, each block in one dtype (the dtypes
in turn) and the largest blocks in every dtype; this file checks the records it writes:

1. Coverage: every ``BLOCK_V`` and ``BLOCK_K`` the launchers pick for widths met in practice
   (vocabulary shards 1 to 10**6 columns, 0 to 5000 number columns) was compiled, for every kernel and
   architecture, the largest in every dtype; the fused linear CE + NTL's two kernels
   (``lab/on_chip/triton_linear_ce_ntl.py``) at the tiles their launchers pick per dtype, each launch's tiles
   on aligned and unaligned vocabularies, the backward building both gradients and (bf16) each alone.
2. Every compile succeeded, with zero spill stores and loads and no stack frame (ptxas -v), registers
   equal in ptxas's report and ``cuobjdump --dump-resource-usage`` (two tools), a PTX ``.target`` of
   the architecture and a cubin; at least one block fits an SM.
3. The occupancy rule against cases worked out by hand from the CUDA Occupancy Calculator's rules
   (registers per warp rounded up to 256, 1 KiB reserved shared memory per block).
4. A kernel that spills fails: the largest fp64 configuration under a 24-register cap
   (``--plant-spill``) is reported and the script exits 1.
5. docs/kernels.md holds the full run's table (``--markdown``) and the limits: every documented row is
   compiled here, in documented dtypes, with registers in the documented range.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.scripts import load_script

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton; dev extra)")
_jit = pytest.importorskip("triton.runtime.jit")
if not hasattr(triton, "knobs") or not hasattr(_jit.JITFunction, "_pack_args"):  # the AOT path of triton 3.9
    pytest.skip(f"ahead-of-time compiling needs triton >= 3.9 (knobs, JITFunction._pack_args); this is "
                f"{triton.__version__}: pip install 'triton>=3.9'", allow_module_level=True)  # fmt: skip

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "triton_aot.py"
aot = load_script(str(SCRIPT.relative_to(ROOT)), "triton_aot")


def _run(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    # TRITON_INTERPRET (set by test_triton_kernel.py in a whole-suite session) would make triton.jit
    # return interpreted functions that cannot be compiled; TRITON_CACHE_DIR points at an empty folder.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "cache")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT
    )


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("aot")
    out = _run("--pairwise", "--json", str(tmp / "aot.json"), tmp=tmp)
    assert (tmp / "aot.json").exists(), out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads((tmp / "aot.json").read_text())["records"]


# ------------------------------------------------------------------ 1. coverage


def test_every_block_the_launchers_pick_is_compiled(records):
    import torch

    from ntl_scale.ops import triton_ce_ntl as tk

    widths = [1, 15, 16, 17, 100, 1000, 4095, 4097, 8000, 32000, 50257, 64128, 128256, 262144, 10**6]
    numbers = [0, 1, 10, 11, 50, 100, 129, 1000, 5000]
    picked_v = {tk._block_v(w) for w in widths}
    picked_k = {tk._block_k(k) for k in numbers}
    half = ("float32", "bfloat16", "float16")
    for arch in ("sm_80", "sm_90", "sm_100"):
        for kernel in ("stats", "grad"):
            # every block in some dtype (CI's pairwise set: the dtypes in turn), the largest in every dtype
            mine = [r for r in records if (r["arch"], r["kernel"]) == (arch, kernel) and r["dtype"] in half]
            assert picked_v <= {r["block_v"] for r in mine}, (arch, kernel)
            assert picked_k <= {r["block_k"] for r in mine}, (arch, kernel)
            assert {r["warps"] for r in mine} == {tk._warps(v) for v in picked_v}
            largest = (max(picked_v), max(picked_k))
            for dtype in half:
                mine = [r for r in records if (r["arch"], r["kernel"], r["dtype"]) == (arch, kernel, dtype)]
                assert largest in {(r["block_v"], r["block_k"]) for r in mine}, (arch, kernel, dtype)
                assert len({r["block_v"] for r in mine}) > 1, (arch, kernel, dtype)  # and smaller blocks
                assert any(r["width"] % 16 for r in mine)  # a vocabulary without the divisibility hint
            grad = [r for r in records if (r["arch"], r["kernel"]) == (arch, "grad")]
            assert picked_v <= {r["block_v"] for r in grad if r["numbers"] == 0}  # HAS_NUMBERS False, every block
            assert {r["numbers"] > 0 for r in grad} == {True, False}  # HAS_NUMBERS both ways
            assert any(r["dtype"] == "float64" for r in records if (r["arch"], r["kernel"]) == (arch, kernel))
            # the statistics kernel writing the softmax (the chunked op on one device), as its launcher builds it
            fused = [r for r in records if (r["arch"], r["kernel"]) == (arch, "stats_softmax")]
            assert {r["dtype"] for r in fused} == {"float32", "bfloat16", "float16"}, arch
            assert {r["width"] % 16 == 0 for r in fused} == {True, False}, arch
            # every block its persistent launch on a GPU can pick (tk.softmax_launch over the devices' shapes),
            # aligned and unaligned, with 16 warps
            for dtype in ("float32", "bfloat16", "float16"):
                elem = getattr(torch, dtype).itemsize
                picked = {
                    tk.softmax_launch(rows, w, elem * w, elem, sms, l2)[1]
                    for rows in (1368, 8192)
                    for w in widths
                    for sms, l2 in ((108, 40 << 20), (132, 50 << 20), (148, 126 << 20), (1, 0))
                }
                for aligned in (True, False):
                    have = {r["block_v"] for r in fused if r["dtype"] == dtype and (r["width"] % 16 == 0) == aligned}
                    assert {v for v in picked if v >= 4096} <= have, (arch, dtype, aligned)
                assert {r["warps"] for r in fused if r["dtype"] == dtype} == {16}


def test_the_fused_linear_kernels_are_compiled_as_launched(records):
    import torch

    from lab.on_chip import triton_linear_ce_ntl as lk

    for arch in ("sm_80", "sm_90", "sm_100"):
        for dtype in ("float32", "bfloat16", "float16"):
            for kernel, kind in (("linear_fwd", "forward"), ("linear_bwd", "backward")):
                blocks = lk.launch_blocks(kind, getattr(torch, dtype))
                mine = [r for r in records if (r["arch"], r["kernel"], r["dtype"]) == (arch, kernel, dtype)]
                assert {r["block_v"] for r in mine} == {blocks["BLOCK_V"]}, (arch, kernel, dtype)
                assert {r["warps"] for r in mine} == {blocks["num_warps"]}, (arch, kernel, dtype)
                # each launch's tiles (fp32's; bf16's and fp16's, the same) on aligned and unaligned vocabularies
                same_tiles = [
                    r
                    for r in records
                    if (r["arch"], r["kernel"]) == (arch, kernel)
                    and lk.launch_blocks(kind, getattr(torch, r["dtype"])) == blocks
                ]
                assert {r["width"] % 16 == 0 for r in same_tiles} == {True, False}, (arch, kernel, dtype)
                if kernel == "linear_bwd":
                    needs = {"hw", "h", "w"} if dtype == "bfloat16" else {"hw"}
                    assert {r["needs"] for r in mine} == needs, (arch, dtype)
    # the cost model's programs in flight on an H100 (its LRU simulation of the on-chip backward) are the bf16
    # backward's resident blocks per SM on sm_90, both gradients built
    from lab.on_chip import cost_model as on_chip_cost

    h100 = [
        r
        for r in records
        if (r["arch"], r["kernel"], r["dtype"], r["needs"]) == ("sm_90", "linear_bwd", "bfloat16", "hw")
    ]
    assert {r["blocks_per_sm"] for r in h100} == {on_chip_cost.ON_CHIP_PROGRAMS_PER_SM}


# ------------------------------------------------------------------ 2. every compile clean


def test_compiles_without_spills_for_every_architecture(records):
    assert len(records) == 3 * len(aot.configs(pairwise=True))
    for r in records:
        where = {k: r[k] for k in ("kernel", "dtype", "block_v", "block_k", "width", "numbers", "arch")}
        assert "error" not in r, (where, r.get("error"))
        assert (r["spill_stores"], r["spill_loads"], r["stack"]) == (0, 0, 0), where
        assert r["cuobjdump"]["local"] == 0 and r["cuobjdump"]["stack"] == 0, where
        assert r["cuobjdump"]["regs"] == r["regs"] and 0 < r["regs"] <= 255, where
        assert r["ptx_target"] in (r["arch"], r["arch"] + "a"), where  # sm_90 and sm_100 compile as sm_90a, sm_100a
        assert r["cubin_bytes"] > 0 and r["num_warps"] == r["warps"], where
        assert r["blocks_per_sm"] >= 1, where
    assert aot.problems(records) == []


# ------------------------------------------------------------------ 3. occupancy


@pytest.mark.parametrize(
    ("arch", "regs", "smem", "warps", "blocks", "limiter"),
    [
        # 32 regs x 32 threads = 1024 per warp: 64 warps fit by registers; 16-warp blocks: 4 (the warp limit first)
        (1, 32, 0, 16, 4, "warps"),
        # 64 regs -> 2048 per warp -> 32 warps by registers -> two 16-warp blocks
        (1, 64, 0, 16, 2, "registers"),
        # 255 regs -> 8160, rounded up to 8192 per warp -> 8 warps -> two 4-warp blocks
        (0, 255, 0, 4, 2, "registers"),
        # 100 KiB + 1 KiB reserved per block: one block in an A100's 164 KiB, two in an H100's 228 KiB
        (0, 32, 100 * 1024, 4, 1, "shared memory"),
        (1, 32, 100 * 1024, 4, 2, "shared memory"),
        # one-warp blocks of few registers: the 32-block limit
        (2, 16, 0, 1, 32, "blocks"),
    ],
)
def test_occupancy_rule(arch, regs, smem, warps, blocks, limiter):
    got = aot.occupancy(aot.ARCHS[arch], regs, smem, warps)
    assert (got["blocks_per_sm"], got["warps_per_sm"]) == (blocks, blocks * warps)
    assert got["limiter"] == limiter


# ------------------------------------------------------------------ 4. a spill fails


def test_a_spilling_kernel_fails(tmp_path):
    out = _run("--plant-spill", tmp=tmp_path)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    assert "spills" in out.stderr and "sm_90" in out.stderr


# ------------------------------------------------------------------ 5. the docs hold this output


def _rows(markdown: str) -> dict[tuple[str, ...], tuple[set[str], list[tuple[int, int]]]]:
    """The compile table's rows: (kernel, BLOCK_V, warps, BLOCK_K, numbers, width, fp64) -> (the dtypes, the
    register range per architecture)."""
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or not cells[1].isdigit():
            continue
        dtypes = set(cells[6].split(", "))
        regs = [tuple(int(n) for n in (c.split(" / ")[0].split("-") * 2)[:2]) for c in cells[7:]]
        rows[(*cells[:6], str(dtypes == {"fp64"}))] = (dtypes, regs)
    return rows


def test_docs_hold_the_compile_table(records):
    """docs/kernels.md holds the full run's table (``--markdown``); CI's pairwise run compiles a subset of
    its configurations: every documented row is compiled here, in documented dtypes, with registers in the
    documented range (registers are deterministic for a given triton)."""
    docs = (ROOT / "docs" / "kernels.md").read_text()
    for line in aot.limits_markdown().splitlines():
        assert line in docs, f"docs/kernels.md lacks (run benchmarks/triton_aot.py --markdown): {line}"
    documented, here = _rows(docs), _rows(aot.markdown(records))
    differ = here.keys() ^ documented.keys()
    assert not differ, f"docs/kernels.md: rows {differ} (run benchmarks/triton_aot.py --markdown)"
    for key, (dtypes, regs) in here.items():
        doc_dtypes, doc_regs = documented[key]
        assert dtypes <= doc_dtypes, (key, dtypes, doc_dtypes)
        for (lo, hi), (doc_lo, doc_hi) in zip(regs, doc_regs, strict=True):
            assert doc_lo <= lo <= hi <= doc_hi, f"docs/kernels.md: {key} {regs} against {doc_regs} (--markdown)"
