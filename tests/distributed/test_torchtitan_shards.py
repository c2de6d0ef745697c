"""``NTLLoss`` on vocabulary shards at TP 2 over gloo: torchtitan's plain shards and DTensor ``Shard(-1)``.

One spawned job (2 ranks, one TP group) checks, with an uneven vocabulary (37 over 2: 19 + 18, the
split torchtitan's ``_LossParallelCrossEntropy`` uses and DTensor's):

1. plain local shards under torchtitan's ``spmd_types`` backend and a ``tp`` mesh
   (``set_current_spmd_mesh``), the group and offset found as torchtitan's CE finds them: loss and the
   shard's logit gradient equal the float64 full-logit reference; at weight 0 the loss and gradient are
   torchtitan's own vocab-parallel ``CrossEntropyLoss``'s on the same shards, bit for bit; inside torchtitan's
   ``ChunkedLossWrapper`` with a row-sharded ``lm_head`` the hidden-state and weight-shard gradients
   equal the reference's;
2. ``DTensor`` logits ``Shard(-1)`` (torchtitan's ``partial_dtensor`` backend): the same loss and
   gradient;
3. DTensor logits and labels (torchtitan's ``full_dtensor`` backend), split on the vocabulary or on the
   batch: the loss (a DTensor, as torchtitan's CE returns) and gradient;
4. errors naming the value and the fix: a DTensor sharded on another dimension, DTensor labels placed
   unlike the logits, a plain shard of the wrong width (a table for another vocabulary);
5. label smoothing and z-loss on, on each of the three shard forms: under no grad without
   ``global_valid_tokens`` (torchtitan's ``Validator``) the loss is the plain CE sum of the full logits
   (torch's ``F.cross_entropy`` in float64); in training the loss and gradient are the objective's, the
   logged ``ce_mean`` the smoothed CE without the z-loss and ``z_loss_mean`` the z-loss;
6. ``ce_kernel="framework"`` (torchtitan's CE reading NTL's passthrough), every variant without reweighing, on each
   of the three shard forms: loss, logit gradient and ``ntl_mean`` equal torchtitan's CE called alone on the same
   inputs plus the float64 reference NTL; inside ``ChunkedLossWrapper`` the loss and the hidden-state and
   weight-shard gradients equal the reference of section 1 to torchtitan's float32 rounding;
7. under torchtitan's strict SPMD type checking both kernels run on plain shards and give that loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import reference
from tests.helpers.distributed import WorkerContext, run_workers

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 (scripts/setup.sh --dev)")

pytestmark = pytest.mark.distributed

V, WEIGHT = 37, 0.3
SMOOTHING, Z_LOSS = 0.1, 1e-2


def _table(path: str):  # type: ignore[no-untyped-def]
    from ntl_scale import NumberVocab

    NumberVocab(list(range(3, 13)), list(range(10)), V, tokens=[str(d) for d in range(10)]).save(path)
    return path


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 8, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(V, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (2, 8), generator=g)
    labels[:, ::2] = torch.randint(3, 13, (2, 4), generator=g)
    labels[1, 3] = -100
    logits = hidden @ weight.T
    return hidden, weight, logits, labels


def _reference(hidden, weight, labels, vocab):  # type: ignore[no-untyped-def]
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    z = h @ w.T
    z.retain_grad()
    ce, ntl, mask = reference.naive_per_token(z, labels, vocab)
    loss = ce.sum() / (labels != -100).sum() + WEIGHT * ntl.sum() / mask.sum()
    loss.backward()
    return loss.detach(), z.grad, h.grad, w.grad, mask.sum()


def _check(ctx: WorkerContext, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    from ntl_scale.integrations.torchtitan import NTLLoss

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    start, end = (0, 19) if ctx.tp_rank == 0 else (19, V)
    hidden, weight, logits, labels = _inputs()
    tokens = (labels != -100).sum()
    config = NTLLoss.Config(number_vocab=path, vocab_size=V, weight=WEIGHT)
    loss_fn = config.build()
    expected, z_grad, h_grad, w_grad, numbers = _reference(hidden, weight, labels, loss_fn.vocab)
    loss_fn.begin_step(numbers)

    # 1. plain shards under spmd_types
    set_spmd_backend("spmd_types")
    with set_current_spmd_mesh(mesh):
        shard = logits[..., start:end].clone().requires_grad_(True)
        loss, _ = loss_fn(shard, labels, tokens)
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(shard.grad, z_grad[..., start:end], rtol=1e-10, atol=1e-12)

        zero = NTLLoss.Config(number_vocab=path, vocab_size=V, weight=0.0).build()
        zero.begin_step(numbers)
        theirs = CrossEntropyLoss.Config(global_vocab_size=V).build()
        ours32, theirs32 = (logits[..., start:end].float().requires_grad_(True) for _ in range(2))
        ours_loss, theirs_loss = zero(ours32, labels, tokens)[0], theirs(theirs32, labels, tokens)[0]
        (ours_loss + theirs_loss).backward()
        assert torch.equal(ours_loss, theirs_loss) and torch.equal(ours32.grad, theirs32.grad)  # bit for bit

        loss, h_got, w_got = _wrapped(ctx, config, weight[start:end], hidden, numbers, labels, tokens)
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h_got, h_grad, rtol=1e-6, atol=1e-7)  # accumulated in float32 by torchtitan
        torch.testing.assert_close(w_got, w_grad[start:end], rtol=1e-10, atol=1e-12)

        with pytest.raises(ValueError, match=r"logits have 17 vocabulary columns.*shard of 1[89]"):
            loss_fn(logits[..., :17], labels, tokens)  # neither shard's width: refused before any collective

    # 2. DTensor Shard(-1) under partial_dtensor
    set_spmd_backend("partial_dtensor")
    local = logits[..., start:end].clone().requires_grad_(True)
    dlogits = DTensor.from_local(
        local, mesh, [Shard(2)], run_check=False, shape=logits.shape, stride=logits.stride()
    )  # uneven: 19 + 18
    loss, _ = loss_fn(dlogits, labels, tokens)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(local.grad, z_grad[..., start:end], rtol=1e-10, atol=1e-12)

    # 3. full_dtensor: DTensor logits and labels on one mesh, split on the vocabulary (19 + 18) or the batch
    for placements, label_placements in (([Shard(2)], [Replicate()]), ([Shard(0)], [Shard(0)])):
        dpred = distribute_tensor(logits.clone(), mesh, placements).detach().requires_grad_(True)
        loss, _ = loss_fn(dpred, distribute_tensor(labels, mesh, label_placements), tokens)
        assert isinstance(loss, DTensor)  # as torchtitan's CE: Partial over a batch split
        loss.backward()
        torch.testing.assert_close(loss.full_tensor(), expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dpred.grad.full_tensor(), z_grad, rtol=1e-10, atol=1e-12)

    # 4. errors: a DTensor sharded on the batch with plain labels; DTensor labels placed unlike the logits
    by_batch = DTensor.from_local(logits[ctx.tp_rank : ctx.tp_rank + 1], mesh, [Shard(0)], run_check=False)
    with pytest.raises(ValueError, match=r"Shard\(dim=0\).*another dimension than the vocabulary"):
        loss_fn(by_batch, labels, tokens)
    with pytest.raises(ValueError, match=r"need labels placed \(Shard\(dim=0\),\).*got \(Replicate\(\),\)"):
        loss_fn(by_batch, distribute_tensor(labels, mesh, [Replicate()]), tokens)

    # 5. label smoothing and z-loss: the validator's plain CE; training's objective, smoothed ce and z_loss
    _features(ctx, mesh, path, logits, labels, (start, end))

    # 6. ce_kernel="framework": torchtitan's CE through NTL's passthrough, every variant, each shard form
    _framework(ctx, mesh, path, logits, labels, (start, end))
    set_spmd_backend("spmd_types")
    with set_current_spmd_mesh(mesh):  # inside ChunkedLossWrapper: the fused op's gradients, to float32 rounding
        framework = NTLLoss.Config(number_vocab=path, vocab_size=V, weight=WEIGHT, ce_kernel="framework")
        loss, h_got, w_got = _wrapped(ctx, framework, weight[start:end], hidden, numbers, labels, tokens)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(h_got, h_grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w_got, w_grad[start:end], rtol=1e-5, atol=1e-6)

    # 7. strict SPMD type checking: both kernels on plain shards
    _typechecked(path, logits, labels, (start, end), expected)


def _wrapped(ctx: WorkerContext, config, rows, hidden, numbers, labels, tokens):  # type: ignore[no-untyped-def]
    """torchtitan's ``ChunkedLossWrapper`` (4 chunks) around ``config`` on a plain head of this rank's weight
    ``rows``: the loss and the gradients of the hidden states (summed over the shards, as a TP lm_head's
    backward does; this plain Linear does not) and of the rows."""
    from torchtitan.components.loss import ChunkedLossWrapper

    wrapper = ChunkedLossWrapper.Config(num_chunks=4, loss_fn=config).build()
    head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False).double()
    with torch.no_grad():
        head.weight.copy_(rows)
    wrapper.set_lm_head(head)
    wrapper.loss_fn.begin_step(numbers)
    h = hidden.clone().requires_grad_(True)
    loss, _ = wrapper(h, labels, tokens)
    loss.backward()
    torch.distributed.all_reduce(h.grad, group=ctx.tp_group)
    return loss, h.grad, head.weight.grad


def _features(ctx: WorkerContext, mesh, path: str, logits, labels, columns) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    from ntl_scale.integrations.torchtitan import NTLLoss

    start, end = columns
    tokens = (labels != -100).sum()
    flat, targets = logits.reshape(-1, V), labels.reshape(-1)
    plain = F.cross_entropy(flat, targets, reduction="sum")  # the held-out CE sum, from torch's definition
    z = logits.clone().requires_grad_(True)
    zf = z.reshape(-1, V)
    ce = F.cross_entropy(zf, targets, label_smoothing=SMOOTHING, reduction="sum") / tokens
    z_loss = Z_LOSS * torch.logsumexp(zf, -1)[targets != -100].square().sum() / tokens
    features = {"label_smoothing": SMOOTHING, "z_loss_weight": Z_LOSS}
    loss_fn = NTLLoss.Config(number_vocab=path, vocab_size=V, weight=WEIGHT, **features).build()
    _, ntl, mask = reference.naive_per_token(z, labels, loss_fn.vocab)
    expected = ce + z_loss + WEIGHT * ntl.sum() / mask.sum()
    expected.backward()

    def shard_forms():  # type: ignore[no-untyped-def]
        """(name, logits as the loss gets them, labels, the local leaf) for each of the three forms."""
        set_spmd_backend("spmd_types")
        with set_current_spmd_mesh(mesh):
            local = logits[..., start:end].clone().requires_grad_(True)
            yield "plain shard", local, labels, local
        set_spmd_backend("partial_dtensor")
        local = logits[..., start:end].clone().requires_grad_(True)
        dlogits = DTensor.from_local(
            local, mesh, [Shard(2)], run_check=False, shape=logits.shape, stride=logits.stride()
        )
        yield "Shard(-1)", dlogits, labels, local
        for placements, label_placements in (([Shard(2)], [Replicate()]), ([Shard(0)], [Shard(0)])):
            dpred = distribute_tensor(logits.clone(), mesh, placements).detach().requires_grad_(True)
            yield f"full_dtensor {placements}", dpred, distribute_tensor(labels, mesh, label_placements), dpred

    for name, pred, targets_form, leaf in shard_forms():
        with torch.no_grad():  # torchtitan's Validator: no grad, no global_valid_tokens
            held_out, metrics = loss_fn(pred, targets_form)
        held_out = held_out.full_tensor() if isinstance(held_out, DTensor) else held_out
        torch.testing.assert_close(held_out, plain, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        assert metrics == {}
        loss_fn.begin_step(mask.sum())
        loss, metrics = loss_fn(pred, targets_form, tokens)
        loss.backward()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        grad = leaf.grad.full_tensor() if isinstance(leaf.grad, DTensor) else leaf.grad
        want = z.grad if grad.shape == z.grad.shape else z.grad[..., start:end]
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        # the metrics are this rank's parts (a batch split: the two ranks' parts add up)
        parts = torch.stack([metrics["loss_metrics/ce_mean"], metrics["loss_metrics/z_loss_mean"]])
        if "Shard(dim=0)" in name:
            torch.distributed.all_reduce(parts, group=ctx.tp_group)
        torch.testing.assert_close(parts[0], ce.detach(), rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(parts[1], z_loss.detach(), rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


VARIANTS = [{}, {"loss": "mse"}, {"loss": "mae"}, {"loss": "huber", "huber_delta": 0.5},
            {"loss": "was", "squash_factor": 4.0}, {"loss": "number"}]  # fmt: skip


def _framework(ctx: WorkerContext, mesh, path: str, logits, labels, columns) -> None:  # type: ignore[no-untyped-def]
    """``ce_kernel="framework"`` on each shard form: torchtitan's own CE on the same inputs, called alone, plus the
    float64 reference NTL (loss, logit gradient, logged ``ntl_mean``), every variant without reweighing."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    from ntl_scale.integrations.torchtitan import NTLLoss

    start, end = columns
    tokens = (labels != -100).sum()

    def forms():  # type: ignore[no-untyped-def]
        """(name, the logits as the loss gets them, the labels, the leaf) for torchtitan's vocabulary splits."""
        set_spmd_backend("spmd_types")
        with set_current_spmd_mesh(mesh):
            local = logits[..., start:end].clone().requires_grad_(True)
            yield "plain shard", local, labels, local
        set_spmd_backend("partial_dtensor")
        local = logits[..., start:end].clone().requires_grad_(True)
        yield "Shard(-1)", DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=logits.shape,
                                              stride=logits.stride()), labels, local  # fmt: skip
        for placements, label_placements in (([Shard(2)], [Replicate()]), ([Shard(0)], [Shard(0)])):
            dpred = distribute_tensor(logits.clone(), mesh, placements).detach().requires_grad_(True)
            yield f"full_dtensor {placements}", dpred, distribute_tensor(labels, mesh, label_placements), dpred

    def full(t):  # type: ignore[no-untyped-def]
        return t.full_tensor() if isinstance(t, DTensor) else t

    for variant in VARIANTS:
        loss_fn = NTLLoss.Config(number_vocab=path, vocab_size=V, weight=WEIGHT, ce_kernel="framework", **variant)
        loss_fn = loss_fn.build()
        z = logits.clone().requires_grad_(True)
        _, ntl, mask = reference.naive_per_token(z, labels, loss_fn.vocab, **variant)
        ntl_part = WEIGHT * ntl.sum() / mask.sum()
        ntl_part.backward()
        loss_fn.begin_step(mask.sum())
        titan = CrossEntropyLoss.Config(global_vocab_size=V).build()
        for (name, pred, targets, leaf), (_, alone, _, alone_leaf) in zip(forms(), forms()):
            what = f"framework {variant} {name} rank {ctx.rank}"
            loss, metrics = loss_fn(pred, targets, tokens)
            loss.backward()
            ce = titan(alone, targets, tokens)[0]  # torchtitan's CE alone: float32, as it computes
            ce.backward()
            if "Shard(dim=0)" in name:  # the ranks' float32 parts, added in float64 as the objective adds them
                ce = ce.to_local().double()
                torch.distributed.all_reduce(ce, group=ctx.tp_group)
            want = full(ce) + ntl_part.detach()
            torch.testing.assert_close(full(loss), want, rtol=1e-12, atol=1e-12, msg=what)
            grad = full(alone_leaf.grad) + (z.grad if isinstance(leaf, DTensor) else z.grad[..., start:end])
            torch.testing.assert_close(full(leaf.grad), grad, rtol=1e-12, atol=1e-12, msg=what)
            ntl_mean = metrics["loss_metrics/ntl_mean"].clone()
            if "Shard(dim=0)" in name:  # a batch split: this rank's part
                torch.distributed.all_reduce(ntl_mean, group=ctx.tp_group)
            torch.testing.assert_close(ntl_mean, ntl_part.detach() / WEIGHT, msg=what)


