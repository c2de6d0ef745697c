"""The DeepMind mathematics data, generated offline by DeepMind's own generator.

    python launch/deepmind_data.py --out data/mathematics_dataset-v1.0 --per-module 20000
    python launch/deepmind_data.py --setup-only          # just build the generator's environment

``mathematics-dataset==1.0.1`` (PyPI) runs only with ``sympy==1.5.1`` and ``numpy<1.24``, which
conflict with the training stack, so it gets its own virtual environment (``--venv``, built once with
``python -m venv`` and pip). The command writes the released layout::

    OUT/train-easy/<module>.txt    OUT/train-medium/...   OUT/train-hard/...
    OUT/interpolate/<module>.txt   OUT/extrapolate/<module>_big.txt (or _longer)

(question and answer lines alternate), plus the paper's arithmetic subset:

* ``arithmetic_train.txt`` / ``arithmetic_val.txt``: every ``arithmetic__*`` training question of the
  three levels, shuffled with the seed; ``val_fraction`` of them are held out for validation;
* ``arithmetic_test_interpolate.txt`` / ``arithmetic_test_extrapolate.txt``: the ``arithmetic__*``
  files of ``interpolate`` and ``extrapolate``, shuffled with the seed.

The output appears only when complete (written under ``OUT.partial``, then renamed), and
``OUT/generation.json`` records the settings: running the same command again does nothing; other
settings for an existing ``OUT`` are refused.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout, for ntl_scale

from ntl_scale.training.sources import SPLIT_FILES

PINS = ("mathematics-dataset==1.0.1", "sympy==1.5.1", "numpy<1.24")
"""What the generator's environment installs (its own requirements, nothing else)."""

ARITHMETIC_MODULES = (
    "arithmetic__add_or_sub",
    "arithmetic__add_sub_multiple",
    "arithmetic__div",
    "arithmetic__mixed",
    "arithmetic__mul",
    "arithmetic__mul_div_multiple",
    "arithmetic__nearest_integer_root",
)
"""The arithmetic modules whose answers are numbers (``add_or_sub_in_base`` and ``simplify_surd``
answer with other bases and surds)."""

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_deepmind_worker.py")
_LEVELS = ("train-easy", "train-medium", "train-hard")


def default_venv() -> str:
    """``~/.cache/ntl_scale/mathematics-dataset-1.0.1``: shared by every checkout on the machine."""
    return os.path.join(os.path.expanduser("~"), ".cache", "ntl_scale", "mathematics-dataset-1.0.1")


def _python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def _works(venv: str) -> bool:
    if not os.path.isfile(_python(venv)):
        return False
    probe = "import mathematics_dataset.generate, sympy, numpy; assert sympy.__version__ == '1.5.1'"
    return subprocess.run([_python(venv), "-c", probe], capture_output=True).returncode == 0


def ensure_environment(venv: str | None = None, *, python: str | None = None) -> str:
    """Builds the generator's virtual environment unless it already works; returns its interpreter."""
    venv = os.path.abspath(venv or default_venv())
    if _works(venv):
        return _python(venv)
    if os.path.exists(venv):
        shutil.rmtree(venv)  # a half-built or broken environment: build it again
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    steps = [
        [python or sys.executable, "-m", "venv", venv],
        [_python(venv), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *PINS],
    ]
    for command in steps:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"building the DeepMind generator's environment failed: {' '.join(command)} exited "
                f"{done.returncode}:\n{done.stderr[-2000:]}\nIt needs a Python 3.7-3.11 with venv and pip, and "
                f"a package index with {', '.join(PINS)}"
            )
    if not _works(venv):
        raise RuntimeError(f"{venv} was built but cannot import mathematics_dataset with sympy 1.5.1")
    return _python(venv)


