"""A real smg (sgl-model-gateway) on loopback in front of engines: start it, wait for its workers, stop it by PID.

``SmgGateway(worker_urls, ...)`` runs ``python -m smg launch`` (the ``[smg]`` extra) with every listener on
127.0.0.1 (``--host``, and ``--prometheus-host``, which otherwise binds 0.0.0.0). :meth:`SmgGateway.start` waits,
bounded, until every worker is registered and ``ready`` (an emulated ``/health`` runs a short generation: keep
``--health-check-timeout-secs`` above the emulator's ``health_poll_seconds``). :meth:`SmgGateway.stop` sends
SIGTERM to the gateway's one process, waits bounded, then SIGKILL. The worker API used (smg 1.13.0,
``model_gateway/src/server.rs``): ``GET /workers`` (``status`` one of ``pending``, ``ready``, ``not_ready``,
``failed``, ``draining``), ``GET|PATCH|DELETE /workers/{id}``, ``POST /workers``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import requests

from resilience.adapters.smg import GatewayHealthSettings

__all__ = ["GatewayHealth", "SmgGateway", "SmgStartError", "smg_available"]

ProgressCallback = Callable[[int, int], None]

_POLL_S = 0.1
_STOP_TIMEOUT_S = 10.0


class SmgStartError(RuntimeError):
    """smg exited, or its workers did not all register in time; the message carries the end of its log."""


def smg_available() -> bool:
    """True when the ``smg`` package (the ``[smg]`` extra) is installed."""
    return importlib.util.find_spec("smg") is not None


@dataclass(frozen=True, slots=True)
class GatewayHealth(GatewayHealthSettings):
    """The gateway's health-check settings (``smg launch`` flags); the defaults are smg 1.13.0's.

    ``interval_s``: ``--health-check-interval-secs``, seconds between probes of one worker (60).
    ``timeout_s``: ``--health-check-timeout-secs``, seconds a probe may take (5); a paused SGLang's
    ``/health`` hangs ~20 s, so every probe of a held engine fails by this timeout.
    ``failure_threshold``: ``--health-failure-threshold``, failed probes in a row that make a ready
    worker ``not_ready`` (3); ``3 x`` that many more make it ``failed``.
    ``success_threshold``: ``--health-success-threshold``, successes in a row that make it ready again (2).
    ``remove_unhealthy``: ``--remove-unhealthy-workers``, remove ``failed`` workers from the gateway (False).
    """

    remove_unhealthy: bool = False

    @property
    def ejection_window_s(self) -> float:
        """Seconds of failing probes (each up to ``timeout_s``) before a held-paused worker is ``failed``: 4 x threshold rounds."""
        return 4 * self.failure_threshold * (self.interval_s + self.timeout_s)

    def settings(self) -> GatewayHealthSettings:
        """The same settings as ``resilience.adapters.smg.SmgRouter`` takes them (what it restores on release)."""
        return GatewayHealthSettings(self.timeout_s, self.interval_s, self.failure_threshold, self.success_threshold)

    def args(self) -> list[str]:
        """The ``smg launch`` flags for these settings."""
        flags = [
            "--health-check-interval-secs", str(self.interval_s),
            "--health-check-timeout-secs", str(self.timeout_s),
            "--health-failure-threshold", str(self.failure_threshold),
            "--health-success-threshold", str(self.success_threshold),
        ]  # fmt: skip
        if self.remove_unhealthy:
            flags.append("--remove-unhealthy-workers")
        return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SmgGateway:
    """``smg launch`` on 127.0.0.1 in front of ``worker_urls``; a context manager that always stops it.

    - ``worker_urls``: the engines (``http://127.0.0.1:PORT``), registered at launch (``--worker-urls``).
      May be empty (register later through ``POST /workers``).
    - ``health``: the health-check settings (:class:`GatewayHealth`; default smg's own).
    - ``enable_rl``: mount ``/v1/rl/*`` (``--enable-rl``; default True).
    - ``rl_control_timeout_s``: ``--rl-control-timeout-secs`` (None = smg's 600).
    - ``backend``: ``--backend`` (default ``"sglang"``).
    - ``port`` / ``prometheus_port``: 0 (default) picks free loopback ports.
    - ``shutdown_grace_s``: ``--shutdown-grace-period-secs``, how long a stopping smg waits for in-flight
      requests (default 1; smg's own is 180).
    - ``extra_args``: more ``smg launch`` flags, appended as given.
    - ``startup_timeout``: seconds to wait for every worker ``ready`` (default 60).
    - ``progress``: called as ``progress(ready, n)`` whenever more workers are ready.
    - ``log_path``: where smg's output goes (default a temporary file, removed on stop).
    """

    def __init__(
        self,
        worker_urls: Sequence[str] = (),
        *,
        health: GatewayHealth | None = None,
        enable_rl: bool = True,
        rl_control_timeout_s: int | None = None,
        backend: str = "sglang",
        port: int = 0,
        prometheus_port: int = 0,
        shutdown_grace_s: int = 1,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 60.0,
        progress: ProgressCallback | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        if not startup_timeout > 0:
            raise ValueError(f"`startup_timeout` must be > 0 seconds, but was {startup_timeout!r}")
        if rl_control_timeout_s is not None and (isinstance(rl_control_timeout_s, bool) or rl_control_timeout_s < 1):
            raise ValueError(f"`rl_control_timeout_s` must be an integer >= 1 or None, but was {rl_control_timeout_s!r}")
        for url in worker_urls:
            if not url.startswith("http://127.0.0.1:"):
                raise ValueError(f"`worker_urls` must be loopback http://127.0.0.1:PORT URLs, but had {url!r}")
        self.worker_urls = list(worker_urls)
        """The engines registered at launch."""
        self.health = health if health is not None else GatewayHealth()
        """The health-check settings it runs with."""
        self.port = port or _free_port()
        self.prometheus_port = prometheus_port or _free_port()
        self._enable_rl = enable_rl
        self._rl_timeout = rl_control_timeout_s
        self._backend = backend
        self._grace = shutdown_grace_s
        self._extra = list(extra_args)
        self._startup_timeout = startup_timeout
        self._progress = progress
        self._own_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="cpr-smg-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        """Where smg's stdout and stderr go."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._session = requests.Session()
        self._session.trust_env = False  # loopback only: never through a proxy from the environment

    # -- addresses -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The gateway's base URL (data plane, worker API, ``/v1/rl``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """smg's Prometheus endpoint (its own listener, on 127.0.0.1)."""
        return f"http://127.0.0.1:{self.prometheus_port}/metrics"

    @property
    def pid(self) -> int:
        """The gateway's PID (raises before :meth:`start`)."""
        if self._proc is None:
            raise RuntimeError("the gateway has not been started")
        return self._proc.pid

    def command(self) -> list[str]:
        """The full ``smg launch`` command line."""
        cmd = [
            sys.executable, "-m", "smg", "launch",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
            "--backend", self._backend,
            "--shutdown-grace-period-secs", str(self._grace),
            *self.health.args(),
        ]  # fmt: skip
        if self._enable_rl:
            cmd.append("--enable-rl")
        if self._rl_timeout is not None:
            cmd += ["--rl-control-timeout-secs", str(self._rl_timeout)]
        if self.worker_urls:
            cmd += ["--worker-urls", *self.worker_urls]
        return cmd + self._extra

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> SmgGateway:
        """Launch smg and wait (bounded by ``startup_timeout``) until every worker URL is ``ready``; on failure stop it and raise."""
        if self._proc is not None:
            raise RuntimeError("an SmgGateway starts once; create a new one")
        if not smg_available():
            raise SmgStartError("smg is not installed: pip install 'controlplane-resilience[smg]'")
        env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
        env.setdefault("NO_PROXY", "127.0.0.1,localhost")
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._startup_timeout
        want = set(self.worker_urls)
        reported = -1
        for _ in range(int(self._startup_timeout / _POLL_S) + 2):  # bounded by the deadline
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise SmgStartError(f"smg exited with {self._proc.returncode} before its workers registered:\n{self.log_tail()}")
            try:
                ready = {w["url"] for w in self.workers() if w.get("status") == "ready"} & want
            except (requests.RequestException, ValueError):
                ready = None  # not listening yet
            if ready is not None:
                if len(ready) != reported and self._progress is not None:
                    self._progress(len(ready), len(want))
                reported = len(ready)
                if ready == want:
                    return
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        missing = sorted(want - (ready or set()))
        raise SmgStartError(
            f"smg did not register {missing} within {self._startup_timeout:g} s (is each /health answering within"
            f" {self.health.timeout_s} s?):\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM smg's PID, wait up to 10 s, then SIGKILL; remove its own log file. Idempotent."""
        proc = self._proc
        self._session.close()
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(_STOP_TIMEOUT_S)
        if self._own_log and proc is not None and proc.returncode is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> SmgGateway:
        return self.start() if self._proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of smg's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- the worker API ----------------------------------------------------------------

    def workers(self) -> list[dict[str, Any]]:
        """``GET /workers``: every registered worker (``id``, ``url``, ``status``, ``labels``, ...)."""
        response = self._session.get(f"{self.url}/workers", timeout=5)
        response.raise_for_status()
        return list(response.json().get("workers", []))

    def worker(self, url: str) -> dict[str, Any] | None:
        """The registered worker serving ``url``, or None when the gateway has none (never registered, or removed)."""
        for worker in self.workers():
            if worker.get("url") == url:
                return worker
        return None

    def status(self, url: str) -> str | None:
        """The gateway's ``status`` of the worker at ``url`` (``ready``, ``not_ready``, ...), or None when not registered."""
        worker = self.worker(url)
        return None if worker is None else str(worker.get("status"))

    def add_worker(self, url: str) -> None:
        """``POST /workers``: register ``url`` (the gateway probes it before it is ready)."""
        self._session.post(f"{self.url}/workers", json={"url": url}, timeout=5).raise_for_status()

    def wait_status(self, url: str, want: Callable[[str | None], bool], timeout: float) -> str | None:
        """Poll (bounded by ``timeout`` s) until ``want(status(url))``; the last status seen (check it: it may not be wanted)."""
        deadline = time.monotonic() + timeout
        seen = self.status(url)
        for _ in range(int(timeout / _POLL_S) + 1):
            if want(seen) or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
            seen = self.status(url)
        return seen

    def metrics(self) -> str:
        """smg's Prometheus text (``GET /metrics`` on its own listener)."""
        response = self._session.get(self.metrics_url, timeout=5)
        response.raise_for_status()
        return response.text
