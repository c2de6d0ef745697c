"""NTL as a Hugging Face ``loss_function`` (``ntl_scale.integrations.hf.loss``) on a tiny GPT-2 built offline.

Sections:
1. ``NTLCausalLMLoss`` against the naive reference (``tests/helpers/reference.py``) for each meaning of
   ``num_items_in_batch`` (none, ``[tokens, numbers]``, a token count), and against Hugging Face's
   own ``ForCausalLMLoss`` with weight 0; ``shift_labels`` equals the shift of ``labels``.
2. ``apply_ntl_to_hf_model``: the model's loss becomes CE + NTL, a second call is the same, other settings are
   refused, ``remove_ntl`` gives back the model's own loss bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import ntl_scale
from ntl_scale.integrations.hf import NTLCausalLMLoss, apply_ntl_to_hf_model, remove_ntl
from tests.helpers import tokenizers as tk
from tests.helpers.data import text_labels
from tests.helpers.reference import naive_per_token

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def setup():
    tokenizer = tk.byte_level_bpe()
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    labels = text_labels(tokenizer, rows=2, seq=32)
    labels[0, :5] = -100  # a masked prompt
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer, vocab_size=config.vocab_size)
    return model, vocab, labels


def _naive(logits, labels, vocab):
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    ce, ntl, is_number = naive_per_token(logits, targets, vocab)
    valid = (targets != -100).to(torch.float64)
    return (ce * valid).sum(), valid.sum(), (ntl * is_number).sum(), is_number.to(torch.float64).sum()


def test_loss_function_normalisations(setup):
    model, vocab, labels = setup
    logits = model(input_ids=labels.clamp_min(0)).logits.detach()
    ce_sum, tokens, ntl_sum, numbers = _naive(logits, labels, vocab)
    assert numbers > 0
    loss = NTLCausalLMLoss(vocab, 0.3)
    v = logits.shape[-1]
    # batch means
    torch.testing.assert_close(loss(logits, labels, v).double(), ce_sum / tokens + 0.3 * ntl_sum / numbers)
    # the step's [tokens, numbers] (here: this batch is a third of the step's tokens, a half of its numbers)
    counts = torch.tensor([3 * float(tokens), 2 * float(numbers)])
    want = ce_sum / (3 * tokens) + 0.3 * ntl_sum / (2 * numbers)
    torch.testing.assert_close(loss(logits, labels, v, num_items_in_batch=counts).double(), want)
    # a plain token count: CE exactly as Hugging Face's own loss; NTL weighted by the token share
    n = torch.tensor(3 * float(tokens))
    hf_ce = transformers.loss.loss_utils.ForCausalLMLoss(logits, labels, v, num_items_in_batch=n)
    torch.testing.assert_close(NTLCausalLMLoss(vocab, 0.0)(logits, labels, v, num_items_in_batch=n), hf_ce)
    want = ce_sum / n + 0.3 * ntl_sum / numbers * tokens / n
    torch.testing.assert_close(loss(logits, labels, v, num_items_in_batch=n).double(), want.double())
    # a collator's shift_labels
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    assert torch.equal(loss(logits, None, v, shift_labels=shifted), loss(logits, labels, v))
    means = loss.pop_means()
    assert means["ntl"] > 0 and means["ce"] > 0 and loss.totals.sum() == 0
    # every label ignored since the last log: the means without a count are left out, never logged as 0
    loss(logits, torch.full_like(labels, -100), v)
    assert loss.pop_means() == {}
    no_numbers = torch.where(torch.isin(labels, vocab.ids), torch.tensor(-100), labels)
    loss(logits, no_numbers, v)
    assert set(loss.pop_means()) == {"ce"}


def test_apply_ntl_is_idempotent_and_reversible(setup):
    model, vocab, labels = setup
    inputs = labels.clamp_min(0)
    own = model(input_ids=inputs, labels=labels).loss
    installed = apply_ntl_to_hf_model(model, vocab, ntl_weight=0.3)
    assert apply_ntl_to_hf_model(model, vocab, ntl_weight=0.3) is installed
    with pytest.raises(ValueError, match="other settings"):
        apply_ntl_to_hf_model(model, vocab, ntl_weight=0.5)
    out = model(input_ids=inputs, labels=labels)
    ce_sum, tokens, ntl_sum, numbers = _naive(out.logits.detach(), labels, vocab)
    torch.testing.assert_close(out.loss.double(), ce_sum / tokens + 0.3 * ntl_sum / numbers)
    assert remove_ntl(model) and not remove_ntl(model)
    assert torch.equal(model(input_ids=inputs, labels=labels).loss, own)


def test_table_larger_than_the_model_is_refused(setup):
    model, _, _ = setup
    big = ntl_scale.NumberVocab.from_id_to_token(
        {5 + d: str(d) for d in range(10)}, vocab_size=model.config.vocab_size + 64
    )
    with pytest.raises(ValueError, match="vocab_size="):
        apply_ntl_to_hf_model(model, big)


# -- 3. apply_ntl_to_hf_model(chunked=True): the hidden-state loss ------------------------------------------------


# the decoder size of every Llama-family model these tests build from a config
TINY = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
    max_position_embeddings=64,
)  # fmt: skip


def _tiny(kind: str, vocab_size: int):
    torch.manual_seed(1)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab_size, n_embd=16, n_layer=1, n_head=2, n_positions=64)
        return transformers.GPT2LMHeadModel(config)
    common = dict(vocab_size=vocab_size, **TINY)
    if kind == "granite":  # logits divided by logits_scaling; tied embeddings
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(**common, logits_scaling=8.0))
    if kind == "cohere":  # logits multiplied by logit_scale
        return transformers.CohereForCausalLM(transformers.CohereConfig(**common, logit_scale=0.25))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "granite", "cohere"])
def test_chunked_training_loss_equals_the_logits_path(setup, kind):
    _, vocab, labels = setup
    model = _tiny(kind, vocab.vocab_size).train()
    for module in model.modules():  # dropout off, still training mode
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    inputs, counts = labels.clamp_min(0), torch.tensor([90.0, 14.0])
    own_logits = model(input_ids=inputs).logits.detach()

    def step(**extra):
        model.zero_grad()
        out = model(input_ids=inputs, labels=labels, **extra)
        out.loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return out, grads

    apply_ntl_to_hf_model(model, vocab)
    dense, dense_grads = step(num_items_in_batch=counts)
    ce_sum, _, ntl_sum, _ = _naive(own_logits, labels, vocab)
    torch.testing.assert_close(dense.loss.double(), ce_sum / 90 + 0.3 * ntl_sum / 14)
    remove_ntl(model)
    # ce_kernel="framework": the model's own forward and CE on the hidden states and weight NTL hands through
    apply_ntl_to_hf_model(model, vocab, chunked=True, options=ntl_scale.NTLOptions(ce_kernel="framework"))
    framework, framework_grads = step(num_items_in_batch=counts)
    torch.testing.assert_close(framework.loss, dense.loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(framework_grads, dense_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert isinstance(model.get_output_embeddings().weight, torch.nn.Parameter)  # the layer's own again
    _ignore_minus_one_as_a_tuple(model, inputs, labels, counts, dense, dense_grads)
    remove_ntl(model)
    installed = apply_ntl_to_hf_model(model, vocab, chunked=True, chunk_tokens=16)
    assert apply_ntl_to_hf_model(model, vocab, chunked=True, chunk_tokens=16) is installed
    with pytest.raises(ValueError, match="other settings"):
        apply_ntl_to_hf_model(model, vocab)
    chunked, chunked_grads = step(num_items_in_batch=counts)
    assert chunked.logits is None  # no logits were built
    _ignore_minus_one_as_a_tuple(model, inputs, labels, counts, dense, dense_grads)
    torch.testing.assert_close(chunked.loss, dense.loss, rtol=1e-5, atol=1e-6)
    assert len(chunked_grads) == len(dense_grads)
    for a, b in zip(chunked_grads, dense_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    means = installed.pop_means()
    assert means["ntl"] > 0
    # evaluation and generation are the model's own forward
    model.eval()
    assert torch.equal(model(input_ids=inputs).logits, own_logits)
    assert model(input_ids=inputs, labels=labels).logits is not None
    generated = model.generate(inputs[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 7)
    # undone: the forward and the loss are the model's own, bit for bit
    model.train()
    assert remove_ntl(model)
    assert "forward" not in model.__dict__ and "forward" not in model.get_output_embeddings().__dict__
    reference = _tiny(kind, vocab.vocab_size).train()
    reference.load_state_dict(model.state_dict())
    for module in reference.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    assert torch.equal(model(input_ids=inputs, labels=labels).loss, reference(input_ids=inputs, labels=labels).loss)


def _ignore_minus_one_as_a_tuple(model, inputs, labels, counts, dense, dense_grads):
    """The same step with the labels padded by -1 and the forward's ``ignore_index=-1``, as a tuple
    (``return_dict=False``): the loss and gradients of the logits route with -100."""
    model.zero_grad()
    out = model(input_ids=inputs, labels=labels.masked_fill(labels == -100, -1), ignore_index=-1,
                num_items_in_batch=counts, return_dict=False)  # fmt: skip
    assert isinstance(out, tuple)
    out[0].backward()
    torch.testing.assert_close(out[0], dense.loss, rtol=1e-5, atol=1e-6)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for a, b in zip(grads, dense_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_chunked_refuses_what_it_cannot_reproduce(setup):
    from ntl_scale.integrations.hf.chunked import check_head

    _, vocab, _ = setup
    common = dict(vocab_size=vocab.vocab_size, head_dim=8, **TINY)
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, final_logit_softcapping=30.0))
    # soft-capping is the loss's logit_softcap on the chunked route (tests/unit/test_ce_features.py); capping
    # twice is refused on either route
    with pytest.raises(ValueError, match="would cap them twice"):
        apply_ntl_to_hf_model(gemma, vocab, chunked=True, options=ntl_scale.NTLOptions(logit_softcap=30.0))
    with pytest.raises(ValueError, match="would cap them twice"):
        apply_ntl_to_hf_model(gemma, vocab, options=ntl_scale.NTLOptions(logit_softcap=30.0))
    assert "_ntl_scale_loss" not in gemma.__dict__ and "forward" not in gemma.__dict__
    apply_ntl_to_hf_model(gemma, vocab)  # the logits path reproduces the soft-capping: it is the model's own logits
    assert remove_ntl(gemma)
    # an unknown transform between the hidden states and the logits is caught by comparing them
    llama = _tiny("llama", vocab.vocab_size)
    assert check_head(llama, 1.0, llama.lm_head)
    with pytest.raises(ValueError, match="transforms them"):
        check_head(llama, 0.5, llama.lm_head)
    # a biased output layer
    gptj = transformers.GPTJForCausalLM(
        transformers.GPTJConfig(vocab_size=vocab.vocab_size, n_embd=16, n_layer=1, n_head=2, rotary_dim=4)
    )
    with pytest.raises(ValueError, match="bias-free"):
        apply_ntl_to_hf_model(gptj, vocab, chunked=True)


def test_the_options_ignore_index_is_honoured():
    """``NTLCausalLMLoss(options=NTLOptions(ignore_index=-1))``: the logits path replaced it by -100 when the
    caller (a model's ``loss_function`` call) did not pass one (issue 40's sweep: an option read in part)."""
    from ntl_scale.integrations.hf.loss import NTLCausalLMLoss, shift_labels

    vocab = ntl_scale.NumberVocab.from_id_to_token({i: str(i) for i in range(10)}, vocab_size=14)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 14, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 14, (2, 6), generator=g)
    labels[:, :2] = -1  # a prompt masked with -1
    loss = NTLCausalLMLoss(vocab, 0.3, ntl_scale.NTLOptions(ignore_index=-1))
    want = ntl_scale.ce_with_ntl(logits, shift_labels(labels, -1), vocab, ntl_weight=0.3, ignore_index=-1)
    torch.testing.assert_close(loss(logits, labels), want.loss)
    # a caller's explicit ignore_index still wins (a per-call argument, as in Hugging Face's own loss)
    relabelled = torch.where(labels == -1, -100, labels)
    torch.testing.assert_close(loss(logits, relabelled, ignore_index=-100), want.loss)


# -- 4. ntl_trainer_class: training logs see training batches, evaluate() its own ---------------------


def _trainer_reference(model, batch, vocab, *, smoothing: float = 0.0, z_loss_weight: float = 0.0) -> dict:
    """The logged means of one collated batch from its logits in float64: CE as torch's ``F.cross_entropy``
    (label-smoothed with ``smoothing``), z-loss ``w * logsumexp**2``, NTL of the naive reference, arg-max hits."""
    import torch.nn.functional as F

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:].reshape(-1)
    z = logits.reshape(-1, logits.shape[-1])
    valid = targets != -100
    ce = F.cross_entropy(z, targets, label_smoothing=smoothing, reduction="sum", ignore_index=-100)
    z_loss = z_loss_weight * torch.logsumexp(z[valid], -1).square().sum()
    _, ntl, is_number = naive_per_token(z, targets, vocab)
    hits = (z.argmax(-1) == targets) & is_number
    tokens, numbers = float(valid.sum()), float(is_number.sum())
    return {"ce": float(ce) / tokens, "z_loss": float(z_loss) / tokens, "ntl": float(ntl.sum()) / numbers,
            "number_accuracy": float(hits.sum()) / numbers}  # fmt: skip


@pytest.mark.parametrize(("chunked", "features"), [(False, False), (False, True), (True, True)])
def test_trainer_keeps_evaluation_batches_out_of_the_training_logs(tmp_path, chunked, features):
    """Issue 51 item 2: ``Trainer.evaluate`` runs the same loss object; its batches were added to the training
    running totals, so the first training ``ce``/``ntl`` log after each evaluation averaged training and
    evaluation tokens. A 1-layer Llama (float64) at learning rate 0, logging and evaluating every 2 steps,
    one epoch of the 4 training rows per 2 steps: every training log is the training set's float64 means
    (``ce`` label-smoothed as optimised, without the z-loss; ``z_loss`` apart), every evaluation log the
    evaluation set's, with the plain CE (``eval_ce``: no smoothing, no z-loss); also on the chunked route
    (the hidden-state loss in training, the model's own forward in evaluation). ``features``: label smoothing
    0.1 and z-loss 1e-2 on (off: the logged ``ce`` of steps 4 and 6 was the training/evaluation mix)."""
    from ntl_scale.data import EncodedExample, collate, encode, generate
    from ntl_scale.integrations.hf import ntl_trainer_class
    from ntl_scale.training.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer, vocab_size=96)

    def rows(seed: int) -> list[dict]:  # every token a label (a pretraining text), 4 rows
        encoded = [encode(tokenizer, e, max_length=48) for e in generate(4, seed=seed)]
        return [{"input_ids": e.input_ids, "labels": list(e.input_ids)} for e in encoded]

    def collator(batch: list[dict]) -> dict:
        return collate([EncodedExample(r["input_ids"], r["labels"]) for r in batch], tokenizer.pad_token_id)

    train_rows, eval_rows = rows(0), rows(1)
    config = transformers.LlamaConfig(vocab_size=96, **{**TINY, "hidden_size": 32, "intermediate_size": 64})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    smoothing, z_weight = (0.1, 1e-2) if features else (0.0, 0.0)
    options = ntl_scale.NTLOptions(label_smoothing=smoothing, z_loss_weight=z_weight)
    train_want = _trainer_reference(model, collator(train_rows), vocab, smoothing=smoothing, z_loss_weight=z_weight)
    eval_want = _trainer_reference(model, collator(eval_rows), vocab)  # evaluation: the plain CE
    assert abs(train_want["ce"] - eval_want["ce"]) > 1e-3  # a mix of the two would show
    if chunked:
        apply_ntl_to_hf_model(model, vocab, ntl_weight=0.3, options=options, chunked=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=6,
        learning_rate=0.0, optim="sgd", lr_scheduler_type="constant", logging_strategy="steps", logging_steps=2,
        eval_strategy="steps", eval_steps=2, save_strategy="no", use_cpu=True, report_to=[],
        remove_unused_columns=False, seed=0,
    )  # fmt: skip
    trainer = ntl_trainer_class()(
        model=model, args=args, data_collator=collator, train_dataset=train_rows, eval_dataset=eval_rows,
        number_vocab=vocab, ntl_weight=0.3, ntl_options=options,
    )  # fmt: skip
    trainer.train()
    history = trainer.state.log_history
    train_logs = [log for log in history if "loss" in log]
    eval_logs = [log for log in history if "eval_loss" in log]
    assert [log["step"] for log in train_logs] == [2, 4, 6] and [log["step"] for log in eval_logs] == [2, 4, 6]
    # ce and ntl of every log first (the mix showed in those of steps 4 and 6), then the metrics added with the fix
    names = ("ce", "ntl", "number_accuracy", "z_loss") if features else ("ce", "ntl", "number_accuracy")
    for name, log in [(name, log) for name in names for log in train_logs]:
        assert abs(log[name] - train_want[name]) <= 1e-10 * max(1.0, abs(train_want[name])), (name, log)
    for log in train_logs:
        assert ("z_loss" in log) == features and not any(key.startswith("eval_") for key in log), log
    for log in eval_logs:
        for name in ("ce", "ntl", "number_accuracy"):
            got = log[f"eval_{name}"]
            assert abs(got - eval_want[name]) <= 1e-10 * max(1.0, abs(eval_want[name])), (name, log)
        assert "eval_z_loss" not in log and "ce" not in log, log
    # eval_loss is Trainer's mean of the per-batch losses (2 batches of 2 rows): plain CE + 0.3 NTL of each
    halves = [_trainer_reference(model, collator(eval_rows[i : i + 2]), vocab) for i in (0, 2)]
    want_loss = sum(h["ce"] + 0.3 * h["ntl"] for h in halves) / 2
    for log in eval_logs:
        assert abs(log["eval_loss"] - want_loss) <= 1e-10 * want_loss, (log, want_loss)


def test_chunked_route_under_no_grad_is_evaluation(setup):
    """``apply_ntl_to_hf_model(chunked=True)`` with smoothing and a z-loss, the model in training mode: a forward under
    ``torch.no_grad()`` (a held-out loop that left the model in training mode) runs the hidden-state head with
    the evaluation options, so its loss is the plain CE + 0.3 NTL of the model's logits (float64, torch's
    ``F.cross_entropy``) and its sums are the evaluation totals; with gradients, the training objective."""
    import torch.nn.functional as F

    _, vocab, labels = setup
    model = _tiny("llama", vocab.vocab_size).double().train()
    inputs = labels.clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    z = logits.reshape(-1, logits.shape[-1])
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    valid = targets != -100
    _, ntl, is_number = naive_per_token(z, targets, vocab)
    ntl_mean = ntl.sum() / is_number.sum()
    plain = F.cross_entropy(z, targets, ignore_index=-100)
    smoothed = F.cross_entropy(z, targets, ignore_index=-100, label_smoothing=0.1)
    z_loss = 1e-2 * torch.logsumexp(z[valid], -1).square().mean()
    options = ntl_scale.NTLOptions(label_smoothing=0.1, z_loss_weight=1e-2)
    installed = apply_ntl_to_hf_model(model, vocab, ntl_weight=0.3, options=options, chunked=True, chunk_tokens=16)
    try:
        with torch.no_grad():
            evaluation = model(input_ids=inputs, labels=labels).loss
        training = model(input_ids=inputs, labels=labels).loss
    finally:
        remove_ntl(model)
    torch.testing.assert_close(evaluation, plain + 0.3 * ntl_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(training.detach(), smoothed + z_loss + 0.3 * ntl_mean, rtol=1e-12, atol=1e-12)
    evaluated, trained = installed.pop_means(evaluation=True), installed.pop_means()
    assert abs(evaluated["ce"] - float(plain)) <= 1e-12 * float(plain) and "z_loss" not in evaluated
    assert abs(trained["ce"] - float(smoothed)) <= 1e-12 * float(smoothed)
    assert abs(trained["z_loss"] - float(z_loss)) <= 1e-12 * float(z_loss)
