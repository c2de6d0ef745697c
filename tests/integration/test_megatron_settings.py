"""Every NTLSettings field on the model-side Megatron routes, on a megatron.core ``GPTModel`` (issue 40, item 2).

One CPU process (``tests/helpers/megatron_cpu.py``) runs every check, with every option at a non-default
value: ``weight`` 0.5; four variants covering ``loss``, ``squash_factor``, ``reweigh``, ``huber_delta``,
``float_level`` and ``impl``; ``chunked`` off and on with ``chunk_tokens`` 3. The reference is the float64
objective written from the definitions (``tests/helpers/reference.py``) on the same model's logits.

1. ``NTLLanguageModelMixin``: the per-token loss is ``ce + w * ntl * T / K`` of the reference and its
   gradient is the reference's, for every setting, read from the settings (``chunked`` and ``chunk_tokens``
   too: until issue 40 only the variant and the weight were read); keywords that contradict the settings
   are refused; with
   ``context_parallel_size=2`` number-level NTL cuts numbers at the slice seam (the reference cut the same);
   called with ``loss_mask``, ``T`` and ``K`` are the mask's, so Megatron's masked mean is the masked
   objective (it counted every position).
2. The Megatron-LM hook (``apply_ntl_to_megatron_model``): the per-token value is the reference CE, the main
   head's NTL sums
   are the reference's, the gradient is the reference's micro-batch objective, for every setting;
   ``chunk_tokens`` comes from the settings; ``normalization="global"`` without the step's counts
   (``NTLForwardStep``) raises instead of training with the micro-batch mean.
3. The mixin under ``normalization="global"`` (issue 41 item 2; refused until then), with the step's
   ``MicroBatchScale`` set as the forward-step routes set it: a step of 6 sequences whose micro-batches have
   different token and number counts, split 3x2 and 1x6, with and without per-token loss; the summed gradient
   after Megatron's divisions is that of the float64 ``CE_sum / T + w NTL_sum / K`` over the step, the two
   splits agree, a training forward without the scale raises, evaluation needs none, and micro-batch
   normalisation ignores a scale left set (bitwise).
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
            if chunked:
                with pytest.raises(ValueError, match=r"configure_ntl\(chunked=False\) contradicts settings.chunked"):
                    mixin.configure_ntl(settings, vocab, None, chunked=False)
                with pytest.raises(ValueError, match=r"configure_ntl\(chunk_tokens=5\) contradicts"):
                    mixin.configure_ntl(settings, vocab, None, chunk_tokens=5)

            # 2. The Megatron-LM hook.
            model = tiny_gpt(VOCAB, SEQ, tp=1, pp=1)
            model.load_state_dict(plain.state_dict())
            hook = megatron_lm.apply_ntl_to_megatron_model(model, settings, vocab, tp_group=None)
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

    # 3. The mixin under global normalisation: one step of 6 sequences with a mask that keeps different tokens
    # per micro-batch, as 3 micro-batches of 2 and as 1 of 6, the scale set per step as the forward-step routes set
    # it. The summed gradient after Megatron's division (by n and m; DP 1) is that of the float64 objective
    # CE_sum / T + w NTL_sum / K over the whole step, for both splits; with per-token loss (Megatron divides by T).
    g = torch.Generator().manual_seed(11)
    step_tokens = torch.randint(0, len(TOKENS), (6, SEQ + 1), generator=g)
    digits = torch.randint(4, 14, (6, SEQ + 1), generator=g)
    rich = torch.tensor([0.9, 0.9, 0.2, 0.2, 0.6, 0.0]).unsqueeze(1)  # number counts differ per micro-batch
    step_tokens = torch.where(torch.rand(step_tokens.shape, generator=g) < rich, digits, step_tokens)
    step_labels = step_tokens[:, 1:].contiguous()
    keep = torch.tensor([1.0, 0.9, 0.5, 0.7, 0.3, 1.0]).unsqueeze(1)  # token counts differ per micro-batch
    step_mask = (torch.rand(6, SEQ, generator=g) < keep).float()

    def step_inputs(rows):
        n = len(rows)
        return (step_tokens[rows, :-1], torch.arange(SEQ).unsqueeze(0).expand(n, SEQ), inputs[2])

    for variant in (VARIANTS[0], VARIANTS[2]):
        for chunked in (False, True):
            what = f"global {variant} chunked={chunked}"
            settings = ntl_megatron.NTLSettings(weight=WEIGHT, normalization="global", chunked=chunked, **variant)
            plain.zero_grad(set_to_none=True)
            logits = plain(*step_inputs(list(range(6)))).double()
            ce, ntl, is_number = naive_per_token(
                logits, step_labels, vocab, **{k: v for k, v in variant.items() if k != "impl"}
            )
            numbers = is_number.double() * step_mask
            objective = (ce * step_mask).sum() / step_mask.sum() + WEIGHT * (ntl * numbers).sum() / numbers.sum()
            objective.backward()
            want = _grads(plain)
            got = {}
            for split in ((0, 1), (2, 3), (4, 5)), (tuple(range(6)),):
                for per_token_loss in (False, True):
                    mixin = tiny_gpt(VOCAB, SEQ, tp=1, pp=1, model_class=NTLGPTModel)
                    mixin.load_state_dict(plain.state_dict())
                    mixin.configure_ntl(settings, vocab, None)
                    with pytest.raises(RuntimeError, match="needs the step's global counts"):
                        mixin(*step_inputs([0]), labels=step_labels[:1], loss_mask=step_mask[:1])
                    counts = ntl_megatron.GlobalCounts(vocab, None, settings.options())
                    counts.set_step([(step_labels[list(r)], step_mask[list(r)]) for r in split])
                    mixin.ntl_scale = megatron_lm.MicroBatchScale(
                        tokens=counts.tokens.float(), numbers=counts.numbers.float(), microbatches=len(split),
                        dp_cp_size=1, per_token_loss=per_token_loss,
                    )  # fmt: skip
                    for rows in split:
                        mask_i = step_mask[list(rows)]
                        out = mixin(*step_inputs(list(rows)), labels=step_labels[list(rows)], loss_mask=mask_i)
                        loss = (out * mask_i).sum()  # Megatron's loss_func; the schedule divides by n and m
                        (loss if per_token_loss else loss / mask_i.sum().clamp_min(1) / len(split)).backward()
                    grads = _grads(mixin)
                    if per_token_loss:  # Megatron divides the summed gradients by the step's token count
                        grads = {k: v / step_mask.sum() for k, v in grads.items()}
                    key = f"{what} {len(split)}x{len(split[0])} per_token_loss={per_token_loss}"
                    _close_grads(grads, want, key)
                    got[key] = grads
                    with torch.no_grad():  # evaluation has no step counts and needs none: the micro-batch mean
                        mixin.ntl_scale = None
                        mixin(*step_inputs([0]), labels=step_labels[:1], loss_mask=step_mask[:1])
            split_3x2, split_1x6 = got[f"{what} 3x2 per_token_loss=False"], got[f"{what} 1x6 per_token_loss=False"]
            for name in split_1x6:  # split invariance, tighter than against the float64 reference
                torch.testing.assert_close(split_3x2[name], split_1x6[name], atol=1e-6, rtol=1e-5)
    # micro-batch normalisation ignores a scale someone left set: the per-token loss is bitwise the same
    settings = ntl_megatron.NTLSettings(weight=WEIGHT)
    mixin = tiny_gpt(VOCAB, SEQ, tp=1, pp=1, model_class=NTLGPTModel)
    mixin.configure_ntl(settings, vocab, None)
    plain_out = mixin(*inputs, labels=labels, loss_mask=mask)
    one = torch.ones((), dtype=torch.float32)
    mixin.ntl_scale = megatron_lm.MicroBatchScale(one * 3, one * 2, 2, 1, False)
    assert torch.equal(mixin(*inputs, labels=labels, loss_mask=mask), plain_out)

    # the hook: global normalisation needs NTLForwardStep's counts; chunk_tokens must agree with the settings
    model = tiny_gpt(VOCAB, SEQ, tp=1, pp=1)
    megatron_lm.apply_ntl_to_megatron_model(
        model, ntl_megatron.NTLSettings(weight=WEIGHT, normalization="global"), vocab, tp_group=None
    )
    with pytest.raises(RuntimeError, match="needs the step's global counts"):
        model(*inputs, labels=labels, loss_mask=mask)
    with torch.no_grad():  # evaluation has no step counts and needs none
        model(*inputs, labels=labels, loss_mask=mask)
    megatron_lm.remove_ntl(model)
    chunked = ntl_megatron.NTLSettings(weight=WEIGHT, chunked=True, chunk_tokens=3)
    with pytest.raises(
        ValueError, match=r"apply_ntl_to_megatron_model\(chunk_tokens=5\) contradicts settings.chunk_tokens=3"
    ):
        megatron_lm.apply_ntl_to_megatron_model(model, chunked, vocab, tp_group=None, chunk_tokens=5)
    with pytest.raises(ValueError, match=r"--ntl-chunk-tokens=5 applies to the chunked route only"):
        megatron_lm.apply_ntl_to_megatron_model(
            model, ntl_megatron.NTLSettings(weight=WEIGHT), vocab, tp_group=None, chunk_tokens=5
        )
    parallel_state.destroy_model_parallel()


def test_every_setting_on_the_model_side_routes():
    run_workers(1, 1, _worker)
