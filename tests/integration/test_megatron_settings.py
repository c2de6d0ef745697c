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

import functools

import pytest
import torch

from tests.helpers.distributed import WorkerContext, run_workers, skip_if_missing

skip_if_missing("megatron.core")
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
                # the context-parallel size is the model's TransformerConfig's (issue 51; it defaulted to 1): a
                # CP rank's view, this process's batch standing for the rank's two slices
                mixin.config.context_parallel_size = cp
                if cp > 1:
                    with pytest.raises(ValueError, match=r"context_parallel_size=1\) contradicts the model's "):
                        mixin.configure_ntl(settings, vocab, None, context_parallel_size=1)
                mixin.configure_ntl(settings, vocab, None)
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

    _through_megatrons_schedule(plain, vocab, NTLGPTModel)
    parallel_state.destroy_model_parallel()


FEATURES = dict(z_loss_weight=1e-2, label_smoothing=0.1, logit_softcap=5.0)


def _reference_terms(logits: torch.Tensor, labels: torch.Tensor, vocab, *, evaluation: bool = False):
    """float64 per-token ``(ce, z, ntl, is_number)`` of ``[b, s, V]`` logits from the definitions: ``ce`` torch's
    ``F.cross_entropy`` of the capped logits (label-smoothed unless ``evaluation``), ``z`` the z-loss."""
    from tests.helpers.reference import naive_per_token, reference_ce_features

    flat, shape = logits.reshape(-1, VOCAB).double(), labels.shape
    smoothing = 0.0 if evaluation else FEATURES["label_smoothing"]
    ce, lse = reference_ce_features(flat, labels.reshape(-1), label_smoothing=smoothing, logit_softcap=5.0)
    capped = 5.0 * torch.tanh(flat / 5.0)
    _, ntl, is_number = naive_per_token(capped, labels.reshape(-1), vocab)
    z = FEATURES["z_loss_weight"] * lse**2
    return ce.view(shape), z.view(shape), ntl.view(shape), is_number.view(shape).double()


