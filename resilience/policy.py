"""Policies: ``RetryPolicy``, ``EndpointPolicy`` and ``PolicyTable``, frozen values validated when built.

The template a ``PolicyTable`` matched names the endpoint in events, spans and
metric labels, so label values stay bounded however many raw paths are called.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from resilience.errors import ConfigError, finite_number, integer
from resilience.errors import require as _require

__all__ = [
    "DEFAULT_ATTEMPT_TIMEOUT_S",
    "DEFAULT_CONNECT_WINDOW_S",
    "DEFAULT_DEADLINE_S",
    "DEFAULT_STATUSES",
    "HTTP_METHODS",
    "IDEMPOTENT_METHODS",
    "EndpointMatch",
    "EndpointPolicy",
    "PolicyTable",
    "Probe",
    "ProbeAnswer",
    "ProbeContext",
    "RetryPolicy",
    "UnnamedSeconds",
    "parse_key",
    "template_shape",
]

DEFAULT_STATUSES: frozenset[int] = frozenset({502, 503, 504})
"""Gateway statuses: the front end could not get an answer from the engine."""

IDEMPOTENT_METHODS: frozenset[str] = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})
"""Methods HTTP defines as idempotent (RFC 9110 9.2.2)."""


class UnnamedSeconds(float):
    """Seconds a policy's author left at the default: it reads as its number, its type marks it (``EndpointPolicy.named``).

    The caller's own timeout beats an unnamed value and loses to a named one. It
    survives ``dataclasses.replace``, pickling and policy files.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"UnnamedSeconds({float.__repr__(self)})"

    def __str__(self) -> str:
        return float.__repr__(self)


DEFAULT_CONNECT_WINDOW_S: float = 5.0
"""``RetryPolicy.connect_window_s``: how long a call that never connected keeps retrying refusals (see its docstring for why 5 s)."""
DEFAULT_ATTEMPT_TIMEOUT_S: float = UnnamedSeconds(10.0)
"""``EndpointPolicy.attempt_timeout_s`` when the entry does not name it: 10 s, yielding to the caller's own timeout."""
DEFAULT_DEADLINE_S: float = UnnamedSeconds(30.0)
"""``EndpointPolicy.deadline_s`` when the entry does not name it: 30 s, only a retry window under the caller's own timeout."""
TimeField = Literal["attempt_timeout_s", "deadline_s"]
_TIME_FIELDS: tuple[TimeField, ...] = ("attempt_timeout_s", "deadline_s")


def _require_bools(policy: object, *names: str) -> None:
    for name in names:
        value = getattr(policy, name)
        _require(isinstance(value, bool), type(policy).__name__, name, "true or false (a boolean, not a string or number)", value)


