"""VLLMEngineConfig: every knob of one emulated vLLM engine, and its command line.

Where vLLM 0.33.0 has the flag, the emulator takes vLLM's own name: ``--enable-sleep-mode`` (``vllm/config/model.py``
``enable_sleep_mode``), ``--weight-transfer-config '{"backend": "nccl"}'`` (``vllm/config/weight_transfer.py``),
``--api-key`` (``vllm/entrypoints/common/cli_args.py`` l.335, repeatable there too), ``--served-model-name``,
``--max-num-seqs``. The control routes are mounted only with ``VLLM_SERVER_DEV_MODE=1`` (``vllm/envs.py`` l.1468:
``bool(int(os.getenv("VLLM_SERVER_DEV_MODE", "0")))``); ``--server-dev-mode 0|1`` (the emulator's own) overrides the
environment, so a fleet forked from one zygote can run engines of both kinds. Imports neither FastAPI nor torch: the
fleet uses it too.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

from ..config import add_config_arguments, check_fields, config_argv

__all__ = [
    "DEV_MODE_ENV", "ENGINE_KIND", "VLLM_VERSION", "VLLMEngineConfig", "add_vllm_arguments", "dev_mode_from_env",
    "vllm_config_from_namespace",
]  # fmt: skip

VLLM_VERSION = "0.33.0"
"""The vLLM release whose control plane the emulator reproduces (``GET /version`` answers it)."""

ENGINE_KIND = "vllm"
"""The value of the shared entry's ``--engine`` flag that selects this emulator."""

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
"""The environment variable that mounts the dev and RL routers (``vllm/envs.py`` l.1468)."""

WEIGHT_TRANSFER_BACKENDS = ("nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n")
"""Backends named by ``vllm/config/weight_transfer.py`` l.12 (the emulator moves no tensors with any of them)."""


def dev_mode_from_env() -> bool:
    """``VLLM_SERVER_DEV_MODE`` read as vLLM reads it: ``bool(int(value))``, unset = off; ValueError names a bad value."""
    raw = os.environ.get(DEV_MODE_ENV, "0")
    try:
        return bool(int(raw))
    except ValueError:
        raise ValueError(f"`{DEV_MODE_ENV}` must be an integer (0 or 1), but was {raw!r}") from None


