"""Per-shard steps of the fused CE + NTL op (the PyTorch path), no communication; the math is in
docs/math.md and the all-reduces between the steps are :mod:`ntl_scale.ops.logits`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._runtime import is_tracing
from ..options import check_option

__all__ = ["ShardInputs", "ShardMath", "compute_dtype", "index_add", "shift_into"]

# Temporaries of one chunk hold at most this many elements (64 MiB in fp32): the forward and the
# backward walk over the logits in token chunks so that no full-size fp32 copy is made.
_CHUNK_ELEMENTS = 1 << 24


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the loss math: float64 for float64 logits, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def index_add(acc: torch.Tensor, dim: int, index: torch.Tensor, values: torch.Tensor) -> None:
    """``acc.index_add_(dim, index, values)``, with an int32 index on the CPU (14x-1000x faster than int64 there;
    the same bits into float32/float64 accumulators, the only ones with repeated indices here)."""
    acc.index_add_(dim, index.int() if acc.device.type == "cpu" else index, values)


@dataclass
class ShardInputs:
    """What the fused op needs besides the logits, already resolved to the local shard."""

    labels: torch.Tensor
    valid: torch.Tensor
    number_cols: torch.Tensor
    a_table: torch.Tensor
    start: int
    smoothing: float = 0.0

    def rows(self, sl: slice) -> ShardInputs:
        """The inputs of the tokens in ``sl``."""
        return ShardInputs(
            self.labels[sl], self.valid[sl], self.number_cols, self.a_table[sl], self.start, self.smoothing
        )

    def owned_targets(self, rows: slice, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For the tokens in ``rows``: whether this shard holds the label's column, and that column."""
        local_label = self.labels[rows] - self.start
        owned = self.valid[rows] & (local_label >= 0) & (local_label < width)
        return owned, local_label.clamp(0, width - 1)

    def local_target(self, width: int) -> torch.Tensor:
        """The label's local column per token, -1 where this shard does not own it or the label is ignored
        (the Triton kernels' ``target``)."""
        owned, column = self.owned_targets(slice(None), width)
        return torch.where(owned, column, torch.full_like(column, -1))


