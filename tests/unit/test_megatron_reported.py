"""Issue 51 on the Megatron routes, without a model: what ``lm loss`` is, and loss masks that are not 0/1.

Every expected value is a float64 computation from the definitions: torch's ``F.cross_entropy`` (label
smoothing), ``torch.logsumexp`` (the z-loss), soft-capping ``c tanh(z / c)``
(``tests/helpers/reference.py::reference_ce_features``) and NTL from ``naive_per_token``. Megatron's
arithmetic around the ``loss_func`` is written out as its schedule does it: ``num_tokens`` is
``loss_mask.view(-1).float().sum().to(torch.int)`` (pretrain_gpt.py's ``loss_func``), the schedule divides
the loss by ``clamp(num_tokens, 1)`` and the micro-batches and DDP averages over the data-parallel ranks, or,
with ``--calculate-per-token-loss``, the summed gradients are divided by the sum of the ``num_tokens``
(``finalize_model_grads``). The model-side routes through Megatron's real schedule:
``tests/integration/test_megatron_settings.py``.

1. Reported numbers (CE features on: z-loss 1e-2, label smoothing 0.1, soft-cap 5): in training ``lm loss``
   is the label-smoothed CE without the z-loss and ``z loss`` is logged on its own; in evaluation (no
   gradient, ``model.eval()``: Megatron's ``evaluate``) ``lm loss`` is the plain CE of the capped logits and
   there is no ``z loss``; NTL is the same in both; the gradient still holds the z-loss. On
   ``make_loss_func``, ``make_forward_step`` (whose evaluation no longer pulls a training step's micro-batches)
   and the Megatron-LM hook through ``NTLForwardStep``.
2. Loss masks with weights 0, 0.5 and 1.5: Megatron divides by the truncated mask sum; every route gives the
   gradient of ``sum m CE / N + w sum m NTL / K`` (``N``, ``K`` the mask's weights) under global
   normalisation, and of the micro-batch objectives averaged as Megatron averages micro-batches under
   ``micro-batch``, for splits into micro-batches and data-parallel ranks, with and without per-token loss.
   The Megatron-LM route refuses the one case it cannot count (per-token loss, context parallelism and a mask
   that is not 0/1) with the mask named.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import ntl_scale
from ntl_scale import normalization as ntl_normalization
from ntl_scale.integrations import megatron as ntl_megatron
from ntl_scale.integrations.megatron import lm as megatron_lm
from tests.helpers.reference import naive_per_token, reference_ce_features

TOKENS = ["<eod>", "a", "b", "."] + [str(d) for d in range(10)] + [f"w{i}" for i in range(18)]
V = len(TOKENS)
VOCAB = ntl_scale.NumberVocab.from_id_to_token(TOKENS, vocab_size=V)
WEIGHT, Z_LOSS, SMOOTHING, CAP = 0.5, 1e-2, 0.1, 5.0
FEATURES = dict(z_loss_weight=Z_LOSS, label_smoothing=SMOOTHING, logit_softcap=CAP)
ROWS, SEQ = 6, 8


def _batch(seed: int, weighted: bool):
    """Labels (about half digits), a loss mask (0/1, or weights 0, 0.5, 1.5) and float64 logits ``[b, s, V]``."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (ROWS, SEQ), generator=g)
    labels = torch.where(
        torch.rand(ROWS, SEQ, generator=g) < 0.5, torch.randint(4, 14, (ROWS, SEQ), generator=g), labels
    )
    levels = torch.tensor([0.0, 0.5, 1.5]) if weighted else torch.tensor([0.0, 1.0, 1.0])
    mask = levels[torch.randint(0, 3, (ROWS, SEQ), generator=g)]
    logits = torch.randn(ROWS, SEQ, V, generator=g, dtype=torch.float64) * 3
    return labels, mask, logits


def _reference(logits, labels, *, z_loss_weight=0.0, label_smoothing=0.0, logit_softcap=None):
    """float64 per-token ``(ce_term, lse, ntl, is_number)`` from the definitions (``ce_term``: smoothed CE + z-loss)."""
    flat = logits.reshape(-1, V).double()
    ce, lse = reference_ce_features(
        flat,
        labels.reshape(-1),
        label_smoothing=label_smoothing,
        z_loss_weight=z_loss_weight,
        logit_softcap=logit_softcap,
    )
    capped = flat if logit_softcap is None else logit_softcap * torch.tanh(flat / logit_softcap)
    _, ntl, is_number = naive_per_token(capped, labels.reshape(-1), VOCAB)
    shape = labels.shape
    return ce.view(shape), lse.view(shape), ntl.view(shape), is_number.view(shape).double()


