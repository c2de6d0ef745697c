"""Runs a script as ``__main__``, then ends the process as ``launch/finish.py`` does (test only).

    torchrun --nproc_per_node 2 tests/helpers/run_then_leave.py examples/hf_trainer_ntl.py --max-steps 20

For user-facing scripts that end as a user's script would (``examples/``): under the tests' 2-process
gloo runs a finished rank may abort or hang while the interpreter finalises (see ``launch/finish.py``),
which would fail a test of a run that did its work. The script itself runs unchanged.
"""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# This file's folder holds tests/helpers/tokenizers.py, which must not shadow the real package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, ROOT)

from launch.finish import run_then_leave  # noqa: E402

script, *arguments = sys.argv[1:]
sys.argv = [script, *arguments]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` puts the script's folder first
run_then_leave(lambda: runpy.run_path(script, run_name="__main__"))
