"""Packaging: ``import ntl_scale`` needs only torch; the README's two commands are what CI runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_needs_only_torch():
    blocked = ["transformers", "tokenizers", "sentencepiece", "deepspeed", "megatron", "wandb", "ntloss", "numpy"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # any import of it now fails\n"
        "import ntl_scale\n"
        "v = ntl_scale.NumberVocab.from_id_to_token([str(d) for d in range(10)] + ['x'])\n"
        "import torch\n"
        "print(float(ntl_scale.number_token_loss(torch.zeros(2, 11), torch.tensor([0, 10]), v)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert float(out.stdout.strip()) == 4.5  # uniform over 0..9, true 0: mean |k - 0| = 4.5


def test_readme_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
    assert "\nmake run\n" in readme and "\nmake test\n" in readme


def test_gpu_check_asks_for_its_output_folder():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--out DIR is required" in done.stderr, done.stderr
