"""What NTL costs a whole training step: forward, backward and AdamW step of a small Llama.

    python benchmarks/bench_step.py             # vocab 49155 and 128256, 4 x 256 tokens, hidden 256, 2 layers
    python benchmarks/bench_step.py --quick     # vocab 49155, 2 x 128 tokens (under a minute)
    python benchmarks/bench_step.py --share-3b  # the output layer's FLOP share of Llama-3.2-3B (below)

Each variant runs in a fresh process on the same seeded model and batch; time is the median of the
timed steps after two warm-up steps (which also compile; with ``--repeats N`` the variants take
turns N times and each keeps its fastest run, against this machine's run-to-run noise), memory the
rise of the process's peak resident set during the timed steps over what it held before them
(model, batch and optimizer state: the step's own working memory).

Variants: CE alone (``F.cross_entropy`` on the logits), CE + 0.3 NTL with ntl_scale's fused op on the
logits (``ce_with_ntl``), with the chunked op from the hidden states (``linear_ce_with_ntl``, no
logits), and ``F.cross_entropy`` + 0.3 x the reference ``ntloss`` (skipped when not installed); with
``--compile`` also CE alone and the fused op with the loss under ``torch.compile(fullgraph=True)``
(the model stays eager: the comparison is of the loss).
The default model is small enough for 2 CPU cores, so its output layer and loss are a large share of
the step: the ratio is an upper bound for a real model, whose transformer layers dominate.

``--share-3b`` gives the output layer the share of the model FLOPs it has in Llama-3.2-3B (hidden
3072, 28 layers, vocab 128256: 12.1 % at 256 tokens per sequence, 11.1 % at 2048, by the FLOP
count of ``ntl_scale.training.flops``): hidden 2048 and vocab 49155 (the output layer of a 2B-3B
model with a 49k vocabulary), 12 layers of Llama-3.2-1B's shape (MLP 8192, 32 heads, 8 KV heads),
11.9 % at the 256 tokens of its batch. 0.93 B parameters in fp32 do not fit AdamW's state next to
the other jobs of a 24 GiB machine: the update is plain SGD (no state), which leaves the loss's
share of the step larger than under AdamW (an upper bound again). Printed: the FLOP shares, and the
step time of each CE + NTL variant over CE alone (wall clock and the process's CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import llama_config, machine, peak_rss_mib, reset_peak_rss, run_child, tiny_llama, word_level_tokenizer

VARIANTS = {
    "ce": "CE alone",
    "fused": "CE + NTL, ntl_scale fused op (logits)",
    "chunked": "CE + NTL, ntl_scale chunked op (no logits)",
    "ntloss": "CE + NTL, reference ntloss (logits)",
}
COMPILED = {
    "ce_compiled": "CE alone, loss compiled",
    "fused_compiled": "CE + NTL, fused op compiled",
}
NAMES = {**VARIANTS, **COMPILED}
# --share-3b: hidden 2048, vocab 49155, 12 layers of Llama-3.2-1B's shape; 1 x 256 tokens; SGD
SHARE_3B = {"vocab": "49155", "hidden": 2048, "layers": 12, "intermediate": 8192, "heads": 32, "kv_heads": 8,
            "batch": 1, "seq": 256, "steps": 2, "optimizer": "sgd", "variants": "ce,fused,chunked"}  # fmt: skip
# Llama-3.2-3B (its config.json): what --share-3b matches
LLAMA_3B = {"vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
            "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
            "tie_word_embeddings": True}  # fmt: skip


def output_share(config, seq: int) -> float:
    """The output layer's share of a Llama config's model FLOPs per token at ``seq`` tokens per sequence.

    ``6 V H`` over ``ntl_scale.training.flops.FlopsCounter``'s ``6 N + 12 L width seq`` of the model
    built on the meta device (no memory).
    """
    import torch
    import transformers

    from ntl_scale.training.flops import FlopsCounter

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    counter = FlopsCounter.for_model(model, device=torch.device("cpu"))
    return 6.0 * config.vocab_size * config.hidden_size / float(counter.flops(1, seq))


def deepspeed_engine(model, zero_json: str, micro_batch: int):
    """``model`` in a one-process DeepSpeed engine with ``zero_json`` (``auto`` values as train.py fills them)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29533"), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")  # fmt: skip
    import deepspeed

    from ntl_scale.integrations.deepspeed.resolved import resolve_deepspeed_config
    from ntl_scale.training.config import TrainConfig

    deepspeed.init_distributed(dist_backend="gloo")
    with open(zero_json) as f:
        config = resolve_deepspeed_config(json.load(f), TrainConfig(micro_batch_size=micro_batch, lr=1e-4), 1)
    config["gradient_clipping"] = 0.0
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def run_variant(
    name: str,
    vocab_size: int,
    batch: int,
    seq: int,
    hidden: int,
    steps: int,
    zero_json: str | None = None,
    shape: dict | None = None,
    optimizer_name: str = "adamw",
) -> dict:
    import torch
    import torch.nn.functional as F

    import ntl_scale

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    tokenizer = word_level_tokenizer(vocab_size)
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer)  # the ten digits at ids 0-9
    reference = None
    if name == "ntloss":
        import warnings

        import ntloss

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = ntloss.NTLoss(tokenizer, reweigh=False)
    model = tiny_llama(vocab_size, hidden, seq, **(shape or {}))
    if zero_json:  # through the DeepSpeed engine, as launch/train.py trains
        if name == "chunked":
            from ntl_scale.integrations.hf import ChunkedLossCausalLM

            model = ChunkedLossCausalLM(model, vocab)  # the module train.chunked_loss trains
        engine = forward = deepspeed_engine(model, zero_json, batch)
        backward, update = engine.backward, engine.step
    else:
        optimizer = (torch.optim.SGD if optimizer_name == "sgd" else torch.optim.AdamW)(model.parameters(), lr=1e-4)
        forward = model

        def backward(loss: torch.Tensor) -> None:
            loss.backward()

        def update() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab_size, (batch, seq), generator=g)
    digits = torch.rand(ids.shape, generator=g) < 0.3
    ids[digits] = torch.randint(0, 10, (int(digits.sum()),), generator=g)
    targets = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)

    def fused(logits: torch.Tensor) -> torch.Tensor:
        return ntl_scale.ce_with_ntl(logits, targets, vocab).loss

    def ce(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    loss_of = {"fused": fused, "ce": ce, "ntloss": ce}.get(name.removesuffix("_compiled"))
    if name.endswith("_compiled"):
        loss_of = torch.compile(loss_of, fullgraph=True)

    def step() -> float:
        if name == "chunked" and zero_json:
            terms = engine(input_ids=ids, targets=targets)  # ChunkedLossCausalLM: per-token terms, no logits
            valid = targets != -100
            loss = terms.ce.sum() / valid.sum() + 0.3 * terms.ntl.sum() / terms.number_mask.sum().clamp_min(1)
        elif name == "chunked":
            states = model.model(input_ids=ids, use_cache=False).last_hidden_state
            loss = ntl_scale.linear_ce_with_ntl(states, model.lm_head.weight, targets, vocab).loss
        else:
            logits = forward(input_ids=ids, use_cache=False).logits
            loss = loss_of(logits)
            if reference is not None:
                loss = loss + 0.3 * reference(logits, targets)
        backward(loss)
        update()
        return float(loss)

    step()  # warm-up: allocates the optimizer state, compiles; a compiled loss is traced once more
    value = step()  # after the first call has filled the NumberVocab's device caches (a guard)
    before = reset_peak_rss()
    times, cpu = [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    peak = peak_rss_mib() - before
    return {"variant": name, "time_s": statistics.median(times), "cpu_s": statistics.median(cpu), "peak_mib": peak,
            "loss": value}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", default="49155,128256", help="comma-separated vocabulary sizes")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--repeats", type=int, default=1, help="runs per variant, in turns; the fastest is kept")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2 x hidden)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--variants", default=None, help="comma-separated (default: all)")
    parser.add_argument("--quick", action="store_true", help="vocab 49155, 2 x 128 tokens, 2 timed steps")
    parser.add_argument(
        "--share-3b", action="store_true", help="the output layer's FLOP share of Llama-3.2-3B: hidden 2048, "
        "vocab 49155, 12 layers (MLP 8192, 32 heads, 8 KV heads), 1 x 256 tokens, SGD",
    )  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="also CE and the fused op under torch.compile")
    parser.add_argument(
        "--deepspeed", metavar="JSON", help="step through a one-process DeepSpeed engine with this config "
        "(e.g. configs/deepspeed/zero3.json, launch/train.py's default) instead of plain PyTorch",
    )  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.batch, args.seq, args.steps = "49155", 2, 128, 2
    if args.share_3b:
        for key, value in SHARE_3B.items():
            setattr(args, key, value)
    shape = {"layers": args.layers, "intermediate": args.intermediate, "heads": args.heads, "kv_heads": args.kv_heads}
    if args.child:
        sizes = (int(args.vocab), args.batch, args.seq, args.hidden, args.steps)
        print(json.dumps(run_variant(args.child, *sizes, args.deepspeed, shape, args.optimizer)))
        return
    import importlib.util

    engine = f"DeepSpeed engine ({args.deepspeed}, 1 process)" if args.deepspeed else "plain PyTorch"
    size = f"hidden {args.hidden}, {args.batch} x {args.seq} tokens"
    mlp = args.intermediate or 2 * args.hidden
    layers = f"{args.layers} layers (MLP {mlp}, {args.heads} heads, {args.kv_heads} KV)"
    optimizer = {"adamw": "AdamW", "sgd": "SGD"}[args.optimizer]
    print(f"Llama, {layers}, {size}, fp32, {optimizer}, {engine}; {machine()}")
    import transformers

    for vocab in args.vocab.split(","):
        share = output_share(llama_config(int(vocab), args.hidden, args.seq, **shape), args.seq)
        print(f"output layer's share of the model FLOPs, vocab {vocab}: {100 * share:.1f} %")
    l3b = transformers.LlamaConfig(**LLAMA_3B)
    print(
        f"Llama-3.2-3B's: {100 * output_share(l3b, args.seq):.1f} % at {args.seq} tokens per sequence, "
        f"{100 * output_share(l3b, 2048):.1f} % at 2048\n"
    )
    print("| vocab | variant | step time (s) | x CE alone | peak memory (MiB) | x CE alone | loss |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    wanted = args.variants.split(",") if args.variants else list(NAMES)
    names = [n for n in (NAMES if args.compile else VARIANTS) if n in wanted]
    names = [n for n in names if n != "ntloss" or importlib.util.find_spec("ntloss")]
    overheads = []
    for vocab in args.vocab.split(","):
        if "ntloss" in wanted and "ntloss" not in names:
            print(f"| {vocab} | {VARIANTS['ntloss']} | skipped: ntloss not installed | | | | |")
        best: dict[str, dict] = {}
        for _ in range(args.repeats):  # the variants take turns; each keeps its fastest run
            for name in names:
                cmd = [sys.executable, __file__, "--child", name, "--vocab", vocab, "--batch", str(args.batch)]
                cmd += ["--seq", str(args.seq), "--hidden", str(args.hidden), "--steps", str(args.steps)]
                cmd += ["--layers", str(args.layers), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads)]
                cmd += ["--intermediate", str(args.intermediate)] if args.intermediate else []
                cmd += ["--optimizer", args.optimizer]
                cmd += ["--deepspeed", args.deepspeed] if args.deepspeed else []
                row = run_child(cmd)
                if name not in best or row["time_s"] < best[name]["time_s"]:
                    best[name] = row
        rows = [best[name] for name in names]
        base = rows[0]
        for row in rows:
            time_ratio, memory_ratio = row["time_s"] / base["time_s"], row["peak_mib"] / base["peak_mib"]
            print(
                f"| {vocab} | {NAMES[row['variant']]} | {row['time_s']:.3f} | {time_ratio:.3f} | "
                f"{row['peak_mib']:.0f} | {memory_ratio:.2f} | {row['loss']:.4f} |"
            )
            if row is not base and "CE + NTL" in NAMES[row["variant"]]:
                overheads.append(
                    f"- vocab {vocab}, {NAMES[row['variant']]}: {100 * (time_ratio - 1):+.1f} % step time over CE "
                    f"alone ({100 * (row['cpu_s'] / base['cpu_s'] - 1):+.1f} % CPU time); the paper: about 1 %"
                )
    print("\nNTL's overhead on the whole step:\n" + "\n".join(overheads))


if __name__ == "__main__":
    main()
