"""Step 0 of ``scripts/gpu_check.sh``: versions, tools, the carried wheels, the card's measured ceilings.

    python scripts/gpu_probe.py --wheels .gpu_wheels --ceilings OUT/ceilings.json --json probe.json [--cpu]

Writes one JSON object (``--json``) with ``rows`` in the gpu_check row form (``name``, ``status``, ``detail``)
and ``versions``:

- versions: Python, torch, its CUDA, Triton, the GPU and its driver, the machine's libraries the runs use
  (transformers, accelerate, pyarrow, fsspec, numpy), and each carried wheel's distribution as installed;
- ``command -v make g++ nvcc ninja``;
- each carried wheel's declared requirements (``Requires-Dist`` without extras) against what is installed
  (for instance ``datasets`` 5.2 needs ``pyarrow>=24`` and ``fsspec<=2026.9``): a conflict is a failed row;
- an import of every carried wheel's top-level modules (and the deeper module the check uses, where one);
- the ceilings the benchmark divides by: device-to-device copy (bytes read + written per second, TB/s) and
  an 8192^3 bf16 matmul (TFLOP/s), medians of CUDA-event timings after warm-up, into ``--ceilings``
  (``{"copy_tbps", "matmul_tflops", "device"}``). With ``--cpu`` (the dry run) the same code measures the
  CPU at small sizes and says so in ``device``: those are not GPU numbers.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

DEEPER = {  # a carried package's module that the GPU check actually uses, beyond its top level
    "megatron": "megatron.core.tensor_parallel",
    "liger_kernel": "liger_kernel.transformers",
    "cut_cross_entropy": "cut_cross_entropy",
    "deepspeed": "deepspeed",
}
MACHINE = ("transformers", "accelerate", "pyarrow", "fsspec", "numpy", "pytest", "mpi4py", "ninja")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_info(path: Path) -> dict:
    """Distribution name and version, top-level modules and requirements read from the wheel itself."""
    name, version = path.name.split("-")[:2]
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
        requires = []
        if meta:
            for line in z.read(meta).decode("utf-8", "replace").splitlines():
                if line.startswith("Requires-Dist:"):
                    requires.append(line.split(":", 1)[1].strip())
        top = next((n for n in names if n.endswith(".dist-info/top_level.txt")), None)
        if top:
            modules = [m.strip() for m in z.read(top).decode().splitlines() if m.strip()]
        else:
            modules = sorted(
                {
                    n.split("/")[0].removesuffix(".py")
                    for n in names
                    if not n.split("/")[0].endswith((".dist-info", ".data", ".libs"))
                    and (n.endswith(".py") or "/" in n)
                    and not n.startswith("__")
                }
            )
    return {"dist": name, "version": version, "modules": [m for m in modules if m.isidentifier()], "requires": requires}


def check_requirements(requires: list[str]) -> list[str]:
    """Declared requirements (extras skipped, markers evaluated) the installed versions do not meet."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip's vendored copy
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    problems = []
    for text in requires:
        req = Requirement(text)
        if req.marker is not None:
            try:
                if not req.marker.evaluate({"extra": ""}):
                    continue
            except Exception:
                continue
        have = _version(req.name)
        if have is None:
            problems.append(f"{req.name} missing (needs {req.specifier or 'any'})")
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req.name} {have} (needs {req.specifier})")
    return problems


def import_modules(modules: list[str]) -> tuple[bool, str, float]:
    start = time.perf_counter()
    try:
        for module in modules:
            importlib.import_module(module)
    except BaseException as e:  # SystemExit from a package's import-time check too
        return False, f"import {module}: {type(e).__name__}: {str(e)[:300]}", time.perf_counter() - start
    return True, "import " + ", ".join(modules), time.perf_counter() - start


def _median_seconds(fn, device: str, repeats: int) -> float:
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_seconds(size: int, device: str) -> float:
    import torch

    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return _median_seconds(lambda: dst.copy_(src), device, 10)  # both freed on return


