"""The shell commands of a Markdown page: every line of its fenced code blocks that are not Python or output.

Continuation lines (``\\``) are joined and ``#`` comments dropped, so each item is one command as a reader
would paste it. Used by tests/unit/test_docs_commands.py and the torchtitan command's run.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_SHELL = {"", "bash", "sh", "shell", "console"}


def commands(page: str, section: str | None = None) -> list[str]:
    """The commands of ``ROOT/page`` (only under the ``## section`` heading when given), in order."""
    text = (ROOT / page).read_text(encoding="utf-8")
    if section is not None:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start : end if end > 0 else None]
    out = []
    for lang, body in re.findall(r"^```([a-z]*)\n(.*?)^```", text, flags=re.S | re.M):
        if lang not in _SHELL:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(shlex.join(words))
    return out
