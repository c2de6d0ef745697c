"""``ntl_scale.integrations.torchtitan`` in one process: the config, every variant, the wrapper, the errors.

Sections:
1. ``NTLLoss.Config`` has every option of ``ntl_scale.options.option_fields()`` (with the spec's default)
   or says why not (``NOT_CONFIG_FIELDS``); bad values are refused naming the key.
2. Every variant on full logits, as torchtitan calls a loss (``sum / global_valid_tokens`` for CE, the
   step's count for NTL): loss and logit gradient equal the float64 reference
   (``tests/helpers/reference.py``); at weight 0 torchtitan's own ``CrossEntropyLoss``, bit for bit (loss and
   gradient, with and without ``global_valid_tokens``);
   inside torchtitan's ``ChunkedLossWrapper`` (4 chunks) the hidden-state and ``lm_head``
   gradients equal the reference's; without ``global_valid_tokens`` (torchtitan's validator) the CE sum.
   With label smoothing and z-loss on: under no grad (torchtitan's ``Validator``), plain or inside the
   wrapper, the loss is the **plain** CE of the (soft-capped) logits (torch's ``F.cross_entropy`` in
   float64); in training the loss is the objective (gradient included) while the logged ``ce_mean`` is the
   smoothed CE without the z-loss and ``z_loss_mean`` the z-loss; an evaluation call adds nothing to the
   step's metrics.
3. Errors that name the value and the fix: a number table for another vocabulary (saved JSON; logits of
   another width), no step count, a chunk count that does not divide the sequence, no tokenizer.
4. The registry's configs: the debug model's and the Llama-3.2-3B shape's NTL settings.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 (scripts/setup.sh --dev)")

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.loss import cross_entropy_loss as torchtitan_cross_entropy

import ntl_scale
from ntl_scale import NumberVocab
from ntl_scale.integrations.torchtitan import NTLLoss, NTLTrainer, config_registry
from ntl_scale.integrations.torchtitan.loss import METRICS, NOT_CONFIG_FIELDS
from ntl_scale.integrations.torchtitan.trainer import _check_chunks
from ntl_scale.options import option_fields
from tests.helpers import reference

FRAMEWORK_ACCURACY = "loss_metrics/number_choice_accuracy_mean"  # ce_kernel="framework": the arg-max among numbers
V = 37  # vocabulary: ids 3..12 are the digits 0..9, 13 a decimal point
DIGITS = list(range(3, 13))


@pytest.fixture()
def table(tmp_path) -> str:
    path = tmp_path / "numbers.json"
    tokens = [str(d) for d in range(10)]
    NumberVocab(DIGITS, list(range(10)), V, tokens=tokens, decimal_point_id=13).save(path)
    return str(path)


def _batch(seed: int = 0, batch: int = 2, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, V, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (batch, seq), generator=g)
    labels[:, ::3] = torch.randint(3, 13, (batch, (seq + 2) // 3), generator=g)  # many digits
    labels[0, 1] = -100
    return logits, labels


def _reference(logits, labels, vocab, weight, kernel="ntl_scale", **variant):  # type: ignore[no-untyped-def]
    """Loss, logit gradient and NTL count in float64; ``kernel="framework"``: the CE is torchtitan's own op
    (float32, as it computes), called here on its own, plus the float64 reference NTL."""
    z = logits.detach().double().requires_grad_(True)
    ce, ntl, mask = reference.naive_per_token(z, labels, vocab, **variant)
    ce_sum = torchtitan_cross_entropy(z, labels) if kernel == "framework" else ce.sum()  # float32: torchtitan's
    loss = ce_sum / (labels != -100).sum() + weight * ntl.sum() / mask.sum().clamp_min(1)
    loss.backward()
    return loss.detach(), z.grad, mask.sum()


# ---------------------------------------------------------------------------------- 1. the config


def test_config_has_every_option_of_the_spec_with_its_default() -> None:
    fields = {f.name: f for f in dataclasses.fields(NTLLoss.Config)}
    for option in option_fields():
        if option.name in NOT_CONFIG_FIELDS:
            assert option.name not in fields and NOT_CONFIG_FIELDS[option.name]
            continue
        assert option.name in fields, f"option {option.name!r} missing from NTLLoss.Config"
        assert fields[option.name].default == option.default, option.name
    assert set(NOT_CONFIG_FIELDS) <= {o.name for o in option_fields()}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weight": -1.0}, "loss.weight"),
        ({"loss": "cosine"}, "cosine"),
        ({"loss": "mse", "squash_factor": 10.0}, "squash_factor"),
        ({"loss": "number", "digit_level": False}, "digit_level"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
    ],
)
def test_bad_config_values_are_refused_by_name(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NTLLoss.Config(**kwargs)


# ---------------------------------------------------------------------------------- 2. the numbers

VARIANTS = [
    {},
    {"loss": "mse"},
    {"loss": "mae"},
    {"loss": "huber", "huber_delta": 0.5},
    {"loss": "was", "squash_factor": 4.0},
    {"loss": "was", "reweigh": True},
    {"loss": "number"},
    {"loss": "number", "float_level": True},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) or "was")
def test_every_variant_equals_the_float64_reference(table: str, variant: dict) -> None:
    """The fused op (``ce_kernel="ntl_scale"``) equals the float64 reference; torchtitan's CE reading NTL's
    passthrough (``framework``; reweighing is refused there) equals torchtitan's CE called alone plus the float64
    NTL, and the fused op to torchtitan's float32 rounding: loss and logit gradient."""
    logits, labels = _batch()
    kernels = ["ntl_scale"] if variant.get("reweigh") else ["ntl_scale", "framework"]
    got = {}
    for kernel in kernels:
        loss_fn = NTLLoss.Config(number_vocab=table, vocab_size=V, weight=0.3, ce_kernel=kernel, **variant).build()
        expected, grad, numbers = _reference(logits, labels, loss_fn.vocab, 0.3, kernel, **variant)
        loss_fn.begin_step(numbers)
        z = logits.clone().requires_grad_(True)
        loss, metrics = loss_fn(z, labels, (labels != -100).sum())
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12, msg=lambda m, k=kernel: f"{k}: {m}")
        torch.testing.assert_close(z.grad, grad, rtol=1e-10, atol=1e-12, msg=lambda m, k=kernel: f"{k}: {m}")
        assert set(metrics) == set(loss_fn.metric_names)
        got[kernel] = loss, z.grad
    if len(got) == 2:  # the two routes agree to torchtitan's float32 CE
        torch.testing.assert_close(got["framework"][0], got["ntl_scale"][0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["framework"][1], got["ntl_scale"][1], rtol=1e-5, atol=1e-7)
        assert loss_fn.metric_names == (*METRICS[:2], FRAMEWORK_ACCURACY)


def test_weight_zero_is_torchtitans_cross_entropy(table: str) -> None:
    logits, labels = _batch(seed=1)
    logits = logits.float()
    tokens = (labels != -100).sum()
    ours = NTLLoss.Config(number_vocab=table, vocab_size=V, weight=0.0).build()
    ours.begin_step(1)
    theirs = CrossEntropyLoss.Config(global_vocab_size=V).build()
    for count in (tokens, None):  # training (scaled) and validation (the CE sum)
        ours_logits, theirs_logits = (logits.clone().requires_grad_(True) for _ in range(2))
        ours_loss, theirs_loss = ours(ours_logits, labels, count)[0], theirs(theirs_logits, labels, count)[0]
        (ours_loss + theirs_loss).backward()
        assert torch.equal(ours_loss, theirs_loss), (ours_loss - theirs_loss).item()  # bit for bit
        assert torch.equal(ours_logits.grad, theirs_logits.grad)


@pytest.mark.parametrize("kernel", ["ntl_scale", "framework"])
def test_chunked_wrapper_gradients_equal_the_reference(table: str, kernel: str) -> None:
    """Inside torchtitan's ChunkedLossWrapper, the fused op or torchtitan's CE with NTL's passthrough."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 8, 6, generator=g, dtype=torch.float64)
    head = torch.nn.Linear(6, V, bias=False).double()
    _, labels = _batch(seed=2)
    loss_fn = NTLLoss.Config(number_vocab=table, vocab_size=V, ce_kernel=kernel)
    wrapper = ChunkedLossWrapper.Config(num_chunks=4, loss_fn=loss_fn).build()
    wrapper.set_lm_head(head)
    # reference: logits of the whole sequence in float64
    w = head.weight.detach().clone().requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    z = h @ w.T
    ce, ntl, mask = reference.naive_per_token(z, labels, wrapper.loss_fn.vocab)
    tokens = (labels != -100).sum()
    ce_mean = ce.sum() / tokens
    if kernel == "framework":  # torchtitan's CE of each chunk (float32, as it computes)
        chunks = [torchtitan_cross_entropy(z[:, i : i + 2], labels[:, i : i + 2]) / tokens for i in range(0, 8, 2)]
        ce_mean = torch.stack(chunks).double().sum()
    expected = ce_mean + 0.3 * ntl.sum() / mask.sum()
    expected.backward()
    wrapper.loss_fn.begin_step(mask.sum())
    h2 = hidden.clone().requires_grad_(True)
    loss, metrics = wrapper(h2, labels, (labels != -100).sum())
    loss.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    # torchtitan's GradAccumulator collects the hidden-state gradient in float32
    torch.testing.assert_close(h2.grad, h.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(head.weight.grad, w.grad, rtol=1e-10, atol=1e-12)
    step = wrapper.loss_fn.step_metrics()  # the chunks' parts add up to the step's means
    torch.testing.assert_close(step["loss_metrics/ce_mean"].double(), ce_mean.detach().double())
    torch.testing.assert_close(metrics["loss_metrics/ntl_mean"], (ntl.sum() / mask.sum()).detach())


def test_without_global_valid_tokens_the_loss_is_the_ce_sum(table: str) -> None:
    loss_fn = NTLLoss.Config(number_vocab=table, vocab_size=V).build()
    logits, labels = _batch(seed=3)
    ce, _, _ = reference.naive_per_token(logits, labels, loss_fn.vocab)
    torch.testing.assert_close(loss_fn(logits, labels)[0], ce.sum(), rtol=1e-12, atol=1e-12)


FEATURES = [
    {"label_smoothing": 0.1, "z_loss_weight": 1e-2},
    {"label_smoothing": 0.1, "z_loss_weight": 1e-2, "logit_softcap": 3.0},
]
"""The training-only CE terms on (and soft-capping, which is the model's and stays in evaluation)."""
Z_LOSS_METRIC = "loss_metrics/z_loss_mean"  # the name users see in TensorBoard / W&B


def _capped(logits: torch.Tensor, features: dict) -> torch.Tensor:
    """The model's logits in float64: ``c * tanh(z / c)`` when the features cap them (differentiable)."""
    z = logits.double()
    cap = features.get("logit_softcap")
    return z if cap is None else cap * torch.tanh(z / cap)


def _plain_ce_sum(logits: torch.Tensor, labels: torch.Tensor, features: dict) -> torch.Tensor:
    """The held-out CE sum from the definition: torch's F.cross_entropy in float64, no smoothing, no z-loss."""
    z = _capped(logits.detach(), features)
    return F.cross_entropy(z.reshape(-1, V), labels.reshape(-1), reduction="sum")


@pytest.mark.parametrize("weight", [0.0, 0.3])
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f))
def test_under_no_grad_the_loss_is_the_plain_cross_entropy(table: str, features: dict, weight: float) -> None:
    """torchtitan's Validator calls the loss under torch.no_grad() without global_valid_tokens and logs
    sum / tokens: that is the plain CE, whatever smoothing and z-loss train with (on full logits and
    inside ChunkedLossWrapper, as the validator runs it); a count under no grad gives the plain CE mean and
    leaves the step's training metrics alone."""
    loss_fn = NTLLoss.Config(number_vocab=table, vocab_size=V, weight=weight, **features).build()
    logits, labels = _batch(seed=7)
    expected = _plain_ce_sum(logits, labels, features)
    with torch.no_grad():
        loss, metrics = loss_fn(logits, labels)
        if weight == 0 and "logit_softcap" not in features:  # torchtitan's own CE op, which computes in float32
            assert torch.equal(loss, CrossEntropyLoss.Config(global_vocab_size=V).build()(logits, labels)[0])
    rtol = 1e-12 if loss.dtype == torch.float64 else 1e-6
    torch.testing.assert_close(loss.double(), expected, rtol=rtol, atol=0)
    assert metrics == {}

    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(2, 8, 6, generator=g, dtype=torch.float64)
    head = torch.nn.Linear(6, V, bias=False).double()
    wrapper = ChunkedLossWrapper.Config(
        num_chunks=4, loss_fn=NTLLoss.Config(number_vocab=table, vocab_size=V, weight=weight, **features)
    ).build()
    wrapper.set_lm_head(head)
    with torch.no_grad():
        chunked, _ = wrapper(hidden, labels)
        expected = _plain_ce_sum(hidden @ head.weight.T, labels, features)
    torch.testing.assert_close(chunked.double(), expected, rtol=1e-6, atol=0)  # the wrapper sums in float32

    tokens = (labels != -100).sum()
    loss_fn.begin_step(1)
    with torch.no_grad():
        _, metrics = loss_fn(logits, labels, tokens)
    ce_mean = metrics["loss_metrics/ce_mean"]
    rtol = 1e-12 if ce_mean.dtype == torch.float64 else 1e-6
    torch.testing.assert_close(ce_mean.double(), _plain_ce_sum(logits, labels, features) / tokens, rtol=rtol, atol=0)
    assert Z_LOSS_METRIC not in metrics
    assert all(float(v) == 0 for v in loss_fn.step_metrics().values())  # evaluation is not in the training log


