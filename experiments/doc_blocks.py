"""Generated blocks of the documentation: text between two marker comments, rewritten by a script.

A block in a Markdown file reads

    <!-- generated: NAME (by the command that writes it) -->
    ...the generated text...
    <!-- end: NAME -->

and :func:`replace_block` swaps what lies between the two markers for new text, so that a table of
``docs/results.md`` is refreshed from its JSON by one command and never typed by hand.
"""

from __future__ import annotations

import re


def replace_block(path: str, name: str, text: str) -> None:
    """Replaces the generated block ``name`` of the file ``path`` with ``text`` (the markers stay).

    Raises:
        ValueError: the file has no such block, or has it more than once.
    """
    with open(path) as f:
        doc = f.read()
    pattern = re.compile(
        r"(<!-- generated: " + re.escape(name) + r"(?: [^\n]*)? -->\n)(.*?)(<!-- end: " + re.escape(name) + r" -->)",
        re.DOTALL,
    )
    found = pattern.findall(doc)
    if len(found) != 1:
        raise ValueError(
            f"{path}: expected one block '<!-- generated: {name} ... -->' ... '<!-- end: {name} -->', found "
            f"{len(found)}; add the two marker lines where the table belongs"
        )
    new = pattern.sub(lambda m: m.group(1) + text.rstrip("\n") + "\n" + m.group(3), doc)
    with open(path, "w") as f:
        f.write(new)
