"""``EngineAnswerError``: an engine's HTTP answer that is an error, naming engine, endpoint, status and a body excerpt.

The base of the SGLang clients' ``SGLangError`` and the vLLM clients' ``VLLMError``: one message format, one delivery
record (``attempts``, read by ``resilience.outcome.attempts_of``) and one pickling rule for both engine kinds.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Self

import requests

from resilience.outcome import AttemptRecord, attempts_of

if TYPE_CHECKING:
    from resilience.adapters.engine_http import Answer

__all__ = ["EXCERPT_CHARS", "EngineAnswerError", "excerpt", "parse_object"]

EXCERPT_CHARS = 200
"""How much of a body an error message shows."""


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """A one-line, bounded excerpt of a response body."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def parse_object(text: str) -> dict[str, Any] | None:
    """``text`` parsed as a JSON object; None when it is not JSON, or JSON but not an object."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


class EngineAnswerError(requests.exceptions.RequestException):
    """An engine's endpoint answered with an error, or with an answer its API does not promise.

    ``engine``, ``endpoint`` (``"POST /sleep"``), ``status`` (None = no answer, or nothing was sent) and
    ``body_excerpt`` (at most ``EXCERPT_CHARS`` characters) are attributes and in the message; ``detail`` adds a
    few words after the status. ``attempts``: the call's delivery record: the transport's, else read from
    ``response=``, else empty. Survives pickling (Ray and multiprocessing ship errors pickled).
    """

    def __init__(
        self, engine: str, endpoint: str, status: int | None, body: str, *, detail: str = "", attempts: tuple[AttemptRecord, ...] = (),
        **kwargs: Any
    ) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.status = status
        self.body_excerpt = excerpt(body)
        what = (f"HTTP {status}" + (f": {detail}" if detail else "")) if status is not None else (detail or "no response")
        super().__init__(f"{engine} {endpoint}: {what}; body: {self.body_excerpt!r}", **kwargs)
        self.attempts = attempts or _response_attempts(self.response)

    @classmethod
    def of(cls, engine: str, answer: Answer, detail: str = "", *, body: str | None = None, **kwargs: Any) -> Self:
        """The error for ``answer``: its endpoint, status, body (or ``body``), response and delivery record."""
        text = answer.text if body is None else body
        kwargs.update({"detail": detail} if detail else {})  # a class that words its own detail (SGLangAuthError) takes none
        return cls(engine, answer.endpoint, answer.status, text, response=answer.response, attempts=answer.records, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuild from the message and attributes (Ray and multiprocessing ship errors pickled)."""
        return (_rebuild_error, (type(self), self.args, self.__dict__))


def _response_attempts(response: object) -> tuple[AttemptRecord, ...]:
    """The record a driver put on ``response`` (requests, aiohttp: ``.attempts``; httpx: ``.extensions``), else ()."""
    if response is None:
        return ()
    holder = Exception()
    holder.response = response  # type: ignore[attr-defined]  # where attempts_of looks for a response
    return attempts_of(holder) or ()


def _rebuild_error(cls: type[EngineAnswerError], args: tuple[Any, ...], state: dict[str, Any]) -> EngineAnswerError:
    err = cls.__new__(cls)
    requests.exceptions.RequestException.__init__(err, *args)
    err.__dict__.update(state)
    return err
