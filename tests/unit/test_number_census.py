"""Number-token census, the multi-digit scale recipe, and the shipped configs (docs/number_vocab.md, recipes).

1. The census of each tokenizer family (offline builds of tests/helpers/tokenizers.py) against counts
   written from the token rules; the warning and the command line's refusal where the digit table loses
   most number tokens.
2. The scale: ``untrained_was`` and ``digit_scale_squash_factor`` against a float64 pairwise reference; an
   untrained model's NTL-WAS on a Llama 3-style tokenizer's digit table vs its multi-digit table with the
   recipe, from an independent float64 NTL-WAS written from the definition.
3. The refusal at initialisation on every front end's spelling.
4. Every shipped config with a multi-digit NTL-WAS table carries a squash factor that the recipe accepts.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import yaml

import ntl_scale
from tests.helpers import tokenizers as tk

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGIT_WAS = 99 / 30  # mean |i - j| over i, j in 0..9
FACTOR = 1.25  # the untrained NTL of the recipe's multi-digit table is within this of the digit table's


def _reference_counts(tokens: list[str]) -> tuple[int, int]:
    """(bare digits, bare multi-digit literals) by the rule of docs/number_vocab.md, written with str methods."""
    digits = sum(1 for t in tokens if len(t) == 1 and t in "0123456789")
    multi = 0
    for t in tokens:
        body = t[1:] if t[:1] in "+-" else t
        whole, _, frac = body.partition(".")
        ok = whole.isascii() and whole.isdigit() and (not _ or (frac.isascii() and frac.isdigit()))
        multi += ok and not (len(t) == 1 and t in "0123456789")
    return digits, multi


# ------------------------------------------------------------------------------- 1. census


@pytest.mark.parametrize(
    "family, build, recipe",
    [
        ("Llama 3 (1-3 digit chunks)", tk.llama3_style_bpe, "multi-digit table"),
        ("Qwen / DeepSeek / Tekken (single digits, byte-level BPE)", tk.byte_level_bpe, "digit table"),
        ("Mistral / Gemma (SentencePiece, split digits)", lambda: tk.mistral_style_sentencepiece(), "digit table"),
    ],
)
def test_census_of_each_family(family, build, recipe):
    tokenizer = build()
    if isinstance(tokenizer, str):
        import sentencepiece as spm

        tokenizer = spm.SentencePieceProcessor(model_file=tokenizer)
        tokens = [tokenizer.id_to_piece(i) for i in range(tokenizer.get_piece_size())]
    else:
        tokens = list(tokenizer.get_vocab())
    digits, multi = _reference_counts(tokens)
    census = ntl_scale.number_vocab.number_token_census(tokenizer)
    assert (len(census.digits), census.multi_digit, census.tokens) == (digits, multi, len(tokens)), family
    assert census.kept == digits and census.left_out == multi + census.prefixed
    assert census.recipe().startswith(recipe), (family, census.recipe())
    assert census.loses_most == (recipe == "multi-digit table")


def test_llama3_style_census_counts_what_the_digit_table_leaves_out():
    tokenizer = tk.llama3_style_bpe()
    census = ntl_scale.number_vocab.number_token_census(tokenizer)
    tokens = list(tokenizer.get_vocab())
    digits, multi = _reference_counts(tokens)
    assert (digits, multi) == (10, 904)  # the numbers for this build
    assert census.summary().splitlines()[1].startswith("the digit table keeps 10 and leaves out 904")
    multi_census = ntl_scale.number_vocab.number_token_census(tokenizer, digit_level=False)
    assert (multi_census.kept, multi_census.left_out, multi_census.loses_most) == (914, 0, False)


def test_digit_table_on_llama3_style_warns_with_the_recipe():
    with pytest.warns(ntl_scale.number_vocab.NumberTableWarning, match=r"leaves out 904.*squash_factor=7\.8"):
        ntl_scale.NumberVocab.from_tokenizer(tk.llama3_style_bpe())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ntl_scale.number_vocab.NumberTableWarning)
        ntl_scale.NumberVocab.from_tokenizer(tk.byte_level_bpe())  # single digits: nothing lost, no warning
        ntl_scale.NumberVocab.from_tokenizer(tk.llama3_style_bpe(), digit_level=False)
        ntl_scale.NumberVocab.from_sentencepiece(tk.mistral_style_sentencepiece())


def test_command_line_refuses_the_digit_table_that_loses_most_numbers(tmp_path):
    directory = tk.save_dir(tk.llama3_style_bpe(), "llama3_cli")
    out = tmp_path / "numbers.json"
    env = {**os.environ, "PYTHONPATH": ROOT}
    command = [sys.executable, os.path.join(ROOT, "launch", "save_number_vocab.py"), directory, "--out", str(out)]
    refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode == 2 and not out.exists()
    assert "904 multi-digit number tokens" in refused.stdout and "--multi-digit" in refused.stderr
    made = subprocess.run([*command, "--multi-digit"], capture_output=True, text=True, env=env, timeout=300)
    assert made.returncode == 0, made.stderr
    assert len(ntl_scale.NumberVocab.load(out)) == 914 and "squash_factor 7.8" in made.stdout
    kept = subprocess.run([*command, "--digits"], capture_output=True, text=True, env=env, timeout=300)
    assert kept.returncode == 0 and len(ntl_scale.NumberVocab.load(out)) == 10


# ------------------------------------------------------------------------------- 2. the scale


def _pairwise_was(values: list[float], squash: float | None) -> float:
    """Mean over all token pairs of the (squashed) distance: the definition, as an n x n float64 matrix."""
    v = torch.tensor(values, dtype=torch.float64)
    d = (v[:, None] - v[None, :]).abs()
    if squash is not None:
        nonzero = d[d > 0]
        low, high = nonzero.min(), nonzero.max()
        d = torch.where(d > 0, 1 + (d - low) * (squash - 1) / (high - low), d)
    return float(d.mean())


@pytest.mark.parametrize(
    "values",
    [list(range(1000)), [float(int(s)) for n in (1, 2, 3) for s in (f"{i:0{n}d}" for i in range(10**n))],
     [0, 1, 2, 5, 5, 12, 345, -3, 2.5], list(range(10))],
)  # fmt: skip
def test_untrained_was_and_the_matching_squash_factor(values):
    from ntl_scale.number_vocab import digit_scale_squash_factor, untrained_was

    for squash in (None, 2.0, 10.0):
        assert untrained_was(values, squash) == pytest.approx(_pairwise_was(values, squash), rel=1e-12)
    squash = digit_scale_squash_factor(values)
    assert _pairwise_was(values, squash) == pytest.approx(DIGIT_WAS, rel=1e-12)


def _reference_ntl_was(logits: torch.Tensor, labels: torch.Tensor, ids: list[int], values: list[float], squash):
    """NTL-WAS from the definition in float64: softmax over the number columns, sum_k p_k d(v_k, t), mean over
    the positions whose label is a number token."""
    value_of = dict(zip(ids, values))
    rows = [i for i, y in enumerate(labels.tolist()) if y in value_of]
    v = torch.tensor(values, dtype=torch.float64)
    pairs = (v[:, None] - v[None, :]).abs()
    nonzero = pairs[pairs > 0]
    low, high = float(nonzero.min()), float(nonzero.max())
    total = 0.0
    for i in rows:
        p = torch.softmax(logits[i, ids].double(), dim=0)
        d = (v - value_of[int(labels[i])]).abs()
        if squash is not None:
            d = torch.where(d > 0, 1 + (d - low) * (squash - 1) / (high - low), d)
        total += float((p * d).sum())
    return total / len(rows)


def test_untrained_ntl_of_the_multi_digit_recipe_matches_the_digit_table_on_llama3_style():
    """A tiny untrained model (embedding and output head at init scale 0.02) on the Llama 3-style tokenizer's
    text: NTL-WAS on its digit table vs its multi-digit table with digit_scale_squash_factor, both by the
    float64 reference; the library's loss agrees with the reference."""
    tokenizer = tk.llama3_style_bpe()
    ids = torch.tensor(tokenizer("\n".join(tk.corpus(200, seed=3)))["input_ids"])
    inputs, labels = ids[:-1], ids[1:]
    size, hidden = len(tokenizer), 64
    generator = torch.Generator().manual_seed(0)
    embedding = torch.randn(size, hidden, generator=generator) * 0.02
    head = torch.randn(size, hidden, generator=generator) * 0.02
    logits = embedding[inputs] @ head.T
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ntl_scale.number_vocab.NumberTableWarning)
        digit = ntl_scale.NumberVocab.from_tokenizer(tokenizer)
    multi = ntl_scale.NumberVocab.from_tokenizer(tokenizer, digit_level=False)
    squash = ntl_scale.number_vocab.digit_scale_squash_factor(multi.values)
    on_digits = _reference_ntl_was(logits, labels, digit.ids.tolist(), digit.values.tolist(), None)
    on_multi = _reference_ntl_was(logits, labels, multi.ids.tolist(), multi.values.tolist(), squash)
    unsquashed = _reference_ntl_was(logits, labels, multi.ids.tolist(), multi.values.tolist(), None)
    assert 1 / FACTOR < on_multi / on_digits < FACTOR, (on_digits, on_multi, squash)
    assert unsquashed / on_digits > 50  # what the initialisation check refuses
    library = ntl_scale.number_token_loss(logits, labels, multi, squash_factor=squash)
    assert float(library) == pytest.approx(on_multi, rel=1e-4)


