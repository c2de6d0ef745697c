"""A Hugging Face training step with NTL: the logits path vs ``apply_ntl_to_hf_model(model, chunked=True)``.

A small Llama built from a config (Llama-3-sized vocabulary by default) takes forward + backward on
one batch in a fresh subprocess per variant; the peak is the rise of the process's maximum resident
set size over what it held right before the step (model and batch already allocated).

    python benchmarks/bench_hf_chunked.py                  # 4 x 256 tokens, vocab 128256, hidden 256
    python benchmarks/bench_hf_chunked.py --quick          # 2 x 128 tokens, vocab 49155

Variants: the model's own CE (baseline), ``apply_ntl_to_hf_model(model, vocab)`` (CE + NTL from the logits),
``apply_ntl_to_hf_model(model, vocab, chunked=True)`` (CE + NTL from the hidden states, no logits).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, print_logits_table, rss_mib, run_child, tiny_llama

VARIANTS = {
    "ce": "model's own CE (no NTL)",
    "logits": "apply_ntl_to_hf_model(model, vocab): CE + NTL on the logits",
    "chunked": "apply_ntl_to_hf_model(model, vocab, chunked=True): CE + NTL from hidden states",
}


def run_variant(name: str, batch: int, seq: int, vocab_size: int, hidden: int) -> dict:
    import torch

    import ntl_scale
    from ntl_scale.integrations.hf import apply_ntl_to_hf_model

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model = tiny_llama(vocab_size, hidden, seq)
    vocab = ntl_scale.NumberVocab.from_id_to_token({100 + d: str(d) for d in range(10)}, vocab_size=vocab_size)
    if name == "logits":
        apply_ntl_to_hf_model(model, vocab)
    elif name == "chunked":
        apply_ntl_to_hf_model(model, vocab, chunked=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    ids[torch.rand(ids.shape, generator=g) < 0.3] = 100 + torch.randint(0, 10, (1,), generator=g)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss)

    before = rss_mib()
    start = time.perf_counter()
    value = step()
    times = [time.perf_counter() - start]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for _ in range(2):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"variant": name, "peak_mib": peak - before, "time_s": min(times), "loss": value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="2 x 128 tokens, vocab 49155")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.vocab = 2, 128, 49155
    sizes = [str(args.batch), str(args.seq), str(args.vocab), str(args.hidden)]
    if args.child:
        print(json.dumps(run_variant(args.child, *map(int, sizes))))
        return
    rows = []
    for name in VARIANTS:
        cmd = [sys.executable, __file__, "--child", name, "--batch", sizes[0], "--seq", sizes[1]]
        cmd += ["--vocab", sizes[2], "--hidden", sizes[3]]
        rows.append(run_child(cmd))
    logits_mib = args.batch * args.seq * args.vocab * 4 / 2**20
    print(
        f"Llama, 2 layers, hidden {args.hidden}, {args.batch} x {args.seq} tokens, vocab {args.vocab}, fp32 logits = "
        f"{logits_mib:.0f} MiB; {machine()}\n"
    )
    print_logits_table(rows, VARIANTS, logits_mib, "peak step memory")


if __name__ == "__main__":
    main()
