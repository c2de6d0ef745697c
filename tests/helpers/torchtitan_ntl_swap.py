"""pytest plugin: torchtitan's own loss tests with ntl_scale's ``NTLLoss`` in place of torchtitan's CE. Test only.

    python -m pytest -p tests.helpers.torchtitan_ntl_swap --ntl-weight 0.3 [--ntl-calls DIR] <torchtitan's test files>

The upstream files run unmodified (``tests/integration/test_torchtitan_upstream.py`` extracts them from
``../shared/third_party``). What is swapped, in the test process and in every process torch's
``MultiProcessTestCase`` starts for the multi-rank cases (the swap travels with each rank's target):

* in each collected test module, the names ``cross_entropy_loss`` and ``_LossParallelCrossEntropy``
  (torchtitan's own modules keep theirs: ``NTLLoss`` at weight 0 calls them);
* in torchtitan, ``CrossEntropyLoss.Config`` builds :class:`NTLAsCrossEntropy` (so do
  ``ChunkedLossWrapper``'s default ``loss_fn`` and every explicit ``CrossEntropyLoss.Config(...)``).

The multi-rank cases' ranks are forked from the test process rather than spawned (:func:`_fork_with_swap`):
the same tests at the same sizes, without an interpreter start and torchtitan's import in every rank.

The number table makes the tokens ``0 .. min(V - 1, 1000) - 1`` numbers (token id ``i`` has the value
``i % 10``; a table needs one token that is not a number, and NTL-WAS keeps a numbers x numbers distance
table, so not all of a 32000-token vocabulary), and the stand-in hands ``NTLLoss`` torchtitan's
``global_valid_tokens`` as the step's NTL count ``K``, so that ``loss = (sum CE + weight * sum NTL) /
global_valid_tokens`` on every route a test compares (chunked or not, with or without a count).
torchtitan's CE protocol returns a **sum** when no ``global_valid_tokens`` is given; its stand-in returns
``sum CE + weight * sum NTL`` (``NTLLoss`` with a count of 1), except at weight 0, where ``NTLLoss``'s own
call without a count (the CE sum) is run.

A one-process group that an upstream file starts on a fixed TCP port
(``TestGradAccumulatorDTensor.setUpClass``: ``init_method="tcp://localhost:12358"``, ``world_size=1``) gets its
store on a port the OS picks instead (:func:`_any_free_port`): ``EADDRINUSE`` when another process holds
12358 was the file's only tie to that port. The multi-rank cases rendezvous through a file
(``MultiProcessTestCase``) and are not touched.

With ``--ntl-calls DIR`` every stand-in records each use, one file per process (``DIR/<pid>.tsv``: the
test and ``built`` or ``called``), so a run can show that the loss it tested was ``NTLLoss``, on every rank.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

_STATE: dict[str, Any] = {}
_SWAPPED_NAMES = ("cross_entropy_loss", "_LossParallelCrossEntropy")


def pytest_addoption(parser: Any) -> None:
    parser.addoption("--ntl-weight", type=float, default=0.0, help="NTLLoss weight of the swapped-in loss")
    parser.addoption("--ntl-calls", default=None, help="a folder where each process records its uses of NTLLoss")


def pytest_configure(config: Any) -> None:
    install(config.getoption("--ntl-weight"), config.getoption("--ntl-calls"))


def pytest_unconfigure(config: Any) -> None:
    uninstall()


def pytest_collection_modifyitems(items: list[Any]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if module is not None:
            swap_module(module)


# ------------------------------------------------------------------------------ the loss


def record(event: str) -> None:
    """Notes a use of the stand-ins under ``--ntl-calls`` (the test: pytest's, or the rank's in a spawned rank)."""
    folder = _STATE.get("calls")
    if folder:
        test = _STATE.get("test") or os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(Path(folder) / f"{os.getpid()}.tsv", "a") as out:
            out.write(f"{test}\t{event}\n")


def number_loss(vocab_size: int) -> Any:
    """The ``NTLLoss`` of this run for ``vocab_size`` tokens (the numbers: the module docstring)."""
    record("called")
    cache: dict[int, Any] = _STATE["losses"]
    if vocab_size not in cache:
        from torch.utils._python_dispatch import _disable_current_modes

        # built as a trainer builds it, outside any traced call (make_fx's torch-function and dispatch modes)
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            cache[vocab_size] = _build_loss(vocab_size)
    return cache[vocab_size]


def _build_loss(vocab_size: int) -> Any:
    from ntl_scale import NumberVocab
    from ntl_scale.integrations.torchtitan import NTLLoss

    path = Path(_STATE["dir"]) / f"numbers_{vocab_size}.json"
    ids = list(range(min(vocab_size - 1, 1000)))
    NumberVocab(ids, [float(i % 10) for i in ids], vocab_size).save(path)
    config = NTLLoss.Config(weight=_STATE["weight"], number_vocab=str(path), vocab_size=vocab_size)
    return config.build()


class NTLAsCrossEntropy:
    """``NTLLoss`` where torchtitan builds its ``CrossEntropyLoss`` (``CrossEntropyLoss.Config._owner``)."""

    def __init__(self, config: Any, *, compile_config: Any = None) -> None:
        del compile_config
        self.global_vocab_size = config.global_vocab_size
        record("built")

    def __call__(
        self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: Any = None, **kwargs: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = number_loss(self.global_vocab_size or pred.shape[-1])
        if global_valid_tokens is None:
            if loss.weight == 0:
                return loss(pred, labels, None, **kwargs)  # NTLLoss's own call without a count: the CE sum
            global_valid_tokens = 1  # torchtitan's CE protocol: a sum over the tokens
        loss.begin_step(global_valid_tokens)  # K = global_valid_tokens (module docstring)
        return loss(pred, labels, global_valid_tokens, **kwargs)


def ntl_cross_entropy_loss(
    pred: torch.Tensor, labels: torch.Tensor, *, global_vocab_size: int | None = None
) -> torch.Tensor:
    """torchtitan's ``cross_entropy_loss`` (a sum) from ``NTLLoss``."""
    return NTLAsCrossEntropy(_Config(global_vocab_size))(pred, labels)[0]


