"""Fine-tune a Hugging Face causal LM with CE + NTL through `Trainer` or TRL's `SFTTrainer`.

    # one process, a tiny GPT-2 built from a config on generated arithmetic (no download):
    python examples/hf_trainer_ntl.py --max-steps 20
    # two processes, DeepSpeed ZeRO-3, the loss from the hidden states (no logits):
    accelerate launch --num_processes 2 examples/hf_trainer_ntl.py --deepspeed configs/deepspeed/zero3.json --chunked
    # TRL SFTTrainer on prompt/completion pairs (TRL masks the prompts):
    accelerate launch --num_processes 2 examples/hf_trainer_ntl.py --sft
    # on CPU (accelerate's --cpu starts independent processes): torchrun over gloo
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/hf_trainer_ntl.py --deepspeed configs/deepspeed/zero3.json
    # your model: a local checkpoint directory (nothing is downloaded)
    accelerate launch examples/hf_trainer_ntl.py --model /path/to/checkpoint --bf16

The NTL parts are three lines: the number table (`number_vocab_from_pretrained` or
`NumberVocab.from_tokenizer`), optionally `apply_ntl_to_hf_model(model, vocab, chunked=True)`, and the trainer
class from `ntl_trainer_class`. Everything else is plain Hugging Face.
"""

from __future__ import annotations

import argparse
import os

import datasets
import torch
import transformers

import ntl_scale
from ntl_scale.data import generate
from ntl_scale.integrations.hf import apply_ntl_to_hf_model, ntl_trainer_class, number_vocab_from_pretrained


def load_model(path: str | None) -> tuple:
    """A local checkpoint, or (``None``) a tiny GPT-2 with the project's character tokenizer."""
    if path is not None:
        if not os.path.isdir(path):
            raise SystemExit(f"--model {path!r} is not a local directory; this example never downloads")
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        return model, tokenizer, number_vocab_from_pretrained(path)
    from ntl_scale.training.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    return model, tokenizer, ntl_scale.NumberVocab.from_tokenizer(tokenizer, vocab_size=config.vocab_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local checkpoint directory (default: a tiny GPT-2 built from a config)")
    parser.add_argument("--sft", action="store_true", help="TRL SFTTrainer on prompt/completion pairs")
    parser.add_argument("--chunked", action="store_true", help="the loss from the hidden states (no logits)")
    parser.add_argument("--deepspeed", help="a DeepSpeed JSON config (e.g. configs/deepspeed/zero3.json)")
    parser.add_argument("--ntl-weight", type=float, default=0.3)
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--output-dir", default="outputs/hf_trainer_ntl")
    args = parser.parse_args()

    model, tokenizer, vocab = load_model(args.model)
    if args.chunked:
        apply_ntl_to_hf_model(model, vocab, ntl_weight=args.ntl_weight, chunked=True)
    pairs = [{"prompt": e.question + " ", "completion": e.answer} for e in generate(args.examples, seed=0)]
    common = dict(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation, learning_rate=1e-3, logging_steps=5, save_strategy="no",
        report_to=[], bf16=args.bf16, use_cpu=not torch.cuda.is_available(), deepspeed=args.deepspeed,
    )  # fmt: skip
    if args.sft:
        import trl

        trainer_class = ntl_trainer_class(trl.SFTTrainer)
        extra = {"args": trl.SFTConfig(**common, max_length=64), "processing_class": tokenizer}
        train = datasets.Dataset.from_list(pairs)
    else:
        trainer_class = ntl_trainer_class()
        extra = {
            "args": transformers.TrainingArguments(**common, remove_unused_columns=False),
            "data_collator": transformers.DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100),
        }

        def tokenize(row: dict) -> dict:
            prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            answer = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            return {"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer}

        train = datasets.Dataset.from_list(pairs).map(tokenize, remove_columns=["prompt", "completion"])
    trainer = trainer_class(model=model, train_dataset=train, number_vocab=vocab, ntl_weight=args.ntl_weight, **extra)
    result = trainer.train()
    if trainer.is_world_process_zero():
        logged = [entry for entry in trainer.state.log_history if "ntl" in entry]
        engine = "DeepSpeed" if trainer.is_deepspeed_enabled else "no DeepSpeed"
        processes = trainer.args.world_size
        print(f"done: {result.global_step} steps ({engine}, {processes} processes), loss {result.training_loss:.4f}")
        for name, entry in (("first", logged[0]), ("last", logged[-1])) if logged else ():
            terms = f"loss {entry['loss']:.4f}, ce {entry['ce']:.4f}, ntl {entry['ntl']:.4f}"
            print(f"{name} log: step {entry['step']}, {terms}")
    if torch.distributed.is_initialized():  # shut the process group down before exit (a live one can abort it)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
