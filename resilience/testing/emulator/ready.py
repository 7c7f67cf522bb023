"""The READY line: how an engine process tells whoever started it that it serves, and at which URL.

A leaf module (standard library only): the engine side (``server.py``, ``serve_many.py``) prints the line and the
fleet side (``processes.py``) reads it, without either importing the other.
"""

from __future__ import annotations

__all__ = ["READY_PREFIX", "print_ready", "ready_url"]

READY_PREFIX = "EMULATOR READY "
"""Start of the line printed on stdout when the engine serves; the URL follows."""


def print_ready(url: str) -> None:
    """Print ``EMULATOR READY <url>`` on stdout and flush it (the default ``on_ready`` of ``server.main``)."""
    print(f"{READY_PREFIX}{url}", flush=True)


def ready_url(line: str) -> str | None:
    """The URL of a READY line (surrounding whitespace ignored), or None when ``line`` is not one."""
    text = line.strip()
    return text[len(READY_PREFIX) :] if text.startswith(READY_PREFIX) else None
