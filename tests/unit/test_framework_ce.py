"""``ce_kernel="framework"``: the stack's own CE with NTL beside it, in one process.

1. The option: what it refuses (the CE options of ntl_scale's op, ``reweigh``), on every front end's spelling.
2. The routes that cannot keep the framework's CE say so before a step: Megatron's ``--ntl-chunked`` and a
   missing Transformer Engine, Hugging Face's hidden-state route on a soft-capping model.
3. Hugging Face on a tiny GPT-2: transformers' ``ForCausalLMLoss`` (logits) and the model's own forward with
   NTL from the hidden states (``chunked=True``) give the loss and gradients of a float64 computation of
   ``CE/N + w NTL/K`` from the definitions (torch's ``F.cross_entropy``, the reference NTL), for both
   normalisations Hugging Face hands in; the logs give the arg-max among the number columns in place of
   ``number_accuracy``.
4. torchtitan: with NTL on, torchtitan's CE reads the logits through NTL's passthrough, so the backward allocates
   the ``[T, V]`` tensors of torchtitan's CE alone and no other (no dense NTL gradient, no sum of two).
"""

from __future__ import annotations

import argparse
import types

import pytest
import torch
import torch.nn.functional as F

import ntl_scale
from ntl_scale.options import NTLOptions, NTLRunOptions
from tests.helpers import reference
from tests.helpers.dispatch import OpOutputs, allocated

# ------------------------------------------------------------------------------------ 1. the option


@pytest.mark.parametrize(
    "extra",
    [dict(z_loss_weight=1e-4), dict(label_smoothing=0.1), dict(logit_softcap=30.0), dict(reweigh=True)],
    ids=lambda d: next(iter(d)),
)
def test_framework_refuses_what_only_the_fused_op_computes(extra):
    with pytest.raises(ValueError, match=r"ce_kernel='framework' runs the stack's own cross entropy.*ntl_scale"):
        NTLOptions(ce_kernel="framework", **extra)
    with pytest.raises(ValueError, match="ce_kernel='framework'"):
        NTLRunOptions(ce_kernel="framework", **extra)
    NTLOptions(**extra)  # the fused op computes them
    with pytest.raises(ValueError, match="unknown ce_kernel 'megatron'"):
        NTLOptions(ce_kernel="megatron")


# ------------------------------------------------------------------------------------ 2. refused routes


def test_megatron_refuses_chunked_and_a_missing_transformer_engine():
    from ntl_scale.integrations.megatron import NTLSettings, add_ntl_args
    from ntl_scale.integrations.megatron.lm import _check_te_cross_entropy

    parser = add_ntl_args(argparse.ArgumentParser())
    args = parser.parse_args(["--ntl-weight", "0.3", "--ntl-ce-kernel", "framework"])
    settings = NTLSettings.from_args(args)
    assert settings.options().ce_kernel == "framework"
    with pytest.raises(ValueError, match=r"--ntl-chunked computes ntl_scale's CE.*drop one of them"):
        NTLSettings(weight=0.3, chunked=True, ce_kernel="framework")
    te = types.SimpleNamespace(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(ValueError, match="Transformer Engine's CE, which is not installed"):
            _check_te_cross_entropy(settings, te)
    _check_te_cross_entropy(NTLSettings(weight=0.3), te)  # the fused op: Megatron's flag is not used
    from ntl_scale.integrations.megatron.args import ignored_megatron_flags

    fused = types.SimpleNamespace(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")
    assert ignored_megatron_flags(fused)  # said: the fused op replaces Megatron's CE
    assert not ignored_megatron_flags(types.SimpleNamespace(**vars(fused), ntl_ce_kernel="framework"))


def _gpt2(vocab_size: int = 96, **config):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab_size, n_embd=16, n_layer=1, n_head=2, n_positions=64,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, **config)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def test_hf_hidden_state_route_refuses_a_soft_capping_model():
    from ntl_scale.integrations.hf import apply_ntl_to_hf_model

    model = _gpt2()
    model.config.final_logit_softcapping = 30.0
    vocab = ntl_scale.NumberVocab.from_id_to_token({i: str(i) for i in range(10)}, vocab_size=96)
    with pytest.raises(ValueError, match="soft-caps its logits: ce_kernel='framework' with chunked=True"):
        apply_ntl_to_hf_model(model, vocab, options=NTLOptions(ce_kernel="framework"), chunked=True)


# ------------------------------------------------------------------------------------ 3. Hugging Face


def _step(chunked: bool, ids: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor | None, ntl: bool = True):
    """The framework route's loss, its logits gradient (logits route), every parameter's gradient, the logged
    means, the table and what the backward's aten ops made; ``ntl=False``: the model's own loss."""
    from ntl_scale.integrations.hf import apply_ntl_to_hf_model

    model = _gpt2()
    vocab = ntl_scale.NumberVocab.from_id_to_token({i: str(i) for i in range(10)}, vocab_size=96)
    loss = apply_ntl_to_hf_model(model, vocab, ntl_weight=0.3, options=NTLOptions(ce_kernel="framework"),
                                 chunked=chunked, chunk_tokens=16 if chunked else None) if ntl else None  # fmt: skip
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out))
    value = model(input_ids=ids, labels=labels, num_items_in_batch=counts).loss
    hook.remove()
    seen[-1].retain_grad()
    with OpOutputs() as made:
        value.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return value, seen[-1].grad, grads, loss.pop_means() if loss else None, vocab, made.records


