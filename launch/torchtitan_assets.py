"""Builds, offline, the small assets the torchtitan command of the README reads: a tokenizer and a corpus.

    python launch/torchtitan_assets.py /tmp/ntl_torchtitan

writes ``OUT/tokenizer/{tokenizer.json,tokenizer_config.json}`` (a byte-level BPE of about 300 tokens whose
digits stay single tokens, so the digit-level number table has the ten digits; it fits the llama3
``debugmodel``'s vocabulary of 2,048) for ``--hf_assets_path``, and ``OUT/data/train.jsonl`` (seeded
arithmetic sentences, torchtitan's ``c4_test`` format: one ``{"text": ...}`` per line) for
``--dataloader.dataset_path``. It needs only the ``tokenizers`` package (a torchtitan dependency) and
downloads nothing; the same arguments give the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import random

SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>")


def corpus(lines: int, seed: int) -> list[str]:
    """Seeded sentences with integers, sums and products: text with many number tokens."""
    rng = random.Random(seed)
    words = "what is the sum of and product minus plus times let be x y so we get".split()
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 9999), rng.randint(0, 999)
        w1, w2 = rng.choice(words), rng.choice(words)
        out.append(f"{w1} {a} plus {b} is {a + b}, {w2} {a} times {b} is {a * b}.")
    return out


def build(out: str, *, vocab_size: int = 1000, lines: int = 4000, seed: int = 0) -> dict[str, str]:
    """Writes the tokenizer and the corpus under ``out``; returns their directories."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    text = corpus(lines, seed)
    tok = Tokenizer(models.BPE())
    # digits split off before the byte-level split: every digit stays one token (digit-level table)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text, trainer=trainer)
    paths = {"tokenizer": os.path.join(out, "tokenizer"), "data": os.path.join(out, "data")}
    for path in paths.values():
        os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(paths["tokenizer"], "tokenizer.json"))
    config = {"bos_token": SPECIAL[0], "eos_token": SPECIAL[1], "add_bos_token": True, "add_eos_token": False}
    with open(os.path.join(paths["tokenizer"], "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(paths["data"], "train.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in text)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder to write tokenizer/ and data/ into")
    parser.add_argument("--vocab-size", type=int, default=1000, help="BPE vocabulary (at most the model's)")
    parser.add_argument("--lines", type=int, default=4000, help="sentences in data/train.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = build(args.out, vocab_size=args.vocab_size, lines=args.lines, seed=args.seed)
    print(f"--hf_assets_path {paths['tokenizer']} --dataloader.dataset_path {paths['data']}")


if __name__ == "__main__":
    main()
