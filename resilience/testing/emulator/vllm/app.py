"""The FastAPI application of one emulated vLLM engine, mounted as ``register_api_routers`` mounts vLLM's.

``vllm/entrypoints/launchers/api_server/routers.py`` l.12-53: the serve routers always; the dev routers and the RL
router only when ``VLLM_SERVER_DEV_MODE`` is set (l.46), so without it every control route is a plain 404; the
fault-tolerance routes only with ``--enable-fault-tolerance`` (l.85-90). The ``--api-key`` middleware is added only
when a key is set, and guards ``/v1...`` only (``auth.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ..auth import AuthenticationMiddleware
from ..crash import vllm_log_line
from ..errors import install_vllm_exception_handlers
from ..record import CallRecord, RecordMiddleware
from .config import VLLMEngineConfig
from .core import EngineCore
from .dev_routes import dev_routers
from .ft_routes import ft_router
from .rl_routes import rl_router
from .serve_routes import debug_router, serve_router

__all__ = ["create_app"]


async def _scheduler(core: EngineCore) -> None:
    """Step the core every ``tick_seconds`` until cancelled (the app's lifespan ends)."""
    last = time.monotonic()
    while True:  # ends by cancellation when the server shuts down
        await asyncio.sleep(core.config.tick_seconds)
        now = time.monotonic()
        core.step(now - last)
        last = now


def create_app(config: VLLMEngineConfig, *, host: str = "127.0.0.1", port: int = 0) -> tuple[FastAPI, EngineCore]:
    """Build the app and its engine core; the scheduler task runs while the app's lifespan does (``host`` and ``port``
    change nothing: vLLM's routes do not report them).

    Dev mode is resolved here (``config.dev_mode``, else ``VLLM_SERVER_DEV_MODE``), once, as vLLM reads it at start.
    """
    dev_mode = config.resolved_dev_mode()
    core = EngineCore(config)
    record = CallRecord()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if core.memory_state is not None:
            core.memory_state.started(sorted(core.sleeping_tags))
        task = asyncio.create_task(_scheduler(core))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    install_vllm_exception_handlers(app)
    app.include_router(serve_router(core))
    if dev_mode:
        # serve/__init__.py l.44: logged once when the dev routers are mounted
        warning = "SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!"
        vllm_log_line("WARNING", "__init__.py", warning)
        for router in dev_routers(core):
            app.include_router(router)
        app.include_router(rl_router(core))
    if core.fault_tolerance is not None:  # routers.py l.85-90: with --enable-fault-tolerance, dev mode or not
        app.include_router(ft_router(core.fault_tolerance))
    app.include_router(debug_router(core, record, dev_mode))
    if config.api_key:
        app.add_middleware(AuthenticationMiddleware, tokens=[config.api_key])
    app.add_middleware(RecordMiddleware, record=record, unrecorded=("/v1/completions",))  # outermost: refusals too
    return app, core
