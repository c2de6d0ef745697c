"""The Triton CE + NTL kernels compiled ahead of time for A100, H100 and B200, with no GPU present.

    python benchmarks/triton_aot.py --markdown          # the table of docs/kernels.md
    python benchmarks/triton_aot.py --json out.json     # every compile as a record
    python benchmarks/triton_aot.py --pairwise --json out.json   # CI's subset (the test reads it)

Each kernel of ``ntl_scale/ops/triton_ce_ntl.py`` (and of ``lab/on_chip/triton_linear_ce_ntl.py``) is
compiled for ``sm_80``, ``sm_90`` (Triton emits ``sm_90a``) and ``sm_100`` (``sm_100a``) through
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``: Python -> TTIR -> TTGIR -> LLVM IR
-> PTX, then the ``ptxas`` bundled in the triton wheel (CUDA 12.9's for sm_80, ``ptxas-blackwell``, CUDA 13.x,
for sm_90 and
later) -> cubin. Nothing is launched and nothing reads a device.

What is compiled is what the launchers would compile on a GPU: the arguments come from the
launchers' own argument builders (``_stats_arguments``, ``_grad_arguments``) on small CPU tensors,
and Triton's own binder (``create_function_from_signature`` + ``JITFunction._pack_args``, the code
``kernel[grid](...)`` runs) turns them into the signature, the constexprs (strides of 1), the
divisibility attributes and the options (``num_warps``). The block configurations come from the
launcher's block functions (``_block_v``, ``_block_k``, ``_warps``) evaluated over every power-of-two
width, so a new configuration there is compiled here without an edit. Compiled per kernel and
dtype (fp32, bf16, fp16; fp64 at the largest blocks only, a reference dtype): every ``BLOCK_V`` (with
its ``num_warps``) at the largest ``BLOCK_K``, every ``BLOCK_K`` at the largest ``BLOCK_V``, the
gradient kernel also without number columns (``HAS_NUMBERS=False``) at every ``BLOCK_V``, and the
largest blocks once more with a vocabulary that is not a multiple of 16 (50257: no divisibility
hint, so no vectorised row loads). The two loops of each kernel run one after the other, so these
pairs bound the register use of every other pair. ``--pairwise`` (CI) compiles each of these blocks in
one dtype only (the dtypes in turn), the largest blocks in every dtype, and the fused linear kernels'
half-precision tiles (the same for bf16 and fp16) aligned in bf16 and unaligned in fp16.

Per compile: registers, spill stores and loads and the stack frame from ``ptxas -v``; registers and
local memory again from ``cuobjdump --dump-resource-usage`` on the cubin (both bundled); dynamic
shared memory from Triton's metadata; and the occupancy (resident warps per SM) these imply under
:data:`ARCHS`' limits. :func:`problems` lists what fails CI: a compile error, a spill, a stack
frame, a missing PTX target or cubin, registers or shared memory over the architecture's limit, a
configuration no resident block fits. The test (``tests/unit/test_triton_aot.py``) and
``--markdown`` call the same :func:`compile_all`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lab.on_chip import triton_linear_ce_ntl as lk
from ntl_scale.ops import triton_ce_ntl as tk


@dataclass(frozen=True)
class Arch:
    """Per-SM limits of one architecture (what :func:`occupancy` needs).

    Source: NVIDIA CUDA C++ Programming Guide (CUDA 12.9 / 13), "Compute Capabilities", table
    "Technical Specifications per Compute Capability" (registers, warps, blocks and shared memory
    per SM, shared memory per block, registers per thread), and the CUDA Occupancy Calculator's
    allocation rules (registers allocated per warp in units of 256; 1 KiB of shared memory reserved
    per block since compute capability 8.0).
    """

    name: str  #: the GPU our users have with this compute capability
    capability: int  #: compute capability x 10 (``GPUTarget``'s arch)
    regs_per_sm: int
    max_regs_per_thread: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    smem_per_sm: int  #: bytes, the most an SM can hand out
    max_smem_per_block: int  #: bytes, dynamic shared memory one block may request (opt-in)
    reserved_smem_per_block: int = 1024  #: bytes the system keeps per resident block
    reg_alloc_unit: int = 256  #: registers are allocated per warp in multiples of this


#: One table of the limits the occupancy is computed from (source: :class:`Arch`'s docstring).
ARCHS: tuple[Arch, ...] = (
    Arch("A100", 80, 65536, 255, 64, 32, 164 * 1024, 163 * 1024),
    Arch("H100", 90, 65536, 255, 64, 32, 228 * 1024, 227 * 1024),
    Arch("B200", 100, 65536, 255, 64, 32, 228 * 1024, 227 * 1024),
)

#: Logits dtypes the launchers take; fp64 (a reference dtype, fp64 arithmetic) at the largest blocks only.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
UNALIGNED_WIDTH = 50257  # GPT-2's vocabulary: not a multiple of 16, so no divisibility hint on the rows


def block_choices() -> tuple[list[int], list[int]]:
    """Every ``BLOCK_V`` and ``BLOCK_K`` the launchers can pick, from their own block functions.

    Both are powers of two of ``next_power_of_2`` of the width (columns, number columns) clipped to a
    range, so evaluating them at every power of two up to 2**24 (and 0) yields every value they return.
    """
    sizes = [0] + [1 << i for i in range(25)]
    return sorted({tk._block_v(n) for n in sizes}), sorted({tk._block_k(n) for n in sizes})


def softmax_blocks() -> dict[str, list[int]]:
    """Per logits dtype, every ``BLOCK_V`` the statistics-and-softmax launch's persistent grid can pick.

    :func:`~ntl_scale.ops.triton_ce_ntl.softmax_launch` over every power-of-two width and L2 size, in
    place (a row's bytes: its logits); the blocks of its grids with fewer programs than rows.
    """
    out: dict[str, list[int]] = {}
    rows = 1 << 20
    for dtype in DTYPES:
        elem = torch.empty((), dtype=dtype).element_size()
        launches = [
            tk.softmax_launch(rows, 1 << w, elem << w, elem, 132, 1 << l2) for w in range(25) for l2 in range(40)
        ]
        out[str(dtype).removeprefix("torch.")] = sorted({block for programs, block in launches if programs < rows})
    return out


@dataclass(frozen=True)
class Config:
    """One launch configuration: the kernel, the logits dtype, the blocks, the shard's shape."""

    #: "stats" or "grad" (logits kernels); "stats_softmax" (the statistics kernel writing the softmax too: the
    #: chunked op on one device); "linear_fwd" or "linear_bwd" (the fused linear op's)
    kernel: str
    dtype: str  #: "float32", "bfloat16", "float16", "float64"
    block_v: int
    block_k: int
    width: int  #: local vocabulary columns (picks ``BLOCK_V`` through the launcher)
    numbers: int  #: number columns K (picks ``BLOCK_K``; 0: none)
    needs: str = "hw"  #: linear_bwd: the gradients built, "hw", "h" or "w"

    @property
    def warps(self) -> int:
        if self.kernel.startswith("linear"):
            kind = "forward" if self.kernel == "linear_fwd" else "backward"
            return lk.launch_blocks(kind, getattr(torch, self.dtype))["num_warps"]
        return tk._warps(self.block_v)


#: The hidden size of the fused linear kernels' compiles: a multiple of 16 like every model's (the compile
#: sees only its divisibility), small so that the ``[V, H]`` CPU weight the launcher reads stays small.
LINEAR_HIDDEN = 64


def configs(pairwise: bool = False) -> list[Config]:
    """The launch configurations to compile (see the module docstring for the choice).

    ``pairwise`` (``--pairwise``, what CI compiles): every block of each logits kernel in one dtype (the
    dtypes in turn), the largest blocks in every dtype; the fused linear kernels' tiles per dtype, each
    half-precision dtype at one vocabulary alignment (bf16 and fp16 share their tiles). Every block and
    tile the launchers pick is still compiled for every architecture, every dtype at the largest blocks.
    """
    block_vs, block_ks = block_choices()
    top_v, top_k = block_vs[-1], block_ks[-1]
    pairs = [(v, top_k) for v in block_vs] + [(top_v, k) for k in block_ks if k != top_k]
    names = [str(dtype).removeprefix("torch.") for dtype in DTYPES]

    def turn(i: int, name: str, largest: bool) -> bool:  # whether dtype ``name`` compiles the i-th choice
        return not pairwise or largest or names[i % len(names)] == name

    out: list[Config] = []
    for kernel in ("stats", "grad"):
        for name in names:
            out += [
                Config(kernel, name, v, k, v, k)
                for i, (v, k) in enumerate(pairs)
                if turn(i, name, (v, k) == (top_v, top_k))
            ]
            if kernel == "grad":
                k0 = tk._block_k(0)
                out += [Config(kernel, name, v, k0, v, 0) for i, v in enumerate(block_vs) if turn(i, name, v == top_v)]
            out.append(Config(kernel, name, top_v, top_k, UNALIGNED_WIDTH, top_k))
        out.append(Config(kernel, "float64", top_v, top_k, top_v, top_k))
    # the statistics kernel that also writes the softmax (one device): the chunked op's half-precision and
    # fp32 chunks, at the largest blocks (its second loop reads and writes like the gradient kernel's), aligned
    # and unaligned, and with the number loop's smallest block (K = 10 digits)
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        out += [Config("stats_softmax", name, top_v, top_k, width, top_k) for width in (top_v, UNALIGNED_WIDTH)]
        out.append(Config("stats_softmax", name, top_v, tk._block_k(10), top_v, 10))
    # and its persistent grid on a GPU (tk.softmax_launch: larger blocks), aligned and unaligned
    for name, blocks in softmax_blocks().items():
        out += [Config("stats_softmax", name, v, top_k, w, top_k) for v in blocks for w in (v, UNALIGNED_WIDTH)]
    # the fused linear CE + NTL (logits on chip): its launch tiles, aligned and unaligned vocabulary shards,
    # the backward with both gradients and, in bf16, with one (a frozen weight, a frozen input); no fp64 (refused)
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        forward, backward = lk.launch_blocks("forward", dtype), lk.launch_blocks("backward", dtype)
        fwd_v, fwd_k, bwd_v = forward["BLOCK_V"], forward["BLOCK_K"], backward["BLOCK_V"]
        widths = (4096, UNALIGNED_WIDTH)
        if pairwise and dtype != torch.float32:  # bf16 aligned, fp16 not: the half-precision tiles both ways
            widths = (4096,) if dtype == torch.bfloat16 else (UNALIGNED_WIDTH,)
        for width in widths:
            out.append(Config("linear_fwd", name, fwd_v, fwd_k, width, 10))
            out.append(Config("linear_bwd", name, bwd_v, 0, width, 0))  # number columns: the host's
        if dtype == torch.bfloat16:  # one gradient only (a frozen weight or input): the training dtype
            out += [Config("linear_bwd", name, bwd_v, 0, 4096, 0, needs) for needs in ("h", "w")]
    return out


def _linear_launch(config: Config) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The fused linear kernels' arguments from their launchers' builders on 2-token CPU tensors."""
    forward_kernel, backward_kernel = lk._kernels()
    dtype = getattr(torch, config.dtype)
    hidden = torch.zeros(2, LINEAR_HIDDEN, dtype=dtype)
    weight = torch.zeros(config.width, LINEAR_HIDDEN, dtype=dtype)
    target = torch.zeros(2, dtype=torch.int64)
    per_token = torch.ones(2, dtype=torch.float32)
    if config.kernel == "linear_fwd":
        cols = torch.arange(config.numbers, dtype=torch.int64)
        stats, number_logits = torch.empty(2, 6), torch.empty(2, config.numbers)
        a_table = torch.zeros(2, config.numbers)
        args, meta = lk._forward_arguments(hidden, weight, target, cols, a_table, stats, number_logits)
        return forward_kernel, args, meta
    grad_h = torch.zeros(2, LINEAR_HIDDEN) if "h" in config.needs else None
    grad_w = torch.zeros(config.width, LINEAR_HIDDEN) if "w" in config.needs else None
    args, meta = lk._backward_arguments(hidden, weight, per_token, per_token, per_token, target, grad_h, grad_w)
    return backward_kernel, args, meta


def launch_arguments(config: Config) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The kernel and what its launcher passes it, built by the launcher's own code on 2-token CPU tensors."""
    if config.kernel.startswith("linear"):
        kernel, args, meta = _linear_launch(config)
        if meta["BLOCK_V"] != config.block_v:
            raise RuntimeError(f"the launcher picked BLOCK_V={meta['BLOCK_V']} for {config}")
        return kernel, args, meta
    stats_kernel, grad_kernel = tk._kernels()
    dtype = getattr(torch, config.dtype)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    tokens = 2
    logits = torch.zeros(tokens, config.width, dtype=dtype)
    target = torch.zeros(tokens, dtype=torch.int64)
    cols = torch.arange(config.numbers, dtype=torch.int64)
    if config.kernel in ("stats", "stats_softmax"):
        out = torch.empty(tokens, 6, dtype=cdt)
        a_table = torch.zeros(tokens, config.numbers, dtype=cdt)
        into = logits if config.kernel == "stats_softmax" else None  # in place, as the chunked op writes it
        # the persistent grid's larger blocks, passed as shard_stats passes them on a GPU (softmax_launch)
        block = config.block_v if into is not None and config.block_v > tk._block_v(config.width) else None
        args, meta = tk._stats_arguments(logits, target, cols, a_table, out, block, into, block is not None)
        kernel = stats_kernel
    else:
        per_token = torch.ones(tokens, dtype=cdt)
        number_grad = torch.zeros(tokens, config.numbers, dtype=cdt) if config.numbers else None
        args, meta = tk._grad_arguments(
            logits, logits, per_token, per_token, per_token, per_token, target, cols, number_grad, None
        )
        kernel = grad_kernel
    if (meta["BLOCK_V"], meta["BLOCK_K"]) != (config.block_v, config.block_k):
        raise RuntimeError(f"the launcher picked {meta['BLOCK_V']}/{meta['BLOCK_K']} for {config}")
    return kernel, args, meta


def _bind(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any], backend: Any) -> tuple[Any, Any, Any, Any]:
    """Signature, constexprs, attributes and options exactly as ``kernel[grid](*args, **meta)`` binds them."""
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound, specialization, options)
    return signature, constexprs, attrs, options


