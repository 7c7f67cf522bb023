"""How an emulated engine dies: at once, whole process, the way the real one does; and each engine's log line.

SGLang: any exception in the scheduler process is logged as ``Scheduler hit an exception: <traceback>``, the
scheduler sends SIGQUIT to its parent and the parent kills the whole process tree: clients see dropped connections,
never an HTTP error. torch_memory_saver's misuse errors call ``exit(1)`` from C++ without a traceback.

vLLM: a forward (or a weight load) that touches memory released by sleep mode is an illegal memory access
(vllm#15483, #44395: ``wake_up(tags=["weights"])`` then a forward). It kills the EngineCore (``EngineDeadError``),
and ``launcher.py`` ``terminate_if_errored`` stops the API server (unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH``).

Nothing runs after a death (no atexit, no graceful uvicorn shutdown).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import NoReturn

__all__ = ["die_from_scheduler_exception", "die_of_engine_error", "die_of_illegal_memory_access", "exit_like_memory_saver"]
__all__ += ["log_line", "vllm_log_line"]


def _write(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def log_line(message: str) -> None:
    """Write one SGLang-style log line (``[YYYY-mm-dd HH:MM:SS] message``) to stderr and flush."""
    _write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}")


def vllm_log_line(level: str, source: str, message: str) -> None:
    """Write one vLLM-style log line (``LEVEL mm-dd HH:MM:SS [source] message``) to stderr and flush."""
    _write(f"{level} {time.strftime('%m-%d %H:%M:%S')} [{source}] {message}")


def _sigkill() -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)  # not reached: SIGKILL cannot be caught


def die_from_scheduler_exception(exc: BaseException) -> NoReturn:
    """Log ``Scheduler hit an exception: <traceback>`` and SIGKILL this process, like SGLang's SIGQUIT path."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    log_line(f"Scheduler hit an exception: {text.rstrip()}")
    log_line("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
    _sigkill()


def exit_like_memory_saver(message: str) -> NoReturn:
    """Print torch_memory_saver's error line and ``exit(1)`` at once, as its C++ code does."""
    _write(f"[torch_memory_saver.cpp] {message}")
    os._exit(1)


def die_of_illegal_memory_access(what: str) -> NoReturn:
    """vLLM: log EngineCore's fatal error for ``what`` (e.g. "a forward onto slept kv_cache") and SIGKILL this process."""
    vllm_log_line("ERROR", "core.py", f"EngineCore encountered a fatal error: {what}.")
    vllm_log_line("ERROR", "core.py", "torch.AcceleratorError: CUDA error: an illegal memory access was encountered")
    vllm_log_line("ERROR", "launcher.py", "Engine core proc EngineCore_DP0 died unexpectedly, shutting down API server.")
    _sigkill()


def die_of_engine_error(error_type: str, why: str = "") -> NoReturn:
    """vLLM: the busy loop raised ``error_type`` and nothing recovers it (no fault tolerance, or ``why``): the engine dies."""
    if why:
        vllm_log_line("ERROR", "engine_core_sentinel.py", f"[FT] {why[0].upper()}{why[1:]}.")
    vllm_log_line("ERROR", "core.py", f"EngineCore encountered a fatal error: {error_type}.")
    vllm_log_line("ERROR", "launcher.py", "Engine core proc EngineCore_DP0 died unexpectedly, shutting down API server.")
    _sigkill()
