"""The chunked CE + NTL op from hidden states: its autograd Function and the chunk math, called by
:func:`ntl_scale.linear.linear_ce_ntl`. NTL alone (``need_full=False``) forms only ``z_N = h W_N^T``.

The logits ``z = h W^T`` (``[T, V]``, the largest activation of a large-vocabulary model) never exist
whole: the op walks over the tokens in chunks of ``C`` and keeps only per-token statistics
(``ce``, ``expect``, ``mass``; see :mod:`ntl_scale.ops.logits`) and what the gradients need.

The gradient w.r.t. the logits of ``sum_t g_ce_t ce_t + g_e_t expect_t + g_m_t mass_t`` is

    dz_t = u_t pi_t  -  g_ce_t e_{y_t}  +  [number columns: g_m_t pi_tN + g_e_t p_t (a_t - expect_t)]

with ``pi`` the full softmax, ``p`` the softmax over the number columns and
``u_t = g_ce_t - g_m_t mass_t``. Only the first term is dense over the vocabulary; the label term
touches one column per token and the NTL terms the ``K`` number columns (10 for digits). So:

* forward, per chunk: ``z = h W^T``, the softmax statistics (two all-reduces per chunk under tensor
  parallelism, as for the logits op), then ``pi``, ``P_h += pi W`` (per token) and
  ``G_W += (w pi)^T h`` with ``w`` the per-token weights the caller's reduction will apply
  (``token_weights``; default: 1 on every non-ignored label);
* backward: the dense part of the hidden gradient is ``u_t P_h[t]``, exact for any upstream
  gradient. When ``u = s w`` for one scalar ``s`` (a mean or sum of CE with those weights: the usual
  case) the weight gradient's dense part is ``s G_W``; only the sparse terms are added
  (``O(T K H)``). Otherwise (e.g. ``reweigh=True``, whose ``g_m`` varies per token) the backward
  recomputes ``z`` chunk by chunk for ``(u pi)^T h``: exact for any upstream gradient, two more
  matmuls.

``G_W`` accumulates in fp32 (fp64 for fp64 weights), each chunk's product scaled to a mean, and is rounded
to the weight's dtype once. Only what the requested gradients need is built: without any (evaluation) a
chunk is ``z = h W^T`` and its statistics. Peak extra memory: ``docs/memory_efficient.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .logits import (
    all_reduce_max,
    all_reduce_sums,
    kernel_shard_softmax,
    kernel_shard_stats,
    label_number_logit,
    raise_if_not_finite,
    writable_grad,
)
from .shard_math import ShardInputs, ShardMath, compute_dtype, index_add, shift_into
from .shards import group_size

#: Elements of one chunk of logits on the CPU: ``2**26`` (256 MiB in fp32). Smaller chunks save memory but
#: re-read the ``[V, H]`` weight-gradient accumulator once per chunk (measured, docs/benchmarks.md: 8192 x
#: 131072 x 2048 on CPU, 128-token chunks 1.24x the materialised time, 512-token chunks 0.91x).
CPU_CHUNK_ELEMENTS = 1 << 26

#: Elements of one chunk of logits on a GPU: ``2**28`` (512 MiB in bf16, plus the backward's fp32 copy:
#: 1.5 GiB of temporaries). At 128256 x 4096 that is 2092-token chunks, long enough for each chunk's
#: ``[V, H]`` weight-gradient GEMM not to be bound by re-reading its fp32 accumulator (``benchmarks/cost_model.py``
#: puts that bound near 1280 tokens on an H100). A provisional rule: the measured table comes from the GPU check
#: (``benchmarks/bench_gpu.py``, ``docs/gpu.md``).
GPU_CHUNK_ELEMENTS = 1 << 28


def choose_chunk_tokens(device_type: str, tokens: int, vocab: int) -> int:
    """Tokens per chunk of the chunked op when the caller gives none: a fixed budget of logits per chunk.

    ``min(max(tokens, 1), max(1, budget // vocab))`` with ``budget`` :data:`GPU_CHUNK_ELEMENTS` (``2**28``) on
    ``"cuda"``, else :data:`CPU_CHUNK_ELEMENTS` (``2**26``; 512-token chunks at 131072 columns, what
    ``docs/benchmarks.md`` measured best on the CPU). ``vocab`` is the local vocabulary (a TP shard's rows).
    The GPU budget is provisional: the measured table will come from the GPU check.
    """
    for name, value in (("tokens", tokens), ("vocab", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    budget = GPU_CHUNK_ELEMENTS if device_type == "cuda" else CPU_CHUNK_ELEMENTS
    return min(max(tokens, 1), max(1, budget // max(vocab, 1)))


def default_chunk_tokens(hidden: torch.Tensor, width: int) -> int:
    """:func:`choose_chunk_tokens` for ``hidden [T, H]`` and a weight shard of ``width`` rows (the CPU's
    budget while compiling)."""
    device_type = "cpu" if torch.compiler.is_compiling() else hidden.device.type
    return choose_chunk_tokens(device_type, hidden.shape[0], width)


class _ChunkWalk:
    """The forward's walk over the token chunks: the per-token statistics and, where ``dense``, the products
    ``P_h`` and ``G_W`` from each chunk's softmax (Triton kernel or PyTorch code, ``kernels``). The op reads
    the attributes afterwards and drops the walk."""

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        inputs: ShardInputs,
        tp_group: dist.ProcessGroup | None,
        token_weights: torch.Tensor,
        rows: list[slice],
        *,
        need_full: bool,
        dense: tuple[bool, bool],
        kernels: bool,
        smoothing: bool,
        z_weight: float,
        cap: float | None,
    ) -> None:
        self.hidden, self.weight, self.inputs, self.tp_group = hidden, weight, inputs, tp_group
        self.token_weights, self.rows = token_weights, rows
        self.smoothing, self.z_weight, self.cap = smoothing, z_weight, cap
        self.cdt = cdt = compute_dtype(hidden.dtype)
        num_tokens, width, device = hidden.shape[0], weight.shape[0], hidden.device
        cols = inputs.number_cols
        if need_full:  # filled chunk by chunk from the chunk's logits: one matmul, one source of truth
            self.number_logits = torch.empty(num_tokens, cols.numel(), dtype=cdt, device=device)
        else:  # only the K number columns: a [T, K] matmul
            self.number_logits = (hidden @ weight.index_select(0, cols).t()).to(cdt)
            if cap is not None:  # soft-capped like every logit: z' = cap tanh(z / cap)
                self.number_logits = self.number_logits.div_(cap).tanh_().mul_(cap)
        self.maxes = torch.zeros(num_tokens, 2, dtype=cdt, device=device)
        self.sums = torch.zeros(num_tokens, 6 if smoothing else 4, dtype=cdt, device=device)
        self.number_exp = torch.zeros(num_tokens, cols.numel(), dtype=cdt, device=device)
        self.dense_h = self.dense_w = None
        if need_full and dense[0]:
            # P_h in the dtype of its matmul's output (half precision for half parameters: its values are
            # those already; the backward scales and completes each row in fp32 and rounds it once, into
            # this same buffer, which becomes the input gradient: T H b bytes, not T H (4 + b))
            half = hidden.dtype if hidden.dtype == weight.dtype else cdt
            self.dense_h = torch.empty(num_tokens, hidden.shape[1], dtype=half, device=device)
        if need_full and dense[1]:
            # The weight gradient sums over every token: it accumulates in fp32 (fp64 for fp64), never
            # in a half dtype (fp16 overflowed at 8k tokens, bf16 lost precision with the chunk count).
            # Not zeroed: the first chunk's product writes it (accumulate(first=True)), no [V, H] pass.
            self.dense_w = torch.empty(width, hidden.shape[1], dtype=cdt, device=weight.device)
        self.product = product_buffer(weight, cdt) if self.dense_w is not None else None
        self.wants_dense = self.dense_h is not None or self.dense_w is not None
        self.fast = need_full and kernels
        # per-token factors of P_h's rows (the one-kernel path under tensor parallelism; on one device the
        # kernel's softmax is final and there are none)
        scaled = self.fast and self.dense_h is not None and group_size(tp_group) > 1
        self.dense_scale = torch.ones(num_tokens, dtype=cdt, device=device) if scaled else None
        # Reused buffers for the torch path (a fresh allocation per chunk costs a page fault per page on
        # the CPU: 40 ms for a 64 MiB chunk here, about 5 % of the op at 2048 x 32768 x 512): the chunk's
        # logits, in the parameters' dtype; for half-precision parameters also an fp32 work buffer of a
        # quarter of the chunk's rows (half the bytes of the logits buffer, not twice), through which the
        # softmax is computed in parts, twice: once for the sums, once more after their all-reduce, into
        # the logits buffer as the half softmax both gradient matmuls read.
        self.logits_buf = self.work_buf = None
        self.parts_of = 1
        if need_full and not self.fast:
            self.logits_buf = ShardMath.chunk_buffer(hidden, rows, hidden.dtype, width)
            if hidden.dtype != cdt:
                self.parts_of = max(1, -(-self.logits_buf.shape[0] // 4))
                self.work_buf = ShardMath.chunk_buffer(hidden, [slice(0, self.parts_of)], cdt, width)

    def numbers_only(self) -> None:
        """NTL alone: the statistics of the number columns only (and the label's logit among them, for the
        number-choice hit), no pass over the vocabulary."""
        maxes, sums, number_logits, cols = self.maxes, self.sums, self.number_logits, self.inputs.number_cols
        maxes[:, 1] = number_logits.max(dim=-1).values if cols.numel() else float("-inf")
        all_reduce_max(maxes, self.tp_group)
        self.number_exp = torch.exp(number_logits - ShardMath.safe_number_max(maxes[:, 1]).unsqueeze(1))
        sums[:, 1] = label_number_logit(number_logits, self.inputs)
        sums[:, 2] = self.number_exp.sum(dim=-1)
        sums[:, 3] = (self.number_exp * self.inputs.a_table).sum(dim=-1)
        all_reduce_sums(sums, self.tp_group)

    def triton_chunk(self, sl: slice) -> None:
        """A chunk by the Triton kernel (:mod:`ntl_scale.ops.triton_ce_ntl`): one launch for the statistics and
        then the softmax written in place; under tensor parallelism the shard's softmax, made global by a
        per-token factor."""
        logits = self.hidden[sl] @ self.weight.t()
        self.number_logits[sl] = logits.index_select(1, self.inputs.number_cols).to(self.cdt)  # before the kernel
        rescale = None
        if self.wants_dense:
            max_all, self.maxes[sl, 1], self.sums[sl], rescale = kernel_shard_softmax(
                logits, self.inputs.rows(sl), self.tp_group
            )
        else:  # no gradient wanted: the statistics only
            max_all, self.maxes[sl, 1], self.sums[sl] = kernel_shard_stats(logits, self.inputs.rows(sl), self.tp_group)
        self.maxes[sl, 0] = max_all
        self._z_loss_weights(sl, max_all)
        number_max = ShardMath.safe_number_max(self.maxes[sl, 1])
        self.number_exp[sl] = torch.exp(self.number_logits[sl] - number_max.unsqueeze(1))
        if self.wants_dense:
            self.dense_products(sl, logits, rescale)

    def torch_chunk(self, sl: slice) -> None:
        """A chunk by the PyTorch code: the max, the two all-reduces' operands, and the softmax (soft-capping's
        factor included) into the reused logits buffer."""
        if self.logits_buf is None:
            raise RuntimeError("internal: the torch path of the chunked op has no logits buffer")
        cap, cdt, width, work_buf = self.cap, self.cdt, self.weight.shape[0], self.work_buf
        logits = torch.mm(self.hidden[sl], self.weight.t(), out=self.logits_buf[: sl.stop - sl.start])
        if cap is not None:  # soft-capping, in place: every statistic below is of the capped logits
            logits.div_(cap).tanh_().mul_(cap)
        self.number_logits[sl] = logits.index_select(1, self.inputs.number_cols).to(cdt)
        # the max of half-precision logits in their dtype: exact, like the max of their fp32 copy
        self.maxes[sl] = ShardMath.local_max(logits, self.number_logits[sl], [slice(None)], True)
        all_reduce_max(self.maxes[sl], self.tp_group)
        number_max, max_all = ShardMath.safe_number_max(self.maxes[sl, 1]), self.maxes[sl, 0]
        # fp32/fp64: in place, the logits become exp(z - max), then the softmax pi; half precision:
        # exp(z - max) part by part through the fp32 work buffer, the logits kept for the second pass
        parts = [slice(None)] if work_buf is None else ShardMath.chunk_rows(logits.shape[0], width, self.parts_of)
        self.sums[sl], self.number_exp[sl] = ShardMath.local_sums(
            logits, self.number_logits[sl], self.inputs.rows(sl), max_all, number_max, parts, True,
            work_buf is None, work_buf, self.smoothing,
        )  # fmt: skip
        all_reduce_sums(self.sums[sl], self.tp_group)
        self._z_loss_weights(sl, max_all)
        if not self.wants_dense:  # no gradient wanted: the statistics are all
            return
        inv_total = self.sums[sl, 0].reciprocal().unsqueeze(1)
        # with soft-capping the dense part of the gradient is pi * (1 - (z'/cap)^2), z' the capped logit
        if work_buf is None:
            if cap is not None:  # z' = log(exp(z' - max)) + max; a 0 (underflow) gives factor 0, pi 0
                logits.mul_(_cap_factor(logits.log().add_(max_all.unsqueeze(1)), cap))
            logits.mul_(inv_total)
        else:  # the softmax in the parameters' dtype (one rounding), shared by both matmuls
            for part in parts:
                work = shift_into(logits[part], max_all[part], work_buf[: part.stop - part.start]).exp_()
                if cap is not None:
                    work.mul_(_cap_factor(logits[part].to(cdt), cap))
                logits[part].copy_(work.mul_(inv_total[part]))
        self.dense_products(sl, logits)

    def _z_loss_weights(self, sl: slice, max_all: torch.Tensor) -> None:
        """The z-loss ``z_weight * lse^2`` rides on CE's weights: ``d/dz = (1 + 2 z_weight lse) pi``, so the
        forward's weight gradient is built for these effective per-token weights."""
        if self.z_weight:
            lse = torch.log(self.sums[sl, 0]) + max_all
            self.token_weights[sl] = self.token_weights[sl] * (1 + 2 * self.z_weight * lse)

    def dense_products(self, sl: slice, probs: torch.Tensor, rescale: torch.Tensor | None = None) -> None:
        """The chunk's dense gradient parts from its softmax: ``P_h = pi W`` and ``G_W += (w pi)^T h``;
        ``rescale`` (per token, or None): ``probs`` is the shard's softmax over its local statistics and
        ``rescale * probs`` the global one (the one-kernel path under tensor parallelism)."""
        if self.dense_h is not None:
            self.dense_h[sl] = probs @ self.weight
            if rescale is not None and self.dense_scale is not None:  # (TP only) applied in the backward's fp32
                self.dense_scale[sl] = rescale
        if self.dense_w is not None:
            # sum_t w_t pi_t h_t^T of the chunk, as a mean over a power of two >= its length in half
            # precision (no fp16 overflow, whatever the chunk's length) and added back in fp32
            span = _mean_span(sl) if self.product is not None else 1
            weights = self.token_weights[sl] if rescale is None else self.token_weights[sl] * rescale
            rows_w = _weighted_rows(self.hidden[sl], weights, span, self.cdt)
            accumulate(self.dense_w, probs, rows_w, self.product, span, first=sl is self.rows[0])


class ChunkedLinearCENTL(torch.autograd.Function):
    """``hidden [T, H]``, ``weight [V_local, H]`` -> per-token ``ce, expect, mass, hit, lse``.

    Without ``need_full`` (NTL alone) only ``z_N = h W_N^T`` is formed; ``hit`` is then the arg-max among
    the number columns, and ``mass`` is ``exp(lse_N - lse)`` from the caller's ``lse`` (0 without it)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        inputs: ShardInputs,
        need_full: bool,
        check_finite: bool,
        tp_group: dist.ProcessGroup | None,
        chunk_tokens: int | None,
        token_weights: torch.Tensor,
        proportional: bool = False,
        needs: tuple[bool, bool] = (True, True),
        kernels: bool = False,
        z_weight: float = 0.0,
        cap: float | None = None,
        lse: torch.Tensor | None = None,
        passthrough: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        # needs: whether the gradient of hidden / of weight will be asked for (grad mode on and the
        # tensor requiring it; decided by the caller: inside forward grad mode is always off). What no
        # one needs is not built: under no_grad (evaluation) a chunk is its logits matmul and the
        # statistics only, the forward FLOPs 2 T V H instead of 3x that, no [V, H] accumulator.
        need_h, need_w = needs
        plain_weights = token_weights  # the caller's CE weights (token_weights becomes CE + z-loss's below)
        if z_weight and need_full:  # becomes the effective weights of CE + z-loss, chunk by chunk
            token_weights = token_weights.clone()
        smoothing = need_full and inputs.smoothing != 0
        # soft-capping with label smoothing: the smoothed target's uniform part times the cap factor is dense
        # per token and column, with a coefficient (g_ce) other than the softmax's (u): no per-token P_h or
        # forward G_W carries it, so the backward recomputes each chunk's logits for both dense products
        recompute = smoothing and cap is not None
        width = weight.shape[0]
        rows = ShardMath.chunk_rows(hidden.shape[0], width, chunk_tokens or default_chunk_tokens(hidden, width))
        walk = _ChunkWalk(
            hidden, weight, inputs, tp_group, token_weights, rows,
            need_full=need_full, dense=(need_h and not recompute, need_w and not recompute), kernels=kernels,
            smoothing=smoothing, z_weight=z_weight, cap=cap,
        )  # fmt: skip
        if not need_full:  # NTL alone reads only the number columns: no pass over the vocabulary
            walk.numbers_only()
        for sl in rows if need_full else []:
            if walk.fast:
                walk.triton_chunk(sl)
            else:
                walk.torch_chunk(sl)
        maxes, sums, number_logits, number_exp = walk.maxes, walk.sums, walk.number_logits, walk.number_exp
        dense_h, dense_w, dense_scale = walk.dense_h, walk.dense_w, walk.dense_scale
        del walk
        if dense_w is not None and not rows:  # no tokens: no chunk wrote the accumulator
            dense_w.zero_()
        if check_finite:
            raise_if_not_finite(maxes, sums, need_full)
        number_max = ShardMath.safe_number_max(maxes[:, 1])
        eps = inputs.smoothing if smoothing else 0.0
        ce, expect, mass, hit, lse_out = ShardMath.finalize(maxes[:, 0], sums, number_max, inputs.valid, need_full, eps)
        if not need_full:  # the label's logit is the largest of the number columns'
            hit = inputs.valid & (sums[:, 1] >= maxes[:, 1])
            if lse is not None:  # the number mass from the caller's log-sum-exp (saved in max_all's place)
                maxes[:, 0] = lse.to(expect.dtype)
                mass = sums[:, 2] * torch.exp(number_max - maxes[:, 0])
        ctx.mark_non_differentiable(hit)
        ctx.set_materialize_grads(False)
        ctx.smoothing = (eps, sums[:, 5]) if smoothing else None
        ctx.cap = None
        if cap is not None:  # the factor 1 - (z'/cap)^2 at the label (with CE) and the number columns
            label_factor = _cap_factor(sums[:, 1].clone(), cap) if need_full else None
            ctx.cap = (cap, label_factor, _cap_factor(number_logits.clone(), cap))
        ctx.recompute, ctx.mass_from_lse = recompute, not need_full and lse is not None
        ctx.inputs, ctx.need_full, ctx.rows, ctx.proportional = inputs, need_full, rows, proportional
        ctx.needs = needs
        ctx.save_for_backward(
            hidden, weight, token_weights, maxes[:, 0], number_max, sums[:, 0], number_exp, sums[:, 2], expect, mass,
            plain_weights,
        )  # fmt: skip
        ctx.dense = (dense_h, dense_w, dense_scale)
        ctx.passthrough = passthrough  # (NTL alone) hidden and weight come back first, for a partner CE
        stats = (ce, expect, mass, hit, lse_out)
        return (hidden.detach(), weight.detach(), *stats) if passthrough else stats  # (not views: see logits.py)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        # autocast off, as in the forward (linear_ce_ntl): a backward called under autocast would
        # otherwise cast its fp32 products to half precision
        # (the partner's gradients are not kept on ctx: a second reference would make autograd copy the result)
        partner, grads = (grads[:2], grads[2:]) if ctx.passthrough else ((None, None), grads)
        stats = (grads[0], grads[1], grads[2], grads[4] if len(grads) > 4 else None)
        device = ctx.saved_tensors[0].device.type
        if device == "meta":  # shape-only tensors (cost counts): no autocast state
            return ChunkedLinearCENTL._backward(ctx, *stats, partner)
        with torch.autocast(device, enabled=False):
            return ChunkedLinearCENTL._backward(ctx, *stats, partner)

    @staticmethod
    def _backward(
        ctx: Any,
        g_ce: torch.Tensor | None,
        g_expect: torch.Tensor | None,
        g_mass: torch.Tensor | None,
        g_lse: torch.Tensor | None = None,
        partner: tuple[torch.Tensor | None, ...] = (None, None),
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, token_weights, max_all, number_max, total, number_exp, number_total, expect, mass = (
            ctx.saved_tensors[:10]
        )
        plain_weights = ctx.saved_tensors[10]
        dense_h, dense_w, dense_scale = ctx.dense
        ctx.dense = None
        inputs: ShardInputs = ctx.inputs
        cdt = expect.dtype
        zeros = torch.zeros_like(expect)
        g_ce, g_expect, g_mass = (zeros if g is None else g.to(cdt) for g in (g_ce, g_expect, g_mass))
        g_ce = torch.where(inputs.valid, g_ce, zeros)
        saved = {"number_exp": number_exp, "number_total": number_total, "expect": expect}
        cols = inputs.number_cols
        number_coef = ShardMath.number_grad(slice(None), saved, inputs, g_expect)  # [T, K]
        need_h, need_w = ctx.needs
        nones = (None,) * 13
        if not ctx.need_full:
            grad_h = grad_w = g_lse = None
            if ctx.mass_from_lse:  # d mass/dz_k = pi_k = p_k S_N exp(max_N - lse), d mass/d lse = -mass
                number_coef = number_coef + g_mass.unsqueeze(1) * number_exp * torch.exp(number_max - max_all)[:, None]
                g_lse = -g_mass * mass
            if ctx.cap is not None:  # d z'/dz of the capped number logits
                number_coef = number_coef * ctx.cap[2]
            # into the partner CE's gradients in place where given and writable (passthrough), else new ones
            g_h, g_w = partner
            del partner
            if need_h:
                grad_h = number_coef @ weight.index_select(0, cols).to(cdt)
                grad_h = grad_h.to(hidden.dtype) if g_h is None else writable_grad(g_h, *_like(hidden)).add_(grad_h)
            if need_w:
                grad_w = writable_grad(g_w, *_like(weight))
                index_add(grad_w, 0, cols, (number_coef.t() @ hidden.to(cdt)).to(weight.dtype))
            return grad_h, grad_w, *nones[2:], g_lse, None

        # number columns of the full softmax: pi_N = exp(z_N - max) / S
        pi_numbers = number_exp * (torch.exp(number_max - max_all) / total).unsqueeze(1)
        number_coef = number_coef + g_mass.unsqueeze(1) * pi_numbers
        cap = None if ctx.cap is None else ctx.cap[0]
        if ctx.cap is not None:  # the gradient of the capped logits times d z'/dz = 1 - (z'/cap)^2
            number_coef = number_coef * ctx.cap[2]
        u = g_ce - g_mass * mass
        if g_lse is not None:  # d lse/dz = pi: the z-loss (or any use of lse) adds to pi's coefficient
            u = u + g_lse.to(cdt)
        eps = 0.0 if ctx.smoothing is None else ctx.smoothing[0]
        # the smoothed target's uniform part, -eps/V g_ce on every column of every shard (V: the whole vocabulary)
        uniform = None if ctx.smoothing is None else g_ce * (eps / ctx.smoothing[1])
        # pi_t W, per token: exact for any upstream gradient; scaled by u (times the per-token factors of the
        # one-kernel path under TP) row by row in the loop below, with the sparse terms
        grad_h = dense_h
        u_h = u if dense_scale is None else u * dense_scale
        grad_w = None
        # folded: with a gradient proportional to the token weights by the caller's guarantee (g_ce = s w), the
        # label and smoothing terms join the forward's G_W in its own units (no scale) and the scale is applied
        # in the one pass that casts to the weight's dtype; only the K number rows are fixed apart
        fold = need_w and ctx.proportional and not ctx.recompute
        scale = None
        if ctx.recompute:  # soft-capping with smoothing: both dense products from recomputed logits
            grad_h, grad_w = _recompute_dense(
                hidden, weight, ctx.rows, max_all, total, u, cap, uniform, (need_h, need_w), cdt
            )
        elif need_w:
            scale = _scale_of(u, token_weights) if ctx.proportional else _common_scale(u, token_weights)
            if scale is not None:  # the weight gradient was built in the forward for these token weights
                grad_w = dense_w if fold else dense_w.mul_(scale)
            else:  # any other upstream gradient: recompute the logits chunk by chunk with the true u
                # (u carries the caller's normaliser, as the materialised path's logit gradient does)
                _, grad_w = _recompute_dense(hidden, weight, ctx.rows, max_all, total, u, cap, None, (False, True), cdt)
        del dense_h, dense_w, dense_scale
        # the label column (-g_ce e_y, for labels in this shard) and the number columns, chunk by
        # chunk so that no [T, H] temporary is made
        owned, local_label = inputs.owned_targets(slice(None), weight.shape[0])
        number_weight = weight.index_select(0, cols).to(cdt)
        # every row, with a zero coefficient where this shard does not own the label: no nonzero() sync
        label_index = torch.where(owned, local_label, torch.zeros_like(local_label))
        label_grad = -(1 - eps) * g_ce if ctx.cap is None else -(1 - eps) * g_ce * ctx.cap[1]
        label_coef_all = torch.where(owned, label_grad, torch.zeros_like(g_ce)).unsqueeze(1)
        weight_sum = None
        if uniform is not None and not ctx.recompute:  # (folded: in scaled_cast)
            # without soft-capping the uniform part is a rank-one term, c_t = eps/V g_ce_t:
            # dh_t -= c_t sum_j W_j (in the loop below), dW_j -= sum_t c_t h_t for every local row j
            weight_sum = weight.sum(dim=0, dtype=cdt) if grad_h is not None else None
            if grad_w is not None and not fold:
                grad_w.sub_((uniform.unsqueeze(1) * hidden.to(cdt)).sum(dim=0))
        if fold:  # the label coefficient in G_W's units: -(1 - eps) w (times the cap factor at the label)
            unit = -(1 - eps) * plain_weights if ctx.cap is None else -(1 - eps) * plain_weights * ctx.cap[1]
            label_unit_all = torch.where(owned, unit, torch.zeros_like(unit)).unsqueeze(1)
            number_rows = torch.zeros(cols.numel(), weight.shape[1], dtype=cdt, device=weight.device)
        half_rows = grad_h is not None and grad_h.dtype != cdt
        for sl in ctx.rows:
            label_coef, index = label_coef_all[sl], label_index[sl]
            if grad_h is not None:  # each row in fp32 (P_h's half rows are exact there), rounded once
                rows_h = grad_h[sl] if not half_rows else grad_h[sl].to(cdt)
                if not ctx.recompute:  # (the recomputed products carry u and the uniform part already)
                    rows_h.mul_(u_h[sl].unsqueeze(1))
                if weight_sum is not None and uniform is not None:
                    rows_h.sub_(uniform[sl].unsqueeze(1) * weight_sum)
                rows_h.add_(label_coef * weight.index_select(0, index).to(cdt))
                rows_h.add_(number_coef[sl] @ number_weight)
                if half_rows:  # back into P_h's buffer: it becomes the input gradient
                    grad_h[sl] = rows_h
            if grad_w is not None and fold:
                index_add(grad_w, 0, index, label_unit_all[sl] * hidden[sl].to(cdt))
                number_rows.add_(number_coef[sl].t() @ hidden[sl].to(cdt))
            elif grad_w is not None:
                index_add(grad_w, 0, index, label_coef * hidden[sl].to(cdt))
                index_add(grad_w, 0, cols, number_coef[sl].t() @ hidden[sl].to(cdt))
        if fold and grad_w is not None and scale is not None:
            grad_w = scaled_cast(grad_w, scale, number_rows, cols, weight.dtype, hidden, uniform, eps)
        # one rounding to the weight's dtype, at the end (grad_w is the fp32/fp64 accumulator)
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            *nones,
        )


def _like(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return tensor.shape, tensor.dtype, tensor.device


def scaled_cast(
    acc: torch.Tensor,
    scale: torch.Tensor,
    number_rows: torch.Tensor,
    cols: torch.Tensor,
    dtype: torch.dtype,
    hidden: torch.Tensor,
    uniform: torch.Tensor | None,
    eps: float,
    fused: bool | None = None,
) -> torch.Tensor:
    """The weight gradient ``s acc + number rows (- the smoothing row)`` rounded once to ``dtype``, in one pass
    over ``[V, H]``: ``acc`` holds the dense and label parts in the forward's units (``s`` not applied).

    ``fused`` (default on CUDA, or when ``acc`` has ``dtype``): ``torch.mul``/``addcmul`` write the weight's
    dtype straight from the fp32 accumulator; else (CPU: mixed-dtype ops are not vectorised) scale, then cast.
    The ``K`` number rows are computed in fp32 beside it and written over their rows; label smoothing's uniform
    row ``-(eps/V) s sum_t w_t h_t`` is added to every row in that pass.
    """
    cdt = acc.dtype
    row = None
    if uniform is not None and eps:  # uniform_t = (eps / V) g_ce_t: the row in absolute units
        row = -(uniform.unsqueeze(1) * hidden.to(cdt)).sum(dim=0)
    fix = acc.index_select(0, cols).mul_(scale).add_(number_rows)
    if row is not None:
        fix.add_(row)
    if fused if fused is not None else (acc.is_cuda or dtype == cdt):  # one pass: fp32 in, the weight's dtype out
        out = acc if dtype == cdt else torch.empty(acc.shape, dtype=dtype, device=acc.device)
        if row is None:
            torch.mul(acc, scale, out=out)
        else:
            torch.addcmul(row, acc, scale, out=out)
    else:  # CPU: in place, then the vectorised cast (measured 2x faster there than one mixed-dtype op)
        acc.mul_(scale)
        if row is not None:
            acc.add_(row)
        out = acc.to(dtype)
    out.index_copy_(0, cols, fix.to(dtype))
    return out


def _recompute_dense(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: list[slice],
    max_all: torch.Tensor,
    total: torch.Tensor,
    u: torch.Tensor,
    cap: float | None,
    uniform: torch.Tensor | None,
    needs: tuple[bool, bool],
    cdt: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The dense parts of the gradients from the logits recomputed chunk by chunk: ``D @ W`` and ``D^T h``
    with ``D = (u pi - uniform) * (1 - (z'/cap)^2)`` (``z'`` the capped logits; no factor without ``cap``;
    ``uniform`` the smoothed target's ``eps/V g_ce`` per token, or None). Exact for any upstream gradient;
    the logits are capped in their own dtype, as the forward capped them."""
    need_h, need_w = needs
    grad_h = torch.empty(hidden.shape, dtype=cdt, device=hidden.device) if need_h else None
    # written by the first chunk's product, as in the forward (zeroed only when there is no chunk)
    grad_w = torch.empty(weight.shape, dtype=cdt, device=weight.device) if need_w else None
    if grad_w is not None and not rows:
        grad_w.zero_()
    product = product_buffer(weight, cdt) if need_w else None
    for sl in rows:
        logits = hidden[sl] @ weight.t()
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)
        work = logits if logits.dtype == cdt else logits.to(cdt)
        factor = None if cap is None else _cap_factor(work.clone(), cap)
        work.sub_(max_all[sl].unsqueeze(1)).exp_().mul_((u[sl] / total[sl]).unsqueeze(1))
        if uniform is not None:
            work.sub_(uniform[sl].unsqueeze(1))
        if factor is not None:
            work.mul_(factor)
        if grad_h is not None:
            grad_h[sl] = work.to(weight.dtype) @ weight
        if grad_w is not None:
            accumulate(grad_w, work, hidden[sl], product, 1, first=sl is rows[0])
        del logits, work, factor
    return grad_h, grad_w


def _cap_factor(capped: torch.Tensor, cap: float) -> torch.Tensor:
    """``1 - (z'/cap)^2`` of capped logits ``z' = cap tanh(z / cap)``, in place of ``capped``: ``d z'/dz``.

    Clamped to ``[0, 1]`` (``z'/cap`` to ``[-1, 1]``), so a ``-inf`` from ``log(0)`` gives 0.
    """
    return capped.div_(cap).clamp_(-1, 1).square_().neg_().add_(1)


class ProductBuffer:
    """A reused ``[V_local, H]`` buffer for one chunk's weight-gradient product in the weight's half dtype
    (the matmul runs at half-precision speed), allocated when first needed: where the fp32-output GEMM adds
    straight into the accumulator (:func:`fp32_output_gemm`: CUDA) it never is, and the op's peak holds no
    ``V H b`` bytes for it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self._like = weight
        self.buffer: torch.Tensor | None = None  # None until the first product needs it

    def get(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty_like(self._like)
        return self.buffer


def product_buffer(weight: torch.Tensor, cdt: torch.dtype) -> ProductBuffer | None:
    """The weight-gradient product's buffer for half-precision weights (allocated on first use); None when
    the weight is already fp32/fp64 (the product is computed in the accumulator's dtype)."""
    return None if weight.dtype == cdt else ProductBuffer(weight)


def fp32_output_gemm(acc: torch.Tensor) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32)`` with half-precision inputs can add into the fp32
    accumulator ``acc`` in its epilogue: on CUDA (torch has no CPU kernel of it), not while compiling."""
    return acc.is_cuda and acc.dtype == torch.float32 and not torch.compiler.is_compiling()


def _weighted_rows(rows: torch.Tensor, weights: torch.Tensor, span: int, cdt: torch.dtype) -> torch.Tensor:
    """``rows * weights / span`` ([C, H], in ``rows``' dtype): the per-token factors of the weight gradient.

    They scale the chunk's ``[C, H]`` hidden rows instead of its ``[C, V]`` softmax (one pass over
    ``C x V`` fewer). With 0/1 token weights and the power-of-two ``span`` both are exact, so the
    gradient is bitwise what scaling the softmax gives.
    """
    return (rows.to(cdt) * (weights * (1.0 / span)).unsqueeze(1)).to(rows.dtype)


def _mean_span(sl: slice) -> int:
    """The power of two >= the chunk's length: dividing by it is exact in every binary float."""
    return 1 << max(0, (sl.stop - sl.start - 1).bit_length())


def accumulate(
    acc: torch.Tensor,
    coef: torch.Tensor,
    rows: torch.Tensor,
    product: ProductBuffer | None,
    span: int,
    first: bool = False,
) -> None:
    """``acc += span * coef^T rows`` (``first``: ``acc = span * coef^T rows``, ``acc`` neither zeroed nor
    read); ``acc`` fp32/fp64; ``coef`` [C, V] in ``acc``'s or ``rows``' dtype, ``rows`` [C, H].

    For half-precision weights the product is one half-precision matmul into ``product`` (fp32
    accumulation inside the matmul, one rounding of the chunk's sum), then added in fp32: one rounding
    per chunk instead of a half-precision running sum. The first chunk's product is written (scaled by the
    power of two ``span``: exact), bitwise what adding it to a zeroed accumulator gives.
    """
    if product is None:
        if first:
            torch.mm(coef.t(), rows, out=acc)
            if span != 1:
                acc.mul_(span)
        else:
            acc.addmm_(coef.t(), rows, alpha=span)
        return
    if fp32_output_gemm(acc):
        # one GEMM with half-precision inputs and an fp32 output that adds the accumulator in its
        # epilogue: no extra [V, H] pass per chunk (the path below re-reads the accumulator); the first
        # chunk with beta=0, which neither reads the uninitialised accumulator nor propagates its NaN
        try:
            torch.addmm(
                acc, coef.to(rows.dtype).t(), rows, beta=0 if first else 1, alpha=span, out_dtype=torch.float32,
                out=acc,
            )  # fmt: skip
            return
        except RuntimeError:  # a torch or GPU without the fp32-output half-precision GEMM
            pass
    buffer = product.get()
    torch.mm(coef.to(buffer.dtype).t(), rows, out=buffer)
    if first and acc.is_cuda:  # one pass; a one-element (not 0-d) factor: computed in fp32, not fp16
        torch.mul(buffer, torch.full((1,), span, dtype=acc.dtype, device=acc.device), out=acc)
    elif first:  # CPU: the vectorised cast and an in-place scale (a mixed-dtype mul is 8x slower there)
        acc.copy_(buffer)
        if span != 1:
            acc.mul_(span)
    else:
        acc.add_(buffer, alpha=span)


def _scale_of(u: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``s`` with ``u == s * weights``, for a caller that guarantees the proportion; on the device, no sync.

    The pivot is the weight of largest magnitude, whatever its sign: with the z-loss the effective weights
    ``w (1 + 2 z_weight lse)`` are negative wherever ``lse < -1 / (2 z_weight)``, possibly on every token, and
    may be zero; ``s`` is 0 only when every weight is (then the dense part ``s G_W`` is 0 whatever ``s``).
    """
    if u.numel() == 0:
        return torch.zeros((), dtype=u.dtype, device=u.device)
    pivot = torch.argmax(weights.abs()).reshape(1)
    at = weights.gather(0, pivot).to(u.dtype)
    nonzero = at != 0
    return torch.where(nonzero, u.gather(0, pivot) / torch.where(nonzero, at, 1), 0).reshape(())


def _common_scale(u: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """``s`` with ``u == s * weights`` (within rounding), or None. Host syncs: for per-token callers only.

    Pivots on the weight of largest magnitude, as :func:`_scale_of` (the z-loss's effective weights may all
    be negative)."""
    if u.numel() == 0:
        return torch.zeros((), dtype=u.dtype, device=u.device)
    pivot = int(torch.argmax(weights.abs()))
    if float(weights[pivot]) == 0:
        return torch.zeros((), dtype=u.dtype, device=u.device) if not bool(u.any()) else None
    scale = u[pivot] / weights[pivot]
    tolerance = 8 * torch.finfo(u.dtype).eps * float(u.abs().max())
    return scale if float((u - scale * weights).abs().max()) <= tolerance else None
