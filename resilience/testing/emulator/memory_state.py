"""The emulator's side channel for its memory truth: one small JSON file per engine, replaced atomically.

An engine started with ``--memory-state-dir DIR`` keeps ``DIR/engine-<port>.json`` up to date with the tags it has
released (SGLang's ``WeightUpdater.offload_tags``, ``sglang/srt/managers/scheduler_components/weight_updater.py``;
vLLM's sleeping tags) and how many release/resume calls it is carrying out right now::

    {"version": 1, "pid": P, "start_ticks": T, "port": N, "released_tags": [...], "pending": K, "seq": S}

``resilience.testing.memory_probe.EmulatorMemoryProbe`` reads it. A file, not a route: the emulator's routes stay
exactly the engine's (the contract checks compare them); it is written where the truth changes, before the call is
answered, with no extra thread or server; any process can read it, even while the engine hangs; and ``os.replace``
of a fully written temporary file is atomic, so a reader never sees half a state (a SIGKILL mid-write leaves the old
file and a stray ``.tmp``). A dead engine leaves its last file: the reader compares ``pid`` and ``start_ticks``
(field 22 of ``/proc/<pid>/stat``) with the running process, so neither a dead engine nor a recycled PID passes for
the live one. Standard library only.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["STATE_VERSION", "MemoryStateWriter", "process_start_ticks", "read_state", "state_path"]

STATE_VERSION = 1
"""The file format's version (``"version"``); a reader refuses any other."""


def state_path(directory: str | os.PathLike[str], port: int) -> Path:
    """Where the engine on ``port`` keeps its state in ``directory``."""
    return Path(directory) / f"engine-{port}.json"


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22); None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
        return None
    # after the ")" of the command name: field 3 (state) is fields[0], field 22 (starttime) is fields[19]
    if not fields or fields[0] in ("Z", "X") or len(fields) < 20:
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


def read_state(path: Path) -> dict[str, Any] | None:
    """The state in ``path``, or None when the file is missing, unreadable, not this format, or of another version."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        return None
    return data


class MemoryStateWriter:
    """Publishes one engine's released tags and its memory calls in progress; safe from any thread.

    ``directory``: the state folder (created if missing); ``port``: the engine's port (its file name).
    """

    def __init__(self, directory: str | os.PathLike[str], port: int) -> None:
        self.path = state_path(directory, port)
        """The file this engine writes."""
        self._port = port
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._start_ticks = process_start_ticks(self._pid)
        self._released: tuple[str, ...] = ()
        self._pending = 0
        self._seq = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def started(self, released: Iterable[str]) -> None:
        """The engine serves: publish its tags with no call in progress."""
        with self._lock:
            self._released = tuple(released)
            self._pending = 0
            self._write()

    def call_began(self) -> None:
        """A release or resume was handed to the scheduler: readers cannot prove anything until it ends."""
        with self._lock:
            self._pending += 1
            self._write()

    def call_ended(self, released: Iterable[str]) -> None:
        """A release or resume was carried out (called before it is answered): publish the tags released now."""
        with self._lock:
            self._pending = max(0, self._pending - 1)
            self._released = tuple(released)
            self._write()

    def _write(self) -> None:
        self._seq += 1
        body = {
            "version": STATE_VERSION,
            "pid": self._pid,
            "start_ticks": self._start_ticks,
            "port": self._port,
            "released_tags": list(self._released),
            "pending": self._pending,
            "seq": self._seq,
        }
        tmp = self.path.with_name(f"{self.path.name}.{self._pid}.tmp")
        tmp.write_text(json.dumps(body, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, self.path)
