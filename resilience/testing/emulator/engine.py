"""One engine's parts wired together: memory pools, scheduler thread, tokenizer-side frontend, call record."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .config import SGLANG_VERSION, EngineConfig
from .frontend import Frontend
from .pools import MemoryPools
from .record import CallRecord
from .scheduler import Scheduler

__all__ = ["Engine"]


@dataclass(eq=False)
class Engine:
    """Everything the routes of one emulated engine need."""

    config: EngineConfig
    host: str
    port: int
    pools: MemoryPools
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
        return cls(config, host, port, pools, scheduler, frontend, CallRecord())

    def state(self) -> dict[str, Any]:
        """What ``/_emulator/state`` answers: tokenizer side and scheduler side merged."""
        front = self.frontend.state()
        sched = self.scheduler.snapshot()
        return {
            "pid": os.getpid(),
            "version": SGLANG_VERSION,
            **front,
            "scheduler_paused": sched["scheduler_paused"],
            "released_tags": sched["released_tags"],
            "allocated_bytes": sched["allocated_bytes"],
            "running": sched["running"],
            "waiting": sched["waiting"],
            "counts": sched["counts"],
        }
