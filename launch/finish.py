"""How a launched process of a finished multi-rank run ends: every script that a launcher starts
(``launch/*.py``, ``experiments/train_baselines.py``, ``examples/hf_trainer_ntl.py`` and the test
helpers that run Megatron-LM, torchtitan, DeepSpeed or the Hugging Face ``Trainer``) calls
:func:`leave_after_a_finished_run` after its work.

Why: a rank of a finished 2-process gloo run on the CPU sometimes aborts at interpreter exit
(SIGABRT, "terminate called without an active exception") or never exits, after its last step and
its group teardown; the launcher then reports the finished job as failed, or waits. Seen in CI on
2026-11-26 under DeepSpeed AutoTP (rank 1), accelerate FSDP2 (both ranks) and, as a hang, Megatron-LM
with two pipeline stages; never reproduced locally. It is the known hazard of C++ distributed objects
(gloo's worker threads and the work they hold, whose tensors keep Python references) still alive
while CPython finalises: destroying them then takes the GIL of a dying interpreter or destroys a
joinable thread (pytorch/pytorch#190489, and the atexit-teardown attempt of pytorch/pytorch#179291).
``destroy_process_group`` drops only the Python side; objects still held elsewhere (FSDP states,
device meshes, accelerate's state) outlive it.

So the process does not finalise the interpreter: it ends as CPython's exit would up to that point
(non-daemon threads joined, thread-pool exit hooks, then the ``atexit`` handlers: logging, trackers,
the host-tensor guard's report, a user's), flushes Python and C output and leaves with
``os._exit(0)``. Errors are untouched (they raise before this and exit non-zero with their
traceback); a one-process run (``WORLD_SIZE`` unset or 1) returns, so it stays an ordinary exit for
profilers and debuggers.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading


def leave_after_a_finished_run() -> None:
    """Meets the other ranks, destroys the process groups still alive and leaves without finalising.

    Returns (does nothing) in a world of one rank. A group still initialised here (upstream scripts such
    as Megatron-LM's ``pretrain_gpt.py`` end without destroying theirs) is met at a barrier first, so no
    rank leaves while a peer still communicates, then destroyed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    threading._shutdown()  # type: ignore[attr-defined]  # the first steps of CPython's own exit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(Exception):  # printf output of C/C++ code (DeepSpeed's CPU Adam) into a pipe
        ctypes.CDLL(None).fflush(None)
    os._exit(0)
