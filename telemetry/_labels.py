"""Small, dependency-free helpers shared by the tracing and metrics observers.

Nothing here imports ``opentelemetry`` or ``prometheus_client``. Every helper
is meant to run once per *distinct* value (the observers cache the result),
never once per event.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = [
    "HTTP_METHODS",
    "OTHER",
    "scrub_engine",
    "scrub_message",
    "status_label",
    "transport_label",
    "url_template",
]

HTTP_METHODS: Final = frozenset({"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE"})
"""The methods OpenTelemetry's HTTP semantic conventions know; any other is reported as ``_OTHER``."""

OTHER: Final = "other"
"""The label value of endpoints and engines past a bound (``max_label_values``, ``max_engines``)."""

_USERINFO: Final = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")
_BEARER: Final = re.compile(r"(?i)\b(bearer|basic|token|apikey|api-key)(\s+|=|:\s*)[^\s,;'\"&]+")
_SECRET_PARAM: Final = re.compile(
    r"(?i)([?&;]|\b)((?:api[_-]?key|access[_-]?token|token|secret|password|passwd|auth|authorization|key|sig|signature)=)[^&\s'\"]+"
)
_AUTH_HEADER: Final = re.compile(r"(?i)\b(authorization|x-api-key|api-key|cookie|set-cookie)(['\"]?\s*[:=]\s*['\"]?)[^'\",}\n]+")
_MAX_MESSAGE: Final = 512


def scrub_engine(engine: str) -> str:
    """Return ``engine`` (``scheme://host:port``) without any ``user:password@`` part."""
    if "@" not in engine:
        return engine
    return _USERINFO.sub(r"\g<scheme>", engine)


def scrub_message(message: str) -> str:
    """Redact URL user-info, auth headers, bearer tokens and secret-looking query values; cap the length.

    Used for the free-text failure messages of barrier phases, the only free
    text an event carries. The result is at most 512 characters.
    """
    text = _USERINFO.sub(r"\g<scheme>", message)
    text = _AUTH_HEADER.sub(r"\1\2[REDACTED]", text)
    text = _BEARER.sub(r"\1\2[REDACTED]", text)
    text = _SECRET_PARAM.sub(r"\1\2[REDACTED]", text)
    if len(text) > _MAX_MESSAGE:
        text = text[: _MAX_MESSAGE - 3] + "..."
    return text


def url_template(endpoint: str) -> str | None:
    """The path template of a policy endpoint (``"POST /flush_cache"`` -> ``"/flush_cache"``), or None.

    Endpoints that are not ``METHOD /path`` (a default-policy label, say)
    have no template, and ``url.template`` is then omitted.
    """
    _, sep, path = endpoint.partition(" ")
    if sep and path.startswith("/"):
        return path
    if endpoint.startswith("/"):
        return endpoint
    return None


_TIMEOUT_WORDS: Final = ("timeout", "timedout")
_RESET_WORDS: Final = ("reset", "disconnect", "aborted", "chunked", "protocol", "closed", "brokenpipe", "incomplete")


def transport_label(error_type: str | None, *, sent: bool, ambiguous: bool) -> str:
    """Map a failed attempt without a response to a bounded status label.

    ``connect_error`` when the request surely never reached the server,
    ``read_timeout`` for a timeout after sending, ``connection_reset`` for a
    connection that dropped after sending (or any other ambiguous failure),
    ``error`` for anything else.
    """
    if not sent:
        return "connect_error"
    name = (error_type or "").lower()
    if any(w in name for w in _TIMEOUT_WORDS):
        return "read_timeout"
    if ambiguous or any(w in name for w in _RESET_WORDS):
        return "connection_reset"
    return "error"


def status_label(status: int) -> str:
    """The status as a string (``"502"``); values outside 100-599 become ``"invalid"`` so the label stays bounded."""
    if 100 <= status <= 599:
        return str(status)
    return "invalid"
