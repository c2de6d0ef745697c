"""Test order: the longest files first, so that two xdist workers (``make test``) finish together.

``make test`` runs whole files per worker (``--dist loadfile --no-loadscope-reorder``: xdist otherwise starts
the files with the most tests first, which puts the few long end-to-end tests last and leaves one worker
running them alone). Files start in this order: ``LONGEST`` (measured on the 2-core machine, longest first),
then the other integration, distributed and lab files, then the unit files, which fill the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent

# the files over about 80 s on two workers (pytest --durations, 2026-11-29), longest first
LONGEST = (
    "tests/integration/test_train_deepspeed.py",
    "tests/integration/test_megatron_lm.py",
    "tests/integration/test_gpu_study.py",
    "tests/integration/test_docs_and_study.py",
    "tests/integration/test_slurm.py",
    "tests/integration/test_torchtitan.py",
    "tests/integration/test_host_tensors.py",
    "tests/unit/test_triton_aot.py",
    "tests/integration/test_train_pretrain.py",
    "tests/integration/test_torchtitan_upstream.py",
)
KINDS = ("tests/integration/", "tests/distributed/", "lab/", "tests/gpu/", "tests/unit/")


def _rank(path: str) -> tuple[int, int]:
    if path in LONGEST:
        return 0, LONGEST.index(path)
    return 1, next((i for i, kind in enumerate(KINDS) if path.startswith(kind)), len(KINDS))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    missing = [name for name in LONGEST if not (ROOT / name).is_file()]
    if missing:
        raise pytest.UsageError(f"conftest.py LONGEST names files that do not exist: {missing}; update the list")
    # by the node id's file (relative to the rootdir, what --dist loadfile groups by); sorted() is stable: the
    # tests of one file keep their order
    items[:] = sorted(items, key=lambda item: _rank(item.nodeid.split("::")[0]))
