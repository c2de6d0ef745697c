"""GPU benchmark: CE + NTL against the cross-entropy kernels people use, forward + backward, bf16.

    python benchmarks/bench_gpu.py                                  # the default: V 128256, T 8k and 16k, H 4096
    python benchmarks/bench_gpu.py --vocab 49155,128256,262144 --tokens 8192,16384,32768 --hidden 2048,4096
    python benchmarks/bench_gpu.py --rows liger,cce,ours_chunked    # a subset of rows (names: --list-rows)
    python benchmarks/bench_gpu.py --dry-run                        # tiny sizes on the CPU: the script runs

Every row runs the same step on the same inputs: bf16 hidden states ``[T, H]`` and output weight
``[V, H]``, labels with 30% digits, forward and backward to both. Rows on logits compute the bf16
logits ``hidden @ weight.T`` in the step (so every row includes the output layer's matmuls). Times
are CUDA-event medians after warm-up; peak memory is ``torch.cuda.max_memory_allocated`` above the
inputs (gradients included). Each row's time and peak are also given as a ratio to the fastest
CE-only row of the same configuration, and as the fraction of the matmul roofline
``2 x 3 x T x H x V`` FLOPs (forward + backward) at the device's dense bf16 peak. The loss and CE
values stand beside, so a wrong kernel cannot look fast. Baselines come from their own packages;
a row that cannot run says why. The output ends with one Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ntl_scale
from ntl_scale.training.flops import peak_tflops_for_name  # dense bf16 peak by device name (data sheets)

NTL_WEIGHT = 0.3
DIGIT_IDS = range(10)  # the benchmark tokenizer's digits: ids 0-9, as in benchmarks/common.word_level_tokenizer


class Skip(Exception):
    """A row that cannot run here; the message is the reason printed."""


@dataclass
class Inputs:
    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    vocab: ntl_scale.NumberVocab
    tp_group: object = None

    def zero_grad(self) -> None:
        self.hidden.grad = self.weight.grad = None


Step = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # one forward + backward; returns (loss, ce), detached


@dataclass
class Row:
    key: str
    name: str
    ce_only: bool
    build: Callable[[Inputs], Step]
    compiled: bool = False
    env: dict[str, str] = field(default_factory=dict)  # rows needing their own process (import-time settings)


def _needs_cuda(x: Inputs, what: str) -> None:
    if not x.hidden.is_cuda:
        raise Skip(f"{what} needs a CUDA GPU")


def _import(module: str, package: str):
    try:
        with warnings.catch_warnings():  # megatron-core warns about Transformer Engine and Apex at import
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ImportError as e:
        raise Skip(f"{package} not installed ({e.__class__.__name__}: {e})") from None


def _on_logits(x: Inputs, loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> Step:
    def step():
        x.zero_grad()
        loss, ce = loss_fn(x.hidden @ x.weight.t())
        loss.backward()
        return loss.detach(), ce.detach()

    return step


def _on_hidden(x: Inputs, loss_fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Step:
    def step():
        x.zero_grad()
        loss, ce = loss_fn()
        loss.backward()
        return loss.detach(), ce.detach()

    return step


def _same(loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return loss, loss


# ---------------------------------------------------------------------------------------- CE only


def liger(x: Inputs) -> Step:
    _needs_cuda(x, "Liger-Kernel (Triton)")
    module = _import("liger_kernel.transformers", "liger-kernel")
    loss_fn = module.LigerFusedLinearCrossEntropyLoss()
    return _on_hidden(x, lambda: _same(loss_fn(x.weight, x.hidden, x.labels)))


def quack(x: Inputs) -> Step:
    _needs_cuda(x, "QuACK (CuTe DSL)")
    module = _import("quack.linear_cross_entropy", "quack-kernels (and nvidia-cutlass-dsl)")
    return _on_hidden(x, lambda: _same(module.chunked_linear_cross_entropy(x.hidden, x.weight, x.labels)))


def torch_linear_ce(x: Inputs) -> Step:
    if not hasattr(F, "linear_cross_entropy"):
        raise Skip(f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy")
    return _on_hidden(x, lambda: _same(F.linear_cross_entropy(x.hidden, x.weight, x.labels)))


def cce(x: Inputs) -> Step:
    _needs_cuda(x, "Cut Cross Entropy (Triton)")
    module = _import("cut_cross_entropy", "cut-cross-entropy")
    return _on_hidden(x, lambda: _same(module.linear_cross_entropy(x.hidden, x.weight, x.labels)))


def megatron_fused(x: Inputs) -> Step:
    module = _import("megatron.core.fusions.fused_cross_entropy", "megatron-core")
    if x.tp_group is None:
        raise Skip("no process group (torch.distributed could not be initialised)")
    labels = x.labels.view(-1, 1)

    def loss_fn(logits):  # Megatron's layout: [s, b, V/tp] logits, [s, b] labels; per-token losses
        return _same(
            module.fused_vocab_parallel_cross_entropy(logits.view(-1, 1, logits.shape[-1]), labels, x.tp_group).mean()
        )

    return _on_logits(x, loss_fn)


def compiled_ce(x: Inputs) -> Step:
    fn = torch.compile(lambda z, y: F.cross_entropy(z.float(), y))
    return _on_logits(x, lambda z: _same(fn(z, x.labels)))


def materialised_ce(x: Inputs) -> Step:
    return _on_logits(x, lambda z: _same(F.cross_entropy(z.float(), x.labels)))


# ---------------------------------------------------------------------------------------- CE + NTL


def ce_plus_ntloss(x: Inputs) -> Step:
    module = _import("ntloss", "ntloss")
    from benchmarks.common import word_level_tokenizer

    with contextlib.redirect_stderr(open(os.devnull, "w")):  # ntloss logs its table through loguru
        ntl = module.NTLoss(word_level_tokenizer(x.weight.shape[0]), vocab_size=x.weight.shape[0], reweigh=False)

    def loss_fn(z):
        ce = F.cross_entropy(z.float(), x.labels)
        return ce + NTL_WEIGHT * ntl(z.float().unsqueeze(0), x.labels.unsqueeze(0)), ce

    return _on_logits(x, loss_fn)


def _impl(x: Inputs, kernels: bool) -> str:
    """``triton`` for the kernel rows on a GPU (the PyTorch code while compiled); ``torch`` otherwise (and
    for a ``--dry-run`` on the CPU, where the kernels cannot run)."""
    return "triton" if kernels and x.labels.is_cuda else "torch"


def _ours_logits(x: Inputs, compiled: bool, kernels: bool = True) -> Step:
    """``ce_with_ntl`` with the Triton kernels or without (:func:`_impl`)."""
    impl = _impl(x, kernels)

    def fn(z, y):
        out = ntl_scale.ce_with_ntl(z, y, x.vocab, ntl_weight=NTL_WEIGHT, impl=impl)
        return out.loss, out.ce

    fn = torch.compile(fn) if compiled else fn
    return _on_logits(x, lambda z: fn(z, x.labels))


def _ours_chunked(x: Inputs, compiled: bool, kernels: bool = True) -> Step:
    """``linear_ce_with_ntl`` with the Triton kernels or without (:func:`_impl`)."""
    impl = _impl(x, kernels)

    def fn(h, w, y):
        out = ntl_scale.linear_ce_with_ntl(h, w, y, x.vocab, ntl_weight=NTL_WEIGHT, impl=impl)
        return out.loss, out.ce

    fn = torch.compile(fn) if compiled else fn
    return _on_hidden(x, lambda: fn(x.hidden, x.weight, x.labels))


CUTEDSL = {"LIGER_KERNEL_IMPL": "cutedsl"}
ROWS = [
    Row("liger", "Liger fused linear CE (Triton)", True, liger),
    Row("liger_cutedsl", "Liger fused linear CE (LIGER_KERNEL_IMPL=cutedsl)", True, liger, env=CUTEDSL),
    Row("quack", "QuACK chunked_linear_cross_entropy", True, quack),
    Row("torch_linear_ce", "torch F.linear_cross_entropy", True, torch_linear_ce),
    Row("cce", "Cut Cross Entropy (cce)", True, cce),
    Row("megatron", "Megatron fused vocab-parallel CE (TP=1)", True, megatron_fused),
    Row("compiled_ce", "torch.compile(F.cross_entropy) on logits", True, compiled_ce, compiled=True),
    Row("ce", "F.cross_entropy on logits", True, materialised_ce),
    Row("ce_ntloss", "F.cross_entropy + ntloss on logits", False, ce_plus_ntloss),
    Row("ours_logits", "ours: ce_with_ntl on logits", False, lambda x: _ours_logits(x, False)),
    Row("ours_logits_pytorch", "ours: ce_with_ntl on logits, Triton kernels off", False,
        lambda x: _ours_logits(x, False, kernels=False)),
    Row("ours_logits_compiled", "ours: torch.compile(ce_with_ntl) on logits", False,
        lambda x: _ours_logits(x, True), compiled=True),
    Row("ours_chunked", "ours: linear_ce_with_ntl (chunked)", False, lambda x: _ours_chunked(x, False)),
    Row("ours_chunked_pytorch", "ours: linear_ce_with_ntl (chunked), Triton kernels off", False,
        lambda x: _ours_chunked(x, False, kernels=False)),
    Row("ours_chunked_compiled", "ours: torch.compile(linear_ce_with_ntl)", False,
        lambda x: _ours_chunked(x, True), compiled=True),
]  # fmt: skip


# ---------------------------------------------------------------------------------------- running


def make_inputs(tokens: int, hidden: int, vocab: int, device: str, tp_group) -> Inputs:
    g = torch.Generator(device=device).manual_seed(0)
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    digits = torch.rand(tokens, device=device, generator=g) < 0.3
    labels = torch.where(digits, labels % 10, labels)
    h = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=g) / hidden**0.5).to(torch.bfloat16).requires_grad_()
    table = ntl_scale.NumberVocab.from_id_to_token({i: str(i) for i in DIGIT_IDS}, vocab_size=vocab)
    return Inputs(h, w, labels, table, tp_group)


def measure(step: Step, x: Inputs, warmup: int, iters: int) -> dict:
    """Median time (ms), peak memory above the inputs (MiB; CUDA only), and the last loss and CE."""
    cuda = x.hidden.is_cuda
    for _ in range(warmup):
        step()
    x.zero_grad()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss, ce = step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            loss, ce = step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return {"ms": statistics.median(times), "peak_mib": peak, "loss": float(loss), "ce": float(ce)}


def run_row(row: Row, x: Inputs, args) -> dict:
    if row.compiled and args.dry_run and not args.compile_on_cpu:
        return {"skip": "torch.compile rows are left out of --dry-run (compile time); add --compile-on-cpu"}
    if row.env:
        return run_in_child(row, x, args)
    try:
        step = row.build(x)
        return measure(step, x, args.warmup, args.iters)
    except Skip as e:
        return {"skip": str(e)}
    except torch.cuda.OutOfMemoryError:
        return {"skip": "out of GPU memory at this size"}
    except Exception as e:  # a baseline that breaks must not hide the others
        return {"skip": f"failed: {e.__class__.__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    finally:
        x.zero_grad()
        if x.hidden.is_cuda:
            torch.cuda.empty_cache()


def run_in_child(row: Row, x: Inputs, args) -> dict:
    """A row whose package reads its settings at import (Liger's LIGER_KERNEL_IMPL): a fresh process."""
    if not x.hidden.is_cuda:
        return {"skip": f"{row.name} needs a CUDA GPU"}
    if row.key == "liger_cutedsl":
        if importlib.util.find_spec("liger_kernel") is None:
            return {"skip": "liger-kernel not installed"}
        if importlib.util.find_spec("liger_kernel.ops.cutedsl") is None:
            return {"skip": "the installed liger-kernel has no CuTe DSL backend (liger_kernel.ops.cutedsl)"}
        if importlib.util.find_spec("cutlass") is None:
            return {"skip": "nvidia-cutlass-dsl (CuTe DSL) not installed; its CUDA 13 wheel is 92 MB"}
    T, H = x.hidden.shape
    V = x.weight.shape[0]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", row.key, "--tokens", str(T), "--hidden", str(H),
           "--vocab", str(V), "--warmup", str(args.warmup), "--iters", str(args.iters)]  # fmt: skip
    env = {**os.environ, **row.env}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.child_timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"skip": f"failed in its own process (rc {done.returncode}): {last[:160]}"}
    return json.loads(lines[-1])


