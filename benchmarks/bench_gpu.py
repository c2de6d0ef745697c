"""GPU benchmark: CE + NTL (ours first) against the cross-entropy kernels people use; bf16, forward + backward.

    python benchmarks/bench_gpu.py --time-budget 240 --json OUT/bench.json --markdown OUT/bench.md \\
        --ceilings OUT/ceilings.json                      # on the GPU (scripts/gpu_check.sh calls this)
    python benchmarks/bench_gpu.py --dry-run --json /tmp/b.json --markdown /tmp/b.md   # the plan; no CUDA needed
    python benchmarks/bench_gpu.py --smoke --json /tmp/b.json --markdown /tmp/b.md     # every row's code, tiny, CPU
    python benchmarks/bench_gpu.py --list-rows

Shape: ``T x V x H`` = 8192 x 128256 x 4096 (``--tokens 8192,16384``: 16k after every 8k eager row, with time
left), bf16 hidden states ``[T, H]`` and output weight ``[V, H]``, labels with 30 % digits (ids 0-9, the
number tokens, ``K = 10``), forward and backward to both. Rows on logits compute the bf16 logits
``hidden @ weight.T`` in the step, so every row includes the output layer's three matmuls. Time: median of
``--iters`` (at least 5) CUDA-event timings after ``--warmup``; peak memory: ``torch.cuda.max_memory_allocated``
above the inputs, gradients included.

Order (a run cut by its time limit keeps what it finished, so what matters most runs first):
  1. ours, eager: ``ce_with_ntl`` on logits (Triton, Triton in place, PyTorch) and ``linear_ce_with_ntl``
     from hidden states (Triton, PyTorch, Triton with 2048-token chunks, the issue-43 on-chip design), each
     also at NTL weight 0; the two Triton kernels alone (achieved TB/s against the measured copy ceiling);
  2. the eager CE-only peers, each from its own package: Liger's fused linear CE, Cut Cross-Entropy,
     ``F.linear_cross_entropy`` (chunked where the installed torch has ``options=``), Megatron's fused
     vocab-parallel CE (its ``jit_fuser`` bypassed), ``F.cross_entropy``, QuACK; and CE + ``ntloss``;
  3. the same at the next ``--tokens`` (16k);
  4. compiled rows, with time left: Megatron's fused CE as Megatron runs it (``jit_fuser`` = ``torch.compile``),
     ``torch.compile`` of ours and of ``F.cross_entropy``, CCE with ``CCE_AUTOTUNE=1``.
A row starts only if its estimated time fits in what is left of ``--time-budget``; otherwise it is listed
with the reason. The JSON and the Markdown are rewritten (atomically) after every row.

Beside each row: the cost model's prediction (``benchmarks/cost_model.py``, at the H100 datasheet and at the
ceilings measured on this card, when ``--ceilings`` gives them). Verdicts (issue 39 C), each "not measured"
where an input is missing, never passed by default:
  * fused on logits: our fastest ``ce_with_ntl`` row <= 1.05x Megatron's fused CE (its fastest row);
  * chunked: one of our ``linear_ce_with_ntl`` rows <= 1.1x the fastest chunked CE-only peer, at no more
    than that peer's peak memory;
  * compiled chunked within 1.3x of the matmul roofline (``6 T H V`` FLOPs at the measured matmul ceiling).
Every row's CE (and CE + 0.3 NTL) is checked against a reference computed here from the definitions, so a
wrong kernel cannot look fast.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ntl_scale  # noqa: E402
from benchmarks import cost_model  # noqa: E402
from lab.on_chip import cost_model as on_chip_cost  # noqa: E402
from ntl_scale.atomic import atomic_write  # noqa: E402

SCHEMA = "ntl_scale.bench_gpu/1"
NTL_WEIGHT = 0.3
DIGIT_IDS = range(10)  # the benchmark vocabulary's number tokens: ids 0-9 with values 0-9 (K = 10)
DEFAULT_VOCAB, DEFAULT_HIDDEN = 128256, 4096
SMOKE_DIVISOR, SMOKE_HIDDEN, SMOKE_VOCAB = 128, 32, 512  # --smoke: T / 128 tokens (at least 32), H 32, V 512
CHECK_RTOL = 1e-2  # bf16 logits: every correct row lands well inside; a wrong kernel far outside
FUSED_LIMIT, CHUNKED_LIMIT, ROOFLINE_LIMIT = 1.05, 1.1, 1.3
INPUTS_S = 5.0  # estimated seconds to make one size's inputs and references
FALLBACK = r"ignored|fall(s|ing)? (back|through)|reference path"  # a warning that a chunked path was not taken


class Skip(Exception):
    """A row that cannot run here; the message is the reason recorded."""


@dataclass
class Inputs:
    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    vocab: ntl_scale.NumberVocab
    tp_group: object = None
    interpret: bool = False  # --smoke on the CPU: the Triton rows run under Triton's interpreter

    def zero_grad(self) -> None:
        self.hidden.grad = self.weight.grad = None

    @property
    def cuda(self) -> bool:
        return self.hidden.is_cuda


Step = Callable[[], "tuple[torch.Tensor, torch.Tensor] | None"]  # one forward + backward; (loss, CE), detached


@dataclass
class Built:
    """What a row's builder returns: the step, and what it learned about itself at run time."""

    step: Step
    note: str = ""
    chunked: bool | None = None  # overrides Row.chunked (F.linear_cross_entropy: decided by the installed torch)
    values: Callable[[Any], Any] | None = None  # the last step's output -> (loss, CE), computed after the timing


@dataclass(frozen=True)
class Row:
    """One benchmark row (a design). ``family`` groups the rows a verdict reads:

    ``ours_logits``, ``ours_chunked``, ``ours_kernel``, ``megatron``, ``ce_peer`` (CE-only), ``ntl_peer``."""

    key: str
    name: str
    group: str  # "ours" | "peer" | "compiled" | "late" (a design question, if time is left): the order they run in
    family: str
    build: Callable[[Inputs], Built]
    ntl_weight: float | None = None  # None: CE only
    chunked: bool = False  # from hidden states without the whole [T, V] logits
    # a cost_model.PATHS or lab.on_chip.cost_model.PATHS key (or a kernel of ce_ntl_logits: "kernel:<name prefix>")
    model: str | None = None
    model_is_floor: bool = False  # the model path is a lower bound for this code, not a model of it
    chunk_tokens: int | None = None
    setup: tuple[str, float] = ("torch", 2.0)  # a one-off cost (imports, compiles) paid by the first row of its tag
    slowdown: float = 3.0  # estimated step time as a multiple of the model's (or CE alone's) time
    requires: tuple[str, str] | None = None  # (module, package): without it the row is skipped at once
    env: dict[str, str] = field(default_factory=dict)  # import-time settings: the row runs in its own process
    note: str = ""
    approximate: bool = False  # its gradients skip terms (CCE's filter): never the reference of an exact row


# ---------------------------------------------------------------------------------------- steps


def _needs_cuda(x: Inputs, what: str) -> None:
    if not x.cuda:
        raise Skip(f"{what} needs a CUDA GPU")


def _import(module: str, package: str) -> Any:
    try:
        with warnings.catch_warnings():  # megatron-core warns about Transformer Engine and Apex at import
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ImportError as e:
        raise Skip(f"{package} not installed ({e.__class__.__name__}: {e})") from None


