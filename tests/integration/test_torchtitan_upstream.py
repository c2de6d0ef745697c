"""torchtitan's own loss tests, unmodified, with ntl_scale's ``NTLLoss`` in place of torchtitan's CE.

The files come from ``../shared/third_party/torchtitan-release-0.3-loss-tests.tar.gz`` (torchtitan
``release/0.3``; ``NTL_SCALE_THIRD_PARTY`` names another folder): ``tests/unit_tests/test_loss.py``,
``test_loss_dtensor.py``, ``test_invalid_loss.py``, ``test_trainer.py`` and graph_trainer's
``test_chunked_loss.py``, extracted once into the cache. Each run is one pytest process over them with
the plugin :mod:`tests.helpers.torchtitan_ntl_swap`, which swaps the loss in, also in the ranks torch's
``MultiProcessTestCase`` starts (forked by the plugin; the 4-rank ``test_loss_parallel_cross_entropy_parity``
and the 8-rank ``test_loss_dtensor.py`` run at their own sizes over gloo: their meshes are written for them). A JUnit
report says what passed; each process's record of its ``NTLLoss`` calls, that the loss was ours.

1. weight 0: every test of the five files passes: ``NTLLoss`` is torchtitan's CE there, bit for bit
   (the parity test asks ``torch.equal`` of the loss and the logits' gradients with ``loss_parallel``),
   under strict SPMD type checking, chunked, traced by ``make_fx`` and with DTensor labels.
2. weight 0.3: the tests that compare one route of the loss against another (chunked against
   unchunked, chunk counts, the FSDP unshard order, the traced chunked loss, gradients, the SPMD
   vocabulary split under strict type checking, graph_trainer's param-grad wrapper bit for bit) pass
   with NTL in the loss; those comparing against ``F.cross_entropy`` itself do not apply (NTL adds to it).

Every run holds port 12358 (:func:`holding`), the fixed port of ``test_loss.py``'s one-process group
(``TestGradAccumulatorDTensor``), as another job on a shared machine may: the plugin gives that group a port
the OS picks, so the run passes whoever holds 12358 (before, those two tests failed with ``EADDRINUSE``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("expecttest", reason="torchtitan's tests import torch's test utilities, which need expecttest")

ROOT = Path(__file__).resolve().parents[2]
THIRD_PARTY = Path(os.environ.get("NTL_SCALE_THIRD_PARTY", ROOT.parent / "shared" / "third_party"))
ARCHIVE = THIRD_PARTY / "torchtitan-release-0.3-loss-tests.tar.gz"
CACHE = Path(os.environ.get("NTL_SCALE_CACHE", Path.home() / ".cache" / "ntl_scale")) / "third_party"
FILES = (
    "tests/unit_tests/test_loss.py",
    "tests/unit_tests/test_loss_dtensor.py",
    "tests/unit_tests/test_invalid_loss.py",
    "tests/unit_tests/test_trainer.py",
    "torchtitan/experiments/graph_trainer/tests/test_chunked_loss.py",
)
WEIGHT_03_FILES = (FILES[0], FILES[4])
NOT_AT_03 = "test_loss_parallel_cross_entropy_parity"  # F.cross_entropy's bits; test_loss_dtensor.py likewise
PASSED_AT_0 = 37  # every test of the five files (torchtitan's own CE passes the same 37 here)
PASSED_AT_03 = 22  # test_loss.py without the parity test (19) and test_chunked_loss.py (3)
CHUNKED = (
    "test_chunked_loss_matches_torch_chunk_reference_for_supported_shapes",
    "test_chunked_loss_backward_matches_torch_chunk_reference",
    "test_fsdp_unshards_once_before_chunk_forwards",
    "test_numerical_equivalence",
    "test_different_chunk_counts",
    "test_symbolic_seq_len_traces_chunking",
    "test_single_token_chunks_match_torch_chunk_reference",
    "test_ignore_index_equal_per_token_contribution",
    "test_ignore_index_gradient_accumulation_consistency",
    "test_bitwise_equal_with_chunked_loss",
    "test_does_not_touch_dot_grad",
)
"""Tests that compute a loss: each must have called ``NTLLoss`` (in the test process)."""
UPSTREAM_PORT = 12358
"""``tests/unit_tests/test_loss.py``'s ``TestGradAccumulatorDTensor.setUpClass``: ``tcp://localhost:12358``."""
RANKS = {"test_spmd_matches_eager_and_types": 2, NOT_AT_03: 4}
RANKS_DTENSOR = {
    "test_legacy_tp_replicated_logits": 8,
    "test_legacy_tp_loss_parallel": 8,
    "test_full_dtensor_replicated_logits": 8,
}
"""Multi-rank tests: the number of rank processes that must each have called ``NTLLoss``."""


