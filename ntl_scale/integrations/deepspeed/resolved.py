"""What a run derives from its config and from where it runs (``run_dir/resolved.json``): the world,
the accumulation and global batch, bf16, the DeepSpeed JSON as handed to ``deepspeed.initialize`` and how
the run starts. The config itself stays as the user gave it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

from ...atomic import write_json_atomically
from ...training.config import TrainConfig
from .resume_layout import Layout

__all__ = ["RESOLVED_FILE", "Resolved", "accelerator_has_bf16", "resolve_deepspeed_config", "resolve_run"]

RESOLVED_FILE = "resolved.json"


@dataclass(frozen=True)
class Resolved:
    """The values a run resolved; ``run_dir/resolved.json``."""

    world_size: int
    """All ranks (``tensor_parallel x data_parallel``)."""
    tensor_parallel: int
    """Ranks that share each layer (DeepSpeed AutoTP; ``train.tensor_parallel_size``)."""
    data_parallel: int
    """Ranks that read different micro-batches."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step on each data-parallel rank."""
    global_batch: int
    """Sequences per optimizer step over all data-parallel ranks."""
    bf16: bool
    """bf16 mixed precision (the DeepSpeed config's ``bf16.enabled``)."""
    deepspeed: dict[str, Any]
    """The DeepSpeed config handed to ``deepspeed.initialize``."""
    resume: str | None = None
    """``None`` (from step 0), ``"same"`` (the checkpoint as written) or ``"universal"`` (re-partitioned
    for another layout); see :func:`~ntl_scale.integrations.deepspeed.resume_layout.plan_resume`."""

    @property
    def layout(self) -> Layout:
        """How the run is split, as recorded next to its checkpoints."""
        return Layout(self.data_parallel, self.tensor_parallel, self.global_batch)

    def resuming(self, plan: str | None) -> Resolved:
        """This record for a run that resumes as ``plan`` says (``"universal"``: DeepSpeed loads the
        re-partitioned copy, ``checkpoint.load_universal``)."""
        deepspeed = copy.deepcopy(self.deepspeed)
        if plan == "universal":
            deepspeed.setdefault("checkpoint", {})["load_universal"] = True
        return dataclasses.replace(self, deepspeed=deepspeed, resume=plan)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str) -> None:
        """Writes the record as JSON, atomically."""
        write_json_atomically(self.to_dict(), path)


def resolve_deepspeed_config(
    ds: dict[str, Any], train: TrainConfig, world_size: int, *, bf16_default: bool = False
) -> dict[str, Any]:
    """Fills DeepSpeed's ``"auto"`` values from the training config; a contradiction is an error."""
    ds = copy.deepcopy(ds)
    tp = train.tensor_parallel_size
    if world_size % tp:
        raise ValueError(
            f"train.tensor_parallel_size={tp} does not divide the {world_size} ranks; launch a multiple of {tp} "
            "processes (the rest of the world is data parallel)"
        )
    section = ds.setdefault("tensor_parallel", {})
    given = section.get("autotp_size", tp)
    if given not in (tp, "auto") and not (tp == 1 and given == 0):  # DeepSpeed's own "off" is 0
        raise ValueError(
            f"DeepSpeed tensor_parallel.autotp_size={given!r} contradicts train.tensor_parallel_size={tp}; "
            'drop it from the JSON or set it to "auto"'
        )
    if tp > 1:
        # Any ZeRO stage: DeepSpeed >= 0.19.4 trains AutoTP with ZeRO-3 (its engine.py says so; tested here
        # equal to TP=1). ZeRO-3 then partitions each TP shard over the data-parallel ranks and the
        # replicated weights (norms, embeddings) over all ranks.
        if section.get("vocab_parallel_lm_head") is False:
            raise ValueError(
                "tensor_parallel.vocab_parallel_lm_head=false in the DeepSpeed JSON: ntl_scale computes CE + NTL on "
                "the vocabulary shard; remove the key"
            )
        section.update(autotp_size=tp, vocab_parallel_lm_head=True)
    elif not section:
        del ds["tensor_parallel"]  # nothing asked for: the JSON stays as it was
    world_size //= tp
    accumulation = train.accumulation_for(world_size)
    wanted = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": train.micro_batch_size * accumulation * world_size,
    }
    for key, value in wanted.items():
        given = ds.get(key, "auto")
        if given == "auto":
            ds[key] = value
        elif given != value:
            raise ValueError(
                f"DeepSpeed config sets {key}={given!r} but the run config implies {value} "
                f"(train.micro_batch_size={train.micro_batch_size}, train.gradient_accumulation_steps="
                f'{accumulation}, {world_size} ranks); set it to "auto" or make them agree'
            )
    if tp > 1:
        # DeepSpeed 0.19 checks train_batch_size against micro x accumulation x *all* ranks while AutoTP
        # is set up (its data-parallel size is known only later); let it derive the value.
        ds.pop("train_batch_size", None)
    bf16 = ds.get("bf16", {})
    if bf16.get("enabled") == "auto":
        bf16["enabled"] = bf16_default if train.bf16 is None else train.bf16
    elif train.bf16 is not None and bool(bf16.get("enabled", False)) != train.bf16:
        raise ValueError(
            f'DeepSpeed bf16.enabled={bf16.get("enabled")} contradicts train.bf16={train.bf16}; use "auto"'
        )
    params = ds.get("optimizer", {}).get("params", {})
    if params.get("lr", "auto") == "auto":
        params["lr"] = train.lr
    elif float(params["lr"]) != train.lr:
        raise ValueError(f'DeepSpeed optimizer lr={params["lr"]} contradicts train.lr={train.lr}; use "auto"')
    return ds


def accelerator_has_bf16(device: torch.device) -> bool:
    """What ``train.bf16: null`` (auto) means on ``device``: True on an accelerator that supports bf16
    (DeepSpeed's ``get_accelerator().is_bf16_supported()``), False on the CPU."""
    if device.type == "cpu":
        return False
    import deepspeed

    return bool(deepspeed.get_accelerator().is_bf16_supported())


def resolve_run(train: TrainConfig, world_size: int, *, bf16_default: bool) -> Resolved:
    """Resolves the DeepSpeed JSON ``train.deepspeed_config`` for ``world_size`` ranks; ``train`` is read,
    never changed."""
    with open(train.deepspeed_config) as f:
        deepspeed = resolve_deepspeed_config(json.load(f), train, world_size, bf16_default=bf16_default)
    tp = train.tensor_parallel_size
    dp = world_size // tp
    accumulation = int(deepspeed["gradient_accumulation_steps"])
    return Resolved(
        world_size=world_size,
        tensor_parallel=tp,
        data_parallel=dp,
        gradient_accumulation_steps=accumulation,
        global_batch=train.micro_batch_size * accumulation * dp,
        bf16=bool(deepspeed.get("bf16", {}).get("enabled", False)),
        deepspeed=deepspeed,
    )
