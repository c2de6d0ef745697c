"""``apply_ntl_to_megatron_model`` on a megatron.core ``GPTModel`` (the wheel), one CPU process, against the
naive reference.

Sections:
1. The per-token loss keeps the value of Megatron's own CE; its gradient is the gradient of
   ``mean CE + 0.3 * mean NTL over number tokens`` computed the obvious way from the same model's
   logits (``tests/helpers/reference.py``), for the micro-batch mean and for global counts.
2. Non-finite logits reach Megatron's checks as a NaN loss instead of raising.
3. ``apply_ntl_to_megatron_model`` is idempotent and ``remove_ntl`` restores Megatron's loss bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import WorkerContext, run_workers, skip_if_missing

skip_if_missing("megatron.core")
pytestmark = pytest.mark.distributed

VOCAB, SEQ = 64, 8
TOKENS = ["<eod>", "a", "b", "."] + [str(d) for d in range(10)] + [f"w{i}" for i in range(36)]


def _batch():
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, len(TOKENS), (2, SEQ + 1), generator=g)
    digits = torch.randint(4, 14, (2, SEQ + 1), generator=g)
    tokens = torch.where(torch.rand(tokens.shape, generator=g) < 0.5, digits, tokens)
    mask = (torch.rand(2, SEQ, generator=g) < 0.8).float()
    inputs = (tokens[:, :-1], torch.arange(SEQ).unsqueeze(0).expand(2, SEQ), torch.ones(1, 1, SEQ, SEQ).tril() < 0.5)
    return inputs, tokens[:, 1:].contiguous(), mask


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(ctx: WorkerContext) -> None:
    from megatron.core import parallel_state

    import ntl_scale
    from ntl_scale.integrations.megatron import NTLSettings
    from ntl_scale.integrations.megatron import lm as megatron_lm
    from tests.helpers.megatron_cpu import patch_for_cpu, tiny_gpt
    from tests.helpers.reference import naive_per_token

    patch_for_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model = tiny_gpt(VOCAB, SEQ, tp=1, pp=1)
    vocab = ntl_scale.NumberVocab.from_id_to_token(TOKENS, vocab_size=VOCAB)
    inputs, labels, mask = _batch()
    plain_ce = model(*inputs, labels=labels, loss_mask=mask).detach()

    def reference_grads(ce_den: float, ntl_den: float, scale: float = 1.0):
        model.zero_grad(set_to_none=True)
        ce, ntl, is_number = naive_per_token(model(*inputs), labels, vocab)
        numbers = is_number.to(torch.float64) * mask
        total = scale * ((ce * mask).sum() / ce_den + 0.3 * (ntl * numbers).sum() / ntl_den)
        total.backward()
        return _grads(model), float(numbers.sum())

    def hooked_grads(micro_batches: int = 1):
        model.zero_grad(set_to_none=True)
        per_token = model(*inputs, labels=labels, loss_mask=mask)
        # Megatron's loss_func and schedule: sum over the mask, / num_tokens, / micro-batches.
        ((per_token * mask).sum() / mask.sum() / micro_batches).backward()
        return per_token.detach(), _grads(model)

    # 1. Micro-batch mean.
    hook = megatron_lm.apply_ntl_to_megatron_model(model, NTLSettings(weight=0.3), vocab, tp_group=None)
    assert megatron_lm.apply_ntl_to_megatron_model(model, NTLSettings(weight=0.3), vocab, tp_group=None) is hook
    per_token, got = hooked_grads()
    torch.testing.assert_close(per_token, plain_ce, atol=1e-6, rtol=1e-6)
    numbers = (vocab.number_mask(labels).float() * mask).sum()
    assert float(numbers) > 0
    want, _ = reference_grads(float(mask.sum()), float(numbers))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name].float(), atol=1e-6, rtol=1e-5, msg=name)
    stats = hook.pop_stats()
    assert stats is not None and float(stats.numbers) == float(numbers)

    # Global counts: this micro-batch is one of m = 2 of a step with T tokens and K number tokens.
    tokens_global, numbers_global = float(mask.sum()) * 3, float(numbers) * 2.5
    hook.scale = megatron_lm.MicroBatchScale(
        tokens=torch.tensor(tokens_global), numbers=torch.tensor(numbers_global), microbatches=2, dp_cp_size=1,
        per_token_loss=False,
    )  # fmt: skip
    _, got = hooked_grads(micro_batches=2)
    want, _ = reference_grads(tokens_global, numbers_global)
    for name in want:
        torch.testing.assert_close(got[name], want[name].float(), atol=1e-6, rtol=1e-5, msg=name)
    hook.scale = None

    # 2. NaN logits: a NaN loss for Megatron's validate_result, no exception from the op.
    with torch.no_grad():
        saved = model.output_layer.weight[5].clone()
        model.output_layer.weight[5] = float("nan")
    assert torch.isnan(model(*inputs, labels=labels, loss_mask=mask)).any()
    with torch.no_grad():
        model.output_layer.weight[5] = saved

    # 3. Removal restores Megatron's own loss exactly.
    assert megatron_lm.remove_ntl(model) and not megatron_lm.remove_ntl(model)
    assert "forward" not in model.__dict__ and "compute_language_model_loss" not in model.__dict__
    assert torch.equal(model(*inputs, labels=labels, loss_mask=mask).detach(), plain_ce)
    parallel_state.destroy_model_parallel()


def test_apply_ntl_against_the_naive_reference():
    run_workers(1, 1, _worker)
