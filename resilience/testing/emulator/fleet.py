"""EmulatedFleet: N emulated engines, each its own OS process (and failure domain), optionally behind a FaultProxy each.

By default one zygote imports torch and the app once and forks every engine from it (``processes.py``,
``zygote.py``), so 256 engines start in seconds and fit in a few GB; an engine's crash (``crash.py``) still ends
its process alone, and its port refuses connections while its neighbours serve. Whatever happens, :meth:`stop`
(and leaving the ``with`` block) ends every process by PID: SIGTERM, a bounded wait, SIGKILL, then the zygote.
Engines' stdout and stderr go to files, so no pipe ever blocks an engine.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import requests

from .config import EngineConfig
from .processes import EmulatorStartError, EngineProcess, ExecLauncher, Launcher, Zygote
from .vllm.config import VLLMEngineConfig

if TYPE_CHECKING:
    from resilience.testing.faults import FaultPlan, FaultProxy
    from resilience.testing.memory_probe import EmulatorMemoryProbe

__all__ = ["DEFAULT_STARTUP_TIMEOUT", "EmulatedFleet", "EmulatorStartError", "EngineHandle", "StartMethod"]

DEFAULT_STARTUP_TIMEOUT = 60.0
"""Seconds to wait for every engine's READY (the zygote imports torch once: a few seconds; 256 forks: seconds more)."""
StartMethod = Literal["zygote", "spawn"]
"""How engine processes start: forked from one zygote (default), or a fresh interpreter each ("spawn")."""
_STOP_TIMEOUT = 5.0
_POLL = 0.05
_HTTP_TIMEOUT = 10.0


