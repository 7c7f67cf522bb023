"""Copies of files (and README sections) inlined into docs pages, so the pages read whole on the forge, without MkDocs.

A page marks each copy::

    <!-- inline: examples/policies.toml toml -->
    ```toml
    ...the file, verbatim...
    ```
    <!-- /inline -->

``SOURCE`` is a path from the repository root, or ``README.md:NAME`` for the README's text between its
``<!-- --8<-- [start:NAME] -->`` and ``<!-- --8<-- [end:NAME] -->`` lines; an optional language wraps the copy in
a fence. ``tests/cli/test_docs_examples.py`` fails when a copy differs from its source; after editing a source,
``python -m tests.cli.docs_inline`` rewrites every copy.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["DOCS", "ROOT", "render", "source_text", "write_all"]

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
_BLOCK = re.compile(r"^<!-- inline: (\S+)(?: (\w+))? -->\n(.*?)^<!-- /inline -->$", re.M | re.S)


def source_text(source: str) -> str:
    """The text a marker names: a whole file, or ``README.md:NAME``'s section (without its marker lines)."""
    path, _, section = source.partition(":")
    text = (ROOT / path).read_text(encoding="utf-8")
    if not section:
        return text
    start, end = f"<!-- --8<-- [start:{section}] -->\n", f"<!-- --8<-- [end:{section}] -->"
    if start not in text or end not in text:
        raise ValueError(f"{path} has no section {section!r} (its lines {start.strip()} ... {end})")
    return text[text.index(start) + len(start) : text.index(end)]


def render(page: str) -> str:
    """``page`` with every inlined copy replaced by its source's current text."""

    def copy(m: re.Match[str]) -> str:
        source, lang = m.group(1), m.group(2)
        body = source_text(source)
        if not body.endswith("\n"):
            body += "\n"
        inner = f"```{lang}\n{body}```\n" if lang else body
        return f"<!-- inline: {source}{' ' + lang if lang else ''} -->\n{inner}<!-- /inline -->"

    return _BLOCK.sub(copy, page)


def write_all() -> list[Path]:
    """Rewrite every docs page whose copies are out of date; returns the pages written."""
    written = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            written.append(page)
    return written


if __name__ == "__main__":
    for page in write_all():
        print(f"rewrote {page.relative_to(ROOT)}")