def _status_set(owner: str, name: str, value: object) -> frozenset[int]:
    if not isinstance(value, (frozenset, set, list, tuple)):
        raise ConfigError(f"{owner}.{name} must be a set of HTTP statuses (integers within 100-599), but was {value!r}")
    for status in value:
        _require(integer(status) and 100 <= status <= 599, owner, name, "HTTP statuses within 100-599", status)
    return frozenset(value)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When and how long to wait before another attempt; a value, reusable across calls and threads."""

    max_attempts: int = 4
    """Attempts that may reach the server, the first included. 1 = never re-send.

    Failures before sending do not count (they are retried within
    ``connect_window_s``, then the deadline), unless the call has no deadline
    at all. A body that cannot be replayed always gets one attempt."""
    statuses: frozenset[int] = DEFAULT_STATUSES
    """Statuses that are retried (default 502, 503, 504). 429 is retried only with a Retry-After header."""
    retry_before_send: bool = True
    """Retry failures that happened before the request was sent (connection refused, connect timeout). Safe for any method."""
    connect_window_s: float | None = DEFAULT_CONNECT_WINDOW_S
    """How long a call that has never connected keeps retrying, seconds from its start. Default 5 s.

    Past it, a call whose every attempt failed before sending fails with the
    refusal itself (with ``.attempts``) and the engine's breaker opens at once.
    Once an attempt has reached the server, refusals are retried until the
    deadline. None = no window. Why 5 s: ``docs/retry-rules.md``."""
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
        _require(integer(self.max_attempts) and self.max_attempts >= 1, owner, "max_attempts", "an integer >= 1", self.max_attempts)
        object.__setattr__(self, "statuses", _status_set(owner, "statuses", self.statuses))
        _require_bools(self, "retry_before_send", "respect_retry_after")
        for name in ("base_s", "cap_s", "retry_after_max_s"):
            value = getattr(self, name)
            _require(finite_number(value) and value >= 0, owner, name, "a finite number >= 0", value)
        window = self.connect_window_s
        _require(window is None or (finite_number(window) and window > 0), owner, "connect_window_s", "a number > 0 or None", window)
        _require(self.cap_s >= self.base_s, owner, "cap_s", f">= base_s ({self.base_s})", self.cap_s)
        _require(finite_number(self.multiplier) and self.multiplier >= 1, owner, "multiplier", "a number >= 1", self.multiplier)
        _require(finite_number(self.jitter) and 0 <= self.jitter <= 1, owner, "jitter", "within [0, 1]", self.jitter)


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
    """What a probe is told about the attempt it judges: an ambiguous failure, or a gateway status on a non-idempotent endpoint."""

    method: str
    url: str
    endpoint: str
    """``METHOD /template`` of the table entry."""
    engine: str
    """``scheme://host:port`` of the server (the name a ``MemoryProbe`` is asked about)."""
    attempt: int
    """0 for the first attempt, then the resend count."""
    error: BaseException | None
    """The transport error of an ambiguous failure (None after a status)."""
    status: int | None
    """The gateway status answered (502/503/504), or None after an ambiguous failure."""
    body: bytes | None = None
    """The request body when the driver held it as bytes (``CallSpec.body``), else None. May hold secrets: never log it."""


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
    attempt_timeout_s: float | None = DEFAULT_ATTEMPT_TIMEOUT_S
    """Connect and read timeout of each attempt, seconds (capped by what is left of the deadline). Default 10 s.

    A value the table entry *names* (here or in a policy file) beats the
    caller's own timeout; the default applies only when the caller gave none
    (the precedence rule: ``docs/retry-rules.md``). None = no per-attempt limit."""
    deadline_s: float | None = DEFAULT_DEADLINE_S
    """Total time for all attempts and waits, seconds. Default 30 s.

    A named deadline caps each attempt; the default one only stops starting
    retries when the caller gave its own timeout. None = no policy deadline."""
    retry_statuses_if_not_idempotent: bool = False
    """On a non-idempotent endpoint, treat the retry statuses (502/503/504) as retryable anyway. Default False.

    A trade-off: a 502 from a front end that never handed the request on is safe to repeat, one after is not."""
    on_ambiguous: Literal["raise"] | Probe = "raise"
    """What to do when a non-idempotent attempt may have been applied: ``"raise"`` (``AmbiguousOutcome``) or a probe.

    A probe is also asked after a gateway status (``retry.statuses``) on this
    endpoint when it is not idempotent, before anything is re-sent; its
    "unknown" then falls back to ``retry_statuses_if_not_idempotent``."""
    raise_on_exhausted: bool = False
    """After the last attempt got a retryable status: False = return that response (as requests does), True = raise
    ``RetriesExhausted``."""
    accept_statuses: frozenset[int] = frozenset()
    """Non-2xx statuses that count as success for this endpoint (e.g. 404 for an idempotent delete)."""

    def __post_init__(self) -> None:
        owner = "EndpointPolicy"
        _require(isinstance(self.retry, RetryPolicy), owner, "retry", "a RetryPolicy", self.retry)
        _require_bools(self, "idempotent", "retry_statuses_if_not_idempotent", "raise_on_exhausted")
        for name in ("attempt_timeout_s", "deadline_s"):
            value = getattr(self, name)
            _require(value is None or (finite_number(value) and value > 0), owner, name, "a number > 0 or None", value)
        # an unnamed attempt timeout is simply capped by a shorter deadline; a named one above the deadline is a mistake
        limit, deadline = self.attempt_timeout_s, self.deadline_s
        if limit is not None and deadline is not None and self.named("attempt_timeout_s"):
            unnamed = "" if self.named("deadline_s") else ", its default: name a longer one"
            _require(limit <= deadline, owner, "attempt_timeout_s", f"<= deadline_s ({deadline}{unnamed})", limit)
        probe = self.on_ambiguous
        _require(probe == "raise" or callable(probe), owner, "on_ambiguous", "'raise' or a probe callable", probe)
        object.__setattr__(self, "accept_statuses", _status_set(owner, "accept_statuses", self.accept_statuses))

    def named(self, name: TimeField) -> bool:
        """Whether the policy's author named ``name`` rather than leaving it at its default (an ``UnnamedSeconds``)."""
        if name not in _TIME_FIELDS:
            raise ConfigError(f"EndpointPolicy.named takes one of {', '.join(_TIME_FIELDS)}, but was {name!r}")
        return type(getattr(self, name)) is not UnnamedSeconds

    def __eq__(self, other: object) -> bool:
        """Field by field, and a named value never equals the same number left unnamed (they decide differently)."""
        if other.__class__ is not self.__class__ or not isinstance(other, EndpointPolicy):
            return NotImplemented
        same_values = all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self))
        return same_values and all(self.named(name) == other.named(name) for name in _TIME_FIELDS)

    @classmethod
    def for_method(cls, method: str) -> EndpointPolicy:
        """The default for a request no table entry matches: ``EndpointPolicy()`` for an idempotent method
        (``IDEMPOTENT_METHODS``), else ``EndpointPolicy(idempotent=False)`` (retried only on failures before sending)."""
        return _DEFAULT_IDEMPOTENT if method.upper() in IDEMPOTENT_METHODS else _DEFAULT_UNSAFE


