"""``python tests/helpers/script_help.py SCRIPT...``: each script's ``--help``, all in this one process.

Each script runs as ``python SCRIPT --help`` would run it: as ``__main__`` (runpy), with ``sys.argv``
``[SCRIPT, "--help"]`` and the script's folder first on ``sys.path``; the working directory, the
environment and ``sys.path`` are restored after it, and every module it imported from outside the standard
library and the installed packages is dropped, so one script's imports do not stand in for another's. The
interpreter and the libraries start once instead of once a script. Prints one JSON object: the scripts that
did not exit with status 0, each with what it wrote to stderr (or its traceback); empty when every one
answered.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import sysconfig
import traceback

INSTALLED = tuple(
    os.path.abspath(sysconfig.get_path(key)) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")
)


def _installed(file: str | None) -> bool:
    """A built-in module, or one of the standard library or the installed packages (kept between scripts)."""
    return file is None or os.path.abspath(file).startswith(INSTALLED)


def answer_help(script: str) -> str | None:
    """None when ``script --help`` exits with status 0; else its stderr or traceback."""
    path = os.path.abspath(script)
    saved = (list(sys.path), list(sys.argv), os.getcwd(), dict(os.environ), set(sys.modules))
    sys.path.insert(0, os.path.dirname(path))
    sys.argv = [path, "--help"]
    out, err = io.StringIO(), io.StringIO()
    failure: str | None = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            failure = f"exit status {stop.code!r}\n{err.getvalue()}"
    except BaseException:  # any error is the script's answer
        failure = traceback.format_exc() + err.getvalue()
    finally:
        sys.path[:], sys.argv[:] = saved[0], saved[1]
        os.chdir(saved[2])
        os.environ.clear()
        os.environ.update(saved[3])
        for name in set(sys.modules) - saved[4]:  # the script's own modules: the next script imports its own
            if not _installed(getattr(sys.modules[name], "__file__", None)):
                del sys.modules[name]
    return failure


def main(scripts: list[str]) -> dict[str, str]:
    failed = {}
    for script in scripts:
        failure = answer_help(script)
        if failure is not None:
            failed[script] = failure[-2000:]
    return failed


if __name__ == "__main__":
    # this file's folder (tests/helpers: its tokenizers.py would shadow the library) is no script's
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    print(json.dumps(main(sys.argv[1:])))