def shift_into(src: torch.Tensor, shift: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = src - shift[:, None]``, with ``out`` in the compute dtype and ``src`` possibly half.

    On the CPU a converting ``copy_`` then ``sub_`` (8x faster than a mixed-dtype ``sub(out=)``, same bits);
    not while a graph is traced, where ``out=`` ops refuse autograd.
    """
    if (src.dtype == out.dtype or src.device.type != "cpu") and not is_tracing():
        return torch.sub(src, shift.unsqueeze(1), out=out)
    return out.copy_(src).sub_(shift.unsqueeze(1))


class ShardMath:
    """Per-shard steps of the fused op: pure functions, no communication."""

    @staticmethod
    def chunk_rows(num_tokens: int, num_cols: int, chunk_tokens: int | None) -> list[slice]:
        """Token slices whose ``[chunk, V_local]`` temporaries stay below a fixed element budget."""
        check_option("chunk_tokens", chunk_tokens)
        step = chunk_tokens or max(1, _CHUNK_ELEMENTS // max(num_cols, 1))
        return [slice(i, min(i + step, num_tokens)) for i in range(0, num_tokens, step)]

    @staticmethod
    def chunk_buffer(
        logits: torch.Tensor, rows: list[slice], dtype: torch.dtype, width: int | None = None
    ) -> torch.Tensor:
        """An uninitialised ``[largest chunk, width]`` work buffer (default width: ``logits``' columns)."""
        longest = max([sl.stop - sl.start for sl in rows]) if rows else 0
        width = logits.shape[1] if width is None else width
        return torch.empty(longest, width, dtype=dtype, device=logits.device)

    @staticmethod
    def local_max(
        logits: torch.Tensor, number_logits: torch.Tensor, rows: list[slice], need_full: bool
    ) -> torch.Tensor:
        """``[T, 2]``: the max over the shard (0 when not needed) and over its number columns."""
        cdt = number_logits.dtype
        maxes = torch.zeros(logits.shape[0], 2, dtype=cdt, device=logits.device)
        if need_full:
            for sl in rows:
                # amax, not max: max(dim) also finds the arg-max, 5x the CPU time (0.12 s vs 0.025 s at 4096 x 32768)
                maxes[sl, 0] = logits[sl].amax(dim=-1).to(cdt)
        if number_logits.shape[1] > 0:
            maxes[:, 1] = number_logits.amax(dim=-1)
        else:
            maxes[:, 1] = float("-inf")
        return maxes

    @staticmethod
    def safe_number_max(number_max: torch.Tensor) -> torch.Tensor:
        """The number-column max with -inf replaced by 0 (NaN and +inf kept: NTL is NaN when its logits are)."""
        return torch.where(number_max == float("-inf"), torch.zeros_like(number_max), number_max)

    @staticmethod
    def local_sums(
        logits: torch.Tensor,
        number_logits: torch.Tensor,
        inputs: ShardInputs,
        max_all: torch.Tensor,
        number_max: torch.Tensor,
        rows: list[slice],
        need_full: bool,
        inplace: bool,
        buffer: torch.Tensor | None = None,
        smoothing: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 4]`` partial sums ``[S, z_y, S_N, A]`` of this shard, and the exponentiated numbers."""
        cdt = number_logits.dtype
        num_tokens, width = logits.shape
        sums = torch.zeros(num_tokens, 6 if smoothing else 4, dtype=cdt, device=logits.device)
        if smoothing:
            sums[:, 5] = width
        if need_full:  # z_y is CE's: NTL alone reads the logits once, through the number columns
            owned, local_label = inputs.owned_targets(slice(None), width)
            target = logits.gather(1, local_label.unsqueeze(1)).squeeze(1).to(cdt)
            sums[:, 1] = torch.where(owned, target, torch.zeros_like(target))
        if need_full:
            # One reused chunk buffer (or the logits themselves): fresh allocations per chunk would
            # cost a page fault per page on every call.
            if inplace:
                buffer = None
            elif buffer is None:
                buffer = ShardMath.chunk_buffer(logits, rows, cdt)
            for sl in rows:
                chunk = logits[sl]
                work = chunk if buffer is None else buffer[: chunk.shape[0]]
                if smoothing:  # before an in-place pass overwrites the logits
                    sums[sl, 4] = chunk.sum(dim=-1, dtype=cdt)
                shift_into(chunk, max_all[sl], work)
                sums[sl, 0] = work.exp_().sum(dim=-1)
        number_exp = torch.exp(number_logits - number_max.unsqueeze(1))
        sums[:, 2] = number_exp.sum(dim=-1)
        sums[:, 3] = (number_exp * inputs.a_table).sum(dim=-1)
        return sums, number_exp

    @staticmethod
    def finalize(
        max_all: torch.Tensor,
        sums: torch.Tensor,
        number_max: torch.Tensor,
        valid: torch.Tensor,
        need_full: bool,
        smoothing: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token ``ce``, ``expect``, ``mass``, ``hit`` and ``lse`` from the reduced maxima and sums.

        ``ce = lse - (1 - eps) z_y - eps/V sum_j z_j``; ``hit``: the label's logit ties the global max (every
        tied label is a hit, docs/math.md "Number accuracy").
        """
        total, target, number_total, weighted = sums[:, :4].unbind(dim=1)
        zero = torch.zeros_like(total)
        if need_full:
            lse = torch.log(total) + max_all
            if smoothing:
                smooth = smoothing * (sums[:, 4] / sums[:, 5])
                ce = torch.where(valid, lse - (1 - smoothing) * target - smooth, zero)
            else:
                ce = torch.where(valid, lse - target, zero)
            mass = number_total * torch.exp(number_max - max_all) / total
            hit = valid & (target >= max_all)
        else:
            ce, mass, hit, lse = zero, zero, torch.zeros_like(valid), zero
        # 0 only when no number logit is finite (NTL is then 0); a NaN total (a NaN or +inf number
        # logit) gives a NaN expect, so NTL is NaN when its inputs are, without a host check
        no_numbers = number_total == 0
        expect = torch.where(no_numbers, zero, weighted / torch.where(no_numbers, 1, number_total))
        return ce, expect, mass, hit, lse

    @staticmethod
    def number_grad(
        sl: slice, saved: dict[str, torch.Tensor], inputs: ShardInputs, g_expect: torch.Tensor
    ) -> torch.Tensor:
        """``g_expect * d expect/dz_k = g_expect * p_k (a_k - expect)`` on the local number columns."""
        number_total = saved["number_total"][sl].unsqueeze(1)
        number_probs = saved["number_exp"][sl] / torch.where(number_total == 0, 1, number_total)
        spread = inputs.a_table[sl] - saved["expect"][sl].unsqueeze(1)
        return g_expect[sl].unsqueeze(1) * number_probs * spread

    @staticmethod
    def grad_chunk(
        work: torch.Tensor,
        sl: slice,
        saved: dict[str, torch.Tensor],
        inputs: ShardInputs,
        grads: tuple[torch.Tensor, ...],
        smoothing: float = 0.0,
    ) -> None:
        """Turns ``work = exp(z - max)`` of one chunk into the gradient of
        ``sum(g_ce*ce + g_expect*expect + g_mass*mass + g_lse*lse)`` w.r.t. those logits, in place.

        ``d ce/dz_j = pi_j - (1 - eps) [j = y] - eps/V``; ``d lse/dz_j = pi_j``; ``d expect/dz_k = p_k (a_k -
        expect)`` on number columns; ``d mass/dz_j = pi_j [j in N] - mass * pi_j``.
        """
        g_ce, g_mass = grads[0][sl], grads[2][sl]
        coef = g_ce - g_mass * saved["mass"][sl]
        if len(grads) > 3:
            coef = coef + grads[3][sl]
        cols = inputs.number_cols
        inv_total = saved["total"][sl].reciprocal().unsqueeze(1)
        number_grad = g_mass.unsqueeze(1) * work[:, cols] * inv_total
        number_grad += ShardMath.number_grad(sl, saved, inputs, grads[1])
        work.mul_(inv_total * coef.unsqueeze(1))  # one pass: pi * coef
        if smoothing:  # the uniform part of the smoothed target, on every column of every shard
            work.sub_((g_ce * (smoothing / saved["vocab"][sl])).unsqueeze(1).to(work.dtype))
        owned, local_label = inputs.owned_targets(sl, work.shape[1])
        # -(1 - eps) g_ce at each owned label; rows whose label another shard owns add 0 at column 0 (no
        # nonzero() sync)
        column = torch.where(owned, local_label, torch.zeros_like(local_label)).unsqueeze(1)
        label = -(1 - smoothing) * g_ce
        work.scatter_add_(1, column, torch.where(owned, label, torch.zeros_like(g_ce)).unsqueeze(1).to(work.dtype))
        index_add(work, 1, cols, number_grad)
