"""``EngineClientState``: what every engine client (SGLang's and vLLM's, sync and async) holds: the engine, its keys, a lock.

Each kind's ``state.py`` adds what its clients remember (SGLang: the pause
sent, the tags released; vLLM: the server's API, the weights asleep).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

from resilience.adapters.engine_steps import Steps
from resilience.adapters.routing import engine_of
from resilience.engine_contract import PauseMode

T = TypeVar("T")

__all__ = ["EngineClientState", "ForwardedCalls", "check_base_url"]


def check_base_url(base_url: str, owner: str) -> str:
    """``base_url`` without a trailing slash; a clear error naming ``owner`` when it is not http(s)."""
    if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
        raise ValueError(f"{owner} base_url must start with http:// or https://, but was {base_url!r}")
    return base_url.rstrip("/")


class EngineClientState:
    """The engine (``base_url``, checked; ``engine``, its label) and the lock guarding what a client remembers.

    ``KEYS``: the names of the client's keys (attributes ``_<name>``), shown in repr as ``name=***`` when set, never by
    value. Pickles without the lock (a client travels to Ray actors) and rebuilds it.
    """

    KEYS: ClassVar[tuple[str, ...]] = ("api_key",)

    def __init__(self, base_url: str) -> None:
        self.base_url = check_base_url(base_url, type(self).__name__)
        self.engine = engine_of(self.base_url)[0]
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        keys = "".join(f", {name}=***" for name in self.KEYS if getattr(self, "_" + name, None))
        return f"{type(self).__name__}({self.base_url!r}{keys})"

    def _perform(self, step: object) -> Any:
        """One step of an exchange (``engine_steps.drive``): seconds waited (a number), else a request sent.

        A sync client answers with the value, an async one with an awaitable of it.
        """
        return self._pause_between_polls(step) if isinstance(step, int | float) else self._send(step)

    def _timed(
        self, request: object, read: Callable[[str, Any, float, BaseException | None], T], errors: tuple[type[BaseException], ...]
    ) -> Steps[Any, T]:
        """A health check as steps: ``request`` sent, then ``read(engine, answer, latency_s, error)``, where a transport
        error in ``errors`` is read (answer None), never raised."""
        t0 = time.monotonic()
        answer, error = yield request
        if error is not None and not isinstance(error, errors):
            raise error
        return read(self.engine, answer, time.monotonic() - t0, error)

    def _send(self, request: Any) -> Any:
        raise NotImplementedError  # each client sends its own way

    def _pause_between_polls(self, seconds: float) -> Any:
        raise NotImplementedError  # each client waits its own way (a method, so a test can play a stalled machine)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class ForwardedCalls:
    """The barrier's five calls (``ControlPlaneEngine``), each run by ``_forward`` as the method of the same name
    elsewhere: a Ray engine actor on its client, a Ray handle in its actor, ``SmgEngine`` through the gateway."""

    def _forward(self, method: str, kwargs: Mapping[str, Any]) -> Any:
        """Run ``method`` with ``kwargs`` where this object runs it, and return its value."""
        raise NotImplementedError

    def pause_generation(self, mode: PauseMode = "abort") -> Any:
        """Stop admitting requests (``abort``, ``retract`` or ``in_place``)."""
        return self._forward("pause_generation", {"mode": mode})

    def flush_cache(self, deadline_s: float | None = None) -> Any:
        """Flush the KV cache, waiting up to ``deadline_s`` (None = the engine's default) for idle."""
        return self._forward("flush_cache", {"deadline_s": deadline_s})

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """Release GPU memory for ``tags`` (None = every tag)."""
        return self._forward("release_memory_occupation", {"tags": None if tags is None else list(tags)})

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """Occupy GPU memory again for ``tags`` (None = every tag)."""
        return self._forward("resume_memory_occupation", {"tags": None if tags is None else list(tags)})

    def continue_generation(self, torch_empty_cache: bool = True) -> Any:
        """Admit requests again."""
        return self._forward("continue_generation", {"torch_empty_cache": torch_empty_cache})
