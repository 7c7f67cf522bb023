"""The FastAPI application of one emulated engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from .config import EngineConfig
from .control_routes import control_router
from .engine import Engine
from .errors import install_exception_handlers
from .generate_route import generate_router
from .info_routes import info_router
from .record import RecordMiddleware

__all__ = ["create_app"]


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
    app.add_middleware(RecordMiddleware, record=engine.record)
    return app, engine
