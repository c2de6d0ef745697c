"""Packed pretraining data, checked against a naive re-implementation in this file (concatenate the
documents' token lists, slice every ``seq_length`` tokens) and against the tokenizer called directly.

1. Packing: every sequence of :class:`PackedSequences` and of the streaming packer equals the naive
   slices; counts of empty, long and tail tokens; document isolation restarts ``position_ids`` at each
   document start and masks the label of each document's first token; the held-out part is disjoint.
2. Text corpora through ``datasets`` (JSON lines, Parquet, a ``save_to_disk`` folder, a folder of files,
   streaming): documents are the tokenizer's ids plus EOS (BOS only where the tokenizer adds one), and
   the packed training sequences equal the naive packing of the documents after the held-out ones.
3. Order: resuming at a step boundary on 1, 2 or 4 data-parallel ranks gives the global batches of the
   uninterrupted run (map-style and streaming), every sequence once per epoch.
4. Megatron indexed datasets written by megatron-core's own ``IndexedDatasetBuilder``: read with
   megatron-core's reader and with ours, the same documents; packed as the naive reference.
5. Bad data: an empty file, a missing column, a non-UTF-8 or malformed line (file and line named), a
   missing Megatron prefix, too little data for the held-out part, a non-text value.
6. Document isolation in a real Hugging Face model (transformers' own mask from ``position_ids``):
   each document's logits inside a packed sequence equal the model run on that document alone.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from ntl_scale.data.hf_datasets import document_specials, load_text, tokenize_documents
from ntl_scale.data.packing import PackedSequences, collate_packed, heldout_split, pack_documents
from ntl_scale.training.config import DataConfig
from ntl_scale.training.sources import Batches, heldout_batches, packing_summary, train_dataset
from tests.helpers import tokenizers

IGNORE = -100


def naive_pack(documents: list[list[int]], seq_length: int, isolate: bool = False) -> list[dict[str, list[int]]]:
    """The reference: one token list, cut every ``seq_length`` tokens; positions counted token by token."""
    stream, position, first = [], [], []
    for doc in documents:
        for j, token in enumerate(doc):
            stream.append(token)
            position.append(j)
            first.append(j == 0)
    out = []
    for s in range(len(stream) // seq_length):
        part = slice(s * seq_length, (s + 1) * seq_length)
        ids = stream[part]
        row = {"input_ids": ids, "labels": list(ids)}
        if isolate:
            # positions restart per document, and at the sequence start (a continued document)
            pos, labels, offset = [], list(ids), 0
            for k, (p, f) in enumerate(zip(position[part], first[part])):
                if k == 0 or f:
                    offset = p
                pos.append(p - offset)
                if f and k > 0:
                    labels[k] = IGNORE
            row.update(position_ids=pos, labels=labels)
        out.append(row)
    return out


class ListDocuments:
    """A DocumentSource over Python lists (the test's own)."""

    def __init__(self, documents: list[list[int]]) -> None:
        self.documents = documents
        self.lengths = np.array([len(d) for d in documents], dtype=np.int64)

    def read(self, first: int, stop: int) -> np.ndarray:
        return np.array([t for d in self.documents[first:stop] for t in d], dtype=np.int64)


def random_documents(seed: int, count: int = 40, longest: int = 30) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    docs = [list(rng.integers(1, 1000, rng.integers(0, longest))) for _ in range(count)]
    docs[3] = []  # an empty document
    docs[5] = list(range(1, 3 * longest))  # longer than any sequence below
    return docs


def as_lists(row: dict) -> dict[str, list[int]]:
    return {k: [int(x) for x in v] for k, v in row.items()}


# ---- 1. packing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_length", [2, 7, 16, 64])
@pytest.mark.parametrize("isolate", [False, True])
def test_packed_sequences_equal_the_naive_slices(seq_length, isolate):
    docs = random_documents(seq_length)
    expected = naive_pack(docs, seq_length, isolate)
    packed = PackedSequences(ListDocuments(docs), seq_length, document_isolation=isolate)
    assert len(packed) == len(expected) > 0
    assert [as_lists(packed[i]) for i in range(len(packed))] == expected
    streamed = list(pack_documents(docs, seq_length, document_isolation=isolate))
    assert [as_lists(r) for r in streamed] == expected
    total = sum(len(d) for d in docs)
    stats = packed.stats
    assert (stats.documents, stats.tokens, stats.sequences) == (40, total, len(expected))
    assert stats.empty_documents == sum(1 for d in docs if not d) >= 1
    assert stats.long_documents == sum(1 for d in docs if len(d) > seq_length) >= 1
    assert stats.tail_tokens == total - len(expected) * seq_length
    assert "empty documents skipped" in packing_summary(packed)
    with pytest.raises(IndexError):
        packed[len(packed)]


def test_isolation_positions_and_labels_by_hand():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]]
    rows = [as_lists(r) for r in pack_documents(docs, 4, document_isolation=True)]
    assert rows == [  # 11 tokens: two sequences of 4, the last 3 tokens left out
        {"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, IGNORE], "position_ids": [0, 1, 2, 0]},
        {"input_ids": [5, 6, 7, 8], "labels": [5, IGNORE, 7, 8], "position_ids": [0, 0, 1, 2]},
    ]
    batch = collate_packed(list(pack_documents(docs, 4, document_isolation=True)))
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].dtype == torch.long
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 0, 1, 2]]
    assert set(collate_packed(list(pack_documents(docs, 4)))) == {"input_ids", "labels"}  # no mask, no padding