def init_tp_group(device: str):
    """A one-rank process group for Megatron's fused CE (TP=1): NCCL on a GPU, gloo on the CPU."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(
            backend, rank=0, world_size=1, device_id=torch.device("cuda", 0) if device == "cuda" else None
        )
    return dist.new_group([0])


def write_markdown(path: str, lines: list[str]) -> None:
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=_ints, default=[128256], help="vocabulary sizes (default 128256)")
    parser.add_argument("--tokens", type=_ints, default=[8192, 16384], help="tokens per step (default 8192,16384)")
    parser.add_argument("--hidden", type=_ints, default=[4096], help="hidden sizes (default 4096)")
    parser.add_argument("--rows", default="all", help="comma-separated row keys (see --list-rows), or 'all'")
    parser.add_argument("--list-rows", action="store_true", help="print the row keys and exit")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds; configurations not started within it are listed as not run")  # fmt: skip
    parser.add_argument("--markdown", help="also write the final table to this file")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on the CPU (T 64, H 32, V 512): runs, measures nothing")  # fmt: skip
    parser.add_argument("--compile-on-cpu", action="store_true", help="with --dry-run: run the torch.compile rows too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-timeout", type=float, default=300, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    keys = [r.key for r in ROWS]
    if args.rows != "all":
        unknown = sorted(set(args.rows.split(",")) - set(keys))
        if unknown:
            parser.error(f"unknown rows {unknown}; expected some of {keys}")
    return args


def child_main(args) -> None:
    row = next(r for r in ROWS if r.key == args.child)
    x = make_inputs(args.tokens[0], args.hidden[0], args.vocab[0], "cuda", None)
    try:
        result = measure(row.build(x), x, args.warmup, args.iters)
    except Skip as e:
        result = {"skip": str(e)}
    print(json.dumps(result))


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table(results: list[dict], peak_tflops: float | None) -> list[str]:
    """The Markdown table of every configuration's rows, ratios to that configuration's fastest CE-only row."""
    lines = [
        "| T | H | V | row | kind | time (ms) | x best CE | peak (MiB) | x its peak | roofline | loss | CE |",
        "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config in results:
        T, H, V = config["T"], config["H"], config["V"]
        measured = [r for r in config["rows"] if "ms" in r]
        ce_rows = [r for r in measured if r["ce_only"]]
        best = min(ce_rows, key=lambda r: r["ms"]) if ce_rows else None
        roofline_ms = 6 * T * H * V / (peak_tflops * 1e12) * 1e3 if peak_tflops else None
        for r in config["rows"]:
            kind = "CE" if r["ce_only"] else "CE+NTL"
            if "ms" not in r:
                lines.append(f"| {T} | {H} | {V} | {r['name']} | {kind} | not run: {r['skip']} | | | | | | |")
                continue
            best_mark = " (best CE)" if best is r else ""
            x_time = r["ms"] / best["ms"] if best else None
            x_peak = r["peak_mib"] / best["peak_mib"] if best and r["peak_mib"] and best["peak_mib"] else None
            lines.append(
                f"| {T} | {H} | {V} | {r['name']}{best_mark} | {kind} | {r['ms']:.2f} | {_fmt(x_time, '.2f')} | "
                f"{_fmt(r['peak_mib'], '.0f')} | {_fmt(x_peak, '.2f')} | "
                f"{_fmt(roofline_ms / r['ms'] if roofline_ms else None, '.0%')} | {r['loss']:.4f} | {r['ce']:.4f} |"
            )
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_rows:
        for r in ROWS:
            print(f"{r.key:24s} {'CE only' if r.ce_only else 'CE + NTL':9s} {r.name}")
        return 0
    if args.child:
        child_main(args)
        return 0
    if args.dry_run:
        device, configs = "cpu", [(64, 32, 512)]
        torch.set_num_threads(min(2, torch.get_num_threads()))
    elif not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU visible to torch; nothing measured (--dry-run runs tiny sizes on the CPU)")
        return 0
    else:
        device = "cuda"
        configs = [(t, h, v) for v in args.vocab for t in args.tokens for h in args.hidden]
    selected = [r for r in ROWS if args.rows == "all" or r.key in args.rows.split(",")]
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        peak = peak_tflops_for_name(name)
    else:
        name, peak = "CPU (dry run: timings are not measurements)", None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    header = (
        f"{name}; torch {torch.__version__} (CUDA {torch.version.cuda}); Triton {triton_version}; "
        f"bf16 peak {_fmt(peak, '.0f', 'unknown')} TFLOP/s; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"median of {args.iters} after {args.warmup} warm-up; command: python benchmarks/bench_gpu.py "
        + " ".join(sys.argv[1:] if argv is None else argv)
    )
    print(header, flush=True)
    tp_group = None
    if any(r.key == "megatron" for r in selected):
        try:
            tp_group = init_tp_group(device)
        except Exception as e:
            print(f"bench_gpu: no process group for Megatron's CE ({e.__class__.__name__}: {e})")
    started = time.monotonic()
    results = []
    for T, H, V in configs:
        if args.time_budget is not None and time.monotonic() - started > args.time_budget:
            results.append({"T": T, "H": H, "V": V, "rows": [
                {"name": r.name, "ce_only": r.ce_only, "skip": f"time budget of {args.time_budget:.0f} s spent"}
                for r in selected]})  # fmt: skip
            continue
        x = make_inputs(T, H, V, device, tp_group)
        rows = []
        for row in selected:
            result = {"name": row.name, "ce_only": row.ce_only, **run_row(row, x, args)}
            rows.append(result)
            if "ms" in result:
                print(f"  T={T} H={H} V={V} {row.name}: {result['ms']:.2f} ms, peak "
                      f"{_fmt(result['peak_mib'], '.0f')} MiB, loss {result['loss']:.4f}", flush=True)  # fmt: skip
            else:
                print(f"  T={T} H={H} V={V} {row.name}: not run: {result['skip']}", flush=True)
        results.append({"T": T, "H": H, "V": V, "rows": rows})
        if args.markdown:  # after each configuration: a run stopped by a time limit keeps what it finished
            write_markdown(args.markdown, [header, "", *table(results, peak)])
        del x
        if device == "cuda":
            torch.cuda.empty_cache()
    lines = [header, "", *table(results, peak)]
    if args.markdown:
        write_markdown(args.markdown, lines)
    print()
    print("\n".join(lines[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
