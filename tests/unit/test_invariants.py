"""Normalisation invariants of every NTL variant in every integration (issue 23).

What NTL's mean divides by is one definition (``ntl_scale.ntl_positions``: number-token labels, or one
position per number for ``loss="number"``); every integration counts its step with it. Checked here
against the naive float64 reference (``tests/helpers/reference.py``), in the DeepSpeed step functions
(``ntl_scale.integrations.deepspeed.steps``), megatron.core's ``loss_func`` (``integrations/megatron/core.py``), the
Megatron-LM hook (``integrations/megatron/lm.py``, on a stand-in model) and Hugging Face's loss with the
Trainer's count (``integrations/hf/loss.py``, ``integrations/hf/trainer.py``).

Sections:
1. The review's repro: targets ``1 2 3 x 4 5`` (2 numbers, 5 digits), one micro-batch on one rank:
   global normalisation equals micro-batch normalisation in all four paths (value and gradient).
2. Every variant x integration, one micro-batch on one rank: global == micro-batch == the reference.
3. Every variant x integration: a step split into micro-batches and data-parallel ranks (simulated
   in-process: each rank's losses use the step's global counts, gradients summed as DDP does) has
   the gradient of the one-piece step and of the float64 reference.
4. The count itself: ``ntl_positions`` / ``ntl_counts`` against a count written out with loops, and
   equal to the mask ``per_token_ce_ntl`` returns; context-parallel slices cut numbers.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import ntl_scale
from ntl_scale import normalization as ntl_normalization
from ntl_scale.integrations import megatron as ntl_megatron
from ntl_scale.integrations.deepspeed import steps
from ntl_scale.integrations.hf import NTLCausalLMLoss, count_step_numbers
from ntl_scale.integrations.megatron import lm as megatron_lm
from ntl_scale.training.config import NTLConfig
from tests.helpers.reference import naive_per_token

WEIGHT = 0.3
VARIANTS = [
    dict(loss="was"),
    dict(loss="was", reweigh=True),
    dict(loss="mse"),
    dict(loss="mae"),
    dict(loss="huber"),
    dict(loss="huber", reweigh=True),
    dict(loss="number"),
    dict(loss="number", reweigh=True),
]
PATHS = ["deepspeed", "megatron_core", "megatron_lm", "hf"]
SPLITS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]  # (micro-batches per rank, data-parallel ranks)
V = 32
DIGIT_IDS = list(range(10, 20))  # token id 10 + d is the digit d


def _name(variant: dict) -> str:
    return variant["loss"] + ("+reweigh" if variant.get("reweigh") else "")


def _vocab() -> ntl_scale.NumberVocab:
    return ntl_scale.NumberVocab.from_id_to_token({10 + d: str(d) for d in range(10)}, vocab_size=V)


def _batch(rows: int = 4, seq: int = 12, seed: int = 0):
    """Labels with digit runs of several lengths, words between them, a few ignored; float64 logits."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(20, V, (rows, seq), generator=g)
    digits = torch.randint(10, 20, (rows, seq), generator=g)
    runs = torch.rand(rows, seq, generator=g) < 0.55
    labels = torch.where(runs, digits, labels)
    labels[0, :5] = torch.tensor([11, 12, 13, 25, 14])  # 123 x 4...
    labels[:, -1] = -100
    labels[rows - 1, 3] = -100
    logits = torch.randn(rows, seq, V, generator=g, dtype=torch.float64) * 2
    return labels, logits


