"""The server-side record of control calls, kept by a pure ASGI middleware.

Each call gets an entry when its request arrives, completed when its answer has been written. Times are
``time.monotonic_ns()``, system-wide on Linux, so tests can order the calls of several engine processes. The data
plane and ``/_emulator/*`` are not recorded. Only the last ``MAX_CALLS`` calls are kept (a 1000-step soak keeps a
flat memory); ``seq`` keeps counting over the calls dropped, and ``dropped`` says how many were.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["MAX_CALLS", "CallRecord", "RecordMiddleware"]

Scope = MutableMapping[str, Any]
ASGIMessage = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[ASGIMessage]]
Send = Callable[[ASGIMessage], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_UNRECORDED_PATHS = ("/generate",)
_UNRECORDED_PREFIX = "/_emulator/"


MAX_CALLS = 2048
"""Calls a ``CallRecord`` keeps by default: the oldest go first (about 1 MB per engine at most; a colocate step makes ~10)."""


class CallRecord:
    """The last ``max_calls`` control calls this engine received (default ``MAX_CALLS``), in arrival order."""

    def __init__(self, max_calls: int = MAX_CALLS) -> None:
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise ValueError(f"`max_calls` must be an integer >= 1, but was {max_calls!r}")
        self._calls: deque[dict[str, Any]] = deque(maxlen=max_calls)
        self._seq = 0

    @property
    def dropped(self) -> int:
        """How many of the oldest calls are no longer kept."""
        return self._seq - len(self._calls)

    def begin(self, method: str, path: str, query: str) -> dict[str, Any]:
        """Add the entry of a call that just arrived; the caller fills body, status and answered_ns."""
        seq, self._seq = self._seq, self._seq + 1
        entry: dict[str, Any] = {
            "seq": seq,
            "method": method,
            "path": path,
            "query": query,
            "body": None,
            "status": None,
            "received_ns": time.monotonic_ns(),
            "answered_ns": None,
        }
        self._calls.append(entry)
        return entry

    def calls(self) -> list[dict[str, Any]]:
        """A copy of every entry (``status`` and ``answered_ns`` stay None while a call is unanswered)."""
        return [dict(entry) for entry in self._calls]


def _parse_body(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", errors="replace")


class RecordMiddleware:
    """ASGI middleware that writes each recorded call into a :class:`CallRecord`.

    ``unrecorded``: the data-plane paths left out (default ``("/generate",)``, SGLang's; vLLM's is ``/v1/completions``).
    """

    def __init__(self, app: ASGIApp, record: CallRecord, unrecorded: tuple[str, ...] = _UNRECORDED_PATHS) -> None:
        self._app = app
        self._record = record
        self._unrecorded = unrecorded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self._unrecorded or path.startswith(_UNRECORDED_PREFIX):
            await self._app(scope, receive, send)
            return
        entry = self._record.begin(scope["method"], path, scope.get("query_string", b"").decode("latin-1"))
        chunks: list[bytes] = []

        async def recording_receive() -> ASGIMessage:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    entry["body"] = _parse_body(b"".join(chunks))
            return message

        async def recording_send(message: ASGIMessage) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # stamped before the last body goes out: once it is sent, the client may act on it (and its next call
                # arrive) before this task runs again, which made "answered before the next call arrived" flaky
                entry["answered_ns"] = time.monotonic_ns()
            await send(message)

        await self._app(scope, recording_receive, recording_send)
