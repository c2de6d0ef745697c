"""CE + NTL from hidden states with the logits kept on chip: the Triton kernels of a fused linear CE + NTL.

The op around them (autograd, the all-reduces, the NTL terms, the refusals) is
:func:`lab.on_chip.linear_on_chip.fused_linear_ce_ntl`, one layer up; this module imports only the package's
CE + NTL kernel.

:func:`ntl_scale.linear_ce_ntl` (the chunked op) writes each chunk's ``[C, V]`` logits to memory and
reads them back for the softmax and both gradient GEMMs. Here no logit ever reaches HBM (Cut
Cross-Entropy's design, with NTL's number-column statistics added):

* **forward** (:func:`forward_stats`), one program per block of ``BLOCK_T`` tokens: for each vocabulary
  tile of ``BLOCK_V`` columns, ``z = h W^T`` accumulated in fp32 over ``BLOCK_H`` slices of the hidden
  size (``tl.dot``), then an online log-sum-exp (running max ``m`` and ``S = sum exp(z - m)``) and the
  label's logit ``z_y`` picked out of the tile where the label's column falls. The ``K`` number
  columns' logits ``z_N = h W_N^T`` come from one more small ``tl.dot`` per block of number columns
  (``K x H`` weight rows); they are written (``[T, K]``, small) and their local max ``mN``,
  ``SN = sum exp(z_k - mN)`` and ``A = sum exp(z_k - mN) a_k`` are formed on the fly. The per-token
  statistics are :func:`ntl_scale.ops.triton_ce_ntl.shard_stats`'s ``[T, 6]``, relative to the
  local maxima, so the two all-reduces of :func:`ntl_scale.ops.logits.combine_kernel_stats` (MAX of
  ``[m, mN]``, then SUM of ``[S, z_y, SN, A]``) run on the host between the forward and the backward
  launch, as on every other path; ``ShardMath.finalize`` turns them into ``ce, expect, mass, lse``.
* **backward** (:func:`backward_grads`), one program per (token block, vocabulary tile): ``z`` is
  recomputed for the tile, ``dz = (u_t / S_t) exp(z - m_t) - g_ce_t [j = y_t]`` (the dense term and the
  label term of ``ntl_scale/linear.py``'s formula, with ``u = g_ce - g_mass mass + g_lse``), cast to the
  inputs' dtype, and for each ``BLOCK_H`` slice ``dH[t] += dz W[v]`` and ``dW[v] += dz^T h[t]`` are
  **atomically added** into fp32 buffers. The number columns' own term ``g_mass pi_N + g_expect p (a -
  expect)`` (``[T, K]``) is added on the host: two ``O(T K H)`` GEMMs.

Why atomics for ``dW`` (and ``dH``): the alternative without atomics, one kernel over token
blocks for ``dH`` and one over vocabulary tiles for ``dW``, recomputes ``z`` twice (8 ``T V H`` FLOPs in the
backward instead of 6). A per-block split-K reduction of ``dW`` instead (each token block writing its own
``[V, H]`` partial, summed afterwards) writes ``T / BLOCK_T`` fp32 copies of ``[V, H]`` (269 GB at 8192 x
128256 x 4096) and reads them back. The atomics send as many bytes to L2 (538 GB for ``dH`` and ``dW``, in
any order), but what they move to HBM depends on what the programs in flight share:

* in the plain ``(token block, vocabulary tile)`` order the programs in flight touch every ``dH`` strip
  between two touches of one line, so ``dH`` is fetched again for every vocabulary tile;
* so programs run in groups of ``GROUP_T`` token blocks (``_grouped_tile``), as Cut Cross-Entropy orders its
  own. An LRU simulation of the launch (``benchmarks/cost_model.py``; H100, 15-50 MiB of L2, programs out of
  phase or in waves) gives 84-221 GB in groups of 8, 395-799 GB in the plain order (``docs/kernels.md``).

Whether L2 absorbs the 538 GB of atomics fast enough is not modelled. The price of atomics: fp32 sums in
an order the hardware picks, so the gradients are not bitwise reproducible run to run on a GPU (they are
in the interpreter). Both accumulators are fp32 and rounded to the parameters' dtype once, at the end.
Cut Cross-Entropy accumulates the same per-tile products differently (``cce_backward.py``, read for this):
a lock-guarded read-add-write per 64-wide slice (``tl_lock_add``), in the gradient's dtype (bf16) unless
``accum_e_fp32`` / ``accum_c_fp32`` (fp32) or Kahan compensation is asked for, tiles whose ``|dz|`` is below
``filter_eps`` skipped, programs ordered in groups of 8 token blocks for L2 reuse. Here: hardware fp32
``tl.atomic_add`` (no lock), no filtering (exact), groups of ``GROUP_T``. Tuning the group, the tiles and
filtering waits for a GPU (``benchmarks/bench_gpu.py``'s late rows).

Supported: fp32, bf16 and fp16 ``hidden`` and ``weight`` (fp32 dots at IEEE precision, no TF32), every
NTL variant (``terms_from_stats`` forms them from the statistics), ``reweigh`` (its gradient is
exact: the backward recomputes for any upstream gradient), z-loss (``lse`` returned and
differentiable), ``token_weights`` (accepted and checked; nothing is prebuilt for them), tensor
parallelism on vocabulary shards (``tp_group`` with ``vocab_start``, uneven shards included; the
returned hidden gradient is this shard's part, as in :func:`ntl_scale.linear_ce_ntl`), autocast.
Refused with a ``ValueError``/``TypeError``: fp64 (use the chunked op), label smoothing and logit
soft-capping (the chunked op computes them), ``need_ce=False`` without reweighing (the chunked op then
reads only the number columns: nothing to fuse), a DTensor ``weight`` or ``hidden`` (pass
``weight.to_local()`` with ``tp_group`` and ``vocab_start``), tensors the kernels cannot run on (CPU
outside Triton's interpreter).

Measured so far: exactness against a float64 reference under Triton's interpreter on the CPU, and the
ahead-of-time compiles for sm_80/90/100 (``benchmarks/triton_aot.py``). Its speed on a GPU is not
measured (``docs/kernels.md``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ntl_scale.ops import triton_ce_ntl

__all__ = ["backward_grads", "forward_stats", "launch_blocks"]

#: Launch tiles (tokens, vocabulary columns, hidden slice) and warps of the two kernels, for half-precision
#: and fp32 inputs; ``benchmarks/triton_aot.py`` compiles exactly these. Chosen so that the fp32
#: ``[BLOCK_T, BLOCK_V]`` tile and the dot operands stay in registers without spills on sm_80/90/100 (the fp32
#: kernels spilled at the half-precision tiles on sm_80: their IEEE dots hold fp32 operands); their speed is not tuned
#: (no GPU here).
FORWARD_BLOCKS = {
    "half": {"BLOCK_T": 64, "BLOCK_V": 128, "BLOCK_H": 64, "BLOCK_K": 16, "num_warps": 8},
    "float32": {"BLOCK_T": 64, "BLOCK_V": 64, "BLOCK_H": 32, "BLOCK_K": 16, "num_warps": 8},
}
BACKWARD_BLOCKS = {
    "half": {"BLOCK_T": 64, "BLOCK_V": 64, "BLOCK_H": 64, "GROUP_T": 8, "num_warps": 8},
    "float32": {"BLOCK_T": 32, "BLOCK_V": 64, "BLOCK_H": 32, "GROUP_T": 8, "num_warps": 8},
}


def launch_blocks(kind: str, dtype: torch.dtype) -> dict[str, int]:
    """The tiles and warps a launch of ``kind`` (``"forward"`` or ``"backward"``) takes for inputs of ``dtype``."""
    table = FORWARD_BLOCKS if kind == "forward" else BACKWARD_BLOCKS
    return dict(table["float32" if dtype == torch.float32 else "half"])


def _launch(kind: str, dtype: torch.dtype, blocks: dict[str, int] | None) -> dict[str, int]:
    """:func:`launch_blocks` with the caller's overrides, each a key of that table and a positive int (a
    ``GROUP_T`` of 0 would divide by zero inside the kernel: on a GPU, silently wrong gradients)."""
    launch = launch_blocks(kind, dtype)
    for key, value in (blocks or {}).items():
        if key not in launch or isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"blocks for the {kind} kernel: {key}={value!r}; expected one of {sorted(launch)} set to a "
                f"positive int (the launch's: {launch})"
            )
    return {**launch, **(blocks or {})}


#: The inputs' dtypes the kernels take.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def _logits_tile(
        h_ptr, stride_ht, stride_hh, w_ptr, stride_wv, stride_wh, H, rows, row_mask, ids, id_mask,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        # z = h[rows] W[ids]^T, [BLOCK_T, BLOCK_N] in fp32, over the hidden size in tiles of BLOCK_H: the one
        # product of the forward's vocabulary tiles, its number columns and the backward's recomputation
        z = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_mask = ks < H
            h = tl.load(h_ptr + rows[:, None] * stride_ht + ks[None, :] * stride_hh,
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
            w = tl.load(w_ptr + ids[:, None] * stride_wv + ks[None, :] * stride_wh,
                        mask=id_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
            z = tl.dot(
                (h.to(tl.float32) if UPCAST else h),
                tl.trans(w.to(tl.float32) if UPCAST else w),
                z,
                input_precision=PRECISION,
            )
        return z

    @triton.jit
    def _grouped_tile(pid, T, V, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, GROUP_T: tl.constexpr):
        # the backward's (token block, vocabulary tile) of program ``pid`` in grouped order: consecutive
        # programs take GROUP_T token blocks (fastest) times successive vocabulary tiles, the last group
        # fewer token blocks, so the programs in flight share a few dH strips and dW tiles (the module docs)
        blocks_t = tl.cdiv(T, BLOCK_T)
        per_group = GROUP_T * tl.cdiv(V, BLOCK_V)
        first_t = (pid // per_group) * GROUP_T
        in_group = tl.minimum(blocks_t - first_t, GROUP_T)
        return (first_t + (pid % per_group) % in_group).to(tl.int64), ((pid % per_group) // in_group).to(tl.int64)

    # Triton resolves a called jit function among the kernel's module globals (a closure is not seen)
    globals()["_logits_tile"] = _logits_tile
    globals()["_grouped_tile"] = _grouped_tile

    @triton.jit
    def forward_kernel(
        h_ptr, stride_ht, stride_hh, w_ptr, stride_wv, stride_wh, T, V, H,
        target_ptr, cols_ptr, K, a_ptr, stride_at, stride_ak,
        out_ptr, zn_ptr, stride_znt, stride_znk,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        row_mask = rows < T
        neg_inf = float("-inf")
        target = tl.load(target_ptr + rows, mask=row_mask, other=-1)
        m = tl.full((BLOCK_T,), neg_inf, tl.float32)
        s = tl.zeros((BLOCK_T,), tl.float32)
        z_y = tl.zeros((BLOCK_T,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_mask = cols < V
            z = _logits_tile(h_ptr, stride_ht, stride_hh, w_ptr, stride_wv, stride_wh, H, rows, row_mask, cols,
                            col_mask, PRECISION, UPCAST, BLOCK_T, BLOCK_V, BLOCK_H)  # fmt: skip
            z = tl.where(col_mask[None, :], z, neg_inf)
            z_y += tl.sum(tl.where(cols[None, :] == target[:, None], z, 0.0), 1)
            new_m = tl.maximum(m, tl.max(z, 1))
            base = tl.where(new_m == neg_inf, 0.0, new_m)  # an all -inf tile adds 0, not NaN
            s = s * tl.exp(m - base) + tl.sum(tl.exp(z - base[:, None]), 1)
            m = new_m
        # the number columns: their logits by one small dot per block of them, written out ([T, K]) and
        # their own online statistics
        mn = tl.full((BLOCK_T,), neg_inf, tl.float32)
        sn = tl.zeros((BLOCK_T,), tl.float32)
        an = tl.zeros((BLOCK_T,), tl.float32)
        for n0 in range(0, K, BLOCK_K):
            kofs = n0 + tl.arange(0, BLOCK_K)
            n_mask = kofs < K
            ids = tl.load(cols_ptr + kofs, mask=n_mask, other=0)
            zk = _logits_tile(h_ptr, stride_ht, stride_hh, w_ptr, stride_wv, stride_wh, H, rows, row_mask, ids,
                             n_mask, PRECISION, UPCAST, BLOCK_T, BLOCK_K, BLOCK_H)  # fmt: skip
            tl.store(zn_ptr + rows[:, None] * stride_znt + kofs[None, :] * stride_znk, zk,
                     mask=row_mask[:, None] & n_mask[None, :])  # fmt: skip
            ak = tl.load(a_ptr + rows[:, None] * stride_at + kofs[None, :] * stride_ak,
                         mask=row_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
            zk = tl.where(n_mask[None, :], zk, neg_inf)
            new_m = tl.maximum(mn, tl.max(zk, 1))
            base = tl.where(new_m == neg_inf, 0.0, new_m)
            scale = tl.exp(mn - base)
            ek = tl.exp(zk - base[:, None])
            sn = sn * scale + tl.sum(ek, 1)
            an = an * scale + tl.sum(ek * ak, 1)
            mn = new_m
        out = out_ptr + rows * 6
        tl.store(out + 0, m, mask=row_mask)
        tl.store(out + 1, s, mask=row_mask)
        tl.store(out + 2, z_y, mask=row_mask)
        tl.store(out + 3, mn, mask=row_mask)
        tl.store(out + 4, sn, mask=row_mask)
        tl.store(out + 5, an, mask=row_mask)

    @triton.jit
    def backward_kernel(
        h_ptr, stride_ht, stride_hh, w_ptr, stride_wv, stride_wh, T, V, H,
        max_ptr, scale_ptr, label_coef_ptr, target_ptr,
        dh_ptr, stride_dht, stride_dhh, dw_ptr, stride_dwv, stride_dwh,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr, NEED_H: tl.constexpr, NEED_W: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, GROUP_T: tl.constexpr,
    ):  # fmt: skip
        pid_t, pid_v = _grouped_tile(tl.program_id(0), T, V, BLOCK_T, BLOCK_V, GROUP_T)
        rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        row_mask = rows < T
        col_mask = cols < V
        z = _logits_tile(h_ptr, stride_ht, stride_hh, w_ptr, stride_wv, stride_wh, H, rows, row_mask, cols, col_mask,
                        PRECISION, UPCAST, BLOCK_T, BLOCK_V, BLOCK_H)  # fmt: skip
        m = tl.load(max_ptr + rows, mask=row_mask, other=0.0)
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)  # u_t / S_t; 0 past the tokens
        label_coef = tl.load(label_coef_ptr + rows, mask=row_mask, other=0.0)
        target = tl.load(target_ptr + rows, mask=row_mask, other=-1)
        dz = scale[:, None] * tl.exp(z - m[:, None])
        dz = tl.where(cols[None, :] == target[:, None], dz - label_coef[:, None], dz)
        dz = tl.where(col_mask[None, :] & row_mask[:, None], dz, 0.0).to(h_ptr.dtype.element_ty)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_mask = ks < H
            if NEED_H:
                w = tl.load(w_ptr + cols[:, None] * stride_wv + ks[None, :] * stride_wh,
                            mask=col_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
                dh = tl.dot(
                    (dz.to(tl.float32) if UPCAST else dz),
                    (w.to(tl.float32) if UPCAST else w),
                    input_precision=PRECISION,
                )
                tl.atomic_add(dh_ptr + rows[:, None] * stride_dht + ks[None, :] * stride_dhh, dh,
                              mask=row_mask[:, None] & k_mask[None, :], sem="relaxed")  # fmt: skip
            if NEED_W:
                h = tl.load(h_ptr + rows[:, None] * stride_ht + ks[None, :] * stride_hh,
                            mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
                dw = tl.dot(
                    tl.trans(dz.to(tl.float32) if UPCAST else dz),
                    (h.to(tl.float32) if UPCAST else h),
                    input_precision=PRECISION,
                )
                tl.atomic_add(dw_ptr + cols[:, None] * stride_dwv + ks[None, :] * stride_dwh, dw,
                              mask=col_mask[:, None] & k_mask[None, :], sem="relaxed")  # fmt: skip

    return forward_kernel, backward_kernel


def _precision(dtype: torch.dtype) -> dict[str, Any]:
    """``tl.dot``'s input precision (IEEE fp32 for fp32 inputs: torch's default matmul, no TF32) and ``UPCAST``.

    Triton 3.9's interpreter multiplies bf16/fp16 operands of ``tl.dot`` wrongly (off by 1e10 on a 16 x 16
    product, checked here): under the interpreter ``UPCAST`` casts the operands to fp32 first, exact for
    half-precision values, so the products and their fp32 sums are those of the half-precision dot with fp32
    accumulation. Compiled for a GPU (``benchmarks/triton_aot.py``) ``UPCAST`` is False.
    """
    upcast = dtype != torch.float32 and triton_ce_ntl.interpreting()
    return {"PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}


def _forward_arguments(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    number_cols: torch.Tensor,
    a_table: torch.Tensor,
    out: torch.Tensor,
    number_logits: torch.Tensor,
    blocks: dict[str, int] | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The forward kernel's arguments and meta-parameters (``benchmarks/triton_aot.py`` compiles from them)."""
    num_tokens, width = hidden.shape[0], weight.shape[0]
    k = number_cols.numel()
    a = a_table if k else torch.zeros(num_tokens, 1, dtype=torch.float32, device=hidden.device)
    zn = number_logits if k else torch.zeros(num_tokens, 1, dtype=torch.float32, device=hidden.device)
    cols = number_cols.contiguous() if k else torch.zeros(1, dtype=torch.int64, device=hidden.device)
    args = (
        hidden, hidden.stride(0), hidden.stride(1), weight, weight.stride(0), weight.stride(1),
        num_tokens, width, hidden.shape[1],
        target.contiguous(), cols, k, a, a.stride(0), a.stride(1),
        out, zn, zn.stride(0), zn.stride(1),
    )  # fmt: skip
    return args, {**_precision(hidden.dtype), **_launch("forward", hidden.dtype, blocks)}


