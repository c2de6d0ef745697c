"""The DeepSpeed training loop of ``launch/train.py``, in named parts.

:class:`Trainer` owns one run: :meth:`~Trainer.setup` (resume plan, tokenizer, number table, data,
model and engine), :meth:`~Trainer.train_step` (one optimizer step of exactly normalised CE + NTL),
:meth:`~Trainer.save` / :meth:`~Trainer.load` (checkpoints), :meth:`~Trainer.evaluate_heldout`
(loss and perplexity on held-out batches), :meth:`~Trainer.evaluate_generation` (answers generated
and scored), :meth:`~Trainer.log` (metrics.jsonl, wandb, the progress line) and
:meth:`~Trainer.export` (a Hugging Face folder). :meth:`~Trainer.run` calls them in order.

Distributed is initialised by the caller (``launch/train.py``); the trainer receives the rank, the
world size and the device. Every tensor it creates or receives goes to the engine's device before it
meets the model or a collective (NCCL refuses host tensors): collated batches, the step's token
counts, the logging sums, the stop flag.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..data.arithmetic import Example
from ..data.collate import collate, encode_pairs, fits
from ..eval.numbers import extract_number
from ..losses import NTLOptions, PerTokenTerms, per_token_ce_ntl
from ..number_vocab import NumberVocab, pad_vocab_size
from .build import build_model, build_tokenizer, model_vocab_size
from .config import RunConfig
from .flops import FlopsCounter
from .resume import Layout, load_rng, plan_resume, read_layout, save_rng, to_universal, write_layout
from .steps import global_counts, loss_from_terms, ntl_options, resolve_deepspeed_config, shift_for_causal
from .tracking import Tracker, plot_curves

__all__ = ["Trainer", "check_inputs", "heldout_qa_batches", "print_summary", "to_device"]


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


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of a host batch on ``device`` (DeepSpeed's ``engine(...)`` does not move inputs)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def heldout_qa_batches(
    examples: list[Example], tokenizer: Any, *, kind: str, max_length: int, micro_batch_size: int, dp_rank: int, dp: int
) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's held-out micro-batches of question/answer examples (host tensors).

    The examples are tokenised as in training (prompt masked); those longer than ``max_length`` are
    left out. They are cut to a multiple of ``dp`` and dealt round-robin, so every rank runs the same
    number of forward passes (ZeRO-3 gathers parameters collectively).
    """
    input_ids, labels = encode_pairs(tokenizer, [e.question for e in examples], [e.answer for e in examples], kind=kind)
    from ..data.collate import EncodedExample

    rows = [EncodedExample(i, t) for i, t in zip(input_ids, labels) if fits(i, t, kind=kind, max_length=max_length)]
    rows = rows[: len(rows) - len(rows) % dp][dp_rank::dp]
    pad = tokenizer.pad_token_id
    return [collate(rows[s : s + micro_batch_size], pad) for s in range(0, len(rows), micro_batch_size)]


