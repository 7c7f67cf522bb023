"""``AttemptLedger`` and ``LedgerRetrier``: one engine+endpoint's attempts counted across calls.

A framework that has its own retry loop (AReaL's ``arequest_with_retry``: 3 tries, 1 s apart; verl's
``_make_async_request``: 3 tries, 2 s then 4 s) sends a new logical call after ours gave up, and each call would get the
policy's ``max_attempts`` again: AReaL's 3 tries times our 6 attempts sent up to 17 releases to one engine in one cycle.
The ledger remembers, per engine and endpoint template, what recent calls spent and whether the last attempt was left
unresolved, and ``LedgerRetrier`` (a ``Retrier``) starts each call from it:

- **Which calls share a count.** Only where a re-send can hurt: a non-idempotent endpoint (SGLang's release and resume,
  the weight updates) unless its probe has just answered "not applied". There the attempts that may have reached the
  engine (``Delivery`` other than ``NOT_SENT``) in calls that did not succeed are counted; a call starts with
  ``max_attempts`` minus that count, and one with nothing left is refused before sending (``RetriesExhausted``, the
  driver's own class). A success, or a probe that confirms the call was applied, clears the count.
- **Everywhere else** (an idempotent endpoint: ``/pause_generation``, ``/flush_cache``, ``/continue_generation``; a
  release the probe proved not applied) a re-send is harmless, so a framework's own retry gets its own ``max_attempts``,
  bounded by the engine's retry budget (below) and by the endpoint's ``deadline_s`` counted from the first failed
  attempt of the run of failed calls: a repeat runs under a ``Deadline`` of what is left of it, and one with nothing
  left is refused before sending (``DeadlineExceeded``). A call of ours that spends all its attempts on gateway statuses
  there goes on in further rounds under the same bounds (``_go_on``), as a framework's retry would: a streak of 502s
  longer than one call's attempts is ridden out within the deadline even by a framework that never retries a status
  (verl). The engine's breaker still cuts an engine that only fails (``CircuitOpen``).
- **Budget.** The first attempt of a call that repeats a failed one is a retry for the engine's retry budget: it takes a
  token, and none left refuses the call (``RetryBudgetExhausted``).
- **Unresolved non-idempotent calls.** When the last attempt on a non-idempotent endpoint ended without an answer that
  settles it (a gateway status 502/503/504, a read timeout or a connection dropped after sending), the next call asks
  the endpoint's probe first (``EndpointPolicy.on_ambiguous`` when it is a callable, e.g. the memory probe of
  ``sglang_policies``): "done" returns the driver's "applied" response without sending, "not done" sends with attempts
  of its own, "unknown" (or no probe) follows the preset with the shared count: a gateway status is re-sent only when
  the policy sets ``retry_statuses_if_not_idempotent`` (the seed's trade-off), a transport ambiguity never
  (``AmbiguousOutcome``).
- **Window.** An entry is forgotten ``window_s`` seconds (default 10) after its last attempt: a framework's loop
  re-sends within seconds; a later call is a new decision of its caller.

Thread-safe (one lock, never held across I/O); one ledger serves every driver of a process
(``resilience.adapters.instrument.SGLangInstrumentor`` shares one across requests, httpx and aiohttp).
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar, cast

from resilience.adapters.engine_steps import Steps, drive, run_now, value_of
from resilience.breaker import BreakerRegistry
from resilience.budget import RetryBudgets
from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.deadline import Deadline
from resilience.errors import ConfigError, ErrorTypes, ResilienceError
from resilience.events import Observer
from resilience.outcome import AttemptRecord, Delivery, Outcome
from resilience.policy import ProbeAnswer, ProbeContext
from resilience.retry.retrier import AsyncAttempt, Attempt, Failed, Records, Report, Retrier, ask_probe, ask_probe_async
from resilience.retry.spec import AttemptResult, CallSpec, is_success_status

__all__ = ["DEFAULT_WINDOW_S", "AttemptLedger", "LedgerEntry", "LedgerRetrier"]

R = TypeVar("R")
T = TypeVar("T")
DEFAULT_WINDOW_S = 10.0
"""Seconds after its last attempt that an engine+endpoint's record is kept.

