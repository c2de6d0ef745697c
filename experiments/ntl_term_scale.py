"""The NTL term's scale on a Llama 3-style tokenizer against the digit level, at init and after brief training.

    python experiments/ntl_term_scale.py                 # the table (markdown), about 50 s of one CPU core
    python experiments/ntl_term_scale.py --write-doc     # also into docs/gpu_study.md's generated block
    python experiments/ntl_term_scale.py --json OUT.json

The weight of NTL (0.3 in the paper) was tuned where every number token is one digit. The GPU study runs
on Llama 3's tokenizer, whose number tokens are the chunks 0-999 (``1234`` is ``123`` ``4``). This script
measures, on the same text, what the term weighs beside cross entropy under each formulation:

* two byte-level BPE tokenizers trained offline on the same generated text (``tests/helpers/tokenizers.py``):
  ``digits`` splits every number into single digits (the paper's setting, Qwen-style), ``llama3``
  splits numbers into groups of 1-3 digits from the left (Llama 3's rule);
* per tokenizer one tiny causal transformer (2 layers, width 64, GPT-2 initialisation: normal(0, 0.02)),
  measured at init and after ``--steps`` steps of CE-only training on other text of the same generator;
* per formulation, on held-out text: the share of tokens that are number tokens, the mean NTL per number
  token, the weighted term beside CE (``w * NTL / CE``, each a mean as the loss reduces it), the mean norm
  of one number token's gradient of ``w * NTL`` with respect to its logits, and the ratio of the whole
  batch's gradient norms ``|d(w * NTL)/dz| / |d CE/dz|`` (the term's pull on the logits beside CE's).

Formulations: the digit table on the digit tokenizer at 0.3 (the reference), and on the Llama 3-style one
the multi-digit table with the squash factor the study uses (8) at the study's primary weight and at 0.3,
with the factor :func:`ntl_scale.number_vocab.digit_scale_squash_factor` computes for this table, without a
squash factor, and the digit table (which keeps only the chunks that happen to be one digit). Every
quantity is linear in the weight, so a row at another weight is that row scaled.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

DIGIT_WEIGHT = 0.3
"""The paper's weight on the digit table: the reference every row is compared with."""
STUDY_SQUASH = 8.0
STUDY_WEIGHT = 1.0
"""The GPU study's primary arm on the Llama 3-style table (docs/gpu_study.md chooses it from this table)."""
SEQ = 64


class TinyLM(torch.nn.Module):
    """A 2-layer causal transformer with GPT-2's initialisation (every weight normal(0, 0.02), biases 0)."""

    def __init__(self, vocab: int, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(SEQ, width)
        block = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)  # fmt: skip
        self.body = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.out = torch.nn.Linear(width, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, 0.0, 0.02)
            elif "norm" not in name:
                torch.nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n)
        h = self.embed(ids) + self.pos(torch.arange(n))
        return self.out(self.norm(self.body(h, mask=mask, is_causal=True)))


