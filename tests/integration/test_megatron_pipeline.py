"""NTL through Megatron's real pipeline schedules on CPU (gloo), with a tiny GPTModel.

Sections:
1. Reference run, TP = 1, PP = 1 (one process): ``--ntl-weight 0`` through ``make_forward_step``
   equals the plain Megatron loss path exactly; the global normalisation gives the same gradients
   for micro-batch splits 1 x 8, 2 x 4 and 4 x 2 sequences.
2. TP = 2 and TP = 2 x PP = 2 runs load the reference weights (sliced by each parameter's partition dimension)
   and must reproduce the reference losses and gradients within 1e-5. TP = 2 x PP = 2 takes the pipeline
   schedule and a last stage whose tensor-parallel group is global ranks 2 and 3 (group ranks and the global
   count's guard differ from the world's there); PP = 2 alone takes no path it does not.
3. The mixin's chunked loss (no logits) equals the same model computing logits at TP = 2 (in the TP = 2
   processes of section 2, after its check), for NTL off, micro-batch and global normalisation (the step's
   ``MicroBatchScale`` set on both models).
4. Context parallelism (in the same TP = 2 processes, re-initialised at CP = 2): the ``megatron.core`` routes
   read the context-parallel size from ``parallel_state`` (a contradicting argument is refused).
5. ``ce_kernel="framework"`` (same processes): Megatron's own CE (plain, fused native) with NTL beside it equals
   ntl_scale's fused op through ``make_loss_func`` and the mixin.

megatron.core is imported by the spawned workers only, never by the collecting process (about 6 CPU-s).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.distributed import WorkerContext, run_workers, skip_if_missing

skip_if_missing("megatron.core")
pytestmark = pytest.mark.distributed

VOCAB, SEQ, SEQUENCES = 64, 8, 8
TOKENS = ["<eod>", "a", "b", "."] + [str(d) for d in range(10)] + [f"w{i}" for i in range(36)]  # 50 tokens
VARIANTS = {
    "off": dict(weight=0.0),
    "micro-batch": dict(weight=0.3, loss="was", normalization="micro-batch"),
    "global": dict(weight=0.3, loss="mse", reweigh=True, normalization="global"),
}


def _data():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, len(TOKENS), (SEQUENCES, SEQ + 1), generator=g)
    digits = torch.randint(4, 14, (SEQUENCES, SEQ + 1), generator=g)
    tokens = torch.where(torch.rand(tokens.shape, generator=g) < 0.5, digits, tokens)
    loss_mask = (tokens[:, 1:] != 0).float()
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), loss_mask


def _get_batch_factory(micro_batches: int):
    tokens, labels, loss_mask = _data()
    size = SEQUENCES // micro_batches
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(size, SEQ)
    attention_mask = torch.ones(1, 1, SEQ, SEQ).tril() < 0.5

    def get_batch(iterator):
        i = next(iterator)
        rows = slice(i * size, (i + 1) * size)
        return tokens[rows], labels[rows], loss_mask[rows], attention_mask, position_ids

    return get_batch, size


def _run(model, variant: str, micro_batches: int, tp_group, count_group, vocab):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ntl_scale.integrations import megatron as ntl_megatron

    settings = ntl_megatron.NTLSettings(**VARIANTS[variant])
    get_batch, size = _get_batch_factory(micro_batches)
    forward_step = ntl_megatron.make_forward_step(
        settings, vocab, get_batch, tp_group=tp_group, count_group=count_group, num_microbatches=micro_batches
    )
    model.zero_grad(set_to_none=True)
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(range(micro_batches)),
        model=[model],
        num_microbatches=micro_batches,
        seq_length=SEQ,
        micro_batch_size=size,
        forward_only=False,
    )
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return reports, grads


def _global_name(model, name: str) -> str:
    """Local parameter name -> the TP1/PP1 model's name (layer indices are global there)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = model.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
    return ".".join(parts)


