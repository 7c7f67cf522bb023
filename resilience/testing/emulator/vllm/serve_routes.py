"""The always-mounted routes: ``/health``, ``/version``, ``/v1/models``, ``/v1/completions``, and the debug routes.

- ``/health`` (``serve/instrumentator/health.py`` l.22): 200 with an empty body, also while paused or asleep; 503 only
  for a dead engine, which the emulator never is (its death ends the process).
- ``/version`` (``serve/instrumentator/basic.py`` l.53): ``{"version": "0.33.0"}``.
- ``/v1/completions``: the OpenAI completion, non-streaming. Its text comes from the weights the engine holds
  (``text.py``). An abort answers 200 with ``finish_reason: "abort"``; during an abort/wait pause a new request is 503
  ``ServiceUnavailableError`` (``v1/engine/core.py`` l.1796); during a keep pause or a sleep it waits in the queue.
- ``/_emulator/state`` and ``/_emulator/record`` (the emulator's own, never behind a key).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ..errors import error_body
from ..record import CallRecord
from .config import VLLM_VERSION
from .core import EngineCore
from .text import count_tokens

__all__ = ["CompletionRequest", "debug_router", "serve_router"]


class CompletionRequest(BaseModel):
    """The part of ``CompletionRequest`` (``entrypoints/openai/completion/protocol.py``) the emulator models."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[str]
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False


def serve_router(core: EngineCore) -> APIRouter:
    """``/health``, ``/version``, ``/v1/models``, ``/v1/completions``."""
    router = APIRouter()
    config = core.config

    @router.get("/health", response_class=Response)
    async def health(raw_request: Request) -> Response:
        return Response(status_code=200)

    @router.get("/version")
    async def show_version() -> JSONResponse:
        return JSONResponse(content={"version": VLLM_VERSION})

    @router.get("/v1/models")
    async def show_available_models() -> JSONResponse:
        card = {"id": config.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": config.served_model_name, "parent": None, "max_model_len": 4096}  # fmt: skip
        return JSONResponse(content={"object": "list", "data": [card]})

    @router.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> JSONResponse:
        if request.model is not None and request.model != config.served_model_name:
            body = error_body(f"The model `{request.model}` does not exist.", "NotFoundError", 404, "model")
            return JSONResponse(body, status_code=404)
        if request.stream:
            return JSONResponse(error_body("stream=true is not emulated", "BadRequestError", 400, "stream"), status_code=400)
        prompts = [request.prompt] if isinstance(request.prompt, str) else list(request.prompt)
        if not prompts:
            return JSONResponse(error_body("prompt must not be empty", "BadRequestError", 400, "prompt"), status_code=400)
        base = raw_request.headers.get("X-Request-Id") or uuid.uuid4().hex
        max_tokens = request.max_tokens or config.default_max_tokens
        engine_requests = [core.add_request(p, max_tokens, f"{base}-{i}" if len(prompts) > 1 else base) for i, p in enumerate(prompts)]
        choices: list[dict[str, Any]] = []
        for index, engine_request in enumerate(engine_requests):
            reason = await engine_request.done
            choices.append({"index": index, "text": "".join(engine_request.tokens), "logprobs": None, "finish_reason": reason,
                            "stop_reason": None, "prompt_logprobs": None})  # fmt: skip
        prompt_tokens = sum(count_tokens(p) for p in prompts)
        completion_tokens = sum(len(r.tokens) for r in engine_requests)
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens, "completion_tokens": completion_tokens}
        body = {"id": f"cmpl-{base}", "object": "text_completion", "created": int(time.time()), "model": config.served_model_name,
                "choices": choices, "usage": usage}  # fmt: skip
        return JSONResponse(content=body)

    return router


def debug_router(core: EngineCore, record: CallRecord, dev_mode: bool) -> APIRouter:
    """``GET /_emulator/state``, ``GET /_emulator/record`` and ``POST /_emulator/fault`` (not vLLM's)."""
    router = APIRouter()

    def state() -> dict[str, Any]:
        return {"pid": os.getpid(), "version": VLLM_VERSION, "engine": "vllm", "dev_mode": dev_mode,
                "sleep_mode": core.config.enable_sleep_mode, **core.state()}  # fmt: skip

    @router.get("/_emulator/state")
    async def emulator_state() -> JSONResponse:
        return JSONResponse(state())

    @router.post("/_emulator/fault")
    async def emulator_fault(error_type: str = "RuntimeError") -> JSONResponse:
        """The busy loop raises ``error_type`` now (``EngineCore.fault``): without fault tolerance the engine dies."""
        core.fault(error_type)
        return JSONResponse(state())

    @router.get("/_emulator/record")
    async def emulator_record() -> JSONResponse:
        return JSONResponse({"calls": record.calls(), "dropped": record.dropped, "state": state()})

    return router
