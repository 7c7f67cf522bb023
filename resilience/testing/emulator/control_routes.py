"""The control endpoints: pause/continue, flush, memory occupation, weight updates, abort."""

from __future__ import annotations

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response

from .bodies import (
    AbortReq,
    BeginWeightUpdateReqInput,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    EndWeightUpdateReqInput,
    InitWeightsUpdateGroupReqInput,
    MemoryOccupationReqInput,
    PauseGenerationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)
from .engine import Engine
from .errors import error_response
from .pools import ALL_TAGS

__all__ = ["control_router"]

_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def _tags(body: MemoryOccupationReqInput) -> tuple[str, ...]:
    """null or [] means every tag; an unknown tag is refused before it reaches the scheduler."""
    if not body.tags:
        return ALL_TAGS
    unknown = [t for t in body.tags if t not in ALL_TAGS]
    if unknown:
        raise ValueError(f"Unknown memory tags {unknown}; known tags: {list(ALL_TAGS)}")
    return tuple(body.tags)


def _result(success: bool, message: str, **extra: object) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


def control_router(engine: Engine) -> APIRouter:
    """Routes that change the engine's state, bound to ``engine``."""
    router = APIRouter()
    front = engine.frontend

    @router.post("/pause_generation")
    async def pause_generation(obj: PauseGenerationReqInput) -> Response:
        await front.pause_generation(obj.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @router.post("/continue_generation")
    async def continue_generation(obj: ContinueGenerationReqInput) -> Response:
        await front.continue_generation()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)) -> Response:
        result = await front.flush_cache(timeout)
        if result.success:
            return Response(_FLUSHED, status_code=200)
        return Response(result.message or "Flush cache failed.\n", status_code=400)

    @router.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(obj: MemoryOccupationReqInput) -> Response:
        try:
            tags = _tags(obj)
        except ValueError as exc:
            return error_response(exc)
        await front.release_memory_occupation(tags)
        return JSONResponse(None)

    @router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(obj: MemoryOccupationReqInput) -> Response:
        try:
            tags = _tags(obj)
        except ValueError as exc:
            return error_response(exc)
        await front.resume_memory_occupation(tags)
        return JSONResponse(None)

    @router.post("/begin_weight_update")
    async def begin_weight_update(obj: BeginWeightUpdateReqInput) -> Response:
        if front.weight_update_session_open:
            return _result(False, "A weight update session is already open; call /end_weight_update first.")
        front.weight_update_session_open = True
        return _result(True, "Success")

    @router.post("/end_weight_update")
    async def end_weight_update(obj: EndWeightUpdateReqInput) -> Response:
        if not front.weight_update_session_open:
            return _result(False, "No weight update session is open; call /begin_weight_update first.")
        front.weight_update_session_open = False
        return _result(True, "Success")

    @router.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(obj: UpdateWeightsFromTensorReqInput) -> Response:
        if not front.weight_update_session_open:
            return _result(
                False,
                "update_weights_from_tensor must be called inside a weight update session (/begin_weight_update ... /end_weight_update).",
            )
        message = await front.load_weights(flush_cache=obj.flush_cache, abort_all=obj.abort_all_requests, weight_version=obj.weight_version)
        return _result(True, message)

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(obj: UpdateWeightsFromDistributedReqInput) -> Response:
        if not len(obj.names) == len(obj.dtypes) == len(obj.shapes):
            return _result(False, "names, dtypes and shapes must have the same length.")
        if obj.group_name not in front.weight_update_groups:
            return _result(
                False,
                f"Failed to update parameter online: process group {obj.group_name!r} is not initialized; "
                "call /init_weights_update_group first.",
            )
        message = await front.load_weights(flush_cache=obj.flush_cache, abort_all=obj.abort_all_requests, weight_version=obj.weight_version)
        return _result(True, message)

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput) -> Response:
        await front.load_weights(flush_cache=obj.flush_cache, abort_all=obj.abort_all_requests, weight_version=obj.weight_version)
        message = "Succeeded to update model weights."
        if obj.weight_version is not None:
            message += f" Weight version updated to {obj.weight_version}."
        return _result(True, message, num_paused_requests=0)

    @router.post("/update_weight_version")
    async def update_weight_version(obj: UpdateWeightVersionReqInput) -> Response:
        if obj.abort_all_requests:
            front.abort_request(abort_all=True)
        front.weight_version = obj.new_version
        return _result(True, f"Weight version updated to {obj.new_version}", new_version=obj.new_version)

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput) -> Response:
        front.weight_update_groups.add(obj.group_name)
        return _result(True, "Succeeded to initialize custom process group.")

    @router.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(obj: DestroyWeightsUpdateGroupReqInput) -> Response:
        if obj.group_name not in front.weight_update_groups:
            return _result(False, f"Process group {obj.group_name!r} does not exist.")
        front.weight_update_groups.discard(obj.group_name)
        return _result(True, "Succeeded to destroy custom process group.")

    @router.post("/abort_request")
    async def abort_request(obj: AbortReq) -> Response:
        front.abort_request(obj.rid, obj.abort_all)
        return Response(status_code=200)

    return router