A framework's own loop re-sends within seconds (AReaL 1 s later, verl 2 s then 4 s); a call later than this is a new
decision of its caller, which a longer window would refuse for having failed before."""
Unresolved = Literal["status", "transport"] | None
"""Why the last attempt left a call unresolved: a gateway status, a transport failure after sending, or None (it was answered)."""


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """What recent calls on one engine and endpoint left behind."""

    spent: int
    """Attempts that may have reached the engine, in calls that did not succeed."""
    unresolved: Unresolved
    """Why the last attempt settled nothing (None: it was answered)."""
    last_status: int | None
    """The last attempt's status, when it got one."""
    at: float
    """Clock reading of the last attempt's report."""
    since: float
    """Clock reading of the first attempt's report in this run of failed calls (the deadline of harmless repeats counts from it)."""


class AttemptLedger:
    """Per (engine, endpoint template): attempts spent by recent calls that did not succeed.

    ``window_s``: seconds an entry is kept after its last attempt (default
    ``DEFAULT_WINDOW_S``, 10; must be > 0). ``clock``: its time source.
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, *, clock: Clock = SYSTEM_CLOCK) -> None:
        if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not (window_s > 0 and math.isfinite(window_s)):
            raise ConfigError(f"AttemptLedger.window_s must be a finite number of seconds > 0, but was {window_s!r}")
        self.window_s = float(window_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], LedgerEntry] = {}

    def get(self, engine: str, endpoint: str) -> LedgerEntry | None:
        """The live entry of ``engine`` and ``endpoint``, or None (never written, cleared, or older than the window)."""
        key = (engine, endpoint)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and self._clock.monotonic() - entry.at > self.window_s:
                del self._entries[key]
                return None
            return entry

    def clear(self, engine: str, endpoint: str) -> None:
        """Forget ``engine`` and ``endpoint``: a call there succeeded."""
        with self._lock:
            self._entries.pop((engine, endpoint), None)

    def record(self, spec: CallSpec, result: AttemptResult[Any]) -> None:
        """Count one attempt's report: a success clears, an attempt that may have arrived is counted, a refusal is not."""
        policy = spec.match.policy
        status = result.status
        if status is not None and is_success_status(policy, status):
            self.clear(spec.engine, spec.match.endpoint)
            return
        if status is None and result.delivery is Delivery.NOT_SENT:
            return
        unresolved: Unresolved
        if status is None:
            unresolved = "transport"
        elif status in policy.retry.statuses:
            unresolved = "status"
        else:
            unresolved = None
        self._add(spec, unresolved, status)

    def record_abandoned(self, spec: CallSpec) -> None:
        """An attempt ended by an exception outside the transport (a cancelled task, an interrupt): ambiguous."""
        self._add(spec, "transport", None)

    def _add(self, spec: CallSpec, unresolved: Unresolved, status: int | None) -> None:
        key = (spec.engine, spec.match.endpoint)
        now = self._clock.monotonic()
        with self._lock:
            entry = self._entries.get(key)
            live = entry is not None and now - entry.at <= self.window_s
            spent, since = (entry.spent, entry.since) if live and entry is not None else (0, now)
            self._entries[key] = LedgerEntry(spent + 1, unresolved, status, now, since)


@dataclass(frozen=True, slots=True)
class _Admission:
    """What the ledger decided before a call: send it (with what is left), answer "applied", or refuse."""

    spec: CallSpec | None = None
    """The call to run, its ``max_attempts`` cut to what is left; None when it is not sent."""
    applied: bool = False
    """The probe says an earlier call was applied: return the driver's "applied" response."""
    error: ResilienceError | None = None
    """Refused before sending."""
    probe: Callable[[ProbeContext], Any] | None = None
    """A probe to ask before deciding (then ``_after_probe``)."""
    context: ProbeContext | None = None
    deadline_s: float | None = None
    """A harmless repeat runs under a ``Deadline`` of this many seconds (what its run of failed calls left); None: none added."""
    harmless: bool = False
    """Admitted as a re-send that cannot hurt (``_fresh``): attempts of its own."""


