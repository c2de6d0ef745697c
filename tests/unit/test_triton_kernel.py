"""The Triton CE + NTL kernels (``ntl_scale/ops/triton_ce_ntl.py``) under Triton's CPU interpreter.

``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors (slowly: sizes stay small). Compared with
float64 computations written out here with plain torch ops:

1. One-pass statistics of a shard: max, sum of exponentials, label logit, number-column max, sums;
   fp32 and bf16, vocabulary not a multiple of the block, several blocks, shard offsets,
   ignored labels, a shard without number columns.
2. TP: shards of one vocabulary, their statistics combined with the two all-reduces (threads with a
   recording all-reduce), against the full-vocabulary softmax.
3. Gradients: the kernel's in-place logits gradient for arbitrary upstream gradients of ``ce``,
   ``expect`` and ``mass`` against float64 autograd, per shard; uneven token chunks; a shard that
   owns no label; no number targets.
4. The ops with the kernels (``impl="triton"``, which the interpreter runs on CPU tensors): ``ce_with_ntl``
   (fp32 in and out of place, NTL-WAS and MSE with reweighing; bf16, NTL-WAS) and ``linear_ce_with_ntl`` (uneven chunks)
   against the float64 reference of ``tests/helpers/reference.py``, loss and gradients; bf16 and
   fp16 logits gradients rounded once (in half-ulps of the float64 gradient), the kernel and the
   PyTorch path alike; the chunked op without gradients launches the statistics kernel only.
5. Selection per call: ``impl="torch"`` launches no kernel and ``impl="triton"`` does, call after call in
   one process; ``impl="auto"`` takes them nowhere by default; ``impl="triton"`` where they cannot run
   is refused.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

# Triton reads TRITON_INTERPRET when it is imported, and in a whole-suite session an earlier module
# (megatron-core, torch's inductor) may import it first: the interpreter tests then run in a process of
# their own (test_interpreter_tests_in_their_own_process below), started with the variable set.
from tests.helpers.triton_interpreter import own_process, run_in_own_process, skip_unless_own_process

OWN_PROCESS = own_process()


def test_interpreter_tests_in_their_own_process():
    """Runs this file again in a fresh process with ``TRITON_INTERPRET=1`` when this session imported Triton
    before the file could set it; its tests must pass there."""
    if OWN_PROCESS:
        pytest.skip("this process runs the tests itself")
    run_in_own_process(__file__)


triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton; dev extra)")

from ntl_scale.ops import triton_ce_ntl as tk  # noqa: E402
from ntl_scale.ops.logits import combine_kernel_stats  # noqa: E402
from ntl_scale.ops.shard_math import ShardInputs, ShardMath  # noqa: E402
from tests.helpers.distributed import run_ranks_in_threads  # noqa: E402


@pytest.fixture(autouse=True)
def _in_own_process(request):
    skip_unless_own_process(request, OWN_PROCESS)


if OWN_PROCESS and os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - a GPU run sets it off
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="TRITON_INTERPRET is off and no GPU")

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5}  # relative; bf16 inputs are exact in fp32 arithmetic


def _problem(tokens=9, vocab=203, numbers=(3, 17, 64, 65, 130, 200), seed=0, dtype=torch.float32):
    """Global logits ``[T, V]``, labels (some ignored, some numbers), number ids and a per-token ``a`` table."""
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(tokens, vocab, generator=g)).to(dtype)
    ids = torch.tensor(numbers, dtype=torch.int64)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    pick = torch.randint(0, len(numbers), (tokens,), generator=g)
    labels = torch.where(torch.arange(tokens) % 3 == 0, ids[pick], labels)
    labels[1] = -100
    a = torch.rand(tokens, len(numbers), generator=g, dtype=torch.float64) * 5
    return logits, labels, ids, a


def _inputs(labels, ids, a, start, width):
    """The shard ``[start, start + width)``'s inputs: its number columns and their slice of ``a``."""
    valid = labels != -100
    inside = (ids >= start) & (ids < start + width)
    return ShardInputs(
        labels=torch.where(valid, labels, 0).to(DEVICE),
        valid=valid.to(DEVICE),
        number_cols=(ids[inside] - start).to(DEVICE),
        a_table=a[:, inside].float().to(DEVICE),
        start=start,
    )


def _reference_stats(z64, labels, ids, a, start, width):
    """float64 per-shard ``m, S, z_y, mN, SN, A`` the obvious way."""
    shard = z64[:, start : start + width]
    m = shard.max(dim=1).values
    s = torch.exp(shard - m[:, None]).sum(1)
    local = labels - start
    owned = (labels != -100) & (local >= 0) & (local < width)
    z_y = torch.where(owned, shard.gather(1, local.clamp(0, width - 1)[:, None])[:, 0], torch.zeros_like(m))
    inside = (ids >= start) & (ids < start + width)
    if not bool(inside.any()):
        return torch.stack([m, s, z_y, torch.full_like(m, float("-inf")), 0 * m, 0 * m], 1)
    zn = shard[:, ids[inside] - start]
    mn = zn.max(1).values
    en = torch.exp(zn - mn[:, None])
    return torch.stack([m, s, z_y, mn, en.sum(1), (en * a[:, inside]).sum(1)], 1)


# ------------------------------------------------------------------------- 1. one-pass statistics


