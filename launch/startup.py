"""Distributed start-up of one process: its process group and its device, from values the caller passes.

:func:`init_distributed` is the one place the launchers (``launch/train.py``, ``launch/megatron_example.py``)
and the test and benchmark workers create a process group. It reads no environment variable: the
launcher reads its rendezvous (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...) and passes the values.

- NCCL with CUDA, else gloo (``backend`` overrides; under DeepSpeed its accelerator's backend);
- on a GPU the process is bound to GPU ``local_rank`` before any collective (NCCL needs it);
- ``launched=False``: a process started without a launcher is a one-rank world on an in-process store
  (``HashStore``): no rendezvous port is picked ahead of its use, so single-process runs started side by
  side cannot race for one;
- ``deepspeed=True``: ``deepspeed.init_distributed`` then adopts the group as it is (a launched process's
  group is created by DeepSpeed from its launcher's rendezvous, as DeepSpeed reads it), and the device
  is DeepSpeed's accelerator's.
"""

from __future__ import annotations

import contextlib
import io
import os

import torch
import torch.distributed as dist

__all__ = ["init_distributed"]


def init_distributed(
    *,
    rank: int = 0,
    world_size: int = 1,
    local_rank: int = 0,
    launched: bool = True,
    backend: str | None = None,
    init_method: str | None = None,
    threads: int | None = None,
    deepspeed: bool = False,
) -> tuple[int, int, torch.device]:
    """Creates this process's default process group; returns its rank, the world size and its device.

    Args:
        rank: this process's rank (ignored with ``launched=False``, a world of one; with
            ``deepspeed=True`` DeepSpeed reads its launcher's).
        world_size: the number of processes (ignored as ``rank`` is).
        local_rank: this process's rank on its node: the GPU it is bound to.
        launched: False for a process started without a launcher: a one-rank world on an in-process
            store, no rendezvous port.
        backend: ``"nccl"``, ``"gloo"``, ...; None: NCCL with CUDA, else gloo.
        init_method: torch's rendezvous (``"tcp://host:port"``); None: ``env://``, the launcher's
            ``MASTER_ADDR``/``MASTER_PORT``.
        threads: torch's CPU threads for this process (None: as they are).
        deepspeed: start DeepSpeed's communication too (``deepspeed.init_distributed``, which adopts
            the group); its engine reads ``LOCAL_RANK``, set here for a process without a launcher.
    """
    for name, value, least in (("rank", rank, 0), ("world_size", world_size, 1), ("local_rank", local_rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"init_distributed: {name} must be an int >= {least}, got {value!r}")
    if launched and rank >= world_size:
        raise ValueError(f"init_distributed: rank={rank} must be below world_size={world_size}")
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"init_distributed: threads must be an int >= 1 or None, got {threads!r}")
        torch.set_num_threads(threads)
    if deepspeed:
        return _init_deepspeed(launched=launched, local_rank=local_rank)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # before any collective: NCCL binds each rank to its own GPU
        device = torch.device("cuda", local_rank)
    if not launched:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return dist.get_rank(), dist.get_world_size(), device


def _init_deepspeed(*, launched: bool, local_rank: int) -> tuple[int, int, torch.device]:
    """DeepSpeed's accelerator's backend and device; ``deepspeed.init_distributed`` adopts the group."""
    if not launched:  # DeepSpeed's engine reads LOCAL_RANK; nothing reads MASTER_ADDR/MASTER_PORT here
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    on_cpu = accelerator.device_name() == "cpu"
    backend = "gloo" if on_cpu else accelerator.communication_backend_name()  # nccl on NVIDIA and AMD GPUs
    if not on_cpu:  # before any collective: NCCL binds each rank to its own GPU
        accelerator.set_device(local_rank)
    if not launched:  # a HashStore lives in this process: no TCPStore, no port picked ahead of its use
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # DeepSpeed's CPU backend prints "... built successfully" per rank
        deepspeed.init_distributed(dist_backend=backend)  # adopts an initialised group as it is
    for line in printed.getvalue().splitlines():
        if not (line.startswith("DeepSpeed ") and line.endswith(" built successfully")):
            print(line, flush=True)
    device = torch.device(accelerator.current_device_name())
    return dist.get_rank(), dist.get_world_size(), device