def _typechecked(path: str, logits, labels, columns, expected) -> None:  # type: ignore[no-untyped-def]
    """Plain shards under torchtitan's strict SPMD type checking (``--debug.spmd_typechecking``), both CE kernels:
    the passthrough carries the logits' SPMD type into torchtitan's CE; the loss is the unchecked run's."""
    import spmd_types as spmd
    from spmd_types.checker import typecheck
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    from ntl_scale.integrations.torchtitan import NTLLoss

    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp", "cp", "tp"))
    dp, cp, tp = (mesh.get_group(axis) for axis in ("dp", "cp", "tp"))
    set_spmd_backend("spmd_types")
    for kernel in ("ntl_scale", "framework"):
        loss_fn = NTLLoss.Config(number_vocab=path, vocab_size=V, weight=WEIGHT, ce_kernel=kernel).build()
        loss_fn.begin_step((labels[..., None] == torch.arange(3, 13)).sum())
        shard, targets, tokens = logits[..., columns[0] : columns[1]].clone(), labels.clone(), (labels != -100).sum()
        spmd.assert_type(shard.requires_grad_(True), {dp: spmd.V, cp: spmd.V, tp: spmd.S(2)})
        spmd.assert_type(targets, {dp: spmd.V, cp: spmd.V, tp: spmd.I})
        spmd.assert_type(tokens, {tp: spmd.I})
        with set_current_spmd_mesh(mesh), typecheck(local=False):
            loss, _ = loss_fn(shard, targets, tokens)
            loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7, msg=kernel)


def test_plain_and_dtensor_vocabulary_shards(tmp_path) -> None:
    run_workers(2, 2, _check, _table(str(tmp_path / "numbers.json")))