# every shard in fp32 ((5, 50): no numbers), the whole vocabulary in bf16 (the dtype changes the loads only)
@pytest.mark.parametrize(
    "dtype,start,width",
    [(torch.float32, 0, 203), (torch.float32, 64, 70), (torch.float32, 140, 63), (torch.float32, 5, 50),
     (torch.bfloat16, 0, 203)],
)  # fmt: skip
def test_stats_match_float64(dtype, start, width):
    logits, labels, ids, a = _problem(dtype=dtype)
    inputs = _inputs(labels, ids, a, start, width)
    shard = logits[:, start : start + width].to(DEVICE)  # a strided view: the row stride is V
    target = inputs.local_target(width)
    got = tk.shard_stats(shard, target, inputs.number_cols, inputs.a_table, block_v=32).double().cpu()
    a32 = a.float().double()  # the kernel reads the fp32 table
    want = _reference_stats(logits.double(), labels, ids, a32, start, width)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=1e-6)


def test_stats_float64_logits_stay_float64():
    logits, labels, ids, a = _problem(dtype=torch.float64)
    inputs = _inputs(labels, ids, a, 0, 203)
    inputs.a_table = inputs.a_table.double()
    got = tk.shard_stats(logits.to(DEVICE), inputs.local_target(203), inputs.number_cols, inputs.a_table)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.cpu(), _reference_stats(logits, labels, ids, a.float().double(), 0, 203))


def test_nan_logits_give_nan_sums():
    """A NaN logit is never dropped by the max: that row's sum (and, on a number column, SN) is NaN."""
    logits, labels, ids, a = _problem()
    logits[2, 50] = float("nan")  # not a number column
    logits[4, 64] = float("nan")  # a number column
    inputs = _inputs(labels, ids, a, 0, 203)
    got = tk.shard_stats(logits.to(DEVICE), inputs.local_target(203), inputs.number_cols, inputs.a_table, block_v=32)
    _, _, sums = combine_kernel_stats(got, None)
    assert torch.isnan(sums[2, 0]) and torch.isnan(sums[4, 0]) and torch.isnan(sums[4, 2])
    finite = [0, 1, 3, 5, 6, 7, 8]
    assert torch.isfinite(sums[finite]).all() and not torch.isnan(sums[2, 2])


# ------------------------------------------------------------------------- 2. tensor parallel


def test_tp_shards_combine_to_the_full_softmax():
    """Uneven split 203 = 64 + 76 + 63; the number ids straddle the borders (64, 65; 130)."""
    logits, labels, ids, a = _problem()
    bounds = [(0, 64), (64, 76), (140, 63)]
    inputs = [_inputs(labels, ids, a, s, w) for s, w in bounds]
    local = [
        tk.shard_stats(logits[:, s : s + w].to(DEVICE), i.local_target(w), i.number_cols, i.a_table, block_v=16)
        for (s, w), i in zip(bounds, inputs)
    ]  # kernels first, one at a time (the interpreter is not thread-safe); only the collectives in threads
    results, calls = run_ranks_in_threads(lambda r: combine_kernel_stats(local[r], object()), 3)
    ops = [op for rank in calls.values() for op, _ in rank]
    assert ops.count(torch.distributed.ReduceOp.MAX) == 3 and ops.count(torch.distributed.ReduceOp.SUM) == 3
    z = logits.double()
    m = z.max(1).values
    zn = z[:, ids]
    mn = zn.max(1).values
    en = torch.exp(zn - mn[:, None])
    valid = labels != -100
    want_sums = torch.stack(
        [
            torch.exp(z - m[:, None]).sum(1),
            torch.where(valid, z.gather(1, torch.where(valid, labels, 0)[:, None])[:, 0], 0),
            en.sum(1),
            (en * a.float().double()).sum(1),
        ],
        1,
    )
    for rank in range(3):
        max_all, number_max, sums = results[rank]
        torch.testing.assert_close(max_all.double().cpu(), m)
        torch.testing.assert_close(number_max.double().cpu(), mn)
        torch.testing.assert_close(sums.double().cpu(), want_sums, rtol=2e-6, atol=1e-6)


# ------------------------------------------------------------------------- 3. gradients


def _reference_grad(z64, labels, ids, a, g_ce, g_expect, g_mass):
    """float64 autograd of ``sum(g_ce*ce + g_expect*expect + g_mass*mass)`` over the full vocabulary."""
    z = z64.clone().requires_grad_()
    valid = labels != -100
    ce = -F.log_softmax(z, 1).gather(1, torch.where(valid, labels, 0)[:, None])[:, 0]
    ce = torch.where(valid, ce, 0)
    p = F.softmax(z[:, ids], 1)
    expect = (p * a).sum(1)
    mass = F.softmax(z, 1)[:, ids].sum(1)
    ((g_ce * ce + g_expect * expect + g_mass * mass).sum()).backward()
    return ce.detach(), expect.detach(), mass.detach(), z.grad


def _kernel_grad(logits, labels, ids, a, bounds, grads, *, inplace, rows=None):
    """Per shard: statistics, combine (threads), finalize, then the gradient kernel; concatenated."""
    inputs = [_inputs(labels, ids, a, s, w) for s, w in bounds]
    shards = [logits[:, s : s + w].contiguous().to(DEVICE) for s, w in bounds]
    local = [
        tk.shard_stats(x, i.local_target(x.shape[1]), i.number_cols, i.a_table, block_v=32)
        for x, i in zip(shards, inputs)
    ]
    if len(bounds) == 1:
        combined = {0: combine_kernel_stats(local[0], None)}
    else:
        combined, _ = run_ranks_in_threads(lambda r: combine_kernel_stats(local[r], object()), len(bounds))
    outs, terms = [], None
    for r, (x, i) in enumerate(zip(shards, inputs)):
        max_all, number_max, sums = combined[r]
        ce, expect, mass, _, _ = ShardMath.finalize(
            max_all, sums, ShardMath.safe_number_max(number_max), i.valid, need_full=True
        )
        terms = (ce, expect, mass)
        g = tuple(t.float().to(DEVICE) for t in grads)
        g = (torch.where(i.valid, g[0], 0), g[1], g[2])
        out = x if inplace else torch.empty_like(x)
        for sl in rows or [slice(None)]:  # token chunks, as the chunked op calls it
            saved = tk.number_exp_of(x[sl], i.number_cols, number_max[sl]) if sl.start else None  # both ways
            rows_in = i.rows(sl)
            part = tk.logits_grad_(
                x[sl], out[sl], rows_in.local_target(x.shape[1]), rows_in.number_cols, rows_in.a_table,
                max_all[sl], sums[sl, 0], number_max[sl], sums[sl, 2], expect[sl],
                mass[sl], tuple(t[sl] for t in g), saved, block_v=32,
            )  # fmt: skip
        outs.append(out)
        assert part.data_ptr() == out[sl].data_ptr()
    return terms, torch.cat([o.double().cpu() for o in outs], 1)