def _repro():
    """The review's case: targets 1 2 3 x 4 5, one sequence."""
    labels = torch.tensor([[11, 12, 13, 25, 14, 15]])
    logits = torch.randn(1, 6, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return labels, logits


def _reference_grad(vocab, labels, logits, variant, weight=WEIGHT):
    """The global objective ``sum CE / tokens + w sum NTL / NTL positions`` in float64, the naive way."""
    leaf = logits.clone().requires_grad_()
    ce, ntl, mask = naive_per_token(leaf, labels, vocab, **variant)
    valid = (labels != -100).double()
    objective = (ce * valid).sum() / valid.sum() + weight * (ntl * valid).sum() / (mask.double() * valid).sum()
    return objective.detach(), torch.autograd.grad(objective, leaf)[0]


# ---------------------------------------------------------------------------------- the four paths
# Each returns (objective value, gradient w.r.t. the logits) of one optimizer step over ``labels``
# (rows split evenly into dp x micro-batches), as the integration's training loop computes them.


def _parts(rows: int, micro: int, dp: int) -> list[list[torch.Tensor]]:
    pieces = torch.chunk(torch.arange(rows), dp * micro)
    return [list(pieces[r * micro : (r + 1) * micro]) for r in range(dp)]


def _deepspeed(vocab, labels, logits, variant, normalization, micro=1, dp=1):
    cfg = NTLConfig(weight=WEIGHT, normalization=normalization, **variant)
    leaf = logits.clone().requires_grad_()
    ranks = _parts(labels.shape[0], micro, dp)
    counts = None
    if normalization == "global":  # the all-reduce over DP: every rank's micro-batches
        counts = steps.global_counts([labels[p] for rank in ranks for p in rank], vocab, None, steps.ntl_options(cfg))
    value, grad = 0.0, torch.zeros_like(leaf)
    for rank in ranks:
        for p in rank:
            # the trainer's composition: per-token terms (Engine.terms_of_logits), then loss_from_terms
            terms = ntl_scale.per_token_ce_ntl(leaf[p], labels[p], vocab, steps.ntl_options(cfg))
            loss, _ = steps.loss_from_terms(terms, labels[p], cfg, counts=counts, scale=micro * dp)
            objective = loss / (micro * dp)  # DeepSpeed divides by accumulation steps, DDP averages over DP
            value += float(objective.detach())
            grad += torch.autograd.grad(objective, leaf)[0]
    return value, grad


def _megatron_core(vocab, labels, logits, variant, normalization, micro=1, dp=1):
    settings = ntl_megatron.NTLSettings(weight=WEIGHT, normalization=normalization, **variant)
    loss_mask = (labels != -100).float()
    labels = labels.clamp_min(0)  # Megatron's labels are token ids everywhere; the loss mask drops positions
    leaf = logits.clone().requires_grad_()
    ranks = _parts(labels.shape[0], micro, dp)
    counts = None
    if normalization == "global":
        counts = ntl_megatron.GlobalCounts(vocab, None, settings.options())
        counts.set_step([(labels[p], loss_mask[p]) for rank in ranks for p in rank])
    loss_func = ntl_megatron.make_loss_func(
        settings, vocab, tp_group=None, global_counts=counts, num_microbatches=micro, data_parallel_size=dp
    )
    value, grad = 0.0, torch.zeros_like(leaf)
    for rank in ranks:
        for p in rank:
            out, num_tokens, _ = functools.partial(loss_func, labels[p], loss_mask[p])(leaf[p])
            objective = out / num_tokens.clamp_min(1) / micro / dp  # the schedule's division, DDP's mean
            value += float(objective.detach())
            grad += torch.autograd.grad(objective, leaf)[0]
    return value, grad


class _StandInGPT:
    """What the hook needs of a megatron.core ``GPTModel``: ``forward`` with labels and loss mask, and
    ``compute_language_model_loss`` (Megatron's per-token CE of ``[s, b, V]`` logits, ``[b, s]``)."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(mtp_num_layers=None)
        self.logits: torch.Tensor | None = None

    def forward(self, tokens, position_ids, attention_mask, labels=None, loss_mask=None):
        return self.compute_language_model_loss(labels, self.logits)

    def compute_language_model_loss(self, labels, logits):
        per_token = F.cross_entropy(
            logits.transpose(0, 1).reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        )
        return per_token.view(labels.shape)


class _SummingDist:
    """Stands in for ``torch.distributed`` in the hook's step count (``ntl_scale.normalization.step_counts``):
    the 'all-reduce' over ``dp`` ranks adds the other ranks' counts, which the test hands over."""

    def __init__(self, world: int, others: torch.Tensor) -> None:
        self.world, self.others = world, others

    def get_world_size(self, group=None) -> int:
        return self.world

    def all_reduce(self, tensor, group=None) -> None:
        tensor += self.others.to(tensor.dtype)


def _megatron_lm(vocab, labels, logits, variant, normalization, micro=1, dp=1, monkeypatch=None):
    settings = ntl_megatron.NTLSettings(weight=WEIGHT, normalization=normalization, **variant)
    loss_mask = (labels != -100).float()
    labels = labels.clamp_min(0)
    leaf = logits.clone().requires_grad_()
    ranks = _parts(labels.shape[0], micro, dp)

    def forward_step(data_iterator, model):  # pretrain_gpt.py's, reduced to what the hook touches
        item = next(data_iterator)
        model.logits = item["logits"]
        output = model.forward(None, None, None, labels=item["labels"], loss_mask=item["loss_mask"])
        return output, functools.partial(megatron_loss_func, item["loss_mask"])

    def megatron_loss_func(loss_mask, output_tensor):  # pretrain_gpt.py's arithmetic, kept in float64
        mask = loss_mask.view(-1).double()
        num_tokens = mask.sum().to(torch.int)
        loss = (output_tensor.view(-1) * mask).sum()
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.double()])}

    def local_counts(rank):  # written out here: loss-mask weight of tokens and of NTL positions
        mask = torch.cat([loss_mask[p] for p in rank])
        positions = _loop_positions(torch.cat([labels[p] for p in rank]), variant["loss"])
        return torch.stack([mask.sum(), (mask * positions).sum()]).double()

    value, grad = 0.0, torch.zeros_like(leaf)
    for r, rank in enumerate(ranks):
        others = sum(local_counts(q) for i, q in enumerate(ranks) if i != r) if dp > 1 else torch.zeros(2)
        if monkeypatch is not None:
            monkeypatch.setattr(ntl_normalization, "dist", _SummingDist(dp, others))
        groups = megatron_lm.StepGroups(
            tp_group=None, cp_group=None, count_group=object() if dp > 1 else None, dp_cp_size=dp,
            reads_data=True, counts_data=True,
        )  # fmt: skip
        model = _StandInGPT()
        wrapped = megatron_lm.NTLForwardStep(forward_step, settings, vocab, groups, micro, per_token_loss=False)
        # the logits are cloned: the hook overwrites fp32/fp64 logits in place, as Megatron's CE does
        items = iter(
            [{"labels": labels[p], "loss_mask": loss_mask[p], "logits": leaf[p].transpose(0, 1).clone()} for p in rank]
        )
        for _ in rank:
            output, loss_func = wrapped(items, model)
            loss, num_tokens, report = loss_func(output)
            objective = loss / num_tokens.clamp_min(1) / micro / dp
            value += float(objective.detach())
            grad += torch.autograd.grad(objective, leaf)[0]
            assert "ntl loss" in report
        megatron_lm.remove_ntl(model)
    return None, grad  # the hook hands back CE's value (NTL enters the gradient only): no objective value


