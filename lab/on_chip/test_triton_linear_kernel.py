"""The fused linear CE + NTL kernels (``lab/on_chip/triton_linear_ce_ntl.py``) under Triton's CPU interpreter.

Logits never written: the forward's statistics and the backward's recomputed ``dz`` stay in the tile.
Compared with a float64 full-logit reference written from the definitions (``tests/helpers/reference.py``:
``log_softmax``, the number softmax, the NTL variants; ``torch.logsumexp`` for the z-loss) through
float64 autograd, on ``T=37, V=203, H=48, K=10`` with tiles smaller than every dimension (several token
blocks, vocabulary tiles and hidden slices, none dividing its dimension):

1. Per-token CE, NTL and log-sum-exp and both gradients for arbitrary per-token upstream weights, fp32 and
   bf16 inputs (NTL-WAS, MSE with reweighing, Huber and the z-loss in fp32; NTL-WAS in bf16: the options
   change only the host's per-token coefficients); the default tiles once; a frozen weight; autocast;
   ``check_finite``.
2. ``ntloss`` (the reference package) for NTL-WAS on the same logits.
3. Tensor parallelism: TP 3 over gloo with uneven vocabulary shards (the numbers split between two, one
   without number columns), the two all-reduces, each shard's weight gradient and the summed hidden gradient.
4. A kernel without the label term is caught; the refusals name what to do instead.

Like ``tests/unit/test_triton_kernel.py`` the tests run in one process of their own with ``TRITON_INTERPRET=1`` when
Triton was imported before this file (a whole-suite session).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.triton_interpreter import own_process, run_in_own_process, skip_unless_own_process

OWN_PROCESS = own_process()


def test_interpreter_tests_in_their_own_process():
    """Runs this file again in a fresh process with ``TRITON_INTERPRET=1`` when this session imported Triton
    before the file could set it; its tests must pass there."""
    if OWN_PROCESS:
        pytest.skip("this process runs the tests itself")
    run_in_own_process(__file__)


triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton; dev extra)")

import ntl_scale  # noqa: E402
from lab.on_chip import linear_on_chip  # noqa: E402
from lab.on_chip import triton_linear_ce_ntl as fk  # noqa: E402
from lab.on_chip.linear_on_chip import fused_linear_ce_ntl  # noqa: E402
from tests.helpers.reference import naive_per_token  # noqa: E402


@pytest.fixture(autouse=True)
def _in_own_process(request):
    skip_unless_own_process(request, OWN_PROCESS)


if OWN_PROCESS and os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - a GPU run sets it off
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="TRITON_INTERPRET is off and no GPU")

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
T, V, H = 37, 203, 48
# three token blocks; the backward in groups of two (the second group has one token block)
SMALL = ({"BLOCK_T": 16, "BLOCK_V": 32, "BLOCK_H": 16}, {"BLOCK_T": 16, "BLOCK_V": 32, "BLOCK_H": 16, "GROUP_T": 2})


def _problem(dtype, seed=0):
    """Digits 0-9 at ids 60-69 (K = 10), labels half numbers, one ignored; hidden, weight, upstream weights."""
    vocab = ntl_scale.NumberVocab.from_id_to_token({60 + d: str(d) for d in range(10)}, vocab_size=V)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (T,), generator=g)
    labels = torch.where(torch.arange(T) % 2 == 0, 60 + labels % 10, labels)
    labels[3] = -100
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / 3).to(dtype)
    up = torch.rand(3, T, generator=g, dtype=torch.float64)  # per-token weights of ce, ntl, lse**2
    return vocab, labels, hidden, weight, up


def _reference(hidden, weight, labels, vocab, up, z_loss=0.0, **options):
    """float64 per-token ``ce`` (with the z-loss), ``ntl``, ``lse``; the upstream-weighted objective's gradients."""
    h64, w64 = (t.double().requires_grad_() for t in (hidden, weight))
    z = h64 @ w64.t()
    ce, ntl, _ = naive_per_token(z, labels, vocab, **options)
    lse = torch.logsumexp(z, dim=-1)
    ce = ce + torch.where(labels != -100, z_loss * lse**2, 0)
    (up[0] * ce + up[1] * ntl + up[2] * lse).sum().backward()
    return ce.detach(), ntl.detach(), lse.detach(), h64.grad, w64.grad


