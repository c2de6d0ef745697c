"""``launch/pretrain_gpt_ntl.py`` with Megatron-LM's dataset helpers taken prebuilt, never built with ``make``.

    MEGATRON_LM_PATH=/path/to/Megatron-LM torchrun --standalone --nproc_per_node 1 \\
        scripts/megatron_prebuilt_helpers.py <pretrain_gpt.py and --ntl-* arguments>

Megatron-LM's ``initialize_megatron`` (``megatron/training/initialize.py``, ``_compile_dependencies``) calls
``megatron.core.datasets.utils.compile_helpers`` on rank 0 whatever the data, mock data included, and that
runs ``make -C megatron/core/datasets`` (which needs ``make``, a C++ compiler, pybind11 and ``python3-config``).
The GPU machine is not known to have ``make``; ``scripts/gpu_wheels.sh`` puts the megatron-core wheel's
prebuilt ``helpers_cpp`` extension (same release) into the carried Megatron-LM tree. This wrapper replaces
``compile_helpers`` in this process with an import of that extension (an error naming the fix when it is
missing), then runs the launcher as ``__main__``. Used by ``scripts/gpu_check.sh`` (step D).
"""

from __future__ import annotations

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_prebuilt_helpers() -> None:
    """Stands in for ``compile_helpers``: the prebuilt extension must import, nothing is compiled."""
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError as e:
        raise SystemExit(
            f"Megatron-LM's dataset helpers are not prebuilt for this Python ({e}); this run never calls make. "
            "Fix: build the carried tree with scripts/gpu_wheels.sh (it copies helpers_cpp*.so from the "
            "megatron-core wheel of the same release), or run `make -C megatron/core/datasets` where make exists."
        ) from None


def main() -> None:
    checkout = os.path.abspath(os.environ.get("MEGATRON_LM_PATH", os.getcwd()))
    sys.path.insert(0, checkout)
    import megatron.core.datasets.utils as utils

    utils.compile_helpers = import_prebuilt_helpers  # initialize.py imports it by name at call time
    script = os.path.join(ROOT, "launch", "pretrain_gpt_ntl.py")
    sys.argv = [script, *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
