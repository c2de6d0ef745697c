"""The process the Triton interpreter tests run in (``tests/unit/test_triton_kernel.py``,
``lab/on_chip/test_triton_linear_kernel.py``).

Triton reads ``TRITON_INTERPRET`` when it is imported. A test file run alone sets it before that
(:func:`own_process`); in a whole-suite session an earlier module (megatron-core, torch's inductor) may
have imported Triton already, and the file's tests then run again in a process of their own, started with
the variable set (:func:`run_in_own_process`), while the session skips them (:func:`skip_unless_own_process`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

RUNNER = "test_interpreter_tests_in_their_own_process"
"""The name of each file's test that runs the file again in its own process."""


def own_process() -> bool:
    """Whether this process runs the interpreter tests itself: it was started for them, or Triton is not
    imported yet (``TRITON_INTERPRET`` is then set here, before the import; a GPU run may set it to 0)."""
    if os.environ.get("NTL_TRITON_TESTS") == "1":
        return True
    if "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return True
    return False


def run_in_own_process(path: str) -> None:
    """Runs the test file ``path`` in a fresh process with ``TRITON_INTERPRET=1``; its tests must pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "NTL_TRITON_TESTS": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                         env=env, capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-5000:] + out.stderr[-2000:]


def skip_unless_own_process(request: pytest.FixtureRequest, own: bool) -> None:
    """Skips every test but the runner where the file's tests run in a process of their own."""
    if not own and request.node.originalname != RUNNER:
        pytest.skip(f"run by {RUNNER} (Triton was imported before this file)")
