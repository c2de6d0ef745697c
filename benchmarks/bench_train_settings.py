"""What activation checkpointing and the attention implementation cost: one training step of a small
Llama-style model, as ``launch/train.py`` builds it (``ntl_scale.training.build.build_model``).

Reports per setting the forward + backward time (median of ``--repeats``) and the bytes of the
activations autograd keeps for the backward (counted with ``torch.autograd.graph.saved_tensors_hooks``;
shared storages once), with CE + NTL from the logits or from the hidden states (chunked).

    python benchmarks/bench_train_settings.py                    # CPU, small
    python benchmarks/bench_train_settings.py --hidden 1024 --layers 8 --seq 2048 --device cuda
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import ntl_scale
from ntl_scale.integrations.hf import ChunkedLossCausalLM
from ntl_scale.training.build import build_model, build_tokenizer
from ntl_scale.training.config import ModelConfig


def saved_bytes(fn) -> tuple[int, float]:
    """Bytes autograd saves during ``fn()`` (each storage once) and the seconds of ``fn()`` plus its backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    loss.backward()
    return sum(seen.values()), time.perf_counter() - start


def step_loss(model, chunked, ids: torch.Tensor, targets: torch.Tensor, vocab) -> torch.Tensor:
    """CE + 0.3 NTL of one batch, from the logits (``chunked`` None) or from the hidden states."""
    if chunked is not None:
        terms = chunked(ids, targets=targets)
    else:
        terms = ntl_scale.per_token_ce_ntl(model(ids).logits, targets, vocab)
    return terms.ce.sum() / targets.numel() + 0.3 * terms.ntl.sum() / terms.number_mask.sum().clamp_min(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = build_tokenizer(ModelConfig())
    vocab_size = ntl_scale.pad_vocab_size(len(tokenizer), divisible_by=8)
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer, vocab_size=vocab_size)
    arch = {"model_type": "llama", "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
            "num_hidden_layers": args.layers, "num_attention_heads": max(1, args.hidden // 64),
            "max_position_embeddings": args.seq}  # fmt: skip
    ids = torch.randint(3, len(tokenizer), (args.batch, args.seq), device=args.device)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    print(f"{args.layers} layers, hidden {args.hidden}, {args.batch} x {args.seq} tokens, {args.device}")
    print(f"{'attention':<10} {'checkpointing':<14} {'loss':<8} {'step ms':>8} {'saved MiB':>10}")
    for attn in ("sdpa", "eager"):
        for checkpointing in (False, True):
            cfg = ModelConfig(architecture=arch, attn_implementation=attn, gradient_checkpointing=checkpointing)
            torch.manual_seed(0)
            model, _ = build_model(cfg, vocab_size, {"train_micro_batch_size_per_gpu": 1}, tokenizer)
            model.to(args.device).train()
            chunked = ChunkedLossCausalLM(model, vocab)
            for loss_name in ("logits", "chunked"):
                step = functools.partial(step_loss, model, chunked if loss_name == "chunked" else None, ids, targets,
                                         vocab)  # fmt: skip
                runs = [saved_bytes(step) for _ in range(args.repeats)]
                model.zero_grad(set_to_none=True)
                ms = statistics.median(r[1] for r in runs) * 1e3
                print(f"{attn:<10} {checkpointing!s:<14} {loss_name:<8} {ms:>8.1f} {runs[-1][0] / 2**20:>10.1f}")


if __name__ == "__main__":
    main()
