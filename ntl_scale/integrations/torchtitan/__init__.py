"""torchtitan (0.3.0): ``loss`` (``NTLLoss``, a ``BaseLoss``), ``trainer`` (``NTLTrainer``: the step's NTL
count and log) and ``config_registry`` (``--module ntl_scale.integrations.torchtitan``). Importing this
package imports torchtitan; ``import ntl_scale`` does not.
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
