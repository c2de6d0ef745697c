"""Runs a real Megatron-LM script (``pretrain_gpt.py`` or our drop-in) on CPU over gloo. Test only.

    MEGATRON_LM_PATH=/path/to/Megatron-LM torchrun --nproc_per_node 2 tests/helpers/megatron_lm_cpu.py \\
        SCRIPT.py <Megatron arguments> --distributed-backend gloo --transformer-impl local ...

Megatron-LM's training loop assumes a GPU in places that have nothing to do with what the tests
check. Each patch below redirects one such call to the CPU, in this process only, before the script
runs; nothing of this reaches ``ntl_scale/`` or ``launch/``. Found by running core_v0.16.1 and
core_v0.19.0 here:

* tensor factories called with ``device="cuda"`` (token counters, loss buffers, rerun state) and
  ``Tensor.cuda()`` / ``.to("cuda")`` (get_batch, checkpoint loading) stay on the CPU;
* ``torch.cuda.device_count`` is 1 so that ``_initialize_distributed`` builds the model-parallel
  groups; ``set_device``, ``synchronize``, streams, events and the memory statistics are no-ops;
* the CUDA RNG state (``get_rng_state``/``set_rng_state``, saved in checkpoints) is the CPU state,
  and Megatron's CUDA RNG tracker records seeds without forking (so dropout must be 0);
* ``torch.compile`` is disabled (Megatron's ``jit_fuser`` functions and their warm-up run eagerly);
* ``initialize_megatron`` gets ``allow_no_cuda=True``; the fused-kernel build of releases that have
  one is skipped (``--transformer-impl local`` with fusions off needs none);
* Python 3.11 lacks ``typing.override``, which releases >= 0.17 import (they declare Python >= 3.12):
  ``typing_extensions.override`` stands in.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import typing

import torch


def _is_gpu(device) -> bool:
    """A CUDA device as Megatron names it: "cuda", "cuda:0", torch.device("cuda") or an index."""
    return (isinstance(device, int) and not isinstance(device, bool)) or "cuda" in str(device)


def _redirect(factory):
    def wrapped(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and _is_gpu(device):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    wrapped.__wrapped__ = factory
    return wrapped


def _cpu_to(original):
    def to(self, *args, **kwargs):
        args = tuple("cpu" if (isinstance(a, (str, torch.device)) and "cuda" in str(a)) else a for a in args)
        if kwargs.get("device") is not None and _is_gpu(kwargs["device"]):
            kwargs["device"] = "cpu"
        return original(self, *args, **kwargs)

    return to


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return _Event()

    def wait_event(self, *args, **kwargs):
        pass


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _Props:
    name, total_memory, major, minor, multi_processor_count = "cpu", 0, 9, 0, 1


_PROPS = _Props()


class _CPURNGTracker:
    """Megatron's CUDA RNG tracker without CUDA: records seeds, forks nothing."""

    def __init__(self, *args, **kwargs):
        self.states_ = {}
        self.seeds_ = set()

    def reset(self):
        self.states_, self.seeds_ = {}, set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def add(self, name, seed):
        self.seeds_.add(seed)
        self.states_[name] = torch.tensor([seed])

    def is_initialized(self):
        return True

    @contextlib.contextmanager
    def fork(self, name=None):
        yield


