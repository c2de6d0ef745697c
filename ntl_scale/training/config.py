"""Typed, strictly validated run configuration for ``launch/train.py``: YAML onto nested dataclasses, an
unknown key an error naming the closest valid one, ``key=value`` overrides by dotted path.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ..atomic import write_json_atomically
from ..options import NTLRunOptions, check_chunk_route, check_option

__all__ = [
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "NTLConfig",
    "RunConfig",
    "TrackingConfig",
    "TrainConfig",
    "load_config",
]


ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")


@dataclass
class ModelConfig:
    """The model to train."""

    kind: str = "causal"
    """``causal`` (AutoModelForCausalLM) or ``seq2seq`` (AutoModelForSeq2SeqLM, T5)."""
    path: str | None = None
    """A local pretrained model directory; None = random init from ``architecture``."""
    architecture: dict[str, Any] = field(
        default_factory=lambda: {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}
    )
    """Hugging Face config fields for a random init (``model_type`` picks the class)."""
    tokenizer: str = "builtin:char"
    """A local tokenizer directory, or ``builtin:char`` (a character tokenizer built offline)."""
    attn_implementation: str = "sdpa"
    """Hugging Face attention kernel: ``sdpa`` (PyTorch's fused attention), ``flash_attention_2`` (needs the
    ``flash_attn`` package and a CUDA GPU) or ``eager`` (the plain matmul-softmax reference)."""
    gradient_checkpointing: bool = False
    """Activation checkpointing: keep only each layer's input and recompute the layer in the backward
    (non-reentrant; works with ZeRO-3). Saves most activation memory for about one more forward."""

    def __post_init__(self) -> None:
        if self.kind not in ("causal", "seq2seq"):
            raise ValueError(f"model.kind must be 'causal' or 'seq2seq', got {self.kind!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"model.attn_implementation must be one of {', '.join(ATTN_IMPLEMENTATIONS)}, got "
                f"{self.attn_implementation!r}"
            )


@dataclass
class NTLConfig(NTLRunOptions):
    """Number Token Loss settings: the ``ntl`` section, the run-level option spec itself."""


@dataclass
class DataConfig:
    """Training and evaluation data."""

    source: str = "arithmetic"
    """Question/answer sources: ``arithmetic`` (the seeded generator), ``deepmind`` (text files) or
    ``jsonl``. Pretraining sources, packed into ``train.seq_length`` sequences: ``text`` (documents in a
    text column of JSON lines, Parquet or a ``save_to_disk`` folder) or ``megatron`` (a Megatron
    ``.bin``/``.idx`` prefix from ``preprocess_data.py``)."""
    train_path: str | None = None
    """File for ``deepmind``/``jsonl`` sources; for ``deepmind`` also a folder written by
    ``python launch/deepmind_data.py`` (its arithmetic subset: train, interpolate, extrapolate).
    ``text``: a ``.jsonl``/``.json``/``.parquet`` file, a folder of them, or a ``save_to_disk`` folder.
    ``megatron``: the path prefix (``PREFIX.bin`` and ``PREFIX.idx``)."""
    eval_path: str | None = None
    """Evaluation file for ``deepmind``/``jsonl`` sources; for the packed sources (``text``,
    ``megatron``) a JSON-lines file of ``{question, answer}`` asked by greedy generation at the end."""
    train_examples: int = 4000
    """Generated training examples (``arithmetic``)."""
    eval_examples: int = 64
    """Evaluation examples per split."""
    max_length: int = 48
    """Longest tokenized question + answer; longer examples are dropped."""
    seed: int = 0
    """Seed of the generator and of the shuffling."""
    kinds: list[str] = field(default_factory=lambda: ["add_sub", "add_sub_multiple", "mul"])
    """Arithmetic problem kinds (``add``, ``add_sub``, ``add_sub_multiple``, ``mul``), in equal shares."""
    train_digits: int = 3
    """Arithmetic operands have 1 to this many digits in ``train`` and ``interpolate``."""
    extrapolate_digits: int = 5
    """... and ``train_digits + 1`` to this many in ``extrapolate``."""
    negative_share: float = 0.2
    """Share of arithmetic operands drawn negative."""
    reverse_answers: bool = False
    """``arithmetic`` source: answers written least-significant digit first (``What is 57 + 68? 521`` for
    125); evaluation reads them back, so ``eval.json`` and the predictions hold the true numbers."""
    position_coupling: bool = False
    """Position ids that couple the digits of the question and the reversed answer by place value
    (:mod:`ntl_scale.data.positions`), in training and generation. Needs ``reverse_answers``, answers never
    negative, one token per digit and a causal model taking ``position_ids`` (docs/data.md)."""
    position_offset: int = 0
    """With ``position_coupling``: shift each training row's digit positions by a random offset, 0 to this many
    (evaluation: 0); at least the number of places the model should extrapolate to."""
    streaming: bool = False
    """Read ``train_path`` as a stream (``datasets.IterableDataset``) instead of building its Arrow table:
    for corpora larger than memory or disk cache."""
    shuffle_buffer: int = 10000
    """Rows in the streaming shuffle buffer (0: file order)."""
    num_proc: int = 1
    """Processes that tokenise a file (``datasets.map``); the result is cached."""
    cache_dir: str | None = None
    """The ``datasets`` Arrow cache (default: ``~/.cache/huggingface/datasets``)."""
    text_column: str = "text"
    """``text`` source: the column holding each document."""
    document_isolation: bool = False
    """Packed sources: ``position_ids`` restart at every document and no position predicts across a document
    boundary (Hugging Face's flattening layout, docs/data.md)."""
    eval_sequences: int = 0
    """Packed sources: sequences held out for evaluation loss and perplexity (the corpus's first documents
    that hold them; no document is in both parts); 0: none."""

    def __post_init__(self) -> None:
        sources = ("arithmetic", "deepmind", "jsonl", "text", "megatron")
        if self.source not in sources:
            raise ValueError(f"data.source must be one of {', '.join(sources)}, got {self.source!r}")
        if self.source != "arithmetic" and not self.train_path:
            raise ValueError(f"data.source={self.source!r} needs data.train_path")
        if self.streaming and self.source in ("arithmetic", "megatron"):
            raise ValueError(
                f"data.streaming=true reads data.train_path through datasets; data.source={self.source!r} "
                "has no such file (a Megatron corpus is memory-mapped already)"
            )
        if self.num_proc < 1 or self.shuffle_buffer < 0 or self.eval_sequences < 0:
            raise ValueError(
                f"need data.num_proc >= 1, data.shuffle_buffer >= 0 and data.eval_sequences >= 0, got "
                f"{self.num_proc}, {self.shuffle_buffer} and {self.eval_sequences}"
            )
        if self.reverse_answers and self.source != "arithmetic":
            raise ValueError(
                f"data.reverse_answers=true writes the generated arithmetic answers reversed; data.source="
                f"{self.source!r} reads its answers from files: reverse them there, or use data.source=arithmetic"
            )
        if self.position_offset < 0 or (self.position_offset and not self.position_coupling):
            raise ValueError(
                f"data.position_offset={self.position_offset} shifts the coupled positions of training rows: it "
                "needs data.position_coupling=true and a value >= 0"
            )
        if self.position_coupling and not self.reverse_answers:
            raise ValueError(
                "data.position_coupling=true couples each answer digit with the operand digits of its place, "
                "which needs the answers least-significant digit first: set data.reverse_answers=true"
            )
        signed = [k for k in self.kinds if k in ("add_sub", "add_sub_multiple")]
        if self.position_coupling and (signed or self.negative_share):
            raise ValueError(
                f"data.position_coupling=true counts answer positions from the units digit, and a negative answer "
                f"starts with its sign (data.kinds={self.kinds}, data.negative_share={self.negative_share}); use "
                "kinds whose answers are never negative (add, mul) with data.negative_share=0"
            )
        if self.source not in ("text", "megatron") and (self.document_isolation or self.eval_sequences):
            raise ValueError(
                f"data.document_isolation and data.eval_sequences apply to packed corpora (data.source=text or "
                f"megatron), not data.source={self.source!r}"
            )


@dataclass
class TrainConfig:
    """The optimisation loop."""

    steps: int = 150
    """Optimizer steps."""
    micro_batch_size: int = 16
    """Sequences per micro-batch per rank."""
    seq_length: int = 2048
    """Tokens per packed sequence of the pretraining sources (``data.source=text`` or ``megatron``);
    question/answer sources use ``data.max_length``."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (derived when ``global_batch_size`` is set)."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all data-parallel ranks; when set, the accumulation steps derive from
    it, so a job restarted on another number of GPUs keeps its batch (Megatron's convention)."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    lr_decay: str = "constant"
    """After warm-up: ``constant``, ``cosine`` or ``linear`` decay to ``min_lr`` at the last step
    (Megatron's ``--lr-decay-style``)."""
    min_lr: float = 0.0
    """The learning rate the decay ends at."""
    seed: int = 1234
    """Model init and dropout seed."""
    log_every: int = 10
    """Steps between progress lines."""
    eval_every: int = 0
    """Steps between held-out loss/perplexity evaluations (0: only at the end, with ``eval.at_end``)."""
    save_every: int = 0
    """Steps between checkpoints (0: only at the end)."""
    bf16: bool | None = None
    """bf16 mixed precision; null = auto: on for a GPU/accelerator with bf16, off on the CPU. Fills the
    DeepSpeed JSON's ``"bf16": {"enabled": "auto"}``; an explicit JSON value must agree with a set one."""
    peak_tflops: float | None = None
    """Peak dense bf16 TFLOP/s of one device, for the logged MFU; null = from the built-in table of
    GPUs (H100, H200, A100, ...), none on the CPU (MFU not reported)."""
    deepspeed_config: str = "configs/deepspeed/zero3.json"
    """DeepSpeed JSON; ``auto`` values are filled from this config."""
    chunked_loss: bool = False
    """CE + NTL straight from the final hidden states in token chunks, never materialising the
    ``[tokens, vocab]`` logits (causal models; ``ntl_scale.linear_ce_ntl``)."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the chunked loss (default: about 2**26 logits per chunk)."""
    tensor_parallel_size: int = 1
    """DeepSpeed AutoTP size: the model and its output layer (the vocabulary too) split over this many ranks; the
    rest of the world is data parallel. ZeRO-3 needs DeepSpeed >= 0.19.4."""

    def __post_init__(self) -> None:
        if self.seq_length < 2:
            raise ValueError(f"train.seq_length must be >= 2, got {self.seq_length}")
        for name in ("steps", "micro_batch_size", "gradient_accumulation_steps", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError(f"train.global_batch_size must be >= 1 or null, got {self.global_batch_size}")
        if self.lr_decay not in ("constant", "cosine", "linear"):
            raise ValueError(f"train.lr_decay must be constant, cosine or linear, got {self.lr_decay!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} must be in [0, train.lr={self.lr}]")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"train.peak_tflops must be > 0 or null, got {self.peak_tflops}")
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every must be >= 0 (0: only at the end), got {self.eval_every}")
        check_option("chunk_tokens", self.loss_chunk_tokens, "train.loss_chunk_tokens")
        check_chunk_route(self.chunked_loss, self.loss_chunk_tokens, "yaml")  # ignored otherwise: refused

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (1-based): linear warm-up, then the decay."""
        if step <= self.warmup_steps:
            return self.lr * step / max(self.warmup_steps, 1)
        if self.lr_decay == "constant" or self.steps <= self.warmup_steps:
            return self.lr
        done = min(1.0, (step - self.warmup_steps) / (self.steps - self.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * done)) if self.lr_decay == "cosine" else 1 - done
        return self.min_lr + (self.lr - self.min_lr) * shape

    def accumulation_for(self, data_parallel: int) -> int:
        """Micro-batches per optimizer step on ``data_parallel`` ranks (from ``global_batch_size`` if set)."""
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        per_micro_batch = self.micro_batch_size * data_parallel
        if self.global_batch_size % per_micro_batch:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of train.micro_batch_size="
                f"{self.micro_batch_size} x {data_parallel} data-parallel ranks = {per_micro_batch}; change either "
                "so that the accumulation steps are a whole number"
            )
        return self.global_batch_size // per_micro_batch


@dataclass
class EvalConfig:
    """Generation-based evaluation."""

    max_new_tokens: int = 12
    """Tokens generated per answer."""
    num_beams: int = 1
    """1 = greedy; more = beam search."""
    at_end: bool = True
    """Evaluate after the last step."""
    answer_until: str | None = None
    """Cut each generated answer at the first occurrence of this text before its number is read (the
    reader takes the last number of the answer): ``"\n"`` for a corpus whose answer lines are followed
    by the next question."""


@dataclass
class TrackingConfig:
    """Experiment tracking."""

    wandb: str = "offline"
    """``offline`` (files in the run directory), ``online`` or ``disabled``."""
    project: str = "ntl_scale"
    """The wandb project."""
    plot: bool = True
    """Write ``loss_curves.png`` into the run directory at the end."""


@dataclass
class RunConfig:
    """The whole run."""

    run_dir: str = "runs/tiny"
    """Where config, logs, metrics, predictions and checkpoints go."""
    model: ModelConfig = field(default_factory=ModelConfig)
    ntl: NTLConfig = field(default_factory=NTLConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.data.reverse_answers and self.ntl.options().loss == "number":
            raise ValueError(
                "ntl.loss=number reads each digit run as a number written most-significant digit first, and "
                "data.reverse_answers=true writes the answers the other way round; use a token-level ntl.loss "
                "(was, mse, mae, huber) with reversed answers"
            )

        if self.data.position_coupling and self.model.kind != "causal":
            raise ValueError(
                f"data.position_coupling=true sets the position ids of one causal sequence (question + answer); "
                f"model.kind={self.model.kind!r} has no such sequence: use model.kind=causal"
            )
        if self.data.position_coupling and self.model.attn_implementation == "flash_attention_2":
            raise ValueError(
                "data.position_coupling=true gives position ids that are not 0, 1, 2, ...; with "
                "model.attn_implementation=flash_attention_2 Hugging Face reads such ids as packed documents "
                "(a row without padding is cut at every id 0); use model.attn_implementation=sdpa or eager"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str) -> None:
        """Writes the config as given (no values the run derives: those go to ``resolved.json``) as JSON
        (valid YAML), atomically."""
        write_json_atomically(self.to_dict(), path)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        hint = next(o for o in options if o is not type(None))
        origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        try:
            number = hint(value)
        except (TypeError, ValueError, OverflowError):  # int(inf) overflows
            raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}") from None
        if hint is int and isinstance(value, float) and value != number:
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        if not math.isfinite(number):  # every numeric key, in one place: inf/nan would reach the run as NaN
            raise ValueError(f"{where}: expected a finite number, got {value!r}")
        return number
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return str(value)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list like [a, b], got {value!r}")
        (item,) = typing.get_args(hint)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    return value


def _build(cls: Any, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {(where + '.' if where else '') + close[0]!r}?" if close else ""
            raise ValueError(f"unknown config key {path!r}{hint} (valid here: {', '.join(names)})")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def _set(data: dict, dotted: str, raw: str) -> None:
    import yaml

    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {key!r} is not a section")
    node[keys[-1]] = yaml.safe_load(raw)


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Reads a YAML config (or the defaults) and applies ``key=value`` overrides."""
    import yaml

    data: dict[str, Any] = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ValueError(f"no such config file {path!r}")
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        _set(data, key.strip(), raw)
    cfg = _build(RunConfig, data, "")
    resolve_paths(cfg, os.path.dirname(os.path.abspath(path)) if path is not None else None)
    return cfg


# Input files a config names; outputs (run_dir) stay relative to the working directory.
_INPUT_PATHS = (("model", "path"), ("model", "tokenizer"), ("data", "train_path"), ("data", "eval_path"),
                ("train", "deepspeed_config"))  # fmt: skip


def resolve_paths(cfg: RunConfig, config_dir: str | None) -> None:
    """Makes the config's relative input paths absolute, so a run starts from any directory."""
    repository = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bases = [os.getcwd(), *([config_dir] if config_dir else []), repository]
    for section, key in _INPUT_PATHS:
        owner = getattr(cfg, section)
        value = getattr(owner, key)
        if not value or os.path.isabs(value) or value.startswith("builtin:"):
            continue
        for base in bases:
            candidate = os.path.join(base, value)
            if os.path.exists(candidate) or os.path.exists(f"{candidate}.idx"):  # .idx: a Megatron prefix
                setattr(owner, key, os.path.normpath(candidate))
                break