_GRADIENT_CASES = [
    ([(0, 203)], False, None),
    ([(0, 203)], True, [slice(0, 4), slice(4, 9)]),  # uneven chunks, in place
    ([(0, 64), (64, 76), (140, 63)], False, None),  # TP: uneven shards, numbers on the borders
]


@pytest.mark.parametrize(  # in place is for fp32 logits only: no bf16 in-place case (a skip would count as a failure)
    "dtype,bounds,inplace,rows",
    [(dtype, *case) for dtype in (torch.float32, torch.bfloat16) for case in _GRADIENT_CASES
     if dtype == torch.float32 or not case[1]],
)  # fmt: skip
def test_gradient_matches_float64_autograd(dtype, bounds, inplace, rows):
    logits, labels, ids, a = _problem(dtype=dtype)
    g = torch.Generator().manual_seed(3)
    grads = tuple(torch.randn(labels.shape[0], generator=g, dtype=torch.float64) for _ in range(3))
    a32 = a.float().double()
    ce, expect, mass, want = _reference_grad(logits.double(), labels, ids, a32, *grads)
    (got_ce, got_expect, got_mass), got = _kernel_grad(
        logits, labels, ids, a, bounds, grads, inplace=inplace, rows=rows
    )
    torch.testing.assert_close(got_ce.double().cpu(), ce, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got_expect.double().cpu(), expect, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got_mass.double().cpu(), mass, rtol=2e-5, atol=2e-5)
    # bf16 gradients are rounded once when written (8 bits of mantissa)
    atol = 2e-6 if dtype == torch.float32 else 8e-3 * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0 if dtype == torch.bfloat16 else 1e-5, atol=atol)


def test_gradient_without_number_targets_or_number_columns():
    """No label is a number, and the vocabulary has no number token: CE's gradient alone."""
    logits, labels, _, _ = _problem(numbers=(3,))
    labels = torch.where(labels == 3, 4, labels)
    ids = torch.zeros(0, dtype=torch.int64)
    a = torch.zeros(labels.shape[0], 0, dtype=torch.float64)
    g_ce = torch.full((labels.shape[0],), 0.25, dtype=torch.float64)
    zeros = torch.zeros_like(g_ce)
    ce, _, _, want = _reference_grad(logits.double(), labels, ids, a, g_ce, zeros, zeros)
    (got_ce, got_expect, got_mass), got = _kernel_grad(
        logits, labels, ids, a, [(0, 203)], (g_ce, zeros, zeros), inplace=False
    )
    torch.testing.assert_close(got_ce.double().cpu(), ce, rtol=2e-5, atol=2e-5)
    assert float(got_expect.abs().max()) == 0 and float(got_mass.abs().max()) == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_a_wrong_gradient_is_caught():
    """The comparison above fails when the kernel's label term is dropped (the test can fail)."""
    logits, labels, ids, a = _problem()
    grads = tuple(torch.ones(labels.shape[0], dtype=torch.float64) for _ in range(3))
    *_, want = _reference_grad(logits.double(), labels, ids, a.float().double(), *grads)
    original = tk.softmax_grad_

    def no_label(logits, out, row_max, total, coef, label_coef=None, target=None, *rest, **kw):
        return original(logits, out, row_max, total, coef, None, None, *rest, **kw)

    patch = pytest.MonkeyPatch()
    patch.setattr(tk, "softmax_grad_", no_label)
    try:
        _, got = _kernel_grad(logits, labels, ids, a, [(0, 203)], grads, inplace=False)
    finally:
        patch.undo()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


