"""EngineConfig: every knob of one emulated SGLang engine, and its command-line form.

This module imports neither torch nor FastAPI: the fleet (the test side) uses it too.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from resilience.errors import finite_number, integer

__all__ = [
    "SGLANG_VERSION", "EngineConfig", "add_config_arguments", "check_fields", "config_argv", "config_from_namespace", "field_docs",
    "field_help",
]  # fmt: skip

SGLANG_VERSION = "0.5.23"
"""The SGLang release whose control plane the emulator reproduces."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one emulated engine behaves. Every field has a default right for tests of client code.

    Times are in seconds. The defaults follow SGLang where SGLang has the same knob
    (``health_hang_seconds`` = ``SGLANG_HEALTH_CHECK_TIMEOUT`` = 20, the 1 s polls of
    ``/health`` and of ``pause_generation(mode="abort")``); tests usually shrink them.
    """

    token_rate: float = 200.0
    """Tokens per second that each running request decodes. Sets how long a request stays in flight."""
    max_running_requests: int = 32
    """Most requests in the running batch at once; the rest wait in the admission queue."""
    kv_pool_tokens: int = 16384
    """Rows of the KV pool tensor (tag ``kv_cache``): the total token capacity."""
    max_req_slots: int = 64
    """Rows of the ``req_to_token`` tensor (tag ``kv_cache``); must be >= ``max_running_requests``."""
    context_length: int = 4096
    """Columns of ``req_to_token``: prompt plus generated tokens of one request may not exceed it."""
    default_max_new_tokens: int = 128
    """``max_new_tokens`` of a ``/generate`` that does not set it (SGLang's default is 128)."""
    swap_seconds: float = 0.05
    """How long ``release_memory_occupation`` / ``resume_memory_occupation`` hold the scheduler."""
    health_hang_seconds: float = 20.0
    """How long ``/health`` waits for scheduler output before answering 503 (SGLang: 20)."""
    health_poll_seconds: float = 1.0
    """How often ``/health`` checks for scheduler output; a healthy ``/health`` takes this long (SGLang: 1)."""
    abort_poll_seconds: float = 1.0
    """How often ``pause_generation(mode="abort")`` re-sends abort-all while requests are in flight (SGLang: 1)."""
    tick_seconds: float = 0.02
    """How long the idle scheduler waits for a message before looking again (messages wake it at once;
    this bounds how late a ``flush_cache?timeout=`` deadline is noticed)."""
    model_path: str = "emulated/sglang-model"
    """Reported as ``model_path`` by ``/model_info`` and ``/server_info``."""
    served_model_name: str | None = None
    """Reported by ``/v1/models`` and ``/model_info``; None = ``model_path``, as in SGLang."""
    weight_version: str = "default"
    """Initial weight version (SGLang's ``--weight-version`` default is ``"default"``)."""
    memory_saver: bool = True
    """SGLang's ``--enable-memory-saver`` (default on here: the colocated RL case). On: released tags
    really free their tensors, so a double release ends the process (torch_memory_saver's ``exit(1)``)
    and a write into a released pool kills the scheduler. Off (``--no-memory-saver``): release and
    resume only keep SGLang's tag bookkeeping (its no-op adapter); memory stays, a double release is harmless."""
    startup_seconds: float = 0.0
    """How long after the server starts ``/health`` answers 503 at once and ``/ready`` 503 (SGLang's
    ``ServerStatus.Starting`` until its warm-up request finishes). 0 = up at once."""
    api_key: str | None = field(default=None, repr=False)
    """SGLang's ``--api-key``: Bearer key that normal routes (and admin routes, when no admin key is set)
    require. None = open. Never shown in repr or logs."""
    admin_api_key: str | None = field(default=None, repr=False)
    """SGLang's ``--admin-api-key``: Bearer key that admin routes (pause, continue, flush, release,
    resume, weight updates, abort) require; the API key is then refused there. None = not set."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            non_negative=(
                *("token_rate", "swap_seconds", "health_hang_seconds", "health_poll_seconds", "abort_poll_seconds"),
                *("tick_seconds", "startup_seconds"),
            ),
            positive=("token_rate", "health_poll_seconds", "abort_poll_seconds", "tick_seconds"),
            counts=("max_running_requests", "kv_pool_tokens", "max_req_slots", "context_length", "default_max_new_tokens"),
            switches=("memory_saver",),
            names=("model_path", "weight_version"),
            keys=("api_key", "admin_api_key"),
        )
        if self.max_req_slots < self.max_running_requests:
            raise ValueError(
                f"`max_req_slots` must be >= `max_running_requests` ({self.max_running_requests}), but was {self.max_req_slots}"
            )
        if self.kv_pool_tokens < self.context_length:
            raise ValueError(f"`kv_pool_tokens` must be >= `context_length` ({self.context_length}), but was {self.kv_pool_tokens}")
        if self.served_model_name == "":
            raise ValueError("`served_model_name` must be None or a non-empty string, but was ''")

    @property
    def model_name(self) -> str:
        """The name clients see: ``served_model_name``, else ``model_path``."""
        return self.served_model_name or self.model_path

    def to_argv(self) -> list[str]:
        """The command-line flags that rebuild this config (only the fields that differ from the default)."""
        return config_argv(self)


def check_fields(
    config: Any,
    *,
    non_negative: Iterable[str] = (),
    positive: Iterable[str] = (),
    counts: Iterable[str] = (),
    switches: Iterable[str] = (),
    names: Iterable[str] = (),
    keys: Iterable[str] = (),
) -> None:
    """Raise ValueError naming the first field of ``config`` that breaks its rule: a finite number >= 0 or > 0, an
    integer >= 1, True or False, a non-empty string, or None or a non-empty key without surrounding spaces (not shown)."""
    at_least_zero = tuple(non_negative)
    for name in at_least_zero:
        value = getattr(config, name)
        if not finite_number(value) or value < 0:
            raise ValueError(f"`{name}` must be a finite number >= 0, but was {value!r}")
    for name in positive:
        value = getattr(config, name)
        if not finite_number(value) or value <= 0:
            raise ValueError(f"`{name}` must be {'' if name in at_least_zero else 'a finite number '}> 0, but was {value!r}")
    for name in counts:
        value = getattr(config, name)
        if not integer(value) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1, but was {value!r}")
    for name in switches:
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"`{name}` must be True or False, but was {getattr(config, name)!r}")
    for name in names:
        if not isinstance(getattr(config, name), str) or not getattr(config, name):
            raise ValueError(f"`{name}` must be a non-empty string, but was {getattr(config, name)!r}")
    for name in keys:
        key = getattr(config, name)
        if key is not None and (not isinstance(key, str) or not key or key != key.strip()):
            raise ValueError(f"`{name}` must be None or a non-empty string without surrounding spaces (value not shown)")


def config_argv(config: Any, special: Mapping[str, Callable[[Any], list[str]]] | None = None) -> list[str]:
    """The flags that rebuild dataclass ``config``, for the fields that differ from their default.

    A switch is ``--name`` or ``--no-name``, any other value ``--name VALUE``; ``special`` maps a field to the flags
    its value is written as instead.
    """
    argv: list[str] = []
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        if value == spec.default:
            continue
        if special and spec.name in special:
            argv += special[spec.name](value)
        elif isinstance(value, bool):
            argv.append(_flag(spec.name) if value else "--no-" + spec.name.replace("_", "-"))
        else:
            argv += [_flag(spec.name), str(value)]
    return argv


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal right below its annotation), whitespace folded, by name.

    Read from the class's source, so ``--help`` and the docstrings cannot drift apart; a field without
    one (or a class whose source is not installed) is simply missing from the result.
    """
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0]
    if not isinstance(body, ast.ClassDef):
        return {}
    docs: dict[str, str] = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            text = " ".join(after.value.value.split())
            docs[node.target.id] = re.sub(r"``([^`]+)``", r"\1", text)  # plain text: --help shows no reST
    return docs


