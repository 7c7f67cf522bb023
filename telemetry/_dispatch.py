"""The base of the observers here: a ``CallObserver`` whose events go to a handler per event type, failures logged, never raised."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from resilience.events import CallObserver, Event

__all__ = ["Dispatcher"]

log = logging.getLogger("resilience.telemetry")


class Dispatcher(CallObserver):
    """Routes each event to the handler registered for its exact type; other events are ignored.

    A per-call event given as an object (by a producer other than the retry
    core: the smg fan-out, a test) is handed to its per-call method
    (``CallObserver.replay``), which the subclass overrides. A handler that
    raises is logged at WARNING on ``resilience.telemetry`` and the event
    dropped: telemetry must never break a control call.
    """

    _handlers: Mapping[type[Any], Callable[[Any], None]]

    def __call__(self, event: Event) -> None:
        """Handle one event; never raises."""
        handler = self._handlers.get(type(event))
        if handler is None:
            return
        try:
            handler(event)
        except Exception:
            log.warning("%s failed on %s", type(self).__name__, type(event).__name__, exc_info=True)