# ------------------------------------------------------------------------- 4. the ops with the kernels


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Counts the kernel launches (the ops take the kernels with ``impl="triton"``: the interpreter runs them
    on CPU tensors)."""
    calls = {"stats": 0, "grad": 0}
    stats, grad = tk.shard_stats, tk.softmax_grad_

    def counted_stats(*args, **kwargs):
        calls["stats"] += 1
        return stats(*args, **kwargs)

    def counted_grad(*args, **kwargs):
        calls["grad"] += 1
        return grad(*args, **kwargs)

    monkeypatch.setattr(tk, "shard_stats", counted_stats)
    monkeypatch.setattr(tk, "softmax_grad_", counted_grad)
    return calls


def _op_problem(dtype):
    import ntl_scale

    vocab = ntl_scale.NumberVocab.from_id_to_token({60 + d: str(d) for d in range(10)}, vocab_size=203)
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, 203, (11,), generator=g)
    labels = torch.where(torch.arange(11) % 2 == 0, 60 + labels % 10, labels)
    labels[3] = -100
    hidden = torch.randn(11, 16, generator=g).to(dtype)
    weight = (torch.randn(203, 16, generator=g) / 4).to(dtype)
    return vocab, labels, hidden, weight


def _op_reference(logits64, labels, vocab, **options):
    from tests.helpers.reference import naive_per_token

    ce, ntl, is_number = naive_per_token(logits64, labels, vocab, **options)
    valid = (labels != -100).double()
    return (ce * valid).sum() / valid.sum() + 0.3 * (ntl * is_number).sum() / is_number.double().sum()


@pytest.mark.parametrize(  # each loss in fp32; bf16 with NTL-WAS (the options change host-side coefficients only)
    "dtype,options", [(torch.float32, {}), (torch.float32, {"loss": "mse", "reweigh": True}), (torch.bfloat16, {})]
)
def test_ce_with_ntl_uses_the_kernels_and_matches_float64(kernels_on_cpu, dtype, options):
    import ntl_scale

    vocab, labels, hidden, weight = _op_problem(dtype)
    logits = (hidden.float() @ weight.float().t()).to(dtype)
    x64 = logits.double().requires_grad_()
    want = _op_reference(x64, labels, vocab, **options)
    want.backward()
    for inplace in (False, True) if dtype == torch.float32 else (False,):
        z = logits.to(DEVICE, copy=True).requires_grad_()
        work = z * 1 if inplace else z  # inplace needs a non-leaf buffer it may overwrite
        got = ntl_scale.ce_with_ntl(work, labels.to(DEVICE), vocab, inplace=inplace, impl="triton", **options).loss
        got.backward()
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-6)
        atol = 1e-6 if dtype == torch.float32 else 1e-2 * float(x64.grad.abs().max())
        rtol = 1e-4 if dtype == torch.float32 else 0
        torch.testing.assert_close(z.grad.double().cpu(), x64.grad, rtol=rtol, atol=atol)
    assert kernels_on_cpu["stats"] > 0 and kernels_on_cpu["grad"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_ce_with_ntl_uses_the_kernels_and_matches_float64(kernels_on_cpu, dtype):
    import ntl_scale

    vocab, labels, hidden, weight = _op_problem(dtype)
    h64, w64 = (t.double().requires_grad_() for t in (hidden, weight))
    want = _op_reference(h64 @ w64.t(), labels, vocab)
    want.backward()
    h, w = (t.to(DEVICE, copy=True).requires_grad_() for t in (hidden, weight))
    got = ntl_scale.linear_ce_with_ntl(h, w, labels.to(DEVICE), vocab, chunk_tokens=4, impl="triton").loss  # 4, 4, 3
    got.backward()
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double().cpu(), want, rtol=rtol, atol=1e-6)
    for a, b in ((h.grad, h64.grad), (w.grad, w64.grad)):
        scale = float(b.abs().max())
        atol = (1e-5 if dtype == torch.float32 else 2e-2) * scale
        torch.testing.assert_close(a.double().cpu(), b, rtol=0, atol=atol)
    # one kernel per chunk writes the statistics and then the softmax
    assert kernels_on_cpu["stats"] == 3 and kernels_on_cpu["grad"] == 0


@pytest.mark.parametrize(  # fp32 in place and not, bf16 in place, fp16 not (the dtype changes loads and stores)
    "dtype,inplace", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True), (torch.float16, False)]
)
def test_statistics_kernel_writes_the_softmax_of_the_two_kernel_path(dtype, inplace):
    """Issue 43, item 1: the statistics kernel also writes the softmax (``softmax_into``), the chunked op's
    two walks over a chunk in one kernel. Its statistics are the statistics-only launch's, bit
    for bit; its softmax is what the gradient kernel writes after them with ``coef = 1``, bit for bit (the
    same arithmetic), and the float64 softmax within the output dtype's rounding. 203 columns in blocks of
    16 (a partial last block), an ignored label, number columns at the block borders."""
    logits, labels, ids, a = _problem(dtype=dtype)
    inputs = _inputs(labels, ids, a, 0, 203)
    z = logits.to(DEVICE)
    args = (inputs.local_target(203), inputs.number_cols, inputs.a_table)
    stats_only = tk.shard_stats(z, *args, block_v=16)
    two_kernels = tk.softmax_grad_(z, torch.empty_like(z), stats_only[:, 0], stats_only[:, 1],
                                   torch.ones(z.shape[0], dtype=stats_only.dtype), block_v=16)  # fmt: skip
    work = z.clone()
    into = work if inplace else torch.empty_like(z)
    stats = tk.shard_stats(work, *args, block_v=16, softmax_into=into)
    assert torch.equal(stats, stats_only)
    assert torch.equal(into, two_kernels)
    want = torch.softmax(logits.double(), dim=-1)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(into.double().cpu(), want, rtol=tol, atol=tol * float(want.max()))
    with pytest.raises(ValueError, match="softmax_into must have the logits' shape"):
        tk.shard_stats(z, *args, softmax_into=z[:, :5])


@pytest.mark.parametrize(  # each grid once; each block (13 blocks a row, one block a row) on two of them
    "programs,block_v", [(1, 16), (2, 256), (4, 16), (8, 256)]
)
def test_a_persistent_grid_gives_the_launch_per_row_bit_for_bit(programs, block_v):
    """The statistics kernel's rows ``pid, pid + programs, ...`` (the persistent grid a GPU launch sizes to
    its L2 for the softmax's second walk): statistics and softmax bit for bit those of one program per row,
    in place and not, whatever the grid (9 rows: programs that take one row, two, three or all nine), with
    several blocks per row and with one."""
    logits, labels, ids, a = _problem(dtype=torch.bfloat16)
    inputs = _inputs(labels, ids, a, 0, 203)
    z = logits.to(DEVICE)
    args = (inputs.local_target(203), inputs.number_cols, inputs.a_table)
    per_row_out = torch.empty_like(z)
    per_row = tk.shard_stats(z, *args, block_v=block_v, softmax_into=per_row_out)
    persistent_out = torch.full_like(z, 7.0)
    assert torch.equal(
        tk.shard_stats(z, *args, block_v=block_v, softmax_into=persistent_out, programs=programs), per_row
    )
    assert torch.equal(persistent_out, per_row_out)
    work = z.clone()
    assert torch.equal(tk.shard_stats(work, *args, block_v=block_v, softmax_into=work, programs=programs), per_row)
    assert torch.equal(work, per_row_out)
    assert torch.equal(tk.shard_stats(z, *args, block_v=block_v, programs=programs), per_row)  # statistics only


def test_on_a_gpu_shard_stats_launches_the_grid_softmax_launch_chooses(monkeypatch):
    """The CUDA branch of ``shard_stats`` (device limits patched in, since this machine has no GPU): with a
    softmax to write and an L2 too small for one program per row, the launch is ``softmax_launch``'s
    persistent grid with its 32 KiB blocks, and the result is bit for bit one program per row at the same
    blocks; without the softmax (one walk), and where the rows fit, one program per row."""
    stats_kernel, grad_kernel = tk._kernels()
    grids: list[tuple[int, int, bool]] = []

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                grids.append((grid[0], meta["BLOCK_V"], meta["PERSISTENT"]))
                return stats_kernel[grid](*args, **meta)

            return launch

    monkeypatch.setattr(tk, "_kernels", lambda: (Recorded(), grad_kernel))
    g = torch.Generator().manual_seed(5)
    width, rows = 20000, 9  # wider than one 16384-column block: the persistent grid's blocks
    z = (torch.randn(rows, width, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    target = torch.randint(0, width, (rows,), generator=g).to(DEVICE)
    cols = torch.tensor([5, 17, 19999], device=DEVICE)
    a_table = torch.rand(rows, 3, generator=g).to(DEVICE)
    monkeypatch.setattr(tk, "_gpu_limits", lambda t: (2, 1024))  # 2 SMs, 1 KiB of L2
    into = torch.empty_like(z)
    stats = tk.shard_stats(z, target, cols, a_table, softmax_into=into)
    assert grids == [(2, 16384, True)]  # 9 rows in 5 rounds of 2 programs
    want_into = torch.empty_like(z)
    want = tk.shard_stats(z, target, cols, a_table, block_v=16384, softmax_into=want_into, programs=rows)
    assert grids[-1] == (rows, 16384, False)
    assert torch.equal(stats, want) and torch.equal(into, want_into)
    tk.shard_stats(z, target, cols, a_table)
    assert grids[-1] == (rows, 4096, False)  # the statistics alone: one walk, one program per row
    monkeypatch.setattr(tk, "_gpu_limits", lambda t: (132, 50 << 20))  # an H100: 9 rows fit in L2
    tk.shard_stats(z, target, cols, a_table, softmax_into=into)
    assert grids[-1] == (rows, 4096, False)
    for bad in (0, -3, 2.7, True, "4"):  # the grid is a positive int, refused otherwise with the value named
        with pytest.raises(ValueError, match="programs must be a positive int"):
            tk.shard_stats(z, target, cols, a_table, softmax_into=into, programs=bad)


def test_the_softmax_launch_fits_l2_and_balances_its_rounds():
    """``softmax_launch`` (the GPU's grid for the statistics-and-softmax kernel), over shapes of A100/H100/
    B200-like devices: one program per row where four per SM fit in L2_SHARE of L2 (or the rows are narrower
    than a persistent block, or fp64); else a persistent grid of at most one program per SM, every row taken
    (programs x rounds >= rows) in the fewest rounds, with 32 KiB blocks (those compiled ahead of time)."""
    for sms, l2 in ((108, 40 << 20), (132, 50 << 20), (148, 126 << 20)):
        for width in (1, 100, 4096, 16032, 32064, 50257, 128256, 262144):
            for elem, extra in ((2, 0), (2, 2), (4, 0), (4, 2), (8, 0)):
                row_bytes = width * (elem + extra)
                for rows in (1, 7, 131, 132, 1368, 8192, 65536):
                    programs, block = tk.softmax_launch(rows, width, row_bytes, elem, sms, l2)
                    in_flight = min(rows, 4 * sms)  # one program per row: four 16-warp programs per SM at most
                    if in_flight * row_bytes <= tk.L2_SHARE * l2 or elem == 8 or rows <= sms or width * elem < 32768:
                        assert (programs, block) == (rows, tk._block_v(width))
                        continue
                    rounds = -(-rows // programs)
                    assert programs <= sms and rounds == -(-rows // sms) and (rounds - 1) * programs < rows
                    assert block == 32768 // elem <= width
    # a chunk of 1368 bf16 rows of 128256 columns, in place: one program per SM (125, in 11 equal
    # rounds), 32 KiB blocks; under TP 8 (16032 columns) one program per row (528 rows in flight fit)
    assert tk.softmax_launch(1368, 128256, 2 * 128256, 2, 132, 50 << 20) == (125, 16384)
    assert tk.softmax_launch(1368, 16032, 2 * 16032, 2, 132, 50 << 20) == (1368, 4096)
    # a short chunk whose rows all fit (200 rows of 50257 bf16 columns: 20 MB) keeps one program per row
    assert tk.softmax_launch(200, 50257, 2 * 50257, 2, 132, 50 << 20) == (200, 4096)


def test_a_shard_of_minus_infinity_writes_a_zero_softmax():
    """Under TP a shard may hold only -inf logits for a token (masked columns): its share of the softmax is
    0, and the kernel writes 0 there (not the NaN of exp(-inf - -inf)), so the rescaled rows stay finite."""
    logits, labels, ids, a = _problem()
    logits[2] = float("-inf")
    inputs = _inputs(labels, ids, a, 0, 203)
    z = logits.to(DEVICE)
    out = torch.full_like(z, 7.0)
    stats = tk.shard_stats(z, inputs.local_target(203), inputs.number_cols, inputs.a_table, block_v=16,
                           softmax_into=out)  # fmt: skip
    assert float(stats[2, 1]) == 0 and torch.equal(out[2], torch.zeros_like(out[2]))
    keep = torch.arange(9) != 2
    torch.testing.assert_close(out[keep].double().cpu(), torch.softmax(logits[keep].double(), -1), rtol=1e-6, atol=1e-7)


def test_linear_ce_with_ntl_under_tp_rescales_the_shard_softmax(kernels_on_cpu, monkeypatch):
    """Under tensor parallelism one kernel per chunk writes the shard's softmax over its local statistics,
    and the per-token factor ``S_local exp(m_local - m) / S`` from the all-reduces, folded into ``P_h``'s rows
    and the weight gradient's hidden rows, makes it the global one: the shards' loss and gradients are the
    float64 full-vocabulary reference's, with no second kernel. TP 2 (the 203 columns padded to 204, Megatron's way: two
    shards of 102; number ids 60-69 in the first) in threads, each kernel launch serialised (the interpreter
    is not thread-safe)."""
    import threading

    import ntl_scale

    lock = threading.Lock()
    for name in ("shard_stats", "softmax_grad_"):
        counted = getattr(tk, name)

        def serialised(*args, _launch=counted, **kwargs):
            with lock:
                return _launch(*args, **kwargs)

        monkeypatch.setattr(tk, name, serialised)
    _, labels, hidden, weight = _op_problem(torch.float32)
    vocab = ntl_scale.NumberVocab.from_id_to_token({60 + d: str(d) for d in range(10)}, vocab_size=204)
    weight = torch.cat([weight, weight[-1:] / 2])  # the padding row: a column like any other
    h64, w64 = (t.double().requires_grad_() for t in (hidden, weight))
    want = _op_reference(h64 @ w64.t(), labels, vocab)
    want.backward()
    bounds = [(0, 102), (102, 102)]

    def rank(r):
        start, width = bounds[r]
        h = hidden.to(DEVICE, copy=True).requires_grad_()
        w = weight[start : start + width].to(DEVICE, copy=True).requires_grad_()
        got = ntl_scale.linear_ce_with_ntl(h, w, labels.to(DEVICE), vocab, tp_group=object(), chunk_tokens=4,
                                           impl="triton").loss  # fmt: skip
        got.backward()
        return got.detach(), h.grad, w.grad

    results, calls = run_ranks_in_threads(rank, 2)
    for r in range(2):
        torch.testing.assert_close(results[r][0].double().cpu(), want, rtol=1e-5, atol=1e-6)
        start, width = bounds[r]
        grad_w = w64.grad[start : start + width]
        torch.testing.assert_close(results[r][2].double().cpu(), grad_w, rtol=0, atol=1e-5 * float(grad_w.abs().max()))
    grad_h = sum(results[r][1].double().cpu() for r in range(2))  # the partial input gradients, summed by TP
    torch.testing.assert_close(grad_h, h64.grad, rtol=0, atol=1e-5 * float(h64.grad.abs().max()))
    assert kernels_on_cpu["stats"] == 6 and kernels_on_cpu["grad"] == 0  # per rank: one kernel per chunk
    ops = [op for op, _ in calls[0]]
    assert ops.count(torch.distributed.ReduceOp.MAX) == 3 and ops.count(torch.distributed.ReduceOp.SUM) >= 3


@pytest.mark.parametrize("inplace", [False, True])
def test_z_loss_on_the_kernels_matches_float64(kernels_on_cpu, inplace):
    """The z-loss (issue 43, item 2) on the kernel path: the kernels' gradient with the log-sum-exp's
    gradient added to the softmax's coefficient, the label column given it back; the chunked op's
    forward-built weight gradient for the effective weights ``1 + 2 w lse``. Against torch's CE plus
    ``w * logsumexp**2`` in float64, and NTL from the naive reference."""
    import ntl_scale
    from tests.helpers.reference import naive_per_token

    vocab, labels, hidden, weight = _op_problem(torch.float32)
    valid = labels != -100

    def reference(logits64):
        ce = F.cross_entropy(logits64, labels, reduction="none", ignore_index=-100)
        z_loss = 0.05 * torch.logsumexp(logits64, -1) ** 2
        _, ntl, is_number = naive_per_token(logits64, labels, vocab)
        return (ce + z_loss)[valid].mean() + 0.3 * ntl[is_number].mean()

    x64 = (hidden.double() @ weight.double().t()).requires_grad_()
    reference(x64).backward()
    z = (hidden.float() @ weight.float().t()).to(DEVICE, copy=True).requires_grad_()
    work = z * 1 if inplace else z
    got = ntl_scale.ce_with_ntl(work, labels.to(DEVICE), vocab, z_loss_weight=0.05, inplace=inplace, impl="triton")
    got.loss.backward()
    torch.testing.assert_close(got.loss.double().cpu(), reference(x64.detach()), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z.grad.double().cpu(), x64.grad, rtol=1e-4, atol=1e-6)
    if inplace:
        return
    h64, w64 = (t.double().requires_grad_() for t in (hidden, weight))
    reference(h64 @ w64.t()).backward()
    h, w = (t.to(DEVICE, copy=True).requires_grad_() for t in (hidden, weight))
    got = ntl_scale.linear_ce_with_ntl(
        h, w, labels.to(DEVICE), vocab, z_loss_weight=0.05, chunk_tokens=4, impl="triton"
    )
    got.loss.backward()
    for a, b in ((h.grad, h64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(a.double().cpu(), b, rtol=0, atol=1e-5 * float(b.abs().max()))
    assert kernels_on_cpu["stats"] > 0 and kernels_on_cpu["grad"] > 0


@pytest.mark.parametrize("shift", [-12.0, "mixed"])
def test_z_loss_with_negative_effective_weights_on_the_kernels(kernels_on_cpu, shift):
    """Issue 51, item 3, on the kernel path: logits shifted so that every lse (``-12``), or every other one
    (``mixed``), is below ``-1 / (2 z_weight)`` at z_weight 1: the effective weights ``1 + 2 lse`` of the
    forward-built weight gradient all negative, or of both signs. The chunked op's weight gradient against
    float64 autograd of torch's CE plus ``logsumexp**2`` and the naive NTL (it was dropped, relative error ~1)."""
    import ntl_scale
    from tests.helpers.reference import naive_per_token

    vocab, labels, hidden, weight = _op_problem(torch.float32)
    valid = labels != -100
    per_token = torch.tensor([-12.0 if shift != "mixed" or t % 2 == 0 else 0.0 for t in range(len(labels))])
    hidden = torch.cat([hidden, per_token.unsqueeze(1)], dim=1)  # logits + the shift: a column of ones in weight
    weight = torch.cat([weight, torch.ones(weight.shape[0], 1)], dim=1)

    def reference(logits64):
        ce = F.cross_entropy(logits64, labels, reduction="none", ignore_index=-100)
        _, ntl, is_number = naive_per_token(logits64, labels, vocab)
        return (ce + torch.logsumexp(logits64, -1) ** 2)[valid].mean() + 0.3 * ntl[is_number].mean()

    h64, w64 = (t.double().requires_grad_() for t in (hidden, weight))
    reference(h64 @ w64.t()).backward()
    lse = torch.logsumexp(h64.detach() @ w64.detach().t(), -1)[valid]
    assert float((1 + 2 * lse).max()) < 0 if shift != "mixed" else float((1 + 2 * lse).min()) < 0 < float(lse.max())
    h, w = (t.to(DEVICE, copy=True).requires_grad_() for t in (hidden, weight))
    got = ntl_scale.linear_ce_with_ntl(h, w, labels.to(DEVICE), vocab, z_loss_weight=1.0, chunk_tokens=4, impl="triton")
    got.loss.backward()
    for a, b in ((h.grad, h64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(a.double().cpu(), b, rtol=0, atol=1e-5 * float(b.abs().max()))
    assert kernels_on_cpu["stats"] > 0


def test_a_tie_at_the_maximum_is_a_hit_on_the_kernels_as_in_the_pytorch_code(kernels_on_cpu):
    """Issue 51, item 5 (docs/math.md, "Number accuracy"): a hit is the label's logit equal to the vocabulary's
    largest, a tie counting for every tied label. The kernels (no soft-capping: a tie of equal logits) give the
    same hits as the PyTorch code and as that rule written here; torch.argmax (first index) differs on row 1."""
    import ntl_scale

    vocab, labels, hidden, weight = _op_problem(torch.float32)
    logits = (hidden @ weight.t()).contiguous()
    labels = labels.clone()
    labels[:2] = torch.tensor([61, 64])
    logits[:2, 61] = logits[:2, 64] = float(logits.max()) + 1.0  # rows 0 and 1: columns 61 and 64 tie at the max
    rule = logits.gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1) == logits.amax(-1)
    assert rule[:2].tolist() == [True, True] and (logits[:2].argmax(-1) == labels[:2]).tolist() == [True, False]
    hits = {}
    for impl in ("torch", "triton"):
        options = ntl_scale.NTLOptions(impl=impl)
        hits[impl] = ntl_scale.per_token_ce_ntl(logits.to(DEVICE), labels.to(DEVICE), vocab, options).hit.cpu()
    assert torch.equal(hits["triton"], hits["torch"]) and torch.equal(hits["torch"], rule & (labels != -100))
    assert kernels_on_cpu["stats"] > 0


def test_linear_ce_with_ntl_without_gradients_launches_the_statistics_only(kernels_on_cpu):
    """Issue 29, item 8, on the kernel path: under ``no_grad`` no chunk writes its softmax (that feeds
    only the gradient matmuls); the loss is the float64 reference's and the with-gradient call's."""
    import ntl_scale

    vocab, labels, hidden, weight = _op_problem(torch.float32)
    want = _op_reference(hidden.double() @ weight.double().t(), labels, vocab)
    h, w = (t.to(DEVICE, copy=True).requires_grad_() for t in (hidden, weight))
    with torch.no_grad():
        got = ntl_scale.linear_ce_with_ntl(h, w, labels.to(DEVICE), vocab, chunk_tokens=4, impl="triton").loss
    assert kernels_on_cpu["stats"] == 3 and kernels_on_cpu["grad"] == 0
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-6)
    with_grad = ntl_scale.linear_ce_with_ntl(h, w, labels.to(DEVICE), vocab, chunk_tokens=4, impl="triton").loss
    assert torch.equal(with_grad.detach(), got) and kernels_on_cpu["stats"] == 6  # the softmax in the same kernel


