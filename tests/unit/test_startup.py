"""``launch.startup.init_distributed``, the one distributed start-up (issue 41, item 5), and the Megatron-LM
route's assembly ``forward_step_from_args`` that ``launch/pretrain_gpt_ntl.py`` calls.

References: torch's own collectives and store (a SUM all-reduce of known values; the class of the store the
default group meets at), DeepSpeed's own ``deepspeed.comm`` state, and the
release's ``forward_step`` object itself. Each spawned check is one subprocess with every case in it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launch.startup import init_distributed
from tests.helpers.distributed import WorkerContext, run_workers

ROOT = Path(__file__).resolve().parents[2]

STORE = """
def store_kind():
    \"\"\"The class of the store under the default group's prefix stores: where the ranks meet.\"\"\"
    from torch.distributed import distributed_c10d
    store = distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return type(store).__name__
"""


def _run(code: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", STORE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _sum_of_ranks(ctx: WorkerContext) -> None:
    import torch
    import torch.distributed as dist

    # run_workers started this process through init_distributed (tcp rendezvous, gloo)
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (ctx.rank, 2, "gloo")
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    assert total.item() == 3.0


def test_launched_ranks_meet_at_the_rendezvous_they_are_given():
    run_workers(2, 1, _sum_of_ranks)


def test_a_process_without_a_launcher_is_a_world_of_one_on_an_in_process_store():
    result = _run(
        """
        import json, socket
        import torch, torch.distributed as dist
        from launch.startup import init_distributed

        out = {}
        out["alone"] = list(init_distributed(launched=False, threads=1))
        out["alone"][2] = str(out["alone"][2])
        out["backend"] = dist.get_backend()
        out["threads"] = torch.get_num_threads()
        total = torch.tensor([5.0]); dist.all_reduce(total); out["sum"] = total.item()
        out["alone_store"] = store_kind()
        dist.destroy_process_group()
        # the check can fail: a launched world of one meets at a TCP store on its port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        init_distributed(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
        out["tcp_store"] = store_kind()
        dist.destroy_process_group()
        print(json.dumps(out))
        """
    )
    assert result["alone"] == [0, 1, "cpu"]
    assert (result["backend"], result["threads"], result["sum"]) == ("gloo", 1, 5.0)
    assert (result["alone_store"], result["tcp_store"]) == ("HashStore", "TCPStore")


def test_deepspeed_adopts_the_group_of_a_process_without_a_launcher():
    env = {"DS_ACCELERATOR": "cpu"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env[name] = ""
    result = _run(
        """
        import contextlib, io, json, os
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if not os.environ[name]:
                del os.environ[name]
        import torch.distributed as dist
        from launch.startup import init_distributed

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            rank, world, device = init_distributed(launched=False, deepspeed=True)
        import deepspeed.comm as ds_comm
        out = {"result": [rank, world, str(device)], "ds": ds_comm.is_initialized(),
               "ds_world": ds_comm.get_world_size(), "torch_world": dist.get_world_size(),
               "env": [os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")],
               "printed": printed.getvalue(), "store": store_kind()}
        print(json.dumps(out))
        """,
        env,
    )
    assert result["result"] == [0, 1, "cpu"]
    assert result["ds"] and result["ds_world"] == result["torch_world"] == 1
    assert result["env"] == ["0", "0", "1"]  # what DeepSpeed's engine reads
    assert "built successfully" not in result["printed"]
    assert result["store"] == "HashStore"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": -1, "world_size": 2}, "rank must be an int >= 0, got -1"),
        ({"rank": 0, "world_size": 0}, "world_size must be an int >= 1, got 0"),
        ({"rank": 2, "world_size": 2}, "rank=2 must be below world_size=2"),
        ({"local_rank": "0"}, "local_rank must be an int >= 0, got '0'"),
        ({"threads": 0}, "threads must be an int >= 1 or None, got 0"),
    ],
)
def test_bad_values_are_refused_before_any_start_up(kwargs, message):
    import torch.distributed as dist

    with pytest.raises(ValueError, match=message):
        init_distributed(**kwargs)
    assert not dist.is_initialized()


# -- the Megatron-LM route's assembly -----------------------------------------------------------------
def _megatron_args(*argv: str, **extra) -> argparse.Namespace:
    from ntl_scale.integrations.megatron import add_ntl_args

    args = add_ntl_args(argparse.ArgumentParser()).parse_args(list(argv))
    for key, value in extra.items():
        setattr(args, key, value)
    return args


def test_megatron_forward_step_is_the_releases_own_when_ntl_is_off():
    from ntl_scale.integrations.megatron.lm import forward_step_from_args

    def forward_step(data_iterator, model):  # the release's function: returned as it is
        raise AssertionError("not called")

    # parallel_state is not consulted when NTL is off (None would fail on any use)
    assert forward_step_from_args(forward_step, _megatron_args("--ntl-weight", "0"), None) is forward_step


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("overlap_moe_expert_parallel_comm", "does not support --overlap-moe-expert-parallel-comm"),
        ("use_legacy_models", "needs megatron.core models; drop --use-legacy-models"),
    ],
)
def test_megatron_flags_ntl_cannot_train_with_are_refused(flag, message):
    from ntl_scale.integrations.megatron.lm import forward_step_from_args

    args = _megatron_args("--ntl-weight", "0.3", **{flag: True})
    with pytest.raises(ValueError, match=message):
        forward_step_from_args(lambda *a: None, args, None)
