"""One optimizer step of a real ``transformers.Trainer`` (or TRL ``SFTTrainer``) with NTL, in 1 or more processes.

    torchrun --nproc_per_node N tests/helpers/hf_trainer_step.py OUT.pt MICRO ACCUMULATION KIND [OUT.pt ...]

KIND is ``trainer``, ``zero3``, ``fsdp2`` or ``sft``, optionally with ``-chunked``. Each group of four arguments
is one step, from a new model and a new trainer; several steps run one after another in the same
processes (the accelerate and DeepSpeed state of the previous step reset), which saves the start-up
of a launch per step.

A tiny GPT-2 (built from a config, seed 0) takes one SGD step (lr 0.1, no clipping) on the same four
arithmetic examples whatever the split: ``MICRO`` per device x ``ACCUMULATION`` steps x N devices = 4.
``zero3`` runs the ``Trainer`` under DeepSpeed ZeRO-3 (set ``DS_ACCELERATOR=cpu``), ``fsdp2`` under accelerate's
FSDP2 (``fsdp_config={"version": 2}``; on CPU with the test-only :mod:`tests.helpers.fsdp2_cpu`); a ``-chunked``
suffix installs ``apply_ntl_to_hf_model(model, vocab, chunked=True)`` first (the loss from the hidden states).
Rank 0 saves the
updated weights, the step's logs and, before the step, the reference CE and NTL of the whole batch
from ``ntl_scale.ce_with_ntl`` on the model's logits, and (``fsdp2``) the weights one plain SGD step on the whole
batch gives in this process (float64 autograd through the naive reference of ``tests/helpers/reference.py``);
(``trainer``) ``evaluate()``'s metrics on the four rows after the step, with ``ce_with_ntl`` of the updated
model's logits. Test only.
"""

from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# This file's folder holds tests/helpers/tokenizers.py, which must not shadow the real package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, ROOT)


def main() -> None:
    steps = sys.argv[1:]
    if not steps or len(steps) % 4:
        raise SystemExit(f"expected OUT.pt MICRO ACCUMULATION KIND (repeated), got {steps}")
    if any(kind.startswith("zero3") for kind in steps[3::4]):
        import importlib

        # DeepSpeed's CPU accelerator would compile a shared-memory op at start-up; gloo does the work.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda *args, **kwargs: None
    from accelerate import PartialState

    if any(kind.startswith("fsdp2") for kind in steps[3::4]):
        from tests.helpers.fsdp2_cpu import fsdp_on_cpu

        fsdp_on_cpu()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        PartialState(backend="gloo")  # Trainer on CPU: gloo, set up before TrainingArguments
    for i in range(0, len(steps), 4):
        _reset()
        step(steps[i], int(steps[i + 1]), int(steps[i + 2]), steps[i + 3])
    if torch.distributed.is_initialized():  # an orderly shutdown: a live gloo group can abort the process at exit
        torch.distributed.destroy_process_group()


def _reset() -> None:
    """Forgets the previous step's trainer: accelerate's shared state (not the process group) and the
    DeepSpeed config that ``TrainingArguments(deepspeed=...)`` registers process-wide."""
    import gc

    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    gc.collect()