def _local_slice(param, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    if getattr(param, "tensor_model_parallel", False):
        return torch.chunk(full, tp_size, dim=param.partition_dim)[tp_rank]
    return full


def _setup(tp: int, pp: int):
    from megatron.core import parallel_state

    from tests.helpers.megatron_cpu import patch_for_cpu, tiny_gpt

    patch_for_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = tiny_gpt(VOCAB, SEQ, tp=tp, pp=pp)
    return parallel_state, model


def _reference_worker(ctx: WorkerContext, out_path: str) -> None:
    import ntl_scale
    from ntl_scale.integrations import megatron as ntl_megatron

    parallel_state, model = _setup(1, 1)
    vocab = ntl_scale.NumberVocab.from_id_to_token(TOKENS, vocab_size=VOCAB)
    results = {"state": {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None}}
    for variant in VARIANTS:
        results[variant] = _run(model, variant, 4, None, None, vocab)

    # --ntl-weight 0 is the plain Megatron path: the model's own loss, Megatron-LM's loss_func.
    tokens, labels, loss_mask = _data()
    plain = []
    for i in range(4):
        rows = slice(2 * i, 2 * i + 2)
        per_token = model(
            tokens[rows],
            torch.arange(SEQ).unsqueeze(0).expand(2, SEQ),
            torch.ones(1, 1, SEQ, SEQ).tril() < 0.5,
            labels=labels[rows],
        )
        plain.append(ntl_megatron.plain_loss_func(loss_mask[rows], per_token)[2]["lm loss"])
    assert all(torch.equal(a["lm loss"], b) for a, b in zip(results["off"][0], plain))

    # The model-side route (for multi-token-prediction heads): the mixin's per-token loss averages to
    # mean CE + 0.3 * mean NTL over number tokens, as ce_with_ntl computes from the model's logits.
    from megatron.core.models.gpt import GPTModel

    from tests.helpers.megatron_cpu import tiny_gpt

    class NTLGPTModel(ntl_megatron.NTLLanguageModelMixin, GPTModel):
        pass

    hooked = tiny_gpt(VOCAB, SEQ, tp=1, pp=1, model_class=NTLGPTModel)
    hooked.load_state_dict(model.state_dict())
    hooked.configure_ntl(ntl_megatron.NTLSettings(weight=0.3), vocab, None)
    inputs = (tokens[:2], torch.arange(SEQ).unsqueeze(0).expand(2, SEQ), torch.ones(1, 1, SEQ, SEQ).tril() < 0.5)
    per_token = hooked(*inputs, labels=labels[:2])
    want = ntl_scale.ce_with_ntl(model(*inputs), labels[:2], vocab, ntl_weight=0.3)
    assert float(want.num_number_tokens) > 0
    torch.testing.assert_close(per_token.mean(), want.loss, atol=1e-6, rtol=1e-6)

    # Global normalisation: the micro-batch split does not change the gradient.
    for micro_batches in (1, 2):
        _, grads = _run(model, "global", micro_batches, None, None, vocab)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, results["global"][1][name], atol=1e-6, rtol=1e-5, msg=name)
    assert float(results["micro-batch"][0][0]["ntl loss"][1]) > 0  # number tokens were present
    torch.save(results, out_path)
    parallel_state.destroy_model_parallel()


