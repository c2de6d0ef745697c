"""Number-token tables.

Sections:
1. The token rules (digit level, multi-digit, prefixes, unicode digits, signs).
2. Tables from each tokenizer family, built offline: T5-style SentencePiece (fast, slow, raw model
   file), byte-level BPE, Llama-3-style multi-digit BPE, WordPiece (fast, slow), a Megatron-style
   ``inv_vocab`` object; the tokenizer is never modified.
3. Padded vocabularies, JSON round trip, shard slices.
4. The explicit ``add_digit_tokens`` helper and bad input.
"""

from __future__ import annotations

import json

import pytest
import torch

import ntl_scale
from ntl_scale import NumberVocab, parse_number_token
from tests.helpers import tokenizers as tk


@pytest.mark.parametrize(
    "token,digit_level,prefixed,value",
    [
        ("3", True, False, 3.0),
        ("0", True, False, 0.0),
        ("12", True, False, None),
        ("12", False, False, 12.0),
        ("007", False, False, 7.0),
        ("-5", True, False, None),
        ("-5", False, False, -5.0),
        ("+5", False, False, 5.0),
        ("2.5", False, False, 2.5),
        ("2.", False, False, None),
        (".", False, False, None),
        ("-", False, False, None),
        ("1e5", False, False, None),
        ("1_000", False, False, None),
        ("inf", False, False, None),
        ("nan", False, False, None),
        ("٣", True, False, None),  # Arabic-Indic three
        ("٣", False, False, None),
        ("３", False, False, None),  # fullwidth three
        ("²", False, False, None),
        ("▁3", True, False, None),
        ("▁3", True, True, 3.0),
        ("Ġ3", True, True, 3.0),
        (" 3", True, True, 3.0),
        ("##3", True, True, 3.0),
        ("##3", True, False, None),
        ("Ġ123", False, True, 123.0),
        ("Ġ123", True, True, None),
        ("▁", True, True, None),
        ("a3", True, True, None),
    ],
)
def test_token_rules(token, digit_level, prefixed, value):
    assert parse_number_token(token, digit_level=digit_level, prefixed=prefixed) == value


DIGIT_TOKENIZERS = {
    "t5_fast": tk.t5_fast,
    "sentencepiece_slow": tk.sentencepiece_slow,
    "byte_level_bpe": tk.byte_level_bpe,
    "llama3_style_bpe": tk.llama3_style_bpe,
    "wordpiece_fast": tk.wordpiece_fast,
    "wordpiece_slow": tk.wordpiece_slow,
}


@pytest.mark.parametrize("name", sorted(DIGIT_TOKENIZERS))
def test_digit_level_finds_exactly_the_ten_digits(name):
    tokenizer = DIGIT_TOKENIZERS[name]()
    before = len(tokenizer)
    vocab = NumberVocab.from_tokenizer(tokenizer)
    assert len(tokenizer) == before  # never mutated
    assert sorted(vocab.values.tolist()) == [float(d) for d in range(10)]
    for token_id, value in zip(vocab.ids.tolist(), vocab.values.tolist()):
        assert tokenizer.convert_ids_to_tokens(token_id) == str(int(value))
    assert vocab.digit_level and vocab.vocab_size == before


def test_raw_sentencepiece_file_matches_the_hf_wrapper():
    from_file = NumberVocab.from_sentencepiece(tk.sentencepiece_model())
    from_hf = NumberVocab.from_tokenizer(tk.t5_fast())
    assert torch.equal(from_file.ids, from_hf.ids) and torch.equal(from_file.values, from_hf.values)


def test_multi_digit_keeps_token_values():
    tokenizer = tk.llama3_style_bpe()
    vocab = NumberVocab.from_tokenizer(tokenizer, digit_level=False)
    assert len(vocab) > 100
    tokens = tokenizer.convert_ids_to_tokens(vocab.ids.tolist())
    assert [float(t) for t in tokens] == vocab.values.tolist()
    assert any(len(t) == 3 for t in tokens)


def test_wordpiece_continuations_only_with_prefixed():
    tokenizer = tk.wordpiece_fast()
    plain = NumberVocab.from_tokenizer(tokenizer)
    prefixed = NumberVocab.from_tokenizer(tokenizer, prefixed=True)
    assert len(plain) == 10 and len(prefixed) == 20
    extra = [t for t in prefixed.tokens if t.startswith("##")]
    assert sorted(extra) == [f"##{d}" for d in range(10)]


def test_megatron_style_inv_vocab_and_plain_mapping():
    class MegatronLikeTokenizer:  # Megatron tokenizers expose id -> token as inv_vocab
        def __init__(self, tokens):
            self.inv_vocab = dict(enumerate(tokens))

    tokens = ["<s>", "a", "7", "3", "▁4", ".", "x"] + [str(d) for d in (0, 1, 2, 4, 5, 6, 8, 9)]
    a = NumberVocab.from_tokenizer(MegatronLikeTokenizer(tokens))
    b = NumberVocab.from_id_to_token(tokens)
    c = NumberVocab.from_id_to_token(dict(enumerate(tokens)))
    assert a == b == c
    assert a.decimal_point_id == 5
    assert 4 not in a.ids.tolist()  # "▁4" is word-prefixed


