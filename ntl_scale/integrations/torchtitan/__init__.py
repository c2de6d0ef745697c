"""torchtitan: CE + NTL as a torchtitan loss, a trainer that counts NTL positions per step, and configs.

| module | what |
|---|---|
| `loss` | `NTLLoss`: a torchtitan `BaseLoss` (CE + NTL), with or without `ChunkedLossWrapper` |
| `trainer` | `NTLTrainer`: torchtitan's `Trainer` plus the step's global NTL count and the `ce`/`ntl`/accuracy log |
| `config_registry` | `python -m torchtitan.train --module ntl_scale.integrations.torchtitan --config <function>` |

``torchtitan`` (0.3.0) is imported when this package is; ``import ntl_scale`` does not import it. Without
it the import raises an ImportError that says how to install it beside the pinned torch
(``docs/torchtitan.md``).
"""

from __future__ import annotations

import importlib


def _require_torchtitan() -> None:
    try:
        importlib.import_module("torchtitan.components.loss")
    except ImportError as e:
        raise ImportError(
            "ntl_scale.integrations.torchtitan needs torchtitan 0.3.0, which is not importable here "
            f"({e}). Install it without letting pip change torch: pip install --no-deps torchtitan==0.3.0 "
            "&& pip install tyro spmd_types==0.2.3 torchdata torch_checkpointing tensorboard triton "
            "(bash scripts/setup.sh --dev does this; docs/torchtitan.md)"
        ) from e


_require_torchtitan()

from typing import TYPE_CHECKING, Any  # noqa: E402

from .loss import NTLLoss, number_table  # noqa: E402

if TYPE_CHECKING:
    from .trainer import NTLTrainer

__all__ = ["NTLLoss", "NTLTrainer", "number_table"]


def __getattr__(name: str) -> Any:
    # NTLTrainer imports torchtitan's trainer (about 5 s): only when asked for, so that a process that
    # needs the loss alone (torchtitan's loss tests spawn eight) does not pay it
    if name == "NTLTrainer":
        from .trainer import NTLTrainer

        return NTLTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