def _parallel_worker(ctx: WorkerContext, tp: int, pp: int, ref_path: str) -> None:
    import ntl_scale

    reference = torch.load(ref_path, weights_only=False)
    parallel_state, model = _setup(tp, pp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = reference["state"][_global_name(model, name)]
            param.copy_(_local_slice(param, full, tp_rank, tp))
    vocab = ntl_scale.NumberVocab.from_id_to_token(TOKENS, vocab_size=VOCAB)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    last_stage = parallel_state.is_pipeline_last_stage()
    for variant in VARIANTS:
        reports, grads = _run(model, variant, 4, tp_group, dp_group, vocab)
        ref_reports, ref_grads = reference[variant]
        if last_stage:
            for got, want in zip(reports, ref_reports):
                for key in want:
                    torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5, msg=f"{variant} {key}")
        else:
            assert reports == []
        for name, param in model.named_parameters():
            want = _local_slice(param, ref_grads[_global_name(model, name)], tp_rank, tp)
            torch.testing.assert_close(grads[name], want, atol=1e-5, rtol=1e-4, msg=f"{variant} {name}")
    parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def reference_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("megatron") / "reference.pt")
    run_workers(1, 1, _reference_worker, path)
    assert os.path.isfile(path)
    return path


def test_tensor_x_pipeline_parallel_matches_the_reference(reference_path):
    """Section 2 at TP = 2 x PP = 2 (TP = 2 alone: the next test)."""
    run_workers(4, 4, _parallel_worker, 2, 2, reference_path)


def _chunked_worker(ctx: WorkerContext) -> None:
    """The mixin with chunked=True (no logits) against the same model computing logits, at TP=2."""
    from megatron.core.models.gpt import GPTModel

    import ntl_scale
    from ntl_scale.integrations import megatron as ntl_megatron
    from ntl_scale.integrations.megatron.lm import MicroBatchScale
    from tests.helpers.megatron_cpu import tiny_gpt

    class NTLGPTModel(ntl_megatron.NTLLanguageModelMixin, GPTModel):
        pass

    parallel_state, _ = _setup(2, 1)
    vocab = ntl_scale.NumberVocab.from_id_to_token(TOKENS, vocab_size=VOCAB)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    logits_model = tiny_gpt(VOCAB, SEQ, tp=2, pp=1, model_class=NTLGPTModel)
    chunked_model = tiny_gpt(VOCAB, SEQ, tp=2, pp=1, model_class=NTLGPTModel)
    chunked_model.load_state_dict(logits_model.state_dict())
    tokens, labels, _ = _data()
    inputs = (tokens, torch.arange(SEQ).unsqueeze(0).expand(SEQUENCES, SEQ), torch.ones(1, 1, SEQ, SEQ).tril() < 0.5)
    for variant in ("off", "micro-batch", "global"):
        settings = ntl_megatron.NTLSettings(**VARIANTS[variant])
        logits_model.configure_ntl(settings, vocab, tp_group)
        chunked_model.configure_ntl(settings, vocab, tp_group, chunked=True, chunk_tokens=5)
        if variant == "global":  # the step's counts, as the forward-step routes set them (issue 41 item 2)
            with pytest.raises(RuntimeError, match="needs the step's global counts"):
                chunked_model(*inputs, labels=labels)
            counts = ntl_megatron.GlobalCounts(vocab, None, settings.options())
            counts.set_step([(labels, torch.ones(labels.shape))])
            scale = MicroBatchScale(counts.tokens.float(), counts.numbers.float(), 2, 1, False)
            logits_model.ntl_scale = chunked_model.ntl_scale = scale
        for model in (logits_model, chunked_model):
            model.zero_grad(set_to_none=True)
            model(*inputs, labels=labels).mean().backward()
        want = logits_model(*inputs, labels=labels)
        got = chunked_model(*inputs, labels=labels)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{variant} per-token loss")
        grads = dict(logits_model.named_parameters())
        for name, param in chunked_model.named_parameters():
            torch.testing.assert_close(param.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=f"{variant} {name}")
        # without labels the chunked model still returns the logits
        torch.testing.assert_close(chunked_model(*inputs), logits_model(*inputs), atol=0, rtol=0)
    parallel_state.destroy_model_parallel()


