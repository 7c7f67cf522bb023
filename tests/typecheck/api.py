"""Type-checked (never run) uses of the public API: mypy must accept these."""

from __future__ import annotations

import requests

import resilience
from resilience import EndpointPolicy, PolicyTable, RetryPolicy
from resilience.adapters.requests import ResilientAdapter, resilient_session

table: PolicyTable = PolicyTable({"POST /pause_generation": EndpointPolicy(retry=RetryPolicy(max_attempts=3))})
session: requests.Session = resilient_session(table)
adapter: ResilientAdapter = ResilientAdapter(table, breaker=None)
with resilience.Deadline(5.0) as d:
    left: float = d.remaining()
try:
    session.post("http://127.0.0.1:1/pause_generation", json={})
except resilience.AmbiguousOutcome as exc:
    attempts: tuple[resilience.AttemptRecord, ...] = exc.attempts
except requests.RequestException:
    pass