@pytest.mark.parametrize("weight", [0.0, 0.3])
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f))
def test_training_logs_smoothed_ce_without_the_z_loss_and_the_z_loss(table: str, features: dict, weight: float) -> None:
    """In training the loss and its gradient are the objective (smoothed CE + z-loss + weight * NTL); the logged
    ce_mean is the smoothed CE alone (F.cross_entropy(label_smoothing=eps)), z_loss_mean the z-loss, ntl_mean
    the NTL and number_accuracy_mean the share of NTL positions whose label is the arg-max."""
    loss_fn = NTLLoss.Config(number_vocab=table, vocab_size=V, weight=weight, **features).build()
    logits, labels = _batch(seed=9)
    valid = (labels != -100).reshape(-1)
    tokens = valid.sum()
    z = logits.detach().clone().requires_grad_(True)
    capped = _capped(z, features)
    flat = capped.reshape(-1, V)
    ce = F.cross_entropy(flat, labels.reshape(-1), label_smoothing=features["label_smoothing"], reduction="sum")
    z_loss = features["z_loss_weight"] * torch.logsumexp(flat, -1)[valid].square().sum()
    _, ntl, mask = reference.naive_per_token(capped, labels, loss_fn.vocab)
    expected = (ce + z_loss) / tokens + weight * ntl.sum() / mask.sum()
    expected.backward()

    loss_fn.begin_step(mask.sum())
    ours = logits.clone().requires_grad_(True)
    loss, metrics = loss_fn(ours, labels, tokens)
    loss.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.grad, z.grad, rtol=1e-10, atol=1e-12)
    for logged in (metrics, loss_fn.step_metrics()):
        torch.testing.assert_close(logged["loss_metrics/ce_mean"], (ce / tokens).detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(logged[Z_LOSS_METRIC], (z_loss / tokens).detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(logged["loss_metrics/ntl_mean"], (ntl.sum() / mask.sum()).detach())
        hits = (capped.detach().argmax(-1) == labels) & mask.reshape(labels.shape)  # arg-max over the vocabulary
        torch.testing.assert_close(
            logged["loss_metrics/number_accuracy_mean"].double(), hits.sum().double() / mask.sum()
        )
    assert tuple(loss_fn.step_metrics()) == (*METRICS, Z_LOSS_METRIC)


# ---------------------------------------------------------------------------------- 3. errors


def test_a_table_of_another_vocabulary_is_refused(table: str) -> None:
    with pytest.raises(ValueError, match=r"saved for a vocabulary of 37.*model's is 64.*vocab_size=64"):
        NTLLoss.Config(number_vocab=table, vocab_size=64).build()
    loss_fn = NTLLoss.Config(number_vocab=table, vocab_size=V).build()
    loss_fn.begin_step(1)
    logits, labels = _batch()
    with pytest.raises(ValueError, match=r"logits have 19 vocabulary columns.*vocab_size 37.*loss.vocab_size"):
        loss_fn(logits[..., :19], labels, torch.tensor(10))


def test_no_step_count_names_ntl_trainer(table: str) -> None:
    loss_fn = NTLLoss.Config(number_vocab=table, vocab_size=V).build()
    logits, labels = _batch()
    with pytest.raises(ValueError, match="NTLTrainer"):
        loss_fn(logits, labels, torch.tensor(10))


def test_chunk_count_that_does_not_divide_the_sequence() -> None:
    config = config_registry.llama3_debugmodel_ntl()
    config.training.seq_len = 96
    config.loss.num_chunks = 5
    with pytest.raises(ValueError, match=r"num_chunks=5 does not divide.*96 tokens.*--loss.num_chunks"):
        _check_chunks(config)
    config.loss.num_chunks = 4
    _check_chunks(config)


def test_no_tokenizer_file(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        NTLLoss.Config(tokenizer_path=str(tmp_path), vocab_size=V).build()


# ---------------------------------------------------------------------------------- 4. the registry


def test_registry_configs() -> None:
    debug = config_registry.llama3_debugmodel_ntl()
    assert isinstance(debug, NTLTrainer.Config) and isinstance(debug.loss, ChunkedLossWrapper.Config)
    assert debug.loss.loss_fn.weight == 0.3 and debug.loss.loss_fn.vocab_size == 2048
    assert isinstance(config_registry.llama3_debugmodel_ntl_logits().loss, NTLLoss.Config)
    big = config_registry.llama3_3b_ntl()
    model = big.model_spec.model
    assert (model.dim, len(model.layers), model.vocab_size) == (3072, 28, 128256)
    ntl = big.loss.loss_fn
    assert (ntl.digit_level, ntl.squash_factor, ntl.vocab_size) == (False, 8.0, 128256)


def test_number_level_loss_under_context_parallelism_is_refused() -> None:
    """loss=number assembles whole numbers along the sequence, which context parallelism deals out to
    ranks in load-balanced pieces: refused before anything is built."""
    config = config_registry.llama3_debugmodel_ntl_logits()
    config.loss.loss = "number"
    config.parallelism.context_parallel_degree = 2
    with pytest.raises(ValueError, match="context_parallel_degree=2"):
        NTLTrainer(config)


@pytest.mark.parametrize("variant", [{"loss": "number"}, {"loss": "number", "float_level": True}, {}], ids=str)
def test_number_level_inside_the_chunked_wrapper_cuts_numbers_at_the_chunks(table: str, variant: dict) -> None:
    """ChunkedLossWrapper hands the loss one chunk of each sequence at a time, so a number across a chunk
    border is two numbers; the trainer counts K with the same cuts (ntl_pieces = num_chunks). Reference:
    float64 per chunk, the chunks' sums added, divided by the chunks' total count."""
    from ntl_scale.integrations.torchtitan.trainer import ntl_pieces

    chunks = 4
    config = config_registry.llama3_debugmodel_ntl()
    config.loss.num_chunks = chunks
    assert ntl_pieces(config) == chunks and ntl_pieces(config_registry.llama3_debugmodel_ntl_logits()) == 1
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 8, 6, generator=g, dtype=torch.float64)
    head = torch.nn.Linear(6, V, bias=False).double()
    _, labels = _batch(seed=5)
    wrapper = ChunkedLossWrapper.Config(
        num_chunks=chunks, loss_fn=NTLLoss.Config(number_vocab=table, vocab_size=V, **variant)
    ).build()
    wrapper.set_lm_head(head)
    w = head.weight.detach().clone().requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    width = labels.shape[1] // chunks
    parts = [reference.naive_per_token(h[:, i : i + width] @ w.T, labels[:, i : i + width], wrapper.loss_fn.vocab,
                                       **variant) for i in range(0, labels.shape[1], width)]  # fmt: skip
    numbers = sum(mask.sum() for _, _, mask in parts)
    counted = ntl_scale.ntl_counts(labels, wrapper.loss_fn.vocab, wrapper.loss_fn.options, pieces=chunks)[1]
    assert float(counted) == float(numbers)
    expected = (
        sum(ce.sum() for ce, _, _ in parts) / (labels != -100).sum()
        + 0.3 * sum(ntl.sum() for _, ntl, _ in parts) / numbers
    )
    expected.backward()
    wrapper.loss_fn.begin_step(counted)
    h2 = hidden.clone().requires_grad_(True)
    loss, _ = wrapper(h2, labels, (labels != -100).sum())
    loss.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h2.grad, h.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(head.weight.grad, w.grad, rtol=1e-10, atol=1e-12)
