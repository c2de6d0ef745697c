"""Fused cross entropy + number-token statistics on a vocab shard, with an explicit TP group.

The one place where the softmax over the vocabulary is computed. Per token (``docs/math.md``): ``ce``, ``expect``
``= sum_{k in N} p_k a_k`` with ``p = softmax(z_N)`` (``a_k = d(v_k, t)`` for NTL-WAS, ``v_k`` for the point
losses) and ``mass = sum_{k in N} softmax(z)_k``. Under tensor parallelism the forward needs one MAX all-reduce
of ``[max z, max z_N]`` and one SUM all-reduce of ``[S, z_y, S_N, A]`` per token (:func:`all_reduce_max`,
:func:`all_reduce_sums`: the only TP collectives of the loss); the backward none. ``tp_group=None`` (or size 1)
is the same code without collectives. Here: the kernel choice (:func:`use_triton`) and the autograd
Functions (:class:`_FusedCENTL`; :class:`_NumberColumnsNTL`, NTL alone on the number columns).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..options import check_impl, check_option
from . import triton_ce_ntl
from .shard_math import ShardInputs, ShardMath, compute_dtype, index_add, shift_into
from .shards import group_size

__all__ = [
    "KERNEL_FEATURES",
    "all_reduce_max",
    "all_reduce_sums",
    "combine_kernel_stats",
    "fused_shard_stats",
    "kernel_shard_softmax",
    "kernel_shard_stats",
    "label_number_logit",
    "use_triton",
]


# ---------------------------------------------------------------------------------- the TP collectives


def all_reduce_max(maxes: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The forward's first collective: MAX all-reduce, in place, of ``[T, 2]`` = ``[max z, max z_N]``.

    Over ``tp_group``; nothing on one device (None or a group of size 1). Returns ``maxes``.
    """
    if group_size(tp_group) > 1:
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=tp_group)
    return maxes


