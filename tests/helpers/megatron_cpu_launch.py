"""Runs a megatron.core script on CPU: applies the test suite's CUDA patches, then runs the script.

    torchrun --nproc_per_node 2 tests/helpers/megatron_cpu_launch.py launch/megatron_example.py --tp 2 ...

Test-only, like the patches themselves (``tests/helpers/megatron_cpu.py``).
"""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# This file's folder holds tests/helpers/tokenizers.py, which must not shadow the real package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, ROOT)

from tests.helpers.megatron_cpu import patch_for_cpu  # noqa: E402

patch_for_cpu()
script, *arguments = sys.argv[1:]
sys.argv = [script, *arguments]
from launch.finish import run_then_leave  # noqa: E402

run_then_leave(lambda: runpy.run_path(script, run_name="__main__"))
