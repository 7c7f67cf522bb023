"""What the retry core's tests share: one engine, a call spec for a policy, scripted attempt results."""

from __future__ import annotations

from collections.abc import MutableMapping

from resilience import EndpointPolicy, PolicyTable
from resilience.outcome import Delivery
from resilience.retry.spec import AttemptResult, CallSpec, Timeouts

ENGINE = "http://127.0.0.1:1"
"""Never dialled: the scripts answer in its place."""


def spec(policy: EndpointPolicy, method: str = "POST", *, explicit: bool = True) -> CallSpec:
    """A call to ``{method} /x`` under ``policy``: as a table entry (``explicit``), or as the table's default for unmatched paths."""
    table = PolicyTable({f"{method} /x": policy}) if explicit else PolicyTable(default=lambda _method: policy)
    return CallSpec(method, f"{ENGINE}/x", table.match(method, "/x"), ENGINE, "127.0.0.1", 1)


def status(code: int, retry_after: float | None = None) -> AttemptResult[str]:
    """A response with ``code`` (its body: ``resp<code>``), and a Retry-After in seconds when given."""
    return AttemptResult(response=f"resp{code}", status=code, retry_after=retry_after)


def refused() -> AttemptResult[str]:
    """A refused connection: never sent."""
    return AttemptResult(error=ConnectionRefusedError("refused"), delivery=Delivery.NOT_SENT, error_kind="connect_error")


def lost() -> AttemptResult[str]:
    """A read timeout: the request may have been applied."""
    return AttemptResult(error=TimeoutError("read"), delivery=Delivery.AMBIGUOUS, error_kind="read_timeout")


class Script:
    """Plays AttemptResults in order and records the timeouts it was given."""

    def __init__(self, *results: AttemptResult[str]) -> None:
        self.results = list(results)
        self.timeouts: list[Timeouts] = []

    def __call__(self, n: int, timeouts: Timeouts, carrier: MutableMapping[str, str]) -> AttemptResult[str]:
        self.timeouts.append(timeouts)
        return self.results.pop(0)
