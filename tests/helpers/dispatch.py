"""A record of the tensors the aten ops make while a block runs (``torch``'s dispatch mode), for the tests
that count what an op allocates, multiplies or passes over (``tests/unit/test_cost_model.py``,
``tests/unit/test_linear_chunking.py``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Made(NamedTuple):
    """One tensor an aten op returned: the op (``torch.ops.aten.mm.default``...), shape, dtype, bytes."""

    func: Any
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int

    @property
    def op(self) -> str:
        """The op's name without its overload: ``mm``, ``zero_``, ``_to_copy``."""
        return self.func.overloadpacket.__name__


class OpOutputs(TorchDispatchMode):
    """``with OpOutputs() as made:`` records every tensor every aten op returns in the block, in order, in
    ``made.records`` (one :class:`Made` per tensor of an op returning several)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Made] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.records.append(Made(func, tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return out


def allocated(records: list[Made], numel: int) -> list[str]:
    """The ops among ``records`` that made a new tensor of ``numel`` elements (no view, no in-place op), sorted."""
    return sorted(m.op for m in records if m.bytes == numel * m.dtype.itemsize and not m.func.is_view
                  and not m.op.endswith("_"))  # fmt: skip
