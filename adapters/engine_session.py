"""The driver an engine client (SGLang or vLLM) builds for its own session: its keyword arguments, checked one way for all."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import requests

from resilience.adapters.driver_config import UNSET, DriverConfig, Unset
from resilience.adapters.engine_http import DEFAULT_LIMIT_PER_HOST
from resilience.adapters.requests import ResilientAdapter, resilient_session
from resilience.engine_contract import MemoryProbe
from resilience.errors import ConfigConflict
from resilience.events import Observer
from resilience.policy import PolicyTable

__all__ = ["DRIVER_KEYWORDS", "SyncSessionOwner", "WithProbe", "mount_adapter", "own_driver_kwargs", "own_policies", "probed_config"]

WithProbe = Callable[[PolicyTable, MemoryProbe], PolicyTable]
"""A kind's way to have a memory probe asked by its table (SGLang's ``with_memory_probe``)."""


DRIVER_KEYWORDS = ("policies", "observers", "breaker", "retry_budget", "clock", "rng")
"""The keywords a ``DriverConfig`` holds: given with ``config=``, they conflict."""


def own_driver_kwargs(
    owner: str, default: PolicyTable, *, session: object, config: DriverConfig | None, policies: PolicyTable | Unset,
    observers: Sequence[Observer] | Unset, extra: Mapping[str, Any], limit_per_host: int = DEFAULT_LIMIT_PER_HOST,
    memory_probe: MemoryProbe | None = None, with_probe: WithProbe | None = None
) -> dict[str, Any]:
    """The keyword arguments of the driver a client builds for its own session, checked the same way for every client.

    ``policies`` left ``UNSET`` is ``default`` (the kind's table: ``SGLANG_POLICIES``, ``VLLM_POLICIES``), or the
    config's policies. ``extra``: the driver's other keywords the caller gave (``breaker``, ``retry_budget``, ``clock``,
    pool sizes); ``limit_per_host``: an async client's own pool size, an own-session setting when not
    ``DEFAULT_LIMIT_PER_HOST``. ``memory_probe`` (None = none): asked on the table's release and resume entries
    (``with_probe``, the kind's ``with_memory_probe``; a probe given to a kind without one is a ``ConfigConflict``);
    with ``config``, the client gets a copy of the config whose policies ask it (``probed_config``: same observers, and
    the same per-engine breakers and budgets, still shared). With a ``session``, none of them applies, so any of them
    (``config`` and ``memory_probe`` included) raises ``ConfigConflict`` naming them; so does ``config`` with any
    keyword it already holds. Returns {} when a session is given.
    """
    given = [name for name, value in (("policies", policies), ("observers", observers)) if value is not UNSET]
    given += ["memory_probe"] if memory_probe is not None else []
    given += ["limit_per_host"] if limit_per_host != DEFAULT_LIMIT_PER_HOST else []
    given += sorted(extra)
    if memory_probe is not None and with_probe is None:
        raise ConfigConflict(f"{owner} got memory_probe=: this engine kind has no memory probe")
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
        probed = config if memory_probe is None or with_probe is None else probed_config(config, memory_probe, with_probe)
        return {"config": probed, **extra}
    table = default if isinstance(policies, Unset) else policies
    return {
        "policies": table if memory_probe is None or with_probe is None else with_probe(table, memory_probe),
        "observers": () if isinstance(observers, Unset) else observers,
        **extra,
    }


def probed_config(config: DriverConfig, memory_probe: MemoryProbe, with_probe: WithProbe) -> DriverConfig:
    """``config`` with ``memory_probe`` asked on its policies' release and resume entries (``with_probe``).

    A new ``DriverConfig`` over the same observers, clock and random source, and the same per-engine breakers and
    budgets (handed over as the registries themselves, so what this client sees still opens the breaker every other
    driver of ``config`` uses). A config whose policies have no release or resume entry is refused (``ValueError``):
    build it with the kind's table (``policies=SGLANG_POLICIES``).
    """
    return DriverConfig(
        policies=with_probe(config.policies, memory_probe),
        observers=config.observers,
        breaker=config.breakers,
        retry_budget=config.budgets,
        clock=config.clock,
        rng=config.rng,
    )


def own_policies(driver_kwargs: Mapping[str, Any], default: PolicyTable) -> PolicyTable:
    """The table the client's own session routes by (``own_driver_kwargs``' answer); ``default`` with a session of the caller's."""
    config = driver_kwargs.get("config")
    if isinstance(config, DriverConfig):
        return config.policies
    table = driver_kwargs.get("policies", default)
    return table if isinstance(table, PolicyTable) else default


def mount_adapter(
    owner: str, default: PolicyTable, session: requests.Session, base_urls: Sequence[str], *, policies: PolicyTable | Unset,
    observers: Sequence[Observer] | Unset, config: DriverConfig | None, extra: Mapping[str, Any]
) -> ResilientAdapter:
    """``mount_sglang`` and ``mount_vllm`` (``owner``, over their kind's ``default`` table): one ``ResilientAdapter``
    built from ``own_driver_kwargs`` mounted on ``session`` for each engine URL; returns it."""
    kwargs = own_driver_kwargs(owner, default, session=None, config=config, policies=policies, observers=observers, extra=extra)
    adapter = ResilientAdapter(**kwargs)
    for url in base_urls:
        session.mount(url.rstrip("/") + "/", adapter)
    return adapter


class SyncSessionOwner:
    """A sync client's ``requests.Session``: the one passed (used as is, never closed) or its own; ``close`` and ``with``."""

    session: requests.Session
    _owns_session: bool

    def _open_session(self, session: requests.Session | None, driver_kwargs: Mapping[str, Any]) -> None:
        """Use ``session``, or open the client's own with a ``ResilientAdapter(**driver_kwargs)`` (None = open one)."""
        self._owns_session = session is None
        self.session = session if session is not None else resilient_session(**driver_kwargs)

    def close(self) -> None:
        """Close the session if this client created it."""
        if self._owns_session:
            self.session.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