def _objective(logits, labels, mask, **features):
    """``sum m CE / N + w sum m NTL / K`` in float64, the CE term with the features (value, differentiable)."""
    ce, _, ntl, is_number = _reference(logits, labels, **features)
    m = mask.double()
    return (ce * m).sum() / m.sum().clamp_min(1) + WEIGHT * (ntl * m).sum() / (is_number * m).sum().clamp_min(1)


def _megatron_num_tokens(mask: torch.Tensor) -> torch.Tensor:
    """pretrain_gpt.py's ``num_tokens``, written out: the float32 sum of the mask, truncated."""
    return mask.view(-1).float().sum().to(torch.int)


def _ratio(pair: torch.Tensor) -> float:
    return float(pair[0]) / float(pair[1])


# ------------------------------------------------------------------------------------ 1. reported numbers


def test_make_loss_func_reports_smoothed_ce_and_z_loss_in_training_and_plain_ce_in_evaluation():
    labels, mask, logits = _batch(1, weighted=False)
    settings = ntl_megatron.NTLSettings(weight=WEIGHT, **FEATURES)
    loss_func = ntl_megatron.make_loss_func(settings, VOCAB, tp_group=None)
    m = mask.double()
    smoothed, lse, ntl, is_number = _reference(logits, labels, label_smoothing=SMOOTHING, logit_softcap=CAP)
    plain, *_ = _reference(logits, labels, logit_softcap=CAP)
    numbers = is_number * m

    leaf = logits.clone().requires_grad_()
    loss, num_tokens, report = loss_func(labels, mask, leaf)
    assert _ratio(report["lm loss"]) == pytest.approx(float((smoothed * m).sum() / m.sum()), rel=1e-12)
    assert _ratio(report["z loss"]) == pytest.approx(float((Z_LOSS * lse**2 * m).sum() / m.sum()), rel=1e-12)
    assert _ratio(report["ntl loss"]) == pytest.approx(float((ntl * numbers).sum() / numbers.sum()), rel=1e-12)
    # the gradient is the objective's, the z-loss included (Megatron divides by num_tokens)
    grad = torch.autograd.grad(loss / num_tokens.clamp_min(1), leaf)[0]
    leaf = logits.clone().requires_grad_()
    want = torch.autograd.grad(_objective(leaf, labels, mask, **FEATURES), leaf)[0]
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-13)

    with torch.no_grad():  # Megatron's evaluate
        _, _, evaluated = loss_func(labels, mask, logits.clone())
    assert _ratio(evaluated["lm loss"]) == pytest.approx(float((plain * m).sum() / m.sum()), rel=1e-12)
    assert "z loss" not in evaluated
    torch.testing.assert_close(evaluated["ntl loss"], report["ntl loss"], rtol=1e-12, atol=0)
    torch.testing.assert_close(evaluated["number accuracy"], report["number accuracy"], rtol=0, atol=0)
    # no z-loss configured: no z loss entry in training either
    plain_settings = ntl_megatron.NTLSettings(weight=WEIGHT)
    _, _, report = ntl_megatron.make_loss_func(plain_settings, VOCAB, tp_group=None)(labels, mask, logits.clone())
    assert set(report) == {"lm loss", "ntl loss", "number accuracy"}