def test_heldout_part_is_whole_documents_disjoint_from_training():
    docs = random_documents(1)
    lengths = np.array([len(d) for d in docs])
    first = heldout_split(lengths, 8, 5)
    assert sum(lengths[: first - 1]) < 5 * 8 <= sum(lengths[:first])  # the fewest documents that hold 5 sequences
    held = PackedSequences(ListDocuments(docs), 8, stop_document=first, max_sequences=5)
    train = PackedSequences(ListDocuments(docs), 8, first_document=first)
    assert [as_lists(held[i]) for i in range(5)] == naive_pack(docs[:first], 8)[:5]
    assert [as_lists(train[i]) for i in range(len(train))] == naive_pack(docs[first:], 8)
    streamed = list(pack_documents(docs, 8, skip_tokens=5 * 8))
    assert [as_lists(r) for r in streamed] == naive_pack(docs[first:], 8)
    with pytest.raises(ValueError, match=r"fewer than the 100000 that data.eval_sequences=10000"):
        heldout_split(lengths, 10, 10000)


# ---- 2. text corpora ----------------------------------------------------------------------------------

TEXTS = [f"item {i}: {i * 37 % 1000} apples cost {i * 1.5:.2f} dollars, total {i * 111}." for i in range(60)]
TEXTS[7] = ""  # empty documents are skipped and counted
TEXTS[11] = " ".join(str(n) for n in range(200))  # longer than a sequence


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def reference_documents(tokenizer, texts, bos=None):
    head = [bos] if bos is not None else []
    out = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=False)["input_ids"] if t else []
        out.append([*head, *ids, tokenizer.eos_token_id] if ids else [])
    return out


def test_documents_are_the_tokenizer_ids_plus_eos(tmp_path):
    import datasets

    tokenizer = tokenizers.byte_level_bpe()
    assert document_specials(tokenizer) == (None, tokenizer.eos_token_id)  # GPT-2 style: BOS is EOS, not added
    expected = reference_documents(tokenizer, TEXTS)
    jsonl = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    datasets.Dataset.from_dict({"body": TEXTS}).to_parquet(str(tmp_path / "c.parquet"))
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "disk"))
    (tmp_path / "shards").mkdir()
    write_jsonl(tmp_path / "shards" / "a.jsonl", TEXTS[:25])
    write_jsonl(tmp_path / "shards" / "b.jsonl", TEXTS[25:])
    cache = str(tmp_path / "cache")
    for path, column in [(jsonl, "text"), (tmp_path / "c.parquet", "body"), (tmp_path / "disk", "text"),
                         (tmp_path / "shards", "text")]:  # fmt: skip
        rows = load_text(str(path), text_column=column, cache_dir=cache)
        docs = tokenize_documents(rows, tokenizer, text_column=column)
        assert [list(d) for d in docs["input_ids"]] == expected, path
        stream = tokenize_documents(load_text(str(path), text_column=column, streaming=True), tokenizer,
                                    text_column=column)  # fmt: skip
        assert [list(r["input_ids"]) for r in stream] == expected, path
    two = tokenize_documents(load_text(str(jsonl), cache_dir=cache), tokenizer, num_proc=2)
    assert [list(d) for d in two["input_ids"]] == expected


def test_bos_only_where_the_tokenizer_adds_it():
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "1": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    llama_like = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert document_specials(llama_like) == (0, 1)
    raw.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    no_bos = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert document_specials(no_bos) == (None, 1)
    assert document_specials(tokenizers.t5_fast()) == (None, tokenizers.t5_fast().eos_token_id)


def text_config(path, tmp_path, **extra) -> DataConfig:
    return DataConfig(source="text", train_path=str(path), cache_dir=str(tmp_path / "cache"), **extra)


