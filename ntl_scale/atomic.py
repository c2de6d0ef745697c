"""Files written whole or not at all: a temporary file beside the target, ``fsync``, then ``os.replace``.
Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["atomic_write", "write_atomically", "write_json_atomically"]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w", *, encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """A file to write ``path``'s new content into; ``path`` is replaced when the ``with`` block ends normally.

    ``mode`` is ``"w"`` or ``"wb"``. An exception in the block leaves ``path`` as it was.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes a whole file: mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        # "x": a new file with the permissions any open() gives (mkstemp's would be 0600)
        with open(tmp, mode.replace("w", "x"), encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_atomically(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Writes ``data`` (a ``str``, as UTF-8, or ``bytes``) to ``path`` through :func:`atomic_write`."""
    with atomic_write(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def write_json_atomically(value: Any, path: str | os.PathLike[str], **dump: Any) -> None:
    """Writes ``value`` as JSON to ``path`` through :func:`atomic_write`, with a final newline."""
    with atomic_write(path) as f:
        json.dump(value, f, **{"indent": 2, **dump})
        f.write("\n")