def patch_torch() -> None:
    """The torch-level redirections (idempotent)."""
    if getattr(torch, "_ntl_scale_lm_cpu_patched", False):
        return
    for name in (
        "zeros",
        "ones",
        "empty",
        "full",
        "tensor",
        "arange",
        "zeros_like",
        "ones_like",
        "empty_like",
        "rand",
        "randn",
        "randint",
        "as_tensor",
        "full_like",
        "linspace",
    ):
        setattr(torch, name, _redirect(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.to = _cpu_to(torch.Tensor.to)
    cuda = torch.cuda
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: None
    cuda.manual_seed = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.get_device_properties = lambda *a, **k: _PROPS
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, stat, lambda *a, **k: 0)
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.memory_stats = lambda *a, **k: {}
    cuda.mem_get_info = lambda *a, **k: (0, 0)
    # torch.compile'd helpers (jit_fuser) would compile for a GPU; run them eagerly.
    torch._dynamo.config.disable = True
    if not hasattr(typing, "override"):
        from typing_extensions import override

        typing.override = override
    torch._ntl_scale_lm_cpu_patched = True


def patch_megatron() -> None:
    """The Megatron-level redirections; call after the checkout is on ``sys.path``."""
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._CUDA_RNG_STATE_TRACKER = _CPURNGTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mp_random.get_cuda_rng_tracker = lambda *a, **k: mp_random._CUDA_RNG_STATE_TRACKER
    mp_random._set_cuda_rng_state = lambda *a, **k: None
    with contextlib.suppress(Exception):
        import megatron.core.tensor_parallel as tp_pkg

        tp_pkg.get_cuda_rng_tracker = mp_random.get_cuda_rng_tracker
    from megatron.training import initialize, training

    original = initialize.initialize_megatron
    if not getattr(original, "_ntl_cpu", False):

        def initialize_megatron(*args, **kwargs):
            kwargs["allow_no_cuda"] = True
            return original(*args, **kwargs)

        initialize_megatron._ntl_cpu = True
        initialize.initialize_megatron = initialize_megatron
        training.initialize_megatron = initialize_megatron
        import megatron.training as training_pkg  # lm-eval's megatron_lm backend imports it from the package

        training_pkg.initialize_megatron = initialize_megatron
    if hasattr(initialize, "fused_kernels"):
        initialize.fused_kernels.load = lambda *a, **k: None
    with contextlib.suppress(Exception):
        from megatron.core import utils as core_utils

        core_utils.get_device_arch_version = lambda: 9


def trace_training_log(path: str) -> None:
    """Appends each iteration's losses and gradient norm at full precision to ``path`` (JSON lines), and
    each evaluation's totals (``{"validation": {...}}`` lines).

    Megatron prints them rounded (the gradient norm to 3 decimals); the tests compare more closely.
    Only the rank that holds a loss (the last pipeline stage) writes.
    """
    import inspect
    import json

    from megatron.training import training

    original = training.training_log
    signature = inspect.signature(original)

    def training_log(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        losses = {k: float(v) for k, v in (bound.arguments["loss_dict"] or {}).items()}
        if losses and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            grad_norm = bound.arguments.get("grad_norm")
            with open(path, "a", encoding="utf-8") as f:
                record = {
                    "iteration": bound.arguments["iteration"],
                    "losses": losses,
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                }
                f.write(json.dumps(record) + "\n")
        return original(*args, **kwargs)

    training.training_log = training_log

    evaluate = training.evaluate

    def traced_evaluate(*args, **kwargs):
        """Megatron's ``evaluate``: its totals (``lm loss`` and every other key, before the drop-in takes the NTL
        metrics to their own line) at full precision, one ``{"validation": {...}}`` line per evaluation."""
        result = evaluate(*args, **kwargs)
        totals = result[0] if isinstance(result, tuple) and result else None
        if isinstance(totals, dict) and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"validation": {k: float(v) for k, v in totals.items()}}) + "\n")
        return result

    training.evaluate = traced_evaluate


def main() -> None:
    checkout = os.environ.get("MEGATRON_LM_PATH")
    if not checkout:
        raise SystemExit("set MEGATRON_LM_PATH to the Megatron-LM checkout")
    # This file's folder holds tests/helpers/tokenizers.py, which must not shadow the real package.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, checkout)
    patch_torch()
    patch_megatron()
    if os.environ.get("NTL_TEST_TRACE"):
        trace_training_log(os.environ["NTL_TEST_TRACE"])
    script, *arguments = sys.argv[1:]
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from launch.finish import run_then_leave

    run_then_leave(main)
