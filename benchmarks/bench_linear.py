"""Peak memory and time of CE + NTL from hidden states: materialised logits vs the chunked op.

Same seeded inputs for every variant, each in a fresh subprocess; forward + backward to the hidden
states and the output weight. The peak is the rise of the process's maximum resident set size (CPU)
or of ``torch.cuda.max_memory_allocated`` (GPU) over what it held right before the step (hidden
states, weight and labels allocated), so only the loss's own memory is counted, including the weight
gradient that every variant produces.

    python benchmarks/bench_linear.py                          # 8192 x 131072 x 2048 fp32 on CPU
    python benchmarks/bench_linear.py --tokens 2048 --vocab 32768 --hidden 1024
    python benchmarks/bench_linear.py --device cuda --dtype bf16   # GPU; adds Liger's fused op if installed
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import rss_mib

VARIANTS = {
    "materialised": "(a) logits = h W^T, then ntl_scale.ce_with_ntl",
    "chunked": "(b) ntl_scale.linear_ce_with_ntl (chunked, no logits)",
    "materialised_ce": "logits = h W^T, then F.cross_entropy (CE alone)",
    "liger_ce": "(c) Liger FusedLinearCrossEntropy (CE alone)",
}


def run_variant(name: str, args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    import ntl_scale

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", str(os.cpu_count() or 2))))
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    tokens = [str(d) for d in range(10)] + [f"w{i}" for i in range(10, args.vocab)]
    vocab = ntl_scale.NumberVocab.from_id_to_token(tokens)
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.3] = torch.randint(0, 10, (1,), generator=g)
    hidden = (torch.randn(args.tokens, args.hidden, generator=g) / args.hidden**0.25).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.25).to(device, dtype)
    hidden.requires_grad_()
    weight.requires_grad_()
    labels = labels.to(device)
    liger = None
    if name == "liger_ce":
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError:
            return {"variant": name, "skipped": "liger-kernel not installed"}
        if device.type != "cuda":
            return {"variant": name, "skipped": "Liger's Triton kernels need a GPU"}
        liger = LigerFusedLinearCrossEntropyLoss()

    def step() -> float:
        if name == "materialised":
            loss = ntl_scale.ce_with_ntl(hidden @ weight.t(), labels, vocab).loss
        elif name == "materialised_ce":
            loss = F.cross_entropy((hidden @ weight.t()).float(), labels)
        elif name == "chunked":
            loss = ntl_scale.linear_ce_with_ntl(hidden, weight, labels, vocab, chunk_tokens=args.chunk_tokens).loss
        else:
            assert liger is not None
            loss = liger(weight, hidden, labels)
        loss.backward()
        hidden.grad = weight.grad = None
        return float(loss)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    value = 0.0
    for i in range(args.repeat):
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() / 2**20
        else:
            before = rss_mib()
        start = time.perf_counter()
        value = step()
        sync()
        times.append(time.perf_counter() - start)
        if i == 0:
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated() / 2**20 - before
            else:
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    return {"variant": name, "peak_mib": peak, "time_s": min(times), "loss": value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=2, help="steps per variant; the time is the fastest")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_variant(args.child, args)))
        return
    rows = []
    for name in args.variants.split(","):
        cmd = [sys.executable, __file__, "--child", name, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    size = 4 if args.dtype == "fp32" else 2
    logits_mib = args.tokens * args.vocab * size / 2**20
    print(
        f"tokens x vocab x hidden = {args.tokens} x {args.vocab} x {args.hidden}, {args.dtype} on {args.device} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores); logits = {logits_mib:.0f} MiB\n"
    )
    base = next(r for r in rows if r["variant"] == rows[0]["variant"])
    grad_mib = args.vocab * args.hidden * size / 2**20  # the weight gradient: every variant makes it
    print(
        f"'without W grad' subtracts the {grad_mib:.0f} MiB weight gradient that every variant produces (in training\n"
        "it lands in the persistent gradient buffer of DDP/ZeRO/Megatron either way).\n"
    )
    print(
        "| variant | peak loss memory (MiB) | vs (a) | without W grad (MiB) | vs (a) "
        "| time fwd+bwd (s) | vs (a) | loss |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if "skipped" in row:
            print(f"| {VARIANTS[row['variant']]} | not run: {row['skipped']} | | | | | | |")
            continue
        net, base_net = row["peak_mib"] - grad_mib, base["peak_mib"] - grad_mib
        print(
            f"| {VARIANTS[row['variant']]} | {row['peak_mib']:.0f} | {row['peak_mib'] / base['peak_mib']:.3f} | "
            f"{net:.0f} | {net / base_net:.3f} | "
            f"{row['time_s']:.2f} | {row['time_s'] / base['time_s']:.2f} | {row['loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
