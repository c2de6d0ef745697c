#!/usr/bin/env bash
# One Slurm task = one training process: maps Slurm's task numbering onto torch.distributed's
# environment (MASTER_ADDR and MASTER_PORT come from the batch script), then becomes the process, so
# signals that srun forwards reach Python directly.
set -euo pipefail
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
export LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE%%(*}
exec "$@"
