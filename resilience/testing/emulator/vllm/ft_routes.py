"""The fault-tolerance router of vLLM 0.33.0 (``vllm/entrypoints/serve/fault_tolerance/api_router.py``), mounted only
with ``--enable-fault-tolerance`` (``entrypoints/launchers/api_server/routers.py`` l.85-90), in or out of dev mode.

Each endpoint keeps its original's signature and answer bodies (line numbers below are that file's), so the
contract check can compare them by AST. The state behind them is ``fault_tolerance.py``'s.
"""

from __future__ import annotations

import json
import uuid
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, BackgroundTasks, Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..crash import vllm_log_line
from .fault_tolerance import FaultTolerance

__all__ = ["ALLOWED_INSTRUCTIONS", "ft_router"]

ALLOWED_INSTRUCTIONS = frozenset({"retry"})
"""``_ALLOWED_INSTRUCTIONS`` (l.20): 0.33.0 knows ``retry`` only."""


async def validate_json_request(raw_request: Request) -> None:
    """``serve/utils/api_utils.py`` l.309-315: a body that is not ``application/json`` is a validation error (400)."""
    media_type = raw_request.headers.get("content-type", "").lower().split(";", maxsplit=1)[0]
    if media_type != "application/json":
        raise RequestValidationError(errors=["Unsupported Media Type: Only 'application/json' is allowed"])


def _validate_payload(body: Any) -> tuple[str, dict[str, Any]]:
    """l.23-34, with its messages."""
    if not isinstance(body, dict):
        raise HTTPException(400, "Request body must be a JSON object.")
    instruction = body.get("instruction")
    if not instruction:
        raise HTTPException(400, "'instruction' is required.")
    if instruction not in ALLOWED_INSTRUCTIONS:
        raise HTTPException(400, f"Invalid instruction: '{instruction}'.")
    params = body.get("params", {})
    if not isinstance(params, dict):
        raise HTTPException(400, "'params' must be an object.")
    return instruction, params


def ft_router(ft: FaultTolerance) -> APIRouter:
    """``register_fault_tolerance_api_router``: the two routes, over one engine's sentinel."""
    router = APIRouter()

    def run_fault_recovery(instruction: str, request_id: str) -> None:
        """``_run_fault_recovery`` (l.76-90): a failed recovery is only logged."""
        success, reason = ft.handle(instruction, request_id)
        if not success:
            vllm_log_line("ERROR", "api_router.py", f"[FT] Recovery failed for request {request_id}: {reason}")

    @router.post("/fault_tolerance/apply", dependencies=[Depends(validate_json_request)])  # l.37
    async def process_fault_tolerance_instruction(raw_request: Request, background_tasks: BackgroundTasks) -> JSONResponse:
        try:
            body = await raw_request.json()
        except json.JSONDecodeError as e:
            raise HTTPException(400, "Invalid JSON format") from e
        instruction, _params = _validate_payload(body)
        request_id = str(uuid.uuid4())
        background_tasks.add_task(run_fault_recovery, instruction, request_id)  # l.65: answered first, recovered after
        return JSONResponse(
            status_code=HTTPStatus.ACCEPTED.value,
            content={"message": "Request accepted; poll /fault_tolerance/status for updates.", "request_id": request_id},
            background=background_tasks,
        )

    @router.get("/fault_tolerance/status")  # l.93
    async def get_status(raw_request: Request) -> JSONResponse:
        return JSONResponse(content=ft.answer())

    return router
