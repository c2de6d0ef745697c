"""The run-config overrides of a study preset's arm, for tests that load every arm's config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def run_overrides(preset: dict[str, Any], overrides: list[str]) -> tuple[list[str], Any]:
    """An arm's overrides for ``load_config``, and what the preset's training ``entry`` takes itself
    (the ``baseline.*`` settings of experiments/train_baselines.py, split off by that script's own
    ``split_overrides``); launch/train.py takes them all."""
    entry = preset.get("entry", "launch/train.py")
    if entry == "launch/train.py":
        return overrides, None
    module = load_script(entry, Path(entry).stem)
    return module.split_overrides(overrides)
