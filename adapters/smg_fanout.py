"""SmgFanOut: the barrier's phases through an smg gateway's ``/v1/rl`` fan-out, for trainers that reach only the gateway.

Each phase is one ``POST /v1/rl/engine/{path}?selector=id in (...)`` (smg 1.13.0 with ``--enable-rl``), naming exactly
the phase's engines by their gateway worker ids (engines whose calls carry different arguments go in one fan-out each,
concurrently). smg answers 200 (all succeeded) or 207 (some failed) with ``results`` (an engine's own answer:
``status``, ``body``) and ``failed`` (``error``, ``message``, maybe ``status``). Each engine's
:class:`~resilience.barrier.fanout.EngineResult` carries a delivery record (``resilience.outcome.AttemptRecord``), so
the barrier's ``effect_of`` reads it like any driver's:

- a result with a 2xx: the call's value (``ControlResult``, ``FlushResult``), APPLIED;
- a result with the engine's error status (an engine refusal, 4xx or 5xx): RESPONDED with that status; a 502/503/504 (a
  proxy between the gateway and the engine may answer it after forwarding) is MAYBE, anything else NOT_APPLIED;
- a ``failed`` entry: ``no_control_endpoint`` and other refusals before sending are NOT_SENT; ``upstream_unreachable``
  (reqwest's "error sending request" covers a refused connect and a reset after sending alike), an expired
  ``--rl-control-timeout-secs`` and anything else are AMBIGUOUS; one with a ``status`` is that answer (RESPONDED);
- an engine the gateway's answer does not mention: MAYBE.

When **the gateway itself** fails, nothing says what reached the engines: a 5xx or a body that is not the fan-out's (a
502 from a proxy in front of smg), a reset or a read timeout after the request was sent: every engine of that call is
MAYBE (its touched facts unknown). A connection the gateway refused, or its own 4xx refusal (``no_workers_match``, a bad
selector), proves nothing was fanned out: :class:`GatewayRefused` (an ``EngineSkipped``), NOT_APPLIED, and never read as
the engine being dead.

``flush_cache`` asks SGLang to wait for idle (``?timeout=``) and, while engines answer 400 (not idle yet), asks those
again until the phase deadline. The idempotent calls (pause, flush, continue: sending one twice does no harm) are sent
again, up to ``retries`` times, to the engines whose answer was a maybe (a 502/503/504, unreachable, timed out); release
and resume never are (a second release or resume crashes SGLang): their maybe goes to the barrier, unless a
``memory_probe`` proves it (``memory_check.probe_verdict``): applied (``ControlResult.confirmed_by_probe``), or not
applied after a 502/503 (sent again, up to ``retries``). Every HTTP request is bounded by the phase deadline (or
``timeout_s``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests

from resilience.adapters.engine_state import ForwardedCalls
from resilience.adapters.requests import exception_chain
from resilience.adapters.sglang import ControlResult, FlushResult
from resilience.adapters.sglang.calls import Call, continue_call, flush_call, memory_call, memory_tags, pause_call
from resilience.adapters.sglang.memory_check import probe_verdict
from resilience.adapters.smg import gateway_session
from resilience.barrier.fanout import Calls, EngineResult, PhaseTimeout
from resilience.barrier.state import EngineSkipped
from resilience.deadline import Deadline
from resilience.engine_contract import GATEWAY_STATUSES, MemoryProbe, engine_name
from resilience.events import AttemptEnded, CallEnded, CallStarted, Observer, RetryScheduled, emit
from resilience.outcome import AttemptRecord, CallOutcome, Delivery, Outcome
from resilience.policy import ProbeAnswer

__all__ = ["GatewayRefused", "SmgEngine", "SmgFanOut", "SmgWorkerError"]

_NOT_SENT_ERRORS = frozenset({"no_control_endpoint", "worker_not_found", "bad_request", "invalid_path"})
"""``failed[].error`` codes smg gives before it sends anything to the engine."""
_IDEMPOTENT = frozenset({"pause_generation", "flush_cache", "continue_generation"})
"""The calls SmgFanOut sends again after a maybe (``resilience.testing.faultplan``'s idempotent control calls)."""
_MEMORY = frozenset({"release_memory_occupation", "resume_memory_occupation"})
_FLUSH_WAIT_S = 2.0
"""Seconds SGLang waits for idle on one ``flush_cache`` (its ``?timeout=``), capped by the phase deadline."""


class SmgWorkerError(ConnectionError):
    """One engine's call through the gateway did not succeed; ``attempts`` is its delivery record (one attempt)."""

    def __init__(self, message: str, record: AttemptRecord) -> None:
        super().__init__(message)
        self.attempts = (record,)


class GatewayRefused(EngineSkipped):
    """The gateway refused the call before fanning it out (connection refused, its own 4xx): nothing reached the engine."""


def _record(delivery: Delivery, status: int | None, duration_s: float, error_type: str | None = None) -> AttemptRecord:
    if delivery is Delivery.RESPONDED and status is not None and status < 400:
        outcome = Outcome.SUCCESS
    elif delivery is Delivery.AMBIGUOUS:
        outcome = Outcome.AMBIGUOUS
    else:
        outcome = Outcome.FATAL
    return AttemptRecord(0, status, outcome, delivery, error_type, duration_s)


def _request(method: str, kwargs: Mapping[str, Any], flush_wait_s: float) -> Call:
    """The engine call one barrier control call is, built as ``SGLangClient`` builds it (its checks included: a pause
    mode SGLang does not know is refused before anything is sent)."""
    if method == "pause_generation":
        return pause_call(kwargs.get("mode", "abort"))
    if method == "continue_generation":
        return continue_call(bool(kwargs.get("torch_empty_cache", True)))
    if method in ("release_memory_occupation", "resume_memory_occupation"):
        return memory_call(f"/{method}", kwargs.get("tags"))
    if method == "flush_cache":
        return flush_call(flush_wait_s)
    raise ValueError(f"SmgFanOut cannot send {method!r}: not a barrier control call")


@dataclass(frozen=True, slots=True)
class _Answer:
    """One engine's outcome inside one fan-out: a success body, or an error."""

    status: int | None
    body: Any = None
    error: BaseException | None = None


class SmgFanOut:
    """Sends each phase through the gateway at ``gateway_url`` (see the module docstring).

    - ``gateway_url``: the smg gateway (``http://127.0.0.1:PORT``), launched with ``--enable-rl``.
    - ``api_key``: the gateway's key (``--api-key``), sent as a bearer token; never logged.
    - ``worker_urls``: engine name -> the URL the gateway knows it by, when they differ; default the same.
    - ``timeout_s``: the HTTP timeout of a call when the phase deadline is unbounded (default 630: past smg's
      own ``--rl-control-timeout-secs`` default of 600, so smg's answer comes first).
    - ``max_workers``: concurrent fan-out calls at most (engines with different arguments; default 8).
    - ``memory_probe``: proves a release or resume whose answer was ambiguous (or, after a 502/503, not
      applied: then sent again); default None (every such maybe goes to the barrier).
    - ``observers``: told of each engine's call as our drivers tell theirs (``CallStarted``, ``AttemptEnded`` per
      answer, ``RetryScheduled`` per re-send, ``CallEnded``; endpoint ``POST /{path}``), so ``MetricsObserver``
      counts the 502s the gateway relayed and the ones re-sending absorbed; default none.
    - ``retries``: times an idempotent call (pause, flush, continue) is sent again to an engine whose answer was a
      maybe (default 2; 0 = never); ``backoff_s`` apart (default 0.05).
    """

    def __init__(
        self,
        gateway_url: str,
        *,
        api_key: str | None = None,
        worker_urls: Mapping[str, str] | None = None,
        timeout_s: float = 630.0,
        max_workers: int = 8,
        retries: int = 2,
        backoff_s: float = 0.05,
        memory_probe: MemoryProbe | None = None,
        observers: Sequence[Observer] = (),
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"`timeout_s` must be > 0 seconds, but was {timeout_s!r}")
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"`max_workers` must be an integer >= 1, but was {max_workers!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"`retries` must be an integer >= 0, but was {retries!r}")
        if not backoff_s >= 0:
            raise ValueError(f"`backoff_s` must be >= 0 seconds, but was {backoff_s!r}")
        self._retries = retries
        self._probe = memory_probe
        self._observers = tuple(observers)
        self.absorbed_502 = 0
        """502 answers (from the engine side of the gateway) inside phase calls that ended well for that engine."""
        self.probe_verdicts = 0
        """Releases and resumes whose maybe the memory probe settled (applied, or not applied and sent again)."""
        self._backoff = backoff_s
        self.gateway_url, self._session = gateway_session(gateway_url, api_key)
        self._aliases = dict(worker_urls or {})
        self._timeout = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="smg-fanout")
        self._ids: dict[str, str] = {}  # gateway URL -> worker id
        self._ids_lock = threading.Lock()
        self.gateway_calls = 0
        """Fan-out requests sent to the gateway so far."""
        self._counts_lock = threading.Lock()
        """Guards the three counters: phases with different arguments run on the pool's threads at once."""

    # -- engines -------------------------------------------------------------------

    def engines(self, urls: Iterable[str]) -> list[SmgEngine]:
        """One :class:`SmgEngine` per engine URL, for ``EngineGroup``: its calls go through this gateway."""
        return [SmgEngine(url, self) for url in urls]

    def check_engines(self, engines: Iterable[object]) -> None:
        """Called by the Orchestrator: every engine must be a worker of the gateway (``GET /v1/rl/workers``), else
        ``TypeError`` naming it; ``ConnectionError`` when the gateway does not answer."""
        self._refresh_ids()
        for engine in engines:
            name = engine_name(engine)
            if self._aliases.get(name, name) not in self._ids:
                raise TypeError(f"{name} is not a worker of the gateway {self.gateway_url} (GET /v1/rl/workers does not list it)")

    def _refresh_ids(self) -> None:
        try:
            response = self._session.get(f"{self.gateway_url}/v1/rl/workers", timeout=min(self._timeout, 10.0))
            response.raise_for_status()
        except requests.RequestException as exc:
            raise ConnectionError(f"cannot list the workers of the gateway {self.gateway_url} (GET /v1/rl/workers): {exc}") from exc
        ids = {str(w["url"]): str(w["id"]) for w in response.json().get("workers", [])}
        with self._ids_lock:
            self._ids = ids

    def _forget(self) -> None:
        """Drop the cached worker ids: the next call asks the gateway again."""
        with self._ids_lock:
            self._ids = {}

    def _worker_id(self, name: str) -> str | None:
        url = self._aliases.get(name, name)
        with self._ids_lock:
            known = self._ids.get(url)
        if known is None:
            try:
                self._refresh_ids()
            except (ConnectionError, ValueError):
                return None
            with self._ids_lock:
                known = self._ids.get(url)
        return known

    # -- a phase -------------------------------------------------------------------

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        """One result per (engine, kwargs) pair, in the order given; engines with equal kwargs share one fan-out."""
        names = [engine_name(engine) for engine, _ in calls]
        batches: dict[tuple[tuple[str, Any], ...], list[int]] = {}
        for i, (_, kwargs) in enumerate(calls):
            key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
            batches.setdefault(key, []).append(i)
        results: list[EngineResult | None] = [None] * len(calls)

        def run(indices: list[int]) -> None:
            kwargs = calls[indices[0]][1]
            for i, result in zip(indices, self._phase([names[i] for i in indices], method, kwargs, deadline), strict=True):
                results[i] = result

        groups = list(batches.values())
        if len(groups) == 1:
            run(groups[0])
        else:
            for future in [self._pool.submit(run, g) for g in groups]:
                future.result()
        lost = PhaseTimeout("no answer", maybe_sent=True)
        return [r if r is not None else EngineResult(n, error=lost) for r, n in zip(results, names, strict=True)]

    def _phase(self, names: Sequence[str], method: str, kwargs: Mapping[str, Any], deadline: Deadline) -> list[EngineResult]:
        t0 = time.monotonic()
        endpoint = _request(method, kwargs, 0.0).endpoint  # first: a call SGLang would refuse is never sent, nor are ids asked for
        ids: dict[str, str] = {}
        results: dict[str, EngineResult] = {}
        for name in names:
            worker_id = self._worker_id(name)
            if worker_id is None:
                results[name] = EngineResult(name, error=GatewayRefused(f"{name}: the gateway has no worker for it; nothing was sent"))
            else:
                ids[name] = worker_id
        polls = verdicts = 0
        resends: dict[str, int] = {}
        seen_502: dict[str, int] = {}
        pending = dict(ids)
        calls = {name: _Track(next(_CALL_IDS)) for name in ids} if self._observers else {}
        for name, track in calls.items():
            limit = deadline.remaining() if deadline.bounded else None
            emit(self._observers, CallStarted(call_id=track.call_id, method="POST", endpoint=endpoint, engine=name, deadline_s=limit))
        while pending:
            if deadline.expired():
                for name in pending:
                    results[name] = EngineResult(name, error=PhaseTimeout(f"no time left for {method}", maybe_sent=polls > 0))
                break
            polls += 1
            remaining = deadline.remaining() if deadline.bounded else None
            flush_wait = min(_FLUSH_WAIT_S, max(0.0, (remaining or _FLUSH_WAIT_S) - 0.5))
            sent_at = time.monotonic()
            answers = self._fan_out(list(pending.values()), method, kwargs, remaining, flush_wait)
            retry: dict[str, str] = {}
            for name, worker_id in pending.items():
                answer = answers.get(worker_id)
                duration = time.monotonic() - t0
                if answer is not None and answer.status == 502:
                    seen_502[name] = seen_502.get(name, 0) + 1
                if answer is None:
                    record = _record(Delivery.AMBIGUOUS, None, duration, "NotInAnswer")
                    error: BaseException = SmgWorkerError(f"{name}: the gateway's answer to {method} does not mention it", record)
                    results[name] = EngineResult(name, error=error, duration_s=duration)
                elif answer.error is None:
                    results[name] = EngineResult(name, value=self._value(name, method, answer.body, polls), duration_s=duration)
                else:
                    results[name] = EngineResult(name, error=answer.error, duration_s=duration)
                    verdict = self._verdict(name, method, kwargs, answer) if method in _MEMORY and _maybe(answer.error) else None
                    if verdict:
                        verdicts += 1
                        value = ControlResult(name, f"/{method}", "applied (the memory probe proved it)", confirmed_by_probe=True)
                        results[name] = EngineResult(name, value=value, duration_s=duration)
                    elif method == "flush_cache" and _engine_status(answer) == 400 and not deadline.expired():
                        retry[name] = worker_id  # SGLang: not idle yet; ask again
                    elif (verdict is False or (method in _IDEMPOTENT and _maybe(answer.error))) and resends.get(name, 0) < self._retries:
                        verdicts += verdict is False  # proved not applied after a 502/503, or idempotent: sending it again is safe
                        resends[name] = resends.get(name, 0) + 1
                        retry[name] = worker_id
                if name in calls:
                    calls[name].attempt(self._observers, endpoint, name, answers.get(worker_id), time.monotonic() - sent_at)
                    if name in retry and not (method == "flush_cache" and _engine_status(answers[worker_id]) == 400):
                        calls[name].retry(self._observers, endpoint, name, answers[worker_id], self._backoff)
            pending = retry
            if pending:
                time.sleep(self._backoff if resends else 0.05)
        for name, track in calls.items():
            track.end(self._observers, endpoint, name, results[name], time.monotonic() - t0)
        with self._counts_lock:
            self.absorbed_502 += sum(n for name, n in seen_502.items() if results[name].ok)
            self.probe_verdicts += verdicts
        return [results[n] for n in names]

    def _verdict(self, name: str, method: str, kwargs: Mapping[str, Any], answer: _Answer) -> bool | None:
        """The memory probe's word on a release or resume that got a maybe (``memory_check.probe_verdict``): True
        applied, False not applied (after a 502/503 only), None unknown (no probe, or nothing proved)."""
        if self._probe is None:
            return None
        tags = frozenset(memory_tags(kwargs.get("tags")))
        verdict = probe_verdict(self._probe, name, tags, releasing=method == "release_memory_occupation", status=answer.status)
        return None if verdict is ProbeAnswer.UNKNOWN else verdict is ProbeAnswer.DONE

    def _value(self, name: str, method: str, body: Any, polls: int) -> object:
        message = body.get("message", "") if isinstance(body, dict) else (body if isinstance(body, str) else "")
        if method == "flush_cache":
            return FlushResult(name, str(message).strip(), polls)
        return ControlResult(name, f"/{method}", str(message))

    def _fan_out(
        self, worker_ids: Sequence[str], method: str, kwargs: Mapping[str, Any], remaining: float | None, flush_wait_s: float
    ) -> dict[str, _Answer]:
        """One ``POST /v1/rl/engine/{path}`` naming ``worker_ids``; an answer per worker id (every one on a gateway failure)."""
        call = _request(method, kwargs, flush_wait_s)
        path, body = call.path.lstrip("/"), {} if call.body is None else call.body  # smg's RL routes take a JSON body
        params = {**(call.params or {}), "selector": f"id in ({','.join(worker_ids)})"}
        timeout = self._timeout if remaining is None else max(0.05, remaining)
        t0 = time.monotonic()
        with self._counts_lock:
            self.gateway_calls += 1
        try:
            response = self._session.post(f"{self.gateway_url}/v1/rl/engine/{path}", json=body, params=params, timeout=timeout)
        except (requests.ConnectionError, requests.Timeout) as exc:
            if isinstance(exc, requests.ConnectTimeout) or (isinstance(exc, requests.ConnectionError) and _refused(exc)):
                refused = f"gateway refused {method}: {type(exc).__name__}; nothing was sent"
                return {w: _Answer(None, error=GatewayRefused(refused)) for w in worker_ids}
            record = _record(Delivery.AMBIGUOUS, None, time.monotonic() - t0, type(exc).__name__)
            lost = f"gateway lost during {method}: {type(exc).__name__}"
            return {w: _Answer(None, error=SmgWorkerError(lost, record)) for w in worker_ids}
        duration = time.monotonic() - t0
        payload = _json(response)
        if response.status_code in (200, 207) and isinstance(payload, dict) and "results" in payload:
            answers = self._per_worker(payload, method, duration)
            missing = [w for w in worker_ids if w not in answers]
            if missing and len(answers) == int(payload.get("total", -1)):  # smg answers every worker it selected
                self._forget()  # an id it no longer has (a worker removed, registered again): learn them anew
                why = f"gateway has no worker with this id any more; {method} was not sent to it"
                answers.update({w: _Answer(None, error=GatewayRefused(why)) for w in missing})
            return answers
        if 400 <= response.status_code < 500 and isinstance(payload, dict) and "error" in payload:
            if payload.get("error") in ("no_workers_match", "worker_not_found"):
                self._forget()
            why = f"gateway refused {method} ({response.status_code} {payload.get('error')}); nothing was sent"
            return {w: _Answer(response.status_code, error=GatewayRefused(why)) for w in worker_ids}
        record = _record(Delivery.AMBIGUOUS, None, duration, f"Gateway{response.status_code}")
        why = f"gateway answered {response.status_code} to {method} without per-engine results: each may have applied it"
        return {w: _Answer(response.status_code, error=SmgWorkerError(why, record)) for w in worker_ids}

    def _per_worker(self, payload: Mapping[str, Any], method: str, duration: float) -> dict[str, _Answer]:
        answers: dict[str, _Answer] = {}
        for worker_id, result in (payload.get("results") or {}).items():
            status = int(result.get("status", 0))
            if 200 <= status < 300:
                answers[worker_id] = _Answer(status, body=result.get("body"))
            else:
                record = _record(Delivery.RESPONDED, status, duration)
                answers[worker_id] = _Answer(status, error=SmgWorkerError(f"{method} answered {status} through the gateway", record))
        for failure in payload.get("failed") or []:
            worker_id = str(failure.get("worker_id", ""))
            code = str(failure.get("error", ""))
            status = failure.get("status")
            if isinstance(status, int):
                record = _record(Delivery.RESPONDED, status, duration, code or None)
            elif code in _NOT_SENT_ERRORS:
                record = _record(Delivery.NOT_SENT, None, duration, code)
            else:
                record = _record(Delivery.AMBIGUOUS, None, duration, code or "unknown")
            error = SmgWorkerError(f"{method} failed through the gateway: {code}", record)
            answers[worker_id] = _Answer(status if isinstance(status, int) else None, error=error)
        return answers

    def close(self) -> None:
        """Stop the pool and close the HTTP session."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._session.close()


_CALL_IDS = itertools.count(1 << 40)
"""Call ids of the events SmgFanOut emits (far above the retry loop's own, so the two never meet)."""


@dataclass(slots=True)
class _Track:
    """One engine's call inside one phase, as events: its id, attempts so far, and the last answer."""

    call_id: int
    attempts: int = 0

    def attempt(self, observers: Sequence[Observer], endpoint: str, engine: str, answer: _Answer | None, duration: float) -> None:
        error = None if answer is None else answer.error
        record = error.attempts[0] if isinstance(error, SmgWorkerError) else None
        status = None if answer is None else answer.status
        if answer is not None and error is None:
            outcome, sent, error_type = Outcome.SUCCESS, True, None
        elif isinstance(error, GatewayRefused):
            outcome, sent, error_type = Outcome.RETRYABLE, False, type(error).__name__
        else:
            outcome = record.outcome if record is not None else Outcome.AMBIGUOUS
            sent = record is None or record.delivery is not Delivery.NOT_SENT
            error_type = (record.error_type if record is not None else None) or (str(status) if status else "NotInAnswer")
        attempt = AttemptEnded(
            call_id=self.call_id, attempt=self.attempts, method="POST", endpoint=endpoint, engine=engine, status=status, outcome=outcome,
            error_type=error_type, sent=sent, duration_s=duration,
        )
        emit(observers, attempt)
        self.attempts += 1

    def retry(self, observers: Sequence[Observer], endpoint: str, engine: str, answer: _Answer, delay: float) -> None:
        reason = f"status_{answer.status}" if answer.status is not None else "read_timeout"
        emit(
            observers,
            RetryScheduled(call_id=self.call_id, attempt=self.attempts - 1, endpoint=endpoint, engine=engine, reason=reason, delay_s=delay),
        )

    def end(self, observers: Sequence[Observer], endpoint: str, engine: str, result: EngineResult, duration: float) -> None:
        error = result.error
        if error is None:
            outcome = CallOutcome.SUCCESS if self.attempts <= 1 else CallOutcome.RETRIED_SUCCESS
        elif isinstance(error, PhaseTimeout):
            outcome = CallOutcome.DEADLINE_EXCEEDED
        elif _maybe(error):
            outcome = CallOutcome.AMBIGUOUS
        else:
            outcome = CallOutcome.FAILED
        status = error.attempts[0].status if isinstance(error, SmgWorkerError) else (None if error is not None else 200)
        ended = CallEnded(
            call_id=self.call_id, method="POST", endpoint=endpoint, engine=engine, outcome=outcome, status=status, attempts=self.attempts,
            duration_s=duration, error_type=None if error is None else type(error).__name__, retry_budget_tokens=None,
        )
        emit(observers, ended)


def _engine_status(answer: _Answer) -> int | None:
    """The status the engine side answered (through the gateway), or None (no answer, or the gateway's own refusal)."""
    return answer.status if isinstance(answer.error, SmgWorkerError) else None


def _maybe(error: BaseException) -> bool:
    """An answer that may or may not have been applied: a gateway status, or no answer (unreachable, timed out, lost)."""
    if not isinstance(error, SmgWorkerError):
        return False
    record = error.attempts[0]
    return record.delivery is Delivery.AMBIGUOUS or record.status in GATEWAY_STATUSES


def _refused(exc: requests.ConnectionError) -> bool:
    """True when the connection to the gateway was refused (nothing sent), as opposed to lost after sending."""
    return any(isinstance(cause, ConnectionRefusedError) for cause in exception_chain(exc))


def _json(response: requests.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


class SmgEngine(ForwardedCalls):
    """One engine the barrier drives through the gateway: its name is its URL; each call is a one-engine fan-out."""

    def __init__(self, url: str, fanout: SmgFanOut) -> None:
        self.engine = url
        self._fanout = fanout

    def __repr__(self) -> str:
        return f"SmgEngine({self.engine!r})"

    def _forward(self, method: str, kwargs: Mapping[str, Any]) -> Any:
        """``method`` through the gateway on this engine alone, within a flush's ``deadline_s`` (None: no limit of its
        own) and the deadline in force; a negative or NaN one is a ``ConfigError``, as for ``SGLangClient``."""
        sent = dict(kwargs)
        with Deadline(sent.pop("deadline_s", None)) as deadline:  # capped by the deadline in force, if any
            result = self._fanout.call([(self, sent)], method, deadline)
        if result[0].error is not None:
            raise result[0].error
        return result[0].value
