"""Position coupling (``data.position_coupling``): the ids of training rows and of generation.

The reference reads the ids off the text, character by character: in the prompt, the ``i``-th digit of a
run of ``n`` digits has ``n - i`` and every other character 0; the answer's ``k``-th character (and then
EOS) has ``k + 1``. The generation check needs no reference ids at all: a random rotary model answers
through :func:`evaluate_generation` with the coupled prompt ids, and the same model, run once over
question + generated answer with the *training* ids, must pick the same token at every answer step
(with the model's default positions it does not: the control shows the check can fail).
"""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ntl_scale.data import ArithmeticConfig, collate, generate  # noqa: E402
from ntl_scale.data.collate import EncodedExample, encode_pairs  # noqa: E402
from ntl_scale.data.positions import coupled_position_ids, training_position_ids  # noqa: E402
from ntl_scale.number_vocab import NumberVocab  # noqa: E402
from ntl_scale.training.config import DataConfig, ModelConfig, RunConfig  # noqa: E402
from ntl_scale.training.scoring import evaluate_generation  # noqa: E402
from ntl_scale.training.tokenizer import build_char_tokenizer  # noqa: E402


def _text_ids(prompt: str, answer_tokens: int, offset: int = 0) -> list[int]:
    ids = [0] * len(prompt)
    for run in re.finditer(r"\d+", prompt):
        for i in range(len(run.group())):
            ids[run.start() + i] = offset + len(run.group()) - i
    ids[-1] = offset  # the prompt ends with a space: place 0, the token that predicts the units
    return ids + [offset + k + 1 for k in range(answer_tokens)]


@pytest.fixture(scope="module")
def char():
    tokenizer = build_char_tokenizer()
    return tokenizer, NumberVocab.from_tokenizer(tokenizer, vocab_size=len(tokenizer))


def _examples(count: int, seed: int):
    """Sums and products (answers never negative: what data.position_coupling accepts)."""
    config = ArithmeticConfig(kinds=("add", "mul"), train_digits=3, negative_share=0.0, reverse_answers=True)
    return generate(count, "train", seed=seed, config=config) + generate(count, "extrapolate", seed=seed, config=config)


def _places(text: str) -> list[int | None]:
    """Each character's place value in its number (1 = units) when numbers are written as usual."""
    places: list[int | None] = [None] * len(text)
    for run in re.finditer(r"\d+", text):
        for i in range(len(run.group())):
            places[run.start() + i] = len(run.group()) - i
    return places


@pytest.mark.parametrize("offsets", [False, True])
def test_training_ids_match_the_text(char, offsets):
    tokenizer, vocab = char
    examples = _examples(12, seed=3)
    input_ids, labels = encode_pairs(tokenizer, [e.question for e in examples], [e.answer for e in examples])
    batch = collate([EncodedExample(i, t) for i, t in zip(input_ids, labels)], tokenizer.pad_token_id)
    offset = torch.arange(len(examples)) % 7 if offsets else None
    ids = training_position_ids(vocab.number_mask(batch["input_ids"]), batch["labels"], offset)
    for row, e in enumerate(examples):
        shift = row % 7 if offsets else 0
        expected = _text_ids(e.question + " ", len(e.answer) + 1, shift)  # + EOS
        assert ids[row, : len(expected)].tolist() == expected, e
        # right padding continues the count (masked out of attention and loss)
        padding = ids.shape[1] - len(expected)
        assert ids[row, len(expected) :].tolist() == [expected[-1] + 1 + k for k in range(padding)]
        # the coupling itself: the answer digit of each place (reversed answer) has the id of the operand
        # digits of that place, and no other token of the row has it
        prompt, answer = e.question + " ", e.answer
        question_places = _places(prompt)
        for k, _ in enumerate(answer):
            place, token_id = k + 1, int(ids[row, len(prompt) + k])
            same = [i for i, p in enumerate(question_places) if p == place]
            assert all(int(ids[row, i]) == token_id for i in same), (e, place)
            others = [i for i, p in enumerate(question_places) if p != place]
            assert all(int(ids[row, i]) != token_id for i in others), (e, place)


def test_prompt_ids_match_the_text_under_left_padding(char):
    tokenizer, vocab = char
    examples = _examples(8, seed=5)
    tokenizer.padding_side = "left"
    enc = tokenizer([e.question + " " for e in examples], return_tensors="pt", padding=True, add_special_tokens=False)
    tokenizer.padding_side = "right"
    ids = coupled_position_ids(vocab.number_mask(enc["input_ids"]))
    for row, e in enumerate(examples):
        expected = _text_ids(e.question + " ", 0)
        width = len(expected)
        assert ids[row, -width:].tolist() == expected
        assert ids[row, :-width].eq(0).all()


def test_bad_digit_mask_is_refused():
    with pytest.raises(ValueError, match="2-D bool"):
        coupled_position_ids(torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="2-D bool"):
        coupled_position_ids(torch.zeros(2, 4, dtype=torch.long))


