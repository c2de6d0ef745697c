"""Real Megatron-LM releases for the tests: checkouts from ``../shared/third_party`` and a runner.

``checkout(tag)`` extracts ``megatron-lm-<tag>.tar.gz`` once into a cache folder and builds the dataset
helpers with Megatron's own ``make`` (pybind11 and a C++ compiler come from ``scripts/setup.sh``), or
uses ``MEGATRON_LM_PATH`` when set. ``run(...)`` launches a script of the checkout (or our drop-in)
through ``tests/helpers/megatron_lm_cpu.py`` in ``nproc`` ranks started with the variables torchrun sets
(one process directly, several by ``tests/helpers/spawn_ranks.py``; ``torchrun=True``: under
``torch.distributed.run`` itself) and returns the per-iteration trace (full-precision losses and
gradient norm) and the output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.distributed import free_port, run_launch
from tests.helpers.spawn_ranks import torchrun_command, torchrun_env

ROOT = Path(__file__).resolve().parents[2]
THIRD_PARTY = ROOT.parent / "shared" / "third_party"
RELEASES = ("core_v0.16.1", "core_v0.19.0")
HARNESS = ROOT / "tests" / "helpers" / "megatron_lm_cpu.py"
DROP_IN = ROOT / "launch" / "pretrain_gpt_ntl.py"
CACHE = Path(os.environ.get("NTL_SCALE_CACHE", Path.home() / ".cache" / "ntl_scale")) / "third_party"


def _env() -> dict[str, str]:
    """The child environment: this interpreter first on PATH (Megatron's Makefile calls ``python3``)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    site = ROOT / "tests" / "helpers" / "py311_site"  # typing.override for spawned children (3.11)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site), env.get("PYTHONPATH", "")])
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron asks for it with TP/CP
    env["OMP_NUM_THREADS"] = "1"
    env.pop("NTL_TEST_TRACE", None)
    return env


def checkout(tag: str) -> Path:
    """A Megatron-LM checkout of release ``tag`` with its dataset helpers built; skips (never in CI) without one."""
    if os.environ.get("MEGATRON_LM_PATH"):
        path = Path(os.environ["MEGATRON_LM_PATH"])
    else:
        archive = THIRD_PARTY / f"megatron-lm-{tag}.tar.gz"
        if not archive.is_file():
            reason = f"no Megatron-LM {tag}: {archive} is missing and MEGATRON_LM_PATH is not set"
            if os.environ.get("CI"):
                pytest.fail(f"{reason} (CI must run the real Megatron-LM tests)")
            pytest.skip(reason)
        path = CACHE / f"Megatron-LM-{tag}"
        if not (path / ".ntl_scale_complete").is_file():
            CACHE.mkdir(parents=True, exist_ok=True)
            with tarfile.open(archive) as tar:
                tar.extractall(CACHE, filter="data")
            (path / ".ntl_scale_complete").write_text(tag)
    datasets = path / "megatron" / "core" / "datasets"
    subprocess.run(["make", "-C", str(datasets)], check=True, env=_env(), capture_output=True)
    return path


@dataclass
class Run:
    returncode: int
    output: str
    trace: list[dict]
    validations: list[dict[str, float]] = field(default_factory=list)  # each evaluation's totals, in order

    def losses(self, key: str = "lm loss") -> dict[int, float]:
        return {r["iteration"]: r["losses"][key] for r in self.trace if key in r["losses"]}

    def grad_norms(self) -> dict[int, float]:
        return {r["iteration"]: r["grad_norm"] for r in self.trace}


# What the CPU harness needs on top of a GPU command: gloo, Megatron's own (local) layers built on the CPU,
# no fused CUDA kernels, and no gradient clipping (its norm asserts CUDA tensors). Appended last, so they
# win over a command's own choices.
CPU_FLAGS = [
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion", "--no-masked-softmax-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm", "--clip-grad", "0",
]  # fmt: skip


def tiny_args(*, iters: int = 3, micro_batch: int = 2, global_batch: int = 4, vocab: int = 127) -> list[str]:
    """A 2-layer, 32-wide GPT on CPU: local transformer, fusions off, dropout 0, no gradient clipping.

    ``--make-vocab-size-divisible-by 64`` pads the vocabulary to 128 at TP 1 and 2 alike, so runs
    with different layouts build the same model.
    """
    return [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", str(micro_batch),
        "--global-batch-size", str(global_batch), "--train-iters", str(iters), "--lr", "1e-3",
        "--lr-decay-style", "constant", "--vocab-size", str(vocab), "--make-vocab-size-divisible-by", "64",
        "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
        "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion", "--no-masked-softmax-fusion",
        "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--clip-grad", "0", "--log-interval", "1", "--seed", "1234",
    ]  # fmt: skip


def run(
    tag: str,
    script: str | Path,
    args: list[str],
    *,
    nproc: int,
    workdir: Path,
    timeout: int = 420,
    cwd: Path | None = None,
    torchrun: bool = False,
) -> Run:
    """Runs ``script`` (relative to ``cwd``, by default the checkout, or absolute) in ``nproc`` CPU processes
    (started with torchrun's variables; under ``torch.distributed.run`` itself with ``torchrun``)."""
    path = checkout(tag)
    workdir.mkdir(parents=True, exist_ok=True)
    trace = workdir / f"trace-{free_port()}.jsonl"
    env = _env()
    env["MEGATRON_LM_PATH"] = str(path)
    env["NTL_TEST_TRACE"] = str(trace)
    if nproc == 1 and not torchrun:  # the rank torchrun would start, with its variables, without torchrun
        env.update(torchrun_env(0, 1, str(free_port())))
        command = [sys.executable, "-u", str(HARNESS), str(script), *args]
    else:  # the ranks torchrun would start, by a starter that does not import torch (or by torchrun itself)
        command = torchrun_command(nproc, str(free_port()), str(HARNESS), str(script), *args, launcher=torchrun)
    done = run_launch(command, cwd=path if cwd is None else cwd, env=env, timeout=timeout)
    records = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
    training = [r for r in records if "validation" not in r]
    validations = [r["validation"] for r in records if "validation" in r]
    return Run(done.returncode, done.stdout + done.stderr, training, validations)


def run_tool(tag: str, script: str, args: list[str], *, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs a single-process tool of the checkout (``tools/preprocess_data.py``) under the same harness."""
    path = checkout(tag)
    env = _env()
    env["MEGATRON_LM_PATH"] = str(path)
    command = [sys.executable, str(HARNESS), script, *args]
    return subprocess.run(command, cwd=path, env=env, capture_output=True, text=True, timeout=timeout)


def tail(text: str, lines: int = 60) -> str:
    """The end of a run's output, for assertion messages."""
    return "\n".join(line for line in text.splitlines() if "warn" not in line.lower())[-6000:]
