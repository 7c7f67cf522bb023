"""The driver a client builds for its own session: its keyword arguments, checked the same way for both SGLang clients."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from resilience.adapters.driver_config import UNSET, DriverConfig, Unset
from resilience.adapters.sglang.policies import SGLANG_POLICIES, with_memory_probe
from resilience.errors import ConfigConflict
from resilience.events import Observer
from resilience.memory_probe import MemoryProbe
from resilience.policy import PolicyTable

__all__ = ["DRIVER_KEYWORDS", "own_driver_kwargs", "own_policies", "probed_config"]


DRIVER_KEYWORDS = ("policies", "observers", "breaker", "retry_budget", "clock", "rng")
"""The keywords a ``DriverConfig`` holds: given with ``config=``, they conflict."""


def own_driver_kwargs(
    owner: str,
    *,
    session: object,
    config: DriverConfig | None,
    policies: PolicyTable | Unset,
    observers: Sequence[Observer] | Unset,
    extra: Mapping[str, Any],
    own_session_only: Sequence[str] = (),
    memory_probe: MemoryProbe | None = None,
) -> dict[str, Any]:
    """The keyword arguments of the driver a client builds for its own session, checked the same way for both clients.

    ``policies`` left ``UNSET`` is ``SGLANG_POLICIES`` (or the config's
    policies). ``extra``: the driver's other keywords the caller gave
    (``breaker``, ``retry_budget``, ``clock``, pool sizes); ``own_session_only``:
    names of the client's own-session settings the caller gave (``limit_per_host``).
    ``memory_probe`` (None = none): asked on the table's release and resume
    entries (``with_memory_probe``); with ``config``, the client gets a copy
    of the config whose policies ask it (``probed_config``: same observers,
    and the same per-engine breakers and budgets, still shared).
    With a ``session``, none of them applies, so any of them (``config`` and
    ``memory_probe`` included) raises ``ConfigConflict`` naming them; so does
    ``config`` with any keyword it already holds. Returns {} when a session is given.
    """
    given = [name for name, value in (("policies", policies), ("observers", observers)) if value is not UNSET]
    given += ["memory_probe"] if memory_probe is not None else []
    given += [*own_session_only, *sorted(extra)]
    if session is not None:
        named = (["config"] if config is not None else []) + given
        if named:
            probe_hint = " (with_memory_probe(policies, probe) from resilience.adapters.sglang for the probe)"
            raise ConfigConflict(
                f"{owner} got session= and {', '.join(n + '=' for n in named)}: those configure only the client's own "
                f"session; mount the resilience layer on the session you pass instead{probe_hint if memory_probe else ''}"
            )
        return {}
    if config is not None:
        clash = [name for name in given if name in DRIVER_KEYWORDS]
        if clash:
            raise ConfigConflict(
                f"{owner} got config= and {', '.join(n + '=' for n in clash)}: the DriverConfig already holds "
                f"{'that' if len(clash) == 1 else 'those'}; pass one or the other"
            )
        return {"config": config if memory_probe is None else probed_config(config, memory_probe), **extra}
    table = SGLANG_POLICIES if isinstance(policies, Unset) else policies
    return {
        "policies": table if memory_probe is None else with_memory_probe(table, memory_probe),
        "observers": () if isinstance(observers, Unset) else observers,
        **extra,
    }


def probed_config(config: DriverConfig, memory_probe: MemoryProbe) -> DriverConfig:
    """``config`` with ``memory_probe`` asked on its policies' release and resume entries (``with_memory_probe``).

    A new ``DriverConfig`` over the same observers, clock and random source, and
    the same per-engine breakers and budgets (handed over as the registries
    themselves, so what this client sees still opens the breaker every other
    driver of ``config`` uses). A config whose policies have no release or
    resume entry is refused (``ValueError``): build it with ``policies=SGLANG_POLICIES``.
    """
    return DriverConfig(
        policies=with_memory_probe(config.policies, memory_probe),
        observers=config.observers,
        breaker=config.breakers,
        retry_budget=config.budgets,
        clock=config.clock,
        rng=config.rng,
    )


def own_policies(driver_kwargs: Mapping[str, Any]) -> PolicyTable:
    """The table the client's own session routes by (``own_driver_kwargs``' answer); ``SGLANG_POLICIES`` with a session of the caller's."""
    config = driver_kwargs.get("config")
    if isinstance(config, DriverConfig):
        return config.policies
    table = driver_kwargs.get("policies", SGLANG_POLICIES)
    return table if isinstance(table, PolicyTable) else SGLANG_POLICIES