class _Logits(torch.nn.Module):
    """A model called without labels that returns the micro-batch's ``[b, s, V]`` logits, as ``GPTModel``."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, tokens, position_ids, attention_mask):
        return self.logits[tokens[:, 0]].clone()


def test_make_forward_step_evaluates_one_micro_batch_at_a_time_with_the_plain_ce():
    """Under ``normalization='global'`` a training step pulls its ``m`` micro-batches to count them; Megatron's
    evaluation has its own iterator and micro-batch count: a call there pulls one, counts nothing, and its
    ``lm loss`` is the plain CE (it pulled ``m`` and reported the smoothed CE plus z-loss)."""
    labels, mask, logits = _batch(2, weighted=True)
    settings = ntl_megatron.NTLSettings(weight=WEIGHT, normalization="global", **FEATURES)

    def get_batch(iterator):
        rows = next(iterator)
        return rows.view(-1, 1), labels[rows], mask[rows], None, None

    forward_step = ntl_megatron.make_forward_step(settings, VOCAB, get_batch, tp_group=None, num_microbatches=3)
    model = _Logits(logits).eval()
    evaluation = iter([torch.tensor([4, 5])])  # one evaluation micro-batch, fewer than a training step's 3
    with torch.no_grad():
        output, loss_func = forward_step(evaluation, model)
        _, _, report = loss_func(output)
    plain, *_ = _reference(logits[4:], labels[4:], logit_softcap=CAP)
    m = mask[4:].double()
    assert _ratio(report["lm loss"]) == pytest.approx(float((plain * m).sum() / m.sum()), rel=1e-12)
    assert "z loss" not in report
    # a training step afterwards counts its own three micro-batches; evaluation in its middle is refused
    model.train()
    training = iter(torch.arange(ROWS).view(3, 2))
    forward_step(training, model)
    with pytest.raises(RuntimeError, match="an evaluation pass started while 2 micro-batches"), torch.no_grad():
        forward_step(iter([torch.tensor([0, 1])]), model.eval())


class _StandInGPT:
    """What the Megatron-LM hook needs of a ``GPTModel``: ``forward`` with labels and loss mask,
    ``compute_language_model_loss`` (Megatron's per-token CE of ``[s, b, V]`` logits), ``config``, ``training``."""

    def __init__(self, per_token_loss: bool = False) -> None:
        self.config = SimpleNamespace(mtp_num_layers=None, calculate_per_token_loss=per_token_loss)
        self.training = True
        self.logits: torch.Tensor | None = None

    def forward(self, tokens, position_ids, attention_mask, labels=None, loss_mask=None):
        return self.compute_language_model_loss(labels, self.logits)

    def compute_language_model_loss(self, labels, logits):
        per_token = F.cross_entropy(logits.transpose(0, 1).reshape(-1, V), labels.t().reshape(-1), reduction="none")
        return per_token.view(labels.shape[1], labels.shape[0]).t()


def _pretrain_gpt_step(data_iterator, model):
    """pretrain_gpt.py's ``forward_step`` and ``loss_func``, reduced to what the hook touches (loss in float64)."""
    item = next(data_iterator)
    model.logits = item["logits"]
    output = model.forward(None, None, None, labels=item["labels"], loss_mask=item["loss_mask"])

    def loss_func(loss_mask, output_tensor):
        mask = loss_mask.view(-1)
        loss = (output_tensor.reshape(-1) * mask.double()).sum()
        num_tokens = _megatron_num_tokens(mask)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.double()])}

    return output, functools.partial(loss_func, item["loss_mask"])


def _items(labels, mask, leaf, rows_per_micro_batch):
    """The data iterator's micro-batches (dicts, as Megatron's GPT datasets), logits ``[s, b, V]`` cloned (the hook
    overwrites fp32/fp64 logits in place, as Megatron's CE does)."""
    return [
        {"labels": labels[r], "loss_mask": mask[r], "logits": leaf[r].transpose(0, 1).clone()}
        for r in rows_per_micro_batch
    ]


def test_megatron_lm_hook_reports_smoothed_ce_and_z_loss_in_training_and_plain_ce_in_evaluation():
    labels, mask, logits = _batch(3, weighted=False)
    settings = ntl_megatron.NTLSettings(weight=WEIGHT, **FEATURES)
    groups = megatron_lm.StepGroups(
        tp_group=None, cp_group=None, count_group=None, dp_cp_size=1, reads_data=True, counts_data=True
    )
    wrapped = megatron_lm.NTLForwardStep(_pretrain_gpt_step, settings, VOCAB, groups, 1, per_token_loss=False)
    model = _StandInGPT()
    m = mask.double()
    smoothed, lse, ntl, is_number = _reference(logits, labels, label_smoothing=SMOOTHING, logit_softcap=CAP)
    plain, *_ = _reference(logits, labels, logit_softcap=CAP)

    leaf = logits.clone().requires_grad_()
    output, loss_func = wrapped(iter(_items(labels, mask, leaf, [slice(None)])), model)
    torch.testing.assert_close(output.detach(), smoothed, rtol=1e-12, atol=1e-12)  # per token: no z-loss
    loss, num_tokens, report = loss_func(output)
    assert _ratio(report["lm loss"]) == pytest.approx(float((smoothed * m).sum() / m.sum()), rel=1e-12)
    z_mean = float((Z_LOSS * lse**2 * m).sum() / m.sum())
    assert _ratio(report["z loss"]) == pytest.approx(z_mean, rel=1e-6)  # a float32 pair, as ntl loss
    grad = torch.autograd.grad(loss / num_tokens.clamp_min(1), leaf)[0]  # the schedule's division
    leaf_ref = logits.clone().requires_grad_()
    want = torch.autograd.grad(_objective(leaf_ref, labels, mask, **FEATURES), leaf_ref)[0]
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-13)  # the z-loss is still in the gradient

    for no_grad in (True, False):  # Megatron's evaluate: no gradient and model.eval(); either one is evaluation
        model.training = False
        with torch.set_grad_enabled(not no_grad):
            output, loss_func = wrapped(iter(_items(labels, mask, logits, [slice(None)])), model)
            _, _, evaluated = loss_func(output)
        torch.testing.assert_close(output.detach(), plain, rtol=1e-12, atol=1e-12)
        assert _ratio(evaluated["lm loss"]) == pytest.approx(float((plain * m).sum() / m.sum()), rel=1e-12)
        assert "z loss" not in evaluated
        assert _ratio(evaluated["ntl loss"]) == pytest.approx(
            float((ntl * is_number * m).sum() / (is_number * m).sum())
        )
        model.training = True


