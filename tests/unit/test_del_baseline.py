"""experiments/baselines.py and experiments/train_baselines.py: DEL and NTL-WAS over the digit logits.

1. Place weights: hand-worked values of DEL's ``generate_place`` (PolyU-VCLab/DEL train-qwen-deepseek.py,
   lines 355-386, evaluated by hand for each number below), and rows broken by ignored and other tokens.
2. The DEL term and the digit-only WAS against plain float64 loops over the formulas (math module, no
   tensor code of the module under test), ignored and non-digit positions zero.
3. Gradients: torch.autograd.gradcheck in float64; no gradient reaches non-digit positions or columns.
4. The entry: its overrides, and a few steps through launch/train.py's main: at baseline.weight=0 every
   logged CE, NTL and gradient norm equals launch/train.py's own run, and the rows add the term.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ntl_scale.number_vocab import NumberVocab
from tests.helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))


def _load(name: str):
    return load_script(f"experiments/{name}.py", name)


bl = _load("baselines")

# a vocabulary of 20 ids: the digits at scattered ids (value order != id order), "." at 15, the rest words
DIGIT_ID = {0: 11, 1: 3, 2: 17, 3: 5, 4: 0, 5: 9, 6: 14, 7: 2, 8: 19, 9: 7}
POINT, WORD, IGNORE = 15, 1, -100
VOCAB = NumberVocab(
    list(DIGIT_ID.values()), list(DIGIT_ID), 20, tokens=[str(d) for d in DIGIT_ID], decimal_point_id=POINT
)


def encode(text: str) -> list[int]:
    """Characters to labels: digits and '.', 'w' a word token, 'x' an ignored target."""
    table = {".": POINT, "w": WORD, "x": IGNORE}
    return [DIGIT_ID[int(c)] if c.isdigit() else table[c] for c in text]


ROWS = ["w305w12.5w0.25x", "7x42w9.w.5w1.2.3"]  # equal lengths (15, 16 -> padded below)
LABELS = torch.tensor([encode(ROWS[0] + "w"), encode(ROWS[1])])

# ---- 1. place weights -------------------------------------------------------------------------------

# generate_place by hand: an integer digit k places from the right of its integer part gets 2k, the m-th
# digit after the first point 1.02^-(m+1); a run starting with "." is one integer (the point counted)
EXPECTED = {
    0: [0, 6, 4, 2, 0, 4, 2, 0, 1.02**-2, 0, 2, 0, 1.02**-2, 1.02**-3, 0, 0],
    1: [2, 0, 4, 2, 0, 2, 0, 0, 0, 2, 0, 2, 0, 1.02**-2, 0, 1.02**-4],
}


def test_place_weights_match_generate_place_by_hand():
    got = bl.place_weights(LABELS, bl.digit_ids(VOCAB), POINT, torch.float64)
    for row, expected in EXPECTED.items():
        assert got[row].tolist() == pytest.approx(expected, rel=1e-12, abs=0)


def test_place_weights_without_a_point_token_are_integers():
    labels = torch.tensor([encode("12.34w")])
    got = bl.place_weights(labels, bl.digit_ids(VOCAB), None, torch.float64)
    assert got[0].tolist() == [4, 2, 0, 4, 2, 0]  # "." is then not a number token: two integers


def test_digit_ids_need_every_digit():
    vocab = NumberVocab([1, 2], [1.0, 2.0], 5, tokens=["1", "2"])
    with pytest.raises(ValueError, match=r"no token for \['0', '3'"):
        bl.digit_ids(vocab)


# ---- 2. values against float64 loops ------------------------------------------------------------------


def _softplus(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def reference(logits: torch.Tensor, labels: torch.Tensor, kind: str) -> list[list[float]]:
    """Per position, plainly from the formulas: z = the ten digit logits, p = their softmax."""
    out = []
    for b, row in enumerate(labels.tolist()):
        values = []
        for t, label in enumerate(row):
            digit = next((d for d, i in DIGIT_ID.items() if i == label), None)
            if digit is None:
                values.append(0.0)
                continue
            z = [float(logits[b, t, DIGIT_ID[k]]) for k in range(10)]
            top = max(z)
            total = sum(math.exp(v - top) for v in z)
            p = [math.exp(v - top) / total for v in z]
            if kind == "was":
                values.append(sum(p[k] * abs(k - digit) for k in range(10)))
            else:  # BCE with logits: target 1 -> softplus(-z), target 0 -> softplus(z)
                bce = [_softplus(-z[k]) if k == digit else _softplus(z[k]) for k in range(10)]
                values.append(EXPECTED[b][t] * sum(bce[k] * p[k] for k in range(10)) / 10)
        out.append(values)
    return out


@pytest.mark.parametrize("kind, term", [("del", "del_term"), ("was", "digit_was_term")])
@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_terms_equal_float64_loops(kind, term, scale):
    torch.manual_seed(0)
    logits = torch.randn(*LABELS.shape, 20, dtype=torch.float64) * scale
    got = getattr(bl, term)(logits, LABELS, VOCAB)
    assert got.value.dtype == torch.float64
    assert got.value.tolist() == [pytest.approx(r, rel=1e-12, abs=1e-14) for r in reference(logits, LABELS, kind)]
    digits = [[label in DIGIT_ID.values() for label in row] for row in LABELS.tolist()]
    assert got.mask.tolist() == digits  # ignored (-100), "." and word targets carry nothing


def test_float32_logits_agree_with_float64():
    torch.manual_seed(1)
    logits = torch.randn(*LABELS.shape, 20, dtype=torch.float64)
    for term in (bl.del_term, bl.digit_was_term):
        single = term(logits.float(), LABELS, VOCAB).value
        assert single.dtype == torch.float32
        torch.testing.assert_close(single.double(), term(logits, LABELS, VOCAB).value, rtol=1e-5, atol=1e-6)


# ---- 3. gradients -------------------------------------------------------------------------------------


@pytest.mark.parametrize("term", ["del_term", "digit_was_term"])
def test_gradcheck_float64(term):
    torch.manual_seed(2)
    labels = LABELS[:, 5:14]  # integer parts, fractions, points, words and an ignored target
    logits = torch.randn(*labels.shape, 20, dtype=torch.float64)
    columns = list(DIGIT_ID.values())  # the other columns get no gradient (checked below): held constant
    digits = logits[..., columns].clone().requires_grad_(True)
    weights = torch.randn(*labels.shape, dtype=torch.float64)  # an arbitrary upstream gradient

    def term_of(z: torch.Tensor) -> torch.Tensor:
        full = logits.clone()
        full[..., columns] = z
        return (getattr(bl, term)(full, labels, VOCAB).value * weights).sum()

    assert torch.autograd.gradcheck(term_of, (digits,))


@pytest.mark.parametrize("term", ["del_term", "digit_was_term"])
def test_no_gradient_outside_digit_targets_and_digit_columns(term):
    torch.manual_seed(3)
    logits = torch.randn(*LABELS.shape, 20, dtype=torch.float64, requires_grad=True)
    getattr(bl, term)(logits, LABELS, VOCAB).value.sum().backward()
    mask = getattr(bl, term)(logits, LABELS, VOCAB).mask
    grad = logits.grad
    assert grad[~mask].abs().max() == 0
    others = [i for i in range(20) if i not in DIGIT_ID.values()]
    assert grad[..., others].abs().max() == 0
    assert grad[mask][:, list(DIGIT_ID.values())].abs().min() > 0


# ---- 4. the entry -------------------------------------------------------------------------------------


def test_split_overrides():
    tb = _load("train_baselines")
    rest, settings = tb.split_overrides(["--config", "c.yaml", "ntl.weight=0", "baseline.loss=del"])
    assert rest == ["--config", "c.yaml", "ntl.weight=0"] and settings == {"loss": "del", "weight": 0.01}
    assert tb.split_overrides(["baseline.loss=digit_was"])[1] == {"loss": "digit_was", "weight": 0.3}
    assert tb.split_overrides(["train.steps=3"]) == (["train.steps=3"], None)
    for bad, message in (
        (["baseline.loss=dell"], r"baseline.loss='dell': expected one of \['del', 'digit_was'\]"),
        (["baseline.loss=del", "baseline.weight=much"], r"baseline.weight='much': expected a number"),
        (["baseline.loss=del", "baseline.weight=-1"], r"baseline.weight=-1.0: expected a finite number >= 0"),
        (["baseline.loss=del", "baseline.wieght=1"], r"unknown override\(s\) baseline.\['wieght'\]"),
    ):
        with pytest.raises(ValueError, match=message):
            tb.split_overrides(bad)


def test_the_term_needs_global_normalisation():
    from ntl_scale.training.config import load_config

    tb = _load("train_baselines")
    cfg = load_config(str(ROOT / "configs/train/tiny_cpu.yaml"), ["ntl.normalization=micro-batch"])
    trainer = type("T", (tb.BaselineTrainer,), {"baseline": {"loss": "del", "weight": 0.01}})
    with pytest.raises(ValueError, match=r"set ntl.normalization=global \(got 'micro-batch'\)"):
        trainer(cfg, rank=0, world_size=1, device="cpu").setup()


def _run(script: str, run_dir: Path, *extra: str) -> list[dict]:
    overrides = ["ntl.weight=0", f"run_dir={run_dir}", "train.steps=3", "train.log_every=3", "train.micro_batch_size=8",
                 "data.train_examples=64", "data.eval_examples=4", "eval.max_new_tokens=4", "tracking.wandb=disabled",
                 "tracking.plot=false", "model.architecture.n_layer=1"]  # fmt: skip
    command = [sys.executable, script, "--config", "configs/train/tiny_cpu.yaml", *overrides, *extra]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_entry_runs_launch_train_with_the_term(tmp_path):
    pytest.importorskip("deepspeed")
    plain = _run("launch/train.py", tmp_path / "plain")
    zero = _run("experiments/train_baselines.py", tmp_path / "del0", "baseline.loss=del", "baseline.weight=0")
    assert json.loads((tmp_path / "del0" / "baseline.json").read_text()) == {"loss": "del", "weight": 0.0}
    for a, b in zip(plain, zero, strict=True):  # the same run: the term at weight 0 changes nothing
        assert (a["ce"], a["ntl"], a["number_acc"], a["grad_norm"]) == (
            b["ce"],
            b["ntl"],
            b["number_acc"],
            b["grad_norm"],
        )
        assert b["baseline"] > 0 and b["objective"] == b["ce"]
    assert json.loads((tmp_path / "plain" / "eval.json").read_text()) == json.loads(
        (tmp_path / "del0" / "eval.json").read_text()
    )


def test_each_name_of_the_entry_is_its_term():
    """``baseline.loss=NAME`` trains with ``BASELINES[NAME]``; the entry runs above with ``del`` only, the CI study
    (configs/study/del_ci.yaml) with ``del`` only: ``digit_was`` is the same step with this term."""
    assert bl.BASELINES == {"del": bl.del_term, "digit_was": bl.digit_was_term}
