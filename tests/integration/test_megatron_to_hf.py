"""A Megatron-LM GPT checkpoint to Hugging Face (``launch/megatron_to_hf.py``), against Megatron's own forward.

Each release (core_v0.16.1 keeps the run's arguments in ``common.pt``, core_v0.19.0 inside the
``torch_dist`` files) trains the tests' tiny GPT with the NTL drop-in for one iteration in one CPU
process and saves it (``--save``, ``torch_dist``); the converted ``GPT2LMHeadModel`` gives, on seeded
tokens, the logits of Megatron Core's own ``GPTModel`` loaded from the same checkpoint by Megatron's own
``dist_checkpointing`` (``tests/helpers/megatron_forward.py``, run with that release).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import megatron_lm as mlm

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--split", "100,0,0", "--eval-iters", "0",
        "--eval-interval", "1000"]  # fmt: skip


@pytest.mark.parametrize("tag", mlm.RELEASES)
def test_converted_checkpoint_gives_megatrons_logits(tag: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from launch.megatron_to_hf import convert
    from ntl_scale import NumberVocab

    numbers = tmp_path / "numbers.json"  # ids 48-57 are the digits (the NullTokenizer runs' table)
    NumberVocab.from_id_to_token({i: (str(i - 48) if 48 <= i < 58 else f"w{i}") for i in range(127)},
                                 vocab_size=128).save(numbers)  # fmt: skip
    ckpt = tmp_path / "ckpt"
    args = [*mlm.tiny_args(iters=1), *MOCK, "--ntl-weight", "0.3", "--ntl-number-vocab", str(numbers),
            "--save", str(ckpt), "--save-interval", "1"]  # fmt: skip
    run = mlm.run(tag, mlm.DROP_IN, args, nproc=1, workdir=tmp_path / "run")
    assert run.returncode == 0, mlm.tail(run.output)
    iteration = ckpt / "iter_0000001"
    config = convert(str(iteration), str(tmp_path / "hf"))
    assert config["n_layer"] == 2 and config["vocab_size"] == 128 and config["tie_word_embeddings"]

    tokens = torch.randint(0, 127, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MEGATRON_LM_PATH": str(mlm.checkout(tag))}
    helper = [sys.executable, str(ROOT / "tests" / "helpers" / "megatron_forward.py")]
    done = subprocess.run([*helper, str(iteration), str(tmp_path / "tokens.pt"), str(tmp_path / "logits.pt")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    expected = torch.load(tmp_path / "logits.pt")

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits
    assert logits.shape == expected.shape == (2, 32, 128)
    # about 1e-7 apart; GPT-2's tanh GeLU in place of Megatron's erf GeLU is 2e-6 off, unregrouped QKV 0.2
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
