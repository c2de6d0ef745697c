"""Test-only: accelerate's FSDP2 on CPU processes over gloo (accelerate 1.15.0).

accelerate turns a given ``fsdp_plugin`` into ``DistributedType.FSDP`` only for accelerator devices:
in ``AcceleratorState.__init__`` (``accelerate/state.py``) the branch that sets ``DistributedType.FSDP``
sits under ``elif self.distributed_type in [MULTI_GPU, MULTI_NPU, MULTI_XPU, ...]``, which leaves out
``MULTI_CPU``; on CPU the plugin is dropped without a word and ``prepare`` wraps the model in DDP.
Everything after that decision (``fsdp2_prepare_model``: torch's ``fully_shard`` on a CPU device mesh,
the optimizer's parameters swapped for the DTensor shards, the gradient reduce-scatter over gloo)
runs on CPU as it is. :func:`fsdp_on_cpu` makes that one decision as it is made for GPUs; nothing
else is patched. The type lives in ``PartialState``'s shared state, which accelerate's state reset between
trainers keeps: a process that used it runs FSDP2 steps only. Never used by ``ntl_scale/`` or ``launch/``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def fsdp_on_cpu() -> Callable[[], None]:
    """Patches ``AcceleratorState.__init__`` so a CPU run given an ``fsdp_plugin`` uses FSDP; returns the undo.

    Idempotent: a second call returns an undo that does nothing.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "_ntl_fsdp_on_cpu", False):
        return lambda: None

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        # MULTI_CPU, or FSDP copied from PartialState after accelerate's state reset between trainers
        if fsdp_plugin is not None and self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.FSDP):
            # what accelerate does for MULTI_GPU with a plugin, ending as its __init__ ends: the type is
            # shared with PartialState (later AcceleratorState() calls copy it from there)
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    init._ntl_fsdp_on_cpu = True  # type: ignore[attr-defined]
    init.__wrapped__ = original  # type: ignore[attr-defined]
    AcceleratorState.__init__ = init  # type: ignore[method-assign]

    def undo() -> None:
        AcceleratorState.__init__ = original  # type: ignore[method-assign]

    return undo
