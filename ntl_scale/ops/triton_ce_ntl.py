"""CE + NTL statistics of a logits shard in one pass (Triton), and the gradient written in place.

* :func:`shard_stats`: per token ``m, S, z_y, mN, SN, A`` relative to the shard's *local* maxima, so no
  second pass follows the MAX all-reduce (:func:`global_sums` rescales them before the SUM all-reduce,
  both :mod:`ntl_scale.ops.logits`'s); with ``softmax_into`` the same kernel then writes the shard's softmax.
* :func:`softmax_grad_`: ``coef * softmax - label_coef * onehot(y)``, with ``number_grad`` stored on the
  number columns (their whole gradient, rounded once).

``impl="triton"`` takes them where :func:`runs_on` says they can run; ``impl="auto"`` only where
:func:`enabled` says so, nowhere until they have run on a GPU (docs/kernels.md).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = [
    "enabled",
    "global_sums",
    "logits_grad_",
    "number_exp_of",
    "runs_on",
    "shard_stats",
    "softmax_grad_",
    "triton_available",
]


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether ``triton`` imports (cached)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def enabled(tensor: torch.Tensor) -> bool:
    """Whether ``impl="auto"`` takes these kernels for ``tensor``: nowhere until the GPU check has run them
    on a GPU (see the module docs); ``impl="triton"`` takes them explicitly."""
    del tensor  # the rule will depend on the device (CUDA, not while torch.compile traces) once measured
    return False


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` before it was imported)."""
    import triton

    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; earlier releases have no interpreter switch to read
    return bool(knobs is not None and knobs.runtime.interpret)


def runs_on(tensor: torch.Tensor) -> bool:
    """Whether the kernels can run on ``tensor``'s device: CUDA, or any device under Triton's interpreter."""
    return triton_available() and (tensor.is_cuda or interpreting())


