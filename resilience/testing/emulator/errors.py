"""The engines' error bodies and exception handlers: SGLang 0.5.23's and vLLM 0.33.0's.

SGLang: an HTTPException is an error object, a validation error 400 (not FastAPI's 422), and a route's own failure
``_create_error_response``'s 400 ``{"error": {"message": ...}}``.

vLLM (``vllm/entrypoints/serve/exception_handling/``): every error is ``{"error": {"message", "type", "param",
"code"}}`` (``ErrorResponse``, ``serve/engine/protocol.py`` l.79-87): a FastAPI ``HTTPException`` keeps its status
with the status phrase as type (``handlers/http.py``); a validation error is **400** (``handlers/validation.py``
l.149); ``ValueError``/``TypeError`` are 400 ``BadRequestError``, any other exception 500 ``InternalServerError``
(``error_response.py`` l.80-96).

For both, Starlette's own 404/405 for an unknown route keep ``{"detail": ...}``: the handler is registered for
FastAPI's subclass only (vLLM's ``register.py`` l.27), so with vLLM's dev mode off a control route is a plain 404.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .vllm.core import EnginePausedError, UtilityError

__all__ = ["error_body", "error_response", "install_exception_handlers", "install_vllm_exception_handlers"]


def error_response(exc: BaseException | str) -> JSONResponse:
    """SGLang's ``_create_error_response``: 400 ``{"error": {"message": ...}}``."""
    return JSONResponse({"error": {"message": str(exc)}}, status_code=HTTPStatus.BAD_REQUEST)


def _sglang_body(message: Any, type_: str, code: int) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": type_, "param": None, "code": code}


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return JSONResponse(_sglang_body(exc.detail, str(exc.status_code), exc.status_code), status_code=exc.status_code)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    exc_str = str(exc)
    errors_str = str(exc.errors())
    message = f"{exc_str} {errors_str}" if errors_str and errors_str != exc_str else exc_str
    body = _sglang_body(message, HTTPStatus.BAD_REQUEST.phrase, HTTPStatus.BAD_REQUEST.value)
    return JSONResponse(body, status_code=HTTPStatus.BAD_REQUEST)


def install_exception_handlers(app: FastAPI) -> None:
    """Install SGLang's handlers: FastAPI HTTPException -> error object; RequestValidationError -> 400."""
    app.add_exception_handler(HTTPException, _http_exception)
    app.add_exception_handler(RequestValidationError, _validation_error)


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse(error=ErrorInfo(...)).model_dump()``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def _vllm_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    phrase = HTTPStatus(exc.status_code).phrase
    return JSONResponse(error_body(str(exc.detail), phrase, exc.status_code), status_code=exc.status_code)


async def _vllm_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {_format_error(e)}\n" for e in errors[:10])
    first = errors[0] if errors else None
    param = ".".join(str(p) for p in first.get("loc", ())) if isinstance(first, dict) else None
    return JSONResponse(error_body(message.rstrip(), "BadRequestError", 400, param), status_code=400)


def _format_error(e: object) -> str:
    """One error of the message; a plain string (``validate_json_request``'s) as it is (``handlers/validation.py`` _format_error)."""
    if not isinstance(e, dict):
        return str(e)
    return f"{{'type': {e.get('type')!r}, 'loc': {'.'.join(str(p) for p in e.get('loc', ()))!r}, 'msg': {e.get('msg')!r}}}"


async def _vllm_exception(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, EnginePausedError):  # RetryableRequestError -> 503 ServiceUnavailableError (error_response.py l.60-67)
        return JSONResponse(error_body(str(exc), "ServiceUnavailableError", 503), status_code=503)
    if isinstance(exc, ValueError | TypeError | OverflowError):
        return JSONResponse(error_body(str(exc), "BadRequestError", 400), status_code=400)
    return JSONResponse(error_body(str(exc), "InternalServerError", 500), status_code=500)


def install_vllm_exception_handlers(app: FastAPI) -> None:
    """The handlers of vLLM's ``init_exception_handler`` (``register.py`` l.26-42)."""
    app.add_exception_handler(HTTPException, _vllm_http_exception)
    app.add_exception_handler(RequestValidationError, _vllm_validation_error)
    # the engine's own errors by class, so they stay in ExceptionMiddleware (no re-raise, no traceback in the log)
    for exc_type in (EnginePausedError, UtilityError, ValueError, TypeError, OverflowError, Exception):
        app.add_exception_handler(exc_type, _vllm_exception)
