"""``METHODS``: the SGLang clients' method table, one row per endpoint method, written once.

``SGLangClient`` and ``AsyncSGLangClient`` are hand-written twins: each method is a real ``def``, so mypy strict,
IDEs and the API docs see its parameters, types and docstring. ``tests/sglang/test_sglang_route_table.py`` holds
both to this table: the same methods and parameters (names, kinds, types, defaults), the declared result (an
``Iterator`` / ``AsyncIterator`` of it for a stream), a docstring that starts with ``summary``, an entry ``policy``
of its own in ``SGLANG_POLICIES``, and, against a loopback server, a request on ``http`` ``path``. The clients are
not generated from it: a generated method loses the static docstring and "go to definition", and half of them do
more than build, send and parse (``flush_cache`` polls, pause and release note what was sent, ``health`` answers
for an engine this client paused, ``generate_stream`` reads SSE).

A new endpoint method: a row here, a call builder and a parser in ``calls.py``, an entry in ``policies.py``, and
the method on both clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from resilience.adapters.sglang.results import ControlResult, FlushResult, GenerateResult, Health, ModelInfo, WeightUpdateResult

__all__ = ["METHODS", "Method"]


@dataclass(frozen=True, slots=True)
class Method:
    """One endpoint method of both SGLang clients."""

    name: str
    """The method's name on ``SGLangClient`` and ``AsyncSGLangClient``."""
    http: str
    """The HTTP method it sends (``"POST"``)."""
    path: str
    """The route it sends to (``"/pause_generation"``), without the query."""
    params: tuple[str, ...]
    """Its parameters after ``self``, in order; ``*name`` = keyword-only."""
    result: Any
    """What it returns (the sync method's return annotation); for a stream, the type of each item."""
    policy: str
    """The key of its entry in ``SGLANG_POLICIES`` (``"POST /pause_generation"``)."""
    summary: str
    """The first line of both clients' docstrings."""
    stream: bool = False
    """True: it returns an ``Iterator`` (sync) / ``AsyncIterator`` (async) of ``result``."""


def _m(name: str, route: str, params: str, result: Any, summary: str, *, policy: str = "", stream: bool = False) -> Method:
    """A row: ``policy`` defaults to ``route`` (``"POST /pause_generation"``)."""
    http, path = route.split(" ")
    return Method(name, http, path, tuple(params.split()), result, policy or route, summary, stream)


METHODS: tuple[Method, ...] = (
    # -- generation control
    _m("pause_generation", "POST /pause_generation", "mode", ControlResult,
       "Pause admission. ``abort`` answers in-flight requests as aborted; ``retract`` re-queues them; ``in_place`` keeps their KV."),
    _m("continue_generation", "POST /continue_generation", "torch_empty_cache", ControlResult,
       "Reopen admission. SGLang's pause is one flag: the first continue wins (the orchestrator owns holds)."),
    _m("flush_cache", "POST /flush_cache", "deadline_s *wait_for_idle", FlushResult,
       'Flush the radix cache, asking again on "not idle" answers until ``deadline_s`` (default ``flush_deadline_s``).',
       policy="GET|POST /flush_cache"),
    _m("abort_request", "POST /abort_request", "rid abort_all", ControlResult,
       "Abort requests whose rid starts with ``rid``, or all of them."),
    # -- memory occupation
    _m("release_memory_occupation", "POST /release_memory_occupation", "tags", ControlResult,
       "Release GPU memory for ``tags`` (None = kv_cache, weights and cuda_graph). Not re-sent once it may have been applied.",
       policy="GET|POST /release_memory_occupation"),
    _m("resume_memory_occupation", "POST /resume_memory_occupation", "tags", ControlResult,
       "Re-occupy memory for ``tags`` (None = all three). Not re-sent once it may have been applied.",
       policy="GET|POST /resume_memory_occupation"),
    # -- weights
    _m("begin_weight_update", "POST /begin_weight_update", "selector", WeightUpdateResult,
       "Open a weight-update session (SGLang 0.5.23); 400 when one is already open."),
    _m("end_weight_update", "POST /end_weight_update", "", WeightUpdateResult, "Close the weight-update session; 400 when none is open."),
    _m("update_weights_from_tensor", "POST /update_weights_from_tensor",
       "serialized_named_tensors *load_format *flush_cache *abort_all_requests *weight_version", WeightUpdateResult,
       "Load weights from serialized tensors (inside a begin/end session in 0.5.23)."),
    _m("update_weights_from_distributed", "POST /update_weights_from_distributed",
       "names dtypes shapes *group_name *flush_cache *weight_version", WeightUpdateResult,
       "Receive weights over the distributed group set up by ``init_weights_update_group``."),
    _m("update_weights_from_disk", "POST /update_weights_from_disk", "model_path *flush_cache *weight_version *load_format",
       WeightUpdateResult, "Load weights from a checkpoint path on the engine's machine."),
    _m("update_weight_version", "POST /update_weight_version", "new_version abort_all_requests", WeightUpdateResult,
       "Set the weight version reported by ``/model_info`` and in generation meta_info."),
    _m("init_weights_update_group", "POST /init_weights_update_group",
       "master_address master_port rank_offset world_size group_name backend", WeightUpdateResult,
       "Join the trainer's process group for distributed weight updates."),
    # -- reads
    _m("health", "GET /health", "", Health,
       "``/health``. An engine this client paused reports ``paused_by_us`` at once (its /health would hang ~20 s, then 503)."),
    _m("health_generate", "GET /health_generate", "", Health,
       "``/health_generate`` (runs a one-token generation), with the same paused-by-us rule."),
    _m("ready", "GET /ready", "", bool, "``/ready``: True only when serving and not paused."),
    _m("server_info", "GET /server_info", "", dict[str, Any], "``/server_info``: server args, internal states, version."),
    _m("model_info", "GET /model_info", "", ModelInfo,
       "``/model_info``, including the weight version (``/get_weight_version`` is gone in 0.5.23)."),
    _m("loads", "GET /v1/loads", "", dict[str, Any], "``/v1/loads?include=core``: per-rank running and waiting requests."),
    _m("models", "GET /v1/models", "", list[str], "``/v1/models``: the served model ids."),
    # -- generation
    _m("generate", "POST /generate", "text *input_ids *sampling_params *rid", GenerateResult,
       "``/generate`` (never re-sent once it may have reached the engine). Aborted requests come back with ``aborted``."),
    _m("generate_stream", "POST /generate", "text *input_ids *sampling_params *rid", GenerateResult,
       "Streaming ``/generate``: yields the cumulative result of each SSE chunk until ``[DONE]``.", stream=True),
)
"""Every endpoint method of both SGLang clients, in the order the clients define them."""
