"""Hugging Face adapter: tables from local checkpoints, causal-LM label shift, lazy import errors.

The causal-LM CE is checked against a tiny GPT-2 built offline from a config, whose own loss is the
independent reference.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ntl_scale
from ntl_scale.integrations import hf
from tests.helpers import tokenizers as tk
from tests.helpers.data import text_labels

transformers = pytest.importorskip("transformers")


def test_table_from_local_checkpoint_uses_the_padded_model_vocab(tmp_path):
    tokenizer = tk.t5_fast()
    tokenizer.save_pretrained(tmp_path)
    transformers.T5Config(vocab_size=256, d_model=8, d_ff=8, num_layers=1, num_heads=1, d_kv=8).save_pretrained(
        tmp_path
    )
    vocab = hf.number_vocab_from_pretrained(tmp_path)
    assert vocab.vocab_size == 256 and len(vocab) == 10
    assert vocab == ntl_scale.NumberVocab.from_tokenizer(tokenizer, vocab_size=256)
    assert hf.number_vocab_from_pretrained(tmp_path, vocab_size=512).vocab_size == 512


def test_not_a_local_directory(tmp_path):
    with pytest.raises(ValueError, match="not a local directory; ntl_scale never downloads"):
        hf.number_vocab_from_pretrained(tmp_path / "org/model")


def test_causal_lm_ce_matches_the_models_own_loss():
    tokenizer = tk.byte_level_bpe()
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    labels = text_labels(tokenizer, rows=2, seq=32)
    input_ids = labels.clamp_min(0)
    with torch.no_grad():
        output = model(input_ids=input_ids, labels=labels)
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer)
    ours = hf.causal_lm_ce_with_ntl(output.logits, labels, vocab, ntl_weight=0.3)
    torch.testing.assert_close(ours.ce, output.loss, atol=1e-5, rtol=1e-6)
    assert ours.ntl > 0 and torch.isclose(ours.loss, ours.ce + 0.3 * ours.ntl)
    assert torch.equal(hf.shift_labels(labels)[:, :-1], labels[:, 1:])


def test_missing_extra_names_the_install_command(tmp_path):
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None\n"
        "from ntl_scale.integrations import hf\n"
        f"hf.number_vocab_from_pretrained({str(tmp_path)!r})\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert out.returncode != 0
    assert "pip install 'ntl_scale[hf]'" in out.stderr


def test_save_number_vocab_command_writes_the_tokenizers_table(tmp_path):
    """``python launch/save_number_vocab.py DIR --out PATH`` saves what ``from_tokenizer`` builds."""
    tokenizer = tk.t5_fast()
    tokenizer.save_pretrained(tmp_path / "tok")
    out = tmp_path / "numbers.json"
    command = [sys.executable, "launch/save_number_vocab.py", str(tmp_path / "tok"), "--out", str(out)]
    done = subprocess.run(
        [*command, "--vocab-size", "256"], capture_output=True, text=True, cwd=Path(__file__).parents[2]
    )
    assert done.returncode == 0, done.stderr
    assert ntl_scale.NumberVocab.load(out) == ntl_scale.NumberVocab.from_tokenizer(tokenizer, vocab_size=256)
    bad = subprocess.run([*command[:2], str(tmp_path / "missing"), "--out", str(out)], capture_output=True, text=True)
    assert bad.returncode != 0 and "neither a local tokenizer directory" in bad.stderr
