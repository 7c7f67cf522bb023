"""controlplane-resilience: HTTP control planes that survive transient failure.

The public API is what ``__all__`` lists. Transports live in
``resilience.adapters`` (requests, SGLang, Ray), observers in
``resilience.telemetry``, the SGLang emulator in ``resilience.testing``.
"""

from resilience._config import set_testing, testing_mode
from resilience.backoff import backoff_delay, parse_retry_after
from resilience.breaker import BreakerConfig, BreakerRegistry, BreakerState, CircuitBreaker
from resilience.budget import RestartBudget, RestartBudgetError, RestartRecord, RetryBudget, RetryBudgetConfig, RetryBudgets
from resilience.clock import Clock, FakeClock, SystemClock
from resilience.deadline import Deadline, current_deadline
from resilience.errors import (
    AmbiguousOutcome,
    CircuitOpen,
    DeadlineExceeded,
    PolicyError,
    ResilienceError,
    RetriesExhausted,
    RetryBudgetExhausted,
)
from resilience.events import CallOutcome, Event, Observer, Outcome
from resilience.outcome import AttemptRecord, Delivery, classify
from resilience.policy import EndpointMatch, EndpointPolicy, PolicyTable, Probe, ProbeAnswer, ProbeContext, RetryPolicy
from resilience.retry import AttemptResult, CallSpec, Retrier

__version__ = "0.1.0"

__all__ = [
    "AmbiguousOutcome",
    "AttemptRecord",
    "AttemptResult",
    "BreakerConfig",
    "BreakerRegistry",
    "BreakerState",
    "CallOutcome",
    "CallSpec",
    "CircuitBreaker",
    "CircuitOpen",
    "Clock",
    "Deadline",
    "DeadlineExceeded",
    "Delivery",
    "EndpointMatch",
    "EndpointPolicy",
    "Event",
    "FakeClock",
    "Observer",
    "Outcome",
    "PolicyError",
    "PolicyTable",
    "Probe",
    "ProbeAnswer",
    "ProbeContext",
    "ResilienceError",
    "RestartBudget",
    "RestartBudgetError",
    "RestartRecord",
    "Retrier",
    "RetriesExhausted",
    "RetryBudget",
    "RetryBudgetConfig",
    "RetryBudgetExhausted",
    "RetryBudgets",
    "RetryPolicy",
    "SystemClock",
    "__version__",
    "backoff_delay",
    "classify",
    "current_deadline",
    "parse_retry_after",
    "set_testing",
    "testing_mode",
]
