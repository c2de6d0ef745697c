"""Vocab-parallel CE + NTL vs Megatron's CE alone vs the naive gather-then-ntloss path.

For each TP size, ``tp`` CPU processes over gloo hold the same shards of seeded logits and run, one
after another, forward + backward of:

* ``megatron_ce``: ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` (CE only, in place);
* ``fused``: ``ntl_scale.vocab_parallel_ce_ntl`` CE + 0.3 * NTL-WAS, ``inplace=True`` (Megatron's
  memory model: the logits buffer becomes the gradient);
* ``fused_copy``: the same with ``inplace=False`` (the logits stay intact, one new gradient buffer);
* ``naive``: all-gather the full logits, then ``F.cross_entropy`` + 0.3 * ``ntloss.NTLoss`` on them
  (rank 0 computes; the others only gather, so the machine is not oversubscribed by duplicates).

Time is the median of the repeats on rank 0 (all ranks step together through the collectives;
the variants take turns within each repeat);
memory is the peak RSS rise on rank 0 during one step beyond the logits shard already held.

    python benchmarks/bench_vocab_parallel.py                   # both sizes, TP = 1, 2, 4
    python benchmarks/bench_vocab_parallel.py --sizes 8192x32768 --tp 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import PeakRSS, word_level_tokenizer

VARIANTS = ("megatron_ce", "fused", "fused_copy", "naive")


def _worker(rank: int, tp: int, port: int, tokens: int, vocab_size: int, repeats: int, out_path: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    from launch.startup import init_distributed

    init_distributed(rank=rank, world_size=tp, backend="gloo", init_method=f"tcp://127.0.0.1:{port}")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    import ntl_scale

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    group = parallel_state.get_tensor_model_parallel_group()
    tokenizer = word_level_tokenizer(vocab_size)
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer)
    width = vocab_size // tp
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab_size, (tokens,), generator=g)
    labels[torch.rand(tokens, generator=g) < 0.3] = torch.randint(0, 10, (1,), generator=g)
    shard_source = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1 + rank))
    reference = None
    if rank == 0:
        import ntloss

        reference = ntloss.NTLoss(tokenizer, reweigh=False)

    def step(variant: str, x: torch.Tensor) -> float:
        if variant == "megatron_ce":
            loss = vocab_parallel_cross_entropy(x.unsqueeze(1), labels.unsqueeze(1)).mean()
        elif variant in ("fused", "fused_copy"):
            ce, ntl, mask = ntl_scale.vocab_parallel_ce_ntl(
                x, labels, vocab, tp_group=group, inplace=variant == "fused", check_finite=False
            )
            loss = ce.mean() + 0.3 * ntl.sum() / mask.sum().clamp_min(1)
        else:
            parts = [torch.empty_like(x) for _ in range(tp)]
            dist.all_gather(parts, x.detach(), group=group)
            if rank != 0:
                return 0.0
            full = torch.cat(parts, dim=-1).requires_grad_()
            loss = torch.nn.functional.cross_entropy(full, labels) + 0.3 * reference(
                full.unsqueeze(0), labels.unsqueeze(0)
            )
            loss.backward()
            x.grad = full.grad[:, rank * width : (rank + 1) * width]
            return float(loss)
        loss.backward()
        return float(loss)

    # Variants take turns within each repeat so that drifts of a shared 2-core machine hit all alike.
    times = {v: [] for v in VARIANTS}
    peaks = {v: [] for v in VARIANTS}
    values = {}
    for _ in range(repeats):
        for variant in VARIANTS:
            x = shard_source.clone().requires_grad_()  # a fresh logits buffer, outside the measurement
            dist.barrier(group=group)
            with PeakRSS() as memory:
                start = time.perf_counter()
                values[variant] = step(variant, x)
                times[variant].append(time.perf_counter() - start)
            peaks[variant].append(memory.peak)
            del x
    results = {
        v: {"time_s": statistics.median(times[v]), "peak_mib": max(peaks[v]), "loss": values[v]} for v in VARIANTS
    }
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tp: int, tokens: int, vocab_size: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(
            _worker,
            args=(tp, _free_port(), tokens, vocab_size, repeats, out),
            nprocs=tp,
            start_method="spawn",
        )
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8192x32768,4096x131072", help="tokens x vocab, comma separated")
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        f"CPU: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, fp32 logits; "
        f"median of {args.repeats}; memory = peak RSS rise on rank 0 beyond the logits shard\n"
    )
    print(
        "| tokens x vocab | TP | shard MiB | Megatron CE s | fused CE+NTL s | time ratio | Megatron CE MiB "
        "| fused MiB | peak ratio (shard + extra) | fused, no in-place: s / MiB | naive gather+ntloss: s / MiB "
        "| naive / fused time | naive / fused peak |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes.split(","):
        tokens, vocab_size = (int(x) for x in size.split("x"))
        for tp in (int(t) for t in args.tp.split(",")):
            r = run(tp, tokens, vocab_size, args.repeats)
            shard = tokens * vocab_size // tp * 4 / 2**20
            meg, fused, copy, naive = (r[v] for v in VARIANTS)

            def total(row: dict, shard: float = shard) -> float:
                return shard + row["peak_mib"]

            print(
                f"| {tokens} x {vocab_size} | {tp} | {shard:.0f} | {meg['time_s']:.3f} | {fused['time_s']:.3f} | "
                f"{fused['time_s'] / meg['time_s']:.2f} | {meg['peak_mib']:.0f} | {fused['peak_mib']:.0f} | "
                f"{total(fused) / total(meg):.3f} | {copy['time_s']:.3f} / {copy['peak_mib']:.0f} | "
                f"{naive['time_s']:.3f} / {naive['peak_mib']:.0f} | {naive['time_s'] / fused['time_s']:.2f} | "
                f"{total(naive) / total(fused):.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