def _pairs(path: str) -> list[tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return list(zip(lines[0::2], lines[1::2]))


def _write(path: str, pairs: list[tuple[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{q}\n{a}\n" for q, a in pairs)


def _arithmetic_subset(root: str, seed: int, val_fraction: float) -> dict[str, int]:
    """Writes the four ``arithmetic_*.txt`` files from the generated modules; returns their sizes."""

    def gather(levels: tuple[str, ...]) -> list[tuple[str, str]]:
        pairs = []
        for level in levels:
            folder = os.path.join(root, level)
            for name in sorted(os.listdir(folder)):
                if name.startswith("arithmetic__"):
                    pairs += _pairs(os.path.join(folder, name))
        random.Random(f"{seed}/{'+'.join(levels)}").shuffle(pairs)
        return pairs

    train = gather(_LEVELS)
    held = round(len(train) * val_fraction)
    splits = {
        "train": train[held:],
        "val": train[:held],
        "interpolate": gather(("interpolate",)),
        "extrapolate": gather(("extrapolate",)),
    }
    for split, pairs in splits.items():
        _write(os.path.join(root, SPLIT_FILES[split]), pairs)
    return {split: len(pairs) for split, pairs in splits.items()}


def generate_deepmind(
    out: str,
    *,
    modules: tuple[str, ...] | list[str] = ARITHMETIC_MODULES,
    per_module: int = 10000,
    per_test_module: int | None = None,
    seed: int = 0,
    val_fraction: float = 0.01,
    venv: str | None = None,
) -> dict[str, Any]:
    """Generates the released layout and the arithmetic subset into ``out`` (see the module docstring)."""
    modules = [m.strip() for m in modules if m.strip()]
    if not modules:
        raise ValueError("modules is empty; name at least one, e.g. arithmetic__add_or_sub")
    if per_module < 1:
        raise ValueError(f"per_module must be >= 1, got {per_module}")
    per_test_module = min(per_module, 10000) if per_test_module is None else per_test_module
    if per_test_module < 1:
        raise ValueError(f"per_test_module must be >= 1, got {per_test_module}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    settings = {
        "generator": list(PINS),
        "modules": sorted(modules),
        "per_module": per_module,
        "per_test_module": per_test_module,
        "seed": seed,
        "val_fraction": val_fraction,
    }
    out = os.path.abspath(out)
    record = os.path.join(out, "generation.json")
    if os.path.exists(out):
        previous = None
        if os.path.isfile(record):
            with open(record, encoding="utf-8") as f:
                previous = json.load(f)
        if previous is not None and previous.get("settings") == settings:
            return previous
        raise ValueError(
            f"{out} already exists with other settings ({previous['settings'] if previous else 'no generation.json'}); "
            "remove it or choose another --out"
        )
    python = ensure_environment(venv)
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted run
    command = [
        python, _WORKER, "--out", partial, "--modules", ",".join(modules), "--per-module", str(per_module),
        "--per-test-module", str(per_test_module), "--seed", str(seed),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"the DeepMind generator failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    written = json.loads(done.stdout.strip().splitlines()[-1])
    arithmetic = any(m.startswith("arithmetic__") for m in modules)
    sizes = _arithmetic_subset(partial, seed, val_fraction) if arithmetic else {}
    result = {"settings": settings, "files": written, "arithmetic_subset": sizes}
    with open(os.path.join(partial, "generation.json"), "w") as f:
        json.dump(result, f, indent=2)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    os.replace(partial, out)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/mathematics_dataset-v1.0", help="output folder")
    parser.add_argument("--modules", default=",".join(ARITHMETIC_MODULES), help="comma-separated module names")
    parser.add_argument("--per-module", type=int, default=10000, help="questions per module per training level")
    parser.add_argument("--per-test-module", type=int, default=None, help="questions per module per test split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--venv", default=None, help=f"the generator's environment (default {default_venv()})")
    parser.add_argument("--setup-only", action="store_true", help="build the environment and stop")
    args = parser.parse_args(argv)
    try:
        if args.setup_only:
            print(ensure_environment(args.venv))
            return 0
        result = generate_deepmind(
            args.out, modules=args.modules.split(","), per_module=args.per_module,
            per_test_module=args.per_test_module, seed=args.seed, val_fraction=args.val_fraction, venv=args.venv,
        )  # fmt: skip
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    sizes = ", ".join(f"{split} {n}" for split, n in result["arithmetic_subset"].items())
    print(f"{args.out}: {len(result['settings']['modules'])} modules; arithmetic subset: {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