class EngineHandle:
    """One engine process of a fleet: its URLs, PID, liveness, record and log."""

    def __init__(
        self,
        index: int,
        config: EngineConfig | VLLMEngineConfig,
        log_dir: Path,
        extra_args: Sequence[str],
        launcher: Launcher,
        port: int = 0,
    ) -> None:
        self.index = index
        """Position in the fleet (also the FaultProxy's ``engine_index``)."""
        self.config = config
        self._log_dir = log_dir
        self._extra_args = tuple(extra_args)
        self._launcher = launcher
        self._proc: EngineProcess | None = None
        self._direct_url: str | None = None
        self._port = port
        self._generation = 0
        self._proxy: FaultProxy | None = None
        self._session = requests.Session()
        self._session.trust_env = False  # never send loopback calls through a proxy from the environment
        self._final_log: str | None = None

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

    def ready(self) -> bool:
        """Whether the current process has said it serves (READY)."""
        return self._proc is not None and self._proc.ready.is_set()

    def _log_path(self, stream: str) -> Path:
        return self._log_dir / f"engine{self.index}.{self._generation}.{stream}.log"

    def spawn(self) -> None:
        """Start the engine process (on its previous port when restarting); returns at once."""
        self._generation += 1
        argv = ["--port", str(self._port), *self.config.to_argv(), *self._extra_args]
        self._proc = self._launcher.launch(argv, self._log_path("stdout"), self._log_path("stderr"))

    def wait_ready(self, deadline: float) -> None:
        """Block until READY, the process's exit, or ``deadline`` (monotonic); raise EmulatorStartError."""
        if self._proc is None:
            raise RuntimeError(f"engine {self.index} is not started")
        proc = self._proc
        turns = int(max(0.0, deadline - time.monotonic()) / _POLL) + 2
        for _ in range(turns):  # bounded by the deadline: each turn waits <= _POLL s
            if proc.ready.wait(timeout=_POLL):
                self._on_ready()
                return
            if not self.alive():
                proc.ready.wait(timeout=0.5)  # the reader may still be handing over the line
                if proc.ready.is_set():
                    self._on_ready()
                    return
                raise EmulatorStartError(f"engine {self.index} exited with {self.returncode} before READY:\n{self.log()[-4000:]}")
            if time.monotonic() >= deadline:
                break
        raise EmulatorStartError(f"engine {self.index} printed no READY line in time:\n{self.log()[-4000:]}")

    def _on_ready(self) -> None:
        assert self._proc is not None and self._proc.url is not None
        self._direct_url = self._proc.url
        self._port = int(self._direct_url.rsplit(":", 1)[1])

    def terminate(self) -> None:
        """Send SIGTERM (graceful uvicorn shutdown) if the process runs."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the engine process now and wait for its end (a crash, from the clients' point of view)."""
        if self._proc is None:
            return
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
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL; always waits for the end."""
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
        if self._proc is not None:
            self._proc.join()

    def close(self) -> None:
        """Let the engine go for good: stop its process if it runs, keep its log in memory (the fleet may delete its
        folder), close its inspection session (:meth:`record` would open a new one). Stops no fault proxy. Idempotent."""
        if self._proc is not None and self.alive():
            self.stop()
        self._join_reader()
        if self._final_log is None:
            self._final_log = self.log()
        self._session.close()

    def start_proxy(self, plan: FaultPlan) -> FaultProxy:
        """Start a :class:`resilience.testing.faults.FaultProxy` with ``plan`` in front of this READY engine, and return it:
        :attr:`url` is then the proxy's. One proxy per engine (a second call raises RuntimeError)."""
        from resilience.testing.faults import FaultProxy  # lazy: only engines behind a fault plan need it

        if self._proxy is not None:
            raise RuntimeError(f"engine {self.index} already has a fault proxy in front of it ({self._proxy.url})")
        proxy = FaultProxy(self.direct_url, plan, self.index)
        self._proxy = proxy  # before start(): a start that fails half way is still stopped by stop_proxy()
        proxy.start()
        return proxy

    def stop_proxy(self) -> None:
        """Stop the fault proxy in front of this engine, if any (:attr:`url` keeps naming it: calls then fail). Idempotent."""
        if self._proxy is not None:
            self._proxy.stop()

    def record(self) -> dict[str, Any]:
        """``GET /_emulator/record``: ``{"calls": [...], "dropped": n, "state": {...}}`` (see the package docs for the fields)."""
        return self._debug("record")

    def state(self) -> dict[str, Any]:
        """``GET /_emulator/state``: paused mode, released tags, weight version, counts."""
        return self._debug("state")

    def _debug(self, route: str) -> dict[str, Any]:
        response = self._session.get(f"{self.direct_url}/_emulator/{route}", timeout=_HTTP_TIMEOUT)
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


ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(ready, n)`` each time more engines serve while a fleet starts."""


class EmulatedFleet:
    """N emulated engines in their own processes; a context manager that always cleans up.

    ``config``: every engine's configuration (default ``EngineConfig()``); its type picks the engine (a
    :class:`~resilience.testing.emulator.vllm.VLLMEngineConfig`: vLLM 0.33.0). ``fault_plan``: when given, a
    :class:`resilience.testing.faults.FaultProxy` runs in front of each engine and :attr:`urls` are the proxies'
    (:attr:`direct_urls` bypass them). ``startup_timeout`` bounds the wait for all engines' READY, the zygote's
    imports included (default 60 s). ``start_method``: ``"zygote"`` (default) forks every engine from one process
    that imported torch and the app once; ``"spawn"`` starts a fresh interpreter per engine (~240 MB and seconds of
    imports each). ``progress``: called as ``progress(ready, n)`` whenever more engines serve while starting.
    ``host``: the address every engine binds (default 127.0.0.1). ``base_port``: 0 (default) lets each engine pick a
    free port; P puts engine i on port P + i. ``log_level``: uvicorn's in every engine (default ``"warning"``).
    ``memory_state_dir``: where every engine publishes the tags it has released, for :meth:`memory_probe`; None
    (default) = a ``memory`` folder in the fleet's log folder.
    """

    def __init__(
        self,
        n: int,
        config: EngineConfig | VLLMEngineConfig | None = None,
        fault_plan: FaultPlan | None = None,
        *,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        log_dir: str | Path | None = None,
        start_method: StartMethod = "zygote",
        progress: ProgressCallback | None = None,
        host: str = "127.0.0.1",
        base_port: int = 0,
        log_level: str = "warning",
        memory_state_dir: str | Path | None = None,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"`n` must be an integer >= 1, but was {n!r}")
        if isinstance(base_port, bool) or not isinstance(base_port, int) or not (base_port == 0 or 1 <= base_port <= 65536 - n):
            raise ValueError(f"`base_port` must be 0 (free ports) or a port with room for {n} engines after it, but was {base_port!r}")
        if not host:
            raise ValueError("`host` must be a non-empty address, but was ''")
        if not startup_timeout > 0:
            raise ValueError(f"`startup_timeout` must be > 0 seconds, but was {startup_timeout!r}")
        if start_method not in ("zygote", "spawn"):
            raise ValueError(f"`start_method` must be 'zygote' or 'spawn', but was {start_method!r}")
        self.config: EngineConfig | VLLMEngineConfig = config if config is not None else EngineConfig()
        self.fault_plan = fault_plan
        self.start_method: StartMethod = start_method
        self._startup_timeout = startup_timeout
        self._progress = progress
        self._own_log_dir = log_dir is None
        self._log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="cpr-emulator-"))
        self._zygote = Zygote(self._log_dir) if start_method == "zygote" else None
        launcher: Launcher = self._zygote if self._zygote is not None else ExecLauncher()
        self.memory_state_dir = Path(memory_state_dir) if memory_state_dir is not None else self._log_dir / "memory"
        extra = (
            *(("--host", host) if host != "127.0.0.1" else ()),
            *(("--log-level", log_level) if log_level != "warning" else ()),
            "--memory-state-dir",
            str(self.memory_state_dir),
        )
        self.engines: list[EngineHandle] = [
            EngineHandle(i, self.config, self._log_dir, extra, launcher, port=base_port + i if base_port else 0) for i in range(n)
        ]
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
        """PIDs of the engine processes started so far (all of them once :meth:`start` returned)."""
        pids = []
        for engine in self.engines:
            try:
                pids.append(engine.pid)
            except RuntimeError:  # never started, or never forked (its zygote went away first)
                continue
        return pids

    @property
    def zygote_pid(self) -> int | None:
        """PID of the zygote the engines are forked from (None with ``start_method="spawn"`` or before start)."""
        return self._zygote.pid if self._zygote is not None and self._started else None

    def memory_probe(self) -> EmulatorMemoryProbe:
        """A ``MemoryProbe`` over these engines' own truth (the ``--memory-state-dir`` side channel), under their direct
        and (once started) their proxies' URLs; see ``resilience.testing.memory_probe``."""
        from resilience.testing.memory_probe import EmulatorMemoryProbe

        aliases = {e.proxy.url: e.direct_url for e in self.engines if e.proxy is not None}
        return EmulatorMemoryProbe(self.memory_state_dir, aliases=aliases)

    def start(self, on_ready: Callable[[int], None] | None = None) -> EmulatedFleet:
        """Start every engine in parallel and wait for all READY; on any failure stop all and raise.
        ``on_ready``: called with an engine's index once that engine serves (default None)."""
        if self._started:
            raise RuntimeError("an EmulatedFleet starts once; create a new one")
        self._started = True
        try:
            deadline = time.monotonic() + self._startup_timeout
            if self._zygote is not None:
                self._zygote.start()
                self._zygote.wait_hello(deadline)
            for engine in self.engines:
                engine.spawn()
            self._wait_all_ready(deadline, on_ready)
            if self.fault_plan is not None:
                for engine in self.engines:
                    engine.start_proxy(self.fault_plan)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_all_ready(self, deadline: float, on_ready: Callable[[int], None] | None) -> None:
        """Wait for every engine's READY (in any order), reporting progress; raise for the first that failed."""
        pending = list(self.engines)
        ready = 0
        turns = int(max(0.0, deadline - time.monotonic()) / _POLL) + 2
        for _ in range(turns):  # bounded by the deadline: each turn sleeps <= _POLL s
            still = []
            for engine in pending:
                if engine.ready():
                    engine.wait_ready(deadline)  # takes the URL over at once
                    if on_ready is not None:
                        on_ready(engine.index)
                elif not engine.alive():
                    engine.wait_ready(deadline)  # raises EmulatorStartError with the engine's log
                else:
                    still.append(engine)
            if len(still) < len(pending) and self._progress is not None:
                ready += len(pending) - len(still)
                self._progress(ready, len(self.engines))
            pending = still
            if not pending:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL)
        pending[0].wait_ready(deadline)  # past the deadline: raises with the first missing engine's log

    def stop(self) -> None:
        """Stop proxies, then every engine by PID (SIGTERM, bounded wait, SIGKILL), then the zygote. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            for engine in self.engines:
                engine.stop_proxy()
        finally:
            try:
                for engine in self.engines:
                    engine.terminate()
                deadline = time.monotonic() + _STOP_TIMEOUT
                for engine in self.engines:
                    if engine.wait_exit(max(0.0, deadline - time.monotonic())) is None:
                        engine.kill()
                    engine.close()
            finally:
                if self._zygote is not None:
                    self._zygote.close()
                if self._own_log_dir:
                    shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self) -> EmulatedFleet:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
