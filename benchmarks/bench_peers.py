"""CE + NTL (ours) against the CE-only kernels a user would otherwise pick: one run, one table.

Two families of inputs, each built from the same seeds for every variant and TP size:

* **logits** ``[T, V/tp]`` fp32 or bf16, one vocab shard per rank (the output layer already ran):
  ours ``ce_with_ntl`` (the fused CE + 0.3 NTL-WAS op, ``tp_group`` = the shard's group) in place
  (Megatron's memory model: the logits buffer becomes the gradient) and not in place, and under
  ``torch.compile``; CE-only peers: Megatron's ``vocab_parallel_cross_entropy`` (in place),
  DeepSpeed's ``deepspeed.sequence.cross_entropy.vocab_parallel_cross_entropy``, torch's
  ``loss_parallel()`` on ``Shard(-1)`` DTensor logits, torchtitan's vocab-parallel CE
  (``torchtitan.components.loss._LossParallelCrossEntropy``, what its ``cross_entropy_loss`` runs
  under TP), and at TP 1 ``F.cross_entropy``.
* **hidden** states ``[T, H]`` and the output weight ``[V/tp, H]`` (no logits are materialised):
  ours ``linear_ce_with_ntl`` (chunked; at TP 2 the hidden gradient is all-reduced after the
  backward, as the column-parallel output layer does, so that it does the work DeepSpeed's op does
  inside) and under ``torch.compile``; CE-only chunked peers: torch's ``F.linear_cross_entropy``
  with ``options=torch.nn.LinearCrossEntropyOptions(...)`` (TP 1: it has no rule for a vocab-sharded
  weight) and DeepSpeed's ``vocab_parallel_linear_cross_entropy``, all at the same tokens per chunk
  (``--chunk``, so at comparable memory) and, marked "default", at each op's own default chunk; and
  as context ``F.linear_cross_entropy`` without options (materialised logits).

Each variant runs in fresh processes (``tp`` of them over gloo, ``BENCH_THREADS`` / ``tp`` torch
threads each); the variants take turns over ``--repeats``, except the slow context rows (compiled,
default chunks, materialised: at fp32 and TP 1 only), measured in the first turn. Per process:
``--warmup`` untimed steps (``torch.compile`` compiles there), then ``--steps`` timed forward +
backward steps. Time: wall clock on rank 0, median over all timed steps of all repeats; CPU: this
process's CPU time (all threads) for the same steps, which other jobs on a shared machine disturb
less. Memory: the rise of
rank 0's peak resident set during the timed steps over what it held before them (inputs allocated,
Linux ``clear_refs`` resets the peak), so it counts the loss's own buffers and the gradients it
makes. Ratios are to the fastest CE-only peer of the same configuration (the fastest *chunked* one
for the hidden family; the materialised row is context). The CE values must agree across the rows
and the TP sizes of a configuration (and ours' losses among themselves): the run fails otherwise.

    python benchmarks/bench_peers.py                    # the full grid (about 25 minutes on 2 shared cores)
    python benchmarks/bench_peers.py --quick            # tiny sizes, every variant but the compiled ones;
                                                        # checks the rows run and agree (no timing claim)
    python benchmarks/bench_peers.py --configs logits:8192x32768:fp32:2 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))
from common import peak_rss_mib, reset_peak_rss  # noqa: E402

NTL_WEIGHT = 0.3
# name: (family, label, kind); kind "ours" = CE + NTL, "peer" = CE only, "context" = CE only, not chunked
VARIANTS: dict[str, tuple[str, str, str]] = {
    "ours_fused_inplace": ("logits", "ours: ce_with_ntl, inplace=True", "ours"),
    "ours_fused": ("logits", "ours: ce_with_ntl", "ours"),
    "ours_fused_compiled": ("logits", "ours: ce_with_ntl, torch.compile", "ours"),
    "megatron": ("logits", "Megatron vocab_parallel_cross_entropy (in place)", "peer"),
    "deepspeed": ("logits", "DeepSpeed vocab_parallel_cross_entropy", "peer"),
    "loss_parallel": ("logits", "torch loss_parallel() on Shard(-1) DTensor", "peer"),
    "torchtitan": ("logits", "torchtitan vocab-parallel CE", "peer"),
    "torch_ce": ("logits", "F.cross_entropy", "peer"),
    "ours_chunked": ("hidden", "ours: linear_ce_with_ntl", "ours"),
    "ours_chunked_compiled": ("hidden", "ours: linear_ce_with_ntl, torch.compile", "ours"),
    "ours_chunked_default": ("hidden", "ours: linear_ce_with_ntl, default chunk", "ours"),
    "torch_chunked": ("hidden", "torch F.linear_cross_entropy chunked", "peer"),
    "torch_chunked_default": ("hidden", "torch F.linear_cross_entropy chunked, default chunk", "peer"),
    "ds_linear": ("hidden", "DeepSpeed vocab_parallel_linear_cross_entropy", "peer"),
    "ds_linear_default": ("hidden", "DeepSpeed vocab_parallel_linear_cross_entropy, default chunk", "peer"),
    "torch_linear_ce": ("hidden", "torch F.linear_cross_entropy, no options (materialised)", "context"),
}
TP1_ONLY = {"torch_ce", "torch_chunked", "torch_chunked_default", "torch_linear_ce", "ours_chunked_compiled",
            "ours_fused_compiled"}  # fmt: skip
COMPILED = {"ours_fused_compiled", "ours_chunked_compiled"}
DEFAULT_CHUNK = {"ours_chunked_default", "torch_chunked_default", "ds_linear_default"}
# rows measured in the first turn only (slow, and context for the targets): the compiled ones (whose
# warm-up compiles), each chunked op at its own default chunk, the materialised logits
ONCE = COMPILED | DEFAULT_CHUNK | {"torch_linear_ce"}


@dataclass(frozen=True)
class Config:
    """One configuration: ``family:TxV[xH]:dtype:tp``; ``chunk`` tokens per chunk for the hidden family."""

    family: str
    tokens: int
    vocab: int
    hidden: int
    dtype: str
    tp: int
    chunk: int

    @classmethod
    def parse(cls, text: str, chunk: int) -> Config:
        family, size, dtype, tp = text.split(":")
        dims = [int(x) for x in size.split("x")]
        if family not in ("logits", "hidden") or dtype not in ("fp32", "bf16") or len(dims) != 2 + (family == "hidden"):
            raise SystemExit(f"bad configuration {text!r}: want logits:TxV:fp32|bf16:TP or hidden:TxVxH:fp32|bf16:TP")
        return cls(family, dims[0], dims[1], dims[2] if family == "hidden" else 0, dtype, int(tp), chunk)

    @property
    def size(self) -> str:
        return f"{self.tokens} x {self.vocab}" + (f" x {self.hidden}" if self.hidden else "")

    def variants(self, names: list[str]) -> list[str]:
        def applies(name: str) -> bool:
            if VARIANTS[name][0] != self.family or (self.tp > 1 and name in TP1_ONLY):
                return False
            if name == "ours_fused_inplace" and self.dtype != "fp32":  # in place needs fp32 logits
                return False
            return name not in ONCE or (self.dtype == "fp32" and self.tp == 1)  # the slow rows at one size

        return [n for n in names if applies(n)]


FULL = [
    "logits:4096x32768:fp32:1", "logits:4096x32768:fp32:2", "logits:2048x128256:bf16:2",
    "hidden:2048x32768x512:fp32:1", "hidden:2048x32768x512:fp32:2", "hidden:2048x32768x512:bf16:1",
]  # fmt: skip
# every variant at least once, TP 1 and 2, fp32 and bf16, in four pairs of processes
QUICK = ["logits:256x4096:fp32:1", "logits:256x4096:bf16:2", "hidden:256x4096x64:fp32:1", "hidden:256x4096x64:bf16:2"]


def _halves(shape_of_half: tuple[int, ...], dim: int, rank: int, tp: int, seed: int) -> torch.Tensor:
    """This rank's part of a tensor made of two seeded halves along ``dim`` (the same data at TP 1 and 2)."""
    halves = [torch.randn(*shape_of_half, generator=torch.Generator().manual_seed(seed + i)) for i in range(2)]
    per_rank = 2 // tp
    return torch.cat(halves[rank * per_rank : (rank + 1) * per_rank], dim=dim)


