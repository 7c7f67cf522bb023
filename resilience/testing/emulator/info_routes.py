"""Read-only routes: health, readiness, model and server info, loads, models; and the emulator's debug routes."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, HTTPException
from fastapi.responses import JSONResponse, Response

from .config import SGLANG_VERSION
from .engine import Engine

__all__ = ["info_router"]

_LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def info_router(engine: Engine) -> APIRouter:
    """Routes that only read the engine's state, bound to ``engine``."""
    router = APIRouter()
    config, front = engine.config, engine.frontend

    @router.get("/health")
    @router.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200 if await front.health() else 503)

    @router.get("/ready")
    async def ready() -> Response:
        return Response(status_code=503 if front.is_pause else 200)

    def model_info_body() -> dict[str, Any]:
        return {
            "model_path": config.model_path,
            "tokenizer_path": config.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": front.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "emulated",
            "architectures": ["EmulatedForCausalLM"],
        }

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info() -> Response:
        return JSONResponse(model_info_body())

    @router.get("/get_weight_version")
    @router.get("/weight_version")
    async def weight_version_gone() -> Response:
        raise HTTPException(
            status_code=404,
            detail="Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead.",
        )

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> Response:
        loads = await front.loads()
        server_args = {
            "model_path": config.model_path,
            "tokenizer_path": config.model_path,
            "served_model_name": config.model_name,
            "host": engine.host,
            "port": engine.port,
            "context_length": config.context_length,
            "max_running_requests": config.max_running_requests,
            "weight_version": front.weight_version,
            "enable_memory_saver": True,
            "skip_tokenizer_init": False,
            "tp_size": 1,
            "dp_size": 1,
        }
        internal_state = {
            "last_gen_throughput": loads["gen_throughput"],
            "memory_usage": {
                "weight": round(loads["memory"]["weight_gb"], 6),
                "kvcache": round(loads["memory"]["kv_cache_gb"], 6),
                "graph": round(loads["memory"]["graph_gb"], 6),
                "token_capacity": loads["max_total_num_tokens"],
            },
        }
        return JSONResponse(
            {
                **server_args,
                "max_total_num_tokens": loads["max_total_num_tokens"],
                "max_req_input_len": config.context_length - 1,
                "internal_states": [internal_state],
                "version": SGLANG_VERSION,
            }
        )

    @router.get("/v1/loads")
    async def v1_loads(include: str | None = None, dp_rank: int | None = None) -> Response:
        sections = {s.strip() for s in include.split(",")} if include else {"all"}
        invalid = sections - _LOAD_SECTIONS
        if invalid:
            raise HTTPException(
                status_code=400,
                detail=f"Invalid include sections: {invalid}. Valid options: {sorted(_LOAD_SECTIONS)}",
            )
        loads = await front.loads()
        load: dict[str, Any] = {"dp_rank": 0, "timestamp": time.time()}
        load.update({k: v for k, v in loads.items() if k not in ("memory", "num_retracted_reqs")})
        if sections & {"memory", "all"}:
            load["memory"] = loads["memory"]
        if sections & {"queues", "all"}:
            load["queues"] = {
                "waiting": loads["num_waiting_reqs"],
                "grammar": 0,
                "paused": 0,
                "retracted": loads["num_retracted_reqs"],
            }
        body = {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": SGLANG_VERSION,
            "accelerator": None,
            "num_accelerators": 1,
            "loads": [load] if dp_rank in (None, 0) else [],
        }
        return JSONResponse(body)

    @router.get("/get_load")
    async def get_load() -> Response:
        loads = await front.loads()
        return JSONResponse(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": loads["num_running_reqs"] + loads["num_waiting_reqs"],
                    "num_waiting_reqs": loads["num_waiting_reqs"],
                    "num_tokens": loads["num_total_tokens"],
                    "num_pending_tokens": loads["num_total_tokens"] - loads["num_used_tokens"],
                    "ts_tic": time.perf_counter(),
                }
            ]
        )

    @router.get("/v1/models")
    async def v1_models() -> Response:
        name = config.model_name
        card = {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": name,
            "max_model_len": config.context_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @router.get("/_emulator/state")
    async def emulator_state() -> Response:
        return JSONResponse(engine.state())

    @router.get("/_emulator/record")
    async def emulator_record() -> Response:
        return JSONResponse({"calls": engine.record.calls(), "state": engine.state()})

    return router
