"""Spawns CPU worker processes over gloo and hands each its tensor/data-parallel groups.

``run_workers(world_size, tp_size, fn, *args)`` starts ``world_size`` processes on loopback, builds
the data x tensor layout (TP groups of consecutive ranks, Megatron's convention), calls
``fn(ctx, *args)`` in each and raises in the parent if any worker failed, with the worker's traceback.
``fn`` must be a module-level function (spawned children import it).

``run_ranks_in_threads(fn, ranks)`` is the cheap in-process variant for the loss's own collectives:
one thread per rank, ``torch.distributed.all_reduce`` replaced by an in-memory MAX/SUM that records
each call.

``run_launch(command, timeout=...)`` runs a launcher command (``torchrun``, ``deepspeed``) like
``subprocess.run(..., capture_output=True, text=True)``, but a launch that outlives its timeout has every
process of its tree sent SIGABRT (with ``PYTHONFAULTHANDLER=1``, each prints the Python stack of every
thread: where a hung rank waits), SIGKILL for whatever still runs 20 s later, and fails the test with the
output's tail; no orphaned rank keeps a port or a core for the tests after it. The ranks are found as
the launcher's descendants (``torchrun`` starts each in a session of its own, out of reach of its
process group).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import resource
import shlex
import signal
import socket
import subprocess
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class WorkerContext:
    rank: int
    world_size: int
    tp_size: int
    tp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup


def run_launch(
    command: list[str], *, timeout: float, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)``; a launch past ``timeout`` fails (see the module)."""
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    _no_core_files()  # inherited by the launch: the SIGABRT below writes no core file into its directory
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal(_process_tree(proc.pid), signal.SIGABRT)  # faulthandler: every thread's Python stack to stderr
        out, err = _collect(proc)
        pytest.fail(
            f"timed out after {timeout:.0f} s, then every process sent SIGABRT (their Python stacks are "
            f"below): {shlex.join(map(str, command))}\n{(out + err)[-12000:]}"
        )
    except BaseException:  # Ctrl-C or a pytest timeout: the new session is out of the terminal's reach
        _signal(_process_tree(proc.pid), signal.SIGKILL)
        _collect(proc)
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _collect(proc: subprocess.Popen) -> tuple[str, str]:
    """The output of a launch being stopped; whatever of it still runs after 20 s is killed, then reaped."""
    try:
        return proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        _signal(_process_tree(proc.pid), signal.SIGKILL)  # the tree as it is now: no stale process id
        try:
            return proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:  # a process outside the tree holds the pipes
            proc.kill()
            proc.wait()
            return "", "(no output: the launch's pipes stayed open after it was killed)"


def _no_core_files() -> None:
    """This process and its children from now on: no core file (the soft limit only; the hard one stays)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))


def _process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ")"
                children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:  # a group leader (a rank): its own children (data loaders) too
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)


def skip_if_missing(module: str) -> None:
    """``pytest.importorskip(module)``'s skip, without importing ``module`` when it is installed: collection
    stays light in the workers that never run the file (megatron.core alone costs ~6 CPU-s to import)."""
    import importlib.util

    try:
        missing = importlib.util.find_spec(module) is None
    except ImportError:  # its parent package is missing
        missing = True
    if missing:
        pytest.importorskip(module)


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, tp_size: int, port: int, error_dir: str, fn, args) -> None:
    faulthandler.enable()  # a worker run_workers stops with SIGABRT prints where it waits
    _no_core_files()  # and leaves no core file behind
    torch.set_num_threads(1)
    try:
        from launch.startup import init_distributed

        init_distributed(rank=rank, world_size=world_size, backend="gloo", init_method=f"tcp://127.0.0.1:{port}")
        tp_groups = [dist.new_group(list(range(s, s + tp_size))) for s in range(0, world_size, tp_size)]
        dp_groups = [dist.new_group(list(range(r, world_size, tp_size))) for r in range(tp_size)]
        ctx = WorkerContext(
            rank=rank,
            world_size=world_size,
            tp_size=tp_size,
            tp_rank=rank % tp_size,
            dp_rank=rank // tp_size,
            tp_group=tp_groups[rank // tp_size],
            dp_group=dp_groups[rank % tp_size],
        )
        fn(ctx, *args)
        dist.barrier()
    except BaseException:
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(world_size: int, tp_size: int, fn, *args, timeout: float = 300.0) -> None:
    """Runs ``fn(ctx, *args)`` on ``world_size`` gloo processes (``world_size // tp_size`` DP replicas)."""
    if world_size % tp_size:
        raise ValueError(f"world_size {world_size} is not a multiple of tp_size {tp_size}")
    with tempfile.TemporaryDirectory() as error_dir:
        context = mp.start_processes(
            _worker,
            args=(world_size, tp_size, free_port(), error_dir, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):  # returns as each one ends
                if time.monotonic() >= deadline:
                    break
        except Exception as e:
            reports = sorted(os.listdir(error_dir))
            details = "\n".join(open(os.path.join(error_dir, r)).read() for r in reports)
            raise AssertionError(f"distributed worker failed:\n{details or e}") from None
        else:
            alive = [p for p in context.processes if p.is_alive()]
            if alive:
                for process in alive:  # faulthandler (enabled in each worker) prints its stacks to stderr
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, signal.SIGABRT)
                for process in alive:
                    process.join(10)
                    process.kill()
                    process.join()
                raise AssertionError(f"distributed workers did not finish within {timeout:.0f} s (stacks above)")


def run_ranks_in_threads(fn, ranks: int) -> tuple[dict[int, object], dict[int, list]]:
    """``fn(rank)`` in one thread per rank, with ``torch.distributed.all_reduce`` replaced by an in-memory
    reduction (MAX or SUM over the ranks' tensors) and ``get_world_size`` / ``get_rank`` answering for
    the thread. Returns each rank's result and each rank's all-reduce calls as ``(op, shape)``."""
    import pytest

    barrier = threading.Barrier(ranks)
    slots: dict[int, torch.Tensor] = {}
    local = threading.local()
    calls: dict[int, list] = {r: [] for r in range(ranks)}

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls[local.rank].append((op, tuple(tensor.shape)))
        slots[local.rank] = tensor.clone()
        barrier.wait()
        stacked = torch.stack([slots[r] for r in range(ranks)])
        reduced = stacked.amax(0) if op == dist.ReduceOp.MAX else stacked.sum(0)
        barrier.wait()
        tensor.copy_(reduced)

    results: dict[int, object] = {}

    def worker(rank: int) -> None:
        local.rank = rank
        results[rank] = fn(rank)

    patch = pytest.MonkeyPatch()
    patch.setattr(dist, "all_reduce", all_reduce)
    patch.setattr(dist, "get_world_size", lambda group=None: ranks)
    patch.setattr(dist, "get_rank", lambda group=None: local.rank)
    try:
        threads = [threading.Thread(target=worker, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        patch.undo()
    return results, calls