def test_padded_vocab_size():
    tokenizer = tk.byte_level_bpe()
    padded = ntl_scale.pad_vocab_size(len(tokenizer), divisible_by=128, tp_size=4)
    assert padded % 512 == 0 and padded >= len(tokenizer) > padded - 512
    vocab = NumberVocab.from_tokenizer(tokenizer, vocab_size=padded)
    assert vocab.vocab_size == padded
    assert vocab.index_of_id().shape == (padded,)
    assert (vocab.index_of_id()[len(tokenizer) :] == -1).all()
    with pytest.raises(ValueError, match="does not fit vocab_size"):
        NumberVocab.from_tokenizer(tokenizer, vocab_size=int(vocab.ids.max()))


def test_json_round_trip(tmp_path):
    vocab = NumberVocab.from_tokenizer(tk.llama3_style_bpe(), digit_level=False, vocab_size=2048)
    path = tmp_path / "numbers.json"
    vocab.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "ntl_scale.NumberVocab" and data["vocab_size"] == 2048
    loaded = NumberVocab.load(path)
    assert loaded == vocab and loaded.tokens == vocab.tokens and not loaded.digit_level
    assert NumberVocab.load(path, vocab_size=4096).vocab_size == 4096
    assert not list(tmp_path.glob("*.tmp*"))  # atomic write leaves nothing behind


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        NumberVocab.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        NumberVocab.load(bad)
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="format"):
        NumberVocab.load(bad)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_shards_partition_the_table(world_size):
    tokens = [f"w{i}" for i in range(60)]
    for value, position in zip(range(10), [1, 2, 3, 29, 30, 31, 32, 33, 58, 59]):
        tokens[position] = str(value)
    vocab = NumberVocab.from_id_to_token(tokens, vocab_size=64)
    seen = []
    for rank in range(world_size):
        shard = vocab.shard(rank, world_size)
        assert shard.start == rank * 64 // world_size and shard.size == 64 // world_size
        assert torch.equal(shard.local_ids + shard.start, vocab.ids[shard.table_index])
        assert torch.equal(shard.values, vocab.values[shard.table_index])
        assert ((shard.local_ids >= 0) & (shard.local_ids < shard.size)).all()
        seen.extend(shard.table_index.tolist())
    assert seen == list(range(len(vocab)))
    if world_size == 8:
        assert len(vocab.shard(2, 8).table_index) == 0  # a shard without number tokens


def test_shard_errors():
    vocab = NumberVocab.from_id_to_token([str(d) for d in range(10)] + ["a"], vocab_size=30)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 4"):
        vocab.shard(0, 4)
    with pytest.raises(ValueError, match="rank"):
        vocab.shard(3, 3)


def test_distance_table_and_squash():
    vocab = NumberVocab.from_id_to_token(["a", "0", "1", "5", "10"], digit_level=False)
    plain = vocab.distance_table()
    assert plain[0].tolist() == [0.0, 1.0, 5.0, 10.0]
    squashed = vocab.distance_table(squash_factor=3.0)
    assert squashed.diagonal().eq(0).all()
    assert float(squashed[squashed > 0].min()) == pytest.approx(1.0)
    assert float(squashed.max()) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="squash_factor must be a finite number > 1"):
        vocab.distance_table(squash_factor=1.0)


def test_no_number_tokens_and_missing_digits():
    with pytest.raises(ValueError, match=r"found no number tokens.*add_digit_tokens"):
        NumberVocab.from_id_to_token(["a", "b", "▁3"])
    with pytest.warns(UserWarning, match=r"lacks the digits \[5, 6, 7, 8, 9\]"):
        NumberVocab.from_id_to_token(["a", "0", "1", "2", "3", "4"])


def test_add_digit_tokens_is_explicit():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "7": 3}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    with pytest.warns(UserWarning, match="lacks the digits"):
        NumberVocab.from_tokenizer(tokenizer)
    assert len(tokenizer) == 4
    added = ntl_scale.add_digit_tokens(tokenizer)
    assert added == [d for d in "012345689"]
    assert ntl_scale.add_digit_tokens(tokenizer) == []  # idempotent
    vocab = NumberVocab.from_tokenizer(tokenizer)
    assert sorted(vocab.values.tolist()) == [float(d) for d in range(10)] and len(tokenizer) == 13


def test_bad_constructor_input():
    with pytest.raises(TypeError, match="unsupported tokenizer type"):
        NumberVocab.from_tokenizer(object())
    with pytest.raises(ValueError, match="no number tokens"):
        NumberVocab([], [], 10)
    with pytest.raises(ValueError, match="duplicates"):
        NumberVocab([1, 1], [1.0, 2.0], 10)
    with pytest.raises(ValueError, match="every vocabulary id is a number token"):
        NumberVocab([0, 1], [0.0, 1.0], 2)
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        NumberVocab([0], [0.0], 0)
    with pytest.raises(ValueError, match="finite"):
        NumberVocab([0], [float("nan")], 5)
    with pytest.raises(ValueError, match="pad_vocab_size: tp_size must be a positive int"):
        ntl_scale.pad_vocab_size(100, tp_size=0)


def test_number_mask():
    tokens = ["a", "7", "b", "3"] + [str(d) for d in (0, 1, 2, 4, 5, 6, 8, 9)]
    vocab = NumberVocab.from_id_to_token(tokens, vocab_size=16)
    labels = torch.tensor([[0, 1, 2, 3, -100], [15, 16, 11, 4, 99]])
    want = [[tokens[i].isdigit() if 0 <= i < len(tokens) else False for i in row] for row in labels.tolist()]
    assert vocab.number_mask(labels).tolist() == want
