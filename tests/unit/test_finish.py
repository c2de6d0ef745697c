"""``launch/finish.py``: a finished multi-rank process ends as CPython's own exit would, minus finalisation.

The reference is the interpreter itself: the same script run to an ordinary exit. Both must print the same
(buffered Python output, a C ``printf`` left in libc's buffer), run the same ``atexit`` handlers in the same
order, wait for the same non-daemon thread, leave the same bytes in a file left open and exit 0. With
``WORLD_SIZE`` 2 the process must not reach finalisation (an object whose ``__del__`` runs then, and only
then, stays silent); with ``WORLD_SIZE`` 1 it must. ``run_then_leave`` leaves after ``sys.exit(0)`` (as
Megatron-LM's ``pretrain`` stops) and exits as before on any other status. Under ``torchrun`` with a gloo
group still up, both ranks meet at the barrier (a rank that arrives late holds the other back), destroy the
group and exit 0.
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
    from launch.finish import leave_after_a_finished_run, run_then_leave

    class AtFinalisation:
        def __del__(self, write=os.write):  # bound now: module globals are gone when it runs
            write(1, b"finalised\\n")

    keep = AtFinalisation()  # a module global: destroyed only when the interpreter finalises
    atexit.register(lambda: sys.stdout.write("atexit first-registered\\n"))
    atexit.register(lambda: sys.stdout.write("atexit last-registered\\n"))
    left_open = open({path!r}, "w")  # never flushed nor closed: finalisation flushes it
    left_open.write("written, never flushed")

    def late():
        time.sleep(1.0)
        sys.stdout.write("thread done\\n")

    threading.Thread(target=late).start()  # non-daemon: an ordinary exit waits for it
    sys.stdout.write("buffered, no newline;")
    ctypes.CDLL(None).printf(b"from C\\n")  # stays in libc's buffer (stdout is a pipe)
    how = {how!r}
    if how == "leave":
        leave_after_a_finished_run()
    elif how == "exit-bare":
        run_then_leave(lambda: sys.exit())  # Megatron-LM's checkpoint errors: one rank, no status
    elif how.startswith("exit"):
        run_then_leave(lambda: sys.exit(int(how[4:])))
    """
)


def _run(tmp_path: Path, how: str, world_size: str) -> tuple[subprocess.CompletedProcess, str]:
    # PYTHONUNBUFFERED (set on some machines) makes Python and C output unbuffered: the flushes would go untested
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "WORLD_SIZE": world_size}
    path = tmp_path / f"{how}-{world_size}.txt"
    code = SCRIPT.format(root=str(ROOT), how=how, path=str(path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    return done, path.read_text() if path.exists() else ""


@pytest.mark.parametrize("how", ["leave", "exit0"])
def test_a_multi_rank_process_ends_as_an_ordinary_exit_without_finalising(tmp_path, how):
    ordinary, ordinary_file = _run(tmp_path, "none", "2")
    left, left_file = _run(tmp_path, how, "2")
    assert ordinary.returncode == 0 and left.returncode == 0, (ordinary.stderr, left.stderr)
    assert "finalised" in ordinary.stdout  # the control: the script does reach finalisation normally
    assert left.stdout == ordinary.stdout.replace("finalised\n", ""), (left.stdout, ordinary.stdout)
    for line in ("thread done", "atexit last-registered\natexit first-registered", "from C", "buffered, no newline;"):
        assert line in left.stdout, left.stdout
    assert left_file == ordinary_file == "written, never flushed"


def test_a_one_rank_process_returns_and_exits_normally(tmp_path):
    ordinary, _ = _run(tmp_path, "none", "1")
    one, _ = _run(tmp_path, "leave", "1")
    assert one.returncode == 0 and one.stdout == ordinary.stdout and "finalised" in one.stdout, one.stdout


@pytest.mark.parametrize("how, status", [("exit3", 3), ("exit-bare", 0)])
def test_an_exit_other_than_sys_exit_0_is_an_ordinary_exit(tmp_path, how, status):
    ordinary, ordinary_file = _run(tmp_path, "none", "2")
    stopped, written = _run(tmp_path, how, "2")
    assert stopped.returncode == status and "finalised" in stopped.stdout, (stopped.returncode, stopped.stdout)
    pieces = ("buffered, no newline;", "from C\n", "thread done\n", "atexit last-registered\natexit first-registered\n")
    for piece in pieces:  # C's and Python's buffers reach the pipe in another order when an exception ends it
        assert piece in stopped.stdout, stopped.stdout
    assert len(stopped.stdout) == len(ordinary.stdout) and written == ordinary_file == "written, never flushed"


def test_a_process_that_never_imported_torch_leaves_too():
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); import atexit; "
        "atexit.register(lambda: print('atexit ran')); "
        "from launch.finish import leave_after_a_finished_run; leave_after_a_finished_run(); print('not reached')"
    )
    env = {**os.environ, "WORLD_SIZE": "2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "atexit ran\n", ""), done
    assert "torch" not in subprocess.run([sys.executable, "-c", code + "; import sys; print(sorted(sys.modules))"],
                                         env={**os.environ, "WORLD_SIZE": "1"}, capture_output=True, text=True,
                                         timeout=60).stdout  # fmt: skip


@pytest.mark.distributed
def test_torchrun_ranks_with_a_live_group_meet_destroy_it_and_exit_zero(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import atexit, os, sys, time
            import torch, torch.distributed as dist
            sys.path.insert(0, {str(ROOT)!r})
            from launch.finish import leave_after_a_finished_run

            def say(text):  # one write(2) a line: the ranks share one pipe, and print() may write the newline apart
                os.write(1, (text + "\\n").encode())

            dist.init_process_group("gloo")
            rank = dist.get_rank()
            total = torch.tensor([float(rank + 1)])
            dist.all_reduce(total)
            destroy = dist.destroy_process_group
            dist.destroy_process_group = lambda *a, **k: (say("destroyed"), destroy(*a, **k))
            atexit.register(lambda: say(f"rank {{rank}} atexit {{time.time():.3f}}"))
            say(f"rank {{rank}} sum {{total.item():.0f}}")
            if rank == 1:
                time.sleep(3.0)  # the late rank: the barrier holds rank 0 until it arrives
                say(f"rank 1 arrives {{time.time():.3f}}")
            leave_after_a_finished_run()
            say("not reached")
            """
        )
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(script)]  # fmt: skip
    done = run_launch(command, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sorted(line for line in lines if " sum " in line) == ["rank 0 sum 3", "rank 1 sum 3"], done.stdout
    assert done.stdout.count("destroyed") == 2 and "not reached" not in done.stdout, done.stdout
    stamp = {
        " ".join(line.split()[:-1]): float(line.split()[-1]) for line in lines if "atexit" in line or "arrives" in line
    }
    assert stamp["rank 0 atexit"] >= stamp["rank 1 arrives"], stamp