@pytest.mark.parametrize("isolate", [False, True])
def test_train_and_heldout_sequences_equal_the_naive_packing(tmp_path, isolate):
    tokenizer = tokenizers.byte_level_bpe()
    path = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    documents = reference_documents(tokenizer, TEXTS)
    seq = 24
    cfg = text_config(path, tmp_path, eval_sequences=4, document_isolation=isolate)
    train = train_dataset(cfg, tokenizer, seq_length=seq)
    first = heldout_split(np.array([len(d) for d in documents]), seq, 4)
    assert [as_lists(train[i]) for i in range(len(train))] == naive_pack(documents[first:], seq, isolate)
    held = heldout_batches(cfg, tokenizer, seq_length=seq, micro_batch_size=3, dp_rank=0, dp=1)
    reference = naive_pack(documents[:first], seq, isolate)[:4]
    assert [r for b in held for r in b["input_ids"].tolist()] == [r["input_ids"] for r in reference]
    # two ranks share the held-out sequences round-robin, the same count each
    halves = [heldout_batches(cfg, tokenizer, seq_length=seq, micro_batch_size=8, dp_rank=r, dp=2) for r in (0, 1)]
    assert [b["input_ids"].shape[0] for b in halves[0]] == [b["input_ids"].shape[0] for b in halves[1]] == [2]
    # streaming packs the same training sequences, in corpus order when not shuffled
    stream = train_dataset(text_config(path, tmp_path, eval_sequences=4, document_isolation=isolate,
                                       streaming=True), tokenizer, seq_length=seq)  # fmt: skip
    assert [as_lists(r) for r in stream.rows] == naive_pack(documents[first:], seq, isolate)
    held_stream = heldout_batches(text_config(path, tmp_path, eval_sequences=4, streaming=True,
                                              document_isolation=isolate), tokenizer, seq_length=seq,
                                  micro_batch_size=3, dp_rank=0, dp=1)  # fmt: skip
    assert [r for b in held_stream for r in b["input_ids"].tolist()] == [r["input_ids"] for r in reference]


# ---- 3. order and resume ------------------------------------------------------------------------------


def global_batches(make, ranks: int, micro_batches: int) -> list[list[tuple[int, ...]]]:
    """Each micro-batch step's sequences over all ranks (rank order), ``micro_batches`` times."""
    orders = [make(r, ranks) for r in range(ranks)]
    return [[tuple(row) for o in orders for row in o.next()["input_ids"].tolist()] for _ in range(micro_batches)]