# ------------------------------------------------------------------------------- 3. initialisation


@pytest.mark.parametrize(
    "surface, spelled",
    [("hf", "options.squash_factor"), ("megatron", "--ntl-squash-factor"), ("yaml", "ntl.squash_factor"),
     ("torchtitan", "loss.squash_factor")],
)  # fmt: skip
def test_multi_digit_was_without_a_scale_is_refused_with_the_factor(surface, spelled):
    from ntl_scale._validation import check_table

    table = ntl_scale.NumberVocab(list(range(1000)), [float(i) for i in range(1000)], 1024)
    with pytest.raises(ValueError, match=re.escape(f"{spelled}=7.9") + ".*digit level"):
        check_table(table, ntl_scale.NTLOptions(), surface)
    check_table(table, ntl_scale.NTLOptions(squash_factor=8.0), surface)  # the recipe passes quietly
    with pytest.warns(ntl_scale.number_vocab.NumberTableWarning, match="7.9 matches it"):
        check_table(table, ntl_scale.NTLOptions(squash_factor=100.0), surface)
    with pytest.warns(ntl_scale.number_vocab.NumberTableWarning, match="no squash factor applies"):
        check_table(table, ntl_scale.NTLOptions(loss="mse"), surface)


def test_hf_and_megatron_refuse_it_when_the_loss_is_built():
    from ntl_scale.integrations.hf import NTLCausalLMLoss
    from ntl_scale.integrations.megatron import NTLSettings, build_number_vocab

    tokenizer = tk.llama3_style_bpe()
    multi = ntl_scale.NumberVocab.from_tokenizer(tokenizer, digit_level=False)
    with pytest.raises(ValueError, match=r"options\.squash_factor=7\.8"):
        NTLCausalLMLoss(multi)
    NTLCausalLMLoss(multi, options=ntl_scale.NTLOptions(squash_factor=7.8))

    class Megatron:  # Megatron's tokenizers expose id -> token as inv_vocab
        def __init__(self) -> None:
            self.inv_vocab = {i: t for t, i in tokenizer.get_vocab().items()}

    with pytest.raises(ValueError, match=r"--ntl-squash-factor=7\.8"):
        build_number_vocab(NTLSettings(weight=0.3, number_vocab="multi-digit"), Megatron(), 1536)
    build_number_vocab(NTLSettings(weight=0.3, number_vocab="multi-digit", squash_factor=8.0), Megatron(), 1536)


