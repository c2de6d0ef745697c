"""The CE features of pretraining recipes (z-loss, label smoothing, logit soft-capping) on one device.

Sections:
1. The logits op (``per_token_ce_ntl``, ``ce_with_ntl``): per-token CE, the returned log-sum-exp and the
   gradient of the logits against independent references: torch's ``F.cross_entropy(label_smoothing=)``,
   a float64 z-loss written from its definition (``w * logsumexp(z)**2``) and ``c * tanh(z / c)``
   written out; arbitrary upstream gradients, ignored labels, fp64 and fp32.
2. NTL keeps the hard number target: label smoothing leaves NTL and its gradient unchanged.
3. The chunked op (``linear_ce_ntl``, ``linear_ce_with_ntl``): the same references on ``hidden @ weight.T``
   for the gradients of both, with the forward-built weight gradient (proportional) and the recomputed
   one, with loss weights; soft-capping with label smoothing there (its dense gradient recomputed in the
   backward) and soft-capping on NTL alone (``need_ce=False``: the number columns only).
4. Kernel choice and surfaces: ``impl="triton"`` with label smoothing or soft-capping is refused,
   ``auto`` runs the PyTorch code (the z-loss runs on the kernels: ``tests/unit/test_triton_kernel.py``);
   Megatron refuses the features with ``--ntl-weight 0`` (its own CE would run, without them); Hugging
   Face's ``label_smoothing_factor`` is refused beside the NTL loss (Trainer would skip it silently); the HF
   chunked route takes Gemma 2's own soft-capping (against the model's logits in float64); torchtitan's
   ``NTLLoss`` at weight 0 is torchtitan's ``CrossEntropyLoss`` plus the float64 z-loss.
"""

from __future__ import annotations

import pytest
import torch

import ntl_scale
from ntl_scale.ops.logits import use_triton
from ntl_scale.options import NTLOptions
from tests.helpers.reference import reference_ce_features

V, H, T = 37, 8, 9
FEATURES = [
    dict(label_smoothing=0.1),
    dict(z_loss_weight=1e-2),
    dict(label_smoothing=0.2, z_loss_weight=3e-2),
    dict(logit_softcap=4.0),
    dict(logit_softcap=3.0, z_loss_weight=1e-2),
    dict(logit_softcap=3.0, label_smoothing=0.1, z_loss_weight=1e-2),
]
# what the chunked op computes: every combination (soft-capping with label smoothing since issue 43)
CHUNKED = [*FEATURES, dict(logit_softcap=2.0, label_smoothing=0.3)]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5}


def _vocab() -> ntl_scale.NumberVocab:
    return ntl_scale.NumberVocab(list(range(5, 15)), list(range(10)), V)


def _labels() -> torch.Tensor:
    return torch.tensor([1, 7, -100, 12, 30, 5, 14, 36, 0])


def _close(actual, expected, tol, what):
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol, msg=what)


# ------------------------------------------------------------------------------------ 1. the logits op


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("features", FEATURES)
def test_logits_op_against_torch_and_the_definitions(features, dtype):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(T, V, generator=gen, dtype=torch.float64) * 3
    upstream = torch.randn(T, generator=gen, dtype=torch.float64)
    labels = _labels()
    logits = base.to(dtype).clone().requires_grad_()
    terms = ntl_scale.per_token_ce_ntl(logits, labels, _vocab(), NTLOptions(**features))
    (terms.ce * upstream.to(terms.ce.dtype)).sum().backward()
    reference = base.clone().requires_grad_()
    ce, lse = reference_ce_features(reference, labels, **features)
    (ce * upstream).sum().backward()
    tol = TOLERANCE[dtype]
    _close(terms.ce, ce, tol, f"ce {features}")
    _close(terms.lse, lse, tol, f"lse {features}")
    _close(logits.grad, reference.grad, tol, f"grad {features}")


