"""Tiny data for the GPU study's CPU run: a real BPE tokenizer and Megatron indexed corpora, built offline.

:func:`build` writes into a folder

* ``tokenizer/``: the Llama-3-style byte-level BPE of ``tests/helpers/tokenizers.py`` (numbers split
  into 1-3 digit tokens, so the ``multi-digit`` number table of the study's arms has 1,000 values);
* five Megatron indexed datasets (``<name>_text_document.{bin,idx}``, written with megatron.core's own
  ``IndexedDatasetBuilder``, one document per text, end-of-document token appended, as
  ``tools/preprocess_data.py --append-eod`` writes them): ``text`` (training prose: CPython's
  documentation topics), ``number_rich`` (the number documents of ``experiments/pretrain_corpus.py``,
  seed 0), and the small held-out sets ``prose`` (other documentation topics), ``code`` (Python source
  of the standard library) and ``math`` (number documents of another seed);
* ``<set>_heldout.jsonl``: the held-out sets as JSON lines (the data file's ``heldout_text``, for the harness);
* ``data.yaml``: the study's data file pointing at them.
"""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _texts() -> dict[str, list[str]]:
    import sys

    sys.path.insert(0, str(ROOT / "experiments"))
    import pretrain_corpus

    prose = pretrain_corpus.prose_documents(0, 240_000)
    numbers = [t for _, t in pretrain_corpus.number_documents(random.Random(0), 600, set())]
    math_ = [t for _, t in pretrain_corpus.number_documents(random.Random(1), 8, set())]
    import json as json_module

    code = [inspect.getsource(json_module.decoder)[:2000]]
    # small held-out sets (Megatron evaluates each in full): about 1,000 tokens each
    return {"text": prose[4:], "number_rich": numbers, "prose": [d[:2000] for d in prose[:4]], "code": code,
            "math": math_}  # fmt: skip


def build(folder: Path) -> Path:
    """Writes the tokenizer, the corpora and ``data.yaml`` into ``folder``; returns the data file's path."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from tests.helpers import tokenizers

    tok = tokenizers.llama3_style_bpe()
    tok_dir = folder / "tokenizer"
    tok.save_pretrained(tok_dir)
    prefixes = {}
    texts = _texts()
    for name, docs in texts.items():
        prefix = folder / f"{name}_text_document"
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
        for text in docs:
            ids = tok(text)["input_ids"] + [tok.eos_token_id]
            builder.add_document(torch.tensor(ids, dtype=torch.int32), [len(ids)])
        builder.finalize(f"{prefix}.idx")
        prefixes[name] = str(prefix)
    heldout = {}
    for name in ("prose", "code", "math"):  # the same held-out texts as JSON lines, for the harness
        heldout[name] = folder / f"{name}_heldout.jsonl"
        heldout[name].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[name]))
    data = {"tokenizer": str(tok_dir), "text": prefixes["text"], "number_rich": prefixes["number_rich"],
            "valid": {k: prefixes[k] for k in ("prose", "code", "math")},
            "heldout_text": {k: str(v) for k, v in heldout.items()}}  # fmt: skip
    path = folder / "data.yaml"
    path.write_text(yaml.safe_dump(data))
    (folder / "vocab_size.json").write_text(json.dumps(len(tok)))
    return path
