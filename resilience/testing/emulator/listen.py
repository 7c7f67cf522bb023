"""What every engine entry does with its process before serving: bind the port, check and watch its parent.

A leaf module (standard library only), shared by the SGLang entry (``server.py``) and the
vLLM one (``vllm/server.py``) without either importing the other.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

__all__ = ["bind_listener", "listen_url", "parent_problem", "watch_parent"]


def watch_parent(parent_pid: int) -> None:
    """Start a daemon thread that SIGTERMs this process once ``parent_pid`` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:  # ends when the parent dies (we are re-parented)
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="emulator-parent-watch", daemon=True).start()


def parent_problem(pid: int) -> str | None:
    """Why ``--exit-with-parent PID`` cannot work (no such process, or not our parent), or None when it can.

    The watch compares ``os.getppid()`` with PID, so any other PID would end the engine at once, silently.
    """
    if pid <= 0:
        return f"must be a process ID > 0, but was {pid}"
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return "no process with that PID is running"
    except PermissionError:
        pass  # it exists (owned by someone else)
    if os.getppid() != pid:
        return f"that process is not this engine's parent (the parent is {os.getppid()})"
    return None


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening, inheritable socket on ``host:port`` (0 picks a free port); OSError when it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def listen_url(host: str, port: int) -> str:
    """``http://host:port`` (IPv6 hosts in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
