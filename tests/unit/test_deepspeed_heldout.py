"""The numbers ``launch/train.py`` (DeepSpeed) reports, with label smoothing and the z-loss on, on both loss paths.

Issue 51 item 1: with ``train.chunked_loss=true`` the held-out ``eval/ce`` and perplexities included label
smoothing (the head computed the training objective; the engine only took the z-loss out by hand). Here the
real engine methods (``Engine.forward_terms``, ``Engine.heldout_terms``), the real ``Evaluator.heldout``, the
real chunked head (``ChunkedLossCausalLM``) and a real Hugging Face Llama in float64 run without DeepSpeed
itself: :class:`ModuleEngine` stands for DeepSpeed's engine, whose forward is its module's forward (ZeRO's
parameter gathering is covered by ``tests/integration/test_train_deepspeed.py``), and the held-out all-reduce
over one rank runs in a thread (``run_ranks_in_threads``).

1. Held-out: ``eval/ce``, ``eval/ppl``, ``eval/ntl``, ``eval/loss``, ``eval/number_acc`` and the per-kind
   perplexities equal a float64 reference from torch's plain ``F.cross_entropy`` on the model's logits, on
   the logits path and on the chunked path alike.
2. Training: the step's logged ``ce`` sum is the label-smoothed CE without the z-loss, the ``z_loss`` sum is
   ``w * sum logsumexp**2``, and the loss back-propagated is still the whole objective, on both paths.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ntl_scale
from tests.helpers.distributed import run_ranks_in_threads
from tests.helpers.reference import naive_per_token

transformers = pytest.importorskip("transformers")

SMOOTHING, Z_WEIGHT, WEIGHT = 0.1, 1e-2, 0.3


class ModuleEngine(torch.nn.Module):
    """What the trainer uses of DeepSpeed's engine here: its forward (the module's) and its device."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.device = torch.device("cpu")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@pytest.fixture(scope="module")
def setup():
    from ntl_scale.data import generate
    from ntl_scale.integrations.deepspeed.heldout import heldout_qa_batches
    from ntl_scale.training.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer, vocab_size=96)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    batches = heldout_qa_batches(generate(6, seed=3), tokenizer, kind="causal", max_length=48, micro_batch_size=2,
                                 dp_rank=0, dp=1)  # fmt: skip
    assert len(batches) == 3
    return tokenizer, vocab, model, batches


def _engine(model, vocab, chunked: bool):
    from ntl_scale.integrations.deepspeed.engine import Engine
    from ntl_scale.integrations.hf import ChunkedLossCausalLM

    options = ntl_scale.NTLOptions(label_smoothing=SMOOTHING, z_loss_weight=Z_WEIGHT)
    module = ChunkedLossCausalLM(model, vocab, options, chunk_tokens=7) if chunked else model
    return Engine(model, ModuleEngine(module), kind="causal", chunked=chunked, options=options, vocab=vocab,
                  shard=None, tp=1, dp=1, dp_group=None, dp_rank=0, flops=None, keep_alive=None)  # fmt: skip


def _restore(model) -> None:
    from ntl_scale.integrations.hf.chunked import remove_linear_loss_head

    remove_linear_loss_head(model.get_output_embeddings())


def _reference(model, batches, vocab) -> dict[str, float]:
    """Held-out metrics from the model's logits in float64: torch's plain F.cross_entropy, the naive NTL."""
    sums = dict.fromkeys(("ce", "tokens", "ntl", "numbers", "hits", "number_ce", "abs_error"), 0.0)
    values = torch.zeros(96, dtype=torch.float64)
    values[vocab.ids] = vocab.values.double()
    for batch in batches:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
        targets = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], 1).reshape(-1)
        z = logits.reshape(-1, logits.shape[-1])
        ce = F.cross_entropy(z, targets, reduction="none", ignore_index=-100)
        _, ntl, is_number = naive_per_token(z, targets, vocab)
        expected = (F.softmax(z[:, vocab.ids], -1) * vocab.values.double()).sum(-1)
        truth = values[targets.clamp_min(0)]
        sums["ce"] += float(ce.sum())
        sums["tokens"] += float((targets != -100).sum())
        sums["ntl"] += float(ntl.sum())
        sums["numbers"] += float(is_number.sum())
        sums["hits"] += float(((z.argmax(-1) == targets) & is_number).sum())
        sums["number_ce"] += float(ce[is_number].sum())
        sums["abs_error"] += float((expected - truth).abs()[is_number].sum())
    ce, ntl = sums["ce"] / sums["tokens"], sums["ntl"] / sums["numbers"]
    text_ce = (sums["ce"] - sums["number_ce"]) / (sums["tokens"] - sums["numbers"])
    return {
        "ce": ce, "ppl": math.exp(ce), "ntl": ntl, "loss": ce + WEIGHT * ntl,
        "number_acc": sums["hits"] / sums["numbers"], "text_ce": text_ce, "text_ppl": math.exp(text_ce),
        "number_token_ce": sums["number_ce"] / sums["numbers"],
        "number_token_ppl": math.exp(sums["number_ce"] / sums["numbers"]),
        "tokens": sums["tokens"], "number_tokens": sums["numbers"],
        "number_token_acc": sums["hits"] / sums["numbers"], "number_token_mae": sums["abs_error"] / sums["numbers"],
    }  # fmt: skip