class NTLLossParallel:
    """torchtitan's ``_LossParallelCrossEntropy.apply(logits, labels, tp_group, V, reduction)`` from ``NTLLoss``."""

    @staticmethod
    def apply(
        logits: torch.Tensor, labels: torch.Tensor, tp_group: Any, global_vocab_size: int, reduction: str = "sum"
    ) -> torch.Tensor:
        if reduction != "sum":
            raise ValueError(f"NTLLoss returns sums only, got reduction={reduction!r}")
        import torch.distributed as dist

        loss = number_loss(global_vocab_size)
        size, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        start = min(global_vocab_size, -(-global_vocab_size // size) * rank)
        if loss.weight == 0:
            return loss.on_shard(logits, labels, None, tp_group=tp_group, vocab_start=start)[0]
        loss.begin_step(1)
        return loss.on_shard(logits, labels, 1, tp_group=tp_group, vocab_start=start)[0]


class _Config:
    def __init__(self, global_vocab_size: int | None) -> None:
        self.global_vocab_size = global_vocab_size


_REPLACEMENTS = {"cross_entropy_loss": ntl_cross_entropy_loss, "_LossParallelCrossEntropy": NTLLossParallel}


# ------------------------------------------------------------------------------ installing it


def install(weight: float, calls: str | None = None) -> None:
    """Swaps the loss in torchtitan (``CrossEntropyLoss.Config`` builds :class:`NTLAsCrossEntropy`)."""
    import torchtitan.components.loss as tt_loss
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    if _STATE:
        uninstall()
    _STATE.update(
        weight=float(weight),
        calls=calls,
        losses={},
        dir=tempfile.mkdtemp(prefix="ntl_swap_"),
        owner=tt_loss.CrossEntropyLoss.Config._owner,
        originals={name: getattr(tt_loss, name) for name in _SWAPPED_NAMES},
        modules=[],
    )
    tt_loss.CrossEntropyLoss.Config._owner = NTLAsCrossEntropy
    _STATE["start"] = MultiProcessTestCase._start_processes
    MultiProcessTestCase._start_processes = _fork_with_swap(_STATE["start"])  # type: ignore[method-assign]
    _STATE["init_process_group"] = torch.distributed.init_process_group
    torch.distributed.init_process_group = _any_free_port(_STATE["init_process_group"])


def uninstall() -> None:
    """Undoes :func:`install` and every :func:`swap_module`."""
    if not _STATE:
        return
    import shutil

    import torchtitan.components.loss as tt_loss
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    tt_loss.CrossEntropyLoss.Config._owner = _STATE["owner"]
    MultiProcessTestCase._start_processes = _STATE["start"]  # type: ignore[method-assign]
    torch.distributed.init_process_group = _STATE["init_process_group"]
    for module in _STATE["modules"]:
        for name, original in _STATE["originals"].items():
            if getattr(module, name, None) is _REPLACEMENTS[name]:
                setattr(module, name, original)
    shutil.rmtree(_STATE["dir"], ignore_errors=True)
    _STATE.clear()


def swap_module(module: Any) -> None:
    """Points ``module``'s own names of torchtitan's CE at the ``NTLLoss`` stand-ins (idempotent)."""
    for name, original in _STATE["originals"].items():
        if getattr(module, name, None) is original:
            setattr(module, name, _REPLACEMENTS[name])
            if module not in _STATE["modules"]:
                _STATE["modules"].append(module)


def _any_free_port(original: Any) -> Any:
    """``init_process_group`` that gives a one-process ``tcp://host:port`` rendezvous a store on a port the OS
    picks (``TCPStore(host, 0)``: bound atomically, no window for another process to take it).

    A group of one has no peer that must find the port, so the fixed port the caller wrote is not needed;
    any other call (more ranks, another ``init_method``, a store of its own) is passed on unchanged.
    """

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        method = kwargs.get("init_method")
        if (
            not args[1:]
            and isinstance(method, str)
            and method.startswith("tcp://")
            and kwargs.get("world_size") == 1
            and kwargs.get("rank", 0) == 0
            and kwargs.get("store") is None
        ):
            del kwargs["init_method"]
            host = urlparse(method).hostname or "localhost"
            kwargs["store"] = torch.distributed.TCPStore(host, 0, world_size=1, is_master=True)
            kwargs["rank"] = 0
        return original(*args, **kwargs)

    return init_process_group


def _fork_with_swap(original: Any) -> Any:
    """``MultiProcessTestCase._start_processes`` starting its ranks through :func:`_child_main`, forked.

    torch's ``DTensorTestBase`` spawns each rank (a new interpreter importing torch, torchtitan and the test
    module: about 4 CPU-s a rank, 32 ranks in the two runs); a forked rank starts from the test process,
    where all of that is imported already. Each rank then runs torch's own ``MultiProcessTestCase._run``
    (the target torch gives every rank it starts), with its own process group over the file store the test set up.
    """

    def start_processes(self: Any, proc: Any) -> None:
        import torch.multiprocessing as mp

        del proc  # the spawn context's Process

        def with_swap(*args: Any, target: Any, **kwargs: Any) -> Any:
            run = functools.partial(_child_main, _STATE["weight"], _STATE["calls"], target)
            return mp.get_context("fork").Process(*args, target=run, **kwargs)

        original(self, with_swap)

    return start_processes


def _child_main(weight: float, calls: str | None, target: Any, *args: Any, **kwargs: Any) -> Any:
    """A rank: the swap in this process and in the test module, then torch's own entry.

    A forked rank has the test process's swap already: installing again would first undo it, deleting the
    test process's number tables (``uninstall``) under the tests still to run there."""
    if not _STATE:
        install(weight, calls)
    module = target.__self__.__module__
    _STATE["test"] = f"{module}::{target.__self__.__name__}::{args[1]}"  # MultiProcessTestCase._run(rank, test, ...)
    swap_module(sys.modules[module])
    return target(*args, **kwargs)
