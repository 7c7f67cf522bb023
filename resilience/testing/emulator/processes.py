"""How an engine process is started and watched: the interface a fleet needs (:class:`EngineProcess`), and its two
kinds: :class:`ExecProcess`, a fresh interpreter per engine (``python -m resilience.testing.emulator``), and
:class:`ForkedProcess`, a child forked by the fleet's zygote (the default).

:class:`Zygote` runs ``python -m resilience.testing.emulator.zygote`` (see that module for the line protocol), which
imports torch and the app once; every engine is then a ``fork()`` of it, sharing those pages copy-on-write. A reader
thread turns the zygote's lines into the state of each :class:`ForkedProcess`. The engines are the zygote's children,
not ours: the zygote reaps them and reports their exit status; signals go to them straight from here (only while their
exit is not reported, so a recycled PID is never signalled).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from .memory_state import process_start_ticks
from .ready import ready_url

__all__ = ["EmulatorStartError", "EngineProcess", "ExecLauncher", "ExecProcess", "ForkedProcess", "Launcher", "Zygote", "engine_env"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[3]
_TIMEOUT = 5.0
"""Seconds of each bounded wait on a process (its readers' join, its fork's report, the zygote's end)."""
_POLL = 0.05
_ORPHAN_STATUS = -signal.SIGKILL
"""Exit status given to an engine whose zygote died before reporting it (the real one is lost with the zygote)."""


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
        self._reader.join(timeout=_TIMEOUT)


class ExecLauncher:
    """Launches :class:`ExecProcess` engines."""

    def launch(self, argv: Sequence[str], stdout: Path, stderr: Path) -> EngineProcess:
        return ExecProcess(argv, stdout, stderr)


class ForkedProcess(EngineProcess):
    """One engine forked by the zygote (the zygote's reader thread serves every engine: nothing to join)."""

    def __init__(self, zygote: Zygote, ident: int) -> None:
        super().__init__()
        self.ident = ident
        """The spawn command's id (unique within the zygote)."""
        self._zygote = zygote
        self._spawned = threading.Event()
        self._exited = threading.Event()
        self._pid: int | None = None
        self._returncode: int | None = None

    # -- what the zygote reports (its reader thread calls these; so does a launch that found the zygote gone) --
    def note_spawned(self, pid: int) -> None:
        """The zygote forked this engine as process ``pid``: :attr:`pid` answers from now on."""
        self._pid = pid
        self._spawned.set()

    def note_ready(self, url: str) -> None:
        """The engine serves at ``url``: sets :attr:`url` and :attr:`ready`."""
        self.url = url
        self.ready.set()

    def note_exit(self, code: int) -> None:
        """The engine ended with exit status ``code`` (or was never forked: then 1); :meth:`poll` returns it from now on."""
        self._returncode = code
        self._spawned.set()
        self._exited.set()

    @property
    def pid(self) -> int:
        """The child's PID; waits (bounded) for the zygote to fork it; RuntimeError if it was never forked."""
        self._spawned.wait(timeout=_TIMEOUT)
        if self._pid is None:
            raise RuntimeError(f"engine process {self.ident} was not forked (see the zygote's log)")
        return self._pid

    def poll(self) -> int | None:
        if self._exited.is_set():
            return self._returncode
        if not self._zygote.running():
            self._check_orphan()
        return self._returncode if self._exited.is_set() else None

    def _check_orphan(self) -> None:
        """The zygote is gone: our child was re-parented; it counts as ended once it no longer runs."""
        if self._pid is None or process_start_ticks(self._pid) is None:
            self.note_exit(_ORPHAN_STATUS if self._pid is not None else 1)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        for _ in range(int(timeout / _POLL) + 2):  # bounded by the timeout: each turn waits <= _POLL s
            code = self.poll()
            if code is not None:
                return code
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._exited.wait(min(_POLL, remaining))
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"engine process {self.ident}", timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self._pid is None or self.poll() is not None:
            return
        try:
            os.kill(self._pid, sig)
        except ProcessLookupError:
            pass


class Zygote:
    """One zygote process and the engines it forked; a :class:`~.processes.Launcher`.

    ``log_dir`` receives ``zygote.stderr.log``. :meth:`start` returns at once; :meth:`wait_hello` waits for the
    imports to finish. :meth:`close` ends the zygote, which SIGKILLs whatever engines are left.
    """

    def __init__(self, log_dir: Path) -> None:
        self._log_path = log_dir / "zygote.stderr.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._hello = threading.Event()
        self._eof = threading.Event()
        self._lock = threading.Lock()
        """Guards the id and PID maps (the reader thread takes it too)."""
        self._write_lock = threading.Lock()
        """Serializes writes to the zygote's stdin; never held by the reader, so a full pipe cannot block it."""
        self._next_id = 0
        self._by_id: dict[int, ForkedProcess] = {}
        self._by_pid: dict[int, ForkedProcess] = {}

    @property
    def pid(self) -> int:
        """The zygote's PID (RuntimeError before :meth:`start`)."""
        if self._proc is None:
            raise RuntimeError("the zygote is not started")
        return self._proc.pid

    def running(self) -> bool:
        """Whether the zygote still runs and reports."""
        return self._proc is not None and not self._eof.is_set() and self._proc.poll() is None

    def start(self) -> None:
        """Start the zygote process (it imports torch and the app: seconds); returns at once."""
        env = {**engine_env(), "OMP_NUM_THREADS": "1"}
        env.setdefault("MALLOC_ARENA_MAX", "1")
        command = [sys.executable, "-m", "resilience.testing.emulator.zygote", "--exit-with-parent", str(os.getpid())]
        with open(self._log_path, "wb") as err:
            self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env)
        assert self._proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), name="emulator-zygote", daemon=True)
        self._reader.start()

    def wait_hello(self, deadline: float) -> None:
        """Block until the zygote finished importing, it exited, or ``deadline`` (monotonic); raise EmulatorStartError."""
        for _ in range(int(max(0.0, deadline - time.monotonic()) / _POLL) + 2):  # bounded by the deadline
            if self._hello.wait(timeout=_POLL):
                return
            if not self.running():
                raise EmulatorStartError(f"the engines' zygote exited before any engine was READY:\n{self.log()[-4000:]}")
            if time.monotonic() >= deadline:
                break
        raise EmulatorStartError(f"no engine READY in time: the engines' zygote did not finish importing:\n{self.log()[-4000:]}")

    def launch(self, argv: Sequence[str], stdout: Path, stderr: Path) -> ForkedProcess:
        """Ask the zygote to fork one engine with ``argv``; returns at once (a dead zygote gives an ended process)."""
        with self._lock:
            ident = self._next_id
            self._next_id += 1
            process = ForkedProcess(self, ident)
            self._by_id[ident] = process
        line = json.dumps({"op": "spawn", "id": ident, "argv": list(argv), "stdout": str(stdout), "stderr": str(stderr)})
        stdin = self._proc.stdin if self._proc is not None else None
        try:
            if stdin is None:
                raise RuntimeError("the zygote is not started")
            with self._write_lock:
                stdin.write(line.encode() + b"\n")
                stdin.flush()
        except (OSError, ValueError, RuntimeError) as exc:  # a closed or broken pipe: the zygote is gone
            stderr.write_text(f"the engines' zygote is gone, no engine forked: {exc!r}\n", encoding="utf-8")
            process.note_exit(1)
        return process

    def _read(self, stream: IO[bytes]) -> None:
        try:
            for raw in iter(stream.readline, b""):  # ends at EOF: the zygote and every child closed their ends
                try:
                    event: dict[str, Any] = json.loads(raw)
                except ValueError:
                    continue
                self._dispatch(event)
        finally:
            self._eof.set()
            stream.close()

    def _dispatch(self, event: dict[str, Any]) -> None:
        kind = event.get("ev")
        if kind == "hello":
            self._hello.set()
            return
        with self._lock:
            process = self._by_pid.get(event["pid"]) if kind == "exit" else self._by_id.get(event["id"])
            if kind == "spawned" and process is not None:
                self._by_pid[event["pid"]] = process
            elif kind == "exit":
                self._by_pid.pop(event["pid"], None)
        if process is None:
            return
        if kind == "spawned":
            process.note_spawned(event["pid"])
        elif kind == "ready":
            process.note_ready(event["url"])
        elif kind == "exit":
            process.note_exit(int(event["code"]))
        elif kind == "failed":  # the zygote wrote the reason into the engine's stderr log
            process.note_exit(1)

    def log(self) -> str:
        """The zygote's own stderr (import errors, tracebacks)."""
        try:
            return self._log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        """End the zygote: close its stdin (it SIGKILLs and reaps what is left), wait, SIGKILL it if it lingers. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if not self._hello.is_set() and proc.poll() is None:
            proc.kill()  # still importing: it has forked nothing, and reads stdin only once it is done
        if proc.stdin is not None:
            try:
                with self._write_lock:
                    proc.stdin.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=_TIMEOUT)
        if self._reader is not None:
            self._reader.join(timeout=_TIMEOUT)