def _hf(vocab, labels, logits, variant, normalization, micro=1, dp=1):
    """``NTLCausalLMLoss`` as Trainer calls it: micro-batch = no count; global = the step's
    ``[tokens, NTL positions]`` as ``ntl_trainer_class`` counts them (Trainer's token count, our number
    count via ``count_step_numbers``), gradients summed over accumulation and ranks as Trainer does
    (it multiplies by the process count and DDP averages)."""
    options = ntl_scale.NTLOptions(**variant)
    loss = NTLCausalLMLoss(vocab, WEIGHT, options, causal=True)
    # Trainer's labels are the inputs; the loss shifts them. Prepend a column so the targets are ``labels``.
    inputs = torch.cat([torch.full_like(labels[:, :1], 20), labels], dim=1)
    leaf = logits.clone().requires_grad_()
    padded = torch.cat([leaf, torch.zeros_like(leaf[:, :1])], dim=1)  # the last position predicts nothing
    ranks = _parts(labels.shape[0], micro, dp)
    counts = None
    if normalization == "global":
        samples = [{"labels": inputs[p]} for rank in ranks for p in rank]
        tokens = sum(int((s["labels"][..., 1:] != -100).sum()) for s in samples)  # Trainer's own count
        counts = torch.stack([torch.tensor(float(tokens), dtype=torch.float64), count_step_numbers(loss, samples)])
    value, grad = 0.0, torch.zeros_like(leaf)
    for rank in ranks:
        for p in rank:
            objective = loss(padded[p], inputs[p], num_items_in_batch=counts)
            if counts is None:
                objective = objective / (micro * dp)  # a plain mean per micro-batch, averaged
            value += float(objective.detach())
            grad += torch.autograd.grad(objective, leaf)[0]
    return value, grad


def _loop_positions(labels: torch.Tensor, loss: str) -> torch.Tensor:
    """NTL positions written out with loops: number labels, or the first digit of each digit run."""
    out = torch.zeros(labels.shape, dtype=torch.float64)
    for row in range(labels.shape[0]):
        previous = False
        for col in range(labels.shape[1]):
            digit = int(labels[row, col]) in DIGIT_IDS
            out[row, col] = float(digit and (loss != "number" or not previous))
            previous = digit
    return out


def _run(path, *args, monkeypatch=None, **kwargs):
    if path == "deepspeed":
        return _deepspeed(*args, **kwargs)
    if path == "megatron_core":
        return _megatron_core(*args, **kwargs)
    if path == "megatron_lm":
        return _megatron_lm(*args, monkeypatch=monkeypatch, **kwargs)
    return _hf(*args, **kwargs)


# ---------------------------------------------------------------------------------- 1. the repro


def _global_equals_micro_batch(path, vocab, labels, logits, variant, monkeypatch) -> None:
    """Both normalisations of one micro-batch on one rank give the float64 reference's value and gradient."""
    want_value, want_grad = _reference_grad(vocab, labels, logits, variant)
    for normalization in ("micro-batch", "global"):
        value, grad = _run(path, vocab, labels, logits, variant, normalization, monkeypatch=monkeypatch)
        torch.testing.assert_close(grad, want_grad, atol=1e-12, rtol=1e-9, msg=f"{path} {normalization}")
        if value is not None:
            torch.testing.assert_close(value, float(want_value), atol=1e-12, rtol=1e-9)


