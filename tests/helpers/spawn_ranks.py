"""Starts N ranks of one command on this host with the variables ``torchrun`` sets, without importing torch.

    python tests/helpers/spawn_ranks.py N PORT -- COMMAND ...

Each rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR`` (loopback) and ``MASTER_PORT``, and shares this process's output. As under ``torchrun``,
the first rank to fail stops the others (SIGTERM, SIGKILL 10 s later), and the exit status is that
rank's (0 when every rank succeeds). The tests' launches of more than one process use it in place of
``torch.distributed.run``, whose agent imports torch once more per launch; what the ranks run is the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def torchrun_env(rank: int, world: int, port: str) -> dict[str, str]:
    """The variables ``torchrun`` gives rank ``rank`` of ``world`` on one host, rendezvous on ``port``."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        raise SystemExit("usage: spawn_ranks.py N PORT -- COMMAND ...")
    world, port, command = int(argv[0]), argv[1], argv[3:]
    ranks = []
    for rank in range(world):
        ranks.append(subprocess.Popen(command, env={**os.environ, **torchrun_env(rank, world, port)}))
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
