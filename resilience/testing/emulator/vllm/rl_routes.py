"""The RL router of vLLM 0.33.0 (``vllm/entrypoints/rl/online/api_router.py``), mounted only in dev mode.

Each endpoint keeps its original's signature and answer bodies (line numbers below
are that file's), so the contract check can compare them by AST.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, HTTPException, Query, Request
from fastapi.responses import JSONResponse

from .core import EngineCore, PauseMode

__all__ = ["engine_core_gate", "rl_router"]

_NO_CORE_CALL = frozenset({"/abort_requests", "/get_world_size", "/server_info"})
"""Routes that answer without waiting for the EngineCore: an abort is sent without a reply
(``AsyncLLM.abort``), the world size and the server info are read from the config."""


def engine_core_gate(core: EngineCore) -> Callable[[Request], Awaitable[None]]:
    """A router dependency: a route that needs the EngineCore waits forever once the core is wedged (``core.py``)."""

    async def gate(request: Request) -> None:
        if request.url.path not in _NO_CORE_CALL:
            await core.utility_gate()

    return gate


WeightTransferUpdatePayload = dict[str, Any] | list[dict[str, Any]]
"""``vllm/distributed/weight_transfer/base.py``: backend-specific update info, or one per global worker rank."""


def rl_router(core: EngineCore) -> APIRouter:
    """``register_rl_api_routers`` (``rl/factories.py``): the one RL router."""
    router = APIRouter(dependencies=[Depends(engine_core_gate(core))])

    @router.post("/pause")  # l.31
    async def pause_generation(
        raw_request: Request, mode: Annotated[PauseMode, Query()] = "abort", clear_cache: Annotated[bool, Query()] = True
    ) -> JSONResponse:
        try:
            await core.pause_generation(mode=mode, clear_cache=clear_cache)
            return JSONResponse(content={"status": "paused"}, status_code=HTTPStatus.OK.value)
        except ValueError as err:  # l.65-69
            return JSONResponse(content={"error": str(err)}, status_code=HTTPStatus.BAD_REQUEST.value)

    @router.post("/resume")  # l.78
    async def resume_generation(raw_request: Request) -> JSONResponse:
        core.resume_scheduler()
        return JSONResponse(content={"status": "resumed"}, status_code=HTTPStatus.OK.value)

    @router.post("/abort_requests")  # l.97
    async def abort_requests(raw_request: Request) -> JSONResponse:
        try:
            body = await raw_request.json()
        except json.JSONDecodeError as e:
            raise HTTPException(status_code=400, detail="Invalid JSON format") from e
        if not isinstance(body, dict):
            raise HTTPException(status_code=400, detail="Request body must be a JSON object")
        request_ids = body.get("request_ids")
        if request_ids:
            core.abort(str(r) for r in request_ids)
        else:
            request_ids = core.abort(None)
        # l.134: the count of ids asked for (or tracked), not of requests found
        return JSONResponse(content={"status": "aborted", "aborted": len(request_ids)}, status_code=HTTPStatus.OK.value)

    @router.get("/is_paused")  # l.145
    async def is_paused(raw_request: Request) -> JSONResponse:
        return JSONResponse(content={"is_paused": core.is_paused()})

    @router.post("/init_weight_transfer_engine")  # l.162
    async def init_weight_transfer_engine(raw_request: Request, init_info: Annotated[dict[str, Any], Body(embed=True)]) -> JSONResponse:
        core.init_weight_transfer_engine(init_info)
        return JSONResponse(content={"message": "Weight transfer initialized"})

    @router.post("/shutdown_weight_transfer_engine")  # l.174
    async def shutdown_weight_transfer_engine(raw_request: Request) -> JSONResponse:
        core.shutdown_weight_transfer_engine()
        return JSONResponse(content={"message": "Weight transfer shut down"})

    @router.post("/start_weight_update")  # l.181
    async def start_weight_update(raw_request: Request) -> JSONResponse:
        core.start_weight_update()
        return JSONResponse(content={"message": "Weight update started"})

    @router.post("/start_draft_weight_update")  # l.188
    async def start_draft_weight_update(raw_request: Request) -> JSONResponse:
        core.start_weight_update(draft=True)
        return JSONResponse(content={"message": "Draft weight update started"})

    @router.post("/update_weights")  # l.195
    async def update_weights(raw_request: Request, update_info: Annotated[WeightTransferUpdatePayload, Body(embed=True)]) -> JSONResponse:
        core.update_weights(update_info)
        await core.utility_gate()  # a re-sent chunk wedged the core: this call never answers
        return JSONResponse(content={"message": "Weights updated"})

    @router.post("/finish_weight_update")  # l.207
    async def finish_weight_update(raw_request: Request, weight_version: Annotated[str | None, Body(embed=True)] = None) -> JSONResponse:
        core.finish_weight_update(weight_version)
        return JSONResponse(content={"message": "Weight update finished"})

    @router.post("/update_weight_version")  # l.217
    async def update_weight_version(raw_request: Request, new_version: Annotated[str, Body(embed=True)]) -> JSONResponse:
        core.update_weight_version(new_version)
        return JSONResponse(content={"success": True, "new_version": new_version})

    @router.get("/weight_info")  # l.226
    async def weight_info(raw_request: Request) -> JSONResponse:
        return JSONResponse(content={"weight_version": core.weight_version})

    @router.post("/weight_checker")  # l.232
    async def weight_checker(
        raw_request: Request,
        action: Annotated[Literal["checksum", "reset", "compare"], Body(embed=True)],
        baseline: Annotated[dict[str, str] | None, Body(embed=True)] = None,
    ) -> JSONResponse:
        if action == "reset":
            core.zero_weights()  # l.240-242: collective_rpc("reset_weights") zeroes every weight (gpu_worker.py l.393)
            return JSONResponse(content={"status": "reset"})
        if action == "compare" and baseline is None:
            raise HTTPException(status_code=HTTPStatus.BAD_REQUEST.value, detail="action='compare' requires a 'baseline' object")
        checksums = core.weight_checksums()
        if action == "checksum":
            return JSONResponse(content={"checksums": checksums})
        assert baseline is not None
        mismatches = sorted(key for key in checksums.keys() | baseline.keys() if checksums.get(key) != baseline.get(key))
        return JSONResponse(content={"match": not mismatches, "mismatches": mismatches})

    @router.get("/get_world_size")  # l.269
    async def get_world_size(raw_request: Request, include_dp: bool = Query(True)) -> JSONResponse:
        world_size = 1  # one worker, no data parallelism: TP * PP (* DP) = 1 either way (l.285-288)
        return JSONResponse(content={"world_size": world_size})

    return router
