"""The fused CE + NTL op in place, from the checkout given: median wall and CPU time of 5 steps.

    python benchmarks/ab_fused_inplace.py /path/to/checkout_a   # alternate with checkout_b, a fresh process each

4096 x 32768 fp32 logits (30 % digit labels), 2 threads, one warm-up step. Meant for before/after
comparisons of two checkouts on the same machine state (docs/benchmarks.md used it with both cores
busy, to show what the number of parallel regions costs under load).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

checkout = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, checkout)
import ntl_scale  # noqa: E402

if not os.path.abspath(ntl_scale.__file__).startswith(checkout):
    raise SystemExit(f"imported {ntl_scale.__file__}, not the checkout {checkout}")
torch.set_num_threads(2)
T, V = 4096, 32768
vocab = ntl_scale.NumberVocab.from_id_to_token([str(d) for d in range(10)] + [f"w{i}" for i in range(10, V)])
g = torch.Generator().manual_seed(0)
labels = torch.randint(10, V, (T,), generator=g)
digits = torch.rand(T, generator=g) < 0.3
labels[digits] = torch.randint(0, 10, (int(digits.sum()),), generator=g)
labels[:7] = -100
source = torch.randn(T, V, generator=torch.Generator().manual_seed(1))
wall, cpu = [], []
for step in range(6):
    x = source.clone().requires_grad_()
    w0, c0 = time.perf_counter(), time.process_time()
    ntl_scale.ce_with_ntl(x, labels, vocab, ntl_weight=0.3, inplace=True).loss.backward()
    if step:
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
print(f"{checkout}: wall {statistics.median(wall):.3f} s, CPU {statistics.median(cpu):.3f} s")