def test_config_refusals():
    with pytest.raises(ValueError, match=re.escape("data.reverse_answers=true")):
        DataConfig(position_coupling=True)
    with pytest.raises(ValueError, match=re.escape("data.position_offset=4")):
        DataConfig(position_offset=4, reverse_answers=True)
    with pytest.raises(ValueError, match=re.escape("data.position_offset=-1")):
        DataConfig(position_offset=-1, position_coupling=True, reverse_answers=True)
    coupled = {"position_coupling": True, "reverse_answers": True, "kinds": ["add"], "negative_share": 0.0}
    with pytest.raises(ValueError, match=re.escape("model.kind=causal")):
        RunConfig(model=ModelConfig(kind="seq2seq"), data=DataConfig(**coupled))
    with pytest.raises(ValueError, match=re.escape("use model.attn_implementation=sdpa or eager")):
        RunConfig(model=ModelConfig(attn_implementation="flash_attention_2"), data=DataConfig(**coupled))
    # a negative answer starts with its sign, which would take the units' position
    with pytest.raises(ValueError, match=re.escape("data.kinds=['add', 'add_sub']")):
        DataConfig(**{**coupled, "kinds": ["add", "add_sub"]})
    with pytest.raises(ValueError, match=re.escape("data.negative_share=0.2")):
        DataConfig(**{**coupled, "negative_share": 0.2})
    DataConfig(**{**coupled, "kinds": ["add", "mul"]})  # answers never negative: accepted


def _trainer_part(tokenizer, **data):
    """The Trainer's set-up checks (ntl_scale/training/model_inputs.py), on the parts they read (no engine needed)."""
    from types import SimpleNamespace

    from ntl_scale.training import model_inputs as inputs

    cfg = RunConfig(data=DataConfig(position_coupling=True, reverse_answers=True, kinds=["add"], negative_share=0.0,
                                    **data))  # fmt: skip
    vocab = NumberVocab.from_tokenizer(tokenizer, vocab_size=len(tokenizer))
    checks = SimpleNamespace(
        check_one_token_per_digit=lambda part: inputs.check_one_token_per_digit(part.tokenizer, part.vocab, "tok"),
        check_position_ids_reach_the_model=lambda part: inputs.check_position_ids(part.model, part.cfg.data),
    )
    return checks, SimpleNamespace(cfg=cfg, tokenizer=tokenizer, vocab=vocab)


def test_tokenizers_with_multi_digit_tokens_are_refused(char):
    from tests.helpers import tokenizers

    trainer, part = _trainer_part(char[0])
    trainer.check_one_token_per_digit(part)  # one character per token: accepted
    trainer, part = _trainer_part(tokenizers.llama3_style_bpe())  # 1-3 digit groups
    with pytest.raises(ValueError, match="needs a tokenizer with one token per digit"):
        trainer.check_one_token_per_digit(part)
    digit_tokens = [t for t in part.tokenizer.get_vocab() if any(c.isdigit() for c in t)]
    assert any(len([c for c in t if c.isdigit()]) > 1 for t in digit_tokens)  # the refusal's reason exists


def test_models_without_room_for_the_ids_are_refused(char):
    trainer, part = _trainer_part(char[0], position_offset=40, max_length=32)
    config = transformers.GPT2Config(vocab_size=len(char[0]), n_embd=16, n_layer=1, n_head=2, n_positions=64)
    part.model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match=re.escape("ids reach data.position_offset + data.max_length = 72")):
        trainer.check_position_ids_reach_the_model(part)
    part.cfg.data.position_offset = 3
    trainer.check_position_ids_reach_the_model(part)

    class NoPositions(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    part.model = NoPositions()
    part.model.config = config
    with pytest.raises(ValueError, match=re.escape("NoPositions.forward takes none")):
        trainer.check_position_ids_reach_the_model(part)


def test_generation_continues_the_training_ids(char, tmp_path):
    tokenizer, vocab = char
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharp, strong attention: what a token predicts depends on where it attends
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(6.0)
            for proj in (layer.self_attn.v_proj, layer.self_attn.o_proj):
                proj.weight.mul_(10.0)
        digits = [tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]
        others = [i for i in range(len(tokenizer)) if i not in digits]
        model.lm_head.weight[others] *= 0.1  # answers are mostly digits, several tokens long
    examples = _examples(10, seed=7)
    path = tmp_path / "predictions.jsonl"
    prompt_ids = lambda ids: coupled_position_ids(vocab.number_mask(ids))  # noqa: E731
    evaluate_generation(model, tokenizer, examples, max_new_tokens=6, batch_size=7, predictions_path=str(path),
                        reverse_answers=True, position_ids=prompt_ids)  # fmt: skip
    generated = [json.loads(line)["generated"] for line in path.read_text().splitlines()]
    answers = [tokenizer(g, add_special_tokens=False)["input_ids"] for g in generated]
    assert sum(len(a) for a in answers) >= 3 * len(answers)  # several steps per question on average
    input_ids, labels = encode_pairs(tokenizer, [e.question for e in examples], generated)
    batch = collate([EncodedExample(i, t) for i, t in zip(input_ids, labels)], tokenizer.pad_token_id)
    coupled = training_position_ids(vocab.number_mask(batch["input_ids"]), batch["labels"])

    def greedy(position_ids):
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=position_ids).logits  # fmt: skip
        picks = []
        for row, answer in enumerate(answers):
            start = int((batch["labels"][row] != -100).int().argmax())
            picks.append(logits[row, start - 1 : start - 1 + len(answer)].argmax(-1).tolist())
        return picks

    assert greedy(coupled) == answers
    assert greedy(None) != answers  # the model's own positions give other answers: the check can fail