@pytest.mark.parametrize("streaming", [False, True])
def test_resume_on_1_2_and_4_ranks_gives_the_uninterrupted_batches(tmp_path, streaming):
    tokenizer = tokenizers.byte_level_bpe()
    path = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    data = train_dataset(text_config(path, tmp_path, streaming=streaming), tokenizer, seq_length=16)
    every = Counter(tuple(as_lists(r)["input_ids"]) for r in (data.rows if streaming else data))
    total = sum(every.values())
    global_batch = 8

    def make(rank, world):  # the same global batch of 8 on every layout
        return Batches(data, 8 // (world * 2), rank, world, seed=3, accumulation=2, shuffle_buffer=16)

    per_epoch = total // global_batch  # steps per epoch
    steps = per_epoch + 3  # into the second epoch
    run = [x for b in global_batches(make, 2, 2 * steps) for x in b]
    assert Counter(run[: per_epoch * global_batch]) <= every  # once per epoch at most (a remainder is left out)
    assert len(set(run[: per_epoch * global_batch])) == per_epoch * global_batch or len(every) < total
    for ranks in (1, 2, 4):
        uninterrupted = [x for b in global_batches(make, ranks, (8 // (8 // (ranks * 2) * ranks)) * steps) for x in b]
        assert uninterrupted == run, ranks
        for k in (1, per_epoch, per_epoch + 1):  # resume after step k, also at an epoch boundary

            def resumed(rank, world, k=k):
                order = make(rank, world)
                order.position = k * global_batch
                return order

            micro = (steps - k) * global_batch // (8 // (ranks * 2) * ranks)
            again = [x for b in global_batches(resumed, ranks, micro) for x in b]
            assert again == run[k * global_batch :], (ranks, k)


# ---- 4. Megatron indexed datasets ---------------------------------------------------------------------


def write_indexed(prefix: str, documents: list[list[list[int]]]) -> None:
    """megatron-core's own writer: each document a list of sentences (``--split-sentences``)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for sentences in documents:
        for sentence in sentences:
            builder.add_item(torch.tensor(sentence, dtype=torch.long))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def test_megatron_indexed_dataset_is_read_and_packed_like_the_reference(tmp_path):
    pytest.importorskip("megatron.core")
    from ntl_scale.data.indexed import IndexedDocuments

    rng = np.random.default_rng(0)
    documents = [[[*rng.integers(0, 60000, rng.integers(1, 12)).tolist(), 0] for _ in range(rng.integers(1, 4))]
                 for _ in range(30)]  # fmt: skip
    flat = [[int(t) for s in doc for t in s] for doc in documents]
    prefix = str(tmp_path / "corpus_text_document")
    write_indexed(prefix, documents)
    ours, theirs = IndexedDocuments(prefix, use_megatron=False), IndexedDocuments(prefix, use_megatron=True)
    assert (ours.reader, theirs.reader) == ("ntl_scale", "megatron.core")
    for source in (ours, theirs):
        assert source.lengths.tolist() == [len(d) for d in flat]
        assert [source.read(d, d + 1).tolist() for d in range(30)] == flat
        assert source.read(4, 9).tolist() == [t for d in flat[4:9] for t in d]
    cfg = DataConfig(source="megatron", train_path=prefix, eval_sequences=3, document_isolation=True)
    train = train_dataset(cfg, tokenizer=None, seq_length=10)
    first = heldout_split(np.array([len(d) for d in flat]), 10, 3)
    assert [as_lists(train[i]) for i in range(len(train))] == naive_pack(flat[first:], 10, isolate=True)
    held = heldout_batches(cfg, None, seq_length=10, micro_batch_size=2, dp_rank=0, dp=1)
    assert [r for b in held for r in b["input_ids"].tolist()] == [r["input_ids"] for r in naive_pack(flat, 10)[:3]]
    with pytest.raises(ValueError, match=r"missing_text_document.bin and .*missing_text_document.idx do not exist"):
        train_dataset(DataConfig(source="megatron", train_path=str(tmp_path / "missing_text_document")), None,
                      seq_length=10)  # fmt: skip


# ---- 5. bad data --------------------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True])
def test_bad_files_are_named_with_their_line(tmp_path, streaming):
    tokenizer = tokenizers.byte_level_bpe()
    good = '{"text": "one 1"}\n'

    def packed(path, **extra):
        cfg = text_config(path, tmp_path, streaming=streaming, **extra)
        data = train_dataset(cfg, tokenizer, seq_length=4)
        return list(data.rows) if streaming else data

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl: an empty file"):
        packed(empty)
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text(good * 3 + '{"text": "two 2"\n' + good)
    with pytest.raises(ValueError, match=r"malformed\.jsonl:4: not valid JSON"):
        packed(malformed)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(good.encode() * 2 + b'{"text": "bad \xff\xfe 3"}\n' + good.encode())
    with pytest.raises(ValueError, match=r"binary\.jsonl:3: not UTF-8"):
        packed(binary)
    other = write_jsonl(tmp_path / "other.jsonl", TEXTS, key="body")
    with pytest.raises(ValueError, match=r"no column 'text' \(columns: \['body', 'id'\]\); set data.text_column"):
        packed(other)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text(good + '{"text": 12}\n')
    with pytest.raises(ValueError, match=r"text_column 'text' holds a int"):
        packed(numbers)
    if not streaming:
        with pytest.raises(ValueError, match=r"fewer than the .* data.eval_sequences=1000"):
            packed(write_jsonl(tmp_path / "c.jsonl", TEXTS), eval_sequences=1000)


def test_config_refuses_what_does_not_apply():
    with pytest.raises(ValueError, match=r"data\.source must be one of"):
        DataConfig(source="csv", train_path="x")
    with pytest.raises(ValueError, match="apply to packed corpora"):
        DataConfig(document_isolation=True)
    with pytest.raises(ValueError, match="a Megatron corpus is memory-mapped"):
        DataConfig(source="megatron", train_path="x", streaming=True)
    with pytest.raises(ValueError, match="packs documents for causal models"):
        train_dataset(DataConfig(source="text", train_path="x"), None, kind="seq2seq", seq_length=8)


# ---- 6. document isolation in a Hugging Face model ----------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_isolation_in_a_hf_model_equals_each_document_alone(model_type, attn):
    from transformers import AutoConfig, AutoModelForCausalLM

    shapes = {
        "llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "max_position_embeddings": 64},
        "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
    }  # fmt: skip
    config = AutoConfig.for_model(model_type, vocab_size=50, **shapes[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    docs = [[5, 6, 7, 8, 1], [9, 10, 11, 1], [12, 13, 14, 15, 16, 17]]
    (row,) = list(pack_documents(docs, 15, document_isolation=True))
    batch = collate_packed([row])
    ids, positions = batch["input_ids"], batch["position_ids"]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        alone = [model(input_ids=torch.tensor([d])).logits[0] for d in docs]
        plain = model(input_ids=ids, use_cache=False).logits[0]
        cached = model(input_ids=ids, position_ids=positions).logits[0]  # use_cache defaults to True
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain[5:], torch.cat(alone[1:]), atol=1e-3)  # without isolation documents mix
    # transformers builds the per-document mask only without a cache: the trainer passes use_cache=False
    assert not torch.allclose(cached[5:], torch.cat(alone[1:]), atol=1e-3)