@pytest.mark.parametrize("path", PATHS)
def test_the_review_repro_global_equals_micro_batch_for_number_level(path, monkeypatch):
    vocab = _vocab()
    labels, logits = _repro()
    variant = dict(loss="number")
    _global_equals_micro_batch(path, vocab, labels, logits, variant, monkeypatch)


# ---------------------------------------------------------------------------------- 2. one micro-batch


@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
@pytest.mark.parametrize("path", PATHS)
def test_global_equals_micro_batch_for_one_micro_batch_on_one_rank(path, variant, monkeypatch):
    vocab = _vocab()
    labels, logits = _batch(rows=1, seed=2)
    _global_equals_micro_batch(path, vocab, labels, logits, variant, monkeypatch)


# ---------------------------------------------------------------------------------- 3. splits


@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
@pytest.mark.parametrize("path", PATHS)
def test_splitting_a_step_into_micro_batches_and_ranks_keeps_the_gradient(path, variant, monkeypatch):
    vocab = _vocab()
    labels, logits = _batch(rows=4, seed=3)
    _, want = _reference_grad(vocab, labels, logits, variant)
    for micro, dp in SPLITS:
        _, grad = _run(path, vocab, labels, logits, variant, "global", micro=micro, dp=dp, monkeypatch=monkeypatch)
        torch.testing.assert_close(grad, want, atol=1e-12, rtol=1e-9, msg=f"{path}: {micro} x dp {dp}")


# ---------------------------------------------------------------------------------- 4. the count


@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_the_count_is_one_definition(variant):
    vocab = _vocab()
    labels, logits = _batch(rows=4, seed=4)
    options = ntl_scale.NTLOptions(**variant)
    want = _loop_positions(labels, variant["loss"])
    positions = ntl_scale.ntl_positions(labels, vocab, options)
    assert positions.dtype == torch.bool
    torch.testing.assert_close(positions.double(), want)
    terms = ntl_scale.per_token_ce_ntl(logits, labels, vocab, options)
    assert torch.equal(terms.number_mask, positions)
    counts = ntl_scale.ntl_counts(labels, vocab, options)
    torch.testing.assert_close(counts, torch.stack([(labels != -100).sum().double(), want.sum()]))
    out = ntl_scale.ce_with_ntl(logits, labels, vocab, **variant)
    torch.testing.assert_close(out.num_number_tokens, want.sum())


def test_the_repro_counts_two_numbers_and_five_digits():
    vocab = _vocab()
    labels, _ = _repro()
    assert ntl_scale.ntl_counts(labels, vocab, ntl_scale.NTLOptions(loss="number")).tolist() == [6.0, 2.0]
    assert ntl_scale.ntl_counts(labels, vocab, ntl_scale.NTLOptions(loss="was")).tolist() == [6.0, 5.0]
    counts = ntl_megatron.count_targets(labels, torch.ones(1, 6), vocab, ntl_scale.NTLOptions(loss="number"))
    assert counts.tolist() == [6.0, 2.0]


def test_context_parallel_slices_cut_numbers_in_the_count_and_the_loss():
    """Under CP a number across a slice border is two numbers (docs/math.md): the count with ``pieces``
    and the hook's loss on a rank's two slices agree."""
    vocab = _vocab()
    labels = torch.tensor([[11, 12, 13, 14, 25, 15, 16, 17]])  # 1234 x 567; 4 slices of 2 (CP = 2)
    options = ntl_scale.NTLOptions(loss="number")
    assert int(ntl_scale.ntl_positions(labels, vocab, options).sum()) == 2
    cut = ntl_scale.ntl_positions(labels, vocab, options, pieces=4)
    assert cut.tolist() == [[True, False, True, False, False, True, True, False]]
    # CP rank 0 holds slices 0 and 3 ([11, 12] + [16, 17]): two numbers, not one number 1267
    local = torch.cat([labels[:, 0:2], labels[:, 6:8]], dim=1)
    logits = torch.randn(2 * 2, 1, V, dtype=torch.float64)  # [s, b, V]
    terms = ntl_megatron.sequence_first_terms(logits.clone(), local, vocab, options, pieces=2)
    assert terms.number_mask.tolist() == [[True, False, True, False]]
    with pytest.raises(ValueError, match="divisible by 2 x the context-parallel size"):
        ntl_megatron.sequence_first_terms(logits[:3].clone(), local[:, :3], vocab, options, pieces=2)
