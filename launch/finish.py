"""How a launched process of a finished multi-rank run ends: the training entry points
(``launch/train.py``, ``launch/pretrain_gpt_ntl.py``, ``launch/megatron_example.py``,
``experiments/train_baselines.py``) and the test helpers that launch Megatron-LM, torchtitan, DeepSpeed
or the Hugging Face ``Trainer`` end through :func:`run_then_leave` or :func:`leave_after_a_finished_run`.
``examples/`` are left as a user's script ends (their tests wrap them in
``tests/helpers/run_then_leave.py``).

Why: in CI (2026-11-26) a rank of a finished 2-process gloo run on the CPU aborted at interpreter exit
(SIGABRT, "terminate called without an active exception") after its last step and its group
teardown, under DeepSpeed AutoTP (rank 1) and accelerate FSDP2 (both ranks), and the launcher reported
the finished job as failed; never reproduced locally. It is the known hazard of C++ distributed
objects (gloo's worker threads and the work they hold, whose tensors keep Python references) still
alive while CPython finalises: destroying them then takes the GIL of a dying interpreter or destroys a
joinable thread (pytorch/pytorch#190489, and the atexit-teardown attempt of pytorch/pytorch#179291).
``destroy_process_group`` drops only the Python side; objects still held elsewhere (FSDP states,
device meshes, accelerate's state) outlive it. (A Megatron-LM run with two pipeline stages also did not
end within 420 s in that CI run; where it waited is not known. The tests' ``run_launch`` now prints
every rank's stack when a launch hangs.)

So the process does not finalise the interpreter. It ends as CPython's exit would up to that point:
non-daemon threads joined (and thread-pool exit hooks), then, if a process group is still up (upstream
scripts such as Megatron-LM's ``pretrain_gpt.py`` end without destroying theirs), a barrier (no rank
leaves while a peer still communicates) and ``destroy_process_group``, then the ``atexit`` handlers
(logging, trackers, the host-tensor guard's report, a user's; unlike an ordinary exit, the group is
down while they run), then every file object still open for writing is flushed, then Python's and
C's standard output, and then ``os._exit(0)``. Errors are untouched: they raise before this and exit non-zero with their
traceback. A one-process run (``WORLD_SIZE`` unset or 1) returns, so it stays an ordinary exit for
profilers and debuggers.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import io
import os
import sys
import threading
from collections.abc import Callable


def run_then_leave(main: Callable[[], object]) -> None:
    """Runs ``main()``; a finished run (it returns, or raises ``SystemExit(0)``, as Megatron-LM's
    ``pretrain`` does when ``--exit-signal-handler``, ``--exit-interval`` or ``--exit-duration-in-mins``
    stops every rank together) then leaves through :func:`leave_after_a_finished_run`. Anything else
    propagates unchanged, a bare ``sys.exit()`` included: Megatron-LM's checkpoint loading stops a
    single rank that way on an error, and that rank must not wait for its peers at a barrier."""
    try:
        main()
    except SystemExit as stop:
        if stop.code != 0:
            raise
    leave_after_a_finished_run()


def leave_after_a_finished_run() -> None:
    """Ends the process without finalising the interpreter (see the module); returns in a world of one rank."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    # never imported means no group is up; and no import may follow the thread shutdown, which refuses
    # the atexit hooks that importing torch registers
    dist = sys.modules.get("torch.distributed")
    threading._shutdown()  # type: ignore[attr-defined]  # the first step of CPython's own exit
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    atexit._run_exitfuncs()
    _flush_open_files()
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(Exception):  # printf output of C/C++ code (DeepSpeed's CPU Adam) into a pipe
        ctypes.CDLL(None).fflush(None)
    os._exit(0)


def _flush_open_files() -> None:
    """Flushes every Python file object still open for writing (``gc.get_objects`` lists unreachable ones
    too, so no collection runs: it would run the destructors this module avoids). Finalisation would
    close them; a flush is all ``os._exit`` allows, so a compressed writer left open (gzip, lzma) keeps
    its data but gets no trailer."""
    for obj in gc.get_objects():
        with contextlib.suppress(Exception):  # closed, detached, read-only, a broken pipe, an odd subclass
            # type(obj), not isinstance: isinstance reads obj.__class__, which some objects answer with a
            # warning (torch.distributed.reduce_op's deprecation notice)
            if issubclass(type(obj), io.IOBase) and not obj.closed and obj.writable():
                obj.flush()