_DEFAULT_IDEMPOTENT = EndpointPolicy()
_DEFAULT_UNSAFE = EndpointPolicy(idempotent=False)

_TEMPLATE_VAR = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")
HTTP_METHODS: frozenset[str] = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"})
"""Methods a table key may name (RFC 9110 section 9 and PATCH), alone, joined by ``|``, or ``*`` for any."""


@dataclass(frozen=True, slots=True)
class EndpointMatch:
    """The result of routing a request: its endpoint label and policy.

    The fields after ``policy`` are derived from it once per route: the retry core reads them on every call
    (``resilience.retry.spec.attempt_timeouts``).
    """

    endpoint: str
    """``METHOD /template`` of the entry that matched, or ``METHOD *`` for the default."""
    template: str
    """The path template alone (``/pause_generation``), or ``*``: the ``url.template`` attribute."""
    policy: EndpointPolicy
    own_timeout_s: float | None = field(init=False, repr=False, compare=False)
    """The ``attempt_timeout_s`` a matched entry named (it then overrules the caller's); else None."""
    own_deadline: bool = field(init=False, repr=False, compare=False)
    """True when a matched entry named ``deadline_s`` (it then caps attempts the caller bounded)."""
    fallback_timeout_s: float | None = field(init=False, repr=False, compare=False)
    """The policy's ``attempt_timeout_s`` as a plain float: the timeout when neither the entry nor the caller gave one."""
    deadline_s: float | None = field(init=False, repr=False, compare=False)
    """The policy's ``deadline_s`` as a plain float."""
    probe: Probe | None = field(init=False, repr=False, compare=False)
    """The policy's ``on_ambiguous`` probe, None when it is ``"raise"`` (drivers read a body for probes only then)."""

    def __post_init__(self) -> None:
        policy, limit, deadline = self.policy, self.policy.attempt_timeout_s, self.policy.deadline_s
        fallback = None if limit is None else float(limit)
        object.__setattr__(self, "own_timeout_s", fallback if self.explicit and policy.named("attempt_timeout_s") else None)
        object.__setattr__(self, "own_deadline", self.explicit and policy.named("deadline_s"))
        object.__setattr__(self, "fallback_timeout_s", fallback)
        object.__setattr__(self, "deadline_s", None if deadline is None else float(deadline))
        object.__setattr__(self, "probe", None if isinstance(policy.on_ambiguous, str) else policy.on_ambiguous)

    @property
    def explicit(self) -> bool:
        """True when a table entry matched; False for the default policy (template ``*``)."""
        return self.template != "*"


@dataclass(frozen=True, slots=True)
class _Route:
    key: str
    methods: frozenset[str] | None
    template: str
    pattern: re.Pattern[str]
    literal_segments: int
    policy: EndpointPolicy


