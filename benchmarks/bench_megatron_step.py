"""What NTL costs a whole megatron.core training step, at TP=1 and TP=2 (gloo on CPU).

    python benchmarks/bench_megatron_step.py             # vocab 49155 and 128256, TP 1 and 2, 4 x 256 tokens
    python benchmarks/bench_megatron_step.py --quick     # vocab 49155, TP 1 and 2, 2 x 128 tokens

A 2-layer ``GPTModel`` (megatron.core, local layer spec, hidden 256, fp32, the output layer and the
vocabulary split over the TP ranks) takes forward, backward and an AdamW step on a seeded batch (30 %
digit tokens). Each (vocabulary, TP, variant) runs in fresh processes; time is rank 0's median over
the timed steps after two warm-up steps, memory the rise of rank 0's peak resident set during the
timed steps over what it held before them (the step's working memory); the loss is the first step's,
at the same initial weights for every variant.

Variants:
- ``ce``: Megatron's own loss: ``GPTModel`` called with labels (``compute_language_model_loss``,
  ``vocab_parallel_cross_entropy`` on the vocabulary shard);
- ``fused``: ``NTLLanguageModelMixin`` (CE + 0.3 NTL-WAS by ``per_token_ce_ntl`` on the shard, the
  model-side route of ``launch/pretrain_gpt_ntl.py``);
- ``chunked``: the same with ``chunked=True`` (from the hidden states, no logits);
- ``ntloss``: the logits all-gathered over TP, then ``F.cross_entropy`` + 0.3 x the reference
  ``ntloss`` on them, the way to add it without ntl_scale (skipped when ntloss is not installed;
  Megatron's in-place CE cannot share the logits with a second loss).

The CPU patches for Megatron's CUDA-only calls (``benchmarks/common.py``, the test suite's too) are
applied in each worker; the optimizer is ``torch.optim.AdamW`` over the rank's parameters (no data
parallelism, so no gradient all-reduce).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))
from common import machine, patch_for_cpu, peak_rss_mib, reset_peak_rss, word_level_tokenizer  # noqa: E402

VARIANTS = {
    "ce": "CE alone (Megatron's vocab_parallel_cross_entropy)",
    "fused": "CE + NTL, ntl_scale fused op (logits shard)",
    "chunked": "CE + NTL, ntl_scale chunked op (no logits)",
    "ntloss": "CE + NTL, reference ntloss (logits gathered)",
}


def _worker(rank: int, tp: int, rendezvous: str, name: str, sizes: tuple, out_path: str) -> None:
    vocab_size, batch, seq, hidden, steps = sizes
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    from launch.startup import init_distributed

    init_distributed(rank=rank, world_size=tp, backend="gloo", init_method=f"file://{rendezvous}")
    patch_for_cpu()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    import ntl_scale
    from ntl_scale.integrations.megatron import NTLLanguageModelMixin, NTLSettings

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    padded = ntl_scale.pad_vocab_size(vocab_size, divisible_by=128, tp_size=tp)  # as Megatron pads it
    tokenizer = word_level_tokenizer(padded)  # padding ids as words: every variant sees the same width
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer)  # the ten digits at ids 0-9
    config = TransformerConfig(
        num_layers=2, hidden_size=hidden, num_attention_heads=4, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )  # fmt: skip

    class NTLGPTModel(NTLLanguageModelMixin, GPTModel):
        pass

    torch.manual_seed(0)
    model = (GPTModel if name in ("ce", "ntloss") else NTLGPTModel)(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=padded,
        max_sequence_length=seq, share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )  # fmt: skip
    if name in ("fused", "chunked"):
        settings = NTLSettings(weight=0.3, loss="was")
        model.configure_ntl(settings, vocab, tp_group, chunked=name == "chunked")
    reference = None
    if name == "ntloss":
        import ntloss

        reference = ntloss.NTLoss(tokenizer, reweigh=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab_size, (batch, seq), generator=g)
    digits = torch.rand(ids.shape, generator=g) < 0.3
    ids[digits] = torch.randint(0, 10, (int(digits.sum()),), generator=g)
    tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    positions = torch.arange(seq - 1).unsqueeze(0).expand(batch, -1)
    mask = torch.triu(torch.ones(1, 1, seq - 1, seq - 1, dtype=torch.bool), diagonal=1)  # True = masked

    def step() -> float:
        if reference is None:  # the model computes its loss (Megatron's CE, or CE + NTL by the mixin)
            loss = model(tokens, positions, mask, labels=labels).mean()
        else:
            logits = model(tokens, positions, mask)  # without labels: [b, s, V/tp]
            whole = tensor_parallel.gather_from_tensor_model_parallel_region(logits)  # [b, s, V]
            ce = torch.nn.functional.cross_entropy(whole.flatten(0, 1), labels.flatten())
            loss = ce + 0.3 * reference(whole, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    first = step()  # the loss at the same initial weights for every variant
    step()
    before = reset_peak_rss()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        result = {"variant": name, "time_s": statistics.median(times), "peak_mib": peak_rss_mib() - before}
        with open(out_path, "w") as f:
            json.dump({**result, "loss": first}, f)
    dist.barrier()
    dist.destroy_process_group()


def run(name: str, tp: int, sizes: tuple) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        rendezvous = os.path.join(tmp, "rendezvous")  # a file store: no port to pick
        mp.spawn(_worker, args=(tp, rendezvous, name, sizes, out), nprocs=tp, join=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", default="49155,128256", help="comma-separated vocabulary sizes")
    parser.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--quick", action="store_true", help="vocab 49155, 2 x 128 tokens, 2 timed steps")
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.batch, args.seq, args.steps = "49155", 2, 128, 2
    import importlib.util

    names = [n for n in VARIANTS if n != "ntloss" or importlib.util.find_spec("ntloss") is not None]
    print(f"megatron.core GPTModel, 2 layers, hidden {args.hidden}, {args.batch} x {args.seq} tokens, fp32, AdamW; "
          f"{machine()}, gloo\n")  # fmt: skip
    if "ntloss" not in names:
        print("skipped: ntloss not installed (the reference variant)\n")
    print("| vocab | TP | variant | step time (s) | x CE alone | peak memory (MiB) | x CE alone | loss |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for vocab in args.vocab.split(","):
        for tp in (int(t) for t in args.tp.split(",")):
            sizes = (int(vocab), args.batch, args.seq, args.hidden, args.steps)
            rows = [run(name, tp, sizes) for name in names]
            base = rows[0]
            for row in rows:
                print(
                    f"| {vocab} | {tp} | {VARIANTS[row['variant']]} | {row['time_s']:.3f} | "
                    f"{row['time_s'] / base['time_s']:.3f} | {row['peak_mib']:.0f} | "
                    f"{row['peak_mib'] / base['peak_mib']:.2f} | {row['loss']:.4f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
