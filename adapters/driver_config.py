"""``DriverConfig``: one value that configures every driver, made once and handed to all of them.

The requests adapter, both httpx transports, the aiohttp middleware and both
SGLang clients take ``config=DriverConfig(...)``::

    config = DriverConfig(policies=SGLANG_POLICIES, observers=(metrics,))
    session = resilient_session(config=config)
    client = httpx.Client(transport=ResilientTransport(config=config))
    aiohttp.ClientSession(middlewares=(ResilientMiddleware(config=config),))

Every driver built from one config shares its per-engine state: one circuit
breaker and one retry budget per engine (keyed by ``scheme://host:port``), so
a dead engine opens one breaker for every session that talks to it, and
retries through any of them spend one budget. The drivers' old keywords
(``policies``, ``observers``, ``breaker``, ``retry_budget``, ``clock``,
``rng``) still work: they build a config of their own (with state of its
own, as before); ``config=`` with any of them: ``driver_config``.
"""

from __future__ import annotations

import enum
import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypedDict

from resilience.adapters.control_lane import DEFAULT_LANE, ControlLane
from resilience.adapters.ledger import AttemptLedger, LedgerRetrier
from resilience.breaker import BreakerConfig, BreakerRegistry
from resilience.budget import RetryBudgetConfig, RetryBudgets
from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.errors import ConfigConflict, ErrorTypes, require
from resilience.events import Observer
from resilience.policy import PolicyTable
from resilience.retry.retrier import Retrier

__all__ = ["DEFAULT_BREAKER", "DEFAULT_BUDGET", "UNSET", "ConfigViews", "DriverConfig", "DriverKeywords", "Unset", "driver_config"]

DEFAULT_BREAKER: Final = BreakerConfig()
"""The breaker every driver gets unless told otherwise: ``BreakerConfig()``'s defaults."""
DEFAULT_BUDGET: Final = RetryBudgetConfig()
"""The retry budget every driver gets unless told otherwise: ``RetryBudgetConfig()``'s defaults."""


class Unset(enum.Enum):
    """The type of ``UNSET``."""

    UNSET = "unset"


UNSET: Final = Unset.UNSET
"""A constructor keyword the caller did not give (so ``config=`` may supply it)."""


class DriverKeywords(TypedDict, total=False):
    """The keywords a driver's constructor takes besides ``policies`` and ``config`` (``**keywords: Unpack[DriverKeywords]``).

    Each one is ``DriverConfig``'s field of that name, for a config of the
    driver's own (``driver_config``); one not given (or ``UNSET``) takes that
    field's default.
    """

    observers: Sequence[Observer] | Unset
    """Receive every event (default none)."""
    breaker: BreakerConfig | BreakerRegistry | Unset | None
    """The circuit breaker per engine (default ``BreakerConfig()``; None turns breaking off)."""
    retry_budget: RetryBudgetConfig | RetryBudgets | Unset | None
    """The retry budget per engine (default ``RetryBudgetConfig()``; None turns it off)."""
    clock: Clock | Unset
    """Injectable time and sleeps (default the system clock)."""
    rng: Callable[[], float] | Unset
    """Injectable jitter source, floats in [0, 1) (default ``random.random``)."""