def parse_key(key: str) -> tuple[frozenset[str] | None, str]:
    """A table key's methods (None for ``*``) and path template, validated; ConfigError naming the key otherwise."""
    if not isinstance(key, str):
        raise ConfigError(f"PolicyTable keys must be strings like 'POST /pause_generation', but was {key!r}")
    parts = key.split()
    if len(parts) != 2:
        raise ConfigError(f"PolicyTable key {key!r} must be 'METHOD /path', e.g. 'POST /pause_generation'")
    text, template = parts
    methods = None if text == "*" else text.upper().split("|")
    names, rest = _TEMPLATE_VAR.findall(template), _TEMPLATE_VAR.sub("", template)
    twice = sorted({n for n in names if names.count(n) > 1})
    for broken, rule in (  # the first rule broken is the one named
        (methods is not None and not set(methods) <= HTTP_METHODS,
         f"method must be one of {', '.join(sorted(HTTP_METHODS))}, several joined by '|', or *, but was {text!r}"),
        (methods is not None and len(set(methods)) != len(methods), f"method {text!r} names a method twice"),
        (not template.startswith("/"), f"path template must start with '/', but was {template!r}"),
        ("?" in template or "#" in template, "path template must be a path without '?query' or '#fragment' "
         f"(matching ignores the query string, so it could never match), but was {template!r}"),
        ("{" in rest or "}" in rest, f"path template has an unbalanced or invalid '{{name}}' (names are letters, digits, _): {template!r}"),
        (bool(twice), f"path template names {', '.join(twice)} more than once"),
    ):
        if broken:
            raise ConfigError(f"PolicyTable key {key!r}: {rule}")
    return (None if methods is None else frozenset(methods)), template


def template_shape(template: str) -> str:
    """A template with its variable names erased and no trailing slash: equal shapes match the same paths."""
    return _TEMPLATE_VAR.sub("{}", template).rstrip("/") or "/"


def _compile_route(key: str, policy: EndpointPolicy) -> _Route:
    methods, template = parse_key(key)
    if not isinstance(policy, EndpointPolicy):
        raise ConfigError(f"PolicyTable[{key!r}] must be an EndpointPolicy, but was {policy!r}")
    regex = "[^/]+".join(re.escape(piece) for piece in _TEMPLATE_VAR.split(template))
    literal = sum(1 for seg in template.split("/") if seg and not _TEMPLATE_VAR.fullmatch(seg))
    return _Route(key, methods, template, re.compile(f"^{regex}/?$"), literal, policy)


def _segments_overlap(a: str, b: str) -> bool:
    """Whether two template segments can match the same text."""
    if _TEMPLATE_VAR.fullmatch(a) or _TEMPLATE_VAR.fullmatch(b):
        return True
    a_var, b_var = _TEMPLATE_VAR.search(a) is not None, _TEMPLATE_VAR.search(b) is not None
    if a_var == b_var:  # both literal, or both with variables: alike when equal but for the variables' names
        return _TEMPLATE_VAR.sub("{}", a) == _TEMPLATE_VAR.sub("{}", b)
    pattern, text = (a, b) if a_var else (b, a)
    return re.fullmatch(".+".join(re.escape(p) for p in _TEMPLATE_VAR.split(pattern)), text) is not None


def _routes_overlap(a: _Route, b: _Route) -> bool:
    """Two entries some request would match with equal precedence: which wins would depend on their order."""
    if a.literal_segments != b.literal_segments or (a.methods is None) != (b.methods is None):
        return False
    if a.methods is not None and b.methods is not None and not (a.methods & b.methods):
        return False
    sa, sb = a.template.rstrip("/").split("/"), b.template.rstrip("/").split("/")
    return len(sa) == len(sb) and all(_segments_overlap(x, y) for x, y in zip(sa, sb, strict=True))


def _reject_overlaps(routes: tuple[_Route, ...]) -> None:
    for a, b in itertools.combinations(routes, 2):
        if _routes_overlap(a, b):
            raise ConfigError(
                f"PolicyTable keys {a.key!r} and {b.key!r} overlap: a request can match both with equal precedence, "
                "so which policy applies would depend on their order; merge them or split their methods"
            )


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
        routes = [_compile_route(k, v) for k, v in self._entries.items()]
        self._routes = tuple(sorted(routes, key=lambda r: (-r.literal_segments, r.methods is None)))
        _reject_overlaps(self._routes)
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
