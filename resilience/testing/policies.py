"""Policy tables for tests: the same decisions, shorter waits."""

from __future__ import annotations

from dataclasses import replace

from resilience.policy import PolicyTable

__all__ = ["fast_policies"]


def fast_policies(
    table: PolicyTable,
    *,
    base_s: float = 0.01,
    cap_s: float = 0.05,
    attempt_timeout_s: float | None = None,
    deadline_s: float | None = None,
) -> PolicyTable:
    """``table`` with every backoff shrunk to ``base_s``/``cap_s`` (and, when given, attempt timeouts and deadlines replaced).

    What is retried and what is never re-sent stays exactly as in ``table``:
    only the waiting changes, so a test of the decisions runs in milliseconds.
    """
    overrides = {k: v for k, v in (("attempt_timeout_s", attempt_timeout_s), ("deadline_s", deadline_s)) if v is not None}
    entries = {}
    for key, policy in table.entries.items():
        retry = replace(policy.retry, base_s=min(base_s, cap_s), cap_s=cap_s)
        entries[key] = replace(policy, retry=retry, **overrides)
    return PolicyTable(entries)
