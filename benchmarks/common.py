"""Shared benchmark helpers: a synthetic tokenizer, a small Llama, variant subprocesses, a peak-RSS sampler, and
the patches that let ``megatron.core`` run on CPU over gloo (:func:`patch_for_cpu`; the test suite's too)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import random
import subprocess
import threading
import time

_WORDS = "what is the sum of and product minus plus times divided by calculate let be x y".split()


def corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    """Generated arithmetic sentences with integers and decimals."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "qua", "bri", "dom"]
    words = _WORDS + ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 99999), rng.randint(0, 999)
        w1, w2, w3 = rng.choice(words), rng.choice(words), rng.choice(words)
        out.append(f"{w1} {a} {w2} {b}? {a * b}. {a + b}.{rng.randint(0, 99)} {w3} -{b}")
    return out


def _byte_level(pattern: str | None, vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    splitters = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pattern is not None:
        splitters.insert(0, pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splitters)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@functools.cache
def byte_level_bpe():
    """GPT-2 style byte-level BPE whose digits stay single tokens (``"3"`` and ``"Ġ3"`` may exist)."""
    return _byte_level(r"\d", 400)


@functools.cache
def llama3_style_bpe():
    """Byte-level BPE that splits numbers into groups of up to three digits (``"123"`` tokens)."""
    return _byte_level(r"\d{1,3}", 1500)


def word_level_tokenizer(vocab_size: int):
    """A Hugging Face fast tokenizer with the ten digits at ids 0-9 and ``vocab_size - 10`` words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {str(d): d for d in range(10)}
    words.update({f"w{i}": i for i in range(10, vocab_size)})
    raw = Tokenizer(models.WordLevel(words, unk_token="w10"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w10")


def llama_config(vocab_size: int, hidden: int, seq: int, layers: int = 2, intermediate: int | None = None,
                 heads: int = 4, kv_heads: int = 2):  # fmt: skip
    """A ``LlamaConfig`` with an untied head (default: 2 layers, MLP width ``2 * hidden``, 4 heads, 2 KV heads)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=seq, tie_word_embeddings=False,
    )  # fmt: skip


def tiny_llama(vocab_size: int, hidden: int, seq: int, **shape):
    """A seeded ``LlamaForCausalLM`` of :func:`llama_config` (``shape``: its layer arguments) in training mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config(vocab_size, hidden, seq, **shape)).train()


def run_child(cmd: list[str]) -> dict:
    """Runs one variant in a fresh process; its result is the JSON on the last line of its stdout."""
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine() -> str:
    """The CPU, its cores and the torch threads the benchmarks use (``BENCH_THREADS``, default 2)."""
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, torch threads {os.environ.get('BENCH_THREADS', '2')}"


def rss_mib() -> float:
    """Resident set size of this process, MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> float:
    """Resets this process's peak resident set (Linux ``clear_refs``) and returns the RSS now, MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_mib()


def peak_rss_mib() -> float:
    """This process's peak resident set since start or the last :func:`reset_peak_rss`, MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


class PeakRSS:
    """Samples this process's RSS every millisecond; ``.peak`` is the rise over the RSS at entry (MiB).

    Large tensors are mmapped by glibc and returned on free, so RSS follows live tensor memory.
    """

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.peak = 0.0
        self._stop = threading.Event()

    def __enter__(self) -> PeakRSS:
        self.base = rss_mib()
        self._max = self.base
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self._max = max(self._max, rss_mib())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._max = max(self._max, rss_mib())
        self.peak = self._max - self.base


def print_logits_table(rows: list[dict], names: dict[str, str], logits_mib: float, memory: str) -> None:
    """The markdown table of per-variant peak memory (also as a multiple of the logits), time and loss."""
    print(f"| variant | {memory} (MiB) | x logits | time fwd+bwd (s) | loss |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {names[row['variant']]} | {row['peak_mib']:.0f} | {row['peak_mib'] / logits_mib:.2f} | "
            f"{row['time_s']:.3f} | {row['loss']:.4f} |"
        )


# ------------------------------------------------------------------ Megatron on CPU (benchmarks and tests)
# Never imported by the library. Apply patch_for_cpu in each spawned worker before building anything. What it
# changes, and why (found by running Megatron 0.16 here): torch.cuda.current_device returns the CPU device and
# torch.cuda.synchronize does nothing (the schedules and layers call them unconditionally); torch.zeros(...,
# device="cuda") and friends are redirected to CPU (the schedule allocates its token counter on "cuda"); the
# CUDA RNG tracker is replaced by one whose add only records and whose fork does nothing (so dropout 0).


class _CPURNGTracker:
    def __init__(self, *args, **kwargs):
        self.states_ = {}

    def reset(self):
        self.states_ = {}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def add(self, name, seed):
        self.states_[name] = seed

    def is_initialized(self):
        return True

    @contextlib.contextmanager
    def fork(self, name=None):
        yield


def _redirect(factory):
    def wrapped(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and "cuda" in str(device):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapped


def patch_for_cpu() -> None:
    """Applies the CPU patches in this process (idempotent)."""
    import torch

    if getattr(torch, "_ntl_scale_cpu_patched", False):
        return
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    for name in ("zeros", "ones", "empty", "full", "tensor"):
        setattr(torch, name, _redirect(getattr(torch, name)))
    from megatron.core.tensor_parallel import random as mp_random

    # get_cuda_rng_tracker() is re-exported under several names; it returns this module global once
    # the "initialized" flag is set, so replacing the global reaches every caller.
    mp_random._CUDA_RNG_STATE_TRACKER = _CPURNGTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch._ntl_scale_cpu_patched = True
