"""SmgRouter: keep an smg (sgl-model-gateway) gateway in step with the orchestrator's holds, through smg's worker API.

The problem (``docs/routers.md``; ``tests/smg/test_smg_holds.py`` shows it on smg 1.13.0): smg ejects every engine
the orchestrator holds paused for longer than about ``4 x threshold x (interval + timeout)``, as a paused SGLang's
``/health`` never answers (``model_gateway/src/worker/manager.rs``, ``compute_next_status``).

What smg's API offers (1.13.0; ``PATCH /workers/{id}`` takes ``priority``, ``cost``, ``labels``, ``api_key`` and
``health`` overrides; there is no call that sets a worker's status): a health override is applied by replacing the
worker with one that keeps its status, with fresh failure counters. So, for each engine the orchestrator does not know
to be serving (paused, flushed, released, unknown, quarantined, in flight):

1. **taking it out of rotation**: ``health = {failure_threshold: 1, timeout_secs: 1, check_interval_secs: 1}``: the next
   probe of the paused engine fails and smg marks it ``not_ready``, which smg never routes to
   (``WorkerStatus::is_routable``). Until then a request smg routes there waits in the paused engine's queue.
2. **held**: once it is ``not_ready``, ``failure_threshold`` = 1,000,000: it stays ``not_ready`` (never ``failed``,
   never removed) for as long as the hold lasts. The label ``cpr.held`` names why (the orchestrator's state).
3. **dead while held**: the router asks a held engine's ``GET /model_info`` (SGLang's HTTP process answers it without
   the scheduler, at once while paused); ``dead_after`` refusals or timeouts in a row, or the orchestrator calling it
   dead, restore the gateway's own settings, and smg's checker ejects it as it would any dead engine.
4. **released** (the orchestrator knows it serving again, after an onload, an unpause, or a failed transition it later
   recovered): the gateway's own settings and ``cpr.held = ""``: smg probes ``/health`` again and makes it ``ready``
   after ``--health-success-threshold`` successes.
5. **retired** (it left the group: ``retire``, so ``states()`` no longer names it): its worker is deregistered (``DELETE
   /workers/{id}``), so the gateway stops sending to it at once (NeMo-RL #3613: an engine never deregistered took
   traffic for ~180 s). An engine joining or fenced (``resilience.barrier.membership``) is not serving, so it is held
   out as in 1-2.

:meth:`SmgRouter.sync` does one pass and is idempotent (it PATCHes only what differs from what it last applied, per
worker id); :meth:`SmgRouter.start` runs it every ``interval_s`` on a thread, and the router is also an orchestrator
observer (``Orchestrator(..., observers=[router])``): a ``HoldChanged`` or ``EngineStateChanged`` event wakes the thread
at once. Every request to the gateway or an engine has a timeout; a gateway that does not answer is retried on the next
pass.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import requests

from resilience.engine_contract import EngineState, EngineStateChanged, HoldChanged
from resilience.events import Event

__all__ = ["HELD_LABEL", "GatewayHealthSettings", "HoldOrchestrator", "SmgRouter", "SyncReport", "gateway_session"]

log = logging.getLogger(__name__)

HELD_LABEL = "cpr.held"
"""The worker label SmgRouter sets: the orchestrator's state of a held engine (``paused``, ``released``, ...),
``dead`` once it gave the engine back to smg's checker, ``""`` when released."""

_NEVER_FAILS = 1_000_000
"""A failure threshold no hold reaches: ``3 x`` that many failed probes before smg calls a worker ``failed``."""

Phase = Literal["free", "leaving", "held", "dead"]


class HoldOrchestrator(Protocol):
    """What SmgRouter needs of ``resilience.barrier.Orchestrator`` (or ``AsyncOrchestrator``)."""

    def states(self) -> dict[str, EngineState]:
        """Every engine's state, by name (its URL)."""
        ...


def gateway_session(gateway_url: str, api_key: str | None) -> tuple[str, requests.Session]:
    """``gateway_url`` checked (an http(s):// URL, no trailing slash) and a session for it: no proxy from the
    environment, the gateway's key (``--api-key``) as a bearer token, never logged."""
    if not gateway_url.startswith(("http://", "https://")):
        raise ValueError(f"`gateway_url` must be an http(s):// URL, but was {gateway_url!r}")
    session = requests.Session()
    session.trust_env = False
    if api_key:
        session.headers["Authorization"] = f"Bearer {api_key}"
    return gateway_url.rstrip("/"), session