_PTXAS = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", re.S
)
_CUOBJDUMP = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _cuobjdump(cubin: bytes) -> dict[str, int]:
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = _CUOBJDUMP.search(text)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return dict(zip(("regs", "stack", "static_smem", "local"), map(int, found.groups()), strict=True))


def compile_one(config: Config, arch: Arch, maxnreg: int | None = None) -> dict[str, Any]:
    """Compiles one configuration for one architecture; returns its record (``error`` set on failure).

    ``maxnreg`` caps the registers per thread (Triton's option; ``--plant-spill`` uses it to show that a
    spilling kernel is caught); the launchers never set it.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    record: dict[str, Any] = {**dataclasses.asdict(config), "warps": config.warps, "arch": f"sm_{arch.capability}"}
    record["gpu"] = arch.name
    start = time.perf_counter()
    try:
        target = GPUTarget("cuda", arch.capability, 32)
        kernel, args, meta = launch_arguments(config)
        if maxnreg is not None:
            meta = {**meta, "maxnreg": maxnreg}
        signature, constexprs, attrs, options = _bind(kernel, args, meta, make_backend(target))
        log = io.StringIO()
        with contextlib.redirect_stdout(log):  # ptxas -v's report, printed by Triton with dump_ptxas_log
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target, options.__dict__)
        found = _PTXAS.search(log.getvalue())
        if found is None:
            raise RuntimeError(f"no ptxas -v report in:\n{log.getvalue()}")
        stack, spill_stores, spill_loads, regs = map(int, found.groups())
        ptx_target = re.search(r"^\.target (\S+)", compiled.asm["ptx"], re.M)
        record.update(
            regs=regs,
            spill_stores=spill_stores,
            spill_loads=spill_loads,
            stack=stack,
            smem=int(compiled.metadata.shared),
            ptx_target=ptx_target.group(1) if ptx_target else None,
            cubin_bytes=len(compiled.asm["cubin"]),
            cuobjdump=_cuobjdump(compiled.asm["cubin"]),
            num_warps=int(compiled.metadata.num_warps),
        )
        record.update(occupancy(arch, regs, record["smem"], config.warps))
    except Exception as error:  # a kernel that no longer compiles is a finding, recorded and failed by problems()
        record["error"] = f"{type(error).__name__}: {error}"[:2000]
    record["compile_s"] = round(time.perf_counter() - start, 3)
    return record


def occupancy(arch: Arch, regs: int, smem: int, warps: int) -> dict[str, Any]:
    """Resident blocks and warps per SM of a kernel using ``regs`` registers per thread and ``smem`` bytes.

    ``blocks = min(max_blocks, max_warps // warps, (regs_per_sm // regs_per_warp) // warps,
    smem_per_sm // (smem + reserved))`` with ``regs_per_warp = ceil(32 regs / unit) * unit`` (the
    Occupancy Calculator's rule); ``warps_per_sm = blocks * warps``; the limiter is the smallest term.
    """
    regs_per_warp = math.ceil(32 * max(regs, 1) / arch.reg_alloc_unit) * arch.reg_alloc_unit
    limits = {
        "blocks": arch.max_blocks_per_sm,
        "warps": arch.max_warps_per_sm // warps,
        "registers": (arch.regs_per_sm // regs_per_warp) // warps,
        "shared memory": arch.smem_per_sm // (smem + arch.reserved_smem_per_block),
    }
    blocks = min(limits.values())
    limiter = min(limits, key=lambda name: limits[name])
    return {
        "blocks_per_sm": blocks,
        "warps_per_sm": blocks * warps,
        "occupancy": blocks * warps / arch.max_warps_per_sm,
        "limiter": limiter,
    }


@contextlib.contextmanager
def _fresh_compiler() -> Iterator[None]:
    """A cache directory of its own (every kernel compiled from source) and ptxas's -v report printed."""
    from triton import knobs

    with tempfile.TemporaryDirectory(prefix="ntl_triton_aot_") as cache, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
        saved = (knobs.cache.dir, knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile)
        knobs.cache.dir, knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = cache, True, True
        try:
            yield
        finally:
            knobs.cache.dir, knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved


def compile_all(archs: tuple[Arch, ...] = ARCHS, pairwise: bool = False) -> list[dict[str, Any]]:
    """Every configuration of :func:`configs` (``pairwise``: CI's) compiled for every architecture, in this
    process, cache-free.

    Raises:
        RuntimeError: Triton runs in its interpreter here (``TRITON_INTERPRET=1`` when it was imported):
            run this in a process of its own without it.
    """
    if tk.interpreting():
        raise RuntimeError("Triton was imported with TRITON_INTERPRET=1: compile in a process without it")
    with _fresh_compiler():
        return [compile_one(config, arch) for arch in archs for config in configs(pairwise)]


def problems(records: list[dict[str, Any]]) -> list[str]:
    """What fails CI: compile errors, spills, a stack frame, a wrong PTX target, over-limit resources."""
    limits = {f"sm_{a.capability}": a for a in ARCHS}
    found = []
    for r in records:
        where = f"{r['kernel']} {r['dtype']} BLOCK_V={r['block_v']} BLOCK_K={r['block_k']}"
        where += f" width={r['width']} K={r['numbers']} {r['arch']}"
        if "error" in r:
            found.append(f"{where}: does not compile: {r['error']}")
            continue
        arch = limits[r["arch"]]
        if r["spill_stores"] or r["spill_loads"] or r["stack"] or r["cuobjdump"]["local"]:
            found.append(
                f"{where}: spills ({r['spill_stores']} B stores, {r['spill_loads']} B loads, {r['stack']} B stack)"
            )
        if r["cuobjdump"]["regs"] != r["regs"]:
            found.append(f"{where}: ptxas says {r['regs']} registers, cuobjdump {r['cuobjdump']['regs']}")
        if not (r["ptx_target"] or "").startswith(r["arch"]) or not r["cubin_bytes"]:
            found.append(f"{where}: PTX target {r['ptx_target']}, cubin {r['cubin_bytes']} B")
        if r["regs"] > arch.max_regs_per_thread or r["smem"] > arch.max_smem_per_block or not r["blocks_per_sm"]:
            found.append(f"{where}: {r['regs']} registers, {r['smem']} B shared: no block fits an SM")
    return found


def _label(record: dict[str, Any]) -> str:
    """The kernel's name in the table; for the fused linear kernels also their token and hidden tiles and the
    gradients a backward builds (``dH dW``, ``dH``, ``dW``)."""
    kernel = record["kernel"]
    if not kernel.startswith("linear"):
        return kernel
    blocks = lk.launch_blocks("forward" if kernel == "linear_fwd" else "backward", getattr(torch, record["dtype"]))
    label = f"{kernel} T{blocks['BLOCK_T']} H{blocks['BLOCK_H']}"
    if kernel == "linear_bwd":
        label += " " + " ".join(f"d{part.upper()}" for part in record.get("needs", "hw"))
    return label


def markdown(records: list[dict[str, Any]]) -> str:
    """One row per kernel and block configuration; per architecture the registers (min-max over the
    dtypes), the shared memory and the resident warps per SM of the dtype using the most registers."""
    archs = [f"sm_{a.capability}" for a in ARCHS]
    groups: dict[tuple[Any, ...], dict[str, list[dict[str, Any]]]] = {}
    for r in records:
        if "error" in r:
            continue
        fp64 = r["dtype"] == "float64"
        key = (_label(r), r["block_v"], r["warps"], r["block_k"], r["numbers"] > 0, r["width"] % 16 == 0, fp64)
        groups.setdefault(key, {}).setdefault(r["arch"], []).append(r)
    head = "| kernel | BLOCK_V | warps | BLOCK_K | numbers | width | dtypes | "
    head += " | ".join(f"{a} ({g.name}) regs / smem B / warps per SM" for a, g in zip(archs, ARCHS, strict=True))
    lines = [head + " |", "|---|---:|---:|---:|---|---|---|" + "---|" * len(archs)]
    for key in sorted(
        groups, key=lambda k: (k[0].startswith("linear"), k[0] != "stats", k[0], not k[4], not k[5], k[6], k[1], k[3])
    ):
        kernel, block_v, warps, block_k, numbers, aligned, _ = key
        cells = []
        for arch in archs:
            rs = groups[key].get(arch, [])
            if not rs:
                cells.append("-")
                continue
            worst = max(rs, key=lambda r: r["regs"])
            lo, hi = min(r["regs"] for r in rs), worst["regs"]
            regs = f"{lo}" if lo == hi else f"{lo}-{hi}"
            cells.append(f"{regs} / {worst['smem']} / {worst['warps_per_sm']} ({worst['occupancy']:.0%})")
        dtypes = ", ".join(
            sorted({r["dtype"].replace("float", "fp").replace("bfp", "bf") for rs in groups[key].values() for r in rs})
        )
        width = "16 n" if aligned else str(UNALIGNED_WIDTH)
        lines.append(
            f"| {kernel} | {block_v} | {warps} | {block_k} | {'yes' if numbers else 'no'} | {width} | {dtypes} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def limits_markdown() -> str:
    """The architecture limits of :data:`ARCHS` as a Markdown table."""
    lines = [
        "| GPU | target | registers / SM | max registers / thread | max warps / SM | max blocks / SM "
        "| shared memory / SM | max shared / block |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for a in ARCHS:
        lines.append(
            f"| {a.name} | sm_{a.capability} | {a.regs_per_sm} | {a.max_regs_per_thread} | {a.max_warps_per_sm} | "
            f"{a.max_blocks_per_sm} | {a.smem_per_sm // 1024} KiB | {a.max_smem_per_block // 1024} KiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the tables of docs/kernels.md")
    parser.add_argument("--json", metavar="PATH", help="write every compile's record to PATH")
    parser.add_argument(
        "--pairwise",
        action="store_true",
        help="compile what CI compiles: every block in one dtype, the largest blocks in every dtype (configs())",
    )
    parser.add_argument(
        "--plant-spill",
        action="store_true",
        help="compile only the largest fp64 statistics configuration for sm_90 under a 24-register cap: it "
        "must spill and exit 1 (shows that a spilling kernel fails)",
    )
    args = parser.parse_args(argv)
    import triton

    start = time.perf_counter()
    if args.plant_spill:
        largest = max((c for c in configs() if c.kernel == "stats" and c.dtype == "float64"), key=lambda c: c.block_v)
        with _fresh_compiler():
            records = [compile_one(largest, ARCHS[1], maxnreg=24)]
    else:
        records = compile_all(pairwise=args.pairwise)
    elapsed = time.perf_counter() - start
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": records, "seconds": elapsed, "triton": triton.__version__}, f, indent=1)
    found = problems(records)
    if args.markdown:
        ptxas = sorted({r["ptx_target"] for r in records if r.get("ptx_target")})
        print(f"triton {triton.__version__}, torch {torch.__version__}; {len(records)} compiles "
              f"({', '.join(ptxas)}) in {elapsed:.0f} s on this machine, no GPU; problems: {len(found)}\n")  # fmt: skip
        print(markdown(records))
        print()
        print(limits_markdown())
    for line in found:
        print("PROBLEM:", line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
