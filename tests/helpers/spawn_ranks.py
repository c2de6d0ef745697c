"""Starts N ranks of one command on this host with the variables a launcher sets, without importing torch.

    python tests/helpers/spawn_ranks.py N PORT -- COMMAND ...                # as torchrun
    python tests/helpers/spawn_ranks.py --deepspeed N PORT -- SCRIPT ARGS ...  # as deepspeed --num_gpus N

As ``torchrun``, each rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR`` (loopback) and ``MASTER_PORT``. As DeepSpeed's launcher on one node
(``deepspeed.launcher.launch``, started by ``deepspeed``), each rank gets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``, ``CROSS_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, the
accelerator's visible devices (``CUDA_VISIBLE_DEVICES=0,...,N-1``, also for DeepSpeed's CPU accelerator) and
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (set by ``import deepspeed`` in the launcher, inherited), and runs
``python -u SCRIPT --local_rank=R ARGS``. Every rank shares this process's output. As under either launcher,
the first rank to fail stops the others (SIGTERM, SIGKILL 10 s later), and the exit status is that rank's (0
when every rank succeeds).

The Megatron-LM and DeepSpeed tests' launches of more than one process use it in place of
``torch.distributed.run`` and of ``deepspeed``, whose start-up (torchrun's agent; DeepSpeed's runner and
per-node launcher) imports torch once or twice more per launch; what the ranks run and see is the same. Each
launcher still starts runs itself: ``torch.distributed.run`` in ``tests/integration/test_megatron_lm.py``
(``torchrun=True``), the Hugging Face and megatron.core example tests; ``deepspeed`` in
``tests/integration/test_train_deepspeed.py`` (the uninterrupted ZeRO-3 run; ``deepspeed_command(...,
launcher=True)``) and in ``scripts/run.sh`` (``tests/integration/test_main_job.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _rank_env(rank: int, world: int, port: str) -> dict[str, str]:
    """What ``torchrun`` and DeepSpeed's launcher both give rank ``rank`` of ``world`` on one host."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port)  # fmt: skip


def torchrun_env(rank: int, world: int, port: str) -> dict[str, str]:
    """The variables ``torchrun`` gives rank ``rank`` of ``world`` on one host, rendezvous on ``port``."""
    return {**_rank_env(rank, world, port), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0"}


def deepspeed_env(rank: int, world: int, port: str) -> dict[str, str]:
    """The variables ``deepspeed --num_gpus world`` gives rank ``rank`` on one node, rendezvous on ``port``
    (``deepspeed.launcher.launch``: node 0 of 1, devices 0 to world - 1)."""
    return {**_rank_env(rank, world, port), "LOCAL_SIZE": str(world), "CROSS_RANK": "0", "CROSS_SIZE": "1",
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(world)))}  # fmt: skip


def torchrun_command(nproc: int, port: str, script: str, *args: str, launcher: bool = False) -> list[str]:
    """The command that runs ``script args`` on ``nproc`` ranks of this host as ``torchrun --nproc_per_node nproc
    --master_port port script args`` does: by this file, or (``launcher``) by ``torch.distributed.run`` itself."""
    if launcher:
        runner = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", port]
        return [*runner, script, *args]
    return [sys.executable, os.path.abspath(__file__), str(nproc), port, "--", sys.executable, "-u", script, *args]


def deepspeed_command(nproc: int, port: str, script: str, *args: str, launcher: bool = False) -> list[str]:
    """The command that runs ``script args`` on ``nproc`` ranks of this host as ``deepspeed --num_gpus nproc
    --master_port port script args`` does: by this file, or (``launcher``) by DeepSpeed's own launcher."""
    if launcher:
        runner = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", port]
        return [*runner, script, *args]
    return [sys.executable, os.path.abspath(__file__), "--deepspeed", str(nproc), port, "--", script, *args]


def main(argv: list[str]) -> int:
    deepspeed = argv[:1] == ["--deepspeed"]
    argv = argv[1:] if deepspeed else argv
    if len(argv) < 4 or argv[2] != "--":
        raise SystemExit("usage: spawn_ranks.py [--deepspeed] N PORT -- COMMAND ...")
    world, port, command = int(argv[0]), argv[1], argv[3:]
    ranks = []
    for rank in range(world):
        if deepspeed:  # deepspeed.launcher.launch: python -u SCRIPT --local_rank=R ARGS
            env = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", **os.environ, **deepspeed_env(rank, world, port)}
            argv_rank = [sys.executable, "-u", command[0], f"--local_rank={rank}", *command[1:]]
        else:
            env, argv_rank = {**os.environ, **torchrun_env(rank, world, port)}, command
        ranks.append(subprocess.Popen(argv_rank, env=env))
    status = 0
    running = list(ranks)
    while running:
        for proc in list(running):
            code = proc.poll()
            if code is None:
                continue
            running.remove(proc)
            if code != 0 and status == 0:
                status = code if code > 0 else 128 - code
                for other in running:
                    other.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 10
                for other in running:
                    try:
                        other.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        other.kill()
        time.sleep(0.2)
    for proc in ranks:
        proc.wait()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