def _backward_arguments(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    row_max: torch.Tensor,
    scale: torch.Tensor,
    label_coef: torch.Tensor,
    target: torch.Tensor,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    blocks: dict[str, int] | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The backward kernel's arguments and meta-parameters (``benchmarks/triton_aot.py`` compiles from them)."""
    dummy = torch.zeros(1, 1, dtype=torch.float32, device=hidden.device)
    dh = dummy if grad_h is None else grad_h
    dw = dummy if grad_w is None else grad_w
    args = (
        hidden, hidden.stride(0), hidden.stride(1), weight, weight.stride(0), weight.stride(1),
        hidden.shape[0], weight.shape[0], hidden.shape[1],
        row_max.contiguous(), scale.contiguous(), label_coef.contiguous(), target.contiguous(),
        dh, dh.stride(0), dh.stride(1), dw, dw.stride(0), dw.stride(1),
    )  # fmt: skip
    meta = {**_precision(hidden.dtype), "NEED_H": grad_h is not None, "NEED_W": grad_w is not None}
    return args, {**meta, **_launch("backward", hidden.dtype, blocks)}


def forward_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    number_cols: torch.Tensor,
    a_table: torch.Tensor,
    *,
    blocks: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token local statistics of ``hidden @ weight.T`` without writing those logits.

    Args:
        hidden: ``[T, H]``; weight: this shard's ``[V_local, H]`` (same dtype: fp32/bf16/fp16).
        target: the label's local column per token, -1 where this shard does not own it (or it is
            ignored), int64 ``[T]``.
        number_cols: this shard's local number columns, int64 ``[K]`` (may be empty).
        a_table: ``a_k`` per token and number column ``[T, K]`` (fp32; an expanded view is fine).
        blocks: overrides of :data:`FORWARD_BLOCKS` (the tests use small tiles).

    Returns:
        fp32 ``[T, 6]`` = ``m, S, z_y, mN, SN, A`` as :func:`ntl_scale.ops.triton_ce_ntl.shard_stats`
        returns them for the logits, and the number columns' logits fp32 ``[T, K]``.
    """
    forward_kernel, _ = _kernels()
    import triton

    num_tokens = hidden.shape[0]
    out = torch.empty(num_tokens, 6, dtype=torch.float32, device=hidden.device)
    number_logits = torch.empty(num_tokens, number_cols.numel(), dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return out, number_logits
    args, meta = _forward_arguments(hidden, weight, target, number_cols, a_table, out, number_logits, blocks)
    forward_kernel[(triton.cdiv(num_tokens, meta["BLOCK_T"]),)](*args, **meta)
    return out, number_logits


def backward_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    row_max: torch.Tensor,
    scale: torch.Tensor,
    label_coef: torch.Tensor,
    target: torch.Tensor,
    needs: tuple[bool, bool] = (True, True),
    *,
    blocks: dict[str, int] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """fp32 ``dH = dz W`` and ``dW = dz^T h`` for ``dz = scale_t exp(z - row_max_t) - label_coef_t [j = target_t]``.

    ``z = hidden @ weight.T`` is recomputed tile by tile and never written. ``needs``: whether ``dH`` /
    ``dW`` are wanted (None is returned for the other). The sums are atomic adds into fp32 buffers.
    """
    _, backward_kernel = _kernels()
    import triton

    need_h, need_w = needs
    grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    if hidden.shape[0] == 0 or not (need_h or need_w):
        return grad_h, grad_w
    args, meta = _backward_arguments(hidden, weight, row_max, scale, label_coef, target, grad_h, grad_w, blocks)
    grid = (triton.cdiv(hidden.shape[0], meta["BLOCK_T"]) * triton.cdiv(weight.shape[0], meta["BLOCK_V"]),)
    backward_kernel[grid](*args, **meta)
    return grad_h, grad_w
