"""The FastAPI application of one emulated engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from .auth import ApiKeyMiddleware, AuthLevel
from .config import EngineConfig
from .control_routes import control_router
from .engine import Engine
from .errors import install_exception_handlers
from .generate_route import generate_router
from .info_routes import info_router
from .record import RecordMiddleware
from .routes import iter_routes

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
    if config.api_key or config.admin_api_key:  # as launch_server: the middleware only when a key is set
        levels = {route.path: getattr(route.endpoint, "_auth_level", AuthLevel.NORMAL) for route in iter_routes(app.routes)}
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, admin_api_key=config.admin_api_key, levels=levels)
    app.add_middleware(RecordMiddleware, record=engine.record)  # outermost: refused calls are recorded too
    return app, engine
