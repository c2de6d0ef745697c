"""The model of a run under DeepSpeed: built from the model and train sections, forward to per-token terms.

:meth:`Engine.build` creates the model, its chunked-loss wrapper, FLOPs counter, DeepSpeed engine, AutoTP
vocabulary shard and data-parallel group; the trainer asks it for per-token CE and NTL, the backward and
optimizer step, and a Hugging Face export.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...number_vocab import NumberVocab
from ...options import NTLOptions
from ...terms import PerTokenTerms, per_token_ce_ntl
from ...training.build import build_model
from ...training.config import ModelConfig, RunConfig, TrainConfig
from ...training.flops import FlopsCounter
from ..beside import beside, framework_ce
from .resolved import Resolved
from .steps import shift_for_causal

__all__ = ["Engine", "check_inputs"]


def check_inputs(cfg: RunConfig) -> None:
    """Input paths that must exist, checked before distributed start-up (a typo fails in a second)."""
    if cfg.model.path and not os.path.isdir(cfg.model.path):
        raise ValueError(
            f"model.path={cfg.model.path!r} is not a directory (looked in the working directory, next to the config "
            "file and in the repository); ntl_scale never downloads: pass a local checkpoint directory"
        )
    if not os.path.isfile(cfg.train.deepspeed_config):
        raise ValueError(
            f"train.deepspeed_config={cfg.train.deepspeed_config!r} is not a file (looked in the working directory, "
            "next to the config file and in the repository)"
        )


class Engine:
    """A Hugging Face model under a DeepSpeed engine (``ds``), and the groups it runs in (use :meth:`build`).

    ``shard``, ``tp_group`` and ``vocab_start`` are AutoTP's vocabulary shard of the output layer (None without
    tensor parallelism); ``dp_group`` is the world without it.
    """

    def __init__(self, model: Any, ds: Any, *, kind: str, chunked: bool, options: NTLOptions, vocab: NumberVocab,
                 shard: Any, tp: int, dp: int, dp_group: Any, dp_rank: int, flops: FlopsCounter,
                 keep_alive: Any) -> None:  # fmt: skip
        self.model, self.ds, self.kind, self.chunked = model, ds, kind, chunked
        self.options, self.vocab, self.shard, self.flops = options, vocab, shard, flops
        self.device = torch.device(ds.device)
        self.tp, self.dp, self.dp_group, self.dp_rank = tp, dp, dp_group, dp_rank
        self.tp_group: Any = None if shard is None else shard.group
        self.vocab_start: int | None = None if shard is None else shard.start
        self._keep_alive = keep_alive  # DeepSpeed's HfDeepSpeedConfig: alive as long as the model

    @classmethod
    def build(
        cls,
        model_cfg: ModelConfig,
        train: TrainConfig,
        options: NTLOptions,
        resolved: Resolved,
        *,
        tokenizer: Any,
        vocab: NumberVocab,
        vocab_size: int,
        rank: int,
        device: torch.device,
    ) -> Engine:
        """The model (under ZeRO-3 partitioned as it is created), the DeepSpeed engine, AutoTP's shard, the groups;
        ``device`` is this rank's before the engine exists (the FLOPs counter's)."""
        import deepspeed

        tp, ds_config = resolved.tensor_parallel, resolved.deepspeed
        if framework_ce(options) and (tp > 1 or train.chunked_loss):
            raise ValueError(
                "ntl.ce_kernel=framework runs torch's cross entropy on the whole logits; it does not take "
                f"train.tensor_parallel_size={tp} (vocabulary shards) or train.chunked_loss={train.chunked_loss} "
                "(no logits): use ntl.ce_kernel=ntl_scale there"
            )
        torch.manual_seed(train.seed)
        model, keep_alive = build_model(model_cfg, vocab_size, ds_config, tokenizer)
        from ..hf.chunked import head_options

        # the model's own soft-capping for the hidden-state loss; ntl.logit_softcap beside it refused (both paths)
        head = head_options(model, options)
        trained: torch.nn.Module = model
        if train.chunked_loss:  # CE + NTL from the hidden states: the logits are never materialised
            if model_cfg.kind != "causal":
                raise ValueError("train.chunked_loss=true supports model.kind=causal; use the logits path for seq2seq")
            from ..hf import ChunkedLossCausalLM

            trained = ChunkedLossCausalLM(model, vocab, options, train.loss_chunk_tokens)
        # counted from the whole model, before AutoTP leaves each rank a slice of the layers
        flops = FlopsCounter.for_model(model, kind=model_cfg.kind, device=device, peak_tflops=train.peak_tflops)
        if tp > 1 and model_cfg.kind != "causal":
            raise ValueError(
                f"train.tensor_parallel_size={tp} supports model.kind=causal (a vocabulary-parallel lm_head); "
                "train seq2seq models such as T5 with data parallelism and ZeRO-3"
            )
        try:
            ds, *_ = deepspeed.initialize(model=trained, model_parameters=model.parameters(), config=ds_config)
        except AssertionError as error:
            if tp > 1 and "AutoTP not supported" in str(error):
                raise ValueError(
                    f"DeepSpeed AutoTP cannot split {type(model).__name__} (train.tensor_parallel_size={tp}): it "
                    "supports models built from nn.Linear layers, such as Llama, Granite, Mistral or Qwen; GPT-2 uses "
                    "Conv1D. Use one of those architectures or train.tensor_parallel_size=1"
                ) from error
            raise
        from .autotp import head_shard, install_vocab_parallel_loss_head

        shard = head_shard(model) if tp > 1 else None
        if tp > 1 and shard is None:
            raise ValueError(
                f"DeepSpeed AutoTP left {type(model).__name__}'s output layer whole, expected a vocabulary shard"
            )
        if shard is not None and train.chunked_loss:
            install_vocab_parallel_loss_head(shard, vocab, head, train.loss_chunk_tokens)
        if tp > 1:
            from deepspeed.utils import groups

            dp_group, dp_rank = groups.get_data_parallel_group(), groups.get_data_parallel_rank()
        else:
            dp_group, dp_rank = dist.group.WORLD, rank
        return cls(model, ds, kind=model_cfg.kind, chunked=train.chunked_loss, options=options, vocab=vocab,
                   shard=shard, tp=tp, dp=resolved.data_parallel, dp_group=dp_group, dp_rank=dp_rank, flops=flops,
                   keep_alive=keep_alive)  # fmt: skip

    def targets_of(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the logits at each position are scored against (causal: the next token)."""
        return shift_for_causal(batch["labels"]) if self.kind == "causal" else batch["labels"]

    def model_inputs(self, batch: dict[str, torch.Tensor], target: torch.Tensor) -> dict[str, Any]:
        """The model's keyword arguments for one device micro-batch."""
        inputs: dict[str, Any] = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        if "position_ids" in inputs:  # packed documents: HF builds the per-document mask only without a cache
            inputs["use_cache"] = False
        if self.kind != "causal":  # seq2seq labels already align with the decoder's logits
            inputs["decoder_input_ids"] = self.model.prepare_decoder_input_ids_from_labels(labels=target)
        return inputs

    def terms_of_logits(self, logits: torch.Tensor, target: torch.Tensor, options: NTLOptions | None = None,
                        **kwargs: Any) -> PerTokenTerms:  # fmt: skip
        """Per-token terms of logits (with TP: this rank's shard); ``ntl.ce_kernel=framework``: CE is torch's
        ``F.cross_entropy`` of the float32 logits (the model's own loss), NTL beside it."""
        options = self.options if options is None else options
        if framework_ce(options) and kwargs.get("need_ce", True):
            through: list[torch.Tensor] = []  # the logits torch's CE reads; NTL's columns join its gradient
            kwargs = {**kwargs, "need_ce": False, "passthrough": through}
            terms = per_token_ce_ntl(logits, target, self.vocab, options, **kwargs)
            flat = through[0].reshape(-1, logits.shape[-1]).float()
            ce = torch.nn.functional.cross_entropy(flat, target.reshape(-1), ignore_index=options.ignore_index,
                                                   reduction="none")  # fmt: skip
            return beside(ce, terms, hit=flat.detach().argmax(-1) == target.reshape(-1))
        return per_token_ce_ntl(logits, target, self.vocab, options, tp_group=self.tp_group,
                                vocab_start=self.vocab_start, **kwargs)  # fmt: skip

    def forward_terms(self, batch: dict[str, torch.Tensor], target: torch.Tensor) -> PerTokenTerms:
        """Per-token CE and NTL of one device micro-batch."""
        inputs = self.model_inputs(batch, target)
        if self.chunked:
            return PerTokenTerms(*self.ds(**inputs, targets=target))
        return self.terms_of_logits(self.ds(**inputs).logits, target)

    def heldout_terms(
        self, batch: dict[str, torch.Tensor], target: torch.Tensor
    ) -> tuple[PerTokenTerms, torch.Tensor | None]:
        """Evaluation terms of one held-out micro-batch (plain CE) and, on the logits path, the per-token
        NTL-MAE of the same logits (None with the chunked loss)."""
        with torch.no_grad():
            if self.chunked:
                return self.forward_terms(batch, target), None
            logits = self.ds(**self.model_inputs(batch, target)).logits
            mae = self.terms_of_logits(logits, target, NTLOptions(loss="mae"), need_ce=False).ntl
            return self.terms_of_logits(logits, target, self.options.for_evaluation()), mae

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """The model in eval mode (no dropout) inside the block, in train mode after it."""
        self.ds.eval()
        try:
            yield
        finally:
            self.ds.train()

    def set_lr(self, lr: float) -> None:
        """The learning rate of every parameter group."""
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        return float(self.ds.optimizer.param_groups[0]["lr"])

    def backward(self, loss: torch.Tensor) -> None:
        """The micro-batch's backward, then the engine's step (the optimizer steps at the accumulation boundary)."""
        self.ds.backward(loss)
        self.ds.step()

    def grad_norm(self) -> float:
        """The last optimizer step's global gradient norm (0 when DeepSpeed reports none)."""
        return float(self.ds.get_global_grad_norm() or 0)

    def write_partition(self, run_dir: str, rank: int) -> None:
        """``zero_rank{r}.json``: how much of the model this rank holds, its place in the layout."""
        params = list(self.model.parameters())
        held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)  # this rank's part
        total = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3: the whole parameter
        part: dict[str, Any] = {"held": held, "total": total, "host": socket.gethostname(), "tp": self.tp,
                                "dp": self.dp, "dp_rank": self.dp_rank}  # fmt: skip
        if self.shard is not None:
            part["vocab_shard"] = [self.shard.start, self.shard.end]
        with open(os.path.join(run_dir, f"zero_rank{rank}.json"), "w") as f:
            json.dump(part, f)

    def export(self, run_dir: str, tokenizer: Any, rank: int) -> None:
        """A plain Hugging Face folder (``run_dir/hf_model``, with the number table): every weight gathered."""
        import deepspeed

        from .autotp import gathered_weights

        out = os.path.join(run_dir, "hf_model")
        with (
            deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None),
            gathered_weights(self.model),
        ):
            if rank == 0:
                self.model.save_pretrained(out)
                tokenizer.save_pretrained(out)
                self.vocab.save(os.path.join(out, "number_vocab.json"))