def all_reduce_sums(sums: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The forward's second collective: SUM all-reduce, in place, of ``[T, 4]`` = ``[S, z_y, S_N, A]``.

    The partial sums must be relative to the global maxima (after :func:`all_reduce_max`). Over
    ``tp_group``; nothing on one device. Returns ``sums``.
    """
    if group_size(tp_group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
    return sums


def combine_kernel_stats(
    local: torch.Tensor, tp_group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global ``max [T]``, number max ``[T]`` (-inf kept) and sums ``[T, 4]`` from the kernel's local statistics.

    ``local`` is :func:`~ntl_scale.ops.triton_ce_ntl.shard_stats`'s ``[T, 6]``; the same two
    all-reduces as the PyTorch path: MAX of ``[T, 2]``, then SUM of ``[T, 4]``.
    """
    maxes = all_reduce_max(local[:, [0, 3]].clone(), tp_group)
    sums = all_reduce_sums(triton_ce_ntl.global_sums(local, maxes), tp_group)
    return maxes[:, 0], maxes[:, 1], sums


def kernel_shard_stats(
    logits: torch.Tensor,
    inputs: ShardInputs,
    tp_group: dist.ProcessGroup | None = None,
    *,
    block_v: int | None = None,
    softmax_into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``max [T]``, number max ``[T]`` (-inf kept) and ``sums [T, 4]`` of a logits shard, with the Triton kernel.

    What :meth:`ShardMath.local_max` and :meth:`ShardMath.local_sums` compute with the two
    all-reduces, in one pass over the logits; ``ShardMath.finalize`` turns them into the terms.
    ``softmax_into`` (one device only: the statistics are then final in the kernel): the softmax written
    there by the same kernel (:func:`~ntl_scale.ops.triton_ce_ntl.shard_stats`).
    """
    if softmax_into is not None and group_size(tp_group) > 1:
        raise ValueError(
            "softmax_into needs the whole vocabulary on this device: under tensor parallelism the softmax "
            "waits for the all-reduced statistics (write it with softmax_grad_ after them)"
        )
    local = triton_ce_ntl.shard_stats(
        logits, inputs.local_target(logits.shape[1]), inputs.number_cols, inputs.a_table, block_v=block_v,
        softmax_into=softmax_into,
    )  # fmt: skip
    return combine_kernel_stats(local, tp_group)


def kernel_shard_softmax(
    logits: torch.Tensor,
    inputs: ShardInputs,
    tp_group: dist.ProcessGroup | None = None,
    *,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`kernel_shard_stats`, with the same kernel writing the shard's softmax over ``logits`` in place.

    The kernel writes ``exp(z - m_local) / S_local``; ``rescale [T] = S_local exp(m_local - m) / S`` (None on
    one device) turns each row into the global softmax, folded by the caller into its per-token factors.

    Returns:
        ``max [T]``, number max ``[T]`` (-inf kept), ``sums [T, 4]`` (as :func:`kernel_shard_stats`) and
        ``rescale`` (None on one device).
    """
    local = triton_ce_ntl.shard_stats(
        logits, inputs.local_target(logits.shape[1]), inputs.number_cols, inputs.a_table, block_v=block_v,
        softmax_into=logits,
    )  # fmt: skip
    max_all, number_max, sums = combine_kernel_stats(local, tp_group)
    if group_size(tp_group) <= 1:
        return max_all, number_max, sums, None
    # S_local exp(m_local - m) is this shard's term of the SUM all-reduce (0 for a shard of -inf logits)
    share = triton_ce_ntl.global_sums(local, torch.stack((max_all, number_max), dim=1))[:, 0]
    return max_all, number_max, sums, share / sums[:, 0]


KERNEL_FEATURES = ("z_loss_weight",)
"""The CE features the Triton path computes (the z-loss needs only the reduced log-sum-exp and adds to the
coefficient of the softmax); the others (label smoothing, soft-capping) run the PyTorch code."""


def use_triton(impl: str, tensor: torch.Tensor, features: tuple[str, ...] = ()) -> bool:
    """Whether an op called with ``impl`` runs the Triton kernels on ``tensor``.

    ``"torch"``: never. ``"auto"``: where :func:`ntl_scale.ops.triton_ce_ntl.enabled` says, never with a CE
    feature the kernels lack (``features`` less :data:`KERNEL_FEATURES`). ``"triton"``: always, except while
    ``torch.compile`` traces; a ValueError where the kernels cannot run (device, features), an ImportError
    without ``triton``.
    """
    check_impl(impl)
    features = tuple(name for name in features if name not in KERNEL_FEATURES)
    if impl == "torch" or (impl == "auto" and features):
        return False
    if impl == "triton" and features:
        raise ValueError(
            f"impl='triton' runs Triton kernels that do not compute {', '.join(features)} (the CE features of "
            "NTLOptions); pass impl='auto' or 'torch' for the PyTorch code, which computes them"
        )
    if impl == "auto":
        return triton_ce_ntl.enabled(tensor)
    if torch.compiler.is_compiling():
        return False
    if not triton_ce_ntl.triton_available():
        raise ImportError(
            "impl='triton' needs the optional dependency 'triton', which is not installed. Install it with: "
            "pip install triton (or pass impl='auto' or 'torch' for the PyTorch code)"
        )
    if not triton_ce_ntl.runs_on(tensor):
        raise ValueError(
            f"impl='triton' runs Triton kernels, which need CUDA tensors, but the logits are on {tensor.device}; "
            "pass impl='auto' or 'torch' for the PyTorch code on this device (tests run the kernels on the CPU "
            "under Triton's interpreter, TRITON_INTERPRET=1 before triton is imported)"
        )
    return True


class _FusedCENTL(torch.autograd.Function):
    """Autograd wrapper: two all-reduces in the forward, none in the backward.

    Outputs ``ce, expect, mass, hit, lse``; ``lse`` (the whole vocabulary's log-sum-exp) is
    differentiable (``d lse/dz = pi``), so a z-loss built from it needs nothing more here.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: torch.Tensor,
        inputs: ShardInputs,
        need_full: bool,
        inplace: bool,
        check_finite: bool,
        tp_group: dist.ProcessGroup | None,
        chunk_tokens: int | None,
        kernels: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        cdt = compute_dtype(logits.dtype)
        rows = ShardMath.chunk_rows(logits.shape[0], logits.shape[1], chunk_tokens)
        # The chunks bound the [chunk, V_local] work buffer; in place there is none, so one pass over
        # the shard (each chunk is a parallel region per op: on a loaded CPU, 8 chunks at 4096 x 32768
        # cost 2-4x the time of one)
        whole = [slice(0, logits.shape[0])] if chunk_tokens is None else rows
        rows = whole if inplace else rows
        number_logits = logits.index_select(1, inputs.number_cols).to(cdt)

        fast = need_full and kernels
        if fast:  # Triton (ntl_scale/ops/triton_ce_ntl.py): the statistics in one pass, the same two all-reduces
            max_all, raw_number_max, sums = kernel_shard_stats(logits, inputs, tp_group)
            maxes = torch.stack((max_all, raw_number_max), dim=1)
            number_max = ShardMath.safe_number_max(raw_number_max)
            number_exp = torch.exp(number_logits - number_max.unsqueeze(1))
        else:
            maxes = all_reduce_max(ShardMath.local_max(logits, number_logits, rows, need_full), tp_group)
            max_all = maxes[:, 0]
            number_max = ShardMath.safe_number_max(maxes[:, 1])

            sums, number_exp = ShardMath.local_sums(
                logits, number_logits, inputs, max_all, number_max, rows, need_full, inplace,
                smoothing=need_full and inputs.smoothing != 0,
            )  # fmt: skip
            all_reduce_sums(sums, tp_group)
        if check_finite:
            raise_if_not_finite(maxes, sums, need_full)
        smoothing = inputs.smoothing if need_full else 0.0
        ce, expect, mass, hit, lse = ShardMath.finalize(max_all, sums, number_max, inputs.valid, need_full, smoothing)
        ctx.mark_non_differentiable(hit)
        ctx.set_materialize_grads(False)
        ctx.vocab = sums[:, 5] if smoothing else None

        # the backward writes its own output buffer: a work buffer only for half-precision logits
        backward_rows = whole if inplace or cdt == logits.dtype else rows
        ctx.inputs, ctx.need_full, ctx.inplace, ctx.rows = inputs, need_full, inplace, backward_rows
        ctx.fast, ctx.number_max = fast, number_max
        ctx.save_for_backward(logits, max_all, sums[:, 0], number_exp, sums[:, 2], expect, mass)
        return ce, expect, mass, hit, lse

    @staticmethod
    def backward(ctx, g_ce, g_expect, g_mass, _g_hit, g_lse=None):  # type: ignore[override]
        logits, max_all, total, number_exp, number_total, expect, mass = ctx.saved_tensors
        saved = {
            "max_all": max_all,
            "total": total,
            "number_exp": number_exp,
            "number_total": number_total,
            "expect": expect,
            "mass": mass,
            "vocab": ctx.vocab,
        }
        zeros = torch.zeros_like(expect)
        grads = tuple(zeros if g is None else g.to(expect.dtype) for g in (g_ce, g_expect, g_mass))
        grads = (torch.where(ctx.inputs.valid, grads[0], zeros), grads[1], grads[2])
        if not ctx.need_full:
            # Only the number columns carry gradient: no pass over the vocabulary.
            out = torch.zeros_like(logits)
            number_grad = ShardMath.number_grad(slice(None), saved, ctx.inputs, grads[1])
            index_add(out, 1, ctx.inputs.number_cols, number_grad.to(out.dtype))
            return out, None, None, None, None, None, None, None
        g_lse = None if g_lse is None else g_lse.to(expect.dtype)
        if ctx.fast:  # Triton: one pass writes the gradient (over the logits, which it left intact, in place)
            out = logits if ctx.inplace else torch.empty_like(logits)
            inputs = ctx.inputs
            target = inputs.local_target(logits.shape[1])
            if g_lse is not None:  # d lse/dz = pi: the kernel's coefficient of pi is g_ce (+ NTL's terms)
                grads = (grads[0] + g_lse, grads[1], grads[2])
            args = (max_all, total, ctx.number_max, number_total, expect, mass, grads, number_exp)
            out = triton_ce_ntl.logits_grad_(logits, out, target, inputs.number_cols, inputs.a_table, *args)
            if g_lse is not None:  # ... and it wrote -(g_ce + g_lse) at the label: give g_lse back there
                owned = target >= 0
                back = torch.where(owned, g_lse, torch.zeros_like(g_lse)).unsqueeze(1).to(out.dtype)
                out.scatter_add_(1, target.clamp_min(0).unsqueeze(1), back)
            return out, None, None, None, None, None, None, None
        if g_lse is not None:
            grads = (*grads, g_lse)
        cdt = expect.dtype
        # In place: the saved buffer holds exp(z - max) and becomes the gradient. Otherwise a new
        # gradient buffer; half-precision logits go through one reused fp32 chunk buffer.
        out = logits if ctx.inplace else torch.empty_like(logits)
        buffer = None if ctx.inplace or out.dtype == cdt else ShardMath.chunk_buffer(logits, ctx.rows, cdt)
        for sl in ctx.rows:
            if ctx.inplace:
                work = out[sl]
            else:
                work = out[sl] if buffer is None else buffer[: sl.stop - sl.start]
                shift_into(logits[sl], max_all[sl], work).exp_()
            smoothing = ctx.inputs.smoothing if ctx.vocab is not None else 0.0
            ShardMath.grad_chunk(work, sl, saved, ctx.inputs, grads, smoothing)
            if buffer is not None:
                out[sl].copy_(work)
        return out, None, None, None, None, None, None, None


def raise_if_not_finite(maxes: torch.Tensor, sums: torch.Tensor, need_full: bool) -> None:
    """Raise ``ValueError`` naming the token positions whose reduced statistics are not finite.

    ``maxes`` ``[T, 2]`` and ``sums`` ``[T, >= 4]`` after their all-reduces (:func:`all_reduce_max`,
    :func:`all_reduce_sums`); ``need_full``: the full-vocabulary columns are checked too, else only the
    number columns'. Used by every op that forms the statistics (a host sync: callers pass
    ``check_finite=False`` to skip it).
    """
    # After the SUM all-reduce a NaN/Inf on any rank shows up in the reduced sums on every rank,
    # so every rank takes the same branch here and none is left waiting in a collective.
    checked = sums[:, [0, 2]] if need_full else sums[:, 2:3]
    bad = ~torch.isfinite(checked).all(dim=1)
    if need_full:
        bad |= ~torch.isfinite(maxes[:, 0])
    if bool(bad.any()):
        positions = torch.nonzero(bad).flatten()
        raise ValueError(
            f"logits contain NaN or Inf at {positions.numel()} of {bad.numel()} token positions "
            f"(first at flattened position {int(positions[0])}); expected finite logits. The model has "
            "probably diverged (lower the learning rate, check the data and the fp16 loss scale); pass "
            "check_finite=False to skip this check and let NaN propagate into the loss."
        )


def label_number_logit(number_logits: torch.Tensor, inputs: ShardInputs) -> torch.Tensor:
    """``[T]``: the label's logit where this shard holds the label among its number columns, else 0.

    A ``[T, K_local]`` comparison, no pass over the vocabulary; the SUM all-reduce completes it (one owner).
    """
    match = inputs.number_cols.unsqueeze(0) == (inputs.labels - inputs.start).unsqueeze(1)
    match &= inputs.valid.unsqueeze(1)
    return torch.where(match, number_logits, torch.zeros_like(number_logits)).sum(dim=1)


class _NumberColumnsNTL(torch.autograd.Function):
    """NTL alone on logits ``[..., V_local]``: the number columns are read once, the gradient written once.

    The same two all-reduces, no full softmax. ``lse`` (the CE kernel's, or None): ``mass = exp(lse_N - lse)``.
    ``hit``: the arg-max among the number columns. ``passthrough``: the logits come back first, for a partner
    CE, and the backward adds the number columns into its gradient in place (:func:`writable_grad`).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: torch.Tensor,
        inputs: ShardInputs,
        check_finite: bool,
        tp_group: dist.ProcessGroup | None,
        cap: float | None,
        lse: torch.Tensor | None,
        passthrough: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        cols = inputs.number_cols
        cdt = compute_dtype(logits.dtype)
        tokens = logits.numel() // logits.shape[-1]  # not reshape(-1, n): a shard may hold no number column
        number_logits = logits.index_select(-1, cols).reshape(tokens, cols.numel()).to(cdt)
        factor = None
        if cap is not None:
            number_logits = torch.tanh(number_logits / cap) * cap
            factor = 1 - (number_logits / cap).square()
        rows = [slice(0, number_logits.shape[0])]
        maxes = all_reduce_max(ShardMath.local_max(number_logits, number_logits, rows, False), tp_group)
        number_max = ShardMath.safe_number_max(maxes[:, 1])
        sums, number_exp = ShardMath.local_sums(
            number_logits, number_logits, inputs, maxes[:, 0], number_max, rows, False, False
        )
        sums[:, 1] = label_number_logit(number_logits, inputs)
        all_reduce_sums(sums, tp_group)
        if check_finite:
            raise_if_not_finite(maxes, sums, False)
        ce, expect, mass, _, lse_out = ShardMath.finalize(maxes[:, 0], sums, number_max, inputs.valid, False)
        hit = inputs.valid & (sums[:, 1] >= maxes[:, 1])
        scale = None
        if lse is not None:  # pi_N = exp(z_N - lse): the number mass and its columns' share of the softmax
            scale = torch.exp(number_max - lse.to(cdt))
            mass = sums[:, 2] * scale
        ctx.mark_non_differentiable(hit)
        ctx.inputs, ctx.shape, ctx.dtype, ctx.passthrough = inputs, logits.shape, logits.dtype, passthrough
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(number_exp, sums[:, 2], expect, factor, scale, mass)
        stats = (ce, expect, mass, hit, lse_out)
        # the same storage, not a view: a partner that overwrites its input (Megatron, Liger) may then do so
        return (logits.detach(), *stats) if passthrough else stats

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        g_pass, grads = (grads[0], grads[1:]) if ctx.passthrough else (None, grads)
        g_expect, g_mass = grads[1], grads[2]  # ce and lse are constants here
        number_exp, number_total, expect, factor, scale, mass = ctx.saved_tensors
        inputs: ShardInputs = ctx.inputs
        out = writable_grad(g_pass, ctx.shape, ctx.dtype, expect.device)
        number_grad, g_lse = None, None
        if g_expect is not None:
            saved = {"number_exp": number_exp, "number_total": number_total, "expect": expect}
            number_grad = ShardMath.number_grad(slice(None), saved, inputs, g_expect.to(expect.dtype))
        if g_mass is not None and scale is not None:  # d mass/dz_k = pi_k, d mass/d lse = -mass
            g_mass = g_mass.to(expect.dtype)
            share = g_mass.unsqueeze(1) * number_exp * scale.unsqueeze(1)
            number_grad = share if number_grad is None else number_grad + share
            g_lse = -g_mass * mass
        if number_grad is not None:
            if factor is not None:  # d z'/dz = 1 - (z'/cap)^2
                number_grad = number_grad * factor
            # on the last dim in the logits' own shape: a partner's gradient may arrive in another layout
            cols = inputs.number_cols
            index_add(out, out.dim() - 1, cols, number_grad.to(ctx.dtype).view(*ctx.shape[:-1], cols.numel()))
        return out, None, None, None, None, g_lse, None


def writable_grad(
    grad: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The buffer NTL's columns are added into: the partner's incoming gradient itself where safely writable.

    Writable: dense and non-overlapping in some dimension order (contiguous or a transpose of it, as a matmul's
    weight gradient comes: no expanded or zero-stride view, every element its own memory), of the input's shape
    and dtype, outside a ``create_graph`` backward. Otherwise a contiguous copy of it, or zeros where
    the partner left no gradient. A partner whose backward hands this same tensor to another input too
    (``logits + bias`` of the same shape) would see NTL's columns there: put such ops before the passthrough.
    """
    if grad is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    order = sorted(range(grad.dim()), key=lambda d: -grad.stride()[d])
    # grad mode is on in a backward only under create_graph (not requires_grad: Megatron's CE returns its input)
    dense = grad.permute(order).is_contiguous() and grad.shape == shape and grad.dtype == dtype
    if dense and not torch.is_grad_enabled():
        return grad
    return grad.to(dtype).clone(memory_format=torch.contiguous_format).reshape(shape)


def fused_shard_stats(
    logits: torch.Tensor,
    inputs: ShardInputs,
    *,
    need_full: bool,
    inplace: bool = False,
    check_finite: bool = False,
    tp_group: dist.ProcessGroup | None = None,
    chunk_tokens: int | None = None,
    impl: str = "auto",
    features: tuple[str, ...] = (),
    cap: float | None = None,
    lse: torch.Tensor | None = None,
    passthrough: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Per-token ``(ce, expect, mass, hit, lse)`` of a ``[T, V_local]`` logits shard; differentiable.

    Args:
        logits: the local logits shard, ``[T, V_local]``, fp32/bf16/fp16/fp64 (without ``need_full``
            any ``[..., V_local]``, the tokens in row-major order: its gradient keeps that shape).
        need_full: compute the full softmax (for CE, and the number mass without ``lse``); if False only
            the number columns are read (:class:`_NumberColumnsNTL`, with ``cap``, ``lse``, ``passthrough``).
        inplace: reuse the fp32/fp64 logits buffer for ``exp(z - max)`` and the gradient, as Megatron's CE does.
        chunk_tokens: tokens per chunk of the temporaries (default: a 64 MiB budget).
        impl: ``"auto"``, ``"torch"`` or ``"triton"``: the code of the statistics and the gradient
            (:func:`use_triton`); the NTL-only path (``need_full=False``) is PyTorch code always.
        features: the CE features on (:attr:`ntl_scale.options.NTLOptions.ce_features`), which the
            kernels lack (:func:`use_triton`). Label smoothing itself is ``inputs.smoothing``.

    Returns:
        ``ce``, ``expect``, ``mass``, each ``[T]`` in the compute dtype, the bool ``hit`` (the label is the
        arg-max of the full vocabulary; without ``need_full``, among the number columns) and ``lse``, the
        whole vocabulary's log-sum-exp (0 without ``need_full``; differentiable), identical on every TP rank.
        Without ``need_full``, ``ce`` is 0 and ``mass`` 0 unless ``lse`` is given.
    """
    check_option("chunk_tokens", chunk_tokens)
    if not need_full:
        return _NumberColumnsNTL.apply(logits, inputs, check_finite, tp_group, cap, lse, passthrough)
    kernels = use_triton(impl, logits, features)
    return _FusedCENTL.apply(logits, inputs, need_full, inplace, check_finite, tp_group, chunk_tokens, kernels)
