"""How an engine process is started and watched: the interface a fleet needs (:class:`EngineProcess`), and
:class:`ExecProcess`, a fresh interpreter per engine (``python -m resilience.testing.emulator``); the default is
:class:`~resilience.testing.emulator.forkserver.ForkedProcess`, a child forked by the fleet's zygote.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Protocol

from .ready import ready_url

__all__ = ["EmulatorStartError", "EngineProcess", "ExecLauncher", "ExecProcess", "Launcher", "engine_env"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]
_JOIN_TIMEOUT = 5.0


def engine_env() -> dict[str, str]:
    """The environment of an engine process: ours, with this package first on ``PYTHONPATH`` (one OpenMP thread unless set)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class EmulatorStartError(RuntimeError):
    """An engine did not print its READY line in time, or exited first; the message holds its log tail."""


class EngineProcess:
    """One engine's OS process, as the fleet sees it: Popen-like, plus ``ready`` (set once the engine serves) and
    ``url`` (``http://host:port`` from then on, else None)."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.url: str | None = None

    @property
    def pid(self) -> int:
        """The process id (RuntimeError when the process was never created)."""
        raise NotImplementedError

    def poll(self) -> int | None:
        """Exit status once ended (``-N``: killed by signal N), else None."""
        raise NotImplementedError

    def wait(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for the end; the exit status, or ``subprocess.TimeoutExpired``."""
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` if the process still runs."""
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL the process if it still runs."""
        self.send_signal(signal.SIGKILL)

    def join(self) -> None:
        """Wait (bounded) for the threads that read the process's output once it ended (default: there are none)."""


class Launcher(Protocol):
    """Starts engine processes from engine flags (``--port``, EngineConfig flags)."""

    def launch(self, argv: Sequence[str], stdout: Path, stderr: Path) -> EngineProcess:
        """Start one engine with ``argv``, its stdout and stderr going to the two files; returns at once."""
        ...


class ExecProcess(EngineProcess):
    """An engine in a fresh interpreter: ``sys.executable -m resilience.testing.emulator`` (~240 MB and seconds each)."""

    def __init__(self, argv: Sequence[str], stdout: Path, stderr: Path) -> None:
        super().__init__()
        command = [sys.executable, "-m", "resilience.testing.emulator", *argv, "--exit-with-parent", str(os.getpid())]
        with open(stderr, "wb") as err:
            self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=engine_env())
        assert self._proc.stdout is not None
        self._reader = threading.Thread(target=self._drain, args=(self._proc.stdout, stdout), name="emulator-stdout", daemon=True)
        self._reader.start()

    def _drain(self, stream: IO[bytes], path: Path) -> None:
        with open(path, "wb") as out:
            for line in iter(stream.readline, b""):  # ends at EOF, when the process exits
                out.write(line)
                out.flush()
                url = None if self.ready.is_set() else ready_url(line.decode("utf-8", errors="replace"))
                if url is not None:
                    self.url = url
                    self.ready.set()
        stream.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float) -> int:
        return self._proc.wait(timeout=timeout)

    def send_signal(self, sig: int) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(sig)

    def join(self) -> None:
        self._reader.join(timeout=_JOIN_TIMEOUT)


class ExecLauncher:
    """Launches :class:`ExecProcess` engines."""

    def launch(self, argv: Sequence[str], stdout: Path, stderr: Path) -> EngineProcess:
        return ExecProcess(argv, stdout, stderr)
