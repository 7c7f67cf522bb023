"""``SGLangInstrumentor``: our drivers on the requests, httpx and aiohttp clients other code creates, for given engines.

In the manner of OpenTelemetry's client instrumentors: one call patches the libraries' client classes, so code that
knows nothing of us (a framework's ``aiohttp.ClientSession`` per fan-out, verl's module-level ``requests.post``) goes
through the retry loop for the engines named, and through plain library code for every other host::

    from resilience.adapters.instrument import SGLangInstrumentor

    SGLangInstrumentor(["http://10.0.0.5:30000", "10.0.0.6"]).instrument()   # URLs, host:port or hosts
    ...                                                                       # the framework runs as shipped
    SGLangInstrumentor.active().uninstrument()                                # everything back as it was

What is patched (requests' ``Session.get_adapter``, httpx's ``_transport_for_url``, aiohttp's ``ClientSession.__init__``),
the one state per engine (breaker, retry budget, ``AttemptLedger``: ``resilience.adapters.ledger`` has the rules), the
sessions left alone and the rules per process are in ``docs/frameworks.md``, "Mount once, keep the framework's code".
Beyond that page: httpx's ``_transport_for_url`` is private (httpx 0.23 to 0.28) and ``instrument`` fails at once,
naming it, where it is missing; after ``uninstrument`` the middleware of aiohttp sessions still open passes everything
through. **A probe that cannot see an engine is refused** (``check_probes``): a mount must not run without its memory
probe, silently. An instrumentor pickles as its settings and is not active in the process that unpickles it
(``tests/adapters/test_instrument.py`` instruments real Ray actors); it is callable too (``instrumentor()`` =
``instrument()``), for hooks that take one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Unpack
from urllib.parse import urlsplit

from resilience.adapters.driver_config import UNSET, DriverConfig, DriverKeywords, Unset, driver_config
from resilience.adapters.ledger import DEFAULT_WINDOW_S, AttemptLedger
from resilience.adapters.sglang import SGLANG_POLICIES
from resilience.engine_contract import MemoryProbe, covers
from resilience.errors import ConfigError, ErrorTypes
from resilience.policy import PolicyTable
from resilience.retry.retrier import Retrier

__all__ = ["LIBRARIES", "SGLangInstrumentor", "VLLMInstrumentor"]

logger = logging.getLogger(__name__)

LIBRARIES: tuple[str, ...] = ("requests", "httpx", "aiohttp")
"""The client libraries an instrumentor can patch."""
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_LOCK = threading.RLock()
_ACTIVE: SGLangInstrumentor | None = None
"""The instrumentor whose patches are in place in this process, or None."""


@dataclass(frozen=True, slots=True)
class _Target:
    """One engine as given: a host, and a port unless any port of that host is meant."""

    host: str
    port: int | None
    scheme: str = "http"

    @property
    def engine(self) -> str | None:
        """``scheme://host:port`` as the drivers name the engine (``http`` when none was given); None for a bare host."""
        if self.port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @classmethod
    def parse(cls, text: object) -> _Target:
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"SGLangInstrumentor.engines must hold URLs, 'host:port' or hosts, but held {text!r}")
        raw = text.strip()
        try:
            parts = urlsplit(raw if "://" in raw else f"//{raw}")
            port = parts.port
        except ValueError as exc:
            raise ConfigError(f"SGLangInstrumentor.engines: {raw!r} is not a URL, 'host:port' or host ({exc})") from None
        if not parts.hostname:
            raise ConfigError(f"SGLangInstrumentor.engines: {raw!r} names no host")
        if parts.path not in ("", "/") or parts.query:
            raise ConfigError(f"SGLangInstrumentor.engines: {raw!r} must name an engine (scheme://host:port), not a path or query")
        if port is None and "://" in raw:
            port = _DEFAULT_PORTS.get(parts.scheme.lower())
        return cls(parts.hostname.lower(), port, parts.scheme.lower() if "://" in raw else "http")

    def matches(self, host: str, port: int | None) -> bool:
        return host == self.host and (self.port is None or port == self.port)

    def same_engine(self, other: _Target) -> bool:
        """Whether both name the same host and port (the scheme is how the drivers name it, not which requests match)."""
        return (self.host, self.port) == (other.host, other.port)