class LedgerRetrier(Retrier):
    """A ``Retrier`` whose calls start from an ``AttemptLedger``: a caller's own retry loop cannot multiply the attempts.

    ``ledger``: the shared ledger (several ``LedgerRetrier``s, one per driver library, share one, with one
    ``BreakerRegistry`` and one ``RetryBudgets``). The other arguments are ``Retrier``'s.
    """

    def __init__(
        self, ledger: AttemptLedger, *, breakers: BreakerRegistry | None = None, budgets: RetryBudgets | None = None,
        observers: Sequence[Observer] = (), clock: Clock = SYSTEM_CLOCK, rng: Callable[[], float] = random.random,
        error_types: ErrorTypes | None = None
    ) -> None:
        super().__init__(breakers=breakers, budgets=budgets, observers=observers, clock=clock, rng=rng, error_types=error_types)
        self.ledger = ledger

    # -- admission (no I/O but the probe) --------------------------------

    def _admit(self, spec: CallSpec) -> _Admission:
        entry = self.ledger.get(spec.engine, spec.match.endpoint)
        if entry is None:
            return _Admission(spec=spec)
        policy = spec.match.policy
        if entry.unresolved is not None and not policy.idempotent:
            probe = policy.on_ambiguous
            if callable(probe):
                endpoint = spec.match.endpoint  # the body names the tags a release or resume asks for (MemoryProbeCheck reads them)
                context = ProbeContext(spec.method, str(spec.url), endpoint, spec.engine, entry.spent, None, entry.last_status, spec.body)
                return _Admission(probe=probe, context=context)
            return self._preset_choice(spec, entry)
        if not policy.idempotent:
            return self._cut(spec, entry)
        return self._fresh(spec, entry)

    def _after_probe(self, spec: CallSpec, answer: object) -> _Admission:
        try:
            verdict = ProbeAnswer(answer if isinstance(answer, str) else "")
        except ValueError:
            verdict = ProbeAnswer.UNKNOWN
        entry = self.ledger.get(spec.engine, spec.match.endpoint)
        if entry is None or verdict is ProbeAnswer.DONE:
            return _Admission(spec=spec, applied=verdict is ProbeAnswer.DONE)
        if verdict is ProbeAnswer.NOT_DONE:  # proven not applied: a re-send cannot be the second one
            return self._fresh(spec, entry)
        return self._preset_choice(spec, entry)

    def _preset_choice(self, spec: CallSpec, entry: LedgerEntry) -> _Admission:
        """No probe could tell: a gateway status is re-sent only under ``retry_statuses_if_not_idempotent``; anything else never."""
        if entry.unresolved == "status" and spec.match.policy.retry_statuses_if_not_idempotent:
            return self._cut(spec, entry)
        why = f"status_{entry.last_status}" if entry.unresolved == "status" else "no answer after sending"
        message = (
            f"{spec.match.endpoint} on {spec.engine}: an earlier call's attempt may have been applied ({why}); not re-sent"
        )
        return self._refuse(self.error_types.ambiguous, spec, message, entry)

    def _cut(self, spec: CallSpec, entry: LedgerEntry) -> _Admission:
        """A re-send that can hurt: the attempts the earlier calls left, no more."""
        policy = spec.match.policy
        left = policy.retry.max_attempts - entry.spent
        if left <= 0:
            message = (
                f"{spec.match.endpoint} on {spec.engine}: {entry.spent} attempts already spent by earlier calls "
                f"within {self.ledger.window_s:g}s (max_attempts={policy.retry.max_attempts}); not sent"
            )
            return self._refuse(self.error_types.retries_exhausted, spec, message, entry)
        retry = replace(policy.retry, max_attempts=left)
        return self._withdraw(spec, entry) or _Admission(spec=replace(spec, match=replace(spec.match, policy=replace(policy, retry=retry))))

    def _fresh(self, spec: CallSpec, entry: LedgerEntry) -> _Admission:
        """A harmless re-send: attempts of its own, within the budget and what the run of failed calls left of the deadline."""
        deadline_s = spec.match.policy.deadline_s
        left: float | None = None
        if deadline_s is not None:
            elapsed = self.clock.monotonic() - entry.since
            left = deadline_s - elapsed
            if left <= 0:
                message = (
                    f"{spec.match.endpoint} on {spec.engine}: earlier calls have failed for {elapsed:.3g}s, past the "
                    f"endpoint's deadline_s={deadline_s:g}; not sent"
                )
                return self._refuse(self.error_types.deadline_exceeded, spec, message, entry)
        return self._withdraw(spec, entry) or _Admission(spec=spec, deadline_s=left, harmless=True)

    def _withdraw(self, spec: CallSpec, entry: LedgerEntry) -> _Admission | None:
        """The repeat's first attempt is a retry for the engine's budget: a refusal when no token is left, else None."""
        if self.budgets is not None and not self.budgets.by_engine[spec.engine].try_withdraw():
            message = f"retry budget of {spec.engine} exhausted ({spec.match.endpoint} repeats a failed call); not sent"
            return self._refuse(self.error_types.budget_exhausted, spec, message, entry)
        return None

    @staticmethod
    def _refuse(kind: type[ResilienceError], spec: CallSpec, message: str, entry: LedgerEntry) -> _Admission:
        """A refusal before sending: a ``kind`` error with its one-line record (an earlier attempt left unresolved stays "ambiguous").

        ``resilience.outcome.attempts_of`` readers (the barrier) must not take a
        refusal that follows an unanswered release for proof that nothing was released.
        """
        delivery = Delivery.NOT_SENT if entry.unresolved is None else Delivery.AMBIGUOUS
        outcome = Outcome.RETRYABLE if entry.unresolved is None else Outcome.AMBIGUOUS
        record = AttemptRecord(0, None, outcome, delivery, kind.__qualname__, 0.0)
        error = kind(message, endpoint=spec.match.endpoint, engine=spec.engine, attempts=(record,), last_status=entry.last_status)
        return _Admission(error=error)

    # -- the drivers' entry points ----------------------------------------

    def _rounds(self, spec: CallSpec, on_probe_done: Callable[[], R] | None) -> Steps[tuple[Any, ...], tuple[R, Records]]:
        """A call from the ledger as steps (``engine_steps``): refused, answered "applied", or run with the attempts
        left; a call that spends its attempts on gateway statuses where a re-send is harmless goes on for another
        round (``_go_on``), as a framework's own retry would, until the ledger stops admitting one.

        Steps: ``("probe", probe, context)``, ``("round", spec, deadline_s)`` (one ``Retrier`` run of the call),
        ``("discard", response)``, ``("sleep", seconds)``; ``run`` and ``arun`` perform them.
        """
        admission = yield from self._admitted(spec)
        run_spec = self._settle(spec, admission, on_probe_done)
        if not isinstance(run_spec, CallSpec):
            return run_spec, ()
        while True:
            response, records = value_of((yield ("round", run_spec, admission.deadline_s)))
            if not _ended_on_status(records):
                return response, records
            after = yield from self._admitted(spec)
            if not self._go_on(after):
                return response, records
            value_of((yield ("discard", response)))
            value_of((yield ("sleep", self._pause_before_round(spec, after))))
            settled = self._settle(spec, after, on_probe_done)
            if not isinstance(settled, CallSpec):
                return settled, records
            admission, run_spec = after, settled

    def _admitted(self, spec: CallSpec) -> Steps[tuple[Any, ...], _Admission]:
        """``_admit``, then ``_after_probe`` with the probe's answer when the ledger asks one."""
        admission = self._admit(spec)
        if admission.probe is not None and admission.context is not None:
            admission = self._after_probe(spec, value_of((yield ("probe", admission.probe, admission.context))))
        return admission

    def run(
        self, spec: CallSpec, send: Attempt, *, report: Report[R] = None, failed: Failed[R] = None,
        discard: Callable[[R], None] = lambda _r: None, on_probe_done: Callable[[], R] | None = None,
        never_sent: Callable[[BaseException], bool] = lambda _e: False
    ) -> tuple[R, tuple[AttemptRecord, ...]]:
        """``Retrier.run`` from the ledger (``_rounds``), each attempt counted."""
        reported, failing = self._counting(spec, report, failed, never_sent)
        done = self._clearing(spec, on_probe_done)

        def perform(step: tuple[Any, ...]) -> Any:
            if step[0] == "round":
                with Deadline(step[2], clock=self.clock):
                    return Retrier.run(
                        self, step[1], send, report=reported, failed=failing, discard=discard, on_probe_done=done, never_sent=never_sent
                    )
            if step[0] == "probe":
                return ask_probe(step[1], step[2])
            return discard(step[1]) if step[0] == "discard" else self.clock.sleep(step[1])

        return run_now(drive(self._rounds(spec, on_probe_done), perform))

    async def arun(  # type: ignore[override]  # one signature for both of Retrier.arun's overloads
        self,
        spec: CallSpec,
        send: AsyncAttempt,
        *,
        report: Report[R] = None,
        failed: Failed[R] = None,
        discard: Callable[[R], Awaitable[None] | None] = lambda _r: None,
        on_probe_done: Callable[[], R] | None = None,
        never_sent: Callable[[BaseException], bool] = lambda _e: False,
        finish: Callable[[R, Records], T] | None = None,
    ) -> tuple[R, Records] | T:
        """``Retrier.arun`` from the ledger (rounds as ``run``); a sync probe runs in a worker thread."""
        reported, failing = self._counting(spec, report, failed, never_sent)
        done = self._clearing(spec, on_probe_done)
        asleep: Callable[[float], Awaitable[None]] = getattr(self.clock, "asleep", asyncio.sleep)

        async def perform(step: tuple[Any, ...]) -> Any:
            if step[0] == "round":
                with Deadline(step[2], clock=self.clock):
                    return await Retrier.arun(
                        self, step[1], send, report=reported, failed=failing, discard=discard, on_probe_done=done, never_sent=never_sent
                    )
            if step[0] == "probe":
                return await ask_probe_async(step[1], step[2])
            released = discard(step[1]) if step[0] == "discard" else asleep(step[1])
            return None if released is None else await released

        response, records = await drive(self._rounds(spec, on_probe_done), perform)
        return (response, records) if finish is None else finish(response, records)

    def _counting(
        self, spec: CallSpec, report: Report[R], failed: Failed[R], never_sent: Callable[[BaseException], bool]
    ) -> tuple[Callable[[Any], AttemptResult[R]], Callable[[BaseException], AttemptResult[R]]]:
        """``report`` and ``failed`` that also count each attempt in the ledger; an error re-raised out of an attempt
        leaves it unresolved unless ``never_sent`` proves it never left."""

        def reported(answer: Any) -> AttemptResult[R]:
            result = cast("AttemptResult[R]", answer) if report is None else report(answer)
            self.ledger.record(spec, result)
            return result

        def failing(exc: BaseException) -> AttemptResult[R]:
            try:
                if failed is None:
                    raise exc
                result = failed(exc)
            except BaseException as raised:
                if not (isinstance(raised, Exception) and never_sent(raised)):
                    self.ledger.record_abandoned(spec)
                raise
            self.ledger.record(spec, result)
            return result

        return reported, failing

    @staticmethod
    def _go_on(after: _Admission) -> bool:
        """Whether a call whose attempts all ended on gateway statuses gets another round: only where a re-send is harmless
        (``_fresh`` admitted it within a deadline) or the probe says it was applied; never on a shared count or a refusal."""
        return after.error is None and (after.applied or (after.harmless and after.deadline_s is not None))

    def _pause_before_round(self, spec: CallSpec, after: _Admission) -> float:
        """The wait before another round: full jitter up to the policy's ``cap_s`` (its longest backoff), within the deadline."""
        if after.applied:
            return 0.0
        wait = spec.match.policy.retry.cap_s * self.rng()
        return max(0.0, min(wait, (after.deadline_s or 0.0) / 2))

    def _settle(self, spec: CallSpec, admission: _Admission, on_probe_done: Callable[[], R] | None) -> CallSpec | R:
        """The spec to run, or the "applied" response; raises a refusal."""
        if admission.error is not None:
            raise admission.error
        if admission.applied:
            if on_probe_done is None:
                message = f"{spec.match.endpoint} on {spec.engine}: the probe says an earlier call was applied; not re-sent"
                raise self.error_types.ambiguous(message, endpoint=spec.match.endpoint, engine=spec.engine)
            self.ledger.clear(spec.engine, spec.match.endpoint)
            return on_probe_done()
        assert admission.spec is not None
        return admission.spec

    def _clearing(self, spec: CallSpec, on_probe_done: Callable[[], R] | None) -> Callable[[], R] | None:
        """``on_probe_done`` that also clears the ledger: a probe inside the call confirmed it was applied."""
        if on_probe_done is None:
            return None

        def done() -> R:
            self.ledger.clear(spec.engine, spec.match.endpoint)
            return on_probe_done()

        return done



def _ended_on_status(records: tuple[AttemptRecord, ...]) -> bool:
    """Whether a call returned (not raised) after its last attempt got a status the policy retries: its attempts ran out on them."""
    return bool(records) and records[-1].outcome is Outcome.RETRYABLE and records[-1].status is not None