def _context_parallel_worker(ctx: WorkerContext) -> None:
    """Section 4: the ``megatron.core`` routes read the context-parallel size from ``parallel_state`` (issue 51).

    ``make_loss_func``, ``GlobalCounts`` and ``make_forward_step`` defaulted ``context_parallel_size`` to 1, so a
    caller under context parallelism who left it out joined number-level NTL's numbers across the slice seam.
    With ``parallel_state`` at CP = 2 and the argument left out, rank 0's local sequence ``5 6 | 7 8`` (global
    slices 0 and 3) holds two numbers; an argument that contradicts ``parallel_state`` is refused, and so is
    leaving it out in several processes without ``parallel_state`` (nothing can tell the size then).
    """
    from megatron.core import parallel_state

    import ntl_scale
    from ntl_scale.integrations import megatron as ntl_megatron
    from tests.helpers.megatron_cpu import patch_for_cpu

    patch_for_cpu()
    vocab = ntl_scale.NumberVocab.from_id_to_token(TOKENS, vocab_size=VOCAB)
    number = ntl_megatron.NTLSettings(weight=0.3, loss="number")
    digit = {d: TOKENS.index(str(d)) for d in range(10)}
    local = torch.tensor([[digit[5], digit[6], digit[7], digit[8]]])  # rank 0: slices 0 and 3 of "5 6 a a a a 7 8"
    mask = torch.ones(local.shape)
    logits = torch.randn(1, 4, VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert not parallel_state.model_parallel_is_initialized()
    with pytest.raises(ValueError, match=r"make_loss_func needs context_parallel_size="):
        ntl_megatron.make_loss_func(number, vocab, tp_group=None)
    with pytest.raises(ValueError, match=r"make_loss_func needs data_parallel_size="):
        ntl_megatron.make_loss_func(
            ntl_megatron.NTLSettings(weight=0.3, normalization="global"), vocab, tp_group=None,
            global_counts=ntl_megatron.GlobalCounts(vocab),
        )  # fmt: skip
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    assert parallel_state.get_context_parallel_world_size() == 2
    _, _, report = ntl_megatron.make_loss_func(number, vocab, tp_group=None)(local, mask, logits.clone())
    assert float(report["ntl loss"][1]) == 2  # 5 6 and 7 8: cut at the seam (joined, one number: 1)
    counts = ntl_megatron.GlobalCounts(vocab, None, number.options())
    counts.set_step([(local, mask)])
    assert float(counts.numbers) == 2
    with pytest.raises(ValueError, match=r"make_loss_func\(context_parallel_size=1\) contradicts megatron.core."):
        ntl_megatron.make_loss_func(number, vocab, tp_group=None, context_parallel_size=1)
    with pytest.raises(ValueError, match=r"make_loss_func\(data_parallel_size=1\) contradicts"):
        ntl_megatron.make_loss_func(number, vocab, tp_group=None, data_parallel_size=1)
    parallel_state.destroy_model_parallel()


def _framework_worker(ctx: WorkerContext) -> None:
    """Section 5: ``ce_kernel="framework"`` keeps Megatron's CE (plain, and fused ``native``), NTL beside it: at
    TP = 2 ``make_loss_func``'s loss, report and logits gradient equal the fused op's (1e-5; the native kernel's
    CE gradient to its bfloat16 rounding); the mixin with Megatron's plain CE equals the mixin on ntl_scale's op,
    per token and in every parameter's gradient."""
    import dataclasses

    from megatron.core.models.gpt import GPTModel

    import ntl_scale
    from ntl_scale.integrations import megatron as ntl_megatron
    from tests.helpers.megatron_cpu import tiny_gpt

    class NTLGPTModel(ntl_megatron.NTLLanguageModelMixin, GPTModel):
        pass

    parallel_state, _ = _setup(2, 1)
    vocab = ntl_scale.NumberVocab.from_id_to_token(TOKENS, vocab_size=VOCAB)
    tp_group, rank = parallel_state.get_tensor_model_parallel_group(), ctx.rank
    tokens, labels, _ = _data()
    g = torch.Generator().manual_seed(11)
    full = torch.randn(SEQUENCES, SEQ, VOCAB, generator=g) * 3
    shard = full[..., rank * VOCAB // 2 : (rank + 1) * VOCAB // 2].contiguous()
    mask = (torch.rand(SEQUENCES, SEQ, generator=g) > 0.2).float()
    for loss, impl in (("was", None), ("mse", "native")):
        runs = {}
        for kernel, weight in (("ntl_scale", 0.3), ("framework", 0.3), ("ntl_scale", 0.0)):
            settings = ntl_megatron.NTLSettings(weight=weight, loss=loss, ce_kernel=kernel)
            func = ntl_megatron.make_loss_func(settings, vocab, tp_group=tp_group, data_parallel_size=1,
                                               context_parallel_size=1, cross_entropy_fusion_impl=impl)  # fmt: skip
            logits = shard.clone().requires_grad_()
            value, _, report = func(labels, mask, logits)
            value.backward()
            runs[kernel, weight] = value, report, logits.grad
        (want, want_report, want_grad), (got, got_report, got_grad) = runs["ntl_scale", 0.3], runs["framework", 0.3]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if impl == "native":  # Megatron's fused CE returns its logits gradient in bfloat16 (calculate_gradients)
            ce_grad = runs["ntl_scale", 0.0][2]  # the CE part of the gradient; the NTL part stays float32
            assert ((got_grad - want_grad).abs() <= 2**-8 * ce_grad.abs() + 1e-6).all()
        else:
            torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=1e-5)
        for key in ("lm loss", "ntl loss"):
            torch.testing.assert_close(got_report[key], want_report[key], atol=1e-5, rtol=1e-5)
        assert "number accuracy" not in got_report and "number accuracy" in want_report
        choice = got_report["number choice accuracy"]  # the arg-max among the number columns, from the full logits
        number_ids = vocab.ids.clone()
        picked = number_ids[full[..., number_ids].argmax(-1)]
        numbers = torch.isin(labels, number_ids).float() * mask
        torch.testing.assert_close(choice, torch.stack([((picked == labels) * numbers).sum(), numbers.sum()]))
    inputs = (tokens, torch.arange(SEQ).unsqueeze(0).expand(SEQUENCES, SEQ), torch.ones(1, 1, SEQ, SEQ).tril() < 0.5)
    ours = tiny_gpt(VOCAB, SEQ, tp=2, pp=1, model_class=NTLGPTModel)
    theirs = tiny_gpt(VOCAB, SEQ, tp=2, pp=1, model_class=NTLGPTModel)
    theirs.load_state_dict(ours.state_dict())
    assert not theirs.config.cross_entropy_loss_fusion  # Megatron's plain vocab_parallel_cross_entropy
    settings = ntl_megatron.NTLSettings(weight=0.3, loss="was")
    ours.configure_ntl(settings, vocab, tp_group)
    theirs.configure_ntl(dataclasses.replace(settings, ce_kernel="framework"), vocab, tp_group)
    per_token = []
    for model in (ours, theirs):
        model.zero_grad(set_to_none=True)
        out = model(*inputs, labels=labels)
        out.mean().backward()
        per_token.append(out.detach())
    torch.testing.assert_close(per_token[1], per_token[0], atol=1e-5, rtol=1e-5)
    grads = dict(ours.named_parameters())
    for name, param in theirs.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, atol=1e-6, rtol=1e-4, msg=name)
    parallel_state.destroy_model_parallel()


def _tp2_worker(ctx: WorkerContext, ref_path: str) -> None:
    _parallel_worker(ctx, 2, 1, ref_path)
    _chunked_worker(ctx)
    _context_parallel_worker(ctx)
    _framework_worker(ctx)


def test_tp2_matches_the_reference_and_the_chunked_loss_without_logits_matches(reference_path):
    """Sections 2 (the TP = 2 layout), 3, 4 and 5 in one pair of processes."""
    run_workers(2, 2, _tp2_worker, reference_path)
