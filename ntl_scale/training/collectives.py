"""Every collective of the DeepSpeed training loop, named by what the ranks agree on.

Each helper takes its group or rank explicitly; tensors it creates are on ``device`` (NCCL reduces device
tensors only). DeepSpeed's engine does its own gradient and parameter collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["barrier", "from_rank_zero", "gathered", "largest_over_ranks", "on_rank_zero", "rank_zero_first", "sum_over"]

T = TypeVar("T")


def sum_over(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """``tensor`` summed over the ranks of ``group``, in place (one SUM all-reduce); returns it."""
    dist.all_reduce(tensor, group=group)
    return tensor


def largest_over_ranks(value: int, device: torch.device) -> int:
    """The largest ``value`` of all ranks of the world (one MAX all-reduce of an int64 on ``device``)."""
    flag = torch.tensor([value], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def barrier() -> None:
    """Every rank of the world waits for the others."""
    dist.barrier()


def rank_zero_first(rank: int, work: Callable[[], T]) -> T:
    """``work()`` on every rank, rank 0 first and the others after it (one barrier): rank 0 fills a cache
    (the ``datasets`` Arrow files) that the others then read instead of writing it at the same time."""
    result = work() if rank == 0 else None
    dist.barrier()
    return work() if rank != 0 else result  # type: ignore[return-value]


def on_rank_zero(rank: int, device: torch.device, work: Callable[[], Any], what: str) -> None:
    """Runs ``work`` on rank 0 while the others wait; if it fails, every rank stops (none waits forever)."""
    failed = torch.zeros(1, dtype=torch.long, device=device)
    error = None
    if rank == 0:
        try:
            work()
        except Exception as exc:  # re-raised below, after the other ranks have been told
            failed[0], error = 1, exc
    dist.broadcast(failed, src=0)
    if error is not None:
        raise error
    if failed.item():
        raise RuntimeError(f"rank 0 failed {what} (its error is above); stopping")


def from_rank_zero(value: T) -> T:
    """Rank 0's ``value`` on every rank (one object broadcast; pass anything picklable on the others)."""
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[no-any-return]


def gathered(value: Any, group: Any, size: int) -> list[Any]:
    """Every rank's ``value`` of ``group`` (``size`` ranks), in group-rank order (one object all-gather)."""
    shares: list[Any] = [None] * size
    dist.all_gather_object(shares, value, group=group)
    return shares
