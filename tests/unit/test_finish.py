"""``launch/finish.py``: a finished multi-rank process ends as CPython's own exit would, minus finalisation.

The reference is the interpreter itself: the same script run to an ordinary exit. Both must print the same
(buffered Python output, a C ``printf`` left in libc's buffer), run the same ``atexit`` handlers in the same
order, wait for the same non-daemon thread and exit 0. With ``WORLD_SIZE`` 2 the process must not reach
finalisation (an object's ``__del__`` that runs then, and only then, stays silent); with ``WORLD_SIZE`` 1 it
must. Under ``torchrun`` with a gloo group still up, both ranks pass the barrier, destroy the group and exit 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.distributed import free_port, run_launch

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import atexit, ctypes, os, sys, threading, time
    import torch.distributed  # imported ahead: the thread below must outlast the call, not an import
    sys.path.insert(0, {root!r})
    from launch.finish import leave_after_a_finished_run

    class AtFinalisation:
        def __del__(self, write=os.write):  # bound now: module globals are gone when it runs
            write(1, b"finalised\\n")

    keep = AtFinalisation()  # a module global: destroyed only when the interpreter finalises
    atexit.register(lambda: sys.stdout.write("atexit first-registered\\n"))
    atexit.register(lambda: sys.stdout.write("atexit last-registered\\n"))

    def late():
        time.sleep(1.0)
        sys.stdout.write("thread done\\n")

    threading.Thread(target=late).start()  # non-daemon: an ordinary exit waits for it
    sys.stdout.write("buffered, no newline;")
    ctypes.CDLL(None).printf(b"from C\\n")  # stays in libc's buffer (stdout is a pipe)
    if {leave}:
        leave_after_a_finished_run()
    """
)


def _run(leave: bool, world_size: str) -> subprocess.CompletedProcess:
    # PYTHONUNBUFFERED (set on some machines) makes Python and C output unbuffered: the flushes would go untested
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "WORLD_SIZE": world_size}
    code = SCRIPT.format(root=str(ROOT), leave=leave)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_a_multi_rank_process_ends_as_an_ordinary_exit_without_finalising():
    ordinary = _run(leave=False, world_size="2")
    left = _run(leave=True, world_size="2")
    assert ordinary.returncode == 0 and left.returncode == 0, (ordinary.stderr, left.stderr)
    assert "finalised" in ordinary.stdout  # the control: the script does reach finalisation normally
    expected = ordinary.stdout.replace("finalised\n", "")
    assert left.stdout == expected, (left.stdout, ordinary.stdout)
    for line in ("thread done", "atexit last-registered\natexit first-registered", "from C", "buffered, no newline;"):
        assert line in left.stdout, left.stdout


def test_a_one_rank_process_returns_and_exits_normally():
    ordinary = _run(leave=False, world_size="1")
    one = _run(leave=True, world_size="1")
    assert one.returncode == 0 and one.stdout == ordinary.stdout and "finalised" in one.stdout, one.stdout


@pytest.mark.distributed
def test_torchrun_ranks_with_a_live_group_meet_destroy_it_and_exit_zero(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            import torch, torch.distributed as dist
            sys.path.insert(0, {str(ROOT)!r})
            from launch.finish import leave_after_a_finished_run

            dist.init_process_group("gloo")
            total = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(total)
            destroy = dist.destroy_process_group
            dist.destroy_process_group = lambda *a, **k: (print("destroyed", flush=True), destroy(*a, **k))
            print(f"rank {{dist.get_rank()}} sum {{total.item():.0f}}", flush=True)
            leave_after_a_finished_run()
            print("not reached", flush=True)
            """
        )
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(script)]  # fmt: skip
    done = run_launch(command, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 sum 3",
        "rank 1 sum 3",
    ]
    assert done.stdout.count("destroyed") == 2 and "not reached" not in done.stdout, done.stdout
