"""Fused cross entropy + number-token statistics on a vocab shard, with an explicit TP group.

This is the one place where the softmax over the vocabulary is computed. Everything NTL needs
reduces to three per-token quantities of the logits (see ``docs/math.md``):

* ``ce``     = ``log sum_j exp(z_j) - z_y``                       (cross entropy)
* ``expect`` = ``sum_{k in N} p_k a_k``, ``p = softmax(z_N)``      (``a_k = d(v_k, t)`` for NTL-WAS,
  ``a_k = v_k`` for the expected value ``yhat`` of the dot-product losses)
* ``mass``   = ``sum_{k in N} softmax(z)_k``                       (number-token probability mass)

Under tensor parallelism each rank holds the columns ``[r*V/tp, (r+1)*V/tp)``. The forward needs
one MAX all-reduce of ``[max z, max z_N]`` and one SUM all-reduce of ``[S, z_y, S_N, A]`` per token,
the same two collectives Megatron's fused cross entropy uses for CE alone. The backward needs no
collective: every gradient is a local expression of the local logits and those reduced scalars
(the input-gradient reduction happens in the output layer's own backward).

The per-shard steps are plain functions in :class:`ShardMath` (PyTorch) and in
:mod:`ntl_scale.kernels.triton_ce_ntl` (Triton; :func:`use_triton` picks one per call from ``impl``).
The TP collectives of the loss are written here only, behind two helpers: :func:`all_reduce_max`
(``[T, 2]``) and :func:`all_reduce_sums` (``[T, 4]``), used by :class:`_FusedCENTL`, by the chunked op
(:mod:`ntl_scale.linear`) and around the Triton statistics (:func:`kernel_shard_stats`).
``tp_group=None`` (or a group of size 1) is the same code without collectives.

``DTensor`` inputs (``torch.distributed.tensor``): :func:`dtensor_vocab_shard` turns logits sharded on the
vocabulary (``Shard(-1)``) or an output weight sharded on its rows (``Shard(0)``) into what the ops
take: the local tensor, the process group of the sharding mesh dimension and the shard's first
vocabulary id (DTensor's own split, uneven ones included); :func:`resolve_vocab_shard` does that for
the losses and checks the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ._tracing import is_tracing
from .kernels import triton_ce_ntl
from .options import check_chunk_tokens as options_check_chunk_tokens
from .options import check_impl

__all__ = [
    "KERNEL_FEATURES",
    "LocalShard",
    "ShardInputs",
    "ShardMath",
    "all_reduce_max",
    "all_reduce_sums",
    "check_chunk_tokens",
    "dtensor_vocab_shard",
    "fused_shard_stats",
    "index_add",
    "is_dtensor",
    "kernel_shard_stats",
    "resolve_vocab_shard",
    "use_triton",
]

# Temporaries of one chunk hold at most this many elements (64 MiB in fp32): the forward and the
# backward walk over the logits in token chunks so that no full-size fp32 copy is made.
_CHUNK_ELEMENTS = 1 << 24


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the loss math: float64 for float64 logits, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def index_add(acc: torch.Tensor, dim: int, index: torch.Tensor, values: torch.Tensor) -> None:
    """``acc.index_add_(dim, index, values)``, with an int32 index on the CPU.

    torch's CPU ``index_add_`` is 14x-1000x slower with an int64 index than with an int32 one
    (measured here with 2 threads: 78 ms vs 0.07 ms for 512 rows of a 32768 x 512 weight gradient,
    8.4 ms vs 0.6 ms for 10 columns of a 4096 x 32768 logits gradient, the latter a quarter of a pass
    over those logits). The result is the same, bitwise, for float32/float64 accumulators and for any
    dtype with unique indices; with repeated indices into a bfloat16/float16 accumulator the two index
    types round differently (each deterministic). Our callers add repeated label rows only into the
    float32/float64 weight-gradient accumulator. GPUs keep the index as given.
    """
    acc.index_add_(dim, index.int() if acc.device.type == "cpu" else index, values)


def check_chunk_tokens(chunk_tokens: int | None) -> None:
    """Refuses a ``chunk_tokens`` that is not None or a whole number >= 1 (the spec's check:
    :func:`ntl_scale.options.check_chunk_tokens`)."""
    options_check_chunk_tokens(chunk_tokens)


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of an explicit process group; None means a single device (never the default group)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """Rank in an explicit process group; None means a single device."""
    return 0 if group is None else dist.get_rank(group)


# ------------------------------------------------------------------------------------------- DTensor


class LocalShard(NamedTuple):
    """A vocabulary shard as the ops take it: what :func:`dtensor_vocab_shard` returns.

    Attributes:
        local: the rank's local tensor (``DTensor.to_local()``: differentiable, its gradient flows back
            to the DTensor with the DTensor's placements).
        group: the process group of the mesh dimension that splits the vocabulary; None when the
            vocabulary is not split (a replicated DTensor: full logits on every rank).
        start: the global id of the shard's first vocabulary entry (0 when not split).
        vocab_size: the global vocabulary size (the DTensor's size along the vocabulary dimension).
    """

    local: torch.Tensor
    group: dist.ProcessGroup | None
    start: int
    vocab_size: int


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (False where torch has no distributed).

    Never imports ``torch.distributed.tensor``: no DTensor exists before that package has been imported,
    and importing it (sympy and some 500 modules) cost the first call of every loss 1.4 s and 30-45 MiB
    of resident memory on a CPU (issue 43).
    """
    package = getattr(dist, "tensor", None) if dist.is_available() else None
    dtensor = getattr(package, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def dtensor_vocab_shard(tensor: Any, *, dim: int = -1, name: str = "logits") -> LocalShard:
    """The local tensor, process group and first vocabulary id of a DTensor split on its vocabulary dim.

    For logits ``[..., V]`` sharded ``Shard(-1)`` (``dim=-1``, torch's ``loss_parallel`` and torchtitan's
    DTensor backends) or an output weight ``[V, H]`` sharded ``Shard(0)`` (``dim=0``). The vocabulary
    must be split over exactly one mesh dimension; the group is that mesh dimension's
    (``mesh.get_group(mesh_dim)``) and the shard's offset is DTensor's own
    (``compute_local_shape_and_global_offset``): ``torch.chunk``'s split, ``ceil(V / n)`` columns per
    rank and what is left on the last ones (``V=13`` over 2: 7 and 6). Other mesh dimensions must be
    ``Replicate``. A DTensor replicated on every mesh dimension is the full vocabulary on every rank:
    group None, start 0. No communication.

    Raises:
        ValueError: a ``Partial`` placement (unreduced sums); a ``Shard`` of another dimension; the
            vocabulary split over more than one mesh dimension or strided (``_StridedShard``); a split
            that leaves a rank without a column (known on every rank, so all raise together); each
            message names the placement and the fix.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    ndim = tensor.dim()
    vocab_dim = dim % ndim if ndim else 0
    placements = tuple(tensor.placements)
    fix = (
        f"redistribute it first (e.g. {name}.redistribute(placements=[Shard({dim})]) or "
        f"{name}.full_tensor()), or pass the local tensor with tp_group and vocab_start"
    )
    mesh_dims = []
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, Partial):
            raise ValueError(
                f"{name} is a DTensor with placements {placements}: Partial on mesh dim {mesh_dim} holds "
                f"unreduced partial sums, but the loss needs the values themselves, split on the vocabulary "
                f"(Shard({dim})) or replicated; {fix}"
            )
        if isinstance(placement, Shard) and placement.dim % ndim == vocab_dim:
            if type(placement) is not Shard:  # _StridedShard (FSDP2 + TP): columns not contiguous
                raise ValueError(
                    f"{name} is a DTensor with placements {placements}: {placement!r} on mesh dim {mesh_dim} splits "
                    f"the vocabulary dim {dim} into non-contiguous pieces; {fix}"
                )
            mesh_dims.append(mesh_dim)
            continue
        raise ValueError(
            f"{name} is a DTensor with placements {placements}: {placement!r} on mesh dim {mesh_dim} shards "
            f"another dimension than the vocabulary (dim {dim} of shape {tuple(tensor.shape)}); the loss needs "
            f"Shard({dim}) (vocabulary-parallel) or Replicate on every mesh dim; {fix}"
        )
    if len(mesh_dims) > 1:
        raise ValueError(
            f"{name} is a DTensor with placements {placements}: the vocabulary dim {dim} is split over mesh dims "
            f"{mesh_dims}, the loss takes one process group; {fix}"
        )
    vocab_size = int(tensor.shape[vocab_dim])
    local = tensor.to_local()
    if not mesh_dims:
        return LocalShard(local, None, 0, vocab_size)
    mesh = tensor.device_mesh
    parts = mesh.size(mesh_dims[0])
    if -(-vocab_size // parts) * (parts - 1) >= vocab_size:  # known on every rank: all raise, none waits
        raise ValueError(
            f"{name} is a DTensor whose vocabulary of {vocab_size} split over {parts} ranks leaves a rank without a "
            f"column (DTensor gives ceil({vocab_size}/{parts}) per rank); pad the vocabulary to at least "
            f"{-(-vocab_size // parts) * (parts - 1) + 1} (e.g. a multiple of {parts})"
        )
    _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    return LocalShard(local, mesh.get_group(mesh_dims[0]), int(offset[vocab_dim]), vocab_size)


def resolve_vocab_shard(
    tensor: torch.Tensor,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int | None,
    *,
    dim: int = -1,
    name: str = "logits",
) -> tuple[torch.Tensor, dist.ProcessGroup | None, int | None]:
    """``(local tensor, tp_group, vocab_start)`` for the ops: the DTensor's (:func:`dtensor_vocab_shard`) or as given.

    A plain tensor comes back unchanged with ``tp_group`` and ``vocab_start``. For a DTensor the group
    and offset come from its placements, so passing ``tp_group`` or ``vocab_start`` as well is refused,
    and the number table's ``vocab_size`` must equal the DTensor's global vocabulary.

    Raises:
        ValueError: see :func:`dtensor_vocab_shard`; ``tp_group``/``vocab_start`` given with a DTensor;
            a table built for another vocabulary size (the shard's included).
    """
    if not is_dtensor(tensor):
        return tensor, tp_group, vocab_start
    if tp_group is not None or vocab_start is not None:
        raise ValueError(
            f"{name} is a DTensor, which carries its process group and shard offset, but tp_group={tp_group!r} "
            f"and vocab_start={vocab_start!r} were passed as well; drop them (or pass {name}.to_local() with them)"
        )
    shard = dtensor_vocab_shard(tensor, dim=dim, name=name)
    if vocab_size != shard.vocab_size:
        width = shard.local.shape[dim]
        what = (
            f"this rank's shard width ({width}): the table must describe the whole vocabulary, not the shard"
            if vocab_size == width
            else "neither that nor this rank's shard width " + str(width)
        )
        raise ValueError(
            f"the number table's vocab_size is {vocab_size} but the DTensor {name} has a vocabulary of "
            f"{shard.vocab_size} (global shape {tuple(tensor.shape)}), {what}; build the table for the full "
            f"vocabulary: NumberVocab.from_tokenizer(tokenizer, vocab_size={shard.vocab_size}) or "
            f"vocab.with_vocab_size({shard.vocab_size})"
        )
    group = shard.group
    start = None if group is None or group_size(group) == 1 else shard.start
    return shard.local, group, start


@dataclass
class ShardInputs:
    """What the fused op needs besides the logits, already resolved to the local shard.

    Attributes:
        labels: global label ids, LongTensor ``[T]`` (``ignore_index`` already replaced by 0).
        valid: bool ``[T]``: label is not ignored.
        number_cols: local column indices of the number tokens in this shard, LongTensor ``[n]``.
        a_table: per-token weights ``a_k`` of the local number columns, ``[T, n]`` (may be an
            expanded view).
        start: first global id of this shard.
        smoothing: CE label smoothing ``eps`` over the whole vocabulary (0: off; ``docs/math.md``).
    """

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

    ``local`` is :func:`~ntl_scale.kernels.triton_ce_ntl.shard_stats`'s ``[T, 6]``; the same two
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``max [T]``, number max ``[T]`` (-inf kept) and ``sums [T, 4]`` of a logits shard, with the Triton kernel.

    What :meth:`ShardMath.local_max` and :meth:`ShardMath.local_sums` compute with the two
    all-reduces, in one pass over the logits; ``ShardMath.finalize`` turns them into the terms.
    """
    local = triton_ce_ntl.shard_stats(
        logits, inputs.local_target(logits.shape[1]), inputs.number_cols, inputs.a_table, block_v=block_v
    )
    return combine_kernel_stats(local, tp_group)


KERNEL_FEATURES = ("z_loss_weight",)
"""The CE features the Triton path computes (the z-loss needs only the reduced log-sum-exp and adds to the
coefficient of the softmax); the others (label smoothing, soft-capping) run the PyTorch code."""


def use_triton(impl: str, tensor: torch.Tensor, features: tuple[str, ...] = ()) -> bool:
    """Whether an op called with ``impl`` runs the Triton kernels on ``tensor``: the per-call kernel choice.

    ``"torch"``: never. ``"auto"``: where :func:`ntl_scale.kernels.triton_ce_ntl.enabled` says (nowhere
    until the kernels have passed the GPU suite), and never with a CE feature the kernels lack
    (``features``: :attr:`ntl_scale.options.NTLOptions.ce_features`, less :data:`KERNEL_FEATURES`; the
    PyTorch code computes those).
    ``"triton"``: always, except while ``torch.compile`` traces (Inductor compiles the PyTorch code into
    its own fused kernels).

    Raises:
        ValueError: ``impl`` is not one of ``auto``, ``torch``, ``triton``; ``impl="triton"`` for a
            tensor the kernels cannot run on (not on CUDA, outside Triton's interpreter), or with a CE
            feature in ``features`` the kernels lack (label smoothing, soft-capping).
        ImportError: ``impl="triton"`` without ``triton`` installed.
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


def shift_into(src: torch.Tensor, shift: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = src - shift[:, None]``, with ``out`` in the compute dtype and ``src`` possibly half.

    On the CPU a mixed-dtype ``sub(out=)`` takes TensorIterator's casting loop, about 8x the time of a
    converting ``copy_`` and an fp32 ``sub_`` (38 ms vs 5 ms for 256 x 64128 bf16, one thread); the two
    give the same bits (the bf16 -> fp32 conversion is exact). On a GPU the mixed-dtype ``sub`` is kept, one
    kernel there; that it is the faster there is an expectation, not measured on a GPU.
    Not while a graph is traced (``make_fx``, which torchtitan's graph trainer runs over the chunked loss,
    or ``torch.compile``): the trace inlines an autograd Function's forward, and its replay records the
    ops for autograd, which an ``out=`` op refuses ("functions with out=... arguments don't support
    automatic differentiation").
    """
    if (src.dtype == out.dtype or src.device.type != "cpu") and not is_tracing():
        return torch.sub(src, shift.unsqueeze(1), out=out)
    return out.copy_(src).sub_(shift.unsqueeze(1))


class ShardMath:
    """Per-shard steps of the fused op: pure functions, no communication."""

    @staticmethod
    def chunk_rows(num_tokens: int, num_cols: int, chunk_tokens: int | None) -> list[slice]:
        """Token slices whose ``[chunk, V_local]`` temporaries stay below a fixed element budget."""
        check_chunk_tokens(chunk_tokens)
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
        """The number-column max with -inf (no number column, or every number logit -inf) replaced by 0.

        NaN and +inf are kept: they make the number statistics NaN, so NTL is NaN when its logits are.
        """
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
        """``[T, 4]`` partial sums ``[S, z_y, S_N, A]`` of this shard, and the exponentiated numbers.

        With ``smoothing`` (label smoothing) ``[T, 6]``: also ``sum_j z_j`` over the shard and the shard's
        width, so that the one SUM all-reduce gives the whole vocabulary's sum and size.
        With ``inplace`` the logits buffer is overwritten with ``exp(z - max)`` for the backward;
        otherwise ``exp(z - max)`` goes through ``buffer`` (compute dtype, at least the longest of
        ``rows``; default: a new one).
        """
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

        ``lse = log sum_j exp(z_j)`` over the whole vocabulary (0 without ``need_full``). With label
        smoothing ``eps`` (``sums`` ``[T, 6]``: the vocabulary's sum of logits and size ``V``),
        ``ce = lse - (1 - eps) z_y - eps/V sum_j z_j``.
        ``hit``: the label's logit is the largest of the whole vocabulary (greedy prediction is
        right; ties count as right), known from ``z_y`` and the global max without a collective.
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
        expect)`` on number columns; ``d mass/dz_j = pi_j [j in N] - mass * pi_j``. ``pi`` is the full
        softmax, ``p`` the softmax over the number columns, ``eps`` the label smoothing (``V``:
        ``saved["vocab"]``, the whole vocabulary's size). ``grads``: ``(g_ce, g_expect, g_mass[, g_lse])``.
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
        if fast:  # Triton (ntl_scale/kernels): the statistics in one pass, the same two all-reduces
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
            _raise_if_not_finite(maxes, sums, need_full)
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


def _raise_if_not_finite(maxes: torch.Tensor, sums: torch.Tensor, need_full: bool) -> None:
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


class _NumberColumnsNTL(torch.autograd.Function):
    """NTL alone on logits ``[..., V_local]``: the number columns are read once, the gradient written once.

    The statistics of :meth:`ShardMath.local_max`, :meth:`ShardMath.local_sums` and
    :meth:`ShardMath.finalize` without the full vocabulary (``ce`` and ``mass`` are 0), with the same
    two all-reduces. The Function takes the logits in the caller's shape and returns its gradient in
    that shape, a new tensor rather than a view: autograd can then add another loss's gradient of the
    same logits (``F.cross_entropy + number_token_loss``) into it in place, where a view's gradient
    (the ``reshape`` to ``[T, V]`` ahead of :class:`_FusedCENTL`) kept its base alive and cost one more
    logits-sized buffer and pass. Nothing logits-sized is saved for the backward, and non-contiguous
    logits (shifted ones) are not copied.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, logits: torch.Tensor, inputs: ShardInputs, check_finite: bool, tp_group: dist.ProcessGroup | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        cols = inputs.number_cols
        cdt = compute_dtype(logits.dtype)
        tokens = logits.numel() // logits.shape[-1]  # not reshape(-1, n): a shard may hold no number column
        number_logits = logits.index_select(-1, cols).reshape(tokens, cols.numel()).to(cdt)
        rows = [slice(0, number_logits.shape[0])]
        maxes = all_reduce_max(ShardMath.local_max(number_logits, number_logits, rows, False), tp_group)
        number_max = ShardMath.safe_number_max(maxes[:, 1])
        sums, number_exp = ShardMath.local_sums(
            number_logits, number_logits, inputs, maxes[:, 0], number_max, rows, False, False
        )
        all_reduce_sums(sums, tp_group)
        if check_finite:
            _raise_if_not_finite(maxes, sums, False)
        ce, expect, mass, hit, lse = ShardMath.finalize(maxes[:, 0], sums, number_max, inputs.valid, False)
        ctx.mark_non_differentiable(hit)
        ctx.inputs, ctx.shape, ctx.dtype = inputs, logits.shape, logits.dtype
        ctx.save_for_backward(number_exp, sums[:, 2], expect)
        return ce, expect, mass, hit, lse

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        g_expect = grads[1]  # ce and mass are constants here: only expect carries gradient
        number_exp, number_total, expect = ctx.saved_tensors
        inputs: ShardInputs = ctx.inputs
        out = torch.zeros(ctx.shape, dtype=ctx.dtype, device=expect.device)
        if g_expect is not None:
            saved = {"number_exp": number_exp, "number_total": number_total, "expect": expect}
            number_grad = ShardMath.number_grad(slice(None), saved, inputs, g_expect.to(expect.dtype))
            # through a temporary [T, V] view of the new tensor; the tensor itself goes back, no view
            index_add(out.view(-1, ctx.shape[-1]), 1, inputs.number_cols, number_grad.to(ctx.dtype))
        return out, None, None, None


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(ce, expect, mass, hit, lse)`` of a ``[T, V_local]`` logits shard; differentiable.

    Args:
        logits: the local logits shard, ``[T, V_local]``, fp32/bf16/fp16/fp64 (without ``need_full``
            any ``[..., V_local]``, the tokens in row-major order: its gradient keeps that shape).
        inputs: the resolved per-shard inputs.
        need_full: compute the full softmax (for CE and the number-mass reweighing); if False only
            the number columns are read (:class:`_NumberColumnsNTL`; ``inplace`` and ``chunk_tokens``
            do not apply).
        inplace: overwrite the logits buffer with ``exp(z - max)`` and reuse it for the gradient
            (fp32/fp64 only), like Megatron's vocab-parallel cross entropy; the logits are garbage
            afterwards.
        check_finite: raise when logits hold NaN/Inf (one host sync); default off: NaN propagates.
        tp_group: the tensor-parallel group over which the vocabulary is split; None = one device.
        chunk_tokens: tokens per chunk of the temporaries (default: a 64 MiB budget).
        impl: ``"auto"``, ``"torch"`` or ``"triton"``: the code of the statistics and the gradient
            (:func:`use_triton`); the NTL-only path (``need_full=False``) is PyTorch code always.
        features: the CE features on (:attr:`ntl_scale.options.NTLOptions.ce_features`), which the
            kernels lack (:func:`use_triton`). Label smoothing itself is ``inputs.smoothing``.

    Returns:
        ``ce``, ``expect``, ``mass``, each ``[T]`` in the compute dtype, the bool ``hit`` (the
        label is the arg-max of the full vocabulary; only with ``need_full``) and ``lse``, the whole
        vocabulary's log-sum-exp (0 without ``need_full``; differentiable), identical on every TP rank.
    """
    check_chunk_tokens(chunk_tokens)
    if not need_full:
        return _NumberColumnsNTL.apply(logits, inputs, check_finite, tp_group)
    kernels = use_triton(impl, logits, features)
    return _FusedCENTL.apply(logits, inputs, need_full, inplace, check_finite, tp_group, chunk_tokens, kernels)
