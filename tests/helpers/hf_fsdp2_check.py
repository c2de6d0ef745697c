"""``apply_ntl_to_hf_model`` and the NTL ``Trainer`` under accelerate's FSDP2, 2 CPU processes over gloo (test only).

    torchrun --nproc_per_node 2 tests/helpers/hf_fsdp2_check.py OUT_DIR

1. ``apply_ntl_to_hf_model`` on the logits (``model.loss_function``) and with ``chunked=True`` (the loss from the final
   hidden states, inside the output layer's forward), for a GPT-2 with an untied and with a tied
   ``lm_head``, prepared by ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``:
   every parameter is a ``Shard(0)`` DTensor, the ``lm_head`` weight included; ``apply_ntl_to_hf_model`` called before
   ``prepare`` and (chunked) after it. Each rank runs half of
   the batch with the whole batch's ``[tokens, numbers]`` as ``num_items_in_batch``; the sum of the
   ranks' losses and the gathered gradients (FSDP2 averages them over the 2 ranks) equal the float64
   naive reference on the whole batch in one process. With ``ce_kernel="framework"`` and ``chunked=True`` the
   forward is refused (the decoder hook would read the output weight outside its FSDP2 unit's forward). Writes
   ``OUT_DIR/apply_ntl.pt`` (the errors, and that refusal).
2. One ``ntl_trainer_class()`` SGD step per split under FSDP2 (``fsdp_config={"version": 2}``), with and
   without ``apply_ntl_to_hf_model(chunked=True)``: ``hf_trainer_step.step`` writes the weights beside the weights
   of one float64 SGD step on the whole batch in one process.

accelerate drops an FSDP plugin on CPU: :mod:`tests.helpers.fsdp2_cpu` makes the one decision it makes
for GPUs (see there).
"""

from __future__ import annotations

import copy
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# This file's folder holds tests/helpers/tokenizers.py, which must not shadow the real package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, ROOT)

# (tied lm_head, chunked, apply_ntl_to_hf_model after accelerator.prepare)
CASES = [(False, False, False), (False, True, False), (True, False, False), (True, True, False), (False, True, True)]
TRAINER_STEPS = [(2, 1, "fsdp2"), (1, 2, "fsdp2"), (2, 1, "fsdp2-chunked"), (1, 2, "fsdp2-chunked")]


def main() -> None:
    out_dir = sys.argv[1]
    from accelerate import PartialState

    from tests.helpers.fsdp2_cpu import fsdp_on_cpu

    fsdp_on_cpu()
    PartialState(backend="gloo", cpu=True)
    from tests.helpers import hf_trainer_step

    results = {}
    for tied, chunked, after in CASES:
        hf_trainer_step._reset()
        results[tied, chunked, after] = check_apply_ntl(tied, chunked, after)
    results["framework"] = check_apply_ntl(False, True, False, framework=True)
    if torch.distributed.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "apply_ntl.pt"))
    for micro, accumulation, kind in TRAINER_STEPS:
        hf_trainer_step._reset()
        out = os.path.join(out_dir, f"{kind}-{micro}x{accumulation}.pt")
        hf_trainer_step.step(out, micro, accumulation, kind)
    torch.distributed.destroy_process_group()


def check_apply_ntl(tied: bool, chunked: bool, after: bool, framework: bool = False) -> dict:
    """Loss and gradients of ``apply_ntl_to_hf_model`` under FSDP2 against the one-process float64 reference;
    ``framework``: ``ce_kernel="framework"``'s refusal (its hook reads the output weight outside its FSDP2 unit)."""
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    import ntl_scale
    from ntl_scale.data import collate, encode, generate
    from ntl_scale.integrations.hf import apply_ntl_to_hf_model
    from ntl_scale.training.tokenizer import build_char_tokenizer
    from tests.helpers.reference import naive_per_token

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tokenizer = build_char_tokenizer()
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer, vocab_size=96)
    examples = [e for e in (encode(tokenizer, g, max_length=48) for g in generate(8, seed=1)) if e is not None][:4]
    whole = collate(examples, tokenizer.pad_token_id)
    config = transformers.GPT2Config(
        vocab_size=96, n_embd=16, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)

    # the reference: the whole batch in one process, float64, the naive loss (CE over the batch's
    # tokens + 0.3 NTL over its number tokens) on the model's own logits
    twin = copy.deepcopy(model).double()
    labels = whole["labels"]
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    logits = twin(input_ids=whole["input_ids"], attention_mask=whole["attention_mask"]).logits
    ce, ntl, mask = naive_per_token(logits, targets, vocab)
    tokens, numbers = (targets != -100).sum(), mask.sum()
    reference = ce.sum() / tokens + 0.3 * ntl.sum() / numbers
    reference.backward()

    options = ntl_scale.NTLOptions(ce_kernel="framework") if framework else None
    if not after:
        apply_ntl_to_hf_model(model, vocab, ntl_weight=0.3, options=options, chunked=chunked,
                              chunk_tokens=16 if chunked else None)  # fmt: skip
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"]
    )
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    head = model.get_output_embeddings().weight
    assert isinstance(head, DTensor) and head.placements == (Shard(0),), (type(head), getattr(head, "placements", 0))
    assert head.to_local().shape[0] == 96 // world
    # accelerate shards the output layer as its own FSDP2 unit (FSDPLinear): its pre-forward hook gathers
    # the weight for the loss and resharding after the forward, its pre-backward hook gathers it again
    assert isinstance(model.get_output_embeddings(), FSDPModule)
    if after:  # on the sharded model: the install-time check of the head is skipped, as under ZeRO-3
        apply_ntl_to_hf_model(model, vocab, ntl_weight=0.3, chunked=chunked, chunk_tokens=16 if chunked else None)
    errors = {}
    model.train()
    rows = slice(rank * 2, rank * 2 + 2)  # this rank's half of the batch, the whole batch's counts
    counts = torch.stack([tokens, numbers]).to(torch.float64)
    try:
        out = model(
            input_ids=whole["input_ids"][rows],
            attention_mask=whole["attention_mask"][rows],
            labels=labels[rows],
            num_items_in_batch=counts,
        )
    except ValueError as error:
        if framework:
            return {"refused": str(error)}
        raise
    assert (out.logits is None) == chunked
    out.loss.backward()
    loss = out.loss.detach().clone()
    torch.distributed.all_reduce(loss)
    errors["loss"] = float((loss - reference).abs() / reference.abs())
    expected = dict(twin.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() * world  # FSDP2 averages the ranks' gradients
        want = expected[name].grad.float()
        worst = max(worst, float((grad - want).abs().max() / want.abs().max().clamp_min(1e-12)))
    errors["grad"] = worst
    errors["parameters"] = sum(1 for _ in model.named_parameters())
    return errors


if __name__ == "__main__":
    from launch.finish import run_then_leave

    run_then_leave(main)
