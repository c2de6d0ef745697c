"""DTensor inputs to the losses (issue 31, item 4), on real gloo process groups over a CPU DeviceMesh.

One launch of 2 processes runs every section (torch 2.13's DTensor and ``loss_parallel`` work on CPU):

1. Logits ``Shard(-1)`` of an uneven vocabulary (13 columns: DTensor gives 7 and 6, a number table
   across the border): per-token CE, NTL, the mask and the logits' gradient (through the DTensor) of
   ``vocab_parallel_ce_ntl`` for every NTL variant equal the naive float64 full-logit reference
   (1e-12) and, bitwise, the plain local shard with ``tp_group`` and the offset ``torch.chunk`` gives;
   ``ce_with_ntl``'s means equal the reference's; on a 2-D mesh ``(1, 2)`` with ``[Replicate(),
   Shard(-1)]`` the same bits; replicated logits are the full logits.
2. CE alone equals torch's own vocab-parallel CE, ``loss_parallel()`` + ``F.cross_entropy`` on the same
   DTensor logits, loss and gradient.
3. ``linear_ce_with_ntl`` with a ``Shard(0)`` weight DTensor (uneven rows) and a replicated DTensor
   hidden, and ``linear_ce_ntl`` on the weight's local rows with ``tp_group``: loss, weight gradient and
   hidden gradient (summed over the group) equal the float64 reference on ``hidden @ W.T``, for every
   variant; a plain hidden beside the ``Shard(0)`` weight is refused (nothing says the ranks share the
   tokens). An FSDP2 (``fully_shard``) weight outside its module's forward, each rank its own tokens:
   refused, and the gather the message names gives each rank its float64 one-process loss and the
   weight the ranks' mean gradient. An output layer split by torch's own
   ``parallelize_module(..., ColwiseParallel(use_local_output=False))`` feeding ``ce_with_ntl``: the same.
4. NTL alone beside a partner CE on the same DTensors: torch's ``loss_parallel()`` + ``F.cross_entropy`` (or our
   per-token CE with its ``lse`` for reweighing) plus ``0.3 * number_token_loss`` on ``Shard(-1)`` logits, and our
   chunked CE plus ``linear_number_token_loss`` with a ``Shard(0)`` weight and a replicated hidden (and, without
   reweighing, each partner consuming ``beside_ce`` / ``linear_beside_ce``'s DTensors), equal
   ``ce_with_ntl`` / ``linear_ce_with_ntl`` on the same DTensors: loss and gradients, every variant.
5. NTL-WAS and NTL-MSE on DTensor logits of a WordPiece tokenizer's vocabulary equal the reference
   package ``ntloss`` on the full logits, loss and gradient (where ``ntloss`` is installed).
6. Bad input: logits sharded on another dim, ``Partial`` logits, a number table for the shard's width or
   another size, ``tp_group`` with a DTensor, DTensor labels, a split that leaves a rank empty, a weight
   sharded on its hidden dim, the Hugging Face chunked head called outside an FSDP2 model's forward:
   ValueErrors naming the value and the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ntl_scale
from tests.helpers.data import random_labels, random_logits
from tests.helpers.distributed import WorkerContext, run_workers
from tests.helpers.reference import naive_per_token

pytestmark = pytest.mark.distributed

VOCAB = 13  # over 2 ranks DTensor gives 7 and 6 columns
VARIANTS = [
    dict(loss="was"),
    dict(loss="was", squash_factor=3.0, reweigh=True),
    dict(loss="mse"),
    dict(loss="mae", reweigh=True),
    dict(loss="huber", huber_delta=2.0),
    dict(loss="number"),
    dict(loss="number", float_level=True),
]
TOL = 1e-12  # float64 everywhere: only the summation order differs from the reference


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = max(1.0, float(expected.detach().abs().max()))
    torch.testing.assert_close(
        actual.detach(), expected.detach(), atol=TOL * scale, rtol=TOL, msg=lambda m: f"{what}: {m}"
    )


def _vocab(size: int = VOCAB) -> ntl_scale.NumberVocab:
    tokens = [f"w{i}" for i in range(VOCAB)]
    for value, position in zip(range(10), [1, 2, 4, 5, 6, 7, 8, 9, 11, 12]):  # across the 7 | 6 border
        tokens[position] = str(value)
    tokens[3] = "."
    return ntl_scale.NumberVocab.from_id_to_token(tokens, vocab_size=size)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    vocab = _vocab()
    labels = random_labels(vocab, (3, 10), VOCAB, seed=seed, number_fraction=0.6)
    full = random_logits((*labels.shape, VOCAB), seed=seed + 1)
    upstream = torch.Generator().manual_seed(seed + 2)
    g_ce = torch.randn(labels.shape, generator=upstream, dtype=torch.float64)
    g_ntl = torch.randn(labels.shape, generator=upstream, dtype=torch.float64)
    return labels, full, g_ce, g_ntl


def _reference(full: torch.Tensor, labels, vocab, g_ce, g_ntl, **variant):
    leaf = full.detach().clone().requires_grad_()
    ce, ntl, mask = naive_per_token(leaf, labels, vocab, **variant)
    ((ce * g_ce).sum() + (ntl * g_ntl).sum()).backward()
    return ce, ntl, mask, leaf.grad


def _check_logits(ctx: WorkerContext) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    mesh_2d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    vocab = _vocab()
    labels, full, g_ce, g_ntl = _inputs()
    columns = torch.arange(VOCAB).chunk(2)[ctx.rank]  # torch.chunk's split, DTensor's documented one
    start, end = int(columns[0]), int(columns[-1]) + 1
    assert (start, end) == ((0, 7), (7, 13))[ctx.rank]
    for variant in VARIANTS:
        what = f"{variant} rank={ctx.rank}"
        ce_ref, ntl_ref, mask_ref, grad_ref = _reference(full, labels, vocab, g_ce, g_ntl, **variant)
        logits = distribute_tensor(full.detach().clone(), mesh, [Shard(-1)]).requires_grad_()
        ce, ntl, mask = ntl_scale.vocab_parallel_ce_ntl(logits, labels, vocab, **variant)
        assert not ntl_scale.ops.shards.is_dtensor(ce)  # plain per-token outputs, the same on every rank
        ((ce * g_ce).sum() + (ntl * g_ntl).sum()).backward()
        assert logits.grad.placements == (Shard(2),)
        assert torch.equal(mask, mask_ref), what
        _close(ce, ce_ref, f"{what} ce")
        _close(ntl, ntl_ref, f"{what} ntl")
        _close(logits.grad.to_local(), grad_ref[..., start:end], f"{what} local grad")
        _close(logits.grad.full_tensor(), grad_ref, f"{what} full grad")

        # the plain local shard with tp_group and vocab_start: the same code, the same bits
        shard = full[..., start:end].clone().requires_grad_()
        ce_p, ntl_p, _ = ntl_scale.vocab_parallel_ce_ntl(
            shard, labels, vocab, tp_group=mesh.get_group(0), vocab_start=start, **variant
        )
        ((ce_p * g_ce).sum() + (ntl_p * g_ntl).sum()).backward()
        assert torch.equal(ce, ce_p) and torch.equal(ntl, ntl_p), what
        assert torch.equal(logits.grad.to_local(), shard.grad), what

        # the vocabulary on the second dim of a 2-D mesh (a data-parallel dim of size 1 replicated)
        logits_2d = distribute_tensor(full.detach().clone(), mesh_2d, [Replicate(), Shard(-1)])
        ce_2d, ntl_2d, _ = ntl_scale.vocab_parallel_ce_ntl(logits_2d, labels, vocab, **variant)
        assert torch.equal(ce, ce_2d) and torch.equal(ntl, ntl_2d), what

    # replicated logits are the full vocabulary on each rank
    replicated = distribute_tensor(full.detach().clone(), mesh, [Replicate()]).requires_grad_()
    ce_r, ntl_r, _ = ntl_scale.vocab_parallel_ce_ntl(replicated, labels, vocab)
    ((ce_r * g_ce).sum() + (ntl_r * g_ntl).sum()).backward()
    ce_ref, ntl_ref, _, grad_ref = _reference(full, labels, vocab, g_ce, g_ntl)
    _close(ce_r, ce_ref, "replicated ce")
    _close(ntl_r, ntl_ref, "replicated ntl")
    _close(replicated.grad.to_local(), grad_ref, "replicated grad")

    # ce_with_ntl: the means (CE over valid labels, NTL over number labels) and the weighted sum
    for variant in (VARIANTS[0], VARIANTS[2], VARIANTS[5]):
        logits = distribute_tensor(full.detach().clone(), mesh, [Shard(-1)]).requires_grad_()
        out = ntl_scale.ce_with_ntl(logits, labels, vocab, ntl_weight=0.3, **variant)
        out.loss.backward()
        leaf = full.detach().clone().requires_grad_()
        ce_t, ntl_t, mask_t = naive_per_token(leaf, labels, vocab, **variant)
        ce_mean = ce_t.sum() / (labels != -100).sum()
        ntl_mean = ntl_t.sum() / mask_t.sum()
        (ce_mean + 0.3 * ntl_mean).backward()
        _close(out.ce, ce_mean, f"ce_with_ntl {variant} ce")
        _close(out.ntl, ntl_mean, f"ce_with_ntl {variant} ntl")
        _close(out.loss, ce_mean + 0.3 * ntl_mean, f"ce_with_ntl {variant} loss")
        _close(logits.grad.full_tensor(), leaf.grad, f"ce_with_ntl {variant} grad")


def _check_loss_parallel(ctx: WorkerContext) -> None:
    """CE alone against torch's own vocabulary-parallel cross entropy on the same DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2,))
    vocab = _vocab()
    labels, full, _, _ = _inputs(seed=10)
    flat, flat_labels = full.reshape(-1, VOCAB), labels.reshape(-1)
    theirs = distribute_tensor(flat.clone(), mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        reference = F.cross_entropy(theirs, flat_labels, ignore_index=-100)
        reference.backward()
    ours = distribute_tensor(flat.clone(), mesh, [Shard(1)]).requires_grad_()
    out = ntl_scale.ce_with_ntl(ours, flat_labels, vocab, ntl_weight=0.0)
    out.loss.backward()
    reference_value = reference.full_tensor() if ntl_scale.ops.shards.is_dtensor(reference) else reference
    _close(out.loss, reference_value, "CE vs loss_parallel")
    _close(ours.grad.to_local(), theirs.grad.to_local(), "CE grad vs loss_parallel")


def _check_linear(ctx: WorkerContext) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    vocab = _vocab()
    labels, _, _, _ = _inputs(seed=20)
    g = torch.Generator().manual_seed(21)
    hidden = torch.randn(*labels.shape, 5, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, 5, generator=g, dtype=torch.float64)
    group = mesh.get_group(0)
    for variant in VARIANTS:
        what = f"linear {variant} rank={ctx.rank}"
        h_ref = hidden.clone().requires_grad_()
        w_ref = weight.clone().requires_grad_()
        ce_t, ntl_t, mask_t = naive_per_token(h_ref @ w_ref.T, labels, vocab, **variant)
        ce_mean, ntl_mean = ce_t.sum() / (labels != -100).sum(), ntl_t.sum() / mask_t.sum()
        (ce_mean + 0.3 * ntl_mean).backward()

        # plain hidden beside a Shard(0) weight: nothing says the ranks hold the same tokens (issue 40: an
        # FSDP2 weight looks the same), refused; the plain-shard route says it with tp_group
        w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
        with pytest.raises(ValueError, match=r"hidden is a plain tensor, which does not say whether"):
            ntl_scale.linear_ce_with_ntl(hidden, w, labels, vocab, ntl_weight=0.3, **variant)
        start, rows = (0, 7) if ctx.rank == 0 else (7, 6)  # DTensor's split of 13 rows
        h = hidden.clone().requires_grad_()
        w_local = weight[start : start + rows].clone().requires_grad_()
        opts = ntl_scale.NTLOptions(**variant)
        terms = ntl_scale.linear_ce_ntl(
            h, w_local, labels, vocab, opts, tp_group=group, vocab_start=start, chunk_tokens=7
        )
        out = ntl_scale.reductions.combine_terms(terms, labels, vocab, opts, 0.3, None, "mean")
        out.loss.backward()
        _close(out.ce, ce_mean, f"{what} ce")
        _close(out.ntl, ntl_mean, f"{what} ntl")
        _close(w_local.grad, w_ref.grad[start : start + rows], f"{what} weight grad")
        h_grad = h.grad.clone()
        torch.distributed.all_reduce(h_grad, group=group)
        _close(h_grad, h_ref.grad, f"{what} hidden grad (summed)")

        # replicated DTensor hidden: its gradient comes back Partial, DTensor sums it
        w2 = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
        h2 = distribute_tensor(hidden.clone(), mesh, [Replicate()]).requires_grad_()
        out2 = ntl_scale.linear_ce_with_ntl(h2, w2, labels, vocab, ntl_weight=0.3, chunk_tokens=7, **variant)
        out2.loss.backward()
        assert torch.equal(out2.loss, out.loss), what
        _close(h2.grad.full_tensor(), h_ref.grad, f"{what} replicated hidden grad")
        _close(w2.grad.full_tensor(), w_ref.grad, f"{what} weight grad (replicated hidden)")


def _check_fsdp2_weight(ctx: WorkerContext) -> None:
    """Issue 40, item 1: ``fully_shard(nn.Linear(8, 24))``'s weight outside the module's forward is a ``Shard(0)``
    DTensor over data-parallel ranks with their own tokens. The chunked loss refuses it (it took it for a
    vocabulary split and mixed the ranks' tokens: both ranks CE 3.52037 where the references are 3.82391
    and 3.45655); the gather the message names gives each rank its own float64 one-process loss, and the
    weight the average of the ranks' gradients, as FSDP2 reduces them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Partial, Replicate

    mesh = init_device_mesh("cpu", (2,))
    tokens = [f"w{i}" for i in range(24)]
    for value in range(10):
        tokens[2 * value + 3] = str(value)
    vocab = ntl_scale.NumberVocab.from_id_to_token(tokens)
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 24, dtype=torch.float64)
    full = layer.weight.detach().clone()
    fully_shard(layer, mesh=mesh)

    def rank_inputs(rank: int):
        labels = random_labels(vocab, (2, 5), 24, seed=40 + rank, number_fraction=0.6)
        hidden = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(50 + rank), dtype=torch.float64)
        return hidden, labels

    def reference(rank: int):
        hidden, labels = rank_inputs(rank)
        w = full.clone().requires_grad_()
        ce, ntl, mask = naive_per_token(hidden @ w.T, labels, vocab)
        ce_mean, ntl_mean = ce.sum() / (labels != -100).sum(), ntl.sum() / mask.sum()
        (ce_mean + 0.3 * ntl_mean).backward()
        return ce_mean, ntl_mean, w.grad

    hidden, labels = rank_inputs(ctx.rank)
    assert ntl_scale.ops.shards.is_dtensor(layer.weight) and layer.weight.to_local().shape == (12, 8)
    with pytest.raises(ValueError, match=r"FSDP2 fully_shard parameter used outside its module's forward"):
        ntl_scale.linear_ce_with_ntl(hidden, layer.weight, labels, vocab)
    with pytest.raises(ValueError, match=r"Partial\('avg'\)"):
        ntl_scale.linear_ce_ntl(hidden, layer.weight, labels, vocab)

    gathered = layer.weight.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial("avg")])
    out = ntl_scale.linear_ce_with_ntl(hidden, gathered, labels, vocab, ntl_weight=0.3, chunk_tokens=4)
    out.loss.backward()
    ce_ref, ntl_ref, _ = reference(ctx.rank)
    _close(out.ce, ce_ref, f"FSDP2 rank {ctx.rank} ce")
    _close(out.ntl, ntl_ref, f"FSDP2 rank {ctx.rank} ntl")
    mean_grad = (reference(0)[2] + reference(1)[2]) / 2
    rows = slice(12 * ctx.rank, 12 * ctx.rank + 12)
    _close(layer.weight.grad.to_local(), mean_grad[rows], f"FSDP2 rank {ctx.rank} weight grad (DP mean)")


def _check_colwise_parallel(ctx: WorkerContext) -> None:
    """An output layer split by torch's own ``ColwiseParallel`` (DTensor logits out): loss and gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    vocab = _vocab()
    labels, _, _, _ = _inputs(seed=50)
    g = torch.Generator().manual_seed(51)
    hidden = torch.randn(*labels.shape, 5, generator=g, dtype=torch.float64)
    head = torch.nn.Linear(5, VOCAB, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, 5, generator=g, dtype=torch.float64))
    w_ref = head.weight.detach().clone().requires_grad_()
    h_ref = hidden.clone().requires_grad_()
    ce_t, ntl_t, mask_t = naive_per_token(h_ref @ w_ref.T, labels, vocab)
    (ce_t.sum() / (labels != -100).sum() + 0.3 * ntl_t.sum() / mask_t.sum()).backward()

    parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
    h = hidden.clone().requires_grad_()
    logits = head(h)
    assert ntl_scale.ops.shards.is_dtensor(logits) and logits.to_local().shape[-1] == (7, 6)[ctx.rank]
    out = ntl_scale.ce_with_ntl(logits, labels, vocab, ntl_weight=0.3)
    out.loss.backward()
    _close(out.ce, ce_t.sum() / (labels != -100).sum(), "ColwiseParallel ce")
    _close(head.weight.grad.full_tensor(), w_ref.grad, "ColwiseParallel weight grad")
    _close(h.grad, h_ref.grad, "ColwiseParallel hidden grad (summed by ColwiseParallel's input layout)")


