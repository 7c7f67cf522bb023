"""vLLM 0.33.0's ``--api-key`` check (``serve/middleware/authenticate.py``): only some path prefixes are guarded.

Paths starting with ``/v1``, ``/v2``, ``/inference`` or ``/cohere`` (``GUARDED_PREFIX``,
l.11) need ``Authorization: Bearer <key>``; every other path, the control routes
(``/sleep``, ``/pause``, ``/update_weights``, ...) and ``/health`` included, is open even
with a key set. OPTIONS always passes (l.48-54). A refusal is 401 ``{"error": "Unauthorized"}``
(l.60). Keys are compared as SHA-256 digests with ``secrets.compare_digest`` (l.28-45).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["GUARDED_PREFIX", "AuthenticationMiddleware"]

GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
"""``authenticate.py`` l.11."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class AuthenticationMiddleware:
    """Pure ASGI middleware: a guarded path without one of ``tokens`` as Bearer answers 401."""

    def __init__(self, app: ASGIApp, tokens: list[str]) -> None:
        self._app = app
        self._hashes = [hashlib.sha256(t.encode("utf-8")).digest() for t in tokens]

    def __repr__(self) -> str:
        return "AuthenticationMiddleware(tokens=***)"

    def _verify(self, scope: Scope) -> bool:
        value = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if not value:
            return False
        scheme, _, param = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(param.encode("utf-8")).digest()
        match = False
        for expected in self._hashes:
            match |= secrets.compare_digest(digest, expected)
        return match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self._app(scope, receive, send)
            return
        path = str(scope["path"]).removeprefix(str(scope.get("root_path", "")))
        if path.startswith(GUARDED_PREFIX) and not self._verify(scope):
            body = json.dumps({"error": "Unauthorized"}).encode()
            await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self._app(scope, receive, send)