def _through_megatrons_schedule(plain, vocab, mixin_class) -> None:
    """4. Issue 51 through Megatron's own schedule (``get_forward_backward_func``, Megatron's DDP and
    ``finalize_model_grads``) on the three routes, with every CE feature on.

    (a) A loss mask of weights 0, 0.5 and 1.5 over a step of 3 micro-batches: Megatron divides each micro-batch's
    loss by its truncated mask sum (or, with ``--calculate-per-token-loss``, the step's gradients by the sum of
    those); the gradient is that of the float64 ``sum m CE / N + w sum m NTL / K`` (the CE term with the label
    smoothing and the z-loss), with and without per-token loss. (b) The reports of the same step: ``lm loss`` is
    the label-smoothed CE without the z-loss, ``z loss`` the z-loss. (c) Megatron's evaluation (``model.eval()``,
    no gradient, ``forward_only``): ``lm loss`` is the plain CE of the capped logits, no ``z loss``; the mixin's
    per-token loss holds the plain CE.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ntl_scale.integrations import megatron as ntl_megatron
    from ntl_scale.integrations.megatron import lm as megatron_lm
    from tests.helpers.megatron_cpu import tiny_gpt

    g = torch.Generator().manual_seed(23)
    step_tokens = torch.randint(0, len(TOKENS), (6, SEQ + 1), generator=g)
    digits = torch.randint(4, 14, (6, SEQ + 1), generator=g)
    step_tokens = torch.where(torch.rand(step_tokens.shape, generator=g) < 0.5, digits, step_tokens)
    labels = step_tokens[:, 1:].contiguous()
    weighted = torch.tensor([0.0, 0.5, 1.5])[torch.randint(0, 3, (6, SEQ), generator=g)]
    binary = (torch.rand(6, SEQ, generator=g) < 0.8).float()
    attention = torch.ones(1, 1, SEQ, SEQ).tril() < 0.5
    rows = [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert any(float(weighted[r].sum()) % 1 for r in rows)  # Megatron's truncated count is not the weight

    def inputs(r):
        tokens = step_tokens[r, :-1]
        return tokens, torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], SEQ), attention

    plain.zero_grad(set_to_none=True)
    logits = plain(*inputs(slice(None)))
    ce, z, ntl, is_number = _reference_terms(logits, labels, vocab)
    m = weighted.double()
    objective = ((ce + z) * m).sum() / m.sum() + WEIGHT * (ntl * is_number * m).sum() / (is_number * m).sum()
    objective.backward()
    want = _grads(plain)
    with torch.no_grad():
        ce, z, ntl, is_number = _reference_terms(plain(*inputs(slice(None))), labels, vocab)
        plain_ce, *_ = _reference_terms(plain(*inputs(slice(None))), labels, vocab, evaluation=True)
    settings = ntl_megatron.NTLSettings(weight=WEIGHT, normalization="global", **FEATURES)

    def pretrain_gpt_loss_func(loss_mask, output_tensor):  # pretrain_gpt.py's arithmetic
        losses, mask = output_tensor.view(-1).float(), loss_mask.view(-1).float()
        loss, num_tokens = torch.sum(losses * mask), mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    def run(route: str, mask: torch.Tensor, per_token: bool, evaluation: bool = False):
        """One step (or evaluation pass) of the route through the schedule: the reports and the main grads."""
        model = tiny_gpt(VOCAB, SEQ, tp=1, pp=1, model_class=mixin_class if route == "mixin" else None)
        model.load_state_dict(plain.state_dict())
        model.config.calculate_per_token_loss = per_token
        model.config.finalize_model_grads_func = finalize_model_grads
        ddp = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(), module=model)
        batches = [
            {"tokens": inputs(r)[0], "position_ids": inputs(r)[1], "attention_mask": attention, "labels": labels[r],
             "loss_mask": mask[r]}
            for r in rows
        ]  # fmt: skip
        if route == "megatron_core":

            def get_batch(iterator):
                b = next(iterator)
                return b["tokens"], b["labels"], b["loss_mask"], b["attention_mask"], b["position_ids"]

            forward_step = ntl_megatron.make_forward_step(
                settings, vocab, get_batch, tp_group=None, num_microbatches=3, calculate_per_token_loss=per_token
            )
        else:

            def forward_step(iterator, model):  # pretrain_gpt.py's: the model computes the per-token loss
                b = next(iterator)
                output = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"],
                               loss_mask=b["loss_mask"])  # fmt: skip
                return output, functools.partial(pretrain_gpt_loss_func, b["loss_mask"])

            if route == "megatron_lm":
                groups = megatron_lm.StepGroups(
                    tp_group=None, cp_group=None, count_group=None, dp_cp_size=1, reads_data=True, counts_data=True
                )
                forward_step = megatron_lm.NTLForwardStep(forward_step, settings, vocab, groups, 3, per_token)
            else:
                model.configure_ntl(settings, vocab, None)
                counts = ntl_megatron.GlobalCounts(vocab, None, settings.options())
                counts.set_step([(b["labels"], b["loss_mask"]) for b in batches])
                model.ntl_scale = megatron_lm.MicroBatchScale(
                    tokens=counts.tokens.float(), numbers=counts.numbers.float(), microbatches=3, dp_cp_size=1,
                    per_token_loss=per_token, divisor=counts.divisor,
                )  # fmt: skip
        ddp.zero_grad_buffer()
        if evaluation:
            ddp.eval()
        with torch.set_grad_enabled(not evaluation):
            reports = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp], num_microbatches=3,
                seq_length=SEQ, micro_batch_size=2, forward_only=evaluation,
            )  # fmt: skip
        grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
        total = {k: sum(r[k].double() for r in reports) for k in reports[0]}
        return total, grads, model

    for route in ("megatron_core", "megatron_lm", "mixin"):
        for per_token in (False, True):
            what = f"schedule {route} per_token_loss={per_token}"
            total, grads, _ = run(route, weighted, per_token)
            _close_grads(grads, want, what)  # (a)
            if route == "mixin":
                continue
            # (b) lm loss: the label-smoothed CE without the z-loss (megatron_core's count is the mask's weight,
            # pretrain_gpt.py's its truncated sum); z loss over the mask's weight
            torch.testing.assert_close(total["lm loss"][0], (ce * m).sum(), rtol=1e-5, atol=0, msg=what)
            z_mean = (z * m).sum() / m.sum()
            torch.testing.assert_close(total["z loss"][0] / total["z loss"][1], z_mean, rtol=1e-5, atol=0, msg=what)
        # (c) evaluation: the plain CE of the capped logits
        b = binary.double()
        total, _, model = run(route, binary, False, evaluation=True)
        if route == "mixin":  # its per-token loss is the micro-batch objective: the plain CE plus weight x NTL
            with torch.no_grad():
                model.eval()
                out = model(*inputs(rows[0]), labels=labels[rows[0]], loss_mask=binary[rows[0]]).double()
            b0, n0 = binary[rows[0]].double(), is_number[rows[0]] * binary[rows[0]].double()
            want_out = plain_ce[rows[0]] + WEIGHT * ntl[rows[0]] * b0.sum() / n0.sum()
            torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5, msg="mixin evaluation")
            continue
        torch.testing.assert_close(total["lm loss"][0] / total["lm loss"][1], (plain_ce * b).sum() / b.sum(),
                                   rtol=1e-5, atol=0, msg=f"evaluation {route}")  # fmt: skip
        assert "z loss" not in total, route


def test_every_setting_on_the_model_side_routes():
    run_workers(1, 1, _worker)
