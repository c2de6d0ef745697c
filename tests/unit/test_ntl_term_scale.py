"""experiments/ntl_term_scale.py: the NTL term's scale on a Llama 3-style tokenizer against the digit level.

1. Every quantity of one model's row against a float64 computation written here from the definitions
   (softmax over the vocabulary, the number tokens' renormalised distribution, squashed distances
   ``1 + (d - d_min) (s - 1) / (d_max - d_min)``, CE from ``torch.nn.functional.cross_entropy``).
2. The table of docs/gpu_study.md is the script's output (regenerated here: about a minute of CPU).
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import tokenizers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import ntl_term_scale  # noqa: E402


def _reference(logits: torch.Tensor, labels: torch.Tensor, ids: list[int], values: list[float], squash, weight):
    """w * NTL-WAS / CE and the two terms' whole-batch gradient norms, from the definitions, in float64."""
    z = logits.double().clone().requires_grad_(True)
    ce = torch.nn.functional.cross_entropy(z, labels)
    value_of = dict(zip(ids, values))
    index = torch.tensor(ids)
    v = torch.tensor(values, dtype=torch.float64)
    rows = [i for i, t in enumerate(labels.tolist()) if t in value_of]
    target = torch.tensor([value_of[labels[i].item()] for i in rows], dtype=torch.float64)
    d = (v.unsqueeze(0) - target.unsqueeze(1)).abs()
    if squash is not None:
        all_d = (v.unsqueeze(0) - v.unsqueeze(1)).abs()
        small, large = all_d[all_d > 0].min(), all_d.max()
        d = torch.where(d == 0, torch.zeros_like(d), 1 + (d - small) * (squash - 1) / (large - small))
    p = torch.softmax(z[rows], dim=-1)[:, index]
    p = p / p.sum(dim=-1, keepdim=True)
    ntl = (p * d).sum(dim=-1).mean()
    (g_ntl,) = torch.autograd.grad(weight * ntl, z, retain_graph=True)
    (g_ce,) = torch.autograd.grad(ce, z)
    ntl, ce = ntl.detach(), ce.detach()
    return {"ntl": float(ntl), "term_over_ce": float(weight * ntl / ce),
            "grad_ratio": float(g_ntl.norm() / g_ce.norm()), "number_share": len(rows) / len(labels)}  # fmt: skip


@pytest.mark.parametrize("squash", [None, 8.0])
def test_a_row_matches_the_definitions(squash):
    from ntl_scale import NumberVocab

    torch.manual_seed(0)
    tok = tokenizers.llama3_style_bpe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vocab = NumberVocab.from_tokenizer(tok, digit_level=False)
    model = ntl_term_scale.TinyLM(len(tok)).eval()
    rows = ntl_term_scale._batches(ntl_term_scale._stream(tok, tokenizers.corpus(40, seed=1)), 8)
    got = ntl_term_scale.measure(model, rows, vocab, squash, 1.0)
    with torch.no_grad():
        logits = model(rows[:, :-1]).reshape(-1, len(tok))
    want = _reference(logits, rows[:, 1:].reshape(-1), vocab.ids.tolist(), vocab.values.tolist(), squash, 1.0)
    for key, value in want.items():  # the library's squashed distance table is float32: 1e-6
        assert got[key] == pytest.approx(value, rel=1e-6), key


def test_the_documented_table_is_the_script_s_output():
    page = (ROOT / "docs" / "gpu_study.md").read_text()
    block = re.search(r"<!-- generated: ntl_term_scale [^\n]*-->\n(.*?)<!-- end: ntl_term_scale -->", page, re.S)
    assert block, "docs/gpu_study.md lacks the ntl_term_scale block"
    assert block.group(1).strip() == ntl_term_scale.markdown(ntl_term_scale.run()).strip()
