"""Classify one attempt under its endpoint's policy: success, retryable, ambiguous or fatal.

The transport says what it knows (a status, or whether a failed request
surely never left: ``Delivery``); ``classify`` applies the endpoint's policy.
"""

from __future__ import annotations

from resilience.outcome import Delivery, Outcome
from resilience.policy import EndpointPolicy

__all__ = ["classify", "is_success_status"]


def is_success_status(policy: EndpointPolicy, status: int) -> bool:
    """2xx, or a status the endpoint accepts."""
    return 200 <= status < 300 or status in policy.accept_statuses


def classify(
    policy: EndpointPolicy,
    *,
    status: int | None,
    delivery: Delivery,
    retry_after: float | None = None,
) -> Outcome:
    """Classify one attempt under ``policy``.

    - a 2xx or accepted status: SUCCESS;
    - a status in ``retry.statuses`` (or 429 with Retry-After): RETRYABLE when
      the endpoint is idempotent or explicitly retries statuses when it is not;
      otherwise FATAL (the response is handed back as plain requests would);
    - no response and never sent: RETRYABLE when ``retry.retry_before_send``;
    - no response and maybe applied: AMBIGUOUS (the loop decides by idempotency);
    - anything else: FATAL.
    """
    if status is not None:
        if is_success_status(policy, status):
            return Outcome.SUCCESS
        gateway = status in policy.retry.statuses or (status == 429 and retry_after is not None and policy.retry.respect_retry_after)
        if gateway and (policy.idempotent or policy.retry_statuses_if_not_idempotent):
            return Outcome.RETRYABLE
        return Outcome.FATAL
    if delivery is Delivery.NOT_SENT:
        return Outcome.RETRYABLE if policy.retry.retry_before_send else Outcome.FATAL
    return Outcome.AMBIGUOUS
