"""``benchmarks/bench_peers.py --quick`` runs and its rows agree (a smoke test: no timing is asserted).

1. Every variant of the benchmark (ours on logits and from hidden states; Megatron's, DeepSpeed's,
   torch's ``loss_parallel`` and torchtitan's vocab-parallel CE; torch's and DeepSpeed's chunked
   linear CE) appears in the table at tiny sizes, TP 1 and 2, fp32 and bf16, except the compiled
   rows (``tests/unit/test_compile.py`` covers those).
2. The CE column of every row equals that of the first row of its configuration: the CE-only peers
   are independent implementations (torch, Megatron, DeepSpeed, torchtitan), so ours' CE is checked
   against them; ours' loss (CE + 0.3 NTL) is above its CE.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_peers.py"


def test_bench_peers_quick_runs_and_the_losses_agree():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows: dict[tuple[str, str, str], list[tuple[str, float, float]]] = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 13 and cells[0] in ("logits", "hidden"):
            assert not cells[5].startswith("not run"), line  # every peer is installed here
            rows.setdefault((cells[0], cells[1], cells[2]), []).append(
                (cells[4].replace(" **(fastest CE)**", ""), float(cells[11]), float(cells[12]))
            )
    names = {name for group in rows.values() for name, _, _ in group}
    for expected in (
        "ours: ce_with_ntl, inplace=True", "ours: ce_with_ntl", "Megatron vocab_parallel_cross_entropy (in place)",
        "DeepSpeed vocab_parallel_cross_entropy", "torch loss_parallel() on Shard(-1) DTensor",
        "torchtitan vocab-parallel CE", "F.cross_entropy", "ours: linear_ce_with_ntl",
        "torch F.linear_cross_entropy chunked", "DeepSpeed vocab_parallel_linear_cross_entropy",
        "torch F.linear_cross_entropy, no options (materialised)",
    ):  # fmt: skip
        assert expected in names, sorted(names)
    for (family, size, dtype), group in rows.items():
        tolerance = 2e-2 if dtype == "bf16" else 1e-4  # bf16: some peers return the loss in bf16
        first_ce = group[0][2]
        for name, loss, ce in group:
            assert abs(ce - first_ce) <= tolerance * abs(first_ce), (family, size, dtype, name, ce, first_ce)
            if name.startswith("ours"):
                assert loss > ce, (name, loss, ce)  # + 0.3 NTL, and NTL > 0 on these labels
            else:
                assert loss == ce, (name, loss, ce)
    assert "ours' losses agree: yes" in done.stdout
