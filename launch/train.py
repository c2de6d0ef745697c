"""Train a Hugging Face model with CE + NTL under DeepSpeed (ZeRO-1/2/3, AutoTP).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/train.py --config configs/train/tiny_cpu.yaml [key=value ...]
    deepspeed --num_gpus 8 launch/train.py --config configs/train/granite-3.2-2b_zero3.yaml
    python launch/train.py                      # one process, the tiny default
    torchrun --nproc_per_node 2 launch/train.py --config ... train.steps=20

Reads the config, initialises distributed once and runs ``ntl_scale.integrations.deepspeed.trainer.Trainer``:
exactly normalised CE + NTL, held-out loss and perplexity, checkpoints (resuming automatically from
the run directory's latest checkpoint; SIGTERM/SIGUSR1 checkpoint and stop), a Hugging Face export
and evaluation by generation.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import startup
from launch.finish import run_then_leave
from ntl_scale.integrations.deepspeed.engine import check_inputs
from ntl_scale.integrations.deepspeed.trainer import Trainer
from ntl_scale.training.config import load_config


def init_distributed() -> tuple[int, int, torch.device]:
    """The process group (NCCL on GPUs, gloo on the CPU) and this rank's device, from DeepSpeed's
    accelerator (:func:`launch.startup.init_distributed`, with what the launcher says).

    Launched processes (deepspeed, torchrun, Slurm's srun) meet at their launcher's rendezvous
    (``MASTER_ADDR``/``MASTER_PORT``). A process started without a launcher (no ``RANK``) is a
    one-rank world on an in-process store: it picks no rendezvous port, so single-process runs started
    side by side (``experiments/study.py``) cannot race for one; DeepSpeed adopts that group (without it,
    DeepSpeed would look for MPI and ask for mpi4py)."""
    threads = None
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores: N ranks x all cores each runs 3-4x slower
            local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
            threads = max(1, len(os.sched_getaffinity(0)) // local)
    quiet_libraries()
    return startup.init_distributed(
        launched="RANK" in os.environ,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        threads=threads,
        deepspeed=True,
    )


def quiet_libraries() -> None:
    """One progress line per log interval: drop the libraries' known repeated notices (each named
    here), never their errors or other warnings."""
    warnings.filterwarnings(  # DeepSpeed's ZeRO-3 calls these per step; torch warns on every call site
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )
    import datasets
    import transformers

    datasets.disable_progress_bars()  # a bar per cached map and filter
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" at export


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="run config YAML (default: the tiny CPU run)")
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_intermixed_args(argv)  # key=value overrides before or after --config
    cfg = load_config(args.config, args.overrides)
    check_inputs(cfg)  # before distributed start-up: a wrong path fails in a second
    rank, world, device = init_distributed()
    trainer = Trainer(cfg, rank=rank, world_size=world, device=device)
    for sig in (signal.SIGTERM, signal.SIGUSR1):  # checkpoint and stop after the current step
        signal.signal(sig, lambda num, _frame: trainer.request_stop(num))
    result = trainer.run()
    # every rank gets here before any tears down gloo/NCCL: a rank that destroys its process group while
    # a peer still works (rank 0 writing the model, the plot, wandb) can abort the peer
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    run_then_leave(main)