def test_lse_is_differentiable_and_ce_reductions_keep_weights():
    """The returned lse carries d lse/dz = softmax; ce_with_ntl(reduction="none") is the weighted per-token term."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(T, V, generator=gen, dtype=torch.float64)
    logits = base.clone().requires_grad_()
    terms = ntl_scale.per_token_ce_ntl(logits, _labels(), _vocab())
    terms.lse.sum().backward()
    torch.testing.assert_close(logits.grad, torch.softmax(base, -1), atol=1e-14, rtol=0)
    weights = torch.rand(T, generator=gen, dtype=torch.float64)
    out = ntl_scale.ce_with_ntl(
        base, _labels(), _vocab(), label_smoothing=0.1, z_loss_weight=1e-2, loss_weights=weights, reduction="none"
    )
    ce, _ = reference_ce_features(base, _labels(), label_smoothing=0.1, z_loss_weight=1e-2)
    _close(out.ce, ce * weights * (_labels() != -100), 1e-12, "reduction none")
    mean = ntl_scale.ce_with_ntl(base, _labels(), _vocab(), label_smoothing=0.1, z_loss_weight=1e-2).ce
    valid = _labels() != -100
    _close(mean, ce[valid].mean(), 1e-12, "mean")


# ------------------------------------------------------------------------------------ 2. NTL's target


@pytest.mark.parametrize("loss", ["was", "mse"])
def test_label_smoothing_leaves_ntl_on_the_hard_target(loss):
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(T, V, generator=gen, dtype=torch.float64)
    grads = []
    for eps in (0.0, 0.3):
        logits = base.clone().requires_grad_()
        terms = ntl_scale.per_token_ce_ntl(logits, _labels(), _vocab(), NTLOptions(loss=loss, label_smoothing=eps))
        terms.ntl.sum().backward()
        grads.append((terms.ntl.detach(), logits.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    # a control: smoothing does change CE
    plain = ntl_scale.per_token_ce_ntl(base, _labels(), _vocab()).ce
    smoothed = ntl_scale.per_token_ce_ntl(base, _labels(), _vocab(), NTLOptions(label_smoothing=0.3)).ce
    assert not torch.allclose(plain, smoothed)


# ------------------------------------------------------------------------------------ 3. the chunked op


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("features", CHUNKED)
@pytest.mark.parametrize("proportional", [True, False])
def test_chunked_op_against_torch_and_the_definitions(features, dtype, proportional):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(T, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64)
    token_weights = torch.rand(T, generator=gen, dtype=torch.float64)
    labels = _labels()
    # proportional: the upstream gradient is one scale times the token weights (a weighted mean); else any
    upstream = 0.37 * token_weights if proportional else torch.randn(T, generator=gen, dtype=torch.float64)
    hidden, weight = h.to(dtype).clone().requires_grad_(), w.to(dtype).clone().requires_grad_()
    terms = ntl_scale.linear_ce_ntl(
        hidden, weight, labels, _vocab(), NTLOptions(**features), chunk_tokens=4, token_weights=token_weights,
        proportional_grad=proportional,
    )  # fmt: skip
    (terms.ce * upstream.to(terms.ce.dtype)).sum().backward()
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    ce, lse = reference_ce_features(h_ref @ w_ref.T, labels, **features)
    (ce * upstream).sum().backward()
    tol = TOLERANCE[dtype]
    _close(terms.ce, ce, tol, f"ce {features}")
    _close(terms.lse, lse, tol, f"lse {features}")
    _close(hidden.grad, h_ref.grad, tol, f"hidden grad {features}")
    _close(weight.grad, w_ref.grad, tol, f"weight grad {features}")


def test_linear_ce_with_ntl_mean_matches_the_reference():
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(2, 5, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64)
    labels = _labels()[: 10 - 1].reshape(-1)
    labels = torch.cat([labels, torch.tensor([9])]).reshape(2, 5)
    hidden, weight = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = ntl_scale.linear_ce_with_ntl(
        hidden, weight, labels, _vocab(), ntl_weight=0.3, label_smoothing=0.1, z_loss_weight=1e-2, chunk_tokens=3
    )
    out.loss.backward()
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits = h_ref @ w_ref.T
    ce, _ = reference_ce_features(logits.reshape(-1, V), labels.reshape(-1), label_smoothing=0.1, z_loss_weight=1e-2)
    ntl = ntl_scale.number_token_loss(logits, labels, _vocab())  # NTL on the hard target, as without smoothing
    loss = ce[labels.reshape(-1) != -100].mean() + 0.3 * ntl
    loss.backward()
    _close(out.loss, loss, 1e-12, "loss")
    _close(hidden.grad, h_ref.grad, 1e-12, "hidden grad")
    _close(weight.grad, w_ref.grad, 1e-12, "weight grad")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("loss", ["was", "mse"])
def test_chunked_op_soft_caps_ntl_alone(dtype, loss):
    """need_ce=False reads the number columns only: NTL of the capped logits, against float64 written out."""
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(T, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64) * 2
    upstream = torch.randn(T, generator=gen, dtype=torch.float64)
    hidden, weight = h.to(dtype).clone().requires_grad_(), w.to(dtype).clone().requires_grad_()
    options = NTLOptions(loss=loss, logit_softcap=2.5)
    terms = ntl_scale.linear_ce_ntl(hidden, weight, _labels(), _vocab(), options, need_ce=False, chunk_tokens=4)
    (terms.ntl * upstream.to(terms.ntl.dtype)).sum().backward()
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    capped = 2.5 * torch.tanh((h_ref @ w_ref.T) / 2.5)
    ntl = ntl_scale.number_token_loss(capped, _labels(), _vocab(), loss=loss, reduction="none")
    (ntl * upstream).sum().backward()
    tol = TOLERANCE[dtype]
    _close(terms.ntl, ntl, tol, "ntl")
    _close(hidden.grad, h_ref.grad, tol, "hidden grad")
    _close(weight.grad, w_ref.grad, tol, "weight grad")
    # a control: the cap changes NTL here
    assert not torch.allclose(ntl, ntl_scale.number_token_loss(h @ w.T, _labels(), _vocab(), reduction="none"))


def test_linear_ce_with_ntl_soft_caps_and_smooths_like_torch():
    """The mean loss with both features against torch's F.cross_entropy(label_smoothing=) on the capped logits
    (the CE-only value at ntl_weight 0, and its gradients)."""
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(T, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64) * 2
    hidden, weight = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = ntl_scale.linear_ce_with_ntl(
        hidden, weight, _labels(), _vocab(), ntl_weight=0.0, label_smoothing=0.2, logit_softcap=3.0, chunk_tokens=2
    )
    out.loss.backward()
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    capped = 3.0 * torch.tanh((h_ref @ w_ref.T) / 3.0)
    torch_ce = torch.nn.functional.cross_entropy(capped, _labels(), label_smoothing=0.2)
    torch_ce.backward()
    _close(out.loss, torch_ce, 1e-12, "loss")
    _close(hidden.grad, h_ref.grad, 1e-12, "hidden grad")
    _close(weight.grad, w_ref.grad, 1e-12, "weight grad")


Z_WEIGHTS = [0.0, 0.1, 1.0, 10.0]
# per-token shifts of the logits (a constant hidden feature times a weight column of ones): every lse negative,
# every lse positive, or both in one batch; with the z-loss the effective weights w (1 + 2 z_weight lse) are then
# all negative (z_weight >= 1 below), all positive, or of both signs (and 0 where the loss weight is 0)
SHIFTS = {"negative": (-8.0, -8.0), "positive": (0.0, 0.0), "mixed": (-8.0, 0.0)}


def _shifted_problem(regime: str, seed: int = 11):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.3
    low, high = SHIFTS[regime]
    shift = torch.tensor([low if t % 2 == 0 else high for t in range(T)], dtype=torch.float64)
    h = torch.cat([h, shift.unsqueeze(1)], dim=1)
    w = torch.cat([w, torch.ones(V, 1, dtype=torch.float64)], dim=1)
    weights = torch.rand(T, generator=gen, dtype=torch.float64) + 0.5
    weights[5] = 0.0  # a masked token: effective weight 0
    return h, w, weights


def _z_loss_reference(h, w, weights, z_weight):
    """CE (torch's F.cross_entropy) + z_weight * logsumexp**2, weighted mean over the non-ignored tokens, plus 0.3
    times NTL (tests/helpers/reference.naive_per_token) weighted by the same weights over the number labels; the
    gradients of h and w by float64 autograd over the full logits; and the per-token lse."""
    from tests.helpers.reference import naive_per_token

    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits = h_ref @ w_ref.T
    labels = _labels()
    valid = labels != -100
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none", ignore_index=-100)
    lse = torch.logsumexp(logits, dim=-1)
    per_token = torch.where(valid, ce + z_weight * lse**2, 0)
    _, ntl, is_number = naive_per_token(logits, labels, _vocab())
    cw, nw = weights * valid, weights * is_number
    loss = (per_token * cw).sum() / cw.sum() + 0.3 * (ntl * nw).sum() / nw.sum()
    loss.backward()
    return loss.detach(), h_ref.grad, w_ref.grad, lse.detach()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("regime", sorted(SHIFTS))
@pytest.mark.parametrize("z_weight", Z_WEIGHTS)
def test_chunked_z_loss_gradients_for_either_sign_of_the_effective_weights(z_weight, regime, dtype):
    """Issue 51, item 3: the forward-built weight gradient of CE + z-loss is ``s G_W`` for the effective weights
    ``w (1 + 2 z_weight lse)``; ``s`` was read at the largest effective weight and taken as 0 when that was not
    positive, so with every lse below ``-1 / (2 z_weight)`` the dense part of the weight gradient was dropped
    (relative error 0.93 at z_weight 1). Exact now for every accepted z_weight and every sign pattern, on
    ``linear_ce_with_ntl`` (mean with loss weights) and on ``linear_ce_ntl`` with a proportional upstream gradient
    (``proportional_grad`` True: the scale read on the device; False: checked on the host)."""
    h, w, weights = _shifted_problem(regime)
    loss, grad_h, grad_w, lse = _z_loss_reference(h, w, weights, z_weight)
    effective = (weights * (1 + 2 * z_weight * lse))[_labels() != -100]
    if z_weight >= 1.0 and regime == "negative":  # the regime the test is about: no positive effective weight
        assert float(effective.max()) <= 0.0
    if z_weight >= 1.0 and regime == "mixed":
        assert float(effective.min()) < 0.0 < float(effective.max())
    tol = TOLERANCE[dtype]
    hidden, weight = h.to(dtype).clone().requires_grad_(), w.to(dtype).clone().requires_grad_()
    out = ntl_scale.linear_ce_with_ntl(
        hidden, weight, _labels(), _vocab(), ntl_weight=0.3, z_loss_weight=z_weight, loss_weights=weights.to(dtype),
        chunk_tokens=4, impl="torch",
    )  # fmt: skip
    out.loss.backward()
    _close(out.loss, loss, tol, f"loss z_weight {z_weight} {regime}")
    _close(hidden.grad, grad_h, tol, f"hidden grad z_weight {z_weight} {regime}")
    _close(weight.grad, grad_w, tol, f"weight grad z_weight {z_weight} {regime}")
    # the per-token op with an upstream gradient proportional to the token weights (CE only: the z-loss is in ce)
    valid = _labels() != -100
    for proportional in (True, False):
        h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
        ce, _ = reference_ce_features(h_ref @ w_ref.T, _labels(), z_loss_weight=z_weight)
        (ce * weights * valid).sum().mul(0.37).backward()
        hidden, weight = h.to(dtype).clone().requires_grad_(), w.to(dtype).clone().requires_grad_()
        terms = ntl_scale.linear_ce_ntl(
            hidden, weight, _labels(), _vocab(), NTLOptions(z_loss_weight=z_weight, impl="torch"), chunk_tokens=4,
            token_weights=weights.to(dtype), proportional_grad=proportional,
        )  # fmt: skip
        (terms.ce * (0.37 * weights).to(dtype)).sum().backward()
        what = f"z_weight {z_weight} {regime} proportional_grad={proportional}"
        _close(hidden.grad, h_ref.grad, tol, "hidden grad " + what)
        _close(weight.grad, w_ref.grad, tol, "weight grad " + what)


def _tied_at_the_cap() -> tuple[torch.Tensor, torch.Tensor, float]:
    """Logits ``[2, V]`` whose two largest raw values, 20 and 24 at a cap of 2, both round to the cap in fp32
    (``tanh(10)`` and ``tanh(12)`` are 1 - 4e-9 and 1 - 8e-11: 1.0 in fp32, apart in fp64): in row 0 the label (7)
    has the smaller raw logit and the lower index, in row 1 (label 9) the smaller raw logit and the higher index."""
    logits = torch.linspace(-3.0, 3.0, V, dtype=torch.float64).repeat(2, 1)
    logits[0, 7], logits[0, 9] = 20.0, 24.0
    logits[1, 9], logits[1, 7] = 20.0, 24.0
    return logits, torch.tensor([7, 9]), 2.0


def test_a_tie_at_the_soft_cap_is_a_hit_by_the_same_rule_in_every_op():
    """Issue 51, item 5: capped logits that round to the same fp32 value (the cap) while the raw ones differ. The
    documented rule (docs/math.md, "Number accuracy"): a hit is the label's (capped) logit equal to the largest of
    the vocabulary, as the op rounds them; a tie counts for every tied label. Checked on the logits op and the chunked
    op (fp32), against that rule written here on the capped fp32 logits; torch.argmax, whose first index wins a tie,
    and the raw logits' arg-max differ on row 1 (what the rule does not claim: the accuracy is at most the share of
    positions tied with another token above torch.argmax's)."""
    logits, labels, cap = _tied_at_the_cap()
    capped32 = (cap * torch.tanh(logits / cap)).float()
    assert torch.equal(capped32[:, 7], capped32[:, 9]) and not torch.equal(logits[:, 7], logits[:, 9])
    rule = capped32.gather(1, labels.unsqueeze(1)).squeeze(1) == capped32.amax(-1)
    assert rule.tolist() == [True, True]
    assert (capped32.argmax(-1) == labels).tolist() == [True, False]  # torch.argmax: the first tied index
    assert (logits.argmax(-1) == labels).tolist() == [False, False]  # the raw logits: the other token wins
    options = NTLOptions(logit_softcap=cap)
    hit_logits = ntl_scale.per_token_ce_ntl(logits.float(), labels, _vocab(), options).hit
    eye = torch.eye(2, dtype=torch.float32)  # hidden @ weight.T is the logits exactly (products with 1 and 0)
    hit_chunked = ntl_scale.linear_ce_ntl(eye, logits.float().T.contiguous(), labels, _vocab(), options).hit
    assert hit_logits.tolist() == rule.tolist() == hit_chunked.tolist()
    accuracy = ntl_scale.ce_with_ntl(logits.float(), labels, _vocab(), logit_softcap=cap).number_accuracy
    assert float(accuracy) == 1.0


def test_a_tie_across_vocabulary_shards_is_a_hit_on_every_rank():
    """The same rule under tensor parallelism (two shards in threads, the all-reduces in memory): the tied columns
    on different shards, the hit from z_y and the global max alike on both ranks."""
    from tests.helpers.distributed import run_ranks_in_threads

    logits, labels, cap = _tied_at_the_cap()
    logits = logits[:, :36]  # an even split: columns 0-17 and 18-35; move column 9 onto the second shard
    logits[:, [9, 20]] = logits[:, [20, 9]]
    labels = torch.where(labels == 9, 20, labels)
    capped32 = (cap * torch.tanh(logits / cap)).float()
    rule = (capped32.gather(1, labels.unsqueeze(1)).squeeze(1) == capped32.amax(-1)).tolist()
    vocab = ntl_scale.NumberVocab(list(range(5, 15)), list(range(10)), 36)

    def rank(r: int) -> list[bool]:
        shard = logits[:, 18 * r : 18 * (r + 1)].float()
        terms = ntl_scale.per_token_ce_ntl(shard, labels, vocab, NTLOptions(logit_softcap=cap), tp_group=object())
        return terms.hit.tolist()

    results, _ = run_ranks_in_threads(rank, 2)
    assert rule == [True, True] and results[0] == results[1] == rule


# ------------------------------------------------------------------------------------ 4. kernels, surfaces


def test_triton_is_refused_with_a_ce_feature_and_auto_falls_back():
    logits = torch.zeros(2, V)
    for name in ("label_smoothing", "logit_softcap"):
        with pytest.raises(ValueError, match=f"do not compute {name}"):
            use_triton("triton", logits, (name,))
        assert use_triton("auto", logits, (name,)) is False
    # the z-loss is computed by the kernels (tests/unit/test_triton_kernel.py): at most the device is refused
    try:
        use_triton("triton", logits, ("z_loss_weight",))
    except (ValueError, ImportError) as error:
        assert "do not compute" not in str(error)
    assert NTLOptions(z_loss_weight=1e-4, logit_softcap=30.0).ce_features == ("z_loss_weight", "logit_softcap")
    with pytest.raises(ValueError, match="do not compute label_smoothing"):
        ntl_scale.ce_with_ntl(logits, torch.tensor([1, 2]), _vocab(), label_smoothing=0.1, impl="triton")


def test_megatron_refuses_the_features_when_its_own_ce_runs():
    from ntl_scale.integrations.megatron import NTLSettings

    with pytest.raises(ValueError, match="--ntl-z-loss-weight: these apply to the NTL loss, which --ntl-weight 0"):
        NTLSettings(weight=0.0, z_loss_weight=1e-4)
    assert NTLSettings(weight=0.3, label_smoothing=0.1).options().label_smoothing == 0.1


def test_hf_trainer_refuses_its_own_label_smoothing(tmp_path):
    """Trainer's LabelSmoother does not run beside a loss function: its factor would be silently ignored."""
    transformers = pytest.importorskip("transformers")
    from ntl_scale.integrations.hf import ntl_trainer_class

    config = transformers.GPT2Config(vocab_size=V, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    trainer_class = ntl_trainer_class()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), label_smoothing_factor=0.1, use_cpu=True, report_to=[]
    )
    with pytest.raises(ValueError, match=r"label_smoothing_factor=0\.1 is not applied"):
        trainer_class(model=model, args=args, number_vocab=_vocab())
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    smoothed = NTLOptions(label_smoothing=0.1)
    assert trainer_class(model=model, args=args, number_vocab=_vocab(), ntl_options=smoothed).ntl_loss is not None


