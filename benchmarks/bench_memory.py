"""Peak memory and time of NTL on full logits: ntl_scale vs the reference ``ntloss``.

Each variant runs forward + backward in a fresh subprocess on the same seeded logits; the peak is
the rise of the process's maximum resident set size over what it held right before the first step
(logits and labels already allocated), so only the loss's own memory is counted, with whatever the
first call loads (a module imported on the first call shows here). Time: the first step (what such
loading costs) and the fastest of three steps.

    python benchmarks/bench_memory.py                      # 8192 x 32768 fp32, markdown table
    python benchmarks/bench_memory.py --tokens 4096 --vocab 131072
    BENCH_THREADS=1 python benchmarks/bench_memory.py --tokens 4096 \
        --variants ce+ntloss,ce+ntl_scale,ntloss,ntl_scale,ntloss_rw,ntl_scale_rw   # issue 43's configuration

Needs ``ntloss`` and ``tokenizers``/``transformers`` (``bash scripts/setup.sh --dev``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, rss_mib, run_child, word_level_tokenizer

VARIANTS = {
    "ce": "F.cross_entropy alone (baseline)",
    "ntloss": "ntloss NTLoss (WAS)",
    "ntl_scale": "ntl_scale.number_token_loss (WAS)",
    "ntloss_rw": "ntloss NTLoss (WAS, reweigh)",
    "ntl_scale_rw": "ntl_scale.number_token_loss (WAS, reweigh)",
    "ce+ntloss": "F.cross_entropy + 0.3 * ntloss",
    "ce+ntl_scale": "F.cross_entropy + 0.3 * ntl_scale.number_token_loss",
    "ce_with_ntl": "ntl_scale.ce_with_ntl",
    "ce_with_ntl_inplace": "ntl_scale.ce_with_ntl(inplace=True)",
}


def run_variant(name: str, tokens: int, vocab_size: int) -> dict:
    import warnings

    import torch
    import torch.nn.functional as F

    import ntl_scale

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    tokenizer = word_level_tokenizer(vocab_size)
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer)
    ref = ref_rw = None
    if "ntloss" in name:
        import ntloss

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = ntloss.NTLoss(tokenizer, reweigh=False)
            ref_rw = ntloss.NTLoss(tokenizer, reweigh=True)
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab_size, (1, tokens), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.3] = torch.randint(0, 10, (1,), generator=g)
    logits = torch.randn(1, tokens, vocab_size, generator=g).requires_grad_()

    def activation():
        # The in-place variant overwrites its input: give it a fresh activation (as an output layer
        # would), made before the measurement starts so that only the loss's memory is counted.
        return logits * 1.0 if name == "ce_with_ntl_inplace" else logits

    def step(x):
        if name == "ce":
            loss = F.cross_entropy(x[0], labels[0])
        elif name == "ntloss":
            loss = ref(x, labels)
        elif name == "ntloss_rw":
            loss = ref_rw(x, labels)
        elif name == "ntl_scale":
            loss = ntl_scale.number_token_loss(x, labels, vocab)
        elif name == "ntl_scale_rw":
            loss = ntl_scale.number_token_loss(x, labels, vocab, reweigh=True)
        elif name == "ce+ntloss":
            loss = F.cross_entropy(x[0], labels[0]) + 0.3 * ref(x, labels)
        elif name == "ce+ntl_scale":
            loss = F.cross_entropy(x[0], labels[0]) + 0.3 * ntl_scale.number_token_loss(x, labels, vocab)
        elif name == "ce_with_ntl":
            loss = ntl_scale.ce_with_ntl(x, labels, vocab).loss
        elif name == "ce_with_ntl_inplace":
            loss = ntl_scale.ce_with_ntl(x, labels, vocab, inplace=True).loss
        else:
            raise ValueError(name)
        loss.backward()
        logits.grad = None
        return float(loss)

    x = activation()
    before = rss_mib()
    start = time.perf_counter()
    value = step(x)
    first = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = [first]
    for _ in range(2):
        x = activation()
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
    return {"variant": name, "peak_mib": peak - before, "time_s": min(times), "first_s": first, "loss": value}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_variant(args.child, args.tokens, args.vocab)))
        return
    rows = []
    for name in args.variants.split(","):
        cmd = [sys.executable, __file__, "--child", name, "--tokens", str(args.tokens), "--vocab", str(args.vocab)]
        rows.append(run_child(cmd))
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"tokens x vocab = {args.tokens} x {args.vocab}, fp32 logits = {logits_mib:.0f} MiB; {machine()}; "
          f"{_versions()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")  # fmt: skip
    print("| variant | peak extra memory (MiB) | x logits | first step (s) | time fwd+bwd (s) | loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {VARIANTS[row['variant']]} | {row['peak_mib']:.0f} | {row['peak_mib'] / logits_mib:.2f} | "
            f"{row['first_s']:.3f} | {row['time_s']:.3f} | {row['loss']:.4f} |"
        )


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("torch", "ntloss"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


if __name__ == "__main__":
    main()
