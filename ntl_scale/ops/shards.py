"""Vocabulary shards: which columns this rank holds, in which process group; no math, no collective.

``DTensor`` inputs split on the vocabulary become the local tensor, the group and the first id
(:func:`dtensor_vocab_shard`); :func:`resolve_vocab_shard` does that for the losses.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["LocalShard", "dtensor_vocab_shard", "group_rank", "group_size", "is_dtensor", "resolve_vocab_shard"]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of an explicit process group; None means a single device (never the default group)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """Rank in an explicit process group; None means a single device."""
    return 0 if group is None else dist.get_rank(group)


# ------------------------------------------------------------------------------------------- DTensor


class LocalShard(NamedTuple):
    """A vocabulary shard as the ops take it: what :func:`dtensor_vocab_shard` returns."""

    local: torch.Tensor
    group: dist.ProcessGroup | None
    start: int
    vocab_size: int


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor``, without importing that package (1.4 s)."""
    package = getattr(dist, "tensor", None) if dist.is_available() else None
    dtensor = getattr(package, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def dtensor_vocab_shard(tensor: Any, *, dim: int = -1, name: str = "logits") -> LocalShard:
    """The local tensor, process group and first vocabulary id of a DTensor split on its vocabulary dim.

    Logits ``[..., V]`` as ``Shard(-1)`` or an output weight ``[V, H]`` as ``Shard(0)``, split over one mesh
    dimension (``torch.chunk``'s split), ``Replicate`` elsewhere; fully replicated: group None, start 0. Any
    other placement is a ValueError naming it and the fix. No communication.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    ndim = tensor.dim()
    vocab_dim = dim % ndim if ndim else 0
    placements = tuple(tensor.placements)
    fix = (
        f"redistribute it first (e.g. {name}.redistribute(placements=[Shard({dim})]) or "
        f"{name}.full_tensor()), or pass the local tensor with tp_group and vocab_start"
    )
    mesh_dims = _vocab_mesh_dims(tensor, dim, name, fix)
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


def _vocab_mesh_dims(tensor: Any, dim: int, name: str, fix: str) -> list[int]:
    """The mesh dims whose placement splits the vocabulary dim ``dim`` (``Shard``); every other one must be
    ``Replicate``. A ValueError naming the placement and ``fix`` otherwise (see :func:`dtensor_vocab_shard`)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    ndim = tensor.dim()
    vocab_dim = dim % ndim if ndim else 0
    placements = tuple(tensor.placements)
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
    return mesh_dims


def resolve_vocab_shard(
    tensor: torch.Tensor,
    vocab_size: int,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int | None,
    *,
    dim: int = -1,
    name: str = "logits",
) -> tuple[torch.Tensor, dist.ProcessGroup | None, int | None]:
    """``(local tensor, tp_group, vocab_start)`` for the ops: a DTensor's (:func:`dtensor_vocab_shard`) or as given."""
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
