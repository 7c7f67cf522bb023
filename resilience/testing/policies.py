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
    """``table`` with every backoff shrunk to ``base_s``/``cap_s`` (and, when given, attempt timeouts and deadlines
    replaced): what is retried and what is never re-sent stays ``table``'s."""
    entries = {}
    for key, policy in table.entries.items():
        changed = replace(policy, retry=replace(policy.retry, base_s=min(base_s, cap_s), cap_s=cap_s))
        if attempt_timeout_s is not None:
            changed = replace(changed, attempt_timeout_s=attempt_timeout_s)
        if deadline_s is not None:
            changed = replace(changed, deadline_s=deadline_s)
        entries[key] = changed
    return PolicyTable(entries)
