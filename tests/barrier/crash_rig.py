"""The crash-consistency rig: emulated engines that outlive their controllers, generation traffic, controller processes.

- ``Traffic``: one thread per engine sending ``/generate`` (directly, not through the
  controller) and counting what came back: answered, aborted (by a pause), held (a read
  timeout at a paused engine's gate) and errors (a refused or reset connection: a dead engine).
- ``Controller``: ``tests/barrier/controller_main.py`` as a subprocess, its JSON lines read
  on a thread; ``kill()`` is SIGKILL by PID, and every controller is ended in ``finally``.
- ``put_in_order``: an engine a test killed is restarted, and every engine serves with all
  its memory, before each test.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from resilience.cli.story import death_causes
from resilience.testing.emulator import EmulatedFleet, EngineHandle

CONTROLLER = Path(__file__).with_name("controller_main.py")
REPO = Path(__file__).resolve().parents[2]
HTTP_TIMEOUT = 10.0
"""Seconds: a bound no healthy loopback exchange reaches."""
GENERATE_TIMEOUT = 2.0
"""Read timeout of one traffic request: a request held at a paused engine's gate gives up after this."""
_TRAFFIC_TURNS = 100_000
"""Upper bound on the requests one traffic thread sends (it stops at ``stop()`` long before)."""


def session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    return s


@dataclass
class Traffic:
    """Generation requests on every engine while controllers come and go; counts per outcome."""

    urls: Sequence[str]
    counts: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> Traffic:
        for i, url in enumerate(self.urls):
            thread = threading.Thread(target=self._loop, args=(i, url), name=f"traffic-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(GENERATE_TIMEOUT + HTTP_TIMEOUT)

    def _count(self, key: str, error: str | None = None) -> None:
        with self._lock:
            self.counts[key] += 1
            if error is not None and len(self.errors) < 20:
                self.errors.append(error)

    def _loop(self, i: int, url: str) -> None:
        body = {"text": f"traffic {i}", "sampling_params": {"max_new_tokens": 4}}
        with session() as http:
            for _ in range(_TRAFFIC_TURNS):
                if self._stop.is_set():
                    return
                try:
                    r = http.post(url + "/generate", json=body, timeout=(HTTP_TIMEOUT, GENERATE_TIMEOUT))
                except requests.ReadTimeout:
                    self._count("held")  # waiting at a paused engine's gate
                    continue
                except requests.RequestException as exc:  # refused or reset: the engine is gone
                    self._count("error", f"engine {i}: {type(exc).__name__}: {exc}")
                    self._stop.wait(0.05)
                    continue
                if r.status_code != 200:
                    self._count("error", f"engine {i}: HTTP {r.status_code} {r.text[:200]}")
                    continue
                finish = (r.json().get("meta_info") or {}).get("finish_reason") or {}
                self._count("aborted" if isinstance(finish, dict) and finish.get("type") == "abort" else "answered")


class Controller:
    """One controller process; its JSON lines arrive on ``lines`` as they are printed."""

    def __init__(self, urls: Sequence[str], *args: str) -> None:
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(CONTROLLER), *args, *urls],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={k: v for k, v in os.environ.items() if "proxy" not in k.lower()},
        )
        self._stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except json.JSONDecodeError:
                self.lines.put({"event": "noise", "text": line})
        self.lines.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def next_line(self, timeout: float) -> dict[str, Any] | None:
        """The next JSON line (None at EOF or after ``timeout`` s)."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is not None:
            self.seen.append(line)
        return line

    def wait_for(self, event: str, timeout: float, **match: Any) -> dict[str, Any] | None:
        """Read lines until one has ``event`` (and the fields in ``match``); None at EOF or timeout (bounded)."""
        for _ in range(10_000):
            line = self.next_line(timeout)
            if line is None:
                return None
            if line.get("event") == event and all(line.get(k) == v for k, v in match.items()):
                return line
        return None

    def kill(self) -> None:
        """SIGKILL by PID (no cleanup runs in the controller) and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=HTTP_TIMEOUT)
        self._join()

    def wait(self, timeout: float) -> int:
        """Wait for a normal end; the exit status."""
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.kill()
        self._join()
        return rc

    def _join(self) -> None:
        for reader in self._readers:
            reader.join(HTTP_TIMEOUT)
        for _ in range(10_000):  # drain what arrived before the end
            if self.next_line(0) is None:
                break


def crash_causes(engine: EngineHandle) -> list[str]:
    """What killed the engine, from its log (empty: it never crashed)."""
    return death_causes(engine.log())


def health(engine: EngineHandle) -> int | None:
    """``/health``'s status (None when it does not answer). A paused engine's /health hangs and answers 503."""
    with session() as http:
        try:
            return http.get(engine.direct_url + "/health", timeout=HTTP_TIMEOUT).status_code
        except requests.RequestException:
            return None


def put_in_order(fleet: EmulatedFleet) -> None:
    """Every engine alive, serving, with all its memory (dead ones restarted on their port)."""
    with session() as http:
        for handle in fleet.engines:
            if not handle.alive():
                handle.restart()
            state = handle.state()
            if state["released_tags"]:
                http.post(handle.direct_url + "/resume_memory_occupation", json={"tags": state["released_tags"]}, timeout=HTTP_TIMEOUT)
            if state["weight_update_session_open"]:
                http.post(handle.direct_url + "/end_weight_update", json={}, timeout=HTTP_TIMEOUT)
            if state["paused"]:
                http.post(handle.direct_url + "/continue_generation", json={}, timeout=HTTP_TIMEOUT)
            state = handle.state()
            assert not state["paused"] and not state["released_tags"], f"{handle.direct_url} not back in order: {state}"
