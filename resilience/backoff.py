"""Backoff: exponential, full jitter by default, capped; Retry-After honoured within the deadline."""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Callable

__all__ = ["backoff_delay", "parse_retry_after"]


def backoff_delay(
    retry_number: int,
    *,
    base_s: float,
    cap_s: float,
    multiplier: float,
    jitter: float,
    rng: Callable[[], float] = random.random,
) -> float:
    """The wait before retry number ``retry_number`` (1 for the first retry), of ceiling
    ``min(cap_s, base_s * multiplier**(retry_number - 1))``; the knobs are ``RetryPolicy``'s. ``rng`` returns a float in [0, 1).
    """
    if retry_number < 1:
        raise ValueError(f"retry_number must be >= 1, but was {retry_number}")
    try:
        ceiling = min(cap_s, base_s * multiplier ** (retry_number - 1))
    except OverflowError:
        ceiling = cap_s
    return ceiling * (1.0 - jitter) + ceiling * jitter * rng()


def parse_retry_after(value: str | None, *, now: Callable[[], float] = time.time) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP-date); None when absent or invalid."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            parsed = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = parsed.timestamp() - now()
    if math.isnan(seconds) or math.isinf(seconds):
        return None
    return max(0.0, seconds)