def ceilings(cpu: bool) -> dict:
    """Copy bandwidth (read + write bytes per second) and bf16 matmul rate measured on this device."""
    import torch

    device = "cpu" if cpu else "cuda"
    n, copy_bytes = (1024, 64 << 20) if cpu else (8192, 2 << 30)
    dtype = torch.float32 if cpu else torch.bfloat16
    copy_s = _copy_seconds(copy_bytes, device)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    matmul_s = _median_seconds(lambda: a @ b, device, 10)
    name = "cpu (dry run: not a GPU ceiling)" if cpu else torch.cuda.get_device_name(0)
    return {
        "copy_tbps": 2 * copy_bytes / copy_s / 1e12,
        "matmul_tflops": 2 * n**3 / matmul_s / 1e12,
        "device": name,
        "method": f"copy of {copy_bytes >> 20} MiB (read + write bytes) and a {n}^3 {str(dtype)[6:]} matmul: "
        "medians of 10 after 2 warm-ups",
    }


def versions(cpu: bool) -> dict:
    info = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda or "none"
        if not cpu and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            props = torch.cuda.get_device_properties(0)
            info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            info["capability"] = f"{props.major}.{props.minor}"
    except ImportError as e:
        info["torch"] = f"not importable: {e}"
    info["triton"] = _version("triton") or "none"
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
        info["driver"] = done.stdout.strip() or done.stderr.strip()[:100]
    else:
        info["driver"] = "no nvidia-smi"
    for dist in MACHINE:
        info[dist] = _version(dist) or "none"
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", required=True, help="the carried wheel folder (.gpu_wheels)")
    parser.add_argument("--ceilings", required=True, help="where the measured ceilings go (JSON)")
    parser.add_argument("--json", required=True, help="where this step's rows go (JSON)")
    parser.add_argument("--cpu", action="store_true", help="dry run: measure the CPU, label it so")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    info = versions(args.cpu)
    rows.append({"name": "versions", "status": "ok", "detail": ", ".join(f"{k} {v}" for k, v in info.items())})
    tools = {tool: shutil.which(tool) for tool in ("make", "g++", "nvcc", "ninja")}
    rows.append(
        {
            "name": "command -v make g++ nvcc ninja",
            "status": "ok",
            "detail": ", ".join(f"{t}: {p or 'absent'}" for t, p in tools.items()),
        }
    )
    wheels = sorted(Path(args.wheels).glob("*.whl")) if Path(args.wheels).is_dir() else []
    if not wheels:
        status = "NOT RUN" if args.cpu else "FAILED"  # CI has none; the GPU run needs them
        detail = f"no wheels in {args.wheels} (bash scripts/gpu_prepare.sh builds them)"
        rows.append({"name": "carried wheels", "status": status, "detail": detail})
    for path in wheels:
        w = wheel_info(path)
        installed = _version(w["dist"])
        problems = check_requirements(w["requires"])
        modules = list(w["modules"])
        modules += [DEEPER[m] for m in w["modules"] if m in DEEPER and DEEPER[m] not in modules]
        if args.cpu and installed is None:  # the dry run imports what is installed here
            rows.append(
                {
                    "name": f"wheel {w['dist']} {w['version']}",
                    "status": "NOT RUN",
                    "detail": "not installed on this machine (dry run: imports what is here)",
                }
            )
            continue
        ok, detail, seconds = import_modules(modules)
        rows.append(
            {
                "name": f"wheel {w['dist']} {w['version']}",
                "status": "ok" if ok and not problems else "FAILED",
                "detail": f"installed {installed or 'none'}; {detail}"
                + (f"; requirements not met: {'; '.join(problems)}" if problems else ""),
                "seconds": round(seconds, 2),
                "installed": installed,
            }
        )
        info[f"carried {w['dist']}"] = installed or "none"
    try:
        measured = ceilings(args.cpu)
        Path(args.ceilings).write_text(json.dumps(measured, indent=1) + "\n")
        rows.append(
            {
                "name": "ceilings",
                "status": "ok",
                **measured,
                "detail": f"copy {measured['copy_tbps']:.3f} TB/s, matmul {measured['matmul_tflops']:.3g} "
                f"TFLOP/s on {measured['device']}",
            }
        )
    except Exception as e:
        rows.append({"name": "ceilings", "status": "FAILED", "detail": f"{type(e).__name__}: {e}"[:400]})
    Path(args.json).write_text(json.dumps({"versions": info, "rows": rows}, indent=1) + "\n")
    for row in rows:
        print(f"{row['status']:6} {row['name']}: {row.get('detail', '')}", flush=True)
    return 0 if all(r["status"] in ("ok", "NOT RUN") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
