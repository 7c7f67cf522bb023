"""The FastAPI application of one emulated SGLang engine, and the engine its routes share."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from .auth import ApiKeyMiddleware, AuthLevel
from .config import SGLANG_VERSION, EngineConfig
from .control_routes import control_router
from .errors import install_exception_handlers
from .frontend import Frontend
from .generate_route import generate_router
from .info_routes import info_router
from .pools import MemoryPools
from .record import CallRecord, RecordMiddleware
from .routes import iter_routes
from .scheduler import Scheduler

__all__ = ["Engine", "create_app"]


@dataclass(eq=False)
class Engine:
    """Everything the routes of one emulated engine need."""

    config: EngineConfig
    host: str
    port: int
    scheduler: Scheduler
    frontend: Frontend
    record: CallRecord

    @classmethod
    def build(cls, config: EngineConfig, host: str, port: int) -> Engine:
        """Allocate the tensors and wire scheduler and frontend (the scheduler thread starts with the app)."""
        pools = MemoryPools(config)
        frontend_box: list[Frontend] = []
        scheduler = Scheduler(config, pools, lambda out: frontend_box[0].on_scheduler_output(out))
        frontend = Frontend(config, scheduler)
        frontend_box.append(frontend)
        return cls(config, host, port, scheduler, frontend, CallRecord())

    def state(self) -> dict[str, Any]:
        """What ``/_emulator/state`` answers: tokenizer side and scheduler side merged."""
        return {"pid": os.getpid(), "version": SGLANG_VERSION, **self.frontend.state(), **self.scheduler.snapshot()}


def create_app(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 0) -> tuple[FastAPI, Engine]:
    """Build the app and its engine; the scheduler thread runs while the app's lifespan does."""
    engine = Engine.build(config, host, port)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.frontend.attach(asyncio.get_running_loop())
        engine.scheduler.start()
        try:
            yield
        finally:
            engine.scheduler.stop()

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    install_exception_handlers(app)
    app.include_router(info_router(engine))
    app.include_router(control_router(engine))
    app.include_router(generate_router(engine))
    if config.api_key or config.admin_api_key:  # as launch_server: the middleware only when a key is set
        levels = {route.path: getattr(route.endpoint, "_auth_level", AuthLevel.NORMAL) for route in iter_routes(app.routes)}
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, admin_api_key=config.admin_api_key, levels=levels)
    app.add_middleware(RecordMiddleware, record=engine.record)  # outermost: refused calls are recorded too
    return app, engine
