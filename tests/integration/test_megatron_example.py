"""The megatron.core example (launch/megatron_example.py) end to end at TP = 2 x PP = 2 on CPU.

A real indexed dataset of arithmetic text, a character tokenizer's digit table, Megatron's pipeline
schedule; CE + 0.3 * NTL-WAS must decrease. CPU patches come from tests/helpers/megatron_cpu.py.

The run is also test_host_tensors.py's section 3: it trains under ``tests/helpers/host_guard.py``
(the dataset's samples arrive as host-only tensors, tensors the example creates without ``device=``
are host-only, collectives refuse them), so a forgotten device move fails here; the first stage must
have read host batches and moved them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.distributed import WorkerContext, run_workers, skip_if_missing
from tests.helpers.scripts import load_script

skip_if_missing("megatron.core")
pytestmark = pytest.mark.distributed

EXAMPLE = Path(__file__).resolve().parents[2] / "launch" / "megatron_example.py"


def _worker(ctx: WorkerContext, workdir: str) -> None:
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from tests.helpers import host_guard
    from tests.helpers.megatron_cpu import patch_for_cpu

    patch_for_cpu()
    host_guard.install(files={str(EXAMPLE)})
    read = GPTDataset.__getitem__
    GPTDataset.__getitem__ = lambda self, i: host_guard._wrap(read(self, i))  # the data arrive on the host
    example = load_script("launch/megatron_example.py", "megatron_example")
    args = example.parse_args(
        f"--tp 2 --pp 2 --steps 30 --micro-batches 2 --ntl-weight 0.3 --workdir {workdir}".split()
    )
    history = example.train(args)
    if ctx.rank == 0:  # the guard was active: the first stage read host batches and moved them
        assert host_guard.COUNTS["wrapped"] > 0 and host_guard.COUNTS["moved"] > 0, host_guard.COUNTS
    if history:
        with open(os.path.join(workdir, f"history{ctx.rank}.json"), "w") as f:
            json.dump(history, f)


def test_example_trains_at_tp2_pp2(tmp_path):
    run_workers(4, 4, _worker, str(tmp_path))
    files = sorted(tmp_path.glob("history*.json"))
    assert files, "the last pipeline stage reports losses"
    history = json.loads(files[0].read_text())
    assert len(history) == 30
    assert set(history[0]) == {"lm loss", "ntl loss", "number accuracy"}

    def mean(key, rows):
        return sum(r[key] for r in rows) / len(rows)

    first, last = history[:3], history[-3:]
    assert mean("lm loss", last) < 0.9 * mean("lm loss", first)
    assert mean("ntl loss", last) < mean("ntl loss", first)  # digits are learnt later; it must not rise


# The laptop route as the docs write it: configs/megatron/tiny_cpu.yaml through the example on CPU.

ROOT = EXAMPLE.parents[1]
TINY = "configs/megatron/tiny_cpu.yaml"


def test_every_flag_of_the_tiny_config_reaches_the_example():
    """Each ``megatron_args`` key of tiny_cpu.yaml is a flag of the example and arrives with the file's value."""
    import yaml

    example = load_script("launch/megatron_example.py", "megatron_example_flags")
    flags = yaml.safe_load((ROOT / TINY).read_text())["megatron_args"]
    args = example.parse_args(["--config", str(ROOT / TINY)])
    dests = {"train-iters": "steps"}
    for flag, value in flags.items():
        dest = dests.get(flag, flag.replace("-", "_"))
        assert hasattr(args, dest), f"--{flag} of {TINY} is not a flag of launch/megatron_example.py"
        assert getattr(args, dest) == value, flag
    assert example.parse_args(["--config", str(ROOT / TINY), "--lr", "0.5"]).lr == 0.5  # the command line wins


def test_tiny_config_trains_on_cpu_as_documented():
    """The command of configs/megatron/tiny_cpu.yaml and docs/megatron.md, run as written (30 steps)."""
    import sys

    from tests.helpers.distributed import free_port, run_launch

    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
        "tests/helpers/megatron_cpu_launch.py", "launch/megatron_example.py", "--config", TINY,
    ]  # fmt: skip
    written = " ".join((ROOT / TINY).read_text().replace("\\", " ").replace("#", " ").split())
    assert "torchrun " + " ".join(command[3:5] + command[7:]) in written
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = run_launch(command, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(rows) == 30 and rows[-1][1] == "30/30", out.stdout[-2000:]
    lm = [float(r[r.index("lm") + 2]) for r in rows]
    ntl = [float(r[r.index("ntl") + 2]) for r in rows]
    assert all(0 < v < 10 for v in lm + ntl), (lm, ntl)  # ntl-weight 0.3 in the file: NTL is computed
    assert sum(lm[-5:]) < 0.95 * sum(lm[:5]), lm