def _on_logits(x: Inputs, loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> Step:
    def step():
        x.zero_grad()
        loss, ce = loss_fn(x.hidden @ x.weight.t())
        loss.backward()
        return loss.detach(), ce.detach()

    return step


def _on_hidden(x: Inputs, loss_fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Step:
    def step():
        x.zero_grad()
        loss, ce = loss_fn()
        loss.backward()
        return loss.detach(), ce.detach()

    return step


def _same(loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return loss, loss


def _plus_ntl(x: Inputs, ntl: str, ce_fn: Callable[..., torch.Tensor], z: torch.Tensor | None = None):
    """``(CE, CE)`` of a partner's ``ce_fn`` (called on the logits ``z``, or on the hidden states and weight), or
    ``(CE + w NTL, CE)`` with NTL alone beside it, run before the partner (Megatron's and Liger's CE overwrite
    their input): ``ntl="beside"`` through the passthrough (``beside_ce`` / ``linear_beside_ce``: the partner
    consumes its tensors and NTL's columns join its gradient in place), ``"dense"`` as its own loss
    (``number_token_loss`` / ``linear_number_token_loss``: a dense gradient summed by autograd)."""
    inputs: tuple[torch.Tensor, ...] = (x.hidden, x.weight) if z is None else (z,)
    if not ntl:
        return _same(ce_fn(*inputs))
    if ntl == "beside" and z is None:
        *inputs, term = ntl_scale.linear_beside_ce(x.hidden, x.weight, x.labels, x.vocab)
    elif ntl == "beside":
        *inputs, term = ntl_scale.beside_ce(z, x.labels, x.vocab)
    elif z is None:
        term = ntl_scale.linear_number_token_loss(x.hidden, x.weight, x.labels, x.vocab)
    else:
        term = ntl_scale.number_token_loss(z, x.labels, x.vocab)
    ce = ce_fn(*inputs)
    return ce + NTL_WEIGHT * term, ce


def _impl(x: Inputs, triton: bool) -> str:
    if triton and not (x.cuda or x.interpret):
        raise Skip("impl='triton' needs a CUDA GPU (or Triton's interpreter: --smoke)")
    return "triton" if triton else "torch"


def ours_logits(triton: bool, inplace: bool = False, weight: float = NTL_WEIGHT, compiled: bool = False):
    """``ntl_scale.ce_with_ntl`` as a user calls it. In place: on the logits cast to fp32 (as Megatron's CE
    casts them), since ``inplace=True`` refuses half-precision logits."""

    def build(x: Inputs) -> Built:
        impl = _impl(x, triton)

        def fn(z, y):
            z = z.float() if inplace else z
            out = ntl_scale.ce_with_ntl(z, y, x.vocab, ntl_weight=weight, impl=impl, inplace=inplace)
            return out.loss, out.ce

        fn = torch.compile(fn) if compiled else fn
        return Built(_on_logits(x, lambda z: fn(z, x.labels)))

    return build


def ours_chunked(triton: bool, weight: float = NTL_WEIGHT, chunk_tokens: int | None = None, compiled: bool = False):
    """``ntl_scale.linear_ce_with_ntl`` as a user calls it."""

    def build(x: Inputs) -> Built:
        impl = _impl(x, triton)

        def fn(h, w, y):
            out = ntl_scale.linear_ce_with_ntl(
                h, w, y, x.vocab, ntl_weight=weight, impl=impl, chunk_tokens=chunk_tokens
            )
            return out.loss, out.ce

        fn = torch.compile(fn) if compiled else fn
        return Built(_on_hidden(x, lambda: fn(x.hidden, x.weight, x.labels)))

    return build


#: The on-chip backward at 128 x 128 tiles (bf16): half the fp32 atomics of the launch's 64 x 64 (269 GB instead of
#: 538 at 8192 x 128256 x 4096), one 16-warp program per SM. Compiled once for sm_80/90/100 (2026-11-27, triton
#: 3.9.0, ``triton_aot.compile_one`` with these blocks): no spills, 128 / 88 / 98 registers; it is not in the
#: ahead-of-time table, which compiles the launches. The tiles and group of ``lab.on_chip.cost_model.ON_CHIP_T128``.
ON_CHIP_T128 = {**on_chip_cost.ON_CHIP_T128, "BLOCK_H": 32, "num_warps": 16}


def on_chip_linear_ce_ntl(backward: dict[str, int] | None = None) -> Callable[[Inputs], Built]:
    """``lab.on_chip.linear_on_chip.fused_linear_ce_ntl`` (the logits never leave the chip; a design in ``lab/``,
    imported when the row runs, from the checkout's root),
    its per-token terms reduced as ``linear_ce_with_ntl`` reduces them (mean CE + 0.3 mean NTL-WAS);
    ``backward``: overrides of the backward's launch (``BACKWARD_BLOCKS``; ``GROUP_T=0``: all token blocks
    in one group, the order before grouping)."""

    def build(x: Inputs) -> Built:
        _impl(x, True)
        from lab.on_chip.linear_on_chip import fused_linear_ce_ntl
        from ntl_scale.reductions import combine_terms

        options = ntl_scale.NTLOptions()
        tokens = x.hidden.numel() // x.hidden.shape[-1]
        blocks = (None, None if backward is None else {**backward, "GROUP_T": backward.get("GROUP_T") or tokens})

        def fn():
            terms = fused_linear_ce_ntl(
                x.hidden, x.weight, x.labels, x.vocab, options, tp_group=x.tp_group, blocks=blocks
            )
            out = combine_terms(terms, x.labels, x.vocab, options, NTL_WEIGHT, None, "mean")
            return out.loss, out.ce

        return Built(_on_hidden(x, fn))

    return build


def _kernel_inputs(x: Inputs):
    """The bf16 logits (no grad), the label columns, the number columns and ``a_k = |v_k - t|`` per token."""
    with torch.no_grad():
        logits = x.hidden @ x.weight.t()
    cols = x.vocab.ids.to(x.labels.device)
    values = x.vocab.values.to(x.labels.device, torch.float32)
    is_number = x.labels < len(DIGIT_IDS)
    target = torch.where(is_number, x.labels, torch.zeros_like(x.labels)).to(torch.float32)
    a_table = (values.unsqueeze(0) - target.unsqueeze(1)).abs()
    return logits, x.labels.contiguous(), cols, a_table


def _stats_ce(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean CE ``log S + m - z_y`` from the statistics kernel's ``[T, 6]`` (loss and CE alike)."""
    ce = (stats[:, 1].log() + stats[:, 0] - stats[:, 2]).mean()
    return ce, ce


def kernel_stats(x: Inputs) -> Built:
    """The statistics kernel alone on the whole ``[T, V]`` logits; its CE (``log S + m - z_y``) is checked."""
    triton_ce_ntl = importlib.import_module("ntl_scale.ops.triton_ce_ntl")
    if not triton_ce_ntl.triton_available():
        raise Skip("triton not installed")
    _impl(x, True)
    logits, target, cols, a_table = _kernel_inputs(x)

    return Built(lambda: triton_ce_ntl.shard_stats(logits, target, cols, a_table), values=_stats_ce,
                 note="statistics kernel (shard_stats), one launch over [T, V]")  # fmt: skip


def kernel_grad(x: Inputs) -> Built:
    """The gradient kernel alone, written in place over the logits (number columns included)."""
    triton_ce_ntl = importlib.import_module("ntl_scale.ops.triton_ce_ntl")
    if not triton_ce_ntl.triton_available():
        raise Skip("triton not installed")
    _impl(x, True)
    logits, target, cols, a_table = _kernel_inputs(x)
    stats = triton_ce_ntl.shard_stats(logits, target, cols, a_table)
    row_max, total = stats[:, 0].contiguous(), stats[:, 1].contiguous()  # no copies inside the timing
    t = logits.shape[0]
    coef = torch.full((t,), 1.0 / t, device=logits.device)
    number_grad = torch.full((t, cols.numel()), 1e-6, device=logits.device)

    def step():
        # repeated in place: the values stay finite (the gradient's own softmax), the traffic is the same
        triton_ce_ntl.softmax_grad_(logits, logits, row_max, total, coef, coef, target, cols, number_grad)
        return None

    return Built(step, note="gradient kernel (softmax_grad_), in place over [T, V], number columns stored")


def kernel_stats_softmax(x: Inputs, per_row: bool = False) -> Built:
    """The statistics kernel writing the softmax too (``softmax_into``, the chunked op's one kernel per chunk)
    over ``[T, V]``: against ``kernel_stats`` plus ``kernel_grad`` it shows how much of the second walk over
    each row L2 serves (the cost model's assumption). Written in place, as the op writes it, so the launch is
    the op's on this GPU (``softmax_launch``: a persistent grid of one program per SM where four per SM would
    not fit in L2), or with ``per_row`` one program per row (the launch before). The timed steps repeat it in
    place (the values stay finite: the softmax of a softmax; the traffic is the same). Checked after the
    timing, on the logits copied back: its CE, and the softmax it wrote (each row sums to 1 within the logits
    dtype's rounding; else the check fails)."""
    triton_ce_ntl = importlib.import_module("ntl_scale.ops.triton_ce_ntl")
    if not triton_ce_ntl.triton_available():
        raise Skip("triton not installed")
    _impl(x, True)
    logits, target, cols, a_table = _kernel_inputs(x)
    work = logits.clone()

    programs = logits.shape[0] if per_row else None
    grid = "one program per row" if per_row else "the op's launch (softmax_launch)"
    note = f"statistics + softmax in place (shard_stats(softmax_into=logits)), one launch over [T, V], {grid}"

    def step() -> torch.Tensor:
        return triton_ce_ntl.shard_stats(work, target, cols, a_table, softmax_into=work, programs=programs)

    def values(_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        work.copy_(logits)
        loss, ce = _stats_ce(step())
        rows = work.float().sum(dim=-1)
        if not bool(((rows - 1).abs() <= 1e-2).all()):  # a wrong softmax: the check against CE fails
            return torch.full_like(loss, float("nan")), ce
        return loss, ce

    return Built(step, values=values, note=note)


def kernel_stats_softmax_per_row(x: Inputs) -> Built:
    return kernel_stats_softmax(x, per_row=True)


def liger(x: Inputs, ntl: str = "") -> Built:
    _needs_cuda(x, "Liger-Kernel (Triton)")
    module = _import("liger_kernel.transformers.fused_linear_cross_entropy", "liger-kernel")
    loss_fn = module.LigerFusedLinearCrossEntropyLoss()
    step = _on_hidden(x, lambda: _plus_ntl(x, ntl, lambda h, w: loss_fn(w, h, x.labels)))
    return Built(step, note="Liger's defaults")


def liger_fp32(x: Inputs) -> Built:
    """Liger's fused linear CE accumulating the weight gradient in fp32 (``accum_dtype=torch.float32``, what
    recipes that care pass): the accumulation ours always does, so its memory compares like for like."""
    _needs_cuda(x, "Liger-Kernel (Triton)")
    module = _import("liger_kernel.transformers.fused_linear_cross_entropy", "liger-kernel")
    try:
        loss_fn = module.LigerFusedLinearCrossEntropyLoss(accum_dtype=torch.float32)
    except TypeError as e:  # a Liger before accum_dtype
        raise Skip(f"this Liger has no accum_dtype ({e})") from None
    return Built(_on_hidden(x, lambda: _same(loss_fn(x.weight, x.hidden, x.labels))), note="accum_dtype=fp32")


def cce(exact: bool, ntl: str = "") -> Callable[[Inputs], Built]:
    """Cut Cross-Entropy's ``linear_cross_entropy``: its defaults, or ``filter_eps=None`` (``exact``)."""

    def build(x: Inputs) -> Built:
        _needs_cuda(x, "Cut Cross-Entropy (Triton)")
        module = _import("cut_cross_entropy", "cut-cross-entropy")
        kwargs: dict[str, Any] = {"filter_eps": None} if exact else {}
        note = (
            "filter_eps=None"
            if exact
            else "CCE's defaults (impl 'cce', filter_eps: a gradient tile whose every entry lies below bf16's eps / "
            "32 is skipped; how many depends on the logits)"
        )

        def ce_fn(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return module.linear_cross_entropy(h, w, x.labels, **kwargs)

        return Built(_on_hidden(x, lambda: _plus_ntl(x, ntl, ce_fn)), note=note)

    return build


def torch_linear_ce(x: Inputs, ntl: str = "") -> Built:
    """``F.linear_cross_entropy``: chunked where the installed torch has ``options=``, else its materialised path."""
    if not hasattr(F, "linear_cross_entropy"):
        raise Skip(
            f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy (neither materialised nor "
            "chunked; torch 2.11's wheel has none)"
        )
    options_cls = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options_cls is None or "options" not in inspect.signature(F.linear_cross_entropy).parameters:
        note = f"materialised (torch {torch.__version__} has no chunked mode)"
        ce_fn = lambda h, w: F.linear_cross_entropy(h, w, x.labels)  # noqa: E731
        return Built(_on_hidden(x, lambda: _plus_ntl(x, ntl, ce_fn)), note, chunked=False)
    options = options_cls()
    ce_fn = lambda h, w: F.linear_cross_entropy(h, w, x.labels, options=options)  # noqa: E731
    step = _on_hidden(x, lambda: _plus_ntl(x, ntl, ce_fn))
    return Built(step, "chunked (options=torch.nn.LinearCrossEntropyOptions(), its 'auto' choices)", chunked=True)


def quack(x: Inputs) -> Built:
    _needs_cuda(x, "QuACK (CuTe DSL)")
    module = _import("quack.linear_cross_entropy", "quack-kernels (and nvidia-cutlass-dsl)")
    return Built(_on_hidden(x, lambda: _same(module.chunked_linear_cross_entropy(x.hidden, x.weight, x.labels))))


def megatron(jit: bool, ntl: str = ""):
    """Megatron's ``fused_vocab_parallel_cross_entropy`` at TP = 1; its helpers are decorated with
    ``jit_fuser`` (``torch.compile``) at import: ``jit=False`` runs them eagerly (``torch.compiler.set_stance``)."""

    def build(x: Inputs) -> Built:
        module = _import("megatron.core.fusions.fused_cross_entropy", "megatron-core")
        if x.tp_group is None:
            raise Skip("no process group (torch.distributed could not be initialised)")
        labels = x.labels.view(-1, 1)

        def loss_fn(logits):  # Megatron's layout: [s, b, V/tp] logits, [s, b] labels; per-token losses
            def ce_fn(z):
                return module.fused_vocab_parallel_cross_entropy(z.view(-1, 1, z.shape[-1]), labels, x.tp_group).mean()

            return _plus_ntl(x, ntl, ce_fn, logits)

        step = _on_logits(x, loss_fn)
        if jit:
            return Built(step, note="as Megatron runs it: jit_fuser = torch.compile")

        def eager():
            with torch.compiler.set_stance("force_eager"):
                return step()

        return Built(eager, note="jit_fuser bypassed: torch.compiler.set_stance('force_eager')")

    return build


def te(ntl: str = ""):
    """Transformer Engine's ``parallel_cross_entropy`` at TP = 1, called as Megatron's ``--cross-entropy-fusion-impl
    te`` calls it (``megatron.core.extensions.transformer_engine.te_parallel_cross_entropy``, ``[s, b]`` labels)."""

    def build(x: Inputs) -> Built:
        _needs_cuda(x, "Transformer Engine")
        module = _import("megatron.core.extensions.transformer_engine", "megatron-core")
        if getattr(module, "te_parallel_cross_entropy", None) is None:
            raise Skip("transformer-engine not installed (megatron.core has no te_parallel_cross_entropy)")
        if x.tp_group is None:
            raise Skip("no process group (torch.distributed could not be initialised)")
        labels = x.labels.view(-1, 1)

        def loss_fn(logits):
            def ce_fn(z):
                return module.te_parallel_cross_entropy(z.view(-1, 1, z.shape[-1]), labels, x.tp_group).mean()

            return _plus_ntl(x, ntl, ce_fn, logits)

        return Built(_on_logits(x, loss_fn), note="as Megatron's --cross-entropy-fusion-impl te calls it")

    return build


def materialised_ce(compiled: bool, ntl: str = ""):
    def build(x: Inputs) -> Built:
        fn = torch.compile(lambda z, y: F.cross_entropy(z.float(), y)) if compiled else None

        def loss_fn(z):
            return _plus_ntl(x, ntl, lambda zz: fn(zz, x.labels) if fn else F.cross_entropy(zz.float(), x.labels), z)

        return Built(_on_logits(x, loss_fn))

    return build


@functools.lru_cache(maxsize=2)
def _ntloss(vocab_size: int) -> Any:
    """``ntloss.NTLoss`` over the benchmark's word-level tokenizer (built once per vocabulary: seconds at 128k)."""
    module = _import("ntloss", "ntloss")
    from benchmarks.common import word_level_tokenizer

    with contextlib.redirect_stderr(open(os.devnull, "w")):  # ntloss logs its table through loguru
        return module.NTLoss(word_level_tokenizer(vocab_size), vocab_size=vocab_size, reweigh=False)


def ce_plus_ntloss(x: Inputs) -> Built:
    ntl = _ntloss(x.weight.shape[0])

    def loss_fn(z):
        ce = F.cross_entropy(z.float(), x.labels)
        return ce + NTL_WEIGHT * ntl(z.float().unsqueeze(0), x.labels.unsqueeze(0)), ce

    return Built(_on_logits(x, loss_fn), note="ntloss 0.3 NTLoss (NTL-WAS, reweigh=False) on fp32 logits")


_INPLACE = "inplace=True refuses bf16 logits: cast to fp32 in the step; no model (the model's path is bf16)"
_W0 = "; at NTL weight 0 the op still computes the NTL terms (the weight multiplies them)"
_TRITON = {"setup": ("triton", 15.0), "slowdown": 1.5}  # our two kernels compiled once, shared by the rows
_COMPILED = {"slowdown": 2.0}  # each compiles its own graph: setup (its key, 60 s)
_LIGER = ("liger_kernel", "liger-kernel")
_CCE = ("cut_cross_entropy", "cut-cross-entropy")
_MEGATRON = ("megatron.core", "megatron-core")
_TE = ("transformer_engine", "transformer-engine")
_ADDON = (
    "the row above it plus NTL alone on the K number columns through the passthrough (NTL's columns added into the "
    "CE's gradient in place): the add-on's count is in docs/benchmarks.md"
)
_DENSE = "the same add-on as its own loss (a dense gradient summed by autograd): what the passthrough saves"
ROWS = [
    # 1. ours, eager
    Row("ours_logits_triton", "ours: ce_with_ntl on logits, Triton", "ours", "ours_logits",
        ours_logits(True), NTL_WEIGHT, model="ce_ntl_logits", **_TRITON),
    Row("ours_logits_triton_w0", "ours: ce_with_ntl on logits, Triton, NTL weight 0", "ours", "ours_logits",
        ours_logits(True, weight=0.0), 0.0, model="ce_ntl_logits", note=_W0[2:], **_TRITON),
    Row("ours_logits_triton_inplace", "ours: ce_with_ntl on logits cast to fp32, Triton, in place", "ours",
        "ours_logits", ours_logits(True, inplace=True), NTL_WEIGHT, note=_INPLACE, **_TRITON),
    Row("ours_logits_triton_inplace_w0", "ours: ce_with_ntl on fp32 logits, Triton, in place, NTL weight 0", "ours",
        "ours_logits", ours_logits(True, inplace=True, weight=0.0), 0.0, note=_INPLACE + _W0, **_TRITON),
    Row("ours_logits_torch", "ours: ce_with_ntl on logits, PyTorch (impl='torch')", "ours", "ours_logits",
        ours_logits(False), NTL_WEIGHT, note="no model: the model covers impl='triton'", slowdown=4.0),
    Row("ours_logits_torch_w0", "ours: ce_with_ntl on logits, PyTorch, NTL weight 0", "ours", "ours_logits",
        ours_logits(False, weight=0.0), 0.0, note="no model" + _W0, slowdown=4.0),
    Row("ours_chunked_triton", "ours: linear_ce_with_ntl (chunked), Triton", "ours", "ours_chunked",
        ours_chunked(True), NTL_WEIGHT, chunked=True, model="ce_ntl_chunked",
        note="issue 43: the chunk chosen for the device (choose_chunk_tokens), the [V, H] passes folded", **_TRITON),
    Row("ours_chunked_triton_c523", "ours: linear_ce_with_ntl, Triton, chunks of 523 tokens (the CPU's)", "ours",
        "ours_chunked", ours_chunked(True, chunk_tokens=523), NTL_WEIGHT, chunked=True, model="ce_ntl_chunked",
        chunk_tokens=523, note="the CPU's 2**26 // V chunk at V = 128256, the GPU default before issue 43",
        **_TRITON),
    Row("ours_chunked_triton_w0", "ours: linear_ce_with_ntl (chunked), Triton, NTL weight 0", "ours",
        "ours_chunked", ours_chunked(True, weight=0.0), 0.0, chunked=True, model="ce_ntl_chunked", note=_W0[2:],
        **_TRITON),
    Row("ours_chunked_torch", "ours: linear_ce_with_ntl (chunked), PyTorch", "ours", "ours_chunked",
        ours_chunked(False), NTL_WEIGHT, chunked=True, note="no model: the model covers impl='triton'",
        slowdown=4.0),
    Row("ours_chunked_torch_w0", "ours: linear_ce_with_ntl (chunked), PyTorch, NTL weight 0", "ours",
        "ours_chunked", ours_chunked(False, weight=0.0), 0.0, chunked=True, note="no model" + _W0, slowdown=4.0),
    Row("ours_chunked_triton_c2048", "ours: linear_ce_with_ntl, Triton, chunks of 2048 tokens", "ours",
        "ours_chunked", ours_chunked(True, chunk_tokens=2048), NTL_WEIGHT, chunked=True, model="ce_ntl_chunked",
        chunk_tokens=2048, note="issue 43: a chunk long enough for a math-bound weight-gradient GEMM", **_TRITON),
    Row("ours_linear_on_chip", "ours: fused linear CE + NTL, logits on chip (issue 43)", "ours", "ours_chunked",
        on_chip_linear_ce_ntl(), NTL_WEIGHT, chunked=True, model="ce_ntl_on_chip", setup=("triton_linear", 15.0),
        slowdown=1.5),
    Row("ours_linear_on_chip_ungrouped", "ours: the same, its backward in the order before (all token blocks "
        "fastest)", "late", "ours_chunked", on_chip_linear_ce_ntl({"GROUP_T": 0}), NTL_WEIGHT, chunked=True,
        model="ce_ntl_on_chip_ungrouped", setup=("triton_linear", 15.0), slowdown=1.5,
        note="issue 43: what the grouped order saves; the model puts it at several times the grouped row"),
    Row("ours_linear_on_chip_g12", "ours: the same, its backward in groups of 12 token blocks", "late",
        "ours_chunked", on_chip_linear_ce_ntl({"GROUP_T": 12}), NTL_WEIGHT, chunked=True,
        setup=("triton_linear", 15.0), slowdown=2.0,
        note="issue 43: the runner-up group size of the cost model's LRU simulation (no model row)"),
    Row("ours_linear_on_chip_t128", "ours: the same, its backward in 128 x 128 tiles, groups of 4", "late",
        "ours_chunked", on_chip_linear_ce_ntl(ON_CHIP_T128), NTL_WEIGHT, chunked=True, setup=("triton_linear", 15.0),
        slowdown=2.0, note="issue 43: half the fp32 atomics of the 64 x 64 tiles (no model row)"),
    Row("kernel_stats", "ours: Triton statistics kernel alone", "ours", "ours_kernel", kernel_stats,
        model="kernel:stats kernel", **_TRITON),
    Row("kernel_grad", "ours: Triton gradient kernel alone, in place", "ours", "ours_kernel", kernel_grad,
        model="kernel:grad kernel", **_TRITON),
    Row("kernel_stats_softmax", "ours: Triton statistics kernel writing the softmax in place, launched as the op "
        "launches it", "ours", "ours_kernel", kernel_stats_softmax,
        note="no model row of its own: 1x the logits read if L2 serves the second walk, 2x if not", **_TRITON),
    Row("kernel_stats_softmax_per_row", "ours: the same, one program per row (the launch before the persistent "
        "grid)", "ours", "ours_kernel", kernel_stats_softmax_per_row,
        note="against kernel_stats_softmax: what sizing the grid to L2 saves", **_TRITON),
    # 2. the eager peers
    Row("liger", "Liger fused linear CE", "peer", "ce_peer", liger, chunked=True, setup=("liger", 15.0),
        requires=_LIGER),
    Row("liger_ntl", "Liger fused linear CE + NTL alone (linear_beside_ce)", "peer", "addon",
        functools.partial(liger, ntl="beside"), NTL_WEIGHT, chunked=True, setup=("liger", 15.0), requires=_LIGER,
        note=_ADDON),
    Row("liger_ntl_dense", "Liger fused linear CE + NTL alone (linear_number_token_loss)", "peer", "addon",
        functools.partial(liger, ntl="dense"), NTL_WEIGHT, chunked=True, setup=("liger", 15.0), requires=_LIGER,
        note=_DENSE),
    Row("liger_fp32", "Liger fused linear CE, fp32 weight-gradient accumulation", "peer", "ce_peer", liger_fp32,
        chunked=True, setup=("liger", 15.0), requires=_LIGER),
    Row("cce", "Cut Cross-Entropy", "peer", "ce_peer", cce(False), chunked=True, model="linear_ce_filtered",
        model_is_floor=True, setup=("cce", 15.0), requires=_CCE, approximate=True),
    Row("cce_exact", "Cut Cross-Entropy, no gradient filtering (filter_eps=None)", "peer", "ce_peer", cce(True),
        chunked=True, model="linear_ce_recompute", model_is_floor=True, setup=("cce", 15.0), requires=_CCE,
        note="no tile skipped, the design of ours_linear_on_chip without NTL (its gradients added in bf16 under "
        "locks in CCE 25.1.1, ours in fp32)"),
    Row("cce_exact_ntl", "Cut Cross-Entropy, filter_eps=None, + NTL alone (linear_beside_ce)", "peer",
        "addon", cce(True, ntl="beside"), NTL_WEIGHT, chunked=True, model="linear_ce_recompute", model_is_floor=True,
        setup=("cce", 15.0), requires=_CCE, note=_ADDON),
    Row("cce_exact_ntl_dense", "Cut Cross-Entropy, filter_eps=None, + NTL alone (linear_number_token_loss)", "peer",
        "addon", cce(True, ntl="dense"), NTL_WEIGHT, chunked=True, model="linear_ce_recompute", model_is_floor=True,
        setup=("cce", 15.0), requires=_CCE, note=_DENSE),
    Row("torch_linear_ce", "torch F.linear_cross_entropy", "peer", "ce_peer", torch_linear_ce, chunked=True,
        note="chunked or materialised: decided by the installed torch"),
    Row("torch_linear_ce_ntl", "torch F.linear_cross_entropy + NTL alone (linear_beside_ce)", "peer", "addon",
        functools.partial(torch_linear_ce, ntl="beside"), NTL_WEIGHT, chunked=True, note=_ADDON),
    Row("torch_linear_ce_ntl_dense", "torch F.linear_cross_entropy + NTL alone (linear_number_token_loss)", "peer",
        "addon", functools.partial(torch_linear_ce, ntl="dense"), NTL_WEIGHT, chunked=True, note=_DENSE),
    Row("megatron", "Megatron fused vocab-parallel CE (TP 1), eager", "peer", "megatron", megatron(False),
        model="ce_logits", model_is_floor=True, setup=("megatron", 15.0), requires=_MEGATRON),
    Row("megatron_ntl", "Megatron fused vocab-parallel CE (TP 1), eager, + NTL alone (beside_ce)", "peer",
        "addon", megatron(False, ntl="beside"), NTL_WEIGHT, model="ce_logits", model_is_floor=True,
        setup=("megatron", 15.0), requires=_MEGATRON, note=_ADDON),
    Row("megatron_ntl_dense", "Megatron fused vocab-parallel CE (TP 1), eager, + NTL alone (number_token_loss)",
        "peer", "addon", megatron(False, ntl="dense"), NTL_WEIGHT, model="ce_logits", model_is_floor=True,
        setup=("megatron", 15.0), requires=_MEGATRON, note=_DENSE),
    Row("te", "Transformer Engine parallel CE (TP 1), as Megatron's te fusion", "peer", "ce_peer", te(),
        model="ce_logits", model_is_floor=True, setup=("megatron", 15.0), requires=_TE),
    Row("te_ntl", "Transformer Engine parallel CE (TP 1) + NTL alone (beside_ce)", "peer", "addon", te("beside"),
        NTL_WEIGHT, model="ce_logits", model_is_floor=True, setup=("megatron", 15.0), requires=_TE, note=_ADDON),
    Row("te_ntl_dense", "Transformer Engine parallel CE (TP 1) + NTL alone (number_token_loss)", "peer", "addon",
        te("dense"), NTL_WEIGHT, model="ce_logits", model_is_floor=True, setup=("megatron", 15.0), requires=_TE,
        note=_DENSE),
    Row("ce", "F.cross_entropy on logits", "peer", "ce_peer", materialised_ce(False), model="ce_logits",
        model_is_floor=True),
    Row("ce_ntl", "F.cross_entropy on logits + NTL alone (beside_ce)", "peer", "addon",
        materialised_ce(False, ntl="beside"), NTL_WEIGHT, model="ce_logits", model_is_floor=True, note=_ADDON),
    Row("ce_ntl_dense", "F.cross_entropy on logits + NTL alone (number_token_loss)", "peer", "addon",
        materialised_ce(False, ntl="dense"), NTL_WEIGHT, model="ce_logits", model_is_floor=True, note=_DENSE),
    Row("ce_ntloss", "F.cross_entropy + ntloss on logits", "peer", "ntl_peer", ce_plus_ntloss, NTL_WEIGHT,
        setup=("ntloss", 20.0), slowdown=4.0, requires=("ntloss", "ntloss")),
    Row("quack", "QuACK chunked_linear_cross_entropy", "peer", "ce_peer", quack, chunked=True,
        setup=("quack", 30.0), requires=("quack", "quack-kernels")),
    # 4. compiled, with time left (Megatron as it runs first: the fused verdict's reference)
    Row("megatron_jit", "Megatron fused vocab-parallel CE (TP 1), jit_fuser", "compiled", "megatron",
        megatron(True), model="ce_logits", model_is_floor=True, setup=("megatron_jit", 60.0), requires=_MEGATRON,
        **_COMPILED),
    Row("ours_logits_compiled", "ours: torch.compile(ce_with_ntl) on logits", "compiled", "ours_logits",
        ours_logits(True, compiled=True), NTL_WEIGHT, setup=("ours_logits_compiled", 60.0), **_COMPILED),
    Row("ours_chunked_compiled", "ours: torch.compile(linear_ce_with_ntl)", "compiled", "ours_chunked",
        ours_chunked(True, compiled=True), NTL_WEIGHT, chunked=True, setup=("ours_chunked_compiled", 60.0),
        **_COMPILED),
    Row("compiled_ce", "torch.compile(F.cross_entropy) on logits", "compiled", "ce_peer", materialised_ce(True),
        model="ce_logits", model_is_floor=True, setup=("compiled_ce", 45.0), **_COMPILED),
    Row("cce_autotune", "Cut Cross-Entropy, CCE_AUTOTUNE=1", "compiled", "ce_peer", cce(False), chunked=True,
        model="linear_ce_filtered", model_is_floor=True, env={"CCE_AUTOTUNE": "1"}, setup=("cce_autotune", 240.0),
        requires=_CCE, approximate=True),
]  # fmt: skip
ROW_BY_KEY = {r.key: r for r in ROWS}


# ---------------------------------------------------------------------------------------- plan, model, budget


@dataclass(frozen=True)
class Planned:
    row: Row
    tokens: int  # the configuration's T (the GPU shape; --smoke runs T / 128)


def plan_rows(tokens: list[int], keys: list[str] | None = None) -> list[Planned]:
    """Ours and the eager peers at each ``T`` in order, then the compiled rows at each ``T``, then the late rows
    (designs not chosen, measured to check a model's claim about them) at each ``T``."""
    rows = [r for r in ROWS if keys is None or r.key in keys]
    eager = [Planned(r, t) for t in tokens for r in rows if r.group not in ("compiled", "late")]
    return eager + [Planned(r, t) for group in ("compiled", "late") for t in tokens for r in rows if r.group == group]


def model_kernels(row: Row, shape: cost_model.Shape) -> list[cost_model.Kernel] | None:
    if row.model is None:
        return None
    if row.model.startswith("kernel:"):
        prefix = row.model.split(":", 1)[1]
        return [k for k in cost_model.ce_ntl_logits(shape) if k.name.startswith(prefix)]
    fn = {**cost_model.PATHS, **on_chip_cost.PATHS}[row.model][1]
    return fn(shape, row.chunk_tokens) if row.chunk_tokens else fn(shape)  # type: ignore[call-arg]


def model_prediction(row: Row, shape: cost_model.Shape, ceilings: dict | None) -> dict | None:
    """The cost model's time for this row's path (datasheet H100, and at the measured ceilings if given)."""
    kernels = model_kernels(row, shape)
    if kernels is None:
        return None
    out = {
        "path": row.model,
        "floor": row.model_is_floor,
        "bytes": sum(k.bytes for k in kernels),
        "flops": sum(k.flops for k in kernels),
        "ms_h100_datasheet": cost_model.cost(kernels).seconds * 1e3,
        "ms_at_ceilings": None,
    }
    if ceilings:
        c = cost_model.cost(kernels, ceilings["copy_tbps"] * 1e12, ceilings["matmul_tflops"] * 1e12)
        out["ms_at_ceilings"] = c.seconds * 1e3
    return out


def estimate_s(row: Row, shape: cost_model.Shape, warmup: int, iters: int, first: bool) -> float:
    """Seconds this row is expected to take: its one-off setup (``first``: the first row of its setup tag),
    1 s of building and cleaning, and ``warmup + iters`` steps at ``slowdown`` x the model (CE alone on logits
    where it has none), at least 5 ms each."""
    kernels = model_kernels(row, shape) or cost_model.ce_logits(shape)
    step_ms = max(cost_model.cost(kernels).seconds * 1e3 * row.slowdown, 5.0)
    return (row.setup[1] if first else 0.0) + 1.0 + (warmup + iters) * step_ms / 1e3


class Estimator:
    """Estimated seconds of each planned row (:func:`estimate_s`): a setup tag's one-off cost is charged until
    a row of that tag has started (a compiled row's tag is per ``T``: a new shape compiles again)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.paid = args, set()

    def tag(self, p: Planned) -> str:
        return f"{p.row.setup[0]}@{p.tokens}" if p.row.group == "compiled" else p.row.setup[0]

    def __call__(self, p: Planned) -> float:
        shape = cost_model.Shape(p.tokens, self.args.vocab, self.args.hidden, len(DIGIT_IDS))
        return estimate_s(p.row, shape, self.args.warmup, self.args.iters, self.tag(p) not in self.paid)

    def started(self, p: Planned) -> None:
        self.paid.add(self.tag(p))


def missing_package(row: Row) -> str | None:
    """Why the row is skipped at once (its package is not importable here), or None."""
    if row.requires is None:
        return None
    module, package = row.requires
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"{package} not installed"


def budget_reason(estimate: float, left: float, budget: float) -> str | None:
    """Why a row does not start (None: it starts): its estimate exceeds what is left of the budget."""
    if estimate <= left:
        return None
    return f"time budget: {max(left, 0):.0f} s of {budget:.0f} s left, this row needs about {estimate:.0f} s (estimate)"


# ---------------------------------------------------------------------------------------- verdicts


def _measured(rows: list[dict], family: str, tokens: int, **match: Any) -> list[dict]:
    return [
        r
        for r in rows
        if r["family"] == family
        and r["T"] == tokens
        and r["status"] == "measured"
        and r.get("ms") is not None
        and all(r.get(k) == v for k, v in match.items())
    ]


def _brief(r: dict) -> dict:
    return {"row": r["key"], "ms": r["ms"], "peak_mib": r.get("peak_mib")}


def _verdict(key: str, rule: str, tokens: int, result: str, reason: str = "", **numbers: Any) -> dict:
    return {"key": key, "rule": rule, "T": tokens, "result": result, "reason": reason, **numbers}


def verdicts(rows: list[dict], ceilings: dict | None, not_measured: str | None = None) -> list[dict]:
    """Issue 39 C's verdicts from the row records, per ``T`` planned. ``not_measured``: why nothing was.

    A verdict passes only on measured rows whose values were checked; a missing input gives "not measured",
    one of our rows with a wrong value gives "fail"."""
    out = []
    for t in sorted({r["T"] for r in rows}):
        rule1 = f"our fastest ce_with_ntl row on logits <= {FUSED_LIMIT}x Megatron's fused CE (its fastest row)"
        rule2 = (
            f"one of our linear_ce_with_ntl rows <= {CHUNKED_LIMIT}x the fastest chunked CE-only peer with exact "
            "gradients (CCE's default filter skips some: shown beside), at no more than its peak memory"
        )
        rule3 = f"our compiled chunked row <= {ROOFLINE_LIMIT}x the matmul roofline (6 T H V FLOPs at the ceiling)"
        if not_measured:
            keys = ("fused_vs_megatron", "chunked_vs_peers", "compiled_chunked_roofline")
            out += [_verdict(k, r, t, "not measured", not_measured) for k, r in zip(keys, (rule1, rule2, rule3))]
            continue
        out.append(_fused_verdict(rows, t, rule1))
        out.append(_chunked_verdict(rows, t, rule2))
        out.append(_roofline_verdict(rows, t, rule3, ceilings))
    return out


def _wrong(ours: list[dict]) -> list[dict]:
    return [r for r in ours if r.get("check_ok") is False]


def _fused_verdict(rows: list[dict], t: int, rule: str) -> dict:
    key = "fused_vs_megatron"
    ours = _measured(rows, "ours_logits", t, ntl_weight=NTL_WEIGHT)
    refs = [r for r in _measured(rows, "megatron", t) if r.get("check_ok") is not False]
    if not ours or not refs:
        missing = "our fused rows" if not ours else "Megatron's fused CE"
        return _verdict(key, rule, t, "not measured", f"{missing} not measured at T = {t}")
    if _wrong(ours):
        return _verdict(key, rule, t, "fail", f"wrong values: {', '.join(r['key'] for r in _wrong(ours))}")
    best, ref = min(ours, key=lambda r: r["ms"]), min(refs, key=lambda r: r["ms"])
    ratio = best["ms"] / ref["ms"]
    result = "pass" if ratio <= FUSED_LIMIT else "fail"
    return _verdict(key, rule, t, result, "", ratio=ratio, limit=FUSED_LIMIT, ours=_brief(best), reference=_brief(ref))


def _chunked_verdict(rows: list[dict], t: int, rule: str) -> dict:
    key = "chunked_vs_peers"
    ours = _measured(rows, "ours_chunked", t, ntl_weight=NTL_WEIGHT)
    checked = [r for r in _measured(rows, "ce_peer", t, chunked=True) if r.get("check_ok") is not False]
    peers = [r for r in checked if not r.get("approximate")]  # exact gradients, as ours
    approximate = [_brief(r) for r in checked if r.get("approximate")]  # shown beside, never the reference
    extra = {"approximate_peers": approximate} if approximate else {}
    if not ours or not peers:
        missing = "our chunked rows" if not ours else "no chunked CE-only peer with exact gradients"
        return _verdict(key, rule, t, "not measured", f"{missing} measured at T = {t}", **extra)
    if _wrong(ours):
        return _verdict(key, rule, t, "fail", f"wrong values: {', '.join(r['key'] for r in _wrong(ours))}", **extra)
    ref = min(peers, key=lambda r: r["ms"])
    if ref.get("peak_mib") is None or any(r.get("peak_mib") is None for r in ours):
        return _verdict(key, rule, t, "not measured", "peak memory not measured", reference=_brief(ref), **extra)
    meets = [r for r in ours if r["ms"] <= CHUNKED_LIMIT * ref["ms"] and r["peak_mib"] <= ref["peak_mib"]]
    best = min(meets or ours, key=lambda r: r["ms"])
    ratio, memory = best["ms"] / ref["ms"], best["peak_mib"] / ref["peak_mib"] if ref["peak_mib"] else math.inf
    reason = "" if meets else "no row within both limits; the fastest of ours shown"
    return _verdict(key, rule, t, "pass" if meets else "fail", reason, ratio=ratio, limit=CHUNKED_LIMIT,
                    memory_ratio=memory, ours=_brief(best), reference=_brief(ref), **extra)  # fmt: skip


def _roofline_verdict(rows: list[dict], t: int, rule: str, ceilings: dict | None) -> dict:
    key = "compiled_chunked_roofline"
    ours = [r for r in _measured(rows, "ours_chunked", t, ntl_weight=NTL_WEIGHT) if r["key"].endswith("_compiled")]
    if not ours:
        return _verdict(key, rule, t, "not measured", f"the compiled chunked row not measured at T = {t}")
    if not ceilings:
        return _verdict(key, rule, t, "not measured", "no measured matmul ceiling (--ceilings)")
    if _wrong(ours):
        return _verdict(key, rule, t, "fail", f"wrong values: {', '.join(r['key'] for r in _wrong(ours))}")
    r = ours[0]
    roofline_ms = 6 * r["T_run"] * r["H"] * r["V"] / (ceilings["matmul_tflops"] * 1e12) * 1e3
    ratio = r["ms"] / roofline_ms
    return _verdict(key, rule, t, "pass" if ratio <= ROOFLINE_LIMIT else "fail", "", ratio=ratio,
                    limit=ROOFLINE_LIMIT, ours=_brief(r), roofline_ms=roofline_ms)  # fmt: skip


# ---------------------------------------------------------------------------------------- measuring


def make_inputs(tokens: int, hidden: int, vocab: int, device: str, tp_group: object, interpret: bool) -> Inputs:
    g = torch.Generator(device=device).manual_seed(0)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    digits = torch.rand(tokens, device=device, generator=g) < 0.3
    labels = torch.where(digits, labels % 10, labels)
    h = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=g) / hidden**0.5).to(torch.bfloat16).requires_grad_()
    table = ntl_scale.NumberVocab.from_id_to_token({i: str(i) for i in DIGIT_IDS}, vocab_size=vocab)
    return Inputs(h, w, labels, table, tp_group, interpret)


def references(x: Inputs) -> dict[str, float]:
    """CE and CE + 0.3 NTL-WAS of the bf16 logits in fp32, from the definitions (not from ntl_scale):
    NTL-WAS = sum_k softmax(z over the digits)_k |k - t| at positions whose label is a digit, averaged."""
    with torch.no_grad():
        z = (x.hidden @ x.weight.t()).float()
        ce = F.cross_entropy(z, x.labels)
        number = x.labels < len(DIGIT_IDS)
        p = torch.softmax(z[number][:, : len(DIGIT_IDS)], dim=-1)
        values = torch.arange(len(DIGIT_IDS), device=z.device, dtype=z.dtype)
        ntl = (p * (values.unsqueeze(0) - x.labels[number].to(z.dtype).unsqueeze(1)).abs()).sum(-1).mean()
        return {"ce": float(ce), "ntl": float(ntl)}


def measure(step: Step, x: Inputs, warmup: int, iters: int, values: Callable[[Any], Any] | None = None) -> dict:
    """Median time (ms) of ``iters`` steps after ``warmup``, peak memory above the inputs (MiB; CUDA only),
    the last loss and CE, and the warnings the first step raised."""
    caught: list[str] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step()  # the first warm-up step; its warnings say, e.g., that a peer fell back to another path
        caught = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:160]}" for w in seen})
    for _ in range(max(warmup - 1, 0)):
        step()
    x.zero_grad()
    if x.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times, out = [], None
    for _ in range(iters):
        if x.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if x.cuda else None
    out = values(out) if values and out is not None else out  # outside the timed steps
    loss, ce = (None, None) if out is None else (float(out[0]), float(out[1]))
    return {"ms": statistics.median(times), "times_ms": times, "peak_mib": peak, "loss": loss, "ce": ce,
            "warnings": caught}  # fmt: skip


def run_row(row: Row, x: Inputs, args: argparse.Namespace, left: float) -> dict:
    """One row's record fields: ``status`` ``measured``, ``skipped`` or ``failed``, with its numbers or reason."""
    if row.group == "compiled" and not x.cuda:
        return {"status": "skipped", "reason": "compiled rows run on the GPU only (compile time)"}
    if row.env:
        return run_in_child(row, x, args, left)
    built = None
    try:
        built = row.build(x)
        result = measure(built.step, x, args.warmup, args.iters, built.values)
        result.update(status="measured", note="; ".join(n for n in (row.note, built.note) if n))
        if built.chunked is not None:
            result["chunked"] = built.chunked
        fallback = [w for w in result["warnings"] if re.search(FALLBACK, w, re.IGNORECASE)]
        if row.family == "ce_peer" and result.get("chunked", row.chunked) and fallback:  # it ran another path
            result.update(chunked=False, note=f"{result['note']}; not chunked, it warned: {fallback[0]}")
        return result
    except Skip as e:
        return {"status": "skipped", "reason": str(e)}
    except torch.cuda.OutOfMemoryError:
        return {"status": "failed", "reason": "out of GPU memory at this size"}
    except Exception as e:  # a row that breaks must not hide the others
        text = str(e).strip().splitlines()[0][:240] if str(e).strip() else ""
        return {"status": "failed", "reason": f"{e.__class__.__name__}: {text}"}
    finally:
        del built
        x.zero_grad()
        gc.collect()
        if x.cuda:
            torch.cuda.empty_cache()


def run_in_child(row: Row, x: Inputs, args: argparse.Namespace, left: float) -> dict:
    """A row whose package reads its settings at import (``CCE_AUTOTUNE``): a fresh process, same inputs."""
    if not x.cuda:
        return {"status": "skipped", "reason": f"{row.name} needs a CUDA GPU"}
    t, h = x.hidden.shape
    cmd = [sys.executable, os.path.abspath(__file__), "--child", row.key, "--tokens", str(t), "--hidden", str(h),
           "--vocab", str(x.weight.shape[0]), "--warmup", str(args.warmup), "--iters", str(args.iters)]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **row.env}, timeout=max(left, 1))
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"its own process ran past the {left:.0f} s left of the budget"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "failed", "reason": f"its own process failed (rc {done.returncode}): {last[:200]}"}
    return json.loads(lines[-1])


def check_values(record: dict, refs: dict[str, float]) -> None:
    """``check_ok`` / ``check``: the row's CE (and its loss, CE + w NTL) against the references."""
    if record.get("ce") is None:
        record.update(check_ok=None, check="no value (a kernel alone)")
        return
    w = record.get("ntl_weight") or 0.0
    problems = []
    for what, got, want in (("CE", record["ce"], refs["ce"]), ("loss", record["loss"], refs["ce"] + w * refs["ntl"])):
        if not math.isfinite(got) or abs(got - want) > CHECK_RTOL * abs(want):
            problems.append(f"{what} {got:.5g} vs reference {want:.5g}")
    record.update(check_ok=not problems, check="; ".join(problems) or f"CE and loss within {CHECK_RTOL:g}")


def add_rates(record: dict, ceilings: dict | None) -> None:
    """Achieved TB/s of a kernel row (the model's bytes), its fraction of the copy ceiling; for the other
    rows the matmul utilisation (``6 T H V`` FLOPs over the time, against the matmul ceiling)."""
    model, ms = record.get("model"), record.get("ms")
    if ms is None:
        return
    if record["family"] == "ours_kernel" and model:
        record["tbps"] = model["bytes"] / (ms / 1e3) / 1e12
        record["copy_fraction"] = record["tbps"] / ceilings["copy_tbps"] if ceilings else None
    else:
        tflops = 6 * record["T_run"] * record["H"] * record["V"] / (ms / 1e3) / 1e12
        record["matmul_tflops"] = tflops
        record["matmul_fraction"] = tflops / ceilings["matmul_tflops"] if ceilings else None
    if model:
        ref = model["ms_at_ceilings"] or model["ms_h100_datasheet"]
        record["measured_over_model"] = ms / ref


def init_tp_group(device: str) -> object:
    """A one-rank process group for Megatron's fused CE (TP = 1): NCCL on a GPU, gloo on the CPU."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(
            backend, rank=0, world_size=1, device_id=torch.device("cuda", 0) if device == "cuda" else None
        )
    return dist.new_group([0])


# ---------------------------------------------------------------------------------------- writing


def write_atomic(path: str, text: str) -> None:
    """Writes ``text`` to a temporary file beside ``path`` and renames it over ``path``: a reader (or a run
    killed mid-write) sees the old file or the new one, never a part."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path) as f:
        f.write(text)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: a non-finite float (a broken row's loss) is written as its text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def save(report: dict, args: argparse.Namespace) -> None:
    # serialised whole before anything is written
    text = json.dumps(_finite(report), indent=1, allow_nan=False, default=str)
    if args.json:
        write_atomic(args.json, text + "\n")
    if args.markdown:
        write_atomic(args.markdown, markdown(report))


def _f(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(report: dict) -> str:
    """The report as Markdown (rendered from the JSON record alone): header, rows, verdicts."""
    c, ceil = report["config"], report["ceilings"]
    ceilings = (
        f"measured ceilings ({report['ceilings_source']}): copy {ceil['copy_tbps']:.2f} TB/s, "
        f"matmul {ceil['matmul_tflops']:.0f} TFLOP/s ({ceil['device']})"
        if ceil
        else f"no ceilings: {report['ceilings_source']}; the achieved-fraction columns are empty"
    )
    lines = [
        f"# GPU benchmark ({report['mode']}): CE + NTL against the CE peers",
        "",
        f"- {report['device']}; {report['versions_line']}",
        f"- {report['date']}; commit {report['commit']}; command: `{report['command']}`",
        f"- T x V x H = {'/'.join(str(t) for t in c['tokens'])} x {c['vocab']} x {c['hidden']} bf16"
        + (
            f" (smoke run at {'/'.join(str(t) for t in c['tokens_run'])} x {SMOKE_VOCAB} x {SMOKE_HIDDEN})"
            if report["mode"] == "smoke"
            else ""
        )
        + f", K = 10 digit tokens, NTL-WAS weight {NTL_WEIGHT}, "
        f"forward + backward; median of {c['iters']} after {c['warmup']} warm-up; peak above the inputs",
        f"- {ceilings}",
        f"- time budget {c['time_budget_s']:.0f} s; elapsed {report['elapsed_s']:.0f} s; {report['status']}",
        "",
        "| # | row | T | time (ms) | x best CE-only | peak (MiB) | model (ms) | measured / model | achieved | CE | "
        "loss | check | status |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---|",
    ]
    best: dict[int, float] = {}  # the fastest CE-only row per T (GPU runs only: CPU timings are no ratios)
    for r in report["rows"] if report["mode"] == "gpu" else []:
        exact = r["family"] in ("megatron", "ce_peer") and not r.get("approximate")
        if exact and r.get("ms") and r.get("check_ok") is not False:
            best[r["T"]] = min(best.get(r["T"], math.inf), r["ms"])
    for i, r in enumerate(report["rows"], 1):
        m = r.get("model") or {}
        model_ms = m.get("ms_at_ceilings") or m.get("ms_h100_datasheet")
        model = f"{_f(model_ms, '.2f')}{' (floor)' if m.get('floor') else ''}" if m else ""
        achieved = ""
        if r.get("tbps") is not None:
            copy = f" ({r['copy_fraction']:.0%} of copy)" if r.get("copy_fraction") else ""
            achieved = f"{r['tbps']:.2f} TB/s{copy}"
        elif r.get("matmul_fraction") is not None:
            achieved = f"{r['matmul_fraction']:.0%} of matmul"
        x_best = r["ms"] / best[r["T"]] if r.get("ms") and r["T"] in best else None
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        if r.get("note"):
            status += f" ({r['note']})"
        lines.append(
            f"| {i} | {r['name']} | {r['T']} | {_f(r.get('ms'), '.2f')} | {_f(x_best, '.3f')} | "
            f"{_f(r.get('peak_mib'), '.0f')} | {model} | {_f(r.get('measured_over_model'), '.2f')} | {achieved} | "
            f"{_f(r.get('ce'), '.4f')} | {_f(r.get('loss'), '.4f')} | {r.get('check') or ''} | {status} |"
        )
    lines += ["", "Model: `benchmarks/cost_model.py` at the measured ceilings where given, else at the H100 datasheet "
              "(3.35 TB/s, 989 TFLOP/s); (floor): a lower bound for that code, not a model of it.", "",
              "## Verdicts", "", "| verdict | T | result | numbers | rule |", "|---|---:|---|---|---|"]  # fmt: skip
    for v in report["verdicts"]:
        numbers = v.get("reason") or ""
        if v.get("ratio") is not None:
            numbers = f"{v['ratio']:.3f}x (limit {v['limit']}x): {v['ours']['row']} {v['ours']['ms']:.2f} ms"
            if v.get("reference"):
                numbers += f" vs {v['reference']['row']} {v['reference']['ms']:.2f} ms"
            if v.get("memory_ratio") is not None:
                numbers += f", peak {v['memory_ratio']:.2f}x"
            if v.get("roofline_ms") is not None:
                numbers += f" vs roofline {v['roofline_ms']:.2f} ms"
            numbers += f"; {v['reason']}" if v.get("reason") else ""
        if v.get("approximate_peers"):
            beside = ", ".join(f"{b['row']} {b['ms']:.2f} ms" for b in v["approximate_peers"])
            numbers += f"; beside, approximate gradients: {beside}"
        lines.append(f"| {v['key']} | {v['T']} | **{v['result']}** | {numbers} | {v['rule']} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- arguments


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds for all rows (default 420)")
    p.add_argument("--json", help="the report as JSON, rewritten after every row")
    p.add_argument("--markdown", help="the report as Markdown, rewritten after every row")
    p.add_argument("--ceilings", help='JSON {"copy_tbps": float, "matmul_tflops": float, "device": str} measured here')
    p.add_argument("--dry-run", action="store_true", help="no CUDA needed: the plan, the model, nothing run")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (Triton interpreted): rows run")
    p.add_argument("--tokens", type=_ints, default=[8192, 16384], help="T per configuration (default 8192,16384)")
    p.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help=f"V (default {DEFAULT_VOCAB})")
    p.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN, help=f"H (default {DEFAULT_HIDDEN})")
    p.add_argument("--rows", default="all", help="comma-separated row keys (--list-rows), or 'all'")
    p.add_argument("--list-rows", action="store_true", help="print the row keys in run order and exit")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per row (default 3, at least 1)")
    p.add_argument("--iters", type=int, default=10, help="timed steps per row (default 10, at least 5)")
    p.add_argument("--commit", help="the commit measured (default: git rev-parse HEAD, where .git exists)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rows != "all":
        unknown = sorted(set(args.rows.split(",")) - set(ROW_BY_KEY))
        if unknown:
            p.error(f"unknown rows {unknown}; expected some of {list(ROW_BY_KEY)} (--list-rows)")
    if args.time_budget < 0 or not math.isfinite(args.time_budget):
        p.error(f"--time-budget must be a non-negative number of seconds, got {args.time_budget}")
    if args.dry_run and args.smoke:
        p.error("--dry-run and --smoke exclude each other: the dry run runs nothing, the smoke run runs tiny rows")
    if not args.smoke and (args.iters < 5 or args.warmup < 1):
        p.error(f"a median of at least 5 after warm-up: --iters >= 5 and --warmup >= 1 "
                f"(got {args.iters}, {args.warmup}); only --smoke takes fewer")  # fmt: skip
    if args.vocab <= len(DIGIT_IDS) or args.hidden <= 0:
        p.error(f"--vocab must exceed the 10 digit tokens and --hidden be positive, got {args.vocab}, {args.hidden}")
    if not args.list_rows and not args.child and not (args.json or args.markdown):
        p.error("nothing to write: give --json PATH and/or --markdown PATH")
    return args


def read_ceilings(path: str | None) -> tuple[dict | None, str]:
    """The measured ceilings and where they came from, or None and why not (the run goes on without)."""
    if not path:
        return None, "no --ceilings given"
    if not os.path.exists(path):
        return None, f"ceilings file {path} absent"
    try:
        with open(path) as f:
            data = json.load(f)
        out = {"copy_tbps": float(data["copy_tbps"]), "matmul_tflops": float(data["matmul_tflops"]),
               "device": str(data["device"])}  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as e:
        expected = '{"copy_tbps": float, "matmul_tflops": float, "device": str}'
        return None, f"ceilings file {path} unreadable ({e.__class__.__name__}: {e}); expected {expected}"
    if not (out["copy_tbps"] > 0 and out["matmul_tflops"] > 0):
        return None, f"ceilings file {path} has non-positive ceilings {out}"
    return out, path


def _versions() -> str:
    names = ["triton", "liger-kernel", "cut-cross-entropy", "megatron-core", "ntloss", "quack-kernels"]
    found = []
    for n in names:
        try:
            found.append(f"{n} {importlib.metadata.version(n)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{n} -")
    versions = f"Python {platform.python_version()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
    return versions + ", ".join(found)


def _commit(args: argparse.Namespace) -> str:
    """``--commit``, else ``git rev-parse HEAD``, else the record ``scripts/gpu_prepare.sh`` leaves in
    ``.gpu_wheels/COMMIT`` before the copy (``.git`` does not travel to the GPU machine)."""
    if args.commit:
        return args.commit
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        with open(os.path.join(ROOT, ".gpu_wheels", "COMMIT")) as f:
            record = json.load(f)
        return f"{record['commit']}{' (dirty)' if record.get('dirty') else ''} (.gpu_wheels/COMMIT)"
    return "unknown (no .git, no .gpu_wheels/COMMIT)"


def smoke_tokens(tokens: int) -> int:
    return max(32, tokens // SMOKE_DIVISOR)


def _record(p: Planned, args: argparse.Namespace, ceilings: dict | None) -> dict:
    """A planned row's record (``--smoke`` runs T / 128 x 512 x 32; the model is of the GPU shape)."""
    r = p.row
    if args.smoke:
        t_run, h, v = smoke_tokens(p.tokens), SMOKE_HIDDEN, SMOKE_VOCAB
    else:
        t_run, h, v = p.tokens, args.hidden, args.vocab
    return {
        "key": r.key, "name": r.name, "group": r.group, "family": r.family, "T": p.tokens, "T_run": t_run,
        "H": h, "V": v, "ntl_weight": r.ntl_weight, "chunked": r.chunked, "approximate": r.approximate,
        "model": model_prediction(r, cost_model.Shape(p.tokens, args.vocab, args.hidden, len(DIGIT_IDS)), ceilings),
        "note": r.note, "status": "not reached", "reason": "",
    }  # fmt: skip


def _print_row(rec: dict) -> None:
    if rec["status"] == "measured":
        peak = "" if rec.get("peak_mib") is None else f", peak {rec['peak_mib']:.0f} MiB"
        print(f"bench_gpu: {rec['key']} T={rec['T']}: {rec['ms']:.2f} ms{peak}; {rec.get('check')}", flush=True)
    else:
        print(f"bench_gpu: {rec['key']} T={rec['T']}: {rec['status']}: {rec['reason']}", flush=True)


def child_main(args: argparse.Namespace) -> int:
    row = ROW_BY_KEY[args.child]
    x = make_inputs(args.tokens[0], args.hidden, args.vocab, "cuda", None, False)
    try:
        built = row.build(x)
        result = {"status": "measured", **measure(built.step, x, args.warmup, args.iters, built.values),
                  "note": built.note}  # fmt: skip
    except Skip as e:
        result = {"status": "skipped", "reason": str(e)}
    print(json.dumps(result))
    return 0


def plan_budget(rows: list[dict], plan: list[Planned], estimate: Estimator, budget: float) -> int:
    """The dry run's schedule: each row marked with when it would start or why it would not (the run's own
    rule: a row starts only if its estimate fits in what is left; a missing package skips it at once).
    Returns how many rows would run."""
    spent, current, planned = 0.0, None, 0
    for rec, p in zip(rows, plan):
        missing = missing_package(p.row)
        if missing:
            rec.update(status="not run (dry run)", estimate_s=0.0, planned_start_s=None,
                       reason=f"would be skipped: {missing} here")  # fmt: skip
            continue
        est = estimate(p) + (INPUTS_S if p.tokens != current else 0.0)
        reason = budget_reason(est, budget - spent, budget)
        start = None if reason else spent
        if reason is None:
            current, spent, planned = p.tokens, spent + est, planned + 1
            estimate.started(p)
        why = f"would be skipped: {reason}" if reason else f"would start at about {start:.0f} s"
        rec.update(status="not run (dry run)", estimate_s=est, planned_start_s=start, reason=why)
    return planned


def run_plan(report: dict, plan: list[Planned], estimate: Estimator, args: argparse.Namespace) -> None:
    """Runs the rows in order within the budget, rewriting the report after each."""
    started = time.monotonic() - report["elapsed_s"]
    smoke = report["mode"] == "smoke"
    dev = "cpu" if smoke else "cuda"
    ceilings = None if smoke else report["ceilings"]
    if smoke:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    tp_group = None
    if any(p.row.family == "megatron" and missing_package(p.row) is None for p in plan):
        try:
            tp_group = init_tp_group(dev)
        except Exception as e:
            print(f"bench_gpu: no process group for Megatron's CE ({e.__class__.__name__}: {e})")
    x, refs, current = None, {}, None
    for rec, p in zip(report["rows"], plan):
        left = args.time_budget - (time.monotonic() - started)
        est = estimate(p)
        missing = missing_package(p.row)
        reason = budget_reason(est + (INPUTS_S if p.tokens != current else 0.0), left, args.time_budget)
        if missing:
            rec.update(status="skipped", reason=missing)
        elif reason:
            rec.update(status="not run (time budget)", reason=reason, estimate_s=est)
        else:
            if p.tokens != current:
                x = refs = None
                gc.collect()
                if dev == "cuda":
                    torch.cuda.empty_cache()
                x = make_inputs(rec["T_run"], rec["H"], rec["V"], dev, tp_group, smoke)
                refs, current = references(x), p.tokens
            assert x is not None and refs is not None
            estimate.started(p)
            t0 = time.monotonic()
            rec.update(run_row(p.row, x, args, left), estimate_s=est)
            rec["wall_s"] = time.monotonic() - t0
            if rec["status"] == "measured":
                check_values(rec, refs)
                if not smoke:  # the model and the ceilings are of the GPU shape, not of the smoke run's
                    add_rates(rec, ceilings)
        report["elapsed_s"] = time.monotonic() - started
        save(report, args)
        _print_row(rec)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_rows:
        for p in plan_rows([8192]):
            print(f"{p.row.key:32s} {p.row.group:9s} {'CE + NTL' if p.row.ntl_weight is not None else 'CE':9s} "
                  f"{p.row.name}")  # fmt: skip
        return 0
    if args.child:
        return child_main(args)
    started = time.monotonic()
    if args.smoke:
        mode, why = "smoke", "CPU smoke run: tiny sizes, timings are not measurements"
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    elif args.dry_run or not torch.cuda.is_available():
        mode = "dry run"
        why = "dry run: nothing measured" + ("" if args.dry_run else " (no CUDA GPU visible to torch)")
    else:
        mode, why = "gpu", ""
    ceilings, ceilings_source = read_ceilings(args.ceilings)
    plan = plan_rows(args.tokens, None if args.rows == "all" else args.rows.split(","))
    report: dict[str, Any] = {
        "schema": SCHEMA, "mode": mode,
        "device": torch.cuda.get_device_name(0) if mode == "gpu" else f"CPU ({platform.machine()}): {why}",
        "versions_line": _versions(), "date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        "commit": _commit(args),
        "command": "python benchmarks/bench_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "ceilings": ceilings, "ceilings_source": ceilings_source,
        "config": {"tokens": args.tokens, "tokens_run": [smoke_tokens(t) if args.smoke else t for t in args.tokens],
                   "vocab": args.vocab, "hidden": args.hidden, "numbers": len(DIGIT_IDS), "ntl_weight": NTL_WEIGHT,
                   "warmup": args.warmup, "iters": args.iters, "time_budget_s": args.time_budget},
        "status": "running", "elapsed_s": 0.0,
        "rows": [_record(p, args, ceilings) for p in plan], "verdicts": [],
    }  # fmt: skip
    if mode == "dry run":
        planned = plan_budget(report["rows"], plan, Estimator(args), args.time_budget)
        report["verdicts"] = verdicts(report["rows"], ceilings, why)
        report.update(status=f"dry run: {planned} of {len(plan)} rows would run within the budget (estimates)",
                      elapsed_s=time.monotonic() - started)  # fmt: skip
        save(report, args)
        print(f"bench_gpu: {report['status']}; {why}; wrote {args.json or ''} {args.markdown or ''}".rstrip())
        return 0
    report["elapsed_s"] = time.monotonic() - started
    save(report, args)
    run_plan(report, plan, Estimator(args), args)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # Megatron's one-rank group, set up by run_plan
    report["verdicts"] = verdicts(report["rows"], ceilings, why or None)
    report.update(status="finished", elapsed_s=time.monotonic() - started)
    save(report, args)
    for v in report["verdicts"]:
        ratio = f" {v['ratio']:.3f}x (limit {v['limit']}x)" if v.get("ratio") is not None else ""
        print(f"bench_gpu: verdict {v['key']} T={v['T']}: {v['result']}{ratio} {v.get('reason') or ''}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
