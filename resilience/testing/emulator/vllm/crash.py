"""How an emulated vLLM engine dies: the EngineCore hits a CUDA fault and the whole server goes, at once.

A forward (or a weight load) that touches memory released by sleep mode is an illegal
memory access (vllm#15483, #44395: ``wake_up(tags=["weights"])`` then a forward). It
kills the EngineCore (``EngineDeadError``), and ``launcher.py`` ``terminate_if_errored``
stops the API server (unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH``): clients see a
dropped connection. The emulator logs vLLM's lines and SIGKILLs its process; nothing
runs after that (no atexit, no graceful shutdown).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import NoReturn

__all__ = ["die_of_engine_error", "die_of_illegal_memory_access", "log_line"]


def log_line(level: str, source: str, message: str) -> None:
    """Write one vLLM-style log line (``LEVEL mm-dd HH:MM:SS [source] message``) to stderr and flush."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    sys.stderr.write(f"{level} {stamp} [{source}] {message}\n")
    sys.stderr.flush()


def die_of_illegal_memory_access(what: str) -> NoReturn:
    """Log EngineCore's fatal error for ``what`` (e.g. "a forward onto slept kv_cache") and SIGKILL this process."""
    log_line("ERROR", "core.py", f"EngineCore encountered a fatal error: {what}.")
    log_line("ERROR", "core.py", "torch.AcceleratorError: CUDA error: an illegal memory access was encountered")
    log_line("ERROR", "launcher.py", "Engine core proc EngineCore_DP0 died unexpectedly, shutting down API server.")
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)  # not reached: SIGKILL cannot be caught


def die_of_engine_error(error_type: str, why: str = "") -> NoReturn:
    """The busy loop raised ``error_type`` and nothing recovers it (no fault tolerance, or ``why``): the engine dies."""
    if why:
        log_line("ERROR", "engine_core_sentinel.py", f"[FT] {why[0].upper()}{why[1:]}.")
    log_line("ERROR", "core.py", f"EngineCore encountered a fatal error: {error_type}.")
    log_line("ERROR", "launcher.py", "Engine core proc EngineCore_DP0 died unexpectedly, shutting down API server.")
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)  # not reached: SIGKILL cannot be caught
