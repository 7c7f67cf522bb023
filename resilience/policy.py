"""Policies: ``RetryPolicy``, ``EndpointPolicy`` and ``PolicyTable``.

Policies are frozen values, validated when built: an invalid one raises
``PolicyError`` naming the field and the rule. A ``PolicyTable`` routes
``METHOD /path/{template}`` to an ``EndpointPolicy``; the matched template is
the endpoint's name in events, spans and metric labels, so label values stay
bounded however many raw paths are called.
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from resilience.errors import PolicyError

__all__ = [
    "DEFAULT_STATUSES",
    "IDEMPOTENT_METHODS",
    "EndpointMatch",
    "EndpointPolicy",
    "PolicyTable",
    "Probe",
    "ProbeAnswer",
    "ProbeContext",
    "RetryPolicy",
]

DEFAULT_STATUSES: frozenset[int] = frozenset({502, 503, 504})
"""Gateway statuses: the front end could not get an answer from the engine."""

IDEMPOTENT_METHODS: frozenset[str] = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})
"""Methods HTTP defines as idempotent (RFC 9110 9.2.2)."""


def _require(ok: bool, owner: str, name: str, rule: str, value: object) -> None:
    if not ok:
        raise PolicyError(f"{owner}.{name} must be {rule}, but was {value!r}")


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When and how long to wait before another attempt.

    The policy object is a value: reuse it across calls and threads freely.
    """

    max_attempts: int = 4
    """Attempts in all, the first included. 1 = never retry."""
    statuses: frozenset[int] = DEFAULT_STATUSES
    """Statuses that are retried (default 502, 503, 504). 429 is retried only with a Retry-After header."""
    retry_before_send: bool = True
    """Retry failures that happened before the request was sent (connection refused, connect timeout). Safe for any method."""
    base_s: float = 0.1
    """Ceiling of the first backoff, seconds."""
    cap_s: float = 5.0
    """Largest backoff ceiling, seconds (must be >= base_s)."""
    multiplier: float = 2.0
    """Growth of the ceiling per retry (>= 1)."""
    jitter: float = 1.0
    """Random fraction of each wait: 1.0 = full jitter (uniform in [0, ceiling]), 0.0 = none."""
    respect_retry_after: bool = True
    """Honour a Retry-After header (never past the deadline) instead of the computed backoff."""
    retry_after_max_s: float = 60.0
    """The longest Retry-After honoured, seconds; longer values are clamped to this."""

    def __post_init__(self) -> None:
        owner = "RetryPolicy"
        _require(
            isinstance(self.max_attempts, int) and not isinstance(self.max_attempts, bool) and self.max_attempts >= 1,
            owner,
            "max_attempts",
            "an integer >= 1",
            self.max_attempts,
        )
        statuses = self.statuses
        if not isinstance(statuses, frozenset):
            try:
                statuses = frozenset(statuses)
            except TypeError:
                raise PolicyError(f"{owner}.statuses must be a set of integers, but was {self.statuses!r}") from None
            object.__setattr__(self, "statuses", statuses)
        for status in statuses:
            _require(
                isinstance(status, int) and not isinstance(status, bool) and 100 <= status <= 599,
                owner,
                "statuses",
                "HTTP statuses within 100-599",
                status,
            )
        for name in ("base_s", "cap_s", "retry_after_max_s"):
            value = getattr(self, name)
            _require(_finite_number(value) and value >= 0, owner, name, "a finite number >= 0", value)
        _require(self.cap_s >= self.base_s, owner, "cap_s", f">= base_s ({self.base_s})", self.cap_s)
        _require(_finite_number(self.multiplier) and self.multiplier >= 1, owner, "multiplier", "a number >= 1", self.multiplier)
        _require(_finite_number(self.jitter) and 0 <= self.jitter <= 1, owner, "jitter", "within [0, 1]", self.jitter)


class ProbeAnswer(enum.StrEnum):
    """A probe's verdict on an ambiguous attempt."""

    DONE = "done"
    """The server did act: treat the call as succeeded."""
    NOT_DONE = "not_done"
    """The server did not act: the request may be sent again."""
    UNKNOWN = "unknown"
    """Cannot tell: raise ``AmbiguousOutcome``."""


