"""The server-side record of control calls, kept by a pure ASGI middleware.

Each call gets an entry when its request arrives and is completed when its answer
has been written. Times are ``time.monotonic_ns()``, which is system-wide on Linux,
so tests can order the calls of several engine processes against their own clock.
``/generate`` (data plane) and ``/_emulator/*`` (the record itself) are not recorded.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["CallRecord", "RecordMiddleware"]

Scope = MutableMapping[str, Any]
ASGIMessage = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[ASGIMessage]]
Send = Callable[[ASGIMessage], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_UNRECORDED_PATHS = ("/generate",)
_UNRECORDED_PREFIX = "/_emulator/"


class CallRecord:
    """Every control call this engine received, in arrival order."""

    def __init__(self) -> None:
        self._calls: list[dict[str, Any]] = []

    def begin(self, method: str, path: str, query: str) -> dict[str, Any]:
        """Add the entry of a call that just arrived; the caller fills body, status and answered_ns."""
        entry: dict[str, Any] = {
            "seq": len(self._calls),
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
    """ASGI middleware that writes each recorded call into a :class:`CallRecord`."""

    def __init__(self, app: ASGIApp, record: CallRecord) -> None:
        self._app = app
        self._record = record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in _UNRECORDED_PATHS or path.startswith(_UNRECORDED_PREFIX):
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
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                entry["answered_ns"] = time.monotonic_ns()

        await self._app(scope, recording_receive, recording_send)
