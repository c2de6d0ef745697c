"""Step A of ``scripts/gpu_check.sh``: the CE + NTL ops against float64, one JSON row per case.

    python -m tests.gpu.check_parity --json rows.jsonl                       # on a GPU: shapes test,large
    TRITON_INTERPRET=1 python -m tests.gpu.check_parity --device cpu --shapes tiny --json rows.jsonl

Each case runs ``ntl_scale.ce_with_ntl`` (on logits; in place and not) or ``ntl_scale.linear_ce_with_ntl``
(from hidden states, token chunks that do not divide the tokens) with ``impl="triton"`` and with
``impl="torch"``, forward and backward, and compares loss and gradients with float64 autograd of
``tests.helpers.reference.dense_per_token`` (the definitions written as whole-tensor ops, nothing shared
with the library) computed from the same input values. The reference runs in row blocks with the global
token counts, so 8192 x 128256 logits never exist in float64 at once; gradients are compared block by block.
Rows: fp32/bf16/fp16; NTL-WAS and NTL-MSE with reweighing; shapes ``tiny`` (the CPU dry run), ``test``
(300 x 20011 x 256: several vocabulary blocks, the last partial) and ``large`` (8192 x 128256 x 4096 bf16).

Errors: ``loss_err`` = |loss - ref| / |ref|; ``grad_err`` = max |grad - ref| / max |ref| over each gradient
(the worst one is reported, each also by name). A row passes when both are within its tolerance.
``vs_torch`` gives the Triton row's largest difference from the PyTorch row, in the same units.
Every row is written (and flushed) as it finishes; exit status 1 if any row failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ntl_scale  # noqa: E402
from ntl_scale.ops import triton_ce_ntl  # noqa: E402
from tests.helpers.reference import dense_per_token  # noqa: E402

NTL_WEIGHT = 0.3
SHAPES = {  # tokens, vocabulary, hidden, chunk_tokens (None: the op's default), dtypes
    "tiny": (40, 301, 16, 15, ("fp32", "bf16", "fp16")),
    "test": (300, 20011, 256, 96, ("fp32", "bf16", "fp16")),
    "large": (8192, 128256, 4096, None, ("bf16",)),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VARIANTS = {"was": {"loss": "was"}, "mse+reweigh": {"loss": "mse", "reweigh": True}}
# (loss, gradients) tolerances, relative (see the module docstring); half precision: the logits gradient
# is rounded once to bf16/fp16 (a half-ulp is 2^-9 / 2^-12 of its value), the chunked op's logits are too
TOLERANCE = {
    ("fused", "fp32"): (1e-5, 1e-4),
    ("fused", "bf16"): (1e-3, 1e-2),
    ("fused", "fp16"): (1e-3, 2e-3),
    ("chunked", "fp32"): (1e-5, 1e-4),
    ("chunked", "bf16"): (1e-2, 2e-2),
    ("chunked", "fp16"): (1e-2, 2e-2),
}


@dataclass
class Problem:
    vocab: ntl_scale.NumberVocab
    labels: torch.Tensor
    hidden: torch.Tensor
    weight: torch.Tensor
    logits: torch.Tensor
    chunk_tokens: int | None

    @property
    def counts(self) -> tuple[int, int]:
        valid = self.labels != -100
        number = valid & torch.isin(self.labels, self.vocab.ids.to(self.labels.device))
        return int(valid.sum()), int(number.sum())


def make_problem(shape: str, dtype: torch.dtype, device: str, seed: int = 0) -> Problem:
    """Labels with 40% digits (ten number ids in the middle of the vocabulary) and some ignored; hidden
    states and weight drawn in fp32 and rounded to ``dtype``; logits ``hidden @ weight.T`` in ``dtype``."""
    tokens, size, width, chunk, _ = SHAPES[shape]
    first = 7000 if size > 7010 else 60
    vocab = ntl_scale.NumberVocab.from_id_to_token({first + d: str(d) for d in range(10)}, vocab_size=size)
    g = torch.Generator(device=device).manual_seed(seed)
    labels = torch.randint(0, size, (tokens,), device=device, generator=g)
    digits = torch.rand(tokens, device=device, generator=g) < 0.4
    labels = torch.where(digits, first + labels % 10, labels)
    labels[:: max(1, tokens // 7)] = -100
    hidden = torch.randn(tokens, width, device=device, generator=g).to(dtype)
    weight = (torch.randn(size, width, device=device, generator=g) / width**0.5).to(dtype)
    logits = hidden @ weight.t()
    return Problem(vocab, labels, hidden, weight, logits, chunk)


def _block_rows(tokens: int, size: int) -> int:
    """Rows per float64 reference block: about 512 MiB of logits (autograd keeps a few such buffers)."""
    return max(1, min(tokens, (512 << 20) // (8 * size)))


def _objective(z64: torch.Tensor, labels: torch.Tensor, p: Problem, options: dict, n_valid: int, n_num: int):
    ce, ntl, _ = dense_per_token(z64, labels, p.vocab.ids, p.vocab.values, **options)
    return ce.sum() / n_valid + NTL_WEIGHT * ntl.sum() / max(n_num, 1)


class Errors:
    """Largest |got - ref| and |ref| per named gradient, accumulated block by block."""

    def __init__(self) -> None:
        self.diff: dict[str, float] = {}
        self.scale: dict[str, float] = {}

    def add(self, name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        d = float((got.double() - ref).abs().max()) if ref.numel() else 0.0
        s = float(ref.abs().max()) if ref.numel() else 0.0
        self.diff[name] = max(self.diff.get(name, 0.0), d)
        self.scale[name] = max(self.scale.get(name, 0.0), s)

    def relative(self) -> dict[str, float]:
        return {k: self.diff[k] / (self.scale[k] or 1.0) for k in self.diff}


def reference_fused(p: Problem, options: dict, grads: list[torch.Tensor]) -> tuple[float, dict[str, float]]:
    """float64 loss of the logits and each ``grads`` entry's relative error, block by block."""
    n_valid, n_num = p.counts
    tokens, size = p.logits.shape
    rows = _block_rows(tokens, size)
    total = 0.0
    errors = [Errors() for _ in grads]
    for start in range(0, tokens, rows):
        sl = slice(start, start + rows)
        z64 = p.logits[sl].double().requires_grad_()
        part = _objective(z64, p.labels[sl], p, options, n_valid, n_num)
        part.backward()
        total += float(part.detach())
        for err, g in zip(errors, grads):
            err.add("logits", g[sl], z64.grad)
        del z64, part
    return total, [err.relative() for err in errors]