def _fused(hidden, weight, labels, vocab, up, options=None, blocks=SMALL, **kwargs):
    h = hidden.to(DEVICE, copy=True).requires_grad_()
    w = weight.to(DEVICE, copy=True).requires_grad_()
    terms = fused_linear_ce_ntl(h, w, labels.to(DEVICE), vocab, options, blocks=blocks, **kwargs)
    up = up.to(DEVICE)
    (up[0] * terms.ce + up[1] * terms.ntl + up[2] * terms.lse).sum().backward()
    return terms, h.grad, w.grad


def _close(got, want, dtype, what):
    # fp32: the float64 reference's rounding of fp32 sums; bf16: the dz tile rounded to bf16 before the two
    # gradient dots (as every bf16 fused CE does) and the gradients rounded to bf16 once (2**-8 relative)
    scale = float(want.abs().max())
    atol = (2e-6 if dtype == torch.float32 else 1e-2) * scale
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------- 1. against float64


CASES = {
    "was": {},
    "mse-reweigh": {"loss": "mse", "reweigh": True},
    "z-loss": {"z_loss_weight": 0.05},
    "huber": {"loss": "huber", "squash_factor": None},
}


@pytest.mark.parametrize(
    ("dtype", "case"),
    [(torch.float32, case) for case in CASES.values()] + [(torch.bfloat16, CASES["was"])],
    ids=[f"fp32-{name}" for name in CASES] + ["bf16-was"],
)
def test_matches_float64(dtype, case):
    """Every option case in fp32, NTL-WAS in bf16: the options change only the host's per-token coefficients
    (the same kernels and tiles run for each), the dtype the kernels' loads, casts and stores."""
    vocab, labels, hidden, weight, up = _problem(dtype)
    z_loss = case.get("z_loss_weight", 0.0)
    ref_options = {k: v for k, v in case.items() if k != "z_loss_weight"}
    ce, ntl, lse, gh, gw = _reference(hidden, weight, labels, vocab, up, z_loss, **ref_options)
    terms, got_h, got_w = _fused(hidden, weight, labels, vocab, up, ntl_scale.NTLOptions(**case))
    valid = labels != -100
    torch.testing.assert_close(terms.ce.double().cpu(), ce, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(terms.ntl.double().cpu(), ntl, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(terms.lse.double().cpu()[valid], lse[valid], rtol=2e-6, atol=2e-6)
    _close(got_h, gh, dtype, "hidden gradient")
    _close(got_w, gw, dtype, "weight gradient")
    assert got_h.dtype == dtype and got_w.dtype == dtype


@pytest.mark.parametrize("group", [1, 3], ids=["vocab-fastest", "one-group"])
def test_backward_launch_order_does_not_change_the_gradients(group):
    """The backward's grouped order (GROUP_T token blocks fastest) with groups of 1 (vocabulary tiles fastest)
    and all three token blocks: the same float64 gradients (SMALL's groups of 2 above). A group larger than
    the token blocks launches the one-group order (``test_grouped_tile_order``'s ``5-300-8`` case)."""
    vocab, labels, hidden, weight, up = _problem(torch.float32, seed=2)
    _, _, _, gh, gw = _reference(hidden, weight, labels, vocab, up)
    blocks = (SMALL[0], {**SMALL[1], "GROUP_T": group})
    _, got_h, got_w = _fused(hidden, weight, labels, vocab, up, blocks=blocks)
    _close(got_h, gh, torch.float32, "hidden gradient")
    _close(got_w, gw, torch.float32, "weight gradient")


@pytest.mark.parametrize(("tokens", "width", "group"), [(37, 203, 2), (37, 203, 1), (64, 64, 4), (5, 300, 8)])
def test_grouped_tile_order(monkeypatch, tokens, width, group):
    """``_grouped_tile``, the backward's program -> (token block, vocabulary tile) map, recorded per program
    under the interpreter: every tile exactly once, in the order of the nested loops written here (groups of
    ``group`` token blocks, the last one shorter; in each, the vocabulary tiles in turn, token blocks fastest)."""
    import triton.language as tl

    fk._kernels()
    monkeypatch.setattr(fk, "tl", tl, raising=False)  # the helper resolves tl among its module's globals

    @triton.jit
    def record(out, T, V, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, GROUP_T: tl.constexpr):
        pid = tl.program_id(0)
        pid_t, pid_v = fk._grouped_tile(pid, T, V, BLOCK_T, BLOCK_V, GROUP_T)
        tl.store(out + 2 * pid, pid_t)
        tl.store(out + 2 * pid + 1, pid_v)

    blocks_t, tiles_v = -(-tokens // 16), -(-width // 32)
    out = torch.full((blocks_t * tiles_v, 2), -1, dtype=torch.int64)
    record[(blocks_t * tiles_v,)](out, tokens, width, 16, 32, group)
    want = [
        (t, v)
        for first in range(0, blocks_t, group)
        for v in range(tiles_v)
        for t in range(first, min(first + group, blocks_t))
    ]
    assert [tuple(pair) for pair in out.tolist()] == want


def test_default_tiles_and_a_frozen_weight():
    """The launch tiles of FORWARD_BLOCKS / BACKWARD_BLOCKS (one token block, two vocabulary tiles), and a
    weight without a gradient (the backward builds dH only)."""
    vocab, labels, hidden, weight, up = _problem(torch.float32, seed=1)
    _, _, _, gh, gw = _reference(hidden, weight, labels, vocab, up)
    _, got_h, got_w = _fused(hidden, weight, labels, vocab, up, blocks=(None, None))
    _close(got_h, gh, torch.float32, "hidden gradient")
    _close(got_w, gw, torch.float32, "weight gradient")
    h = hidden.to(DEVICE, copy=True).requires_grad_()
    terms = fused_linear_ce_ntl(h, weight.to(DEVICE), labels.to(DEVICE), vocab, blocks=SMALL)
    (up[0] * terms.ce + up[1] * terms.ntl + up[2] * terms.lse).sum().backward()
    _close(h.grad, gh, torch.float32, "hidden gradient, frozen weight")


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # numpy's, in the interpreter's max over the NaN row
def test_autocast_runs_the_half_precision_kernels_and_check_finite_raises():
    """Under CPU autocast (bf16) fp32 parameters are cast as an autocast linear layer casts them and get fp32
    gradients through the cast; a NaN hidden state with check_finite raises, naming the fix."""
    vocab, labels, hidden, weight, up = _problem(torch.float32, seed=4)
    bf = (hidden.bfloat16(), weight.bfloat16())
    _, _, _, gh, gw = _reference(*bf, labels, vocab, up)
    h, w = (t.to(DEVICE, copy=True).requires_grad_() for t in (hidden, weight))
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        terms = fused_linear_ce_ntl(h, w, labels.to(DEVICE), vocab, blocks=SMALL)
    (up[0] * terms.ce + up[1] * terms.ntl + up[2] * terms.lse).sum().backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    _close(h.grad, gh, torch.bfloat16, "hidden gradient under autocast")
    _close(w.grad, gw, torch.bfloat16, "weight gradient under autocast")
    bad = hidden.clone()
    bad[5, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf at 1 of"):
        fused_linear_ce_ntl(bad.to(DEVICE), weight.to(DEVICE), labels.to(DEVICE), vocab, check_finite=True)


# ------------------------------------------------------------------------- 2. ntloss


def test_ntl_was_matches_ntloss():
    """Per-token NTL-WAS and its gradients through ``h W^T`` against ``ntloss.NTLoss`` on float64 logits."""
    ntloss = pytest.importorskip("ntloss")
    import warnings

    from tests.helpers import tokenizers
    from tests.helpers.data import random_labels

    tokenizer = tokenizers.t5_fast()
    vocab = ntl_scale.NumberVocab.from_tokenizer(tokenizer, digit_level=True)
    labels = random_labels(vocab, (1, T), vocab.vocab_size, seed=7)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, T, H, generator=g)
    weight = torch.randn(vocab.vocab_size, H, generator=g) / 3
    upstream = torch.rand(1, T, generator=g, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = ntloss.NTLoss(tokenizer, digit_level=True, reweigh=False)
    h64, w64 = (t.double().requires_grad_() for t in (hidden, weight))
    want = reference(h64 @ w64.t(), labels, reduction="none")
    (want * upstream).sum().backward()
    h, w = (t.to(DEVICE, copy=True).requires_grad_() for t in (hidden, weight))
    terms = fused_linear_ce_ntl(h, w, labels.to(DEVICE), vocab, blocks=SMALL)
    assert bool(terms.number_mask.any()) and float(want.detach().abs().max()) > 0
    (terms.ntl.double().cpu() * upstream).sum().backward()
    torch.testing.assert_close(terms.ntl.double().cpu(), want.detach().reshape(terms.ntl.shape), rtol=2e-6, atol=2e-6)
    _close(h.grad, h64.grad, torch.float32, "hidden gradient")
    _close(w.grad, w64.grad, torch.float32, "weight gradient")


# ------------------------------------------------------------------------- 3. tensor parallelism


def _tp_worker(ctx, bounds):
    torch.manual_seed(0)
    vocab, labels, hidden, weight, up = _problem(torch.float32, seed=3)
    _, _, _, gh, gw = _reference(hidden, weight, labels, vocab, up, 0.05)
    ce, ntl, *_ = _reference(hidden, weight, labels, vocab, up, 0.05)
    start, stop = bounds[ctx.tp_rank], bounds[ctx.tp_rank + 1]
    h = hidden.clone().requires_grad_()
    w = weight[start:stop].clone().requires_grad_()
    options = ntl_scale.NTLOptions(z_loss_weight=0.05)
    terms = fused_linear_ce_ntl(h, w, labels, vocab, options, tp_group=ctx.tp_group, vocab_start=start, blocks=SMALL)
    (up[0] * terms.ce + up[1] * terms.ntl + up[2] * terms.lse).sum().backward()
    torch.testing.assert_close(terms.ce.double(), ce, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(terms.ntl.double(), ntl, rtol=2e-6, atol=2e-6)
    _close(w.grad, gw[start:stop], torch.float32, f"weight gradient of shard {start}:{stop}")
    grad_h = h.grad.clone()
    torch.distributed.all_reduce(grad_h, group=ctx.tp_group)  # the caller's layer sums the shards' parts
    _close(grad_h, gh, torch.float32, "summed hidden gradient")


def test_tensor_parallel_uneven_shards():
    """TP 3 over uneven shards (62, 88, 53 columns); numbers 60-69 split between the first two shards, the last
    holds none: every case of a two-shard split (a shard with numbers, the split, the label owned elsewhere)."""
    from tests.helpers.distributed import run_workers

    run_workers(3, 3, _tp_worker, (0, 62, 150, 203), timeout=600)


# ------------------------------------------------------------------------- 4. failures caught, refusals


def test_a_kernel_without_the_label_term_is_caught(monkeypatch):
    vocab, labels, hidden, weight, up = _problem(torch.float32)
    *_, gw = _reference(hidden, weight, labels, vocab, up)
    backward = fk.backward_grads

    def no_label(hidden, weight, row_max, scale, label_coef, target, needs, *, blocks=None):
        return backward(hidden, weight, row_max, scale, 0 * label_coef, target, needs, blocks=blocks)

    monkeypatch.setattr(linear_on_chip, "backward_grads", no_label)  # the name the op calls
    *_, got_w = _fused(hidden, weight, labels, vocab, up)
    with pytest.raises(AssertionError):
        _close(got_w, gw, torch.float32, "weight gradient")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": torch.float64}, "fp32, bf16 or fp16"),
        ({"options": {"label_smoothing": 0.1}}, "label_smoothing"),
        ({"options": {"logit_softcap": 30.0}}, "logit_softcap"),
        ({"need_ce": False}, "need_ce=False"),
    ],
)
def test_refusals_name_the_alternative(change, message):
    vocab, labels, hidden, weight, _ = _problem(change.get("dtype", torch.float32))
    options = ntl_scale.NTLOptions(**change.get("options", {}))
    extra = {"need_ce": change["need_ce"]} if "need_ce" in change else {}
    error = TypeError if "dtype" in change else ValueError
    with pytest.raises(error, match=message) as info:
        fused_linear_ce_ntl(hidden.to(DEVICE), weight.to(DEVICE), labels.to(DEVICE), vocab, options, **extra)
    assert "linear_ce_ntl" in str(info.value)


@pytest.mark.parametrize(
    "backward",
    [{"GROUP_T": 0}, {"GROUP_T": -2}, {"BLOCK_T": 16.0}, {"GROUP": 4}],
    ids=["zero", "negative", "float", "key"],
)
def test_bad_launch_overrides_are_refused(backward):
    """A group of 0 would divide by zero inside the backward kernel (on a GPU: wrong gradients, no error)."""
    vocab, labels, hidden, weight, up = _problem(torch.float32)
    with pytest.raises(ValueError, match="blocks for the backward kernel") as info:
        _fused(hidden, weight, labels, vocab, up, blocks=(SMALL[0], {**SMALL[1], **backward}))
    assert repr(next(iter(backward.values()))) in str(info.value)
