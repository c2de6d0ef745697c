"""``deepspeed launch/train.py --config configs/train/tiny_pretrain_cpu.yaml``: pretraining on a packed,
number-rich text corpus that the test writes, on CPU processes over gloo (ZeRO-2).

Sections (sections 1-3: two launches in all, several checks each):
1. Two processes, 12 steps with document isolation and a checkpoint at step 5: the packing counts are
   printed, the loss falls, held-out perplexity is in the log and in metrics.jsonl every 4 steps (exp of
   the held-out CE), the progress line shows MFU.
2. Resume mid-epoch: section 1's checkpoint at step 5 (written on 2 processes) resumed on 1 process in a
   run folder of its own (the same global batch, DeepSpeed's universal checkpoint), the curve and the
   held-out perplexity are the uninterrupted run's.
3. The same corpus as a Megatron indexed dataset (written by megatron-core's own builder) trains the
   same sequences: with the chunked loss, which must honour ``position_ids``, the first 4 steps equal
   section 1's logits-path run. Sections 2 and 3 are one process, ``main()`` once each
   (test_train_deepspeed.py's ``_mains``).
4. Megatron-LM's own ``tools/preprocess_data.py`` (the real release, ``--append-eod``) writes the same
   documents as our ``datasets`` path, so both give the same packed sequences.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest

from tests.integration.test_train_deepspeed import _mains, _metrics, _train

pytest.importorskip("deepspeed")
pytest.importorskip("datasets")
pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "train" / "tiny_pretrain_cpu.yaml"


def corpus_texts(documents: int = 200, seed: int = 0) -> list[str]:
    """Number-rich documents of 0-6 sentences (so some empty), one of 25 (longer than a sequence)."""
    rng = random.Random(seed)
    words = ["plus", "minus", "times"]
    texts = []
    for i in range(documents):
        count = 25 if i == 7 else rng.randint(0, 6)
        sentences = []
        for _ in range(count):
            a, b, op = rng.randint(0, 999), rng.randint(0, 99), rng.choice(words)
            value = {"plus": a + b, "minus": a - b, "times": a * b}[op]
            sentences.append(f"{a} {op} {b} is {value}.")
        texts.append(" ".join(sentences))
    return texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "numbers.jsonl"
    path.write_text("".join(json.dumps({"text": t, "source": "test"}) + "\n" for t in corpus_texts()))
    return path


COMMON = (
    f"--config={CONFIG}", "train.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=8",
    "train.warmup_steps=2", "train.lr_decay=constant", "train.log_every=4", "train.eval_every=4",
    "data.eval_sequences=4", "data.document_isolation=true", "tracking.wandb=disabled", "tracking.plot=false",
    "eval.at_end=false",
    "train.peak_tflops=1.0",  # a nominal peak (CPUs have no table entry): the MFU column is then printed
)  # fmt: skip


def _same_curve(a: list[dict], b: list[dict], rel: float) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for key in ("ce", "ntl", "grad_norm", "eval/ce", "eval/ppl"):
            if key in x or key in y:
                assert abs(x[key] - y[key]) <= rel * max(1.0, abs(x[key])), (key, x, y)


def test_pretrain_packed_text_resume_and_megatron(tmp_path, corpus):
    text = (*COMMON, f"data.train_path={corpus}", f"data.cache_dir={tmp_path / 'cache'}")
    whole = tmp_path / "whole"
    out = _train(whole, *text, "train.steps=12", "train.save_every=5")
    # 1. counts, falling loss, held-out perplexity, MFU
    texts = corpus_texts()
    empty = sum(1 for t in texts if not t)
    summary = next(line for line in out.stdout.splitlines() if line.startswith("packed training corpus: "))
    assert f" {empty} empty documents skipped" in summary and "longer than a sequence" in summary, summary
    rows = _metrics(whole)
    assert [r["step"] for r in rows] == list(range(1, 13))
    first, last = sum(r["ce"] for r in rows[:3]) / 3, sum(r["ce"] for r in rows[-3:]) / 3
    assert last < 0.85 * first, (first, last)
    evaluated = [r for r in rows if "eval/ppl" in r]
    assert [r["step"] for r in evaluated] == [4, 8, 12]
    for r in evaluated:
        assert math.isclose(r["eval/ppl"], math.exp(r["eval/ce"]), rel_tol=1e-9) and r["eval/tokens"] > 0
    assert evaluated[-1]["eval/ppl"] < evaluated[0]["eval/ppl"]
    progress = [line for line in out.stdout.splitlines() if line.startswith("step 12/12")]
    assert progress and "eval ppl" in progress[0] and "MFU" in progress[0] and "MFU n/a" not in progress[0]

    # 2. resume mid-epoch (8 steps an epoch here) on another number of processes: the checkpoint at step 5, in a
    # folder of their own, with the log a run that died after step 5 leaves; its rows after step 5 are made wrong
    # here, so only a resume that cuts the log back to its step and logs the rest again gives the whole curve
    parted = tmp_path / "parted"
    shutil.copytree(whole / "checkpoints" / "step5", parted / "checkpoints" / "step5")
    shutil.copy(whole / "checkpoints" / "layout.json", parted / "checkpoints" / "layout.json")
    (parted / "checkpoints" / "latest").write_text("step5")
    died = [{**r, "ce": -1.0} if r["step"] > 5 else r for r in _metrics(whole)]
    (parted / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in died))

    # 3. the same corpus as a Megatron indexed dataset, the chunked loss with position_ids
    pytest.importorskip("megatron.core")
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from ntl_scale.training.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    prefix = tmp_path / "numbers_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for t in texts:  # what preprocess_data.py --append-eod writes: the ids, then the end-of-document token
        ids = tokenizer(t, add_special_tokens=False)["input_ids"] if t else []
        builder.add_item(torch.tensor([*ids, tokenizer.eos_token_id] if ids else [], dtype=torch.long))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    megatron = tmp_path / "megatron"
    ran = _mains(tmp_path, {
        "resumed": [f"run_dir={parted}", *text, "train.steps=12"],
        "megatron": [f"run_dir={megatron}", *COMMON, "data.source=megatron", f"data.train_path={prefix}",
                     "train.steps=4", "train.chunked_loss=true", "train.loss_chunk_tokens=50"],
    })  # fmt: skip
    assert ran["resumed"]["error"] is None and ran["megatron"]["error"] is None, ran
    assert "resumed from step 5" in ran["resumed"]["stdout"]
    # 1e-5: one process adds the 4 micro-batch gradients in another order than 2 processes and their
    # all-reduce (fp32 rounding; measured 3.5e-6 relative on the gradient norm after 8 steps)
    _same_curve(rows, _metrics(parted), 1e-5)
    assert "packed training corpus: " in ran["megatron"]["stdout"]
    _same_curve(rows[:4], _metrics(megatron), 1e-4)


def test_megatron_preprocess_data_gives_the_same_documents_and_sequences(tmp_path, corpus):
    """Megatron-LM's own ``tools/preprocess_data.py`` (``--append-eod``, a Hugging Face tokenizer) and our
    ``datasets`` path tokenise the corpus to the same documents, so both entries train the same sequences."""
    import numpy as np

    from ntl_scale.data.hf_datasets import HFDocuments, load_text, tokenize_documents
    from ntl_scale.data.indexed import IndexedDocuments
    from ntl_scale.data.packing import PackedSequences
    from ntl_scale.training.tokenizer import build_char_tokenizer
    from tests.helpers import megatron_lm as mlm

    tokenizer = build_char_tokenizer()
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    prefix = tmp_path / "numbers"
    done = mlm.run_tool(
        mlm.RELEASES[-1], "tools/preprocess_data.py",
        ["--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer",
         "--tokenizer-model", str(folder), "--append-eod", "--workers", "1"],
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    theirs = IndexedDocuments(f"{prefix}_text_document")
    ours = HFDocuments(tokenize_documents(load_text(str(corpus), cache_dir=str(tmp_path / "cache")), tokenizer))
    assert (theirs.lengths == 0).sum() == (ours.lengths == 0).sum() > 0  # empty texts: empty documents in both
    assert theirs.lengths.tolist() == ours.lengths.tolist()
    assert theirs.read(0, len(theirs)).tolist() == ours.read(0, len(ours)).tolist()
    a, b = PackedSequences(theirs, 64, document_isolation=True), PackedSequences(ours, 64, document_isolation=True)
    assert len(a) == len(b) > 0
    for i in range(len(a)):
        for key in ("input_ids", "labels", "position_ids"):
            assert np.array_equal(a[i][key], b[i][key]), (i, key)