# ------------------------------------------------------------------------------------ 2. mask weights 0.5 / 1.5


def _parts(micro: int, dp: int) -> list[list[torch.Tensor]]:
    pieces = torch.chunk(torch.arange(ROWS), dp * micro)
    return [list(pieces[r * micro : (r + 1) * micro]) for r in range(dp)]


def _expected_grad(logits, labels, mask, normalization, micro, dp, per_token):
    """The gradient Megatron's arithmetic must give, from the float64 objective of the definitions."""
    leaf = logits.clone().requires_grad_()
    if normalization == "global":
        total = _objective(leaf, labels, mask, **FEATURES)
    else:  # each micro-batch's own means, averaged as Megatron averages micro-batches
        parts = [p for rank in _parts(micro, dp) for p in rank]
        objectives = [_objective(leaf[p], labels[p], mask[p], **FEATURES) for p in parts]
        if per_token:  # summed, then divided by the sum of num_tokens: weighted by each micro-batch's num_tokens
            n = [math.floor(float(mask[p].double().sum())) for p in parts]
            total = sum(k * o for k, o in zip(n, objectives)) / sum(n)
        else:  # / m by the schedule, mean over the data-parallel ranks by DDP
            total = sum(objectives) / len(parts)
    return torch.autograd.grad(total, leaf)[0]


def _core_route_grad(logits, labels, mask, settings, micro, dp, per_token):
    leaf = logits.clone().requires_grad_()
    counts = None
    if settings.normalization == "global":
        counts = ntl_megatron.GlobalCounts(VOCAB, None, settings.options())
        counts.set_step([(labels[p], mask[p]) for rank in _parts(micro, dp) for p in rank])  # as if all-reduced
    loss_func = ntl_megatron.make_loss_func(
        settings, VOCAB, tp_group=None, calculate_per_token_loss=per_token, global_counts=counts,
        num_microbatches=micro, data_parallel_size=dp,
    )  # fmt: skip
    grad, divisor = torch.zeros_like(leaf), 0
    for rank in _parts(micro, dp):
        for p in rank:
            loss, num_tokens, _ = functools.partial(loss_func, labels[p], mask[p])(leaf[p])
            assert int(num_tokens) == int(_megatron_num_tokens(mask[p]))  # what Megatron divides by
            divisor += int(num_tokens)
            if not per_token:
                loss = loss / num_tokens.clamp_min(1) / micro / dp  # the schedule's division, DDP's mean
            grad += torch.autograd.grad(loss, leaf)[0]
    return grad / divisor if per_token else grad


class _SummingDist:
    """Stands in for ``torch.distributed`` in the hook's step count: the all-reduce over the ``dp`` ranks adds
    the other ranks' counts, which the test hands over (written out from the masks)."""

    def __init__(self, world: int, others: torch.Tensor) -> None:
        self.world, self.others = world, others

    def get_world_size(self, group=None) -> int:
        return self.world

    def all_reduce(self, tensor, group=None) -> None:
        tensor += self.others[: tensor.numel()].to(tensor.dtype)


def _rank_counts(labels, mask, rank) -> torch.Tensor:
    """``[N, K, D, B]`` of one rank's micro-batches, written out: the mask's weight, its number positions', the sum
    of Megatron's ``num_tokens``, the positions whose weight is neither 0 nor 1."""
    n = sum(float(mask[p].double().sum()) for p in rank)
    k = sum(float((VOCAB.number_mask(labels[p]).double() * mask[p]).sum()) for p in rank)
    d = sum(int(_megatron_num_tokens(mask[p])) for p in rank)
    b = sum(int(((mask[p] != 0) & (mask[p] != 1)).sum()) for p in rank)
    return torch.tensor([n, k, d, b], dtype=torch.float64)