class SGLangInstrumentor:
    """Attaches the resilience drivers to the requests, httpx and aiohttp clients of this process, for ``engines`` only.

    ``engines``: URLs (``http://10.0.0.5:30000``: that host and port; a URL without a port means the scheme's default),
    ``host:port``, or bare hosts (every port of that host). ``config``: a ``DriverConfig`` every attached driver is
    built from (its policies, observers, clock, random source, and its one breaker and one retry budget per engine,
    shared by them all); default one built from the keywords: ``policies`` (default ``SGLANG_POLICIES``), ``observers``,
    ``breaker`` / ``retry_budget`` (defaults ``BreakerConfig()`` / ``RetryBudgetConfig()``; None turns that strategy
    off), ``clock`` / ``rng``. ``config`` with any of those raises ``ConfigConflict``. ``window_s``: how long an
    engine+endpoint's attempts are remembered across calls after the last one (default 10 s; see
    ``resilience.adapters.ledger``). ``libraries``: which of ``LIBRARIES`` to patch (default: each one installed; naming
    one that is not installed is an error at ``instrument``).
    """

    def __init__(
        self,
        engines: Sequence[str],
        *,
        config: DriverConfig | None = None,
        policies: PolicyTable | Unset = UNSET,
        window_s: float = DEFAULT_WINDOW_S,
        libraries: Collection[str] | None = None,
        **keywords: Unpack[DriverKeywords],
    ) -> None:
        if isinstance(engines, str) or not isinstance(engines, Sequence) or not engines:
            raise ConfigError(f"SGLangInstrumentor.engines must be a non-empty sequence of URLs or hosts, but was {engines!r}")
        if libraries is not None:
            unknown = sorted(set(libraries) - set(LIBRARIES))
            if isinstance(libraries, str) or unknown or not libraries:
                raise ConfigError(f"SGLangInstrumentor.libraries must be a non-empty subset of {LIBRARIES}, but was {libraries!r}")
        if config is None and isinstance(policies, Unset):
            policies = self._default_policies()
        self.config: DriverConfig = driver_config(type(self).__name__, config, policies=policies, **keywords)
        """What every attached driver is built from; its breakers and budgets are the per-engine state they share."""
        self.engines: tuple[str, ...] = tuple(engines)
        """The engines as given."""
        self._targets = tuple(_Target.parse(e) for e in self.engines)
        self.libraries: tuple[str, ...] | None = None if libraries is None else tuple(lib for lib in LIBRARIES if lib in libraries)
        """The libraries asked for (None: each one installed)."""
        self.ledger = AttemptLedger(window_s, clock=self.config.clock)
        """Attempts per engine and endpoint across calls, shared by every attached driver."""
        self.window_s = self.ledger.window_s
        self._state_lock = threading.RLock()
        self._retriers: dict[int, Retrier] = {}
        self._requests_adapter: Any = None
        self._aiohttp_middleware: Any = None
        self._patches: list[tuple[type, str, Any]] = []

    @staticmethod
    def _default_policies() -> PolicyTable:
        """The table used when neither ``policies`` nor ``config`` is given: ``SGLANG_POLICIES``."""
        return SGLANG_POLICIES

    @property
    def policies(self) -> PolicyTable:
        """The table every attached driver uses (the config's)."""
        return self.config.policies

    # -- identity, pickling ---------------------------------------------

    def same_settings(self, other: SGLangInstrumentor) -> bool:
        """Whether ``other`` would mount the same thing: equal engines, policies, libraries and window."""
        return type(self) is type(other) and len(self._targets) == len(other._targets) and all(
            a.same_engine(b) for a, b in zip(self._targets, other._targets, strict=True)
        ) and self.libraries == other.libraries and self.window_s == other.window_s and (
            self.policies is other.policies or dict(self.policies.entries) == dict(other.policies.entries)
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Settings only (the config pickles as its settings): the process that unpickles it has its own patches and state."""
        return (_rebuilt, (type(self), self.engines, self.config, self.window_s, self.libraries))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.engines)!r}, libraries={self.libraries!r}, window_s={self.window_s:g})"

    # -- the process's instrumentation ---------------------------------------

    @staticmethod
    def active() -> SGLangInstrumentor | None:
        """The instrumentor whose patches are in place in this process, or None."""
        return _ACTIVE

    @property
    def instrumented(self) -> bool:
        """Whether this instrumentor's patches are in place in this process."""
        return _ACTIVE is self

    def instrument(self) -> SGLangInstrumentor:
        """Patch the libraries in this process; returns the active instrumentor (this one, or an equal one already active).

        Idempotent: a second call, or a call on an equal instrumentor, changes nothing. Raises ``RuntimeError`` while a
        different instrumentor is active, and ``ConfigError`` for a named library that is not installed, an httpx
        without the method patched, or a memory probe in the policies that does not know every engine
        (``check_probes``).
        """
        global _ACTIVE
        with _LOCK:
            current = _ACTIVE
            if current is not None:
                if current is self or current.same_settings(self):
                    return current
                raise RuntimeError(f"{current!r} is already active in this process; call its uninstrument() first")
            self.check_probes()
            patches = self._plan_patches()
            for owner, name, replacement in patches:
                original = owner.__dict__[name]
                self._patches.append((owner, name, original))
                setattr(owner, name, replacement)
            _ACTIVE = self
            logger.info("instrumented %s for %d engine(s)", ", ".join(sorted({_lib(o) for o, _, _ in patches})), len(self._targets))
            return self

    def uninstrument(self) -> None:
        """Undo this instrumentor's patches (a no-op when it is not the active one); open aiohttp sessions pass through."""
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not self:
                return
            for owner, name, original in reversed(self._patches):
                setattr(owner, name, original)
            self._patches.clear()
            _ACTIVE = None

    def __call__(self) -> None:
        """``instrument()``, for hooks that take a callable (Ray's ``worker_process_setup_hook``)."""
        self.instrument()

    def __enter__(self) -> SGLangInstrumentor:
        return self.instrument()

    def __exit__(self, *exc: object) -> None:
        self.uninstrument()

    def memory_probes(self) -> list[MemoryProbe]:
        """The memory probes the policies ask (each entry's ``on_ambiguous`` that holds one, ``MemoryProbeCheck``), once each."""
        probes: list[MemoryProbe] = []
        for policy in self.policies.entries.values():
            probe = getattr(policy.on_ambiguous, "memory_probe", None)
            if isinstance(probe, MemoryProbe) and not any(p is probe for p in probes):
                probes.append(probe)
        return probes

    def check_probes(self) -> None:
        """Raise ``ConfigError`` unless every memory probe of the policies knows every engine (``resilience.engine_contract.covers``).

        A probe that answers ``UnknownEngine`` for an engine would leave the mount without its probe there, silently (an
        ``EmulatorMemoryProbe`` without the proxies' ``aliases=``, a fleet's probe taken before ``fleet.start()``). A
        bare host (any port) cannot be checked, so a probe needs each engine's port.
        """
        for probe in self.memory_probes():
            bare = [t.host for t in self._targets if t.engine is None]
            if bare:
                raise ConfigError(
                    f"SGLangInstrumentor.engines: {bare!r} name no port, and the policies ask the memory probe {probe!r}, "
                    "which answers per engine: name each engine as scheme://host:port"
                )
            unknown = [t.engine for t in self._targets if t.engine is not None and not covers(probe, t.engine)]
            if unknown:
                raise ConfigError(
                    f"SGLangInstrumentor: the memory probe {probe!r} knows nothing of {unknown!r}, so the mount would run without "
                    "it there; give the probe those engines (EmulatorMemoryProbe(..., aliases={proxy_url: engine_url}), "
                    "fleet.memory_probe() taken after fleet.start(), NvmlMemoryProbe({url: EngineGpu(...)}))"
                )

    # -- matching and drivers ---------------------------------------------

    def matches(self, host: str | None, port: int | None) -> bool:
        """Whether a request to ``host`` and ``port`` goes to one of the engines."""
        if not host:
            return False
        host = host.lower().strip("[]")
        return any(t.matches(host, port) for t in self._targets)

    def matches_url(self, url: str) -> bool:
        """``matches`` for a URL string (its scheme's default port when it names none)."""
        try:
            parts = urlsplit(url)
            port = parts.port or _DEFAULT_PORTS.get(parts.scheme.lower())
        except ValueError:
            return False
        return self.matches(parts.hostname, port)

    def retrier(self, error_types: ErrorTypes) -> Retrier:
        """The retry driver for one library's error classes: this instrumentor's breakers, budgets and ledger."""
        key = id(error_types)
        retrier = self._retriers.get(key)
        if retrier is None:
            with self._state_lock:
                retrier = self._retriers.get(key)
                if retrier is None:
                    retrier = self.config.retrier(error_types, self.ledger)
                    self._retriers[key] = retrier
        return retrier

    def _plan_patches(self) -> list[tuple[type, str, Any]]:
        """(class, attribute, replacement) for every library asked for and installed; raises for what cannot be patched."""
        import importlib.util

        patches: list[tuple[type, str, Any]] = []
        for lib in LIBRARIES:
            installed = importlib.util.find_spec(lib) is not None
            if self.libraries is not None and lib in self.libraries and not installed:
                raise ConfigError(f"SGLangInstrumentor.libraries names {lib!r}, which is not installed")
            if installed and (self.libraries is None or lib in self.libraries):
                patches += _PATCHERS[lib]()
        return patches

    def _adapter(self) -> Any:
        """The one ``ResilientAdapter`` every requests session gets for the engines."""
        if self._requests_adapter is None:
            from resilience.adapters.requests import ResilientAdapter

            with self._state_lock:
                if self._requests_adapter is None:
                    adapter = ResilientAdapter(config=self.config)
                    adapter.retrier = self.retrier(adapter.retrier.error_types)
                    self._requests_adapter = adapter
        return self._requests_adapter

    def _middleware(self) -> Any:
        """The one ``ResilientMiddleware`` the aiohttp sessions' gate runs for the engines."""
        if self._aiohttp_middleware is None:
            from resilience.adapters.aiohttp import ERROR_TYPES, ResilientMiddleware

            with self._state_lock:
                if self._aiohttp_middleware is None:
                    middleware = ResilientMiddleware(config=self.config)
                    middleware.retrier = self.retrier(ERROR_TYPES)
                    self._aiohttp_middleware = middleware
        return self._aiohttp_middleware

    def _transport(self, inner: Any, asynchronous: bool) -> Any:
        """``inner`` wrapped once in a resilient httpx transport with this instrumentor's shared state."""
        from resilience.adapters import httpx as ours
        from resilience.adapters.httpx_errors import ERROR_TYPES

        slot = "_resilience_instrumented"
        held = getattr(inner, slot, None)
        if held is not None and held[0] is self:
            return held[1]
        cls = ours.AsyncResilientTransport if asynchronous else ours.ResilientTransport
        wrapper = cls(transport=inner, config=self.config)
        wrapper.retrier = self.retrier(ERROR_TYPES)
        try:
            setattr(inner, slot, (self, wrapper))
        except AttributeError:  # a transport with __slots__: a fresh wrapper per request (the state is shared anyway)
            pass
        return wrapper


class VLLMInstrumentor(SGLangInstrumentor):
    """``SGLangInstrumentor`` for vLLM engines: the same patches, ledger and checks, over ``VLLM_POLICIES`` by default.

    ``policies`` defaults to ``resilience.adapters.vllm.VLLM_POLICIES`` (one entry per route of vLLM 0.33.0,
    ``adapters/vllm/routes.py``); every other knob is ``SGLangInstrumentor``'s. What the ledger shares follows from that
    table: ``/sleep``, ``/wake_up``, ``/pause``, ``/resume`` and the cache resets are idempotent (a re-send is a no-op
    in vLLM), so a framework's own retries get attempts of their own; ``/update_weights`` and the weight-session routes
    are never re-sent once they may have arrived, and share one count with the framework's tries. One instrumentor is
    active per process: a process that drives both kinds mounts one of them with a table holding both kinds' routes
    (``PolicyTable.with_entries``).
    """

    @staticmethod
    def _default_policies() -> PolicyTable:
        """``VLLM_POLICIES``."""
        from resilience.adapters.vllm.routes import VLLM_POLICIES

        return VLLM_POLICIES


def _rebuilt(
    cls: type[SGLangInstrumentor], engines: tuple[str, ...], config: DriverConfig, window_s: float, libraries: tuple[str, ...] | None
) -> SGLangInstrumentor:
    """An unpickled instrumentor: not active in this process until its ``instrument()``."""
    return cls(engines, config=config, window_s=window_s, libraries=libraries)


def _lib(owner: type) -> str:
    return owner.__module__.partition(".")[0]


def _requests_patches() -> list[tuple[type, str, Any]]:
    import requests

    from resilience.adapters.requests import ResilientAdapter

    original = requests.Session.__dict__["get_adapter"]

    def get_adapter(self: requests.Session, url: str) -> Any:
        mounted = original(self, url)
        active = _ACTIVE
        if active is None or isinstance(mounted, ResilientAdapter) or not active.matches_url(url):
            return mounted
        return active._adapter()

    get_adapter.__doc__ = original.__doc__
    get_adapter.__wrapped__ = original  # type: ignore[attr-defined]
    return [(requests.Session, "get_adapter", get_adapter)]


def _httpx_patches() -> list[tuple[type, str, Any]]:
    import httpx

    from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport

    patches: list[tuple[type, str, Any]] = []
    for cls, asynchronous in ((httpx.Client, False), (httpx.AsyncClient, True)):
        original = cls.__dict__.get("_transport_for_url")
        if original is None:
            raise ConfigError(
                f"httpx {httpx.__version__}: {cls.__name__}._transport_for_url is gone (httpx 0.23 to 0.28 have it); "
                "the httpx instrumentation cannot attach; pass libraries=('requests', 'aiohttp') or mount "
                "ResilientTransport on your clients"
            )

        def transport_for_url(self: Any, url: httpx.URL, _original: Any = original, _async: bool = asynchronous) -> Any:
            transport = _original(self, url)
            active = _ACTIVE
            if active is None or isinstance(transport, (ResilientTransport, AsyncResilientTransport)):
                return transport
            port = url.port or _DEFAULT_PORTS.get(url.scheme)
            if not active.matches(url.host, port):
                return transport
            return active._transport(transport, _async)

        transport_for_url.__wrapped__ = original  # type: ignore[attr-defined]
        patches.append((cls, "_transport_for_url", transport_for_url))
    return patches


class _Gate:
    """The middleware the instrumented ``ClientSession.__init__`` adds: ours for engine URLs, a pass-through for the rest."""

    async def __call__(self, request: Any, handler: Any) -> Any:
        active = _ACTIVE
        url = request.url
        if active is None or not active.matches(url.host, url.port):
            return await handler(request)
        return await active._middleware()(request, handler)


_GATE = _Gate()


def _aiohttp_patches() -> list[tuple[type, str, Any]]:
    import aiohttp

    from resilience.adapters.aiohttp import ResilientMiddleware

    original = aiohttp.ClientSession.__dict__["__init__"]

    def __init__(self: aiohttp.ClientSession, *args: Any, **kwargs: Any) -> None:
        if _ACTIVE is not None:
            middlewares = tuple(kwargs.get("middlewares") or ())
            if not any(isinstance(m, (ResilientMiddleware, _Gate)) for m in middlewares):
                kwargs["middlewares"] = (*middlewares, _GATE)
        original(self, *args, **kwargs)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    return [(aiohttp.ClientSession, "__init__", __init__)]


_PATCHERS: dict[str, Callable[[], list[tuple[type, str, Any]]]] = {
    "requests": _requests_patches,
    "httpx": _httpx_patches,
    "aiohttp": _aiohttp_patches,
}