@dataclass(frozen=True, slots=True)
class VLLMEngineConfig:
    """How one emulated vLLM engine behaves; every field has a default right for tests of client code."""

    enable_sleep_mode: bool = False
    """vLLM's ``--enable-sleep-mode`` (default off, as in vLLM). Off: ``/sleep`` and ``/wake_up`` keep the
    executor's tag bookkeeping (``/is_sleeping``, the pause) but no memory is ever released, so nothing
    crashes and level 2 corrupts nothing (the cumem pool holds no allocation, ``gpu_worker.py`` l.301).
    On: slept memory is really gone: scheduling onto it kills the engine, level 2 leaves garbage weights."""
    weight_transfer_backend: str | None = None
    """The ``backend`` of vLLM's ``--weight-transfer-config`` JSON; None (default) = not configured, so
    every weight-transfer route answers 500 "Weight transfer not configured" (``gpu_worker.py`` l.1512)."""
    dev_mode: bool | None = None
    """Mount the dev and RL routes. None (default) = read ``VLLM_SERVER_DEV_MODE`` from the engine's
    environment at start, as vLLM does; True/False override it (``--server-dev-mode 1|0``)."""
    api_key: str | None = field(default=None, repr=False)
    """vLLM's ``--api-key``: Bearer key for paths under ``/v1``, ``/v2``, ``/inference``, ``/cohere`` only
    (``serve/middleware/authenticate.py`` l.11); the control routes stay open. None = open. Never logged."""
    served_model_name: str = "emulated/vllm-model"
    """The model name ``/v1/models`` reports and ``/v1/completions`` answers with."""
    token_rate: float = 200.0
    """Tokens per second each running request decodes: how long a request stays in flight."""
    max_num_seqs: int = 32
    """vLLM's ``--max-num-seqs``: most requests running at once; the rest wait in the queue."""
    default_max_tokens: int = 16
    """``max_tokens`` of a completion that does not set it (the OpenAI default vLLM uses: 16)."""
    tick_seconds: float = 0.01
    """How often the scheduler steps (decodes, admits, finishes requests)."""
    weight_version: str = "default"
    """The initial weight version (``v1/engine/core.py`` l.147: ``self._weight_version = "default"``)."""
    enable_fault_tolerance: bool = False
    """vLLM's ``--enable-fault-tolerance`` (default off, as in vLLM): mounts ``POST /fault_tolerance/apply`` and
    ``GET /fault_tolerance/status`` (``entrypoints/launchers/api_server/routers.py`` l.85-90), and a fault of the
    busy loop (``POST /_emulator/fault``) waits for ``retry`` instead of killing the engine (``fault_tolerance.py``)."""
    engine_recovery_timeout_s: float = 120.0
    """How long a faulted engine waits for an instruction before it dies: vLLM's
    ``--fault-tolerance-config '{"engine_recovery_timeout_sec": ...}'`` (``config/fault_tolerance.py``, default 120)."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            positive=("token_rate", "tick_seconds", "engine_recovery_timeout_s"),
            counts=("max_num_seqs", "default_max_tokens"),
            switches=("enable_sleep_mode", "enable_fault_tolerance"),
            names=("served_model_name", "weight_version"),
            keys=("api_key",),
        )
        if self.dev_mode is not None and not isinstance(self.dev_mode, bool):
            raise ValueError(f"`dev_mode` must be None, True or False, but was {self.dev_mode!r}")
        if self.weight_transfer_backend is not None and self.weight_transfer_backend not in WEIGHT_TRANSFER_BACKENDS:
            raise ValueError(
                f"`weight_transfer_backend` must be None or one of {', '.join(WEIGHT_TRANSFER_BACKENDS)}, "
                f"but was {self.weight_transfer_backend!r}"
            )

    def resolved_dev_mode(self) -> bool:
        """Whether the control routes are mounted: :attr:`dev_mode`, else ``VLLM_SERVER_DEV_MODE`` now."""
        return self.dev_mode if self.dev_mode is not None else dev_mode_from_env()

    def to_argv(self) -> list[str]:
        """The flags that rebuild this config, led by ``--engine vllm`` (only fields that differ from the default)."""
        return ["--engine", ENGINE_KIND, *config_argv(self, _SPECIAL_FLAGS)]


_SPECIAL_FLAGS = {
    "weight_transfer_backend": lambda value: ["--weight-transfer-config", json.dumps({"backend": value})],
    "dev_mode": lambda value: ["--server-dev-mode", "1" if value else "0"],
}
"""The fields whose flag is not ``--<field>``: vLLM's JSON config, and the emulator's override of the environment."""


def _weight_transfer(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'must be a JSON object such as \'{{"backend": "nccl"}}\', but was {text!r}') from None
    if not isinstance(value, dict) or set(value) - {"backend"}:
        raise argparse.ArgumentTypeError(f"must be a JSON object with at most the key 'backend', but was {text!r}")
    return value


def _dev_mode(text: str) -> bool:
    if text not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"must be 0 or 1, but was {text!r}")
    return text == "1"


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """Add vLLM's flags (and the emulator's knobs), each defaulting to the VLLMEngineConfig default."""
    parser.add_argument(
        "--weight-transfer-config",
        type=_weight_transfer,
        default=None,
        metavar="JSON",
        help='vLLM\'s --weight-transfer-config, e.g. \'{"backend": "nccl"}\' (default: not configured)',
    )
    parser.add_argument(
        "--server-dev-mode",
        type=_dev_mode,
        default=None,
        metavar="0|1",
        help=f"mount the dev and RL routes (default: read {DEV_MODE_ENV} from the environment, as vLLM)",
    )
    add_config_arguments(parser, VLLMEngineConfig, skip=_SPECIAL_FLAGS)


def vllm_config_from_namespace(ns: argparse.Namespace) -> VLLMEngineConfig:
    """Build a VLLMEngineConfig from the flags of :func:`add_vllm_arguments`; ValueError names a bad field."""
    transfer = ns.weight_transfer_config
    values = {spec.name: getattr(ns, spec.name) for spec in fields(VLLMEngineConfig) if spec.name not in _SPECIAL_FLAGS}
    backend = None if transfer is None else str(transfer.get("backend", "nccl"))
    return VLLMEngineConfig(**values, weight_transfer_backend=backend, dev_mode=ns.server_dev_mode)
