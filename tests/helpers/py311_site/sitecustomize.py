"""Test-only: ``typing.override`` for Python 3.11 in every process of a Megatron-LM >= 0.17 run.

Those releases declare Python >= 3.12 and import ``typing.override``; torch exists here for 3.11 only.
The harness (``megatron_lm_cpu.py``) installs the same stand-in in its own process, but checkpoint
writers that Megatron starts with multiprocessing's "spawn" re-import ``pretrain_gpt.py`` without the
harness: this file, on ``PYTHONPATH`` of the test runs only, reaches them.
"""

import typing

if not hasattr(typing, "override"):
    from typing_extensions import override

    typing.override = override