@dataclass(frozen=True, slots=True)
class GatewayHealthSettings:
    """The gateway's own health settings (its ``smg launch`` flags), restored on every worker SmgRouter releases.

    ``timeout_s``: ``--health-check-timeout-secs`` (smg default 5). ``interval_s``:
    ``--health-check-interval-secs`` (60). ``failure_threshold``: ``--health-failure-threshold`` (3).
    ``success_threshold``: ``--health-success-threshold`` (2).
    """

    timeout_s: int = 5
    interval_s: int = 60
    failure_threshold: int = 3
    success_threshold: int = 2

    def __post_init__(self) -> None:
        for name in ("timeout_s", "interval_s", "failure_threshold", "success_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be an integer >= 1 (smg's rule), but was {value!r}")

    def body(self) -> dict[str, int]:
        """The ``health`` object of a ``PATCH /workers/{id}`` that puts these settings back."""
        return {
            "timeout_secs": self.timeout_s,
            "check_interval_secs": self.interval_s,
            "failure_threshold": self.failure_threshold,
            "success_threshold": self.success_threshold,
        }


@dataclass(slots=True)
class SyncReport:
    """What one :meth:`SmgRouter.sync` pass did, by engine name."""

    patched: dict[str, Phase] = field(default_factory=dict)
    """Engines whose gateway worker was PATCHed, with the phase it was moved to."""
    removed: list[str] = field(default_factory=list)
    """Engines that left the orchestrator (retired) whose gateway worker this pass deregistered."""
    missing: list[str] = field(default_factory=list)
    """Engines the gateway has no worker for (never registered, or removed)."""
    errors: dict[str, str] = field(default_factory=dict)
    """Engines whose PATCH or lookup failed this pass (retried on the next)."""


@dataclass(slots=True)
class _Worker:
    worker_id: str
    phase: Phase = "free"
    label: str = ""
    misses: int = 0