def reference_chunked(p: Problem, options: dict, grads: list[tuple[torch.Tensor, torch.Tensor]]):
    """float64 loss from hidden states and weight, and each (hidden, weight) gradient pair's errors."""
    n_valid, n_num = p.counts
    tokens, size = p.logits.shape
    rows = _block_rows(tokens, size)
    w64 = p.weight.double().requires_grad_()
    total = 0.0
    errors = [Errors() for _ in grads]
    for start in range(0, tokens, rows):
        sl = slice(start, start + rows)
        h64 = p.hidden[sl].double().requires_grad_()
        part = _objective(h64 @ w64.t(), p.labels[sl], p, options, n_valid, n_num)
        part.backward()
        total += float(part.detach())
        for err, (gh, _) in zip(errors, grads):
            err.add("hidden", gh[sl], h64.grad)
        del h64, part
    for err, (_, gw) in zip(errors, grads):
        err.add("weight", gw, w64.grad)
    return total, [err.relative() for err in errors]


def run_fused(p: Problem, options: dict, impl: str, inplace: bool) -> tuple[float, torch.Tensor]:
    z = p.logits.detach().clone().requires_grad_()
    work = z * 1 if inplace else z  # in place needs a non-leaf buffer the op may overwrite
    out = ntl_scale.ce_with_ntl(work, p.labels, p.vocab, ntl_weight=NTL_WEIGHT, inplace=inplace, impl=impl, **options)
    out.loss.backward()
    return float(out.loss.detach()), z.grad


def run_chunked(p: Problem, options: dict, impl: str) -> tuple[float, tuple[torch.Tensor, torch.Tensor]]:
    h, w = (t.detach().clone().requires_grad_() for t in (p.hidden, p.weight))
    out = ntl_scale.linear_ce_with_ntl(
        h, w, p.labels, p.vocab, ntl_weight=NTL_WEIGHT, chunk_tokens=p.chunk_tokens, impl=impl, **options
    )
    out.loss.backward()
    return float(out.loss.detach()), (h.grad, w.grad)


def _max_rel_diff(a, b) -> float:
    pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
    return max(float((x.double() - y.double()).abs().max()) / (float(y.double().abs().max()) or 1.0) for x, y in pairs)