def _half_ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``|got - want|`` in half-ulps of ``dtype`` at ``want`` (subnormals: the smallest normal's ulp)."""
    mantissa = -int(torch.log2(torch.tensor(torch.finfo(dtype).eps)))
    smallest_exponent = int(torch.log2(torch.tensor(torch.finfo(dtype).tiny)))
    exponent = torch.floor(torch.log2(want.abs())).clamp_min(smallest_exponent)
    return (got.double() - want).abs() / torch.exp2(exponent - mantissa - 1)


# Triton's interpreter converts fp32 to bf16 by truncation (triton 3.9: ``cast_impl`` passes no
# rounding mode), a compiled kernel rounds to nearest even: one rounding is then up to 2 half-ulps
# (toward zero) in the interpreter, 1 on a GPU. fp32 -> fp16 rounds to nearest in both.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# fp32 arithmetic before the one rounding: ~1e-6 relative to the terms, 5e-4 bf16 half-ulps; times the
# cancellation between CE and NTL terms on the number columns (~10 here)
ROUNDING_SLACK = 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", [{}, {"loss": "mse", "reweigh": True}])
def test_half_precision_gradient_is_rounded_once(kernels_on_cpu, dtype, options):
    """Issue 29, item 7: the kernel's logits gradient on the number columns is computed in fp32 (the CE
    part and the NTL part) and rounded to the logits' dtype once, as the PyTorch path does.

    Against float64 autograd of the full-logit CE + 0.3 NTL (``tests/helpers/reference.py``): every
    element within one rounding of the float64 gradient, for the kernel and for the PyTorch path (both
    checked here). Before the fix the kernel stored the CE part in bf16, read it back, added the NTL
    part and rounded again: 124 half-ulps (30 % off) at one element of this problem (bf16, NTL-WAS).
    """
    import ntl_scale

    vocab = ntl_scale.NumberVocab.from_id_to_token({60 + d: str(d) for d in range(10)}, vocab_size=203)
    g = torch.Generator().manual_seed(0)
    tokens = 24
    logits = (3 * torch.randn(tokens, 203, generator=g)).to(dtype)
    labels = torch.randint(0, 203, (tokens,), generator=g)
    labels = torch.where(torch.arange(tokens) % 2 == 0, 60 + labels % 10, labels)  # every other label a digit
    logits[::4, 60:70] += 4  # rows that favour the digits: CE and NTL terms of similar size there
    labels[3] = -100
    x64 = logits.double().requires_grad_()
    _op_reference(x64, labels, vocab, **options).backward()
    want = x64.grad
    bounds = {}
    for use_kernels in (True, False):
        z = logits.to(DEVICE, copy=True).requires_grad_()
        impl = "triton" if use_kernels else "torch"
        ntl_scale.ce_with_ntl(z, labels.to(DEVICE), vocab, impl=impl, **options).loss.backward()
        assert z.grad.dtype == dtype
        bounds[use_kernels] = float(_half_ulps(z.grad.cpu(), want, dtype).max())
    one_rounding = 2 if INTERPRETED and dtype == torch.bfloat16 else 1
    assert bounds[False] <= 1 + ROUNDING_SLACK, f"PyTorch path: {bounds[False]:.3f} half-ulps"
    assert bounds[True] <= one_rounding + ROUNDING_SLACK, f"kernel: {bounds[True]:.3f} half-ulps"
    assert kernels_on_cpu["grad"] == 1  # the kernel ran (once: the PyTorch path's backward is no launch)


# ------------------------------------------------------------------------- 5. selection


def test_impl_is_chosen_per_call(kernels_on_cpu):
    """No process-wide state: ``torch`` and ``triton`` alternate call by call, each with its own code, and
    the two agree (float32: to rounding)."""
    import ntl_scale

    vocab, labels, hidden, weight = _op_problem(torch.float32)
    logits = (hidden @ weight.t()).to(DEVICE)
    losses = {}
    for impl in ("torch", "triton", "torch", "triton"):
        before = dict(kernels_on_cpu)
        z = logits.clone().requires_grad_()
        losses[impl] = ntl_scale.ce_with_ntl(z, labels.to(DEVICE), vocab, impl=impl).loss
        losses[impl].backward()
        launched = kernels_on_cpu["stats"] - before["stats"], kernels_on_cpu["grad"] - before["grad"]
        assert launched == ((1, 1) if impl == "triton" else (0, 0)), (impl, launched)
    torch.testing.assert_close(losses["triton"], losses["torch"], rtol=1e-6, atol=1e-6)
    options = ntl_scale.NTLOptions(impl="triton")
    before = kernels_on_cpu["stats"]
    ntl_scale.per_token_ce_ntl(logits, labels.to(DEVICE), vocab, options)
    ntl_scale.CEWithNTL(vocab, impl="triton")(logits, labels.to(DEVICE))
    assert kernels_on_cpu["stats"] == before + 2


def test_auto_takes_the_kernels_nowhere_by_default(kernels_on_cpu):
    import ntl_scale

    # auto: the PyTorch code until the kernels have passed the GPU suite
    assert tk.enabled(torch.zeros(1)) is False
    vocab, labels, hidden, weight = _op_problem(torch.float32)
    ntl_scale.ce_with_ntl((hidden @ weight.t()).to(DEVICE), labels.to(DEVICE), vocab)
    ntl_scale.linear_ce_with_ntl(hidden.to(DEVICE), weight.to(DEVICE), labels.to(DEVICE), vocab, impl="auto")
    assert kernels_on_cpu == {"stats": 0, "grad": 0}


def test_triton_where_the_kernels_cannot_run_is_refused(monkeypatch):
    """Outside the interpreter a CPU tensor cannot take the kernels: a ValueError naming the device and the fix."""
    import ntl_scale

    monkeypatch.setattr(tk, "interpreting", lambda: False)
    vocab, labels, hidden, weight = _op_problem(torch.float32)
    with pytest.raises(ValueError, match=r"impl='triton' .* CUDA tensors, but the logits are on cpu.*impl='auto'"):
        ntl_scale.ce_with_ntl(hidden @ weight.t(), labels, vocab, impl="triton")
    with pytest.raises(ValueError, match=r"impl='triton' .* on cpu"):
        ntl_scale.linear_ce_with_ntl(hidden, weight, labels, vocab, impl="triton")