class SmgRouter:
    """Keeps an smg gateway's view of the orchestrator's engines in step with its holds (see the module docstring).

    - ``gateway_url``: the gateway (``http://127.0.0.1:PORT``), with its worker API.
    - ``orchestrator``: anything with ``states()`` (the ``Orchestrator``).
    - ``settings``: the gateway's own health settings, put back on release (:class:`GatewayHealthSettings`).
    - ``engines``: the engine names this router keeps in step (default None: every engine of the orchestrator).
    - ``worker_urls``: engine name -> the URL the gateway knows that engine by, when they differ (a proxy
      in between); default: the same URL.
    - ``api_key``: the gateway's admin key (``--api-key``), sent as a bearer token; never logged.
    - ``interval_s``: seconds between passes of :meth:`start`'s thread (default 0.25).
    - ``timeout_s``: per-request timeout to the gateway and to engines' ``/model_info`` (default 2).
    - ``dead_after``: failed ``/model_info`` answers in a row that make a held engine dead (default 2).
    """

    def __init__(
        self,
        gateway_url: str,
        orchestrator: HoldOrchestrator,
        settings: GatewayHealthSettings | None = None,
        *,
        engines: Collection[str] | None = None,
        worker_urls: Mapping[str, str] | None = None,
        api_key: str | None = None,
        interval_s: float = 0.25,
        timeout_s: float = 2.0,
        dead_after: int = 2,
    ) -> None:
        if not interval_s > 0 or not timeout_s > 0:
            raise ValueError(f"`interval_s` and `timeout_s` must be > 0 seconds, but were {interval_s!r} and {timeout_s!r}")
        if isinstance(dead_after, bool) or not isinstance(dead_after, int) or dead_after < 1:
            raise ValueError(f"`dead_after` must be an integer >= 1, but was {dead_after!r}")
        self.gateway_url, self._session = gateway_session(gateway_url, api_key)
        self.orchestrator = orchestrator
        self.settings = settings if settings is not None else GatewayHealthSettings()
        self._engines = None if engines is None else frozenset(engines)
        self._aliases = dict(worker_urls or {})
        self._interval = interval_s
        self._timeout = timeout_s
        self._dead_after = dead_after
        self._workers: dict[str, _Worker] = {}  # engine name -> what this router last applied to its gateway worker
        self._lock = threading.Lock()  # one pass at a time
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the observer --------------------------------------------------------------

    def __call__(self, event: Event) -> None:
        """Orchestrator observer: a hold or state change wakes the sync thread (never blocks, never raises)."""
        if isinstance(event, HoldChanged | EngineStateChanged):
            self._wake.set()

    # -- one pass ------------------------------------------------------------------

    def phases(self) -> dict[str, Phase]:
        """What this router last applied per engine: ``free``, ``leaving`` (taken out), ``held`` or ``dead``."""
        with self._lock:
            return {name: w.phase for name, w in self._workers.items()}

    def sync(self) -> SyncReport:
        """One pass: bring every engine's gateway worker to the phase the orchestrator's state asks for. Idempotent."""
        with self._lock:
            return self._sync()

    def _sync(self) -> SyncReport:
        report = SyncReport()
        states = {n: s for n, s in self.orchestrator.states().items() if self._engines is None or n in self._engines}
        try:
            listed = self._list_workers()
        except (requests.RequestException, ValueError) as exc:
            report.errors = {name: f"GET /workers: {type(exc).__name__}" for name in states}
            return report
        for name, state in states.items():
            url = self._aliases.get(name, name)
            found = listed.get(url)
            if found is None:
                report.missing.append(name)
                self._workers.pop(name, None)
                continue
            worker_id, status = found
            known = self._workers.get(name)
            if known is None or known.worker_id != worker_id:  # first sight, or removed and registered again
                known = self._workers[name] = _Worker(worker_id)
            try:
                self._step(name, url, state, status, known, report)
            except requests.RequestException as exc:
                report.errors[name] = f"{type(exc).__name__}"
        for name in [n for n in self._workers if n not in states]:  # retired: it left the group
            self._deregister(name, self._workers[name], listed, report)
        return report

    def _deregister(self, name: str, w: _Worker, listed: Mapping[str, tuple[str, str]], report: SyncReport) -> None:
        """``DELETE`` the worker of ``name``, an engine that left the orchestrator; kept for the next pass on an error."""
        if w.worker_id not in {worker_id for worker_id, _ in listed.values()}:
            del self._workers[name]  # already gone from the gateway
            return
        try:
            response = self._session.delete(f"{self.gateway_url}/workers/{w.worker_id}", timeout=self._timeout)
            response.raise_for_status()
        except requests.RequestException as exc:
            report.errors[name] = f"DELETE /workers: {type(exc).__name__}"
            return
        del self._workers[name]
        report.removed.append(name)

    def _step(self, name: str, url: str, state: EngineState, status: str, w: _Worker, report: SyncReport) -> None:
        if state is EngineState.SERVING:
            if w.phase != "free":
                self._patch(w, health=self.settings.body(), label="")
                w.phase, w.misses = "free", 0
                report.patched[name] = "free"
            return
        if state is EngineState.DEAD or w.phase == "dead" or self._engine_dead(url, w):
            if w.phase != "dead":
                self._patch(w, health=self.settings.body(), label="dead")
                w.phase = "dead"
                report.patched[name] = "dead"
            return
        label = str(state)
        if w.phase == "free":
            self._patch(w, health={"failure_threshold": 1, "timeout_secs": 1, "check_interval_secs": 1}, label=label)
            w.phase = "leaving"
            report.patched[name] = "leaving"
        if w.phase == "leaving" and status not in ("ready", "pending"):
            self._patch(w, health={"failure_threshold": _NEVER_FAILS}, label=label)
            w.phase = "held"
            report.patched[name] = "held"
        elif w.label != label and w.phase == "held":
            self._patch(w, label=label)

    def _engine_dead(self, url: str, w: _Worker) -> bool:
        """Ask a held engine's ``/model_info`` (answered without the scheduler); ``dead_after`` failures in a row = dead."""
        try:
            response = self._session.get(f"{url}/model_info", timeout=self._timeout)
            response.close()
            alive = response.status_code < 500
        except requests.RequestException:
            alive = False
        w.misses = 0 if alive else w.misses + 1
        return w.misses >= self._dead_after

    def _list_workers(self) -> dict[str, tuple[str, str]]:
        response = self._session.get(f"{self.gateway_url}/workers", timeout=self._timeout)
        response.raise_for_status()
        return {str(w["url"]): (str(w["id"]), str(w.get("status"))) for w in response.json().get("workers", [])}

    def _patch(self, w: _Worker, *, health: Mapping[str, Any] | None = None, label: str | None = None) -> None:
        body: dict[str, Any] = {}
        if health is not None:
            body["health"] = dict(health)
        if label is not None:
            body["labels"] = {HELD_LABEL: label}
        response = self._session.patch(f"{self.gateway_url}/workers/{w.worker_id}", json=body, timeout=self._timeout)
        response.raise_for_status()
        if label is not None:
            w.label = label

    # -- the thread ----------------------------------------------------------------

    def start(self) -> SmgRouter:
        """Run :meth:`sync` every ``interval_s`` (and at once on a hold or state event) until :meth:`stop`."""
        if self._thread is not None:
            raise RuntimeError("SmgRouter.start() was already called")
        self._thread = threading.Thread(target=self._run, name="smg-router", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception:  # a pass that failed is retried on the next one; the thread must live
                log.exception("SmgRouter: a sync pass failed")
            self._wake.wait(self._interval)
            self._wake.clear()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (bounded wait) and close the HTTP session. Idempotent. Leaves the gateway as it is."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with contextlib.suppress(Exception):
            self._session.close()

    def __enter__(self) -> SmgRouter:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