def _check_errors(ctx: WorkerContext) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    vocab = _vocab()
    labels, full, _, _ = _inputs(seed=30)
    by_rows = distribute_tensor(full.clone(), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"Shard\(dim=0\) on mesh dim 0 shards another dimension"):
        ntl_scale.vocab_parallel_ce_ntl(by_rows, labels, vocab)
    partial = DTensor.from_local(full.clone(), mesh, [Partial()])
    with pytest.raises(ValueError, match=r"Partial on mesh dim 0 holds unreduced partial sums.*redistribute"):
        ntl_scale.ce_with_ntl(partial, labels, vocab)
    sharded = distribute_tensor(full.clone(), mesh, [Shard(-1)])
    width = (7, 6)[ctx.rank]
    for_shard = ntl_scale.NumberVocab.from_id_to_token(["w", "1", "2", "3", "4", "5", "6"][:width])
    with pytest.raises(ValueError, match=rf"vocab_size is {width} .* vocabulary of 13 .* shard width"):
        ntl_scale.vocab_parallel_ce_ntl(sharded, labels.clamp_max(width - 1), for_shard)
    with pytest.raises(ValueError, match=r"vocab_size is 16 .* neither .*with_vocab_size\(13\)"):
        ntl_scale.vocab_parallel_ce_ntl(sharded, labels, _vocab(16))
    with pytest.raises(ValueError, match=r"carries its process group .* drop them"):
        ntl_scale.vocab_parallel_ce_ntl(sharded, labels, vocab, tp_group=mesh.get_group(0))
    with pytest.raises(ValueError, match=r"inplace=True overwrites .* logits.to_local\(\) with tp_group"):
        ntl_scale.ce_with_ntl(sharded, labels, vocab, inplace=True)
    with pytest.raises(ValueError, match=r"labels is a DTensor .*labels.full_tensor"):
        ntl_scale.vocab_parallel_ce_ntl(sharded, distribute_tensor(labels, mesh, [Replicate()]), vocab)
    tiny = distribute_tensor(torch.zeros(2, 1), mesh, [Shard(-1)])  # 1 column over 2 ranks
    with pytest.raises(ValueError, match="leaves a rank without a column"):
        ntl_scale.vocab_parallel_ce_ntl(tiny, torch.zeros(2, dtype=torch.long), vocab)
    weight = distribute_tensor(torch.randn(VOCAB, 4, dtype=torch.float64), mesh, [Shard(1)])
    hidden = torch.randn(*labels.shape, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"weight is a DTensor .* Shard\(dim=1\) .* another dimension"):
        ntl_scale.linear_ce_with_ntl(hidden, weight, labels, vocab)

    # the Hugging Face chunked head of an FSDP2 model called on its own: its weight is the FSDP shard
    # (Shard(0) over ranks holding other tokens, not a vocabulary split), refused
    from torch.distributed.fsdp import fully_shard

    from ntl_scale.integrations.hf.chunked import install_linear_loss_head

    model = torch.nn.Sequential(torch.nn.Linear(4, VOCAB, bias=False, dtype=torch.float64))
    fully_shard(model, mesh=mesh)
    install_linear_loss_head(model[0], vocab, ntl_scale.NTLOptions())
    with pytest.raises(ValueError, match="FSDP2 gathers it only inside the model's forward"):
        model[0](hidden, labels)