# ------------------------------------------------------------------------------- 4. shipped configs


def _ntl_settings() -> list[tuple[str, dict]]:
    """(where, {digit_level, loss, squash_factor}) of every NTL setting in configs/ and the torchtitan registry."""
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            text = yaml.safe_load(f)

        def walk(node, where):
            if isinstance(node, dict):
                if "ntl-weight" in node or "ntl-number-vocab" in node:
                    found.append((where, {"digit_level": node.get("ntl-number-vocab", "digits") == "digits",
                                          "loss": node.get("ntl-loss", "was"),
                                          "squash_factor": node.get("ntl-squash-factor")}))  # fmt: skip
                if isinstance(node.get("ntl"), dict):
                    ntl = node["ntl"]
                    found.append((where + ":ntl", {"digit_level": ntl.get("digit_level", True),
                                                   "loss": ntl.get("loss", "was"),
                                                   "squash_factor": ntl.get("squash_factor")}))  # fmt: skip
                for key, value in node.items():
                    walk(value, f"{where}:{key}")
            elif isinstance(node, list):
                for i, value in enumerate(node):
                    walk(value, f"{where}[{i}]")

        walk(text, os.path.relpath(path, ROOT))
    registry = os.path.join(ROOT, "ntl_scale", "integrations", "torchtitan", "config_registry.py")
    with open(registry, encoding="utf-8") as f:
        for call in re.findall(r"NTLLoss\.Config\(([^)]*)\)", f.read()):
            squash = re.search(r"squash_factor=([0-9.]+)", call)
            read = {"digit_level": "digit_level=False" not in call, "loss": "was"}
            found.append((f"config_registry: {call}", {**read, "squash_factor": float(squash[1]) if squash else None}))
    return found


def test_every_shipped_multi_digit_was_config_follows_the_recipe():
    """The recipe: a multi-digit NTL-WAS table (Llama 3's 1-3 digit chunks, values 0-999) carries a squash factor
    that puts an untrained model's NTL within FACTOR of the digit table's; computed by the pairwise reference."""
    settings = _ntl_settings()
    multi = [(where, s) for where, s in settings if not s["digit_level"] and s["loss"] == "was"]
    assert len(multi) >= 6, settings  # Megatron, DeepSpeed x 2, torchtitan, GPU study (arms and eval)
    for where, s in multi:
        assert s["squash_factor"] is not None, f"{where}: a multi-digit NTL-WAS table without a squash factor"
        ratio = _pairwise_was(list(range(1000)), float(s["squash_factor"])) / DIGIT_WAS
        assert 1 / FACTOR < ratio < FACTOR, (where, s, ratio)
