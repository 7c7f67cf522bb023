"""EmulatedFleet: N emulated engines, each its own OS process, optionally behind a FaultProxy each.

Engines start in parallel (``sys.executable -m resilience.testing.emulator --port 0``);
each one's READY line is awaited with a bounded wait. Whatever happens, :meth:`stop`
(and leaving the ``with`` block) ends every process by PID: SIGTERM, a bounded wait,
then SIGKILL. stdout is drained by a thread and stderr goes straight to a file, so no
pipe ever blocks an engine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

import requests

from .config import EngineConfig
from .server import READY_PREFIX

if TYPE_CHECKING:
    from resilience.testing.faults import FaultPlan, FaultProxy

__all__ = ["DEFAULT_STARTUP_TIMEOUT", "EmulatedFleet", "EmulatorStartError", "EngineHandle"]

DEFAULT_STARTUP_TIMEOUT = 60.0
"""Seconds to wait for every engine's READY line (importing torch takes a few seconds per process)."""
_STOP_TIMEOUT = 5.0
_POLL = 0.05
_HTTP_TIMEOUT = 10.0
_PACKAGE_ROOT = Path(__file__).resolve().parents[3]


class EmulatorStartError(RuntimeError):
    """An engine did not print its READY line in time, or exited first; the message holds its log tail."""


