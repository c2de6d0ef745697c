"""NTL alone beside a team's CE: what the add-on costs against that CE, counted and timed on the CPU.

    python benchmarks/bench_addon.py --count      # FLOPs (FlopCounterMode) and op-level bytes, on meta tensors
    python benchmarks/bench_addon.py --time       # CPU: CE alone vs CE + NTL alone, per partner, one run

Count: forward + backward of the partner's CE alone and of CE + ``w *`` NTL alone (NTL-WAS), on meta tensors (no
memory, any shape); the add-on is the difference. FLOPs are ``torch.utils.flop_counter.FlopCounterMode``'s (matmuls;
elementwise work is not counted there). Bytes: every aten op's tensor inputs read and outputs written once (views
free): an unfused, op-by-op model, the same for both, not a measurement. On logits the CE is ``F.cross_entropy`` on
bf16 logits ``[T, V]`` (its ``.float()`` included, as Megatron and torchtitan run it); from hidden states the
materialised output layer ``h W^T`` and that CE. Shapes: 8192 x 128256 x 4096 with ``K`` = 10 (digits) and 1,110
(Llama 3's 0-999 number tokens), and the ``--time`` shape.

Time: median of ``--iters`` forward + backward steps of each arm, the arms interleaved, fp32, on this CPU: torch's
``F.cross_entropy`` on logits, ``F.linear_cross_entropy``, Megatron's ``vocab_parallel_cross_entropy`` at TP 1
(a gloo group of one process; NTL runs before it, as it overwrites its input), each alone and with the add-on in
both forms (``number_token_loss`` beside it, and the passthrough ``beside_ce`` / ``linear_beside_ce``); and
our fused ``ce_with_ntl`` / ``linear_ce_with_ntl`` against the first two. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import ntl_scale  # noqa: E402

WEIGHT = 0.3
_VIEWS = {"view", "_unsafe_view", "reshape", "alias", "detach", "as_strided", "expand", "slice", "t", "transpose",
          "unsqueeze", "squeeze", "select", "permute", "_reshape_alias", "lift_fresh"}  # fmt: skip


def number_vocab(vocab: int, numbers: int) -> ntl_scale.NumberVocab:
    """``numbers`` number tokens at ids ``0..numbers-1``: digits, then 00-99, then 000-999 (Llama 3's 1,110)."""
    values = [i % 10 for i in range(10)] + list(range(100)) + list(range(1000))
    return ntl_scale.NumberVocab(list(range(numbers)), values[:numbers], vocab)


class Bytes(TorchDispatchMode):
    """Sums the bytes of every aten op's tensor inputs and outputs (each read or written once; views free; an
    indexed read or add counts the elements it touches)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _VIEWS or name.startswith("empty"):  # a view or an allocation moves nothing
            return out
        if name in ("zeros", "zeros_like", "new_zeros", "full", "fill_", "zero_"):  # writes its output only
            moved = _nbytes(out)
        elif name in ("index_select", "gather"):  # reads only what it selects: the output's elements, and writes them
            moved = 2 * _nbytes(out) + _nbytes(args[2])
        elif name in ("index_add", "index_add_"):  # reads the source, reads and writes the rows it adds into
            moved = 3 * _nbytes(args[3]) + _nbytes(args[2])
        else:
            moved = sum(_nbytes(t) for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        self.total += moved
        self.ops[name] = self.ops.get(name, 0) + moved
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _count(step: Callable[[], torch.Tensor]) -> tuple[int, Bytes]:
    flops, moved = FlopCounterMode(display=False), Bytes()
    with flops, moved:
        step().backward()
    return flops.get_total_flops(), moved


def count(tokens: int, vocab: int, hidden: int, numbers: int) -> dict[str, dict[str, float]]:
    """FLOPs and bytes of CE alone and of the add-on (CE + w NTL alone, less CE alone), on logits and hidden states,
    NTL beside the CE as its own loss (``logits``, ``hidden``: a dense gradient summed by autograd) and through
    the passthrough (``beside_ce``, ``linear_beside_ce``: NTL's columns added into the CE's gradient in place)."""
    table = number_vocab(vocab, numbers)
    labels = torch.zeros(tokens, dtype=torch.long, device="meta")
    out = {}

    def logits() -> torch.Tensor:
        return torch.empty(tokens, vocab, dtype=torch.bfloat16, device="meta", requires_grad=True)

    def on_logits(ntl: str) -> Callable[[], torch.Tensor]:
        def step():
            z = logits()
            if ntl == "beside_ce":  # one node: NTL's columns join the CE's gradient in place
                z, extra = ntl_scale.beside_ce(z, labels, table)
            else:
                extra = ntl_scale.number_token_loss(z, labels, table) if ntl else None
            loss = F.cross_entropy(z.float(), labels)
            return loss if extra is None else loss + WEIGHT * extra

        return step

    def on_hidden(ntl: str) -> Callable[[], torch.Tensor]:
        def step():
            h = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
            w = torch.empty(vocab, hidden, dtype=torch.bfloat16, device="meta", requires_grad=True)
            if ntl == "beside_ce":
                h, w, extra = ntl_scale.linear_beside_ce(h, w, labels, table)
            else:
                extra = ntl_scale.linear_number_token_loss(h, w, labels, table) if ntl else None
            loss = F.cross_entropy((h @ w.t()).float(), labels)
            return loss if extra is None else loss + WEIGHT * extra

        return step

    forms = (("logits", on_logits, "dense"), ("logits, beside_ce", on_logits, "beside_ce"),
             ("hidden", on_hidden, "dense"), ("hidden, linear_beside_ce", on_hidden, "beside_ce"))  # fmt: skip
    for name, make, form in forms:
        ce_flops, ce = _count(make(""))
        both_flops, both = _count(make(form))
        ops = {op: n - ce.ops.get(op, 0) for op, n in both.ops.items()}
        top = sorted(((n, op) for op, n in ops.items() if n > 0), reverse=True)[:4]
        largest = ", ".join(f"{op} {n / 1e9:.2f} GB" for n, op in top)
        out[name] = {"ce_flops": ce_flops, "ce_bytes": ce.total, "addon_flops": both_flops - ce_flops,
                     "addon_bytes": both.total - ce.total, "addon_ops": largest}  # fmt: skip
    return out


def count_table(shapes: list[tuple[int, int, int, int]]) -> str:
    lines = [
        "| T x V x H, K | on | CE FLOPs | add-on FLOPs | ratio | CE bytes | add-on bytes | ratio | add-on's top ops |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for t, v, h, k in shapes:
        for on, c in count(t, v, h, k).items():
            lines.append(
                f"| {t} x {v} x {h}, {k} | {on} | {c['ce_flops']:.3e} | {c['addon_flops']:.3e} | "
                f"{c['addon_flops'] / max(c['ce_flops'], 1):.4%} | {c['ce_bytes'] / 1e9:.2f} GB | "
                f"{c['addon_bytes'] / 1e9:.3f} GB | {c['addon_bytes'] / c['ce_bytes']:.2%} | {c['addon_ops']} |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- timing


def _megatron_ce() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """Megatron's ``vocab_parallel_cross_entropy`` at TP 1 in a gloo group of this one process, or None."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    except ImportError:
        return None
    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    return lambda z, y: vocab_parallel_cross_entropy(z, y).mean()


def arms(tokens: int, vocab: int, hidden: int, numbers: int) -> list[tuple[str, str, Callable[[], None]]]:
    """``(row, arm, step)``: each partner alone (``CE``) and with the add-on (``CE + NTL``); ours fused."""
    g = torch.Generator().manual_seed(0)
    table = number_vocab(vocab, numbers)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels = torch.where(torch.rand(tokens, generator=g) < 0.3, labels % numbers, labels)
    base = torch.randn(tokens, vocab, generator=g) * 2
    h = torch.randn(tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).requires_grad_()
    z = base.clone().requires_grad_()

    def backward(loss: torch.Tensor) -> None:
        h.grad = w.grad = z.grad = None
        loss.backward()

    def ntl_z(zz: torch.Tensor) -> torch.Tensor:
        return WEIGHT * ntl_scale.number_token_loss(zz, labels, table)

    def ntl_h() -> torch.Tensor:
        return WEIGHT * ntl_scale.linear_number_token_loss(h, w, labels, table)

    def beside_z() -> None:
        for_ce, ntl = ntl_scale.beside_ce(z, labels, table)
        backward(F.cross_entropy(for_ce, labels) + WEIGHT * ntl)

    def beside_h() -> None:
        h_ce, w_ce, ntl = ntl_scale.linear_beside_ce(h, w, labels, table)
        backward(F.linear_cross_entropy(h_ce, w_ce, labels) + WEIGHT * ntl)

    out = [
        ("torch F.cross_entropy (logits)", "CE", lambda: backward(F.cross_entropy(z, labels))),
        ("torch F.cross_entropy (logits)", "CE + NTL", lambda: backward(F.cross_entropy(z, labels) + ntl_z(z))),
        ("torch F.cross_entropy (logits)", "CE + NTL, beside_ce", beside_z),
        ("torch F.cross_entropy (logits)", "ours ce_with_ntl",
         lambda: backward(ntl_scale.ce_with_ntl(z, labels, table).loss)),
        ("torch F.linear_cross_entropy", "CE", lambda: backward(F.linear_cross_entropy(h, w, labels))),
        ("torch F.linear_cross_entropy", "CE + NTL", lambda: backward(F.linear_cross_entropy(h, w, labels) + ntl_h())),
        ("torch F.linear_cross_entropy", "CE + NTL, linear_beside_ce", beside_h),
        ("torch F.linear_cross_entropy", "ours linear_ce_with_ntl",
         lambda: backward(ntl_scale.linear_ce_with_ntl(h, w, labels, table).loss)),
    ]  # fmt: skip
    megatron = _megatron_ce()
    if megatron is not None:
        y = labels.unsqueeze(1)  # Megatron's [s, b] layout, b = 1

        def mega(add: str) -> None:
            logits = (z * 1).unsqueeze(1)  # a non-leaf copy each step: Megatron overwrites fp32 logits in place
            extra: torch.Tensor | int = 0
            if add == "beside_ce":  # NTL first in both forms
                logits, ntl = ntl_scale.beside_ce(logits, y, table)
                extra = WEIGHT * ntl
            elif add:
                extra = WEIGHT * ntl_scale.number_token_loss(logits, y, table)
            backward(megatron(logits, y) + extra)

        row = "Megatron vocab_parallel_cross_entropy, TP 1"
        out += [(row, "CE", lambda: mega("")), (row, "CE + NTL", lambda: mega("dense")),
                (row, "CE + NTL, beside_ce", lambda: mega("beside_ce"))]  # fmt: skip
    return out


def time_arms(tokens: int, vocab: int, hidden: int, numbers: int, iters: int, warmup: int) -> list[dict]:
    steps = arms(tokens, vocab, hidden, numbers)
    times: dict[tuple[str, str], list[float]] = {(r, a): [] for r, a, _ in steps}
    for i in range(warmup + iters):
        for row, arm, step in steps:  # interleaved: a load change on the machine hits every arm alike
            start = time.perf_counter()
            step()
            if i >= warmup:
                times[row, arm].append(time.perf_counter() - start)
    out = []
    for row, arm, _ in steps:
        ms = statistics.median(times[row, arm]) * 1e3
        alone = statistics.median(times[row, "CE"]) * 1e3
        out.append({"row": row, "arm": arm, "ms": ms, "ratio": ms / alone})
    return out


def time_table(records: list[dict]) -> str:
    lines = ["| partner | arm | ms (median) | x CE alone |", "|---|---|---:|---:|"]
    lines += [f"| {r['row']} | {r['arm']} | {r['ms']:.1f} | {r['ratio']:.3f} |" for r in records]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", action="store_true", help="FLOPs and bytes on meta tensors")
    p.add_argument("--time", action="store_true", help="CPU timing of every partner, alone and with the add-on")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--numbers", type=int, default=10)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    if not (args.count or args.time):
        p.error("pass --count, --time or both")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{stamp}; torch {torch.__version__}; {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    if args.count:
        shape = (args.tokens, args.vocab, args.hidden)
        print(count_table([(8192, 128256, 4096, 10), (8192, 128256, 4096, 1110), (*shape, args.numbers)]))
    if args.time:
        records = time_arms(args.tokens, args.vocab, args.hidden, args.numbers, args.iters, args.warmup)
        print(f"T x V x H = {args.tokens} x {args.vocab} x {args.hidden}, K = {args.numbers}, fp32")
        print(time_table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