def _labels(tokens: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(10, vocab, (tokens,), generator=g)
    digits = torch.rand(tokens, generator=g) < 0.3  # 30 % number tokens (the digits, ids 0-9)
    labels[digits] = torch.randint(0, 10, (int(digits.sum()),), generator=g)
    labels[:7] = -100  # a few ignored positions, as after packing
    return labels


def _step_fn(name: str, cfg: Config, rank: int, group, labels: torch.Tensor):
    """A function ``(inputs) -> (loss, ce)`` for one variant; its forward + backward is what is timed."""
    import torch.nn.functional as F

    import ntl_scale

    vocab = ntl_scale.NumberVocab.from_id_to_token(
        [str(d) for d in range(10)] + [f"w{i}" for i in range(10, cfg.vocab)]
    )
    tp_group = group if cfg.tp > 1 else None
    width = cfg.vocab // cfg.tp
    start, end = rank * width, (rank + 1) * width
    valid = (labels != -100).sum()

    if name.startswith("ours_fused"):
        inplace = name == "ours_fused_inplace"

        def fused(x):
            return ntl_scale.ce_with_ntl(x, labels, vocab, ntl_weight=NTL_WEIGHT, tp_group=tp_group, inplace=inplace)

        fn = torch.compile(fused, fullgraph=True) if name in COMPILED else fused

        def step(x):
            out = fn(x)
            out.loss.backward()
            return out.loss, out.ce

        return step
    if name == "megatron":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        def step(x):
            loss = vocab_parallel_cross_entropy(x.unsqueeze(1), labels.unsqueeze(1)).squeeze(1)
            loss = (loss * (labels != -100)).sum() / valid  # Megatron's loss mask
            loss.backward()
            return loss, loss

        return step
    if name == "deepspeed":
        from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy as ds_ce

        def step(x):  # the shard bounds given: no validation collective per call
            loss = ds_ce(x, labels, tp_group=tp_group, vocab_start_index=start, vocab_end_index=end,
                         global_vocab_size=cfg.vocab)  # fmt: skip
            loss.backward()
            return loss, loss

        return step
    if name == "loss_parallel":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.parallel import loss_parallel

        mesh = init_device_mesh("cpu", (cfg.tp,))
        target = DTensor.from_local(labels, mesh, [Replicate()])

        def step(x):
            with loss_parallel():
                loss = F.cross_entropy(DTensor.from_local(x, mesh, [Shard(1)]), target)
                loss.backward()
            loss = loss.full_tensor()
            return loss, loss

        return step
    if name == "torchtitan":
        from torchtitan.components.loss import _LossParallelCrossEntropy

        def step(x):
            loss = _LossParallelCrossEntropy.apply(x, labels, group, cfg.vocab, "sum") / valid
            loss.backward()
            return loss, loss

        return step
    if name == "torch_ce":

        def step(x):
            loss = F.cross_entropy(x.float(), labels)
            loss.backward()
            return loss, loss

        return step

    # hidden family: x = (hidden, weight shard)
    if name.startswith("ours_chunked"):
        chunk = None if name == "ours_chunked_default" else cfg.chunk

        def chunked(h, w):
            return ntl_scale.linear_ce_with_ntl(
                h, w, labels, vocab, ntl_weight=NTL_WEIGHT, tp_group=tp_group, chunk_tokens=chunk
            )

        fn = torch.compile(chunked, fullgraph=True) if name in COMPILED else chunked

        def step(x):
            out = fn(*x)
            out.loss.backward()
            if tp_group is not None:  # the column-parallel output layer's input-gradient all-reduce
                dist.all_reduce(x[0].grad, group=tp_group)
            return out.loss, out.ce

        return step
    if name.startswith("torch_chunked"):
        options = (
            torch.nn.LinearCrossEntropyOptions()
            if name.endswith("default")
            else torch.nn.LinearCrossEntropyOptions(batch_chunk_size=cfg.chunk, chunking_method=None)
        )

        def step(x):
            loss = F.linear_cross_entropy(x[0], x[1], labels, options=options)
            loss.backward()
            return loss, loss

        return step
    if name.startswith("ds_linear"):
        from deepspeed.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy

        chunk = None if name.endswith("default") else cfg.chunk

        def step(x):
            loss = vocab_parallel_linear_cross_entropy(x[0], x[1], labels, tp_group=tp_group, vocab_start_index=start,
                                                       vocab_end_index=end, chunk_size=chunk)  # fmt: skip
            loss.backward()
            return loss, loss

        return step
    if name == "torch_linear_ce":

        def step(x):
            loss = F.linear_cross_entropy(x[0], x[1], labels)
            loss.backward()
            return loss, loss

        return step
    raise ValueError(name)


def _worker(rank: int, cfg: Config, names: list[str], port: int, warmup: int, steps: int, out_path: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(max(1, int(os.environ.get("BENCH_THREADS", "2")) // cfg.tp))
    from launch.startup import init_distributed

    init_distributed(rank=rank, world_size=cfg.tp, backend="gloo", init_method=f"tcp://127.0.0.1:{port}")
    group = dist.group.WORLD
    if "megatron" in names:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.tp)
    if cfg.tp > 1 and any(n.startswith(("deepspeed", "ds_")) for n in names):  # deepspeed.comm for its group
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]
    labels = _labels(cfg.tokens, cfg.vocab)
    if cfg.family == "logits":
        source = _halves((cfg.tokens, cfg.vocab // 2), 1, rank, cfg.tp, seed=1).to(dtype)
    else:
        scale = cfg.hidden**-0.25  # logits of unit scale
        hidden = (torch.randn(cfg.tokens, cfg.hidden, generator=torch.Generator().manual_seed(1)) * scale).to(dtype)
        weight = (_halves((cfg.vocab // 2, cfg.hidden), 0, rank, cfg.tp, seed=2) * scale).to(dtype)
    results = {}
    for name in names:
        try:
            step = _step_fn(name, cfg, rank, group, labels)
        except ImportError as error:  # a peer that is not installed: its row says so
            results[name] = {"skipped": f"{type(error).__name__}: {error}"}
            continue

        def inputs():
            if cfg.family == "logits":  # a fresh buffer each step: in-place variants overwrite it
                return source.clone().requires_grad_()
            return hidden.detach().requires_grad_(), weight.detach().requires_grad_()

        for _ in range(warmup):
            step(inputs())
        times, cpu, peak, loss, ce = [], [], 0.0, 0.0, 0.0
        for _ in range(steps):
            x = inputs()
            dist.barrier(group=group)
            base = reset_peak_rss()
            wall0, cpu0 = time.perf_counter(), time.process_time()
            loss_t, ce_t = step(x)
            times.append(time.perf_counter() - wall0)
            cpu.append(time.process_time() - cpu0)
            peak = max(peak, peak_rss_mib() - base)
            loss, ce = float(loss_t), float(ce_t)
            del x, loss_t, ce_t
        results[name] = {"time_s": times, "cpu_s": cpu, "peak_mib": peak, "loss": loss, "ce": ce}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    if "megatron" in names:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    # Everything is written and the group is gone. At interpreter exit a TP worker that loaded
    # DeepSpeed's shared-memory comm op can abort in C++ static destructors ("terminate called without
    # an active exception", SIGABRT; seen once in a loaded test run): leave without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cfg: Config, names: list[str], warmup: int, steps: int) -> dict:
    """Runs ``names`` one after another in ``cfg.tp`` fresh processes; rank 0's results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        args = (cfg, names, _free_port(), warmup, steps, out)
        mp.start_processes(_worker, args=args, nprocs=cfg.tp, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def _tolerance(cfg: Config) -> float:
    # fp32: the same fp32 math in another order. bf16: some peers return the loss in bf16 (loss_parallel,
    # F.linear_cross_entropy; a bf16 step at 9 is 0.06) and the chunked ops round the logits of their
    # bf16 matmuls differently (to bf16, or kept in fp32)
    return 2e-2 if cfg.dtype == "bf16" else 1e-4


def _check_agreement(rows: dict[Config, dict[str, dict]]) -> list[str]:
    """CE of every row equals the first row's (and across TP sizes); ours' losses agree among themselves."""
    problems = []
    reference: dict[tuple, tuple[str, float, float]] = {}
    for cfg, results in rows.items():
        key = (cfg.family, cfg.size, cfg.dtype)
        ours_loss = None
        for name, r in results.items():
            if "skipped" in r:
                continue
            if key not in reference:
                reference[key] = (f"{name} at TP {cfg.tp}", r["ce"], r["loss"])
            ref_name, ref_ce, _ = reference[key]
            tol = _tolerance(cfg)
            if not abs(r["ce"] - ref_ce) <= tol * max(1.0, abs(ref_ce)):
                problems.append(
                    f"{cfg.size} {cfg.dtype} TP {cfg.tp}: CE of {name} {r['ce']:.6f} != {ref_name} {ref_ce:.6f}"
                )
            if VARIANTS[name][2] == "ours":
                ours_loss = r["loss"] if ours_loss is None else ours_loss
                if not abs(r["loss"] - ours_loss) <= tol * max(1.0, abs(ours_loss)):
                    problems.append(
                        f"{cfg.size} {cfg.dtype} TP {cfg.tp}: loss of {name} {r['loss']:.6f} != {ours_loss:.6f}"
                    )
    return problems


def _summary(runs: list[dict]) -> dict:
    if "skipped" in runs[0]:
        return runs[0]
    times = [t for r in runs for t in r["time_s"]]
    cpu = [t for r in runs for t in r["cpu_s"]]
    return {"time_s": statistics.median(times), "cpu_s": statistics.median(cpu),
            "peak_mib": statistics.median(r["peak_mib"] for r in runs), "loss": runs[0]["loss"], "ce": runs[0]["ce"],
            "n": len(times)}  # fmt: skip


def overwrites_input(name: str, cfg: Config) -> bool:
    """Whether the variant overwrites its logits buffer (so the caller cannot read them afterwards):
    ours with ``inplace=True``, and Megatron's CE on fp32 logits (on half-precision logits it works on
    an fp32 copy)."""
    return name == "ours_fused_inplace" or (name == "megatron" and cfg.dtype == "fp32")


def _reference(cfg: Config, results: dict[str, dict], intact: bool = False) -> str:
    """The fastest CE-only peer of the configuration (chunked ones for the hidden family); with
    ``intact``, the fastest of those that leave the logits intact."""
    peers = [n for n in results if VARIANTS[n][2] == "peer" and "skipped" not in results[n]]
    if intact:
        peers = [n for n in peers if not overwrites_input(n, cfg)] or peers
    return min(peers, key=lambda n: results[n]["time_s"])


def print_table(rows: dict[Config, dict[str, dict]]) -> None:
    columns = "input | T x V (x H) | dtype | TP | variant | time (s) | x fastest CE | CPU (s) | x | peak (MiB) | x"
    print(f"| {columns} | loss | CE |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cfg, results in rows.items():
        ref = results[_reference(cfg, results)]
        for name, r in results.items():
            if "skipped" in r:
                print(f"| {cfg.family} | {cfg.size} | {cfg.dtype} | {cfg.tp} | {VARIANTS[name][1]} | not run: "
                      f"{r['skipped']} | | | | | | | |")  # fmt: skip
                continue
            label = VARIANTS[name][1] + (" **(fastest CE)**" if r is ref else "")
            peak_ratio = f"{r['peak_mib'] / ref['peak_mib']:.2f}" if ref["peak_mib"] >= 1 else "-"
            print(
                f"| {cfg.family} | {cfg.size} | {cfg.dtype} | {cfg.tp} | {label} | {r['time_s']:.3f} | "
                f"{r['time_s'] / ref['time_s']:.2f} | {r['cpu_s']:.3f} | {r['cpu_s'] / ref['cpu_s']:.2f} | "
                f"{r['peak_mib']:.0f} | {peak_ratio} | {r['loss']:.4f} | {r['ce']:.4f} |"
            )


def print_targets(rows: dict[Config, dict[str, dict]]) -> None:
    """Issue 32's targets: chunked <= 1.0x time at <= 1.05x peak; fused on shards <= 1.05x time at <= peak."""
    print("\nTargets (against the fastest CE-only peer of each configuration; ours not in place against the "
          "fastest that leaves its logits intact):")  # fmt: skip
    for cfg, results in rows.items():
        ours = ["ours_chunked"] if cfg.family == "hidden" else ["ours_fused_inplace", "ours_fused"]
        for name in (n for n in ours if n in results and "skipped" not in results[n]):
            ref_name = _reference(cfg, results, intact=not overwrites_input(name, cfg))
            ref, r = results[ref_name], results[name]
            t = r["time_s"] / ref["time_s"]
            t_max, m_max = (1.0, 1.05) if cfg.family == "hidden" else (1.05, 1.0)
            # below 1 MiB a peak is noise: compared in MiB then, as a ratio above
            m_ok = r["peak_mib"] <= ref["peak_mib"] + 1 or r["peak_mib"] <= m_max * ref["peak_mib"]
            ratio = f"{r['peak_mib'] / ref['peak_mib']:.2f}x" if ref["peak_mib"] >= 1 else "-"
            verdict = "met" if t <= t_max and m_ok else "NOT met"
            print(
                f"- {cfg.family} {cfg.size} {cfg.dtype} TP {cfg.tp}: {VARIANTS[name][1]} vs {VARIANTS[ref_name][1]}: "
                f"time {t:.2f}x (<= {t_max}), CPU {r['cpu_s'] / ref['cpu_s']:.2f}x, peak {r['peak_mib']:.0f} vs "
                f"{ref['peak_mib']:.0f} MiB ({ratio}, <= {m_max}x): {verdict}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(FULL), help="family:TxV[xH]:fp32|bf16:TP, comma separated")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma separated (default: all)")
    parser.add_argument("--chunk", type=int, default=512, help="tokens per chunk of the chunked rows")
    parser.add_argument("--repeats", type=int, default=3, help="turns; each variant gets a fresh process per turn")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per process")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process")
    parser.add_argument("--markdown", help="write the table so far to this file after each turn")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, one process per configuration, no compiled rows"
    )
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.quick:
        args.configs = ",".join(QUICK) if args.configs == ",".join(FULL) else args.configs
        args.chunk, args.repeats, args.warmup, args.steps = 64, 1, 0, 1
        names = [n for n in names if n not in COMPILED]
    configs = [Config.parse(text, args.chunk) for text in args.configs.split(",")]
    versions = _versions()
    load_before = os.getloadavg()
    started = time.time()
    print(
        f"{platform.machine()}, {os.cpu_count()} cores, {versions}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{args.repeats} turns x {args.steps} timed steps after {args.warmup} warm-up; chunk {args.chunk} tokens; "
        f"load average before {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f}",
        flush=True,
    )
    runs: dict[Config, dict[str, list[dict]]] = {cfg: {n: [] for n in cfg.variants(names)} for cfg in configs}
    for turn in range(args.repeats):
        for cfg in configs:
            if args.quick:  # a smoke test: every variant of a configuration in one process
                for name, result in run(cfg, list(runs[cfg]), args.warmup, args.steps).items():
                    runs[cfg][name].append(result)
                continue
            for name in runs[cfg]:
                if turn == 0 or name not in ONCE:
                    runs[cfg][name].append(run(cfg, [name], args.warmup, args.steps)[name])
        print(f"turn {turn + 1}/{args.repeats} done after {time.time() - started:.0f} s", file=sys.stderr, flush=True)
        if args.markdown:  # what is finished so far, so that a run cut short keeps it
            with open(args.markdown, "w") as f, contextlib.redirect_stdout(f):
                print(f"after turn {turn + 1} of {args.repeats}, {time.time() - started:.0f} s\n")
                print_table({cfg: {n: _summary(r) for n, r in by_name.items()} for cfg, by_name in runs.items()})
    rows = {cfg: {n: _summary(r) for n, r in by_name.items()} for cfg, by_name in runs.items()}
    load_after = os.getloadavg()
    print(f"wall time of the run {time.time() - started:.0f} s; load average after "
          f"{load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f}\n")  # fmt: skip
    print_table(rows)
    print_targets(rows)
    problems = _check_agreement(rows)
    print("\nCE agrees across every row and TP size of each configuration; ours' losses agree: "
          + ("yes" if not problems else "NO"))  # fmt: skip
    if problems:
        raise SystemExit("\n".join(problems))


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("torch", "deepspeed", "megatron-core", "torchtitan"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


if __name__ == "__main__":
    main()