def _stream(tok: Any, lines: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for line in lines:
        ids += tok(line)["input_ids"] + [tok.eos_token_id]
    return torch.tensor(ids)


def _batches(stream: torch.Tensor, rows: int) -> torch.Tensor:
    usable = (len(stream) - 1) // SEQ * SEQ
    return stream[: usable + 1].unfold(0, SEQ + 1, SEQ)[:rows]


def train(tok: Any, lines: list[str], steps: int, seed: int) -> tuple[TinyLM, TinyLM]:
    """The model at init and a copy trained ``steps`` steps with CE alone (batch 16 x 64, AdamW 3e-3)."""
    torch.manual_seed(seed)
    model = TinyLM(len(tok))
    init = TinyLM(len(tok))
    init.load_state_dict(model.state_dict())
    data = _batches(_stream(tok, lines), 10_000)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = data[torch.randint(len(data), (16,), generator=gen)]
        logits = model(rows[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return init.eval(), model.eval()


def measure(model: TinyLM, rows: torch.Tensor, vocab: Any, squash: float | None, weight: float) -> dict[str, float]:
    """The term's scale on ``rows`` at ``weight`` (see the module docstring)."""
    from ntl_scale import ce_with_ntl

    with torch.no_grad():
        logits = model(rows[:, :-1]).reshape(-1, vocab.vocab_size).double()
    labels = rows[:, 1:].reshape(-1)
    z = logits.clone().requires_grad_(True)
    out = ce_with_ntl(z, labels, vocab, ntl_weight=weight, loss="was", squash_factor=squash, impl="torch")
    (g_ntl,) = torch.autograd.grad(weight * out.ntl, z, retain_graph=True)
    (g_ce,) = torch.autograd.grad(out.ce, z)
    zt = z.detach().clone().requires_grad_(True)
    per = ce_with_ntl(zt, labels, vocab, ntl_weight=weight, loss="was", squash_factor=squash, reduction="none",
                      impl="torch").ntl  # fmt: skip
    (g_each,) = torch.autograd.grad(weight * per.sum(), zt)
    mask = vocab.number_mask(labels)
    return {
        "number_share": float(mask.double().mean()),
        "ntl": float(out.ntl.detach()),
        "ce": float(out.ce.detach()),
        "term_over_ce": float(weight * out.ntl.detach() / out.ce.detach()),
        "grad_per_number_token": float(g_each[mask].norm(dim=-1).mean()),
        "grad_ratio": float(g_ntl.norm() / g_ce.norm()),
    }


def run(steps: int = 400, seed: int = 0) -> dict[str, Any]:
    """Every row of the table: ``{"rows": [...], "recipe_squash": s}``."""
    from benchmarks import common as tokenizers
    from ntl_scale import NumberVocab
    from ntl_scale.number_vocab import digit_scale_squash_factor

    torch.set_num_threads(1)
    train_lines, heldout = tokenizers.corpus(1500, seed=2), tokenizers.corpus(200, seed=1)
    digit_tok, llama_tok = tokenizers.byte_level_bpe(), tokenizers.llama3_style_bpe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the digit table on Llama 3-style chunks warns: it is measured on purpose
        digit_table = NumberVocab.from_tokenizer(digit_tok)
        multi = NumberVocab.from_tokenizer(llama_tok, digit_level=False)
        llama_digits = NumberVocab.from_tokenizer(llama_tok)
    recipe = digit_scale_squash_factor(multi.values)
    w, s = DIGIT_WEIGHT, STUDY_SQUASH
    setups = [
        ("digits", "digit table (the paper's)", digit_table, None, w),
        ("llama3", f"multi-digit, squash {s:g} (the study's primary arm)", multi, s, STUDY_WEIGHT),
        ("llama3", f"multi-digit, squash {s:g} (the shipped recipe)", multi, s, w),
        ("llama3", f"multi-digit, squash {recipe:.2f} (digit_scale_squash_factor)", multi, recipe, w),
        ("llama3", "multi-digit, no squash", multi, None, w),
        ("llama3", "digit table (1-digit chunks only)", llama_digits, None, w),
    ]
    models = {name: train(tok, train_lines, steps, seed) for name, tok in (("digits", digit_tok),
                                                                            ("llama3", llama_tok))}  # fmt: skip
    rows_of = {name: _batches(_stream(tok, heldout), 64) for name, tok in (("digits", digit_tok),
                                                                            ("llama3", llama_tok))}  # fmt: skip
    rows = []
    for tokenizer, formulation, vocab, squash, weight in setups:
        for state, model in zip(("init", f"{steps} steps"), models[tokenizer]):
            rows.append({"tokenizer": tokenizer, "formulation": formulation, "state": state, "squash": squash,
                         "weight": weight, "numbers": len(vocab),
                         **measure(model, rows_of[tokenizer], vocab, squash, weight)})  # fmt: skip
    return {"rows": rows, "recipe_squash": recipe, "steps": steps, "seed": seed}


def markdown(result: dict[str, Any]) -> str:
    """The table of :func:`run`, and each row's ratio to the digit reference in the same state."""
    ref = {r["state"]: r for r in result["rows"] if r["tokenizer"] == "digits"}
    lines = [
        "| tokenizer | NTL-WAS formulation | weight w | number tokens in table | model | number tokens / all | "
        "NTL per number token | w NTL / CE | x digit level | gradient per number token | "
        "gradient norm w NTL / CE | x digit level |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        base = ref[r["state"]]
        cells = [r["tokenizer"], r["formulation"], f"{r['weight']:g}", str(r["numbers"]), r["state"],
                 f"{r['number_share']:.3f}",
                 f"{r['ntl']:.3g}", f"{r['term_over_ce']:.3g}", f"{r['term_over_ce'] / base['term_over_ce']:.2f}",
                 f"{r['grad_per_number_token']:.3g}", f"{r['grad_ratio']:.3g}",
                 f"{r['grad_ratio'] / base['grad_ratio']:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="CE training steps of the trained model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--write-doc", action="store_true", help="write the table into docs/gpu_study.md")
    args = parser.parse_args(argv)
    result = run(args.steps, args.seed)
    text = markdown(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=lambda v: None if v is None or math.isnan(v) else v)
    if args.write_doc:
        sys.path.insert(0, HERE)
        from doc_blocks import replace_block

        replace_block(os.path.join(ROOT, "docs", "gpu_study.md"), "ntl_term_scale", text)
    return result


if __name__ == "__main__":
    main()
