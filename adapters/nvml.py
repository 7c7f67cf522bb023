"""``NvmlMemoryProbe``: which memory tags an SGLang engine has released, read from NVML on the engine's node.

With ``--enable-memory-saver`` SGLang puts its GPU memory in torch_memory_saver regions by tag (``kv_cache``,
``weights``, ``cuda_graph``; ``sglang/srt/utils/torch_memory_saver_adapter.py``), and ``release_memory_occupation``
pauses them: their physical memory goes back to the driver
(``sglang/srt/managers/scheduler_components/weight_updater.py``). NVML's per-process used memory
(``nvmlDeviceGetComputeRunningProcesses``) of the engine's scheduler processes (titled ``sglang::scheduler...``,
``sglang/srt/managers/scheduler.py``, ``run_scheduler_process``) drops by the tags' size. This probe turns one reading
into a set of released tags.

**What it needs.** ``nvidia-ml-py`` (``pip install 'controlplane-resilience[nvml]'``; a clear ``ImportError`` at
construction without it). To run on the engine's node and see the scheduler PIDs as NVML reports them: in a
container without the host's PID namespace NVML lists host PIDs, which match nothing here (``--pid=host``, or
``hostPID: true``), and every answer is None. Per engine, an ``EngineGpu``: its scheduler PIDs
(``scheduler_pids(server_pid)``), the bytes each tag holds while active (SGLang's ``GET /v1/loads?include=memory``,
``sglang/srt/managers/load_snapshot.py``, through ``tag_bytes_from_loads``), and the used memory while serving
with nothing released (given, or learnt with :meth:`NvmlMemoryProbe.learn` while the engine serves).

**How "released" is inferred** (``infer_released``, a pure function). Every subset S of the tags predicts a reading:
``serving_bytes - sum(tag_bytes[t] for t in S)``. The reading matches S when it lies within the tolerance of that
prediction. Exactly one matching subset is the answer; none, or more than one, is None (it cannot prove). The tolerance
is ``max(NvmlThresholds.tolerance_bytes, tolerance_fraction * serving_bytes)``: by default 1 GiB or 2 % of the serving
memory, whichever is larger. It has to cover what else moves the process's memory (the CUDA context, torch's caching
allocator, NCCL buffers); a tag smaller than about twice the tolerance cannot be told from noise, so states that differ
only in it answer None. A reading taken while a release or resume is under way (memory between two states) answers None,
or, if it happens to match a state, that state: NVML cannot see a call queued in the scheduler. The transport trusts
"not applied" only after a 502/503 for that reason (``resilience.adapters.sglang.memory_check``).

An engine not configured here raises ``UnknownEngine`` (``resilience.engine_contract``: the probe knows nothing of it,
which a mount checks before it starts). None also when: a PID is not running, or NVML lists none of them on any GPU (a
dead engine); NVML cannot be initialised or read; no serving baseline is known yet.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from resilience.engine_contract import UnknownEngine

__all__ = [
    "EngineGpu", "NvmlMemoryProbe", "NvmlReader", "NvmlThresholds", "Reader", "infer_released", "scheduler_pids", "tag_bytes_from_loads",
]

logger = logging.getLogger(__name__)

GiB = 1 << 30
SCHEDULER_TITLE = "sglang::scheduler"
"""The process title SGLang 0.5.23 gives each scheduler (``setproctitle``, ``managers/scheduler.py``)."""

Reader = Callable[[Sequence[int]], int | None]
"""``reader(pids)``: the GPU memory in bytes those processes use on this node now, or None when it cannot be read."""


@dataclass(frozen=True, slots=True)
class NvmlThresholds:
    """How close a reading must be to a state's predicted used memory to count as that state."""

    tolerance_bytes: int = GiB
    """The smallest tolerance, bytes (default 1 GiB): the drift of memory outside the tags (CUDA context, allocator cache)."""
    tolerance_fraction: float = 0.02
    """The tolerance as a fraction of the serving memory, when that is larger (default 0.02 = 2 %)."""

    def __post_init__(self) -> None:
        if isinstance(self.tolerance_bytes, bool) or not isinstance(self.tolerance_bytes, int) or self.tolerance_bytes < 0:
            raise ValueError(f"`tolerance_bytes` must be an integer >= 0, but was {self.tolerance_bytes!r}")
        fraction = self.tolerance_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (math.isfinite(fraction) and 0 <= fraction < 1):
            raise ValueError(f"`tolerance_fraction` must be a number in [0, 1), but was {fraction!r}")

    def tolerance(self, serving_bytes: int) -> float:
        """The tolerance for an engine that uses ``serving_bytes`` while serving."""
        return max(float(self.tolerance_bytes), self.tolerance_fraction * serving_bytes)