@pytest.mark.parametrize("chunked", [False, True])
def test_heldout_ce_and_perplexity_are_the_plain_ce_on_both_paths(tmp_path, setup, chunked):
    """``eval/ce`` and the perplexities with smoothing 0.1 and z-loss 1e-2 on: the plain CE of the logits, on the
    chunked path (which kept the smoothing before) as on the logits path."""
    from ntl_scale.integrations.deepspeed.heldout import Evaluator
    from ntl_scale.training.config import DataConfig, EvalConfig
    from ntl_scale.training.model_inputs import Inputs

    tokenizer, vocab, model, batches = setup
    want = _reference(model, batches, vocab)
    engine = _engine(model, vocab, chunked)
    try:
        inputs = Inputs(DataConfig(), [], tokenizer, vocab, micro_batch_size=2, accumulation=1, seed=0, rank=0,
                        dp_rank=0, dp=1, device=torch.device("cpu"))  # fmt: skip
        evaluator = Evaluator(EvalConfig(), DataConfig(), str(tmp_path), engine=engine, inputs=inputs,
                              batches=batches, eval_splits={}, weight=WEIGHT, rank=0, world_size=1)  # fmt: skip
        results, _ = run_ranks_in_threads(lambda rank: evaluator.heldout(), 1)
    finally:
        _restore(model)
    got = results[0]
    assert model.training  # the evaluator puts the model back in training mode
    names = [name for name in want if not (chunked and name == "number_token_mae")]  # the logits path's only
    for name in names:
        assert abs(got[f"eval/{name}"] - want[name]) <= 1e-10 * max(1.0, abs(want[name])), (name, got, want)
    assert chunked == ("eval/number_token_mae" not in got)


@pytest.mark.parametrize("chunked", [False, True])
def test_training_sums_log_the_smoothed_ce_and_the_z_loss_apart(setup, chunked):
    """The trainer's step sums from ``Engine.forward_terms`` (with gradients): ``loss_from_terms``' ``ce_sum`` is
    torch's label-smoothed CE without the z-loss, ``z_loss_sum`` the z-loss, and the loss is the objective
    ``(smoothed CE + z-loss) / N + 0.3 NTL / K`` (the gradient unchanged)."""
    from ntl_scale.integrations.deepspeed.steps import loss_from_terms, shift_for_causal
    from ntl_scale.training.config import NTLConfig

    _, vocab, model, batches = setup
    batch = batches[0]
    target = shift_for_causal(batch["labels"])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    z, flat = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    valid = flat != -100
    smoothed = F.cross_entropy(z, flat, label_smoothing=SMOOTHING, reduction="sum", ignore_index=-100)
    z_loss = Z_WEIGHT * torch.logsumexp(z[valid], -1).square().sum()
    _, ntl, is_number = naive_per_token(z, flat, vocab)
    hits = float(((z.argmax(-1) == flat) & is_number).sum())
    tokens, numbers = float(valid.sum()), float(is_number.sum())
    engine = _engine(model, vocab, chunked)
    config = NTLConfig(weight=WEIGHT, label_smoothing=SMOOTHING, z_loss_weight=Z_WEIGHT)
    try:
        terms = engine.forward_terms(batch, target)
        loss, stats = loss_from_terms(terms, target, config, counts=(tokens, numbers))
    finally:
        _restore(model)
    objective = (smoothed + z_loss) / tokens + WEIGHT * ntl.sum() / numbers
    assert abs(float(loss.detach()) - float(objective)) <= 1e-10 * float(objective)
    ce_sum, ntl_sum, got_tokens, got_numbers, got_hits = stats.tolist()
    assert (got_tokens, got_numbers, got_hits) == (tokens, numbers, hits)
    assert abs(ce_sum - float(smoothed)) <= 1e-10 * float(smoothed), (ce_sum, float(smoothed), float(z_loss))
    assert abs(ntl_sum - float(ntl.sum())) <= 1e-10 * float(ntl.sum())
    from ntl_scale.integrations.deepspeed.steps import z_loss_sum  # added with the fix

    assert abs(float(z_loss_sum(terms, target, Z_WEIGHT)) - float(z_loss)) <= 1e-10 * float(z_loss)
