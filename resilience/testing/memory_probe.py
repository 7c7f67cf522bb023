"""``EmulatorMemoryProbe``: the emulator's own truth about released memory, read through its side channel.

Each engine started with ``--memory-state-dir DIR`` (every engine of an ``EmulatedFleet`` is) keeps
``DIR/engine-<port>.json`` up to date (``emulator.memory_state``). This probe reads it, never the engine over
HTTP, so a hung engine can still be read::

    probe = fleet.memory_probe()                 # proxy URLs and direct URLs both known
    probe.released_tags(fleet.urls[0])           # frozenset() while serving
    probe = EmulatorMemoryProbe("/tmp/state")    # engines of ``cpr emulate --memory-state-dir /tmp/state``

``UnknownEngine`` for a name that is no alias and whose port has no file here, or that has no port. None for a
known engine that is an alias whose engine has not written its file yet, whose process is gone or is not the one
that wrote the file (a restart still coming up, a recycled PID), or that is carrying out a release or resume now.
Standard library only: it runs in any process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from resilience.engine_contract import UnknownEngine
from resilience.testing.emulator.memory_state import process_start_ticks, read_state, state_path

__all__ = ["EmulatorMemoryProbe"]


def _port_of(engine: str) -> int | None:
    """The port of an engine name (``scheme://host:port``, a trailing path allowed); None when it names none."""
    try:
        return urlsplit(engine).port
    except ValueError:
        return None


def _canonical(engine: str) -> str:
    """``scheme://host:port`` of a URL, so ``http://127.0.0.1:8000/`` and ``http://127.0.0.1:8000`` are one engine."""
    parts = urlsplit(engine)
    return f"{parts.scheme}://{parts.netloc}"


class EmulatorMemoryProbe:
    """A ``MemoryProbe`` over the emulated engines publishing into ``state_dir`` (their ``--memory-state-dir``), told
    apart by port. ``aliases``: other names of an engine (a proxy's URL) to its own URL (default none)."""

    def __init__(self, state_dir: str | os.PathLike[str], *, aliases: Mapping[str, str] | None = None) -> None:
        if not isinstance(state_dir, (str, os.PathLike)) or not str(state_dir):
            raise ValueError(f"`state_dir` must be a folder path, but was {state_dir!r}")
        self.state_dir = Path(state_dir)
        self._aliases: dict[str, str] = {}
        for alias, target in (aliases or {}).items():
            if _port_of(target) is None:
                raise ValueError(f"`aliases[{alias!r}]` must be an engine URL with a port, but was {target!r}")
            self._aliases[_canonical(alias)] = target

    def __repr__(self) -> str:
        return f"EmulatorMemoryProbe({str(self.state_dir)!r}, aliases={len(self._aliases)})"

    def released_tags(self, engine: str) -> frozenset[str] | None:
        """The tags released on ``engine`` now (its URL, or an alias), or None when this probe cannot prove them
        (``UnknownEngine``: see the module docstring)."""
        if not isinstance(engine, str):
            raise UnknownEngine(self, repr(engine))
        aliased = self._aliases.get(_canonical(engine))
        target = engine if aliased is None else aliased
        port = _port_of(target)
        if port is None:
            raise UnknownEngine(self, engine)
        path = state_path(self.state_dir, port)
        state = read_state(path)
        if state is None:
            if aliased is None and not path.exists():
                raise UnknownEngine(self, engine)
            return None
        pid, ticks = state.get("pid"), state.get("start_ticks")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return None
        running = process_start_ticks(pid)
        if running is None or (ticks is not None and running != ticks):
            return None  # dead, or the PID now belongs to another process
        if state.get("pending") != 0:
            return None
        tags = state.get("released_tags")
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            return None
        return frozenset(tags)