def upstream_tests() -> Path:
    """The extracted upstream tests; skips outside CI when the archive is missing."""
    if not ARCHIVE.is_file():
        reason = f"no torchtitan tests: {ARCHIVE} is missing"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI must run torchtitan's own loss tests)")
        pytest.skip(reason)
    path = CACHE / "torchtitan-release-0.3-tests"
    if not (path / ".ntl_scale_complete").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tarfile.open(ARCHIVE) as tar:
            tar.extractall(CACHE, filter="data")
        (path / ".ntl_scale_complete").write_text(ARCHIVE.name)
    return path


@contextlib.contextmanager
def holding(port: int):  # type: ignore[no-untyped-def]
    """Listens on ``port`` (all IPv4 interfaces) while the block runs, as another process on the machine
    might; when someone else already holds it, the block runs as it is (the port is held either way)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
            sock.listen()
        except OSError:
            pass  # held by another process already
        yield


def run_upstream(
    weight: float, files: tuple[str, ...], tmp_path: Path, *extra: str
) -> tuple[dict[str, str], dict[str, set[int]]]:
    """Runs the upstream ``files`` with ``NTLLoss`` at ``weight``.

    Returns ``{test id: passed|failed|error|skipped}`` and, for each test name, the processes that
    called ``NTLLoss`` in it.
    """
    tests = upstream_tests()
    report = tmp_path / f"junit_{weight}.xml"
    calls = tmp_path / f"calls_{weight}"
    calls.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "pytest", "-p", "tests.helpers.torchtitan_ntl_swap", "--ntl-weight", str(weight)]
    command += ["--ntl-calls", str(calls)]
    command += ["-p", "no:cacheprovider", "-q", f"--junitxml={report}", "--rootdir", str(tests), *extra, *files]
    with holding(UPSTREAM_PORT):
        done = subprocess.run(command, cwd=tests, env=env, capture_output=True, text=True, timeout=1200)
    if not report.is_file():
        raise AssertionError(f"no report from torchtitan's tests (exit {done.returncode}):\n{done.stdout[-6000:]}")
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = "failed" if tag == "failure" else tag
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = outcome
    not_passed = {name: outcome for name, outcome in outcomes.items() if outcome != "passed"}
    assert not not_passed, f"torchtitan's tests at weight {weight}: {not_passed}\n{done.stdout[-8000:]}"
    callers: dict[str, set[int]] = {}
    for file in calls.glob("*.tsv"):
        for line in file.read_text().splitlines():
            test, event = line.split("\t")
            if event == "called":
                callers.setdefault(test.split("::")[-1], set()).add(int(file.stem))
    return outcomes, callers


def check_ntl_ran(callers: dict[str, set[int]], ranks: dict[str, int]) -> None:
    """Every test that computes a loss called ``NTLLoss``; a multi-rank test, in each of its ranks."""
    for name in CHUNKED:
        assert callers.get(name), f"{name} never called NTLLoss: {sorted(callers)}"
    for name, size in ranks.items():
        assert len(callers.get(name, ())) == size, (
            f"{name}: NTLLoss called in {callers.get(name)}, expected {size} ranks"
        )


@pytest.mark.distributed
def test_weight_0_every_upstream_test_passes(tmp_path: Path) -> None:
    outcomes, callers = run_upstream(0.0, FILES, tmp_path)
    assert len(outcomes) == PASSED_AT_0, sorted(outcomes)
    check_ntl_ran(callers, {**RANKS, **RANKS_DTENSOR})


def test_weight_03_route_comparisons_pass(tmp_path: Path) -> None:
    outcomes, callers = run_upstream(0.3, WEIGHT_03_FILES, tmp_path, "-k", f"not {NOT_AT_03}")
    assert len(outcomes) == PASSED_AT_03, sorted(outcomes)
    check_ntl_ran(callers, {"test_spmd_matches_eager_and_types": 2})