class Trainer:
    """One DeepSpeed run of CE + NTL.

    Args:
        cfg: the run config.
        rank: this process's global rank.
        world_size: all ranks (data x tensor parallel).
        device: the accelerator device of this rank (DeepSpeed's
            ``get_accelerator().current_device_name()``); the engine's device once it is built.
    """

    def __init__(self, cfg: RunConfig, *, rank: int, world_size: int, device: torch.device | str) -> None:
        self.cfg = cfg
        self.rank, self.world = rank, world_size
        self.device = torch.device(device)
        self.stop_signal = 0
        self.start_step = 0
        self.history: list[dict[str, Any]] = []
        self.ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
        self.metrics_path = os.path.join(cfg.run_dir, "metrics.jsonl")
        self.sequences_path = os.path.join(cfg.run_dir, "heldout_sequences.jsonl")
        self.final_heldout: dict[str, float] = {}
        self.shard: Any = None
        self.tp_group: Any = None
        self.vocab_start: int | None = None
        self.heldout: list[dict[str, torch.Tensor]] = []

    # ---- set-up ---------------------------------------------------------------------------------------

    def request_stop(self, signum: int) -> None:
        """Checkpoint and stop after the current step (a signal handler's target)."""
        self.stop_signal = signum

    def setup(self) -> None:
        """DeepSpeed config, resume plan, tokenizer, number table, data, model, engine; loads a checkpoint."""
        import deepspeed

        cfg, rank = self.cfg, self.rank
        os.makedirs(cfg.run_dir, exist_ok=True)
        with open(cfg.train.deepspeed_config) as f:
            bf16_default = self.device.type != "cpu" and bool(deepspeed.get_accelerator().is_bf16_supported())
            self.ds_config = resolve_deepspeed_config(json.load(f), cfg.train, self.world, bf16_default=bf16_default)
        cfg.train.gradient_accumulation_steps = self.ga = self.ds_config["gradient_accumulation_steps"]
        cfg.train.bf16 = bool(self.ds_config.get("bf16", {}).get("enabled", False))
        if rank == 0:
            cfg.save(os.path.join(cfg.run_dir, "config.json"))
        self.tp = cfg.train.tensor_parallel_size
        self.dp = self.world // self.tp
        self.layout = Layout(self.dp, self.tp, cfg.train.micro_batch_size * self.ga * self.dp)
        self.resume = plan_resume(self.ckpt_dir, self.layout)  # an impossible change stops here, before any step
        if self.resume == "universal":  # written on another number of ranks: DeepSpeed re-partitions a universal copy
            if rank == 0:
                print(
                    f"resuming {cfg.run_dir} (written with {read_layout(self.ckpt_dir).describe()}) on "  # type: ignore[union-attr]
                    f"{self.layout.describe()}: converting its checkpoint to DeepSpeed's universal format",
                    flush=True,
                )
            self.on_rank_zero(lambda: to_universal(self.ckpt_dir))
            self.ds_config.setdefault("checkpoint", {})["load_universal"] = True

        self.tokenizer = build_tokenizer(cfg.model)
        vocab_size = model_vocab_size(cfg.model) or pad_vocab_size(len(self.tokenizer), divisible_by=8)
        if vocab_size < len(self.tokenizer):
            raise ValueError(
                f"model vocab_size {vocab_size} is smaller than the tokenizer ({len(self.tokenizer)} tokens)"
            )
        self.vocab = NumberVocab.from_tokenizer(self.tokenizer, vocab_size=vocab_size, digit_level=cfg.ntl.digit_level)
        if cfg.data.position_coupling:
            self.check_one_token_per_digit()
        self.build_data()
        self.build_engine(vocab_size)
        if cfg.data.position_coupling:
            self.check_position_ids_reach_the_model()
        self.order = self.make_order()
        self.heldout = self.build_heldout()
        self.write_partition()
        if self.resume:
            self.load()

    def check_one_token_per_digit(self) -> None:
        """Position coupling gives every digit token a place value: every token that holds a digit must be
        one digit and a number token of the table."""
        numbers = set(self.vocab.ids.tolist())
        digits_in = {(t, i): sum(c.isdigit() for c in t) for t, i in self.tokenizer.get_vocab().items()}
        wide = sorted(t for (t, i), n in digits_in.items() if n and (i not in numbers or n != 1))
        if wide:
            raise ValueError(
                f"data.position_coupling=true needs a tokenizer with one token per digit; {self.cfg.model.tokenizer!r} "
                f"has {len(wide)} other tokens with digits ({', '.join(map(repr, wide[:5]))}"
                f"{', ...' if len(wide) > 5 else ''}): use a digit-level tokenizer (builtin:char, or one that "
                "splits numbers into single digits)"
            )

    def check_position_ids_reach_the_model(self) -> None:
        """Position coupling passes ``position_ids``: the model must take them, and (absolute position
        tables) have a row for the largest id, ``data.position_offset + data.max_length``."""
        import inspect

        if "position_ids" not in inspect.signature(self.model.forward).parameters:
            raise ValueError(
                f"data.position_coupling=true passes position_ids, and {type(self.model).__name__}.forward takes "
                "none: use a model that does (Llama-style rotary models, GPT-2, ...)"
            )
        config, largest = self.model.config, self.cfg.data.position_offset + self.cfg.data.max_length
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if limit is not None and largest >= limit:
            raise ValueError(
                f"data.position_coupling=true: ids reach data.position_offset + data.max_length = {largest}, and the "
                f"model has {limit} positions; lower data.position_offset or raise the model's position count"
            )

    def coupled_positions(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, training: bool = False
    ) -> torch.Tensor:
        """:func:`~ntl_scale.data.positions.coupled_position_ids` of token rows; the answer starts at the
        first label that is not -100 (``labels=None``: generation prompts); ``training``: with the random
        offsets of ``data.position_offset``."""
        from ..data.positions import coupled_position_ids, training_position_ids

        digits = self.vocab.number_mask(input_ids)
        if labels is None:
            return coupled_position_ids(digits)
        offset = None
        if training and self.cfg.data.position_offset:
            # a function of the seed, the data position and the data-parallel rank: tensor-parallel ranks
            # agree, a resumed run draws the same offsets, and no other random stream moves
            seed = (self.cfg.train.seed * 1_000_003 + self.order.position) * 4099 + self.dp_rank
            generator = torch.Generator().manual_seed(seed)
            offset = torch.randint(0, self.cfg.data.position_offset + 1, (input_ids.shape[0],), generator=generator)
            offset = offset.to(input_ids.device)
        return training_position_ids(digits, labels, offset)

    def build_data(self) -> None:
        """The tokenised training set (rank 0 fills the Arrow cache first, the others read it) and the
        generation-evaluation splits."""
        from .data import eval_sets, packing_summary, train_dataset

        cfg = self.cfg
        options: dict[str, Any] = {"kind": cfg.model.kind, "seq_length": cfg.train.seq_length}
        self.train_set = train_dataset(cfg.data, self.tokenizer, **options) if self.rank == 0 else None
        dist.barrier()
        if self.rank != 0:
            self.train_set = train_dataset(cfg.data, self.tokenizer, **options)
        summary = packing_summary(self.train_set)  # packed corpora: every count of what was left out
        if summary and self.rank == 0:
            print(summary, flush=True)
        self.eval_splits = eval_sets(cfg.data)

    def make_order(self) -> Any:
        """This rank's micro-batch source: ``next()`` gives a micro-batch (encoded rows or a batch dict),
        ``position`` is the resumable state stored in each checkpoint."""
        from .data import Batches

        cfg = self.cfg
        return Batches(self.train_set, cfg.train.micro_batch_size, self.dp_rank, self.dp, cfg.data.seed, self.ga,
                       cfg.data.shuffle_buffer)  # fmt: skip

    def build_heldout(self) -> list[dict[str, torch.Tensor]]:
        """This rank's held-out micro-batches for :meth:`evaluate_heldout` (host tensors): the first
        generation-evaluation split of the question/answer sources; the held-out packed sequences of a
        pretraining corpus (``data.eval_sequences``)."""
        from .data import PACKED_SOURCES, heldout_batches

        cfg = self.cfg
        if cfg.data.source in PACKED_SOURCES:
            return heldout_batches(
                cfg.data, self.tokenizer, seq_length=cfg.train.seq_length,
                micro_batch_size=cfg.train.micro_batch_size, dp_rank=self.dp_rank, dp=self.dp,
            )  # fmt: skip
        if not self.eval_splits:
            return []
        examples = next(iter(self.eval_splits.values()))
        return heldout_qa_batches(
            examples, self.tokenizer, kind=cfg.model.kind, max_length=cfg.data.max_length,
            micro_batch_size=cfg.train.micro_batch_size, dp_rank=self.dp_rank, dp=self.dp,
        )  # fmt: skip

    def build_engine(self, vocab_size: int) -> None:
        """The Hugging Face model (under ZeRO-3 partitioned as it is created), the chunked-loss wrapper,
        the DeepSpeed engine, AutoTP's vocabulary shard and the process groups."""
        import deepspeed

        cfg, tp = self.cfg, self.tp
        torch.manual_seed(cfg.train.seed)
        self.model, self._keep_alive = build_model(cfg.model, vocab_size, self.ds_config, self.tokenizer)
        trained: torch.nn.Module = self.model
        if cfg.train.chunked_loss:  # CE + NTL from the hidden states: the logits are never materialised
            if cfg.model.kind != "causal":
                raise ValueError("train.chunked_loss=true supports model.kind=causal; use the logits path for seq2seq")
            from ..integrations.hf import ChunkedLossCausalLM

            trained = ChunkedLossCausalLM(self.model, self.vocab, ntl_options(cfg.ntl), cfg.train.loss_chunk_tokens)
        # counted from the whole model, before AutoTP leaves each rank a slice of the layers
        self.flops = FlopsCounter.for_model(self.model, kind=cfg.model.kind, device=self.device,
                                            peak_tflops=cfg.train.peak_tflops)  # fmt: skip
        if tp > 1 and cfg.model.kind != "causal":
            raise ValueError(
                f"train.tensor_parallel_size={tp} supports model.kind=causal (a vocabulary-parallel lm_head); "
                "train seq2seq models such as T5 with data parallelism and ZeRO-3"
            )
        try:
            self.engine, *_ = deepspeed.initialize(
                model=trained, model_parameters=self.model.parameters(), config=self.ds_config
            )
        except AssertionError as error:
            if tp > 1 and "AutoTP not supported" in str(error):
                raise ValueError(
                    f"DeepSpeed AutoTP cannot split {type(self.model).__name__} (train.tensor_parallel_size={tp}): it "
                    "supports models built from nn.Linear layers, such as Llama, Granite, Mistral or Qwen; GPT-2 uses "
                    "Conv1D. Use one of those architectures or train.tensor_parallel_size=1"
                ) from error
            raise
        self.device = torch.device(self.engine.device)
        from ..integrations.deepspeed_tp import head_shard, install_chunked_head

        self.shard = head_shard(self.model) if tp > 1 else None
        if tp > 1 and self.shard is None:
            raise ValueError(
                f"DeepSpeed AutoTP left {type(self.model).__name__}'s output layer whole, expected a vocabulary shard"
            )
        if self.shard is not None and cfg.train.chunked_loss:
            install_chunked_head(self.shard, self.vocab, ntl_options(cfg.ntl), cfg.train.loss_chunk_tokens)
        if tp > 1:
            from deepspeed.utils import groups

            self.dp_group, self.dp_rank = groups.get_data_parallel_group(), groups.get_data_parallel_rank()
        else:
            self.dp_group, self.dp_rank = dist.group.WORLD, self.rank
        self.tp_group, self.vocab_start = (
            (self.shard.group, self.shard.start) if self.shard is not None else (None, None)
        )

    def write_partition(self) -> None:
        """``zero_rank{r}.json``: how much of the model this rank holds, its place in the layout."""
        params = list(self.model.parameters())
        held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)  # this rank's part
        total = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3: the whole parameter
        part: dict[str, Any] = {"held": held, "total": total, "host": socket.gethostname(), "tp": self.tp,
                                "dp": self.dp, "dp_rank": self.dp_rank}  # fmt: skip
        if self.shard is not None:
            part["vocab_shard"] = [self.shard.start, self.shard.end]
        with open(os.path.join(self.cfg.run_dir, f"zero_rank{self.rank}.json"), "w") as f:
            json.dump(part, f)

    def on_rank_zero(self, work: Callable[[], Any]) -> None:
        """Runs ``work`` on rank 0 while the others wait; if it fails, every rank stops (none waits forever)."""
        failed = torch.zeros(1, dtype=torch.long, device=self.device)
        error = None
        if self.rank == 0:
            try:
                work()
            except Exception as exc:  # re-raised below, after the other ranks have been told
                failed[0], error = 1, exc
        dist.broadcast(failed, src=0)
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError("rank 0 failed preparing the checkpoint (its error is above); stopping")

    # ---- checkpoints ----------------------------------------------------------------------------------

    def save(self, step: int) -> None:
        """DeepSpeed checkpoint ``step{step}`` with the data position and the RNG (each rank's generators in
        ``rng_rank{rank}.pt``); ``latest`` moves last."""
        import deepspeed

        client = {"step": step, "examples_consumed": self.order.position, "rng": torch.get_rng_state()}
        save_rng(os.path.join(self.ckpt_dir, f"step{step}"), self.rank, deepspeed.get_accelerator())
        self.engine.save_checkpoint(self.ckpt_dir, tag=f"step{step}", client_state=client, save_latest=False)
        dist.barrier()  # every rank's shard is on disk before "latest" points at it
        if self.rank == 0:  # a crash before this line leaves "latest" at the previous, complete checkpoint
            write_layout(self.ckpt_dir, self.layout)
            with open(os.path.join(self.ckpt_dir, "latest.tmp"), "w") as f:
                f.write(f"step{step}")
            os.replace(os.path.join(self.ckpt_dir, "latest.tmp"), os.path.join(self.ckpt_dir, "latest"))
        dist.barrier()

    def load(self) -> None:
        """Loads the checkpoint ``latest`` names: weights, optimizer, data position, RNG."""
        _, client = self.engine.load_checkpoint(self.ckpt_dir)
        if "examples_consumed" not in client:
            raise ValueError(
                f"{self.ckpt_dir} was written by an older launch/train.py (its data position counts micro-batches); "
                "finish it with that version or start a new run_dir"
            )
        self.start_step, self.order.position = client["step"], client["examples_consumed"]
        import deepspeed

        note = load_rng(os.path.join(self.ckpt_dir, f"step{self.start_step}"), self.rank, deepspeed.get_accelerator(),
                        cpu_state=client["rng"], same_layout=self.resume == "same")  # fmt: skip
        if self.rank == 0:
            print(f"resumed from step {self.start_step}" + (f" ({note})" if note else ""), flush=True)

    # ---- the step -------------------------------------------------------------------------------------

    def next_micro_batch(self) -> dict[str, torch.Tensor]:
        """The next micro-batch of this rank as host tensors: ``input_ids``, ``labels`` (unshifted; -100 =
        no loss) and optionally ``attention_mask`` / ``position_ids``."""
        rows = self.order.next()
        return rows if isinstance(rows, dict) else collate(rows, self.tokenizer.pad_token_id)

    def device_batch(self, host: dict[str, torch.Tensor], *, training: bool) -> dict[str, torch.Tensor]:
        """A host micro-batch on the device, with ``data.position_coupling``'s position ids (made there)."""
        batch = to_device(host, self.device)
        if self.cfg.data.position_coupling:
            ids = self.coupled_positions(batch["input_ids"], batch["labels"], training=training)
            batch["position_ids"] = ids.masked_fill(batch["attention_mask"] == 0, 0)  # padding: 0, not counted on
        return batch

    def targets_of(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the logits at each position are scored against (causal: the next token)."""
        return shift_for_causal(batch["labels"]) if self.cfg.model.kind == "causal" else batch["labels"]

    def model_inputs(self, batch: dict[str, torch.Tensor], target: torch.Tensor) -> dict[str, Any]:
        """The model's keyword arguments for one device micro-batch."""
        inputs: dict[str, Any] = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        if "position_ids" in inputs:  # packed documents: HF builds the per-document mask only without a cache
            inputs["use_cache"] = False
        if self.cfg.model.kind != "causal":  # seq2seq labels already align with the decoder's logits
            inputs["decoder_input_ids"] = self.model.prepare_decoder_input_ids_from_labels(labels=target)
        return inputs

    def terms_of_logits(self, logits: torch.Tensor, target: torch.Tensor, options: NTLOptions | None = None,
                        **kwargs: Any) -> PerTokenTerms:  # fmt: skip
        """Per-token terms of logits (with TP: this rank's vocabulary shard); default: the run's variant."""
        options = ntl_options(self.cfg.ntl) if options is None else options
        return per_token_ce_ntl(logits, target, self.vocab, options, tp_group=self.tp_group,
                                vocab_start=self.vocab_start, **kwargs)  # fmt: skip

    def forward_terms(self, batch: dict[str, torch.Tensor], target: torch.Tensor) -> PerTokenTerms:
        """Per-token CE and NTL of one device micro-batch (the logits path, the chunked path, or this
        rank's vocabulary shard under AutoTP)."""
        inputs = self.model_inputs(batch, target)
        if self.cfg.train.chunked_loss:
            return PerTokenTerms(*self.engine(**inputs, targets=target))
        return self.terms_of_logits(self.engine(**inputs).logits, target)

    def heldout_terms(
        self, batch: dict[str, torch.Tensor], target: torch.Tensor
    ) -> tuple[PerTokenTerms, torch.Tensor | None]:
        """:meth:`forward_terms` and, on the logits path, the per-token absolute error of the expected
        value over the number tokens (NTL-MAE of the same logits; ``None`` with the chunked loss, whose
        head computes the run's own variant only)."""
        if self.cfg.train.chunked_loss:
            return self.forward_terms(batch, target), None
        logits = self.engine(**self.model_inputs(batch, target)).logits
        mae = self.terms_of_logits(logits, target, NTLOptions(loss="mae"), need_ce=False).ntl
        return self.terms_of_logits(logits, target), mae

    @staticmethod
    def tokens_read(batch: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
        """Every token the model reads (prompts and answers, not padding; seq2seq: the decoder's too)."""
        mask = batch.get("attention_mask")
        read = (
            mask.sum()
            if mask is not None
            else torch.tensor(batch["input_ids"].numel(), device=batch["input_ids"].device)
        )
        return read if kind == "causal" else read + (batch["labels"] != -100).sum()

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches; returns its metrics row.

        CE and NTL are normalised by the step's global counts (all micro-batches, all data-parallel
        ranks). The logging sums stay on the device and are read once, after one all-reduce.
        """
        cfg, ga, dp = self.cfg, self.ga, self.dp
        step_start = time.perf_counter()
        for group in self.engine.optimizer.param_groups:
            group["lr"] = cfg.train.lr_at(step)
        batches = [self.device_batch(self.next_micro_batch(), training=True) for _ in range(ga)]
        data_s = time.perf_counter() - step_start
        targets = [self.targets_of(b) for b in batches]
        counts = global_counts(targets, self.vocab, None if dp == 1 else self.dp_group, ntl_options(cfg.ntl))
        totals = torch.zeros(7, dtype=torch.float64, device=self.device)  # ce ntl tokens numbers hits read flops
        for batch, target in zip(batches, targets):
            terms = self.forward_terms(batch, target)
            loss, stats = loss_from_terms(terms, target, cfg.ntl, counts=counts, scale=ga * dp)
            self.engine.backward(loss)
            self.engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            totals[:5] += stats
            totals[5] += self.tokens_read(batch, cfg.model.kind)
            totals[6] += self.flops.of_batch(batch)
        dist.all_reduce(totals, group=self.dp_group)  # TP ranks hold the same sums: DP only
        ce_sum, ntl_sum, tokens, numbers, hits, read, flops = totals.cpu().tolist()
        seconds = time.perf_counter() - step_start  # data, forward, backward, optimizer, logging reduce
        row: dict[str, Any] = {
            "step": step,
            "ce": ce_sum / tokens,
            "ntl": ntl_sum / max(numbers, 1),
            "number_acc": hits / max(numbers, 1),
            "lr": self.engine.optimizer.param_groups[0]["lr"],
            "grad_norm": float(self.engine.get_global_grad_norm() or 0),
            "tokens": int(read),
            "time_s": seconds,
            "data_s": data_s,
        }
        row["flops"] = flops  # model FLOPs of the step, all ranks (each token once)
        row.update(self.flops.rates(int(read), flops, seconds, self.world))
        return row

    def stop_requested(self) -> int:
        """The largest signal any rank received (0: none); every rank agrees."""
        flag = torch.tensor([self.stop_signal], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    # ---- evaluation -----------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate_heldout(
        self, batches: Iterable[dict[str, torch.Tensor]] | None = None, *, per_sequence: str | None = None
    ) -> dict[str, float]:
        """Loss, perplexity and number metrics on held-out micro-batches (this rank's share; default
        :attr:`heldout`), summed over every data-parallel rank.

        Returns ``eval/<name>`` for each metric of :func:`~ntl_scale.training.evaluate.heldout_metrics`:
        ``ce``, ``ppl``, ``ntl``, ``loss`` (the training objective), ``number_acc``, and split by label
        kind ``text_ppl`` (labels that are not number tokens) and ``number_token_ppl`` /
        ``number_token_acc`` / ``number_token_mae`` (number-token labels; the MAE of the expected value
        on the logits path only). ``per_sequence``: a file that rank 0 writes with every held-out
        sequence's sums (JSON lines, by global sequence index: the paired tests of the study) and the
        CRC-32 of its int64 labels (``labels_crc32``: runs pair only the same text). Every rank
        must call it with the same number of batches (ZeRO-3 gathers parameters in each forward).
        """
        from .evaluate import HELDOUT_COLUMNS, heldout_metrics, sequence_stats

        batches = self.heldout if batches is None else batches
        totals = torch.zeros(len(HELDOUT_COLUMNS), dtype=torch.float64, device=self.device)
        rows: list[torch.Tensor] = []
        fingerprints: list[int] = []
        self.engine.eval()
        try:
            for host in batches:
                batch = self.device_batch(host, training=False)
                target = self.targets_of(batch)
                terms, abs_error = self.heldout_terms(batch, target)
                stats = sequence_stats(terms, target, self.vocab, abs_error)
                totals += stats.sum(0)
                if per_sequence:
                    rows.append(stats)
                    labels = host.get("labels", host["input_ids"]).to(torch.int64).cpu().numpy()
                    fingerprints += [zlib.crc32(row.tobytes()) for row in labels]
        finally:
            self.engine.train()
        dist.all_reduce(totals, group=self.dp_group)
        if per_sequence:
            columns = HELDOUT_COLUMNS[:-1] if self.cfg.train.chunked_loss else HELDOUT_COLUMNS  # no MAE: see above
            sums = torch.cat(rows)[:, : len(columns)].cpu().tolist() if rows else []
            self.write_sequence_stats(per_sequence, (*columns, "labels_crc32"),
                                      [[*row, crc] for row, crc in zip(sums, fingerprints)])  # fmt: skip
        metrics = heldout_metrics(totals.cpu().tolist(), self.cfg.ntl.weight,
                                  with_abs_error=not self.cfg.train.chunked_loss)  # fmt: skip
        return {f"eval/{k}": v for k, v in metrics.items()}

    def write_sequence_stats(self, path: str, columns: tuple[str, ...], rows: list[list[float]]) -> None:
        """Rank 0 writes every data-parallel rank's held-out sequence sums (named ``columns``) to
        ``path``, ordered by the sequence's index in the held-out set (rank ``r``'s ``i``-th is sequence
        ``r + dp * i``)."""
        shares: list[Any] = [None] * self.dp
        dist.all_gather_object(shares, (self.dp_rank, rows), group=self.dp_group)
        if self.rank != 0:
            return
        indexed = sorted((r + self.dp * i, row) for r, share in shares for i, row in enumerate(share))
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            for index, row in indexed:
                f.write(json.dumps({"sequence": index, **dict(zip(columns, row))}) + "\n")
        os.replace(f"{path}.tmp", path)

    def evaluate_generation(self) -> dict[str, dict[str, float]]:
        """Answers generated for each held-out question split and scored (every rank generates the same)."""
        from ..integrations.deepspeed_tp import full_logits
        from .evaluate import evaluate_generation

        results = {}
        for split, examples in self.eval_splits.items():
            path = os.path.join(self.cfg.run_dir, f"predictions_{split}.jsonl") if self.rank == 0 else None
            with full_logits(self.shard):  # a TP head gathers its columns
                results[split] = evaluate_generation(
                    self.model, self.tokenizer, examples, kind=self.cfg.model.kind,
                    max_new_tokens=self.cfg.eval.max_new_tokens, num_beams=self.cfg.eval.num_beams,
                    synced_gpus=self.world > 1, predictions_path=path, answer_until=self.cfg.eval.answer_until,
                    reverse_answers=self.cfg.data.reverse_answers,
                    position_ids=self.coupled_positions if self.cfg.data.position_coupling else None,
                )  # fmt: skip
        return results

    # ---- logging --------------------------------------------------------------------------------------

    def open_logs(self) -> None:
        """wandb (rank 0) and ``metrics.jsonl``, cut back to the resumed step (steps about to be redone go)."""
        cfg = self.cfg
        self.tracker = Tracker(cfg.tracking.wandb, cfg.run_dir, cfg.to_dict(), cfg.tracking.project,
                               active=self.rank == 0)  # fmt: skip
        if self.rank == 0:
            kept = []
            if os.path.isfile(self.metrics_path):
                with open(self.metrics_path) as f:
                    kept = [line for line in f if json.loads(line)["step"] <= self.start_step]
            with open(self.metrics_path, "w") as f:
                f.writelines(kept)
        self._interval = {"start": time.time(), "tokens": 0, "seconds": 0.0, "steps": 0, "flops": 0.0}
        self._clock = time.time()

    def log(self, row: dict[str, Any]) -> None:
        """One row per step into metrics.jsonl and wandb; a progress line every ``train.log_every`` steps."""
        self.history.append(row)
        interval = self._interval
        interval["tokens"] += row["tokens"]
        interval["seconds"] += row["time_s"]
        interval["flops"] += row["flops"]
        interval["steps"] += 1
        if self.rank != 0:
            return
        self.tracker.log(row, row["step"])
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        step, steps = row["step"], self.cfg.train.steps
        if step % self.cfg.train.log_every == 0 or step == steps:
            elapsed = time.time() - self._clock
            eta = (steps - step) * elapsed / (step - self.start_step)
            rates = self.flops.rates(int(interval["tokens"]), float(interval["flops"]), float(interval["seconds"]),
                                     self.world)  # fmt: skip
            mfu = f"MFU {rates['mfu']:.1%}" if rates.get("mfu") is not None else "MFU n/a"
            evals = f"  eval ppl {row['eval/ppl']:.3f}" if "eval/ppl" in row else ""
            print(
                f"step {step}/{steps}  ce {row['ce']:.4f}  ntl {row['ntl']:.4f}  number acc {row['number_acc']:.3f}"
                f"{evals}  {interval['tokens'] / max(interval['seconds'], 1e-9):.0f} tok/s "
                f"({rates['tokens_per_s_per_device']:.0f}/device)  {rates['tflops']:.3g} TFLOP/s/device  {mfu}  "
                f"eta {eta:.0f}s",
                flush=True,
            )
            self._interval = {"start": time.time(), "tokens": 0, "seconds": 0.0, "steps": 0, "flops": 0.0}

    # ---- export and the end ---------------------------------------------------------------------------

    def export(self) -> None:
        """A plain Hugging Face folder (``run_dir/hf_model``, with the number table): every weight gathered."""
        import deepspeed

        from ..integrations.deepspeed_tp import gathered_weights

        out = os.path.join(self.cfg.run_dir, "hf_model")
        with (
            deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None),
            gathered_weights(self.model),
        ):
            if self.rank == 0:
                self.model.save_pretrained(out)
                self.tokenizer.save_pretrained(out)
                self.vocab.save(os.path.join(out, "number_vocab.json"))

    def read_state(self) -> str:
        """The ``state`` of ``status.json`` (``running``, ``stopped``, ``finished``) as rank 0 reads it;
        every rank gets the same answer, or the same error. A run without one (written before status
        files) counts as ``finished``."""
        state: list[Any] = ["finished", None]
        path = os.path.join(self.cfg.run_dir, "status.json")
        if self.rank == 0 and os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    state[0] = json.load(f)["state"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                state[1] = f"{path} is unreadable ({exc!r}); delete it to let the run finish or train on"
        dist.broadcast_object_list(state, src=0)
        if state[1] is not None:
            raise ValueError(state[1])
        return str(state[0])

    def write_status(self, state: str, step: int) -> None:
        """``status.json``: ``running``, ``stopped`` (checkpointed early on a signal) or ``finished``; batch
        scripts read it, and a run started again after its last step finishes only an unfinished one."""
        if self.rank == 0:
            path = os.path.join(self.cfg.run_dir, "status.json")
            with open(f"{path}.tmp", "w") as f:
                json.dump({"state": state, "step": step}, f)
            os.replace(f"{path}.tmp", path)

    def finish(self, results: dict[str, dict[str, float]]) -> None:
        """Generation results into wandb and eval.json, the loss plot, the summary table."""
        cfg = self.cfg
        if self.rank != 0:
            return
        flat = {f"eval/{split}/{k}": v for split, m in results.items() for k, v in m.items()}
        self.tracker.log(flat, cfg.train.steps)
        self.tracker.finish()
        if cfg.tracking.plot:
            if importlib.util.find_spec("matplotlib") is None:
                print("loss_curves.png skipped: matplotlib is not installed (pip install 'ntl_scale[wandb]')")
            else:
                plot_curves(self.metrics_path, os.path.join(cfg.run_dir, "loss_curves.png"))
        if results:
            with open(os.path.join(cfg.run_dir, "eval.json"), "w") as f:
                json.dump(results, f, indent=2)
            sizes = {split: len(examples) for split, examples in self.eval_splits.items()}
            print_summary(cfg.run_dir, results, sizes)
            if "heldout" in results:
                m = results["heldout"]
                names = ("ppl", "text_ppl", "number_token_ppl", "number_token_acc", "number_token_mae")
                shown = "  ".join(f"{key} {m[key]:.3f}" for key in names if key in m)
                print(f"\nheld-out text ({m['tokens']} tokens): {shown}  ({cfg.run_dir}/heldout_sequences.jsonl)")

    def run(self) -> dict[str, Any]:
        """Set-up, the steps (with held-out evaluation every ``train.eval_every`` steps and checkpoints
        every ``train.save_every``), the final checkpoint, export, evaluation. A signal checkpoints and stops."""
        cfg = self.cfg
        self.setup()
        steps = cfg.train.steps
        from .data import PACKED_SOURCES

        packed = cfg.data.source in PACKED_SOURCES
        state = self.read_state() if self.start_step >= steps else "running"
        if self.start_step > steps and state != "finished":
            raise ValueError(
                f"{cfg.run_dir} has a checkpoint at step {self.start_step}, past train.steps={steps}, and was not "
                f"finished ({state}): set train.steps={self.start_step} to finish it, or more to train on"
            )
        if state == "finished":  # started again after it finished: say so, change nothing
            if self.rank == 0:
                print(
                    f"{cfg.run_dir} already finished: its checkpoint is at step {self.start_step} of train.steps="
                    f"{steps}; nothing to do (raise train.steps to train on, or use a new run_dir)",
                    flush=True,
                )
            return {"finished_before": self.start_step, "history": []}
        self.open_logs()
        if self.start_step >= steps:  # stopped by a signal after its last step: export and evaluate now
            if self.rank == 0:
                print(f"{cfg.run_dir}: every step is done (checkpoint at step {self.start_step}); exporting and "
                      "evaluating", flush=True)  # fmt: skip
            if self.heldout and cfg.eval.at_end and packed:  # the final held-out text, as the last step had it
                heldout = self.evaluate_heldout(per_sequence=self.sequences_path)
                self.final_heldout = {k.removeprefix("eval/"): v for k, v in heldout.items()}
            return self.complete(self.start_step, save=False)
        self.write_status("running", self.start_step)  # a crash from here on leaves the run unfinished
        for step in range(self.start_step + 1, steps + 1):
            row = self.train_step(step)
            every = cfg.train.eval_every
            final = step == steps and cfg.eval.at_end
            if self.heldout and ((every and step % every == 0) or final):
                started = time.perf_counter()
                sequences = self.sequences_path if final and packed else None  # the pretraining study's pairs
                row.update(self.evaluate_heldout(per_sequence=sequences))
                row["eval_s"] = time.perf_counter() - started
                if final and packed:
                    self.final_heldout = {k.removeprefix("eval/"): v for k, v in row.items() if k.startswith("eval/")}
            self.log(row)
            signum = self.stop_requested()
            if (cfg.train.save_every and step % cfg.train.save_every == 0) or signum:
                self.save(step)
            if signum:
                if self.rank == 0:
                    print(f"signal {signum}: checkpointed at step {step}, stopping", flush=True)
                    self.tracker.finish()
                self.write_status("stopped", step)
                return {"stopped_at": step, "history": self.history}
        return self.complete(steps)

    def complete(self, step: int, *, save: bool = True) -> dict[str, Any]:
        """The end of a run: the final checkpoint (``save``), export, generation evaluation, status."""
        if save:
            self.save(step)
        self.export()
        results = self.evaluate_generation() if self.cfg.eval.at_end else {}
        if self.final_heldout:  # a pretraining corpus's held-out text
            results["heldout"] = self.final_heldout
        self.finish(results)
        self.write_status("finished", step)
        return {"history": self.history, "eval": results}


def print_summary(run_dir: str, results: dict, sizes: dict, shown: int = 6) -> None:
    """The end of a run: accuracy and error per held-out split, then a few questions with the model's answers."""
    results = {split: m for split, m in results.items() if split in sizes}  # generation splits only
    if not results:
        return
    print(f"\nheld-out questions, answered by greedy generation ({run_dir}/eval.json)")
    print(f"{'split':<13} {'questions':>9} {'accuracy':>9} {'MAE':>10} {'unparseable':>12}")
    for split, m in results.items():
        print(f"{split:<13} {sizes[split]:>9} {m['accuracy']:>9.1%} {m['mae']:>10.3g} {m['unparseable']:>12.1%}")
    split = next(iter(results))
    with open(os.path.join(run_dir, f"predictions_{split}.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line, _ in zip(f, range(shown))]
    width = max(len(r["question"]) for r in rows)
    print(f"\nexamples ({split}; all in {run_dir}/predictions_{split}.jsonl)")
    for r in rows:
        mark = "right" if r["parsed"] is not None and r["parsed"] == extract_number(r["answer"]) else "wrong"
        generated = r["generated"].strip().replace("\n", "\\n")  # one line per example
        if r["parsed"] is not None and extract_number(r["generated"]) != r["parsed"]:  # cut or reversed answers
            generated += f" (read {r['parsed']:g})"
        print(f"  {r['question']:<{width}}  true {r['answer']:>8}  model {generated:>8}  {mark}")