@dataclass(frozen=True, slots=True)
class ProbeContext:
    """What a probe is told about the ambiguous attempt."""

    method: str
    url: str
    endpoint: str
    engine: str
    attempt: int
    error: BaseException | None
    status: int | None


class Probe(Protocol):
    """Reads the server's state after an ambiguous attempt and says whether it acted."""

    def __call__(self, context: ProbeContext) -> ProbeAnswer: ...


@dataclass(frozen=True, slots=True)
class EndpointPolicy:
    """Everything one endpoint tolerates."""

    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """When and how to retry."""
    idempotent: bool = True
    """Repeating the request has the same effect as sending it once. False: never re-sent once it may have reached the server."""
    attempt_timeout_s: float | None = 10.0
    """Connect and read timeout of each attempt, seconds (capped by what is left of the deadline).

    None = no per-attempt limit."""
    deadline_s: float | None = 30.0
    """Total time for all attempts and waits, seconds.

    None = no policy deadline (the request's ``timeout=`` or an outer Deadline may still bound it)."""
    retry_statuses_if_not_idempotent: bool = False
    """On a non-idempotent endpoint, treat the retry statuses (502/503/504) as retryable anyway.

    An explicit trade-off: a 502 from a front end that never handed the request
    on is safe to repeat, one given after handing it on is not. Default False.
    """
    on_ambiguous: Literal["raise"] | Probe = "raise"
    """What to do when a non-idempotent attempt may have been applied: ``"raise"`` (``AmbiguousOutcome``) or a probe."""
    raise_on_exhausted: bool = False
    """After the last attempt got a retryable status.

    False = return that response (as plain requests does), True = raise ``RetriesExhausted``."""
    accept_statuses: frozenset[int] = frozenset()
    """Non-2xx statuses that count as success for this endpoint (e.g. 404 for an idempotent delete)."""

    def __post_init__(self) -> None:
        owner = "EndpointPolicy"
        if not isinstance(self.retry, RetryPolicy):
            raise PolicyError(f"{owner}.retry must be a RetryPolicy, but was {self.retry!r}")
        for name in ("attempt_timeout_s", "deadline_s"):
            value = getattr(self, name)
            _require(value is None or (_finite_number(value) and value > 0), owner, name, "a number > 0 or None", value)
        if self.attempt_timeout_s is not None and self.deadline_s is not None:
            _require(
                self.attempt_timeout_s <= self.deadline_s,
                owner,
                "attempt_timeout_s",
                f"<= deadline_s ({self.deadline_s})",
                self.attempt_timeout_s,
            )
        if not (self.on_ambiguous == "raise" or callable(self.on_ambiguous)):
            raise PolicyError(f"{owner}.on_ambiguous must be 'raise' or a probe callable, but was {self.on_ambiguous!r}")
        accept = self.accept_statuses
        if not isinstance(accept, frozenset):
            object.__setattr__(self, "accept_statuses", frozenset(accept))
        for status in self.accept_statuses:
            _require(isinstance(status, int) and 100 <= status <= 599, owner, "accept_statuses", "HTTP statuses within 100-599", status)

    @classmethod
    def for_method(cls, method: str) -> EndpointPolicy:
        """The default for a request no table entry matches.

        Idempotent methods (GET, HEAD, PUT, DELETE, OPTIONS, TRACE) are retried
        on 502/503/504 and transport errors; POST and PATCH only on failures
        before sending.
        """
        return _DEFAULT_IDEMPOTENT if method.upper() in IDEMPOTENT_METHODS else _DEFAULT_UNSAFE


_DEFAULT_IDEMPOTENT = EndpointPolicy()
_DEFAULT_UNSAFE = EndpointPolicy(idempotent=False)

_TEMPLATE_VAR = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")
_METHOD = re.compile(r"^[A-Z]+(\|[A-Z]+)*$|^\*$")


@dataclass(frozen=True, slots=True)
class EndpointMatch:
    """The result of routing a request: its endpoint label and policy."""

    endpoint: str
    """``METHOD /template`` of the entry that matched, or ``METHOD *`` for the default."""
    template: str
    """The path template alone (``/pause_generation``), or ``*``: the ``url.template`` attribute."""
    policy: EndpointPolicy

    @property
    def explicit(self) -> bool:
        """True when a table entry matched; False for the default policy (template ``*``)."""
        return self.template != "*"


