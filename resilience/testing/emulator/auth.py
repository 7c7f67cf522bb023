"""API keys as SGLang 0.5.23 (``sglang/srt/utils/auth.py``) and vLLM 0.33.0 (:class:`AuthenticationMiddleware`) check
them.

SGLang: each route has an auth level, set with :func:`auth_level` as SGLang does:

- ``NORMAL`` (the default): needs ``--api-key`` when one is configured, else open.
- ``ADMIN_OPTIONAL`` (pause, continue, flush, release, resume, weight updates, abort): needs ``--admin-api-key`` when
  one is configured (the API key is then *not* accepted), else ``--api-key`` when configured, else open.
- ``ADMIN_FORCE``: needs the admin key; without one configured it is 403 even with the API key. No route of SGLang
  0.5.23 has this level (``http_server.py`` checks the admin key by hand for its hicache routes instead), so neither
  does the emulator.

``/health*``, ``/ready*`` and ``/metrics*`` are always open (k8s probes, Prometheus), and so are the emulator's own
``/_emulator/*`` debug routes. A refusal is 401 ``{"error": "Unauthorized"}`` or 403 ``{"error": "Forbidden"}``. The
middleware is installed only when a key is configured, as in ``http_server.py``'s ``launch_server``.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any, TypeVar

from .record import ASGIApp, Receive, Scope, Send

__all__ = ["GUARDED_PREFIX", "ApiKeyMiddleware", "AuthLevel", "AuthenticationMiddleware", "auth_level", "decide_request_auth"]

F = TypeVar("F", bound=Callable[..., Any])

_OPEN_PREFIXES = ("/health", "/ready", "/metrics", "/_emulator/")


class AuthLevel(StrEnum):
    """Per-route auth level (SGLang's ``AuthLevel``)."""

    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"
    ADMIN_FORCE = "admin_force"


def auth_level(level: AuthLevel) -> Callable[[F], F]:
    """Mark an endpoint function with its auth level (stored as ``_auth_level``, as SGLang does)."""

    def decorator(func: F) -> F:
        func._auth_level = level  # type: ignore[attr-defined]
        return func

    return decorator


def _bearer_matches(authorization: str | None, expected: str) -> bool:
    if not authorization:
        return False
    parts = authorization.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return secrets.compare_digest(parts[1].encode(), expected.encode())


def decide_request_auth(
    *, method: str, path: str, authorization: str | None, api_key: str | None, admin_api_key: str | None, level: AuthLevel
) -> int | None:
    """None when the request may pass, else the status to refuse it with (401 or 403). SGLang's ``decide_request_auth``."""
    if method == "OPTIONS" or path.startswith(_OPEN_PREFIXES):
        return None
    if level is AuthLevel.ADMIN_FORCE:
        if not admin_api_key:
            return 403
        return None if _bearer_matches(authorization, admin_api_key) else 401
    if level is AuthLevel.ADMIN_OPTIONAL:
        expected = admin_api_key or api_key
        return None if expected is None or _bearer_matches(authorization, expected) else 401
    if api_key:
        return None if _bearer_matches(authorization, api_key) else 401
    return None


class ApiKeyMiddleware:
    """ASGI middleware that refuses requests without the key their route's level asks for.

    ``levels`` maps each route path to its level; a path not in it (an unknown route)
    is ``NORMAL``, as SGLang's route matcher answers for a request that matches nothing.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, admin_api_key: str | None, levels: Mapping[str, AuthLevel]) -> None:
        self._app = app
        self._api_key = api_key
        self._admin_api_key = admin_api_key
        self._levels = dict(levels)

    def __repr__(self) -> str:
        return "ApiKeyMiddleware(api_key=***, admin_api_key=***)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope.get("path", "")
        status = decide_request_auth(
            method=scope["method"],
            path=path,
            authorization=_authorization(scope),
            api_key=self._api_key,
            admin_api_key=self._admin_api_key,
            level=self._levels.get(path, AuthLevel.NORMAL),
        )
        if status is None:
            await self._app(scope, receive, send)
        else:
            await _refuse(send, status, "Unauthorized" if status == 401 else "Forbidden")


def _authorization(scope: Scope) -> str | None:
    return next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)


async def _refuse(send: Send, status: int, error: str) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps({"error": error}).encode()})


GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
"""vLLM's ``serve/middleware/authenticate.py`` l.11."""


class AuthenticationMiddleware:
    """vLLM 0.33.0's ``--api-key`` check (``serve/middleware/authenticate.py``): only some path prefixes are guarded.

    Paths starting with :data:`GUARDED_PREFIX` need ``Authorization: Bearer <key>`` (one of ``tokens``); every other
    path, the control routes (``/sleep``, ``/pause``, ``/update_weights``, ...) and ``/health`` included, is open even
    with a key set. OPTIONS always passes (l.48-54). A refusal is 401 ``{"error": "Unauthorized"}`` (l.60). Keys are
    compared as SHA-256 digests with ``secrets.compare_digest`` (l.28-45).
    """

    def __init__(self, app: ASGIApp, tokens: list[str]) -> None:
        self._app = app
        self._hashes = [hashlib.sha256(t.encode("utf-8")).digest() for t in tokens]

    def __repr__(self) -> str:
        return "AuthenticationMiddleware(tokens=***)"

    def _verify(self, scope: Scope) -> bool:
        scheme, _, param = (_authorization(scope) or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(param.encode("utf-8")).digest()
        match = False
        for expected in self._hashes:
            match |= secrets.compare_digest(digest, expected)
        return match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
        guarded = scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS" and path.startswith(GUARDED_PREFIX)
        if guarded and not self._verify(scope):
            await _refuse(send, 401, "Unauthorized")
        else:
            await self._app(scope, receive, send)