@dataclass(frozen=True, slots=True, eq=False)
class DriverConfig:
    """What every driver of the retry core needs, once: policies, observers, breakers, budgets, clock, random source.

    Compared by identity (``eq=False``): it holds the per-engine state that
    the drivers built from it share, so two configs of equal fields are two
    sets of breakers. Pickled (Ray ships sessions and clients that way), it
    arrives with the same settings and fresh per-engine state of its own.
    """

    policies: PolicyTable = field(default_factory=PolicyTable)
    """Routes requests (method + URL path) to endpoint policies (default: an empty table, so
    ``EndpointPolicy.for_method`` applies to everything)."""
    observers: Sequence[Observer] = ()
    """Receive every event, in this order (telemetry); kept as a tuple (default: none)."""
    breaker: BreakerConfig | BreakerRegistry | None = DEFAULT_BREAKER
    """The circuit breaker per engine: a ``BreakerConfig`` (a registry is built from it), a
    ``BreakerRegistry`` to share with other code (it keeps its own clock and observers), or None for no
    breaking (default ``BreakerConfig()``)."""
    retry_budget: RetryBudgetConfig | RetryBudgets | None = DEFAULT_BUDGET
    """The retry budget per engine: a ``RetryBudgetConfig``, a ``RetryBudgets`` to share, or None for no
    budget (default ``RetryBudgetConfig()``)."""
    clock: Clock = SYSTEM_CLOCK
    """Time and sleeps of the loop, the breakers and the budgets (default the system clock)."""
    rng: Callable[[], float] = random.random
    """Floats in [0, 1) for backoff jitter (default ``random.random``)."""
    control_lane: ControlLane | None = DEFAULT_LANE
    """Control routes (the table's entries other than generation) on connections of their own, never queued behind
    streaming generation: a ``ControlLane`` (``resilience.adapters.control_lane``), or None for one pool for
    everything (default ``ControlLane()``: on, at most 2 idle connections per engine kept open)."""
    breakers: BreakerRegistry | None = field(init=False, repr=False)
    """The per-engine breakers every driver built from this config uses (None: breaking is off)."""
    budgets: RetryBudgets | None = field(init=False, repr=False)
    """The per-engine retry budgets every driver built from this config uses (None: no budget)."""

    def __post_init__(self) -> None:
        _validate("DriverConfig", {name: getattr(self, name) for name in _CHECKS})
        observers = tuple(self.observers)
        object.__setattr__(self, "observers", observers)
        breaker, budget = self.breaker, self.retry_budget
        breakers = BreakerRegistry(breaker, clock=self.clock, observers=observers) if isinstance(breaker, BreakerConfig) else breaker
        budgets = RetryBudgets(budget, clock=self.clock) if isinstance(budget, RetryBudgetConfig) else budget
        object.__setattr__(self, "breakers", breakers)
        object.__setattr__(self, "budgets", budgets)

    @property
    def breaker_config(self) -> BreakerConfig | None:
        """The breakers' configuration (None: breaking is off)."""
        return None if self.breakers is None else self.breakers.config

    @property
    def retry_budget_config(self) -> RetryBudgetConfig | None:
        """The budgets' configuration (None: no budget)."""
        return None if self.budgets is None else self.budgets.config

    def retrier(self, error_types: ErrorTypes | None = None, ledger: AttemptLedger | None = None) -> Retrier:
        """A ``Retrier`` over this config's shared breakers and budgets, raising ``error_types`` (a driver's own classes).

        ``ledger`` (default None): a ``LedgerRetrier`` that also remembers calls in it (``SGLangInstrumentor``).
        """
        make: Callable[..., Retrier] = Retrier if ledger is None else functools.partial(LedgerRetrier, ledger)
        return make(
            breakers=self.breakers,
            budgets=self.budgets,
            observers=tuple(self.observers),
            clock=self.clock,
            rng=self.rng,
            error_types=error_types,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the settings, not the state: the copy builds fresh breakers and budgets of the same configurations.

        The default clock and random source travel as "the default" (None), so a
        copy uses its own process's: a pickled ``random.random`` would carry a
        copy of the generator's state, and every copy would draw the same jitter.
        """
        clock = None if self.clock is SYSTEM_CLOCK else self.clock
        rng = None if self.rng is random.random else self.rng
        state = (self.policies, tuple(self.observers), self.breaker_config, self.retry_budget_config, clock, rng, self.control_lane)
        return (_rebuilt, state)


def _rebuilt(
    policies: PolicyTable,
    observers: tuple[Observer, ...],
    breaker: BreakerConfig | None,
    retry_budget: RetryBudgetConfig | None,
    clock: Clock | None,
    rng: Callable[[], float] | None,
    control_lane: ControlLane | None = DEFAULT_LANE,
) -> DriverConfig:
    """A pickled ``DriverConfig`` again (None clock / rng: this process's defaults)."""
    return DriverConfig(
        policies=policies,
        observers=observers,
        breaker=breaker,
        retry_budget=retry_budget,
        clock=SYSTEM_CLOCK if clock is None else clock,
        rng=random.random if rng is None else rng,
        control_lane=control_lane,
    )


_CHECKS: Final[dict[str, tuple[Callable[[Any], bool], str]]] = {
    "policies": (lambda v: isinstance(v, PolicyTable), "a PolicyTable or None"),
    "observers": (lambda v: isinstance(v, Sequence) and all(callable(o) for o in v), "a sequence of callables"),
    "breaker": (lambda v: v is None or isinstance(v, (BreakerConfig, BreakerRegistry)), "a BreakerConfig, a BreakerRegistry or None"),
    "retry_budget": (
        lambda v: v is None or isinstance(v, (RetryBudgetConfig, RetryBudgets)),
        "a RetryBudgetConfig, a RetryBudgets or None",
    ),
    "clock": (
        lambda v: callable(getattr(v, "monotonic", None)) and callable(getattr(v, "sleep", None)),
        "a Clock (with monotonic() and sleep())",
    ),
    "rng": (callable, "a callable returning floats in [0, 1)"),
    "control_lane": (lambda v: v is None or isinstance(v, ControlLane), "a ControlLane or None"),
}
"""``DriverConfig``'s field -> (the test its value passes, the rule an error states)."""


def _validate(owner: str, fields: dict[str, Any]) -> None:
    """``ConfigError`` naming ``owner`` and the first of ``fields`` (in ``_CHECKS``' order) that is not what ``DriverConfig`` takes."""
    for name, (ok, rule) in _CHECKS.items():
        if name in fields:
            require(ok(fields[name]), owner, name, rule, fields[name])


def driver_config(
    owner: str,
    config: DriverConfig | None,
    *,
    policies: PolicyTable | Unset | None = UNSET,
    observers: Sequence[Observer] | Unset = UNSET,
    breaker: BreakerConfig | BreakerRegistry | Unset | None = UNSET,
    retry_budget: RetryBudgetConfig | RetryBudgets | Unset | None = UNSET,
    clock: Clock | Unset = UNSET,
    rng: Callable[[], float] | Unset = UNSET,
) -> DriverConfig:
    """What a driver's constructor does with its arguments: ``config`` as given, or a new one from the keywords given.

    ``owner`` names the constructor in errors. A keyword left ``UNSET`` takes
    ``DriverConfig``'s default; ``policies=None`` means an empty table. Both
    ``config`` and any keyword raise ``ConfigConflict`` naming them all.
    """
    given: dict[str, Any] = {
        "policies": policies,
        "observers": observers,
        "breaker": breaker,
        "retry_budget": retry_budget,
        "clock": clock,
        "rng": rng,
    }
    fields = {name: value for name, value in given.items() if value is not UNSET}
    if config is not None:
        if fields:
            raise ConfigConflict(
                f"{owner} got config= and {', '.join(n + '=' for n in fields)}: the DriverConfig already holds "
                f"{'that' if len(fields) == 1 else 'those'}; pass one or the other"
            )
        require(isinstance(config, DriverConfig), owner, "config", "a DriverConfig or None", config)
        return config
    if policies is None:
        del fields["policies"]  # an empty table, the field's default
    _validate(owner, fields)
    return DriverConfig(**fields)


class ConfigViews:
    """What every driver shows of its ``DriverConfig`` (``self.driver_config``), read-only: one definition for all drivers."""

    driver_config: DriverConfig

    @property
    def policies(self) -> PolicyTable:
        """The config's policy table."""
        return self.driver_config.policies

    @property
    def observers(self) -> tuple[Observer, ...]:
        """The config's observers."""
        return tuple(self.driver_config.observers)

    @property
    def breaker_config(self) -> BreakerConfig | None:
        """The config's breaker configuration (None: breaking is off)."""
        return self.driver_config.breaker_config

    @property
    def retry_budget_config(self) -> RetryBudgetConfig | None:
        """The config's retry budget configuration (None: no budget)."""
        return self.driver_config.retry_budget_config
