"""Every NTLSettings field on the model-side Megatron routes, on a megatron.core ``GPTModel`` (issue 40, item 2).

One CPU process (``tests/helpers/megatron_cpu.py``) runs every check, with every option at a non-default
value: ``weight`` 0.5; four variants covering ``loss``, ``squash_factor``, ``reweigh``, ``huber_delta``,
``float_level`` and ``impl``; ``chunked`` off and on with ``chunk_tokens`` 3. The reference is the float64
objective written from the definitions (``tests/helpers/reference.py``) on the same model's logits.

1. ``NTLLanguageModelMixin``: the per-token loss is ``ce + w * ntl * T / K`` of the reference and its
   gradient is the reference's, for every setting, read from the settings (``chunked`` and ``chunk_tokens``
   too: until issue 40 only the variant and the weight were read); ``normalization="global"`` (which this
   route cannot honour) and keywords that contradict the settings are refused; with
   ``context_parallel_size=2`` number-level NTL cuts numbers at the slice seam (the reference cut the same);
   called with ``loss_mask``, ``T`` and ``K`` are the mask's, so Megatron's masked mean is the masked
   objective (it counted every position).
2. The Megatron-LM hook (``apply_ntl``): the per-token value is the reference CE, the main head's NTL sums
   are the reference's, the gradient is the reference's micro-batch objective, for every setting;
   ``chunk_tokens`` comes from the settings; ``normalization="global"`` without the step's counts
   (``NTLForwardStep``) raises instead of training with the micro-batch mean.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import WorkerContext, run_workers

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed

VOCAB, SEQ, WEIGHT = 64, 8, 0.5
TOKENS = ["<eod>", "a", "b", "."] + [str(d) for d in range(10)] + [f"w{i}" for i in range(36)]
VARIANTS = [
    dict(loss="was", squash_factor=3.0, reweigh=True),
    dict(loss="huber", huber_delta=2.0),
    dict(loss="number", float_level=True),
    dict(loss="mse", impl="torch"),
]


def _batch():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, len(TOKENS), (2, SEQ + 1), generator=g)
    digits = torch.randint(4, 14, (2, SEQ + 1), generator=g)
    tokens = torch.where(torch.rand(tokens.shape, generator=g) < 0.6, digits, tokens)
    tokens[:, 3] = TOKENS.index(".")
    mask = (torch.rand(2, SEQ, generator=g) < 0.8).float()
    inputs = (tokens[:, :-1], torch.arange(SEQ).unsqueeze(0).expand(2, SEQ), torch.ones(1, 1, SEQ, SEQ).tril() < 0.5)
    return inputs, tokens[:, 1:].contiguous(), mask


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close_grads(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name].float(), atol=1e-6, rtol=1e-4, msg=f"{what}: {name}")


def _worker(ctx: WorkerContext) -> None:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    import ntl_scale
    from ntl_scale.integrations import megatron as ntl_megatron
    from ntl_scale.integrations.megatron import lm as megatron_lm
    from tests.helpers.megatron_cpu import patch_for_cpu, tiny_gpt
    from tests.helpers.reference import naive_per_token

    patch_for_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)

    class NTLGPTModel(ntl_megatron.NTLLanguageModelMixin, GPTModel):
        pass

    plain = tiny_gpt(VOCAB, SEQ, tp=1, pp=1)
    vocab = ntl_scale.NumberVocab.from_id_to_token(TOKENS, vocab_size=VOCAB)
    inputs, labels, mask = _batch()

    def reference(model, variant, pieces: int = 1):
        """float64 per-token (ce, ntl, is_number) of ``model``'s logits, numbers cut into ``pieces`` slices."""
        logits = model(*inputs).double()  # called without labels: [b, s, V]
        b, s = labels.shape
        rows = (b * pieces, s // pieces)
        terms = naive_per_token(
            logits.reshape(*rows, VOCAB),
            labels.reshape(rows),
            vocab,
            **{k: v for k, v in variant.items() if k != "impl"},
        )
        return tuple(t.reshape(b, s) for t in terms)

    for variant in VARIANTS:
        for chunked in (False, True):
            what = f"{variant} chunked={chunked}"
            settings = ntl_megatron.NTLSettings(
                weight=WEIGHT, chunked=chunked, chunk_tokens=3 if chunked else None, **variant
            )
            # 1. The mixin.
            for cp in (1, 2) if variant["loss"] == "number" else (1,):
                pieces = 2 if cp == 2 else 1
                mixin = tiny_gpt(VOCAB, SEQ, tp=1, pp=1, model_class=NTLGPTModel)
                mixin.load_state_dict(plain.state_dict())
                mixin.configure_ntl(settings, vocab, None, context_parallel_size=cp)
                assert mixin._ntl_chunked == (chunked, 3 if chunked else None), what
                plain.zero_grad(set_to_none=True)
                ce, ntl, is_number = reference(plain, variant, pieces)
                numbers = is_number.double().sum()
                assert float(numbers) > 0, what
                want = ce + WEIGHT * ntl * labels.numel() / numbers
                want.mean().backward()
                per_token = mixin(*inputs, labels=labels)
                torch.testing.assert_close(per_token.double(), want.detach(), atol=2e-5, rtol=1e-5, msg=what)
                per_token.mean().backward()
                _close_grads(_grads(mixin), _grads(plain), f"mixin {what} cp={cp}")
                # called with the loss mask, T and K are the mask's: Megatron's masked mean is the masked objective
                masked = mixin(*inputs, labels=labels, loss_mask=mask).double()
                numbers_kept = (is_number.double() * mask).sum()
                want = ce + WEIGHT * ntl * mask.sum() / numbers_kept
                torch.testing.assert_close(masked, want.detach(), atol=2e-5, rtol=1e-5, msg=f"{what} masked")
                objective = (ce * mask).sum() / mask.sum() + WEIGHT * (ntl * is_number * mask).sum() / numbers_kept
                torch.testing.assert_close((masked * mask).sum() / mask.sum(), objective.detach(), atol=1e-6, rtol=1e-6)
            mixin = tiny_gpt(VOCAB, SEQ, tp=1, pp=1, model_class=NTLGPTModel)
            with pytest.raises(ValueError, match=r"normalization='global' \(--ntl-normalization\) cannot be honoured"):
                mixin.configure_ntl(ntl_megatron.NTLSettings(weight=WEIGHT, normalization="global"), vocab, None)
            if chunked:
                with pytest.raises(ValueError, match=r"configure_ntl\(chunked=False\) contradicts settings.chunked"):
                    mixin.configure_ntl(settings, vocab, None, chunked=False)
                with pytest.raises(ValueError, match=r"configure_ntl\(chunk_tokens=5\) contradicts"):
                    mixin.configure_ntl(settings, vocab, None, chunk_tokens=5)

            # 2. The Megatron-LM hook.
            model = tiny_gpt(VOCAB, SEQ, tp=1, pp=1)
            model.load_state_dict(plain.state_dict())
            hook = megatron_lm.apply_ntl(model, settings, vocab, tp_group=None)
            assert hook.chunk_tokens == settings.chunk_tokens, what
            plain.zero_grad(set_to_none=True)
            ce, ntl, is_number = reference(plain, variant)
            numbers = is_number.double() * mask
            objective = (ce * mask).sum() / mask.sum() + WEIGHT * (ntl * numbers).sum() / numbers.sum()
            objective.backward()
            per_token = model(*inputs, labels=labels, loss_mask=mask)
            torch.testing.assert_close(per_token.double(), ce.detach(), atol=2e-5, rtol=1e-5, msg=what)
            ((per_token * mask).sum() / mask.sum()).backward()  # Megatron's loss_func and schedule
            _close_grads(_grads(model), _grads(plain), f"hook {what}")
            stats = hook.pop_stats()
            assert float(stats.numbers) == float(numbers.sum()), what
            torch.testing.assert_close(stats.ntl_sum.double(), (ntl * numbers).sum().detach(), atol=1e-5, rtol=1e-5)
            assert megatron_lm.remove_ntl(model)

    # the hook: global normalisation needs NTLForwardStep's counts; chunk_tokens must agree with the settings
    model = tiny_gpt(VOCAB, SEQ, tp=1, pp=1)
    megatron_lm.apply_ntl(model, ntl_megatron.NTLSettings(weight=WEIGHT, normalization="global"), vocab, tp_group=None)
    with pytest.raises(RuntimeError, match="needs the step's global counts"):
        model(*inputs, labels=labels, loss_mask=mask)
    with torch.no_grad():  # evaluation has no step counts and needs none
        model(*inputs, labels=labels, loss_mask=mask)
    megatron_lm.remove_ntl(model)
    chunked = ntl_megatron.NTLSettings(weight=WEIGHT, chunked=True, chunk_tokens=3)
    with pytest.raises(
        ValueError, match=r"apply_ntl_to_megatron_model\(chunk_tokens=5\) contradicts settings.chunk_tokens=3"
    ):
        megatron_lm.apply_ntl(model, chunked, vocab, tp_group=None, chunk_tokens=5)
    with pytest.raises(ValueError, match=r"--ntl-chunk-tokens=5 applies to the chunked route only"):
        megatron_lm.apply_ntl(model, ntl_megatron.NTLSettings(weight=WEIGHT), vocab, tp_group=None, chunk_tokens=5)
    parallel_state.destroy_model_parallel()


def test_every_setting_on_the_model_side_routes():
    run_workers(1, 1, _worker)