@pytest.mark.parametrize("counts", [None, torch.tensor([40.0, 15.0])], ids=["batch-mean", "step-counts"])
def test_hf_framework_ce_equals_the_float64_definition(counts):
    """Logits route against float64 ``F.cross_entropy`` + reference NTL; the hidden-state route against it."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 20), generator=g)
    ids = torch.where(torch.rand(2, 20, generator=g) < 0.5, torch.randint(0, 10, (2, 20), generator=g), ids)
    labels = ids.clone()
    labels[0, :3] = -100
    targets = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
    got, logits_grad, grads, means, vocab, _ = _step(False, ids, labels, counts)
    with torch.no_grad():
        logits = _gpt2()(input_ids=ids).logits.double()
    ref = logits.requires_grad_()
    ce_sum = F.cross_entropy(ref.reshape(-1, 96), targets.reshape(-1), reduction="sum")
    _, ntl, mask = reference.naive_per_token(ref, targets, vocab)
    n, k = ((targets != -100).sum(), mask.sum()) if counts is None else counts
    want = ce_sum / n + 0.3 * ntl.sum() / k
    want.backward()
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_grad.double(), ref.grad, atol=1e-7, rtol=1e-4)
    # no number_accuracy (the full arg-max is the framework's): the arg-max among the number columns
    assert set(means) == {"ce", "ntl", "number_choice_accuracy"}, means
    number_ids = vocab.ids.clone()
    numbers = torch.isin(targets, number_ids)
    picked = number_ids[logits[..., number_ids].argmax(-1)]
    assert means["number_choice_accuracy"] == pytest.approx(float((picked == targets)[numbers].double().mean()))
    hidden_value, _, hidden_grads, _, _, made = _step(True, ids, labels, counts)
    torch.testing.assert_close(hidden_value, got, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(hidden_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    # NTL's gradients join the model's own CE's in place: its backward makes what the model's alone makes, plus
    # NTL's [T, H] product (no [V, H] fill, no [V, H] or [T, H] sum)
    plain = _step(False, ids, labels, None, ntl=False)[-1]
    assert allocated(made, 96 * 16) == allocated(plain, 96 * 16), allocated(made, 96 * 16)
    assert allocated(made, 40 * 16) == sorted([*allocated(plain, 40 * 16), "mm"]), allocated(made, 40 * 16)


# ------------------------------------------------------------------------------------ 4. torchtitan


def test_torchtitan_adds_ntl_into_its_ce_gradient_in_place(tmp_path):
    """torchtitan's CE with NTL beside it (weight 0.3) allocates in its backward what its CE alone (weight 0)
    does: NTL's columns go into that CE's gradient in place; a dense ``[T, V]`` NTL gradient would add two."""
    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 (scripts/setup.sh --dev)")
    from ntl_scale.integrations.torchtitan import NTLLoss

    path = str(tmp_path / "numbers.json")
    ntl_scale.NumberVocab(list(range(3, 13)), list(range(10)), 37, tokens=[str(d) for d in range(10)]).save(path)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 8, 37, generator=g)
    labels = torch.randint(0, 37, (2, 8), generator=g)
    labels[:, ::2] = 5
    made = {}
    for weight in (0.0, 0.3):
        loss_fn = NTLLoss.Config(number_vocab=path, vocab_size=37, weight=weight, ce_kernel="framework").build()
        loss_fn.begin_step(8)
        loss, _ = loss_fn(logits.clone().requires_grad_(True), labels, torch.tensor(16))
        with OpOutputs() as backward:
            loss.backward()
        made[weight] = allocated(backward.records, 2 * 8 * 37)
    assert made[0.0], "the probe sees torchtitan's CE gradient"
    assert made[0.3] == made[0.0], made
