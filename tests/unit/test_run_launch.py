"""``tests.helpers.distributed.run_launch``: a hung launch fails with where each rank waits, and leaves nothing.

A ``torchrun`` of two ranks that never return: the test must fail after the timeout, the failure must show
the Python stack of the function each rank waits in (faulthandler on SIGABRT), and no rank may be left
running. A launch that ends returns its output and exit status as ``subprocess.run`` does. ``run_workers``
stops workers that outlive its timeout and fails instead of waiting for ever.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers.distributed import WorkerContext, free_port, run_launch, run_workers


def _alive(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return found.stdout.split()


def test_a_hung_launch_fails_with_every_ranks_stack_and_leaves_no_process(tmp_path):
    script = tmp_path / "hangs_for_run_launch.py"
    script.write_text(
        "import time\n\ndef waits_here_forever():\n    while True:\n        time.sleep(1)\n\nwaits_here_forever()\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(script)]  # fmt: skip
    with pytest.raises(pytest.fail.Exception) as failed:
        run_launch(command, timeout=20)  # ranks importing nothing wait within seconds of the start
    message = str(failed.value)
    assert "timed out after 20 s" in message and message.count("waits_here_forever") >= 2, message[-3000:]
    for _ in range(20):  # SIGKILL is delivered at once; the kernel may take a moment to reap
        if not _alive(str(script)):
            break
        time.sleep(0.5)
    assert not _alive(str(script)), _alive(str(script))


def test_a_finished_launch_returns_like_subprocess_run():
    done = run_launch([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                      timeout=60)  # fmt: skip
    reference = subprocess.run(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (reference.returncode, reference.stdout, reference.stderr)


def _waits_forever(ctx: WorkerContext) -> None:
    while True:
        time.sleep(1)


def test_run_workers_stops_workers_that_outlive_the_timeout():
    started = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish within 5 s"):
        run_workers(2, 1, _waits_forever, timeout=5)
    assert time.monotonic() - started < 60
