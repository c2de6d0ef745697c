"""What NTL costs a whole training step: forward, backward and AdamW step of a small Llama.

    python benchmarks/bench_step.py             # vocab 49155 and 128256, 4 x 256 tokens, hidden 256, 2 layers
    python benchmarks/bench_step.py --quick     # vocab 49155, 2 x 128 tokens (under a minute)

Each variant runs in a fresh process on the same seeded model and batch; time is the median of the
timed steps after one warm-up step, memory the rise of the process's peak resident set over what it
held before the first step (model and batch allocated; the optimizer state is the same for all).

Variants: CE alone (``F.cross_entropy`` on the logits), CE + 0.3 NTL with ntl_scale's fused op on the
logits (``ce_with_ntl``), with the chunked op from the hidden states (``linear_ce_with_ntl``, no
logits), and ``F.cross_entropy`` + 0.3 x the reference ``ntloss`` (skipped when not installed).
The model is small enough for 2 CPU cores, so its output layer and loss are a large share of the step:
the ratio is an upper bound for a real model, whose transformer layers dominate.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, rss_mib, run_child, tiny_llama, word_level_tokenizer

VARIANTS = {
    "ce": "CE alone",
    "fused": "CE + NTL, ntl_scale fused op (logits)",
    "chunked": "CE + NTL, ntl_scale chunked op (no logits)",
    "ntloss": "CE + NTL, reference ntloss (logits)",
}


def run_variant(name: str, vocab_size: int, batch: int, seq: int, hidden: int, steps: int) -> dict:
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
    model = tiny_llama(vocab_size, hidden, seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab_size, (batch, seq), generator=g)
    digits = torch.rand(ids.shape, generator=g) < 0.3
    ids[digits] = torch.randint(0, 10, (int(digits.sum()),), generator=g)
    targets = torch.cat([ids[:, 1:], torch.full((batch, 1), -100)], dim=1)

    def step() -> float:
        if name == "chunked":
            states = model.model(input_ids=ids, use_cache=False).last_hidden_state
            loss = ntl_scale.linear_ce_with_ntl(states, model.lm_head.weight, targets, vocab).loss
        else:
            logits = model(input_ids=ids, use_cache=False).logits
            if name == "fused":
                loss = ntl_scale.ce_with_ntl(logits, targets, vocab).loss
            else:
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
                if reference is not None:
                    loss = loss + 0.3 * reference(logits, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    before = rss_mib()
    value = step()  # warm-up (allocates the optimizer state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    return {"variant": name, "time_s": statistics.median(times), "peak_mib": peak, "loss": value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", default="49155,128256", help="comma-separated vocabulary sizes")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--quick", action="store_true", help="vocab 49155, 2 x 128 tokens, 2 timed steps")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.batch, args.seq, args.steps = "49155", 2, 128, 2
    if args.child:
        sizes = (int(args.vocab), args.batch, args.seq, args.hidden, args.steps)
        print(json.dumps(run_variant(args.child, *sizes)))
        return
    import importlib.util

    print(f"Llama, 2 layers, hidden {args.hidden}, {args.batch} x {args.seq} tokens, fp32, AdamW; {machine()}\n")
    print("| vocab | variant | step time (s) | x CE alone | peak memory (MiB) | x CE alone | loss |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for vocab in args.vocab.split(","):
        rows = []
        for name in VARIANTS:
            if name == "ntloss" and importlib.util.find_spec("ntloss") is None:
                print(f"| {vocab} | {VARIANTS[name]} | skipped: ntloss not installed | | | | |")
                continue
            cmd = [sys.executable, __file__, "--child", name, "--vocab", vocab, "--batch", str(args.batch)]
            cmd += ["--seq", str(args.seq), "--hidden", str(args.hidden), "--steps", str(args.steps)]
            rows.append(run_child(cmd))
        base = rows[0]
        for row in rows:
            time_ratio, memory_ratio = row["time_s"] / base["time_s"], row["peak_mib"] / base["peak_mib"]
            print(
                f"| {vocab} | {VARIANTS[row['variant']]} | {row['time_s']:.3f} | {time_ratio:.3f} | "
                f"{row['peak_mib']:.0f} | {memory_ratio:.2f} | {row['loss']:.4f} |"
            )


if __name__ == "__main__":
    main()