def _unit(name: str) -> str | None:
    """The unit of a config field, read from its name (None: a count, a name or a switch)."""
    if name.endswith(("_seconds", "_timeout_s")):
        return "seconds"
    if name == "token_rate":
        return "tokens per second"
    if name.endswith("_tokens") or name == "context_length":
        return "tokens"
    return None


def _metavar(name: str, default: Any) -> str:
    """The placeholder ``--help`` shows for a field's value: its unit for numbers, its name otherwise."""
    unit = _unit(name)
    if unit is not None:
        return {"seconds": "SECONDS", "tokens per second": "TOKENS_PER_S", "tokens": "TOKENS"}[unit]
    return "N" if isinstance(default, int) else name.upper()


def field_help(spec: dataclasses.Field[Any], cls: type = EngineConfig) -> str:
    """The ``--help`` text of field ``spec`` of config class ``cls``: what it means (its docstring), its unit and its default."""
    meaning = field_docs(cls).get(spec.name, f"{cls.__name__}.{spec.name}")
    unit = _unit(spec.name)
    default = "none" if spec.default is None else ("on" if spec.default is True else "off" if spec.default is False else repr(spec.default))
    said = f"in {unit}; default: {default}" if unit else f"default: {default}"
    return f"{meaning} ({said})".replace("%", "%%")  # argparse formats help with %


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = EngineConfig, skip: Iterable[str] = ()) -> None:
    """Add one ``--kebab-case`` flag per field of config class ``cls`` (but those in ``skip``), each defaulting to the
    field's default, with :func:`field_help` as its help."""
    for spec in dataclasses.fields(cls):
        if spec.name in skip:
            continue
        default: Any = spec.default
        if isinstance(default, bool):
            action: Any = {"action": argparse.BooleanOptionalAction}
        else:
            action = {"type": str if default is None else type(default), "metavar": _metavar(spec.name, default)}
        parser.add_argument(_flag(spec.name), dest=spec.name, default=default, help=field_help(spec, cls), **action)


def config_from_namespace(ns: argparse.Namespace) -> EngineConfig:
    """Build an EngineConfig from flags added by :func:`add_config_arguments`; ValueError names a bad field."""
    return EngineConfig(**{spec.name: getattr(ns, spec.name) for spec in dataclasses.fields(EngineConfig)})