def _check_ntloss(ctx: WorkerContext) -> None:
    """NTL on DTensor logits against the reference package ``ntloss`` on the full logits (where installed)."""
    import importlib.util
    import warnings

    if importlib.util.find_spec("ntloss") is None:
        return
    import ntloss
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.helpers import tokenizers as tk

    mesh = init_device_mesh("cpu", (2,))
    tokenizer = tk.wordpiece_fast()
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer)
    labels = random_labels(vocab, (3, 16), vocab.vocab_size, seed=40)
    full = random_logits((*labels.shape, vocab.vocab_size), seed=41)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        references = {
            "was": ntloss.NTLoss(tokenizer, digit_level=True, reweigh=False),
            "mse": ntloss.NTLossDotProduct(tokenizer, digit_level=True, reweigh=False, loss_function=F.mse_loss),
        }
    for loss, reference in references.items():
        ours = distribute_tensor(full.clone(), mesh, [Shard(-1)]).requires_grad_()
        got = ntl_scale.number_token_loss(ours, labels, vocab, loss=loss, reweigh=False)
        theirs = full.clone().requires_grad_()
        want = reference(theirs, labels)
        got.backward()
        want.backward()
        _close(got, want, f"ntloss {loss} (vocabulary {vocab.vocab_size} over 2 ranks)")
        _close(ours.grad.full_tensor(), theirs.grad, f"ntloss {loss} grad")