class EngineHandle:
    """One engine process of a fleet: its URLs, PID, liveness, record and log."""

    def __init__(self, index: int, config: EngineConfig, log_dir: Path, extra_args: Sequence[str] = ()) -> None:
        self.index = index
        """Position in the fleet (also the FaultProxy's ``engine_index``)."""
        self.config = config
        """The engine's configuration."""
        self._log_dir = log_dir
        self._extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._ready = threading.Event()
        self._direct_url: str | None = None
        self._port = 0
        self._generation = 0
        self._proxy: FaultProxy | None = None
        self._session = requests.Session()
        self._session.trust_env = False  # never send loopback calls through a proxy from the environment
        self._final_log: str | None = None

    # ----- addresses ----------------------------------------------------------------
    @property
    def direct_url(self) -> str:
        """``http://127.0.0.1:<port>`` of the engine itself."""
        if self._direct_url is None:
            raise RuntimeError(f"engine {self.index} is not started")
        return self._direct_url

    @property
    def url(self) -> str:
        """What clients should use: the FaultProxy's URL when the fleet has a fault plan, else :attr:`direct_url`."""
        return self._proxy.url if self._proxy is not None else self.direct_url

    @property
    def proxy(self) -> FaultProxy | None:
        """The FaultProxy in front of this engine, if any (its ``injected`` lists the faults)."""
        return self._proxy

    @property
    def pid(self) -> int:
        """PID of the current engine process."""
        if self._proc is None:
            raise RuntimeError(f"engine {self.index} is not started")
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once the process ended (-9 after SGLang-like death by SIGKILL), else None."""
        return None if self._proc is None else self._proc.poll()

    def alive(self) -> bool:
        """Whether the engine process is still running."""
        return self._proc is not None and self._proc.poll() is None

    # ----- lifecycle ------------------------------------------------------------------
    def _log_path(self, stream: str) -> Path:
        return self._log_dir / f"engine{self.index}.{self._generation}.{stream}.log"

    def spawn(self) -> None:
        """Start the engine process (on its previous port when restarting); returns at once."""
        self._generation += 1
        self._ready.clear()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        argv = [
            sys.executable,
            "-m",
            "resilience.testing.emulator",
            "--port",
            str(self._port),
            "--exit-with-parent",
            str(os.getpid()),
            *self.config.to_argv(),
            *self._extra_args,
        ]
        with open(self._log_path("stderr"), "wb") as err:
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env)
        assert self._proc.stdout is not None
        self._reader = threading.Thread(
            target=self._drain_stdout, args=(self._proc.stdout,), name=f"emulator-{self.index}-stdout", daemon=True
        )
        self._reader.start()

    def _drain_stdout(self, stream: IO[bytes]) -> None:
        with open(self._log_path("stdout"), "wb") as out:
            for line in iter(stream.readline, b""):  # ends at EOF, when the process exits
                out.write(line)
                out.flush()
                text = line.decode("utf-8", errors="replace").strip()
                if not self._ready.is_set() and text.startswith(READY_PREFIX):
                    self._direct_url = text[len(READY_PREFIX) :]
                    self._port = int(self._direct_url.rsplit(":", 1)[1])
                    self._ready.set()
        stream.close()

    def wait_ready(self, deadline: float) -> None:
        """Block until the READY line, the process's exit, or ``deadline`` (monotonic); raise EmulatorStartError."""
        turns = int(max(0.0, deadline - time.monotonic()) / _POLL) + 2
        for _ in range(turns):  # bounded by the deadline: each turn waits <= _POLL s
            if self._ready.wait(timeout=_POLL):
                return
            if not self.alive():
                self._ready.wait(timeout=0.5)  # the reader may still be handing over the line
                if self._ready.is_set():
                    return
                raise EmulatorStartError(f"engine {self.index} exited with {self.returncode} before READY:\n{self.log()[-4000:]}")
            if time.monotonic() >= deadline:
                break
        raise EmulatorStartError(f"engine {self.index} printed no READY line in time:\n{self.log()[-4000:]}")

    def terminate(self) -> None:
        """Send SIGTERM (graceful uvicorn shutdown) if the process runs."""
        if self.alive():
            assert self._proc is not None
            self._proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the engine process now and reap it (a crash, from the clients' point of view)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=_STOP_TIMEOUT)
        self._join_reader()

    def wait_exit(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the process to end; its exit status, or None if it still runs."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = _STOP_TIMEOUT) -> None:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL; always reaps the process."""
        self.terminate()
        if self.wait_exit(timeout) is None:
            self.kill()
        self._join_reader()

    def restart(self, timeout: float = DEFAULT_STARTUP_TIMEOUT) -> None:
        """Stop the process if it runs and start a fresh one on the same port (same URLs, fresh state)."""
        self.stop()
        self.spawn()
        self.wait_ready(time.monotonic() + timeout)

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=_STOP_TIMEOUT)

    # ----- inspection -------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """``GET /_emulator/record``: ``{"calls": [...], "state": {...}}`` (see the package docs for the fields)."""
        response = self._session.get(self.direct_url + "/_emulator/record", timeout=_HTTP_TIMEOUT)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def state(self) -> dict[str, Any]:
        """``GET /_emulator/state``: paused mode, released tags, weight version, counts."""
        response = self._session.get(self.direct_url + "/_emulator/state", timeout=_HTTP_TIMEOUT)
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body

    def log(self) -> str:
        """The engine's stderr so far (every generation of the process, oldest first)."""
        if self._final_log is not None:
            return self._final_log
        parts = []
        for generation in range(1, self._generation + 1):
            path = self._log_dir / f"engine{self.index}.{generation}.stderr.log"
            if path.exists():
                parts.append(path.read_text(encoding="utf-8", errors="replace"))
        return "".join(parts)

    def _freeze_log(self) -> None:
        self._final_log = self.log()
        self._session.close()


class EmulatedFleet:
    """N emulated SGLang engines in their own processes; a context manager that always cleans up.

    ``fault_plan``: when given, a :class:`resilience.testing.faults.FaultProxy` runs in
    front of each engine and :attr:`urls` are the proxies' URLs (:attr:`direct_urls`
    bypass them). ``startup_timeout`` bounds the wait for all READY lines.
    """

    def __init__(
        self,
        n: int,
        config: EngineConfig | None = None,
        fault_plan: FaultPlan | None = None,
        *,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        log_dir: str | Path | None = None,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"`n` must be an integer >= 1, but was {n!r}")
        if not startup_timeout > 0:
            raise ValueError(f"`startup_timeout` must be > 0 seconds, but was {startup_timeout!r}")
        self.config = config if config is not None else EngineConfig()
        """The configuration every engine runs with."""
        self.fault_plan = fault_plan
        """The fault plan of the proxies, or None (no proxies)."""
        self._startup_timeout = startup_timeout
        self._own_log_dir = log_dir is None
        self._log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="cpr-emulator-"))
        self.engines: list[EngineHandle] = [EngineHandle(i, self.config, self._log_dir) for i in range(n)]
        """The engines, by index."""
        self._started = False
        self._stopped = False

    @property
    def urls(self) -> list[str]:
        """What clients should use, one per engine (proxy URLs when there is a fault plan)."""
        return [e.url for e in self.engines]

    @property
    def direct_urls(self) -> list[str]:
        """The engines' own URLs, bypassing any proxy."""
        return [e.direct_url for e in self.engines]

    @property
    def pids(self) -> list[int]:
        """PIDs of the engine processes."""
        return [e.pid for e in self.engines]

    def start(self, on_ready: Callable[[int], None] | None = None) -> EmulatedFleet:
        """Start every engine in parallel and wait for all READY lines; on any failure stop all and raise.

        ``on_ready``: called with an engine's index once that engine serves (progress displays). Default None.
        """
        if self._started:
            raise RuntimeError("an EmulatedFleet starts once; create a new one")
        self._started = True
        try:
            for engine in self.engines:
                engine.spawn()
            deadline = time.monotonic() + self._startup_timeout
            for engine in self.engines:
                engine.wait_ready(deadline)
                if on_ready is not None:
                    on_ready(engine.index)
            if self.fault_plan is not None:
                self._start_proxies(self.fault_plan)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_proxies(self, plan: FaultPlan) -> None:
        from resilience.testing.faults import FaultProxy  # lazy: only fleets with a fault plan need it

        for engine in self.engines:
            proxy = FaultProxy(engine.direct_url, plan, engine.index)
            engine._proxy = proxy
            proxy.start()

    def stop(self) -> None:
        """Stop proxies, then every engine by PID (SIGTERM, bounded wait, SIGKILL). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            for engine in self.engines:
                if engine.proxy is not None:
                    engine.proxy.stop()
        finally:
            for engine in self.engines:
                engine.terminate()
            deadline = time.monotonic() + _STOP_TIMEOUT
            for engine in self.engines:
                if engine.wait_exit(max(0.0, deadline - time.monotonic())) is None:
                    engine.kill()
                engine._join_reader()
                engine._freeze_log()
            if self._own_log_dir:
                shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self) -> EmulatedFleet:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
