"""The training loop's collectives (ntl_scale/training/collectives.py) and the run status every rank
agrees on (``Checkpointer.read_state``), on two gloo processes.

Each helper's result is compared with what the two ranks' inputs give when combined here by hand; the
status is read from a file only rank 0 can see (rank 1's run directory has none), so agreement can only
come through the broadcast. One spawned worker runs every check (start-up costs more than the checks).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers.distributed import WorkerContext, run_workers

pytestmark = pytest.mark.distributed
CPU = torch.device("cpu")


def _raises(expected: type[BaseException], match: str, fn) -> None:
    with pytest.raises(expected, match=match):
        fn()


def _helpers(ctx: WorkerContext, tmp: str) -> None:
    from ntl_scale.training.collectives import (
        from_rank_zero,
        gathered,
        largest_over_ranks,
        on_rank_zero,
        rank_zero_first,
        sum_over,
    )

    rank = ctx.rank
    sums = torch.tensor([1.0 + rank, 10.0 * rank, 0.5], dtype=torch.float64)
    assert sum_over(sums, ctx.dp_group) is sums and sums.tolist() == [1.0 + 2.0, 0.0 + 10.0, 1.0]
    assert largest_over_ranks(7 * rank, CPU) == 7 and largest_over_ranks(0, CPU) == 0
    assert from_rank_zero(("rank", rank)) == ("rank", 0)
    assert gathered((rank, [rank] * 2), ctx.dp_group, 2) == [(0, [0, 0]), (1, [1, 1])]

    cache = os.path.join(tmp, "cache.txt")

    def fill_or_read() -> str:  # rank 0 fills the cache; the others must find it filled
        if rank == 0:
            with open(cache, "w") as f:
                f.write("filled")
            return "wrote"
        with open(cache) as f:
            return f.read()

    assert rank_zero_first(rank, fill_or_read) == ("wrote" if rank == 0 else "filled")

    converted = os.path.join(tmp, "converted")
    on_rank_zero(rank, CPU, lambda: os.makedirs(converted), "converting")
    assert os.path.isdir(converted)  # every rank returns after rank 0's work is done

    def fail() -> None:
        raise OSError("disk full")

    if rank == 0:
        _raises(OSError, "disk full", lambda: on_rank_zero(rank, CPU, fail, "converting"))  # its own error
    else:  # told, not left waiting
        _raises(RuntimeError, "rank 0 failed converting", lambda: on_rank_zero(rank, CPU, fail, "converting"))


def _status(ctx: WorkerContext, tmp: str) -> None:
    from ntl_scale.integrations.deepspeed.checkpointer import Checkpointer
    from ntl_scale.integrations.deepspeed.resume_layout import Layout
    from ntl_scale.training.collectives import barrier

    run_dir = os.path.join(tmp, f"run{ctx.rank}")  # rank 1's directory never holds a status file
    os.makedirs(run_dir, exist_ok=True)
    checkpoints = Checkpointer(run_dir, Layout(2, 1, 8), save_every=0, rank=ctx.rank, device=CPU)
    assert checkpoints.read_state() == "finished"  # none written (a run from before status files)
    checkpoints.write_status("stopped", 7)
    barrier()
    assert os.path.isfile(os.path.join(run_dir, "status.json")) == (ctx.rank == 0)
    assert checkpoints.read_state() == "stopped"  # rank 0's file, on every rank
    if ctx.rank == 0:
        with open(os.path.join(run_dir, "status.json"), "w") as f:
            f.write("{not json")
    barrier()
    _raises(ValueError, "status.json is unreadable .* delete it", checkpoints.read_state)  # every rank, same error
    if ctx.rank == 0:
        with open(os.path.join(run_dir, "status.json"), "w") as f:
            json.dump({"state": "running", "step": 3}, f)
    barrier()
    assert checkpoints.read_state() == "running"


def _worker(ctx: WorkerContext, tmp: str) -> None:
    _helpers(ctx, tmp)
    _status(ctx, tmp)


def test_collectives_and_status_agree_on_two_ranks(tmp_path):
    run_workers(2, 1, _worker, str(tmp_path))
