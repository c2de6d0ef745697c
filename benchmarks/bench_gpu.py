"""GPU benchmark (``make gpu-check``): CE + NTL against the fused CE kernels people use, bf16, 128k vocabulary.

    python benchmarks/bench_gpu.py                      # T=8192 tokens, H=4096, V=128256, bf16
    python benchmarks/bench_gpu.py --tokens 4096 --vocab 49155

Forward + backward, median of 10 after 3 warm-ups, peak memory above the inputs. Compared when
installed (skipped with a line saying so otherwise): Liger-Kernel's fused linear cross entropy, Cut
Cross Entropy, Megatron's ``vocab_parallel_cross_entropy`` (TP=1). Always: ``F.cross_entropy`` on the
logits, ``ntl_scale.ce_with_ntl`` on the logits, ``ntl_scale.linear_ce_with_ntl`` from hidden states.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import ntl_scale


def measure(step) -> tuple[float, float]:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU; nothing measured")
        return
    T, H, V, dt = args.tokens, args.hidden, args.vocab, torch.bfloat16
    vocab = ntl_scale.NumberVocab.from_id_to_token({100 + d: str(d) for d in range(10)}, vocab_size=V)
    g = torch.Generator(device="cuda").manual_seed(0)
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    labels = torch.where(torch.rand(T, device="cuda", generator=g) < 0.3, 100 + labels % 10, labels)
    hidden = torch.randn(T, H, device="cuda", dtype=dt, generator=g).requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).to(dt).requires_grad_()

    def on_logits(loss_fn):
        def step():
            hidden.grad = weight.grad = None
            loss_fn(hidden @ weight.t()).backward()

        return step

    rows: dict[str, object] = {
        "F.cross_entropy on logits (CE only)": on_logits(lambda z: F.cross_entropy(z.float(), labels)),
        "ntl_scale.ce_with_ntl on logits (CE + NTL)": on_logits(lambda z: ntl_scale.ce_with_ntl(z, labels, vocab).loss),
    }

    def chunked():
        hidden.grad = weight.grad = None
        ntl_scale.linear_ce_with_ntl(hidden, weight, labels, vocab).loss.backward()

    rows["ntl_scale.linear_ce_with_ntl, no logits (CE + NTL)"] = chunked
    skipped = []
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()

        def liger_step():
            hidden.grad = weight.grad = None
            liger(weight, hidden, labels).backward()

        rows["Liger fused linear CE, no logits (CE only)"] = liger_step
    except ImportError:
        skipped.append("Liger-Kernel (not installed)")
    try:
        from cut_cross_entropy import linear_cross_entropy

        def cce_step():
            hidden.grad = weight.grad = None
            linear_cross_entropy(hidden, weight, labels).backward()

        rows["Cut Cross Entropy, no logits (CE only)"] = cce_step
    except ImportError:
        skipped.append("Cut Cross Entropy (not installed)")
    try:
        import megatron.core  # noqa: F401

        skipped.append(
            "Megatron fused CE (needs an initialised model-parallel state; run benchmarks/bench_vocab_parallel.py)"
        )
    except ImportError:
        skipped.append("Megatron fused CE (megatron-core not installed)")
    name = torch.cuda.get_device_name(0)
    print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}; T={T}, H={H}, V={V}, bf16\n")
    print("| variant | time fwd+bwd (ms) | peak memory above inputs (MiB) |")
    print("|---|---:|---:|")
    for label, step in rows.items():
        ms, mib = measure(step)
        print(f"| {label} | {ms:.2f} | {mib:.0f} |")
    for line in skipped:
        print(f"\nskipped: {line}")


if __name__ == "__main__":
    main()