def _check_bytes(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be an integer number of bytes >= 0, but was {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class EngineGpu:
    """What the probe knows of one engine on this node."""

    pids: tuple[int, ...]
    """The engine's scheduler PIDs (one per TP rank on this node), as NVML sees them."""
    tag_bytes: Mapping[str, int]
    """Bytes each tag holds while active, e.g. ``{"kv_cache": 80 * GiB, "weights": 16 * GiB, "cuda_graph": 2 * GiB}``."""
    serving_bytes: int | None = None
    """Used memory of ``pids`` while serving with nothing released; None = learn it (``NvmlMemoryProbe.learn``)."""

    def __post_init__(self) -> None:
        pids = tuple(self.pids)
        if not pids or not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in pids):
            raise ValueError(f"`pids` must be one or more process IDs > 0, but was {self.pids!r}")
        object.__setattr__(self, "pids", pids)
        if not isinstance(self.tag_bytes, Mapping) or not self.tag_bytes:
            raise ValueError(f"`tag_bytes` must map one or more tags to their bytes, but was {self.tag_bytes!r}")
        tags = {}
        for tag, size in self.tag_bytes.items():
            if not isinstance(tag, str) or not tag:
                raise ValueError(f"`tag_bytes` keys must be tag names, but one was {tag!r}")
            tags[tag] = _check_bytes(f"tag_bytes[{tag!r}]", size)
        object.__setattr__(self, "tag_bytes", dict(tags))
        if self.serving_bytes is not None:
            _check_bytes("serving_bytes", self.serving_bytes)


def infer_released(
    used_bytes: int, serving_bytes: int, tag_bytes: Mapping[str, int], thresholds: NvmlThresholds = NvmlThresholds()
) -> frozenset[str] | None:
    """The one set of tags whose release explains ``used_bytes``; None when no set, or more than one, does.

    A set S predicts ``serving_bytes - sum(tag_bytes[t] for t in S)``; the reading
    matches S within ``thresholds.tolerance(serving_bytes)`` (see the module docstring).
    """
    tolerance = thresholds.tolerance(serving_bytes)
    tags = sorted(tag_bytes)
    matches = [
        frozenset(subset)
        for n in range(len(tags) + 1)
        for subset in itertools.combinations(tags, n)
        if abs(used_bytes - (serving_bytes - sum(tag_bytes[t] for t in subset))) <= tolerance
    ]
    return matches[0] if len(matches) == 1 else None


def tag_bytes_from_loads(loads: Mapping[str, Any]) -> dict[str, int]:
    """``tag_bytes`` from SGLang's ``GET /v1/loads?include=memory`` answer (``memory``: ``weight_gb``, ``kv_cache_gb``, ``graph_gb``).

    Takes the first rank's figures (one engine's ranks hold the same); ValueError when they are missing.
    """
    ranks = loads.get("loads") if isinstance(loads.get("loads"), list) else [loads]
    for rank in ranks or ():
        memory = rank.get("memory") if isinstance(rank, Mapping) else None
        if isinstance(memory, Mapping) and all(isinstance(memory.get(k), (int, float)) for k in ("weight_gb", "kv_cache_gb", "graph_gb")):
            return {
                "weights": int(memory["weight_gb"] * GiB),
                "kv_cache": int(memory["kv_cache_gb"] * GiB),
                "cuda_graph": int(memory["graph_gb"] * GiB),
            }
    raise ValueError("the /v1/loads answer has no memory figures (weight_gb, kv_cache_gb, graph_gb): ask it with ?include=memory")


def scheduler_pids(server_pid: int, *, proc: str = "/proc") -> tuple[int, ...]:
    """The PIDs under ``server_pid`` (itself included) whose command line starts with ``sglang::scheduler``, in PID order."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir(proc)
    except OSError:
        return ()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat", encoding="ascii", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo, seen = [server_pid], set()
    while todo:  # bounded: every PID is visited once
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(children.get(pid, ()))
        try:
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0", 1)[0].decode("utf-8", errors="replace")
        except OSError:
            continue
        if title.startswith(SCHEDULER_TITLE):
            found.append(pid)
    return tuple(sorted(found))


class NvmlReader:
    """The default ``Reader``: sums NVML's ``usedGpuMemory`` of the PIDs over every GPU of this node.

    Imports ``pynvml`` (``nvidia-ml-py``) at construction (a clear ImportError when missing)
    and initialises NVML on the first read. None when NVML cannot start or be read, when
    a PID is on no GPU, or when NVML hides a process's usage (``usedGpuMemory`` None).
    """

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise ImportError(
                "NvmlMemoryProbe reads NVML through nvidia-ml-py: pip install 'controlplane-resilience[nvml]' "
                "(or pass reader= with your own reading function)"
            ) from exc
        self._nvml: Any = pynvml
        self._lock = threading.Lock()
        self._started = False
        self._warned = False

    def _start(self) -> bool:
        with self._lock:
            if not self._started:
                try:
                    self._nvml.nvmlInit()
                except self._nvml.NVMLError as exc:
                    if not self._warned:
                        self._warned = True
                        logger.warning("NVML could not start (%s): NvmlMemoryProbe answers None", exc)
                    return False
                self._started = True
            return True

    def __call__(self, pids: Sequence[int]) -> int | None:
        if not self._start():
            return None
        nvml = self._nvml
        wanted, used, seen = set(pids), 0, set()
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if process.pid in wanted:
                        if process.usedGpuMemory is None:
                            return None
                        used += int(process.usedGpuMemory)
                        seen.add(process.pid)
        except nvml.NVMLError:
            return None
        return used if seen == wanted else None

    def close(self) -> None:
        """Shut NVML down if this reader started it."""
        with self._lock:
            if self._started:
                self._started = False
                try:
                    self._nvml.nvmlShutdown()
                except self._nvml.NVMLError:
                    pass


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(eq=False)
class NvmlMemoryProbe:
    """A ``resilience.engine_contract.MemoryProbe`` from NVML's per-process memory of each engine's schedulers on this node.

    ``engines``: engine name (``scheme://host:port``, as the barrier and the transport name it) -> ``EngineGpu``.
    ``thresholds``: the matching tolerance (default ``NvmlThresholds()``: 1 GiB or 2 % of serving memory). ``reader``:
    reads the used memory of PIDs (default ``NvmlReader()``, which needs ``nvidia-ml-py``).
    """

    engines: Mapping[str, EngineGpu]
    thresholds: NvmlThresholds = field(default_factory=NvmlThresholds)
    reader: Reader | None = None
    _learnt: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.engines, Mapping):
            raise ValueError(f"`engines` must map engine names to EngineGpu, but was {self.engines!r}")
        for name, gpu in self.engines.items():
            if not isinstance(gpu, EngineGpu):
                raise ValueError(f"`engines[{name!r}]` must be an EngineGpu, but was {gpu!r}")
        self.engines = {_canonical(name): gpu for name, gpu in self.engines.items()}
        if not isinstance(self.thresholds, NvmlThresholds):
            raise ValueError(f"`thresholds` must be an NvmlThresholds, but was {self.thresholds!r}")
        if self.reader is None:
            self.reader = NvmlReader()

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the lock, and without the default reader (it holds NVML's module): rebuilt on unpickling."""
        with self._lock:
            learnt = dict(self._learnt)
        reader = None if isinstance(self.reader, NvmlReader) else self.reader
        return {"engines": dict(self.engines), "thresholds": self.thresholds, "reader": reader, "learnt": learnt}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.engines, self.thresholds, self.reader = state["engines"], state["thresholds"], state["reader"]
        self._learnt, self._lock = dict(state["learnt"]), threading.Lock()
        if self.reader is None:
            self.reader = NvmlReader()

    def _read(self, gpu: EngineGpu) -> int | None:
        if not all(_pid_runs(pid) for pid in gpu.pids):
            return None
        assert self.reader is not None
        try:
            return self.reader(gpu.pids)
        except Exception:  # a reader that fails cannot prove anything
            return None

    def learn(self, engine: str) -> int | None:
        """Record the engine's used memory now as its serving baseline (call while it serves, nothing released); the bytes, or None."""
        gpu = self.engines.get(_canonical(engine))
        if gpu is None:
            raise KeyError(f"{engine!r} is not one of this probe's engines")
        used = self._read(gpu)
        if used is not None:
            with self._lock:
                self._learnt[_canonical(engine)] = used
        return used

    def serving_bytes(self, engine: str) -> int | None:
        """The serving baseline in use for ``engine``: the configured one, else the learnt one, else None."""
        key = _canonical(engine)
        gpu = self.engines.get(key)
        if gpu is None:
            return None
        if gpu.serving_bytes is not None:
            return gpu.serving_bytes
        with self._lock:
            return self._learnt.get(key)

    def released_tags(self, engine: str) -> frozenset[str] | None:
        """The tags released on ``engine`` now, inferred from one NVML reading; None when that cannot prove them.

        Raises ``UnknownEngine`` for an engine not in ``engines``.
        """
        gpu = self.engines.get(_canonical(engine)) if isinstance(engine, str) else None
        if gpu is None:
            raise UnknownEngine(self, str(engine))
        serving = self.serving_bytes(engine)
        if serving is None:
            return None
        used = self._read(gpu)
        if used is None:
            return None
        return infer_released(used, serving, gpu.tag_bytes, self.thresholds)


def _canonical(engine: str) -> str:
    """``scheme://host:port`` without a trailing slash or path (how the transport names an engine)."""
    parts = urlsplit(engine)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else engine