def test_hf_trainer_refuses_capping_twice_on_the_logits_path(tmp_path):
    """A model that soft-caps its logits (Gemma 2) with ``ntl_options.logit_softcap``: the trainer's loss on the
    model's (already capped) logits would cap them again; refused as apply_ntl_to_hf_model refuses it."""
    transformers = pytest.importorskip("transformers")
    from ntl_scale.integrations.hf import ntl_trainer_class

    config = transformers.Gemma2Config(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, final_logit_softcapping=2.0,
    )  # fmt: skip
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    capped = NTLOptions(logit_softcap=2.0)
    with pytest.raises(ValueError, match=r"would cap them twice"):
        ntl_trainer_class()(model=transformers.Gemma2ForCausalLM(config), args=args, number_vocab=_vocab(),
                            ntl_options=capped)  # fmt: skip
    trainer = ntl_trainer_class()(model=transformers.Gemma2ForCausalLM(config), args=args, number_vocab=_vocab())
    assert trainer.ntl_loss is not None  # the model's own cap alone is fine on the logits path


def test_evaluation_options_drop_the_training_regularisers_only():
    """Held-out CE is the model's own: z-loss and label smoothing off, soft-capping (part of the logits) kept;
    the evaluation CE equals torch's hard F.cross_entropy of the capped logits."""
    options = NTLOptions(z_loss_weight=1e-2, label_smoothing=0.1, logit_softcap=3.0, loss="mse")
    evaluation = options.for_evaluation()
    assert (evaluation.z_loss_weight, evaluation.label_smoothing, evaluation.logit_softcap) == (0.0, 0.0, 3.0)
    assert evaluation.loss == "mse"
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, V, generator=gen, dtype=torch.float64) * 4
    labels = torch.randint(0, V, (12,), generator=gen)
    out = ntl_scale.ce_with_ntl(
        logits, labels, _vocab(), loss=evaluation.loss, z_loss_weight=evaluation.z_loss_weight,
        label_smoothing=evaluation.label_smoothing, logit_softcap=evaluation.logit_softcap,
    )  # fmt: skip
    hard = torch.nn.functional.cross_entropy(3.0 * torch.tanh(logits / 3.0), labels)
    torch.testing.assert_close(out.ce, hard, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_hf_chunked_route_takes_gemmas_own_soft_capping(smoothing):
    """Gemma 2's ``final_logit_softcapping`` (refused on the chunked route before): the hidden-state loss caps as
    the model does; loss and gradients equal CE + 0.3 NTL of the model's own (capped) logits in float64, with
    label smoothing too (refused there with soft-capping before issue 43): torch's smoothed CE, NTL's hard target."""
    transformers = pytest.importorskip("transformers")
    from ntl_scale.integrations.hf import apply_ntl_to_hf_model

    config = transformers.Gemma2Config(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, final_logit_softcapping=0.1, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).double()
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    ids[:, 3:6] = torch.tensor([7, 9, 11])  # number tokens
    logits = model(input_ids=ids).logits
    with torch.no_grad():
        raw = model.lm_head(model.model(input_ids=ids)[0])
    assert float(logits.detach().abs().max()) < 0.1 < float(raw.abs().max())
    shifted, targets = logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)
    ntl = ntl_scale.number_token_loss(shifted, targets, _vocab())
    reference = torch.nn.functional.cross_entropy(shifted, targets, label_smoothing=smoothing) + 0.3 * ntl
    reference.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    apply_ntl_to_hf_model(model, _vocab(), ntl_weight=0.3, chunked=True, options=NTLOptions(label_smoothing=smoothing))
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    _close(loss, reference, 1e-12, "loss")
    for name, p in model.named_parameters():
        _close(p.grad, want[name], 1e-10, name)