def _lm_route_grad(logits, labels, mask, settings, micro, dp, per_token, monkeypatch):
    leaf = logits.clone().requires_grad_()
    grad, divisor = torch.zeros_like(leaf), 0
    ranks = _parts(micro, dp)
    for r, rank in enumerate(ranks):
        others = sum((_rank_counts(labels, mask, q) for i, q in enumerate(ranks) if i != r), torch.zeros(4))
        fake = _SummingDist(dp, others)
        monkeypatch.setattr(ntl_normalization, "dist", fake)  # the step count's all-reduce (no per-token loss)
        monkeypatch.setattr(megatron_lm, "dist", fake)  # the one with Megatron's divisor (per-token loss)
        groups = megatron_lm.StepGroups(
            tp_group=None, cp_group=None, count_group=object() if dp > 1 else None, dp_cp_size=dp,
            reads_data=True, counts_data=True,
        )  # fmt: skip
        wrapped = megatron_lm.NTLForwardStep(_pretrain_gpt_step, settings, VOCAB, groups, micro, per_token)
        model = _StandInGPT(per_token_loss=per_token)
        items = iter(_items(labels, mask, leaf, rank))
        for _ in rank:
            output, loss_func = wrapped(items, model)
            loss, num_tokens, _ = loss_func(output)
            divisor += int(num_tokens)
            if not per_token:
                loss = loss / num_tokens.clamp_min(1) / micro / dp
            grad += torch.autograd.grad(loss, leaf)[0]
        megatron_lm.remove_ntl(model)
    return grad / divisor if per_token else grad


@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per-token-loss"])
@pytest.mark.parametrize("normalization", ["global", "micro-batch"])
@pytest.mark.parametrize("route", ["megatron_core", "megatron_lm"])
def test_mask_weights_give_the_gradient_of_the_weighted_objective(route, normalization, per_token, monkeypatch):
    labels, mask, logits = _batch(4, weighted=True)
    sums = [float(mask[p].double().sum()) for rank in _parts(3, 2) for p in rank]
    assert any(s != math.floor(s) for s in sums), sums  # Megatron's truncated count differs from the weight
    settings = ntl_megatron.NTLSettings(weight=WEIGHT, normalization=normalization, **FEATURES)
    for micro, dp in [(1, 1), (3, 1), (1, 2), (3, 2)]:
        want = _expected_grad(logits, labels, mask, normalization, micro, dp, per_token)
        if route == "megatron_core":
            got = _core_route_grad(logits, labels, mask, settings, micro, dp, per_token)
        else:
            got = _lm_route_grad(logits, labels, mask, settings, micro, dp, per_token, monkeypatch)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13, msg=f"{route} {micro} x dp {dp}")


def test_megatron_lm_refuses_per_token_loss_with_context_parallelism_and_a_weighted_mask(monkeypatch):
    """Under context parallelism each rank's ``num_tokens`` is of its own slices, which the whole sequences give only
    for a 0/1 mask: per-token loss with a weighted mask there is refused, naming the mask; a 0/1 mask trains."""
    settings = ntl_megatron.NTLSettings(weight=WEIGHT, normalization="global")
    for weighted in (True, False):
        labels, mask, logits = _batch(5, weighted=weighted)

        class ContextParallel(_SummingDist):
            def get_world_size(self, group=None) -> int:
                return 2 if group == "cp" else 1

        monkeypatch.setattr(megatron_lm, "dist", ContextParallel(1, torch.zeros(4)))
        groups = megatron_lm.StepGroups(
            tp_group=None, cp_group="cp", count_group=None, dp_cp_size=2, reads_data=True, counts_data=True
        )
        wrapped = megatron_lm.NTLForwardStep(_pretrain_gpt_step, settings, VOCAB, groups, 1, per_token_loss=True)
        items = iter(_items(labels, mask, logits.clone().requires_grad_(), [slice(None)]))
        if weighted:
            with pytest.raises(ValueError, match=r"--calculate-per-token-loss with --context-parallel-size 2 and a "
                               r"loss_mask whose values are not all 0 or 1 \(\d+ positions"):  # fmt: skip
                wrapped(items, _StandInGPT(per_token_loss=True))
        else:
            wrapped(items, _StandInGPT(per_token_loss=True))
