"""``/generate``: single or batch, plain JSON or SSE streaming, validated as SGLang does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .bodies import SAMPLING_PARAM_KEYS, GenerateReqInput
from .errors import error_response
from .frontend import Frontend, NewRequest

if TYPE_CHECKING:
    from .app import Engine

__all__ = ["generate_router"]


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _sampling(params: dict[str, Any] | None) -> dict[str, Any]:
    params = params or {}
    unknown = sorted(set(params) - SAMPLING_PARAM_KEYS)
    if unknown:
        raise ValueError(f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'")
    return params


def normalize(front: Frontend, obj: GenerateReqInput) -> tuple[bool, list[NewRequest]]:
    """Split a GenerateReqInput into validated single requests; returns (is_batch, requests)."""
    if obj.text is None and obj.input_ids is None:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    if obj.text is not None and obj.input_ids is not None:
        raise ValueError("Either text or input_ids should be provided, not both.")
    prompts: list[tuple[list[int] | None, str | None]]
    if isinstance(obj.text, list):
        prompts, is_batch = [(None, t) for t in obj.text], True
    elif isinstance(obj.text, str):
        prompts, is_batch = [(None, obj.text)], False
    elif obj.input_ids and isinstance(obj.input_ids[0], list):
        prompts, is_batch = [(list(ids), None) for ids in obj.input_ids if isinstance(ids, list)], True
    else:
        prompts, is_batch = [([i for i in obj.input_ids or [] if isinstance(i, int)], None)], False
    if is_batch and not prompts:
        raise ValueError("The batch is empty.")
    n = len(prompts)
    if isinstance(obj.sampling_params, list):
        if len(obj.sampling_params) != n:
            raise ValueError("The length of sampling_params must match the batch size.")
        samplings = [_sampling(p) for p in obj.sampling_params]
    else:
        samplings = [_sampling(obj.sampling_params)] * n
    if isinstance(obj.rid, list):
        if len(obj.rid) != n:
            raise ValueError("The specified rids length mismatch with the batch_size for batch processing.")
        rids: list[str | None] = list(obj.rid)
    elif obj.rid is not None and is_batch:
        raise ValueError("The rid should be a list for batch processing.")
    else:
        rids = [obj.rid] * n
    requests = [
        front.new_request(ids, text, sampling, rid, obj.stream) for (ids, text), sampling, rid in zip(prompts, samplings, rids, strict=True)
    ]
    return is_batch, requests


def generate_router(engine: Engine) -> APIRouter:
    """The ``/generate`` route, bound to ``engine``."""
    router = APIRouter()
    front = engine.frontend

    async def run_one(request: NewRequest, http: Request) -> dict[str, Any]:
        last: dict[str, Any] = {}
        async with aclosing(front.generate(request, http.is_disconnected)) as outputs:
            async for out in outputs:
                last = out
        return last

    async def stream(obj: GenerateReqInput) -> AsyncIterator[bytes]:
        try:
            is_batch, requests = normalize(front, obj)
            if is_batch:
                raise ValueError("The emulator does not stream batch requests; send them one by one.")
            async with aclosing(front.generate(requests[0])) as outputs:
                async for out in outputs:
                    yield b"data: " + _dumps(out) + b"\n\n"
        except ValueError as exc:
            yield b"data: " + _dumps({"error": {"message": str(exc)}}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    @router.api_route("/generate", methods=["POST", "PUT"])
    async def generate(obj: GenerateReqInput, http: Request) -> Response:
        if obj.stream:
            return StreamingResponse(stream(obj), media_type="text/event-stream")
        try:
            is_batch, requests = normalize(front, obj)
            results = await asyncio.gather(*(run_one(r, http) for r in requests))
        except ValueError as exc:
            return error_response(exc)
        return JSONResponse(results if is_batch else results[0])

    return router
