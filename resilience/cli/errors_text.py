"""A step's error as a person reads it: engines by a short label, no secrets, cut only between clauses.

:func:`short_error` names each engine URL by its label (``engine 3``, from the caller) or ``host:port``, drops
every URL's credentials, query and fragment, masks ``Bearer`` tokens, and cuts a text longer than ``limit`` at the
last clause boundary outside any parenthesis.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import urlsplit

__all__ = ["ERROR_LIMIT", "clip", "engine_labels", "label_urls", "safe_url", "short_error"]

ERROR_LIMIT = 240
"""Characters of a step's error a progress line shows at most (the JSON report keeps the loop's whole text)."""

_URL = re.compile(r"(?P<for>\s+for url:\s*)?(?P<url>\bhttps?://[^\s'\"<>]+)")
_BEARER = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]+")
_TRAILING = ").,;:]'\""
"""Punctuation that ends a sentence or a group rather than the URL it follows."""


def _base(url: str) -> str | None:
    """``scheme://host:port`` of ``url`` without credentials (the key of a label), or None when it is not a URL."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def safe_url(url: str) -> str:
    """``url`` as it may be shown: no ``user:password@``, no query, no fragment (a name that is no URL: as it is)."""
    base = _base(url)
    if base is None:  # not a URL, or one whose port does not parse: still no credentials, query or fragment
        return re.sub(r"//[^/@\s]*@", "//", url).split("?", 1)[0].split("#", 1)[0]
    return base + urlsplit(url).path


def engine_labels(urls: Mapping[int, list[str]]) -> dict[str, str]:
    """``{base URL: "engine i"}`` for every URL of every engine (``{i: [proxy URL, direct URL, ...]}``)."""
    labels: dict[str, str] = {}
    for i, engine_urls in urls.items():
        for url in engine_urls:
            base = _base(url)
            if base is not None:
                labels[base] = f"engine {i}"
    return labels


def label_urls(text: str, labels: Mapping[str, str] | None = None) -> str:
    """``text`` with every URL as ``label /path`` (``labels`` by base URL, else ``host:port``; credentials, query and
    fragment dropped); requests' ``for url: URL`` reads ``from label /path``."""
    known = labels or {}

    def one(m: re.Match[str]) -> str:
        url = m.group("url")
        tail = ""
        while url and url[-1] in _TRAILING:
            if url[-1] == ")" and url.count("(") >= url.count(")"):
                break  # a ")" the URL itself opened
            tail, url = url[-1] + tail, url[:-1]
        base = _base(url)
        if base is None:
            return m.group(0)
        parts = urlsplit(url)
        label = known.get(base) or base.split("://", 1)[1]
        path = parts.path if parts.path not in ("", "/") else ""
        said = f"{label} {path}" if path else label
        return (" from " if m.group("for") else "") + said + tail

    return _BEARER.sub(r"\1 ***", _URL.sub(one, text))


def clip(text: str, limit: int = ERROR_LIMIT) -> str:
    """``text`` cut to at most ``limit`` characters at the last clause boundary outside parentheses, with `` ...``.

    A boundary is a space after ``;``, ``:``, ``,`` or ``.`` at parenthesis depth 0 in the last third of the
    room; failing one, the last space at depth 0; failing that (the whole text is one group) the text up to
    ``limit`` with its groups closed.
    """
    if len(text) <= limit:
        return text
    room = max(1, limit - 4)
    depth, clause, space = 0, -1, -1
    for i, ch in enumerate(text[: room + 1]):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == " " and depth == 0:
            space = i
            if i and text[i - 1] in ";:,.":
                clause = i
    cut = clause if clause > 0 and clause >= room * 2 // 3 else space  # a clause, unless it would drop a third of the room
    if cut > 0:
        return text[:cut].rstrip(" ;:,") + " ..."
    head = text[:room]
    closers = "".join(")" for _ in range(max(0, head.count("(") - head.count(")"))))
    return head + "..." + closers


def short_error(error: str | None, labels: Mapping[str, str] | None = None, limit: int = ERROR_LIMIT) -> str | None:
    """A step's error for a progress line: no ``step N:`` prefix, engines by label, no secrets, clipped to ``limit``."""
    if error is None:
        return None
    text = re.sub(r"^step \d+: ", "", " ".join(error.split()))
    return clip(label_urls(text, labels), limit)
