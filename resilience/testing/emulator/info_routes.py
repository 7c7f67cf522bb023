"""Read-only routes: health, readiness, model and server info, loads, models; and the emulator's debug routes.

Each follows its handler in ``sglang/srt/entrypoints/http_server.py`` (``/v1/loads``: ``entrypoints/v1_loads.py``).
SGLang 0.5.23 has no ``/get_load``, ``/get_weight_version`` or ``/weight_version``: neither does the emulator (they
are 404). The emulator's own routes live under ``/_emulator/`` only.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from . import crash
from .config import SGLANG_VERSION

if TYPE_CHECKING:
    from .app import Engine

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
        return Response(status_code=200 if front.is_ready() else 503)

    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info() -> Response:
        return JSONResponse(
            {
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
            "enable_memory_saver": config.memory_saver,
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
    async def v1_loads(dp_rank: int | None = None, include: str | None = None) -> Response:
        # SGLang reads the published snapshot (no round trip to the scheduler); an invalid section
        # raises ValueError in LoadSnapshot.to_dict, outside the handler's try: a bare 500.
        sections = {s.strip() for s in include.split(",")} if include else None
        if sections is not None and "all" not in sections and not sections <= _LOAD_SECTIONS:
            crash.log_line(f"Exception in ASGI application: ValueError: Invalid include sections: {sections - _LOAD_SECTIONS}")
            return PlainTextResponse("Internal Server Error", status_code=500)
        snap = front.load_snapshot()
        load: dict[str, Any] = {"timestamp": snap["timestamp"], "dp_rank": 0}
        load.update({k: v for k, v in snap.items() if k not in ("memory", "num_retracted_reqs", "timestamp")})
        wanted = _LOAD_SECTIONS if sections is None or "all" in sections else sections
        if wanted != {"core"}:
            if "memory" in wanted:
                load["memory"] = snap["memory"]
            if "queues" in wanted:
                load["queues"] = {
                    "waiting": snap["num_waiting_reqs"],
                    "grammar": 0,
                    "paused": 0,
                    "retracted": snap["num_retracted_reqs"],
                    "prealloc_ready": 0,
                }
        body = {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": SGLANG_VERSION,
            "accelerator": None,
            "num_accelerators": 1,
            "loads": [load] if dp_rank in (None, 0) else [],
        }
        return JSONResponse(body)

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
        return JSONResponse({"calls": engine.record.calls(), "dropped": engine.record.dropped, "state": engine.state()})

    return router
