"""SGLang's error bodies and its two exception handlers (validation errors are 400, not 422)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

__all__ = ["error_response", "install_exception_handlers"]


def error_response(exc: BaseException | str) -> JSONResponse:
    """SGLang's ``_create_error_response``: 400 ``{"error": {"message": ...}}``."""
    return JSONResponse({"error": {"message": str(exc)}}, status_code=HTTPStatus.BAD_REQUEST)


def _error_body(message: Any, type_: str, code: int) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": type_, "param": None, "code": code}


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return JSONResponse(_error_body(exc.detail, str(exc.status_code), exc.status_code), status_code=exc.status_code)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    exc_str = str(exc)
    errors_str = str(exc.errors())
    message = f"{exc_str} {errors_str}" if errors_str and errors_str != exc_str else exc_str
    body = _error_body(message, HTTPStatus.BAD_REQUEST.phrase, HTTPStatus.BAD_REQUEST.value)
    return JSONResponse(body, status_code=HTTPStatus.BAD_REQUEST)


def install_exception_handlers(app: FastAPI) -> None:
    """Install SGLang's handlers: FastAPI HTTPException -> error object; RequestValidationError -> 400.

    Starlette's own 404/405 (unknown route) keep ``{"detail": ...}``, as in SGLang,
    because the handler is registered for FastAPI's subclass only.
    """
    app.add_exception_handler(HTTPException, _http_exception)
    app.add_exception_handler(RequestValidationError, _validation_error)
