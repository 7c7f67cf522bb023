"""The retry rules both engine kinds' policy tables share (``sglang/policies.py``, ``vllm/routes.py``).

``connect_window_s``: how long a call that never connected keeps retrying refusals before it fails with the refusal
(and the engine's breaker opens). 5 s on every endpoint: an engine's front end that is coming up listens within
seconds, so 5 s of backoff (4-6 attempts at these bases) reaches it; a memory swap takes tens of seconds but never
closes the port (the seed's 502s and slow /health came from a listening front end), so the long deadlines of the
tables still cover it; and an engine that must be restarted takes minutes (the seed's global restart: about 8), which
no call should sit through. A dead or mistyped URL thus fails in ~5 s instead of the deadline (180 s for a pause).
"""

from __future__ import annotations

from resilience.policy import RetryPolicy

__all__ = ["CONNECT_WINDOW_S", "CONTROL_RETRY", "NO_STATUS_RETRY", "READ_RETRY"]

CONNECT_WINDOW_S = 5.0
CONTROL_RETRY = RetryPolicy(max_attempts=6, base_s=0.5, cap_s=4.0, connect_window_s=CONNECT_WINDOW_S)
"""Control and memory calls: 6 attempts, backoff 0.5 s to 4 s."""
READ_RETRY = RetryPolicy(max_attempts=3, base_s=0.2, cap_s=1.0, connect_window_s=CONNECT_WINDOW_S)
"""Reads and health: 3 attempts, backoff 0.2 s to 1 s."""
NO_STATUS_RETRY = RetryPolicy(max_attempts=3, base_s=0.2, cap_s=1.0, statuses=frozenset(), connect_window_s=CONNECT_WINDOW_S)
"""Generation: as ``READ_RETRY``, never on a status (a 5xx answer may have generated)."""