def check_case(shape: str, dtype_name: str, op: str, variant: str, inplace: bool, impls: list[str], device: str):
    """The rows of one case: each impl against float64, the Triton row also against the PyTorch row."""
    p = make_problem(shape, DTYPES[dtype_name], device)
    options = VARIANTS[variant]
    tol_loss, tol_grad = TOLERANCE[(op, dtype_name)]
    tokens, size, width, chunk, _ = SHAPES[shape]
    mode = ("in place" if inplace else "out of place") if op == "fused" else f"chunks of {chunk or 'default'}"
    base = f"{'ce_with_ntl' if op == 'fused' else 'linear_ce_with_ntl'} {dtype_name} {variant} {mode} {shape}"
    got: dict[str, tuple[float, object, float]] = {}
    for impl in impls:
        start = time.perf_counter()
        if op == "fused":
            loss, grad = run_fused(p, options, impl, inplace)
        else:
            loss, grad = run_chunked(p, options, impl)
        if device == "cuda":
            torch.cuda.synchronize()
        got[impl] = (loss, grad, time.perf_counter() - start)
    start = time.perf_counter()
    if op == "fused":
        ref, rel = reference_fused(p, options, [got[i][1] for i in impls])
    else:
        ref, rel = reference_chunked(p, options, [got[i][1] for i in impls])
    ref_seconds = time.perf_counter() - start
    rows = []
    for impl, errors in zip(impls, rel):
        loss, grad, seconds = got[impl]
        loss_err = abs(loss - ref) / abs(ref)
        grad_err = max(errors.values())
        ok = loss_err <= tol_loss and grad_err <= tol_grad and all(v == v for v in (loss, *errors.values()))
        row = {
            "name": f"{base} impl={impl}",
            "status": "ok" if ok else "FAILED",
            "shape": [tokens, size, width],
            "loss": loss,
            "loss_ref": ref,
            "loss_err": loss_err,
            "grad_err": grad_err,
            "grad_errs": errors,
            "tolerance": {"loss": tol_loss, "grad": tol_grad},
            "seconds": round(seconds, 3),
            "reference_seconds": round(ref_seconds, 3),
        }
        if impl == "triton" and "torch" in got:
            row["vs_torch"] = {
                "loss": abs(loss - got["torch"][0]) / abs(ref),
                "grad": _max_rel_diff(grad, got["torch"][1]),
            }
        rows.append(row)
    return rows


def cases(shapes: list[str]):
    for shape in shapes:
        for dtype_name in SHAPES[shape][4]:
            for variant in VARIANTS:
                if shape == "large" and variant != "was":
                    yield shape, dtype_name, "fused", variant, False  # reweigh at size: the fused op only
                    continue
                yield shape, dtype_name, "fused", variant, False
                if dtype_name == "fp32":
                    yield shape, dtype_name, "fused", variant, True  # in place reuses an fp32 buffer
                yield shape, dtype_name, "chunked", variant, False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="JSON-lines file the rows are appended to")
    parser.add_argument("--shapes", default="test,large", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}: choose from {', '.join(SHAPES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU visible to torch (use --device cpu with TRITON_INTERPRET=1)")
    probe = torch.empty(1, device=args.device)
    impls = ["triton", "torch"] if triton_ce_ntl.triton_available() and triton_ce_ntl.runs_on(probe) else ["torch"]
    failed = 0
    out = Path(args.json)
    with out.open("a") as f:
        if impls == ["torch"]:
            row = {"name": "Triton kernels", "status": "FAILED", "detail": "impl='triton' cannot run here"}
            f.write(json.dumps(row) + "\n")
            failed += 1
        for case in cases(shapes):
            try:
                rows = check_case(*case, impls=impls, device=args.device)
            except Exception as e:  # a crash is a failed row with its reason, the next case still runs
                rows = [{"name": " ".join(map(str, case)), "status": "FAILED", "detail": _short(e)}]
            for row in rows:
                failed += row["status"] != "ok"
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(_line(row), flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return 1 if failed else 0


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400] + " | " + traceback.format_exc(limit=-2).replace("\n", " ")[-400:]


def _line(row: dict) -> str:
    if "loss_err" not in row:
        return f"{row['status']:6} {row['name']}: {row.get('detail', '')}"
    tol = row["tolerance"]
    return (
        f"{row['status']:6} {row['name']}: loss err {row['loss_err']:.2e} (tol {tol['loss']:.0e}), "
        f"grad err {row['grad_err']:.2e} (tol {tol['grad']:.0e}), {row['seconds']:.2f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