def test_torchtitan_loss_at_weight_zero_is_its_cross_entropy_plus_the_z_loss(tmp_path):
    """torchtitan's ``loss.z_loss_weight`` / ``loss.label_smoothing``: at NTL weight 0 our loss is torchtitan's
    own ``CrossEntropyLoss`` plus the float64 z-loss; with smoothing torch's smoothed CE (sum / tokens)."""
    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 (scripts/setup.sh --dev)")
    from torchtitan.components.loss import CrossEntropyLoss

    from ntl_scale.integrations.torchtitan import NTLLoss

    path = tmp_path / "numbers.json"
    _vocab().save(path)
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 5, V, generator=gen, dtype=torch.float64) * 2
    labels = torch.randint(0, V, (2, 5), generator=gen)
    labels[0, 1] = -100
    tokens = (labels != -100).sum()
    valid = labels != -100
    theirs = CrossEntropyLoss.Config(global_vocab_size=V).build()(logits, labels, tokens)[0]
    for features in (dict(z_loss_weight=1e-2), dict(z_loss_weight=1e-2, label_smoothing=0.1)):
        ours = NTLLoss.Config(number_vocab=str(path), vocab_size=V, weight=0.0, **features).build()
        ours.begin_step(1)
        loss = ours(logits, labels, tokens)[0]
        z_loss = 1e-2 * (torch.logsumexp(logits, -1) ** 2)[valid].sum() / tokens
        if "label_smoothing" in features:
            ce, _ = reference_ce_features(logits.reshape(-1, V), labels.reshape(-1), **features)
            torch.testing.assert_close(loss, ce.sum() / tokens, rtol=1e-12, atol=1e-12)
        else:
            torch.testing.assert_close(loss, theirs.double() + z_loss, rtol=1e-6, atol=1e-7)
