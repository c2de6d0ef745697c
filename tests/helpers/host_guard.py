"""Host-tensor guard: a host tensor that reaches the model or a collective without a device move raises.

On a CPU every tensor is already "on the device", so a loop that forgets ``.to(device)`` trains
here and fails on the first GPU step (a CUDA model given CPU ``input_ids``, NCCL given a CPU tensor).
This guard makes the omission visible on the CPU:

- :class:`HostOnly`, a tensor subclass whose every use raises :class:`HostTensorError`, except an
  explicit device move (``.to(device)``, ``.to(device=...)``, ``.cuda()``), which returns a plain
  tensor, and reading its metadata (``shape``, ``dtype``, ``device``);
- :func:`install` wraps the outputs of the batch collation in ``HostOnly``, makes the tensor factories
  (``torch.tensor``, ``as_tensor``, ``zeros``, ``ones``, ``full``, ``empty``, ``arange``) return ``HostOnly`` when
  they are called without ``device=`` from the training loop's own files, and makes the
  ``torch.distributed`` collectives raise when given a ``HostOnly`` tensor.

As a launcher shim (test-only), before ``tests/helpers/ds_launch.py``:

    deepspeed --num_gpus 2 tests/helpers/host_guard.py tests/helpers/ds_launch.py launch/train.py key=value ...

``NTL_HOST_GUARD_REPORT=path`` writes ``{"wrapped": n, "moved": m}`` per rank at exit (the test checks
the guard was active: batches were wrapped and moved).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import sys
from typing import Any

import torch

COUNTS = {"wrapped": 0, "moved": 0}


class HostTensorError(RuntimeError):
    """A host tensor was used where only a device tensor may go."""


_METADATA = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"}


def _is_move(func: Any, args: tuple, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    if name == "cuda":
        return True
    if name != "to":
        return False
    if "device" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args[1:]) or any(
        isinstance(a, torch.Tensor) for a in args[1:]
    )


class HostOnly(torch.Tensor):
    """A host tensor that may only be moved to a device (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _is_move(func, args, kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            COUNTS["moved"] += 1
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        owner = getattr(func, "__self__", None)
        name = getattr(func, "__name__", "") or getattr(owner, "__name__", "")
        if name == "__get__" and getattr(owner, "__name__", "") in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name in ("__repr__", "__format__"):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise HostTensorError(
            f"a host tensor reached {getattr(func, '__qualname__', func)!r} without a device move "
            "(a GPU run would fail here: move it with .to(device) first)"
        )


def host_only(tensor: torch.Tensor) -> torch.Tensor:
    COUNTS["wrapped"] += 1
    return tensor.as_subclass(HostOnly)


def _wrap(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _wrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    if isinstance(value, torch.Tensor) and not isinstance(value, HostOnly):
        return host_only(value)
    return value


def _check_collective(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        for value in [*args, *kwargs.values()]:
            for tensor in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(tensor, HostOnly):
                    raise HostTensorError(f"a host tensor reached torch.distributed.{name} (NCCL refuses host tensors)")
        return fn(*args, **kwargs)

    guarded.__ntl_host_guard__ = True  # type: ignore[attr-defined]
    return guarded


COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
               "all_to_all_single", "gather", "scatter")  # fmt: skip
FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange")


def _loop_files() -> set[str]:
    """The files of the training loop whose host-created tensors are guarded (the entry, the trainer and
    its components)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    loop = ("trainer.py", "steps.py", "engine.py", "inputs.py", "evaluator.py", "metrics.py", "checkpoint.py",
            "collectives.py")  # fmt: skip
    files = {os.path.join(root, "ntl_scale", "training", f) for f in loop}
    files |= {os.path.abspath(a) for a in sys.argv[1:] if a.endswith(".py")}  # the entry script (e.g. train.py)
    return files


def _guard_factory(name: str, fn: Any, files: set[str]) -> Any:
    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if kwargs.get("device") is None and sys._getframe(1).f_code.co_filename in files:
            return host_only(out)
        return out

    return factory


def install(files: set[str] | None = None) -> None:
    """Installs the guard in this process (idempotent); ``files``: the loop's files whose tensor
    factories are guarded (default: the trainer's and the entry script's)."""
    import torch.distributed as dist

    if getattr(dist.all_reduce, "__ntl_host_guard__", False):
        return
    for name in COLLECTIVES:
        guarded = _check_collective(name, getattr(dist, name))
        setattr(dist, name, guarded)
        setattr(dist.distributed_c10d, name, guarded)
    files = _loop_files() if files is None else {os.path.abspath(f) for f in files}
    for name in FACTORIES:
        setattr(torch, name, _guard_factory(name, getattr(torch, name), files))
    collate_module = __import__("ntl_scale.data.collate", fromlist=["collate"])
    import ntl_scale.data

    original = collate_module.collate

    @functools.wraps(original)
    def collate(*args: Any, **kwargs: Any) -> Any:
        return _wrap(original(*args, **kwargs))

    collate_module.collate = collate
    ntl_scale.data.collate = collate  # type: ignore[attr-defined]  # the package re-exports the function
    # packed pretraining batches (data.source=text/megatron) are stacked by collate_packed, which
    # ntl_scale.training.sources imported by name: wrap it where the loop looks it up
    import ntl_scale.data.packing as packing_module
    import ntl_scale.training.sources as training_data

    stack = packing_module.collate_packed

    @functools.wraps(stack)
    def collate_packed(*args: Any, **kwargs: Any) -> Any:
        return _wrap(stack(*args, **kwargs))

    packing_module.collate_packed = collate_packed
    training_data.collate_packed = collate_packed  # type: ignore[attr-defined]
    report = os.environ.get("NTL_HOST_GUARD_REPORT")
    if report:

        def write() -> None:
            with open(f"{report}.{os.environ.get('RANK', '0')}", "w") as f:
                json.dump(COUNTS, f)

        atexit.register(write)


if __name__ == "__main__":
    install()
    # the next script (ds_launch.py) reads its own arguments from sys.argv[1:] (the launcher's --local_rank too)
    arguments = sys.argv[1:]
    script = next(a for a in arguments if a.endswith(".py"))
    arguments.remove(script)
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")
