"""Load a script of the repository (experiments/, benchmarks/, launch/) as a module, by its path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str, name: str) -> ModuleType:
    """``ROOT/relative`` imported as the module ``name`` (registered in ``sys.modules``, so that its
    dataclasses and pickling see it)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"{ROOT / relative} cannot be loaded as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