@dataclass(frozen=True, slots=True)
class _Route:
    methods: frozenset[str] | None
    template: str
    pattern: re.Pattern[str]
    literal_segments: int
    policy: EndpointPolicy


def _compile_route(key: str, policy: EndpointPolicy) -> _Route:
    parts = key.split()
    if len(parts) != 2:
        raise PolicyError(f"PolicyTable key {key!r} must be 'METHOD /path', e.g. 'POST /pause_generation'")
    method, template = parts[0].upper(), parts[1]
    if not _METHOD.match(method):
        raise PolicyError(f"PolicyTable key {key!r}: method must be like GET, GET|POST or *, but was {parts[0]!r}")
    if not template.startswith("/"):
        raise PolicyError(f"PolicyTable key {key!r}: path template must start with '/', but was {template!r}")
    if not isinstance(policy, EndpointPolicy):
        raise PolicyError(f"PolicyTable[{key!r}] must be an EndpointPolicy, but was {policy!r}")
    regex, pos, literal = "", 0, 0
    for m in _TEMPLATE_VAR.finditer(template):
        regex += re.escape(template[pos : m.start()]) + "[^/]+"
        pos = m.end()
    regex += re.escape(template[pos:])
    literal = sum(1 for seg in template.split("/") if seg and not _TEMPLATE_VAR.fullmatch(seg))
    methods = None if method == "*" else frozenset(method.split("|"))
    return _Route(methods, template, re.compile(f"^{regex}/?$"), literal, policy)


class PolicyTable:
    """Routes ``METHOD /path/{template}`` to an ``EndpointPolicy``.

    ``entries`` maps keys such as ``"POST /pause_generation"``,
    ``"GET|POST /flush_cache"`` or ``"GET /v1/models/{model}"`` to policies.
    The most specific match wins (most literal segments, then an explicit
    method over ``*``). A request no entry matches gets ``default(method)``,
    by default ``EndpointPolicy.for_method``. Immutable once built.
    """

    def __init__(
        self,
        entries: Mapping[str, EndpointPolicy] | None = None,
        *,
        default: Callable[[str], EndpointPolicy] = EndpointPolicy.for_method,
    ) -> None:
        self._entries = dict(entries or {})
        self._routes = tuple(
            sorted(
                (_compile_route(k, v) for k, v in self._entries.items()),
                key=lambda r: (-r.literal_segments, r.methods is None),
            )
        )
        self._default = default
        self._match = functools.lru_cache(maxsize=4096)(self._match_uncached)

    def __getstate__(self) -> dict[str, Any]:
        return {"entries": self._entries, "default": self._default}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["entries"], default=state["default"])  # type: ignore[misc]

    @property
    def entries(self) -> Mapping[str, EndpointPolicy]:
        """The table's entries as given."""
        return dict(self._entries)

    def with_entries(self, entries: Mapping[str, EndpointPolicy]) -> PolicyTable:
        """A new table with ``entries`` added or replacing existing keys."""
        return PolicyTable({**self._entries, **entries}, default=self._default)

    def match(self, method: str, path: str) -> EndpointMatch:
        """Route a request (path without query string) to its endpoint label and policy."""
        return self._match(method.upper(), path or "/")

    def _match_uncached(self, method: str, path: str) -> EndpointMatch:
        for route in self._routes:
            if (route.methods is None or method in route.methods) and route.pattern.match(path):
                return EndpointMatch(f"{method} {route.template}", route.template, route.policy)
        return EndpointMatch(f"{method} *", "*", self._default(method))

    def __iter__(self) -> Iterator[tuple[str, EndpointPolicy]]:
        return iter(self._entries.items())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"PolicyTable({sorted(self._entries)!r})"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "policy") -> PolicyTable:
        """Build from a mapping ``{"defaults": {...}, "endpoints": {"POST /x": {...}}}`` (see ``resilience.policy_files``)."""
        from resilience.policy_files import table_from_dict

        return table_from_dict(data, source=source)

    @classmethod
    def load(cls, path: str) -> PolicyTable:
        """Load a TOML (``.toml``) or YAML (``.yaml``/``.yml``) policy file; errors name the file, field and rule."""
        from resilience.policy_files import load_policy_file

        return load_policy_file(path)