@functools.lru_cache(maxsize=1)
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def _stats_row(
        row, z_ptr, stride_zt, stride_zv, V,
        target_ptr, cols_ptr, K, a_ptr, stride_at, stride_ak,
        out_ptr, p_ptr, stride_pt, stride_pv,
        ACC: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, WRITE_SOFTMAX: tl.constexpr,
    ):  # fmt: skip
        z_row = z_ptr + row * stride_zt
        neg_inf = float("-inf")
        # online log-sum-exp over the columns: m the running max, s = sum exp(z - m)
        m = tl.full((), neg_inf, ACC)
        s = tl.zeros((), ACC)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            z = tl.load(z_row + offs * stride_zv, mask=offs < V, other=neg_inf).to(ACC)
            new_m = tl.maximum(m, tl.max(z, 0))
            base = tl.where(new_m == neg_inf, 0.0, new_m)  # an all -inf block adds 0, not NaN
            s = s * tl.exp(m - base) + tl.sum(tl.exp(z - base), 0)
            m = new_m
        target = tl.load(target_ptr + row)
        z_y = tl.load(z_row + tl.maximum(target, 0) * stride_zv, mask=target >= 0, other=0.0).to(ACC)
        # the same over the number columns, with the per-token weights a_k
        mn = tl.full((), neg_inf, ACC)
        sn = tl.zeros((), ACC)
        an = tl.zeros((), ACC)
        for start in range(0, K, BLOCK_K):
            kofs = start + tl.arange(0, BLOCK_K)
            kmask = kofs < K
            cols = tl.load(cols_ptr + kofs, mask=kmask, other=0)
            zk = tl.load(z_row + cols * stride_zv, mask=kmask, other=neg_inf).to(ACC)
            ak = tl.load(a_ptr + row * stride_at + kofs * stride_ak, mask=kmask, other=0.0).to(ACC)
            new_m = tl.maximum(mn, tl.max(zk, 0))
            base = tl.where(new_m == neg_inf, 0.0, new_m)
            scale = tl.exp(mn - base)
            ek = tl.exp(zk - base)
            sn = sn * scale + tl.sum(ek, 0)
            an = an * scale + tl.sum(ek * ak, 0)
            mn = new_m
        if WRITE_SOFTMAX:
            # The shard's softmax exp(z - m) / s over its own statistics (grad_kernel's arithmetic with coef 1;
            # under TP the host rescales each row), 0 for an all -inf shard. After the label and number reads,
            # so p_ptr may be z_ptr; walked backwards, from the blocks most likely still in L2.
            p_row = p_ptr + row * stride_pt
            base = tl.where(m == neg_inf, 0.0, m)
            inv = tl.where(s == 0.0, 0.0, 1.0 / s)
            blocks = tl.cdiv(V, BLOCK_V)
            for i in range(0, blocks):
                offs = (blocks - 1 - i) * BLOCK_V + tl.arange(0, BLOCK_V)
                mask = offs < V
                z = tl.load(z_row + offs * stride_zv, mask=mask, other=0.0).to(ACC)
                tl.store(p_row + offs * stride_pv, (inv * tl.exp(z - base)).to(p_ptr.dtype.element_ty), mask=mask)
        out = out_ptr + row * 6
        tl.store(out + 0, m)
        tl.store(out + 1, s)
        tl.store(out + 2, z_y)
        tl.store(out + 3, mn)
        tl.store(out + 4, sn)
        tl.store(out + 5, an)

    # Triton resolves a called jit function among the kernel's module globals (a closure is not seen)
    globals()["_stats_row"] = _stats_row

    @triton.jit
    def stats_kernel(
        z_ptr, stride_zt, stride_zv, V,
        target_ptr, cols_ptr, K, a_ptr, stride_at, stride_ak,
        out_ptr, p_ptr, stride_pt, stride_pv, T,
        ACC: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, WRITE_SOFTMAX: tl.constexpr,
        PERSISTENT: tl.constexpr,
    ):  # fmt: skip
        # One row per program; or (PERSISTENT) rows pid, pid + programs, ...: a grid of fewer programs keeps
        # fewer rows in flight, so that a row's second walk (the softmax) finds it still in L2. Two calls, not
        # one loop: a loop around every launch costs the per-row launch registers (a 4-byte spill on sm_90 with
        # the persistent bounds; 40 registers, 75 % occupancy on sm_80 with a one-row loop: triton_aot.py).
        if PERSISTENT:
            for row in range(tl.program_id(0).to(tl.int64), T, tl.num_programs(0)):
                _stats_row(row, z_ptr, stride_zt, stride_zv, V, target_ptr, cols_ptr, K, a_ptr, stride_at, stride_ak,
                           out_ptr, p_ptr, stride_pt, stride_pv, ACC, BLOCK_V, BLOCK_K, WRITE_SOFTMAX)  # fmt: skip
        else:
            _stats_row(tl.program_id(0).to(tl.int64), z_ptr, stride_zt, stride_zv, V, target_ptr, cols_ptr, K, a_ptr,
                       stride_at, stride_ak, out_ptr, p_ptr, stride_pt, stride_pv, ACC, BLOCK_V, BLOCK_K,
                       WRITE_SOFTMAX)  # fmt: skip

    @triton.jit
    def grad_kernel(
        z_ptr, stride_zt, stride_zv, g_ptr, stride_gt, stride_gv, V,
        max_ptr, total_ptr, coef_ptr, label_coef_ptr, target_ptr,
        cols_ptr, K, num_ptr, stride_nt, stride_nk,
        ACC: tl.constexpr, HAS_NUMBERS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * stride_zt
        g_row = g_ptr + row * stride_gt
        m = tl.load(max_ptr + row).to(ACC)
        scale = tl.load(coef_ptr + row).to(ACC) / tl.load(total_ptr + row).to(ACC)
        label_coef = tl.load(label_coef_ptr + row).to(ACC)
        target = tl.load(target_ptr + row)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < V
            z = tl.load(z_row + offs * stride_zv, mask=mask, other=0.0).to(ACC)
            g = scale * tl.exp(z - m)
            g = tl.where(offs == target, g - label_coef, g)
            tl.store(g_row + offs * stride_gv, g.to(g_ptr.dtype.element_ty), mask=mask)
        if HAS_NUMBERS:
            # The number columns' whole gradient (fp32, rounded once) replaces the value written above; other
            # threads of this program wrote those columns: wait for them, so that this store is the last.
            tl.debug_barrier()
            for start in range(0, K, BLOCK_K):
                kofs = start + tl.arange(0, BLOCK_K)
                kmask = kofs < K
                cols = tl.load(cols_ptr + kofs, mask=kmask, other=0)
                value = tl.load(num_ptr + row * stride_nt + kofs * stride_nk, mask=kmask, other=0.0)
                tl.store(g_row + cols * stride_gv, value.to(g_ptr.dtype.element_ty), mask=kmask)

    return stats_kernel, grad_kernel


def _acc(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def _block_v(width: int) -> int:
    return min(4096, 1 << (max(width, 16) - 1).bit_length())  # the next power of two, 16 to 4096


def _block_k(k: int) -> int:
    import triton

    return min(128, triton.next_power_of_2(max(k, 16)))


def _warps(block: int) -> int:
    return 16 if block >= 4096 else 8 if block >= 1024 else 4


#: The launch plan of the statistics-and-softmax kernel: the share of L2 its rows in flight may fill, 16-warp
#: programs per SM with one program per row, and the bytes a persistent program loads at once.
L2_SHARE = 0.75
MAX_PROGRAMS_PER_SM = 4
INFLIGHT_BYTES = 32 * 1024


def per_row_in_flight(rows: int, sms: int) -> int:
    """Rows one program per row keeps in flight: :data:`MAX_PROGRAMS_PER_SM` 16-warp programs on each SM."""
    return min(rows, MAX_PROGRAMS_PER_SM * sms)


def softmax_launch(rows: int, width: int, row_bytes: int, elem_bytes: int, sms: int, l2_bytes: int) -> tuple[int, int]:
    """Programs and ``BLOCK_V`` of the statistics kernel writing the softmax, on a GPU with ``sms`` SMs."""
    block = INFLIGHT_BYTES // elem_bytes
    fits = per_row_in_flight(rows, sms) * row_bytes <= L2_SHARE * l2_bytes
    if fits or elem_bytes > 4 or width < block or rows <= sms:
        return rows, _block_v(width)
    rounds = -(-rows // sms)
    return -(-rows // rounds), block


@functools.lru_cache(maxsize=8)
def _device_limits(device: torch.device) -> tuple[int, int]:
    """SMs and L2 bytes of a CUDA device (``torch.cuda.get_device_properties``)."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.L2_cache_size


def _gpu_limits(tensor: torch.Tensor) -> tuple[int, int] | None:
    """:func:`_device_limits` of a CUDA tensor's device; None elsewhere (one program per row)."""
    return _device_limits(tensor.device) if tensor.is_cuda else None


def shard_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    number_cols: torch.Tensor,
    a_table: torch.Tensor,
    *,
    block_v: int | None = None,
    softmax_into: torch.Tensor | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """Per-token local statistics of a logits shard in one pass: ``[T, 6]`` = ``m, S, z_y, mN, SN, A``."""
    stats_kernel, _ = _kernels()
    num_tokens = logits.shape[0]
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = torch.empty(num_tokens, 6, dtype=cdt, device=logits.device)
    if num_tokens == 0:
        return out
    if softmax_into is not None and softmax_into.shape != logits.shape:
        raise ValueError(
            f"softmax_into must have the logits' shape {tuple(logits.shape)}, got {tuple(softmax_into.shape)}"
        )
    grid = num_tokens  # one program per row: the statistics alone read a row once
    if programs is not None:
        if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
            raise ValueError(f"programs must be a positive int (the grid), got {programs!r}; leave it None for "
                             "the default launch")  # fmt: skip
        grid = min(programs, num_tokens)
    elif softmax_into is not None and block_v is None and (limits := _gpu_limits(logits)) is not None:
        elem, width = logits.element_size(), logits.shape[1]
        in_place = softmax_into.data_ptr() == logits.data_ptr()
        row_bytes = width * (elem + (0 if in_place else softmax_into.element_size()))
        grid, launch_block = softmax_launch(num_tokens, width, row_bytes, elem, *limits)
        block_v = launch_block
    args, meta = _stats_arguments(logits, target, number_cols, a_table, out, block_v, softmax_into, grid < num_tokens)
    stats_kernel[(grid,)](*args, **meta)
    return out


def _stats_arguments(
    logits: torch.Tensor,
    target: torch.Tensor,
    number_cols: torch.Tensor,
    a_table: torch.Tensor,
    out: torch.Tensor,
    block_v: int | None,
    softmax_into: torch.Tensor | None = None,
    persistent: bool = False,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The statistics kernel's arguments and meta-parameters (``benchmarks/triton_aot.py`` compiles from them);
    ``persistent``: a grid of fewer programs than rows (each loops over its rows)."""
    num_tokens, width = logits.shape
    k = number_cols.numel()
    a = a_table if k else torch.zeros(num_tokens, 1, dtype=out.dtype, device=logits.device)
    block_v = block_v or _block_v(width)
    p = logits if softmax_into is None else softmax_into  # not written without WRITE_SOFTMAX
    args = (
        logits, logits.stride(0), logits.stride(1), width,
        target.contiguous(), number_cols.contiguous(), k, a, a.stride(0), a.stride(1),
        out, p, p.stride(0), p.stride(1), num_tokens,
    )  # fmt: skip
    meta = {
        "ACC": _acc(logits.dtype),
        "BLOCK_V": block_v,
        "BLOCK_K": _block_k(k),
        "WRITE_SOFTMAX": softmax_into is not None,
        "PERSISTENT": persistent,
        "num_warps": _warps(block_v),
    }
    return args, meta


def global_sums(local: torch.Tensor, maxes: torch.Tensor) -> torch.Tensor:
    """This shard's ``[T, 4]`` sums ``S, z_y, SN, A`` relative to the global maxima, for the SUM all-reduce."""

    def rescale(local_max: torch.Tensor, global_max: torch.Tensor) -> torch.Tensor:
        # exp(local - global); a shard whose columns are all -inf (or none) contributes 0. NaN and +inf
        # are kept, as in ShardMath: NaN logits give NaN terms, never a silent 0
        safe = torch.where(global_max == float("-inf"), torch.zeros_like(global_max), global_max)
        return torch.where(local_max == float("-inf"), torch.zeros_like(local_max), torch.exp(local_max - safe))

    full, number = rescale(local[:, 0], maxes[:, 0]), rescale(local[:, 3], maxes[:, 1])
    return torch.stack(
        (local[:, 1] * full, local[:, 2], local[:, 4] * number, local[:, 5] * number), dim=1
    ).contiguous()


def softmax_grad_(
    logits: torch.Tensor,
    out: torch.Tensor,
    row_max: torch.Tensor,
    total: torch.Tensor,
    coef: torch.Tensor,
    label_coef: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    number_cols: torch.Tensor | None = None,
    number_grad: torch.Tensor | None = None,
    *,
    block_v: int | None = None,
) -> torch.Tensor:
    """Writes ``coef * softmax - label_coef * onehot(target)`` into ``out``, and ``number_grad`` on ``number_cols``."""
    _, grad_kernel = _kernels()
    if logits.shape[0] == 0:
        return out
    args, meta = _grad_arguments(
        logits, out, row_max, total, coef, label_coef, target, number_cols, number_grad, block_v
    )
    grad_kernel[(logits.shape[0],)](*args, **meta)
    return out


def _grad_arguments(
    logits: torch.Tensor,
    out: torch.Tensor,
    row_max: torch.Tensor,
    total: torch.Tensor,
    coef: torch.Tensor,
    label_coef: torch.Tensor | None,
    target: torch.Tensor | None,
    number_cols: torch.Tensor | None,
    number_grad: torch.Tensor | None,
    block_v: int | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The gradient kernel's arguments and meta-parameters (``benchmarks/triton_aot.py`` compiles from them)."""
    num_tokens, width = logits.shape
    device = logits.device
    if label_coef is None or target is None:
        label_coef = torch.zeros(num_tokens, dtype=coef.dtype, device=device)
        target = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    has_numbers = number_cols is not None and number_grad is not None and number_cols.numel() > 0
    if has_numbers:
        assert number_cols is not None and number_grad is not None
        cols, k, values = number_cols.contiguous(), number_cols.numel(), number_grad
    else:
        cols, k, values = torch.zeros(1, dtype=torch.int64, device=device), 0, coef.view(-1, 1)
    block_v = block_v or _block_v(width)
    args = (
        logits, logits.stride(0), logits.stride(1), out, out.stride(0), out.stride(1), width,
        row_max.contiguous(), total.contiguous(), coef.contiguous(), label_coef.contiguous(), target.contiguous(),
        cols, k, values, values.stride(0), values.stride(1),
    )  # fmt: skip
    meta = {
        "ACC": _acc(logits.dtype),
        "HAS_NUMBERS": has_numbers,
        "BLOCK_V": block_v,
        "BLOCK_K": _block_k(k),
        "num_warps": _warps(block_v),
    }
    return args, meta


# ------------------------------------------------------------------ the fused op's backward


def number_exp_of(logits: torch.Tensor, number_cols: torch.Tensor, number_max: torch.Tensor) -> torch.Tensor:
    """``exp(z_k - mN)`` on the number columns ``[T, K]`` in the compute dtype (-inf ``mN`` read as 0)."""
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    safe = torch.where(number_max == float("-inf"), torch.zeros_like(number_max), number_max)
    return torch.exp(logits.index_select(1, number_cols).to(cdt) - safe.unsqueeze(1))


def logits_grad_(
    logits: torch.Tensor,
    out: torch.Tensor,
    target: torch.Tensor,
    number_cols: torch.Tensor,
    a_table: torch.Tensor,
    max_all: torch.Tensor,
    total: torch.Tensor,
    number_max: torch.Tensor,
    number_total: torch.Tensor,
    expect: torch.Tensor,
    mass: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    number_exp: torch.Tensor | None = None,
    *,
    block_v: int | None = None,
) -> torch.Tensor:
    """Writes the gradient of ``sum(g_ce*ce + g_expect*expect + g_mass*mass)`` w.r.t. the logits into ``out``."""
    g_ce, g_expect, g_mass = grads
    safe_max = torch.where(number_max == float("-inf"), torch.zeros_like(number_max), number_max)
    if number_exp is None:
        number_exp = number_exp_of(logits, number_cols, number_max)
    probs = number_exp / torch.where(number_total == 0, 1, number_total).unsqueeze(1)  # p, over N only
    pi_numbers = number_exp * (torch.exp(safe_max - max_all) / total).unsqueeze(1)  # the full softmax on N
    coef = g_ce - g_mass * mass
    # The number columns' whole gradient in fp32 (fp64 for fp64 logits), the kernel stores it once:
    # coef pi_k (CE and the mass's dense part) + g_mass pi_k + g_expect p_k (a_k - expect) - g_ce [k = y]
    number_grad = (coef + g_mass).unsqueeze(1) * pi_numbers
    number_grad += g_expect.unsqueeze(1) * probs * (a_table - expect.unsqueeze(1))
    number_grad -= torch.where(number_cols.unsqueeze(0) == target.unsqueeze(1), g_ce.unsqueeze(1), 0)
    return softmax_grad_(logits, out, max_all, total, coef, g_ce, target, number_cols, number_grad, block_v=block_v)
