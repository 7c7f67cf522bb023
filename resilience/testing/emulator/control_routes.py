"""The control endpoints: pause/continue, flush, memory occupation, weight updates, abort.

Each follows its handler in ``sglang/srt/entrypoints/http_server.py`` (status codes,
bodies) and carries SGLang's auth level (all ``ADMIN_OPTIONAL``, ``utils/auth.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response

from .auth import AuthLevel, auth_level
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
from .pools import ALL_TAGS

if TYPE_CHECKING:
    from .app import Engine

__all__ = ["control_router"]

_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def _tags(body: MemoryOccupationReqInput) -> tuple[str, ...]:
    """null or [] means every tag; other tags pass as they are (SGLang records unknown ones and ignores them)."""
    return tuple(body.tags) if body.tags else ALL_TAGS


def _result(success: bool, message: str, **extra: object) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


WeightsUpdate = UpdateWeightsFromTensorReqInput | UpdateWeightsFromDistributedReqInput | UpdateWeightFromDiskReqInput


def control_router(engine: Engine) -> APIRouter:
    """Routes that change the engine's state, bound to ``engine``."""
    router = APIRouter()
    front = engine.frontend

    admin = auth_level(AuthLevel.ADMIN_OPTIONAL)

    @router.post("/pause_generation")
    @admin
    async def pause_generation(obj: PauseGenerationReqInput) -> Response:
        await front.pause_generation(obj.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @router.post("/continue_generation")
    @admin
    async def continue_generation(obj: ContinueGenerationReqInput) -> Response:
        await front.continue_generation()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    @admin
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)) -> Response:
        result = await front.flush_cache(timeout)
        if result.success:
            return Response(_FLUSHED, status_code=200)
        return Response(result.message or "Flush cache failed.\n", status_code=400)

    @router.api_route("/release_memory_occupation", methods=["GET", "POST"])
    @admin
    async def release_memory_occupation(obj: MemoryOccupationReqInput) -> Response:
        await front.release_memory_occupation(_tags(obj))
        return JSONResponse(None)

    @router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    @admin
    async def resume_memory_occupation(obj: MemoryOccupationReqInput) -> Response:
        await front.resume_memory_occupation(_tags(obj))
        return JSONResponse(None)

    @router.post("/begin_weight_update")
    @admin
    async def begin_weight_update(obj: BeginWeightUpdateReqInput) -> Response:
        return _result(*await front.weight_update_session(begin=True))

    @router.post("/end_weight_update")
    @admin
    async def end_weight_update(obj: EndWeightUpdateReqInput) -> Response:
        return _result(*await front.weight_update_session(begin=False))

    @router.post("/update_weights_from_tensor")
    @admin
    async def update_weights_from_tensor(obj: UpdateWeightsFromTensorReqInput) -> Response:
        if (refused := _first(obj, "update_weights_from_tensor")) is not None:
            return refused
        return _result(*await _load(obj, "Success"))

    @router.post("/update_weights_from_distributed")
    @admin
    async def update_weights_from_distributed(obj: UpdateWeightsFromDistributedReqInput) -> Response:
        if (refused := _first(obj, "update_weights_from_distributed")) is not None:
            return refused
        if not len(obj.names) == len(obj.dtypes) == len(obj.shapes):
            return _result(False, "Failed to receive weights: names, dtypes and shapes must have the same length.")
        if obj.group_name not in front.weight_update_groups:
            return _result(
                False,
                f"Failed to receive weights: process group {obj.group_name!r} is not initialized; call /init_weights_update_group first.",
            )
        return _result(*await _load(obj, "Succeeded to update parameter online."))

    @router.post("/update_weights_from_disk")
    @admin
    async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput) -> Response:
        _first(obj)
        success, message = await _load(obj, "Succeeded to update model weights.")
        return _result(success, message, num_paused_requests=0)

    @router.post("/update_weight_version")
    @admin
    async def update_weight_version(obj: UpdateWeightVersionReqInput) -> Response:
        _first(obj)
        await front.set_weight_version(obj.new_version)
        return _result(True, f"Weight version updated to {obj.new_version}", new_version=obj.new_version)

    @router.post("/init_weights_update_group")
    @admin
    async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput) -> Response:
        front.weight_update_groups.add(obj.group_name)
        return _result(True, "Succeeded to initialize custom process group.")

    @router.post("/destroy_weights_update_group")
    @admin
    async def destroy_weights_update_group(obj: DestroyWeightsUpdateGroupReqInput) -> Response:
        if obj.group_name not in front.weight_update_groups:
            return _result(False, f"Process group {obj.group_name!r} does not exist.")
        front.weight_update_groups.discard(obj.group_name)
        return _result(True, "Succeeded to destroy custom process group.")

    @router.post("/abort_request")
    @admin
    async def abort_request(obj: AbortReq) -> Response:
        front.abort_request(obj.rid or "", obj.abort_all)
        return Response(status_code=200)

    def _first(obj: WeightsUpdate | UpdateWeightVersionReqInput, session_route: str | None = None) -> Response | None:
        """What a weight route does first: abort every request when ``obj`` asks; for a ``session_route`` (one that
        loads inside a weight-update session), the refusal outside begin/end (None: go on)."""
        if obj.abort_all_requests:
            front.abort_request(abort_all=True)
        if session_route is not None and not front.weight_update_session_open:
            return _result(False, f"{session_route} must run between begin_weight_update() and end_weight_update()")
        return None

    async def _load(obj: WeightsUpdate, success_message: str) -> tuple[bool, str]:
        """The update itself (``tokenizer_control_mixin.py``): under the writer lock unless paused; may be applied yet refused."""
        return await front.load_weights(flush_cache=obj.flush_cache, weight_version=obj.weight_version, success_message=success_message)

    return router
