"""How an emulated engine dies: at once, whole process, the way SGLang does.

In SGLang any exception in the scheduler process is logged as
``Scheduler hit an exception: <traceback>``, the scheduler sends SIGQUIT to its
parent and the parent kills the whole process tree: clients see dropped
connections, never an HTTP error. torch_memory_saver's misuse errors call
``exit(1)`` from C++ without a traceback. Both are reproduced here; nothing runs
after them (no atexit, no graceful uvicorn shutdown).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import NoReturn

__all__ = ["die_from_scheduler_exception", "exit_like_memory_saver", "log_line"]


def log_line(message: str) -> None:
    """Write one SGLang-style log line (``[YYYY-mm-dd HH:MM:SS] message``) to stderr and flush."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.stderr.write(f"[{stamp}] {message}\n")
    sys.stderr.flush()


def die_from_scheduler_exception(exc: BaseException) -> NoReturn:
    """Log ``Scheduler hit an exception: <traceback>`` and SIGKILL this process, like SGLang's SIGQUIT path."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    log_line(f"Scheduler hit an exception: {text.rstrip()}")
    log_line("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)  # not reached: SIGKILL cannot be caught


def exit_like_memory_saver(message: str) -> NoReturn:
    """Print torch_memory_saver's error line and ``exit(1)`` at once, as its C++ code does."""
    sys.stderr.write(f"[torch_memory_saver.cpp] {message}\n")
    sys.stderr.flush()
    os._exit(1)