def _check_composed(ctx: WorkerContext) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2,))
    vocab = _vocab()
    labels, full, _, _ = _inputs(seed=30)
    flat, flat_labels = full.reshape(-1, VOCAB), labels.reshape(-1)
    valid = flat_labels != -100
    g = torch.Generator().manual_seed(31)
    hidden = torch.randn(flat_labels.shape[0], 5, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, 5, generator=g, dtype=torch.float64)
    for variant in VARIANTS:
        what = f"composed {variant} rank={ctx.rank}"
        reweigh = variant.get("reweigh", False)
        fused_in = distribute_tensor(flat.clone(), mesh, [Shard(1)]).requires_grad_()
        fused = ntl_scale.ce_with_ntl(fused_in, flat_labels, vocab, **variant)
        fused.loss.backward()
        logits = distribute_tensor(flat.clone(), mesh, [Shard(1)]).requires_grad_()
        if reweigh:  # the partner's log-sum-exp: our per-token CE's
            partner = ntl_scale.per_token_ce_ntl(logits, flat_labels, vocab)
            ce, lse = partner.ce[valid].mean(), partner.lse
        else:
            with loss_parallel():
                ce, lse = F.cross_entropy(logits, flat_labels, ignore_index=-100), None
            ce = ce.full_tensor() if ntl_scale.ops.shards.is_dtensor(ce) else ce
        loss = ce + 0.3 * ntl_scale.number_token_loss(logits, flat_labels, vocab, lse=lse, **variant)
        with loss_parallel():
            loss.backward()
        _close(loss, fused.loss, f"{what} loss")
        _close(logits.grad.to_local(), fused_in.grad.to_local(), f"{what} logits grad")
        if not reweigh:  # the passthrough form: loss_parallel's CE consumes beside_ce's DTensor
            logits = distribute_tensor(flat.clone(), mesh, [Shard(1)]).requires_grad_()
            for_ce, ntl = ntl_scale.beside_ce(logits, flat_labels, vocab, **variant)
            assert ntl_scale.ops.shards.is_dtensor(for_ce) and for_ce.placements == logits.placements
            with loss_parallel():
                ce = F.cross_entropy(for_ce, flat_labels, ignore_index=-100)
                ce = ce.full_tensor() if ntl_scale.ops.shards.is_dtensor(ce) else ce
                loss = ce + 0.3 * ntl
                loss.backward()
            _close(loss, fused.loss, f"{what} beside_ce loss")
            _close(logits.grad.to_local(), fused_in.grad.to_local(), f"{what} beside_ce logits grad")

        w_f = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
        h_f = distribute_tensor(hidden.clone(), mesh, [Replicate()]).requires_grad_()
        ntl_scale.linear_ce_with_ntl(h_f, w_f, flat_labels, vocab, chunk_tokens=7, **variant).loss.backward()
        w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
        h = distribute_tensor(hidden.clone(), mesh, [Replicate()]).requires_grad_()
        partner = ntl_scale.linear_ce_ntl(h, w, flat_labels, vocab, chunk_tokens=7)
        ntl = ntl_scale.linear_number_token_loss(
            h, w, flat_labels, vocab, lse=partner.lse if reweigh else None, chunk_tokens=7, **variant
        )
        (partner.ce[valid].mean() + 0.3 * ntl).backward()
        _close(h.grad.full_tensor(), h_f.grad.full_tensor(), f"{what} hidden grad")
        _close(w.grad.full_tensor(), w_f.grad.full_tensor(), f"{what} weight grad")
        if not reweigh:  # the passthrough form from hidden states: our chunked CE consumes linear_beside_ce's
            w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).requires_grad_()
            h = distribute_tensor(hidden.clone(), mesh, [Replicate()]).requires_grad_()
            h_ce, w_ce, ntl = ntl_scale.linear_beside_ce(h, w, flat_labels, vocab, chunk_tokens=7, **variant)
            partner = ntl_scale.linear_ce_ntl(h_ce, w_ce, flat_labels, vocab, chunk_tokens=7)
            (partner.ce[valid].mean() + 0.3 * ntl).backward()
            _close(h.grad.full_tensor(), h_f.grad.full_tensor(), f"{what} linear_beside_ce hidden grad")
            _close(w.grad.full_tensor(), w_f.grad.full_tensor(), f"{what} linear_beside_ce weight grad")


def _check_all(ctx: WorkerContext) -> None:
    torch.set_default_dtype(torch.float32)
    _check_ntloss(ctx)
    _check_logits(ctx)
    _check_loss_parallel(ctx)
    _check_linear(ctx)
    _check_fsdp2_weight(ctx)
    _check_colwise_parallel(ctx)
    _check_composed(ctx)
    _check_errors(ctx)


def test_dtensor_inputs_two_ranks():
    run_workers(2, 2, _check_all)
