"""The dev routers of vLLM 0.33.0, mounted only in dev mode: sleep, cache, rpc, server_info.

Each endpoint keeps the signature of its original (route, method, parameters, defaults, constraints), so the contract
check (``tests/testing/vllm_contract.py``) can compare them by AST: ``vllm/entrypoints/serve/dev/sleep/api_router.py``,
``dev/cache/api_router.py``, ``dev/rpc/api_router.py`` (``/collective_rpc``) and ``dev/server_info/api_router.py``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from http import HTTPStatus
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response

from .core import EngineCore, PauseMode, UtilityError
from .rl_routes import engine_core_gate

__all__ = ["dev_routers"]


def sleep_router(core: EngineCore) -> APIRouter:
    """``serve/dev/sleep/api_router.py``."""
    router = APIRouter(dependencies=[Depends(engine_core_gate(core))])

    @router.post("/sleep")  # l.26
    async def sleep(
        raw_request: Request, level: Annotated[int, Query(ge=0, le=2)] = 1, mode: Annotated[PauseMode, Query()] = "abort"
    ) -> JSONResponse:
        await core.sleep(level, mode)
        return JSONResponse(content={"status": "sleeping", "level": level})  # l.34

    @router.post("/release_kv_cache_memory")  # l.37
    async def release_kv_cache_memory(raw_request: Request) -> JSONResponse:
        core.release_kv_cache_memory()
        return JSONResponse(content={"status": "kv_cache_released"})

    @router.post("/wake_up")  # l.44
    async def wake_up(raw_request: Request) -> JSONResponse:
        tags: list[str] | None = raw_request.query_params.getlist("tags")
        if tags == []:
            tags = None  # l.47-49: no tags = wake everything
        fully_awake = core.wake_up(tags)
        return JSONResponse(content={"status": "awake" if fully_awake else "sleeping", "tags": tags})  # l.53-55

    @router.get("/is_sleeping")  # l.58
    async def is_sleeping(raw_request: Request) -> JSONResponse:
        return JSONResponse(content={"is_sleeping": core.is_sleeping()})

    return router


def cache_router(core: EngineCore) -> APIRouter:
    """``serve/dev/cache/api_router.py``."""
    router = APIRouter(dependencies=[Depends(engine_core_gate(core))])

    @router.post("/reset_prefix_cache")  # l.20
    async def reset_prefix_cache(
        raw_request: Request, reset_running_requests: bool = Query(default=False), reset_external: bool = Query(default=False)
    ) -> JSONResponse:
        success = core.reset_prefix_cache(reset_running_requests)  # no connector: reset_external changes nothing
        return JSONResponse(content={"success": bool(success)})  # l.44: false while blocks are held

    @router.post("/reset_mm_cache")  # l.47
    async def reset_mm_cache(raw_request: Request) -> Response:
        return Response(status_code=200)

    @router.post("/reset_encoder_cache")  # l.57
    async def reset_encoder_cache(raw_request: Request) -> Response:
        return Response(status_code=200)

    return router


def rpc_router(core: EngineCore) -> APIRouter:
    """``serve/dev/rpc/api_router.py`` (``/collective_rpc``, l.23-59); the emulator knows a few worker methods."""
    router = APIRouter(dependencies=[Depends(engine_core_gate(core))])

    @router.post("/collective_rpc")
    async def collective_rpc(raw_request: Request) -> Response:
        try:
            body = await raw_request.json()
        except json.JSONDecodeError as e:
            raise HTTPException(status_code=HTTPStatus.BAD_REQUEST.value, detail=f"JSON decode error: {e}") from e
        if not isinstance(body, dict):
            raise HTTPException(status_code=HTTPStatus.BAD_REQUEST.value, detail="Request body must be a JSON object")
        method = body.get("method")
        if method is None:
            raise HTTPException(status_code=HTTPStatus.BAD_REQUEST.value, detail="Missing 'method' in request body")
        # only serialized strings are passed (l.43-47); the emulated worker methods take none
        args: list[str] = body.get("args", [])
        kwargs: dict[str, str] = body.get("kwargs", {})
        timeout: float | None = body.get("timeout")
        results = _run_worker_method(core, str(method), args, kwargs, timeout)
        return JSONResponse(content={"results": results})

    return router


def _run_worker_method(core: EngineCore, method: str, args: list[str], kwargs: dict[str, str], timeout: float | None) -> list[Any]:
    """One result per worker (one worker here); unknown method names fail as vLLM's would.

    ``reload_weights`` loads the checkpoint again, ``reset_weights`` zeroes the weights (``gpu_worker.py`` l.393),
    ``compute_weight_checksums`` answers the checksums; ``synchronize_device`` and the cache resets do nothing here.
    """
    if method == "reload_weights":
        core.reload_weights()
    elif method == "reset_weights":
        core.zero_weights()
    elif method == "compute_weight_checksums":
        return [core.weight_checksums()]
    elif method not in ("synchronize_device", "reset_mm_cache", "reset_encoder_cache"):
        raise UtilityError("collective_rpc", f"'Worker' object has no attribute '{method}'")
    return [None]


def server_info_router(core: EngineCore) -> APIRouter:
    """``serve/dev/server_info/api_router.py`` (l.43)."""
    router = APIRouter(dependencies=[Depends(engine_core_gate(core))])

    @router.get("/server_info")
    async def show_server_info(raw_request: Request, config_format: Annotated[Literal["text", "json"], Query()] = "text") -> JSONResponse:
        config = core.config
        as_json = {
            "model_config": {"model": config.served_model_name, "enable_sleep_mode": config.enable_sleep_mode},
            "scheduler_config": {"max_num_seqs": config.max_num_seqs},
            "weight_transfer_config": None if config.weight_transfer_backend is None else {"backend": config.weight_transfer_backend},
        }
        server_info = {
            "vllm_config": str(as_json) if config_format == "text" else as_json,
            # l.30: the env dump leaves out every name with KEY in it
            "vllm_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_") and "KEY" not in k},
            "system_env": {"os": platform.platform(), "python_version": sys.version.split()[0]},
        }
        return JSONResponse(content=server_info)

    return router


def dev_routers(core: EngineCore) -> list[APIRouter]:
    """``register_vllm_dev_api_routers`` (``serve/__init__.py`` l.43-65): cache, rpc, server_info, sleep."""
    return [cache_router(core), rpc_router(core), server_info_router(core), sleep_router(core)]