def step(out: str, micro: int, accumulation: int, kind: str) -> None:
    chunked = kind.endswith("-chunked")
    kind = kind.removesuffix("-chunked")
    framework = kind.endswith("-framework")  # ce_kernel="framework": transformers' CE, NTL beside it
    kind = kind.removesuffix("-framework")
    import transformers

    import ntl_scale
    from ntl_scale.data import EncodedExample, collate, encode, generate
    from ntl_scale.integrations import hf
    from ntl_scale.training.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer, vocab_size=96)
    examples = [encode(tokenizer, e, max_length=48) for e in generate(8, seed=0)]
    rows = [{"input_ids": e.input_ids, "labels": e.labels} for e in examples if e is not None][:4]

    def collator(batch):
        return collate([EncodedExample(r["input_ids"], r["labels"]) for r in batch], tokenizer.pad_token_id)

    config = transformers.GPT2Config(
        vocab_size=96, n_embd=16, n_layer=1, n_head=2, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    whole = collator(rows)
    with torch.no_grad():
        logits = model(input_ids=whole["input_ids"], attention_mask=whole["attention_mask"]).logits
    reference = hf.causal_lm_ce_with_ntl(logits, whole["labels"], vocab, ntl_weight=0.3)
    expected = expected_step(model, whole, vocab) if kind.startswith("fsdp2") else None
    options = ntl_scale.NTLOptions(ce_kernel="framework") if framework else None
    if chunked:
        from ntl_scale.integrations.hf import apply_ntl_to_hf_model

        apply_ntl_to_hf_model(model, vocab, ntl_weight=0.3, options=options, chunked=True, chunk_tokens=32)
    common = dict(
        output_dir=os.path.join(os.path.dirname(out), f"hf-{kind}-{framework}-{chunked}-{micro}x{accumulation}"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=1,
        remove_unused_columns=False,
        seed=0,
        max_grad_norm=0.0,
    )
    if kind == "sft":
        import datasets
        import trl

        args = trl.SFTConfig(**common, dataset_kwargs={"skip_prepare_dataset": True})
        trainer_class = hf.ntl_trainer_class(trl.SFTTrainer)
        extra = {"processing_class": tokenizer, "train_dataset": datasets.Dataset.from_list(rows)}
    else:
        if kind == "zero3":
            common["deepspeed"] = {
                "zero_optimization": {"stage": 3},
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "zero_allow_untested_optimizer": True,
            }
        if kind == "fsdp2":  # accelerate's FSDP2: fully_shard per GPT2Block, on the output layer and the root
            common["fsdp"] = "full_shard"
            common["fsdp_config"] = {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}
        args = transformers.TrainingArguments(**common)
        trainer_class = hf.ntl_trainer_class()
        extra = {"train_dataset": rows}
    trainer = trainer_class(
        model=model, args=args, data_collator=collator, number_vocab=vocab, ntl_weight=0.3, ntl_options=options, **extra
    )
    trainer.train()
    evaluation = None
    if kind == "trainer":  # evaluate() on the four rows after the step: eval_* over all processes, no training log
        metrics = trainer.evaluate(eval_dataset=rows)
        with torch.no_grad():
            logits = model(input_ids=whole["input_ids"], attention_mask=whole["attention_mask"]).logits
        after = hf.causal_lm_ce_with_ntl(logits, whole["labels"], vocab, ntl_weight=0.3)
        evaluation = {"metrics": metrics, "reference": {"ce": float(after.ce), "ntl": float(after.ntl)}}
    parameters = list(model.parameters())
    if kind == "zero3":  # ZeRO-3 partitions the parameters: gather them (a collective on every rank)
        import deepspeed

        with deepspeed.zero.GatheredParameters(parameters):
            weights = torch.cat([p.detach().flatten().clone() for p in parameters])
    elif kind == "fsdp2":  # FSDP2 parameters are DTensor shards: gather them (a collective on every rank)
        weights = torch.cat([p.detach().full_tensor().flatten() for p in parameters])
    else:
        weights = torch.cat([p.detach().flatten() for p in parameters])
    if trainer.args.process_index == 0:
        torch.save(
            {
                "weights": weights,
                "logs": trainer.state.log_history,
                "reference": {"ce": float(reference.ce), "ntl": float(reference.ntl)},
                "expected": expected,
                "evaluation": evaluation,
            },
            out,
        )


def expected_step(model, whole: dict, vocab) -> torch.Tensor:
    """The weights after one SGD step (lr 0.1) on the whole batch, in one process: float64 autograd on a copy
    through the naive reference (CE over the step's tokens + 0.3 NTL over its number tokens), flattened
    like ``model.parameters()``."""
    import copy

    from tests.helpers.reference import naive_per_token

    twin = copy.deepcopy(model).double()
    logits = twin(input_ids=whole["input_ids"], attention_mask=whole["attention_mask"]).logits
    labels = whole["labels"]
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    ce, ntl, mask = naive_per_token(logits, targets, vocab)
    loss = ce.sum() / (targets != -100).sum() + 0.3 * ntl.sum() / mask.sum()
    loss.backward()
    return torch.cat([(p.detach() - 0.1 * p.grad).flatten() for p in twin.parameters()]).float()


if __name__ == "__main__":
    from launch.finish import run_then_leave

    run_then_leave(main)
